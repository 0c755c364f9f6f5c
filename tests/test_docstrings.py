"""Every public module, function, class and method of jax_onnx_attn has a docstring (issue 7).

Public means reachable as a name without a leading underscore from a module of the package whose
dotted path has no `_`-prefixed part, and defined in the package (names imported from numpy, jax,
onnx, ... are not ours to document). Public methods (including properties, static and class methods)
of those classes count too. Whether a docstring gives shapes and dtypes cannot be checked
mechanically; this test enforces that one exists, so the rule holds for new code.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re

import jax_onnx_attn

PACKAGE = jax_onnx_attn.__name__


def _public_modules():
    """The package and every submodule whose dotted path has no `_`-prefixed part, imported."""
    modules = [jax_onnx_attn]
    for info in pkgutil.walk_packages(jax_onnx_attn.__path__, PACKAGE + "."):
        if any(part.startswith("_") for part in info.name.split(".")[1:]):
            continue
        modules.append(importlib.import_module(info.name))
    return modules


def _ours(obj) -> bool:
    module = getattr(obj, "__module__", None) or ""
    return module == PACKAGE or module.startswith(PACKAGE + ".")


def _has_doc(obj) -> bool:
    doc = getattr(obj, "__doc__", None)
    if not (isinstance(doc, str) and doc.strip()):
        return False
    if inspect.isclass(obj):
        # dataclasses and NamedTuples write `Name(field, ...)` in place of a missing docstring.
        if re.fullmatch(rf"{re.escape(obj.__name__)}\(.*\)", doc.strip(), flags=re.S):
            return False
    return True


def _methods(cls):
    """(name, function) for the public methods and properties defined in `cls` itself."""
    for name, attr in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(attr, (staticmethod, classmethod)):
            yield name, attr.__func__
        elif isinstance(attr, property):
            yield name, attr.fget
        elif inspect.isfunction(attr):
            yield name, attr


def _undocumented() -> list[str]:
    missing: list[str] = []
    seen: set[int] = set()
    for module in _public_modules():
        if not _has_doc(module):
            missing.append(f"{module.__name__} (module)")
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or not (inspect.isclass(obj) or callable(obj)):
                continue
            if inspect.ismodule(obj) or not _ours(obj) or id(obj) in seen:
                continue
            seen.add(id(obj))
            qualname = f"{obj.__module__}.{getattr(obj, '__qualname__', name)}"
            if not _has_doc(obj):
                missing.append(qualname)
            if inspect.isclass(obj):
                for method_name, fn in _methods(obj):
                    if fn is not None and not _has_doc(fn):
                        missing.append(f"{qualname}.{method_name}")
    return sorted(set(missing))


def test_public_api_has_docstrings():
    missing = _undocumented()
    assert not missing, f"{len(missing)} public names without a docstring:\n  " + "\n  ".join(missing)


def test_the_check_sees_undocumented_names():
    # The walk must actually reach the package's functions, classes and methods, or it passes vacuously.
    from jax_onnx_attn.onnx import interpreter

    assert _ours(interpreter.Interpreter) and not _ours(re.compile)
    assert "run_node" in dict(_methods(interpreter.Interpreter))

    def undocumented():
        pass

    class Plain:
        pass

    assert not _has_doc(undocumented) and not _has_doc(Plain)
