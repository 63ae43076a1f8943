"""Gradients: how an op's call becomes differentiable in the input its manifest names.

A target's implementation is either

* a plain callable taking the inputs as keywords, whose output autograd already tracks (the
  ``"torch"`` target is ordinary PyTorch); or
* a *kernel set*: an object with ``prepare(tensors) -> state``, ``forward(state, tensors) -> out``
  and ``backward(state, grad, tensors) -> grad of the input`` (BUILTIN: the backward is the same
  TileLang builder with the rotation reversed). ``state`` is what both directions must share,
  e.g. the cos/sin tables a call picked.

When the manifest declares ``backward.wrt`` and that input requires grad, a kernel set runs inside
:class:`_KernelFunction`, so the output carries a ``grad_fn``. Anything that would return an output
without one while its input requires grad raises instead: a silently detached output is the worst
kind of wrong answer (the weights before it would never learn).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

__all__ = ["run_differentiable", "is_kernel_set"]


def is_kernel_set(impl: Any) -> bool:
    return hasattr(impl, "prepare") and hasattr(impl, "forward") and hasattr(impl, "backward")


class _KernelFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, op: Any, impl: Any, state: Any, wrt: str,
                tensors: dict[str, Any]) -> torch.Tensor:
        ctx.op, ctx.impl, ctx.state, ctx.wrt = op, impl, state, wrt
        ctx.others = {k: v for k, v in tensors.items() if k != wrt}  # not differentiable (positions)
        return impl.forward(state, {**tensors, wrt: x})

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        g = ctx.impl.backward(ctx.state, grad, {**ctx.others, ctx.wrt: None})
        if torch.is_grad_enabled() and grad.requires_grad:
            # create_graph=True: a gradient of this gradient is not implemented; say so if asked
            # (the error node needs an input that requires grad to attach to)
            g = g.detach().requires_grad_(True)
            g = torch._C._functions.DelayedError(
                f"{ctx.op.name}: double backward (a gradient of the gradient) is not supported; the backward "
                f"kernel is not itself differentiable", 1)(g)
        return g, None, None, None, None, None


def run_differentiable(op: Any, impl: Any, tensors: Mapping[str, Any]) -> Any:
    """Run ``impl`` on ``tensors`` so that the output is differentiable where the manifest says."""
    bwd = op.manifest.backward
    if bwd is None:
        if torch.is_grad_enabled():
            needing = [k for k, v in tensors.items() if getattr(v, "requires_grad", False)]
            if needing:
                raise RuntimeError(f"{op.name}: {needing[0]} requires grad, but the op declares no backward; "
                                   f"pass {needing[0]}.detach() or call it under torch.no_grad()")
        wants_grad = False
    else:
        wants_grad = torch.is_grad_enabled() and bool(getattr(tensors.get(bwd.wrt), "requires_grad", False))
    if not is_kernel_set(impl):
        out = impl(**tensors)
        if wants_grad and isinstance(out, torch.Tensor) and out.grad_fn is None:
            raise RuntimeError(f"{op.name}: target {op.serving_target!r} returned an output without a grad_fn "
                               f"although {bwd.wrt} requires grad; it does not implement the backward")
        return out
    state = impl.prepare(tensors)
    if not wants_grad:
        return impl.forward(state, tensors)
    return _KernelFunction.apply(tensors[bwd.wrt], op, impl, state, bwd.wrt, dict(tensors))
