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


def _cuda_devices() -> tuple[list[str], str | None]:
    """(names of the CUDA devices jax sees, why there are none or None)."""
    try:
        devices = jax.devices("cuda")
    except RuntimeError as e:  # jax without CUDA support, or no GPU / driver
        platforms = sorted({d.platform for d in jax.devices()})
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        return [], f"jax has no CUDA device (its devices: {', '.join(platforms)}; {first})"
    if not devices:
        return [], "jax has no CUDA device"
    return [d.device_kind for d in devices], None


def build_info() -> dict[str, Any]:
    """What the compiled extension contains, and whether its kernels can run in this process.

    Returns a dict with:
      cuda_compiled (bool): whether CUDA kernels were compiled into the extension;
      cuda (bool): the same as cuda_compiled (kept for older callers);
      reason (str | None): why they were not compiled, when they were not (e.g. no GPU was found at
        build time: `JOA_ENABLE_CUDA=ON` compiles them anyway);
      cuda_version (str | None), cuda_architectures (list[str]): the toolkit and the targets built;
      jaxlib_headers (str): the jaxlib version whose XLA FFI headers were compiled against;
      targets (list[str]): FFI target names registered for platform "CUDA";
      cuda_usable (bool): compiled AND jax sees a CUDA device now, i.e. `backend="auto"` runs the
        kernels when it compiles for that device;
      cuda_devices (list[str]): the CUDA devices jax sees (device kinds);
      usable_reason (str | None): why the kernels cannot run now, when they cannot.
    """
    if _ffi is None:
        info: dict[str, Any] = {
            "cuda": False,
            "cuda_version": None,
            "cuda_architectures": [],
            "jaxlib_headers": None,
            "targets": [],
            "reason": _IMPORT_ERROR,
        }
    else:
        info = dict(_ffi.build_info())
        info["targets"] = sorted(TARGET_PREFIX + name for name in _ffi.registrations())
    info["cuda"] = bool(info["cuda"])
    info["cuda_compiled"] = info["cuda"]
    devices, no_device = _cuda_devices()
    info["cuda_devices"] = devices
    info["cuda_usable"] = info["cuda"] and not no_device
    if not info["cuda"]:
        info["usable_reason"] = f"the CUDA kernels were not compiled: {info['reason']}"
    else:
        info["usable_reason"] = no_device
    return info


def has_cuda() -> bool:
    """True when the extension was compiled with CUDA kernels (whether or not a GPU is here: see
    `cuda_usable`)."""
    return bool(_ffi is not None and _ffi.build_info()["cuda"])


def cuda_usable() -> bool:
    """True when the CUDA kernels were compiled AND jax sees a CUDA device in this process."""
    return has_cuda() and not _cuda_devices()[1]


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
