"""Two batch-1 decode sessions of one small fp16 decoder, with a load-time switch off and on, for
the GPU tests of a fusion (`DecoderSession` reads the switch when it loads the model)."""

from __future__ import annotations

from typing import NamedTuple

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
