#!/usr/bin/env bash
# Ran at ae4b8c0; both switches are reverted since: apply tools/patches/record-l2-prefetch/ and
# tools/patches/decode-speculate/ (they carry the tests and probe this script names) to run it again.
# Session 31, call A (~7 min): two switches, each off by default. 1) GPU tests of both: the
# record-layout GEMV's L2 prefetch (JOA_GEMV_L2_PREFETCH: every distance the same bits, refusals,
# every element written) and the decode engine's speculated first tiles (JOA_DECODE_SPECULATE: the
# same bits as without, NaN past kv_len never read into the output, windows, variants, a loop in a
# command buffer); 2) one GEMV per ~1B / ~8B shape at prefetch distances 0 / 3 / 8
# (tools/probes/record_l2_prefetch.py); 3) the decode shapes of issue 15's B=1 / B=8 targets,
# ours / ours[spec] / jax-cudnn. To $OUT: prepare.log, tests.log, prefetch.json, dec.json, run.log.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
{
el tests
timeout 170 python3 -m pytest -m gpu -q -ra -n 12 --dist load -p no:cacheprovider \
  tests/gpu/test_decode_speculate_gpu.py tests/gpu/test_linear_record_gpu.py \
  "tests/gpu/test_linear_gpu.py::test_every_output_element_is_written" \
  "tests/gpu/test_linear_rows_gpu.py::test_every_output_element_is_written" > "$out/tests.log" 2>&1
echo "tests rc $?"; tail -1 "$out/tests.log"; grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -12
el probe
(cd tools/probes && timeout 150 python3 record_l2_prefetch.py "$out/prefetch.json" 0 3 8) 2>&1 | grep -v Warning | \
  python3 -c "
import json, sys
for line in sys.stdin:
    try: r = json.loads(line)
    except ValueError: print(line.rstrip()); continue
    print(r['k'], r['n'], ' '.join(f\"{k}={v['us']:.2f}{'' if v['same_bits'] else '(BITS DIFFER)'}\" for k, v in r.items() if k.startswith('pf')))"
el decode
timeout 150 python3 -m jax_onnx_attn.bench decode --batch 1 8 --ctx 2304 4096 8192 131072 --qlen 1 --heads 32/8 \
  --dims 128 --dtypes bf16 fp16 --impls ours ours[spec] jax-cudnn --target-ms 10 --reps 3 --max-seconds 140 \
  --out "$out/dec.json" 2>&1 | grep -v Warning | tail -24
el done
} 2>&1 | tee "$out/run.log"
