"""Batch-1 decode sessions with a load-time switch off and on (`DecoderSession` reads the switch
when it loads the model): two of a small fp16 decoder for the GPU tests of a fusion
(`sessions_with_switch`), and the CPU check of a switch's rule and fusion (`check_load_switch`)."""

from __future__ import annotations

from typing import NamedTuple

import pytest

LAYERS = 2
PROMPTS = [[1, 2, 3, 4, 5, 6]]


class SessionPair(NamedTuple):
    plain: object      # the session with the switch at "0"
    session: object    # with it at "1"
    want: object       # plain's GenerationResult on PROMPTS
    got: object        # session's

    def logits(self):
        """(session's, plain's) float32 logits of got's sequence, prompt by prefill, then by decode."""
        sequence, n = self.got.sequences[0], len(PROMPTS[0])
        return self.session.logits(sequence, n), self.plain.logits(sequence, n)


def sessions_with_switch(monkeypatch, env: str, max_new_tokens: int = 16) -> SessionPair:
    from jax_onnx_attn.models.builder import build_decoder
    from jax_onnx_attn.models.config import DecoderConfig
    from jax_onnx_attn.runtime import DecoderSession

    model = build_decoder(DecoderConfig(layers=LAYERS, hidden=1024, heads=8, kv_heads=2, intermediate=4096,
                                        vocab=512, dtype="float16"))
    monkeypatch.setenv(env, "0")
    plain = DecoderSession(model, max_length=64, batch=1)
    want = plain.generate(PROMPTS, max_new_tokens=max_new_tokens)
    monkeypatch.setenv(env, "1")
    session = DecoderSession(model, max_length=64, batch=1)
    return SessionPair(plain, session, want, session.generate(PROMPTS, max_new_tokens=max_new_tokens))


def check_load_switch(monkeypatch, env: str, rule, fusion: str, bad_value: str = "yes") -> None:
    """A batch-1 load switch on the CPU: off here unless set ("1": `rule` takes batch 1 only, on one
    device), the session it loads has one `fusion` a layer (`lowered.fusions`), the plain session none,
    both generate the same tokens, and another value is refused naming `env`."""
    from jax_onnx_attn.models import build_tiny_decoder
    from jax_onnx_attn.runtime import DecoderSession

    monkeypatch.delenv(env, raising=False)
    assert not rule(1)  # off by default here (no kernels, or off until measured)
    monkeypatch.setenv(env, "1")
    assert rule(1) and not rule(2) and not rule(1, mesh=object())
    model = build_tiny_decoder(layers=LAYERS, hidden=128, heads=2, kv_heads=1, intermediate=96, dtype="f32")
    session = DecoderSession(model, max_length=24, batch=1)
    assert getattr(session.lowered.fusions, fusion) == LAYERS
    monkeypatch.setenv(env, "0")
    plain = DecoderSession(model, max_length=24, batch=1)
    assert getattr(plain.lowered.fusions, fusion) == 0
    prompts = [[1, 2, 3, 4, 5]]
    assert session.generate(prompts, max_new_tokens=8).tokens == plain.generate(prompts, max_new_tokens=8).tokens
    monkeypatch.setenv(env, bad_value)
    with pytest.raises(ValueError, match=env):
        rule(1)
