"""The generator: kernel builder + specialization -> TileLang ``T.prim_func`` -> compiled kernel.

Compiled kernels are cached in memory per (builder, spec, backend, arch) and on disk by TileLang's
own kernel cache (``TILELANG_CACHE_DIR``, default ``~/.cache/tileops/tilelang``). Threads that ask
for the same kernel at once wait on one lock per key: one compile, one result for all.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Hashable

import torch

__all__ = ["compile_kernel", "emit_source", "device_backend", "stats", "CompileStats"]

os.environ.setdefault("TILELANG_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "tileops", "tilelang"))


@dataclass
class CompileStats:
    """How many kernels this process built (``compiles``) and how long that took in all."""

    compiles: int = 0
    seconds: float = 0.0
    lookups: int = 0


stats = CompileStats()
_cache: dict[Hashable, Any] = {}
_locks: dict[Hashable, threading.Lock] = {}
_guard = threading.Lock()


#: TileLang's safe-memory pass guards every access it cannot prove in bounds with a branch, which
#: turns the kernels' 16-byte accesses into scalar ones. The kernels address flat buffers through
#: strides the host has checked (every index lies inside the tensor the op was given), so it is off.
PASS_CONFIGS = {"tl.disable_safe_memory_legalize": True}


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
    stats.lookups += 1
    kernel = _cache.get(key)
    if kernel is not None:
        return kernel
    with _guard:
        lock = _locks.setdefault(key, threading.Lock())
    with lock:
        kernel = _cache.get(key)
        if kernel is None:
            import tilelang

            _quiet(tilelang)
            t0 = time.perf_counter()
            # the Cython backend exposes the library's C entry point, which tileops.launch calls directly
            kernel = tilelang.compile(_prim_func(builder, spec), target=_tvm_target(backend, arch),
                                      execution_backend="cython", pass_configs=PASS_CONFIGS)
            stats.seconds += time.perf_counter() - t0
            stats.compiles += 1
            _cache[key] = kernel
    return kernel


def _quiet(tilelang: Any) -> None:
    # TileLang logs two INFO lines per compile; keep them unless the user asked for detail.
    if not os.environ.get("TILEOPS_VERBOSE"):
        logging.getLogger("tilelang").setLevel(logging.WARNING)


def emit_source(builder: str, spec: Any, backend: str, arch: str) -> str:
    """The kernel source TileLang generates for ``spec``: CUDA C for an sm arch, C for ``c``.

    Needs no GPU: CUDA source is produced by lowering only.
    """
    import tilelang

    _quiet(tilelang)
    func = _prim_func(builder, spec)
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
