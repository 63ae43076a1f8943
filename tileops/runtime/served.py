"""What the runtime knows of an op it serves: plain data and three calls, handed down once.

The runtime sits below the op (``tests/test_layers.py``): it launches kernels and serves the custom
ops ``torch.compile`` traces, and knows nothing of an op's checks, targets or family. An op
registers with it (:func:`tileops.runtime.library.register`) by handing down

* a :class:`Layout`: plain data, fixed at construction, for everything the runtime reads: the
  names of the inputs and outputs, each output's like input and how a new one is made (its dtype
  and shape), the inputs written in place, and the manifest's backward (``wrt``, ``saves``);
* a :class:`Served`: the three calls only the op can make (its general path, its backward, its
  error for a bad value a kernel found), as the op's bound methods, held weakly. The runtime calls
  them from its general path: a custom op's call the native executor does not serve, a custom op's
  backward, a tracked call's report.

The runtime touches nothing else of an op (``tests/test_one_way_down.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple

import torch

from ..manifest.call import DTYPES
from ..manifest.schema import LEAD, Backward

__all__ = ["Served", "Layout", "Output", "layout_of"]


class Served(NamedTuple):
    """The calls the runtime makes back into an op, for what only the op can do: its bound methods,
    which the runtime holds weakly (it never keeps an op alive) and calls with these arguments."""

    #: ``call(tensors, outs)``: check a call and run it, as an eager call of the op does. ``tensors``:
    #: every input name -> its tensor, or None for an optional input not given; ``outs``: output
    #: name -> the tensor to write it into (an output not in it is a new tensor). Returns the
    #: produced outputs (those whose like input is given): one tensor, or a tuple
    call: Callable[[Mapping[str, Any], Mapping[str, Any]], Any]
    #: ``backward(grads, tensors)``: the gradients of the inputs the backward's ``wrt`` names that
    #: ``tensors`` gives, in that order, from the produced outputs' gradients ``grads``; ``tensors``
    #: holds the inputs and the outputs the backward's ``saves`` keeps
    backward: Callable[[tuple, Mapping[str, Any]], tuple]
    #: ``raise_bad_value(name, values, when, found)``: raise the error of a call whose kernel found a
    #: value of its checked input ``name`` out of range; ``values`` is that tensor (None when it was
    #: freed before the report), ``when`` one of :mod:`tileops.runtime.errors`' words, ``found`` the
    #: kernel's record of the first bad element (a :class:`tileops.runtime.errors.BadValue`) or None
    raise_bad_value: Callable[[str, "torch.Tensor | None", str, Any], None]


@dataclass(frozen=True)
class Output:
    """One output of an op, as the runtime makes a new one."""

    name: str
    #: the input it is produced for (not produced when that input is not given), and laid out like
    like: str
    #: its dtype when a param fixes it; None: its like input's
    dtype: "torch.dtype | None" = None
    #: its dims when it has a shape of its own (names of the inputs' dims, or of int params);
    #: None: its like input's shape and strides
    shape: "tuple[str, ...] | None" = None


@dataclass(frozen=True)
class Layout:
    """An op's tensors and gradients as the runtime sees them: plain data, fixed at construction."""

    #: the op's name, which the runtime's errors start with
    name: str
    #: the inputs' names, in the manifest's order (the order of every list the runtime passes)
    inputs: tuple[str, ...]
    outputs: tuple[Output, ...]
    #: the inputs the op writes in place (a KV cache), in the manifest's order
    written: tuple[str, ...] = ()
    #: the manifest's backward: the inputs it gives gradients of (``wrt``) and what it reads
    #: (``saves``); None: the op has none
    backward: "Backward | None" = None
    #: per input, the dims of each shape it may take (without leading dims), where an output with a
    #: shape of its own reads its sizes
    dims: tuple[tuple[str, tuple[tuple[str, ...], ...]], ...] = ()
    #: the int params an output's own shape names
    sizes: Mapping[str, int] = field(default_factory=dict)

    def produced(self, tensors: Mapping[str, Any]) -> list[Output]:
        """The outputs a call with ``tensors`` produces: those whose like input is given."""
        return [o for o in self.outputs if tensors.get(o.like) is not None]

    def shape_of(self, out: Output, tensors: Mapping[str, Any]) -> "list[int] | None":
        """The sizes of output ``out`` of a call with ``tensors`` when it has a shape of its own, from
        the dims the inputs' shapes give, else the int params; None for one shaped like its input."""
        if out.shape is None:
            return None
        sizes: dict[str, int] = {}
        for name, shapes in self.dims:
            x = tensors.get(name)
            if x is None:
                continue
            for dims in shapes:
                if len(dims) == x.dim():
                    sizes.update(zip(dims, x.shape))
        return [int(sizes[d]) if d in sizes else int(self.sizes[d]) for d in out.shape]

    def new_output(self, out: Output, tensors: Mapping[str, Any], zeros: bool = False) -> torch.Tensor:
        """A new tensor for output ``out`` of a call with ``tensors``: laid out like its like input
        (``torch.empty_like``) in the output's dtype, or a new contiguous tensor of its own shape;
        filled with zeros with ``zeros``."""
        like = tensors[out.like]
        dtype = out.dtype or like.dtype
        shape = self.shape_of(out, tensors)
        if shape is not None:
            return (torch.zeros if zeros else torch.empty)(shape, dtype=dtype, device=like.device)
        return (torch.zeros_like if zeros else torch.empty_like)(like, dtype=dtype)


def layout_of(manifest: Any, params: Mapping[str, Any]) -> Layout:
    """The :class:`Layout` of an op of ``manifest`` constructed with ``params`` (checked values)."""
    outputs = tuple(Output(o.name, o.like,
                           DTYPES[params[o.dtype_by]] if o.dtype_by is not None and params[o.dtype_by] is not None
                           else None,
                           tuple(o.own_shape) if o.own_shape else None)
                    for o in manifest.outputs)
    own = {d for o in outputs if o.shape is not None for d in o.shape}
    return Layout(
        name=manifest.name,
        inputs=tuple(t.name for t in manifest.inputs),
        outputs=outputs,
        written=tuple(t.name for t in manifest.inputs if t.written),
        backward=manifest.backward,
        dims=tuple((t.name, tuple(s for s in t.shapes_for(params) if s[:1] != (LEAD,))) for t in manifest.inputs)
        if own else (),
        sizes={d: params[d] for d in own if d in params},
    )
