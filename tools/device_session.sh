#!/usr/bin/env bash
# One device call for a kernel change: optionally time the carried candidate (.snap/) against a
# baseline (.snapA/, another tools/snapshot.sh tree moved there) on the shapes the change targets,
# keep the faster, then run the GPU suite and tools/device_bench.sh on it. Each tree runs with its
# own Python (planner) and prebuilt extension. About 8 minutes of device time.
#   bash tools/device_session.sh ["bench decode args for the A/B"]     (carry [".snap", ".snapA"])
# A device call returns at most 8 files from $OUT: the A/B and tests keep to a few.
set -uo pipefail
root=$(pwd); out=${OUT:-/tmp/joa-out}; mkdir -p "$out"
if [ -d "$root/.snapA" ] && [ $# -ge 1 ]; then
  for w in A B; do
    src=$root/.snap; [ $w = A ] && src=$root/.snapA
    d=/tmp/ab_$w; rm -rf $d; cp -r "$src" $d
    (cd $d && for z in jax_onnx_attn/_ffi*.so.xz; do [ -e "$z" ] && xz -d "$z"; done
     PYTHONPATH=$d python3 -m jax_onnx_attn.bench decode --impls ours $1 --out "$out/ab_$w.json" 2>&1 \
       | grep -E "^B=.*us/" | sed "s/^/$w($(cat COMMIT)) /")
  done
  # B (the candidate) must be 2% faster over the shapes (geometric mean) to be kept.
  win=$(python3 - "$out" <<'PY'
import json, math, sys
t = {w: {r["label"]: r["impls"]["ours"]["us"] for r in json.load(open(f"{sys.argv[1]}/ab_{w}.json"))["results"]}
     for w in "AB"}
common = [k for k in t["A"] if k in t["B"]]
g = math.exp(sum(math.log(t["B"][k] / t["A"][k]) for k in common) / len(common))
print(f"B/A time geomean {g:.3f}", file=sys.stderr)
print("B" if g < 0.98 else "A")
PY
)
  echo "kept: $win"
  if [ "$win" = A ]; then rm -rf "$root/.snap"; mv "$root/.snapA" "$root/.snap"; fi
fi
cd "$root"
bash tools/device_gpu_tests.sh -n 12 --timeout 120 tests/gpu > /dev/null 2>&1; tail -3 "$out/gpu_tests.log"
bash tools/device_bench.sh
