"""The ops as ``torch.library`` custom ops, for ``torch.compile`` (and anything else that traces).

Eager calls go straight to the kernels (a custom op's dispatch costs host time that a 3 µs kernel
cannot afford); while ``torch.compile`` traces, :meth:`tileops.op.Op._call` routes a call here
instead, so Dynamo sees one opaque op with a fake (meta) implementation, never the ctypes launch:

* ``tileops::apply(int handle, Tensor x, Tensor? position_ids, Tensor? key) -> Tensor[]``: new
  outputs (``[out]`` or ``[out, key_out]``), differentiable through ``register_autograd``, whose
  backward is ``tileops::apply_backward`` (one launch of the inverse rotation for every gradient);
* ``tileops::apply_out(int handle, Tensor x, Tensor? position_ids, Tensor? key, Tensor(a!) out,
  Tensor(b!)? key_out) -> ()``: ``out=``/``key_out=`` and in place, with exact ``mutates_args``.

``handle`` names the op object (its parameters and compiled kernels), registered at construction
and forgotten when the op is garbage collected. It is the same int on every call of one op, so a
compiled graph specializes on it and on nothing else: new lengths do not recompile.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, Optional

import torch

__all__ = ["register", "lookup", "apply", "apply_out"]

_ops: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_ids = itertools.count(1)
_lock = threading.Lock()


def register(op: Any) -> int:
    """A handle for ``op``, valid while the op lives."""
    with _lock:
        handle = next(_ids)
        _ops[handle] = op
    return handle


def lookup(handle: int) -> Any:
    op = _ops.get(handle)
    if op is None:
        raise RuntimeError(f"tileops: op handle {handle} names no live op (the op was garbage collected)")
    return op


def _inputs(op: Any, x: torch.Tensor, position_ids: Optional[torch.Tensor], key: Optional[torch.Tensor]) -> dict:
    names = [t.name for t in op.manifest.inputs]
    given = {"x": x, "position_ids": position_ids, "key": key}
    return {n: given.get(n) for n in names}


@torch.library.custom_op("tileops::apply", mutates_args=())
def apply(handle: int, x: torch.Tensor, position_ids: Optional[torch.Tensor],
          key: Optional[torch.Tensor]) -> list[torch.Tensor]:
    op = lookup(handle)
    with torch.no_grad():  # autograd is registered on this op, not traced through its body
        out = op._eager_call(_inputs(op, x, position_ids, key), {})
    return list(out) if isinstance(out, tuple) else [out]


@apply.register_fake
def _apply_fake(handle: int, x: torch.Tensor, position_ids: Optional[torch.Tensor],
                key: Optional[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty_like(x)] + ([torch.empty_like(key)] if key is not None else [])


@torch.library.custom_op("tileops::apply_backward", mutates_args=())
def apply_backward(handle: int, grads: list[torch.Tensor], position_ids: Optional[torch.Tensor],
                   x: torch.Tensor, key: Optional[torch.Tensor]) -> list[torch.Tensor]:
    """Gradients of the inputs ``backward.wrt`` names, from the outputs' gradients."""
    op = lookup(handle)
    return list(op._eager_backward(tuple(grads), _inputs(op, x, position_ids, key)))


@apply_backward.register_fake
def _apply_backward_fake(handle: int, grads: list[torch.Tensor], position_ids: Optional[torch.Tensor],
                         x: torch.Tensor, key: Optional[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty_like(g) for g in grads]


def _setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
    handle, x, position_ids, key = inputs
    ctx.handle = handle
    ctx.save_for_backward(x, position_ids, key)  # x and key: for their shapes and the kernel choice


def _backward(ctx: Any, grads: list[torch.Tensor]) -> tuple:
    x, position_ids, key = ctx.saved_tensors
    grads = [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, (x, key))]
    got = torch.ops.tileops.apply_backward(ctx.handle, grads, position_ids, x, key)
    return None, got[0], None, (got[1] if key is not None else None)


apply.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("tileops::apply_out", mutates_args=("out", "key_out"))
def apply_out(handle: int, x: torch.Tensor, position_ids: Optional[torch.Tensor], key: Optional[torch.Tensor],
              out: torch.Tensor, key_out: Optional[torch.Tensor]) -> None:
    op = lookup(handle)
    op._eager_call(_inputs(op, x, position_ids, key), {"out": out, "key_out": key_out})


@apply_out.register_fake
def _apply_out_fake(handle: int, x: torch.Tensor, position_ids: Optional[torch.Tensor],
                    key: Optional[torch.Tensor], out: torch.Tensor, key_out: Optional[torch.Tensor]) -> None:
    return None
