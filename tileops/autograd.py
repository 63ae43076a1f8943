"""Gradients: how an op's call becomes differentiable in the inputs its manifest names.

A target's implementation is either

* a plain callable taking the inputs as keywords and returning the output (a tuple of outputs when
  several are produced), whose results autograd already tracks (the ``"torch"`` target is ordinary
  PyTorch); or
* a *kernel set*: an object with ``prepare(tensors) -> state``, ``forward(state, tensors, outs) ->
  outputs`` (written into the tensors of ``outs`` where given) and ``backward(state, grads,
  tensors) -> gradients of the wrt inputs`` (RoPE's BUILTIN backward is the same TileLang builder
  with the rotation reversed, one launch for every gradient). ``state`` is what both directions
  must share, e.g. the cos/sin tables a call picked; the backward's ``tensors`` are the inputs not
  differentiated, and the inputs and outputs the manifest's ``backward.saves`` names (kept through
  ``save_for_backward``, so that autograd refuses a backward after they changed in place).

When the manifest declares ``backward.wrt`` and one of those inputs requires grad, a kernel set
runs inside :class:`_KernelFunction`, so the outputs carry a ``grad_fn``. Anything that would
return an output without one while an input requires grad raises instead: a silently detached
output is the worst kind of wrong answer (the weights before it would never learn).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .torch_private import DelayedError

__all__ = ["run_differentiable", "grad_needed", "is_kernel_set", "backward_of"]


def is_kernel_set(impl: Any) -> bool:
    return hasattr(impl, "prepare") and hasattr(impl, "forward") and hasattr(impl, "backward")


class _KernelFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, op: Any, impl: Any, state: Any, wrt: tuple[str, ...], tensors: dict[str, Any],
                *diff: torch.Tensor) -> Any:
        ctx.op, ctx.impl, ctx.state, ctx.wrt = op, impl, state, wrt
        ctx.others = {k: v for k, v in tensors.items() if k not in wrt}  # not differentiable (positions)
        full = {**tensors, **dict(zip(wrt, diff))}
        out = impl.forward(state, full, {})
        bwd = op.manifest.backward
        if bwd.saves:  # what the backward kernels read, kept by autograd (which sees a later in-place change)
            made = (o.name for o in op.manifest.outputs if full.get(o.like) is not None)
            have = {**dict(zip(made, out if isinstance(out, tuple) else (out,))),
                    **{k: v for k, v in full.items() if v is not None}}
            ctx.saved_names = tuple(bwd.saved(have.__contains__))
            ctx.save_for_backward(*(have[n] for n in ctx.saved_names))
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        tensors = ctx.others
        if ctx.op.manifest.backward.saves:
            tensors = {**tensors, **dict(zip(ctx.saved_names, ctx.saved_tensors))}
        got = ctx.impl.backward(ctx.state, grads, tensors)
        if torch.is_grad_enabled() and any(g is not None and g.requires_grad for g in grads):
            # create_graph=True: a gradient of this gradient is not implemented; say so if asked
            # (the error node needs an input that requires grad to attach to)
            err = DelayedError(
                f"{ctx.op.name}: double backward (a gradient of the gradient) is not supported; the backward "
                f"kernel is not itself differentiable", len(got))
            got = err(*[g.detach().requires_grad_(True) for g in got])
            got = got if isinstance(got, tuple) else (got,)
        return (None, None, None, None, None, *got)


def grad_needed(op: Any, tensors: Mapping[str, Any], outs: Mapping[str, Any]) -> list[str]:
    """The inputs that require grad (none under ``torch.no_grad``); raises when the op cannot give
    them a gradient: it declares no backward, or outputs are given (``outs``, the non-None ones)."""
    needing = [k for k, v in tensors.items() if getattr(v, "requires_grad", False)] if torch.is_grad_enabled() else []
    if needing and op.manifest.backward is None:
        raise RuntimeError(f"{op.name}: {needing[0]} requires grad, but the op declares no backward; "
                           f"pass {needing[0]}.detach() or call it under torch.no_grad()")
    if needing and outs:
        raise RuntimeError(f"{op.name}: {', '.join(outs)}= cannot be used while {needing[0]} requires grad "
                           f"(autograd does not follow writes into given tensors); leave it out to get a new, "
                           f"differentiable tensor")
    return needing


def run_differentiable(op: Any, impl: Any, tensors: Mapping[str, Any], outs: Mapping[str, Any] | None = None) -> Any:
    """Run ``impl`` on ``tensors`` so that the outputs are differentiable where the manifest says;
    ``outs`` are tensors to write the outputs into (``out=``), which autograd does not follow."""
    outs = outs or {}
    bwd = op.manifest.backward
    needing = grad_needed(op, tensors, outs)
    wants_grad = bool(needing)
    if not is_kernel_set(impl):
        result = impl(**tensors)
        if wants_grad:
            for r in (result if isinstance(result, tuple) else (result,)):
                if isinstance(r, torch.Tensor) and r.grad_fn is None:
                    raise RuntimeError(f"{op.name}: target {op.serving_target!r} returned an output without a "
                                       f"grad_fn although {needing[0]} requires grad; it does not implement "
                                       f"the backward")
        if outs:
            result = _copy_into(op, result, outs)
        return result
    state = impl.prepare(tensors)
    if not wants_grad:
        return impl.forward(state, tensors, outs)
    wrt = tuple(w for w in bwd.wrt if tensors.get(w) is not None)
    return _KernelFunction.apply(op, impl, state, wrt, dict(tensors), *(tensors[w] for w in wrt))


def _copy_into(op: Any, result: Any, outs: Mapping[str, Any]) -> Any:
    """A plain implementation's fresh outputs copied into the given ``out=`` tensors."""
    names = [o.name for o in op.manifest.outputs]
    results = result if isinstance(result, tuple) else (result,)
    final = []
    for name, r in zip(names, results):
        dst = outs.get(name)
        if dst is not None:
            dst.copy_(r)
            r = dst
        final.append(r)
    return tuple(final) if isinstance(result, tuple) else final[0]


def backward_of(op: Any, impl: Any, grads: tuple, tensors: Mapping[str, Any]) -> tuple:
    """The gradients of the ``backward.wrt`` inputs that are given, from the outputs' gradients
    (for :mod:`tileops.runtime.library`, whose backward is an op of its own); ``tensors`` holds the
    inputs and the outputs ``backward.saves`` names."""
    wrt = tuple(w for w in op.manifest.backward.wrt if tensors.get(w) is not None)
    if is_kernel_set(impl):
        saves = {n for entry in op.manifest.backward.saves for n in entry}
        kept = {k: v for k, v in tensors.items() if k not in wrt or k in saves}
        return tuple(impl.backward(impl.prepare(tensors), grads, kept))
    with torch.enable_grad():
        leaves = {w: tensors[w].detach().requires_grad_(True) for w in wrt}
        out = impl(**{**tensors, **leaves})
        outs = out if isinstance(out, tuple) else (out,)
        return torch.autograd.grad(outs, [leaves[w] for w in wrt], list(grads))
