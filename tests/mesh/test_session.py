"""DecoderSession(mesh=...) on fake CPU meshes: tensor parallel over 2 devices, and 2 x 2 (data,
model). Builder decoders (packed QKV, GroupQueryAttention, float and MatMulNBits weights) and torch
exports (separate Q / K / V; ai.onnx Attention or a decomposed one) give the unsharded session's
logits and greedy tokens; the decode executable holds per layer exactly the two all-reduces of the
row-parallel projections, gathers or moves nothing of an activation's size (what it does move: the
argmax of logits split by vocabulary, a value and an index per row and device; the summary's
status; with a data axis, a row's mask), and updates each device's cache shard in place."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from jax_onnx_attn.models import build_decoder, preset
from jax_onnx_attn.onnx import load
from jax_onnx_attn.runtime import DecoderSession
from jax_onnx_attn.runtime.mesh import make_mesh
from jax_onnx_attn.testing import assert_close, hlo_collectives, hlo_copies_of

FIXTURES = "tests/fixtures"
PROMPTS = [[5, 17, 42, 9, 3, 101], [7, 7, 64], [1, 2], [250, 3, 3, 8]]
NEW_TOKENS = 6
CAPACITY = 24
MESHES = {"tp2": dict(devices=2), "dp2xtp2": dict(devices=4, data=2)}
#: Rows per call: two per device along the data axis (at one row and one KV head per device, XLA:CPU
#: gives the reference's cache update a second buffer; the CUDA kernel writes in place either way).
BATCH = 4
_LOWERED: dict = {}
_PLAIN: dict = {}


def _lowered(name):
    if name not in _LOWERED:
        # vocab 1024: the LM head splits by vocabulary (the preset's 1000 rows do not).
        _LOWERED[name] = (load(build_decoder(preset("tiny", dtype="float32", vocab=1024)))
                          if name == "tiny" else load(f"{FIXTURES}/{name}"))
    return _LOWERED[name]


def _run(session):
    """(greedy tokens of PROMPTS, logits of the first prompt's prefill and decode steps)."""
    tokens = session.generate(PROMPTS, NEW_TOKENS).tokens
    logits = session.logits(PROMPTS[0] + tokens[0][:3], len(PROMPTS[0]))
    return tokens, logits


def _plain(name):
    if name not in _PLAIN:
        _PLAIN[name] = _run(DecoderSession(_lowered(name), max_length=CAPACITY, batch=BATCH))
    return _PLAIN[name]


MODELS = ["tiny", "builder_qwen2_int4", "builder_phi3_fp32", "torch_llama_op20",
          "torch_qwen2_op23"]


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("name", MODELS)
def test_sharded_session_equals_the_unsharded_one(name, mesh):
    lowered = _lowered(name)
    session = DecoderSession(lowered, max_length=CAPACITY, batch=BATCH,
                             mesh=make_mesh(**MESHES[mesh]))
    tokens, logits = _run(session)
    want_tokens, want_logits = _plain(name)
    assert tokens == want_tokens
    assert_close(logits, want_logits)

    plan = session.layout.plan
    assert plan.counts().get("row", 0) >= 2 and not plan.whole
    hidden = lowered.params[next(n.input[0] for n in lowered.model.graph.node
                                 if n.op_type == "Gather" and n.input[1] == "input_ids")].shape[1]
    hlo = session.compiled_text("decode")[0]
    collectives = hlo_collectives(hlo)
    activations = [c for c in collectives if c[2] and c[2][-1] == hidden]
    assert [c[0] for c in activations] == ["all-reduce"] * plan.counts()["row"], collectives
    # Nothing of an activation's size or more is gathered or moved (Q / K / V, the cache).
    moved = [c for c in collectives if c[0] != "all-reduce" and int(np.prod(c[2])) >= hidden]
    assert moved == [], moved
    for past, buffer in session.cache.items():
        shard = buffer.sharding.shard_shape(buffer.shape)
        assert hlo_copies_of(hlo, shard, buffer.dtype, inside_fusions=False) == [], past
    aliases = hlo.split("input_output_alias={", 1)[1].split("}, entry", 1)[0]
    assert aliases.count("may-alias") >= len(session.cache) + 1  # the cache and the state


def test_the_cache_splits_by_kv_heads_and_rows():
    session = DecoderSession(_lowered("tiny"), max_length=CAPACITY, batch=BATCH,
                             mesh=make_mesh(4, data=2))
    for buffer in session.cache.values():
        assert buffer.sharding.spec == jax.sharding.PartitionSpec("data", "model")
        assert buffer.sharding.shard_shape(buffer.shape)[:2] == (BATCH // 2, buffer.shape[1] // 2)


def test_meshes_the_model_cannot_take_are_refused():
    lowered = _lowered("tiny")  # 2 KV heads
    with pytest.raises(ValueError, match="kv_num_heads=2, not a multiple of 4"):
        DecoderSession(lowered, max_length=CAPACITY, mesh=make_mesh(4))
    with pytest.raises(ValueError, match="batch 1 does not split over the mesh's 'data' axis"):
        DecoderSession(lowered, max_length=CAPACITY, batch=1, mesh=make_mesh(4, data=2))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    with pytest.raises(ValueError, match=r"axes \['x'\] are neither 'model'"):
        DecoderSession(lowered, max_length=CAPACITY, mesh=mesh)
    with pytest.raises(ValueError, match="5 devices asked for, jax sees 4"):
        make_mesh(5)


def test_cli_generate_on_two_devices(capsys):
    from jax_onnx_attn.cli import main

    args = ["generate", f"{FIXTURES}/torch_llama_op23", "--ids", "5,17,42,9", "--max-new-tokens",
            "5", "--no-warmup", "--json", "--no-progress"]
    assert main(args) == 0
    one = json.loads(capsys.readouterr().out)
    assert main(args + ["--devices", "2"]) == 0
    two = json.loads(capsys.readouterr().out)
    assert two["rows"][0]["tokens"] == one["rows"][0]["tokens"]
    assert one["mesh"] is None
    assert two["mesh"]["devices"] == 2 and two["mesh"]["model"] == 2
    assert two["mesh"]["projections_split"] == {"column": 8, "row": 4, "vocab": 1}
    assert main(args + ["--devices", "8"]) == 2
    assert "8 devices asked for, jax sees 4" in json.loads(capsys.readouterr().out)["error"]
