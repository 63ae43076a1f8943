"""The ops as ``torch.library`` custom ops, for ``torch.compile`` (and anything else that traces).

Eager calls go straight to the runtime; while ``torch.compile`` traces, :meth:`tileops.op.Op._call`
routes a call here instead, so Dynamo sees one opaque op with a fake (meta) implementation, never
the launch. Three custom ops serve every op of every family; what their lists hold comes from the
op's manifest:

* ``tileops::apply(SymInt handle, Tensor[] inputs, str names) -> Tensor[]``: the given inputs in
  the manifest's order, ``names`` theirs, comma-separated (an optional input not given is left
  out); returns the new outputs whose ``like`` input is given, in the manifest's order.
  Differentiable: its backward is ``tileops::apply_backward`` (the family's backward kernels);
* ``tileops::apply_out(SymInt handle, Tensor[] inputs, str names, Tensor(a3!)[] outs) -> ()``:
  ``out=`` and in place: ``outs`` holds one tensor per output whose ``like`` input is given, with
  exact ``mutates_args``, then the inputs the manifest marks ``written`` (a KV cache the op writes
  in place), which ``inputs`` then leaves out: a call of an op that writes an input always takes
  this op, so a compiled graph knows what it mutates.

``handle`` names the op object (its parameters and compiled kernels), registered at construction
and forgotten when the op is garbage collected. It is the same int on every call of one op, so a
compiled graph specializes on it and on nothing else: new lengths do not recompile.

With the native runtime loaded (:mod:`tileops.runtime.native`) the three ops are the extension's:
C++ kernels serve a call whose signature the op has bound before without any Python (a compiled
graph's call costs what an aten op's does), and call the general path below for anything else;
autograd is C++ for a call that needs none, :class:`_Apply` for one that does. Without it, they are
Python custom ops with the same schemas, bodies and backward. Either way the fakes are the ones here.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from typing import Any

import torch

from ..compile import entry
from ..torch_private import DelayedError, below_autograd
from . import errors, memory, native
from .binding import late_tensors
from .served import Layout, Served

__all__ = ["register", "lookup", "layout", "pack", "written", "raise_bad", "general"]

#: handle -> (the op's calls, each held weakly; its layout); a handle leaves when its op is collected
_ops: "dict[int, tuple[Served, Layout]]" = {}
_ids = itertools.count(1)
_lock = threading.Lock()


def register(served: Served, layout: Layout) -> int:
    """A handle for an op (:mod:`tileops.runtime.served`: what the runtime may call on it, and what
    it reads of it), valid while the op lives: ``served`` holds its bound methods, which the runtime
    holds weakly, forgetting the handle when the op is garbage collected."""
    refs = Served(*(weakref.WeakMethod(fn) for fn in served))
    with _lock:
        handle = next(_ids)
        _ops[handle] = (refs, layout)
    # forgotten when an owner of the calls (the op) is collected: a finalizer, not WeakMethod callbacks,
    # whose callback fails at interpreter exit once the WeakMethod itself is gone first ("'NoneType'
    # object has no attribute '_alive'" on stderr, which a -W error child process reported as a failure)
    for owner in {id(fn.__self__): fn.__self__ for fn in served}.values():
        weakref.finalize(owner, _ops.pop, handle, None).atexit = False
    return handle


def _registered(handle: int) -> "tuple[Served, Layout]":
    """The op of ``handle``: its calls (weak references) and its layout. A fake implementation may get
    the handle as a SymInt (``dynamic=True`` makes ints symbolic): ``int()`` specializes the graph on
    it, which is what a handle is for."""
    got = _ops.get(int(handle))
    if got is None:
        raise RuntimeError(f"tileops: op handle {handle} names no live op (the op was garbage collected)")
    return got


def _call(handle: int, what: str) -> "tuple[Any, Layout]":
    """The op of ``handle``'s call ``what`` (a field of :class:`Served`), and its layout."""
    calls, lay = _registered(handle)
    return _live(getattr(calls, what), handle), lay


def _live(ref: weakref.WeakMethod, handle: int) -> Any:
    fn = ref()
    if fn is None:  # collected since the lookup: its handle is leaving
        raise RuntimeError(f"tileops: op handle {handle} names no live op (the op was garbage collected)")
    return fn


def lookup(handle: int) -> Served:
    """The calls of the op of ``handle``."""
    return Served(*(_live(ref, handle) for ref in _registered(handle)[0]))


def layout(handle: int) -> Layout:
    """The layout the op of ``handle`` registered with."""
    return _registered(handle)[1]


def raise_bad(handle: int, values: "torch.Tensor | None", when: str, name: str = "",
              record: "tuple[int, int, tuple, tuple] | None" = None) -> None:
    """Raise the error of a call whose kernel found a value of its checked input ``name`` (``values``,
    or None when that tensor was freed before the report) out of range (the runtime's tracker calls
    this; ``when`` is one of :mod:`tileops.runtime.errors`' words). An op whose kernel checks one
    input only may leave ``name`` empty. ``record``: the kernel's record of the first bad element
    and the tensor's sizes and strides as launched (:func:`tileops.runtime.errors.found`), which
    names the index when the tensor is gone."""
    _call(handle, "raise_bad_value")[0](name, values, when, errors.found(*record) if record is not None else None)


def pack(layout: Layout, tensors: dict) -> tuple[list[torch.Tensor], str]:
    """The given inputs of a call as the custom ops take them: the tensors in the manifest's order
    and their names, comma-separated (a string is a constant to Dynamo; a list holding None would
    not be differentiable)."""
    given = [n for n in layout.inputs if tensors.get(n) is not None]
    return [tensors[n] for n in given], ",".join(given)


def _inputs(layout: Layout, inputs: list[torch.Tensor], names: str, saved: bool = False) -> dict:
    """Every input of the op by name (None for one not given), from :func:`pack`'s list and names;
    with ``saved`` (``apply_backward``), also the outputs the manifest's ``backward.saves`` names
    that the list holds after the inputs."""
    given = dict(zip(names.split(","), inputs)) if names else {}
    known = set(layout.inputs)
    bwd = layout.backward
    extra = {n for e in bwd.saves for n in e} - known if saved and bwd else set()
    if len(given) != len(inputs) or not set(given) <= known | extra:
        raise TypeError(f"{layout.name}: inputs {names!r} do not match its inputs ({', '.join(layout.inputs)})")
    return {n: given.get(n) for n in layout.inputs} | {n: given[n] for n in extra if n in given}


def written(layout: Layout, tensors: dict) -> list[str]:
    """The inputs of a call with ``tensors`` that the op writes in place (``written`` in its manifest), given ones."""
    return [n for n in layout.written if tensors.get(n) is not None]


# ------------------------------------------------------------------ the general path of each op
def _apply(handle: int, inputs: list[torch.Tensor], names: str) -> list[torch.Tensor]:
    call, lay = _call(handle, "call")
    with torch.no_grad():  # autograd is registered on this op, not traced through its body
        out = call(_inputs(lay, inputs, names), {})
    return list(out) if isinstance(out, tuple) else [out]


def _apply_fake(handle: int, inputs: list[torch.Tensor], names: str) -> list[torch.Tensor]:
    lay = layout(handle)
    tensors = _inputs(lay, inputs, names)
    return [lay.new_output(o, tensors) for o in lay.produced(tensors)]


def _apply_backward(handle: int, grads: list[torch.Tensor], inputs: list[torch.Tensor],
                    names: str) -> list[torch.Tensor]:
    """Gradients of the inputs ``backward.wrt`` names that are given, in that order, from the outputs'
    (``inputs`` and ``names`` end with the outputs ``backward.saves`` names, when it names any)."""
    backward, lay = _call(handle, "backward")
    tensors = _inputs(lay, inputs, names, saved=True)
    got = list(backward(tuple(grads), tensors))
    # the strides the fake promised (a compiled graph views the result by them): the kernels' own
    # choice but after a fallback, which is copied
    for i, ref in enumerate(_gradient_layouts(lay, tensors, grads)):
        if got[i].stride() != ref.stride():
            promised = torch.empty_like(ref)
            if promised.stride() != got[i].stride():
                got[i] = promised.copy_(got[i])
    # a custom op's outputs may not alias one another: one tensor given as two inputs' gradients (a
    # residual's gradient is x's) is returned once and copied for the other
    for i in range(1, len(got)):
        if any(got[i] is g for g in got[:i]):
            got[i] = got[i].clone()
    return got


def _gradient_layouts(lay: Layout, tensors: dict, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """For each gradient ``apply_backward`` returns, a tensor it is laid out like (``empty_like``),
    in its input's dtype: the gradient of the output like its input, as the kernels write it, not
    the input (in a compiled training step they differ: an attention's gradient is ``[b, h, s, d]``
    where the op's input was a ``[b, s, h, d]`` view); an input no output is like (``backward.reduce``)
    is its own layout."""
    like = {o.like: g for o, g in zip(lay.produced(tensors), grads)}
    out = []
    for w in lay.backward.wrt:
        t = tensors.get(w)
        if t is not None:
            ref = like.get(w, t)
            out.append(ref if ref.dtype == t.dtype else torch.empty_like(ref, dtype=t.dtype))
    return out


def _apply_backward_fake(handle: int, grads: list[torch.Tensor], inputs: list[torch.Tensor],
                         names: str) -> list[torch.Tensor]:
    lay = layout(handle)
    return [torch.empty_like(t) for t in _gradient_layouts(lay, _inputs(lay, inputs, names, saved=True), grads)]


def _setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
    handle, tensors, names = inputs
    lay = layout(handle)
    # the outputs the backward reads (backward.saves): passed to apply_backward after the inputs
    given = _inputs(lay, list(tensors), names)
    made = [o.name for o in lay.produced(given)]
    bwd = lay.backward
    kept = [n for n in bwd.saved(lambda n: n in made or given.get(n) is not None) if n in made] if bwd else []
    ctx.handle, ctx.names, ctx.n_inputs = handle, ",".join([names, *kept]) if kept else names, len(tensors)
    # every input: for the shapes, the kernel choice and what the backward reads (inputs not differentiated)
    ctx.save_for_backward(*tensors, *(output[made.index(n)] for n in kept))


def _backward(ctx: Any, grads: list[torch.Tensor]) -> tuple:
    lay = layout(ctx.handle)
    saved = list(ctx.saved_tensors)
    tensors = _inputs(lay, saved, ctx.names, saved=True)
    grads = [g if g is not None else lay.new_output(o, tensors, zeros=True)
             for g, o in zip(grads, lay.produced(tensors))]
    got = dict(zip([w for w in lay.backward.wrt if tensors.get(w) is not None],
                   torch.ops.tileops.apply_backward(ctx.handle, grads, saved, ctx.names)))
    return None, [got.get(n) for n in ctx.names.split(",")[:ctx.n_inputs]], None


def _apply_out(handle: int, inputs: list[torch.Tensor], names: str, outs: list[torch.Tensor]) -> None:
    call, lay = _call(handle, "call")
    tensors = _inputs(lay, inputs, names)
    made = lay.produced(tensors)
    # the written inputs come after the outputs, in the manifest's order (Op._traced_call); the
    # loader makes every written input a required one, so all of them are there
    tensors |= dict(zip(lay.written, outs[len(made):]))
    call(tensors, {o.name: t for o, t in zip(made, outs)})


def _apply_out_fake(handle: int, inputs: list[torch.Tensor], names: str, outs: list[torch.Tensor]) -> None:
    return None


class _Apply(torch.autograd.Function):
    """``tileops::apply`` where an input requires grad, with the native ops (whose C++ autograd
    kernel calls :func:`_apply_grad`): the same context and backward as the Python op's."""

    @staticmethod
    def forward(handle: int, names: str, *inputs: torch.Tensor) -> tuple:  # type: ignore[override]
        return tuple(torch.ops.tileops.apply.default(handle, list(inputs), names))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        handle, names, *tensors = inputs
        _setup_context(ctx, (handle, tensors, names), output)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:  # type: ignore[override]
        _, got, _ = _backward(ctx, list(grads))
        return (None, None, *got)


def _apply_grad(handle: int, inputs: list[torch.Tensor], names: str) -> list[torch.Tensor]:
    return list(_Apply.apply(handle, names, *inputs))


def _apply_backward_grad(handle: int, grads: list[torch.Tensor], inputs: list[torch.Tensor],
                         names: str) -> list[torch.Tensor]:
    """``tileops::apply_backward`` where autograd records it (``create_graph=True``), with the native
    ops: as the Python op (which has no backward formula) does, the gradients come back and raise
    only when differentiated."""
    with below_autograd():
        got = torch.ops.tileops.apply_backward.default(handle, grads, inputs, names)
    fail = DelayedError(f"{layout(handle).name}: double backward (a gradient of the gradient) is not supported",
                        len(got))
    out = fail(*[g.detach().requires_grad_(True) for g in got])
    return list(out) if isinstance(out, tuple) else [out]


#: the Python body of each custom op (and, with the extension, of its autograd kernel's call that
#: needs Python autograd), by the name the extension's kernels pass to :func:`general`
_GENERAL = {"apply": _apply, "apply_out": _apply_out, "apply_backward": _apply_backward,
            "apply_grad": _apply_grad, "apply_backward_grad": _apply_backward_grad}


def general(what: str, handle: int, *args: Any) -> Any:
    """The extension's one way back into Python for its custom ops: the body ``what`` names
    (:data:`_GENERAL`) of a call its C++ kernels do not serve, with the op's schema's arguments."""
    return _GENERAL[what](handle, *args)


if native.module is None:
    apply = torch.library.custom_op("tileops::apply", mutates_args=())(_apply)
    apply.register_autograd(_backward, setup_context=_setup_context)
    apply_out = torch.library.custom_op("tileops::apply_out", mutates_args=("outs",))(_apply_out)
    apply_backward = torch.library.custom_op("tileops::apply_backward", mutates_args=())(_apply_backward)
else:  # defined by the extension: its kernels call general() for what they do not serve
    native.module.configure(
        rc_record_failed=entry.RECORD_FAILED, rc_capturing=entry.CAPTURING, env_strict=errors.ENV_STRICT,
        when_now=errors.WHEN_NOW, when_earlier=errors.WHEN_EARLIER, when_graph=errors.WHEN_GRAPH,
        raise_bad=raise_bad, disjoint=memory.disjoint, late=late_tensors, general=general)
    try:
        if torch.version.cuda is not None and torch.cuda.device_count() > 0:  # NVML: no CUDA initialised
            native.module.set_driver(*errors.driver_addresses(), errors.make_event)
    except OSError as e:  # no libcuda.so.1 to load: no CUDA tensor can exist either
        logging.getLogger("tileops.runtime.native").debug("tileops: no CUDA driver: %s", e)
for _name, _fake in (("apply", _apply_fake), ("apply_out", _apply_out_fake), ("apply_backward", _apply_backward_fake)):
    torch.library.register_fake(f"tileops::{_name}", _fake)
