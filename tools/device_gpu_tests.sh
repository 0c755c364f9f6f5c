#!/usr/bin/env bash
# Run on the GPU machine (no network): build the package from the committed tree and run the GPU
# tests. Usage: bash tools/device_gpu_tests.sh [pytest args...]; logs go to $OUT when it is set.
set -uo pipefail
out=${OUT:-/tmp/joa-out}
mkdir -p "$out"
src=$(pwd)
# Build the snapshot of a commit that tools/snapshot.sh wrote to .snap/ (carry it to the device) when
# there is one: the device's copy of .git can lag behind, and the live tree may hold half-done edits.
if [ -d "$src/.snap" ]; then
  rm -rf /tmp/joa && cp -r "$src/.snap" /tmp/joa && src=/tmp/joa
  export JOA_GIT_COMMIT=$(cat "$src/COMMIT")
fi
cd "$src"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv | tee "$out/gpu.txt"
python3 -m pip install --no-build-isolation --no-deps -e . > "$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
python3 -c "import jax, jax_onnx_attn, json; print(jax.__version__, jax.devices()); print(json.dumps(jax_onnx_attn.build_info()))" | tee "$out/build_info.txt"
python3 -m pytest -m gpu -q -ra -p no:cacheprovider "$@" 2>&1 | tee "$out/gpu_tests.log"
