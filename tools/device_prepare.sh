# Sourced by the tools/device_*.sh scripts on the GPU machine: copies the carried .snap/ (see
# tools/snapshot.sh) to /tmp/joa and cds there, then uses its prebuilt extension when one was
# carried and loads, else builds the package there. Sets JOA_GIT_COMMIT for the bench JSON.
out=${OUT:-/tmp/joa-out}; mkdir -p "$out"
[ -d .snap ] || { echo "no .snap/: run tools/snapshot.sh and carry .snap"; exit 1; }
rm -rf /tmp/joa && cp -r .snap /tmp/joa && cd /tmp/joa
export PYTHONUNBUFFERED=1 JOA_GIT_COMMIT=$(cat COMMIT) PYTHONPATH=/tmp/joa
for z in jax_onnx_attn/_ffi*.so.xz; do [ -e "$z" ] && xz -d "$z"; done
if ls jax_onnx_attn/_ffi*.so > /dev/null 2>&1 &&
   python3 -c "import jax_onnx_attn as j; assert j.build_info()['cuda']" > "$out/prebuilt.log" 2>&1; then
  echo "using the prebuilt extension" | tee "$out/build.log"
else
  rm -f jax_onnx_attn/_ffi*.so
  python3 -m pip install --no-build-isolation --no-deps -e . > "$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv > "$out/gpu.txt"
python3 -c "import jax, jax_onnx_attn, json; print(jax.__version__, jax.devices()); print(json.dumps(jax_onnx_attn.build_info()))" | tee "$out/build_info.txt"
