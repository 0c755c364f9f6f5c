#!/usr/bin/env bash
# Builds the extension here for the GPU machine's Python (3.12) and sm_90a only, so that a device call
# does not spend ~100 s of its time compiling: bash tools/build_device_ext.sh [extra CUDA flags].
# Prints the .so path; pass it to tools/snapshot.sh --so. Needs a Python 3.12 (pyenv's here); the
# venv (.venv-device/, ignored) is made on first use. Reuses build/device-cp312 between runs.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
venv=.venv-device
if [ ! -x $venv/bin/python ]; then
  PYENV_VERSION=${PYENV_VERSION:-3.12.1} python3.12 -m venv $venv
  $venv/bin/pip install -q "jax==0.10.2" nanobind scikit-build-core wheel
fi
out=build/device-cp312/wheel
rm -rf $out
$venv/bin/pip wheel -q --no-build-isolation --no-deps -w $out . -Cbuild-dir=build/device-cp312 \
  -Ccmake.define.CMAKE_CUDA_ARCHITECTURES=90a-real "-Ccmake.define.CMAKE_CUDA_FLAGS=${1:-}" >&2
(cd $out && python3 -m zipfile -e *.whl unpacked >&2)
ls $out/unpacked/jax_onnx_attn/_ffi*.so
