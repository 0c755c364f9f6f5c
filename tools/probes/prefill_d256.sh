#!/usr/bin/env bash
# Issue 14 on the GPU machine: the prefill engine at head sizes 256 (80-key tiles) and 80 / 96 (the
# 128-wide tiles, zero-filled past D), first run. Needs the carried snapshot with a prebuilt
# extension of this tree (here: tools/build_device_ext.sh, then tools/snapshot.sh --so <that .so>;
# carry ".snap"), and runs in about 3-3.5 minutes (at most ~6.5 at every timeout):
#   bash tools/probes/prefill_d256.sh
# 1) a smoke call per new head size x schedule x causal (bf16, GQA 4/1 and 8/2, T ending mid-tile)
#    printing the first mismatch against the spec (a hang ends at the timeout: look at the mbarrier
#    phases / expect_tx bytes of the new tiling first);
# 2) the new GPU tests (-k "d80 or d96 or d256", 4 workers) and a d128 control (CTAs crossing heads);
# 3) the prefill bench, bf16 GQA 32/8, B·S = 16k, causal and not, against jax cuDNN (same process):
#    D 256 at S 4k / 8k / 1k with all three schedules ("ours" is serial; the default, overlap at
#    D 256, is one constant in params.h TilingFor to flip if pingpong wins), then D 128 (control:
#    main ran pingpong 488 causal / 539 non-causal TFLOP/s at 4k), 96 and 80 at S 4k with pingpong,
#    their default. SKIP_BENCH=1 skips it.
# To $OUT (6 files): prepare.log, prefill_d256_smoke.log, prefill_d256_tests.log,
# prefill_d256_bench.json (D 256), prefill_d256_bench_dims.json (D 128 / 96 / 80) and
# prefill_d256_bench.txt (both tables).
set -uo pipefail
source "$(dirname "$0")/../device_prepare.sh"
timeout 100 python3 - <<'PY' 2>&1 | tee "$out/prefill_d256_smoke.log"
import time
import jax.numpy as jnp, numpy as np
from jax_onnx_attn.ops import cuda
from jax_onnx_attn.ops.reference import prefill as ref
print("head dims", cuda.PREFILL_HEAD_DIMS, "tiling", cuda.PREFILL_TILING, flush=True)
rng = np.random.default_rng(0)
for d in (256, 96, 80):
    for causal in (True, False):
        for (b, hq, hkv, s, t) in ((1, 4, 1, 128, 200), (2, 8, 2, 300, 517)):
            q = jnp.asarray(rng.standard_normal((b, hq, s, d)), jnp.bfloat16)
            k = jnp.asarray(rng.standard_normal((b, hkv, t, d)), jnp.bfloat16)
            v = jnp.asarray(rng.standard_normal((b, hkv, t, d)), jnp.bfloat16)
            ql, kl = jnp.full((b,), s, jnp.int32), jnp.array([t] + [t - 37] * (b - 1), jnp.int32)
            want = np.asarray(ref.prefill_attention(q, k, v, ql, kl, scale=d ** -0.5, causal=causal), np.float32)
            for sched in cuda.PREFILL_SCHEDULES:
                t0 = time.perf_counter()
                try:
                    got = np.asarray(cuda.prefill_attention(q, k, v, ql, kl, scale=d ** -0.5, causal=causal,
                                                            schedule=sched), np.float32)
                except Exception as e:  # noqa: BLE001 - say what and go on
                    print(f"d{d} {sched:8s} causal={causal!s:5s} {(b, hq, hkv, s, t)}: {type(e).__name__}: {e}",
                          flush=True)
                    continue
                err = np.abs(got - want)
                bad = np.argwhere(~(err <= 3e-2 + 3e-2 * np.abs(want)))
                print(f"d{d} {sched:8s} causal={causal!s:5s} {(b, hq, hkv, s, t)}: max err {np.nanmax(err):.3g}, "
                      f"{len(bad)} bad of {err.size} ({time.perf_counter() - t0:.1f} s)"
                      + (f", first at {tuple(bad[0])}: got {got[tuple(bad[0])]:.4g} want {want[tuple(bad[0])]:.4g}"
                         if len(bad) else ""), flush=True)
PY
timeout 150 python3 -m pytest -m gpu -q -ra -n 4 --dist load -p no:cacheprovider \
  tests/gpu/test_prefill_engine_gpu.py tests/gpu/test_prefill_route_gpu.py \
  -k "d80 or d96 or d256 or test_tiles_crossing_heads" > "$out/prefill_d256_tests.log" 2>&1
echo "tests: exit $?"; tail -25 "$out/prefill_d256_tests.log"
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  B="python3 -m jax_onnx_attn.bench prefill --heads 32/8 --dtypes bf16 --tokens 16384 --causal causal noncausal
     --calls 4 --target-ms 30 --reps 3"
  timeout 90 $B --dims 256 --seqlens 4096 8192 1024 --impls ours ours-overlap ours-pingpong jax-cudnn \
    --max-seconds 60 --out "$out/prefill_d256_bench.json" 2>&1 | tee "$out/prefill_d256_bench.txt"
  timeout 60 $B --dims 128 96 80 --seqlens 4096 --impls ours-pingpong jax-cudnn \
    --max-seconds 40 --out "$out/prefill_d256_bench_dims.json" 2>&1 | tee -a "$out/prefill_d256_bench.txt"
fi
