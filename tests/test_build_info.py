"""build_info() tells "compiled" from "usable now": kernels compiled into the extension are usable
only where jax sees a CUDA device (issue 17: a CPU machine used to read `cuda: True`)."""

from __future__ import annotations

import jax

import jax_onnx_attn


def _jax_has_cuda() -> bool:
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


def test_compiled_and_usable_are_separate():
    info = jax_onnx_attn.build_info()
    assert info["cuda"] == info["cuda_compiled"] == jax_onnx_attn.has_cuda()
    assert info["cuda_usable"] == (info["cuda_compiled"] and _jax_has_cuda())
    assert info["cuda_usable"] == jax_onnx_attn.cuda_usable()
    assert (info["usable_reason"] is None) == info["cuda_usable"]
    assert (info["reason"] is None) == info["cuda_compiled"]
    if info["cuda_usable"]:
        assert info["cuda_devices"] and all(isinstance(d, str) for d in info["cuda_devices"])
    elif info["cuda_compiled"]:
        assert info["usable_reason"].startswith("jax has no CUDA device")
    else:
        assert info["usable_reason"] == f"the CUDA kernels were not compiled: {info['reason']}"


def test_cpu_only_jax_is_never_usable():
    if _jax_has_cuda():
        return
    info = jax_onnx_attn.build_info()
    assert info["cuda_usable"] is False and info["cuda_devices"] == []
    assert "CUDA" in info["usable_reason"]
