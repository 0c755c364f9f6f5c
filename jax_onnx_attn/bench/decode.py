"""Decode attention: our split-KV engine vs jax.nn.dot_product_attention (xla, cudnn) and torch SDPA.

Every implementation runs in this process on the same GPU, on inputs of the same shapes in its own
native layout (ours and torch BHSD, jax BTNH). Timing: K dependent calls (each call's output is the
next call's query) inside one jitted function / one captured torch CUDA graph, dispatched M times
back to back; per-call time = wall time / (M * K); the median of several such samples after a
warm-up run. XLA captures the K custom calls in a command buffer, so our small-case numbers are
in-graph latencies. KV sets smaller than 256 MB are rotated (R copies read in turn) so that repeated
calls do not read them from the 50 MB L2. --device-time adds, for the jax implementations, the device
time a call: one more run of the chain under jax.profiler (command buffers kept), its kernels' span
(first start to last end) / K. That leaves out the host (dispatch, sync) that a wall-clock figure
carries for µs-sized calls, so it is the one to compare kernels by there.

Figure: effective bandwidth = K+V bytes read per call / time. Ours runs bottom-right causal; for
q_len > 1 the peers run without a mask (none of them offers bottom-right causal without a mask
tensor), which only makes them faster.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import argparse
import dataclasses
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from typing import Callable

HBM_PEAK_GBS = 4800.0  # H200 datasheet
ROTATE_BYTES = 256 << 20  # KV sets below this are rotated through several copies
MAX_KV_BYTES = 36 << 30   # skip cases whose K+V exceed this (peers need room too)
MAX_LOGIT_BYTES = 8 << 30  # the xla implementation materialises [B, Hq, S, C] f32 logits
#: Donate q to the timed jit (see bench_jax); switched off only to measure what re-recording costs.
DONATE = os.environ.get("JOA_BENCH_DONATE", "1") != "0"
#: Forms of "ours" that pin one of the engine's switches, for A/B runs in one process: the keyword
#: arguments each passes to cuda.decode_attention ("ours" follows the JOA_DECODE_* switches) and the
#: caches it applies to. "ours[tiles]" / "ours[regs]": an int8 / int4 cache dequantised tile by tile
#: in shared memory / in registers at every size ("ours" takes the faster for the call's size, the
#: plan's rule; --kv-bits 8 4 --impls ours ours[tiles] ours[regs]); "ours[key-rows]" /
#: "ours[query-rows]": the register kernel at every size with keys / query rows as its MMA rows
#: (JOA_DECODE_KEY_ROWS; the key rows where a block holds <= 8 query rows). "ours[fit]",
#: "ours[cursor]", "ours[fit+cursor]": the "fit" plan policy and / or the cursor loads of a float
#: cache (issue 15; --impls ours ours[fit] ours[cursor] ours[fit+cursor] jax-cudnn); "ours[wave]" /
#: "ours[ladder]": the "wave" plan policy (the default: clusters capped by one wave of clusters) /
#: the uncapped "ladder" of sessions 14-26. "ours[producer]":
#: a float cache's tiles copied by a producer warp (JOA_DECODE_PRODUCER; sm_90). "ours[tile128]":
#: a float cache streamed in 128-row KV tiles (JOA_DECODE_TILE128; 16-row blocks at d64 / d128), its
#: copies by the cursor-loads rule (strided at d64); "ours[tile128+cursor]": with the cursor loads.
#: Those forms run the decode engine at any shape. "ours[decode-engine]" / "ours[prefill-engine]":
#: a float cache's step on one engine (cuda.decode_engine picks for "ours"; issue 14's few-query
#: steps). None is in the default set.
OURS_FORMS = {
    "ours[tiles]": (dict(quant_regs=False), "int"),
    "ours[regs]": (dict(quant_regs=True), "int"),
    "ours[key-rows]": (dict(quant_regs=True, key_rows=True), "int"),
    "ours[query-rows]": (dict(quant_regs=True, key_rows=False), "int"),
    "ours[fit]": (dict(plan_policy="fit", engine="decode"), "float"),
    "ours[cursor]": (dict(cursor_loads=True, engine="decode"), "float"),
    "ours[fit+cursor]": (dict(plan_policy="fit", cursor_loads=True, engine="decode"), "float"),
    "ours[wave]": (dict(plan_policy="wave", engine="decode"), "float"),
    "ours[ladder]": (dict(plan_policy="ladder", engine="decode"), "float"),
    "ours[producer]": (dict(producer=True, engine="decode"), "float"),
    "ours[tile128]": (dict(tile128=True, engine="decode"), "float"),
    "ours[tile128+cursor]": (dict(tile128=True, cursor_loads=True, engine="decode"), "float"),
    "ours[decode-engine]": (dict(engine="decode"), "float"),
    "ours[prefill-engine]": (dict(engine="prefill"), "float"),
}
IMPLS = ("ours", "jax-xla", "jax-cudnn", "torch-flash", "torch-cudnn", *OURS_FORMS)
ALT_IMPL = "ours[tiles]"
DEFAULT_IMPLS = tuple(i for i in IMPLS if i not in OURS_FORMS)


@dataclasses.dataclass(frozen=True)
class Case:
    """One decode shape: q [B, Hq, S, D] against a full K/V cache [B, Hkv, ctx, D] of `dtype`, or
    (kv_bits 8 / 4, ours only) an int8 / int4 cache."""

    batch: int
    ctx: int
    q_len: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: str  # "bf16" | "fp16"
    kv_bits: int = 0
    scales: str = "tensor"  # quantised caches: "tensor" or "channel" f32 K / V scales

    @property
    def kv_bytes(self) -> int:
        """Bytes of K plus V read per call (2-byte elements, or kv_bits bits)."""
        return 2 * self.batch * self.kv_heads * self.ctx * self.head_dim * (self.kv_bits or 16) // 8

    @property
    def scale_bytes(self) -> int:
        """Bytes of the f32 K and V scales of a quantised cache (0 for a float cache)."""
        if not self.kv_bits:
            return 0
        return 2 * 4 * (self.kv_heads * self.head_dim if self.scales == "channel" else 1)

    @property
    def bytes_read(self) -> int:
        """The bytes a call reads from the cache: K + V, plus the scales of a quantised one."""
        return self.kv_bytes + self.scale_bytes

    @property
    def rotations(self) -> int:
        """K/V copies read in turn so that repeated calls miss the L2 (1 for large sets, <= 16)."""
        return max(1, min(16, math.ceil(ROTATE_BYTES / self.kv_bytes)))

    @property
    def calls(self) -> int:
        """Dependent calls per jitted function / graph: enough that the host's dispatch of one
        function (tens of µs) hides behind the GPU work of the previous one for µs-sized calls."""
        return 32 if self.rotations > 1 else 4

    def label(self) -> str:
        """A one-line description of the case for tables and logs."""
        return (f"B={self.batch} ctx={self.ctx} S={self.q_len} {self.q_heads}/{self.kv_heads} "
                f"d{self.head_dim} {self.dtype}" + (f" int{self.kv_bits}" if self.kv_bits else "")
                + (" per-channel" if self.kv_bits and self.scales == "channel" else ""))


def _jax_dtype(name):
    import jax.numpy as jnp
    return {"bf16": jnp.bfloat16, "fp16": jnp.float16}[name]


def _time_loop(run: Callable[[], None], sync: Callable[[], None], calls: int, target_s: float,
               reps: int) -> float:
    """Median seconds per call: `run` dispatches `calls` dependent calls without waiting."""
    run()
    sync()  # warm-up (compilation, graph capture)
    t0 = time.perf_counter()
    run()
    sync()
    once = max(time.perf_counter() - t0, 1e-6)
    m = max(2, min(500, math.ceil(target_s / once)))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(m):
            run()
        sync()
        samples.append((time.perf_counter() - t0) / (m * calls))
    return statistics.median(samples)


def measure_impls(impls, seconds_of: Callable[[str], float], metrics_of: Callable[[float], dict],
                  skip_of: Callable[[str], str | None] = lambda impl: None,
                  note_of: Callable[[str], str | None] = lambda impl: None) -> dict:
    """{impl: {"us": ..., **metrics_of(seconds)[, "note": ...]} or {"skip": why}} for each impl of
    one case: seconds_of(impl) times it, skip_of(impl) names a reason not to, note_of(impl) says how
    it computed the case where that is not its plain call; an impl that raises is recorded as a skip
    (a peer that cannot run a shape is a result, not a crash)."""
    out = {}
    for impl in impls:
        why = skip_of(impl)
        if why:
            out[impl] = {"skip": why}
            continue
        try:
            sec = seconds_of(impl)
            out[impl] = {"us": sec * 1e6, **metrics_of(sec)}
            note = note_of(impl)
            if note:
                out[impl]["note"] = note
        except Exception as e:
            first = (str(e).splitlines() or [""])[0]
            out[impl] = {"skip": f"error: {type(e).__name__}: {first[:200]}"}
    return out


def run_cases(cases, args, env: dict, suite: str, row_of: Callable, seconds_of: Callable,
              metrics_of: Callable, fmt: Callable[[dict], str], skip_of: Callable | None = None,
              note_of: Callable | None = None) -> list:
    """Time args.impls on each case in turn: row_of(case) -> the result's fields, seconds_of(case,
    impl) -> seconds per call, metrics_of(case, seconds) -> its figures, skip_of(case, impl) -> a
    reason not to run, note_of(case, impl) -> a note for its measurement (or None). Prints one line
    a case (fmt(measurement) per impl) and rewrites args.out after each case. Returns the results."""
    results = []
    for case in cases:
        res = row_of(case)
        res["impls"] = measure_impls(args.impls, lambda impl: seconds_of(case, impl),
                                     lambda sec: metrics_of(case, sec),
                                     (lambda impl: skip_of(case, impl)) if skip_of else (lambda impl: None),
                                     (lambda impl: note_of(case, impl)) if note_of else (lambda impl: None))
        results.append(res)
        print(f"{res['label']:44s} " + "  ".join(
            f"{impl}={fmt(m)}" if "us" in m else f"{impl}={m['skip'][:60]}"
            for impl, m in res["impls"].items()), flush=True)
        if args.out:
            _write(args.out, env, results, args, suite=suite)
    if args.out:
        print(f"wrote {args.out}")
    return results


def add_timing_args(ap, calls: int, target_ms: float) -> None:
    """The options every jitted-chain suite shares: calls per chain, sample time, samples, --out."""
    ap.add_argument("--calls", type=int, default=calls, help="dependent calls per jitted function")
    ap.add_argument("--target-ms", type=float, default=target_ms, help="wall time per timing sample")
    ap.add_argument("--reps", type=int, default=5, help="timing samples (median reported)")
    ap.add_argument("--out", help="write the JSON results here")


def runnable_impls(impls: list[str], ours: str, env: dict) -> tuple[list[str], bool]:
    """(impls less `ours` and its forms "ours-...", where this build has no CUDA kernels or jax
    sees no GPU, said on stderr; whether jax sees a GPU)."""
    import jax

    gpu = any(dev.platform == "gpu" for dev in jax.devices())
    mine = [i for i in impls if i == ours or i.startswith(ours + "-")]
    if mine and not (env["build"]["cuda"] and gpu):
        why = env["build"]["reason"] if not env["build"]["cuda"] else "no GPU visible to jax"
        print(f"{' '.join(mine)} skipped ({why})", file=sys.stderr)
        impls = [i for i in impls if i not in mine]
    return list(impls), gpu


def bench_jax(case: Case, impl: str, target_s: float, reps: int,
              device_time: bool = False) -> tuple[float, float | None]:
    """(median seconds per call, device seconds per call or None) of "ours" (cuda.decode_attention,
    BHSD) or "jax-xla" / "jax-cudnn" (jax.nn.dot_product_attention, BTNH) on random inputs of
    `case`'s shapes and dtype.

    target_s: wall time per timing sample; reps: samples (the median is returned). device_time:
    also one profiled run's device seconds a call (`device_seconds_per_call`), else None.
    """
    import jax
    import jax.numpy as jnp

    from jax_onnx_attn.ops import cuda

    b, s, hq, hkv, d, c = case.batch, case.q_len, case.q_heads, case.kv_heads, case.head_dim, case.ctx
    dt = _jax_dtype(case.dtype)
    scale = 1.0 / math.sqrt(d)
    r, k_calls = case.rotations, case.calls
    keys = jax.random.split(jax.random.PRNGKey(case.batch * 7 + c), 2 * r + 1)
    bits = case.kv_bits
    if impl.startswith("ours"):
        q_shape, kv_shape = (b, hq, s, d), (b, hkv, c, d // 2 if bits == 4 else d)
        kv_scale = jnp.full((1, hkv, 1, d) if case.scales == "channel" else (1,), 0.02, jnp.float32)
        # "ours" follows the JOA_DECODE_* switches; its forms pin one (OURS_FORMS).
        pinned = OURS_FORMS[impl][0] if impl in OURS_FORMS else {}

        def attn(q, k, v, lens):
            return cuda.decode_attention(q, k, v, lens, None, None, kv_scale, kv_scale, scale=scale,
                                         causal=True, kv_bits=bits, **pinned)
    else:
        q_shape, kv_shape = (b, s, hq, d), (b, c, hkv, d)
        which = impl.split("-")[1]

        def attn(q, k, v, lens):
            return jax.nn.dot_product_attention(q, k, v, scale=scale, implementation=which)
    q = jax.random.normal(keys[0], q_shape, dt)
    if bits:  # every byte a valid int8 / packed int4 value
        store = jnp.int8 if bits == 8 else jnp.uint8
        lo, hi = (-128, 128) if bits == 8 else (0, 256)
        ks = [jax.random.randint(keys[1 + i], kv_shape, lo, hi, jnp.int32).astype(store) for i in range(r)]
        vs = [jax.random.randint(keys[1 + r + i], kv_shape, lo, hi, jnp.int32).astype(store)
              for i in range(r)]
    else:
        ks = [jax.random.normal(keys[1 + i], kv_shape, dt) for i in range(r)]
        vs = [jax.random.normal(keys[1 + r + i], kv_shape, dt) for i in range(r)]
    lens = jnp.full((b,), c, jnp.int32)

    def chain(q, ks, vs, lens):
        for i in range(k_calls):
            q = attn(q, ks[i % r], vs[i % r], lens).astype(q.dtype)
        return q

    # q is donated: its buffer becomes the output, so every execution sees the same addresses and
    # XLA replays its recorded command buffer instead of re-recording it (a re-record runs every
    # handler's host code: tens of µs that would be timed as GPU time for µs-sized calls).
    run = jax.jit(chain, donate_argnums=(0,) if DONATE else ())

    state = {"q": q}

    def go():
        state["q"] = run(state["q"], ks, vs, lens)

    def sync():
        state["q"].block_until_ready()

    try:
        sec = _time_loop(go, sync, k_calls, target_s, reps)
        return sec, device_seconds_per_call(go, sync, k_calls) if device_time else None
    finally:
        del ks, vs, state


def device_seconds_per_call(run: Callable[[], None], sync: Callable[[], None], calls: int) -> float | None:
    """One run of `calls` dependent calls (already warm) under jax.profiler: its kernels' span on
    the device (first start to last end) / calls, in seconds; None when the trace has no kernels.
    Command buffers stay on under the profiler only with `keep_command_buffers_when_profiling()`
    called before jax starts (main does, for --device-time)."""
    import tempfile

    import jax

    from jax_onnx_attn.bench.e2e import device_kernel_events, kernel_timeline, read_trace
    sync()
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            run()
            sync()
        kernels, _ = device_kernel_events(read_trace(d))
    span = kernel_timeline(kernels or []).get("span_us")
    return span * 1e-6 / calls if span else None


def time_torch_graph(step, q0, calls: int, target_s: float, reps: int) -> float:
    """Median seconds per call of `step(q)` (`calls` dependent calls): run once on a side stream
    (workspace, heuristics), captured in one CUDA graph, its replays timed by `_time_loop`."""
    import torch

    static_q = q0.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(static_q)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: JAX's threads may free buffers (CUDA calls) while torch captures; in the
    # default global mode that invalidates the capture (jax with preallocation off).
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = step(static_q)
    del out
    return _time_loop(graph.replay, torch.cuda.synchronize, calls, target_s, reps)


def bench_torch(case: Case, impl: str, target_s: float, reps: int) -> float:
    """Median seconds per call of torch SDPA ("torch-flash" / "torch-cudnn"), BHSD, in a CUDA graph.

    Same inputs, timing and arguments as `bench_jax`; needs torch with CUDA.
    """
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, s, hq, hkv, d, c = case.batch, case.q_len, case.q_heads, case.kv_heads, case.head_dim, case.ctx
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[case.dtype]
    backend = {"torch-flash": SDPBackend.FLASH_ATTENTION, "torch-cudnn": SDPBackend.CUDNN_ATTENTION}[impl]
    r, k_calls = case.rotations, case.calls
    g = torch.Generator(device="cuda").manual_seed(c)
    q0 = torch.randn(b, hq, s, d, dtype=dt, device="cuda", generator=g)
    ks = [torch.randn(b, hkv, c, d, dtype=dt, device="cuda", generator=g) for _ in range(r)]
    vs = [torch.randn(b, hkv, c, d, dtype=dt, device="cuda", generator=g) for _ in range(r)]
    try:
        with sdpa_kernel([backend]):
            def step(q):
                for i in range(k_calls):
                    q = F.scaled_dot_product_attention(q, ks[i % r], vs[i % r], enable_gqa=hq != hkv)
                return q

            return time_torch_graph(step, q0, k_calls, target_s, reps)
    finally:
        del ks, vs
        torch.cuda.empty_cache()


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _snapshot_commit() -> str:
    """The commit of a snapshot build (tools/snapshot.sh writes COMMIT beside the package), or ""."""
    import jax_onnx_attn
    path = os.path.join(os.path.dirname(os.path.dirname(jax_onnx_attn.__file__)), "COMMIT")
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def environment() -> dict:
    """GPU (nvidia-smi name, clocks, power), jax / jaxlib / torch versions, build info, git commit,
    the JOA_* environment variables set (routing switches such as JOA_PREFILL_ENGINE, so A/B runs
    describe themselves) and whether GQA prompts route to our prefill engine."""
    import jax
    import jaxlib

    from jax_onnx_attn import build_info
    from jax_onnx_attn.ops.decode_paths import prefill_engine_enabled
    info = {
        "gpu": _run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.max.sm,"
                     "clocks.mem,clocks.max.mem,temperature.gpu,power.draw", "--format=csv"]),
        "jax": jax.__version__, "jaxlib": jaxlib.__version__, "python": platform.python_version(),
        "devices": [str(x) for x in jax.devices()],
        "build": build_info(),
        "commit": os.environ.get("JOA_GIT_COMMIT") or _snapshot_commit()
        or _run(["git", "describe", "--always", "--dirty"]),
        "hbm_peak_gbs": HBM_PEAK_GBS,
        "joa_env": {k: os.environ[k] for k in sorted(os.environ) if k.startswith("JOA_")},
        # XLA_FLAGS as jax read them (session 32: a probe helper's import had turned command buffers off).
        "xla_flags": os.environ.get("XLA_FLAGS"),
        "prefill_engine": prefill_engine_enabled(),  # validates JOA_PREFILL_ENGINE up front
    }
    try:
        import torch
        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.version.cuda
        info["cudnn_torch"] = torch.backends.cudnn.version()
    except ImportError:
        info["torch"] = None
    return info


def default_cases(args) -> list[Case]:
    """Every Case in the product of args' dtypes, heads, dims, batch, ctx, qlen, kv_bits; headline
    first."""
    cases = []
    for dtype in args.dtypes:
        for heads in args.heads:
            hq, hkv = map(int, heads.split("/"))
            for d in args.dims:
                for b in args.batch:
                    for c in args.ctx:
                        for s in args.qlen:
                            for bits in args.kv_bits:
                                for sc in (getattr(args, "scales", None) or ["tensor"]) if bits else ["tensor"]:
                                    cases.append(Case(b, c, s, hq, hkv, d, dtype, bits, sc))
    # The headline configuration first (bf16, 32/8, d128), so a time budget keeps it.
    cases.sort(key=lambda x: (x.dtype != "bf16", (x.q_heads, x.kv_heads) != (32, 8), x.head_dim != 128))
    return cases


def _impl_skip(case: Case, impl: str) -> str | None:
    if case.kv_bits and not impl.startswith("ours"):
        return "no int cache"
    if impl in OURS_FORMS and (OURS_FORMS[impl][1] == "int") != bool(case.kv_bits):
        return "float cache" if OURS_FORMS[impl][1] == "int" else "int cache"
    if case.kv_bytes > MAX_KV_BYTES:
        return "beyond memory"
    if impl == "jax-xla" and case.batch * case.q_heads * case.q_len * case.ctx * 4 > MAX_LOGIT_BYTES:
        return "logits beyond memory"
    return None


def format_table(results: list[dict], impls: list[str]) -> str:
    """The results as an aligned text table: our time, GB/s, % of peak, peers' times and ratios."""
    peers = [i for i in impls if i != "ours"]
    alt = ALT_IMPL in impls  # its GB/s and % of peak too (the bytes it reads are ours')
    head = (["case", "ours us", "GB/s", "%peak"] + (["tiles GB/s", "tiles %peak"] if alt else [])
            + [f"{p} us" for p in peers] + [f"x{p}" for p in peers])
    rows = [head]
    for res in results:
        t = res["impls"]
        ours = t.get("ours", {}).get("us")
        row = [res["label"], f"{ours:.1f}" if ours else "-",
               f"{t['ours']['gbs']:.0f}" if ours else "-",
               f"{100 * t['ours']['gbs'] / HBM_PEAK_GBS:.0f}" if ours else "-"]
        if alt:
            gbs = t.get(ALT_IMPL, {}).get("gbs")
            row += [f"{gbs:.0f}" if gbs else "-", f"{100 * gbs / HBM_PEAK_GBS:.0f}" if gbs else "-"]
        for p in peers:
            us = t.get(p, {}).get("us")
            row.append(f"{us:.1f}" if us else t.get(p, {}).get("skip", "-")[:12])
        for p in peers:
            us = t.get(p, {}).get("us")
            row.append(f"{us / ours:.2f}" if us and ours else "-")
        rows.append(row)
    return align_rows(rows)


def align_rows(rows: list[list[str]]) -> str:
    """Rows of cells as an aligned text table: the first column left-aligned, the others right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(x.rjust(w) if i else x.ljust(w) for i, (x, w) in enumerate(zip(r, widths)))
                     for r in rows)


def format_device_table(results: list[dict], impls: list[str]) -> str:
    """--device-time's figures as a table (device µs a call per implementation and the peers'
    ratios to ours); "" when no result has them."""
    have = [i for i in impls if any("device_us" in r["impls"].get(i, {}) for r in results)]
    if not have:
        return ""
    peers = [i for i in have if i != "ours"]
    rows = [["case"] + [f"{i} dev us" for i in have] + [f"x{p} dev" for p in peers if "ours" in have]]
    for res in results:
        dev = {i: res["impls"].get(i, {}).get("device_us") for i in have}
        row = [res["label"]] + [f"{dev[i]:.1f}" if dev[i] else "-" for i in have]
        if "ours" in have:
            row += [f"{dev[p] / dev['ours']:.2f}" if dev[p] and dev["ours"] else "-" for p in peers]
        rows.append(row)
    return align_rows(rows)


def main(argv: list[str] | None = None) -> int:
    """Run the decode suite (see --help); print a table, optionally write JSON. Returns 0, or 1
    without CUDA kernels."""
    ap = argparse.ArgumentParser(prog="python -m jax_onnx_attn.bench decode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--ctx", type=int, nargs="+", default=[1024, 4096, 16384, 131072])
    ap.add_argument("--qlen", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--heads", nargs="+", default=["32/8", "64/8"], help="Hq/Hkv pairs")
    ap.add_argument("--dims", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=["bf16", "fp16"])
    ap.add_argument("--kv-bits", type=int, nargs="+", default=[0], choices=[0, 8, 4],
                    help="cache formats: 0 (q's dtype), 8 / 4 (int8 / int4, ours only)")
    ap.add_argument("--scales", nargs="+", default=["tensor"], choices=["tensor", "channel"],
                    help="quantised caches: per-tensor and / or per-channel K / V scales")
    ap.add_argument("--impls", nargs="+", default=list(DEFAULT_IMPLS), choices=IMPLS)
    ap.add_argument("--target-ms", type=float, default=40.0, help="wall time per timing sample")
    ap.add_argument("--reps", type=int, default=5, help="timing samples (median reported)")
    ap.add_argument("--max-seconds", type=float, default=float("inf"),
                    help="stop starting new cases after this long (partial results are kept)")
    ap.add_argument("--device-time", action="store_true",
                    help="also the device time a call of the jax implementations (one profiled run: "
                         "its kernels' span / calls, the host left out)")
    ap.add_argument("--out", help="write the JSON results here")
    args = ap.parse_args(argv)

    if args.device_time:
        from jax_onnx_attn.bench.e2e import keep_command_buffers_when_profiling
        why = keep_command_buffers_when_profiling()  # before jax starts its backend
        if why:
            print(f"--device-time: command buffers are off under the profiler ({why})", file=sys.stderr)
    env = environment()
    print(json.dumps({k: env[k] for k in ("gpu", "jax", "jaxlib", "torch", "commit")}, indent=1))
    if not env["build"]["cuda"]:
        print(f"no CUDA kernels in this build: {env['build']['reason']}", file=sys.stderr)
        return 1
    _warm_up()
    results: list[dict] = []
    start = time.perf_counter()
    for case in default_cases(args):
        if time.perf_counter() - start > args.max_seconds:
            print(f"time budget reached: stopping before {case.label()}")
            break
        res = {**dataclasses.asdict(case), "label": case.label(), "kv_bytes": case.kv_bytes,
               "bytes_read": case.bytes_read,
               "rotations": case.rotations, "calls_per_graph": case.calls, "impls": {}}
        for impl in args.impls:
            why = _impl_skip(case, impl)
            if why:
                res["impls"][impl] = {"skip": why}
                continue
            try:
                if impl.startswith(("ours", "jax")):
                    sec, device = bench_jax(case, impl, args.target_ms / 1e3, args.reps, args.device_time)
                else:
                    sec, device = bench_torch(case, impl, args.target_ms / 1e3, args.reps), None
                # GB/s on the bytes read: the cache plus, quantised, its scales.
                res["impls"][impl] = {"us": sec * 1e6, "gbs": case.bytes_read / sec / 1e9}
                if device:
                    res["impls"][impl]["device_us"] = device * 1e6
            except Exception as e:  # a peer that cannot run a shape is a result, not a crash
                res["impls"][impl] = {"skip": f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        results.append(res)
        t = res["impls"]
        print(f"{case.label():44s} " + "  ".join(
            (f"{i}={t[i]['us']:.1f}us/{t[i]['gbs']:.0f}GB/s" +
             (f" (device {t[i]['device_us']:.1f}us)" if "device_us" in t[i] else ""))
            if "us" in t[i] else f"{i}={t[i]['skip'][:40]}" for i in args.impls), flush=True)
        if args.out:
            _write(args.out, env, results, args)
    env["gpu_after"] = _run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw",
                             "--format=csv"])
    print()
    print(format_table(results, args.impls))
    print("\nus: per call; GB/s: K+V bytes (+ scales) / time; %peak of 4800 GB/s; xPEER: peer time / our time")
    device_table = format_device_table(results, args.impls)
    if device_table:
        print("\n" + device_table + "\n\ndev us: device time a call (one profiled run's kernel span / calls)")
    if args.out:
        _write(args.out, env, results, args)
        print(f"wrote {args.out}")
    return 0


def _warm_up(seconds: float = 2.0) -> None:
    """Keep the GPU busy until its clocks have left idle, so the first case is not timed at
    a ramping clock (seen: 345 MHz idle, 1845 MHz under load)."""
    import jax
    import jax.numpy as jnp
    x = jnp.ones((4096, 4096), jnp.bfloat16)
    f = jax.jit(lambda x: (x @ x) * (1.0 / 4096))
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        x = f(x)
        x.block_until_ready()


def _write(path, env, results, args, suite: str = "decode"):
    # measured: when the run ended (UTC): the figures order runs of one day by it (plots._run_order).
    measured = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with open(path, "w") as f:
        json.dump({"suite": suite, "measured": measured, "env": env, "args": vars(args), "results": results},
                  f, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main())
