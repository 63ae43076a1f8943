"""Errors in the values a kernel checks on the device (RoPE's positions), reported without a host
synchronisation: the one error tracker of every family.

A kernel that checks an input's values (a binding's ``checked`` input) clamps one outside its range
(RoPE reads position 0, so nothing is indexed out of bounds) and writes the call's *tag*, a 31-bit
number unique to that call, into an error entry of its own: pinned host memory the GPU writes
directly (mapped through unified addressing), so no copy follows the kernel. Every eighth call of a
stream's queue records a CUDA event on the same stream right after the kernel, in the same C call as
the launch; nothing waits. (An event a call, recorded and later queried, cost 2.35 us of a 9 us call
on an H100: the calls between are covered by the next event, as calls on one stream complete in
order.) The call is then *pending*:

* at the next call of the same op from the same thread, on the same device and stream, a pending
  call whose word already holds its tag has run and found a bad value: its stream is waited for (an
  event recorded after its last call, unless the stream is being captured) and its calls judged in
  order. Otherwise, at the call after each event, every pending call that a completed event covers is
  judged (``cuEventQuery`` does not block; judging stops at the first unfinished event). A word
  holding its tag raises the op's ``ValueError`` naming the index and value of the bad one, before
  that next call runs;
* ``op.check()`` waits for this thread's pending calls of the op (the GIL released; an event is
  recorded after the last where it has none) and reports them;
* each bad call raises its own ``ValueError``, once: a judgement stops at the first bad call, and the
  calls after it stay pending for the next call or ``check()``;
* in strict mode (``TILEOPS_STRICT=1`` when tileops is imported, or ``with tileops.strict():``) every
  call waits for its own kernel and raises at once, at the cost of that synchronisation.

So a bad value is reported at the first call of the op that starts after the GPU has run the bad
call, or at ``op.check()``; on the CPU, where kernels run synchronously, at the call itself.

The state is per call, kept per (thread, device, stream): threads and streams that share an op never
see each other's errors. Words come from a per-device pool that grows in chunks and never shrinks; a
word is reused only after its call was judged, never while a stream may still write it. Inside a CUDA
graph capture no event is recorded: a captured call's word is kept for the graph (never reused), and
``op.check()`` reads it after a replay (synchronise first) and clears it for the next replay.

To name the bad value, the tracker keeps a weak reference to each checked input of a pending or
captured call, never a strong one: keeping the tensor alive until the report would hold memory the
caller freed, which torch's CUDA-graph trees (``torch.compile(mode="reduce-overhead")``) refuse, as
they free a recording's inputs and then check that nothing else holds their pool. So the kernel
records the first bad element itself, its offset and value, beside the tag
(:mod:`tileops.kernels.report`), and the tracker keeps the sizes and strides each checked tensor was
launched with: a report whose tensor was freed by then (a temporary passed to a deferred call, the
common ``op(x, position_ids=pos.to("cuda"))``) names the index and value from the record
(:class:`BadValue`, :func:`found`), as a report of a live tensor names them from its values.

The tracker that defers is the native extension's (:mod:`tileops.runtime.native`), the one
implementation. Without the extension (``TILEOPS_NATIVE=0``, no compiler) nothing is deferred:
:class:`tileops.runtime.executor.PythonRuntime` judges a call that checks values at the call itself,
on a GPU by waiting for its kernel (what strict mode does), and keeps the words of captured calls for
``op.check()`` as above; :class:`Words` is its pool.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import itertools
import os
import threading
from typing import Any, Iterator

import torch

from ..kernels import report
from . import native

__all__ = ["strict", "is_strict", "unnamed", "BadValue", "found", "WORDS", "ENTRY", "Words", "words_for", "driver_addresses", "make_event",
           "WHEN_NOW", "WHEN_EARLIER", "WHEN_GRAPH"]

#: error entries per chunk of a device's pool (a chunk is 192 KiB of pinned memory)
CHUNK = 4096
#: checked inputs one call's entry serves (the attention prologue checks two: positions and slots),
#: each with its tag word ``ERR[k]`` and a record of its first bad element
#: (:mod:`tileops.kernels.report`); the native extension's ``kWords``
WORDS = report.CHECKS
#: int32 words of one call's entry (the native extension's ``kEntry``)
ENTRY = report.ENTRY
_tags = itertools.count(1)

#: how a reported call is named in the error, after the op's name and position (``when``)
WHEN_NOW = ""
WHEN_EARLIER = "reported for an earlier call of this op"
WHEN_GRAPH = "in a CUDA graph replay"

#: ``TILEOPS_STRICT`` is read once, when tileops is imported (reading the environment costs about
#: 1 µs per call on a serving host); within a process, use :func:`strict`
ENV_STRICT = os.environ.get("TILEOPS_STRICT", "") not in ("", "0")


class _StrictLocal(threading.local):
    on = -1  # as the extension's flag: 1, 0, or -1 unset (ENV_STRICT decides); a class default never raises


_strict = _StrictLocal()


def _set_strict(value: int) -> int:
    """Set this thread's flag without the extension, as its ``set_strict`` does; returns the old one."""
    before, _strict.on = _strict.on, (-1 if value < 0 else int(value > 0))
    return before


@contextlib.contextmanager
def strict(enabled: bool = True) -> Iterator[None]:
    """Within this block (on this thread), every call whose kernel checks values (RoPE's positions)
    reports a bad one at the call itself, waiting for its kernel to do so."""
    mod = native.module  # the extension's tracker reads its own thread-local flag
    swap = mod.set_strict if mod is not None else _set_strict
    before = swap(int(bool(enabled)))
    try:
        yield
    finally:
        swap(before)


def unnamed(values: "torch.Tensor | None") -> str:
    """Why a report cannot name the bad value's index: its tensor was freed before the report (None)
    and the kernel's record could not place it, or the tensor no longer holds a bad value (changed
    since the kernel read it)."""
    if values is None:
        return ("the tensor was freed before this report, so its index is unknown: check the call with "
                "op.check() right after it, or in tileops.strict(), to have it named")
    return "the tensor has changed since, so its index is unknown"


@dataclasses.dataclass(frozen=True)
class BadValue:
    """The first bad element a kernel recorded for a checked input (:mod:`tileops.kernels.report`):
    its index in the tensor as launched, and its value (``beyond``: saturated at int32's range, the
    value was that or further from 0)."""

    index: tuple[int, ...]
    value: int
    beyond: bool = False

    def __str__(self) -> str:
        """``[i, j] = v`` (the form a report appends to the argument's name)."""
        more = (" or more" if self.value > 0 else " or less") if self.beyond else ""
        return f"[{', '.join(map(str, self.index))}] = {self.value}{more}"


def found(lo: int, hi: int, sizes: "tuple[int, ...] | None", strides: "tuple[int, ...] | None") -> "BadValue | None":
    """The :class:`BadValue` of a record's two words (low, high) for a tensor launched with ``sizes``
    and ``strides`` (None: not known), or None when the entry holds no record (a kernel of an older
    layout) or its offset cannot be placed in the tensor."""
    stored = ((hi & 0xFFFFFFFF) << 32) | (lo & 0xFFFFFFFF)
    if stored == 0 or sizes is None or strides is None:
        return None
    packed = report.RECORD_MAX - stored
    offset, raw = packed >> 32, packed & 0xFFFFFFFF
    value = raw - (1 << 32) if raw & 0x80000000 else raw
    if offset >= report.OFFSET_MAX:
        return None
    # the offset back to an index: the dims by stride, largest first (a dim of stride 0 or size 1
    # is index 0, a broadcast's first element, as torch's own first element of it)
    index = [0] * len(sizes)
    left = offset
    for d in sorted(range(len(sizes)), key=lambda d: -strides[d]):
        if strides[d] > 0 and sizes[d] > 1:
            index[d], left = divmod(left, strides[d])
            if index[d] >= sizes[d]:
                return None
    if left:
        return None
    return BadValue(tuple(index), value, beyond=value in (2**31 - 1, -(2**31)))


def is_strict() -> bool:
    mod = native.module
    if mod is not None:
        return mod.is_strict()
    return ENV_STRICT if _strict.on < 0 else _strict.on > 0


def next_tag() -> int:
    """A new call's tag: never 0, the value a word starts with (``next`` on a count is atomic)."""
    return next(_tags) % 0x7FFFFFFF + 1


def driver_addresses() -> tuple[int, ...]:
    """The CUDA driver functions the extension's tracker calls, by address (it includes no CUDA
    header): cuEventRecord, cuStreamIsCapturing, cuEventQuery, cuEventSynchronize,
    cuThreadExchangeStreamCaptureMode."""
    lib = ctypes.CDLL("libcuda.so.1")
    return tuple(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0 for name in (
        "cuEventRecord", "cuStreamIsCapturing", "cuEventQuery", "cuEventSynchronize",
        "cuThreadExchangeStreamCaptureMode"))


_events: list = []  # the torch events whose raw handles the extension's words use (never freed)
_side: dict[int, Any] = {}


def make_event(index: int) -> int:
    """A new CUDA event on device ``index``, as its raw handle (for the extension's words). torch
    creates it at its first record, made on a private stream (never one being captured into a graph)."""
    ev = torch.cuda.Event()
    side = _side.get(index)
    if side is None:
        side = _side.setdefault(index, torch.cuda.Stream(index))
    with torch.cuda.device(index):
        ev.record(side)
    _events.append(ev)
    return ev.cuda_event


class Words:
    """A device's error words for :class:`tileops.runtime.executor.PythonRuntime`: int32 in pinned
    host memory that kernels write directly (on the CPU, ordinary memory)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._lock = threading.Lock()
        self._buffers: list[torch.Tensor] = []
        self._words: list[ctypes.Array] = []  # ctypes int32 arrays over the buffers
        self._free: list[int] = []
        self._grow()

    def _grow(self) -> None:
        # pinned memory from cudaHostAlloc is mapped at the same address on the device (UVA)
        buf = torch.zeros(CHUNK * ENTRY, dtype=torch.int32, pin_memory=self.cuda)
        first = len(self._buffers) * CHUNK
        self._buffers.append(buf)
        self._words.append((ctypes.c_int32 * (CHUNK * ENTRY)).from_address(buf.data_ptr()))
        self._free += range(first + CHUNK - 1, first - 1, -1)

    def take(self) -> int:
        """A free word (list.pop is atomic; the lock only serialises growth)."""
        while True:
            try:
                return self._free.pop()
            except IndexError:
                with self._lock:
                    if not self._free:
                        self._grow()

    def give_back(self, i: int) -> None:
        self._free.append(i)

    def address(self, i: int) -> int:
        """The address of entry ``i``'s first word (the kernel's ``ERR``)."""
        return self._buffers[i // CHUNK].data_ptr() + 4 * ENTRY * (i % CHUNK)

    def read(self, i: int, k: int = 0) -> int:
        """Word ``k`` of entry ``i``."""
        return self._words[i // CHUNK][(i % CHUNK) * ENTRY + k]

    def record(self, i: int, k: int) -> tuple[int, int]:
        """The two words (low, high) of checked input ``k``'s record in entry ``i``."""
        return self.read(i, WORDS + 2 * k), self.read(i, WORDS + 2 * k + 1)

    def clear(self, i: int) -> None:
        """Zero entry ``i`` (after a bad call: its records would outrank the next call's)."""
        for k in range(ENTRY):
            self._words[i // CHUNK][(i % CHUNK) * ENTRY + k] = 0


_pools: dict[torch.device, Words] = {}
_pools_lock = threading.Lock()


def words_for(device: torch.device) -> Words:
    """The device's pool of error words (one per device, made at its first use)."""
    pool = _pools.get(device)
    if pool is None:
        with _pools_lock:
            pool = _pools.get(device) or _pools.setdefault(device, Words(device))
    return pool
