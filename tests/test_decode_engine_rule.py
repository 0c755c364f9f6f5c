"""cuda.decode_engine (which engine a decode step runs on) and decode_attention's engine argument:
host-side rules, no GPU needed."""

import numpy as np
import pytest

from jax_onnx_attn.ops import cuda


def test_rule_by_packed_rows(monkeypatch):
    monkeypatch.delenv(cuda.DECODE_ENGINE_ENV, raising=False)
    rows = cuda.FEW_QUERY_MIN_ROWS
    assert cuda.decode_engine(32, 8, rows // 4) == "prefill"
    assert cuda.decode_engine(32, 8, rows // 4 - 1) == "decode"
    assert cuda.decode_engine(32, 8, 1) == "decode"
    assert cuda.decode_engine(8, 8, 64) == "prefill"    # G 1: 64 query rows
    assert cuda.decode_engine(64, 8, 4) == "decode"     # 32 rows


def test_switch_forces_and_checks(monkeypatch):
    monkeypatch.setenv(cuda.DECODE_ENGINE_ENV, "decode")
    assert cuda.decode_engine(64, 8, 64) == "decode"
    monkeypatch.setenv(cuda.DECODE_ENGINE_ENV, "prefill")
    assert cuda.decode_engine(32, 8, 1) == "prefill"
    monkeypatch.setenv(cuda.DECODE_ENGINE_ENV, "fast")
    with pytest.raises(ValueError, match=cuda.DECODE_ENGINE_ENV):
        cuda.decode_engine(32, 8, 1)


def test_engine_argument_errors():
    q = np.zeros((1, 32, 16, 128), np.float16)
    k = np.zeros((1, 8, 256, 128), np.float16)
    lens = np.full((1,), 256, np.int32)
    with pytest.raises(ValueError, match="engine: must be one of"):
        cuda.decode_attention(q, k, k, lens, scale=0.1, engine="flash")
    bias = np.zeros((1, 1, 1, 256), np.float32)
    with pytest.raises(ValueError, match="engine='prefill' does not cover this call: a bias"):
        cuda.decode_attention(q, k, k, lens, bias, scale=0.1, engine="prefill")
