"""Whole-model prefill and decode: our lowered decoder vs a hand-written JAX decoder and torch.

    python -m jax_onnx_attn.bench e2e [--quick] [--models 1b 8b] [--weights fp16 int4]
        [--batch 1 8 32] [--ctx 1024 2048 8192 32768] [--max-seconds S] --out FILE

Models are made on the machine by `jax_onnx_attn.models` (onnxruntime-genai builder graphs, seeded
random weights) and cached under --models-dir (model.onnx + model.onnx.data per preset and weight
format). Per (model, weights) group the model is lowered once (`jax_onnx_attn.load`); the peers
(`bench/e2e_peers.py`) compute on the lowered params' device buffers. Every case (batch B, context
T) gets its own KV capacity C = T + (max_calls + 1) * steps rounded up to 256, the same for every
implementation; one
implementation's cache is freed before the next one's is made.

Decode (tokens/s at context T): each implementation runs K = --steps greedy steps per call, with
nothing read back between calls:
  * ours: `DecoderSession(lowered, max_length=C, batch=B, steps_per_call=K)`; its cache holds the
    prompt's rows (after a prefill case) or random values; each sample starts from a DecodeState of
    rows at length T and runs m calls of the session's compiled decode executable
    (`DecoderSession.run_decode`, the executable `generate` uses); with --devices 1 2 also as
    ours-tp2: the same session on a mesh of two devices (tensor parallel; its bound and GEMM peak
    are the two devices' together, its records carry "devices");
  * jax-peer: one jitted fori_loop of K steps from position T, cache donated;
  * torch-peer: K steps captured in one CUDA graph, replayed (eager ops by default; --torch-compile
    captures the torch.compile'd step instead, whose compile time the default budget does not hold).
    Not run for MatMulNBits models (see bench/e2e_peers.py: the skip says why).
After a warm-up call (compilation) and one timed call that sets m (so that a sample lasts about
--target-ms, at most --max-calls calls), ms/step = the median over --reps samples of
(wall time of m calls) / (m * K). The host dispatches the m calls back to back and synchronises once,
so per-call dispatch hides behind the device. With --rounds N every impl is measured N times in
turn, each time in a new session, and its record is the median round's with every round's ms
(rounds_ms): the ~1B B=1 step of one implementation moved by up to 4% between sessions of one run,
more than within one. frac_of_bound = the bandwidth bound of one step
(`jax_onnx_attn.runtime.roofline`: weights + B gathered rows + B * T KV rows, over the GPU's HBM
bandwidth: 4.8 TB/s on the H200, 3.35 on the H100 SXM; --hbm overrides) over
the measured step; tokens/s = B / step time.

Prefill (cases with B * T <= --max-prefill-tokens): time to first token for a B x T prompt batch:
ours `generate(prompts, max_new_tokens=1).timings.prefill_s` (the prefill executable and the summary
read, compile time excluded), the best of --prefill-reps runs after a compiling one; the peers'
prefill (the LM head on the last position only, as our session's prefill does; first token by
argmax) the same way. frac_of_gemm_peak = the prefill's FLOPs (roofline: 2 x matmul params x tokens
with the LM head once per row, + causal attention) per second over the fp16 GEMM peak measured in
this run (a chain of 8192^3 matmuls in jax).

Kernels per step (--profile first: each group's first case; a prefill's: one prefill traced the
same way, its kernel time beside the TTFT): one decode call traced with
jax.profiler (create_perfetto_trace=True), the
kernels on the GPU's stream lines of the Chrome-trace JSON counted and divided by K (torch: its
profiler's CUDA kernels of one graph replay); null with a note when the trace has no device events
(e.g. on a CPU).

With --profile-command-buffers the traced calls keep XLA's command buffers
(`--xla_enable_command_buffers_during_profiling=true` added to XLA_FLAGS; XLA otherwise runs a
profiled executable's thunks one by one): the trace then shows the step as it runs untraced, e.g.
the FFI record stage's kernel nodes and their programmatic-dependent-launch overlap.

Verification: on the first case of each batch size in each group (a batch size picks its own
kernels: at int4 the record layout at B=1, the rows layout above), the greedy tokens of ours
(`generate`) and of each peer for the same 16-token prompt in every row, 1 + K tokens of row 0,
are recorded side by side (`verify` in the JSON, with the number of leading tokens that agree).

Budget: --max-seconds bounds the whole run (model making included); each (model, weights) group
gets a share of what is left when it starts, in proportion to 1 + its weights' GB / 4 (it is not opened when less than OPEN_S_PER_GB
seconds per GB of weights are left), runs its first case regardless and then its cases in order of
priority while the previous case's duration still fits in its share; cases not run are listed under
"skipped" with the reason (memory, time budget). A case that starts near the end may overrun the
budget by its own duration. The JSON is rewritten after every case.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import argparse
import contextlib
import dataclasses
import functools
import gc
import glob
import gzip
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from typing import Callable

import numpy as np

from jax_onnx_attn import _extension
from jax_onnx_attn.bench.decode import _warm_up, environment
from jax_onnx_attn.runtime.roofline import H200_HBM_BYTES_PER_S, hbm_bytes_per_s

IMPLS = ("ours", "jax-peer", "torch-peer")
#: Weight formats: DecoderConfig overrides.
WEIGHTS = {"fp16": dict(dtype="float16", weight_bits=0), "bf16": dict(dtype="bfloat16", weight_bits=0),
           "fp32": dict(dtype="float32", weight_bits=0),
           "int4": dict(dtype="float16", weight_bits=4), "int8": dict(dtype="float16", weight_bits=8)}
#: The --quick subset: (model, weights, batch, ctx).
QUICK = (("1b", "fp16", 1, 2048), ("1b", "fp16", 8, 2048), ("8b", "fp16", 1, 2048),
         ("1b", "int4", 1, 2048), ("1b", "int4", 8, 2048))
#: Within a group, cases run by context in this order, then by batch (what a budget keeps first).
CTX_PRIORITY = (2048, 8192, 32768, 1024)
BATCH_PRIORITY = (1, 8, 32)
#: Share of the device memory a case may plan for (weights + two caches' worth: ours' pool may keep
#: one cache-sized region while torch allocates its own).
MEMORY_SHARE = 0.9
VERIFY_PROMPT = 16
#: A group is not opened when less time is left than this many seconds per GB of weights (making,
#: writing and lowering a model, then at least one case).
OPEN_S_PER_GB = 4.0
CAPACITY_ALIGN = 256


@dataclasses.dataclass(frozen=True)
class Case:
    """One e2e case: a model preset (or alias), a weight format, batch B and context T."""

    model: str
    weights: str
    batch: int
    ctx: int

    def label(self) -> str:
        """A one-line description for logs."""
        return f"{self.model} {self.weights} B={self.batch} ctx={self.ctx}"


def default_cases(args) -> list[Case]:
    """The cases of `args` (the --quick subset, or models x weights x batch x ctx), grouped by
    (model, weights) in the order given, each group's cases by CTX_PRIORITY then BATCH_PRIORITY."""
    if args.quick:
        return [Case(*c) for c in QUICK]

    def rank(value, order):
        return order.index(value) if value in order else len(order) + value

    cases = []
    for model in args.models:
        for weights in args.weights:
            group = [Case(model, weights, b, c) for b in args.batch for c in args.ctx]
            group.sort(key=lambda x: (rank(x.ctx, CTX_PRIORITY), rank(x.batch, BATCH_PRIORITY)))
            cases += group
    return cases


def model_config(case: Case, seed: int = 0):
    """The DecoderConfig of a case's model and weight format."""
    from jax_onnx_attn.models import preset
    if case.weights not in WEIGHTS:
        raise ValueError(f"unknown weights {case.weights!r}; known: {sorted(WEIGHTS)}")
    return preset(case.model, seed=seed, **WEIGHTS[case.weights])


# --------------------------------------------------------------------------------------------------
# Timing and profiling

def time_steps(start: Callable[[], None], call: Callable[[], None], sync: Callable[[], None],
               steps_per_call: int, target_s: float, max_calls: int, reps: int) -> tuple[float, dict]:
    """Median seconds per step (see the module doc). `start` resets the state (not timed), `call`
    dispatches one call of `steps_per_call` steps, `sync` waits for the device. Returns (seconds,
    details: the calls per sample and every sample's seconds per step)."""
    start()
    call()
    sync()  # warm-up
    start()
    sync()
    t0 = time.perf_counter()
    call()
    sync()
    once = max(time.perf_counter() - t0, 1e-9)
    m = int(min(max_calls, max(1, math.ceil(target_s / once))))
    samples = []
    for _ in range(reps):
        start()
        sync()
        t0 = time.perf_counter()
        for _ in range(m):
            call()
        sync()
        samples.append((time.perf_counter() - t0) / (m * steps_per_call))
    return statistics.median(samples), {"calls_per_sample": m, "samples_ms": [s * 1e3 for s in samples]}


_MEMCPY_WORDS = ("memcpy", "memset", "memory copy", "copy h2d", "copy d2h")
_NOT_KERNEL_LINES = ("xla modules", "xla ops", "steps", "launch stats", "source", "framework",
                     "host threads", "xla traceme")


def device_kernel_events(events: list[dict]) -> tuple[list[dict] | None, dict]:
    """The kernel events of a Chrome-trace event list (jax.profiler's perfetto_trace.json): complete
    events ("ph": "X") on the stream lines of GPU processes, memcpy / memset left out. Returns
    (events, info: the lines read), or (None, info with a "note") when the trace has no device
    events."""
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") != "M":
            continue
        if e.get("name") == "process_name":
            procs[e.get("pid")] = str(e.get("args", {}).get("name", ""))
        elif e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name", ""))
    gpus = {pid for pid, name in procs.items() if "gpu" in name.lower() or "/device:" in name.lower()}
    if not gpus:
        return None, {"note": f"no device events in the trace (processes: {sorted(set(procs.values()))[:6]})"}
    lines = {k: n for k, n in threads.items() if k[0] in gpus}
    streams = {k for k, n in lines.items() if n.lower().startswith("stream")}
    if not streams:  # no "Stream #N" lines: every line of the device but the derived ones
        streams = {k for k, n in lines.items() if not n.lower().startswith(_NOT_KERNEL_LINES)}
    on_streams = [e for e in events if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams]
    kernels, copies = [], Counter()
    for e in on_streams:
        name = str(e.get("name", ""))
        if any(w in name.lower() for w in _MEMCPY_WORDS):
            copies[name[:60]] += float(e.get("dur", 0))
        else:
            kernels.append(e)
    info = {"lines": sorted({lines[k] for k in streams}), "all_lines": sorted(set(lines.values()))}
    if copies:  # copies and memsets: device time that is not a kernel (a cache copied, not donated?)
        info["copies_us"] = {n: round(t, 1) for n, t in copies.most_common(6)}
    return kernels, info


def _kernel_key(event: dict) -> str:
    """A kernel event's name (240 characters at most) and, when its args carry them, its grid and
    block ("name [grid 128,1,1 block 256,1,1]")."""
    name = str(event.get("name", ""))[:240]
    args = event.get("args", {}) or {}
    dims = [f"{k} {args[k]}" for k in sorted(args) if any(w in k.lower() for w in ("grid", "block"))]
    return f"{name} [{' '.join(str(d) for d in dims)[:60]}]" if dims else name


def count_device_kernels(events: list[dict]) -> tuple[int | None, dict]:
    """Kernels in a Chrome-trace event list (see `device_kernel_events`). Returns (count, info: the
    kernel names by count, the lines read); count None with info["note"] when the trace has no
    device kernels."""
    kernels, info = device_kernel_events(events)
    if kernels is None:
        return None, info
    lines = info.pop("all_lines")
    names = Counter(str(e.get("name", "")) for e in kernels)
    info["top"] = names.most_common(8)
    # Where the time goes: kernels by total device µs in the trace (name, grid when the trace gives
    # it, count, µs). The whole name: the GEMV's template arguments tell its fusion apart.
    us, count = Counter(), Counter()
    for e in kernels:
        key = _kernel_key(e)
        us[key] += float(e.get("dur", 0))
        count[key] += 1
    info["top_time"] = [(n, count[n], round(t, 1)) for n, t in us.most_common(24)]
    info["total_us"] = round(sum(us.values()), 1)
    # The same kernels' wall time: what each adds to the busy time. A programmatic dependent launch
    # (our combine kernel, XLA's chained kernels) starts while its predecessor runs and its duration
    # includes that wait, so summed durations count the overlap twice.
    wall = kernel_wall_times(kernels)
    info["top_wall"] = [(n, round(wall[n], 1)) for n, _, _ in info["top_time"]]
    info.update(kernel_timeline(kernels))
    if not names:
        info["note"] = f"no kernels on the device lines {lines[:8]}"
        return None, info
    return sum(names.values()), info


def kernel_wall_times(kernels: list[dict]) -> Counter:
    """µs each kernel key (`_kernel_key`) adds to the union of kernel intervals: a kernel's
    interval less what kernels that started before it already cover. The values sum to
    `kernel_timeline`'s busy_us."""
    wall, covered = Counter(), float("-inf")
    for e in sorted((e for e in kernels if "ts" in e), key=lambda e: float(e["ts"])):
        start = float(e["ts"])
        end = start + float(e.get("dur", 0))
        wall[_kernel_key(e)] += max(0.0, end - max(start, covered))
        covered = max(covered, end)
    return wall


#: A gap between two kernels of a traced step up to this long is a launch boundary; longer ones are
#: the device waiting on the host (the decode loop's predicate round trips, which the profiler's
#: thunk-by-thunk run widens).
SHORT_GAP_US = 10.0


def kernel_timeline(kernels: list[dict], gaps: int = 6) -> dict:
    """Where a traced region's device time is not kernels: span_us (first kernel start to last
    kernel end), busy_us (the union of kernel intervals, overlap counted once), idle_us (span - busy),
    short_gaps_us / short_gaps (the sum and count of gaps up to SHORT_GAP_US: kernel boundaries; the
    rest of idle_us is waits on the host) and the largest idle gaps with the kernels either side
    ([µs, before, after]). A span much longer than busy means the device waited on the host
    (launches, syncs), not on kernels."""
    spans = sorted((float(e.get("ts", 0)), float(e.get("ts", 0)) + float(e.get("dur", 0)),
                    str(e.get("name", ""))[:80]) for e in kernels if "ts" in e)
    if not spans:
        return {}
    busy, idle = 0.0, []
    start, end, last = spans[0][0], spans[0][1], spans[0][2]
    for s, e, name in spans[1:]:
        if s > end:
            busy += end - start
            idle.append((round(s - end, 1), last, name))
            start = s
        if e >= end:
            end, last = e, name
    busy += end - start
    span = end - spans[0][0]
    short = [g for g, _, _ in idle if g <= SHORT_GAP_US]
    return {"span_us": round(span, 1), "busy_us": round(busy, 1), "idle_us": round(span - busy, 1),
            "short_gaps_us": round(sum(short), 1), "short_gaps": len(short),
            "largest_gaps": sorted(idle, reverse=True)[:gaps]}


def read_trace(folder: str) -> list[dict]:
    """The events of the Chrome-trace JSON jax.profiler wrote under `folder` (perfetto_trace.json.gz,
    else *.trace.json.gz); [] when there is none."""
    paths = sorted(glob.glob(os.path.join(folder, "**", "perfetto_trace.json.gz"), recursive=True)) or \
        sorted(glob.glob(os.path.join(folder, "**", "*.trace.json.gz"), recursive=True))
    if not paths:
        return []
    with gzip.open(paths[-1], "rt") as f:
        doc = json.load(f)
    return doc.get("traceEvents", []) if isinstance(doc, dict) else list(doc)


def traced_kernel_events(fn, args, runs: int = 3) -> list[dict]:
    """fn(*args) once (compiled and warm), then `runs` calls under jax.profiler: their device kernel
    events (`device_kernel_events`; [] when the trace has none). For the probes' per-call times."""
    import jax

    fn(*args).block_until_ready()
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(runs):
                fn(*args).block_until_ready()
        kernels, _ = device_kernel_events(read_trace(d))
    return kernels or []


#: Where the traces are kept (--trace-dir), else None: they are read and dropped.
TRACE_DIR: str | None = None


def _keep_trace(folder: str) -> str | None:
    """Copies the perfetto trace under `folder` into TRACE_DIR (numbered); returns its new path."""
    paths = sorted(glob.glob(os.path.join(folder, "**", "perfetto_trace.json.gz"), recursive=True))
    if TRACE_DIR is None or not paths:
        return None
    os.makedirs(TRACE_DIR, exist_ok=True)
    dest = os.path.join(TRACE_DIR, f"trace-{len(os.listdir(TRACE_DIR)):02d}.json.gz")
    shutil.copyfile(paths[-1], dest)
    return dest


#: The XLA flag that keeps command buffers while a profiler runs (XLA's default turns them off).
COMMAND_BUFFERS_DURING_PROFILING = "xla_enable_command_buffers_during_profiling"


def _xla_libraries() -> list[str]:
    """The shared libraries whose XLA parses XLA_FLAGS: the CUDA PJRT plugins installed
    (jax_plugins/xla_cuda*), else jaxlib's own."""
    import importlib.util
    plugins = importlib.util.find_spec("jax_plugins")
    dirs = list(plugins.submodule_search_locations or []) if plugins else []
    found = sorted(p for d in dirs for p in glob.glob(os.path.join(d, "xla_cuda*", "*.so")))
    if found:
        return found
    jaxlib = importlib.util.find_spec("jaxlib")
    return sorted(glob.glob(os.path.join(os.path.dirname(jaxlib.origin), "libjax_common*.so"))) if jaxlib else []


def _library_knows(path: str, word: str) -> bool:
    """Whether the bytes of `word` occur in the file (a flag's name in XLA's flag table)."""
    import mmap
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        return m.find(word.encode()) >= 0


def keep_command_buffers_when_profiling(environ=os.environ, libraries: list[str] | None = None) -> str | None:
    """Adds --xla_enable_command_buffers_during_profiling=true to environ["XLA_FLAGS"] (call it
    before jax starts a backend). Returns None, or why it was not added: XLA aborts on a flag it
    does not know, so the flag is added only where the libraries that parse XLA_FLAGS name it."""
    libraries = _xla_libraries() if libraries is None else libraries
    if not libraries:
        return "no XLA library found to check for the flag"
    missing = [os.path.basename(p) for p in libraries if not _library_knows(p, COMMAND_BUFFERS_DURING_PROFILING)]
    if missing:
        return f"{', '.join(missing)} has no {COMMAND_BUFFERS_DURING_PROFILING} flag"
    flags = environ.get("XLA_FLAGS", "")
    if COMMAND_BUFFERS_DURING_PROFILING not in flags:
        environ["XLA_FLAGS"] = f"{flags} --{COMMAND_BUFFERS_DURING_PROFILING}=true".strip()
    return None


def jax_kernels_per_step(start, call, sync, steps: int) -> dict:
    """{"kernels_per_step": float | None, "profile": info} from one traced call (see
    count_device_kernels)."""
    import jax
    start()
    sync()
    with tempfile.TemporaryDirectory() as d:
        try:
            with jax.profiler.trace(d, create_perfetto_trace=True):
                call()
                sync()
            n, info = count_device_kernels(read_trace(d))
            kept = _keep_trace(d)
            if kept:
                info["trace"] = kept
        except Exception as e:  # a profiler that cannot start is a note, not a failure
            n, info = None, {"note": f"profiler: {type(e).__name__}: {str(e).splitlines()[0][:160]}"}
    return {"kernels_per_step": None if n is None else n / steps, "profile": info}


def torch_kernels_per_step(decoder, steps: int) -> dict:
    """The same from torch's profiler: CUDA kernels of one call of a TorchDecoder."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
        if not decoder.peer.device.startswith("cuda"):
            return {"kernels_per_step": None, "profile": {"note": "torch on a CPU: no device kernels"}}
        decoder.sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            decoder()
            torch.cuda.synchronize()
        names = Counter(e.name for e in prof.events()
                        if str(e.device_type).endswith("CUDA")
                        and not any(w in e.name.lower() for w in _MEMCPY_WORDS))
        if not names:
            return {"kernels_per_step": None, "profile": {"note": "no CUDA kernels in torch's profile"}}
        return {"kernels_per_step": sum(names.values()) / steps, "profile": {"top": names.most_common(8)}}
    except Exception as e:
        return {"kernels_per_step": None,
                "profile": {"note": f"torch profiler: {type(e).__name__}: {str(e).splitlines()[0][:160]}"}}


def gemm_peak(on_gpu: bool, n: int | None = None, chain: int = 8, reps: int = 5) -> dict:
    """TFLOP/s of a chain of `chain` dependent fp16 n x n matmuls in one jit (n = 8192 on a GPU)."""
    import jax
    import jax.numpy as jnp
    n = n or (8192 if on_gpu else 256)
    key = jax.random.PRNGKey(0)
    a = (jax.random.normal(key, (n, n), jnp.float32) / np.sqrt(n)).astype(jnp.float16)
    x = jax.random.normal(jax.random.fold_in(key, 1), (n, n), jnp.float16)

    @jax.jit
    def run(x, a):
        for _ in range(chain):
            x = x @ a
        return x

    run(x, a).block_until_ready()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run(x, a).block_until_ready()
        samples.append(time.perf_counter() - t0)
    t = statistics.median(samples)
    return {"tflops": 2.0 * n ** 3 * chain / t / 1e12, "n": n, "chain": chain, "dtype": "float16",
            "impl": "jax"}


# --------------------------------------------------------------------------------------------------
# One group (model, weights) and its cases

@dataclasses.dataclass
class Group:
    """What the cases of one (model, weights) share: the config, the lowered model, its cost, peers."""

    model: str
    weights: str
    config: object
    # Our lowerings of the model by their load options (`load_key`): the plain one ({}) and those a
    # session of some batch or switch loads (`lowered_for`), least recently used first.
    loaded: dict = dataclasses.field(default_factory=dict)
    cost: object = None
    jax_peer: object = None
    torch_peer: object = None
    peer_skip: dict = dataclasses.field(default_factory=dict)
    info: dict = dataclasses.field(default_factory=dict)

    def close(self):
        """Drop every device reference (peers first: torch holds DLPack views of the params)."""
        import jax
        self.torch_peer = self.jax_peer = None
        self.loaded = {}
        _free()
        jax.clear_caches()  # compiled functions close over the peers and sessions


#: Device memory kept free beside a lowering's weights and caches when deciding whether it fits.
LOAD_HEADROOM = 2 << 30


def load_key(options: dict) -> tuple:
    """A lowering's key in Group.loaded: its `load` options, in order."""
    return tuple(sorted(options.items()))


def lowered_for(g: Group, options: dict, need: int):
    """Our lowering of g's model with these `load` options, made on first use. Each one
    holds the weights on the device (~16 GB at ~8B fp16), so before making one that does not fit
    beside those held (`need` bytes plus LOAD_HEADROOM free) the least recently used are dropped:
    an 80 GB card then runs an ~8B A/B of ours' variants by loading each in turn, where holding
    three at once ran out of memory (session 39)."""
    import jax
    import jax_onnx_attn

    key = load_key(options)
    if key in g.loaded:
        g.loaded[key] = g.loaded.pop(key)  # most recently used last
        return g.loaded[key]
    while g.loaded and not _fits(need + LOAD_HEADROOM):
        g.loaded.pop(next(iter(g.loaded)))
        _free()
        jax.clear_caches()  # compiled steps close over the dropped weights
    g.loaded[key] = jax_onnx_attn.load(g.info["path"], **options)
    return g.loaded[key]


def _fits(nbytes: int) -> bool:
    """Whether the first device has nbytes free under jax's limit (True where it does not say)."""
    import jax
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:
        stats = {}
    if "bytes_limit" not in stats:
        return True
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0) >= nbytes


def _free():
    gc.collect()
    try:
        import torch
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


def _err(e: BaseException) -> str:
    return f"error: {type(e).__name__}: {str(e).splitlines()[0][:240] if str(e) else ''}"


def open_group(case: Case, args, impls) -> Group:
    """Make (or reuse) the model on disk, lower it, compute its StepCost, set up the peers."""
    import jax_onnx_attn
    from jax_onnx_attn.bench.e2e_peers import JaxPeer, PeerUnsupported, TorchPeer
    from jax_onnx_attn.models import ensure_model
    from jax_onnx_attn.runtime.roofline import step_cost

    config = model_config(case, args.seed)
    g = Group(case.model, case.weights, config)
    path, build_s = ensure_model(config, args.models_dir, progress=args.progress)
    t0 = time.perf_counter()
    plain = g.loaded[load_key({})] = jax_onnx_attn.load(path)
    load_s = time.perf_counter() - t0
    g.cost = step_cost(plain)
    g.info = {"config": dataclasses.asdict(config), "path": str(path), "params": config.param_count(),
              "file_bytes": config.file_bytes(), "build_s": build_s, "load_s": load_s,
              "step_cost": g.cost.as_dict()}
    # The peers read the graph as the producer wrote it (our lowering rewrites it into fused nodes
    # with weights in the kernels' layouts), so they get their own unfused lowering: the same
    # weights, their own device copy.
    plain = {}

    def unfused():
        if "lowered" not in plain:
            plain["lowered"] = jax_onnx_attn.load(path, fuse=False)
        return plain["lowered"]

    for impl, make in (("jax-peer", lambda: JaxPeer(unfused())),
                       ("torch-peer", lambda: TorchPeer(unfused(), compile=args.torch_compile))):
        if impl not in impls:
            continue
        try:
            peer = make()
            setattr(g, impl.replace("-", "_"), peer)
        except PeerUnsupported as e:
            g.peer_skip[impl] = str(e)
        except Exception as e:
            g.peer_skip[impl] = _err(e)
    if g.torch_peer is not None:
        g.info["torch_weights_shared"] = g.torch_peer.shared
    return g


def capacity_for(ctx: int, args) -> int:
    """KV capacity of a case: ctx + (max_calls + 1) * steps, rounded up to a multiple of 256 (the
    same for every implementation; cuDNN and torch's kernels like aligned key lengths)."""
    need = ctx + (args.max_calls + 1) * args.steps
    return -(-need // CAPACITY_ALIGN) * CAPACITY_ALIGN


def kv_bytes_per_token(config) -> int:
    """K and V bytes of one cached token of one row (all layers)."""
    return 2 * config.layers * config.kv_heads * config.head_size * config.np_dtype.itemsize


def memory_skip(case: Case, config, capacity: int, limit: int | None) -> str | None:
    """Why a case does not fit in `limit` bytes of device memory (None: it fits or no limit)."""
    if not limit:
        return None
    need = config.file_bytes() + 2 * case.batch * capacity * kv_bytes_per_token(config)
    if need > MEMORY_SHARE * limit:
        return (f"beyond memory: weights + two KV caches = {need / 2**30:.0f} GiB of "
                f"{MEMORY_SHARE * limit / 2**30:.0f} GiB")
    return None


def _decode_record(g: Group, case: Case, sec: float, hbm: float, **extra) -> dict:
    return {"ms": sec * 1e3, "tokens_per_s": case.batch / sec,
            "frac_of_bound": g.cost.decode_seconds(case.batch, case.ctx, hbm) / sec, **extra}


def _prefill_record(g: Group, case: Case, sec: float, peak_tflops: float, **extra) -> dict:
    flops = g.cost.prefill_flops(case.batch, case.ctx)
    return {"ms": sec * 1e3, "tokens_per_s": case.batch * case.ctx / sec, "tflops": flops / sec / 1e12,
            "frac_of_gemm_peak": flops / sec / 1e12 / peak_tflops if peak_tflops else None,
            "kernels_per_step": None, **extra}


def median_round(recs: list[dict]) -> dict:
    """One impl's decode record over --rounds: the median round's (by ms; the lower of the two
    middle ones for an even count), the first round's profile where the median round has none,
    every round's ms as rounds_ms (None for a round that did not run) and, for the rounds that were
    profiled, their device time a traced call (rounds_profile: busy / idle µs, the largest gaps)."""
    timed = sorted((r for r in recs if "ms" in r), key=lambda r: r["ms"])
    if not timed:
        return recs[0]
    out = dict(timed[(len(timed) - 1) // 2])
    for key, value in recs[0].items():
        if out.get(key) is None:
            out[key] = value
    out["rounds_ms"] = [r.get("ms") for r in recs]
    keys = ("busy_us", "idle_us", "short_gaps_us", "largest_gaps")
    profiled = [{"ms": r.get("ms"), **{k: r["profile"][k] for k in keys if k in r["profile"]}}
                for r in recs if isinstance(r.get("profile"), dict) and "busy_us" in r["profile"]]
    if len(profiled) > 1:
        out["rounds_profile"] = profiled
    return out


def _guarded(fn: Callable[[], dict]) -> dict:
    """fn()'s record, or {"skip": the error} (a prefill that does not fit still leaves the decode
    measurement of the case)."""
    try:
        return fn()
    except Exception as e:
        return {"skip": _err(e)}


def _deleted(caches) -> bool:
    """True when any buffer of a jax-peer cache was donated away (a failed call)."""
    return any(x.is_deleted() for kv in caches for x in kv)


def _prompts(vocab: int, batch: int, length: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (batch, length), dtype=np.int64).astype(np.int32)


def measure_ours(g: Group, case: Case, capacity: int, prefill: bool, verify: bool, args, env,
                 devices: int = 1) -> dict:
    """Our DecoderSession on the case (see the module doc): {"decode": ..., "prefill": ...,
    "verify": tokens}. devices > 1: tensor parallel over the first `devices` devices (a mesh of
    that many on the model axis; the bound is theirs together)."""
    import jax
    import jax.numpy as jnp

    from jax_onnx_attn.bench.e2e_peers import _normal_fill
    from jax_onnx_attn.runtime import DecoderSession
    from jax_onnx_attn.runtime.mesh import make_mesh
    from jax_onnx_attn.runtime.session import RUNNING, DecodeState

    b, t, k = case.batch, case.ctx, args.steps
    out = {}
    mesh = make_mesh(devices) if devices > 1 else None
    # What a session of this batch and these switches loads (runtime.session.load_options), shared by
    # the cases that load the same (`lowered_for`): int4 in the rows layout for up to 32 rows (the
    # most the rows kernel takes; the same layouts on the llama shapes at any batch); dense weights
    # have no n-bit layout.
    from jax_onnx_attn.runtime.session import load_options

    options = load_options(b, mesh)
    if g.weights != "int4":
        options.pop("nbits_layout", None)
        options.pop("decode_rows", None)
    elif "decode_rows" in options:
        options["decode_rows"] = 32
    lowered = lowered_for(g, options, g.config.file_bytes() + 2 * b * capacity * kv_bytes_per_token(g.config))
    if options:
        out["nbits_layout"] = options.get("nbits_layout", "onnx")
        out["dense_layout"] = options.get("dense_layout", "nk")
    session = DecoderSession(lowered, max_length=capacity, batch=b, steps_per_call=k, mesh=mesh)
    compile_s = 0.0
    if verify:
        prompt = _prompts(g.config.vocab, 1, VERIFY_PROMPT, 7)[0].tolist()
        r = session.generate([prompt] * b, max_new_tokens=1 + k)
        compile_s += r.timings.compile_s
        out["verify"] = r.tokens[0]
    if prefill:
        def run_prefill():
            prompts = _prompts(g.config.vocab, b, t, case.ctx + b).tolist()
            r = session.generate(prompts, max_new_tokens=1)
            ttft = min(session.generate(prompts, max_new_tokens=1).timings.prefill_s
                       for _ in range(args.prefill_reps))
            rec = _prefill_record(g, case, ttft, env["gemm_peak_tflops"] * devices,
                                  compile_s=compile_s + r.timings.compile_s, devices=devices)
            if _profile_this(g, case, args):  # kernels of one prefill: device time vs the TTFT
                rec.update(jax_kernels_per_step(lambda: None, lambda: session.generate(prompts, max_new_tokens=1),
                                                lambda: None, 1))
            return rec

        out["prefill"] = _guarded(run_prefill)
    if "ms" not in out.get("prefill", {}):
        # Random rows instead of the zeros the session starts with (or the buffers a failed prefill
        # donated), one buffer at a time.
        fill = _normal_fill()
        key = jax.random.PRNGKey(case.ctx)
        for i, name in enumerate(sorted(session.cache)):
            buf = session.cache[name]
            shape, dtype = buf.shape, buf.dtype
            if not buf.is_deleted():
                buf.delete()
            del buf
            filled = fill(jax.random.fold_in(key, i), shape, dtype)
            if session.cache_shardings is not None:
                filled = jax.device_put(filled, session.cache_shardings[name])
            session.cache[name] = filled
    tokens = _prompts(g.config.vocab, b, capacity, case.ctx + 1)
    holder = {}

    def start():
        holder["state"] = DecodeState(
            tokens=jnp.asarray(tokens), length=jnp.full((b,), t, jnp.int32),
            prompt_len=jnp.full((b,), t, jnp.int32), max_new=jnp.full((b,), capacity, jnp.int32),
            finish=jnp.full((b,), RUNNING, jnp.int32), stop_ids=jnp.full((8,), -1, jnp.int32),
            key=jax.random.PRNGKey(0), step=jnp.zeros((), jnp.int32), status=jnp.zeros((b,), jnp.int32))

    def call():
        holder["state"] = session.run_decode(holder["state"], 1)

    def sync():
        jax.block_until_ready(holder["state"])

    t0 = time.perf_counter()
    start()
    call()
    sync()
    first_call_s = time.perf_counter() - t0
    sec, detail = time_steps(start, call, sync, k, args.target_ms / 1e3, args.max_calls, args.reps)
    host = jax.device_get(holder["state"])
    if (host.finish != RUNNING).any() or host.status.any():
        raise RuntimeError(f"decode rows stopped or were refused during timing (finish {host.finish}, "
                           f"status {host.status}): the capacity {capacity} is too small")
    rec = _decode_record(g, case, sec, args.hbm * devices, compile_s=compile_s,
                         first_call_s=first_call_s, devices=devices, **detail)
    rec.update(jax_kernels_per_step(start, call, sync, k) if _profile_this(g, case, args)
               else {"kernels_per_step": None})
    for name in ("qkv_prepare", "gated_mlp", "out_mlp"):
        rec[name] = options.get(name, False)
    out["decode"] = rec
    del session, holder
    return out


def measure_jax_peer(g: Group, case: Case, capacity: int, prefill: bool, verify: bool, args, env) -> dict:
    """The hand-written JAX decoder on the case."""
    import jax
    import jax.numpy as jnp
    peer = g.jax_peer
    b, t, k = case.batch, case.ctx, args.steps
    p = peer.params
    out = {}
    state = {"caches": peer.new_caches(b, capacity, seed=case.ctx)}
    tok0 = jnp.asarray(_prompts(g.config.vocab, b, 1, case.ctx + 2)[:, 0])
    t0 = time.perf_counter()
    dec = peer.compile_with_fallback(lambda: peer.decode_fn(k), p, state["caches"], tok0, jnp.int32(t))
    compile_s = time.perf_counter() - t0
    if verify:
        ids = jnp.asarray(np.repeat(_prompts(g.config.vocab, 1, VERIFY_PROMPT, 7), b, axis=0))
        pre = peer.compile_with_fallback(peer.prefill_fn, p, ids, state["caches"])
        _, state["caches"], first = pre(p, ids, state["caches"])
        state["caches"], toks = dec(p, state["caches"], first, jnp.int32(VERIFY_PROMPT))
        out["verify"] = [int(first[0])] + [int(x) for x in np.asarray(toks)[:, 0]]
    if prefill:
        def run_prefill():
            ids = jnp.asarray(_prompts(g.config.vocab, b, t, case.ctx + b))
            t0 = time.perf_counter()
            pre = peer.compile_with_fallback(peer.prefill_fn, p, ids, state["caches"])
            pre_compile_s = time.perf_counter() - t0
            runs = []
            for _ in range(1 + args.prefill_reps):
                t0 = time.perf_counter()
                _, state["caches"], first = pre(p, ids, state["caches"])
                first.block_until_ready()
                runs.append(time.perf_counter() - t0)
            rec = _prefill_record(g, case, min(runs[1:]), env["gemm_peak_tflops"],
                                  attention=peer.attention, compile_s=pre_compile_s)
            state["first"] = first
            if _profile_this(g, case, args):
                def call():
                    _, state["caches"], state["first"] = pre(p, ids, state["caches"])

                rec.update(jax_kernels_per_step(lambda: None, call,
                                                lambda: state["first"].block_until_ready(), 1))
            return rec

        out["prefill"] = _guarded(run_prefill)
        if "caches" not in state or state["caches"] is None or _deleted(state["caches"]):
            state["caches"] = peer.new_caches(b, capacity, seed=case.ctx)
    holder = {"tok": tok0}
    pos0 = jnp.int32(t)

    def call():
        state["caches"], toks = dec(p, state["caches"], holder["tok"], pos0)
        holder["toks"] = toks

    def sync():
        jax.block_until_ready(holder.get("toks", holder["tok"]))

    sec, detail = time_steps(lambda: None, call, sync, k, args.target_ms / 1e3, args.max_calls, args.reps)
    rec = _decode_record(g, case, sec, args.hbm, compile_s=compile_s, attention=peer.attention, **detail)
    if peer.spec.quantized:
        rec["weights_note"] = "MatMulNBits weights dequantised inside the jit (XLA fuses it)"
    if peer.attention_note:
        rec["attention_note"] = peer.attention_note
    rec.update(jax_kernels_per_step(lambda: None, call, sync, k) if _profile_this(g, case, args)
               else {"kernels_per_step": None})
    out["decode"] = rec
    state.clear()
    return out


def _profile_this(g: Group, case: Case, args) -> bool:
    """--profile first: the group's first case; all: every case; none: no case."""
    return args.profile == "all" or (args.profile == "first" and g.info.get("first_case") == case.label())


def measure_torch_peer(g: Group, case: Case, capacity: int, prefill: bool, verify: bool, args, env) -> dict:
    """The torch decoder on the case (CUDA graph on a GPU)."""
    peer = g.torch_peer
    torch = peer.torch
    b, t, k = case.batch, case.ctx, args.steps
    out = {}
    caches = peer.new_caches(b, capacity, seed=case.ctx)
    t0 = time.perf_counter()
    dec = peer.decoder(b, caches, k)
    compile_s = time.perf_counter() - t0
    dev = peer.device

    def sync():
        dec.sync()

    with torch.no_grad():
        if verify:
            ids = torch.from_numpy(np.repeat(_prompts(g.config.vocab, 1, VERIFY_PROMPT, 7), b, 0)).long().to(dev)
            logits = peer.forward(ids, torch.zeros(1, dtype=torch.long, device=dev), caches, prefill=True,
                                  last_only=True)
            first = torch.argmax(logits[:, -1], dim=-1)
            dec.tok.copy_(first)
            dec.pos0.fill_(VERIFY_PROMPT)
            dec()
            sync()
            out["verify"] = [int(first[0])] + [int(x) for x in dec.toks[:, 0].cpu()]
        if prefill:
            def run_prefill():
                ids = torch.from_numpy(_prompts(g.config.vocab, b, t, case.ctx + b)).long().to(dev)
                zero = torch.zeros(1, dtype=torch.long, device=dev)
                runs = []
                for _ in range(1 + args.prefill_reps):
                    sync()
                    t0 = time.perf_counter()
                    logits = peer.forward(ids, zero, caches, prefill=True, last_only=True)
                    torch.argmax(logits[:, -1], dim=-1)
                    sync()
                    runs.append(time.perf_counter() - t0)
                    del logits
                return _prefill_record(g, case, min(runs[1:]), env["gemm_peak_tflops"])

            out["prefill"] = _guarded(run_prefill)
            _free()
        dec.tok.copy_(torch.from_numpy(_prompts(g.config.vocab, b, 1, case.ctx + 2)[:, 0]).long())
        dec.pos0.fill_(t)
        sec, detail = time_steps(lambda: None, dec, sync, k, args.target_ms / 1e3, args.max_calls, args.reps)
    rec = _decode_record(g, case, sec, args.hbm, compile_s=compile_s, cuda_graph=dec.graph is not None,
                         weights_shared=peer.shared, torch_compile=peer.compiled, **detail)
    # torch's profiler leaves CUPTI to itself: jax.profiler traces nothing after it in the same
    # process (seen on the H200), so torch is profiled only when asked, after every jax trace.
    rec.update(torch_kernels_per_step(dec, k) if args.profile_torch and _profile_this(g, case, args)
               else {"kernels_per_step": None,
                     "profile": {"note": "not profiled (--profile-torch: torch's profiler stops "
                                         "jax.profiler's device tracing for the rest of the run)"}})
    out["decode"] = rec
    del dec, caches
    return out


MEASURE = {"ours": measure_ours, "jax-peer": measure_jax_peer, "torch-peer": measure_torch_peer}


def ours_name(devices: int) -> str:
    """Our impl's name in the results on `devices` devices: "ours", "ours-tp2", ..."""
    return "ours" if devices == 1 else f"ours-tp{devices}"


def parse_ours_env(specs) -> list[tuple[str, dict]]:
    """--ours-env NAME:VAR=VAL[,VAR=VAL] -> [(NAME, {VAR: VAL})]; ValueError names a bad spec."""
    out = []
    for spec in specs or ():
        name, sep, rest = spec.partition(":")
        pairs = [p.partition("=") for p in rest.split(",") if p]
        if not sep or not name or not pairs or any(not var or not eq for var, eq, _ in pairs):
            raise ValueError(f"--ours-env: expected NAME:VAR=VAL[,VAR=VAL], got {spec!r}")
        out.append((name, {var: val for var, _, val in pairs}))
    return out


@contextlib.contextmanager
def _environment(values: dict):
    """os.environ with `values` set for the block (the switches ours reads at trace time)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _ours_with_env(values: dict):
    def measure(*args, **kwargs):
        with _environment(values):
            return measure_ours(*args, **kwargs)
    return measure


def measured_impls(impls, devices, variants=()) -> list[tuple[str, Callable]]:
    """(name, measure function) per impl, ours once per device count of --devices and once per
    --ours-env variant (one device: "ours[NAME]")."""
    runs = []
    for impl in impls:
        if impl == "ours":
            runs += [(ours_name(n), functools.partial(measure_ours, devices=n)) for n in devices]
            runs += [(f"ours[{name}]", _ours_with_env(values)) for name, values in variants]
        else:
            runs.append((impl, MEASURE[impl]))
    return runs


def _group_weight(config) -> float:
    """A group's share of the budget, relative to others: 1 + its weights in GB / 4 (bigger models
    take longer to make, lower and run)."""
    return 1.0 + config.file_bytes() / 4e9


def run_case(g: Group, case: Case, args, env, impls, verify: bool) -> tuple[list[dict], dict | None]:
    """Measure every impl on a case; returns (the decode / prefill result records, the verify record)."""
    capacity = capacity_for(case.ctx, args)
    prefill = "prefill" in args.phases and case.batch * case.ctx <= args.max_prefill_tokens
    base = {"model": g.config.name, "model_alias": case.model, "weights": case.weights,
            "weight_bits": g.config.weight_bits or 8 * g.config.np_dtype.itemsize,
            "dtype": g.config.dtype, "batch": case.batch, "ctx": case.ctx, "capacity": capacity,
            "steps_per_call": args.steps}
    bound = g.cost.decode_seconds(case.batch, case.ctx, args.hbm)
    records = {}
    if "decode" in args.phases:
        records["decode"] = {**base, "phase": "decode", "bytes_per_step": g.cost.decode_bytes(case.batch, case.ctx),
                             "bound_ms": bound * 1e3, "impls": {}}
    if prefill:
        flops = g.cost.prefill_flops(case.batch, case.ctx)
        records["prefill"] = {**base, "phase": "prefill", "tokens": case.batch * case.ctx, "flops": flops,
                              "gemm_peak_tflops": env["gemm_peak_tflops"], "impls": {}}
    verify_rec = {"model": g.config.name, "weights": case.weights, "batch": case.batch, "ctx": case.ctx,
                  "prompt_tokens": VERIFY_PROMPT, "tokens": {}} if verify else None
    runs = measured_impls(impls, args.devices, parse_ours_env(args.ours_env))
    decode_rounds: dict[str, list[dict]] = {impl: [] for impl, _ in runs}
    for r in range(max(1, args.rounds)):
        # Rounds after the first: decode only, profiled only under --profile all.
        round_args = (args if r == 0 or args.profile == "all"
                      else argparse.Namespace(**{**vars(args), "profile": "none"}))
        for impl, measure in runs:
            skip = g.peer_skip.get(impl)
            if skip is None:
                try:
                    out = measure(g, case, capacity, prefill and r == 0, verify and r == 0, round_args, env)
                except Exception as e:  # an impl that cannot run a case is a result, not a crash
                    out, skip = {}, _err(e)
            else:
                out = {}
            if "decode" in records:
                decode_rounds[impl].append(out.get("decode") or {"skip": skip or "not measured"})
            if r == 0:
                for phase, rec in records.items():
                    rec["impls"][impl] = out.get(phase) or {"skip": skip or "not measured"}
                if verify_rec is not None:
                    verify_rec["tokens"][impl] = out.get("verify") or {"skip": skip or "not measured"}
            _free()
    if "decode" in records and args.rounds > 1:
        for impl, recs in decode_rounds.items():
            records["decode"]["impls"][impl] = median_round(recs)
    if verify_rec is not None:
        ours = verify_rec["tokens"].get("ours")
        agree = {}
        for impl, toks in verify_rec["tokens"].items():
            if impl != "ours" and isinstance(toks, list) and isinstance(ours, list):
                n = 0
                while n < min(len(toks), len(ours)) and toks[n] == ours[n]:
                    n += 1
                agree[impl] = n
        verify_rec["agree_with_ours"] = agree
        verify_rec["equal"] = {impl: n == 1 + args.steps for impl, n in agree.items()}
    return list(records.values()), verify_rec


# --------------------------------------------------------------------------------------------------
# The run

def _device_memory() -> int | None:
    import jax
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:
        stats = {}
    return stats.get("bytes_limit")


def format_table(results: list[dict]) -> str:
    """The results as aligned text: per case and phase, each impl's ms, tokens/s and fraction."""
    rows = [["case", "phase", "impl", "ms", "tok/s", "frac", "kern/step"]]
    for r in results:
        for impl, m in r["impls"].items():
            label = f"{r['model_alias']} {r['weights']} B={r['batch']} T={r['ctx']}"
            if "ms" not in m:
                rows.append([label, r["phase"], impl, "-", "-", "-", m.get("skip", "")[:50]])
                continue
            frac = m.get("frac_of_bound", m.get("frac_of_gemm_peak"))
            kern = m.get("kernels_per_step")
            rows.append([label, r["phase"], impl, f"{m['ms']:.3f}", f"{m['tokens_per_s']:.0f}",
                         "-" if frac is None else f"{frac:.2f}", "-" if kern is None else f"{kern:.0f}"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(row, widths)) for row in rows)


def write_json(path: str, env: dict, args, results, skipped, verify, models) -> None:
    """The suite's JSON (see the module doc and bench/plots.py's e2e loader)."""
    versions = {k: env.get(k) for k in ("jax", "jaxlib", "python", "torch", "torch_cuda", "cudnn_torch")}
    env = dict(env, ffi_record=_extension.record_status())  # what the record stage did in this run
    # measured: when the run ended (UTC), so that the loader orders runs of one day by time, not by
    # their commit hashes' spelling.
    measured = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    doc = {"suite": "e2e", "gpu": env.get("gpu"), "versions": versions, "commit": env.get("commit"),
           "measured": measured, "env": env, "args": vars(args), "models": models, "verify": verify,
           "results": results, "skipped": skipped}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    """Run the e2e suite (see --help); print a table, optionally write JSON. Returns 0."""
    ap = argparse.ArgumentParser(prog="python -m jax_onnx_attn.bench e2e", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["1b", "8b"],
                    help="presets or aliases (1b, 8b, issue, tiny)")
    ap.add_argument("--weights", nargs="+", default=["fp16", "int4"], choices=sorted(WEIGHTS))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--ctx", type=int, nargs="+", default=[1024, 2048, 8192, 32768])
    ap.add_argument("--quick", action="store_true",
                    help="only " + ", ".join(f"{m} {w} B={b} T={c}" for m, w, b, c in QUICK))
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    ap.add_argument("--devices", type=int, nargs="+", default=[1],
                    help="device counts to run ours on (tensor parallel over the first N devices; "
                         "results as ours, ours-tp2, ...; default 1)")
    ap.add_argument("--phases", nargs="+", default=["prefill", "decode"], choices=["prefill", "decode"])
    ap.add_argument("--max-prefill-tokens", type=int, default=8192,
                    help="prefill is measured where batch * ctx is at most this")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per call (K)")
    ap.add_argument("--target-ms", type=float, default=150.0, help="wall time per timing sample")
    ap.add_argument("--max-calls", type=int, default=8, help="calls per timing sample at most")
    ap.add_argument("--reps", type=int, default=3, help="timing samples (median reported)")
    # 5: with 2, issue 12's grid once read an ~8B int4 2k TTFT 0.93x the peer's where 5 a round, two
    # rounds, gave 1.025x (bench/results/2026-12-06-854046a-e2e-8b-prefill2k-h100.json).
    ap.add_argument("--prefill-reps", type=int, default=5, help="timed prefills (best reported)")
    ap.add_argument("--profile-torch", action="store_true",
                    help="also count the torch peer's kernels (then jax traces taken later in the "
                         "run see no device events)")
    ap.add_argument("--profile", choices=["first", "all", "none"], default="first",
                    help="trace kernels per step: each group's first case, every case, none")
    ap.add_argument("--profile-command-buffers", action="store_true",
                    help="keep XLA's command buffers in the traced calls (XLA flag "
                         f"--{COMMAND_BUFFERS_DURING_PROFILING}=true): the trace shows the graphs' "
                         "kernels, e.g. the FFI record stage's nodes")
    ap.add_argument("--hbm", type=float, default=None,
                    help="HBM bytes/s of the bound (default: the GPU's, runtime.roofline.HBM_BYTES_PER_S; "
                         "the H200's 4.8e12 where the GPU is not in it)")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="budget for the whole run incl. making models (default 420, --quick 240)")
    ap.add_argument("--models-dir", default=None, help="where models are made and reused "
                    "(default $JOA_MODELS_DIR or /tmp/joa-models)")
    ap.add_argument("--compile-cache", default="/tmp/joa-jax-cache",
                    help="jax's persistent compilation cache on a GPU ('none': off)")
    ap.add_argument("--seed", type=int, default=0, help="weights' seed")
    ap.add_argument("--no-verify", dest="verify", action="store_false", help="skip the token check")
    ap.add_argument("--torch-compile", action="store_true",
                    help="torch.compile the torch peer's decode step before its CUDA graph (its "
                         "compile time is not in the default budget: off by default)")
    ap.add_argument("--progress", action="store_true", help="progress bars while making models")
    ap.add_argument("--trace-dir", default=None,
                    help="keep the profiled calls' perfetto traces here (trace-NN.json.gz, named in the JSON)")
    ap.add_argument("--ours-env", nargs="+", default=[], metavar="NAME:VAR=VAL[,VAR=VAL]",
                    help="also run ours with these environment settings while it traces and runs, "
                         "reported as impl ours[NAME] (A/B of trace-time switches, e.g. "
                         "pf24:JOA_L2_PREFETCH_MB=24)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure every impl's decode this many times in turn (A B C A B C ...), each a "
                         "new session; the record is the median round's, with rounds_ms (prefill and "
                         "verify in the first round only, the profile too unless --profile all, which "
                         "adds rounds_profile): for A/Bs smaller than the spread between sessions "
                         "(~1B B=1: up to 4%%)")
    ap.add_argument("--out", help="write the JSON results here")
    args = ap.parse_args(argv)
    parse_ours_env(args.ours_env)  # a bad spec fails before any model is made
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    global TRACE_DIR
    TRACE_DIR = args.trace_dir
    if args.max_seconds is None:
        args.max_seconds = 240.0 if args.quick else 420.0
    # Before jax starts a backend, which reads XLA_FLAGS once.
    no_command_buffers = keep_command_buffers_when_profiling() if args.profile_command_buffers else None
    if no_command_buffers:
        print(f"--profile-command-buffers: not set ({no_command_buffers})", flush=True)
    start = time.perf_counter()

    import jax
    on_gpu = any(d.platform == "gpu" for d in jax.devices())
    if on_gpu and args.compile_cache != "none":
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
    env = environment()
    env["suite"] = "e2e"
    env["xla_flags"] = os.environ.get("XLA_FLAGS")
    if args.profile_command_buffers:
        env["profile_command_buffers"] = no_command_buffers or "on"
    print(json.dumps({k: env.get(k) for k in ("gpu", "jax", "jaxlib", "torch", "commit",
                                                 "prefill_engine", "joa_env")}, indent=1))
    from jax_onnx_attn.bench.e2e_peers import torch_status
    impls = list(args.impls)
    if on_gpu:
        _warm_up(2.0)
    env["gemm_peak"] = gemm_peak(on_gpu)
    env["gemm_peak_tflops"] = env["gemm_peak"]["tflops"]
    if args.hbm is None:  # the bound of the GPU measured on (an H100's is 0.70 of the H200's)
        kind = str(jax.devices()[0].device_kind) if on_gpu else None
        args.hbm = hbm_bytes_per_s(kind) or H200_HBM_BYTES_PER_S
    env["hbm_bytes_per_s"] = args.hbm
    env["device_memory_bytes"] = limit = _device_memory()
    print(f"GEMM peak (fp16, jax): {env['gemm_peak_tflops']:.1f} TFLOP/s", flush=True)
    torch, why = torch_status()
    env["torch_peer"] = why or ("cuda" if torch.cuda.is_available() else "cpu (eager, no CUDA graph)")

    cases = default_cases(args)
    groups = list(dict.fromkeys((c.model, c.weights) for c in cases))
    results, skipped, verify, models = [], [], [], {}

    def save():
        if args.out:
            write_json(args.out, env, args, results, skipped, verify, models)

    for gi, key in enumerate(groups):
        group_cases = [c for c in cases if (c.model, c.weights) == key]
        elapsed = time.perf_counter() - start
        if elapsed >= args.max_seconds:
            skipped += [{**dataclasses.asdict(c), "why": "time budget"} for c in group_cases]
            continue
        cfg = model_config(group_cases[0], args.seed)
        weights_left = sum(_group_weight(model_config(Case(m, w, 1, 1), args.seed)) for m, w in groups[gi:])
        share_end = time.perf_counter() + (args.max_seconds - elapsed) * _group_weight(cfg) / weights_left
        if args.max_seconds - elapsed < OPEN_S_PER_GB * cfg.file_bytes() / 1e9:
            skipped += [{**dataclasses.asdict(c), "why": "time budget (making and lowering the model)"}
                        for c in group_cases]
            continue
        fits = []
        for c in group_cases:
            why = memory_skip(c, cfg, capacity_for(c.ctx, args), limit)
            if why:
                skipped.append({**dataclasses.asdict(c), "why": why})
            else:
                fits.append(c)
        if not fits:
            continue
        print(f"== {key[0]} {key[1]}: {cfg.name}, {cfg.param_count() / 1e9:.2f} B params, "
              f"{cfg.file_bytes() / 1e9:.2f} GB", flush=True)
        try:
            g = open_group(fits[0], args, impls)
        except Exception as e:
            skipped += [{**dataclasses.asdict(c), "why": f"model: {_err(e)}"} for c in fits]
            print(f"   cannot make / lower the model: {_err(e)}", flush=True)
            save()
            continue
        g.info["first_case"] = fits[0].label()
        models[f"{key[0]}/{key[1]}"] = g.info
        print(f"   made in {g.info['build_s']:.1f} s, lowered in {g.info['load_s']:.1f} s; "
              f"peers: {g.peer_skip or 'all'}", flush=True)
        verified = set()  # the batch sizes whose tokens were checked in this group
        last_case_s = 0.0  # a case is not started when the previous one's time would overrun
        for i, case in enumerate(fits):
            now = time.perf_counter()
            if i and (now + last_case_s > share_end or now + last_case_s - start > args.max_seconds):
                skipped.append({**dataclasses.asdict(case), "why": "time budget"})
                continue
            do_verify = args.verify and case.batch not in verified
            t0 = time.perf_counter()
            recs, ver = run_case(g, case, args, env, impls, do_verify)
            if ver is not None:
                verified.add(case.batch)
                verify.append(ver)
                print(f"   verify: leading tokens equal to ours {ver['agree_with_ours']} of {1 + args.steps}",
                      flush=True)
            last_case_s = time.perf_counter() - t0
            for r in recs:
                r["case_s"] = last_case_s
                results.append(r)
                line = "  ".join(
                    f"{impl}={m['ms']:.3f}ms/{m.get('frac_of_bound', m.get('frac_of_gemm_peak')) or 0:.2f}"
                    if "ms" in m else f"{impl}={m['skip'][:60]}" for impl, m in r["impls"].items())
                print(f"   {case.label():34s} {r['phase']:7s} {line}", flush=True)
            save()
        g.close()
    env["total_s"] = time.perf_counter() - start
    print()
    print(format_table(results))
    print(f"\nms: per decode step / per prefill (TTFT); frac: of the bandwidth bound (decode, "
          f"{args.hbm / 1e12:g} TB/s) or of the measured GEMM peak (prefill); total {env['total_s']:.0f} s")
    if skipped:
        print(f"skipped {len(skipped)} case(s): " + "; ".join(
            f"{s['model']} {s['weights']} B={s['batch']} T={s['ctx']}: {s['why'][:40]}" for s in skipped[:8]))
    save()
    if args.out:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
