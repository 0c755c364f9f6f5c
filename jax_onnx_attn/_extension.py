"""The compiled extension `jax_onnx_attn._ffi`: loading, build info and FFI target registration.

The extension is optional at run time: without it (a source checkout that was never built) every op
runs on the reference backend and `build_info()` says why the CUDA backend is missing.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import jax
import jax.numpy as jnp

#: Every FFI target this package registers is named TARGET_PREFIX + its short name.
TARGET_PREFIX = "jax_onnx_attn_"

#: "1" turns the FFI record stage on (ffi/record/; where the build has it): XLA then adds the GEMV
#: targets' kernels to its command buffers as kernel nodes with programmatic dependent launches
#: across calls, instead of stream-capturing each call into a child graph. Off by default: on the
#: H200 it did not speed up a ~1B decoder's step (fp16 B=1 within noise, int4 B=1 0.73 -> 0.81 ms;
#: bench/results/2026-12-01-e2e-notes.md, session 15). Read once, when a record target is first
#: asked for.
RECORD_ENV = "JOA_FFI_RECORD"

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
def _record_names() -> tuple[str, ...]:
    """Short names of the targets registered with their record stage: those the build has, when
    JOA_FFI_RECORD=1 (read once a process: registration cannot change afterwards)."""
    if _ffi is None or not _ffi.build_info()["cuda"] or os.environ.get(RECORD_ENV, "0") != "1":
        return ()
    return tuple(_ffi.record_targets())


@functools.cache
def register_targets() -> tuple[str, ...]:
    """Register every FFI target of the extension for platform "CUDA", once per process; the
    targets with a record stage wait for `_register_record_targets` (their first use).

    Harmless on a CPU-only jax: the registration is recorded and never used there.
    """
    if _ffi is None or not _ffi.build_info()["cuda"]:
        return ()
    record = _record_names()
    if record:  # XLA calls it when its CUDA backend starts: it keeps XLA's C API for the record stage
        jax.ffi.register_ffi_target(TARGET_PREFIX + "record_api_probe", _ffi.record_api_probe(), platform="CUDA")
    names = []
    for name, capsule in _ffi.registrations().items():
        if name not in record:
            jax.ffi.register_ffi_target(TARGET_PREFIX + name, capsule, platform="CUDA")
            names.append(TARGET_PREFIX + name)
    return tuple(names)


@functools.cache
def _register_record_targets() -> dict[str, str]:
    """Registers the record targets, once, on first use: through XLA's C API with execute + record
    stages (jax's registration drops the record stage), or, where that fails, through jax like the
    others. Returns {short name: "" or why it has no record stage}."""
    register_targets()
    record = _record_names()
    if not record:
        return {}
    try:  # starts jax's CUDA backend, which runs the registrations pending for it (the probe's)
        jax.devices("cuda")
        if _ffi.record_status()["api_minor_version"] < 0:  # registration did not call it: run it once
            with jax.ensure_compile_time_eval():  # now, also when asked while tracing
                jax.jit(lambda: jax.ffi.ffi_call(TARGET_PREFIX + "record_api_probe",
                                                 jax.ShapeDtypeStruct((1,), jnp.float32),
                                                 has_side_effect=True)())().block_until_ready()
    except RuntimeError:
        pass
    errors = {name: str(e) for name, e in _ffi.register_record(TARGET_PREFIX).items()}
    for name, error in errors.items():
        if error:
            jax.ffi.register_ffi_target(TARGET_PREFIX + name, _ffi.registrations()[name], platform="CUDA")
    return errors


def record_status() -> dict[str, Any]:
    """The FFI record stage in this process: whether the build has it ("built"), the targets
    registered with it ("targets") and those that fell back with why ("errors"), and the counters of
    its calls (kernel-node creations, argument updates, falls back to stream capture)."""
    built = bool(_ffi is not None and _ffi.build_info().get("ffi_record"))
    status: dict[str, Any] = {"built": built, "enabled": bool(_record_names())}
    errors = _register_record_targets() if status["enabled"] else {}
    status["targets"] = sorted(TARGET_PREFIX + n for n, e in errors.items() if not e)
    status["errors"] = {n: e for n, e in errors.items() if e}
    status.update(_ffi.record_status() if built else {})
    return status


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


def prefill_plan(**shapes) -> dict[str, Any]:
    """The prefill engine's split-KV plan for a call (`_ffi.prefill_plan`,
    ffi/kernels/prefill/plan.h): a pure function of static shapes. Raises RuntimeError without the
    extension, or with one built before the plan existed (rebuild it: its prefill handler predates
    the workspace result too)."""
    if _ffi is None:
        raise RuntimeError(f"no prefill plan: {_IMPORT_ERROR}")
    if not hasattr(_ffi, "prefill_plan"):
        raise RuntimeError("no prefill plan: the extension was built before split-KV prefill "
                           "(ffi/kernels/prefill/plan.h); rebuild it")
    return dict(_ffi.prefill_plan(**shapes))


def target(name: str) -> str:
    """The registered FFI target name for a short kernel name; fails clearly if it is missing."""
    registered = register_targets()
    full = TARGET_PREFIX + name
    if name in _record_names():
        _register_record_targets()  # with the record stage or, failing that, through jax
        return full
    if full not in registered:
        info = build_info()
        why = info["reason"] or f"the extension has no target {full!r} (it has {list(registered)})"
        raise RuntimeError(f"CUDA backend unavailable for {name!r}: {why}")
    return full
