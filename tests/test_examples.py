"""Every example the project shows runs as written: the Python blocks of README.md and of every docs
page, the scripts of ``docs/examples/``, and every docstring example (``>>>``) of ``tileops``,
``kernels`` and the example family (whose op classes, like RoPE's, carry their manifest's
``examples``).

Each runs in a fresh interpreter, as a user would run it:

* a page's ``python`` blocks, which build on each other, are one script, each block at its own line
  of the page, so a traceback's line number is the page's (``docs/api/rope.md.py``, line 31: line
  31 of ``docs/api/rope.md``). No ``if __name__ == "__main__":`` guard is added: a page that calls
  ``op.compile`` (process-pool workers re-import ``__main__``) runs exactly as a pasted script does;
* a page's ``pycon`` sessions, and each docstring's examples, run as doctests (the output shown is
  compared); each docstring with empty globals, so it must import what it uses.

The runs are marked ``slow`` (minutes on a 2-core machine: each page and the docstrings start an
interpreter and compile their kernels once). On the CPU (``CUDA_VISIBLE_DEVICES=""``, so a GPU machine checks the CPU path too) and, marked
``cuda``, on the GPU. A fenced block must name its language: ``python``/``pycon`` run, and the tags
of :data:`NOT_RUN` (shell commands, output, data) are shown only; an untagged or unknown tag fails
:func:`test_every_block_is_tagged`.

Not run here because a dedicated test runs them and checks their output: the files of
``docs/examples/scale_family`` and ``docs/examples/tileops_target_example`` that pages include
(``tests/test_new_family.py``, ``tests/test_docs.py::test_example_target_through_its_entry_point``)
and ``docs/examples/hf_patch.py`` (``tests/test_hf.py::test_docs_example_runs``).
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["README.md"] + sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md"))
DOCSTRING_TREES = ("tileops", "kernels")
SCALE_FAMILY = ROOT / "docs" / "examples" / "scale_family"
TARGET_EXAMPLE = ROOT / "docs" / "examples" / "tileops_target_example"

RUN = {"python", "pycon"}
#: fenced blocks shown but not run, and why
NOT_RUN = {
    "bash": "shell commands: they install packages, run the test suite or the CLI",
    "text": "output, diagrams and grammars",
    "yaml": "manifests",
    "toml": "package metadata",
}

#: scripts of docs/examples/ with a test of their own that runs them and checks what they print
SCRIPTS_TESTED_ELSEWHERE = {"hf_patch.py": ("tests/test_hf.py", "test_docs_example_runs")}
#: what each other script must print (whitespace-split), None when only its exit status is checked
SCRIPT_OUTPUT = {"first_call.py": ["builtin", "(2,", "128,", "8,", "64)", "torch.float32"],
                 "composed_prologue.py": ["prologue", "rope:", "interleaved", "64", "norm:", "llama", "heads:", "4",
                                          "2", "q:", "True", "k:", "True"],
                 "two_kernel_plan.py": ["launches:", "2", "workspace", "bytes:", "256", "scale", "1", "y:", "[30.0,",
                                        "36.0]", "scale", "10", "y:", "[300.0,", "360.0]"]}

#: pages whose text says to install something before their Python blocks: what the test installs
PAGE_NEEDS = {"docs/writing-a-target.md": "tileops_target_example"}


@dataclass(frozen=True)
class Block:
    lang: str
    line: int  # 1-based line of the page that holds the block's first line of code
    code: str


_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([^\s{`]*)")


def fenced_blocks(text: str) -> list[Block]:
    """The fenced code blocks of a Markdown text, dedented by their fence's indent."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        j = i + 1
        while j < len(lines) and lines[j].strip() != fence and not (
                lines[j].strip().startswith(fence) and not lines[j].strip().strip(fence[0])):
            j += 1
        body = [ln[len(indent):] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1:j]]
        out.append(Block(lang.lower(), i + 2, "\n".join(body)))
        i = j + 1
    return out


def _blocks(page: str) -> list[Block]:
    return fenced_blocks((ROOT / page).read_text(encoding="utf-8"))


def _env(device: str, **extra: str) -> dict[str, str]:
    env = {**os.environ, **extra}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # torch.cuda.is_available() is False: the examples pick the CPU
    return env


def _devices() -> list:
    return ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _run(cmd: list[str], env: dict[str, str], timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT, check=False)


# ------------------------------------------------------------------------------------- the tags
def test_every_block_is_tagged() -> None:
    bad = [f"{page}:{b.line - 1}: ```{b.lang}" for page in PAGES for b in _blocks(page)
           if b.lang not in RUN and b.lang not in NOT_RUN]
    assert not bad, ("fenced blocks without a known language tag (python and pycon run; "
                     f"{', '.join(NOT_RUN)} are shown only):\n" + "\n".join(bad))


def test_the_parser_finds_blocks() -> None:
    text = "x\n```python\na = 1\n```\n\n  ```bash\n  ls\n  ```\n```\nplain\n```\n"
    assert fenced_blocks(text) == [Block("python", 3, "a = 1"), Block("bash", 7, "ls"), Block("", 10, "plain")]


# ------------------------------------------------------------------------------------ the pages
@pytest.fixture(scope="module")
def page_site_packages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """For each page of PAGE_NEEDS, a folder for PYTHONPATH holding what its text installs (pip
    --target into a temp dir: the environment itself is left alone)."""
    out = {}
    for page, what in PAGE_NEEDS.items():
        assert what == "tileops_target_example", what
        tmp = tmp_path_factory.mktemp("site-packages")
        src = tmp / "src"
        shutil.copytree(TARGET_EXAMPLE, src)  # setuptools writes build/ and egg-info beside the source
        install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
                                  "--target", str(tmp / "lib"), str(src)], capture_output=True, text=True,
                                 timeout=600, check=False)
        assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-4000:]
        out[page] = str(tmp / "lib")
    return out


def _pages_with(lang: str) -> list[str]:
    return [p for p in PAGES if any(b.lang == lang for b in _blocks(p))]


def _script(blocks: list[Block]) -> str:
    """The blocks as one script, each block at its page's line numbers (blank lines between)."""
    lines: list[str] = []
    for b in blocks:
        lines += [""] * (b.line - 1 - len(lines))
        lines += b.code.splitlines()
    return "\n".join(lines) + "\n"


def _failing_block(blocks: list[Block], script: Path, stderr: str) -> str:
    lines = [int(n) for n in re.findall(rf'File "{re.escape(str(script))}", line (\d+)', stderr)]
    if not lines:
        return "a block"
    hit = [b for b in blocks if b.line <= lines[-1] < b.line + len(b.code.splitlines())]
    return f"the block at line {hit[0].line}" if hit else f"line {lines[-1]}"


@pytest.mark.slow
@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("page", _pages_with("python"))
def test_page_python_blocks_run(page: str, device: str, tmp_path: Path, page_site_packages) -> None:
    blocks = [b for b in _blocks(page) if b.lang == "python"]
    script = tmp_path / (Path(page).name + ".py")
    script.write_text(_script(blocks), encoding="utf-8")
    extra = {"PYTHONPATH": page_site_packages[page]} if page in page_site_packages else {}
    run = _run([sys.executable, str(script)], _env(device, **extra))
    assert run.returncode == 0, (f"{page}: {_failing_block(blocks, script, run.stderr)} raised "
                                 f"(the script's line numbers are the page's):\n{run.stderr[-6000:]}")


# ------------------------------------------------------------------------------------- doctests
#: Runs doctests given as JSON ([{name, file, line, text} or {name, module, qualname}], shared
#: globals or one namespace each) and writes {name: failure report or ""}; the text is our own docs'.
DOCTEST_RUNNER = textwrap.dedent('''
    import doctest, importlib, io, json, sys

    items, shared, out = json.load(open(sys.argv[1])), sys.argv[2] == "shared", {}
    globs = {"__name__": "__main__"}
    for it in items:
        if "module" in it:  # a docstring, read from the object at run time
            obj = importlib.import_module(it["module"])
            for part in filter(None, it["qualname"].split(".")):
                obj = getattr(obj, part)
            text = obj.__doc__
        else:
            text = it["text"]
        test = doctest.DocTestParser().get_doctest(text, globs if shared else {"__name__": "__main__"},
                                                   it["name"], it["file"], it["line"] - 1)
        report = io.StringIO()
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        runner.run(test, out=report.write)
        out[it["name"]] = ("no examples found" if not test.examples
                           else report.getvalue() if runner.failures else "")
    json.dump(out, open(sys.argv[3], "w"))
''')


def _doctests(items: list[dict], shared: bool, env: dict[str, str], tmp: Path) -> dict[str, str]:
    (tmp / "items.json").write_text(json.dumps(items), encoding="utf-8")
    (tmp / "runner.py").write_text(DOCTEST_RUNNER, encoding="utf-8")
    run = _run([sys.executable, str(tmp / "runner.py"), str(tmp / "items.json"), "shared" if shared else "own",
                str(tmp / "out.json")], env)
    assert run.returncode == 0, f"the doctest runner itself failed:\n{run.stderr[-6000:]}"
    return json.loads((tmp / "out.json").read_text(encoding="utf-8"))


@pytest.mark.slow
@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("page", _pages_with("pycon"))
def test_page_pycon_sessions_run(page: str, device: str, tmp_path: Path) -> None:
    items = [{"name": f"{page}:{b.line}", "file": page, "line": b.line, "text": b.code}
             for b in _blocks(page) if b.lang == "pycon"]
    failed = {k: v for k, v in _doctests(items, True, _env(device), tmp_path).items() if v}
    assert not failed, "\n".join(f"{k}:\n{v}" for k, v in failed.items())


def _docstrings_with_examples(tree: Path, package_root: Path) -> list[dict]:
    """Every module, class and function docstring under ``tree`` that holds a ``>>>`` line, read
    from the source (nothing is imported)."""
    out = []
    for path in sorted(tree.rglob("*.py")):
        rel = path.relative_to(package_root)
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        nodes = [(ast.parse(path.read_text(encoding="utf-8")), "")]
        while nodes:
            node, qual = nodes.pop()
            doc = ast.get_docstring(node, clean=False)
            if doc and re.search(r"^\s*>>> ", doc, re.MULTILINE):
                line = node.body[0].lineno
                out.append({"name": f"{path.relative_to(ROOT).as_posix()}::{qual or '(module)'}",
                            "module": module, "qualname": qual, "file": str(path), "line": line})
            for child in getattr(node, "body", []):
                if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    nodes.append((child, f"{qual}.{child.name}".lstrip(".")))
    return out


def _in_tree_docstrings() -> list[dict]:
    return [d for top in DOCSTRING_TREES for d in _docstrings_with_examples(ROOT / top, ROOT)]


def _family_docstrings() -> list[dict]:
    """The example family's op classes, generated from its manifests in a temp copy (the class
    docstring's Examples come from the manifest's ``examples``)."""
    return [{"name": p.relative_to(ROOT).as_posix(), "module": f"tileops.{p.parent.name}.ops", "qualname": p.stem,
             "file": str(p), "line": 1} for p in sorted((SCALE_FAMILY / "manifests").glob("*/*.yaml"))]


DOCSTRINGS = _in_tree_docstrings() + _family_docstrings()
_doctest_results: dict[str, dict[str, str]] = {}


@pytest.fixture(scope="module")
def family_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("families") / "scale_family"
    shutil.copytree(SCALE_FAMILY, root, ignore=shutil.ignore_patterns("ops.py", "__pycache__"))
    gen = _run([sys.executable, "-m", "tileops", "generate", *sorted(p.name for p in (root / "manifests").iterdir())],
               {**os.environ, "TILEOPS_FAMILY_PATH": str(root)})
    assert gen.returncode == 0, gen.stdout[-2000:] + gen.stderr[-4000:]
    return root


def test_docstring_examples_are_found() -> None:
    names = {d["name"] for d in DOCSTRINGS}
    assert "tileops/rope/ops.py::RoPEFwdOp" in names and "tileops/__init__.py::(module)" in names, sorted(names)


@pytest.mark.slow
@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("item", DOCSTRINGS, ids=[d["name"] for d in DOCSTRINGS])
def test_docstring_examples_run(item: dict, device: str, family_copy: Path,
                                tmp_path_factory: pytest.TempPathFactory) -> None:
    if device not in _doctest_results:  # every docstring in one process, each in its own namespace
        env = _env(device, TILEOPS_FAMILY_PATH=str(family_copy))
        _doctest_results[device] = _doctests(DOCSTRINGS, False, env, tmp_path_factory.mktemp("doctests"))
    report = _doctest_results[device][item["name"]]
    assert not report, f"{item['name']} (from {item['file']}):\n{report}"


# ----------------------------------------------------------------------------------- the scripts
SCRIPTS = sorted(p.name for p in (ROOT / "docs" / "examples").glob("*.py"))


def test_every_script_is_run() -> None:
    for name, (test_file, test_name) in SCRIPTS_TESTED_ELSEWHERE.items():
        assert name in SCRIPTS, f"{name} is gone: drop it from SCRIPTS_TESTED_ELSEWHERE"
        text = (ROOT / test_file).read_text(encoding="utf-8")
        assert f"def {test_name}(" in text and name in text, f"{test_file}::{test_name} no longer runs {name}"


@pytest.mark.slow
@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("script", [s for s in SCRIPTS if s not in SCRIPTS_TESTED_ELSEWHERE])
def test_script_runs(script: str, device: str) -> None:
    run = _run([sys.executable, str(ROOT / "docs" / "examples" / script)], _env(device))
    assert run.returncode == 0, f"docs/examples/{script} raised:\n{run.stderr[-6000:]}"
    if SCRIPT_OUTPUT.get(script) is not None:
        assert run.stdout.split() == SCRIPT_OUTPUT[script], run.stdout
