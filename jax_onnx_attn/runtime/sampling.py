"""Next-token selection: greedy, temperature, top-k and top-p (nucleus) sampling, jittable.

The sampling settings are static (a hashable `SamplingConfig` is part of the jit cache key): greedy
compiles to an argmax, top-k to `lax.top_k` over k candidates instead of a sort of the vocabulary.
They change per `generate` call, never per token, so the decode step still compiles once.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen.

    temperature: 0 means greedy (argmax; ties go to the lowest id); > 0 samples from
      softmax(logits / temperature).
    top_k: keep the k most likely tokens (0 = all).
    top_p: then keep the smallest set of most likely tokens whose probability mass reaches top_p
      (1 = all). The most likely token is always kept.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_k", int(self.top_k))
        object.__setattr__(self, "top_p", float(self.top_p))

    @property
    def greedy(self) -> bool:
        """True for temperature 0 (argmax; top_k / top_p do not matter)."""
        return self.temperature == 0.0


def _candidates(logits, config: SamplingConfig):
    """(scaled logits [B, K], token ids [B, K] int32) of the tokens that may be drawn; the ones top-p
    drops are -inf. K is top_k, the vocabulary (sorted) for top-p alone, else the vocabulary as is."""
    x = logits.astype(jnp.float32) / config.temperature
    b, v = x.shape
    if config.top_k == 0 and config.top_p == 1.0:
        return x, jnp.broadcast_to(jnp.arange(v, dtype=jnp.int32), (b, v))
    # lax.top_k returns its values sorted (descending), which top-p needs.
    vals, ids = lax.top_k(x, min(config.top_k or v, v))
    if config.top_p < 1.0:
        p = jax.nn.softmax(vals, axis=-1)
        mass_before = jnp.cumsum(p, axis=-1) - p
        # A token is kept while the mass of the more likely ones is still short of top_p; the first
        # token has mass_before = 0 < top_p, so at least one survives.
        vals = jnp.where(mass_before < config.top_p, vals, -jnp.inf)
    return vals, ids.astype(jnp.int32)


def sampling_probs(logits, config: SamplingConfig):
    """The distribution `sample` draws from, as probabilities float32 [B, V].

    Args:
      logits: [B, V] any float dtype.
    Greedy gives a one-hot row at the argmax.
    """
    logits = jnp.asarray(logits)
    if config.greedy:
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    vals, ids = _candidates(logits, config)
    p = jax.nn.softmax(vals, axis=-1)
    rows = jnp.arange(logits.shape[0])[:, None]
    return jnp.zeros(logits.shape, jnp.float32).at[rows, ids].set(p)


def sample(logits, key, config: SamplingConfig):
    """Next token per row, int32 [B].

    Args:
      logits: [B, V] any float dtype (computed in float32).
      key: a PRNG key (unused when greedy); the same key and logits give the same tokens.
    """
    logits = jnp.asarray(logits)
    if config.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    vals, ids = _candidates(logits, config)
    j = jax.random.categorical(key, vals, axis=-1)
    return jnp.take_along_axis(ids, j[:, None], axis=-1)[:, 0]


__all__ = ["SamplingConfig", "sample", "sampling_probs"]
