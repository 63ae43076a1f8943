"""TileLang tile programs behind tileops' ops.

This package is installed as ``tileops.kernels``; the ``kernels/`` folder of every family root named
by ``TILEOPS_FAMILY_PATH`` (:mod:`tileops.families`) extends its path. A *builder* is found by its
file: a module ``kernels/<name>.py`` that defines, at module level,

* ``build(spec)``: the ``T.prim_func`` for one specialization;
* ``Spec``: the frozen dataclass ``build`` takes (everything a kernel is compiled for);
* ``STATIC``: the schedule choices a manifest's ``kernel.static`` may set, written as a literal
  ``{key: (low, high, "what it is")}`` (each value an integer in ``[low, high]``). ``tileops check``
  validates manifests against it, and tests/test_manifest_check.py checks it against ``Spec``;
* optionally ``USES``: the other builders whose stages (exported ``T.macro`` factories) it imports,
  a literal tuple of builder names, such as ``USES = ("norm", "rope")`` in ``kernels/prologue.py``.
  Their sources join this builder's cache key (:mod:`tileops.compile.build`): an edit to a used
  builder re-keys its users. A builder without ``USES`` uses none.

Importing this package is cheap: builders are found by reading their source (nothing is executed),
so ``BUILDERS``, ``STATIC`` and ``SPECS`` need no TileLang; :func:`get_builder` and :func:`get_spec`
import a builder's module, which imports no TileLang either: its ``build`` does, when
:func:`tileops.compile.build.prim_func` calls it (having made TileLang importable first). A module
without a module-level ``build`` (a helper such as :mod:`tileops.kernels.storage`) is not a builder.

This package imports nothing of tileops but :mod:`tileops.families`: the manifests name builders, the
compile layer builds them (``tests/test_layers.py``).
"""

from __future__ import annotations

import sys

if __name__ == "kernels":
    # Imported by its bare name: this folder sits at the top of the repository, which pytest (and
    # ``python -m`` from the root) puts on sys.path, so a bare ``import kernels`` finds it. Hugging
    # Face's ``kernels`` distribution has that name too, and transformers 5.25 imports it whenever it
    # is installed (``from kernels import CUDAProperties, ...``): a test run in the repository broke
    # at every transformers import. The installed distribution, if any, takes the name (the import
    # system hands back whatever sys.modules holds once this module has run); tileops itself only
    # ever imports this package as ``tileops.kernels``.
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _elsewhere = [p for p in sys.path if _os.path.abspath(p or _os.curdir) != _root]
    _spec = _machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is not None and _spec.loader is not None:
        _module = _util.module_from_spec(_spec)
        sys.modules["kernels"] = _module
        _spec.loader.exec_module(_module)

import ast
import importlib
import re
from pathlib import Path
from typing import Any, Callable

from tileops.families import extend_path

__path__ = extend_path(__path__, "kernels")  # noqa: F821 - a package's own __path__


_BUILD = re.compile(r"^(?:(?:async\s+)?def\s+build\s*\(|build\s*(?::[^=\n]*)?=)", re.M)
_STATIC = re.compile(r"^STATIC\s*(?::[^=\n]*)?=", re.M)
_USES = re.compile(r"^USES\s*(?::[^=\n]*)?=", re.M)


def _literal(path: Path, text: str, name: str, pattern: re.Pattern, default: Any) -> Any:
    """The literal assigned to ``name`` at module level (column 0) in ``text``, or ``default``."""
    found = pattern.search(text)
    if found is None:
        return default
    lineno = text.count("\n", 0, found.start()) + 1
    lines = text[found.start():].split("\n")
    for n in range(1, len(lines) + 1):  # the statement: the shortest run of lines that parses
        try:
            node = ast.parse("\n".join(lines[:n])).body[0]
        except SyntaxError:
            continue
        try:
            return ast.literal_eval(node.value)
        except ValueError:
            break
    raise ValueError(f"{path}:{lineno}: {name} must be a literal (tileops reads it without importing the module)")


def _declared(path: Path) -> tuple[bool, dict[str, tuple[int, int, str]], tuple[str, ...]]:
    """(whether the module defines ``build`` at module level, its ``STATIC`` literal, its ``USES``
    literal), read from its source: the lines that start at column 0 (a full parse of every builder
    costs ~10 ms a module, on every process that loads manifests)."""
    text = path.read_text(encoding="utf-8")
    has_build = _BUILD.search(text) is not None
    static = _literal(path, text, "STATIC", _STATIC, {})
    uses = _literal(path, text, "USES", _USES, ())
    if not isinstance(uses, tuple) or not all(isinstance(u, str) for u in uses):
        raise ValueError(f"{path}: USES must be a tuple of builder names (strings), got {uses!r}")
    return has_build, static, uses


def _discover() -> tuple[dict[str, str], dict[str, dict[str, tuple[int, int, str]]], dict[str, str], list[str],
                         dict[str, tuple[str, ...]], dict[str, str]]:
    builders, static, specs, helpers, uses, files = {}, {}, {}, [], {}, {}
    for folder in __path__:
        for path in sorted(Path(folder).glob("*.py")):
            if path.name.startswith("_"):
                continue
            has_build, choices, used = _declared(path)
            if has_build:
                builders[path.stem], static[path.stem], specs[path.stem] = (
                    f"{path.stem}:build", choices, f"{path.stem}:Spec")
                uses[path.stem], files[path.stem] = used, str(path)
            else:
                helpers.append(str(path))
    return builders, static, specs, helpers, uses, files


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
#: builder name -> the builders it declares in ``USES`` (read, not checked: an unknown name is an error
#: when the builder's cache key is made, :func:`used_files`)
USES: dict[str, tuple[str, ...]]
#: builder name -> the path of its module's source
FILES: dict[str, str]
BUILDERS, STATIC, SPECS, HELPERS, USES, FILES = _discover()


def used_files(name: str) -> list[str]:
    """The source files of the builders ``name`` uses, directly or through another (``USES``), each
    once, in the order first reached; never ``name``'s own (a cycle back to it stops there). An
    unknown name raises KeyError naming the builder that declared it."""
    if name not in BUILDERS:
        raise KeyError(f"unknown kernel builder {name!r}; known: {', '.join(BUILDERS)}")
    out: list[str] = []
    seen = {name}
    todo = [name]
    while todo:
        user = todo.pop(0)
        for used in USES[user]:
            if used not in BUILDERS:
                raise KeyError(f"{FILES[user]}: USES names {used!r}, which is not a kernel builder; known: "
                               f"{', '.join(BUILDERS)}")
            if used not in seen:
                seen.add(used)
                out.append(FILES[used])
                todo.append(used)
    return out


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
