"""Position errors reported without a host synchronisation.

A kernel that reads positions clamps one outside its range (it reads position 0, so nothing is
indexed out of bounds) and writes the call's *tag*, a 31-bit number unique to that call, into an
error word of its own. The words live in pinned host memory that the GPU writes directly (mapped
through unified addressing), so no copy follows the kernel. Right after the kernel a CUDA event is
recorded on the same stream (in the same C call as the launch); nothing waits. The call is then
*pending*:

* at the next call of the same op from the same thread, on the same device and stream, every
  pending call whose event has completed is judged (``cuEventQuery`` does not block; calls on one
  stream complete in order, so judging stops at the first unfinished one): a word holding its tag
  raises the ``ValueError`` naming the index and value of the bad position, before that next call
  runs;
* ``op.check()`` waits for this thread's pending calls of the op and reports them;
* each bad call raises its own ``ValueError``, once: a judgement stops at the first bad call it
  finds, and the calls after it stay pending for the next call or ``check()``;
* in strict mode (``TILEOPS_STRICT=1`` in the environment when tileops is imported, or
  ``with tileops.strict():``) every call waits for its own kernel and raises at once, at the cost
  of that synchronisation.

A bad position is therefore reported at the first call of the op that starts after the GPU has run
the bad call, or at ``op.check()``; a call queued behind it cannot know yet without waiting.

On the CPU the kernels run synchronously, so a bad position is reported at the call itself.

The state is per call, kept per (thread, device, stream): threads and streams that share an op
never see each other's errors. Words come from a per-device pool that grows in chunks and never
shrinks; a word is reused only after its call was judged, so no word is reused while a stream may
still write it.

Inside a CUDA graph capture no event is recorded: the words a captured call uses are kept for the
graph (never reused), and ``op.check()`` reads them after a replay (synchronise first) and clears
them, so the next replay is judged alone.

Two implementations of the pool and the tracker behave identically: :class:`ErrorWords` and
:class:`Tracker` here, and the native extension's ``Pool`` and ``Tracker`` (:mod:`tileops.runtime.native`),
which :func:`words_for` and :func:`new_tracker` hand out once the extension is loaded, and which
its fast path uses without Python. A native tracker judges the calls an op made through the Python
one before the extension was loaded (its ``legacy``) first.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import os
import sys
import threading
from typing import Any, Callable, Iterator

import torch

from . import native

__all__ = ["strict", "is_strict", "ErrorWords", "Tracker", "words_for", "new_tracker", "driver"]

#: error words per chunk of a device's pool (a chunk is 16 KiB of pinned memory)
CHUNK = 4096
_tags = itertools.count(1)

#: how a reported call is named in the error, after the op's name and position (``when``)
WHEN_NOW = ""
WHEN_EARLIER = "reported for an earlier call of this op, whose kernel read the position as 0"
WHEN_GRAPH = "in a CUDA graph replay"


class _StrictLocal(threading.local):
    on: "bool | None" = None  # a class default: reading it never raises (the native path reads it too)


_strict = _StrictLocal()


@contextlib.contextmanager
def strict(enabled: bool = True) -> Iterator[None]:
    """Within this block (on this thread), every call that takes positions reports a bad one at
    the call itself, waiting for its kernel to do so."""
    before = _strict.on
    _strict.on = enabled
    try:
        yield
    finally:
        _strict.on = before


#: ``TILEOPS_STRICT`` is read once, when tileops is imported (reading the environment costs about
#: 1 µs per call on a serving host); within a process, use :func:`strict`
_ENV_STRICT = os.environ.get("TILEOPS_STRICT", "") not in ("", "0")


def is_strict() -> bool:
    on = _strict.on
    return _ENV_STRICT if on is None else on


def next_tag() -> int:
    """A new call's tag: never 0, the value a word starts with (``next`` on a count is atomic)."""
    return next(_tags) % 0x7FFFFFFF + 1


# ------------------------------------------------------------------------------ CUDA driver
class _Driver:
    """The few CUDA driver calls the error words need, through ctypes (torch's Python wrappers for
    events cost 5-6 µs per record on the host; these cost well under 1 µs)."""

    NOT_READY = 600  # CUDA_ERROR_NOT_READY

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        vp = ctypes.c_void_p
        for name, args in (("cuEventRecord", [vp, vp]), ("cuEventQuery", [vp]), ("cuEventSynchronize", [vp]),
                           ("cuStreamIsCapturing", [vp, ctypes.POINTER(ctypes.c_int)])):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        self.lib = lib
        address = lambda name: ctypes.cast(getattr(lib, name), ctypes.c_void_p).value  # noqa: E731
        self.record_address = address("cuEventRecord")
        self.capturing_address = address("cuStreamIsCapturing")
        self._query_args = (address("cuEventQuery"), address("cuThreadExchangeStreamCaptureMode"))
        #: for the native extension: (record, capturing, query, synchronize, exchange capture mode)
        self.addresses = (self.record_address, self.capturing_address, self._query_args[0],
                          address("cuEventSynchronize"), self._query_args[1])
        # an event query is one of the calls CUDA forbids while any thread captures a graph in the
        # default (global) mode; it is safe here (no judged event belongs to a capture), so it runs
        # with this thread's capture mode relaxed, in C (through Python it would cost 3 driver calls)
        try:
            from ..compile.entry import build_c_library

            helper = build_c_library(_QUERY_SOURCE).tileops_event_query
            helper.argtypes, helper.restype = [ctypes.c_void_p] * 3, ctypes.c_int
            q, x = self._query_args
            self._query = functools.partial(helper, q, x)
        except OSError:
            exchange = lib.cuThreadExchangeStreamCaptureMode
            exchange.argtypes, exchange.restype = [ctypes.POINTER(ctypes.c_int)], ctypes.c_int

            def query(ev: int) -> int:
                mode = ctypes.c_int(2)  # CU_STREAM_CAPTURE_MODE_RELAXED
                exchange(ctypes.byref(mode))
                try:
                    return lib.cuEventQuery(ev)
                finally:
                    exchange(ctypes.byref(mode))
            self._query = query

    _side: dict[int, Any] = {}

    def create_event(self, device_index: int) -> tuple[Any, int]:
        """A new CUDA event on the device, and its raw handle. torch creates it at its first record,
        made on a private stream (never one being captured into a graph); the driver calls then use
        the handle."""
        ev = torch.cuda.Event()
        side = self._side.get(device_index)
        if side is None:
            side = self._side.setdefault(device_index, torch.cuda.Stream(device_index))
        with torch.cuda.device(device_index):
            ev.record(side)
        return ev, ev.cuda_event

    def done(self, event: int) -> bool:
        rc = self._query(event)
        if rc == 0:
            return True
        if rc == self.NOT_READY:
            return False
        raise RuntimeError(f"tileops: cuEventQuery failed with CUDA error {rc}")

    def wait(self, event: int) -> None:
        rc = self.lib.cuEventSynchronize(event)
        if rc != 0:
            raise RuntimeError(f"tileops: cuEventSynchronize failed with CUDA error {rc}")



_QUERY_SOURCE = """
/* generated by tileops.runtime.errors: cuEventQuery with this thread's graph-capture mode relaxed */
typedef int (*query_t)(void*);
typedef int (*exchange_t)(int*);
int tileops_event_query(void* query, void* exchange, void* event) {
  int mode = 2; /* CU_STREAM_CAPTURE_MODE_RELAXED */
  ((exchange_t)exchange)(&mode);
  int rc = ((query_t)query)(event);
  ((exchange_t)exchange)(&mode);
  return rc;
}
"""

_driver: _Driver | None = None


def driver() -> _Driver:
    global _driver
    if _driver is None:
        _driver = _Driver()
    return _driver


# ------------------------------------------------------------------------------ error words
class ErrorWords:
    """A device's pool of error words: int32 in pinned host memory that kernels write directly (on
    the CPU, ordinary memory), with a CUDA event per word for its call's completion."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.index = device.index if device.index is not None else (torch.cuda.current_device() if self.cuda else -1)
        self._lock = threading.Lock()
        self._buffers: list[torch.Tensor] = []
        self._words: list[Any] = []  # ctypes int32 arrays over the buffers
        self._bases: list[int] = []
        self._events: list[int] = []
        self._event_objects: list[Any] = []  # the torch events that own the handles
        self._free: list[int] = []
        self._grow()

    def _grow(self) -> None:
        # pinned memory from cudaHostAlloc is mapped at the same address on the device (UVA)
        buf = torch.zeros(CHUNK, dtype=torch.int32, pin_memory=self.cuda)
        first = len(self._buffers) * CHUNK
        self._buffers.append(buf)
        self._words.append((ctypes.c_int32 * CHUNK).from_address(buf.data_ptr()))
        self._bases.append(buf.data_ptr())
        self._events += [0] * CHUNK
        self._free += range(first + CHUNK - 1, first - 1, -1)

    def take(self) -> int:
        """A free word (list.pop is atomic; the lock only serialises growth)."""
        try:
            return self._free.pop()
        except IndexError:
            with self._lock:
                if not self._free:
                    self._grow()
            return self.take()

    def give_back(self, i: int) -> None:
        self._free.append(i)

    def address(self, i: int) -> int:
        """The word's address, as the kernel writes it."""
        return self._bases[i // CHUNK] + 4 * (i % CHUNK)

    def read(self, i: int) -> int:
        return self._words[i // CHUNK][i % CHUNK]

    def clear(self, i: int) -> None:
        self._words[i // CHUNK][i % CHUNK] = 0

    def event(self, i: int) -> int:
        ev = self._events[i]
        if not ev:
            owner, ev = driver().create_event(self.index)
            with self._lock:
                self._event_objects.append(owner)
            self._events[i] = ev
        return ev


_pools: dict[tuple[bool, torch.device], Any] = {}
_pools_lock = threading.Lock()


def words_for(device: torch.device) -> Any:
    """The device's pool of error words: the native extension's once it is loaded, else an
    :class:`ErrorWords` (both have the same methods)."""
    mod = native.module
    key = (mod is not None, device)
    pool = _pools.get(key)
    if pool is None:
        with _pools_lock:
            pool = _pools.get(key)
            if pool is None:
                pool = _pools[key] = ErrorWords(device) if mod is None else _native_pool(mod, device)
    return pool


def _native_pool(mod: Any, device: torch.device) -> Any:
    cuda = device.type == "cuda"
    index = device.index if device.index is not None else (torch.cuda.current_device() if cuda else -1)
    if cuda and not mod.has_driver():
        mod.set_driver(*driver().addresses)

    def grow() -> tuple[torch.Tensor, int]:
        buf = torch.zeros(CHUNK, dtype=torch.int32, pin_memory=cuda)
        return buf, buf.data_ptr()

    def make_event() -> tuple[Any, int]:
        return driver().create_event(index)

    return mod.Pool(device, cuda, index, CHUNK, grow, make_event)


class _TrackerLocal(threading.local):
    state: Any = None  # a native tracker's per-thread state (a class default: reading it never raises)


def new_tracker(raise_bad: Callable[..., None]) -> Any:
    """A tracker for one op: the native extension's once it is loaded, else a :class:`Tracker`."""
    mod = native.module
    return Tracker(raise_bad) if mod is None else mod.Tracker(raise_bad, _TrackerLocal())


def configure_native(mod: Any) -> None:
    """Hand the native extension what it mirrors from this module (called when it is loaded)."""
    from ..compile.entry import _CAPTURING, _RECORD_FAILED

    mod.configure(rc_record_failed=_RECORD_FAILED, rc_capturing=_CAPTURING, when_now=WHEN_NOW,
                  when_earlier=WHEN_EARLIER, when_graph=WHEN_GRAPH, strict_local=_strict,
                  errors_module=sys.modules[__name__], py_tracker=Tracker)


# ------------------------------------------------------------------------------ one op's calls
class Tracker:
    """One op's calls that read positions and are not judged yet.

    A pending call is ``[pool, word, tag, position_ids, event]``, kept in a list per
    (pool, stream) in a per-thread dict. ``raise_bad(position_ids, when)`` raises the op's error.
    """

    def __init__(self, raise_bad: Callable[..., None]):
        self._local = threading.local()
        self._raise_bad = raise_bad
        self._graph: list[tuple[ErrorWords, int, int, torch.Tensor]] = []
        self._graph_lock = threading.Lock()

    def pending(self) -> dict:
        p = getattr(self._local, "pending", None)
        if p is None:
            p = self._local.pending = {}
        return p

    def has_pending(self) -> bool:
        return bool(getattr(self._local, "pending", None))

    def launch(self, kernel: Any, args: Any, err_slot: int, tag_slot: int, position_ids: torch.Tensor,
               pool: ErrorWords, stream: int) -> None:
        """Launch ``kernel`` with a fresh error word and tag filled into ``args`` (at indices
        ``err_slot`` and ``tag_slot``), and follow the call: judged now (CPU, strict mode), later,
        or with a graph."""
        word = pool.take()
        tag = next_tag()
        args[err_slot], args[tag_slot] = pool.address(word), tag
        if not pool.cuda:  # the kernel runs synchronously: judge the call now
            try:
                kernel.launch(args, 0)
                bad = pool.read(word) == tag
            finally:
                pool.give_back(word)  # only after reading it: another call may take it at once
            if bad:
                self._raise_bad(position_ids, WHEN_NOW)
            return
        drv = driver()
        event = pool.event(word)
        try:
            captured = kernel.launch(args, stream, drv.record_address, event, drv.capturing_address)
        except BaseException:
            pool.give_back(word)
            raise
        if captured:  # replays write the word: op.check() reads and clears it
            with self._graph_lock:
                self._graph.append((pool, word, tag, position_ids))
            return
        if is_strict():
            drv.wait(event)
            bad = pool.read(word) == tag
            pool.give_back(word)
            if bad:
                self._raise_bad(position_ids, WHEN_NOW)
            return
        p = self.pending()
        calls = p.get((pool, stream))
        if calls is None:
            calls = p[(pool, stream)] = []
        calls.append((pool, word, tag, position_ids, event))

    def reap(self, wait: bool = False) -> None:
        """Judge this thread's finished calls (all of them with ``wait``); raise for the first bad one.
        Safe while a graph is being captured: no pending call belongs to a capture, and the event
        query runs with this thread's capture mode relaxed."""
        pending = self.pending()
        if not pending:
            return
        failed = None
        drv = driver()
        done_fn = drv.done
        for key in list(pending):
            calls = pending[key]
            done = 0
            try:
                for pool, word, tag, position_ids, event in calls:  # in order: stop at the first unfinished
                    if wait:
                        drv.wait(event)
                    elif not done_fn(event):
                        break
                    done += 1
                    bad = pool.read(word) == tag
                    pool.give_back(word)  # only after reading it
                    if bad:  # one error per bad call: later calls stay pending, for the next report
                        failed = position_ids
                        break
            finally:  # a driver error: the calls judged so far are not judged (nor given back) again
                if done == len(calls):
                    del pending[key]
                elif done:
                    del calls[:done]
            if failed is not None:
                break
        if failed is not None:
            self._raise_bad(failed, WHEN_EARLIER)

    def check(self) -> None:
        """Wait for this thread's calls and judge them, then judge (and clear) the graph-captured words."""
        self.reap(wait=True)
        bad = None
        with self._graph_lock:
            graph = list(self._graph)
        for pool, word, tag, position_ids in graph:
            if bad is None and pool.read(word) == tag:
                bad = position_ids
            pool.clear(word)
        if bad is not None:
            self._raise_bad(bad, WHEN_GRAPH)
