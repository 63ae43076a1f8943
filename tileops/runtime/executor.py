"""One op's launches: the runtime object an op makes at construction (:func:`new_runtime`).

With the native extension loaded (:mod:`tileops.runtime.native`) it is the extension's ``Dispatch``:
the op's bindings by call signature, served from C++ (``run``), the same executor for the general
path's bindings (``execute``), and the deferred error tracker. Without it, a :class:`PythonRuntime`:
the same executor in Python, and errors judged at the call (:mod:`tileops.runtime.errors`). Both have

* ``execute(binding, tensors, outs, scalars=())``: run a :class:`tileops.runtime.binding.Binding`'s
  launches in order on a call's tensors (input name -> tensor, output name -> tensor or None, by the
  binding's names) and per-call scalars, its per-call workspaces in one allocation; returns the
  produced outputs (one tensor, a tuple, or None when there are none), or ``NotImplemented``,
  having done nothing, when the pointers refuse it (alignment, overlap);
* ``check()``: judge this thread's calls (waiting for them) and the words of captured calls;
* ``clear()``: forget every binding; ``stats()``: bindings known, calls served and passed on;

and the native one also ``add(tensors, outs, binding)`` (the binding, or None, of calls shaped like
this one), ``run(tensors, outs)`` (a call served from them, or ``NotImplemented``), and
``has_pending()`` and ``reap()`` (this thread's calls not judged yet, judged without waiting). The
Python runtime keeps no bindings: :meth:`tileops.op.Op._eager_call` looks them up itself.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Mapping

import torch

from . import errors, library, native
from .binding import IN_PLACE, NEW, Binding, device_of
from .memory import disjoint

__all__ = ["new_runtime", "PythonRuntime"]


def new_runtime(handle: int, manifest: Any) -> Any:
    """The runtime of the op registered as ``handle`` (:func:`tileops.runtime.library.register`):
    the extension's when it is loaded, else a :class:`PythonRuntime`."""
    mod = native.module
    if mod is None:
        return PythonRuntime(handle)
    ins = tuple(t.name for t in manifest.inputs)
    return mod.Dispatch(handle, ins, tuple(o.name for o in manifest.outputs),
                        tuple(ins.index(o.like) for o in manifest.outputs),
                        tuple(i for i, t in enumerate(manifest.inputs) if t.written))


class PythonRuntime:
    """The executor and error words without the extension (see the module's doc)."""

    def __init__(self, handle: int):
        self.handle = handle
        self._graph: list[tuple[Any, int, int, list]] = []  # words of captured calls
        self._lock = threading.Lock()

    def clear(self) -> None:
        pass

    def stats(self) -> dict:
        return {"bindings": 0, "hits": 0, "misses": 0, "graph_words": len(self._graph)}

    def execute(self, b: Binding, tensors: Mapping[str, Any], outs: Mapping[str, Any] | None,
                scalars: tuple[int, ...] = ()) -> Any:
        n_in, n = b.inputs, len(b.names)
        ts = [tensors.get(name) for name in b.names[:n_in]]
        ts += [outs.get(name) if outs else None for name in b.names[n_in:]]
        for j, mode in enumerate(b.outputs):
            if mode == IN_PLACE:
                ts[n_in + j] = ts[b.likes[j]]
        ptr = [0 if t is None else t.data_ptr() for t in ts]
        for launch in b.launches:
            for i, _, a in launch.pointers:
                if i < n and ptr[i] % a:
                    return NotImplemented
        for k, (i, si, j, sj) in enumerate(b.pairs):
            a0, a1 = ptr[i], ptr[j]
            if a0 + si <= a1 or a1 + sj <= a0:
                continue  # the byte spans do not meet; else the exact test, remembered by offset
            shared = ts[i].untyped_storage().data_ptr() == ts[j].untyped_storage().data_ptr()
            ok = b.memo.get((k, a1 - a0)) if shared else None
            if ok is None:
                ok = disjoint(ts[i], ts[j])
                if shared and len(b.memo) < 64:
                    b.memo[(k, a1 - a0)] = ok
            if not ok:
                return NotImplemented  # the general path names the overlap
        for j, mode in enumerate(b.outputs):  # from here on the call is served
            if mode == NEW:  # (the strides the binding was made for: empty_like's, cheaper from Python)
                like = ts[b.likes[j]]
                sizes = b.sizes[j] if j < len(b.sizes) else ()
                dtype = b.dtypes[j] if j < len(b.dtypes) else None
                t = ts[n_in + j] = (torch.empty_strided(sizes or like.shape, b.strides[j], dtype=dtype or like.dtype,
                                                        device=like.device)
                                    if sizes or dtype is not None else torch.empty_like(like))
                ptr[n_in + j] = t.data_ptr()
        work = None
        if b.work_bytes:  # the per-call workspaces: one allocation, alive until the launches are queued
            work = torch.empty(b.work_bytes, dtype=torch.uint8, device=device_of(b.kernel))
            ptr += [work.data_ptr() + offset for offset in b.work]
        for k, launch in enumerate(b.launches):
            args = launch.template[:]
            for i, slot, _ in launch.pointers:
                args[slot] = ptr[i]
            for at, slot, index in b.scalars:
                if at == k:
                    args[slot] = scalars[index]
            keep = None
            if k == 0 and b.late:
                named = dict(zip(b.names[:n_in], ts[:n_in]))
                keep = [fn(named) for _, fn in b.late]  # alive until the kernel is queued
                for (slot, _), t in zip(b.late, keep):
                    args[slot] = t.data_ptr()
            if k == b.checked and b.checks:
                self._tracked(b, launch.kernel, args, ts)
            else:
                launch.kernel.launch(args, launch.kernel.stream())
        del work
        if not b.produced:
            return None
        if len(b.produced) == 1:
            return ts[n_in + b.produced[0]]
        return tuple(ts[n_in + j] for j in b.produced)

    def _tracked(self, b: Binding, kernel: Any, args: Any, ts: list) -> None:
        """Launch the binding's checking kernel with the call's error words, and judge them."""
        # (word, values, input name, (sizes, strides) as launched) of each checked input
        checked = [(k, ts[i], b.names[i], (tuple(ts[i].shape), ts[i].stride())) for i, k in b.checks]
        words = errors.words_for(checked[0][1].device)
        w, tag = words.take(), errors.next_tag()
        args[b.word_slot], args[b.tag_slot] = words.address(w), tag
        try:
            with torch.cuda.device(kernel.device_index) if words.cuda else contextlib.nullcontext():
                kernel.launch(args, kernel.stream())  # on the CPU the kernel has run when this returns
                capturing = words.cuda and torch.cuda.is_current_stream_capturing()
        except BaseException:
            words.give_back(w)
            raise
        if capturing:  # replays write the words: check() reads and clears them; the tensors are
            # referred to weakly, as the native tracker does (tileops.runtime.errors says why)
            with self._lock:
                self._graph.append((words, w, tag, [(k, weakref.ref(t), name, sh) for k, t, name, sh in checked]))
            return
        if words.cuda:  # without the extension nothing is deferred: judged now
            torch.cuda.current_stream(kernel.device_index).synchronize()
        bad = _bad(words, w, tag, checked)
        record = None
        if bad is not None:
            record = (*words.record(w, bad[0]), *bad[3])
            words.clear(w)
        words.give_back(w)  # only after reading it: another call may take it at once
        if bad is not None:
            library.raise_bad(self.handle, bad[1], errors.WHEN_NOW, bad[2], record)

    def check(self) -> None:
        """Judge (and clear) the words of calls captured in CUDA graphs; every other call was judged."""
        bad = record = None
        with self._lock:
            graph = list(self._graph)
        for words, w, tag, checked in graph:
            if bad is None:
                bad = _bad(words, w, tag, checked)
                if bad is not None:
                    record = (*words.record(w, bad[0]), *bad[3])
            words.clear(w)
        if bad is not None:
            library.raise_bad(self.handle, bad[1](), errors.WHEN_GRAPH, bad[2], record)


def _bad(words: Any, w: int, tag: int, checked: list) -> Any:
    """The first ``(word, values, name, shape)`` of ``checked`` whose word of entry ``w`` holds ``tag``, or None."""
    return next((c for c in checked if words.read(w, c[0]) == tag), None)
