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
from tileops.runtime.cache import Bindings
from tileops.runtime.plan import WORK_ALIGN, Output, Plan, PlanError, Ptr, Scalar, Step, Workspace, signature

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
    class Mirror:  # the native executor's index of the call entries, cleared with the cache
        cleared = 0

        def clear(self):
            self.cleared += 1

    mirror, owner, other = Mirror(), object(), object()
    bound = Bindings(limit=3, mirror=mirror)
    made = []

    def make(x):
        made.append(x.shape)
        return _bind(x)

    x = torch.randn(8, 4, generator=gen)
    for _ in range(3):
        bound.bind(owner, ("sum", signature(SUM_ROWS.names, {"x": x})), lambda: make(x))
    assert made == [(8, 4)] and len(bound) == 1 and bound.of(owner) == [bound.bind(owner, ("sum", signature(
        SUM_ROWS.names, {"x": x})), lambda: make(x))]
    bound.bind(other, ("sum", signature(SUM_ROWS.names, {"x": x})), lambda: make(x))  # another owner's own entry
    assert made == [(8, 4)] * 2 and len(bound.of(owner)) == len(bound.of(other)) == 1 and mirror.cleared == 0
    for m in (9, 10):  # past the limit the cache starts over, its mirror with it
        y = torch.randn(m, 4, generator=gen)
        bound.bind(owner, ("sum", signature(SUM_ROWS.names, {"x": y})), lambda: make(y))
    assert len(bound) == 1 and made[-1] == (10, 4) and mirror.cleared == 1 and bound.of(other) == []
    bound.clear()
    assert len(bound) == 0 and mirror.cleared == 2


def test_an_op_keeps_its_bindings_in_one_cache(gen):
    """The call's entry and the general path's (autograd's forward here) land in the op's one cache, and
    forgetting the op's bindings empties it and the executor's index."""
    from tileops.rope import RoPEFwdOp

    op = RoPEFwdOp("neox", "2d")
    x = torch.randn(1, 4, 2, 64, generator=gen)
    op(x)
    op(x.clone().requires_grad_(True))  # the general path: the kernel set binds what it launches with
    kernels = op._impl_for(op._check_call({"x": x, "position_ids": None, "key": None}))
    (call,) = [e for e in op._bindings.values() if isinstance(e, tuple)]  # the call's: (kernel set, its binding)
    (general,) = op._bindings.of(kernels)
    assert call[0] is kernels and len(op._bindings) == 2 and general is not call[1] and general is not None
    assert op._bindings.mirror is op._runtime
    op._forget_bindings()
    assert len(op._bindings) == 0 and op._runtime.stats()["bindings"] == 0


def test_a_plan_names_what_does_not_fit():
    with pytest.raises(PlanError, match="no tensor or workspace 'nope'"):
        Plan("bad", inputs=("x",), outputs=(), steps=(Step("k", {"X": Ptr("nope")}),))
    with pytest.raises(PlanError, match="output y: 'z' is not an input"):
        Plan("bad", inputs=("x",), outputs=(Output("y", like="z"),), steps=())
    with pytest.raises(PlanError, match="'s' is not among its scalars"):
        Plan("bad", inputs=("x",), outputs=(), steps=(Step("k", {"S": Scalar("s")}),))
    with pytest.raises(PlanError, match="dtype 'float7'"):
        Plan("bad", inputs=("x",), outputs=(), workspaces=(Workspace("w", "float7", "1"),), steps=())
    with pytest.raises(PlanError, match="output y: dtype 'fp32': expected one of float32, "):
        Plan("bad", inputs=("x",), outputs=(Output("y", like="x", dtype="fp32"),), steps=())
    with pytest.raises(PlanError, match="output y: dtype 'float32': .*no dtype_of beside it"):
        Plan("bad", inputs=("x",), outputs=(Output("y", like="x", dtype="float32", dtype_of="x"),), steps=())
    with pytest.raises(PlanError, match=r"error words are 0 \.\. 3, got \{'x': 4\}"):
        Plan("bad", inputs=("x",), outputs=(), checks={"x": 4}, steps=())
    x = torch.zeros(4, 4)
    with pytest.raises(PlanError, match=r"workspace part's size: `G \* x_n`: unknown name 'G'"):
        SUM_ROWS.bind(kernels(), {"x": x}, {}, env={})
    typo = Plan("typo", inputs=("x",), outputs=(), steps=(Step("partials", {"Q": Ptr("x")}),))
    with pytest.raises(PlanError, match="kernel partials has no argument 'Q'"):
        typo.bind(kernels(), {"x": x}, {}, env={})


# ----------------------------------------------------------------------------- views and the fit policy
from tileops.runtime.plan import Dims, Flat, Rows, Size, Stride  # noqa: E402
from tileops.runtime.views import Misfit, layout  # noqa: E402

ROTATED = Dims({4: "bshd", 3: "shd", 2: "sd"})


def _plan(dims, **kw) -> Plan:
    return Plan("views", inputs=("x", "p"), outputs=(Output("out", like="x"),), steps=(), dims=dims, **kw)


def test_extents_and_strides_come_from_the_declared_dims():
    """Every extent and stride a kernel takes, from the dims a plan declares: a dim of extent 1, one the
    rank lacks, or an absent tensor gives stride 0 (never read), strides count in the tensor's unit."""
    x = torch.empty(2, 4, 16, 64).transpose(1, 2)  # HF's [B, H, S, D] seen as [B, S, H, D]
    seen = layout({"x": ROTATED, "p": Dims({1: "s", 2: "bs"}, vector=False)}, {"x": x, "p": torch.arange(16)}, 8)
    assert seen["x"] == {"b": (2, 4096), "s": (16, 64), "h": (4, 1024), "d": (64, 1)}
    assert seen["p"] == {"s": (16, 1)}  # [S]: no batch dim
    one = layout({"x": ROTATED}, {"x": torch.empty(1, 1, 4, 64)}, 8)["x"]
    assert one["b"] == (1, 0) and one["s"] == (1, 0) and one["h"] == (4, 64)
    ids = layout({"x": ROTATED}, {"x": torch.empty(5, 4, 64)}, 8)["x"]
    assert "b" not in ids and ids["s"] == (5, 256)
    plan = Plan("views", inputs=("x", "p"), outputs=(), steps=(), dims={"x": ROTATED, "p": Dims("bs", vector=False)})
    assert plan._stride(seen, Stride("x", "h"), 8) == 128 and plan._stride(seen, Stride("x", "h", True), 8) == 1024
    assert plan._stride(seen, Stride("x", "b"), {"x": 2}) == 2048  # a unit by tensor
    assert plan._stride({}, Stride("x", "b"), 8) == 0  # absent
    with pytest.raises(PlanError, match="stride 64 is not a multiple of 128"):
        plan._stride(seen, Stride("x", "s"), 128)
    with pytest.raises(PlanError, match="no dims declared for 'y'"):
        Plan("views", inputs=("x",), outputs=(), steps=(Step("k", {"S": Size("y", "s")}),))


def test_rows_are_grouped_across_the_tensors_of_a_plan():
    """:class:`Rows`: the leading dims of every such tensor merge into at most two runs (row r at
    ``(r // NH) * st + (r % NH) * sh``); a view that needs a third is named, the one with most breaks."""
    qkv = torch.empty(8, 12, 64)
    q = qkv[:, 4:8]  # 4 heads of 12: two runs
    seen = layout({"x": Rows(), "out": Rows()}, {"x": q, "out": torch.empty(8, 4, 64)}, 8)
    assert seen["x"] == {"m": (32, 768), "h": (4, 64), "d": (64, 1)}
    assert seen["out"] == {"m": (32, 256), "h": (4, 64), "d": (64, 1)}
    assert layout({"x": Rows()}, {"x": torch.empty(4, 6, 8, 64)[::2, ::2, ::3]}, 1) == Misfit("x", "rows")


def test_spans_stand_for_the_strides_of_dims_of_extent_one():
    """``span``: a dim of extent 1, or one the rank lacks (varlen's batch), strides over what lies
    inside it, and an expanded dim (stride 0) does not fit with vectors (a TMA descriptor's rules)."""
    v = Dims({4: "bshd", 3: "shd"}, span=True)
    assert layout({"q": v}, {"q": torch.empty(7, 3, 64)}, 8)["q"] == {"b": (1, 1344), "s": (7, 192), "h": (3, 64),
                                                                     "d": (64, 1)}
    assert layout({"q": v}, {"q": torch.empty(2, 1, 3, 64)}, 8)["q"]["s"] == (1, 192)
    expanded = torch.empty(1, 5, 1, 64).expand(2, 5, 3, 64)
    assert layout({"q": v}, {"q": expanded}, 8) == Misfit("q", "alignment")
    assert not isinstance(layout({"q": v}, {"q": expanded}, 1), Misfit)  # no vectors: any stride


def test_the_fit_policy_copies_buffers_or_refuses_as_declared():
    """:meth:`Plan.place`: an input that does not fit is copied, an output written through a buffer and
    copied back, an output in place over a copied input through a buffer too; a tensor declared
    ``refuse`` is a ValueError naming it, with what was expected and what came."""
    plan = _plan({"x": ROTATED, "out": ROTATED, "p": Dims("s", vector=False, dense=True)})
    x = torch.randn(2, 4, 3, 16)
    strided = torch.randn(2, 4, 3, 16, 2)[..., 0]  # a last dim that is not contiguous
    placed = plan.place({"x": strided, "p": None}, {"out": None}, 1)
    assert placed.inputs["x"].is_contiguous() and torch.equal(placed.inputs["x"], strided)
    assert placed.writes["out"] is placed.outs["out"]  # a new output that fits: no buffer
    given = torch.zeros(2, 4, 3, 16, 2)[..., 0]
    placed = plan.place({"x": x, "p": None}, {"out": given}, 1)
    assert placed.inputs["x"] is x and placed.writes["out"] is not given and placed.outs["out"] is given
    placed.writes["out"].copy_(x)
    placed.copy_back()
    assert torch.equal(given, x)
    inplace = torch.randn(2, 4, 3, 16, 2)[..., 0]
    placed = plan.place({"x": inplace, "p": None}, {"out": inplace}, 1)
    assert placed.inputs["x"] is not inplace and placed.writes["out"] is not inplace
    assert placed.outs["out"] is inplace and placed.writes["out"] is not placed.inputs["x"]
    placed = plan.place({"x": x, "p": torch.arange(8)[::2]}, {"out": x}, 1)  # not one dense run: copied
    assert placed.inputs["p"].is_contiguous() and placed.writes["out"] is x
    off = torch.zeros(2 * 4 * 3 * 16 + 1)[1:].view(2, 4, 3, 16)  # 4 bytes into a 16-byte vector
    assert plan.place({"x": off, "p": None}, {"out": None}, 4).inputs["x"].data_ptr() % 16 == 0
    refusing = _plan({"x": Dims("bshd", refuse="any"), "p": Dims("s", vector=False)})
    with pytest.raises(ValueError, match=r"views: x: expected its data pointer and strides on a multiple of 4 "
                                         r"elements \(16 bytes: the CUDA kernel's vectors\), got data pointer "
                                         r"offset \d+ bytes mod 256, strides \[192, 48, 16, 1\]"):
        refusing.place({"x": off, "p": None}, {"out": None}, 4)
    with pytest.raises(ValueError, match=r"views: x: expected a contiguous last dim, got strides \[384, 96, 32, 2\]"):
        refusing.place({"x": strided, "p": None}, {"out": None}, 1)
    aligned_only = _plan({"x": Dims("bshd", refuse="alignment")})
    assert aligned_only.place({"x": strided, "p": None}, {"out": None}, 4).inputs["x"].is_contiguous()
    with pytest.raises(ValueError, match="x: expected its data pointer and strides"):
        aligned_only.place({"x": off, "p": None}, {"out": None}, 4)
    flat = _plan({"x": Flat(), "out": Flat()})
    assert flat.place({"x": x.transpose(0, 1), "p": None}, {"out": None}, 1).inputs["x"].is_contiguous()


def test_expressions_see_the_inputs_extents():
    """A workspace's size, an own-shape output and a value may name an input's extents as
    ``<tensor>_<dim>``: every letter of its dims (1 where its rank lacks one), a row tensor's rows."""
    from tileops.runtime.views import extents

    got = extents({"x": ROTATED, "r": Rows(), "f": Flat(), "p": Dims("s", vector=False)},
                  {"x": torch.empty(5, 3, 8), "r": torch.empty(2, 3, 4), "f": torch.empty(2, 5), "p": None})
    assert got == {"x_b": 1, "x_s": 5, "x_h": 3, "x_d": 8, "r_m": 6, "r_d": 4, "f_n": 10}
    x = torch.zeros(6, 24)
    assert _bind(x).work_bytes == -(-G * 24 * 4 // WORK_ALIGN) * WORK_ALIGN  # "G * x_n" fp32
    assert SUM_ROWS.bind(kernels(), {"x": x}, {}, env={"G": G, "x_n": 2}).work_bytes == WORK_ALIGN  # env wins
