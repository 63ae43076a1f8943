"""One way down: the runtime reaches an op only through what the op handed it at registration.

An op registers with the runtime (:mod:`tileops.runtime.served`) by handing down a ``Layout``, plain
data, and a ``Served``, three public methods; the runtime calls nothing else of an op and reads
nothing else off it. Read from the source with :mod:`ast`, as ``tests/test_layers.py`` reads the
imports (which keeps checking that no import of the runtime points up), in every module of
``tileops/runtime/``:

* an attribute with a leading underscore is taken only off the module's own objects: ``self``,
  ``cls``, or a name the module itself defines at its top level; never off an object it was handed
  (an op, a binding, a context) or another module (``getattr`` with a literal name counts too);
* nothing names :mod:`tileops.op`: no import of it, and no attribute that only an op has (its
  ``manifest``, ``params``, ``serving_target``, ...: the public names ``tileops/op.py``'s ``Op``
  defines or sets that no class of the runtime defines too).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterable, Mapping

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ROOT / "tileops" / "runtime"
OP = ROOT / "tileops" / "op.py"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _top_level_names(tree: ast.Module) -> set[str]:
    """The names a module defines itself at its top level (not those it imports)."""
    names: set[str] = set()
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.If, ast.Try)):  # `if native.module is None: apply = ...`
            todo += [*node.body, *node.orelse, *getattr(node, "finalbody", ()),
                     *(s for h in getattr(node, "handlers", ()) for s in h.body)]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def class_members(tree: ast.Module, only: str | None = None) -> set[str]:
    """The attributes the classes of a module define (methods, class attributes, ``self.x = ...``);
    only class ``only``'s when given."""
    members: set[str] = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and only in (None, n.name)):
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                members.add(node.name)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                members.add(node.target.id)
            elif isinstance(node, ast.Assign):
                members |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        for node in ast.walk(cls):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
            members |= {t.attr for t in targets if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                        and t.value.id == "self"}
    return members


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")[:-node.level]
    return ".".join(base + ([node.module] if node.module else []))


def violations(sources: Mapping[str, str], op_only: Iterable[str]) -> list[str]:
    """Every place in ``sources`` (module name -> its text) that reaches up into an op: a line each."""
    op_only = set(op_only)
    found: list[tuple[str, int, str]] = []
    for module, text in sources.items():
        tree = ast.parse(text)
        lines = text.splitlines()
        own = _top_level_names(tree) | {"self", "cls"}

        def report(node: ast.AST, why: str) -> None:
            found.append((module, node.lineno, f"{module}:{node.lineno}: `{lines[node.lineno - 1].strip()}`: {why}"))

        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                owner = node.value.id if isinstance(node.value, ast.Name) else None
                if _private(node.attr) and owner not in own:
                    report(node, f"takes {node.attr} off {owner or ast.unparse(node.value)}, which is not this module's")
                elif node.attr in op_only:
                    report(node, f"reads {node.attr}, which only an op has")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2 and \
                    isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                owner = node.args[0].id if isinstance(node.args[0], ast.Name) else None
                name = node.args[1].value
                if (_private(name) and owner not in own) or name in op_only:
                    report(node, f"{node.func.id} of {name} off {owner or ast.unparse(node.args[0])}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == "tileops.op" or a.name.startswith("tileops.op."):
                        report(node, "imports tileops.op")
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(module, node)
                if target == "tileops.op" or target.startswith("tileops.op.") or \
                        (target == "tileops" and any(a.name == "op" for a in node.names)):
                    report(node, "imports tileops.op")
    return [line for *_, line in sorted(found)]


def runtime_sources(root: Path = ROOT) -> dict[str, str]:
    return {f"tileops.runtime.{p.stem}": p.read_text(encoding="utf-8")
            for p in sorted((root / "tileops" / "runtime").glob("*.py"))}


def op_only_names(root: Path = ROOT) -> set[str]:
    """The public names ``Op`` defines or sets that no class of the runtime defines: reading one in
    the runtime reads it off an op."""
    op = class_members(ast.parse((root / "tileops" / "op.py").read_text(encoding="utf-8")), "Op")
    runtime = set().union(*(class_members(ast.parse(t)) for t in runtime_sources(root).values()))
    return {n for n in op if not n.startswith("_")} - runtime


def test_the_runtime_reaches_an_op_only_through_what_it_was_handed():
    found = violations(runtime_sources(), op_only_names())
    assert not found, f"{len(found)} reaches up from the runtime into an op:\n" + "\n".join(found)


def test_the_runtime_modules_are_read_whole():
    sources = runtime_sources()
    assert {"tileops.runtime.library", "tileops.runtime.served", "tileops.runtime.executor"} <= set(sources)
    assert {"manifest", "params", "serving_target", "compile"} <= op_only_names()
    assert "name" not in op_only_names()  # a Layout has a name too: reading it is not reading an op


# ------------------------------------------------------------------------------ the checker itself
def test_the_checker_finds_what_reaches_up():
    source = '''
from ..op import Op
from tileops import op as op_module
import tileops.op
_registry = {}

def late(handle, key):
    return lookup(handle)._late[key]

def apply(handle, ctx):
    op = lookup(handle)
    op._eager_call({}, {})
    getattr(op, "_new_output")
    return op.manifest.inputs, ctx._saved
'''
    found = violations({"tileops.runtime.library": source}, {"manifest"})
    text = "\n".join(found)
    assert len(found) == 8, text
    for line, what in ((2, "imports tileops.op"), (3, "imports tileops.op"), (4, "imports tileops.op"),
                       (8, "takes _late off lookup(handle)"), (12, "takes _eager_call off op"),
                       (13, "getattr of _new_output off op"), (14, "reads manifest, which only an op has"),
                       (14, "takes _saved off ctx")):
        assert any(f.startswith(f"tileops.runtime.library:{line}: ") and what in f for f in found), (line, what, text)


def test_the_checker_passes_a_module_using_its_own_private_names():
    source = '''
import torch
_ops = {}

class Runtime:
    _shared = 1

    def __init__(self):
        self._lock = None
        self.__dict__["x"] = 1

    def run(self, layout):
        return _ops.get(layout.name), Runtime._shared, self._lock, cls_or_self()

def cls_or_self():
    return _ops.__len__()
'''
    assert violations({"tileops.runtime.x": source}, {"manifest"}) == []
