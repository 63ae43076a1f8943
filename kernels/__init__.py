"""TileLang tile programs behind tileops' ops.

This package is installed as ``tileops.kernels``. Importing it is cheap: ``BUILDERS`` names the
builders without importing TileLang; :func:`get_builder` imports one when a kernel is generated.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

#: builder name (as manifests write it) -> "module:function" inside this package
BUILDERS: dict[str, str] = {
    "rope": "rope:build_rope",
}


#: builder name -> the schedule choices a manifest's ``kernel.static`` may set, each an integer in
#: ``[low, high]``: key -> (low, high, what it is). A value is one integer, or a map from each of the
#: op's ``input_layout`` choices to one. ``tileops check`` validates manifests against this, and
#: tests/test_manifest_check.py checks it against each builder's spec class (``SPECS``).
STATIC: dict[str, dict[str, tuple[int, int, str]]] = {
    "rope": {
        "threads": (32, 1024, "target threads per block (CUDA)"),
        "head_lanes": (1, 64, "threads that split one token's heads (CUDA)"),
        "tokens_per_thread": (1, 64, "tokens each thread walks (CUDA)"),
    },
}

#: builder name -> "module:Class" of the spec it is compiled for (imports TileLang)
SPECS: dict[str, str] = {
    "rope": "rope:RopeKernelSpec",
}


def _load(target: str) -> Any:
    """``module:attr`` inside this package; TileLang is made importable first (its cache directory)."""
    from tileops.generate import ensure_tilelang_importable

    ensure_tilelang_importable()
    module, attr = target.split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), attr)


def _lookup(table: dict[str, str], name: str) -> Any:
    """``table[name]`` loaded; an unknown name raises KeyError listing the known ones (an error while
    importing the module is its own, not reported as an unknown name)."""
    if name not in table:
        raise KeyError(f"unknown kernel builder {name!r}; known: {', '.join(table)}")
    return _load(table[name])


def get_builder(name: str) -> Callable:
    """The builder function registered as ``name``."""
    return _lookup(BUILDERS, name)


def get_spec(name: str) -> Any:
    """The spec class the builder registered as ``name`` is compiled for."""
    return _lookup(SPECS, name)
