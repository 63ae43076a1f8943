"""tileops in layers: every import between tileops' modules points down, none closes a cycle, none
takes another module's private name, and every module has a layer.

The imports are read from the source with :mod:`ast`, not by importing anything: every ``import``
statement counts, at module level, inside functions and under ``if TYPE_CHECKING:`` (an import
inside a function is an import all the same; it only hides a cycle until the function runs), as
does ``importlib.import_module("tileops....")`` with a literal name. Relative imports are resolved
against the importing module's package; ``from pkg import name`` is an import of the module
``pkg.name`` when there is one, else of ``pkg``.

The layers, lowest first (:data:`LAYERS`); a module may import its own layer or any lower one:

* ``base``: what everything may use (progress lines, where family roots live, torch's private API,
  the tolerances against a float64 reference);
* ``kernels``: the kernel builders (``kernels/``, shipped as ``tileops.kernels``): TileLang tile
  programs and the registry that finds them by reading their source. Below ``manifest``: a manifest
  names its builder and the loader checks ``kernel.static`` against the builder's ``STATIC``, while
  no builder knows what a manifest is;
* ``manifest``: the schema, the loader, the expression language, ``CallSpec``, the cases;
* ``compile``: building kernels (TileLang, the lean CUDA build, the shipped lowered sources, warmup);
  it learns a family's kernels from the family's ``kernel_specs``, found by the manifest's family
  name at run time, and never constructs an op;
* ``runtime``: launching kernels, the error words, the native fast path;
* ``op``: the op base class, its autograd, the targets that serve it, the schedules its kernels are
  built with and the tuner that picks them;
* ``families``: one package per folder of ``manifests/`` (``tileops.rope``, ...);
* ``integrations``: patches for other libraries (transformers);
* ``tools``: the command line, code and docs generators, the test matrix, the package's ``__init__``.

A new module is placed here on purpose: one the table does not place fails :func:`test_every_module_has_a_layer`.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

ROOT = Path(__file__).resolve().parents[1]
#: package name -> its folder in the repository (pyproject.toml's ``package-dir``)
PACKAGES = {"tileops": ROOT / "tileops", "tileops.kernels": ROOT / "kernels", "tileops.manifests": ROOT / "manifests"}
#: the families: one per folder of manifests/ (a new family is placed by its manifests)
FAMILIES = sorted(p.name for p in (ROOT / "manifests").iterdir() if p.is_dir() and any(p.glob("*.yaml")))

#: (layer, the modules in it), lowest first; ``x.*`` is every module below package ``x``
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("tileops.progress", "tileops.families", "tileops.torch_private", "tileops.tolerances")),
    ("kernels", ("tileops.kernels", "tileops.kernels.*")),
    ("manifest", ("tileops.manifest", "tileops.manifest.*", "tileops.manifests")),
    ("compile", ("tileops.compile", "tileops.compile.*")),
    ("runtime", ("tileops.runtime", "tileops.runtime.*")),
    ("op", ("tileops.op", "tileops.autograd", "tileops.targets", "tileops.compose", "tileops.schedules",
            "tileops.tuning")),
    ("families", tuple(p for f in FAMILIES for p in (f"tileops.{f}", f"tileops.{f}.*"))),
    ("integrations", ("tileops.integrations", "tileops.integrations.*")),
    ("tools", ("tileops", "tileops.__main__", "tileops.cli", "tileops.cli_coverage", "tileops.codegen",
               "tileops.docgen", "tileops.testing", "tileops.workloads")),
]


@dataclass(frozen=True)
class Source:
    """One module's text, and whether it is a package's ``__init__``."""

    text: str
    package: bool = False
    file: str = ""


@dataclass(frozen=True)
class Import:
    """``importer`` imports ``target`` (a known module) at ``line``; ``names`` are what a
    ``from target import ...`` takes from it (not submodules)."""

    importer: str
    target: str
    line: int
    text: str
    names: tuple[str, ...] = ()

    def where(self, sources: Mapping[str, Source]) -> str:
        return f"{sources[self.importer].file or self.importer}:{self.line}: `{self.text}`"


def read_tree(packages: Mapping[str, Path] = PACKAGES) -> dict[str, Source]:
    """Every module of ``packages`` by its dotted name (a package under another is found once, by
    the longer name: ``kernels/`` is ``tileops.kernels``)."""
    out: dict[str, Source] = {}
    for package, folder in packages.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = [package, *rel.parts]
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts = parts[:-1]
            if "__pycache__" in parts:
                continue
            name = ".".join(parts)
            # a folder inside tileops/ that another entry of `packages` owns is not part of this one
            if any(name.startswith(other + ".") or name == other for other in packages
                   if other != package and other.startswith(package + ".")):
                continue
            out[name] = Source(path.read_text(encoding="utf-8"), is_pkg, str(path.relative_to(ROOT)))
    return out


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def _known(name: str, modules: Iterable[str]) -> str | None:
    """The longest module of ``modules`` that ``name`` is or lies inside."""
    mods = set(modules)
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        cand = ".".join(parts[:n])
        if cand in mods:
            return cand
    return None


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def imports(name: str, sources: Mapping[str, Source]) -> tuple[list[Import], list[str]]:
    """The imports of module ``name`` among ``sources``, and its uses of ``module._private`` through
    a name bound to another module of ``sources``."""
    src = sources[name]
    tree = ast.parse(src.text, filename=src.file or name)
    lines = src.text.splitlines()
    package = name if src.package else name.rpartition(".")[0]
    found: list[Import] = []
    aliases: dict[str, str] = {}  # local name -> the module it is bound to

    def text(node: ast.AST) -> str:
        return " ".join(line.strip() for line in lines[node.lineno - 1:node.end_lineno])

    def add(target: str, node: ast.AST, names: tuple[str, ...] = ()) -> None:
        if target != name:
            found.append(Import(name, target, node.lineno, text(node), names))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                target = _known(a.name, sources)
                if target is None:
                    continue
                add(target, node)
                if a.asname:
                    aliases[a.asname] = target
                else:
                    aliases.setdefault(a.name.split(".")[0], _known(a.name.split(".")[0], sources) or "")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                full = ".".join(base + ([node.module] if node.module else []))
            else:
                full = node.module or ""
            target = _known(full, sources)
            if target is None:
                continue
            plain: list[str] = []
            for a in node.names:
                sub = f"{full}.{a.name}"
                if sub in sources:
                    add(sub, node)
                    aliases[a.asname or a.name] = sub
                    if _private(a.name) and not (name == full or name.startswith(full + ".")):
                        found.append(Import(name, sub, node.lineno, text(node), (a.name,)))
                else:
                    plain.append(a.name)
            if plain:
                add(target, node, tuple(plain))
        elif isinstance(node, ast.Call):
            fn = _dotted(node.func)
            if fn in ("importlib.import_module", "import_module", "__import__") and node.args and \
                    isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                target = _known(node.args[0].value, sources)
                if target is not None:
                    add(target, node)
    private_uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            owner = _dotted(node.value)
            if owner is None:
                continue
            head, _, rest = owner.partition(".")
            module = aliases.get(head)
            if not module:
                continue
            module = f"{module}.{rest}" if rest else module
            if module in sources and module != name:
                private_uses.append(f"{src.file or name}:{node.lineno}: `{text(node)}` uses {module}.{node.attr}")
    return found, private_uses


def layer_of(module: str, layers: Sequence[tuple[str, Sequence[str]]] = LAYERS) -> int | None:
    """The index of ``module``'s layer in ``layers`` (the most specific pattern wins), or None."""
    best: tuple[int, int] | None = None
    for i, (_, patterns) in enumerate(layers):
        for p in patterns:
            if p.endswith(".*"):
                hit = module.startswith(p[:-1])
                weight = len(p) - 2
            else:
                hit = module == p
                weight = len(p) + 1  # an exact name beats a package pattern of the same length
            if hit and (best is None or weight > best[1]):
                best = (i, weight)
    return None if best is None else best[0]


@dataclass
class Report:
    cycles: list[str]
    upward: list[str]
    private: list[str]
    unplaced: list[str]


def check(sources: Mapping[str, Source], layers: Sequence[tuple[str, Sequence[str]]] = LAYERS) -> Report:
    """Every violation of the rules in ``sources``, each a line naming the modules and the import."""
    edges: dict[str, list[Import]] = {m: [] for m in sources}
    private: list[str] = []
    for m in sources:
        found, uses = imports(m, sources)
        edges[m] = found
        private += uses
        for imp in found:
            for n in imp.names:
                if _private(n):
                    private.append(f"{imp.where(sources)} takes {n} from {imp.target}")
    unplaced = [f"{sources[m].file or m}: module {m} has no layer in tests/test_layers.py's LAYERS"
                for m in sources if layer_of(m, layers) is None]
    upward = []
    for m, found in edges.items():
        lm = layer_of(m, layers)
        for imp in found:
            lt = layer_of(imp.target, layers)
            if lm is not None and lt is not None and lt > lm:
                upward.append(f"{imp.where(sources)}: {m} ({layers[lm][0]}) imports {imp.target} ({layers[lt][0]})")
    return Report(_cycles(edges, sources), sorted(set(upward)), sorted(set(private)), unplaced)


def _cycles(edges: Mapping[str, list[Import]], sources: Mapping[str, Source]) -> list[str]:
    """One line per strongly connected group of modules: a cycle through it, import by import."""
    graph = {m: sorted({i.target for i in found if i.target in edges}) for m, found in edges.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    groups: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's algorithm, iteratively (no recursion limit)
        work = [(v, iter(graph[v]))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        while work:
            node, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(graph[w])))
                    break
                if w in on:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        group.append(w)
                        if w == node:
                            break
                    if len(group) > 1:
                        groups.append(sorted(group))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    out = []
    for group in sorted(groups):
        members = set(group)
        start = group[0]
        # the shortest way back to start, within the group
        prev: dict[str, Import] = {}
        frontier = [start]
        seen = {start}
        closing = None
        while frontier and closing is None:
            nxt = []
            for v in frontier:
                for imp in edges[v]:
                    if imp.target == start:
                        closing = imp
                        break
                    if imp.target in members and imp.target not in seen:
                        seen.add(imp.target)
                        prev[imp.target] = imp
                        nxt.append(imp.target)
                if closing is not None:
                    break
            frontier = nxt
        path = [closing]
        while path[-1].importer != start:
            path.append(prev[path[-1].importer])
        steps = "; ".join(i.where(sources) for i in reversed(path))
        out.append(f"cycle among {', '.join(group)}: {steps}")
    return out


# ----------------------------------------------------------------------------------------- the tree
_REPORT: Report | None = None


def _report() -> Report:
    global _REPORT
    if _REPORT is None:
        _REPORT = check(read_tree())
    return _REPORT


def _fail(what: str, lines: list[str]) -> None:
    assert not lines, f"{len(lines)} {what}:\n" + "\n".join(lines)


def test_no_import_cycle():
    _fail("import cycles among tileops' modules", _report().cycles)


def test_every_import_points_down():
    _fail("imports of a higher layer", _report().upward)


def test_no_module_takes_another_modules_private_names():
    _fail("private names taken across modules", _report().private)


def test_every_module_has_a_layer():
    _fail("modules without a layer", _report().unplaced)


def test_the_tree_is_read_whole():
    """The reader finds what the checks need: every module (kernels/ as tileops.kernels), and imports
    inside functions, under TYPE_CHECKING and by relative path."""
    sources = read_tree()
    assert {"tileops", "tileops.op", "tileops.kernels", "tileops.kernels.rope", "tileops.rope.hooks",
            "tileops.compile.build", "tileops.manifest.loader"} <= set(sources)
    assert not any(m.startswith("tileops.kernels.") and "tileops/kernels" in s.file for m, s in sources.items())
    assert len(sources) == len(list(ROOT.glob("tileops/**/*.py")) + list(ROOT.glob("kernels/**/*.py"))
                               + list(ROOT.glob("manifests/**/*.py")))
    targets = {i.target for i in imports("tileops.rope.hooks", sources)[0]}
    assert {"tileops.op", "tileops.rope.freqs", "tileops.rope.tables"} <= targets
    assert "tileops.compile.build" in {i.target for i in imports("tileops.rope.tables", sources)[0]}  # in a function
    assert layer_of("tileops.compile.cuda_build") == [n for n, _ in LAYERS].index("compile")
    assert layer_of("tileops") == len(LAYERS) - 1 and layer_of("tileops.rope") == layer_of("tileops.rope.ops")


# ------------------------------------------------------------------------------ the checker itself
def _synthetic(**modules: str) -> dict[str, Source]:
    """Modules by dotted name (``__`` for ``.``; a name ending in ``__init`` is a package)."""
    out = {}
    for key, text in modules.items():
        name = key.replace("__", ".")
        pkg = name.endswith(".init")
        out[name[:-len(".init")] if pkg else name] = Source(text, pkg, f"{key}.py")
    return out


_TOY_LAYERS = [("low", ("t.low", "t.low.*")), ("high", ("t.high",)), ("top", ("t",))]


def test_the_checker_finds_a_cycle_through_an_import_inside_a_function():
    sources = _synthetic(t__init="", t__low__init="", t__low__a="from . import b\n",
                         t__low__b="def f():\n    from .a import g\n", t__high="import t.low.a\n")
    report = check(sources, _TOY_LAYERS)
    assert len(report.cycles) == 1 and "t.low.a, t.low.b" in report.cycles[0], report.cycles
    assert "t__low__a.py:1: `from . import b`" in report.cycles[0]
    assert "t__low__b.py:2: `from .a import g`" in report.cycles[0]
    assert not report.upward and not report.private and not report.unplaced


def test_the_checker_finds_a_cycle_under_type_checking_and_through_import_module():
    sources = _synthetic(t__init="", t__low__init="",
                         t__low__a="from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from t.low.b import B\n",
                         t__low__b="import importlib\nm = importlib.import_module('t.low.a')\n", t__high="")
    report = check(sources, _TOY_LAYERS)
    assert len(report.cycles) == 1 and "import_module('t.low.a')" in report.cycles[0], report.cycles


def test_the_checker_finds_an_upward_import():
    sources = _synthetic(t__init="from . import high\n", t__low__init="", t__low__a="def f():\n    from ..high import h\n",
                         t__high="from .low import a\n")
    report = check(sources, _TOY_LAYERS)
    assert report.upward == ["t__low__a.py:2: `from ..high import h`: t.low.a (low) imports t.high (high)"], report.upward
    assert report.cycles and "t.high, t.low.a" in report.cycles[0]  # and high imports low.a: a cycle too


def test_the_checker_finds_private_names_taken_and_used():
    sources = _synthetic(t__init="", t__low__init="", t__low___impl="X = 1\n",
                         t__low__a="_secret = 1\n__version__ = '1'\n",
                         t__high=("from .low.a import _secret, __version__\nfrom .low import a\nfrom .low import _impl\n"
                                  "import t.low.a as la\nimport t.low.a\nprint(a._secret, a.public)\nprint(la._secret)\n"
                                  "print(t.low.a._other)\n"))
    report = check(sources, _TOY_LAYERS)
    text = "\n".join(report.private)
    assert "t__high.py:1: `from .low.a import _secret, __version__` takes _secret from t.low.a" in text, text
    assert "__version__" not in text.replace("import _secret, __version__", "")
    assert "t__high.py:3: `from .low import _impl` takes _impl from t.low._impl" in text, text
    assert "uses t.low.a._secret" in text and text.count("uses t.low.a._secret") == 2, text
    assert "uses t.low.a._other" in text and "t.low.a.public" not in text, text
    # a package's own private module, imported inside the package, is its business
    own = _synthetic(t__init="", t__low__init="from . import _impl\n", t__low___impl="", t__high="")
    assert not check(own, _TOY_LAYERS).private


def test_the_checker_finds_a_module_without_a_layer():
    sources = _synthetic(t__init="", t__low__init="", t__stray="")
    report = check(sources, _TOY_LAYERS)
    assert report.unplaced == ["t__stray.py: module t.stray has no layer in tests/test_layers.py's LAYERS"]


def test_the_checker_passes_a_clean_tree():
    sources = _synthetic(t__init="from . import high\n", t__low__init="from .a import f\n",
                         t__low__a="import os\ndef f():\n    from . import b\n", t__low__b="X = 1\n",
                         t__high="from t.low import a\nfrom t.low.a import f\n")
    report = check(sources, _TOY_LAYERS)
    assert report == Report([], [], [], []), report


def test_relative_imports_resolve_against_the_package():
    sources = _synthetic(t__init="", t__low__init="from .a import f\nfrom . import b\n", t__low__a="", t__low__b="",
                         t__high="from .low.a import f\nfrom . import low\n")
    assert {(i.target, i.names) for i in imports("t.low", sources)[0]} == {("t.low.a", ("f",)), ("t.low.b", ())}
    assert {(i.target, i.names) for i in imports("t.high", sources)[0]} == {("t.low.a", ("f",)), ("t.low", ())}
