"""What `generate` reports: compile time apart, time to first token, decode steps, and whether the
call was warm (its executables had run before), so that steady-state rates can be told from first
runs. No assertion on how long anything took: only on what is counted where."""

from __future__ import annotations

import json
import math

import pytest

from jax_onnx_attn.models import tiny
from jax_onnx_attn.runtime import DecoderSession, OrtDecoder, Timings

PROMPT = tiny.encode("Hello, JAX!")


@pytest.fixture(scope="module")
def model():
    return tiny.build_tiny_decoder()


def test_first_call_is_cold_then_warm(model):
    session = DecoderSession(model, max_length=64)
    first = session.generate([PROMPT], 8, progress=False).timings
    assert first.warm is False and first.compile_s > 0
    second = session.generate([PROMPT], 8, progress=False).timings
    assert second.warm is True and second.compile_s == 0.0
    for t in (first, second):
        assert (t.rows, t.prompt_tokens, t.new_tokens) == (1, len(PROMPT), 8)
        assert t.decode_tokens == 7 and t.decode_steps == 7
        assert t.ttft_s == t.prefill_s > 0 and t.decode_s > 0
        assert t.step_s == pytest.approx(t.decode_s / 7)
        assert t.decode_tokens_per_s == pytest.approx(7 / t.decode_s)


def test_warmup_makes_the_next_call_warm_and_changes_no_tokens(model):
    want = OrtDecoder(model).greedy(PROMPT, 12)
    session = DecoderSession(model, max_length=64)
    w = session.warmup([PROMPT], stop_tokens=[want[0]])  # a stop token that would end it at once
    assert w.warm is False and w.compile_s > 0
    assert w.new_tokens == 2 and w.decode_steps == 1  # the decode step ran anyway
    result = session.generate([PROMPT], 12, stop_tokens=[want[0]], progress=False)
    assert result.timings.warm is True and result.timings.compile_s == 0.0
    assert result.tokens == [want[:1]] and result.finish_reasons == ["stop"]
    result = session.generate([PROMPT], 12, progress=False)
    assert result.tokens == [want] and result.timings.warm is True


def test_a_new_prompt_bucket_is_cold_again(model):
    """A longer prompt compiles (and first-runs) another prefill: that call is not warm."""
    session = DecoderSession(model, max_length=96)
    session.warmup([PROMPT])
    assert session.generate([PROMPT], 4, progress=False).timings.warm
    long = PROMPT * 3  # 33 tokens: the 64 bucket, not 16
    t = session.generate([long], 4, progress=False).timings
    assert t.warm is False and t.compile_s > 0


def test_groups_add_up(model):
    """Three prompts at batch 2 run as two groups: counts add, ttft is the first group's."""
    session = DecoderSession(model, max_length=64, batch=2)
    prompts = [PROMPT, PROMPT[:5], PROMPT[:3]]
    session.warmup(prompts)
    result = session.generate(prompts, 6, progress=False)
    t = result.timings
    assert t.rows == 3 and t.new_tokens == 18 and t.prompt_tokens == len(PROMPT) + 8
    assert t.decode_steps == 10 and t.warm  # 5 steps per group
    assert 0 < t.ttft_s < t.prefill_s  # the first group's prefill, of the two


def test_timings_to_dict_is_json():
    t = Timings(prefill_s=0.5, decode_s=0.0, prompt_tokens=4, new_tokens=1, rows=1, ttft_s=0.5)
    d = json.loads(json.dumps(t.to_dict(), allow_nan=False))
    assert d["decode_tokens_per_s"] is None and d["step_s"] is None  # NaN rates become None
    assert d["prefill_tokens_per_s"] == 8.0 and d["warm"] is True
    assert math.isnan(t.decode_tokens_per_s)
    t += Timings(prefill_s=1.0, rows=1, ttft_s=1.0, warm=False, decode_steps=3)
    assert t.ttft_s == 0.5 and t.warm is False and t.decode_steps == 3 and t.rows == 2
