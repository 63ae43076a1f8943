"""TileLang tile programs behind tileops' ops.

This package is installed as ``tileops.kernels``; the ``kernels/`` folder of every family root named
by ``TILEOPS_FAMILY_PATH`` (:mod:`tileops.families`) extends its path. A *builder* is found by its
file: a module ``kernels/<name>.py`` that defines, at module level,

* ``build(spec)``: the ``T.prim_func`` for one specialization;
* ``Spec``: the frozen dataclass ``build`` takes (everything a kernel is compiled for);
* ``STATIC``: the schedule choices a manifest's ``kernel.static`` may set, written as a literal
  ``{key: (low, high, "what it is")}`` (each value an integer in ``[low, high]``). ``tileops check``
  validates manifests against it, and tests/test_manifest_check.py checks it against ``Spec``.

Importing this package is cheap: builders are found by reading their source (nothing is executed),
so ``BUILDERS``, ``STATIC`` and ``SPECS`` need no TileLang; :func:`get_builder` and :func:`get_spec`
import a builder's module, which imports no TileLang either: its ``build`` does, when
:func:`tileops.compile.build.prim_func` calls it (having made TileLang importable first). A module
without a module-level ``build`` (a helper such as :mod:`tileops.kernels.storage`) is not a builder.

This package imports nothing of tileops but :mod:`tileops.families`: the manifests name builders, the
compile layer builds them (``tests/test_layers.py``).
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path
from typing import Any, Callable

from tileops.families import extend_path

__path__ = extend_path(__path__, "kernels")  # noqa: F821 - a package's own __path__


_BUILD = re.compile(r"^(?:(?:async\s+)?def\s+build\s*\(|build\s*(?::[^=\n]*)?=)", re.M)
_STATIC = re.compile(r"^STATIC\s*(?::[^=\n]*)?=", re.M)


def _declared(path: Path) -> tuple[bool, dict[str, tuple[int, int, str]]]:
    """(whether the module defines ``build`` at module level, its ``STATIC`` literal), read from its
    source: the lines that start at column 0 (a full parse of every builder costs ~10 ms a module,
    on every process that loads manifests)."""
    text = path.read_text(encoding="utf-8")
    has_build = _BUILD.search(text) is not None
    found = _STATIC.search(text)
    if found is None:
        return has_build, {}
    lineno = text.count("\n", 0, found.start()) + 1
    lines = text[found.start():].split("\n")
    for n in range(1, len(lines) + 1):  # the statement: the shortest run of lines that parses
        try:
            node = ast.parse("\n".join(lines[:n])).body[0]
        except SyntaxError:
            continue
        try:
            return has_build, ast.literal_eval(node.value)
        except ValueError:
            break
    raise ValueError(f"{path}:{lineno}: STATIC must be a literal (tileops reads it without importing the module)")


def _discover() -> tuple[dict[str, str], dict[str, dict[str, tuple[int, int, str]]], dict[str, str], list[str]]:
    builders, static, specs, helpers = {}, {}, {}, []
    for folder in __path__:
        for path in sorted(Path(folder).glob("*.py")):
            if path.name.startswith("_"):
                continue
            has_build, choices = _declared(path)
            if has_build:
                builders[path.stem], static[path.stem], specs[path.stem] = (
                    f"{path.stem}:build", choices, f"{path.stem}:Spec")
            else:
                helpers.append(str(path))
    return builders, static, specs, helpers


#: builder name (as manifests write it, the module's name) -> "module:function" inside this package
BUILDERS: dict[str, str]
#: builder name -> the schedule choices a manifest's ``kernel.static`` may set: key -> (low, high, what it
#: is). A value is one integer, or a map from each of the op's ``input_layout`` choices to one.
STATIC: dict[str, dict[str, tuple[int, int, str]]]
#: builder name -> "module:Class" of the spec it is compiled for (imports TileLang)
SPECS: dict[str, str]
#: the helper modules (no ``build``) builders may import: their sources are part of every kernel's
#: cache key (:mod:`tileops.compile.build`), as the builder's own is
HELPERS: list[str]
BUILDERS, STATIC, SPECS, HELPERS = _discover()


def _load(target: str) -> Any:
    """``module:attr`` inside this package."""
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
