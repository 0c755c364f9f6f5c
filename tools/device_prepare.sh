# Sourced by the tools/device_*.sh scripts on the GPU machine: copies the carried .snap/ (see
# tools/snapshot.sh) to /tmp/joa and cds there, then uses its prebuilt extension when one was
# carried and loads, else builds the package there. Sets JOA_GIT_COMMIT for the bench JSON and
# writes one file, $OUT/prepare.log (a device call returns at most 8 files).
out=${OUT:-/tmp/joa-out}; mkdir -p "$out"
# Already done in this call (a device script running another one): stay in the copy.
if [ "${JOA_PREPARED:-}" = /tmp/joa ] && [ -d /tmp/joa ]; then cd /tmp/joa; return 0; fi
[ -d .snap ] || { echo "no .snap/: run tools/snapshot.sh and carry .snap"; exit 1; }
rm -rf /tmp/joa && cp -r .snap /tmp/joa && cd /tmp/joa
export PYTHONUNBUFFERED=1 JOA_GIT_COMMIT=$(cat COMMIT) PYTHONPATH=/tmp/joa
log=$out/prepare.log
# Once (2026-11-30) a carried .xz that tests fine here failed `xz -d` there: say why in the log.
[ -e PREBUILT.sha256 ] && { sha256sum -c PREBUILT.sha256 >> "$log" 2>&1 || ls -l jax_onnx_attn >> "$log"; }
for z in jax_onnx_attn/_ffi*.so.xz; do [ -e "$z" ] && { xz -d "$z" >> "$log" 2>&1 || rm -f "$z"; }; done
if ls jax_onnx_attn/_ffi*.so > /dev/null 2>&1 &&
   python3 -c "import jax_onnx_attn as j, jax_onnx_attn._ffi as f; assert f.__file__.startswith('/tmp/joa/'), f.__file__; assert j.build_info()['cuda']" >> "$log" 2>&1; then
  echo "using the prebuilt extension" >> "$log"
else
  rm -f jax_onnx_attn/_ffi*.so
  python3 -m pip install --no-build-isolation --no-deps -e . > /tmp/joa-build.log 2>&1 ||
    { tail -40 /tmp/joa-build.log | tee -a "$log"; exit 1; }
  echo "built here" >> "$log"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv >> "$log"
python3 -c "import jax, jax_onnx_attn, json; print(jax.__version__, jax.devices()); print(json.dumps(jax_onnx_attn.build_info()))" | tee -a "$log"
export JOA_PREPARED=/tmp/joa
