"""The decode benchmark on CPU: --device-time's table (each implementation's device µs a call and
the peers' ratios to ours, cases without the figure shown as "-"), its profiled run (on a machine
whose trace has no GPU kernels: None, not a number), and the XLA_FLAGS a run's JSON records."""

import jax
import jax.numpy as jnp

from jax_onnx_attn.bench import decode


def test_device_table_has_each_impls_device_time_and_the_peers_ratio_to_ours():
    results = [
        {"label": "B=1 ctx=4096", "impls": {"ours": {"us": 10.0, "device_us": 8.0},
                                            "jax-cudnn": {"us": 11.0, "device_us": 10.0}}},
        {"label": "B=1 ctx=8192", "impls": {"ours": {"us": 14.0}, "jax-cudnn": {"us": 15.0, "device_us": 13.0}}},
    ]
    lines = decode.format_device_table(results, ["ours", "jax-cudnn"]).splitlines()
    assert lines[0].split() == ["case", "ours", "dev", "us", "jax-cudnn", "dev", "us", "xjax-cudnn", "dev"]
    assert lines[1].split()[-3:] == ["8.0", "10.0", "1.25"]
    assert lines[2].split()[-3:] == ["-", "13.0", "-"]


def test_device_table_is_empty_without_device_times():
    results = [{"label": "B=1", "impls": {"ours": {"us": 10.0}, "jax-cudnn": {"skip": "no GPU"}}}]
    assert decode.format_device_table(results, ["ours", "jax-cudnn"]) == ""


def test_device_seconds_per_call_is_none_when_the_trace_has_no_device_kernels():
    if any(d.platform == "gpu" for d in jax.devices()):
        import pytest
        pytest.skip("a GPU's trace has kernels: this checks the CPU answer")
    x = {"v": jnp.ones(8)}
    f = jax.jit(lambda v: v * 2)

    def run():
        x["v"] = f(x["v"])
    got = decode.device_seconds_per_call(run, lambda: x["v"].block_until_ready(), 4)
    assert got is None
    assert float(x["v"][0]) == 2.0  # the one profiled run ran


def test_environment_records_the_xla_flags_jax_read(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")
    assert decode.environment()["xla_flags"] == "--xla_gpu_enable_command_buffer="
    monkeypatch.delenv("XLA_FLAGS")
    assert decode.environment()["xla_flags"] is None
