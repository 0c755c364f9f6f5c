"""Projections at decode sizes: our GEMV kernels vs XLA's `x @ w` and torch F.linear.

One case is a weight of a decoder projection (K, N) in a format (fp16, bf16: dense; int4, int8:
MatMulNBits with block 32 and zero points, x in fp16) against x [M, K], M in {1, 8, 32}. Peers in
the same process on the same GPU: XLA with the weight as ONNX stores it ([K, N], `x @ w`) and as
torch does ([N, K], `x @ w.T`); for the n-bit formats XLA's dequantise-and-dot (the ONNX lowering's
path); torch `F.linear` in a CUDA graph (dense only). `--nbits-wide 0 1` times our n-bit kernels in
both formats (one or two 16-byte pieces a lane per chunk): the first is "ours", the other a peer
("ours[wide]" / "ours[narrow]"). `--nbits-rows` also times int4 weights in the rows layout on the
rows kernel (ffi/kernels/gemv/rows.cuh, `ops.to_rows_layout`) as the peer "ours[rows]", and
`--rows-plans` forced plans of it ("ours[rows c,w,d]", with an occupancy "ours[rows c,w,d,o]");
`--nbits-record` times int4 weights in the record layout (`ops.to_record_layout`) on the slots
kernel's record reader (ffi/kernels/gemv/slots.cuh's RecordFormat; one row of x) as the peer
"ours[record]", against "ours" (the slots kernel on the wide format at M = 1);
`--block` sets the quantisation block.

Timing: R calls, each on its own copy of the weight and its own x (R = at least 32, and enough
copies that together they are 5x the 50 MB L2; at most 64 and 24 GiB) in one jitted function /
one CUDA graph, its output buffers donated back so XLA replays its command buffer; dispatched M
times back to back; per-call time = wall / (M * R), the median of several samples after a
warm-up (the conventions of `bench.decode`). Two calls on one weight would be merged by XLA into
one GEMM (its dot merger), and fewer calls a dispatch left the small (1B) shapes host-bound (16
calls: a 2 MB weight measured ~11-13 µs a call, the jit dispatch). Independent calls may still
overlap on the GPU: the e2e profile (`bench e2e`) is the judge of a kernel inside a step.
Effective GB/s = (weight bytes + scales + zero points + x + y) / time; HBM peak 4800 GB/s.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import argparse
import dataclasses
import json
import math
import sys
import time

from jax_onnx_attn.bench.decode import HBM_PEAK_GBS, _time_loop, _warm_up, _write, environment

#: (K, N) of the 1B and 8B Llama-shaped decoders: qkv, o, gate_up, down; and the 128k lm head.
SHAPES = ((2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048), (4096, 6144), (4096, 4096),
          (4096, 28672), (14336, 4096), (2048, 128256))
FORMATS = ("fp16", "bf16", "int4", "int8")
IMPLS = ("ours", "xla-kn", "xla-nk", "torch")
ROTATE_BYTES = 256 << 20  # weight copies read in turn: together well past the 50 MB L2
MAX_ROTATIONS = 64        # weight copies (= calls per dispatch) at most
MIN_CALLS = 32            # calls per dispatch at least: the jit's host cost is spread over them
MAX_COPY_BYTES = 24 << 30  # the copies together at most
BLOCK = 32                # MatMulNBits block size (onnxruntime-genai's default)


@dataclasses.dataclass(frozen=True)
class Case:
    """One projection: x [m, k] against a weight [n, k] in `fmt` (fp16 | bf16 | int4 | int8)."""

    k: int
    n: int
    m: int
    fmt: str
    block: int = BLOCK  # n-bit: the quantisation block

    @property
    def bits(self) -> int:
        """Bits per weight element (16 dense)."""
        return {"int4": 4, "int8": 8}.get(self.fmt, 16)

    @property
    def weight_bytes(self) -> int:
        """Bytes of one weight copy: packed elements, plus 2-byte scales and 1-byte zero points."""
        blocks = self.n * (self.k // self.block) if self.bits != 16 else 0
        return self.n * self.k * self.bits // 8 + 3 * blocks

    @property
    def bytes(self) -> int:
        """Bytes a call moves at least: the weight, x and y (2-byte elements)."""
        return self.weight_bytes + 2 * self.m * (self.k + self.n)

    @property
    def rotations(self) -> int:
        """Weight copies, one per call."""
        want = max(MIN_CALLS, math.ceil(ROTATE_BYTES / self.weight_bytes))
        return max(1, min(MAX_ROTATIONS, want, MAX_COPY_BYTES // self.weight_bytes))

    @property
    def calls(self) -> int:
        """Calls per jitted function (one per weight copy)."""
        return self.rotations

    def label(self) -> str:
        """A one-line description of the case."""
        block = f" bs{self.block}" if self.bits != 16 and self.block != BLOCK else ""
        return f"K={self.k} N={self.n} M={self.m} {self.fmt}{block}"


def _weights(case: Case, impl: str, seed: int = 0, rows: bool = False, record: bool = False):
    """The case's weight copies for a jax implementation, on the default device (rows / record: int4
    in the rows / record layout; one copy packed on the host, the others device copies of it)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_onnx_attn.ops.linear import tile_nbits_meta, to_record_layout, to_rows_layout

    dt = jnp.bfloat16 if case.fmt == "bf16" else jnp.float16
    keys = jax.random.split(jax.random.PRNGKey(seed + case.k + case.n), case.rotations + 1)
    if case.bits == 16:
        shape = (case.k, case.n) if impl == "xla-kn" else (case.n, case.k)
        return [(jax.random.normal(kk, shape, dt) * (1 / math.sqrt(case.k))).astype(dt)
                for kk in keys[1:]]
    kb = case.k // case.block
    out = []
    for kk in keys[1:]:
        a, b, c = jax.random.split(kk, 3)
        bq = jax.random.randint(a, (case.n, kb, case.block * case.bits // 8), 0, 256, jnp.int32).astype(jnp.uint8)
        s = (jax.random.uniform(b, (case.n, kb), jnp.float32, 0.5, 1.5) / (1 << case.bits)).astype(dt)
        z = jax.random.randint(c, (case.n, kb), 0, 1 << case.bits, jnp.int32).astype(jnp.uint8)
        if rows or record:  # packing is host work (seconds for an LM head): once, then device copies
            pack = to_rows_layout if rows else lambda *w: (to_record_layout(*w),)
            packed = tuple(jnp.asarray(a) for a in pack(np.asarray(bq), np.asarray(s), np.asarray(z)))
            return [packed] + [tuple(jnp.copy(a) for a in packed) for _ in range(case.rotations - 1)]
        if impl == "ours":  # the layout the loader stores for our kernels
            s, z = tile_nbits_meta(s), tile_nbits_meta(z)
        out.append((bq, s, z))
    return out


def bench_jax(case: Case, impl: str, target_s: float, reps: int, plan: tuple[int, int] = (0, 0),
              wide: bool = False, rows: tuple[int, int, int, int] | None = None,
              record: bool = False) -> float:
    """Median seconds per call of "ours" (our kernels; plan = forced (cluster, warps_k), (0, 0) =
    the planner's; wide: the two-piece n-bit format; rows: int4 in the rows layout on the rows
    kernel with forced (cluster, warps_n, depth, occupancy), zeros = planned; record: int4 in the
    record layout on the slots kernel's record reader), "xla-kn" (x @ w[K, N];
    n-bit: XLA dequantise + dot) or "xla-nk" (x @ w[N, K].T)."""
    import jax
    import jax.numpy as jnp

    from jax_onnx_attn.ops import cuda_matmul
    from jax_onnx_attn.ops.reference import linear as reference

    dt = jnp.bfloat16 if case.fmt == "bf16" else jnp.float16
    c = case.calls
    # One x per call too (the peers must not see equal calls).
    xs = jax.random.normal(jax.random.PRNGKey(1), (c, case.m, case.k), dt)
    ws = _weights(case, impl, rows=rows is not None, record=record)
    if case.bits == 16:
        if impl == "ours":
            def call(x, w):
                return cuda_matmul.linear(x, w, cluster=plan[0], warps_k=plan[1])
        elif impl == "xla-kn":
            def call(x, w):
                return x @ w
        else:
            def call(x, w):
                return x @ w.T
    else:
        if record:
            def call(x, w):
                return cuda_matmul.matmul_nbits_record(x, *w, n=case.n, block_size=case.block)
        elif rows is not None:
            def call(x, w):
                return cuda_matmul.matmul_nbits_rows(x, *w, n=case.n, block_size=case.block,
                                                     cluster=rows[0], warps_n=rows[1], depth=rows[2],
                                                     occupancy=rows[3])
        elif impl == "ours":
            def call(x, w):
                return cuda_matmul.matmul_nbits(x, *w, bits=case.bits, block_size=case.block,
                                                cluster=plan[0], warps_k=plan[1], wide=wide)
        else:
            def call(x, w):
                return reference.matmul_nbits(x, *w, bits=case.bits, block_size=case.block)

    # Independent calls on distinct weights (no CSE, no extra kernels between them); the previous
    # outputs are donated so that every execution writes the same buffers and XLA replays its
    # recorded command buffer instead of re-recording it.
    def chain(outs, xs, ws):
        del outs
        return tuple(call(xs[i], ws[i]) for i in range(c))

    run = jax.jit(chain, donate_argnums=(0,))
    state = {"outs": tuple(jnp.zeros((case.m, case.n), dt) for _ in range(c))}

    def go():
        state["outs"] = run(state["outs"], xs, ws)

    try:
        return _time_loop(go, lambda: jax.block_until_ready(state["outs"]), c, target_s, reps)
    finally:
        del ws, state


def bench_torch(case: Case, target_s: float, reps: int) -> float:
    """Median seconds per call of torch F.linear(x, w[N, K]) in a CUDA graph of R calls."""
    import torch
    import torch.nn.functional as F

    dt = torch.bfloat16 if case.fmt == "bf16" else torch.float16
    g = torch.Generator(device="cuda").manual_seed(case.k + case.n)
    x = torch.randn(case.m, case.k, dtype=dt, device="cuda", generator=g)
    ws = [torch.randn(case.n, case.k, dtype=dt, device="cuda", generator=g) / math.sqrt(case.k)
          for _ in range(case.rotations)]
    try:
        def step():
            return [F.linear(x, w) for w in ws]

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # warm-up outside the graph (cuBLAS handles, heuristics)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: JAX's threads may free buffers (CUDA calls) while torch captures; in
        # the default global mode that invalidates the capture (jax with preallocation off).
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            outs = step()
        del outs
        return _time_loop(graph.replay, torch.cuda.synchronize, case.rotations, target_s, reps)
    finally:
        del ws
        torch.cuda.empty_cache()


def _skip(case: Case, impl: str, gpu: bool, cuda_built: bool, wide: bool = False,
          rows: tuple[int, int, int, int] | None = None, record: bool = False) -> str | None:
    if impl == "ours":
        if not (gpu and cuda_built):
            return "no GPU / CUDA build"
        from jax_onnx_attn.ops import cuda_matmul
        if record:
            if case.bits != 4:
                return "record layout: int4 only"
            return cuda_matmul.record_unsupported(case.m, case.n, case.k, case.block, False, False)
        if rows is not None:
            if case.bits != 4:
                return "rows layout: int4 only"
            return cuda_matmul.rows_unsupported(case.m, case.n, case.k, case.block, False, False, *rows)
        return cuda_matmul.unsupported(case.m, case.n, case.k, case.bits, False, False, case.block,
                                       wide=wide)
    if impl == "torch":
        if case.bits != 16:
            return "no n-bit peer"
        if not gpu:
            return "no GPU"
    if impl == "xla-nk" and case.bits != 16:
        return "n-bit: see xla-kn"
    return None


#: The rows kernel's planned plan: (cluster, warps_n, depth, occupancy), zeros = the planner's.
PLANNED_ROWS = (0, 0, 0, 0)


def rows_plan(text: str) -> tuple[int, int, int, int]:
    """A --rows-plans value "C,W,D" or "C,W,D,O" as (cluster, warps_n, depth, occupancy), O = 0
    (planned) when left out."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) not in (3, 4):
        raise argparse.ArgumentTypeError(f"rows plan {text!r}: CLUSTER,WARPS_N,DEPTH[,OCCUPANCY] integers")
    return values + (0,) * (4 - len(values))


def rows_plan_name(plan: tuple[int, int, int, int]) -> str:
    """The peer name of a rows-kernel plan: "ours[rows]" for the planner's, "ours[rows c,w,d]"
    forced, ",o" added where the occupancy is forced (the names of earlier results stay)."""
    if plan == PLANNED_ROWS:
        return "ours[rows]"
    c, w, d, o = plan
    return f"ours[rows c{c},w{w},d{d}" + (f",o{o}" if o else "") + "]"


def rows_plan_fields(case: Case, plan: tuple[int, int, int, int]) -> dict:
    """The rows kernel's plan of a case under a forced (cluster, warps_n, depth, occupancy): the
    fields an A/B compares."""
    from jax_onnx_attn.ops import cuda_matmul
    p = cuda_matmul.gemv_plan(case.m, case.n, case.k, 4, False, cluster=plan[0], block_size=case.block,
                              rows_layout=True, warps_n=plan[1], depth=plan[2], occupancy=plan[3])
    return {f: p[f] for f in ("cluster", "warps_n", "stages", "ctas_per_sm", "grid", "smem_bytes")}


def cases(args) -> list[Case]:
    """Every Case of args' formats x shapes x rows, grouped by weight (rows inner); the headline
    formats first, so a time budget keeps them."""
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes] if args.shapes else SHAPES
    return [Case(k, n, m, fmt, args.block) for fmt in args.formats for k, n in shapes for m in args.rows]


def format_table(results: list[dict], impls: list[str]) -> str:
    """The results as a text table: our µs, GB/s and % of peak, the peers' µs and their ratio to ours
    (the decode suite's table; extra plans of ours count as peers)."""
    from jax_onnx_attn.bench.decode import format_table as table
    return table(results, ["ours"] + [i for i in impls if i != "ours"])


def main(argv: list[str] | None = None) -> int:
    """Run the linear suite (see --help); print a table, optionally write JSON. Returns 0."""
    ap = argparse.ArgumentParser(prog="python -m jax_onnx_attn.bench linear", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", help="KxN weights (default: the 1B / 8B projections)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32], help="M: rows of x")
    ap.add_argument("--formats", nargs="+", default=["fp16", "int4", "bf16", "int8"], choices=FORMATS)
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    ap.add_argument("--plans", nargs="*", default=[],
                    help="extra plans of ours to time, as CLUSTER,WARPS_K (e.g. 1,8 4,2): tuning")
    ap.add_argument("--nbits-wide", type=int, nargs="+", choices=(0, 1), default=None,
                    help="n-bit format(s) of ours: 0 one 16-byte piece a lane per chunk, 1 two "
                         "(wide); the first is 'ours' (and the --plans'), the others peers "
                         "'ours[wide]' / 'ours[narrow]' (default: JOA_GEMV_NBITS_WIDE, on)")
    ap.add_argument("--block", type=int, default=BLOCK, choices=(16, 32, 64, 128),
                    help="MatMulNBits block size of the n-bit formats")
    ap.add_argument("--nbits-rows", action="store_true",
                    help="also time int4 in the rows layout on the rows kernel: peer 'ours[rows]'")
    ap.add_argument("--rows-plans", nargs="*", default=[], type=rows_plan,
                    help="forced plans of the rows kernel as CLUSTER,WARPS_N,DEPTH[,OCCUPANCY] "
                         "(0: planned; occupancy 1 or 2 CTAs an SM), peers 'ours[rows c,w,d]' / "
                         "'ours[rows c,w,d,o]' (implies --nbits-rows)")
    ap.add_argument("--nbits-record", action="store_true",
                    help="also time int4 in the record layout on the slots kernel's record reader "
                         "(one row of x): peer 'ours[record]'")
    ap.add_argument("--target-ms", type=float, default=10.0, help="wall time per timing sample")
    ap.add_argument("--reps", type=int, default=3, help="timing samples (median reported)")
    ap.add_argument("--max-seconds", type=float, default=55.0,
                    help="stop starting new cases after this long (partial results are kept)")
    ap.add_argument("--out", help="write the JSON results here")
    args = ap.parse_args(argv)

    import jax

    env = environment()
    print(json.dumps({k: env[k] for k in ("gpu", "jax", "jaxlib", "torch", "commit")}, indent=1))
    gpu = any(d.platform == "gpu" for d in jax.devices())
    cuda_built = bool(env["build"]["cuda"])
    if not (gpu and cuda_built):
        print("ours and torch skipped (no GPU or no CUDA build): timing the XLA peers only",
              file=sys.stderr)
    plans = [tuple(int(v) for v in p.split(",")) for p in args.plans]
    rows_plans = args.rows_plans
    if args.nbits_rows or rows_plans:
        rows_plans = [PLANNED_ROWS] + [p for p in dict.fromkeys(rows_plans) if p != PLANNED_ROWS]
    from jax_onnx_attn.ops.cuda_matmul import nbits_wide
    wides = [bool(w) for w in dict.fromkeys(args.nbits_wide or [int(nbits_wide())])]
    _warm_up(2.0 if gpu else 0.2)
    results: list[dict] = []
    start = time.perf_counter()
    for case in cases(args):
        if time.perf_counter() - start > args.max_seconds:
            print(f"time budget reached: stopping before {case.label()}")
            break
        res = {**dataclasses.asdict(case), "label": case.label(), "bytes": case.bytes,
               "weight_bytes": case.weight_bytes, "rotations": case.rotations, "calls": case.calls,
               "impls": {}}
        res["wide"] = wides[0] and case.bits != 16
        if cuda_built:
            from jax_onnx_attn.ops import cuda_matmul
            res["plan"] = cuda_matmul.gemv_plan(case.m, case.n, case.k, case.bits, False,
                                                wide=wides[0])
            for w in wides[1:]:
                if case.bits != 16:
                    res["plan_wide" if w else "plan_narrow"] = cuda_matmul.gemv_plan(
                        case.m, case.n, case.k, case.bits, False, wide=w)
            if args.nbits_record and case.bits == 4:
                res["plan_record"] = cuda_matmul.gemv_plan(case.m, case.n, case.k, 4, False,
                                                           block_size=case.block, record_layout=True)
            if rows_plans and case.bits == 4:
                res["plan_rows"] = cuda_matmul.gemv_plan(case.m, case.n, case.k, 4, False,
                                                         block_size=case.block, rows_layout=True)
        runs = ([(impl, (0, 0), wides[0], None, False) for impl in args.impls]
                + [("ours", p, wides[0], None, False) for p in plans]
                + [("ours", (0, 0), w, None, False) for w in wides[1:]]
                + [("ours", (0, 0), wides[0], r, False) for r in rows_plans]
                + ([("ours", (0, 0), wides[0], None, True)] if args.nbits_record else []))
        for impl, plan, wide, rows, record in runs:
            name = ("ours[record]" if record else rows_plan_name(rows) if rows is not None else
                    impl if plan == (0, 0) and wide == wides[0] else f"ours[c{plan[0]},wk{plan[1]}]"
                    if plan != (0, 0) else f"ours[{'wide' if wide else 'narrow'}]")
            why = _skip(case, impl, gpu, cuda_built, wide, rows, record)
            if why is None and wide != wides[0] and case.bits == 16:
                why = "dense: one format"
            if why is None and plan != (0, 0):
                from jax_onnx_attn.ops import cuda_matmul
                why = cuda_matmul.unsupported(case.m, case.n, case.k, case.bits, False, False,
                                              case.block, *plan, wide=wide)
            if why:
                res["impls"][name] = {"skip": why}
                continue
            try:
                sec = (bench_torch(case, args.target_ms / 1e3, args.reps) if impl == "torch"
                       else bench_jax(case, impl, args.target_ms / 1e3, args.reps, plan, wide, rows,
                                      record))
                res["impls"][name] = {"us": sec * 1e6, "gbs": case.bytes / sec / 1e9}
                if rows is not None:  # what the forced fields resolved to
                    res["impls"][name]["rows_plan"] = rows_plan_fields(case, rows)
            except Exception as e:  # a peer that cannot run a shape is a result, not a crash
                res["impls"][name] = {"skip": f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        results.append(res)
        t = res["impls"]
        print(f"{case.label():32s} " + "  ".join(
            f"{i}={t[i]['us']:.1f}us/{t[i]['gbs']:.0f}GB/s" if "us" in t[i] else f"{i}={t[i]['skip'][:30]}"
            for i in t), flush=True)
        if args.out:
            _write(args.out, env, results, args, suite="linear")
    print()
    names = dict.fromkeys(name for res in results for name in res["impls"])
    extra = [name for name in names if name.startswith("ours[")]
    print(format_table(results, list(args.impls) + extra))
    print("\nus: per call; GB/s: (weight + scales + x + y bytes) / time; %peak of 4800 GB/s; "
          "xPEER: peer time / our time")
    if args.out:
        _write(args.out, env, results, args, suite="linear")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
