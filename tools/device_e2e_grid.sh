#!/usr/bin/env bash
# Run on the GPU machine (carry .snap from tools/snapshot.sh --so ...): issue 12's whole-model grid in
# one call (~9 min): the ~8B decoder (fp16, int4; B 1 / 8; ctx 2k / 8k; decode and the B=1 prompt)
# and the ~1B (fp16, int4; B 1 / 8 / 32; ctx 1k / 16k), ours and the JAX peer in the same process, the
# first case of each group profiled (kernels a step, busy / idle time). Each run has its own
# --max-seconds; cases that do not fit are listed under "skipped" in its JSON.
# GRID_MODELS: the runs to make, "8b 1b" (default) or one of them (E2E_8B_S=520 GRID_MODELS=8b fills
# a call with the ~8B grid); E2E_8B_S / E2E_1B_S: each run's --max-seconds (default 280 / 280).
# E2E_8B_PROFILE / E2E_1B_PROFILE: --profile of each run (first / all / none; default first: a
# profiled case takes ~30 s more at ~8B).
# Then `python -m jax_onnx_attn.bench targets` on the JSONs: each case against issue 12's targets.
# To $OUT: prepare.log, e2e_8b.json, e2e_1b.json, e2e_grid.txt (the printed tables).
set -uo pipefail
source "$(dirname "$0")/device_prepare.sh"
common="--impls ours jax-peer --phases prefill decode --models-dir /tmp/models"
models=" ${GRID_MODELS:-8b 1b} "
s8=${E2E_8B_S:-280}; s1=${E2E_1B_S:-280}
p8=${E2E_8B_PROFILE:-first}; p1=${E2E_1B_PROFILE:-first}
{
  [[ $models == *" 8b "* ]] && timeout $(( s8 + 50 )) python3 -m jax_onnx_attn.bench e2e --models 8b \
    --weights fp16 int4 --batch 1 8 --ctx 2048 8192 --max-prefill-tokens 8192 --max-seconds $s8 --profile $p8 $common \
    --out "$out/e2e_8b.json" 2>&1 | grep -v Warning | tail -40
  [[ $models == *" 1b "* ]] && timeout $(( s1 + 40 )) python3 -m jax_onnx_attn.bench e2e --models 1b \
    --weights fp16 int4 --batch 1 8 32 --ctx 1024 16384 --max-prefill-tokens 4096 --max-seconds $s1 --profile $p1 $common \
    --out "$out/e2e_1b.json" 2>&1 | grep -v Warning | tail -40
  for f in "$out"/e2e_8b.json "$out"/e2e_1b.json; do
    [ -e "$f" ] && python3 -m jax_onnx_attn.bench targets "$f" | tail -30
  done
} | tee "$out/e2e_grid.txt"
