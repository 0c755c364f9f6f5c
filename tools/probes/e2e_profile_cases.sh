#!/usr/bin/env bash
# Issue 12: where a decode step's time goes, ours beside the JAX peer, kernel by kernel (the
# profile's top_time), for the cases given (default: ~1B fp16 / int4 at B=32 ctx 1k, int4 B=1 1k).
#   bash tools/probes/e2e_profile_cases.sh ["<bench e2e args>" ...]
# To $OUT: prepare.log, profile_<i>.json, profile.log.
set -uo pipefail
source "$(dirname "$0")/../device_prepare.sh"
[ $# -gt 0 ] || set -- "--models 1b --weights fp16 int4 --batch 32 --ctx 1024" "--models 1b --weights int4 --batch 1 8 --ctx 1024"
i=0
for args in "$@"; do
  i=$((i + 1))
  timeout 280 python3 -m jax_onnx_attn.bench e2e $args --phases decode --impls ours jax-peer --profile all \
    --no-verify --max-seconds 240 --models-dir /tmp/models --out "$out/profile_$i.json" 2>&1 | grep -v Warning | tail -4
  python3 - "$out/profile_$i.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["results"]:
    for impl, o in r["impls"].items():
        p = o.get("profile") or {}
        steps = r.get("steps_per_call", 16)
        print(f"== {r['model_alias']} {r['weights']} B={r['batch']} ctx={r['ctx']} {impl}: {o.get('ms', 0):.3f} ms/step "
              f"frac {o.get('frac_of_bound', 0):.2f} kernels/step {o.get('kernels_per_step')} "
              f"busy {(p.get('busy_us') or 0) / steps:.1f} span {(p.get('span_us') or 0) / steps:.1f} us/step")
        for name, n, us in (p.get("top_time") or [])[:14]:
            print(f"   {us / steps:8.1f} us/step {n / steps:6.1f}/step  {name[:150]}")
PY
done 2>&1 | tee "$out/profile.log"
