#!/usr/bin/env bash
# Run on the GPU machine: the rows kernel's occupancy A/B on the carried snapshot (tools/snapshot.sh
# --so: a prebuilt extension, so the ~4 minutes go to measuring). Usage: bash tools/probes/rows_occ_ab.sh
# (carry ".snap"). Writes to $OUT: prepare.log, gpu_tests.log, occ_b{128,32}.json (planner default
# "ours[rows]", occupancy 2 at 4 stages on 8-warp CTAs "ours[rows c0,w8,d4,o2]", 4 stages at
# occupancy 1 "ours[rows c0,w8,d4,o1]"), rule_b{128,32}.json (the planner with JOA_ROWS_OCC2=1, the
# proposed rule: "ours[rows]" there) and rows_occ_ab.txt (the table of all four side by side).
# Order: the rows GPU tests first (4 workers: occupancy 2 against the reference and occupancy 1's
# bits), then the ~8B / ~1B shapes at M = 8 and 16, the 8-warp ones (gate-up, down, LM head) first,
# each run stopping new cases at its own budget.
set -uo pipefail
source "$(dirname "$0")/../device_prepare.sh"
timeout 110 python3 -m pytest -m gpu -q -ra -n 4 --dist load -p no:cacheprovider tests/gpu/test_linear_rows_gpu.py \
  > "$out/gpu_tests.log" 2>&1
tail -3 "$out/gpu_tests.log"
SHAPES="4096x28672 14336x4096 4096x128256 2048x16384 8192x2048 2048x128256 4096x6144 4096x4096 2048x3072 2048x2048"
# xla-nk skips every n-bit peer at no cost: only the rows kernel's plans are timed.
L="python3 -m jax_onnx_attn.bench linear --formats int4 --rows 8 16 --impls xla-nk --shapes $SHAPES --reps 3"
for block in 128 32; do
  budget=$([ $block = 128 ] && echo 50 || echo 40)
  JOA_ROWS_OCC2=0 $L --block $block --rows-plans 0,8,4,2 0,8,4,1 --max-seconds $budget \
    --out "$out/occ_b$block.json" 2>&1 | grep -E "^K=|budget"
done
for block in 128 32; do
  budget=$([ $block = 128 ] && echo 25 || echo 20)
  JOA_ROWS_OCC2=1 $L --block $block --nbits-rows --max-seconds $budget \
    --out "$out/rule_b$block.json" 2>&1 | grep -E "^K=|budget"
done
python3 - "$out" <<'PY' | tee "$out/rows_occ_ab.txt"
import json, os, sys

out = sys.argv[1]
cols = [("default", "occ", "ours[rows]"), ("occ2 d4", "occ", "ours[rows c0,w8,d4,o2]"),
        ("occ1 d4", "occ", "ours[rows c0,w8,d4,o1]"), ("OCC2=1", "rule", "ours[rows]")]
rows = {}
for block in (128, 32):
    for name, prefix, impl in cols:
        path = f"{out}/{prefix}_b{block}.json"
        if not os.path.exists(path):
            continue
        for res in json.load(open(path))["results"]:
            r = res["impls"].get(impl, {})
            plan = r.get("rows_plan")
            cell = f"{r['us']:.1f}" if "us" in r else "-"
            if plan:
                cell += f" ({plan['cluster']}x{plan['warps_n']} d{plan['stages']} o{plan['ctas_per_sm']})"
            rows.setdefault((res["label"]), {})[name] = cell
print("us a call (cluster x warps_n, depth, occupancy)")
print(f"{'case':34s}" + "".join(f"{n:>24s}" for n, _, _ in cols))
for label, cells in rows.items():
    print(f"{label:34s}" + "".join(f"{cells.get(n, ''):>24s}" for n, _, _ in cols))
PY
