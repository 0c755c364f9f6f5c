"""Invalid Attention calls fail at trace time with an error that names the input and the rule.

Each case is a valid call with one thing broken; `test_valid_base_calls` checks the unbroken calls
pass, so every failure below is caused by the one change it makes.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jax_onnx_attn import ops

B, HQ, HKV, S, L, D, DV, P = 2, 4, 2, 3, 5, 8, 6, 4


def z(*shape, dtype=np.float32):
    return np.zeros(shape, dtype)


def call4d(**over):
    """A valid 4D call (GQA, Dv != D) with `over` replacing inputs / attributes (None drops one)."""
    kwargs = dict(Q=z(B, HQ, S, D), K=z(B, HKV, L, D), V=z(B, HKV, L, DV))
    kwargs.update(over)
    return ops.attention(**{k: v for k, v in kwargs.items() if v is not None})


def call3d(**over):
    """A valid 3D call with head counts."""
    kwargs = dict(Q=z(B, S, HQ * D), K=z(B, L, HKV * D), V=z(B, L, HKV * DV), q_num_heads=HQ,
                  kv_num_heads=HKV)
    kwargs.update(over)
    return ops.attention(**{k: v for k, v in kwargs.items() if v is not None})


def cached(**over):
    """A valid attention_with_cache call (capacity 8)."""
    kwargs = dict(Q=z(B, HQ, S, D), K=z(B, HKV, S, D), V=z(B, HKV, S, DV),
                  key_cache=z(B, HKV, 8, D), value_cache=z(B, HKV, 8, DV),
                  cache_lengths=np.zeros(B, np.int32))
    kwargs.update(over)
    return ops.attention_with_cache(**{k: v for k, v in kwargs.items() if v is not None})


PAST = dict(past_key=z(B, HKV, P, D), past_value=z(B, HKV, P, DV))
T = P + L

CASES = [
    # KV cache pairing and nonpad rules
    ("past_key alone", lambda: call4d(past_key=z(B, HKV, P, D)), ValueError,
     "past_key is given without past_value"),
    ("past_value alone", lambda: call4d(past_value=z(B, HKV, P, DV)), ValueError,
     "past_value is given without past_key"),
    ("nonpad with past", lambda: call4d(**PAST, nonpad_kv_seqlen=np.full(B, 3)), ValueError,
     "nonpad_kv_seqlen cannot be combined with past_key"),
    ("nonpad at opset 23", lambda: call4d(nonpad_kv_seqlen=np.full(B, 3), opset=23), ValueError,
     "nonpad_kv_seqlen needs opset >= 24"),
    ("nonpad shape", lambda: call4d(nonpad_kv_seqlen=np.full((B, 1), 3)), ValueError,
     r"nonpad_kv_seqlen must have shape \[B\]"),
    ("nonpad dtype", lambda: call4d(nonpad_kv_seqlen=np.full(B, 3.0)), TypeError,
     "nonpad_kv_seqlen must be an integer"),
    ("past heads", lambda: call4d(past_key=z(B, HQ, P, D), past_value=z(B, HQ, P, DV)), ValueError,
     r"past_key shape \[2, 4, 4, 8\] does not match"),
    ("past head size", lambda: call4d(past_key=z(B, HKV, P, D), past_value=z(B, HKV, P, D)),
     ValueError, "past_value shape .* does not match"),
    ("past lengths differ", lambda: call4d(past_key=z(B, HKV, P, D), past_value=z(B, HKV, 1, DV)),
     ValueError, "past_key has 4 rows but past_value has 1"),
    ("past rank", lambda: call4d(past_key=z(B, P, HKV * D), past_value=z(B, P, HKV * DV)),
     ValueError, "past_key must be 4D"),
    # opset-gated attributes
    ("left window at opset 24", lambda: call4d(left_window_size=2, opset=24), ValueError,
     "left_window_size / right_window_size need opset >= 25"),
    ("right window at opset 23", lambda: call4d(right_window_size=0, opset=23), ValueError,
     "need opset >= 25"),
    ("window below -1", lambda: call4d(left_window_size=-2, opset=25), ValueError,
     "left_window_size must be -1 or >= 0"),
    ("opset 22", lambda: call4d(opset=22), ValueError, "Attention exists from opset 23"),
    # heads and shapes
    ("Hq % Hkv (4D)", lambda: call4d(Q=z(B, 3, S, D)), ValueError,
     r"query heads 3 are not a multiple of KV heads 2 \(Hq % Hkv != 0\)"),
    ("Hq % Hkv (3D)", lambda: call3d(Q=z(B, S, 3 * D), q_num_heads=3), ValueError,
     "query heads 3 are not a multiple of KV heads 2"),
    ("Q hidden % heads", lambda: call3d(Q=z(B, S, HQ * D + 1)), ValueError,
     "Q hidden size 33 is not divisible by q_num_heads=4"),
    ("K hidden % heads", lambda: call3d(K=z(B, L, HKV * D + 1)), ValueError,
     "K hidden size 17 is not divisible by kv_num_heads=2"),
    ("V hidden % heads", lambda: call3d(V=z(B, L, HKV * DV + 1)), ValueError,
     "V hidden size 13 is not divisible by kv_num_heads=2"),
    ("3D without q_num_heads", lambda: call3d(q_num_heads=None), ValueError,
     "3D inputs need both q_num_heads and kv_num_heads"),
    ("3D without kv_num_heads", lambda: call3d(kv_num_heads=None), ValueError,
     "3D inputs need both q_num_heads and kv_num_heads"),
    ("4D with heads at opset 25", lambda: call4d(q_num_heads=HQ, kv_num_heads=HKV, opset=25),
     ValueError, "q_num_heads, kv_num_heads must not be given for 4D inputs"),
    ("4D with wrong heads", lambda: call4d(q_num_heads=2), ValueError,
     "q_num_heads=2 disagrees with the 4D input's head count 4"),
    ("rank 2 Q", lambda: call4d(Q=z(B, S)), ValueError, r"Q must be 3D \[B, S, hidden\] or 4D"),
    ("rank mismatch", lambda: call4d(K=z(B, L, HKV * D)), ValueError,
     "Q, K and V must have the same rank"),
    ("head size", lambda: call4d(K=z(B, HKV, L, D + 1)), ValueError,
     "K head size 9 differs from Q head size 8"),
    ("batch", lambda: call4d(V=z(B + 1, HKV, L, DV)), ValueError, "batch sizes differ"),
    ("V heads", lambda: call4d(V=z(B, 1, L, DV)), ValueError, "V has 1 heads but K has 2"),
    ("V length", lambda: call4d(V=z(B, HKV, L + 1, DV)), ValueError,
     "V has sequence length 6 but K has 5"),
    ("no keys", lambda: call4d(K=z(B, HKV, 0, D), V=z(B, HKV, 0, DV)), ValueError,
     r"K has no keys and there is no past \(T = P \+ L = 0\)"),
    ("head size 0", lambda: call4d(Q=z(B, HQ, S, 0), K=z(B, HKV, L, 0)), ValueError,
     "Q head size must be >= 1"),
    ("no KV heads", lambda: call4d(K=z(B, 0, L, D), V=z(B, 0, L, DV)), ValueError,
     "K must have at least one head"),
    # masks
    ("mask rank 5", lambda: call4d(attn_mask=z(1, B, HQ, S, L)), ValueError,
     "attn_mask must have rank 1 to 4"),
    ("mask rank 0", lambda: call4d(attn_mask=np.float32(0)), ValueError,
     "attn_mask must have rank 1 to 4"),
    ("mask batch", lambda: call4d(attn_mask=z(3, 1, S, L)), ValueError,
     "its batch dim is 3, not 1 or 2"),
    ("mask rank 3 is heads", lambda: call4d(attn_mask=z(B, S, L)), ValueError,
     "its heads dim is 2, not 1 or 4"),
    ("mask query", lambda: call4d(attn_mask=z(S + 1, L)), ValueError,
     "its query dim is 4, not 1 or 3"),
    ("mask too long", lambda: call4d(attn_mask=z(S, L + 1)), ValueError,
     "attn_mask last dim 6 is longer than total_sequence_length T 5"),
    ("short mask at opset 23", lambda: call4d(**PAST, attn_mask=z(S, L), opset=23), ValueError,
     "attn_mask last dim 5 is shorter than total_sequence_length T 9; a shorter mask needs opset"),
    ("mask dtype", lambda: call4d(attn_mask=np.zeros((S, L), np.complex64)), TypeError,
     "attn_mask must be bool, integer or float"),
    # attributes
    ("qk mode 4", lambda: call4d(qk_matmul_output_mode=4), ValueError,
     r"qk_matmul_output_mode must be one of \[0, 1, 2, 3\], got 4"),
    ("qk mode -1", lambda: call4d(qk_matmul_output_mode=-1), ValueError,
     "qk_matmul_output_mode must be one of"),
    ("qk mode float", lambda: call4d(qk_matmul_output_mode=1.0), TypeError,
     "qk_matmul_output_mode must be an int"),
    ("softmax_precision enum", lambda: call4d(softmax_precision=6), ValueError,
     r"softmax_precision must be one of \[1, 10, 11, 16\]"),
    ("softmax_precision dtype", lambda: call4d(softmax_precision=np.int32), ValueError,
     "softmax_precision must be float16, bfloat16, float32 or float64"),
    ("softmax_precision junk", lambda: call4d(softmax_precision="fast"), TypeError,
     "softmax_precision must be a TensorProto enum or a float dtype"),
    ("is_causal 2", lambda: call4d(is_causal=2), ValueError, r"is_causal must be one of \[0, 1\]"),
    ("negative softcap", lambda: call4d(softcap=-1.0), ValueError, "softcap must be finite and >= 0"),
    ("nan scale", lambda: call4d(scale=float("nan")), ValueError, "scale must be finite"),
    ("backend", lambda: call4d(backend="tpu"), ValueError, "backend must be one of"),
    # dtypes
    ("K dtype", lambda: call4d(K=z(B, HKV, L, D, dtype=np.float16)), TypeError,
     "K has dtype float16 but Q has float32"),
    ("Q int", lambda: call4d(Q=z(B, HQ, S, D, dtype=np.int32)), TypeError, "Q must be one of"),
    ("past_key dtype", lambda: call4d(past_key=z(B, HKV, P, D, dtype=np.float16),
                                      past_value=z(B, HKV, P, DV)), TypeError,
     "past_key has dtype float16 but must match float32"),
    ("past_value dtype", lambda: call4d(past_key=z(B, HKV, P, D),
                                        past_value=z(B, HKV, P, DV, dtype=np.float16)), TypeError,
     "past_value has dtype float16 but must match float32"),
    # fixed-capacity form
    ("cache too small", lambda: cached(key_cache=z(B, HKV, 2, D), value_cache=z(B, HKV, 2, DV)),
     ValueError, "3 new rows do not fit a cache of capacity 2"),
    ("cache capacities", lambda: cached(value_cache=z(B, HKV, 7, DV)), ValueError,
     "key_cache capacity 8 differs from value_cache capacity 7"),
    ("cache dtype", lambda: cached(key_cache=z(B, HKV, 8, D, dtype=np.float16)), TypeError,
     "key_cache has dtype float16 but must match float32"),
    ("cache heads", lambda: cached(value_cache=z(B, HQ, 8, DV)), ValueError,
     "value_cache shape .* does not match"),
    ("cache lengths shape", lambda: cached(cache_lengths=np.zeros(B + 1, np.int32)), ValueError,
     r"cache_lengths must have shape \[B\] = \[2\]"),
    ("cache lengths dtype", lambda: cached(cache_lengths=np.zeros(B, np.float32)), TypeError,
     "cache_lengths must be an integer tensor"),
    ("cache new rows != S", lambda: cached(K=z(B, HKV, S + 1, D), V=z(B, HKV, S + 1, DV)),
     ValueError, "needs K / V with the query's 3 new rows, got 4"),
    ("cache mask too long", lambda: cached(attn_mask=z(S, 9)), ValueError,
     "attn_mask last dim 9 is longer than cache capacity C 8"),
    ("cache window at opset 24", lambda: cached(left_window_size=1), ValueError,
     "need opset >= 25, got opset=24"),
]


@pytest.mark.parametrize("make,kind,message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_invalid_call_raises(make, kind, message):
    # Every message starts with the op's name, except the backend check shared by all ops.
    prefix = "" if message.startswith("backend") else "^attention: .*"
    with pytest.raises(kind, match=prefix + message):
        make()


@pytest.mark.parametrize("make", [
    lambda: call4d(), lambda: call3d(), lambda: call4d(**PAST, attn_mask=z(S, T)),
    lambda: call4d(nonpad_kv_seqlen=np.full(B, 3), attn_mask=z(S, 2)),  # short mask at opset 24
    lambda: call4d(q_num_heads=HQ, kv_num_heads=HKV, opset=24),  # consistent heads, 4D, opset 24
    lambda: call4d(left_window_size=1, right_window_size=0, opset=25), lambda: cached(),
    lambda: cached(left_window_size=1, opset=25),
    lambda: call4d(softmax_precision=np.float16), lambda: call4d(attn_mask=z(B, HQ, S, L)),
], ids=["4d", "3d", "past", "nonpad-short-mask", "4d-heads", "window", "cached", "cached-window",
        "precision",
        "mask4d"])
def test_valid_base_calls(make):
    """The calls the error cases start from are valid (so each error comes from its one change)."""
    jax.eval_shape(make)


def test_errors_raise_under_jit():
    """Validation runs at trace time, so jit reports the same error before compiling anything."""
    q, k, v = z(B, HQ, S, D), z(B, HKV, L, D), z(B, HKV, L, DV)
    with pytest.raises(ValueError, match="attention: past_key is given without past_value"):
        jax.jit(lambda q, k, v, pk: ops.attention(q, k, v, past_key=pk))(q, k, v, z(B, HKV, P, D))
