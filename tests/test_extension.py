"""The compiled extension: build info, target registration, and the status flags it shares with Python."""

import jax
import jax.numpy as jnp
import pytest

import jax_onnx_attn
from jax_onnx_attn import _extension
from jax_onnx_attn.ops import status


def test_build_info_reports_what_was_built():
    info = jax_onnx_attn.build_info()
    assert set(info) >= {"cuda", "cuda_version", "cuda_architectures", "jaxlib_headers", "targets", "reason"}
    if info["cuda"]:
        assert info["reason"] is None
        assert info["cuda_version"] and any(a.startswith("90a") for a in info["cuda_architectures"])
        assert "jax_onnx_attn_kv_append" in info["targets"]
        assert all(t.startswith(_extension.TARGET_PREFIX) for t in info["targets"])
    else:
        assert info["reason"], "a build without CUDA must say why"
        assert info["targets"] == []


def test_registration_happens_once_and_is_harmless_without_a_gpu():
    first = _extension.register_targets()
    second = _extension.register_targets()
    assert first is second  # cached: registered once per process
    assert set(first) == set(jax_onnx_attn.build_info()["targets"])
    # Registering CUDA targets on a CPU-only jax leaves CPU computations working.
    assert float(jax.jit(lambda x: x + 1)(jnp.float32(1))) == 2.0


@pytest.mark.skipif(_extension._ffi is None, reason="extension not built")
def test_status_flags_agree_between_cuda_and_python():
    flags = dict(_extension._ffi.status_flags())
    assert flags == {"OK": status.OK, "KV_WRITE_OUT_OF_RANGE": status.KV_WRITE_OUT_OF_RANGE}


def test_cuda_backend_unavailable_is_a_clear_error():
    if jax_onnx_attn.has_cuda():
        pytest.skip("this build has CUDA")
    with pytest.raises(NotImplementedError, match="backend='cuda'"):
        jax_onnx_attn.ops.kv_append(jnp.zeros((1, 1, 4, 8)), jnp.zeros((1, 1, 1, 8)),
                                    jnp.zeros((1,), jnp.int32), backend="cuda")


@pytest.mark.skipif(_extension._ffi is None, reason="extension not built")
def test_the_decode_plan_and_limits_come_from_the_extension():
    """The plan and the limits are the kernels' headers' (ffi/kernels/decode/plan.h), in every build."""
    from jax_onnx_attn.ops import cuda
    limits = _extension.limits()
    assert cuda.DECODE_HEAD_DIMS == tuple(limits["decode"]["head_dims"])
    assert [str(t) for t in cuda.GENERAL_SOFTMAX_DTYPES] == ["float32", "float16", "bfloat16"]
    shapes = dict(batch=1, q_heads=32, kv_heads=8, q_len=1, capacity=4096, kv_bits=0)
    plan = _extension.decode_plan(head_dim=64, cluster_capable=True, **shapes)
    assert plan == _extension.decode_plan(head_dim=64, cluster_capable=True, **shapes)  # pure
    assert plan["cluster"] and plan["splits"] == 16 and plan["workspace_elems"] == 1
    assert not _extension.decode_plan(head_dim=64, cluster_capable=False, **shapes)["cluster"]
    # Head dim 128 at B=1: 4-tile splits and the combine kernel (plan.h PlanPolicy::kWave).
    long = _extension.decode_plan(head_dim=128, cluster_capable=True, **shapes)
    assert not long["cluster"] and long["split_rows"] == 256 and long["workspace_elems"] > 1
    # Head dim 256 runs one CTA per SM: its cluster plan counts half the CTA slots of d128's.
    wide = dict(shapes, kv_heads=32, q_heads=32, capacity=1024)
    assert _extension.decode_plan(head_dim=128, cluster_capable=True, **wide)["ctas_per_sm"] == 2
    assert _extension.decode_plan(head_dim=256, cluster_capable=True, **wide)["ctas_per_sm"] == 1
    # 32 KV heads: 6-CTA clusters (192 of 264 slots, one wave of clusters), 3 at d256 (96 of 132).
    assert cuda.decode_cluster_split_rows(1, 32, 1, 1024, 128) == 192
    assert cuda.decode_cluster_split_rows(1, 32, 1, 1024, 256) == 384
    with pytest.raises(ValueError, match="split_rows"):
        _extension.decode_plan(head_dim=128, split_rows=100, **shapes)


@pytest.mark.skipif(_extension._ffi is None, reason="extension not built")
@pytest.mark.parametrize("kv_bits", [8, 4])
def test_the_quantised_cache_plan_picks_its_kernel_and_fills_its_slots(kv_bits):
    # quant_path (plan.h QuantPath) 0: the tile kernel, 2: the register-dequantising one, 1: the
    # register kernel from kQuantRegsMinRows KV rows a call on (below, the tile kernel is faster).
    shapes = dict(batch=8, q_heads=32, kv_heads=8, q_len=1, capacity=131072, kv_bits=kv_bits)
    regs = _extension.decode_plan(head_dim=128, quant_path=2, **shapes)
    tiles = _extension.decode_plan(head_dim=128, **shapes)
    assert (regs["quant_regs"], tiles["quant_regs"]) == (True, False)
    assert _extension.decode_plan(head_dim=128, quant_path=1, **shapes) == regs
    # The register kernel runs three CTAs an SM at head dims up to 128 (MakeLayout; d256's merge
    # area does not fit a third), and the splits fill those slots: B=8 32/8 at 128k plans ~3 CTAs an
    # SM (6 splits of 64 blocks), the tile kernel ~2 (4).
    assert (regs["ctas_per_sm"], tiles["ctas_per_sm"]) == (3, 2)
    assert 8 * 8 * regs["splits"] > 132 * 2 >= 8 * 8 * tiles["splits"]
    assert _extension.decode_plan(head_dim=256, quant_path=2, **shapes)["ctas_per_sm"] < 3
    # Small calls: "auto" takes the tile kernel (B=1 4k: 4096 rows a head x 8 heads < 65536)...
    small = dict(shapes, batch=1, capacity=4096)
    assert _extension.decode_plan(head_dim=128, quant_path=1, cluster_capable=True, **small) == \
        _extension.decode_plan(head_dim=128, cluster_capable=True, **small)
    assert _extension.decode_plan(head_dim=128, quant_path=1, **dict(small, capacity=8192))["quant_regs"]
    # ... and the register kernel's splits combine in a cluster at B=1, as a float cache's do.
    assert _extension.decode_plan(head_dim=128, quant_path=2, cluster_capable=True, **small)["cluster"]
    assert not _extension.decode_plan(head_dim=128, cluster_capable=True, **small)["cluster"]
    # A float cache ignores the path.
    dense = dict(shapes, kv_bits=0)
    plan = _extension.decode_plan(head_dim=128, quant_path=2, **dense)
    assert plan == _extension.decode_plan(head_dim=128, **dense) and not plan["quant_regs"]
    with pytest.raises(ValueError, match="quant_path"):
        _extension.decode_plan(head_dim=128, quant_path=3, **shapes)


def test_cuda_backend_without_a_gpu_is_a_clear_error(monkeypatch):
    """Kernels compiled but no GPU (a CUDA build on a CPU machine): backend="cuda" raises
    NotImplementedError saying so, not XLA's "No FFI handler registered" from deep inside."""
    from jax_onnx_attn.ops import backend

    monkeypatch.setattr(backend, "has_cuda", lambda: True)
    monkeypatch.setattr(backend, "no_cuda_device", lambda: "jax sees no CUDA device (test)")
    x = jnp.zeros((1, 1, 1, 64), jnp.float16)
    with pytest.raises(NotImplementedError, match="backend='cuda'.*no CUDA device"):
        jax_onnx_attn.ops.attention(x, x, x, backend="cuda")
    with pytest.raises(NotImplementedError, match="backend='cuda'.*no CUDA device"):
        jax_onnx_attn.ops.kv_append(jnp.zeros((1, 1, 4, 8)), jnp.zeros((1, 1, 1, 8)),
                                    jnp.zeros((1,), jnp.int32), backend="cuda")
    if not jax_onnx_attn.build_info()["cuda"]:
        return
    monkeypatch.undo()
    if backend.no_cuda_device() is not None:  # the real machine: a CUDA build without a GPU
        with pytest.raises(NotImplementedError, match="no CUDA device"):
            jax_onnx_attn.ops.attention(x, x, x, backend="cuda")


class _RecordBuild:
    """Stands in for an extension built with the FFI record stage (ffi/record/): two record targets,
    XLA's answers to their registration given."""

    def __init__(self, errors):
        self.errors = errors

    def build_info(self):
        return {"cuda": True, "ffi_record": True}

    def registrations(self):
        return {"kv_append": "kv", "linear": "lin", "matmul_nbits": "nbits"}

    def record_targets(self):
        return ["linear", "matmul_nbits"]

    def record_api_probe(self):
        return "probe"

    def register_record(self, prefix):
        assert prefix == _extension.TARGET_PREFIX
        return dict(self.errors)

    def record_status(self):
        return {"api_minor_version": 4, "creates": 0, "updates": 0, "fallbacks": 0, "last_fallback": ""}


@pytest.fixture
def record_build(monkeypatch):
    """Registration with a fake record build; jax's registration recorded, the caches cleared."""
    registered = []
    monkeypatch.setattr(jax.ffi, "register_ffi_target",
                        lambda name, capsule, platform: registered.append((name, capsule)))
    caches = (_extension._record_names, _extension.register_targets, _extension._register_record_targets)

    def use(errors):
        monkeypatch.setattr(_extension, "_ffi", _RecordBuild(errors))
        for f in caches:
            f.cache_clear()
        return registered

    yield use
    for f in caches:
        f.cache_clear()


def test_record_targets_register_through_xla_and_fall_back_to_jax(record_build, monkeypatch):
    monkeypatch.setenv(_extension.RECORD_ENV, "1")
    registered = record_build({"linear": "", "matmul_nbits": "the running XLA FFI API is 0.3"})
    # At import: the API probe and the targets without a record stage, through jax.
    assert _extension.register_targets() == ("jax_onnx_attn_kv_append",)
    assert registered == [("jax_onnx_attn_record_api_probe", "probe"), ("jax_onnx_attn_kv_append", "kv")]
    # First use: linear is registered through XLA; matmul_nbits, which XLA refused, through jax.
    assert _extension.target("linear") == "jax_onnx_attn_linear"
    assert registered[2:] == [("jax_onnx_attn_matmul_nbits", "nbits")]
    assert _extension.target("matmul_nbits") == "jax_onnx_attn_matmul_nbits"
    assert len(registered) == 3  # once
    status = _extension.record_status()
    assert status["built"] and status["enabled"]
    assert status["targets"] == ["jax_onnx_attn_linear"]
    assert status["errors"] == {"matmul_nbits": "the running XLA FFI API is 0.3"}


@pytest.mark.parametrize("switch", [None, "0"], ids=["default", "off"])
def test_record_stage_off_registers_every_target_through_jax(record_build, monkeypatch, switch):
    if switch is None:
        monkeypatch.delenv(_extension.RECORD_ENV, raising=False)
    else:
        monkeypatch.setenv(_extension.RECORD_ENV, switch)
    registered = record_build({})
    assert set(_extension.register_targets()) == {"jax_onnx_attn_kv_append", "jax_onnx_attn_linear",
                                                  "jax_onnx_attn_matmul_nbits"}
    assert [name for name, _ in registered] == ["jax_onnx_attn_kv_append", "jax_onnx_attn_linear",
                                                "jax_onnx_attn_matmul_nbits"]
    assert _extension.target("linear") == "jax_onnx_attn_linear"
    assert _extension.record_status() == {"built": True, "enabled": False, "targets": [], "errors": {},
                                          "api_minor_version": 4, "creates": 0, "updates": 0,
                                          "fallbacks": 0, "last_fallback": ""}
