#!/usr/bin/env bash
# Issue 14 on the GPU machine: the prefill bench's new cases and peers. Needs the carried snapshot
# (tools/snapshot.sh [--so <prebuilt .so>]; carry .snap); about 3.5 minutes with a prebuilt
# extension (add ~100 s when it builds there):
#   bash tools/probes/prefill_peers.sh
# 1) peers_check.log (~30-60 s, cut at 90 s): every impl as the bench calls it (prefill.jax_attention /
#    torch_attention) against the engine's reference (ops/reference/prefill.py) on small cases:
#    chunked 256:1024, ragged rows, self-attention; causal and not; bf16 / fp16; 8/2 heads, d128.
#    jax-mosaic is compared at softmax scale 1 (it has no scale argument). Rows past a ragged
#    row's length are not compared. Last line: whether attention_mgpu runs bf16 at all (the bench
#    skips jax-mosaic at bf16 as "fp16 only").
# 2) prefill_peers.json / .log: bench prefill at S 4k / 16k (B·S = 16k), ragged rows at S 4k,
#    chunked 2048:8192 / 2048:30720, bf16 and fp16, causal first then non-causal, ours (default
#    schedule) vs jax cuDNN / XLA / Mosaic and torch flash / cuDNN; 30 ms x 3 samples; new cases
#    stop after 110 s (the causal half, 10 cases, is estimated at ~50-90 s; the non-causal half runs
#    as far as the budget goes).
# To $OUT (4 files): prepare.log, peers_check.log, prefill_peers.json, prefill_peers.log.
set -uo pipefail
source "$(dirname "$0")/../device_prepare.sh"
timeout 90 python3 - <<'PY' 2>&1 | tee "$out/peers_check.log" | tail -60
import importlib.util
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_onnx_attn.bench import prefill as P
from jax_onnx_attn.ops.reference.prefill import prefill_attention as ref

print("jax", jax.__version__, "absl", importlib.util.find_spec("absl") is not None)
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())
except Exception as e:
    torch = None
    print("torch:", type(e).__name__, e)
IMPLS = ("ours", "jax-cudnn", "jax-xla", "jax-mosaic", "torch-flash", "torch-cudnn")
cases = []
for dt in ("bf16", "fp16"):
    for causal in (True, False):
        cases += [P.Case(2, 256, 8, 2, 128, dt, causal, ctx=1024),
                  P.Case(3, 256, 8, 2, 128, dt, causal, lengths=(130, 256, 201)),
                  P.Case(2, 256, 8, 2, 128, dt, causal)]
for case in cases:
    keys = jax.random.split(jax.random.PRNGKey(case.seq + case.keys), 3)
    q_shape, kv_shape = P.shapes(case, "BHSD")
    dt = P._jax_dtype(case.dtype)
    q, k, v = (jax.random.normal(key, shape, dt) for key, shape in zip(keys, (q_shape, kv_shape, kv_shape)))
    lens = jnp.asarray(case.q_lens), jnp.asarray(case.kv_lens)
    for impl in IMPLS:
        why = P._impl_skip(case, impl)
        if why:
            print(f"{case.label():40s} {impl:12s} skip: {why}")
            continue
        scale = 1.0 if impl == "jax-mosaic" else 1 / math.sqrt(case.head_dim)
        want = np.asarray(ref(q, k, v, *lens, scale=scale, causal=case.causal), np.float32)
        try:
            if impl.startswith("torch"):
                tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[case.dtype]
                tq, tk, tv = (torch.from_numpy(np.asarray(x, np.float32)).to("cuda", tdt) for x in (q, k, v))
                got = P.torch_attention(case, impl, tq.device)(tq, tk, tv).float().cpu().numpy()
            else:
                fn, layout = P.jax_attention(case, impl)
                if layout == "BHSD":
                    got = np.asarray(fn(q, k, v), np.float32)
                else:
                    got = np.asarray(fn(*(x.transpose(0, 2, 1, 3) for x in (q, k, v))), np.float32)
                    got = got.transpose(0, 2, 1, 3)
        except Exception as e:
            print(f"{case.label():40s} {impl:12s} error: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
            continue
        err, bad = 0.0, 0
        for b, n in enumerate(case.q_lens):
            e = np.abs(got[b, :, :n] - want[b, :, :n])
            err = max(err, float(np.nanmax(e)))
            bad += int(np.sum(~(e <= 2e-2 + 2e-2 * np.abs(want[b, :, :n]))))
        print(f"{case.label():40s} {impl:12s} {'ok ' if not bad else 'BAD'} max err {err:.3g}, {bad} bad")
# The bench skips jax-mosaic at bf16 ("fp16 only"): whether this jax's attention_mgpu runs bf16 at all.
if P._mosaic_status() is None:
    from jax.experimental.pallas.ops.gpu import attention_mgpu as M
    case = P.Case(2, 256, 8, 2, 128, "bf16", False)
    qs, kvs = P.shapes(case, "BHSD")
    q, k, v = (jax.random.normal(jax.random.PRNGKey(i), s, jnp.bfloat16) for i, s in enumerate((qs, kvs, kvs)))
    want = np.asarray(ref(q, k, v, jnp.full((2,), 256), jnp.full((2,), 256), scale=1.0, causal=False), np.float32)
    try:
        cfg = M.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2)
        got = M.attention(*(x.transpose(0, 2, 1, 3) for x in (q, k, v)), cfg)
        err = np.abs(np.asarray(got, np.float32).transpose(0, 2, 1, 3) - want)
        print(f"jax-mosaic bf16 (the bench skips it): runs, max err {np.nanmax(err):.3g}")
    except Exception as e:
        print(f"jax-mosaic bf16 (the bench skips it): {type(e).__name__}: {str(e).splitlines()[0][:160]}")
PY
python3 -m jax_onnx_attn.bench prefill --seqlens 4096 16384 --dtypes bf16 fp16 --causal causal noncausal \
  --ragged 4096 --chunked 2048:8192 2048:30720 \
  --impls ours jax-cudnn jax-xla jax-mosaic torch-flash torch-cudnn \
  --target-ms 30 --reps 3 --max-seconds 110 --out "$out/prefill_peers.json" 2>&1 \
  | tee "$out/prefill_peers.log" | tail -30
