"""The e2e bench's peers compute the model our lowering computes: the hand-written JAX decoder's (and,
where torch is installed, the torch decoder's) prefill logits equal `jax_onnx_attn.load(model).apply`
on builder-shaped models of every weight format, and a decode step continues them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import jax_onnx_attn
from jax_onnx_attn.bench.e2e_peers import DecoderSpec, JaxPeer, PeerUnsupported, TorchPeer
from jax_onnx_attn.models import build_decoder, build_tiny_decoder, preset
from jax_onnx_attn.testing import assert_close

FIXTURES = Path(__file__).parent / "fixtures"
IDS = np.array([[5, 300, 17, 499, 42, 7, 256, 1], [3, 511, 88, 9, 9, 9, 120, 64]], np.int32)
VARIANTS = {"fp32": dict(), "int4-zp": dict(weight_bits=4, zero_points=True),
            "int8-b128": dict(weight_bits=8, block_size=128), "int4-b128": dict(weight_bits=4, block_size=128)}


def _ours(lowered, config, ids):
    feed = {"input_ids": ids.astype(np.int64), "attention_mask": np.ones(ids.shape, np.int64)}
    for i in range(config.layers):
        for kv in ("key", "value"):
            feed[f"past_key_values.{i}.{kv}"] = np.zeros((ids.shape[0], config.kv_heads, 0, config.head_size),
                                                         config.np_dtype)
    return np.asarray(lowered.apply(lowered.params, feed)["logits"], np.float32)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def model(request):
    config = preset("tiny", dtype="float32", vocab=512, **VARIANTS[request.param])
    proto = build_decoder(config)
    # The peers read the graph as written; "ours" is the default (fused) lowering.
    lowered = jax_onnx_attn.load(proto, fuse=False)
    return config, lowered, _ours(jax_onnx_attn.load(proto), config, IDS)


def test_jax_peer_prefill_and_decode_match_the_lowering(model):
    import jax.numpy as jnp
    config, lowered, want = model
    peer = JaxPeer(lowered, attention="xla")
    assert peer.spec.quantized == bool(config.weight_bits)
    caches = peer.new_caches(2, 16)
    logits, caches = peer.forward(peer.params, jnp.asarray(IDS[:, :6]), jnp.int32(0), caches, prefill=True)
    assert_close(np.asarray(logits, np.float32), want[:, :6], np.float32)
    last, _ = peer.forward(peer.params, jnp.asarray(IDS[:, :6]), jnp.int32(0), peer.new_caches(2, 16),
                           prefill=True, last_only=True)
    assert_close(np.asarray(last, np.float32), want[:, 5:6], np.float32)
    # two decode steps through the cache continue the same sequence
    for pos in (6, 7):
        step, caches = peer.forward(peer.params, jnp.asarray(IDS[:, pos:pos + 1]), jnp.int32(pos), caches,
                                    prefill=False)
        assert_close(np.asarray(step[:, 0], np.float32), want[:, pos], np.float32)


def test_torch_peer_matches_the_lowering(model):
    torch = pytest.importorskip("torch")
    config, lowered, want = model
    if config.weight_bits:
        with pytest.raises(PeerUnsupported, match="MatMulNBits"):
            TorchPeer(lowered, device="cpu")
        return
    peer = TorchPeer(lowered, device="cpu")
    assert peer.shared  # the jax buffers, through DLPack
    caches = peer.new_caches(2, 16)
    with torch.no_grad():
        ids = torch.from_numpy(IDS).long()
        logits = peer.forward(ids[:, :6], torch.zeros(1, dtype=torch.long), caches, prefill=True)
        assert_close(logits.float().numpy(), want[:, :6], np.float32)
        last = peer.forward(ids[:, :6], torch.zeros(1, dtype=torch.long), peer.new_caches(2, 16),
                            prefill=True, last_only=True)
        assert_close(last.float().numpy(), want[:, 5:6], np.float32)
        dec = peer.decoder(2, caches, 2)
        dec.tok.copy_(ids[:, 6])
        dec.pos0.fill_(6)
        dec()
    # the step at position 6 chose the argmax of our logits there
    assert dec.toks[0].tolist() == want[:, 6].argmax(-1).tolist()


def test_spec_refuses_other_graphs():
    lowered = jax_onnx_attn.load(build_tiny_decoder(), fuse=False)
    spec = DecoderSpec.from_lowered(lowered)
    assert (spec.heads, spec.kv_heads, spec.head_size, spec.vocab) == (4, 2, 16, 256)
    torch_export = jax_onnx_attn.load(FIXTURES / "torch_llama_op20" / "model.onnx", fuse=False)
    with pytest.raises(PeerUnsupported, match="GroupQueryAttention"):
        DecoderSpec.from_lowered(torch_export)
    gemma = jax_onnx_attn.load(FIXTURES / "builder_gemma2_fp32" / "model.onnx", fuse=False)
    with pytest.raises(PeerUnsupported):
        DecoderSpec.from_lowered(gemma)
