"""The two runtimes of an eager call, for tests that run both in one process: the native
extension's (:mod:`tileops.runtime.native`, loaded when tileops is imported; ``conftest.py`` builds
it before the tests start) and the Python one (:class:`tileops.runtime.executor.PythonRuntime`, what
``TILEOPS_NATIVE=0`` or a machine without a compiler gets), which an op is given explicitly."""

from __future__ import annotations

from typing import Any, Callable

import pytest

from tileops.runtime import executor, native

__all__ = ["native_module", "on_python", "both"]


def native_module() -> Any:
    """The loaded extension, or the test is skipped."""
    if native.module is None:
        pytest.skip(f"no native runtime in this process: {native.status()}")
    return native.module


def on_python(op: Any) -> Any:
    """``op``, served by the Python runtime from now on (as without the extension)."""
    op._use_runtime(executor.PythonRuntime(op._handle))
    return op


def both(scenario: Callable[[Callable[[Any], Any]], Any]) -> tuple[Any, Any]:
    """``scenario(on)`` run on the Python runtime, then on the native one: it passes every op it
    makes through ``on`` and returns ``(result, ops)``; each native op must have served calls
    natively."""
    py, py_ops = scenario(on_python)
    assert all(isinstance(op._runtime, executor.PythonRuntime) for op in py_ops)
    native_module()
    nat, ops = scenario(lambda op: op)
    assert all(op._runtime.stats()["hits"] > 0 for op in ops), [op._runtime.stats() for op in ops]
    return py, nat
