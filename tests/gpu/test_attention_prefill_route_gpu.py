"""ai.onnx Attention prompts (more than 64 query rows) on our prefill engine (ops/decode_paths.py
`attention_prefill_route`, `_attention_prefill`) against the reference backend at the dtype's
tolerance, and the route taken (the engine's custom call in the compiled HLO): every covered
feature of tests/prefill_cases.py COVERED_PROMPTS (no cache S = L and S < L top-left causal, a past
with S = L and S < L, nonpad_kv_seqlen with rows that see no key, windows, softcap, scale, GQA, 3D,
head sizes 64 / 80 / 96 / 128 / 256, float16 / bfloat16), attention_with_cache's prompt, and
prompts that stay on the reference (no engine call; JOA_PREFILL_ENGINE=0 too). Needs an sm_90 GPU
(H100 / H200).

    pytest -q tests/gpu/test_attention_prefill_route_gpu.py
"""

import jax
import numpy as np
import pytest

from jax_onnx_attn import ops
from jax_onnx_attn.testing import assert_close
from prefill_cases import COVERED_PROMPTS, UNCOVERED_PROMPTS, needs_sm90

pytestmark = pytest.mark.gpu

ENV = "JOA_PREFILL_ENGINE"
ENGINE = "jax_onnx_attn_prefill_attention"


def _compiled(case, arrays, backend):
    """(compiled HLO text, outputs) of the op on `backend`."""
    attrs = case.attributes()
    compiled = jax.jit(lambda a: ops.attention(**a, **attrs, backend=backend)).lower(arrays).compile()
    return compiled.as_text(), compiled(arrays)


@needs_sm90
@pytest.mark.parametrize("case", COVERED_PROMPTS, ids=lambda c: c.name)
def test_covered_prompt_on_the_engine_equals_the_reference(monkeypatch, case):
    monkeypatch.delenv(ENV, raising=False)  # the default: on
    arrays, clean = case.inputs()
    hlo, got = _compiled(case, arrays, "cuda")
    assert ENGINE in hlo
    _, want = _compiled(case, clean, "reference")
    y = np.asarray(got.y).astype(np.float32)
    assert_close(y, np.asarray(want.y).astype(np.float32), case.dtype, err_msg="y")
    assert np.isfinite(y).all()  # NaN in K / V past nonpad never reaches y
    if case.cache != "nonpad":
        for name in ("present_key", "present_value"):
            np.testing.assert_array_equal(np.asarray(getattr(got, name)),
                                          np.asarray(getattr(want, name)), err_msg=name)


@needs_sm90
def test_attention_with_cache_prompt_on_the_engine(monkeypatch):
    """The fixed-capacity form's prompt: kv_len = cache_lengths + S, a refused row 0, cache rows
    past the valid length (NaN here) never read."""
    monkeypatch.delenv(ENV, raising=False)
    rng = np.random.default_rng(7)
    b, hq, hkv, s, d, cap = 3, 16, 4, 200, 128, 512
    x = lambda *shape: rng.standard_normal(shape).astype(np.float16)  # noqa: E731
    args = [x(b, hq, s, d), x(b, hkv, s, d), x(b, hkv, s, d), x(b, hkv, cap, d), x(b, hkv, cap, d),
            np.array([0, 250, 400], np.int32)]  # the last does not fit: refused
    poisoned = list(args)
    for i in (3, 4):
        poisoned[i] = args[i].copy()
        poisoned[i][:, :, 450:] = np.nan
    attrs = dict(is_causal=1, left_window_size=100, opset=25)

    def run(bk, a):
        compiled = jax.jit(lambda *a: ops.attention_with_cache(*a, **attrs, backend=bk)).lower(
            *a).compile()
        return compiled.as_text(), compiled(*a)

    hlo, got = run("cuda", poisoned)
    assert ENGINE in hlo
    _, want = run("reference", args)
    assert_close(np.asarray(got.y), np.asarray(want.y), np.float16, err_msg="y")
    assert not np.asarray(got.y)[2].any()
    np.testing.assert_array_equal(np.asarray(got.status), np.asarray(want.status))


@needs_sm90
@pytest.mark.parametrize("case,match", [UNCOVERED_PROMPTS[i] for i in (1, 6, 8)],
                         ids=lambda c: getattr(c, "name", ""))
def test_uncovered_prompt_stays_on_the_reference(monkeypatch, case, match):
    monkeypatch.delenv(ENV, raising=False)
    arrays, _ = case.inputs()
    with pytest.raises(NotImplementedError, match="query rows"):
        _compiled(case, arrays, "cuda")
    hlo, got = _compiled(case, arrays, "auto")
    assert ENGINE not in hlo
    _, want = _compiled(case, arrays, "reference")
    assert_close(np.asarray(got.y), np.asarray(want.y), case.dtype)


@needs_sm90
def test_switch_off_keeps_prompts_on_the_reference(monkeypatch):
    case = COVERED_PROMPTS[0]
    arrays, _ = case.inputs()
    monkeypatch.setenv(ENV, "0")
    with pytest.raises(NotImplementedError, match=f"{ENV}=0"):
        _compiled(case, arrays, "cuda")
    hlo, _ = _compiled(case, arrays, "auto")
    assert ENGINE not in hlo
