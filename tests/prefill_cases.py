"""Shared inputs and markers of the prefill-engine tests (CPU route tests and GPU tests)."""

import jax
import numpy as np
import pytest


def _other_gpu() -> bool:
    """A GPU that is not sm_90 (without any GPU the gpu marker skips these tests, tests/conftest.py)."""
    try:
        dev = jax.devices("gpu")[0]
    except RuntimeError:
        return False
    return str(getattr(dev, "compute_capability", "")) != "9.0"


needs_sm90 = pytest.mark.skipif(_other_gpu(), reason="the prefill engine runs on sm_90 (H100 / H200) only")


def gqa_prompt(seed, dtype, *, b, s, n, hkv, d, cap, seqlens, packed):
    """GroupQueryAttention inputs of a prompt: packed or separate Q/K/V [B, S, ...], random caches
    [B, Hkv, C, D] (rows past the prompt hold garbage), seqlens_k, rotary caches for C positions."""
    rng = np.random.default_rng(seed)
    x = lambda *shape: rng.standard_normal(shape).astype(dtype)  # noqa: E731
    inp = dict(past_key=x(b, hkv, cap, d), past_value=x(b, hkv, cap, d),
               seqlens_k=np.asarray(seqlens, np.int32))
    if packed:
        inp["query"] = x(b, s, (n + 2 * hkv) * d)
    else:
        inp.update(query=x(b, s, n * d), key=x(b, s, hkv * d), value=x(b, s, hkv * d))
    ang = rng.uniform(0, 2 * np.pi, (cap, d // 2))
    inp.update(cos_cache=np.cos(ang).astype(dtype), sin_cache=np.sin(ang).astype(dtype))
    return inp
