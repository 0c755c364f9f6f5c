"""Single-node com.microsoft::GroupQueryAttention models built with onnx.helper, run on onnxruntime CPU.

The oracle of the GQA parity tests. `run_ort(inputs, **attributes)` takes the operator's inputs by
their ONNX names (NumPy arrays; None or absent = not given) and returns its outputs by name.
`shared_buffer=True` binds past_key/past_value and present_key/present_value to the same OrtValue
through IOBinding, which is how onnxruntime recognises a fixed-capacity (shared) KV cache.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import numpy as np
from onnx import TensorProto, helper

from jax_onnx_attn.ops.reference.gqa import resident_length
from jax_onnx_attn.testing import assert_close

INPUTS = ("query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length",
          "cos_cache", "sin_cache", "position_ids", "attention_bias", "head_sink", "k_scale",
          "v_scale", "q_norm_weight", "k_norm_weight", "query_seqlens")
OUTPUTS = ("output", "present_key", "present_value", "output_qk")

_ELEM = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
         np.dtype(np.int32): TensorProto.INT32, np.dtype(np.int64): TensorProto.INT64,
         np.dtype(np.int8): TensorProto.INT8, np.dtype(np.uint8): TensorProto.UINT8}


def _model_bytes(signature: tuple, attributes: tuple) -> bytes:
    """signature: ((name, dtype str, shape), ...) of the given inputs; attributes: sorted items."""
    given = {name: (np.dtype(dt), shape) for name, dt, shape in signature}
    last = max(INPUTS.index(name) for name in given)
    node_inputs = [name if name in given else "" for name in INPUTS[:last + 1]]
    attrs = dict(attributes)
    t = given["query"][0]
    cache_t = given["past_key"][0] if "past_key" in given else t
    out_types = {"output": t, "present_key": cache_t, "present_value": cache_t, "output_qk": t}
    outputs = list(OUTPUTS if attrs.get("qk_output", 0) else OUTPUTS[:3])
    node = helper.make_node("GroupQueryAttention", node_inputs, outputs, domain="com.microsoft",
                            **attrs)
    graph = helper.make_graph(
        [node], "gqa",
        [helper.make_tensor_value_info(n, _ELEM[dt], list(shape)) for n, (dt, shape) in given.items()],
        [helper.make_tensor_value_info(n, _ELEM[out_types[n]], None) for n in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return model.SerializeToString()


@functools.lru_cache(maxsize=256)
def _session(model: bytes):
    import onnxruntime as ort
    options = ort.SessionOptions()
    # Small single-node models: one intra-op thread keeps CI on 2 shared cores predictable.
    options.intra_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    # Rejections are expected in the error tests; the exception carries the message, not the log.
    options.log_severity_level = 4
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def run_ort(inputs: dict, *, shared_buffer: bool = False, **attributes) -> dict:
    """Run one GroupQueryAttention node on onnxruntime CPU.

    Args:
      inputs: ONNX input name -> NumPy array (None = not given). total_sequence_length may be an int.
      shared_buffer: bind past and present KV to one buffer (fixed-capacity cache) via IOBinding.
      attributes: the node's attributes (num_heads, kv_num_heads, ...).

    Returns:
      output name -> NumPy array. Raises onnxruntime's exception where it rejects the node.
    """
    feeds = {}
    for name, value in inputs.items():
        if value is None:
            continue
        if name not in INPUTS:
            raise KeyError(name)
        if name == "total_sequence_length":
            value = np.asarray(value, np.int32)
        feeds[name] = np.ascontiguousarray(value)
    signature = tuple((n, str(feeds[n].dtype), feeds[n].shape) for n in INPUTS if n in feeds)
    attributes = {k: v for k, v in attributes.items() if v is not None}
    sess = _session(_model_bytes(signature, tuple(sorted(attributes.items()))))
    names = [o.name for o in sess.get_outputs()]
    if not shared_buffer:
        return dict(zip(names, sess.run(None, feeds)))
    import onnxruntime as ort
    binding = sess.io_binding()
    shared = {}
    for name, value in feeds.items():
        if name in ("past_key", "past_value"):
            # The copy is ours: onnxruntime writes the present rows into it.
            shared[name] = ort.OrtValue.ortvalue_from_numpy(value.copy())
            binding.bind_ortvalue_input(name, shared[name])
        else:
            binding.bind_cpu_input(name, value)
    for name in names:
        past = name.replace("present", "past")
        if past in shared:
            binding.bind_ortvalue_output(name, shared[past])
        else:
            binding.bind_output(name)
    sess.run_with_iobinding(binding)
    return dict(zip(names, binding.copy_outputs_to_cpu()))


def ort_error(inputs: dict, **attributes) -> str | None:
    """onnxruntime's error message for these inputs, or None when it runs."""
    try:
        run_ort(inputs, **attributes)
    except Exception as e:  # onnxruntime raises its own exception types (Fail, InvalidArgument, ...)
        return str(e)
    return None


def ort_has_input(name: str) -> bool:
    """Whether the installed onnxruntime's GroupQueryAttention schema has this input."""
    from onnxruntime.capi import onnxruntime_pybind11_state as C
    for schema in C.get_all_operator_schema():
        if schema.name == "GroupQueryAttention" and schema.domain == "com.microsoft":
            return name in [i.name for i in schema.inputs]
    return False


# ---------------------------------------------------------------------------------------------
# Test cases: one Case is one compiled shape/attribute signature; each draw is one configuration
# (new random data and new per-batch lengths) run through both onnxruntime and our op.
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    """A GroupQueryAttention configuration with everything static fixed.

    step: "prompt" (first prompt, S == total, right padding in later draws), "decode" (S=1 with a
      past) or "chunk" (S>1 with a past: chunked prefill; onnxruntime takes B=1 only, so B>1 is
      checked against onnxruntime run row by row).
    past: past_key length P (0: none). cache: "shared" (fixed capacity, IOBinding in onnxruntime),
      "grow" (total = P + S, present P + S) or "static" (non-shared, total <= P).
    """
    dtype: str = "float32"
    batch: int = 1
    seq: int = 1
    past: int = 0
    heads: tuple = (6, 3)
    head_size: int = 32
    step: str = "prompt"
    cache: str = "shared"
    packed: bool = False
    rotary: str = ""            # "", "half" or "interleaved"
    rotary_dim: int = 0         # 0: the whole head
    position_ids: bool = False
    bias: tuple = ()            # (B|1, N|1) broadcast of attention_bias, () none
    head_sink: bool = False
    quant: tuple = ()           # (bits, "PER_TENSOR" | "PER_CHANNEL")
    kv_shared: bool = False     # key/value with 0 rows
    query_seqlens: bool = False
    total_len: int = 0          # total_sequence_length override (sliding-window caches: > P)
    attrs: tuple = ()           # other attributes as sorted (name, value) pairs

    @property
    def total(self) -> int:
        """total_sequence_length, fixed per case so that draws reuse one compiled function."""
        if self.total_len:
            return self.total_len
        if self.step == "prompt":
            return self.seq
        if self.cache == "grow":
            return self.past + (0 if self.kv_shared else self.seq)
        return self.past

    def attributes(self) -> dict:
        n, hkv = self.heads
        a = dict(num_heads=n, kv_num_heads=hkv, **dict(self.attrs))
        if self.rotary:
            a.update(do_rotary=1, rotary_interleaved=int(self.rotary == "interleaved"))
        if self.quant:
            a.update(k_quant_type=self.quant[1], v_quant_type=self.quant[1],
                     kv_cache_bit_width=self.quant[0])
        return a

    def id(self) -> str:
        n, hkv = self.heads
        parts = [{"float32": "f32", "float16": "f16"}.get(self.dtype, self.dtype),
                 f"B{self.batch}S{self.seq}P{self.past}T{self.total}", f"N{n}/{hkv}D{self.head_size}",
                 self.step, self.cache if self.past else ""]
        parts += [f for f in ("packed", "position_ids", "head_sink", "kv_shared", "query_seqlens")
                  if getattr(self, f)]
        if self.rotary:
            parts.append(f"rope-{self.rotary}{self.rotary_dim or ''}")
        if self.bias:
            parts.append(f"bias{self.bias[0]}x{self.bias[1]}")
        if self.quant:
            parts.append(f"int{self.quant[0]}-{self.quant[1].lower()}")
        parts += [f"{k[:12]}={v}" for k, v in self.attrs]
        return "-".join(p for p in parts if p)


def _lengths(case: Case, rng, draw: int) -> tuple[np.ndarray, np.ndarray | None]:
    """(seqlens_k, query_seqlens or None) of one draw: ragged rows, the edges in draw 0."""
    b, s, total = case.batch, case.seq, case.total
    if case.step == "prompt":
        # Draw 0: full rows; later draws: right padding (T_b in [1, S]), which onnxruntime
        # rejects for a sliding-window cache.
        padded = draw > 0 and not dict(case.attrs).get("sliding_window_cache")
        t = rng.integers(1, s + 1, b) if padded else np.full(b, s)
        return (t - 1).astype(np.int32), None
    new = 0 if case.kv_shared else s
    # Every non-prompt case has `total` positions (shared: P = total; grow: P + S; static;
    # a sliding-window cache holds fewer rows than positions).
    lo = s if case.kv_shared else 0   # a KV-shared step needs the S query tokens in the cache
    past = rng.integers(lo, total - new + 1, b)
    if draw == 0:
        past[0] = total - new
        if b > 1:
            past[-1] = lo
    if case.query_seqlens:
        q = np.full(b, s) if draw == 0 else rng.integers(0, s + 1, b)
        q = np.where(past + q == 0, 1, q)  # onnxruntime needs T_b >= 1
        return (past + q - 1).astype(np.int32), q.astype(np.int32)
    return (past + new - 1).astype(np.int32), None


def make_inputs(case: Case, draw: int, seed: int = 0) -> dict:
    """The ONNX inputs of one draw (NumPy), total_sequence_length as an int."""
    rng = np.random.default_rng([seed, draw, zlib.crc32(case.id().encode())])
    dt = np.dtype(case.dtype)
    n, hkv = case.heads
    b, s, d, total = case.batch, case.seq, case.head_size, case.total
    kv_rows = 0 if case.kv_shared else s

    def randn(*shape):
        return rng.standard_normal(shape).astype(dt)

    seqlens_k, query_seqlens = _lengths(case, rng, draw)
    x = dict(seqlens_k=seqlens_k, total_sequence_length=total)
    if case.packed:
        x["query"] = randn(b, s, (n + 2 * hkv) * d)
    else:
        x.update(query=randn(b, s, n * d), key=randn(b, kv_rows, hkv * d),
                 value=randn(b, kv_rows, hkv * d))
    if case.past:
        if case.quant:
            bits, mode = case.quant
            # Scales from the data's range, as onnxruntime's quantised tests do.
            qmax = 127 if bits == 8 else 7
            shape = (1,) if mode == "PER_TENSOR" else (1, hkv, 1, d)
            for name in ("k_scale", "v_scale"):
                amax = rng.uniform(2.0, 4.0, shape).astype(np.float32)
                x[name] = (amax / qmax).astype(np.float32)
            if bits == 8:
                cache = lambda: rng.integers(-128, 128, (b, hkv, case.past, d)).astype(np.int8)
            else:
                cache = lambda: rng.integers(0, 256, (b, hkv, case.past, d // 2)).astype(np.uint8)
            x.update(past_key=cache(), past_value=cache())
        else:
            x.update(past_key=randn(b, hkv, case.past, d), past_value=randn(b, hkv, case.past, d))
    if case.rotary:
        rd = case.rotary_dim or d
        rows = total + 8
        angles = rng.uniform(0, 2 * np.pi, (rows, rd // 2))
        x.update(cos_cache=np.cos(angles).astype(dt), sin_cache=np.sin(angles).astype(dt))
        if case.position_ids:
            t = seqlens_k.astype(np.int64) + 1
            start = (np.zeros(b, np.int64) if case.step == "prompt" else
                     t - (query_seqlens if query_seqlens is not None else s))
            # Shifted positions (still inside the table): onnxruntime reads them as given, except
            # on a first prompt where only position_ids[0, 0] counts.
            offset = rng.integers(0, 8, b)
            x["position_ids"] = (start + offset)[:, None] + np.arange(s)[None, :]
    if case.bias:
        x["attention_bias"] = randn(case.bias[0] if case.bias[0] == 1 else b,
                                    case.bias[1] if case.bias[1] == 1 else n, s, total)
    if case.head_sink:
        x["head_sink"] = randn(n)
    if query_seqlens is not None:
        x["query_seqlens"] = query_seqlens
    return x


# Inputs without a batch dimension (kept whole when a batch is run row by row).
_UNBATCHED = ("cos_cache", "sin_cache", "head_sink", "k_scale", "v_scale", "q_norm_weight",
              "k_norm_weight", "total_sequence_length")


def ort_reference(case: Case, inputs: dict) -> dict:
    """onnxruntime's outputs; B>1 multi-token steps with a past run row by row (onnxruntime
    accepts them only for B=1) and are stacked back."""
    shared = case.past > 0 and case.cache == "shared"
    attrs = case.attributes()
    row_by_row = (case.step == "chunk" and case.batch > 1 and not case.query_seqlens)
    if not row_by_row:
        return run_ort(inputs, shared_buffer=shared, **attrs)
    rows = []
    for i in range(case.batch):
        sliced = {k: (v[i:i + 1] if isinstance(v, np.ndarray) and v.ndim and k not in _UNBATCHED
                      and (k != "attention_bias" or v.shape[0] > 1) else v)
                  for k, v in inputs.items()}
        rows.append(run_ort(sliced, shared_buffer=shared, **attrs))
    return {k: np.concatenate([r[k] for r in rows], axis=0) for k in rows[0]}


@functools.lru_cache(maxsize=None)
def _jitted(attributes: tuple, total: int, shared: bool):
    import jax
    from jax_onnx_attn.ops import group_query_attention

    def step(arrays):
        return group_query_attention(**arrays, total_sequence_length=total, shared_buffer=shared,
                                     **dict(attributes))
    # One jitted function per attribute set: jax.jit reuses its compilation for every draw (and
    # every case) of the same shapes.
    return jax.jit(step)


def run_ours(case: Case, inputs: dict):
    """Our op under jax.jit on the same inputs (total_sequence_length static)."""
    arrays = {k: v for k, v in inputs.items() if k != "total_sequence_length"}
    shared = case.past > 0 and case.cache == "shared"
    fn = _jitted(tuple(sorted(case.attributes().items())), case.total, shared)
    return fn(arrays)


def ort_flash_path(case: Case) -> bool:
    """Whether onnxruntime's CPU kernel takes its f32 flash path (else its general path)."""
    a = dict(case.attrs)
    return (case.dtype == "float32" and a.get("softcap", 0) <= 0 and not case.head_sink
            and a.get("smooth_softmax", -1) != 1 and not a.get("qk_output", 0))


def assert_matches(case: Case, inputs: dict, ours, ref: dict, what: str = "") -> None:
    """Our outputs against onnxruntime's, with the shared tolerances of case.dtype.

    Where onnxruntime gives NaN (a query row with no visible key on its non-flash path), ours
    must give the documented 0. Quantised caches must match bit for bit. Rows onnxruntime leaves
    unspecified (padding rows of query_seqlens chunks, cache rows at or past T_b there) are skipped.
    """
    msg = f"{case.id()} {what}"
    out, exp = np.asarray(ours.output), ref["output"]
    assert out.shape == exp.shape, msg
    keep = np.ones(exp.shape[:2], bool)
    if "query_seqlens" in inputs:
        keep = np.arange(case.seq)[None, :] < inputs["query_seqlens"][:, None]
    elif case.step == "prompt" and dict(case.attrs).get("local_window_size", -1) >= 0 \
            and ort_flash_path(case):
        # Right-padding query rows (s >= T_b) with a window: onnxruntime's f32 flash path counts
        # the window back from the row's own position, its general path (and we) from T_b.
        keep = np.arange(case.seq)[None, :] <= inputs["seqlens_k"][:, None]
    nan = np.isnan(exp)
    assert not np.isnan(out).any(), msg
    np.testing.assert_array_equal(np.where(nan & keep[..., None], out, 0), 0, err_msg=msg)
    assert_close(np.where(keep[..., None] & ~nan, out, 0), np.where(keep[..., None] & ~nan, exp, 0),
                 case.dtype, err_msg=msg + " output")
    for name in ("present_key", "present_value"):
        got, want = np.asarray(getattr(ours, name)), ref[name]
        assert got.shape == want.shape and got.dtype == want.dtype, (msg, name, got.shape, want.shape)
        rows = None
        if "query_seqlens" in inputs:
            rows = np.arange(want.shape[2])[None, :] <= inputs["seqlens_k"][:, None]
        elif dict(case.attrs).get("sliding_window_cache") and case.cache != "shared":
            # Rows [L(T_b), C) of a non-shared windowed present are uninitialised in onnxruntime.
            resident = np.asarray(resident_length(inputs["seqlens_k"] + 1, want.shape[2],
                                                  dict(case.attrs)["local_window_size"]))
            rows = np.arange(want.shape[2])[None, :] < resident[:, None]
        if rows is not None:
            got, want = got * rows[:, None, :, None], want * rows[:, None, :, None]
        if case.quant:
            np.testing.assert_array_equal(got, want, err_msg=f"{msg} {name}")
        else:
            assert_close(got, want, case.dtype, err_msg=f"{msg} {name}")
    if "output_qk" in ref:
        assert_close(np.asarray(ours.output_qk), ref["output_qk"], case.dtype,
                     err_msg=msg + " output_qk")
    else:
        assert ours.output_qk is None, msg
    np.testing.assert_array_equal(np.asarray(ours.status), 0, err_msg=msg + " status")


def check_case(case: Case, draws: int, seed: int = 0) -> None:
    """Run `draws` configurations of a case through both sides."""
    for draw in range(draws):
        inputs = make_inputs(case, draw, seed)
        assert_matches(case, inputs, run_ours(case, inputs), ort_reference(case, inputs),
                       f"draw {draw} seqlens_k={inputs['seqlens_k'].tolist()}")
