"""The generator: kernel builder + specialization -> TileLang ``T.prim_func`` -> compiled kernel.

Compiled kernels are cached in memory per (builder, spec, backend, arch) and on disk by TileLang's
own kernel cache (TileLang's ``TILELANG_CACHE_DIR``, by default ``~/.tilelang/cache``; tileops
leaves that setting, and TileLang's logging, as the process has them). Threads that ask for the
same kernel at once wait on one lock per key: one compile, one result for all.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Hashable, Iterator

import torch

__all__ = ["compile_kernel", "emit_source", "device_backend", "stats", "CompileStats", "ensure_tilelang_importable"]


@dataclass
class CompileStats:
    """How many kernels this process built (``compiles``) and how long that took in all."""

    compiles: int = 0
    seconds: float = 0.0


stats = CompileStats()
_cache: dict[Hashable, Any] = {}
_locks: dict[Hashable, threading.Lock] = {}
_guard = threading.Lock()


#: TileLang's safe-memory pass guards every access it cannot prove in bounds with a branch, which
#: turns the kernels' 16-byte accesses into scalar ones. The kernels address flat buffers through
#: strides the host has checked (every index lies inside the tensor the op was given), so it is off.
PASS_CONFIGS = {"tl.disable_safe_memory_legalize": True}


_cache_checked = False


def ensure_tilelang_importable() -> None:
    """Before TileLang is first imported: its kernel cache directory must be writable, or importing
    it fails (it creates the directory at import). When it is not, warn once and point TileLang at a
    private temporary directory with its disk cache off: kernels are then kept in memory only, for
    this process. Nothing changes when TileLang is already imported or the directory is usable."""
    global _cache_checked
    if _cache_checked or "tilelang" in sys.modules:
        _cache_checked = True
        return
    _cache_checked = True
    where = os.environ.get("TILELANG_CACHE_DIR") or os.path.expanduser("~/.tilelang/cache")
    try:
        os.makedirs(where, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=where, prefix=".tileops-write-test-"):
            pass
        return
    except OSError as e:
        reason = e.strerror or type(e).__name__
    warnings.warn(f"tileops: TileLang's kernel cache directory {where} is not writable ({reason}); kernels are "
                  f"compiled and kept in memory only, for this process. Set TILELANG_CACHE_DIR to a writable "
                  f"directory to keep them on disk.", RuntimeWarning, stacklevel=3)
    os.environ["TILELANG_CACHE_DIR"] = tempfile.mkdtemp(prefix="tileops-tilelang-")
    os.environ["TILELANG_DISABLE_CACHE"] = "1"


def device_backend(device: torch.device) -> tuple[str, str]:
    """(backend, arch) for a device: ("cuda", "sm_90") for an H100/H200, ("c", "c") for the CPU."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return "cuda", f"sm_{major}{minor}"
    if device.type == "cpu":
        return "c", "c"
    raise ValueError(f"device: BUILTIN kernels run on cuda or cpu devices, got {device}")


def _tvm_target(backend: str, arch: str):
    if backend == "c":
        return "c"
    from tvm import target as tvm_target

    return tvm_target.Target({"kind": "cuda", "arch": arch})


def _prim_func(builder: str, spec: Any):
    from tileops.kernels import get_builder

    return get_builder(builder)(spec)


def compile_kernel(builder: str, spec: Any, backend: str, arch: str) -> Any:
    """The compiled kernel for ``spec``: built once per process (and once per disk cache)."""
    key = (builder, spec, backend, arch)
    kernel = _cache.get(key)
    if kernel is not None:
        return kernel
    with _guard:
        lock = _locks.setdefault(key, threading.Lock())
    with lock:
        kernel = _cache.get(key)
        if kernel is None:
            import tilelang

            t0 = time.perf_counter()
            with _own_compile():
                # the Cython backend exposes the library's C entry point, which tileops.launch calls directly
                kernel = tilelang.compile(_prim_func(builder, spec), target=_tvm_target(backend, arch),
                                          execution_backend="cython", pass_configs=PASS_CONFIGS)
            stats.seconds += time.perf_counter() - t0
            stats.compiles += 1
            _cache[key] = kernel
    return kernel


_compiling = threading.local()


class _OwnCompileChatter(logging.Filter):
    """Drops TileLang's INFO lines (two per compile) logged while *this library* compiles on the
    current thread; everything else TileLang logs, for anyone, passes. ``TILEOPS_VERBOSE=1`` keeps them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not getattr(_compiling, "on", False)


_filter = _OwnCompileChatter()


def _quiet() -> None:
    """Attach the filter to TileLang's handlers (once; the logger's level is left alone)."""
    if os.environ.get("TILEOPS_VERBOSE"):
        return
    for handler in logging.getLogger("tilelang").handlers:
        if _filter not in handler.filters:
            handler.addFilter(_filter)


@contextlib.contextmanager
def _own_compile() -> Iterator[None]:
    """Within: this thread is compiling for tileops, so TileLang's INFO chatter is dropped."""
    _quiet()
    _compiling.on = True
    try:
        yield
    finally:
        _compiling.on = False


def emit_source(builder: str, spec: Any, backend: str, arch: str) -> str:
    """The kernel source TileLang generates for ``spec``: CUDA C for an sm arch, C for ``c``.

    Needs no GPU: CUDA source is produced by lowering only.
    """
    import tilelang

    func = _prim_func(builder, spec)
    with _own_compile():
        if backend == "c":
            return tilelang.compile(func, target="c", pass_configs=PASS_CONFIGS).get_kernel_source()
        target = _tvm_target(backend, arch)
        from tvm import transform

        with target, transform.PassContext(config=PASS_CONFIGS):
            return tilelang.lower(func, target=target).kernel_source


def clear_memory_cache() -> None:
    """Forget compiled kernels held in memory (the disk cache stays)."""
    with _guard:
        _cache.clear()
        _locks.clear()
