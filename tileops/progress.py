"""Progress of tileops' long steps (compiling kernels, building the native extension), on stderr.

A cold ``tileops warmup`` compiles about 160 kernels (48 s on 2 cores), a first ``op.compile``
takes 16 s: without a word the user cannot tell a slow step from a hung one. Every such step
reports through :class:`Progress` (counted steps) or :func:`task` (one step): a tqdm bar when
stderr is a terminal and tqdm is importable (it is in the ``bench`` extra, not a dependency), else
one plain line per step, ``[12/158] rope neox fp16 head_dim=128 fwd  0.8 s``, which a log or CI
keeps readable.

Whether to show anything is :func:`wanted`: the command line always shows; a library call
(``op.compile(progress=None)``) follows tqdm's own rule for ``disable=None``, shown on a terminal
only, so a server's or a notebook's log gets nothing it did not ask for. ``progress=True`` or
``False`` decides per call, ``TILEOPS_PROGRESS=0`` (or ``1``) for the whole process.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import IO, Any, Iterator

__all__ = ["Progress", "task", "wanted"]


def _tty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def wanted(progress: bool | None, stream: IO[str] | None = None) -> bool:
    """Whether to show progress: ``progress`` when given, else ``TILEOPS_PROGRESS`` when set (``0``,
    ``false``, ``no`` or ``off`` hide it), else whether ``stream`` (stderr) is a terminal."""
    if progress is not None:
        if not isinstance(progress, bool):  # progress="no" would otherwise mean True
            raise TypeError(f"progress: expected True, False or None, got {type(progress).__name__} {progress!r}")
        return progress
    env = os.environ.get("TILEOPS_PROGRESS", "").strip().lower()
    if env:
        return env not in ("0", "false", "no", "off")
    return _tty(stream or sys.stderr)


def _tqdm() -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


class Progress:
    """``total`` steps of ``what``; :meth:`step` after each. A context manager (closes the bar)."""

    def __init__(self, total: int, what: str, show: bool = True, stream: IO[str] | None = None):
        self.total, self.what, self.show, self.done = total, what, show and total > 0, 0
        self.stream = stream or sys.stderr
        self._bar = None
        tqdm = _tqdm() if self.show and _tty(self.stream) else None
        if tqdm is not None:
            self._bar = tqdm(total=total, desc=what, file=self.stream, unit="kernel" if "kernel" in what else "it",
                             dynamic_ncols=True, leave=True)

    def step(self, label: str, seconds: float | None = None) -> None:
        """One step done: ``label`` says which, ``seconds`` how long it took (when known)."""
        self.done += 1
        if not self.show:
            return
        took = f"  {seconds:.1f} s" if seconds is not None else ""
        if self._bar is not None:
            self._bar.set_postfix_str(f"{label}{took}", refresh=False)
            self._bar.update(1)
        else:
            width = len(str(self.total))
            self.stream.write(f"[{self.done:>{width}}/{self.total}] {label}{took}\n")
            self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@contextlib.contextmanager
def task(what: str, show: bool = True, stream: IO[str] | None = None) -> Iterator[None]:
    """One long step with no count (the native extension's compile): a line when it starts, one
    when it ends with its time (or that it failed)."""
    stream = stream or sys.stderr
    if not show:
        yield
        return
    stream.write(f"tileops: {what} ...\n")
    stream.flush()
    t0 = time.perf_counter()
    ok = False
    try:
        yield
        ok = True
    finally:
        stream.write(f"tileops: {what}: {'done' if ok else 'failed'} in {time.perf_counter() - t0:.1f} s\n")
        stream.flush()
