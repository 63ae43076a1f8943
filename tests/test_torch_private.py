"""torch's private API behind tileops/torch_private.py: every symbol resolves in the installed torch,
and a torch without one gets the documented stand-in, or an error naming the symbol at the use."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.modules.module as nn_module

import tileops.torch_private as tp
from tileops import autograd, op as op_module
from tileops.compile import entry
from tileops.rope import RoPEFwdOp
from tileops.runtime import library

ROOT = Path(__file__).resolve().parents[1]
CUDA_BUILD = torch.version.cuda is not None


def _fresh() -> ModuleType:
    """A new copy of tileops/torch_private.py, resolved against torch as it is now (the package's
    copy resolved once, at import)."""
    spec = importlib.util.spec_from_file_location("torch_private_fresh", ROOT / "tileops" / "torch_private.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _newly_missing(fresh: ModuleType) -> list[str]:
    """What ``fresh`` found missing beyond what the package's copy did (a CPU build lacks the raw stream)."""
    return [m for m in fresh.MISSING if m not in tp.MISSING]


def test_every_symbol_resolves_in_this_torch():
    expected_missing = [] if CUDA_BUILD else ["torch._C._cuda_getCurrentRawStream"]
    assert tp.MISSING == expected_missing, f"torch {torch.__version__} lacks {tp.MISSING}"
    assert tp.internal_overlap is torch._debug_has_internal_overlap
    assert tp.below_autograd is torch._C._AutoDispatchBelowAutograd
    assert tp.DelayedError is torch._C._functions.DelayedError
    if CUDA_BUILD:
        assert tp.current_raw_stream is torch._C._cuda_getCurrentRawStream
    assert tp._hooks_known
    # the users hold the resolved objects themselves: no lookup per call
    assert op_module.internal_overlap is tp.internal_overlap and entry.current_raw_stream is tp.current_raw_stream
    assert library.below_autograd is tp.below_autograd and library.DelayedError is autograd.DelayedError is tp.DelayedError


def test_without_debug_has_internal_overlap_the_strides_give_the_same_refusal(monkeypatch, gen):
    monkeypatch.delattr(torch, "_debug_has_internal_overlap")
    fresh = _fresh()
    assert _newly_missing(fresh) == ["torch._debug_has_internal_overlap"]
    monkeypatch.undo()
    base = torch.randn(6, 8, generator=gen)
    for t in (base, base.t(), base[:, ::2], base[:1].expand(6, 8), torch.randn(1, 8).expand(5, 8)[1:],
              torch.randn(8)[None].expand(1, 8), torch.randn(4, 1, 3).expand(4, 2, 3), torch.empty(0, 1).expand(0, 4)):
        assert (fresh.internal_overlap(t) == 1) == (torch._debug_has_internal_overlap(t) == 1), t.stride()
    asked = []
    monkeypatch.setattr(op_module, "internal_overlap", lambda t: asked.append(t) or fresh.internal_overlap(t))
    op = RoPEFwdOp(input_layout="1d")
    with pytest.raises(ValueError, match="out: .*share memory"):
        op(torch.randn(20, 16, generator=gen), out=torch.empty(20, 1).expand(20, 16))
    assert asked, "the op did not ask the stand-in"


def test_without_cuda_get_current_raw_stream_the_public_stream_stands_in(monkeypatch):
    monkeypatch.delattr(torch._C, "_cuda_getCurrentRawStream", raising=False)
    fresh = _fresh()
    assert "torch._C._cuda_getCurrentRawStream" in fresh.MISSING
    assert fresh.current_raw_stream.__module__ == "torch_private_fresh"  # the stand-in, not torch's
    monkeypatch.undo()
    if torch.cuda.is_available():
        assert fresh.current_raw_stream(0) == torch._C._cuda_getCurrentRawStream(0)
        with torch.cuda.stream(torch.cuda.Stream()):  # a side stream: its own handle, not the default's 0
            assert fresh.current_raw_stream(0) == torch._C._cuda_getCurrentRawStream(0) != 0


def test_without_auto_dispatch_below_autograd_the_use_names_it(monkeypatch):
    monkeypatch.delattr(torch._C, "_AutoDispatchBelowAutograd")
    fresh = _fresh()
    monkeypatch.undo()
    assert _newly_missing(fresh) == ["torch._C._AutoDispatchBelowAutograd"]
    monkeypatch.setattr(library, "below_autograd", fresh.below_autograd)
    with pytest.raises(RuntimeError, match=r"^tileops needs torch\._C\._AutoDispatchBelowAutograd, which this torch "
                                           + re.escape(f"({torch.__version__}) lacks: a backward with create_graph=True")):
        library._apply_backward_grad(0, [], [], "")


def test_without_delayed_error_a_python_node_refuses_double_backward(monkeypatch, gen):
    monkeypatch.delattr(torch._C._functions, "DelayedError")
    fresh = _fresh()
    monkeypatch.undo()
    assert _newly_missing(fresh) == ["torch._C._functions.DelayedError"]
    a, b = (torch.randn(3, generator=gen, requires_grad=True) for _ in range(2))
    one = fresh.DelayedError("no second derivative", 1)(a)
    two = fresh.DelayedError("no second derivative", 2)(a, b)
    assert isinstance(one, torch.Tensor) and torch.equal(one, a)
    assert isinstance(two, tuple) and torch.equal(two[0], a) and torch.equal(two[1], b)
    with pytest.raises(RuntimeError, match="^no second derivative$"):
        two[1].sum().backward()
    monkeypatch.setattr(autograd, "DelayedError", fresh.DelayedError)
    op = RoPEFwdOp(input_layout="2d")
    x = torch.randn(1, 5, 2, 16, generator=gen, requires_grad=True)
    (gx,) = torch.autograd.grad(op(x).square().sum(), x, create_graph=True)
    (want,) = torch.autograd.grad(op(x).square().sum(), x)
    assert torch.equal(gx, want)
    with pytest.raises(RuntimeError, match="RoPEFwdOp: double backward"):
        gx.sum().backward()


@pytest.mark.parametrize("missing", ["_global_forward_hooks", "_global_forward_pre_hooks", "_forward_hooks",
                                     "_forward_pre_hooks"])
def test_without_a_forward_hook_attribute_every_module_counts_as_hooked(monkeypatch, missing):
    linear = torch.nn.Linear(2, 2)
    assert not tp.forward_hooked([linear])
    handle = linear.register_forward_pre_hook(lambda m, a: None)
    assert tp.forward_hooked([linear])
    handle.remove()
    if missing.startswith("_global"):
        monkeypatch.delattr(nn_module, missing)
    else:
        init = torch.nn.Module.__init__

        def init_without(self, *args, **kwargs):  # a torch whose modules keep their hooks elsewhere
            init(self, *args, **kwargs)
            object.__delattr__(self, missing)

        monkeypatch.setattr(torch.nn.Module, "__init__", init_without)
    fresh = _fresh()
    monkeypatch.undo()
    owner = "torch.nn.modules.module" if missing.startswith("_global") else "torch.nn.Module"
    assert _newly_missing(fresh) == [f"{owner}.{missing}"]
    assert fresh.forward_hooked([linear])  # so the caller calls the modules (three matmuls, not one)


def test_a_global_hook_counts(monkeypatch):
    linear = torch.nn.Linear(2, 2)
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: None)
    try:
        assert tp.forward_hooked([linear])
    finally:
        handle.remove()
    assert not tp.forward_hooked([linear])


def test_tileops_imports_in_a_torch_lacking_every_symbol():
    """Importing tileops (and the modules that use the symbols) never fails for want of one."""
    code = """
import torch, torch.nn.modules.module as m
for owner, name in ((torch, "_debug_has_internal_overlap"), (torch._C, "_cuda_getCurrentRawStream"),
                    (torch._C, "_AutoDispatchBelowAutograd"), (torch._C._functions, "DelayedError"),
                    (m, "_global_forward_hooks"), (m, "_global_forward_pre_hooks")):
    if hasattr(owner, name):
        delattr(owner, name)
import tileops, tileops.rope, tileops.autograd, tileops.runtime.library, tileops.integrations.transformers_prologue
from tileops import torch_private
print(" ".join(torch_private.MISSING))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["torch._debug_has_internal_overlap", "torch._C._cuda_getCurrentRawStream",
                                   "torch._C._AutoDispatchBelowAutograd", "torch._C._functions.DelayedError",
                                   "torch.nn.modules.module._global_forward_hooks",
                                   "torch.nn.modules.module._global_forward_pre_hooks"]
