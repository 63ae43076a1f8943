"""TileLang's private API, as tileops uses it (tileops/compile/tilelang_api.py): every name is still
there in the installed TileLang, and nothing else in tileops reaches past its public API.

A TileLang upgrade that moves one of these fails here, naming it, instead of far away: the lean
build's launcher generator silently running TileLang's own method where an override no longer
matches, or a kernel record read from an attribute that is gone."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

from tileops.compile import tilelang_api

ROOT = Path(__file__).resolve().parents[1]


def _resolve(name: str):
    module, _, attr = name.partition(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        pytest.fail(f"TileLang has no module {module} (for {name}): {e}")
    if not hasattr(mod, attr):
        pytest.fail(f"TileLang's {module} has no {attr}")
    return getattr(mod, attr)


def _has(cls: type, attr: str) -> bool:
    """Whether ``cls`` (or a base) defines ``attr``, or assigns ``self.attr`` in its source."""
    if hasattr(cls, attr):
        return True
    for klass in cls.__mro__:
        try:
            src = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if re.search(rf"\bself\.{re.escape(attr)}\s*(:[^=\n]*)?=", src):
            return True
    return False


@pytest.mark.parametrize("name", sorted(tilelang_api.PRIVATE))
def test_each_private_name_is_in_the_installed_tilelang(name):
    obj = _resolve(name)
    missing = [a for a in tilelang_api.PRIVATE[name] if not (_has(obj, a) if inspect.isclass(obj) else hasattr(obj, a))]
    assert not missing, f"TileLang's {name} no longer has {', '.join(missing)}"


def test_the_overridden_launcher_methods_are_methods_of_tilelangs_class():
    """An override of a method TileLang renamed would never be called."""
    cls = tilelang_api.cuda_source_wrapper()
    for name in tilelang_api.WRAPPER_OVERRIDES:
        assert callable(getattr(cls, name, None)), f"TLCUDASourceWrapper.{name} is gone: the lean build overrides it"
    from tileops.compile import cuda_build

    lean = cuda_build._wrapper_class()
    overridden = {n for n, v in vars(lean).items() if callable(v) and not n.startswith("__")}
    assert overridden == set(tilelang_api.WRAPPER_OVERRIDES), overridden


def test_the_memory_cache_hint_is_still_a_message_of_tilelangs_kernel_cache():
    src = inspect.getsource(importlib.import_module(tilelang_api.KERNEL_CACHE_LOGGER))
    assert tilelang_api.MEMORY_CACHE_HINT in src, \
        f"{tilelang_api.KERNEL_CACHE_LOGGER} no longer logs {tilelang_api.MEMORY_CACHE_HINT!r}: the filter is stale"


def _tilelang_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of each import of a TileLang or TVM module in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return [(n, m) for n, m in out if m.split(".")[0] in ("tilelang", "tvm")]


#: TileLang's and TVM's public API, which tileops may import anywhere
PUBLIC = re.compile(r"^(tilelang|tilelang\.language(\.\w+)?|tilelang\.cuda\.language\.\w+|tilelang\.tvm|"
                    r"tvm\.(transform|target)(\.\w+)?)$")


def test_nothing_outside_the_door_imports_tilelangs_internals():
    files = sorted([*ROOT.glob("tileops/**/*.py"), *ROOT.glob("kernels/**/*.py"), *ROOT.glob("benchmarks/**/*.py"),
                    *ROOT.glob("docs/examples/**/*.py")])
    door = ROOT / "tileops" / "compile" / "tilelang_api.py"
    bad = [f"{p.relative_to(ROOT)}:{n}: {m}" for p in files if p != door for n, m in _tilelang_imports(p)
           if not PUBLIC.match(m)]
    assert not bad, "TileLang internals imported outside tileops/compile/tilelang_api.py:\n" + "\n".join(bad)
    seen = {m for n, m in _tilelang_imports(door)}
    assert {"tilelang.jit.adapter.wrapper.TLCUDASourceWrapper", "tilelang.jit.adapter.utils.match_declare_kernel"} <= seen
