"""Where families live: a family is a folder, found by its layout, never registered by an edit.

A *family root* is a directory laid out like this repository::

    manifests/<family>/*.yaml     one manifest per op (installed as ``tileops.manifests``)
    kernels/<builder>.py          a TileLang builder: ``build``, ``Spec``, ``STATIC`` (``tileops.kernels``)
    tileops/<family>/             the family package: ``__init__.py``, ``hooks.py``, ``builtin.py``,
                                  ``torch_impl.py``, ``reference.py`` and the generated ``ops.py``
    tests/references_<family>.py  the float64 reference the generated tests compare against

The repository (or the installed package) is the first root. More roots come from the environment
variable ``TILEOPS_FAMILY_PATH``: directories separated by ``os.pathsep``, read once, when tileops
is first imported. Each root's ``tileops/`` and ``kernels/`` folders are appended to the search path
of the packages ``tileops`` and ``tileops.kernels``, so a family outside the tree imports as
``tileops.<family>`` and its builder as ``tileops.kernels.<builder>``, exactly like one inside it;
its manifests join the registry (:func:`tileops.manifest.registry`). A root adds families: a family
package or a builder already found in an earlier root is an error, never a silent override.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

__all__ = ["ENV", "FamilyPathError", "roots", "extend_path", "root_manifest_files"]

#: The environment variable naming extra family roots.
ENV = "TILEOPS_FAMILY_PATH"


class FamilyPathError(ValueError):
    """A ``TILEOPS_FAMILY_PATH`` entry that is not a usable family root."""


@functools.lru_cache(maxsize=1)
def roots() -> tuple[Path, ...]:
    """The extra family roots of ``TILEOPS_FAMILY_PATH``, in order, resolved; empty entries are skipped."""
    out: list[Path] = []
    for entry in os.environ.get(ENV, "").split(os.pathsep):
        if not entry.strip():
            continue
        path = Path(entry).expanduser()
        if not path.is_dir():
            raise FamilyPathError(f"{ENV}: {entry!r} is not a directory (expected a family root holding "
                                  f"manifests/<family>/, kernels/ and tileops/<family>/)")
        path = path.resolve()
        if path not in out:
            out.append(path)
    return tuple(out)


def extend_path(path: list[str], folder: str) -> list[str]:
    """A package's ``__path__`` with each root's ``folder`` (``tileops`` or ``kernels``) after it.

    A module or package of the same name in two places is refused here: Python would take the
    first and ignore the second without a word."""
    extra = [str(r / folder) for r in roots() if (r / folder).is_dir()]
    if not extra:
        return path
    seen: dict[str, str] = {}
    for where in [*path, *extra]:
        for child in sorted(Path(where).iterdir()):
            name = child.stem if child.suffix == ".py" else child.name
            if name.startswith(("_", ".")) or not (child.suffix == ".py" or (child / "__init__.py").is_file()):
                continue
            if name in seen and seen[name] != where:
                raise FamilyPathError(f"{ENV}: {child} is also in {seen[name]}; a family root adds families and "
                                      f"builders, it cannot replace one")
            seen[name] = where
    return [*path, *(e for e in extra if e not in path)]


def root_manifest_files() -> list[Path]:
    """The manifests of every extra root (``<root>/manifests/**/*.yaml``), root by root, sorted within one."""
    out: list[Path] = []
    for r in roots():
        folder = r / "manifests"
        if folder.is_dir():
            out += sorted(p for p in folder.rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file())
    return out
