"""Real producers' decoders lowered to JAX vs onnxruntime CPU (the oracle), logits and greedy tokens.

Fixtures (tests/fixtures/, made by tools/make_fixtures.py from tiny random HF checkpoints):
onnxruntime-genai builder llama fp32/fp16/int4/int8, qwen2 fp32, phi3 (LongRoPE If) fp32, and
torch.onnx.export(dynamo=True) llama at opset 20 and 23, qwen2 at opset 23.

Checks:
  * `apply` on a step with a past (the graph's own I/O) matches onnxruntime on every output;
  * 32 greedy tokens through `fixed_cache_step` (prefill, then decode), batch 1 and a right-padded
    batch of 3, equal onnxruntime's, and every valid logit row is within the dtype's tolerance
    relative to the logit scale. onnxruntime runs each row alone with a growing cache (the truth),
    except for phi3, whose LongRoPE switch depends on the batch's mask width: there onnxruntime runs
    the same right-padded batch.
MatMulNBits models run onnxruntime with accuracy_level=0 (exact dequantised weights); the default
level 4 quantises activations to int8, an onnxruntime speed choice that is not the op's math.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import onnxruntime as ort
import pytest

import jax_onnx_attn
from jax_onnx_attn.onnx.values import np_dtype
from jax_onnx_attn.testing import tolerance

FIXTURES = Path(__file__).parent / "fixtures"
NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / "model.onnx").exists())
N_NEW = 32


def _meta(name):
    return json.loads((FIXTURES / name / "fixture.json").read_text())


def _ort_session(name):
    model = onnx.load(str(FIXTURES / name / "model.onnx"))
    for node in model.graph.node:
        for a in node.attribute:
            if a.name == "accuracy_level":
                a.i = 0
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module", params=NAMES)
def fixture(request):
    name = request.param
    lowered = jax_onnx_attn.load(FIXTURES / name / "model.onnx")
    sess = _ort_session(name)
    return name, lowered, sess




def _scale_tol(dtype, ref):
    return tolerance(dtype)[1] * max(float(np.abs(r).max()) for r in ref)


def test_apply_matches_onnxruntime(fixture):
    """One step with a past of 3 tokens through `apply` (jit) vs onnxruntime, every output."""
    name, lowered, sess = fixture
    rng = np.random.default_rng(0)
    # The builder's GQA accepts S > 1 with a past only for batch 1 in onnxruntime.
    b, s, p = (1, 5, 3) if _meta(name)["producer"] == "builder" else (2, 5, 3)
    dims = {k: v for k, v in lowered.fixed_cache_step(1, 8).cache_shapes.items()}
    feeds = {"input_ids": rng.integers(0, 320, (b, s)).astype(np.int64),
             "attention_mask": np.ones((b, p + s), np.int64)}
    if "position_ids" in lowered.input_names:
        feeds["position_ids"] = np.tile(np.arange(p, p + s), (b, 1)).astype(np.int64)
    for k, ((_, hkv, _, d), dtype) in dims.items():
        feeds[k] = rng.standard_normal((b, hkv, p, d)).astype(dtype)
    ref = sess.run(None, feeds)
    out = jax.jit(lowered.apply)(lowered.params, feeds)
    for n, r in zip([o.name for o in sess.get_outputs()], ref):
        got = np.asarray(out[n]).astype(np.float64)
        atol = _scale_tol(r.dtype, [r])
        np.testing.assert_allclose(got, r.astype(np.float64), rtol=0, atol=atol, err_msg=f"{name}:{n}")


def ort_greedy_row(sess, lowered, prompt, n_new):
    """onnxruntime alone on one row, growing cache: (logits per call [S_t, V], tokens)."""
    shapes = lowered.fixed_cache_step(1, 8).cache_shapes
    past = {k: np.zeros((1, hkv, 0, d), dt) for k, ((_, hkv, _, d), dt) in shapes.items()}
    ids, total, toks, logits = np.asarray(prompt, np.int64)[None], 0, [], []
    out_names = [o.name for o in sess.get_outputs()]
    for _ in range(n_new):
        s = ids.shape[1]
        feeds = {"input_ids": ids, "attention_mask": np.ones((1, total + s), np.int64), **past}
        if "position_ids" in lowered.input_names:
            feeds["position_ids"] = np.arange(total, total + s)[None]
        outs = dict(zip(out_names, sess.run(None, feeds)))
        logits.append(outs["logits"][0])
        toks.append(int(np.argmax(outs["logits"][0, -1])))
        past = {k: outs[k.replace("past_key_values", "present")] for k in past}
        total += s
        ids = np.asarray([[toks[-1]]], np.int64)
    return logits, toks


def ort_greedy_batch(sess, lowered, prompts, n_new):
    """onnxruntime on the right-padded batch (GQA graphs): per row (logits list, tokens)."""
    b, L = len(prompts), max(len(p) for p in prompts)
    shapes = lowered.fixed_cache_step(1, 8).cache_shapes
    past = {k: np.zeros((b, hkv, 0, d), dt) for k, ((_, hkv, _, d), dt) in shapes.items()}
    ids = np.zeros((b, L), np.int64)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = p
    lens = np.array([len(p) for p in prompts])
    out_names = [o.name for o in sess.get_outputs()]
    logits, toks = [[] for _ in prompts], [[] for _ in prompts]
    width = L
    for t in range(n_new):
        # seqlens_k = valid tokens - 1 per row; the mask's width is the batch's length so far.
        mask = (np.arange(width)[None, :] < lens[:, None]).astype(np.int64)
        outs = dict(zip(out_names, sess.run(None, {"input_ids": ids, "attention_mask": mask, **past})))
        lg = outs["logits"]
        last = lens - 1 if t == 0 else np.zeros(b, int)
        for i in range(b):
            logits[i].append(lg[i, :lens[i]] if t == 0 else lg[i])
            toks[i].append(int(np.argmax(lg[i, last[i]])))
        past = {k: outs[k.replace("past_key_values", "present")] for k in past}
        ids = np.asarray([[tk[-1]] for tk in toks], np.int64)
        lens = lens + 1
        width += 1
    return logits, toks


def ours_greedy(lowered, prompts, n_new, capacity):
    """Greedy decoding through fixed_cache_step: (per step logits [B, S, V], tokens per row, number
    of traces)."""
    b, L = len(prompts), max(len(p) for p in prompts)
    step = lowered.fixed_cache_step(b, capacity)
    traces = []

    def counted(*args):
        traces.append(1)  # runs only while tracing
        return step(*args)

    run = jax.jit(counted, donate_argnums=(4,))
    cache = step.init_cache(lowered.params)
    ids = np.zeros((b, L), np.int32)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = p
    cache_len, num_new = np.zeros(b, np.int32), np.array([len(p) for p in prompts], np.int32)
    logits, toks = [], [[] for _ in prompts]
    for _ in range(n_new):
        lg, cache = run(lowered.params, ids, cache_len, num_new, cache)
        lg = np.asarray(lg)
        logits.append(lg)
        nxt = lg[np.arange(b), num_new - 1].argmax(-1)
        for i in range(b):
            toks[i].append(int(nxt[i]))
        cache_len, num_new = cache_len + num_new, np.ones(b, np.int32)
        ids = nxt[:, None].astype(np.int32)
    return logits, toks, len(traces)


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_fixed_cache_matches_onnxruntime(fixture, batch):
    name, lowered, sess = fixture
    rng = np.random.default_rng(batch)
    phi3 = _meta(name)["family"] == "phi3"
    # Phi-3's prompts cross original_max_position_embeddings (64) while decoding: LongRoPE switches.
    lengths = ((50, 30, 41) if phi3 else (7, 3, 5))[:batch]
    prompts = [list(rng.integers(3, 320, n)) for n in lengths]
    capacity = 128 if phi3 else 64
    ours_l, ours_t, n_traces = ours_greedy(lowered, prompts, N_NEW, capacity)
    # One trace for the prefill shape and one for every decode step.
    assert n_traces == 2
    if phi3 and batch > 1:
        ref_rows = list(zip(*ort_greedy_batch(sess, lowered, prompts, N_NEW)))
    else:
        ref_rows = [ort_greedy_row(sess, lowered, p, N_NEW) for p in prompts]
    dtype = lowered.float_type
    for i, (p, (ref_l, ref_t)) in enumerate(zip(prompts, ref_rows)):
        atol = _scale_tol(dtype, ref_l)
        got = [ours_l[0][i, :len(p)]] + [ours_l[t][i, :1] for t in range(1, N_NEW)]
        want = [ref_l[0]] + [ref_l[t][-1:] for t in range(1, N_NEW)]
        err = max(float(np.abs(g.astype(np.float64) - w.astype(np.float64)).max())
                  for g, w in zip(got, want))
        assert err <= atol, f"{name} row {i}: max |logit diff| {err:.3g} > {atol:.3g}"
        assert ours_t[i] == ref_t, f"{name} row {i}: greedy tokens differ"


def test_torch_repeat_kv_is_not_materialised(monkeypatch):
    """The torch opset-23 export expands K/V to 4 query heads before Attention; the lowering must
    hand the op the 2 KV heads (and the compiled step must not broadcast the cache to 4 heads)."""
    name = "torch_llama_op23"
    lowered = jax_onnx_attn.load(FIXTURES / name / "model.onnx")
    seen = []
    real = jax_onnx_attn.ops.attention

    def spy(Q, K, V, *args, **kwargs):
        seen.append((Q.shape[1], K.shape[1], V.shape[1]))
        return real(Q, K, V, *args, **kwargs)

    monkeypatch.setattr(jax_onnx_attn.ops, "attention", spy)
    step = lowered.fixed_cache_step(1, 32)
    cache = step.init_cache(lowered.params)
    hlo = jax.jit(step).lower(lowered.params, np.zeros((1, 1), np.int32), np.zeros(1, np.int32),
                              np.ones(1, np.int32), cache).compile().as_text()
    assert seen and all(s == (4, 2, 2) for s in seen), seen
    assert "f32[1,4,32,16]" not in hlo.replace(" ", ""), "the cache is expanded to the query heads"


def test_bf16_load_runs_and_tracks_f32():
    """load(dtype=bf16) casts weights, cache and compute; greedy logits stay near the f32 model's."""
    path = FIXTURES / "builder_llama_fp32" / "model.onnx"
    f32, bf16 = jax_onnx_attn.load(path), jax_onnx_attn.load(path, dtype=jnp.bfloat16)
    assert all(v.dtype == jnp.bfloat16 for v in bf16.params.values() if jnp.issubdtype(v.dtype, jnp.floating))
    step = bf16.fixed_cache_step(1, 16)
    assert all(dt == np.dtype(jnp.bfloat16) for _, dt in step.cache_shapes.values())
    ids, zero, n = np.array([[5, 17, 33, 2, 9]], np.int32), np.zeros(1, np.int32), np.array([5], np.int32)
    l32, _ = jax.jit(f32.fixed_cache_step(1, 16))(f32.params, ids, zero, n, f32.fixed_cache_step(1, 16).init_cache())
    l16, _ = jax.jit(step)(bf16.params, ids, zero, n, step.init_cache())
    assert l16.dtype == jnp.bfloat16
    l32, l16 = np.asarray(l32), np.asarray(l16).astype(np.float32)
    scale, err = float(np.abs(l32).max()), float(np.abs(l16 - l32).max())
    # bf16 keeps 8 mantissa bits: through 2 layers the logits move by a few percent of their scale.
    assert err <= 0.1 * scale, (err, scale)
    assert np_dtype(onnx.TensorProto.BFLOAT16) == np.dtype(jnp.bfloat16)
