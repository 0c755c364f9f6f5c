#!/usr/bin/env bash
# Run on the GPU machine: the GPU suite in file groups, what landed without a GPU run first,
# each file group under its own time limit so one slow or hanging group cannot take the others'
# time; pytest-xdist workers share the GPU. All groups: ~10 min; pick with JOA_VERIFY. Carry .snap.
#   bash tools/device_verify.sh                 # all groups
#   JOA_VERIFY="gemv nan" bash tools/device_verify.sh
#   JOA_VERIFY=gemv JOA_VERIFY_ARGS="-k written" bash tools/device_verify.sh   # some tests of a group
#   JOA_VERIFY=attention JOA_VERIFY_LIMIT=240 JOA_VERIFY_WORKERS=6 bash tools/device_verify.sh
# Logs: $OUT/verify_<group>.log and a one-line-per-group summary in $OUT/verify.txt.
set -uo pipefail
source "$(dirname "$0")/device_prepare.sh"
declare -A files=(
  [gemv]="tests/gpu/test_linear_gpu.py"
  [nan]="tests/gpu/test_nan_inf_gpu.py tests/gpu/test_properties_gpu.py"
  [attention]="tests/gpu/test_decode_attention_gpu.py tests/gpu/test_decode_paths_gpu.py tests/gpu/test_attention_cuda_gpu.py"
  [spmd]="tests/gpu/test_spmd_gpu.py"
  [prefill]="tests/gpu/test_prefill_engine_gpu.py"
)
# rest: every other GPU test file (quantised decode, gqa_prepare, kv_append, routes, session, long run).
files[rest]=$(ls tests/gpu/test_*.py | grep -v -x -F -f <(printf '%s\n' ${files[@]}) | tr '\n' ' ')
declare -A limit=([gemv]=200 [nan]=80 [attention]=200 [spmd]=40 [prefill]=60 [rest]=120)
# The GPU tests are mostly compile time (host CPU): pytest-xdist workers share the one GPU, each
# growing its own memory (no 75% preallocation). JOA_VERIFY_WORKERS=0 runs them in one process.
# (--dist load: the tests of one file spread over the workers, unlike the CPU suite's loadscope.)
workers=${JOA_VERIFY_WORKERS:-8}
xdist=(-n "$workers"); [ "$workers" -gt 0 ] && xdist+=(--dist load)
export XLA_PYTHON_CLIENT_PREALLOCATE=false
for group in ${JOA_VERIFY:-gemv nan attention spmd prefill rest}; do
  [ -n "${JOA_VERIFY_LIMIT:-}" ] && limit[$group]=$JOA_VERIFY_LIMIT  # seconds, for every group asked
  start=$(date +%s)
  timeout "${limit[$group]}" python3 -m pytest -m gpu -q -ra -p no:cacheprovider "${xdist[@]}" \
    ${files[$group]} ${JOA_VERIFY_ARGS:-} > "$out/verify_$group.log" 2>&1
  rc=$?
  summary=$(grep -E " in [0-9.]+s" "$out/verify_$group.log" | tail -1)
  [ $rc -eq 124 ] && summary="timed out after ${limit[$group]} s: $(tail -c 300 "$out/verify_$group.log" | tr '\n' ' ')"
  echo "$group rc=$rc $(( $(date +%s) - start )) s: $summary" | tee -a "$out/verify.txt"
  grep -E "^(FAILED|ERROR)" "$out/verify_$group.log" | head -10
done
