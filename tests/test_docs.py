"""The docs site: it builds with ``mkdocs build --strict``, its generated parts hold what the code and
the manifests hold, the API reference shows every op, parameter and tensor in a real browser, and
the examples it shows run (the example target package is installed and used through its entry point).
"""

from __future__ import annotations

import html
import itertools
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[docs]')")

from tileops import docgen  # noqa: E402
from tileops.manifest import registry  # noqa: E402
from tileops.manifest.schema import SCHEMA  # noqa: E402

# builds a family copy / the docs site in subprocesses (8-17 s a test on 2 cores); CI runs -m slow
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOT = ROOT / "build" / "docs-screenshot.png"
EXAMPLE = ROOT / "docs" / "examples" / "tileops_target_example"
ROPE_OPS = sorted(name for name, m in registry().items() if m.family == "rope")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout[-4000:]}\n{run.stderr[-8000:]}"
    return out


def _page(site: Path, path: str) -> str:
    return (site / path / "index.html").read_text(encoding="utf-8")


def _text(markup: str) -> str:
    markup = re.sub(r"<(script|style)\b.*?</\1>", " ", markup, flags=re.S)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", markup)).split())


def _squash(text: str) -> str:
    """Text without whitespace: highlighted code and inline tags split words where the source did not."""
    return "".join(text.split())


def _default_forms(value: object) -> list[str]:
    """How a default may be written on the page: ``"neox"`` or ``'neox'``, ``10000.0``, ``None``."""
    return [f'"{value}"', f"'{value}'"] if isinstance(value, str) else [repr(value)]


# ------------------------------------------------------------------------------------ the build
def test_every_page_is_built_in_both_languages(site: Path) -> None:
    for page in ("", "getting-started", "concepts", "api/rope", "manifest-format", "writing-a-target",
                 "coverage", "benchmarks"):
        assert (site / page / "index.html").is_file(), page
        assert (site / "zh" / page / "index.html").is_file(), f"zh/{page}"
    home_zh = _text(_page(site, "zh"))
    assert "算子" in home_zh and "本页暂无中文版" not in home_zh  # the home page is translated
    api_zh = _text(_page(site, "zh/api/rope"))
    assert "本页暂无中文版。以下为英文原文。" in api_zh and "RoPE Operators" in api_zh
    assert "本页暂无中文版" not in _text(_page(site, "api/rope"))


def test_manifest_format_lists_every_schema_key(site: Path) -> None:
    page = _page(site, "manifest-format")
    for section, keys in SCHEMA.items():
        part = page.split(f'id="schema-{section}"', 1)[1].split('id="schema-', 1)[0]
        for key, (_, _, meaning) in keys.items():
            assert f"<code>{key}</code>" in part, f"{section}.{key}"
            assert _squash(meaning.replace("`", "")) in _squash(_text(part)), f"{section}.{key}: {meaning}"


def test_getting_started_shows_the_readme_commands(site: Path) -> None:
    commands = docgen.readme_commands((ROOT / "README.md").read_text(encoding="utf-8"))
    assert len(commands) == 2, commands
    text = _squash(_text(_page(site, "getting-started")))
    for cmd in commands:
        assert _squash(cmd) in text, cmd


def test_benchmarks_and_coverage_pages(site: Path) -> None:
    results = ROOT / "benchmarks" / "results"
    page = _page(site, "benchmarks")
    # every figure the page names (the summary's, serving.png) is published and shown
    shown = re.findall(r'src="\.\./assets/benchmarks/([\w.-]+\.png)"', page)
    assert shown and set(shown) <= {p.name for p in results.glob("*.png")}, shown
    for name in shown:
        assert (site / "assets" / "benchmarks" / name).read_bytes() == (results / name).read_bytes()
    for name in ("summary.md", "latest.md", "serving.md", "cpu.md"):  # inlined, or said to be missing
        if (results / name).is_file():
            first = (results / name).read_text(encoding="utf-8").splitlines()[0]
            assert _squash(first.replace("`", "")) in _squash(_text(page)), name
        else:
            assert f"benchmarks/results/{name} has not been committed yet" in _text(page), name
    assert page.count('class="bench-wide"') == 3  # the wide tables scroll in their own box (extra.css)
    coverage = _page(site, "coverage")
    assert "<table>" in coverage or "Coverage table not available" in coverage


# ---------------------------------------------------------------------------- the API reference
def test_api_reference_in_a_browser(site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is not installed (apt-get install -y chromium)")
    url = (site / "api" / "rope" / "index.html").as_uri()
    SCREENSHOT.parent.mkdir(exist_ok=True)
    profile = site.parent / "chromium-profile"
    flags = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", "--window-size=1280,4000"]
    dom = subprocess.run(flags + ["--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0 and "</html>" in dom.stdout, dom.stderr[-2000:]
    shot = subprocess.run(flags + [f"--screenshot={SCREENSHOT}", url], capture_output=True, text=True, timeout=120)
    assert shot.returncode == 0 and SCREENSHOT.stat().st_size > 10_000, shot.stderr[-2000:]
    with capsys.disabled():
        print(f"\ndocs screenshot of {url}: {SCREENSHOT}")

    _check_api_reference(dom.stdout)


def test_api_reference_layout(site: Path) -> None:
    """What the browser test checks in the rendered DOM, in the built HTML (no browser needed)."""
    _check_api_reference(_page(site, "api/rope"))


def _check_api_reference(page: str) -> None:
    """Every op of the family: its class, ``__init__`` listing each param once (the manifest's
    tables do not repeat them), ``forward``, and its manifest's tables: each tensor labelled input or
    output, the backward in words, every dtype and shape."""
    assert "<h1" in page and "RoPE Operators" in _text(page.split("<h1", 1)[1])
    assert len(ROPE_OPS) >= 8, ROPE_OPS  # every manifest of the family, read from the registry
    for name in ROPE_OPS:
        m = registry()[name]
        ids = [f"tileops.rope.{name}", f"tileops.rope.{name}.__init__", f"tileops.rope.{name}.forward",
               f"{name}-manifest"]
        at = [page.rindex("<", 0, page.index(f'id="{i}"')) for i in ids]  # the tags that carry the ids
        assert at == sorted(at), f"{name}: class, __init__, forward and manifest out of order"
        nxt = page.find('id="tileops.rope.', at[-1])
        at.append(page.rindex("<", 0, nxt) if nxt > 0 else len(page))
        # what mkdocstrings rendered from the docstrings, then the tables generated from the manifest
        cls, init, forward, manifest = (page[a:b] for a, b in itertools.pairwise(at))
        assert _text(cls).startswith(name), _text(cls)[:80]

        def row(markup: str, arg: str) -> bool:  # a table row that names ``arg`` in its first cell
            return re.search(rf"<tr[^>]*>\s*<td[^>]*>\s*<code>{arg}</code>", markup) is not None

        for p in m.params:  # listed once: under __init__, not again in the manifest's tables
            assert row(init, p.name), f"{name}: no row for {p.name} in __init__"
            assert not row(manifest, p.name), f"{name}: {p.name} listed again in the manifest section"
            if p.has_default:
                assert any(f in _text(init) for f in _default_forms(p.default)), \
                    f"{name}: default {p.default!r} of {p.name} not in __init__"
        assert row(init, "target") and "Which set of kernels serves this op" in _text(init), name
        for t in m.inputs:
            assert row(forward, t.name), f"{name}: forward has no row for {t.name}"
            assert row(manifest, t.name) and all(d in _text(manifest) for d in t.dtypes), f"{name}: {t.name}"
            for dims in t.shapes.values():
                assert "[" + ", ".join(dims) + "]" in _text(manifest), f"{name}: {t.name} shape {dims}"
        for role, tensors in (("input", m.inputs), ("output", m.outputs)):
            for t in tensors:  # the Role cell: an output is never called an input
                cell = re.search(rf"<td[^>]*>\s*<code>{t.name}</code>\s*</td>\s*<td[^>]*>(.*?)</td>", manifest, re.S)
                assert cell and _text(cell.group(1)).startswith(role), f"{name}: {t.name} is not labelled {role}"
        if m.backward is not None:  # in words, never a Python tuple
            said = re.search(r"Backward\s*:\s*(.*?)\.", _text(manifest))
            assert said and said.group(1).split() == ["differentiable", "in", *" and ".join(m.backward.wrt).split()], \
                f"{name}: {said and said.group(0)}"
        forward = _text(forward)
        for section in ("Parameters", "Returns", "Raises"):
            assert section in forward, f"{name}.forward has no {section}"


def test_every_family_has_an_api_page_with_its_ops(site: Path) -> None:
    """Every family's page, written (RoPE's) or generated from its package and manifests (the
    norms'), in both languages: each op's class, ``__init__``, ``forward`` and manifest tables, in
    that order, its shapes as the manifest writes them (a leading ``...`` too)."""
    families = sorted({m.family for m in registry().values()})
    assert "norm" in families
    for family in families:
        for lang in ("", "zh/"):
            page = _page(site, f"{lang}api/{family}")
            for name in sorted(n for n, m in registry().items() if m.family == family):
                ids = [f"tileops.{family}.{name}", f"tileops.{family}.{name}.__init__",
                       f"tileops.{family}.{name}.forward", f"{name}-manifest"]
                at = [page.index(f'id="{i}"') for i in ids]
                assert at == sorted(at), f"{family}/{name}: out of order"
                tables = _text(page[at[-1]:])
                for t in registry()[name].inputs:
                    for dims in t.shapes.values():
                        assert t.like or "[" + ", ".join(dims) + "]" in tables, f"{name}: {t.name} {dims}"


def test_api_page_shows_the_classes_first(site: Path) -> None:
    """The first class comes right after the page's short introduction, and the usage details
    (positions, q and k, torch.compile, costs) after the last class."""
    page = _page(site, "api/rope")
    body = page[page.index("<h1"):]
    first = body.index('id="tileops.rope.')
    last_manifest = max(body.index(f'id="{n}-manifest"') for n in ROPE_OPS)
    intro = _text(body[:first])
    assert len(intro) < 2500, f"{len(intro)} characters of text before the first class:\n{intro[:500]}"
    for anchor in ("positions-and-gradients", "q-and-k-together-out-in-place-views", "torchcompile-and-cuda-graphs"):
        assert body.index(f'id="{anchor}"') > last_manifest, f"{anchor} comes before a class"
        assert f'href="#{anchor}"' in body[:first], f"the introduction does not link to {anchor}"


# ------------------------------------------------------------------------------------- examples
# The scripts of docs/examples/, every page's python blocks and pycon sessions and every docstring
# example are run by tests/test_examples.py.


def test_example_target_through_its_entry_point(tmp_path: Path) -> None:
    """Installed, the example package's target is listed and serves ops named ``target="example"``."""
    src = tmp_path / "tileops_target_example"
    shutil.copytree(EXAMPLE, src)  # build in a copy: setuptools writes build/ and egg-info beside the source
    pip = [sys.executable, "-m", "pip"]
    install = subprocess.run(pip + ["install", "--no-deps", "--no-build-isolation", str(src)], capture_output=True,
                             text=True, timeout=600)
    assert install.returncode == 0, (f"pip install of the example failed (it builds with setuptools, without "
                                     f"build isolation):\n{install.stdout[-2000:]}{install.stderr[-4000:]}")
    try:
        check = textwrap.dedent("""
            import torch
            import tileops
            from tileops.rope import RoPEFwdOp, RoPENeoxPositionIdsFwdOp, YaRNFwdOp

            assert "example" in tileops.target_names(), tileops.target_names()
            for make, args in [
                (lambda t: RoPEFwdOp(rope_layout="interleaved", input_layout="2d", target=t),
                 (torch.randn(2, 33, 3, 64),)),
                (lambda t: YaRNFwdOp(scale=4.0, original_max_position=64, target=t), (torch.randn(300, 96),)),
                (lambda t: RoPENeoxPositionIdsFwdOp(500, rotary_dim=32, target=t),
                 (torch.randn(23, 5, 80), torch.randint(0, 500, (23,)))),
            ]:
                op, ref = make("example"), make("torch")
                out = op(*args)
                assert op.serving_target == "example", op.serving_target
                torch.testing.assert_close(out, ref(*args), rtol=0, atol=0)
            print("ok", tileops.target_names())
        """)
        run = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
        assert run.stdout.startswith("ok") and "'example'" in run.stdout, run.stdout
    finally:
        subprocess.run(pip + ["uninstall", "-y", "tileops-target-example"], capture_output=True, timeout=600)


def test_readme_python_example_runs(tmp_path):
    """The README's Python example, as written, on whatever device this machine has."""
    import re
    import subprocess
    import sys

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    script = tmp_path / "readme_example.py"
    script.write_text(code + "\nassert out.grad_fn is not None and q.grad is not None and step.shape[1] == 1\n"
                      "print('readme example ok')\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0 and "readme example ok" in proc.stdout, proc.stderr[-2000:]
