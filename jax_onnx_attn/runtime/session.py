"""DecoderSession: fixed-capacity KV cache, jitted prefill and decode, and `generate`.

How a generation runs (all arrays on the device):

* The cache (whatever pytree the lowered model's fixed-cache step keeps) is allocated once, with
  capacity `max_length`, and donated to every jitted call, so XLA updates it in place.
* Prefill: the right-padded prompts [B, S] go through the step in one call (S is rounded up to a
  bucket so few prompt lengths compile); the first new token is chosen from each row's last valid
  position.
* Decode: one compiled executable, called repeatedly. Each call runs up to `steps_per_call` one-token
  steps: a `lax.while_loop` over blocks of `steps_per_check` steps that stops once no row runs, each
  block a fixed-count loop (XLA reads a while loop's predicate back to the host every iteration
  unless it knows the trip count, and the GPU waits for the host meanwhile). Everything that
  changes per token (lengths, the token buffer, the finish flags, the step counter that seeds the
  sampler) lives in a donated device state, so no host scalar enters a step: the executable never
  retraces, and on GPU XLA does not re-record its command buffers. The host only reads a small
  summary after each call (rows still running, tokens generated, each row's device status) for the
  progress bar and to stop; the next call is already queued when it reads it.
* Several devices (`mesh=`): the weights split Megatron-style over the mesh's "model" axis, the
  attention and the KV cache by heads, the batch rows over its "data" axis (`runtime.mesh`). The
  same two executables run as one SPMD program on every device; each device's cache shard is
  donated and updated in place; per layer the attention block and the MLP each end in one
  all-reduce.
* Device status: every step's status (the OR of its cache writes' `jax_onnx_attn.ops.status`
  flags, from the step's `with_status`) is ORed into the decode state on the device and read only
  with that summary. A flagged row's KV write was refused (skipped, never out of bounds), so the
  cache no longer holds that row's tokens: `generate` (and `logits`) raise RuntimeError naming the
  prompts and the flags, at the first summary read after the step. The refused write left the
  buffers as they were; the session (and its cache) stay usable for the next call. A step without
  `with_status` (a hand-written one) reports no status.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_onnx_attn.ops.status import describe
from jax_onnx_attn.runtime.progress import progress_default, ticking
from jax_onnx_attn.runtime.sampling import SamplingConfig, sample

#: Finish codes kept on the device; FINISH_REASONS names them.
RUNNING, STOP, LENGTH, MAX_LENGTH, PADDING = 0, 1, 2, 3, 4
FINISH_REASONS = {STOP: "stop", LENGTH: "length", MAX_LENGTH: "max_length", PADDING: "padding"}

_MIN_BUCKET = 16
_MIN_STOP_SLOTS = 8

#: Decode steps run between two checks for "every row finished" inside one call (the default; see
#: `steps_per_check_for`). A `lax.while_loop` whose trip count XLA cannot prove has the GPU copy its
#: predicate to the host and wait for it every iteration, so the device idles while the host wakes
#: and launches the next step (H200, ~1B, 16 steps a call: up to 1% of the step against one check a
#: step; the JAX peer's fixed-count loop has none). Steps in a block of this many run as a
#: fixed-count loop instead; a generation that ends inside a block runs its rest as no-op steps
#: (finished rows change nothing).
DEFAULT_STEPS_PER_CHECK = 8
#: Overrides DEFAULT_STEPS_PER_CHECK for sessions made without `steps_per_check` (A/B runs).
STEPS_PER_CHECK_ENV = "JOA_DECODE_STEPS_PER_CHECK"
#: XLA command-buffer settings by name, for A/B runs (`$JOA_XLA_COMMAND_BUFFER`, tools/probe_step.py):
#: "default" XLA's own (jax 0.11: FUSION, CUBLAS, CUBLASLT, CUSTOM_CALL, CUDNN,
#: DYNAMIC_SLICE_FUSION), "while" those plus WHILE and CONDITIONAL (loops captured whole, their
#: predicates evaluated on the device), "off" none.
COMMAND_BUFFERS = {
    "default": None,
    "while": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL",
    "off": "",
}
#: Names a COMMAND_BUFFERS entry for sessions made without `compiler_options`.
COMMAND_BUFFER_ENV = "JOA_XLA_COMMAND_BUFFER"


class DecodeState(NamedTuple):
    """Per-row generation state carried on the device through every decode step (donated).

    tokens: int32 [B, C] prompt then generated tokens, right-padded; C = max_length.
    length: int32 [B] valid tokens in `tokens`; the cache holds the first length - 1 of them.
    prompt_len: int32 [B].
    max_new: int32 [B] new tokens allowed per row.
    finish: int32 [B] RUNNING or the reason the row stopped.
    stop_ids: int32 [K] stop tokens, padded with -1.
    key: the sampler's PRNG key (uint32 [2]).
    step: int32 [] steps taken; step t samples with fold_in(key, t).
    status: int32 [B] OR of every step's device status (`jax_onnx_attn.ops.status` flags).
    """

    tokens: jax.Array
    length: jax.Array
    prompt_len: jax.Array
    max_new: jax.Array
    finish: jax.Array
    stop_ids: jax.Array
    key: jax.Array
    step: jax.Array
    status: jax.Array


@dataclass
class Timings:
    """Wall times of one `generate` call (seconds) and the token counts they cover.

    compile_s is kept apart: no other figure includes it. The first run of a freshly compiled
    executable also pays one-time set-up (allocations, loading kernels; ~10 ms on a CPU, more on a
    GPU) that later runs do not: `warm` says whether this call's prefill_s / decode_s are free of
    it. Steady-state figures come from a warm call (e.g. the second `generate` of a session, or
    after `DecoderSession.warmup`).

    Attributes:
      compile_s: compiling executables this call needed (0 when all were compiled before).
      prefill_s: the prompt steps, from the call to the host holding each row's first token.
      decode_s: the one-token steps after it, until the host holds every row's tokens.
      ttft_s: time to first token: prefill_s of the first batch of prompts (compile excluded).
      prompt_tokens, new_tokens, rows: prompt tokens read, tokens generated, prompts.
      decode_steps: one-token decode steps run (per batch of prompts, the longest row's).
      warm: True when every executable this call ran had run before in this session.
    """

    compile_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    prompt_tokens: int = 0
    new_tokens: int = 0
    rows: int = 0
    ttft_s: float = 0.0
    decode_steps: int = 0
    warm: bool = True

    @property
    def total_s(self) -> float:
        """prefill_s + decode_s (compile time excluded)."""
        return self.prefill_s + self.decode_s

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second over prefill + decode."""
        return self.new_tokens / self.total_s if self.total_s > 0 else float("nan")

    @property
    def decode_tokens(self) -> int:
        """Tokens made by decode steps (the first token of each row comes from prefill)."""
        return max(self.new_tokens - self.rows, 0)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second of the decode phase, over all rows (steady state when `warm`)."""
        n = self.decode_tokens
        return n / self.decode_s if self.decode_s > 0 and n > 0 else float("nan")

    @property
    def step_s(self) -> float:
        """Seconds per decode step (one token for every running row)."""
        return self.decode_s / self.decode_steps if self.decode_steps > 0 else float("nan")

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens per second of the prefill phase."""
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else float("nan")

    def to_dict(self) -> dict:
        """The fields and the derived rates as a JSON-ready dict (NaN rates become None)."""
        out = {f: getattr(self, f) for f in ("compile_s", "prefill_s", "decode_s", "ttft_s",
                                             "prompt_tokens", "new_tokens", "rows", "decode_tokens",
                                             "decode_steps", "warm")}
        for f in ("tokens_per_s", "decode_tokens_per_s", "prefill_tokens_per_s", "step_s"):
            v = getattr(self, f)
            out[f] = None if math.isnan(v) else v
        return out

    def __iadd__(self, other: "Timings") -> "Timings":
        if not self.rows:
            self.ttft_s = other.ttft_s
        for f in ("compile_s", "prefill_s", "decode_s", "prompt_tokens", "new_tokens", "rows",
                  "decode_steps"):
            setattr(self, f, getattr(self, f) + getattr(other, f))
        self.warm = self.warm and other.warm
        return self


@dataclass
class GenerationResult:
    """What `DecoderSession.generate` returns, one entry per prompt in order.

    tokens: the new tokens of each row; a stop token that ended the row is included.
    finish_reasons: "stop" (a stop token), "length" (max_new_tokens reached) or "max_length" (the
      session's capacity reached).
    """

    prompts: list[list[int]]
    tokens: list[list[int]]
    finish_reasons: list[str]
    timings: Timings = field(default_factory=Timings)

    @property
    def sequences(self) -> list[list[int]]:
        """Prompt followed by its new tokens, per row."""
        return [p + t for p, t in zip(self.prompts, self.tokens)]


def nbits_layout_for(batch: int, mesh=None) -> str:
    """The MatMulNBits weight layout a session loads: "rows" for decode steps of 2+ rows on one
    device when `cuda_matmul.rows_layout_enabled()`, "record" for steps of one row on one device
    when `cuda_matmul.record_layout_enabled()` (both layouts' partitioning is batch-only), else
    "onnx"."""
    from jax_onnx_attn.ops import cuda_matmul

    if mesh is not None:
        return "onnx"
    if batch >= 2:
        return "rows" if cuda_matmul.rows_layout_enabled() else "onnx"
    return "record" if batch == 1 and cuda_matmul.record_layout_enabled() else "onnx"


def dense_layout_for(batch: int, mesh=None) -> str:
    """The dense weight layout a session loads: "kn" (ONNX's [K, N]) for 2+ rows on one device, whose
    dense projections run on XLA's GEMM anyway, unless `cuda_matmul.dense_kn_enabled()` says not;
    "nk" (the kernels' layout) for one row (the dense row kernel) and with a mesh (its splits read
    [N, K]). Why: XLA's GEMM reads [K, N] 2-4% faster at decode's 8-32 rows on the H200
    (bench/results/2026-12-03-211e465-xla-weight-layout.json); whole steps, ~8B fp16 B=8 / 32 3.4%
    faster, ~1B unchanged, a ~1B B=8 prompt 2.5-4% slower
    (bench/results/2026-12-03-b00d575-e2e-*-dense-kn.json)."""
    from jax_onnx_attn.ops import cuda_matmul

    return "kn" if batch >= 2 and mesh is None and cuda_matmul.dense_kn_enabled() else "nk"


def qkv_prepare_for(batch: int, mesh=None) -> bool:
    """Whether a session loads GroupQueryAttention's packed QKV projections in the rotary-pair order
    (`onnx.fusion` pass 5: the projection and the step preparation in one launch): decode steps of
    one row on one device, when `cuda_matmul.qkv_prepare_enabled()`."""
    from jax_onnx_attn.ops import cuda_matmul

    return batch == 1 and mesh is None and cuda_matmul.qkv_prepare_enabled()


def gated_mlp_for(batch: int, mesh=None) -> bool:
    """Whether a session loads dense gated MLPs as one node each (`onnx.fusion` pass 4b: one kernel
    a layer for norm, gate / up, SiLU·up, down and the residual): decode steps of one row on one
    device, when `cuda_matmul.gated_mlp_enabled()`."""
    from jax_onnx_attn.ops import cuda_matmul

    return batch == 1 and mesh is None and cuda_matmul.gated_mlp_enabled()


def out_mlp_for(batch: int, mesh=None) -> bool:
    """Whether a session loads each fused MLP with the attention output projection before it as one
    node (`onnx.fusion` pass 4c: one kernel a layer from the attention's output to the next layer's
    input): where it loads the fused MLPs (`gated_mlp_for`), when `cuda_matmul.out_mlp_enabled()`."""
    from jax_onnx_attn.ops import cuda_matmul

    return gated_mlp_for(batch, mesh) and cuda_matmul.out_mlp_enabled()


def load_options(batch: int, mesh=None) -> dict:
    """The `load` keyword arguments of a session of `batch` rows on `mesh` (None: one device): the
    weight layouts and fusions its decode steps take, by the rules above; only those that differ
    from load's defaults (so {} is the plain load). bench e2e loads models by it too."""
    options = {}
    nbits = nbits_layout_for(batch, mesh)
    if nbits != "onnx":
        options["nbits_layout"] = nbits
    if nbits == "rows":
        options["decode_rows"] = batch
    dense = dense_layout_for(batch, mesh)
    if dense != "nk":
        options["dense_layout"] = dense
    for name, rule in (("qkv_prepare", qkv_prepare_for), ("gated_mlp", gated_mlp_for), ("out_mlp", out_mlp_for)):
        if rule(batch, mesh):
            options[name] = True
    return options


def steps_per_check_for(steps_per_call: int, requested: int | None = None) -> int:
    """Decode steps between two "every row finished?" checks of one call: `requested`, else
    $JOA_DECODE_STEPS_PER_CHECK, else the largest divisor of steps_per_call that is at most
    DEFAULT_STEPS_PER_CHECK. ValueError when it does not divide steps_per_call (a call is whole blocks)."""
    what = "steps_per_check"
    if requested is None and os.environ.get(STEPS_PER_CHECK_ENV):
        requested, what = os.environ[STEPS_PER_CHECK_ENV], f"${STEPS_PER_CHECK_ENV}"
    if requested is None:
        return math.gcd(steps_per_call, DEFAULT_STEPS_PER_CHECK)
    try:
        k = int(requested)
    except ValueError:
        raise ValueError(f"{what} must be an integer, got {requested!r}") from None
    if k < 1 or steps_per_call % k:
        raise ValueError(f"{what} must be a divisor of steps_per_call ({steps_per_call}), got {k}")
    return k


def _load(model, dtype, options: dict):
    """A lowered model (`load(model, dtype=dtype, **options)`): anything with `fixed_cache_step` and
    `params` is taken as is (its layout too)."""
    if hasattr(model, "fixed_cache_step") and hasattr(model, "params"):
        if dtype is not None:
            raise ValueError("dtype applies when the session loads the model; this one is already lowered")
        return model
    import jax_onnx_attn

    load = getattr(jax_onnx_attn, "load", None)
    if load is None:
        try:
            from jax_onnx_attn.onnx import load
        except ImportError as e:
            raise RuntimeError(f"the ONNX lowering (jax_onnx_attn.onnx) cannot be imported: {e}") from e
    return load(model, dtype=dtype, **options)


def _takes(fn, name: str) -> bool:
    """Whether callable `fn` accepts a keyword argument `name`."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _bucket(n: int, cap: int) -> int:
    """Prompt lengths round up to a power of two (at least _MIN_BUCKET), at most the capacity."""
    return min(cap, max(_MIN_BUCKET, 1 << (n - 1).bit_length()))


def command_buffer_options(name: str) -> dict:
    """The compiler options of COMMAND_BUFFERS[name] ({} for XLA's own)."""
    if name not in COMMAND_BUFFERS:
        raise ValueError(f"command buffers must be one of {sorted(COMMAND_BUFFERS)}, got {name!r}")
    kinds = COMMAND_BUFFERS[name]
    return {} if kinds is None else {"xla_gpu_enable_command_buffer": kinds}


def default_compiler_options() -> dict:
    """The XLA options DecoderSession compiles with by default: XLA's own, or the
    COMMAND_BUFFERS entry `$JOA_XLA_COMMAND_BUFFER` names.

    XLA's own is the default because adding WHILE and CONDITIONAL made the decode step slower
    both times it was measured: on the H200 with the first session's loop (a 0.73 B decoder, B=1:
    1.17-1.18 ms against 1.02-1.10; bench/results/2026-11-30-fb50f57-probe.json), and on an H100
    with today's blocks of fixed-count steps (~1B B=1 1k, two rounds each: fp16 1.222 against
    1.195 ms, int4 0.733 against 0.708; 2026-12-06-366e59b-e2e-1b-while-h100.json).
    """
    name = os.environ.get(COMMAND_BUFFER_ENV)
    if not name:
        return {}
    try:
        return command_buffer_options(name)
    except ValueError as e:
        raise ValueError(f"${COMMAND_BUFFER_ENV}: {e}") from None


def describe_backend() -> str:
    """Which platform runs and which attention implementation it gets."""
    from jax_onnx_attn._extension import has_cuda

    device = jax.devices()[0]
    if device.platform == "gpu" and has_cuda():
        kernels = "CUDA kernels (FFI)"
    else:
        kernels = "reference (jax.numpy)"
    return f"{device.platform} ({device.device_kind}), attention: {kernels}"


class DecoderSession:
    """A lowered decoder with a fixed-capacity KV cache, ready to generate.

    Args:
      model: a path to an .onnx file, an onnx.ModelProto, or an already lowered model (an object
        with `params` and `fixed_cache_step(batch, capacity)`, e.g. from `jax_onnx_attn.load`).
      max_length: capacity in tokens per row (prompt + generated); the cache holds this many.
      batch: rows per call; `generate` pads fewer prompts and splits more into groups.
      dtype: compute/parameter dtype passed to the loader (None keeps the model's).
      steps_per_call: decode steps per call of the decode executable (the host checks for
        finished rows between calls; a call ends early, at a steps_per_check boundary, when every
        row has finished). 32 by
        default: on the H200 a 0.73 B decoder's step at B=1 took 1.02 ms with 32 steps a call
        against 1.10 ms with 8 (bench/results/2026-11-30-fb50f57-probe.json).
      steps_per_check: decode steps between two checks (on the device) that a row still runs;
        must divide steps_per_call. None: `steps_per_check_for`'s default (8 where it divides
        steps_per_call). Steps between checks run as a fixed-count loop that XLA executes without
        a host round trip each step; a generation that ends inside such a block finishes it with
        no-op steps (at most steps_per_check - 1).
      compiler_options: XLA options for the prefill and decode executables (passed to
        `jax.stages.Lowered.compile`), e.g. {"xla_gpu_enable_command_buffer": ...}; None uses
        `default_compiler_options()` for the platform.
      mesh: None (one device), or a jax Mesh with a "model" axis (tensor parallelism: weights,
        attention heads and the KV cache split over it) and / or a "data" axis (batch rows split
        over it; `batch` must be a multiple of its size): see `runtime.mesh.make_mesh`. The KV
        heads (and the heads of every attention) must be a multiple of the model axis' size.

    Attributes:
      vocab_size: rows of the model's token embedding (None when the model has no recognisable
        one); every token id passed in must lie in [0, vocab_size).
      trace_counts / compile_counts: Counter of how often "prefill" and "decode" were traced and
        compiled (tests use them to show decode compiles once).
      layout: the `runtime.mesh.MeshLayout` of a session made with a mesh (its `plan` says which
        projections split), else None.
      cache_shardings: {past name: NamedSharding} of the cache buffers with a mesh, else None (a
        buffer put into `cache` must have its sharding).
    """

    def __init__(self, model, max_length: int, batch: int = 1, dtype=None, *,
                 steps_per_call: int = 32, steps_per_check: int | None = None,
                 compiler_options: dict | None = None, mesh=None):
        if max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {max_length}")
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        if steps_per_call < 1:
            raise ValueError(f"steps_per_call must be >= 1, got {steps_per_call}")
        # With a mesh the weights load into host memory and go to the devices shard by shard: a
        # model larger than one device never lands whole on one.
        with (jax.default_device(jax.local_devices(backend="cpu")[0]) if mesh is not None
              else contextlib.nullcontext()):
            self.lowered = _load(model, dtype, load_options(batch, mesh))
        self.max_length, self.batch, self.steps_per_call = int(max_length), int(batch), int(steps_per_call)
        self.steps_per_check = steps_per_check_for(self.steps_per_call, steps_per_check)
        self.compiler_options = (default_compiler_options() if compiler_options is None
                                 else dict(compiler_options))
        self.layout = self.cache_shardings = self._whole = None
        if mesh is not None:
            from jax_onnx_attn.runtime.mesh import MeshLayout

            self.layout = MeshLayout(mesh, self.lowered, self.batch)
        self.params = self.lowered.params
        positions = getattr(self.lowered, "max_positions", None)
        if positions is not None and self.max_length > positions:
            raise ValueError(f"max_length {self.max_length} exceeds the {positions} positions the "
                             f"model supports (its rotary cos/sin tables have {positions} rows); "
                             f"make the session with max_length <= {positions}")
        #: Rows of the token embedding: prompts are checked against it (None: not known).
        self.vocab_size = getattr(self.lowered, "vocab_size", None)
        if self.layout is None:
            self.step = self.lowered.fixed_cache_step(self.batch, self.max_length)
            self.cache = self.step.init_cache(self.params)
        else:
            self.step = self.lowered.fixed_cache_step(
                self.batch, self.max_length, regrouped_queries=self.layout.plan.regrouped_queries)
            self.params = self.layout.place_params(self.params)
            self.cache_shardings = self.layout.cache_shardings(self.step.cache_shapes)
            # Allocated in place, each device its shard.
            self.cache = jax.jit(self.step.init_cache, out_shardings=self.cache_shardings)()
        self.trace_counts: Counter = Counter()
        self.compile_counts: Counter = Counter()
        self._executables: dict[tuple, Any] = {}
        self._prefill_jit = jax.jit(self._prefill, static_argnames=("sampling",), donate_argnums=(3,))
        self._decode_jit = jax.jit(self._decode, static_argnames=("sampling", "steps", "check"),
                                   donate_argnums=(1, 2))
        self._score_jit = jax.jit(self._run_step, donate_argnums=(4,), static_argnums=(5,))

    def _token_ids(self, tokens, what: str, in_vocab: bool = True) -> list[int]:
        """`tokens` as Python ints, checked on the host: integers (not floats, not bools) in
        [0, vocab_size) (the embedding's rows: on the device jax's gather would clamp an id beyond
        them, where onnxruntime raises). ValueError / TypeError name the row and position."""
        out = []
        for j, t in enumerate(tokens):
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
                raise TypeError(f"{what}: token {j} is {t!r} ({type(t).__name__}); token ids are "
                                f"integers")
            t = int(t)
            if in_vocab and (t < 0 or (self.vocab_size is not None and t >= self.vocab_size)):
                raise ValueError(f"{what}: token {j} is {t}, outside the model's vocabulary "
                                 f"[0, {self.vocab_size if self.vocab_size is not None else 'V'})")
            out.append(t)
        return out

    # ---------------------------------------------------------------------------------------------
    # Traced functions

    def _finish_update(self, state: DecodeState, token) -> DecodeState:
        """Append `token` [B] to the running rows and set the finish code of rows that end."""
        cap = state.tokens.shape[1]
        running = state.finish == RUNNING
        # Finished rows write nowhere (position cap). A select rather than a scatter: each row
        # writes its own row only, so rows split over devices stay where they are.
        pos = jnp.where(running, state.length, cap)
        tokens = jnp.where(jnp.arange(cap)[None, :] == pos[:, None], token[:, None], state.tokens)
        length = state.length + running.astype(jnp.int32)
        is_stop = jnp.any(token[:, None] == state.stop_ids[None, :], axis=-1)
        finish = state.finish
        finish = jnp.where(running & is_stop, STOP, finish)
        finish = jnp.where((finish == RUNNING) & (length - state.prompt_len >= state.max_new), LENGTH, finish)
        finish = jnp.where((finish == RUNNING) & (length >= cap), MAX_LENGTH, finish)
        return state._replace(tokens=tokens, length=length, finish=finish)

    def _placed_cache(self, cache):
        """The cache pinned to its shardings (with a mesh): a donated shard is then updated in
        place, the output's sharding being the input's."""
        if self.layout is None:
            return cache
        return jax.lax.with_sharding_constraint(cache, self.cache_shardings)

    def state_shardings(self, state: DecodeState) -> DecodeState | None:
        """The shardings of a DecodeState on the session's mesh (per-row fields over the data
        axis, the rest whole), or None without a mesh."""
        if self.layout is None:
            return None
        per_row = ("tokens", "length", "prompt_len", "max_new", "finish", "status")
        return DecodeState(**{f: self.layout.rows(np.ndim(v)) if f in per_row else self.layout.whole()
                              for f, v in state._asdict().items()})

    def _placed_state(self, state: DecodeState) -> DecodeState:
        """The decode state pinned to its shardings (with a mesh)."""
        if self.layout is None:
            return state
        return jax.lax.with_sharding_constraint(state, self.state_shardings(state))

    def _summary(self, state: DecodeState):
        """int32 [2 + B]: rows still running, new tokens so far, then each row's status (what the
        host reads between calls; whole on every device with a mesh, so any process reads it)."""
        summary = jnp.concatenate([jnp.stack([jnp.sum(state.finish == RUNNING, dtype=jnp.int32),
                                              jnp.sum(state.length - state.prompt_len,
                                                      dtype=jnp.int32)]),
                                   state.status])
        if self.layout is None:
            return summary
        return jax.lax.with_sharding_constraint(summary, self.layout.whole())

    def _to_host(self, tree):
        """A pytree of device arrays as NumPy. With a mesh the arrays are first made whole on
        every device (split over processes, no process could read them)."""
        if self.layout is not None:
            if self._whole is None:
                self._whole = jax.jit(lambda x: x, out_shardings=self.layout.whole())
            tree = self._whole(tree)
        return jax.device_get(tree)

    def _host_input(self, x):
        """A host value as the jitted calls take it: with a mesh as NumPy (every process passes
        the same value and jit places it; an array on one local device could not join a mesh
        that spans processes), else a jax array."""
        return np.asarray(x) if self.layout is not None else jnp.asarray(x)

    def _run_step(self, params, ids, cache_len, num_new, cache, empty_cache: bool = False,
                  last_logits: bool = False):
        """(logits, cache, status int32 [B]) of one step; status 0 for a step without with_status.
        empty_cache: every row's cache_len is 0 (prefill): the step may skip the empty cache.
        last_logits: logits [B, 1, V] of each row's last new token (num_new - 1) only."""
        with_status = getattr(self.step, "with_status", None)
        fn = with_status if with_status is not None else self.step
        # A hand-written step need not know these; it then runs its general form.
        kw = {"empty_cache": True} if empty_cache and _takes(fn, "empty_cache") else {}
        if last_logits and _takes(fn, "last_logits"):
            kw["last_logits"] = True
        if with_status is not None:
            logits, cache, status = with_status(params, ids, cache_len, num_new, cache, **kw)
        else:
            logits, cache = self.step(params, ids, cache_len, num_new, cache, **kw)
            status = jnp.zeros((ids.shape[0],), jnp.int32)
        if last_logits and "last_logits" not in kw:
            from jax_onnx_attn.onnx.cache_step import last_new_rows  # the step's own gather
            logits = last_new_rows(logits, num_new)
        return logits, self._placed_cache(cache), status

    def _prefill(self, params, ids, lengths, cache, key, max_new, stop_ids, *, sampling):
        """ids int32 [B, S] right-padded, lengths int32 [B] -> (DecodeState, cache, summary)."""
        self.trace_counts["prefill"] += 1
        b, s = ids.shape
        # Only each row's last prompt token's logits: the LM head runs on B rows, not B x S.
        logits, cache, status = self._run_step(params, ids, jnp.zeros((b,), jnp.int32), lengths, cache,
                                               empty_cache=True, last_logits=True)
        last = logits[:, 0]
        tokens = jnp.zeros((b, self.max_length), jnp.int32).at[:, :s].set(ids)
        state = DecodeState(tokens=tokens, length=lengths, prompt_len=lengths, max_new=max_new,
                            finish=jnp.where(max_new > 0, RUNNING, PADDING).astype(jnp.int32),
                            stop_ids=stop_ids, key=key, step=jnp.zeros((), jnp.int32),
                            status=status)
        state = self._placed_state(
            self._finish_update(state, sample(last, jax.random.fold_in(key, 0), sampling)))
        return state, cache, self._summary(state)

    def _decode(self, params, state: DecodeState, cache, *, sampling, steps, check):
        """Up to `steps` one-token steps for every running row -> (state, cache, summary).

        The steps run in blocks of `check`: a `lax.while_loop` over blocks that stops once no row
        runs (a call made after the last row finished runs nothing), each block a fixed-count
        loop. XLA runs a loop of known trip count without reading anything back; the outer loop's
        predicate goes to the host once a block instead of once a step."""
        self.trace_counts["decode"] += 1
        b = state.length.shape[0]
        ones = jnp.ones((b,), jnp.int32)

        def one_step(_, carry):
            st, c = carry
            # Finished rows recompute their last token at the same position: the cache write is
            # the same, and their state does not change (_finish_update ignores them).
            last = jnp.take_along_axis(st.tokens, (st.length - 1)[:, None], axis=1)
            cache_len = jnp.clip(st.length - 1, 0, self.max_length - 1)
            logits, c, status = self._run_step(params, last, cache_len, ones, c)
            # The step counter (the sampler's seed, Timings.decode_steps) counts the steps where a
            # row ran: a block's no-op steps after the last row finished leave it as it was.
            step = st.step + jnp.any(st.finish == RUNNING).astype(jnp.int32)
            token = sample(logits[:, 0], jax.random.fold_in(st.key, step), sampling)
            st = st._replace(step=step, status=st.status | status)
            return self._placed_state(self._finish_update(st, token)), c

        def cond(carry):
            i, st, _ = carry
            return (i < steps) & jnp.any(st.finish == RUNNING)

        def block(carry):
            i, st, c = carry
            st, c = lax.fori_loop(0, check, one_step, (st, c))
            return i + check, st, c

        _, state, cache = lax.while_loop(cond, block, (jnp.zeros((), jnp.int32), state, cache))
        return state, self._placed_cache(cache), self._summary(state)

    @staticmethod
    def _check_status(status, first_prompt: int, rows: int, where: str) -> None:
        """Raise RuntimeError naming the prompts whose device status has flags (host side)."""
        status = np.asarray(status)[:rows]
        if not status.any():
            return
        bad = ", ".join(str(first_prompt + int(r)) for r in np.flatnonzero(status))
        raise RuntimeError(
            f"{where}: the device refused a KV-cache write for prompt(s) {bad} (batch row r is "
            f"prompt {first_prompt} + r): {'; '.join(describe(status))}. The write was skipped, so "
            "the cache no longer holds those rows' tokens and their output is not valid; the "
            "session's buffers are intact and it can be used again.")

    # ---------------------------------------------------------------------------------------------
    # Host side

    def _executable(self, name: str, jitted, key: tuple, *args, **static):
        """Compile once per (name, key) ahead of time; returns (executable, seconds spent compiling)."""
        cache_key = (name, *key)
        if cache_key in self._executables:
            return self._executables[cache_key], 0.0
        t0 = time.perf_counter()
        exe = jitted.lower(*args, **static).compile(self.compiler_options or None)
        self.compile_counts[name] += 1
        self._executables[cache_key] = exe
        return exe, time.perf_counter() - t0

    def _decode_executable(self, sampling, state: DecodeState):
        """The decode executable for `sampling` and `state`'s stop-token slots (compiled once each);
        returns (executable, seconds spent compiling)."""
        return self._executable("decode", self._decode_jit,
                                (sampling, self.steps_per_call, int(state.stop_ids.shape[0])),
                                self.params, state, self.cache, sampling=sampling,
                                steps=self.steps_per_call, check=self.steps_per_check)

    def compiled_text(self, name: str = "decode") -> list[str]:
        """HLO text of every compiled executable named `name` ("prefill" or "decode") so far."""
        return [exe.as_text() for key, exe in self._executables.items() if key[0] == name]

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 32, *,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 stop_tokens: Sequence[int] = (), progress: bool | None = None) -> GenerationResult:
        """Continue each prompt by up to `max_new_tokens` tokens.

        Args:
          prompts: token ids per row (lengths may differ; rows are right-padded on the device).
          temperature / top_k / top_p: see SamplingConfig; temperature 0 (default) is greedy.
          seed: the sampler's seed; the same seed, prompts and session settings give the same tokens.
          stop_tokens: a row ends after emitting one of these (it is kept in the output).
          progress: progress on stderr (None: when stderr is a terminal and $CI is unset): what
            runs (compile, prefill, decode) with its elapsed time, then a bar of the tokens made.

        The result's `timings` keep compile time apart and say whether the call was `warm` (see
        Timings; `warmup` makes the next call warm).

        Raises TypeError for a token id that is not an integer and ValueError for one outside
        [0, vocab_size), naming the prompt and position (checked on the host before any work).
        """
        prompts = [self._token_ids(p, f"prompt {i}") for i, p in enumerate(prompts)]
        if not prompts:
            raise ValueError("generate needs at least one prompt")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty: a row needs at least one token")
            if len(p) >= self.max_length:
                raise ValueError(f"prompt {i} has {len(p)} tokens, which leaves no room in max_length "
                                 f"{self.max_length}; make the session with a larger max_length")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        sampling = SamplingConfig(temperature, top_k, top_p)
        result = GenerationResult(prompts=prompts, tokens=[], finish_reasons=[])
        if max_new_tokens == 0:
            result.tokens = [[] for _ in prompts]
            result.finish_reasons = ["length"] * len(prompts)
            return result
        stop = sorted(set(self._token_ids(stop_tokens, "stop_tokens", in_vocab=False)))
        slots = max(_MIN_STOP_SLOTS, 1 << max(len(stop) - 1, 0).bit_length())
        stop_ids = np.full((slots,), -1, np.int32)
        stop_ids[:len(stop)] = stop
        if progress is None:
            progress = progress_default()
        from tqdm.auto import tqdm

        with tqdm(total=len(prompts) * max_new_tokens, disable=not progress, unit="tok",
                  desc="generate", leave=False, file=sys.stderr) as bar:
            for g in range(0, len(prompts), self.batch):
                group = prompts[g:g + self.batch]
                tokens, reasons, timings = self._generate_group(
                    group, max_new_tokens, sampling, jax.random.PRNGKey(seed + g), stop_ids, bar,
                    first=g)
                result.tokens += tokens
                result.finish_reasons += reasons
                result.timings += timings
        return result

    def _generate_group(self, group, max_new_tokens, sampling, key, stop_ids, bar, first=0):
        """One batch of prompts (prompts first .. first + len(group) - 1 of the call)."""
        b, cap = self.batch, self.max_length
        s = _bucket(max(len(p) for p in group), cap)
        ids = np.zeros((b, s), np.int32)
        lengths = np.ones((b,), np.int32)  # padding rows: one token 0, never run (max_new 0)
        max_new = np.zeros((b,), np.int32)
        for r, p in enumerate(group):
            ids[r, :len(p)] = p
            lengths[r] = len(p)
            max_new[r] = max_new_tokens
        timings = Timings(prompt_tokens=sum(map(len, group)), rows=len(group))
        args = (self.params, self._host_input(ids), self._host_input(lengths), self.cache,
                self._host_input(key), self._host_input(max_new), self._host_input(stop_ids))
        with ticking(bar, f"compile prefill (prompts <= {s} tokens)"):
            prefill, dt = self._executable("prefill", self._prefill_jit,
                                           (s, sampling, len(stop_ids)), *args, sampling=sampling)
        timings.compile_s += dt
        timings.warm = not self._first_run(prefill)

        with ticking(bar, f"prefill ({timings.prompt_tokens} prompt tokens)"):
            t0 = time.perf_counter()
            state, self.cache, summary = prefill(*args)
            running, generated, _ = self._read_summary(summary, first, len(group))
            timings.prefill_s = timings.ttft_s = time.perf_counter() - t0
        bar.update(generated)
        reported = generated

        with ticking(bar, f"compile decode ({self.steps_per_call} steps a call)"):
            decode, dt = self._decode_executable(sampling, state)
        timings.compile_s += dt
        if running and self._first_run(decode):
            timings.warm = False
        bar.set_description_str("decode", refresh=False)
        t0 = time.perf_counter()
        pending = None  # summary of the last call made, not read yet
        calls_left = math.ceil(max_new_tokens / self.steps_per_call) + 2  # a bound, never reached
        while running:
            if not calls_left:
                raise RuntimeError("decode did not finish within its bound of calls (a bug)")
            # Queue the next call before reading the previous call's summary, so the device never
            # waits for the host; the one call made after the last row finished exits at once.
            state, self.cache, summary = decode(self.params, state, self.cache)
            calls_left -= 1
            if pending is not None:
                running, generated, _ = self._read_summary(pending, first, len(group))
                bar.update(generated - reported)
                reported = generated
            pending = summary
        host = self._to_host(state)
        timings.decode_s = time.perf_counter() - t0
        self._check_status(host.status, first, len(group), "generate")

        tokens, reasons = [], []
        for r, p in enumerate(group):
            n = int(host.length[r])
            tokens.append(host.tokens[r, len(p):n].tolist())
            reasons.append(FINISH_REASONS[int(host.finish[r])])
        timings.new_tokens = sum(map(len, tokens))
        timings.decode_steps = int(host.step)
        return tokens, reasons, timings

    def _first_run(self, executable) -> bool:
        """Whether `executable` is about to run for the first time in this session (the run
        that pays its one-time set-up); records that it runs."""
        ran = self.__dict__.setdefault("_ran_executables", set())
        first = id(executable) not in ran
        ran.add(id(executable))
        return first

    def warmup(self, prompts: Sequence[Sequence[int]], *, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, stop_tokens: Sequence[int] = (),
               progress: bool | None = None) -> Timings:
        """Compile and run once what `generate(prompts, ...)` with these settings will run, so
        that its timings are steady state (`Timings.warm`); returns the warm-up's timings.

        Generates two tokens per prompt (one prefill, one decode step) with stop tokens that never
        match, so the decode step runs even where a real stop token would come first. The cache's
        contents are overwritten by the next prompt's prefill; results of later calls do not change.
        """
        never = [-(i + 1) for i in range(len({int(t) for t in stop_tokens}))]
        return self.generate(prompts, 2, temperature=temperature, top_k=top_k, top_p=top_p,
                             stop_tokens=never, progress=progress).timings

    def _read_summary(self, summary, first: int, rows: int) -> tuple[int, int, np.ndarray]:
        """(rows running, tokens generated, status [B]) from a summary; raises on a flagged row."""
        host = np.asarray(summary)
        self._check_status(host[2:], first, rows, "generate")
        return int(host[0]), int(host[1]), host[2:]

    def run_decode(self, state: DecodeState, calls: int = 1, *,
                   sampling: SamplingConfig | None = None) -> DecodeState:
        """Advance `state` by `calls` calls of the compiled decode executable (steps_per_call steps
        each while rows run) on the session's cache, reading nothing back: no summary, no status
        check, the result not synchronised. For benchmarks and callers that build the DecodeState
        themselves (row b's cache must hold its first length[b] - 1 tokens); it shares the
        executable `generate` uses for the same sampling (default: greedy)."""
        sampling = sampling or SamplingConfig()
        if self.layout is not None:
            state = jax.device_put(state, self.state_shardings(state))
        decode, _ = self._decode_executable(sampling, state)
        for _ in range(calls):
            state, self.cache, _ = decode(self.params, state, self.cache)
        return state

    def logits(self, sequence: Sequence[int], prompt_len: int) -> np.ndarray:
        """float32 [len(sequence), V]: row t is the distribution after token t, computed the way
        generation computes it: rows < prompt_len by one prefill of the prompt, each later row by a
        one-token decode step through the cache. Runs batch row 0 (for parity checks; slow path)."""
        sequence = self._token_ids(sequence, "sequence")
        if not 1 <= prompt_len <= len(sequence) <= self.max_length:
            raise ValueError(f"need 1 <= prompt_len ({prompt_len}) <= len(sequence) ({len(sequence)}) "
                             f"<= max_length ({self.max_length})")
        b = self.batch
        s = _bucket(prompt_len, self.max_length)
        ids = np.zeros((b, s), np.int32)
        ids[0, :prompt_len] = sequence[:prompt_len]
        num_new = np.ones((b,), np.int32)
        num_new[0] = prompt_len
        logits, self.cache, status = self._score_jit(
            self.params, self._host_input(ids), self._host_input(np.zeros((b,), np.int32)),
            self._host_input(num_new), self.cache, True)
        logits, status = self._to_host((logits, status))
        self._check_status(status, 0, 1, "logits")
        rows = [np.asarray(logits[0, :prompt_len], np.float32)]
        for t in range(prompt_len, len(sequence)):
            ids = np.zeros((b, 1), np.int32)
            ids[0, 0] = sequence[t]
            cache_len = np.zeros((b,), np.int32)
            cache_len[0] = t
            logits, self.cache, status = self._score_jit(
                self.params, self._host_input(ids), self._host_input(cache_len),
                self._host_input(np.ones((b,), np.int32)), self.cache)
            logits, status = self._to_host((logits, status))
            self._check_status(status, 0, 1, "logits")
            rows.append(np.asarray(logits[0], np.float32))
        return np.concatenate(rows, axis=0)


__all__ = ["DecoderSession", "DecodeState", "GenerationResult", "Timings", "describe_backend",
           "FINISH_REASONS"]
