"""TileLang's internals, behind one door: what tileops takes from TileLang beyond its public API.

tileops calls TileLang's public API where it is used (``tilelang.compile``, ``tilelang.lower``,
``tilelang.language`` in the kernel builders). What it needs beyond that is looked up here alone:

* the CUDA launcher generator, ``tilelang.jit.adapter.wrapper.TLCUDASourceWrapper``, which the lean
  build subclasses (:mod:`tileops.compile.cuda_build`): the methods it overrides
  (:data:`WRAPPER_OVERRIDES`) and those and the attributes it reads (:data:`WRAPPER_READS`), and
  ``match_declare_kernel``, which finds a kernel's declaration in generated source;
* what a kernel compiled with the Cython execution backend exposes: its loaded library and its path,
  each parameter's type and the dynamic extents (:func:`compiled_parts`, read by
  :func:`tileops.compile.entry.kernel_record`);
* the logger of TileLang's kernel cache and the one message of it that tileops drops
  (:data:`KERNEL_CACHE_LOGGER`, :data:`MEMORY_CACHE_HINT`);
* where TileLang's CUDA templates and its CUTLASS are (:func:`template_include_dirs`), for
  ``benchmarks/lean_sass.py``, which builds a kernel TileLang's way to compare machine code;
* the library loader of TileLang's build (``LibraryGenerator.load_lib``), which :func:`driverless`
  wraps so that a machine with the CUDA toolkit but no driver can build CUDA kernels.

:data:`PRIVATE` lists every one of them; ``tests/test_tilelang_api.py`` checks each against the
installed TileLang (0.1.15, pinned in pyproject.toml, the version they were read from). Importing this
module imports no TileLang: each lookup imports it when called, through :func:`load`, which first
makes sure TileLang's cache directory can be created.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import subprocess
import sys
import tempfile
import warnings
from typing import Any, Iterator

__all__ = ["load", "ensure_importable", "cuda_source_wrapper", "match_declare_kernel", "compiled_parts",
           "library", "library_path", "template_include_dirs", "driver_missing", "driverless", "PRIVATE",
           "WRAPPER_OVERRIDES", "WRAPPER_READS",
           "KERNEL_CACHE_LOGGER", "MEMORY_CACHE_HINT"]

#: the methods of TileLang's launcher generator the lean build overrides: a method renamed in
#: TileLang would leave the override silently unused, and TileLang's own launcher in its place
WRAPPER_OVERRIDES = ("parse_source_information", "get_cuda_host_adapter_include", "get_stream_type",
                     "get_init_func", "get_kernel_launch_code")
#: what the lean build reads of a launcher generator it made: methods and attributes
WRAPPER_READS = ("get_declaration", "get_dynamic_symbolic_set", "prim_func", "function_names", "dynamic_smem_buf",
                 "use_cooperative_groups", "cluster_dims", "tma_descriptor_args", "l2_persistent_map", "source",
                 "lib_code")

#: the logger of TileLang's kernel cache (its module's name), and the start of the message tileops
#: filters from it (:func:`tileops.compile.build._memory_cache_hint` says why)
KERNEL_CACHE_LOGGER = "tilelang.cache.kernel_cache"
MEMORY_CACHE_HINT = "Found kernel '%s' in memory cache"

#: every private name tileops uses: ``"module:attribute"`` -> the attributes it reads of it (a class's
#: methods, or attributes its instances get); the test imports each
PRIVATE: dict[str, tuple[str, ...]] = {
    "tilelang.jit.adapter.wrapper:TLCUDASourceWrapper": WRAPPER_OVERRIDES + WRAPPER_READS,
    "tilelang.jit.adapter.utils:match_declare_kernel": (),
    "tilelang.jit.kernel:JITKernel": ("adapter",),
    "tilelang.jit.adapter.cython.adapter:CythonKernelAdapter": ("lib", "libpath", "params", "dynamic_symbolic_map"),
    "tilelang.engine.param:KernelParam": ("is_scalar", "torch_dtype"),
    f"{KERNEL_CACHE_LOGGER}:KernelCache": (),
    "tilelang.env:TILELANG_TEMPLATE_PATH": (),
    "tilelang.env:CUTLASS_INCLUDE_DIR": (),
    "tilelang.jit.adapter.libgen:LibraryGenerator": ("load_lib",),
}

_checked = False


def ensure_importable() -> None:
    """Before TileLang is first imported: its kernel cache directory must be writable, or importing
    it fails (it creates the directory at import). When it is not, warn once and point TileLang at a
    private temporary directory with its disk cache off: kernels are then kept in memory only, for
    this process. Nothing changes when TileLang is already imported or the directory is usable."""
    global _checked
    if _checked or "tilelang" in sys.modules:
        _checked = True
        return
    _checked = True
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


def load() -> Any:
    """The ``tilelang`` module, imported after :func:`ensure_importable`: every import of TileLang by
    tileops' compile layer goes through here (1-3 s the first time; a process that only loads
    compiled kernels never calls it)."""
    ensure_importable()
    import tilelang

    return tilelang


def cuda_source_wrapper() -> type:
    """TileLang's CUDA launcher generator (``TLCUDASourceWrapper``), the class the lean build subclasses."""
    load()
    from tilelang.jit.adapter.wrapper import TLCUDASourceWrapper

    return TLCUDASourceWrapper


def match_declare_kernel(source: str, annotation: str) -> int:
    """Where in generated CUDA ``source`` the kernel declaration holding ``annotation`` starts (TileLang's helper)."""
    load()
    from tilelang.jit.adapter.utils import match_declare_kernel as match

    return match(source, annotation)


def library(kernel: Any) -> Any:
    """The loaded library (ctypes) of a kernel ``tilelang.compile`` made with the Cython backend."""
    return kernel.adapter.lib


def library_path(kernel: Any) -> str | None:
    """Where that library is on disk, or None when TileLang does not say."""
    return getattr(kernel.adapter, "libpath", None)


def compiled_parts(kernel: Any) -> tuple[Any, list[Any], Any]:
    """``(library, params, extents)`` of a kernel ``tilelang.compile`` made with the Cython backend:
    its loaded library (None without a C entry point), each parameter's torch dtype (None for a
    buffer, passed as a pointer), and its dynamic extents, TileLang's map from each extent's TVM
    variable to ``(ref_kind, ...)`` (None when the adapter has none)."""
    adapter = kernel.adapter
    params = [p.torch_dtype() if p.is_scalar() else None for p in getattr(adapter, "params", ())]
    return getattr(adapter, "lib", None), params, getattr(adapter, "dynamic_symbolic_map", None)


def template_include_dirs() -> list[str]:
    """The include directories TileLang compiles CUDA kernels with: its templates, then CUTLASS."""
    load()
    from tilelang.env import CUTLASS_INCLUDE_DIR, TILELANG_TEMPLATE_PATH

    return [TILELANG_TEMPLATE_PATH, CUTLASS_INCLUDE_DIR]


@functools.lru_cache(maxsize=None)
def driver_missing() -> bool:
    """Whether this machine has no CUDA driver library (``libcuda``): a build machine with the toolkit
    alone, where :func:`driverless` lets TileLang build CUDA kernels. Looked up once a process
    (``find_library`` runs ``ldconfig``), not at every compile."""
    return ctypes.util.find_library("cuda") is None


class _NoInitLibrary(ctypes.CDLL):
    """A kernel library whose ``init()`` answers 0 without running (see :func:`driverless`)."""

    def __getattr__(self, name: str) -> Any:
        if name == "init":
            return lambda: 0
        return super().__getattr__(name)


def _stub_libcuda(where: str) -> str:
    """A folder holding an empty ``libcuda.so`` (soname ``libcuda.so.1``), built once: what TileLang's
    ``-lcuda`` links against here. A library linked so names ``libcuda.so.1``, which a GPU machine's
    driver provides when it is loaded there."""
    lib = os.path.join(where, "libcuda.so")
    if not os.path.exists(lib):
        os.makedirs(where, exist_ok=True)
        src, tmp = os.path.join(where, f"empty.{os.getpid()}.c"), f"{lib}.{os.getpid()}.tmp"
        with open(src, "w") as f:
            f.write("/* a stand-in for the CUDA driver library at link time (tileops.compile.tilelang_api) */\n")
        cc = os.environ.get("CC", "cc")
        done = subprocess.run([cc, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", src, "-o", tmp],
                              capture_output=True, text=True)
        os.unlink(src)
        if done.returncode:
            raise RuntimeError(f"building a stand-in libcuda.so with {cc} failed: {done.stderr[-2000:]}")
        os.replace(tmp, lib)
    return where


@contextlib.contextmanager
def driverless(stub_dir: str) -> Iterator[None]:
    """Within: TileLang builds CUDA kernels on a machine with no CUDA driver. Its build links
    ``-lcuda`` (here: an empty stand-in from ``stub_dir``, found through ``LIBRARY_PATH``), then loads
    the library and calls its ``init()``, which sets the kernel's dynamic shared memory size through
    the driver and fails without one: within, a library TileLang loads answers ``init()`` with 0. The
    library on disk is untouched: a GPU machine that loads it (tileops' index, ``tileops warmup`` run
    on a build machine) runs the real ``init()``. Nothing can be launched here anyway."""
    load()
    from tilelang.jit.adapter.libgen import LibraryGenerator

    original = LibraryGenerator.load_lib
    before = os.environ.get("LIBRARY_PATH")

    def load_lib(self: Any, lib_path: str | None = None) -> Any:
        return _NoInitLibrary(original(self, lib_path)._name)

    os.environ["LIBRARY_PATH"] = os.pathsep.join(filter(None, [_stub_libcuda(stub_dir), before]))
    LibraryGenerator.load_lib = load_lib
    try:
        yield
    finally:
        LibraryGenerator.load_lib = original
        if before is None:
            os.environ.pop("LIBRARY_PATH", None)
        else:
            os.environ["LIBRARY_PATH"] = before
