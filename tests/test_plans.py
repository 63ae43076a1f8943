"""Plans (:mod:`tileops.runtime.plan`): a call's kernels in order, the workspaces they share, every
argument by its role, bound once per call signature and run by both executors.

The test plan is the docs' worked example (``docs/examples/two_kernel_plan.py``): two TileLang
kernels compiled for the CPU, ``partials`` summing each of ``G`` blocks of rows of ``x [M, N]`` into
a row of a per-call fp32 workspace, ``reduce`` adding the ``G`` rows into ``y [N]`` times a per-call
scalar. The reference is float64 torch."""

# (no `from __future__ import annotations`: TileLang reads the prim_funcs' annotations as objects)
import importlib.util
from pathlib import Path

import pytest
import torch

from tests.paths import native_module
from tileops.runtime import executor
from tileops.runtime.plan import WORK_ALIGN, Bound, Output, Plan, PlanError, Ptr, Scalar, Step, Workspace, signature

EXAMPLE = Path(__file__).parents[1] / "docs" / "examples" / "two_kernel_plan.py"
_spec = importlib.util.spec_from_file_location("two_kernel_plan", EXAMPLE)
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)
SUM_ROWS, G, kernels, _bind = example.SUM_ROWS, example.G, example.kernels, example.bind


@pytest.mark.parametrize("which", ["python", "native"])
def test_a_plan_of_two_kernels_and_a_workspace_runs_on_both_executors(which, gen):
    # a runtime of no op (handle 0): the plan's names are its own, and nothing is checked
    rt = executor.PythonRuntime(0) if which == "python" else native_module().Dispatch(0, ("x",), ("y",), (0,), ())
    x = torch.randn(37, 24, generator=gen)
    b = _bind(x)
    assert [launch.kernel for launch in b.launches] == [kernels()["partials"], kernels()["reduce"]]
    # one per-call workspace of G fp32 rows (384 bytes), rounded up to the allocation's 256-byte steps
    assert b.work == (0,) and b.work_bytes == -(-G * 24 * 4 // WORK_ALIGN) * WORK_ALIGN == 512
    for scale in (1, 3, -2):  # a per-call scalar: the same binding serves every value
        y = rt.execute(b, {"x": x}, {}, (scale,))
        assert y.shape == (24,) and y.dtype == torch.float32
        want = x.double().sum(0) * scale
        # each output sums 37 fp32 values, in two stages: |error| <= 37 * 2^-24 * sum|x| (fp32 sums)
        bound = 37 * 2.0**-24 * x.double().abs().sum(0) * abs(scale)
        assert ((y.double() - want).abs() <= bound).all()
    # a given output is written where it lies; a row-strided x is read where it lies
    wide = torch.randn(37, 48, generator=gen)[:, ::1][:, :24]
    out = torch.full((24,), float("nan"))
    got = rt.execute(_bind(wide, {"y": out}), {"x": wide}, {"y": out}, (1,))
    assert got is out and torch.allclose(out.double(), wide.double().sum(0), rtol=0, atol=1e-4)


def test_plans_are_bound_once_per_signature(gen):
    bound = Bound(limit=3)
    made = []

    def make(x):
        made.append(x.shape)
        return _bind(x)

    x = torch.randn(8, 4, generator=gen)
    for _ in range(3):
        bound.get(("sum", signature(SUM_ROWS.names, {"x": x})), lambda: make(x))
    assert made == [(8, 4)] and len(bound) == 1
    for m in (9, 10, 11):  # past the limit the cache starts over
        y = torch.randn(m, 4, generator=gen)
        bound.get(("sum", signature(SUM_ROWS.names, {"x": y})), lambda: make(y))
    assert len(bound) == 1 and made[-1] == (11, 4)


def test_a_plan_names_what_does_not_fit():
    with pytest.raises(PlanError, match="no tensor or workspace 'nope'"):
        Plan("bad", inputs=("x",), outputs=(), steps=(Step("k", {"X": Ptr("nope")}),))
    with pytest.raises(PlanError, match="output y: 'z' is not an input"):
        Plan("bad", inputs=("x",), outputs=(Output("y", like="z"),), steps=())
    with pytest.raises(PlanError, match="'s' is not among its scalars"):
        Plan("bad", inputs=("x",), outputs=(), steps=(Step("k", {"S": Scalar("s")}),))
    with pytest.raises(PlanError, match="dtype 'float7'"):
        Plan("bad", inputs=("x",), outputs=(), workspaces=(Workspace("w", "float7", "1"),), steps=())
    with pytest.raises(PlanError, match=r"error words are 0 \.\. 3, got \{'x': 4\}"):
        Plan("bad", inputs=("x",), outputs=(), checks={"x": 4}, steps=())
    x = torch.zeros(4, 4)
    with pytest.raises(PlanError, match=r"partials.M: `M`: unknown name 'M'"):
        SUM_ROWS.bind(kernels(), {"x": x}, {}, env={"N": 4, "xs": 4, "G": G})
    typo = Plan("typo", inputs=("x",), outputs=(), steps=(Step("partials", {"Q": Ptr("x")}),))
    with pytest.raises(PlanError, match="kernel partials has no argument 'Q'"):
        typo.bind(kernels(), {"x": x}, {}, env={})
