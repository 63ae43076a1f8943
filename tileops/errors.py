"""Position errors reported without a host synchronisation.

A kernel that reads positions clamps one outside its range (it reads position 0, so nothing is
indexed out of bounds) and writes the call's *tag*, a 32-bit number unique to that call, into an
error word of its own. Right after the kernel, the word is copied to pinned host memory
asynchronously and a CUDA event is recorded; nothing waits. The call is then *pending*:

* at the next call of the same op from the same thread and stream, every pending call whose event
  has completed is checked (``event.query()`` does not block): a word holding its tag raises the
  ``ValueError``, naming the index and value of the bad position;
* ``op.check()`` waits for the pending calls of this thread and stream and reports them;
* in strict mode (``TILEOPS_STRICT=1`` in the environment, or ``with tileops.strict():``) every
  call waits for its own kernel and raises at once, at the cost of that synchronisation.

On the CPU the kernels run synchronously, so a bad position is reported at the call itself.

The state is per call, kept per (thread, stream): threads and streams that share an op never see
each other's errors. Error words and pinned host words come from a per-device pool allocated once
(grown only if more than ``SLOTS`` calls are in flight at once); a word is reused only after its
call was checked, so no buffer is freed or reused while a stream may still write it.

Inside a CUDA graph capture no event is recorded: the words a captured call uses are kept for the
graph (never reused), and ``op.check()`` reads them after a replay (synchronise first) and clears
them, so the next replay is judged alone.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from dataclasses import dataclass
from typing import Any, Iterator

import torch

__all__ = ["strict", "is_strict", "ErrorWords", "Pending", "words_for"]

#: error words allocated per device at first use
SLOTS = 1024
_tags = itertools.count(1)
_tag_lock = threading.Lock()
_strict = threading.local()


@contextlib.contextmanager
def strict(enabled: bool = True) -> Iterator[None]:
    """Within this block (on this thread), every call that takes positions reports a bad one at
    the call itself, waiting for its kernel to do so."""
    before = getattr(_strict, "on", None)
    _strict.on = enabled
    try:
        yield
    finally:
        _strict.on = before


def is_strict() -> bool:
    on = getattr(_strict, "on", None)
    if on is not None:
        return on
    return os.environ.get("TILEOPS_STRICT", "") not in ("", "0")


def next_tag() -> int:
    with _tag_lock:
        return (next(_tags) % (2**31 - 1)) + 1  # never 0, the value a word is created with


class ErrorWords:
    """A device's pool of error words (int32 on the device) with a pinned host copy each."""

    def __init__(self, device: torch.device):
        self.device = device
        self._lock = threading.Lock()
        self._free: list[int] = []
        self.dev = torch.empty(0, dtype=torch.int32, device=device)
        self.host = torch.empty(0, dtype=torch.int32)
        self._events: list[Any] = []
        self._grow()

    def _grow(self) -> None:
        n = self.dev.numel()
        add = max(SLOTS, n)
        dev = torch.zeros(n + add, dtype=torch.int32, device=self.device)
        pinned = self.device.type == "cuda"
        host = torch.zeros(n + add, dtype=torch.int32, pin_memory=pinned)
        # the old words stay alive with their pending calls (each holds its own view)
        self.dev, self.host = dev, host
        self._events += [None] * add
        self._free += list(range(n + add - 1, n - 1, -1))

    def take(self) -> int:
        with self._lock:
            if not self._free:
                self._grow()
            return self._free.pop()

    def give_back(self, i: int) -> None:
        with self._lock:
            self._free.append(i)

    def event(self, i: int) -> Any:
        ev = self._events[i]
        if ev is None:
            ev = self._events[i] = torch.cuda.Event()
        return ev


_pools: dict[torch.device, ErrorWords] = {}
_pools_lock = threading.Lock()


def words_for(device: torch.device) -> ErrorWords:
    pool = _pools.get(device)
    if pool is None:
        with _pools_lock:
            pool = _pools.get(device)
            if pool is None:
                pool = _pools[device] = ErrorWords(device)
    return pool


@dataclass
class Pending:
    """One call's error word: where it is, the tag that marks an error, and what to name."""

    pool: ErrorWords
    slot: int
    dev: torch.Tensor  # the 1-element device view the kernel writes
    host: torch.Tensor  # the 1-element pinned view it is copied to
    tag: int
    position_ids: torch.Tensor
    event: Any = None
    graph: bool = False

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def failed(self) -> bool:
        return int(self.host.item()) == self.tag
