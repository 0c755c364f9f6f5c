#!/usr/bin/env bash
# Session 43's device probes. Phases (args, default "hlo"):
#   hlo:  the ~1B-shaped B=8 decode step's optimised HLO (2 layers, fp16, ctx 1k) and its kernels
#         (tools/probe_step.py --profile), to see which XLA fusions the norms / residual adds / casts
#         become at B > 1 (12.8 kernels a layer on the H200 at ~1B; issue 12's target is 10). ~1.5 min.
#   b8:   bench e2e ~1B fp16 decode, B 8 / 32, ctx 1k, ours and the JAX peer, every case profiled
#         (the B > 1 cases' kernels a layer and breakdown at this commit). ~3.5 min.
#   attn: tools/probes/b1_attention_plans.sh at DIM=128 (2k / 8k splits) and DIM=64 (1k / 4k). ~7 min.
# To $OUT: prepare.log, b8_probe.log, hlo.tar.xz; e2e_1b_b8.json; d128.log, run.log (d64), probes.tar.xz.
set -uo pipefail
source "$(dirname "$0")/../../device_prepare.sh"
export JOA_PREPARED
for phase in ${*:-hlo}; do
case $phase in
  hlo)
    XLA_FLAGS="--xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text" timeout 150 python3 tools/probe_step.py \
      --layers 2 --batch 8 --ctx 1024 --steps 1 --n1 1 --n2 3 --profile > "$out/b8_probe.log" 2>&1
    (cd /tmp/hlo && ls -S *after_optimizations.txt | head -4 | xargs tar cJf "$out/hlo.tar.xz")
    tail -32 "$out/b8_probe.log" ;;
  b8)
    timeout 250 python3 -m jax_onnx_attn.bench e2e --models 1b --weights fp16 --batch 8 32 --ctx 1024 \
      --phases decode --impls ours jax-peer --profile all --models-dir /tmp/models --max-seconds 220 \
      --out "$out/e2e_1b_b8.json" 2>&1 | grep -v Warning | tail -12
    python3 -m jax_onnx_attn.bench breakdown "$out/e2e_1b_b8.json" 2>&1 | tail -30 ;;
  attn)
    DIM=128 SPLIT_CTXS="2048 8192" bash tools/probes/b1_attention_plans.sh > "$out/d128.log" 2>&1
    bash tools/probes/b1_attention_plans.sh > /dev/null 2>&1
    (cd "$out" && tar cJf probes.tar.xz d*_*.json && rm -f d*_*.json)
    grep -E "^\[|^B=" "$out/d128.log" "$out/run.log" | tail -60 ;;
esac
done
