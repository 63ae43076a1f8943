"""The native fast path: a CPython extension (``tileops/_native.cpp``) for repeated eager calls.

A call whose signature was seen before costs, through the Python plan, 3-4x the host time of a bare
torch elementwise op: the signature tuple, the plan closure and the error tracker are Python. The
extension does that work in C++: it reads each tensor's metadata through the PyTorch C API, looks
the call's plan up by it, allocates the outputs not given (ATen's ``empty_like``), fills the
kernel's argument array and calls the launch trampoline (:mod:`tileops.compile.entry`); the error words
and the per-call tracking of positions (:mod:`tileops.runtime.errors`) live there too, and the Python path
uses the same tracker when the extension is loaded. Any call it cannot serve exactly as the Python
path would (the first call of a signature, an input that requires grad, a tensor subclass, a
misaligned pointer, an overlap) goes to the Python path.

The extension is compiled once per (torch version, Python ABI, source) with the system C++
compiler (``$CXX``, else ``c++``) against the installed torch's headers, and cached under
:func:`tileops.compile.entry.cache_root` (``native/``), atomically, with a checksum: a damaged file is
rebuilt. Compiling takes tens of seconds, so the first use never waits for it: :func:`start`
(called when an op is constructed) loads a cached build at once; without one, the build starts in a
background thread once the process has made ``BUILD_AFTER`` (200) eager calls, so that a short
script never pays for, nor leaves behind, a compiler run, and ops switch to the native path when
it is ready. ``tileops warmup`` builds it
ahead of time; :func:`build` builds and loads it synchronously (tests).

``TILEOPS_NATIVE=0`` in the environment keeps every call on the Python path (read at each
:func:`start`, i.e. effectively at the first op's construction). Without a compiler or torch's
headers the Python path serves, silently (a debug line on the ``tileops.runtime.native`` logger).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import glob
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

__all__ = ["module", "start", "build", "wait", "enabled", "status", "library_path", "disabled", "SOURCE"]

_log = logging.getLogger("tileops.runtime.native")

#: the extension's source, shipped with the package
SOURCE = Path(__file__).with_name("_native.cpp")
_NAME = "_tileops_native"

#: the loaded extension, or None (the Python path serves every call)
module: Any = None

_lock = threading.Lock()
_thread: threading.Thread | None = None
_status = "not started"


def enabled() -> bool:
    """Whether the native path may be used: ``TILEOPS_NATIVE`` is not ``0``."""
    return os.environ.get("TILEOPS_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


def status() -> str:
    """What happened so far: ``loaded``, ``building``, ``not built`` (no cached build; none started yet),
    ``off``, ``not started`` or why it failed."""
    return _status


def _torch_paths() -> tuple[str, str]:
    import torch

    root = os.path.dirname(torch.__file__)
    return os.path.join(root, "include"), os.path.join(root, "lib")


def _flags() -> list[str]:
    import torch

    abi = int(torch.compiled_with_cxx11_abi())
    return ["-O2", "-shared", "-fPIC", "-fvisibility=hidden", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]


@functools.lru_cache(maxsize=None)
def _key() -> str:
    """What a build depends on: torch's version and build, Python's ABI, the source and flags (read
    once per process)."""
    import torch

    parts = [torch.__version__, getattr(torch.version, "git_version", ""), str(torch.version.cuda),
             sys.implementation.cache_tag, sysconfig.get_config_var("EXT_SUFFIX") or ".so",
             " ".join(_flags()), hashlib.sha256(SOURCE.read_bytes()).hexdigest()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def library_path() -> str:
    """Where the build for this torch, Python and source is cached."""
    from ..compile.entry import cache_root

    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return os.path.join(cache_root(), "native", f"{_NAME}-{_key()}{suffix}")


def _intact(path: str) -> bool:
    """Whether ``path`` and its checksum file exist and agree."""
    from ..compile.entry import file_sha256

    try:
        with open(path + ".sha256") as f:
            want = f.read().strip()
        return bool(want) and file_sha256(path) == want
    except OSError:
        return False


def _compile(path: str) -> None:
    """Compile the extension into ``path`` (atomically: a temporary file, then a rename)."""
    from ..compile.entry import file_sha256

    include, lib = _torch_paths()
    py_include = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(py_include, "Python.h")):
        raise OSError(f"no Python.h in {py_include}")
    if not os.path.exists(os.path.join(include, "torch", "csrc", "autograd", "python_variable.h")):
        raise OSError(f"torch ships no C++ headers in {include}")
    cxx = os.environ.get("CXX", "c++")
    d = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=d)
    os.close(fd)
    try:
        base = [cxx, *_flags(), f"-I{py_include}", f"-I{include}", str(SOURCE), "-o", tmp, f"-L{lib}", "-lc10",
                "-ltorch", "-ltorch_cpu", "-ltorch_python", f"-Wl,-rpath,{lib}"]
        nice = shutil.which("nice")
        last = None
        for std in ("-std=c++20", "-std=c++17"):  # torch 2.13's headers want C++20, older ones C++17
            cmd = ([nice, "-n", "10"] if nice else []) + [base[0], std, *base[1:]]
            t0 = time.perf_counter()
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if r.returncode == 0:
                _log.debug("tileops: built %s in %.1f s (%s)", path, time.perf_counter() - t0, std)
                break
            last = (r.stderr or r.stdout).strip().splitlines()[-3:]
        else:
            raise OSError(f"{cxx} failed: {' / '.join(last or [])}")
        digest = file_sha256(tmp)
        os.replace(tmp, path)  # another process sees the whole library or none
        tmp_sum = path + f".sha256.{os.getpid()}"
        with open(tmp_sum, "w") as f:
            f.write(digest + "\n")
        os.replace(tmp_sum, path + ".sha256")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load(path: str) -> Any:
    loader = importlib.machinery.ExtensionFileLoader(f"tileops.{_NAME}", path)
    spec = importlib.util.spec_from_file_location(f"tileops.{_NAME}", path, loader=loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    from . import errors

    errors.configure_native(mod)
    return mod


def _build_and_load(wait_for_others: bool = True, progress: bool = False) -> Any:
    """The extension: loaded from the cache, else built (under a lock file, so that two processes
    do not build it at once; the second loads the first's; a line on stderr before and after the
    compile with ``progress``) and loaded. Raises OSError/ImportError."""
    from ..progress import task

    path = library_path()
    if not _intact(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX if wait_for_others else fcntl.LOCK_EX | fcntl.LOCK_NB)
            try:
                if not _intact(path):
                    for stale in glob.glob(glob.escape(path) + ".*.tmp"):  # left by a process that died
                        os.unlink(stale)
                    for f in (path, path + ".sha256"):
                        if os.path.exists(f):
                            os.unlink(f)
                    with task("compiling the native fast path (tileops/_native.cpp, about 20 s)", progress):
                        _compile(path)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
    return _load(path)


def _set(mod: Any, why: str) -> None:
    global module, _status
    _status = why
    module = mod


#: eager calls a process makes on the Python path before it starts building the extension, so that
#: a short script (or a test's subprocess) neither waits for nor leaves behind a compiler run
BUILD_AFTER = 200
_python_calls = 0


def start() -> None:
    """Load the cached build, if there is one (called when an op is constructed; cheap after the
    first call). Without one, the build starts in a background thread at the process's
    ``BUILD_AFTER``-th eager call (:func:`python_call`), or at :func:`wait` or :func:`build`."""
    global _status
    if module is not None or _thread is not None or _status not in ("not started", "off"):
        return
    if not enabled():
        _status = "off"
        return
    with _lock:
        if module is not None or _thread is not None or _status not in ("not started", "off"):
            return
        try:
            path = library_path()
            if _intact(path):
                try:
                    _set(_load(path), "loaded")
                    return
                except ImportError as e:  # damaged in a way the checksum did not catch: rebuild
                    _log.debug("tileops: cached native library %s does not load (%s); rebuilding", path, e)
        except Exception as e:  # noqa: BLE001 - no torch headers, unreadable cache...: the Python path serves
            _status = f"failed: {e}"
            _log.debug("tileops: native fast path unavailable: %s", e)
            return
        _status = "not built"


def python_call() -> None:
    """Count an eager call served while the extension is not loaded; the ``BUILD_AFTER``-th starts
    the background build."""
    global _python_calls
    _python_calls += 1
    if _python_calls == BUILD_AFTER:
        _start_build()


def _start_build() -> None:
    global _thread, _status
    with _lock:
        if module is not None or _thread is not None or _status != "not built":
            return
        _status = "building"
        _thread = threading.Thread(target=_background, name="tileops-native-build", daemon=True)
        _thread.start()


def _background() -> None:
    global _status
    try:
        _set(_build_and_load(), "loaded")
    except Exception as e:  # noqa: BLE001 - any failure leaves the Python path serving
        _status = f"failed: {e}"
        _log.debug("tileops: native fast path unavailable: %s", e)


def wait(timeout: float | None = None) -> Any:
    """Start the background build if it has not started (and there is no cached build), then wait
    for it; returns :data:`module` (None when the native path is off or unavailable)."""
    start()
    _start_build()
    t = _thread
    if t is not None:
        t.join(timeout)
    return module


def build(progress: bool | None = None) -> Any:
    """Build (if not cached) and load the extension now, in this thread; returns :data:`module`, or
    None when it cannot be built (the reason is in :func:`status`). For ``tileops warmup`` and tests;
    ``progress`` as :func:`tileops.progress.wanted` (a line before and after a compile)."""
    from ..progress import wanted

    global _status
    if module is not None:
        return module
    if _thread is not None:
        return wait()
    if not enabled():
        _status = "off"
        return None
    with _lock:
        if module is None:
            try:
                _set(_build_and_load(progress=wanted(progress)), "loaded")
            except Exception as e:  # noqa: BLE001
                _status = f"failed: {e}"
                _log.debug("tileops: native fast path unavailable: %s", e)
    return module


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within this block the extension looks absent (process-wide; for tests and benchmarks): an op
    made inside takes the Python path, and keeps it while it is called inside; one made before
    keeps the native path it has."""
    global module, _status
    saved = module, _status, enabled
    module, _status = None, "off"
    globals()["enabled"] = lambda: False
    try:
        yield
    finally:
        module, _status, globals()["enabled"] = saved


def _main(argv: list[str]) -> int:
    """``python -m tileops.runtime.native``: build (if needed) and load; print where and how long."""
    t0 = time.perf_counter()
    mod = build(progress=True)
    print(f"{status()}: {library_path()} ({time.perf_counter() - t0:.1f} s)")
    return 0 if mod is not None else 1


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
