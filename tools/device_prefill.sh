#!/usr/bin/env bash
# Run on the GPU machine (H100 / H200): the prefill engine's first run, on the carried snapshot
# (tools/snapshot.sh --so ...). 1) a smoke call of each schedule with the first mismatch printed,
# 2) tests/gpu/test_prefill_engine_gpu.py, 3) the prefill bench (ours x 3 schedules vs jax cudnn /
# xla) unless the tests failed or SKIP_BENCH=1. Usage: bash tools/device_prefill.sh [pytest args...];
# logs and JSON to $OUT (4 files + prepare.log).
set -uo pipefail
source "$(dirname "$0")/device_prepare.sh"
timeout 120 python3 - <<'PY' 2>&1 | tee "$out/prefill_smoke.log"
import jax, jax.numpy as jnp, numpy as np
from jax_onnx_attn.ops import cuda
from jax_onnx_attn.ops.reference import prefill as ref
rng = np.random.default_rng(0)
for causal in (True, False):
    for (b, hq, hkv, s, t, d) in ((1, 1, 1, 128, 128, 128), (2, 8, 2, 200, 300, 128), (2, 4, 1, 64, 70, 64)):
        q = jnp.asarray(rng.standard_normal((b, hq, s, d)), jnp.bfloat16)
        k = jnp.asarray(rng.standard_normal((b, hkv, t, d)), jnp.bfloat16)
        v = jnp.asarray(rng.standard_normal((b, hkv, t, d)), jnp.bfloat16)
        ql, kl = jnp.full((b,), s, jnp.int32), jnp.full((b,), t, jnp.int32)
        want = np.asarray(ref.prefill_attention(q, k, v, ql, kl, scale=d ** -0.5, causal=causal), np.float32)
        for sched in cuda.PREFILL_SCHEDULES:
            try:
                got = np.asarray(cuda.prefill_attention(q, k, v, ql, kl, scale=d ** -0.5, causal=causal,
                                                        schedule=sched), np.float32)
            except Exception as e:
                print(f"{sched} causal={causal} {(b, hq, hkv, s, t, d)}: {type(e).__name__}: {e}")
                continue
            err = np.abs(got - want)
            bad = np.argwhere(~(err <= 3e-2 + 3e-2 * np.abs(want)))
            print(f"{sched:8s} causal={causal!s:5s} {(b, hq, hkv, s, t, d)}: max err {np.nanmax(err):.3g}, "
                  f"{len(bad)} bad of {err.size}" + (f", first at {tuple(bad[0])}: got {got[tuple(bad[0])]:.4g} "
                                                      f"want {want[tuple(bad[0])]:.4g}" if len(bad) else ""))
PY
python3 -m pytest -m gpu -q -ra -n 0 -p no:cacheprovider tests/gpu/test_prefill_engine_gpu.py "$@" 2>&1 \
  | tee "$out/prefill_tests.log" | tail -30
ok=${PIPESTATUS[0]}
if [ "$ok" = 0 ] && [ "${SKIP_BENCH:-0}" != 1 ]; then
  python3 -m jax_onnx_attn.bench prefill --out "$out/prefill_bench.json" 2>&1 | tee "$out/prefill_bench.log"
fi
