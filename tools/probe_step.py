"""Whole-model decode-step probe for the GPU machine: decode ms/step, TTFT and kernels per step of a
builder-shaped decoder through DecoderSession, for a few session settings (steps per call, XLA
command-buffer options), plus the kernel-time breakdown of one decode step from a jax.profiler
trace. A quick instrument for a device call; `python -m jax_onnx_attn.bench e2e` is the full bench.

    python tools/probe_step.py --batch 1 8 --ctx 2048 --steps 8 32 --cmdbuf default while \
        --prefill 2048 6144 --out $OUT/probe.json

Decode ms/step = difference of two generate calls' decode times (N1 and N2 new tokens) over the
difference of their steps, so prefill, compilation and the first call's warm-up cancel.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jax_onnx_attn.models import TinyConfig, build_tiny_decoder  # noqa: E402
from jax_onnx_attn.onnx import load  # noqa: E402
from jax_onnx_attn.runtime import DecoderSession  # noqa: E402
from jax_onnx_attn.runtime.roofline import step_cost  # noqa: E402
from jax_onnx_attn.runtime.session import COMMAND_BUFFERS, command_buffer_options  # noqa: E402


def weight_bytes(params) -> int:
    return sum(int(v.nbytes) for v in jax.tree_util.tree_leaves(params))


def device_kernels(trace_dir: str):
    """{kernel name: [count, total µs]} of the newest jax.profiler trace under trace_dir (the e2e
    bench's reading of it), and the device lines read."""
    from jax_onnx_attn.bench.e2e import device_kernel_events, read_trace

    kernels, info = device_kernel_events(read_trace(trace_dir))
    if kernels is None:
        return None, [info.get("note", "")]
    out = collections.defaultdict(lambda: [0, 0.0])
    for e in kernels:
        out[e["name"]][0] += 1
        out[e["name"]][1] += float(e.get("dur", 0))
    return dict(out), info["lines"]


def profile(session, prompts, n_new, trace_dir):
    jax.block_until_ready(session.cache)
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        session.generate(prompts, max_new_tokens=n_new)
        jax.block_until_ready(session.cache)
    return device_kernels(trace_dir)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--inter", type=int, default=8192)
    ap.add_argument("--dtype", default="f16")
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--ctx", type=int, nargs="+", default=[2048])
    ap.add_argument("--steps", type=int, nargs="+", default=[8])
    ap.add_argument("--cmdbuf", nargs="+", default=["default"], choices=sorted(COMMAND_BUFFERS))
    ap.add_argument("--prefill", type=int, nargs="*", default=[])
    ap.add_argument("--n1", type=int, default=2, help="decode calls of the short generate")
    ap.add_argument("--n2", type=int, default=6, help="decode calls of the long generate")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--no-fuse", action="store_true", help="load(..., fuse=False)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    cfg = TinyConfig(layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                     intermediate=args.inter, dtype=args.dtype, max_positions=40000)
    lowered = load(build_tiny_decoder(cfg), fuse=not args.no_fuse)
    cost = step_cost(lowered)  # the one definition of the bound (runtime/roofline.py)
    print(f"model built and loaded in {time.perf_counter() - t0:.1f} s: "
          f"{weight_bytes(lowered.params) / 1e9:.2f} GB of params", flush=True)
    rng = np.random.default_rng(0)
    rows = []
    for b in args.batch:
        for ctx in args.ctx:
            prompts = rng.integers(32, 127, (b, ctx)).tolist()
            bound_ms = cost.decode_seconds(b, ctx) * 1e3
            for steps in args.steps:
                for cb in args.cmdbuf:
                    n1, n2 = 1 + steps * args.n1, 1 + steps * args.n2
                    try:
                        s = DecoderSession(lowered, max_length=ctx + n2 + 8, batch=b,
                                           steps_per_call=steps, compiler_options=command_buffer_options(cb))
                        tc = time.perf_counter()
                        s.generate(prompts, max_new_tokens=n1)  # compile + warm
                        compile_s = time.perf_counter() - tc
                        r1 = s.generate(prompts, max_new_tokens=n1).timings
                        r2 = s.generate(prompts, max_new_tokens=n2).timings
                        ms = (r2.decode_s - r1.decode_s) / (n2 - n1) * 1e3
                        row = dict(batch=b, ctx=ctx, steps_per_call=steps, cmdbuf=cb,
                                   decode_ms=ms, tokens_per_s=b / ms * 1e3,
                                   frac_of_bound=bound_ms / ms, bound_ms=bound_ms,
                                   ttft_ms=min(r1.prefill_s, r2.prefill_s) * 1e3,
                                   first_call_s=compile_s)
                        if args.profile and cb == args.cmdbuf[0] and steps == args.steps[-1]:
                            with tempfile.TemporaryDirectory() as d1, \
                                    tempfile.TemporaryDirectory() as d2:
                                k1, _ = profile(s, prompts, n1, d1)
                                k2, threads = profile(s, prompts, n2, d2)
                            if k1 is not None and k2 is not None:
                                names = set(k1) | set(k2)
                                diff = {n: ((k2.get(n, [0, 0])[0] - k1.get(n, [0, 0])[0]) / (n2 - n1),
                                            (k2.get(n, [0, 0])[1] - k1.get(n, [0, 0])[1]) / (n2 - n1))
                                        for n in names}
                                diff = {n: v for n, v in diff.items() if v[0] > 0.01}
                                row["kernels_per_step"] = sum(v[0] for v in diff.values())
                                row["kernel_us_per_step"] = sum(v[1] for v in diff.values())
                                row["top_kernels"] = sorted(
                                    ([n[:90], round(c, 2), round(us, 1)] for n, (c, us) in diff.items()),
                                    key=lambda r: -r[2])[:40]
                            row["trace_threads"] = threads[:20]
                    except Exception as e:  # noqa: BLE001 - record and go on
                        row = dict(batch=b, ctx=ctx, steps_per_call=steps, cmdbuf=cb,
                                   error=f"{type(e).__name__}: {str(e)[:400]}")
                    rows.append(row)
                    print(json.dumps({k: v for k, v in row.items() if k not in ("top_kernels", "trace_threads")}),
                          flush=True)
                    if "top_kernels" in row:
                        for n, c, us in row["top_kernels"][:25]:
                            print(f"   {us:8.1f} us {c:6.2f}x  {n}")
    for ctx in args.prefill:
        s = DecoderSession(lowered, max_length=ctx + 16, batch=1, steps_per_call=args.steps[0])
        prompt = rng.integers(32, 127, (1, ctx)).tolist()
        s.generate(prompt, max_new_tokens=1)
        t = min(s.generate(prompt, max_new_tokens=1).timings.prefill_s for _ in range(3))
        flops = cost.prefill_flops(1, ctx)
        row = dict(phase="prefill", ctx=ctx, ttft_ms=t * 1e3, tflops=flops / t / 1e12)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(commit=os.environ.get("JOA_GIT_COMMIT"), jax=jax.__version__,
                           device=str(jax.devices()[0].device_kind), args=vars(args), rows=rows), f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
