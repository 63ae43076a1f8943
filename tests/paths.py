"""The two paths of an eager call, for tests that run both: the native extension's
(:mod:`tileops.runtime.native`) and the Python one (what ``TILEOPS_NATIVE=0`` or a machine without a
compiler gets)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from tileops.runtime import native

__all__ = ["can_build", "native_module", "python_path", "both"]


def can_build() -> bool:
    """Whether the extension should build here: a C++ compiler, torch's headers, not switched off."""
    include = Path(torch.__file__).parent / "include" / "torch" / "csrc" / "autograd" / "python_variable.h"
    return native.enabled() and shutil.which(os.environ.get("CXX", "c++")) is not None and include.exists()


def native_module() -> Any:
    mod = native.build()
    if mod is None:
        pytest.skip(f"no native extension here: {native.status()}")
    return mod


#: ops made inside use the Python path (as with TILEOPS_NATIVE=0, or with no compiler)
python_path = native.disabled


def both(scenario: Callable[[str], Any]) -> tuple[Any, Any]:
    """``scenario(path)`` run on the Python path, then on the native one (whose op must have been
    served natively: ``scenario`` returns ``(result, ops)``)."""
    with python_path():
        py, py_ops = scenario("python")
    assert all(op._dispatch is None for op in py_ops)
    native_module()
    nat, ops = scenario("native")
    assert all(op._dispatch is not None and op._dispatch.stats()["hits"] > 0 for op in ops), \
        [op._dispatch and op._dispatch.stats() for op in ops]
    return py, nat
