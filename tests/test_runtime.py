"""DecoderSession against onnxruntime: greedy parity, padding, recompilation, donation, sampling, stops.

The session runs on the ONNX lowering (`jax_onnx_attn.onnx.load`) of the embedded tiny decoder; a
hand-written jax.numpy implementation of the same decoder behind the same fixed-cache-step contract
(the stand-in) checks the session apart from the lowering, and stands in for it while the lowering
is not in the tree. onnxruntime CPU is the oracle for both.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_onnx_attn.models.tiny import TinyConfig, build_tiny_decoder, encode, tiny_weights
from jax_onnx_attn.ops.kv_cache import kv_append
from jax_onnx_attn.ops.reference import core
from jax_onnx_attn.ops.reference.norm import rms_norm
from jax_onnx_attn.ops.reference.rotary import rotary_embedding
from jax_onnx_attn.runtime import (DecoderSession, OrtDecoder, SamplingConfig, compare_with_onnxruntime,
                                   sample, sampling_probs)
from jax_onnx_attn.testing import assert_close, hlo_copies_of

CONFIG = TinyConfig()
PROMPTS = [encode("Hello, JAX!"), encode("ab"), encode("The quick brown fox jumps")]
MAX_LENGTH = 64


@functools.cache
def real_load():
    """The ONNX lowering's `load`, or None while it (with its fixed-cache step) is not in the tree."""
    try:
        from jax_onnx_attn.onnx import load

        load(build_tiny_decoder(layers=1)).fixed_cache_step(1, 8)
    except (ImportError, AttributeError, NotImplementedError):
        return None
    return load


# --------------------------------------------------------------------------------------------------
# The stand-in: the fixed-cache-step contract of jax_onnx_attn.load, written out for the tiny decoder.

class StandIn:
    """`params` + `fixed_cache_step(batch, capacity)` for the tiny decoder, directly in jax.numpy."""

    def __init__(self, config: TinyConfig = CONFIG):
        self.config = config
        self.params = {k: jnp.asarray(v) for k, v in tiny_weights(config).items()}

    def fixed_cache_step(self, batch: int, capacity: int):
        return _StandInStep(self.config, batch, capacity)


class _StandInStep:
    def __init__(self, config, batch, capacity):
        self.c, self.batch, self.capacity = config, batch, capacity

    def init_cache(self, params):
        shape = (self.batch, self.c.kv_heads, self.capacity, self.c.head_size)
        return [(jnp.zeros(shape, self.c.np_dtype), jnp.zeros(shape, self.c.np_dtype))
                for _ in range(self.c.layers)]

    def __call__(self, params, input_ids, cache_len, num_new, cache):
        c, w = self.c, params
        b, s = input_ids.shape
        pos = cache_len[:, None] + jnp.arange(s)[None]  # [B, S] absolute positions
        keys = jnp.arange(self.capacity)
        # Key j is visible to query s when it is valid (j < cache_len + num_new) and causal.
        visible = (keys[None, None] < (cache_len + num_new)[:, None, None]) & (keys[None, None] <= pos[..., None])
        x = w["model.embed_tokens.weight"][input_ids]
        residual, h = x, rms_norm(x, w["model.layers.0.input_layernorm.weight"], c.rms_eps)
        new_cache = []
        for i, (kc, vc) in enumerate(cache):
            p = f"model.layers.{i}."
            qkv = h @ w[p + "attn.qkv_proj.MatMul.weight"]
            nq, nk = c.heads * c.head_size, c.kv_heads * c.head_size
            q, k, v = qkv[..., :nq], qkv[..., nq:nq + nk], qkv[..., nq + nk:]
            q, k, v = (t.reshape(b, s, -1, c.head_size).transpose(0, 2, 1, 3) for t in (q, k, v))
            q, k = (rotary_embedding(t, w["cos_cache"], w["sin_cache"], pos) for t in (q, k))
            kc, _ = kv_append(kc, k, cache_len, backend="reference")
            vc, _ = kv_append(vc, v, cache_len, backend="reference")
            new_cache.append((kc, vc))
            x = core.logits(q, kc, 1.0 / np.sqrt(c.head_size))
            probs = core.softmax(jnp.where(visible[:, None], x, -jnp.inf))
            attn = core.weighted_values(probs, vc).astype(q.dtype)
            o = attn.transpose(0, 2, 1, 3).reshape(b, s, nq) @ w[p + "attn.o_proj.MatMul.weight"]
            residual = residual + o
            h = rms_norm(residual, w[p + "post_attention_layernorm.weight"], c.rms_eps)
            gate = h @ w[p + "mlp.gate_proj.MatMul.weight"]
            up = h @ w[p + "mlp.up_proj.MatMul.weight"]
            residual = residual + (gate * jax.nn.sigmoid(gate) * up) @ w[p + "mlp.down_proj.MatMul.weight"]
            norm = (f"model.layers.{i + 1}.input_layernorm.weight" if i + 1 < c.layers
                    else f"model.layers.{c.layers}.final_norm_layernorm.weight")
            h = rms_norm(residual, w[norm], c.rms_eps)
        return h @ w["lm_head.MatMul.weight"], new_cache


# --------------------------------------------------------------------------------------------------
# Fixtures

@pytest.fixture(scope="module")
def model():
    return build_tiny_decoder(CONFIG)


@pytest.fixture(scope="module")
def ort(model):
    return OrtDecoder(model)


@pytest.fixture(scope="module")
def ort_greedy(ort):
    """onnxruntime's greedy 32 tokens per prompt, one prompt at a time without padding."""
    return [ort.greedy(p, 32) for p in PROMPTS]


@pytest.fixture(scope="module")
def lowered(model):
    """The ONNX lowering of the tiny decoder; the stand-in while the lowering is not in the tree."""
    load = real_load()
    return StandIn() if load is None else load(model)


@pytest.fixture(scope="module")
def session3(lowered):
    return DecoderSession(lowered, max_length=MAX_LENGTH, batch=3)


# --------------------------------------------------------------------------------------------------
# Parity with onnxruntime

def test_logits_match_onnxruntime(lowered, ort, ort_greedy):
    """Prefill and cached-decode logits along onnxruntime's greedy path, f32 tolerance."""
    session = DecoderSession(lowered, max_length=MAX_LENGTH, batch=1)
    prompt = PROMPTS[0]
    sequence = prompt + ort_greedy[0]
    assert_close(session.logits(sequence, len(prompt)), ort.logits(sequence, len(prompt)), np.float32)


@pytest.mark.parametrize("rows", [1, 3])
def test_greedy_matches_onnxruntime(lowered, session3, ort_greedy, rows):
    """32 greedy tokens, identical to onnxruntime's; batch 3 right-pads prompts of 11, 2, 25 tokens."""
    session = session3 if rows == 3 else DecoderSession(lowered, max_length=MAX_LENGTH, batch=1)
    result = session.generate(PROMPTS[:rows], max_new_tokens=32)
    assert result.tokens == ort_greedy[:rows]
    assert result.finish_reasons == ["length"] * rows
    assert result.timings.new_tokens == 32 * rows
    assert result.timings.tokens_per_s > 0


def test_more_prompts_than_rows_and_padding_rows(lowered, ort_greedy):
    """3 prompts on a batch-2 session run as two groups; the second group has a padding row."""
    session = DecoderSession(lowered, max_length=MAX_LENGTH, batch=2)
    result = session.generate(PROMPTS, max_new_tokens=12)
    assert result.tokens == [t[:12] for t in ort_greedy]
    assert result.sequences[1] == PROMPTS[1] + ort_greedy[1][:12]


@pytest.mark.skipif(real_load() is None, reason="the stand-in already runs every test")
def test_standin_session_matches_onnxruntime(ort_greedy):
    """The session on the hand-written stand-in: tells a session bug from a lowering bug."""
    session = DecoderSession(StandIn(), max_length=MAX_LENGTH, batch=3)
    assert session.generate(PROMPTS, max_new_tokens=32).tokens == ort_greedy


# --------------------------------------------------------------------------------------------------
# Compilation and donation

def test_decode_compiles_once(lowered, ort_greedy):
    """31 decode calls (one step each) trace and compile the decode function once; a second
    generation with other prompt lengths in the same bucket compiles nothing at all."""
    compiles = []
    listener = lambda event, *a, **k: compiles.append(event) if "backend_compile" in event else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        session = DecoderSession(lowered, max_length=MAX_LENGTH, batch=1, steps_per_call=1)
        assert session.generate(PROMPTS[:1], max_new_tokens=32).tokens == ort_greedy[:1]
        assert session.trace_counts["decode"] == 1 and session.compile_counts["decode"] == 1
        assert session.trace_counts["prefill"] == 1
        compiles.clear()
        result = session.generate(PROMPTS[1:2], max_new_tokens=32)
        assert result.tokens == ort_greedy[1:2]
        assert compiles == []
        assert session.trace_counts["decode"] == 1
    finally:
        unregister = getattr(jax.monitoring, "_unregister_event_duration_listener_by_callback", None)
        if unregister:
            unregister(listener)


def test_cache_is_donated(session3):
    """The decode executable aliases the cache to its output and never copies a cache buffer; the
    buffers handed in are consumed (updated in place), not kept alongside new ones."""
    session3.generate(PROMPTS, max_new_tokens=4)
    (hlo,) = session3.compiled_text("decode")
    leaves = jax.tree_util.tree_leaves(session3.cache)
    # Every cache buffer (and the state) is an aliased input/output pair.
    assert hlo.splitlines()[0].count("may-alias") >= len(leaves)
    for leaf in leaves:
        assert hlo_copies_of(hlo, leaf.shape, leaf.dtype) == []
    before = jax.tree_util.tree_leaves(session3.cache)
    session3.generate(PROMPTS, max_new_tokens=4)
    assert all(x.is_deleted() for x in before)


@pytest.mark.parametrize("check", [1, 4, 16])
def test_steps_per_check_changes_no_token(lowered, ort_greedy, check):
    """Blocks of `check` fixed-count steps between "every row finished?" checks give the tokens,
    finish reasons and step counts of checking every step, for greedy rows against onnxruntime
    and for sampled rows ending mid-block (a stop token, ragged max_new_tokens through padding)."""
    session = DecoderSession(lowered, max_length=MAX_LENGTH, batch=3, steps_per_call=16,
                             steps_per_check=check)
    assert session.steps_per_check == check
    greedy = session.generate(PROMPTS, max_new_tokens=21)  # ends mid-block for 4 and 16
    assert greedy.tokens == [t[:21] for t in ort_greedy]
    assert greedy.timings.decode_steps == 20  # steps where a row ran, not the no-op tail
    stop = ort_greedy[0][5]
    kw = dict(max_new_tokens=13, temperature=1.0, top_k=20, seed=3, stop_tokens=[stop])
    every_step = DecoderSession(lowered, max_length=MAX_LENGTH, batch=3, steps_per_call=16,
                                steps_per_check=1).generate(PROMPTS, **kw)
    sampled = session.generate(PROMPTS, **kw)
    assert sampled.tokens == every_step.tokens
    assert sampled.finish_reasons == every_step.finish_reasons
    assert sampled.timings.decode_steps == every_step.timings.decode_steps
    # The block is a loop XLA knows the trip count of (run without a host read each step).
    for hlo in session.compiled_text("decode"):  # greedy's and the sampler's executables
        assert check == 1 or f'"known_trip_count":{{"n":"{check}"}}' in hlo


def test_a_decode_call_after_the_last_row_finished_runs_nothing(lowered):
    """The outer loop checks before its first block: a call on a finished state changes nothing."""
    session = DecoderSession(lowered, max_length=MAX_LENGTH, batch=1, steps_per_call=8)
    assert session.steps_per_check == 8
    session.generate(PROMPTS[:1], max_new_tokens=3)
    b, cap = 1, MAX_LENGTH
    tokens = np.zeros((b, cap), np.int32)
    tokens[0, :4] = PROMPTS[0][:4]
    from jax_onnx_attn.runtime.session import LENGTH, DecodeState
    state = DecodeState(tokens=jnp.asarray(tokens), length=jnp.full((b,), 4, jnp.int32),
                        prompt_len=jnp.full((b,), 2, jnp.int32), max_new=jnp.full((b,), 2, jnp.int32),
                        finish=jnp.full((b,), LENGTH, jnp.int32), stop_ids=jnp.full((8,), -1, jnp.int32),
                        key=jax.random.PRNGKey(0), step=jnp.full((), 5, jnp.int32),
                        status=jnp.zeros((b,), jnp.int32))
    host = jax.device_get(session.run_decode(state, 2))
    assert int(host.step) == 5 and host.tokens.tolist() == tokens.tolist() and host.length.tolist() == [4]


def test_steps_per_check_must_divide_steps_per_call(lowered, monkeypatch):
    from jax_onnx_attn.runtime.session import STEPS_PER_CHECK_ENV, steps_per_check_for

    assert steps_per_check_for(32) == 8 and steps_per_check_for(12) == 4 and steps_per_check_for(7) == 1
    with pytest.raises(ValueError, match=r"steps_per_check must be a divisor of steps_per_call \(32\), got 5"):
        DecoderSession(lowered, max_length=MAX_LENGTH, steps_per_check=5)
    with pytest.raises(ValueError, match="got 0"):
        steps_per_check_for(32, 0)
    monkeypatch.setenv(STEPS_PER_CHECK_ENV, "32")
    assert steps_per_check_for(32) == 32 and steps_per_check_for(32, 4) == 4  # the argument wins
    monkeypatch.setenv(STEPS_PER_CHECK_ENV, "three")
    with pytest.raises(ValueError, match=r"\$JOA_DECODE_STEPS_PER_CHECK must be an integer, got 'three'"):
        steps_per_check_for(32)


def test_command_buffers_by_name(lowered, monkeypatch):
    from jax_onnx_attn.runtime.session import (COMMAND_BUFFER_ENV, command_buffer_options,
                                               default_compiler_options)

    monkeypatch.delenv(COMMAND_BUFFER_ENV, raising=False)
    assert default_compiler_options() == {} and command_buffer_options("default") == {}
    assert command_buffer_options("off") == {"xla_gpu_enable_command_buffer": ""}
    monkeypatch.setenv(COMMAND_BUFFER_ENV, "while")
    kinds = default_compiler_options()["xla_gpu_enable_command_buffer"].split(",")
    assert {"WHILE", "CONDITIONAL", "CUSTOM_CALL"} <= set(kinds)
    assert DecoderSession(lowered, max_length=MAX_LENGTH).compiler_options == default_compiler_options()
    assert DecoderSession(lowered, max_length=MAX_LENGTH, compiler_options={}).compiler_options == {}
    monkeypatch.setenv(COMMAND_BUFFER_ENV, "loops")
    with pytest.raises(ValueError, match=r"\$JOA_XLA_COMMAND_BUFFER: command buffers must be one of "
                                         r"\['default', 'off', 'while'\], got 'loops'"):
        default_compiler_options()


# --------------------------------------------------------------------------------------------------
# Sampling

LOGITS = np.log(np.array([[0.05, 0.3, 0.1, 0.4, 0.15]], np.float32))


@pytest.mark.parametrize("config, expected", [
    (SamplingConfig(temperature=1.0), [0.05, 0.3, 0.1, 0.4, 0.15]),
    (SamplingConfig(temperature=1.0, top_k=2), [0, 0.3 / 0.7, 0, 0.4 / 0.7, 0]),
    # top-p 0.8: 0.4 + 0.3 = 0.7 is short of it, so 0.15 joins; 0.85 is enough.
    (SamplingConfig(temperature=1.0, top_p=0.8), [0, 0.3 / 0.85, 0, 0.4 / 0.85, 0.15 / 0.85]),
    # top-p applies to the top-k renormalised distribution (0.4 / 0.7 = 0.57), as in transformers.
    (SamplingConfig(temperature=1.0, top_k=2, top_p=0.6), [0, 0.3 / 0.7, 0, 0.4 / 0.7, 0]),
    (SamplingConfig(temperature=1.0, top_k=2, top_p=0.5), [0, 0, 0, 1, 0]),
    (SamplingConfig(temperature=1.0, top_p=0.3), [0, 0, 0, 1, 0]),
    (SamplingConfig(temperature=0.5), np.array([0.05, 0.3, 0.1, 0.4, 0.15]) ** 2 / 0.285),
    (SamplingConfig(), [0, 0, 0, 1, 0]),
])
def test_sampling_distribution(config, expected):
    """The filtered distribution is the one defined, and 20000 draws follow it (no token outside)."""
    probs = np.asarray(sampling_probs(jnp.asarray(LOGITS), config))[0]
    np.testing.assert_allclose(probs, expected, atol=1e-6)
    # 20000 rows of the same logits: every row is an independent draw.
    draws = np.asarray(sample(jnp.broadcast_to(LOGITS, (20000, 5)), jax.random.PRNGKey(0), config))
    freq = np.bincount(draws, minlength=5) / draws.size
    assert set(np.flatnonzero(freq)) <= set(np.flatnonzero(probs))
    np.testing.assert_allclose(freq, expected, atol=0.015)


def test_sampling_config_validation():
    for bad in (dict(temperature=-1), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ValueError):
            SamplingConfig(**bad)


def test_sampled_generation_is_reproducible(session3):
    kw = dict(max_new_tokens=16, temperature=1.0, top_k=20, top_p=0.9)
    a = session3.generate(PROMPTS, seed=1, **kw)
    b = session3.generate(PROMPTS, seed=1, **kw)
    c = session3.generate(PROMPTS, seed=2, **kw)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens
    # The tiny model emits printable bytes only, and top-k keeps the 20 most likely.
    assert all(32 <= t < 127 or t == 10 for row in a.tokens for t in row)


# --------------------------------------------------------------------------------------------------
# Stopping

def test_stop_tokens(session3, ort_greedy):
    """A row ends at its first stop token (kept); rows without one run to max_new_tokens."""
    stop = ort_greedy[0][5]
    result = session3.generate(PROMPTS, max_new_tokens=32, stop_tokens=[stop])
    for row, expected in zip(result.tokens, ort_greedy):
        n = expected.index(stop) + 1 if stop in expected else len(expected)
        assert row == expected[:n]
    assert result.finish_reasons[0] == "stop"
    assert result.tokens[0][-1] == stop and len(result.tokens[0]) <= 6


def test_max_length_stops_rows(lowered, ort_greedy):
    session = DecoderSession(lowered, max_length=20, batch=1)
    result = session.generate(PROMPTS[:1], max_new_tokens=32)
    assert result.tokens == [ort_greedy[0][:20 - len(PROMPTS[0])]]
    assert result.finish_reasons == ["max_length"]


def test_invalid_prompts(session3):
    with pytest.raises(ValueError, match="empty"):
        session3.generate([[]])
    with pytest.raises(ValueError, match="max_length"):
        session3.generate([[1] * MAX_LENGTH])
    assert session3.generate(PROMPTS, max_new_tokens=0).tokens == [[], [], []]


def test_progress_bar_and_timings(session3, capsys):
    result = session3.generate(PROMPTS, max_new_tokens=8, progress=True)
    err = capsys.readouterr().err
    assert "generate" in err and "tok" in err  # tqdm's bar on stderr
    t = result.timings
    assert t.prompt_tokens == sum(map(len, PROMPTS)) and t.new_tokens == 24 and t.rows == 3
    assert t.prefill_s > 0 and t.decode_s > 0 and t.decode_tokens_per_s > 0


def test_float16_model_parity():
    """The f16 tiny decoder: the same greedy tokens as onnxruntime's f16 run, logits within the f16
    tolerance relative to their range (see ParityReport)."""
    if real_load() is None:
        pytest.skip("the stand-in is float32 only")
    model16 = build_tiny_decoder(CONFIG, dtype="float16")
    report = compare_with_onnxruntime(model16, PROMPTS[0], max_new_tokens=16)
    assert report.logits_dtype == np.float16
    assert report.ok, "\n".join(report.lines())


# --------------------------------------------------------------------------------------------------
# Device status

class _Overflowing:
    """The lowered tiny decoder whose step moves row `row`'s cache_len past the capacity once that
    row's cache holds `at` tokens: the lowered step's own cache writes refuse the row and flag it
    (KV_WRITE_OUT_OF_RANGE) while the other rows run on."""

    def __init__(self, lowered, row: int, at: int):
        self.lowered, self.row, self.at, self.params = lowered, row, at, lowered.params

    def fixed_cache_step(self, batch, capacity):
        step, row, at = self.lowered.fixed_cache_step(batch, capacity), self.row, self.at

        class Step:
            init_cache = staticmethod(step.init_cache)

            def with_status(self, params, ids, cache_len, num_new, cache):
                bad = (jnp.arange(batch) == row) & (cache_len >= at)
                return step.with_status(params, ids, jnp.where(bad, cache_len + capacity, cache_len),
                                        num_new, cache)

            def __call__(self, *args):
                return tuple(self.with_status(*args))[:2]

        return Step()


def _kv(session, row, positions):
    """float32 [layers * 2, Hkv, len(positions), D]: every cache buffer of `row` at `positions`."""
    return np.stack([np.asarray(buf[row][:, positions]) for buf in jax.tree_util.tree_leaves(session.cache)])


@pytest.mark.skipif(real_load() is None, reason="needs the lowering's step (with_status)")
@pytest.mark.parametrize("at", [0, 20])
def test_refused_cache_write_raises_and_leaves_the_cache_intact(lowered, at):
    """Row 1's write at position `at` (0: its prefill; 20: a decode step) is pushed past the
    capacity. generate raises RuntimeError naming prompt 1 and the flag, read from the summary
    between decode calls (row 0 is stopped well before its 32 tokens); row 1's cache holds the
    clean session's values below `at` and nothing from `at` on (the prefill of the 16-token bucket
    and the decode steps before `at` wrote the rows below)."""
    session = DecoderSession(_Overflowing(lowered, row=1, at=at), max_length=MAX_LENGTH, batch=2,
                             steps_per_call=2)
    with pytest.raises(RuntimeError, match=r"prompt\(s\) 1 .*batch 1: KV write out of range"):
        session.generate(PROMPTS[:2], max_new_tokens=32)
    clean = DecoderSession(lowered, max_length=MAX_LENGTH, batch=2)
    clean.generate(PROMPTS[:2], max_new_tokens=32)
    written = np.arange(max(at, 0))
    assert_close(_kv(session, 1, written), _kv(clean, 1, written), np.float32)
    assert not _kv(session, 1, np.arange(max(at, 16), MAX_LENGTH)).any()
    if at == 0:
        assert not _kv(session, 1, np.arange(MAX_LENGTH)).any()
    # Row 0 (11 prompt tokens) would fill positions up to 42 in 32 steps; the error stopped it at
    # the prefill's summary (at 0: nothing beyond the 16-token bucket), or one decode call (2
    # steps) after the call that raised row 1's flag at step 19 (at 20: position 10 + 22 = 32).
    limit = 16 if at == 0 else 33
    assert _kv(session, 0, np.arange(11)).any(axis=(0, 1, 3)).all()
    assert not _kv(session, 0, np.arange(limit, MAX_LENGTH)).any()


@pytest.mark.skipif(real_load() is None, reason="needs the lowering's step (with_status)")
def test_refused_cache_write_in_logits_raises(lowered):
    session = DecoderSession(_Overflowing(lowered, row=0, at=5), max_length=MAX_LENGTH, batch=1)
    sequence = PROMPTS[0] + [65, 66, 67]
    with pytest.raises(RuntimeError, match=r"logits: .*prompt\(s\) 0 .*KV write out of range"):
        session.logits(sequence, 3)
    # Without the overflow, the same call runs.
    assert DecoderSession(lowered, max_length=MAX_LENGTH, batch=1).logits(sequence, 3).shape[0] == len(sequence)


# --------------------------------------------------------------------------------------------------
# onnxruntime as the oracle of builder models

@pytest.mark.parametrize("name", ["builder_llama_fp32", "builder_llama_int4", "builder_gemma2_fp32"])
def test_ort_decoder_runs_builder_models(name):
    """OrtDecoder opens builder models (past head size declared as the symbol kv_cache_dim, found
    from the GroupQueryAttention nodes) and runs them as the model tests' own onnxruntime loops do:
    a growing past with MatMulNBits at accuracy_level 0, or, for gemma2's window-sized cache,
    onnxruntime-genai's shared buffers (where the growing past fails). Same 32 greedy tokens, same
    logits at every step."""
    import onnx

    import jax_onnx_attn
    import test_onnx_models as models

    path = models.FIXTURES / name / "model.onnx"
    dims = [vi.type.tensor_type.shape.dim for vi in onnx.load(str(path), load_external_data=False).graph.input
            if vi.name.startswith("past_key_values.")]
    assert {d[3].dim_param for d in dims} == {"kv_cache_dim"}
    prompt = [5, 17, 33, 2, 9, 40, 77]
    ort_decoder = OrtDecoder(path)
    sess = models._ort_session(name)
    if models._window_cache_nodes(onnx.load(str(path), load_external_data=False)):
        ref_logits, ref_tokens = models.ort_genai_row(sess, name, prompt, 32)
    else:
        ref_logits, ref_tokens = models.ort_greedy_row(sess, jax_onnx_attn.load(path), prompt, 32)
    tokens = ort_decoder.greedy(prompt, 32)
    assert tokens == ref_tokens
    logits = ort_decoder.logits(prompt + tokens[:-1], len(prompt))
    assert_close(logits, np.concatenate(ref_logits), np.float32)
    if name.endswith("int4"):
        # The file's accuracy_level (4: int8 activations) is another computation.
        level4 = OrtDecoder(path, accuracy_level=None).logits(prompt, len(prompt))
        assert np.abs(level4 - logits[:len(prompt)]).max() > 1e-2 * np.abs(logits).max()
