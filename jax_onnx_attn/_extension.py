"""The compiled extension `jax_onnx_attn._ffi`: loading, build info and FFI target registration.

The extension is optional at run time: without it (a source checkout that was never built) every op
runs on the reference backend and `build_info()` says why the CUDA backend is missing.
"""

from __future__ import annotations

import functools
from typing import Any

import jax

#: Every FFI target this package registers is named TARGET_PREFIX + its short name.
TARGET_PREFIX = "jax_onnx_attn_"

try:  # pragma: no cover - depends on how the package was installed
    from jax_onnx_attn import _ffi  # type: ignore[attr-defined]

    _IMPORT_ERROR: str | None = None
except ImportError as e:  # a source tree without a build, or a broken build
    _ffi = None
    _IMPORT_ERROR = f"the compiled extension jax_onnx_attn._ffi could not be imported ({e}); reinstall with `pip install .`"


def build_info() -> dict[str, Any]:
    """What the compiled extension contains.

    Returns a dict with:
      cuda (bool): whether CUDA kernels were compiled in;
      cuda_version (str | None), cuda_architectures (list[str]): the toolkit and the targets built;
      jaxlib_headers (str): the jaxlib version whose XLA FFI headers were compiled against;
      targets (list[str]): FFI target names registered for platform "CUDA";
      reason (str | None): why CUDA is missing, when it is.
    """
    if _ffi is None:
        return {
            "cuda": False,
            "cuda_version": None,
            "cuda_architectures": [],
            "jaxlib_headers": None,
            "targets": [],
            "reason": _IMPORT_ERROR,
        }
    info = dict(_ffi.build_info())
    info["targets"] = sorted(TARGET_PREFIX + name for name in _ffi.registrations())
    return info


def has_cuda() -> bool:
    """True when the extension was built with CUDA kernels."""
    return bool(build_info()["cuda"])


@functools.cache
def register_targets() -> tuple[str, ...]:
    """Register every FFI target of the extension for platform "CUDA", once per process.

    Harmless on a CPU-only jax: the registration is recorded and never used there.
    """
    if _ffi is None or not _ffi.build_info()["cuda"]:
        return ()
    names = []
    for name, capsule in _ffi.registrations().items():
        jax.ffi.register_ffi_target(TARGET_PREFIX + name, capsule, platform="CUDA")
        names.append(TARGET_PREFIX + name)
    return tuple(names)


@functools.cache
def limits() -> dict[str, Any] | None:
    """The kernels' limits as the extension was compiled with them (`_ffi.limits()`), or None
    without the extension. Every build has them, one without CUDA too: they come from the kernels'
    host-only headers, which are the one definition (ffi/kernels/decode/plan.h,
    ffi/kernels/general/params.h)."""
    return None if _ffi is None else _ffi.limits()


def decode_plan(**shapes) -> dict[str, Any]:
    """The decode engine's plan for a call (`_ffi.decode_plan`, ffi/kernels/decode/plan.h): a pure
    function of static shapes. Raises RuntimeError without the extension."""
    if _ffi is None:
        raise RuntimeError(f"no decode plan: {_IMPORT_ERROR}")
    return dict(_ffi.decode_plan(**shapes))


def target(name: str) -> str:
    """The registered FFI target name for a short kernel name; fails clearly if it is missing."""
    registered = register_targets()
    full = TARGET_PREFIX + name
    if full not in registered:
        info = build_info()
        why = info["reason"] or f"the extension has no target {full!r} (it has {list(registered)})"
        raise RuntimeError(f"CUDA backend unavailable for {name!r}: {why}")
    return full
