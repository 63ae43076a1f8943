"""A family is a folder: a throwaway family in a temp dir, with no edit to any file of the repository.

The family is ``docs/examples/scale_family`` (the example the adding-an-op page walks through),
copied into a temp dir without its generated ``ops.py``: one op, ``ScaleFwdOp`` (``y = c * x``), a
real TileLang builder, a hook class, the two targets' implementations and a float64 reference.
Pointed at by ``TILEOPS_FAMILY_PATH`` in subprocesses (so this process's registries stay as they
are), it must be generated, listed, checked (and refused with FILE:LINE when broken), served by
BUILTIN (TileLang's C backend) and by ``torch`` on the CPU against its float64 reference, compiled
to CUDA source that nvcc builds, run by ``tileops demo``, counted by ``tileops coverage``, run by
the generated tests and the bad-input tests, and documented by the docs build, following the steps
of docs/adding-an-op.md ("A new family"). About 70 s on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# builds a family copy / the docs site in subprocesses (8-17 s a test on 2 cores); CI runs -m slow
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "docs" / "examples" / "scale_family"
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)

#: every file the family needs, written by hand; ``tileops generate`` adds tileops/scale/ops.py
FILES = [
    "kernels/scale.py",
    "manifests/scale/ScaleFwdOp.yaml",
    "tests/references_scale.py",
    "tileops/scale/__init__.py",
    "tileops/scale/builtin.py",
    "tileops/scale/hooks.py",
    "tileops/scale/reference.py",
    "tileops/scale/torch_impl.py",
]


def _run(cmd: list[str], family: Path, timeout: int = 900, check: bool = True, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "TILEOPS_FAMILY_PATH": str(family), "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=kw.pop("cwd", ROOT), **kw)
    if check:
        assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def _tileops(*args: str, family: Path, check: bool = True) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "tileops", *args], family, check=check)


def _snapshot() -> dict[str, float]:
    """Every file of the repository the family steps could touch, with its modification time."""
    out = {}
    for top in ("tileops", "kernels", "manifests", "docs", "tests"):
        for p in (ROOT / top).rglob("*"):
            if p.is_file() and "__pycache__" not in p.parts:
                out[str(p.relative_to(ROOT))] = p.stat().st_mtime_ns
    for name in ("mkdocs.yml", "pyproject.toml", "setup.py"):
        out[name] = (ROOT / name).stat().st_mtime_ns
    return out


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory):
    """The example family copied into a temp dir and generated there (steps 1-3 of the page)."""
    before = _snapshot()
    root = tmp_path_factory.mktemp("families") / "scale_family"
    shutil.copytree(EXAMPLE, root, ignore=shutil.ignore_patterns("ops.py", "__pycache__"))
    written = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert written == FILES, "the files a new family needs changed: update FILES and docs/adding-an-op.md"
    gen = _tileops("generate", "scale", family=root)
    assert f"{root / 'tileops' / 'scale' / 'ops.py'}: written" in gen.stdout, gen.stdout
    yield root
    assert _snapshot() == before, "a step of the new family changed a file of the repository"


def test_listed_generated_and_checked(family: Path):
    from tileops.manifest import packaged_files

    listed = _tileops("list", family=family).stdout
    row = next(line for line in listed.splitlines() if line.startswith("ScaleFwdOp"))
    assert row.split()[1] == "scale" and "y = c * x" in row
    assert "RoPEFwdOp" in listed  # the in-tree families are still there
    # every generated module matches its manifests: the new one, and the in-tree ones untouched
    assert "ok: every generated module matches" in _tileops("generate", "--check", family=family).stdout
    n = len(packaged_files()) + 1  # one manifest per file in the tree, and the new one
    assert _tileops("check", family=family).stdout.strip() == f"ok: {n} ops in {n} files"
    # broken copies: kernel.static checked against the out-of-tree builder's STATIC, and a bad builder
    text = (family / "manifests" / "scale" / "ScaleFwdOp.yaml").read_text()
    lines = text.splitlines()
    broken = []
    for i, (old, new, fragment) in enumerate((
            ("static: {threads: 256}", "static: {threads: 2048}",
             "kernel.static.threads: expected an integer in [32, 1024], found 2048"),
            ("builder: scale", "builder: scal", "kernel.builder: unknown builder 'scal'"))):
        path = family.parent / f"broken{i}.yaml"
        path.write_text(text.replace(old, new))
        broken.append((path, next(n for n, ln in enumerate(lines, 1) if old in ln), fragment))
    proc = _tileops("check", *(str(p) for p, _, _ in broken), family=family, check=False)
    assert proc.returncode == 1, proc.stderr
    out = proc.stderr.strip().splitlines()
    assert len(out) == len(broken), proc.stderr
    for got, (path, line, fragment) in zip(out, broken):
        assert got.startswith(f"{path}:{line}: ") and fragment in got, got


def test_demo_and_coverage_include_it(family: Path):
    demo = _tileops("demo", "--device", "cpu", family=family).stdout
    row = next(line for line in demo.splitlines() if line.startswith("ScaleFwdOp"))
    assert row.split()[1:5] == ["1d-1m-float16", "65536", "cpu", "builtin"] and row.endswith("ok"), row
    assert re.search(r"^\d+ ok, 0 mismatched$", demo.strip().splitlines()[-1])
    coverage = _tileops("coverage", family=family).stdout
    rows = [line.split() for line in coverage.splitlines() if line.startswith("ScaleFwdOp")]
    # per dtype: 2 cases x (forward, backward) in each of builtin-cpu, torch, builtin-cuda
    assert sorted(r[1] for r in rows) == ["bf16", "fp16", "fp32"] and all(r[2:5] == ["4", "4", "4"] for r in rows)


_SERVE = textwrap.dedent('''
    import json, sys
    import torch
    import tileops
    from tileops.scale import ScaleFwdOp

    sys.path.insert(0, sys.argv[1])
    from references_scale import reference  # the family's float64 reference (imports no tileops)

    TOL = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}  # one rounding of c * x
    g = torch.Generator().manual_seed(int(sys.argv[2]))
    out = {"targets": {}, "classes": sorted(tileops.ops()), "attr": tileops.scale.ScaleFwdOp is ScaleFwdOp}
    for target in ("builtin", "torch"):
        for dtype in TOL:
            for layout, shape, c in (("1d", (1000,), 2.5), ("2d", (37, 129), -0.75)):
                op = ScaleFwdOp(input_layout=layout, c=c, target=target)
                x = torch.randn(shape, generator=g).to(dtype)
                before = x.clone()
                y = op(x)
                want = reference("ScaleFwdOp", {"c": c}, {"x": x})
                err = ((y.double() - want).abs() / want.abs().clamp_min(1)).max().item()
                assert op.serving_target == target and y.dtype == dtype and y.shape == x.shape
                assert torch.equal(x, before) and y.data_ptr() != x.data_ptr()
                assert err <= TOL[dtype], (target, dtype, layout, err)
                # gradients: by the same kernel (BUILTIN) or by autograd (torch)
                leaf = x.clone().requires_grad_(True)
                gy = torch.randn(shape, generator=g).to(dtype)
                (gx,) = torch.autograd.grad(op(leaf), leaf, gy)
                gerr = ((gx.double() - gy.double() * c).abs() / (gy.double() * c).abs().clamp_min(1)).max().item()
                assert gerr <= TOL[dtype], (target, dtype, layout, "grad", gerr)
                # out=, in place, and a strided view
                o = torch.full_like(x, float("nan"))
                assert op(x, out=o) is o and torch.equal(o, y)
                wide = torch.randn(*shape[:-1], shape[-1] * 2, generator=g).to(dtype)[..., ::2]
                ref_w = reference("ScaleFwdOp", {"c": c}, {"x": wide})
                assert ((op(wide).double() - ref_w).abs() / ref_w.abs().clamp_min(1)).max().item() <= TOL[dtype]
                z = x.clone()
                op(z, out=z)
                assert torch.equal(z, y)
                out["targets"].setdefault(target, []).append([str(dtype), layout, err])
    for bad, kind in ((lambda: ScaleFwdOp(c="2"), TypeError), (lambda: ScaleFwdOp(input_layout="3d"), ValueError),
                      (lambda: ScaleFwdOp()(torch.randn(3, 4)), ValueError),
                      (lambda: ScaleFwdOp()(torch.randn(4, dtype=torch.float64)), TypeError)):
        try:
            bad()
        except kind as e:
            assert "ScaleFwdOp" in str(e), e
        else:
            raise AssertionError("no error")
    # torch.compile: one custom op, from the op's manifest (no RoPE names); out= given and not
    op = ScaleFwdOp(c=3.0)
    f = torch.compile(lambda t: op(t) + 1, fullgraph=True)
    t = torch.randn(64, generator=g)
    assert torch.allclose(f(t), op(t) + 1)
    o = torch.empty_like(t)
    assert torch.compile(lambda t, o: op(t, out=o), fullgraph=True)(t, o) is o and torch.equal(o, op(t))
    # the benchmarks time it against its torch target (no baseline of its own), and skip Liger
    from benchmarks.baselines import liger_baseline, make_baseline

    fn, args = make_baseline(op, {"x": t})
    assert torch.equal(fn(*args), ScaleFwdOp(c=3.0, target="torch")(t)) and liger_baseline(op, {"x": t}) is None
    print(json.dumps(out))
''')


def test_builtin_and_torch_serve_it_on_the_cpu(family: Path, tileops_seed: int):
    proc = _run([sys.executable, "-c", _SERVE, str(family / "tests"), str(tileops_seed)], family)
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["attr"] is True and "ScaleFwdOp" in got["classes"] and "RoPEFwdOp" in got["classes"]
    assert {t: len(v) for t, v in got["targets"].items()} == {"builtin": 6, "torch": 6}
    # a later process loads the compiled kernel from tileops' index, without importing TileLang
    warm = _run([sys.executable, "-c", "import sys, torch\nfrom tileops.scale import ScaleFwdOp\n"
                 "x = torch.randn(100)\nassert torch.equal(ScaleFwdOp(c=2.5, target='builtin')(x), (x * 2.5))\n"
                 "print('tilelang' in sys.modules)"], family)
    assert warm.stdout.split() == ["False"], warm.stdout


_FAST = textwrap.dedent('''
    import json, sys
    import torch
    from tileops.runtime import native
    from tileops.scale import ScaleFwdOp

    device = sys.argv[1]
    assert native.module is not None, native.status()
    op = ScaleFwdOp(c=0.5)  # a factor of 0.5 rounds nothing: results compare exactly
    for shape in ((1000,), (4096,)):
        x = torch.randn(shape, device=device)
        for _ in range(3):
            assert torch.equal(op(x), x * 0.5)
        o = torch.full_like(x, float("nan"))
        for _ in range(2):
            assert op(x, out=o) is o and torch.equal(o, x * 0.5)
        y = x.clone()
        for _ in range(2):
            assert op(y, out=y) is y
        assert torch.equal(y, x * 0.25)
    h = op._handle
    x = torch.randn(1000, device=device)
    assert torch.equal(torch.ops.tileops.apply.default(h, [x], "x")[0], x * 0.5)  # as a compiled graph calls it
    print(json.dumps(op._runtime.stats()))
''')


def _fast_path(family: Path, device: str) -> None:
    """ScaleFwdOp's repeated eager calls (new output, out=, in place; two lengths) and a custom-op
    call are served by the native runtime, which has no code of the family's: only the family's
    binding (tileops/scale/builtin.py) says what its kernel takes."""
    proc = _run([sys.executable, "-c", _FAST, device], family)
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    # per length: 3 new-output calls, 2 out=, 2 in place; the first of each signature binds it
    assert stats["hits"] == 2 * (2 + 1 + 1) + 1 and stats["misses"] == 2 * 3, stats


def test_its_eager_calls_take_the_native_fast_path(family: Path):
    from tileops.runtime import native

    if native.module is None:
        pytest.skip(f"no native runtime here: {native.status()}")
    _fast_path(family, "cpu")


@pytest.mark.cuda
def test_its_eager_calls_take_the_native_fast_path_on_cuda(family: Path):
    _fast_path(family, "cuda")


def test_the_generated_tests_run_it(family: Path):
    """tests/test_generated.py and tests/test_bad_inputs.py, unchanged, collect and pass its items."""
    proc = _run([sys.executable, "-m", "pytest", "-q", "-rA", "-n", "0", "-p", "no:cacheprovider", "-k", "ScaleFwdOp",
                 "-m", "slow or not slow",  # every generated item, the ones marked slow too
                 "tests/test_generated.py", "tests/test_bad_inputs.py"], family, timeout=600)
    passed = set(re.findall(r"^PASSED (\S+)", proc.stdout, flags=re.M))
    skipped = re.findall(r"^SKIPPED \[\d+\] .*", proc.stdout, flags=re.M)
    gen = {p.split("::", 1)[1] for p in passed if p.startswith("tests/test_generated.py::test_ScaleFwdOp[")}
    # 2 cases x 3 dtypes x (forward, backward), on the BUILTIN C backend and the torch target
    want = {f"test_ScaleFwdOp[{case}-{dt}-{col}{bwd}]" for case in ("1d-1m", "2d-odd")
            for dt in ("fp16", "bf16", "fp32") for col in ("cpu", "torch") for bwd in ("", "-bwd")}
    assert want <= gen, sorted(want - gen)
    bad = [p for p in passed if p.startswith("tests/test_bad_inputs.py::")]
    assert len(bad) >= 10, bad  # wrong types, choices, ranks, dtypes, rules, a missing target...
    assert any("rows*cols<=2147482624" in p for p in bad), bad  # its own rules, found generically
    if not skipped:  # a GPU: the BUILTIN CUDA kernels ran too
        assert any(p.endswith("-cuda]") for p in gen)


WARMUP = """
import json
from tileops.compile import warmup
from tileops.manifest import get
jobs = warmup.kernel_jobs(["ScaleFwdOp"], "sm_90")
n, _, failures = warmup.warmup(["ScaleFwdOp"], "c", jobs=1)
print(json.dumps({"cuda": sorted({(b, s.dtype, s.threads) for b, s, _, _ in jobs}), "c": n, "failures": failures,
                  "dtypes": list(get("ScaleFwdOp").inputs[0].dtypes),
                  "threads": get("ScaleFwdOp").kernel.static["threads"]}))
"""


def test_warmup_learns_its_kernels_from_the_family(family: Path):
    """``tileops warmup`` (and ``op.compile``) name a family's kernels through its
    ``builtin.kernel_specs``, found by the manifest's family: no op is constructed, nothing in tileops
    names the family. One scale kernel per dtype (``c`` is an argument), built for the CPU here."""
    got = json.loads(_run([sys.executable, "-c", WARMUP], family).stdout.strip().splitlines()[-1])
    assert got["cuda"] == [["scale", d, got["threads"]] for d in sorted(got["dtypes"])], got
    assert got["c"] == len(got["dtypes"]) and not got["failures"], got


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_its_cuda_source_compiles(family: Path, tmp_path: Path):
    src = _tileops("emit", "ScaleFwdOp", "--case", "2d-odd", "--arch", "sm_90", family=family).stdout
    assert "__global__" in src and "scale_cuda" in src
    import tilelang

    tl = Path(tilelang.__file__).parent
    cu = tmp_path / "scale.cu"
    cu.write_text(src)
    subprocess.run([NVCC, "-cubin", "-arch=sm_90", "-std=c++17", f"-I{tl / 'src'}",
                    f"-I{tl / '3rdparty' / 'cutlass' / 'include'}", "-o", str(tmp_path / "scale.cubin"), str(cu)],
                   check=True, capture_output=True, timeout=300)
    assert (tmp_path / "scale.cubin").stat().st_size > 0


def test_it_is_documented(family: Path, tmp_path: Path):
    """The docs build, unchanged, gives the family an API page in the nav, in both languages: the
    class with its signatures (mkdocstrings) and its manifest's tables, and a row of the ops table."""
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[docs]')")
    site = tmp_path / "site"
    _run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)], family, timeout=600)
    for lang in ("", "zh/"):
        page = (site / f"{lang}api" / "scale" / "index.html").read_text(encoding="utf-8")
        for anchor in ("tileops.scale.ScaleFwdOp", "tileops.scale.ScaleFwdOp.__init__",
                       "tileops.scale.ScaleFwdOp.forward", "ScaleFwdOp-manifest"):
            assert f'id="{anchor}"' in page, anchor
        init, manifest = page.split('id="tileops.scale.ScaleFwdOp.__init__"', 1)[1].split('id="ScaleFwdOp-manifest"', 1)
        for param, default in (("input_layout", '"1d"'), ("c", "2.0")):  # under __init__, once
            assert re.search(rf"<td[^>]*>\s*<code>{param}</code>", init), param
            assert not re.search(rf"<td[^>]*>\s*<code>{param}</code>", manifest), param
            assert default in init.replace("&quot;", '"').replace("&#39;", '"'), default
        assert "<code>[rows, cols]</code>" in manifest and "float16, bfloat16, float32" in manifest
        assert "Scale operators" in page and "A tensor times a constant" in page
        home = (site / lang / "index.html").read_text(encoding="utf-8")
        assert 'href="api/scale/#tileops.scale.ScaleFwdOp"' in home  # the ops table
        assert 'href="api/scale/"' in home  # the nav
    assert "本页暂无中文版" in (site / "zh" / "api" / "scale" / "index.html").read_text(encoding="utf-8")


def test_a_bad_family_path_is_refused(tmp_path: Path):
    """A root that is not a directory, or one that would replace an in-tree family package or
    builder (Python would silently take the first), fails at import, naming the variable."""
    clash = tmp_path / "clash"
    (clash / "tileops" / "rope").mkdir(parents=True)
    (clash / "tileops" / "rope" / "__init__.py").write_text("")
    (tmp_path / "kclash" / "kernels").mkdir(parents=True)
    (tmp_path / "kclash" / "kernels" / "rope.py").write_text("build = None\n")
    for root, module, fragment in ((tmp_path / "missing", "tileops", "is not a directory"),
                                   (clash, "tileops", "rope is also in"),
                                   (tmp_path / "kclash", "tileops.kernels", "rope.py is also in")):
        proc = _run([sys.executable, "-c", f"import {module}"], root, check=False)
        assert proc.returncode == 1 and "FamilyPathError: TILEOPS_FAMILY_PATH: " in proc.stderr, proc.stderr[-2000:]
        assert fragment in proc.stderr, proc.stderr[-2000:]


def test_a_test_reference_that_imports_tileops_is_refused(tmp_path: Path):
    try:
        from family_references import check_independent
    except ImportError:  # pragma: no cover - tests/ as a package
        from tests.family_references import check_independent

    for i, line in enumerate(("from tileops.scale.hooks import ScaleFwdHooks", "import kernels.scale as k",
                              "from tileops import workloads")):
        path = tmp_path / f"references_bad{i}.py"
        path.write_text(f'"""A reference."""\nimport torch\n{line}\n')
        with pytest.raises(ImportError, match=rf"references_bad{i}.py:3: a test reference imports"):
            check_independent(path)
    check_independent(EXAMPLE / "tests" / "references_scale.py")
    check_independent(ROOT / "tests" / "references.py")
