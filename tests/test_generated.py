"""Tests generated from the manifests: every case x dtype x target is one pytest item.

The matrix comes from :func:`tileops.testing.generated_cases` (the same list ``tileops coverage``
counts). Each op gets a test function ``test_<Op>`` created below from the registry, so items read
``test_RoPEFwdOp[neox-2d-2k-bf16-cpu]`` (``-torch`` for the PyTorch target, ``-cuda`` for the
BUILTIN kernels on a GPU, which carry the ``cuda`` marker and skip without one). Adding a manifest
adds tests with no new code here.

Each item builds the case's inputs (scaled down on the CPU by the manifest's ``cpu_shrink`` rule,
never skipped), runs the op, and checks against the independent float64 reference of its family
(``tests/references.py`` for RoPE, ``tests/references_<family>.py`` in the family's root for any
other: see ``tests/family_references.py``): never against package code. A family from
``TILEOPS_FAMILY_PATH`` gets its items here like an in-tree one.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tileops.cli import main as cli_main
from tileops.manifest import load_files, packaged_files, registry
from tileops.testing import COLUMNS, TOLERANCES, GeneratedCase, generated_cases
from tileops.workloads import op_class, workload

try:  # pytest puts tests/ on sys.path when it is not a package, the repo root when it is
    import family_references
except ImportError:  # pragma: no cover
    from tests import family_references

#: |out - ref| <= atol + rtol * |ref|: one rounding of an fp32 result to the dtype, plus slack.

REGISTRY = registry()
CASES = generated_cases(REGISTRY)


def is_slow(c: GeneratedCase) -> bool:
    """Whether an item is marked ``slow`` (deselected unless ``-m slow`` or ``-m cuda``). The default
    run keeps each op's first case in every dtype, column and direction, and every other case
    forward in its first dtype through the BUILTIN kernels: every case's params and optional
    inputs, every dtype, the torch target and the backward stay covered; the slow run adds their
    products (when this was written, 121 of the 548 CPU items ran by default)."""
    m = REGISTRY[c.op]
    case = m.case(c.case)
    if case is m.cases[0]:
        return False
    return c.backward or c.target != "builtin" or c.dtype != case.dtypes[0]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # Runs at collection: each test_<Op> below is parametrized with that op's generated cases.
    op = getattr(metafunc.function, "op_name", None)
    if op is None or "gcase" not in metafunc.fixturenames:
        return
    params = [pytest.param(c, id=c.param_id, marks=[getattr(pytest.mark, m) for m in c.marks]
                           + ([pytest.mark.slow] if is_slow(c) else []))
              for c in CASES if c.op == op]
    metafunc.parametrize("gcase", params)


def check_case(gcase: GeneratedCase, gen: torch.Generator) -> None:
    m = REGISTRY[gcase.op]
    if gcase.op == "AttnFwdOp" and gcase.device == "cuda" and gcase.target == "builtin" and gcase.backward:
        from tileops.attention.attn_builtin import cuda_enabled

        if not cuda_enabled(backward=True):  # tests/test_attn_fwd.py checks the refusal itself
            pytest.skip("TILEOPS_ATTENTION_CUDA=0 refuses the attention backward's CUDA kernels")
    if gcase.op == "PagedAttnDecodeFwdOp" and gcase.device == "cuda" and gcase.target == "builtin":
        from tileops.attention.decode_builtin import cuda_enabled as decode_cuda_enabled

        if not decode_cuda_enabled():  # tests/test_paged_decode.py checks the refusal itself
            pytest.skip("TILEOPS_ATTENTION_CUDA=0 refuses the paged decode's CUDA kernels")
    w = workload(m, m.case(gcase.case), gcase.dtype, gcase.device, shrink=gcase.shrink, generator=gen)
    before = {k: v.clone() for k, v in w.inputs.items()}
    op = op_class(gcase.op)(**w.params, target=gcase.target)
    seed = f"(dims {w.dims}, generator seed {gen.initial_seed()})"
    if gcase.backward:
        return check_backward(gcase, m, w, op, before, seed, gen)
    result = op(**w.inputs)

    assert op.serving_target == gcase.target
    # one output per output whose `like` input was passed (out, and key_out with key)
    specs = [o for o in m.outputs if o.like in w.inputs]
    outs = result if isinstance(result, tuple) else (result,)
    assert len(outs) == len(specs), seed
    cpu = {k: before[k].cpu() for k in w.inputs}  # the written inputs (a cache) as they were before the call
    refs = family_references.outputs(m, w.params, cpu)
    scales = family_references.scales(m, w.params, cpu)
    for spec, out in zip(specs, outs):
        src = w.inputs[spec.like]
        assert isinstance(out, torch.Tensor)
        dtype = family_references.output_dtype(m, w.params, spec.name, w.inputs)  # out_dtype, else like's
        shape = family_references.output_shape(m, w.params, spec.name, w.dims) or src.shape  # its own, else like's
        assert (out.shape, out.dtype, out.device) == (shape, dtype, src.device), seed
        for name, t in w.inputs.items():
            assert out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr(), f"{spec.name} aliases {name}"
        # The output is a fresh tensor from the op, so instead of pre-filling it with NaN we check
        # that every element was written with a finite value.
        assert bool(torch.isfinite(out).all()), f"non-finite {spec.name} {seed}"
        assert_close(out, refs[spec.name], gcase.dtype, f"{spec.name} {seed}", scales.get(spec.name))
    written = family_references.written(m, w.params, cpu)
    for name, t in w.inputs.items():
        if name in written:  # written in place: against the reference's state after the call (a float8
            # cache at e4m3's precision)
            tol = "float8_e4m3fn" if t.dtype == torch.float8_e4m3fn else gcase.dtype
            assert_close(t.float(), written[name], tol, f"{name} {seed}", scales.get(name))
        else:
            assert torch.equal(t, before[name]), f"input {name} was modified {seed}"


def check_backward(gcase: GeneratedCase, m, w, op, before, seed, gen) -> None:
    """The gradients of sum(out * g) for random g against float64 autograd of the reference."""
    wrt = [n for n in m.backward.wrt if n in w.inputs]
    leaves = {n: w.inputs[n].detach().clone().requires_grad_(True) for n in wrt}
    inputs = {**w.inputs, **leaves}
    result = op(**inputs)
    outs = result if isinstance(result, tuple) else (result,)
    assert all(o.grad_fn is not None for o in outs), f"no grad_fn although {wrt} require grad {seed}"
    gs = [torch.randn(o.shape, generator=gen, dtype=torch.float32).to(o.dtype).to(o.device) for o in outs]
    got = torch.autograd.grad(outs, [leaves[n] for n in wrt], gs)
    for name, t in w.inputs.items():
        assert torch.equal(t, before[name]), f"input {name} was modified {seed}"
    cpu = {k: v.detach().cpu() for k, v in inputs.items()}
    made = [o.name for o in m.outputs if o.like in w.inputs]
    grad_outs = {n: g.cpu() for n, g in zip(made, gs)}
    refs = family_references.grads(m, w.params, cpu, wrt, grad_outs)
    scales = family_references.grad_scales(m, w.params, cpu, wrt, grad_outs)  # a weight's: its terms'
    for name, g in zip(wrt, got):
        assert (g.shape, g.dtype) == (leaves[name].shape, leaves[name].dtype), seed
        assert bool(torch.isfinite(g).all()), f"non-finite gradient of {name} {seed}"
        assert_close(g, refs[name], gcase.dtype, f"grad of {name} {seed}", scales.get(name))


def assert_close(got_t: torch.Tensor, ref: torch.Tensor, dtype: str, seed: str,
                 scale: torch.Tensor | None = None) -> None:
    """``|got - ref| <= atol + rtol * scale``, ``scale`` the reference's own magnitude unless the
    family's reference gives another (:func:`family_references.scales`, for a gradient
    :func:`family_references.grad_scales`)."""
    got = got_t.detach().cpu().double()
    atol, rtol = TOLERANCES[dtype]
    err = (got - ref).abs()
    bad = err > atol + rtol * (ref.abs() if scale is None else scale)
    if bool(bad.any()):
        i = tuple(int(j) for j in bad.nonzero()[0])
        pytest.fail(f"{int(bad.sum())} of {bad.numel()} elements off; first at {list(i)}: got {got[i].item()}, "
                    f"want {ref[i].item()}; max err {err.max().item():.3g} {seed}")


def _test_for(op_name: str):
    def test(gcase: GeneratedCase, gen: torch.Generator) -> None:
        check_case(gcase, gen)

    test.__name__ = test.__qualname__ = f"test_{op_name}"
    test.op_name = op_name  # read by pytest_generate_tests
    return test


for _name in REGISTRY:
    globals()[f"test_{_name}"] = _test_for(_name)


# --------------------------------------------------------------------------- the generation itself


def test_matrix_covers_every_case_dtype_and_column():
    want = {(n, c.label, d) for n, m in REGISTRY.items() for c in m.cases for d in c.dtypes}
    got = {(c.op, c.case, c.dtype) for c in CASES}
    assert got == want
    directions = {n: 2 if m.backward else 1 for n, m in REGISTRY.items()}
    assert len(CASES) == sum(directions[n] for n, _, _ in want) * len(COLUMNS)
    assert {c.op for c in CASES if c.backward} == {n for n, m in REGISTRY.items() if m.backward}
    assert len({c.id for c in CASES}) == len(CASES)
    assert "RoPEFwdOp[neox-2d-2k-bf16-cpu]" in {c.id for c in CASES}
    assert {c.id for c in CASES if c.marks} == {c.id for c in CASES if c.column == "builtin-cuda"}


def _copy_manifest(tmp_path, name="RoPEFwdOpCopy"):
    src = next(p for p in packaged_files() if p.name == "RoPEFwdOp.yaml")
    text = src.read_text()
    assert text.startswith("RoPEFwdOp:")
    path = tmp_path / f"{name}.yaml"
    path.write_text(name + text[len("RoPEFwdOp"):])
    return path


def test_a_new_manifest_adds_tests(tmp_path):
    path = _copy_manifest(tmp_path)
    extra = load_files([path])
    assert list(extra) == ["RoPEFwdOpCopy"]
    before = {c.id for c in generated_cases(REGISTRY)}
    after = {c.id for c in generated_cases({**REGISTRY, **extra})}
    new = after - before
    assert before <= after
    assert "RoPEFwdOpCopy[neox-2d-2k-bf16-cpu]" in new
    assert "RoPEFwdOpCopy[interleaved-1d-odd-fp32-torch]" in new
    assert {i.replace("RoPEFwdOpCopy[", "RoPEFwdOp[") for i in new} == {
        c.id for c in CASES if c.op == "RoPEFwdOp"}


# --------------------------------------------------------------------------- tileops coverage


def test_coverage_counts_the_generated_tests(capsys):
    assert cli_main(["coverage"]) == 0
    out = capsys.readouterr().out
    assert f"{len(CASES)} generated tests" in out
    for name in REGISTRY:
        assert name in out
    # RoPEFwdOp in bf16: one item per case listing bf16 and direction (forward, backward), in each
    # of the three columns.
    n = 2 * sum(1 for c in REGISTRY["RoPEFwdOp"].cases if "bfloat16" in c.dtypes)
    row = next(line for line in out.splitlines() if line.split()[:2] == ["RoPEFwdOp", "bf16"])
    assert row.split()[2:5] == [str(n)] * 3


def test_coverage_markdown_and_extra_files(tmp_path, capsys):
    path = _copy_manifest(tmp_path)
    assert cli_main(["coverage", "--markdown", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| op | dtype | builtin-cpu | torch | builtin-cuda |")
    assert set(lines[1]) <= set("|-: ")
    assert any(line.startswith("| RoPEFwdOpCopy | fp32 |") for line in lines)
    assert not any(line.startswith("| YaRNFwdOp |") for line in lines)  # only the files given


def test_coverage_runs_as_a_command():
    # The console script installed next to this interpreter, else `python -m tileops`.
    exe = shutil.which("tileops", path=str(Path(sys.executable).parent))
    cmd = [exe] if exe else [sys.executable, "-m", "tileops"]
    proc = subprocess.run([*cmd, "coverage"], capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    assert "builtin-cuda" in proc.stdout
