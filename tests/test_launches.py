"""Only the runtime launches kernels: no module of the tileops package outside ``tileops/runtime/``
launches one, by hand or through a helper (a family declares plans; the runtime binds and runs them).

Two checks: every call of a ``.launch(...)`` method in the package's source is inside
``tileops/runtime/`` (or is the launcher's own definition, ``tileops/compile/entry.py``); and, while
every op of the manifests runs its first case forward and backward on the CPU on the Python runtime
(the native runtime launches through its C trampoline, which no Python frame sees), each launch
of a :class:`tileops.compile.entry.RawKernel` is reached from ``tileops.runtime``: the first frame
outside the launcher's module must be the runtime's, or outside the package (a test, a benchmark)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch

import tileops
from tests.paths import on_python
from tileops import manifest
from tileops.compile import entry
from tileops.workloads import op_class, workload

PACKAGE = Path(tileops.__file__).parent
#: the launcher itself: RawKernel.launch and RawKernel.__call__ are defined there
LAUNCHER = PACKAGE / "compile" / "entry.py"


def _launch_calls(path: Path) -> list[int]:
    """The lines of ``path`` calling a method named ``launch``."""
    tree = ast.parse(path.read_text(), str(path))
    return [n.lineno for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "launch"]


def test_no_module_outside_the_runtime_calls_launch():
    outside = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == LAUNCHER or (PACKAGE / "runtime") in path.parents:
            continue
        outside += [f"{path.relative_to(PACKAGE.parent)}:{line}" for line in _launch_calls(path)]
    assert not outside, f"kernels launched outside tileops/runtime/: {outside}"


def test_the_scan_sees_a_launch():
    """The scan above is not vacuous: it finds the runtime's own launches."""
    assert _launch_calls(PACKAGE / "runtime" / "executor.py")


@pytest.fixture
def launches(monkeypatch):
    """Every RawKernel launch of the test, as the module that reached it (the first frame outside
    the launcher's module)."""
    seen: list[str] = []
    real = entry.RawKernel.launch

    def launch(self, *args, **kwargs):
        frame = sys._getframe(1)
        while frame is not None and frame.f_globals.get("__name__") == entry.__name__:
            frame = frame.f_back
        seen.append(frame.f_globals.get("__name__", "?") if frame is not None else "?")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(entry.RawKernel, "launch", launch)
    return seen


def _by_the_runtime(seen: list[str]) -> list[str]:
    """The launches in ``seen`` reached from a tileops module that is not the runtime's."""
    return [m for m in seen if m.split(".")[0] == "tileops" and not m.startswith("tileops.runtime")]


def _run(name: str, gen: torch.Generator) -> None:
    """Op ``name``'s first case (shrunk), forward and, where the manifest declares one, backward."""
    m = manifest.get(name)
    case = m.cases[0]
    w = workload(m, case, case.dtypes[0] if case.dtypes else m.inputs[0].dtypes[0], shrink=True, generator=gen)
    op = on_python(op_class(name)(**w.params))
    wrt = set(m.backward.wrt) if m.backward else set()
    inputs = {n: t.requires_grad_(True) if n in wrt and t.is_floating_point() else t for n, t in w.inputs.items()}
    out = op(**inputs)
    leaves = [t for t in inputs.values() if t.requires_grad]
    if leaves:
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.grad([o.float().sum() for o in outs], leaves)


@pytest.mark.parametrize("name", ["RMSNormFwdOp", "LayerNormFwdOp", "RoPEDynamicNTKFwdOp", "AttnPrologueFwdOp"])
def test_the_runtime_launches_every_kernel_of_a_call(name, launches, gen):
    """The kernels the families used to launch themselves (the norm backward's two, dynamic NTK's
    tables) and the prologue's: each launch reached from the runtime."""
    _run(name, gen)
    assert launches, "nothing was launched: the check would pass vacuously"
    assert not _by_the_runtime(launches), launches


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(manifest.registry()))
def test_every_op_launches_through_the_runtime(name, launches, gen):
    _run(name, gen)
    assert launches and not _by_the_runtime(launches), launches


#: the modules that hand a call's tensors to kernels: each family's kernel sets
KERNEL_SETS = [*PACKAGE.glob("*/builtin.py"), *PACKAGE.glob("*/*_builtin.py"), PACKAGE / "rope" / "tables.py",
               Path(__file__).parents[1] / "docs" / "examples" / "scale_family" / "tileops" / "scale" / "builtin.py"]


def _stride_reads(path: Path) -> list[int]:
    """The lines of ``path`` reading a tensor's strides (``.stride(...)``)."""
    tree = ast.parse(path.read_text(), str(path))
    return [n.lineno for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "stride"]


def test_no_kernel_set_maps_strides_to_kernel_arguments():
    """A family declares how its kernels see each tensor (a plan's ``dims``) and the runtime computes
    every extent and stride a kernel takes, and applies the fit policy: no kernel set reads a stride."""
    assert len(KERNEL_SETS) >= 7, KERNEL_SETS  # rope, norm, the prologue, attention, decode, NTK, the example
    found = [f"{p.relative_to(p.parents[2])}:{line}" for p in KERNEL_SETS for line in _stride_reads(p)]
    assert not found, f"strides read outside the runtime: {found}"
    assert _stride_reads(PACKAGE / "runtime" / "views.py"), "the scan finds the runtime's own"


def _private_runtime_reads(path: Path) -> list[int]:
    """The lines of ``path`` reading an op's cache or executor (``._bindings``, ``._runtime``)."""
    tree = ast.parse(path.read_text(), str(path))
    return [n.lineno for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr in ("_bindings", "_runtime")]


def test_kernel_sets_run_plans_through_the_ops_door():
    """A kernel set runs its plans through :meth:`tileops.op.Op.run_plan`, not by reaching into the op's
    binding cache and executor (the op's private state, which the op alone keeps)."""
    found = [f"{p.relative_to(p.parents[2])}:{line}"
             for p in (*KERNEL_SETS, PACKAGE / "rope" / "hooks.py") for line in _private_runtime_reads(p)]
    assert not found, f"an op's cache or executor read outside it: {found}"
    assert _private_runtime_reads(PACKAGE / "op.py"), "the scan finds the op's own"
