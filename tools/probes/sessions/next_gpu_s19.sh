#!/usr/bin/env bash
# What session 18 leaves for the next device call (~8 min), outputs straight to $OUT:
# 1) the branch split-merge-dedupe (the decode and prefill combines sharing common/split_merge.cuh;
#    build the device extension from it first): the split-KV GPU files of both engines, which must
#    pass unchanged (same bits: the SASS has the same floating-point instructions);
#    and the branch gqa-chunk-engine (merged onto it: GQA steps of > 64 rows on a filled cache, later
#    prompt chunks, on the prefill engine): tests/gpu/test_decode_paths_gpu.py;
# 2) issue 12's grid at the landed commit (tools/device_e2e_grid.sh, trimmed).
# Build and carry the snapshot (tools/build_device_ext.sh; tools/snapshot.sh --so <.so>; carry .snap).
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
timeout 200 python3 -m pytest -m gpu -q -ra -n 4 --dist load -p no:cacheprovider \
  tests/gpu/test_prefill_split_gpu.py tests/gpu/test_decode_attention_gpu.py tests/gpu/test_decode_fewquery_gpu.py \
  tests/gpu/test_decode_paths_gpu.py -k "split or combine or cluster or fewquery or features or bitwise or gqa" > "$out/tests.log" 2>&1
echo "tests: exit $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$out/tests.log" | tail -20
E2E_8B_S=${E2E_8B_S:-170} E2E_1B_S=${E2E_1B_S:-100} bash tools/device_e2e_grid.sh | tail -40
