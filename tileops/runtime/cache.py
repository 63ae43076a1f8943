"""One op's bindings, in one place: :class:`Bindings`.

A :class:`tileops.runtime.binding.Binding` is made once per call signature and kept here, whichever
path made it:

* the call's own: the call signature (:meth:`tileops.op.Op._eager_call`'s) -> the implementation
  serving it and its binding, or None where such calls cannot be bound. A call found here skips the
  signature checks and runs the binding;
* the general path's: a kernel set's plan bound for the tensors it launches with (views copied first,
  a backward, dynamic NTK's table update), under ``(owner, key)``: the kernel set (or table holder)
  that binds it and the plan's :meth:`tileops.runtime.plan.Plan.key` with whatever else the binding
  depends on.

The native executor (:mod:`tileops.runtime.native`) keeps an index of the call entries of its own, in
C++, to serve a call without Python; it is this cache's mirror: :meth:`Bindings.clear` clears it too,
so the two never disagree about what is bound. Bounded: a workload of ever-new shapes starts over
past ``limit`` entries, rather than growing without end.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

__all__ = ["Bindings", "LIMIT"]

#: entries kept before the cache starts over: a model's calls bind a few dozen signatures (a layer's
#: shapes times prefill and decode), and a bucketed server a few hundred
LIMIT = 4096


class Bindings(dict):
    """One op's bindings by key (see the module's doc). A dict, so that the call path's lookup is a
    plain ``get``; entries go in through :meth:`put` and :meth:`bind`, which keep the bound."""

    def __init__(self, limit: int = LIMIT, mirror: Any = None):
        super().__init__()
        self.limit = limit
        #: the executor's index of the call entries, cleared with this cache (None: the Python executor)
        self.mirror = mirror
        self._lock = threading.Lock()

    def put(self, key: Any, entry: Any) -> None:
        """Keep ``entry`` under ``key``; past the limit, everything is forgotten first."""
        with self._lock:
            if len(self) >= self.limit:
                self._clear()
            self[key] = entry

    def bind(self, owner: Any, key: tuple, make: Callable[[], Any]) -> Any:
        """The binding ``owner`` keeps under ``key`` (a plan's :meth:`~tileops.runtime.plan.Plan.key`,
        and whatever else the binding depends on), made by ``make`` the first time (None: such calls
        cannot be bound, and are not tried again)."""
        try:
            return self[(owner, key)]
        except KeyError:
            pass
        b = make()
        self.put((owner, key), b)
        return b

    def of(self, owner: Any) -> list:
        """The bindings ``owner`` has made (None for a key that cannot be bound), oldest first."""
        return [b for k, b in list(self.items()) if type(k) is tuple and len(k) == 2 and k[0] is owner]

    def clear(self) -> None:
        """Forget every binding, this cache's and its mirror's: the next call of each signature binds again."""
        with self._lock:
            self._clear()

    def _clear(self) -> None:
        super().clear()
        if self.mirror is not None:
            self.mirror.clear()
