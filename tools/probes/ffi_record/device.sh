#!/usr/bin/env bash
# On the GPU machine: build the record probe there (its jaxlib's headers) and run it; $OUT gets
# record_probe.json and the logs. bash tools/probes/ffi_record/device.sh
set -uo pipefail
cd "$(dirname "$0")"
out=${OUT:-/tmp}
inc=$(python3 -c "import jax.ffi;print(jax.ffi.include_dir())")
nvcc -std=c++17 -O2 -shared -Xcompiler -fPIC -gencode arch=compute_90a,code=sm_90a -diag-suppress=940,2473,2361 \
  -I "$inc" record_probe.cu -o /tmp/librecord_probe.so > "$out/record_build.log" 2>&1 || { tail -20 "$out/record_build.log"; exit 1; }
nvcc -cubin -gencode arch=compute_90a,code=sm_90a stream_kernel.cu -o /tmp/stream_kernel.cubin || exit 1
# What XLA says about the record path (one small case): FfiCreateLaunch / use_pdl / fallback lines.
TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=record_ffi=3,custom_call_thunk=3,cuda_command_buffer=2,command_buffer_conversion_pass=2 \
  timeout 120 python3 run.py /tmp/librecord_probe.so /tmp/stream_kernel.cubin --quick > "$out/record_vlog.txt" 2>&1
echo "quick rc=$?"; grep -v "^\s*$" "$out/record_vlog.txt" | grep -iE "record|pdl|fallback|capture|command buffer thunk|error|Traceback" | cut -c1-300 | sort | uniq -c | sort -rn | head -25
timeout 240 python3 run.py /tmp/librecord_probe.so /tmp/stream_kernel.cubin --out "$out/record_probe.json" 2>&1 | grep -v "^W0000\|^I0000" | tail -40
