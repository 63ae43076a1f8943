"""TileLang tile programs behind tileops' ops.

This package is installed as ``tileops.kernels``. Importing it is cheap: ``BUILDERS`` names the
builders without importing TileLang; :func:`get_builder` imports one when a kernel is generated.
"""

from __future__ import annotations

import importlib
from typing import Callable

#: builder name (as manifests write it) -> "module:function" inside this package
BUILDERS: dict[str, str] = {
    "rope": "rope:build_rope",
}


def get_builder(name: str) -> Callable:
    """The builder function registered as ``name``."""
    try:
        target = BUILDERS[name]
    except KeyError:
        raise KeyError(f"unknown kernel builder {name!r}; known: {', '.join(BUILDERS)}") from None
    module, func = target.split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), func)
