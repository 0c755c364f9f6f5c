#!/usr/bin/env bash
# Builds the extension here for the GPU machine's Python (3.12) and sm_90a only, so that a device call
# does not spend ~100 s of its time compiling: bash tools/build_device_ext.sh [extra CUDA flags].
# Prints the .so path; pass it to tools/snapshot.sh --so. Needs a Python 3.12 (pyenv's here); the
# venv (.venv-device/, ignored) is made on first use with the device's jax (JOA_DEVICE_JAX, 0.11.2:
# its XLA FFI headers have the record stage, ffi/record/). Reuses build/device-cp312 between runs.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
venv=.venv-device
jax_version=${JOA_DEVICE_JAX:-0.11.2}
if [ ! -x $venv/bin/python ]; then
  PYENV_VERSION=${PYENV_VERSION:-3.12.1} python3.12 -m venv $venv
  $venv/bin/pip install -q nanobind scikit-build-core wheel
fi
if [ "$($venv/bin/python -c 'import jaxlib; print(jaxlib.__version__)' 2>/dev/null)" != "$jax_version" ]; then
  $venv/bin/pip install -q "jax==$jax_version" "jaxlib==$jax_version"
fi
out=build/device-cp312/wheel
rm -rf $out
$venv/bin/pip wheel -q --no-build-isolation --no-deps -w $out . -Cbuild-dir=build/device-cp312 \
  -Ccmake.define.CMAKE_CUDA_ARCHITECTURES=90a-real "-Ccmake.define.CMAKE_CUDA_FLAGS=${1:-}" >&2
(cd $out && python3 -m zipfile -e *.whl unpacked >&2)
ls $out/unpacked/jax_onnx_attn/_ffi*.so
