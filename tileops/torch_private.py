"""torch's private API, every symbol tileops uses, resolved once when this module is imported.

torch keeps no promise about a name with a leading underscore, so tileops reads each one here and
nowhere else, into a module global its users import (no lookup per call), and says what happens in
a torch that lacks it: a public stand-in where one exists, else an error at the use, naming the
symbol; importing tileops never fails for want of one. ``tests/test_torch_private.py`` checks that
each resolves in the installed torch and what removing each one gives.

The symbols, all older than torch 2.0 as far as known, so expected in every torch this project
supports (>= 2.4); checked on 2.13 (a CPU build, which lacks ``torch._C._cuda_getCurrentRawStream``:
only a CUDA build has it) when this was written:

* ``torch._debug_has_internal_overlap(t)`` (:data:`internal_overlap`): ``tileops/op.py``, whether
  an ``out=`` tensor or an input the op writes has elements sharing memory (an expanded view), which
  the op refuses as torch refuses an in-place write into one. Stand-in: the same answer from the
  public sizes and strides (torch's rule: 1 where a dim of more than one element has stride 0),
  a Python loop over the dims instead of one C call.
* ``torch._C._cuda_getCurrentRawStream(index)`` (:data:`current_raw_stream`):
  ``tileops/compile/entry.py`` (``RawKernel.stream``), the current CUDA stream as an integer, at
  every launch on a GPU. Stand-in: ``torch.cuda.current_stream(index).cuda_stream``, which builds a
  ``torch.cuda.Stream`` object per launch (Python work on every launch, where torch's is one C call;
  not measured). A CPU build of torch has neither, and tileops launches nothing on a GPU there.
* ``torch._C._AutoDispatchBelowAutograd`` (:data:`below_autograd`): ``tileops/runtime/library.py``,
  the native runtime's backward with ``create_graph=True``, which calls ``tileops::apply_backward``
  below autograd (the op has no backward formula; autograd's node is the :data:`DelayedError` after
  it). No public stand-in: such a backward raises a RuntimeError naming the symbol.
* ``torch._C._functions.DelayedError`` (:data:`DelayedError`): ``tileops/autograd.py`` and
  ``tileops/runtime/library.py``, gradients that raise only if differentiated again ("double backward
  is not supported"). Stand-in: a ``torch.autograd.Function`` doing the same in Python (one Python
  node per backward with ``create_graph=True``).
* ``torch.nn.Module._forward_hooks`` and ``_forward_pre_hooks`` (each module's) and
  ``torch.nn.modules.module._global_forward_hooks`` and ``_global_forward_pre_hooks``
  (:func:`forward_hooked`): ``tileops/integrations/transformers_prologue.py``, whether q, k and v
  may be computed by one matmul of the concatenated weights without skipping a hook. Without them,
  every module counts as hooked: q, k and v take three matmuls (the projections called as modules)
  instead of one.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.modules.module as _nn_module

__all__ = ["internal_overlap", "current_raw_stream", "below_autograd", "DelayedError", "forward_hooked",
           "MISSING"]

#: the symbols this torch lacks, by their full names (empty on a torch tileops was written for)
MISSING: list[str] = []

_NOT_FOUND = object()


def _resolve(owner: Any, path: str, name: str) -> Any:
    """``owner.<name>``, or :data:`_NOT_FOUND` (noted in :data:`MISSING` as ``path.name``)."""
    got = getattr(owner, name, _NOT_FOUND)
    if got is _NOT_FOUND:
        MISSING.append(f"{path}.{name}")
    return got


def _lacking(symbol: str, what: str) -> Callable[..., Any]:
    """A stand-in for ``symbol`` that raises, when called, the RuntimeError naming it: ``what`` is the
    work that needs it."""

    def missing(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"tileops needs {symbol}, which this torch ({torch.__version__}) lacks: {what}")

    return missing


# ------------------------------------------------------------------ torch._debug_has_internal_overlap
def _overlap_from_strides(t: torch.Tensor) -> int:
    """torch's answer from the public sizes and strides: 0 (no) for a contiguous tensor (an empty one
    too), 1 (yes) where a dim of more than one element has stride 0, else 2 (too hard to tell)."""
    if t.is_contiguous():
        return 0
    return 1 if any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride())) else 2


#: ``internal_overlap(t) == 1``: some elements of ``t`` share memory
internal_overlap: Callable[[torch.Tensor], int] = _resolve(torch, "torch", "_debug_has_internal_overlap")
if internal_overlap is _NOT_FOUND:
    internal_overlap = _overlap_from_strides

# ------------------------------------------------------------------ torch._C._cuda_getCurrentRawStream
#: ``current_raw_stream(device_index)``: the current CUDA stream of that GPU, as an integer
current_raw_stream: Callable[[int], int] = _resolve(torch._C, "torch._C", "_cuda_getCurrentRawStream")
if current_raw_stream is _NOT_FOUND:
    def current_raw_stream(device_index: int) -> int:
        return torch.cuda.current_stream(device_index).cuda_stream

# ------------------------------------------------------------------ torch._C._AutoDispatchBelowAutograd
#: ``with below_autograd():`` dispatches below autograd (records nothing)
below_autograd: Callable[[], Any] = _resolve(torch._C, "torch._C", "_AutoDispatchBelowAutograd")
if below_autograd is _NOT_FOUND:
    below_autograd = _lacking("torch._C._AutoDispatchBelowAutograd",
                             "a backward with create_graph=True through the native runtime")


# ------------------------------------------------------------------ torch._C._functions.DelayedError
class _Raise(torch.autograd.Function):
    """The stand-in's node: passes its tensors through and raises its message in the backward."""

    @staticmethod
    def forward(ctx: Any, message: str, *tensors: torch.Tensor) -> Any:
        ctx.message = message
        return tensors if len(tensors) != 1 else tensors[0]

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise RuntimeError(ctx.message)


class _DelayedErrorStandIn:
    """``DelayedError(message, n)(*tensors)`` in Python: the tensors (one, or a tuple), whose gradient
    raises ``message``."""

    def __init__(self, message: str, num_inputs: int) -> None:
        self.message = message

    def __call__(self, *tensors: torch.Tensor) -> Any:
        return _Raise.apply(self.message, *tensors)


#: ``DelayedError(message, n)(*tensors)``: ``tensors`` whose gradient raises ``message``
DelayedError: Any = _resolve(getattr(torch._C, "_functions", None), "torch._C._functions", "DelayedError")
if DelayedError is _NOT_FOUND:
    DelayedError = _DelayedErrorStandIn

# ------------------------------------------------------------------ torch.nn.Module's forward hooks
_global_hooks = tuple(_resolve(_nn_module, "torch.nn.modules.module", n)
                      for n in ("_global_forward_hooks", "_global_forward_pre_hooks"))
_probe = torch.nn.Module()
_own_hooks = tuple(n for n in ("_forward_hooks", "_forward_pre_hooks")
                   if _resolve(_probe, "torch.nn.Module", n) is not _NOT_FOUND)
_hooks_known = len(_own_hooks) == 2 and _NOT_FOUND not in _global_hooks
del _probe


def forward_hooked(modules: Any) -> bool:
    """Whether a forward hook (one of a module of ``modules``, or a global one) may run when those
    modules are called; True, so the modules are called, where this torch lacks the attributes."""
    if not _hooks_known:
        return True
    return bool(_global_hooks[0] or _global_hooks[1]) or any(m._forward_hooks or m._forward_pre_hooks for m in modules)
