"""The generator: kernel builder + specialization -> TileLang ``T.prim_func`` -> compiled kernel.

Compiled kernels are cached in memory per (builder, spec, backend, arch) and on disk by TileLang's
own kernel cache (TileLang's ``TILELANG_CACHE_DIR``, by default ``~/.tilelang/cache``; tileops
leaves that setting, and TileLang's logging, as the process has them). Threads that ask for the
same kernel at once wait on one lock per key: one compile, one result for all.

The ops launch kernels through :func:`load_kernel`, which also keeps an index of its own under
``tileops.compile.entry.cache_root()/kernels``: per kernel, a copy of its compiled library and a
record of its arguments (:func:`tileops.compile.entry.kernel_record`), keyed by the builder, the
spec, the backend, the arch, the sources of the builder module and of the kernels' helper modules,
TileLang's version and the pass configs. A later process loads the library from there with ctypes,
without importing TileLang (1-1.5 s) or re-tracing the tile program to find TileLang's own cache
entry. A library whose bytes no longer match its record (truncated, overwritten) is rebuilt, with a
warning.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator

import torch

from . import cuda_build, entry, lowered, tilelang_api

_log = logging.getLogger("tileops.compile.build")

__all__ = ["compile_kernel", "load_kernel", "emit_source", "device_backend", "stats", "CompileStats", "index_key",
           "prim_func", "index_kernel", "kernel_label", "PASS_CONFIGS", "pass_configs", "builder_digest"]


@dataclass
class CompileStats:
    """Kernels this process built (``compiles``, of which ``lean`` by :mod:`tileops.compile.cuda_build`)
    and their seconds in all, and those it loaded from tileops' own index without TileLang (``loads``)."""

    compiles: int = 0
    seconds: float = 0.0
    loads: int = 0
    lean: int = 0
    #: of the lean builds, those compiled from sources shipped lowered (:mod:`tileops.compile.lowered`)
    shipped: int = 0

    @property
    def kernels(self) -> int:
        """Kernels this process made ready, compiled or loaded from the index."""
        return self.compiles + self.loads


stats = CompileStats()
_cache: dict[Hashable, Any] = {}
_locks: dict[Hashable, threading.Lock] = {}
_guard = threading.Lock()


#: TileLang's safe-memory pass guards every access it cannot prove in bounds with a branch, which
#: turns the kernels' 16-byte accesses into scalar ones. The kernels address flat buffers through
#: strides the host has checked (every index lies inside the tensor the op was given), so it is off.
PASS_CONFIGS = {"tl.disable_safe_memory_legalize": True}


def pass_configs(spec: Any) -> dict[str, Any]:
    """:data:`PASS_CONFIGS` plus the spec's own (a ``pass_configs`` property, where a schedule knob is a
    lowering option: the attention forward's ``pipeline`` turns TileLang's warp specialisation and TMA
    off). Every compile, lowering and index key of a kernel goes through this."""
    own = getattr(spec, "pass_configs", None)
    return {**PASS_CONFIGS, **own} if own else PASS_CONFIGS

#: Flags for the C backend's compile. TileLang builds C kernels as ``g++ -std=c++17 -fPIC -shared``:
#: no optimisation at all, so every element went through an unoptimised loop body and every fp16
#: one through half.hpp's software conversion (fp16 [2, 32, 32, 128]: 6.9 ms, against 0.11 ms
#: for torch eager). ``-O3`` alone leaves the arithmetic as it was: no ``-march``, so no FMA to
#: contract into, and the same IEEE fp32 operations in the same order (results stay bit-for-bit
#: those of the ``-O0`` build); ``-ffp-contract=off`` keeps it so whatever the compiler's default.
C_FLAGS = ("-O3", "-ffp-contract=off")


@functools.lru_cache(maxsize=None)
def c_flags() -> tuple[str, ...]:
    """:data:`C_FLAGS`, plus ``-mf16c`` on an x86 CPU that has F16C: half.hpp then converts fp16
    with the F16C instructions (round to nearest even, as its software path does, so the same
    bits) instead of a branchy bit-twiddling routine per element; measured 1.6 -> 0.2 ms on fp16
    [2, 32, 32, 128] with -O3. Part of the kernel index key: a machine without F16C builds its own."""
    flags = C_FLAGS
    if platform.machine().lower() in ("x86_64", "amd64"):
        try:
            with open("/proc/cpuinfo") as f:
                has_f16c = any(line.startswith("flags") and " f16c" in line for line in f)
        except OSError:
            has_f16c = False
        if has_f16c:
            flags += ("-mf16c",)
    return flags


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

    # Hopper's arch-specific features (wgmma, setmaxnreg: the attention kernels' producer warpgroup)
    # exist only in sm_90a code; built for plain sm_90, TileLang's nvcc build refused
    # tl::warpgroup_reg_alloc (seen here). sm_90a code runs on every sm_90 device, so the other
    # kernels lose nothing by it; the index keys keep the device's arch name
    return tvm_target.Target({"kind": "cuda", "arch": "sm_90a" if arch == "sm_90" else arch})


def prim_func(builder: str, spec: Any) -> Any:
    """The ``T.prim_func`` of builder ``builder`` for ``spec`` (TileLang is imported, as the builder needs)."""
    from tileops.kernels import get_builder

    tilelang_api.load()
    return get_builder(builder)(spec)


def _once(cache: dict, key: Hashable, make: Callable[[], Any]) -> Any:
    """``cache[key]``, made by ``make()`` once: threads that ask for it at once wait on one lock."""
    got = cache.get(key)
    if got is None:
        with _guard:
            lock = _locks.setdefault((id(cache), key), threading.Lock())
        with lock:
            got = cache.get(key)
            if got is None:
                got = cache[key] = make()
    return got


def compile_kernel(builder: str, spec: Any, backend: str, arch: str) -> Any:
    """The compiled kernel for ``spec``: built once per process (and once per disk cache)."""
    def make() -> Any:
        tilelang = tilelang_api.load()
        t0 = time.perf_counter()
        # a build machine with the CUDA toolkit and no driver (``tileops warmup --arch sm_90`` there) builds
        # TileLang's CUDA kernels for a GPU machine to load (tilelang_api.driverless)
        nodriver = (tilelang_api.driverless(os.path.join(entry.cache_root(), "driverless"))
                    if backend == "cuda" and tilelang_api.driver_missing() else contextlib.nullcontext())
        with _own_compile(), nodriver:
            # the Cython backend exposes the library's C entry point, which tileops.compile.entry calls directly
            kernel = tilelang.compile(prim_func(builder, spec), target=_tvm_target(backend, arch),
                                      execution_backend="cython", pass_configs=pass_configs(spec),
                                      compile_flags=list(c_flags()) if backend == "c" else None)
        stats.seconds += time.perf_counter() - t0
        stats.compiles += 1
        return kernel

    return _once(_cache, (builder, spec, backend, arch), make)


# ------------------------------------------------------------------------- tileops' own index
#: bump when the index's layout changes: older entries are then simply not found
_INDEX_FORMAT = 1
_loaded: dict[Hashable, tuple[Any, dict[str, Any]]] = {}


def _index_dir() -> str:
    return os.path.join(entry.cache_root(), "kernels")


def _disk_cache_on() -> bool:
    """Whether kernels are kept on disk: TileLang's switch (``TILELANG_DISABLE_CACHE``) turns tileops' index off too."""
    return os.environ.get("TILELANG_DISABLE_CACHE", "") in ("", "0")


@functools.lru_cache(maxsize=None)
def builder_digest(builder: str) -> str:
    """A digest of the builder module's source, of the builders whose stages it uses (its ``USES``,
    followed through theirs: :func:`tileops.kernels.used_files`) and of the helper modules of
    ``tileops.kernels`` it may import (``storage.py``: a module without a ``build``), read, not
    imported (importing a builder imports TileLang). A builder without ``USES`` hashes its own file
    and the helpers alone, as before ``USES`` existed, so its key did not change with it."""
    from tileops.kernels import BUILDERS, HELPERS, used_files

    module = BUILDERS[builder].split(":")[0]
    found = importlib.util.find_spec(f"tileops.kernels.{module}")
    digest = hashlib.sha256()
    for path in (found.origin, *used_files(builder), *HELPERS):
        with open(path, "rb") as f:
            digest.update(hashlib.sha256(f.read()).digest())
    return digest.hexdigest()


@functools.lru_cache(maxsize=None)
def _tilelang_version() -> str:
    try:
        return importlib.metadata.version("tilelang")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - a source checkout of TileLang
        return str(getattr(tilelang_api.load(), "__version__", "unknown"))


@functools.lru_cache(maxsize=None)
def _lean_digest() -> str:
    """A digest of :mod:`tileops.compile.cuda_build`'s source: a lean build's index entries depend on it."""
    return entry.file_sha256(os.path.join(os.path.dirname(__file__), "cuda_build.py"))


def index_key(builder: str, spec: Any, backend: str, arch: str, lean: bool = False) -> str:
    """The index entry of a kernel built TileLang's way, or (``lean``) by :mod:`tileops.compile.cuda_build`."""
    how = ("lean", _lean_digest()) if lean else "tilelang"
    text = repr((_INDEX_FORMAT, builder, spec, backend, arch, builder_digest(builder), _tilelang_version(),
                 sorted(pass_configs(spec).items()), platform.machine(), how)
                + ((c_flags(),) if backend == "c" else ()))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def lowering_digest(func: Any, arch: str, configs: dict[str, Any] | None = None) -> str:
    """A digest of everything lowering ``func`` (a kernel's ``T.prim_func``) for the lean build reads:
    its TIR as TVMScript prints it, ``arch``, the pass configs, TileLang's version and
    :mod:`tileops.compile.cuda_build`'s source. Two kernels with equal digests lower to the same
    sources whatever their builders' files look like, so an edit that leaves a kernel's TIR alone
    (a refactor, a comment) need not lower it again (:func:`tileops.compile.warmup.write_lowered`).
    ``configs``: the kernel's pass configs (:func:`pass_configs`), :data:`PASS_CONFIGS` if not given."""
    configs = PASS_CONFIGS if configs is None else configs
    text = repr((func.script(), arch, sorted(configs.items()), _tilelang_version(), _lean_digest()))
    return hashlib.sha256(text.encode()).hexdigest()


def _init_library(path: str) -> Any:
    """The kernel library at ``path``, loaded and initialised as TileLang does (``init()`` == 0)."""
    lib = ctypes.CDLL(path)
    lib.get_last_error.restype = ctypes.c_char_p
    if lib.init() != 0:
        raise OSError(f"init failed: {lib.get_last_error().decode('utf-8', 'replace')}")
    return lib


def _from_index(key: str) -> tuple[Any, dict[str, Any]] | None:
    """(library, record) from the index, or None when absent; a damaged entry warns and is None."""
    base = os.path.join(_index_dir(), key)
    try:
        with open(base + ".json") as f:
            record = json.load(f)
    except (FileNotFoundError, NotADirectoryError):  # absent (the cache may not even be creatable)
        return None
    except (OSError, ValueError) as e:
        warnings.warn(f"tileops: kernel index entry {base}.json is unreadable ({e}); rebuilding it", RuntimeWarning)
        return None
    try:
        if entry.file_sha256(base + ".so") != record.get("sha256"):
            raise OSError("its bytes differ from the record")
        return _init_library(base + ".so"), record
    except OSError as e:
        warnings.warn(f"tileops: cached kernel {base}.so cannot be used ({e}); rebuilding it", RuntimeWarning)
        return None


def _to_index(key: str, src: str | None, record: dict[str, Any]) -> None:
    """Keep the library at ``src`` and its launch ``record`` in the index (atomically: another
    process sees the whole entry or none); an unwritable index is skipped (the kernel is still
    served from memory)."""
    if not src or not os.path.exists(src):
        return
    d = _index_dir()
    base = os.path.join(d, key)
    try:
        os.makedirs(d, exist_ok=True)
        tmp = f"{base}.{os.getpid()}.{threading.get_ident()}.tmp"
        shutil.copyfile(src, tmp)
        record = {**record, "sha256": entry.file_sha256(tmp)}
        os.replace(tmp, base + ".so")
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, base + ".json")  # written last: an entry with a record has its library
    except OSError as e:
        _log.debug("tileops: kernel index not written (%s)", e)


def load_kernel(builder: str, spec: Any, backend: str, arch: str, device: torch.device,
                param_names: tuple[str, ...] = (), op_name: str = "") -> Any:
    """The launchable kernel (:class:`tileops.compile.entry.RawKernel`) for ``spec`` on ``device``: from
    memory, else from tileops' index (no TileLang import), else compiled by TileLang and indexed.
    A compile logs one INFO line on ``tileops.compile`` saying what (``op_name``'s kernel) and how long."""
    def make() -> tuple[Any, dict[str, Any]]:
        t0 = time.perf_counter()
        got, compiled = _obtain(builder, spec, backend, arch)
        if compiled:
            _say_compiled(op_name, builder, spec, arch, time.perf_counter() - t0)
        return got

    lib, record = _once(_loaded, (builder, spec, backend, arch), make)
    return entry.raw_kernel_from(lib, record, device, param_names)


# ------------------------------------------------------------------- the "compiled ..." line
#: One INFO record per kernel a call compiles (a load from a cache says nothing): a first call that
#: stops for seconds says why. ``logging``, not ``warnings``: a compile is an event, not something to
#: change in one's code, and the warnings filter would show it once per call site only; a named logger
#: is what an application routes, levels or silences:
#: ``logging.getLogger("tileops.compile").setLevel(logging.WARNING)``.
compile_log = logging.getLogger("tileops.compile")


class _UntilConfigured(logging.StreamHandler):
    """stderr for ``tileops.compile``'s records while the application has configured no logging
    (no handler above this logger): once it has, they reach its handlers only, not twice."""

    def emit(self, record: logging.LogRecord) -> None:
        up = compile_log.parent
        while up is not None:
            if up.handlers:
                return
            up = up.parent if up.propagate else None
        super().emit(record)


if compile_log.level == logging.NOTSET:  # an application's own setting stays
    compile_log.setLevel(logging.INFO)
if not any(isinstance(h, _UntilConfigured) for h in compile_log.handlers):
    compile_log.addHandler(_UntilConfigured(sys.stderr))


def kernel_label(builder: str, spec: Any) -> str:
    """A kernel in a few words, from the spec fields it has: ``rope neox bfloat16 head_dim=128 fwd``."""
    parts = [builder, str(getattr(spec, "pairing", "") or ""), str(getattr(spec, "dtype", "") or "")]
    if getattr(spec, "head_dim", None) is not None:
        parts.append(f"head_dim={spec.head_dim}")
    if getattr(spec, "positions", None):
        parts.append(f"positions {spec.positions}")
    if getattr(spec, "mrope_section", None):
        parts.append("mrope")
    if hasattr(spec, "inverse"):
        parts.append("bwd" if spec.inverse else "fwd")
    if getattr(spec, "transposed", False):
        parts.append("head-major")
    return " ".join(p for p in parts if p)


def _say_compiled(op_name: str, builder: str, spec: Any, arch: str, seconds: float) -> None:
    if not compile_log.isEnabledFor(logging.INFO):
        return
    where, home = _index_dir(), os.path.expanduser("~")
    where = "~" + where[len(home):] if where.startswith(home + os.sep) else where
    compile_log.info("tileops: compiled %s(%s) for %s in %.1f s (%s)", f"{op_name} " if op_name else "",
                     kernel_label(builder, spec), arch, seconds,
                     f"cached in {where}" if _disk_cache_on() else "kept in memory only")


def _index_keys(builder: str, spec: Any, backend: str, arch: str) -> list[str]:
    """The index entries a kernel may be found under, in the order they are tried: the lean build's
    first (CUDA, where that build is enabled), then TileLang's."""
    lean = backend == "cuda" and cuda_build.enabled()
    return [*([index_key(builder, spec, backend, arch, lean=True)] if lean else []),
            index_key(builder, spec, backend, arch)]


def _obtain(builder: str, spec: Any, backend: str, arch: str) -> tuple[tuple[Any, dict[str, Any]], bool]:
    """((library, record): from the index, else compiled and indexed; whether it was compiled now)."""
    keys = _index_keys(builder, spec, backend, arch)
    lean = len(keys) > 1  # the lean build's key comes first
    use_disk = _disk_cache_on()
    if use_disk:
        for key in keys:  # a lean build first; a kernel that build does not serve is TileLang's
            found = _from_index(key)
            if found is not None:
                stats.loads += 1
                return found, False
    if lean:
        built = _lean_build(builder, spec, arch, keys[0])
        if built is not None:
            return _keep_lean(keys[0], built, use_disk), True
    kernel = compile_kernel(builder, spec, backend, arch)
    record = entry.kernel_record(kernel)
    if use_disk:
        _to_index(keys[-1], tilelang_api.library_path(kernel), record)
    return (tilelang_api.library(kernel), record), True


_lean_warned = False


def _lean_build(builder: str, spec: Any, arch: str, key: str) -> Any:
    """The kernel built by :mod:`tileops.compile.cuda_build` (None: build it TileLang's way): from the sources
    shipped lowered (:mod:`tileops.compile.lowered`, no TileLang import) when they have ``key``, else lowered
    now (the caller has checked :func:`tileops.compile.cuda_build.enabled`). A kernel that build does not serve
    is a debug line; a compiler failing on one it should serve warns once per process."""
    global _lean_warned
    t0 = time.perf_counter()
    try:
        shipped = lowered.lookup(key, arch)
        if shipped is not None:
            lean = cuda_build.compile_sources(shipped, arch)
        else:
            with _own_compile():
                lean = cuda_build.build(prim_func(builder, spec), arch, pass_configs(spec))
    except cuda_build.Unsupported as e:
        _log.debug("tileops: %s built by TileLang (%s)", spec, e)
        return None
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        if not _lean_warned:
            _lean_warned = True
            warnings.warn(f"tileops: the lean CUDA build failed ({str(e).splitlines()[0]}); building with "
                          f"TileLang's nvcc instead (slower to compile, the same kernel). TILEOPS_LEAN_BUILD=0 "
                          f"skips the attempt.", RuntimeWarning, stacklevel=4)
        _log.debug("tileops: lean build of %s failed: %s", spec, e)
        return None
    stats.seconds += time.perf_counter() - t0
    stats.compiles += 1
    stats.lean += 1
    stats.shipped += shipped is not None
    return lean


def _keep_lean(index_key: str, lean: Any, use_disk: bool) -> tuple[Any, dict[str, Any]]:
    """Load a lean build's library (from the index where the disk cache is on) and remove its build
    directory (a loaded library stays mapped)."""
    try:
        path = lean.libpath
        if use_disk:
            _to_index(index_key, lean.libpath, lean.record)
            if os.path.exists(os.path.join(_index_dir(), index_key + ".json")):
                path = os.path.join(_index_dir(), index_key + ".so")
        return _init_library(path), lean.record
    finally:
        shutil.rmtree(os.path.dirname(lean.libpath), ignore_errors=True)


@contextlib.contextmanager
def index_lock(progress: bool | None = None) -> Iterator[None]:
    """Hold the index's compile lock (``<cache>/kernels/compile.lock``) for a batch of compiles; say so
    on stderr (``progress``: :func:`tileops.progress.wanted`) while another process holds it. Without a
    disk cache, or one that cannot be created, there is nothing to share: no lock."""
    from ..progress import wanted

    if not _disk_cache_on():
        yield
        return
    try:
        os.makedirs(_index_dir(), exist_ok=True)
        lock = open(os.path.join(_index_dir(), "compile.lock"), "a+")
    except OSError:
        yield
        return
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if wanted(progress):
                print(f"tileops: waiting for another process's kernel compiles ({lock.name})", file=sys.stderr,
                      flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield  # released when the file closes


def indexed(builder: str, spec: Any, backend: str, arch: str) -> bool:
    """Whether the disk index has an entry for the kernel (either build's, on CUDA), by its name alone:
    no TileLang, no library loaded (an entry found damaged when it is loaded is rebuilt then)."""
    if not _disk_cache_on():
        return False
    keys = _index_keys(builder, spec, backend, arch)
    return any(os.path.exists(os.path.join(_index_dir(), k + ".json")) for k in keys)


def index_kernel(builder: str, spec: Any, backend: str, arch: str) -> bool:
    """Compile ``spec`` (unless the index has it) and make sure tileops' index has it; whether it compiled."""
    return _obtain(builder, spec, backend, arch)[1]


def _memory_cache_hint(record: logging.LogRecord) -> bool:
    """False for one message of TileLang's kernel cache (``tilelang/cache/kernel_cache.py``), the WARNING
    "Found kernel '%s' in memory cache. For better performance, consider using `@tilelang.jit` ...",
    logged when ``tilelang.compile`` is asked again for a kernel it holds: tileops asks again by design
    (``emit`` and the lean build's lowering trace a kernel anew; tileops' own caches sit in front),
    and the advice is about TileLang's API, not the user's code. Everything else that logger says passes."""
    return not (isinstance(record.msg, str) and record.msg.startswith(tilelang_api.MEMORY_CACHE_HINT))


#: on that logger alone (it need not exist yet: TileLang's ``getLogger`` returns this same object)
_tilelang_cache_log = logging.getLogger(tilelang_api.KERNEL_CACHE_LOGGER)
if _memory_cache_hint not in _tilelang_cache_log.filters:
    _tilelang_cache_log.addFilter(_memory_cache_hint)
_compiling = threading.local()


def _own_compile_chatter(record: logging.LogRecord) -> bool:
    """False for TileLang's INFO lines (two per compile) logged while *this library* compiles on the
    current thread; everything else TileLang logs, for anyone, passes. ``TILEOPS_VERBOSE=1`` keeps them."""
    return record.levelno >= logging.WARNING or not getattr(_compiling, "on", False)


@contextlib.contextmanager
def _own_compile() -> Iterator[None]:
    """Within: this thread is compiling for tileops, so TileLang's INFO chatter is dropped (the filter
    is attached to TileLang's handlers once; the logger's level is left alone)."""
    if not os.environ.get("TILEOPS_VERBOSE"):
        for handler in logging.getLogger("tilelang").handlers:
            if _own_compile_chatter not in handler.filters:
                handler.addFilter(_own_compile_chatter)
    _compiling.on = True
    try:
        yield
    finally:
        _compiling.on = False


def emit_source(builder: str, spec: Any, backend: str, arch: str) -> str:
    """The kernel source TileLang generates for ``spec``: CUDA C for an sm arch, C for ``c``.

    Needs no GPU: CUDA source is produced by lowering only.
    """
    tilelang = tilelang_api.load()
    func = prim_func(builder, spec)
    with _own_compile():
        if backend == "c":
            return tilelang.compile(func, target="c", pass_configs=pass_configs(spec),
                                    compile_flags=list(c_flags())).get_kernel_source()
        target = _tvm_target(backend, arch)
        from tvm import transform

        with target, transform.PassContext(config=pass_configs(spec)):
            return tilelang.lower(func, target=target).kernel_source


def clear_memory_cache() -> None:
    """Forget compiled kernels held in memory (the disk caches stay)."""
    with _guard:
        _cache.clear()
        _loaded.clear()
        _locks.clear()
