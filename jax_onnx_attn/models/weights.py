"""Fast, bounded-memory, seeded random weights for `DecoderConfig` models.

Drawing 8 B normal values one by one takes minutes; here each tensor is assembled from windows of a
small seeded pool instead, so an 8 B fp16 model costs one memcpy-speed pass over its bytes:

  * a pool is 2^20 values drawn once per (distribution, dtype) with numpy's generator in float32
    (N(0, std^2) for embeddings and projections, 1 + 0.1 N(0, 1) for norm weights) and cast to the
    model's dtype;
  * a tensor of n values is ceil(n / W) windows of W = 2^16 consecutive pool values (the last one
    cut short), each starting at an offset drawn from the tensor's own generator
    (seeded by the config's seed and the tensor's name), laid end to end in row-major order.

Projections are N(0, 1 / K) (K: the input width), the LM head N(0, logit_scale^2 / hidden), the
embedding N(0, 1); no tensor is all zeros. Byte-level models with `printable` get zero LM-head
columns for non-printable ids (a quantised byte-sized head is quantised from its masked source).

Quantised projections (weight_bits 4 / 8) are the quantisation (`models.quant`) of a float source
Wᵀ [N, K] made the same way from the same pools but with windows of whole quantisation blocks
(K is a multiple of the block size, so a block never straddles two rows): the quantised pool is
computed once and its packed codes, scales and zero points are laid out with the same window
offsets. `quantized_source` returns that float source so tests can check
`quantize_nbits(source) == the tensor` byte for byte.

Peak memory: the pools plus one tensor (the largest is the embedding or the LM head).
"""

from __future__ import annotations

import zlib
from typing import Iterator

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from jax_onnx_attn.models.config import DecoderConfig
from jax_onnx_attn.models.quant import (Quantized, pack_codes, pack_zero_points, quantize_blocks,
                                        quantize_nbits)

#: Values per pool and per window.
POOL_SIZE = 1 << 20
WINDOW = 1 << 16


def _rng(seed: int, *keys: str) -> np.random.Generator:
    """A generator seeded by `seed` and `keys` (names hashed with crc32: stable across runs)."""
    return np.random.default_rng([int(seed)] + [zlib.crc32(k.encode()) for k in keys])


def printable_ids(vocab: int = 256) -> np.ndarray:
    """bool [vocab]: the byte ids of printable ASCII and newline."""
    ids = np.arange(vocab)
    return ((ids >= 32) & (ids < 127)) | (ids == 10)


def rotary_cache(config) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin caches [max_positions, head_size / 2] (non-interleaved RoPE, base rope_theta),
    computed in float64 and rounded to the config's dtype. (Llama 3's frequency rescaling is left
    out: it changes the table's values, not the work.)"""
    d = config.head_size
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    angles = np.outer(np.arange(config.max_positions, dtype=np.float64), inv_freq)
    return np.cos(angles).astype(config.np_dtype), np.sin(angles).astype(config.np_dtype)


class WeightMaker:
    """Makes every initializer of a `DecoderConfig` model, one tensor at a time (see the module doc)."""

    def __init__(self, config: DecoderConfig):
        self.config = config
        self._pools: dict[tuple, np.ndarray] = {}
        self._qpools: dict[tuple, tuple] = {}

    # -- pools ---------------------------------------------------------------------------------
    def pool(self, kind: str, std: float) -> np.ndarray:
        """The float pool of `kind` ("normal": N(0, std^2); "norm": 1 + 0.1 N(0, 1)) in the dtype."""
        key = (kind, float(std))
        if key not in self._pools:
            rng = _rng(self.config.seed, "pool", kind, repr(float(std)))
            x = rng.standard_normal(POOL_SIZE, dtype=np.float32)
            x = 1.0 + 0.1 * x if kind == "norm" else x * np.float32(std)
            self._pools[key] = x.astype(self.config.np_dtype)
        return self._pools[key]

    def _qpool(self, std: float):
        """The normal pool quantised block by block: (packed codes per block [P, bytes], scales [P],
        zero points [P] or None)."""
        c = self.config
        key = float(std)
        if key not in self._qpools:
            blocks = self.pool("normal", std).reshape(-1, c.block_size)
            codes, scales, zp = quantize_blocks(blocks, c.weight_bits, c.block_size,
                                                symmetric=not c.zero_points)
            # [P, 1 block] rows: quantize_blocks treats each pool block as a row of one block.
            self._qpools[key] = (pack_codes(codes[:, 0], c.weight_bits), scales[:, 0],
                                 None if zp is None else zp[:, 0])
        return self._qpools[key]

    # -- tensors -------------------------------------------------------------------------------
    @staticmethod
    def _offsets(rng: np.random.Generator, n: int, window: int, pool_len: int) -> np.ndarray:
        return rng.integers(0, pool_len - window + 1, size=-(-n // window))

    def fill(self, name: str, shape, kind: str = "normal", std: float = 1.0) -> np.ndarray:
        """A tensor of `shape` in the config's dtype from the pool of (kind, std), windows placed by
        the generator of `name`."""
        n = int(np.prod(shape))
        pool = self.pool(kind, std)
        window = min(WINDOW, n)
        offsets = self._offsets(_rng(self.config.seed, "tensor", name), n, window, len(pool))
        return sliding_window_view(pool, window)[offsets].reshape(-1)[:n].reshape(shape)

    def _block_offsets(self, name: str, n_blocks: int) -> tuple[np.ndarray, int]:
        bs = self.config.block_size
        window = min(WINDOW // bs, n_blocks)
        return self._offsets(_rng(self.config.seed, "tensor", name), n_blocks, window, POOL_SIZE // bs), window

    def quantized_source(self, name: str, k: int, n: int, std: float) -> np.ndarray:
        """The float Wᵀ [N, K] whose quantisation `quantized` returns (for tests; dtype of the model)."""
        bs = self.config.block_size
        offsets, window = self._block_offsets(name, n * k // bs)
        pool = self.pool("normal", std)
        src = sliding_window_view(pool, window * bs)[offsets * bs]
        return src.reshape(-1)[:n * k].reshape(n, k)

    def quantized(self, name: str, k: int, n: int, std: float) -> Quantized:
        """MatMulNBits' inputs for a [K, N] weight (see the module doc)."""
        c = self.config
        bs, bits = c.block_size, c.weight_bits
        kb, per_block = k // bs, bs * bits // 8
        offsets, window = self._block_offsets(name, n * kb)
        codes, scales, zp = self._qpool(std)
        flat = codes.reshape(-1)
        packed = sliding_window_view(flat, window * per_block)[offsets * per_block]
        packed = packed.reshape(-1)[:n * kb * per_block].reshape(n, kb, per_block)
        sc = sliding_window_view(scales, window)[offsets].reshape(-1)[:n * kb].reshape(n, kb)
        if c.dtype == "bfloat16":
            import ml_dtypes
            sc = sc.astype(ml_dtypes.bfloat16)
        zps = None
        if zp is not None:
            zps = sliding_window_view(zp, window)[offsets].reshape(-1)[:n * kb].reshape(n, kb)
            zps = pack_zero_points(zps, bits)
        return Quantized(packed, sc, zps)

    def linear_std(self, name: str, k: int) -> float:
        """Standard deviation of a MatMul weight of input width k (the LM head's sets the logits')."""
        scale = self.config.logit_scale if name.startswith("lm_head") else 1.0
        return scale / float(np.sqrt(k))

    def initializers(self) -> Iterator[tuple[str, np.ndarray]]:
        """(name, array) of every initializer in the builder's order: the embedding, per layer the
        input norm, QKV (then the cos / sin caches after layer 0's), o_proj, the post-attention norm,
        gate, up, down; the final norm; the LM head. Quantised weights give name_Q{bits},
        name_scales (and name_zero_points)."""
        c = self.config
        linear = c.linear_shapes()
        yield "model.embed_tokens.weight", self.fill("model.embed_tokens.weight", (c.vocab, c.hidden))

        def weight(name):
            k, n = linear[name]
            std = self.linear_std(name, k)
            masked = name.startswith("lm_head") and c.printable
            if c.weight_bits:
                if masked:  # a byte-sized head: quantise the masked source directly
                    src = self.quantized_source(name, k, n, std).copy()
                    src[~printable_ids(c.vocab)] = 0
                    q = quantize_nbits(src.T, c.weight_bits, c.block_size, not c.zero_points)
                else:
                    q = self.quantized(name, k, n, std)
                yield f"{name}_Q{c.weight_bits}", q.packed
                yield f"{name}_scales", q.scales
                if q.zero_points is not None:
                    yield f"{name}_zero_points", q.zero_points
            else:
                w = self.fill(name, (k, n), std=std)
                if masked:
                    w = w.copy()
                    w[:, ~printable_ids(c.vocab)] = 0
                yield name, w

        def norm(name):
            return name, self.fill(name, (c.hidden,), kind="norm")

        for i in range(c.layers):
            p = f"model.layers.{i}."
            yield norm(p + "input_layernorm.weight")
            yield from weight(p + "attn.qkv_proj.MatMul.weight")
            if i == 0:
                cos, sin = rotary_cache(c)
                yield "cos_cache", cos
                yield "sin_cache", sin
            yield from weight(p + "attn.o_proj.MatMul.weight")
            yield norm(p + "post_attention_layernorm.weight")
            for proj in ("gate", "up", "down"):
                yield from weight(p + f"mlp.{proj}_proj.MatMul.weight")
        yield norm(f"model.layers.{c.layers}.final_norm_layernorm.weight")
        yield from weight("lm_head.MatMul.weight")


def make_weights(config: DecoderConfig) -> dict[str, np.ndarray]:
    """Every initializer of `config`'s model by name (all in memory: for small models)."""
    return dict(WeightMaker(config).initializers())


__all__ = ["WeightMaker", "make_weights", "rotary_cache", "printable_ids", "POOL_SIZE", "WINDOW"]
