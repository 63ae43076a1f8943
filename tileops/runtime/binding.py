"""Launches described once per call signature: the :class:`Binding`.

A family declares how a call's tensors meet its kernels as a plan (:mod:`tileops.runtime.plan`);
the runtime binds it, once per signature (every tensor's shape, strides, dtype and device, and which
outputs are given or in place), into a :class:`Binding`: each kernel's whole argument array with
every shape, stride and scalar filled, and where each tensor's (and each per-call workspace's)
pointer goes. A later call shaped the same way only reads its pointers into a copy of those arrays:
in the C++ executor (:mod:`tileops.runtime.native`) without Python, else in
:class:`tileops.runtime.executor.PythonRuntime`. The family's general path (a signature's first call,
views it must copy, gradients) binds the tensors it launches with through the same plan and runs
the same executor.

Tensors are numbered as the binding's names list them: the inputs, then the outputs (an op's
manifest's, or those a plan declares). Per call the executor checks what the pointers alone decide
(alignment; the overlap of given outputs with the other arguments by byte spans, then exactly where
the spans meet) and refuses the call, before it has allocated, launched or called Python, when
either fails: the general path then copies or raises.
"""

from __future__ import annotations

import array
import dataclasses
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from .memory import span

__all__ = ["Binding", "Launch", "with_overlap_checks", "late_tensors", "device_of", "ABSENT", "NEW", "IN_PLACE", "GIVEN"]

#: how a call gets each output: its ``like`` input not given (no output), a new tensor allocated per
#: call as ``torch.empty_like(<like input>)``, the like input itself (in place), or a tensor the call gives
ABSENT, NEW, IN_PLACE, GIVEN = 0, 1, 2, 3


@dataclass(frozen=True)
class Launch:
    """One kernel of a :class:`Binding`: its whole argument array but the pointers, and where they go."""

    #: the :class:`tileops.compile.entry.RawKernel` launched
    kernel: Any
    #: every argument of the kernel's C entry point (its parameters, then the dynamic extents) as
    #: int64 (a pointer as its address, a float as its bits)
    template: array.array
    #: ``(tensor, slot, alignment in bytes)``: the data pointer of tensor ``tensor`` (numbered as
    #: :attr:`Binding.names`, then the per-call workspaces) goes into ``template[slot]``
    pointers: tuple[tuple[int, int, int], ...]


@dataclass(frozen=True, eq=False)
class Binding:
    """One call signature's launches, in order: everything but the pointers, which each call brings.

    A call's tensors are numbered as :attr:`names` lists them (the inputs, then the outputs); the
    per-call workspaces come after them, workspace ``w`` as tensor ``len(names) + w``.
    """

    launches: tuple[Launch, ...]
    #: the input names then output names (tensor ``i`` of a call is the one named ``names[i]``): the
    #: op's manifest's for a call of the op, or those a plan declares (a backward's gradients)
    names: tuple[str, ...]
    #: how many of ``names`` are inputs
    inputs: int
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
    #: a new output's dtype when it is not its like input's (a backward's dx in x's dtype, like dy),
    #: else None
    dtypes: tuple[torch.dtype | None, ...] = ()
    #: ``(tensor, span, tensor, span)``: pairs that must not share memory, spans in bytes
    pairs: tuple[tuple[int, int, int, int], ...] = ()
    #: ``(slot, fn)``: ``fn(inputs)`` (input name -> tensor or None) returns a tensor whose pointer
    #: goes into the slot of the first launch (chosen per call, e.g. on the device); kept alive
    #: until the kernel is queued
    late: tuple[tuple[int, Callable[[dict], torch.Tensor]], ...] = ()
    #: ``(input, word)``: the inputs whose values launch ``checked`` checks, each writing the call's
    #: tag into word ``word`` of the call's error words (its ``ERR``) when one is out of range
    #: (:mod:`tileops.runtime.errors`); empty: the call is not tracked
    checks: tuple[tuple[int, int], ...] = ()
    checked: int = 0
    word_slot: int = -1
    tag_slot: int = -1
    #: the per-call workspaces: each one's byte offset in one allocation of ``work_bytes`` bytes,
    #: made per call on the launches' device (a workspace kept across calls is among ``keep``,
    #: its address in the templates)
    work: tuple[int, ...] = ()
    work_bytes: int = 0
    #: ``(launch, slot, index)``: argument ``slot`` of launch ``launch`` takes the call's per-call
    #: scalar ``index`` (a length that changes every call but no tensor's shape: a decode step's)
    scalars: tuple[tuple[int, int, int], ...] = ()
    #: tensors whose addresses the templates hold (kept alive with them)
    keep: tuple[torch.Tensor, ...] = ()
    #: the exact overlap test's answers, by (pair, offset) (one storage: the offset alone decides)
    memo: dict = field(default_factory=dict, repr=False)
    #: the outputs a call returns (those whose like input is given), by output index
    produced: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "produced", tuple(j for j, mode in enumerate(self.outputs) if mode != ABSENT))
        if self.late:
            _late[id(self)] = self

    @property
    def kernel(self) -> Any:
        """The first launch's kernel (the one a single-kernel binding has)."""
        return self.launches[0].kernel


def device_of(kernel: Any) -> torch.device:
    """The device a :class:`tileops.compile.entry.RawKernel` launches on (where a binding's per-call
    workspaces are allocated)."""
    return torch.device("cpu") if kernel.device_index is None else torch.device("cuda", kernel.device_index)


#: the bindings with late-bound slots, by ``id()``, while they live: the native executor keeps a
#: binding's numbers, not its Python functions, and finds them here (:func:`late_tensors`)
_late: "weakref.WeakValueDictionary[int, Binding]" = weakref.WeakValueDictionary()


def late_tensors(key: int, inputs: tuple) -> list[torch.Tensor]:
    """The tensors of the late-bound slots of the binding whose ``id()`` is ``key``, for a call whose
    inputs (tensor or None each, in the manifest's order) are ``inputs``."""
    b = _late[key]
    named = dict(zip(b.names, inputs))
    return [fn(named) for _, fn in b.late]


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

