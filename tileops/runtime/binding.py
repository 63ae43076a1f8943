"""A kernel launch described once per call signature: the :class:`Binding`.

A family (its kernel set) knows what a call's views mean to its kernel; the runtime knows nothing of
that. So the family computes with :func:`bind`, once per signature (every tensor's shape, strides,
dtype and device, and which outputs are given or in place), a :class:`Binding`: the kernel's whole
argument array with every shape, stride and scalar filled, and where each tensor's pointer goes. A
later call shaped the same way only reads its pointers into a copy of that array: in the C++ executor
(:mod:`tileops.runtime.native`) without Python, else in :class:`tileops.runtime.executor.PythonRuntime`.
The family's general path (a signature's first call, views it must copy, gradients) binds the tensors
it launches with through the same :func:`bind` and runs the same executor.

Tensors are numbered as the op's manifest lists them: the inputs, then the outputs. Per call the
executor checks what the pointers alone decide (alignment; the overlap of given outputs with the
other arguments by byte spans, then exactly where the spans meet) and refuses the call, before it
has allocated, launched or called Python, when either fails: the general path then copies or raises.
"""

from __future__ import annotations

import array
import dataclasses
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from .memory import span

__all__ = ["Binding", "bind", "with_overlap_checks", "late_tensors", "ABSENT", "NEW", "IN_PLACE", "GIVEN"]

#: how a call gets each output: its ``like`` input not given (no output), a new tensor allocated per
#: call as ``torch.empty_like(<like input>)``, the like input itself (in place), or a tensor the call gives
ABSENT, NEW, IN_PLACE, GIVEN = 0, 1, 2, 3


@dataclass(frozen=True, eq=False)
class Binding:
    """One call signature's launch: everything but the pointers, which each call brings.

    ``template`` holds every argument of the kernel's C entry point (:class:`tileops.compile.entry.RawKernel`:
    its parameters, then the dynamic extents) as int64 (a pointer as its address, a float as its bits).
    """

    #: the :class:`tileops.compile.entry.RawKernel` launched
    kernel: Any
    template: array.array
    #: the op's input names then output names (tensor ``i`` of a call is the one named ``names[i]``)
    names: tuple[str, ...]
    #: how many of ``names`` are inputs
    inputs: int
    #: ``(tensor, slot, alignment in bytes)``: the tensor's data pointer goes into ``template[slot]``
    pointers: tuple[tuple[int, int, int], ...]
    #: each output's mode (ABSENT, NEW, IN_PLACE, GIVEN) and its like input (an input's index)
    outputs: tuple[int, ...]
    likes: tuple[int, ...]
    #: a new output's strides (those ``torch.empty_like`` gives its like input of this signature;
    #: allocated with them directly, one dispatch fewer), else ()
    strides: tuple[tuple[int, ...], ...] = ()
    #: a new output's sizes when it has a shape of its own (the manifest's ``own_shape``: the
    #: attention prologue's q ``[tokens, Hq, D]`` is not shaped like qkv), which the signature
    #: fixes; () for one shaped like its like input
    sizes: tuple[tuple[int, ...], ...] = ()
    #: ``(tensor, span, tensor, span)``: pairs that must not share memory, spans in bytes
    pairs: tuple[tuple[int, int, int, int], ...] = ()
    #: ``(slot, fn)``: ``fn(inputs)`` (input name -> tensor or None) returns a tensor whose pointer
    #: goes into the slot (chosen per call, e.g. on the device); kept alive until the kernel is queued
    late: tuple[tuple[int, Callable[[dict], torch.Tensor]], ...] = ()
    #: ``(input, word)``: the inputs whose values the kernel checks, each writing the call's tag into
    #: word ``word`` of the call's error words (its ``ERR``) when one is out of range
    #: (:mod:`tileops.runtime.errors`); empty: the call is not tracked
    checks: tuple[tuple[int, int], ...] = ()
    word_slot: int = -1
    tag_slot: int = -1
    #: tensors whose addresses ``template`` holds (kept alive with it)
    keep: tuple[torch.Tensor, ...] = ()
    #: the exact overlap test's answers, by (pair, offset) (one storage: the offset alone decides)
    memo: dict = field(default_factory=dict, repr=False)
    #: the outputs a call returns (those whose like input is given), by output index
    produced: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "produced", tuple(j for j, mode in enumerate(self.outputs) if mode != ABSENT))
        if self.late:
            _late[id(self)] = self


#: the bindings with late-bound slots, by ``id()``, while they live: the native executor keeps a
#: binding's numbers, not its Python functions, and finds them here (:func:`late_tensors`)
_late: "weakref.WeakValueDictionary[int, Binding]" = weakref.WeakValueDictionary()


def late_tensors(key: int, inputs: tuple) -> list[torch.Tensor]:
    """The tensors of the late-bound slots of the binding whose ``id()`` is ``key``, for a call whose
    inputs (tensor or None each, in the manifest's order) are ``inputs``."""
    b = _late[key]
    named = dict(zip(b.names, inputs))
    return [fn(named) for _, fn in b.late]


def bind(kernel: Any, manifest: Any, tensors: Mapping[str, Any], outs: Mapping[str, Any], *,
         args: Mapping[str, Any], pointers: Mapping[str, str], align: Mapping[str, int] | None = None,
         late: Mapping[str, Callable[[dict], torch.Tensor]] | None = None,
         checks: Mapping[str, int] | None = None, errors: tuple[str, str] = ("ERR", "tag"),
         keep: tuple[torch.Tensor, ...] = (),
         views: Mapping[str, Any] | None = None) -> Binding:
    """The :class:`Binding` of ``kernel`` for calls shaped like this one.

    Args:
        kernel: The :class:`tileops.compile.entry.RawKernel` to launch.
        manifest: The op's manifest (its inputs and outputs, each output's ``like`` input).
        tensors: Input name -> the tensor launched with (None: not given).
        outs: Output name -> the tensor written (given), the like input itself (in place), or None
            (a new tensor per call, ``torch.empty_like`` of the like input).
        args: Kernel argument name -> its value (shapes, strides, scalars); the others are 0.
        pointers: Kernel argument name -> the input or output whose data pointer it takes.
        align: Input or output name -> the alignment in bytes its pointer needs (default 1).
        late: Kernel argument name -> ``fn(inputs)``, a tensor chosen per call from the call's
            inputs (by name).
        checks: Input name -> the index of the error word the kernel writes the call's tag into when
            one of that input's values is out of range (RoPE: ``{"position_ids": 0}``; the attention
            prologue: positions 0, slots 1), for a kernel that checks values; at most
            :data:`tileops.runtime.errors.WORDS` words. Inputs not given are left out.
        errors: The kernel's arguments taking the error words' address and the call's tag.
        keep: Tensors whose addresses ``args`` holds.
        views: Output name -> a tensor laid out as a new output is (the family's own
            ``torch.empty_like`` of its like input, or a new tensor of the output's own shape): its
            sizes and strides are every call's. For a new output not in it, one is made here as
            ``torch.empty_like`` of its like input.
    """
    ins = [t.name for t in manifest.inputs]
    names = (*ins, *(o.name for o in manifest.outputs))
    at = {n: i for i, n in enumerate(names)}
    likes = tuple(ins.index(o.like) for o in manifest.outputs)
    slot, align, views = kernel.slot, align or {}, views or {}
    modes, strides, sizes = [], [], []
    for o in manifest.outputs:
        src, dst, new = tensors.get(o.like), outs.get(o.name), views.get(o.name)
        mode = ABSENT if src is None else NEW if dst is None else IN_PLACE if dst is src else GIVEN
        modes.append(mode)
        ref = None if mode != NEW else torch.empty_like(src) if new is None else new
        strides.append(() if ref is None else ref.stride())
        sizes.append(() if ref is None or ref.shape == src.shape else tuple(ref.shape))
    ptrs = []
    for arg, tensor in pointers.items():
        i = at[tensor]
        present = tensors.get(tensor) is not None if i < len(ins) else modes[i - len(ins)] != ABSENT
        if present:
            ptrs.append((i, slot[arg], max(1, align.get(tensor, 1))))
    from .errors import WORDS

    checked = tuple((at[n], w) for n, w in (checks or {}).items() if tensors.get(n) is not None)
    if any(not 0 <= w < WORDS for _, w in checked):
        raise ValueError(f"bind: checks: error words are 0 .. {WORDS - 1}, got {dict(checks or {})}")
    word_slot, tag_slot = (slot[errors[0]], slot[errors[1]]) if checked else (-1, -1)
    return Binding(kernel, kernel.template(args), names, len(ins), tuple(ptrs), tuple(modes), likes, tuple(strides),
                   sizes=tuple(sizes), late=tuple((slot[a], fn) for a, fn in (late or {}).items()),
                   checks=checked, word_slot=word_slot, tag_slot=tag_slot, keep=tuple(keep))


def with_overlap_checks(binding: Binding, tensors: Mapping[str, Any], outs: Mapping[str, Any],
                        written: tuple[str, ...] = ()) -> Binding:
    """``binding`` with the pairs a later call of this signature must check: each output it writes
    into (given, or in place) against every other tensor of the call, but for an in-place output
    and its own input, and each input in ``written`` (one the op writes in place: a KV cache)
    against every other input; spans from this call's shapes and strides, which the signature fixes."""
    names, n_in = binding.names, binding.inputs
    into = [n_in + j for j, mode in enumerate(binding.outputs) if mode in (IN_PLACE, GIVEN)]
    given = [tensors.get(n) for n in names[:n_in]] + [outs.get(n) for n in names[n_in:]]
    have = {i: given[i] for i in [*range(n_in), *into] if given[i] is not None}
    pairs = []
    for o in (o for o in into if o in have):
        own = binding.likes[o - n_in] if binding.outputs[o - n_in] == IN_PLACE else None
        # every other tensor (an output written before this one has its pair already), but its own input
        pairs += [(o, span(have[o]), i, span(t)) for i, t in have.items() if i != own and not n_in <= i <= o]
    done: set[int] = set()
    for w in (names.index(n) for n in written if tensors.get(n) is not None):
        # the outputs' pairs above hold it already; an input written before this one has its pair too
        pairs += [(w, span(have[w]), i, span(t)) for i, t in have.items() if i < n_in and i != w and i not in done]
        done.add(w)
    return dataclasses.replace(binding, pairs=tuple(pairs), memo={})

