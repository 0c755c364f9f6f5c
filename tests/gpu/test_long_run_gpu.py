"""A long run on the GPU: 10,000 decode steps of one session with flat device memory, one decode
executable (no recompiles), and host reads once per decode call, never per step (issue 16).

    pytest -m gpu tests/gpu/test_long_run_gpu.py -s      # prints the measurements
"""

import jax
import numpy as np
import pytest

from jax_onnx_attn.models import build_tiny_decoder, encode
from jax_onnx_attn.runtime import DecoderSession

pytestmark = pytest.mark.gpu

STEPS = 10_000


def _bytes_in_use() -> int:
    stats = jax.devices()[0].memory_stats() or {}
    return int(stats.get("bytes_in_use", 0))


def test_ten_thousand_decode_steps_flat_memory_no_recompile_no_per_step_sync(monkeypatch):
    # head size 64 (the decode engine's), positions for the whole run.
    model = build_tiny_decoder(hidden=256, heads=4, kv_heads=2, intermediate=256, layers=2,
                               dtype="f16", max_positions=STEPS + 64)
    session = DecoderSession(model, max_length=STEPS + 32)
    prompt = encode("A long run ")

    reads = []
    original = session._read_summary

    def counting(*args, **kwargs):
        reads.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(session, "_read_summary", counting)

    # Warm up: compile prefill and decode once, then measure a short and the long generation.
    session.generate([prompt], max_new_tokens=2 * session.steps_per_call)
    compiles = dict(session.compile_counts)
    traces = dict(session.trace_counts)
    before = _bytes_in_use()
    short = session.generate([prompt], max_new_tokens=256)
    after_short = _bytes_in_use()
    reads.clear()
    result = session.generate([prompt], max_new_tokens=STEPS)
    after_long = _bytes_in_use()
    calls = len(reads)

    assert len(result.tokens[0]) == STEPS, result.finish_reasons
    assert dict(session.compile_counts) == compiles, "a generation recompiled"
    assert dict(session.trace_counts) == traces, "a generation retraced"
    # One summary read per decode call of steps_per_call steps (plus prefill's), never per step.
    assert calls <= -(-STEPS // session.steps_per_call) + 2, calls
    # Device memory: the cache and state are donated and reused: nothing grows with the steps.
    growth = after_long - after_short
    print(f"{STEPS} steps: {calls} host reads, bytes in use {before} -> {after_short} (256 steps) "
          f"-> {after_long} ({STEPS} steps), {result.timings.decode_tokens_per_s:.0f} tok/s")
    assert growth <= 1 << 20, f"device memory grew by {growth} bytes over {STEPS} steps"
    assert short.tokens[0] == result.tokens[0][:256], "greedy tokens depend on the run length"
    assert np.isfinite(result.timings.decode_s)
