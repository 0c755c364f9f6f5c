#!/usr/bin/env bash
# Issue 12's prompt host gap (session 19 notes): ~1B fp16 B=1 1k prompts, ours and the JAX peer,
# profiled, with XLA's command buffers as configured and with them off (XLA_FLAGS, its own process):
# whether the 3-6 ms host gap ours' profiled prompt shows after the embedding comes with them.
# To $OUT: prepare.log, gap_default.json, gap_nocb.json, gap.log.
set -uo pipefail
source "$(dirname "$0")/../device_prepare.sh"
run() {
  timeout 140 python3 -m jax_onnx_attn.bench e2e --models 1b --weights fp16 --batch 1 --ctx 1024 --phases prefill \
    --impls ours jax-peer --profile first --max-seconds 110 --models-dir /tmp/models --out "$out/$1.json" 2>&1 \
    | grep -v Warning | tail -6
  python3 - "$out/$1.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["results"]:
    for impl, o in r["impls"].items():
        p = o.get("profile") or {}
        print(sys.argv[1].split("/")[-1], impl, "ttft_ms", round(o.get("ms", 0), 3), "busy", p.get("busy_us"),
              "span", p.get("span_us"), "gaps", (p.get("largest_gaps") or [])[:2])
PY
}
{
echo "== default XLA_FLAGS=${XLA_FLAGS:-}"; run gap_default
echo "== command buffers off"; XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" run gap_nocb
} 2>&1 | tee "$out/gap.log"
