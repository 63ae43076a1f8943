"""The native runtime: a C++ extension (``tileops/runtime/_native.cpp``), loaded once, when tileops is imported.

It holds the op's bindings by call signature and serves a repeated eager call without Python (see
:mod:`tileops.runtime.binding`), runs every binding of the general path too, keeps the one deferred
error tracker (:mod:`tileops.runtime.errors`) and defines the custom ops ``tileops::apply``,
``apply_out`` and ``apply_backward`` (:mod:`tileops.runtime.library`) with C++ kernels, so that a
compiled graph's call costs what an aten op's does.

It is built with ``torch.utils.cpp_extension`` (ninja, the system C++ compiler, torch's headers;
warnings on) into ``native/<key>/`` under :func:`tileops.compile.entry.cache_root`, the key being
torch's version and build, Python's ABI, the flags and the source, with a checksum beside the
library (a damaged file is never loaded). ``tileops warmup``, ``python -m tileops.runtime.native``
or the first import on a machine with a CUDA GPU builds it (20-40 s, said on stderr; after a failed
build an import does not try again: ``build.failed`` beside it says why). A machine without a GPU
never builds at import (a CPU test run, or a process with a fresh ``TILEOPS_CACHE_DIR``, pays no
compile): it loads a cached build, or runs without the extension. The extension is never loaded
later in a process, so every op of a process is served the same way from its first call.

``TILEOPS_NATIVE=0`` leaves it off for the whole process. Without it (off, not built, no compiler or
headers, a failed build: a debug line on the ``tileops.runtime.native`` logger says why),
:class:`tileops.runtime.executor.PythonRuntime` serves every call.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch

from ..compile.entry import cache_root, file_sha256

__all__ = ["module", "build", "enabled", "status", "library_path", "SOURCE"]

_log = logging.getLogger("tileops.runtime.native")

#: the extension's source, shipped with the package
SOURCE = Path(__file__).with_name("_native.cpp")
_NAME = "_tileops_native"
#: besides cpp_extension's own (-fPIC, -std=c++20, torch's headers as system headers)
FLAGS = ("-O2", "-Wall", "-Wextra", "-fvisibility=hidden")

#: the loaded extension, or None (the Python runtime serves every call); set once, at import
module: Any = None
_status = "not loaded"

#: the build runs in a child process that imports only torch: building loads the library, whose
#: operator registrations must not meet those this process made without it
_BUILD = """
import sys
import torch.utils.cpp_extension as ext
name, source, directory, *flags = sys.argv[1:]
ext.load(name, [source], extra_cflags=flags, build_directory=directory, verbose=True)
"""


def enabled() -> bool:
    """Whether the extension may be used: ``TILEOPS_NATIVE`` is not ``0``."""
    return os.environ.get("TILEOPS_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


def status() -> str:
    """``loaded``, ``off`` (``TILEOPS_NATIVE=0``), ``not built`` (no cached build, no GPU), or why it failed."""
    return _status


def _key() -> str:
    """What a build depends on: torch's version and build, Python's ABI, the flags and the source."""
    parts = [torch.__version__, getattr(torch.version, "git_version", ""), str(torch.version.cuda),
             sys.implementation.cache_tag, sysconfig.get_config_var("EXT_SUFFIX") or ".so",
             str(int(torch.compiled_with_cxx11_abi())), " ".join(FLAGS), hashlib.sha256(SOURCE.read_bytes()).hexdigest()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def library_path() -> str:
    """Where the build for this torch, Python and source is cached."""
    return os.path.join(cache_root(), "native", _key(), _NAME + ".so")


def _intact(path: str) -> bool:
    """Whether ``path`` and its checksum file exist and agree."""
    try:
        with open(path + ".sha256") as f:
            want = f.read().strip()
        return bool(want) and file_sha256(path) == want
    except OSError:
        return False


def build(progress: bool | None = None) -> str:
    """Build the extension into the cache unless an intact build is there; returns its path (the
    library a process loads when it imports tileops). Raises OSError when it cannot be built.
    Two processes never build at once (a lock file: the second waits, then finds the first's).
    ``progress`` as :func:`tileops.progress.wanted`: a line on stderr before and after a compile."""
    from ..progress import task, wanted

    path = library_path()
    if _intact(path):
        return path
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "build.lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if _intact(path):
            return path
        for stale in (path, path + ".sha256", os.path.join(directory, "lock")):  # a builder that died
            if os.path.exists(stale):
                os.unlink(stale)
        failed = os.path.join(directory, "build.failed")  # an import does not try again (build() does)
        with task("compiling the native runtime (tileops/runtime/_native.cpp, 20-40 s)", wanted(progress)):
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, "-c", _BUILD, _NAME, str(SOURCE), directory, *FLAGS],
                               capture_output=True, text=True, timeout=1200)
            log = (r.stdout or "") + (r.stderr or "")
            with open(os.path.join(directory, "build.log"), "w") as f:
                f.write(log)
            if r.returncode != 0 or not os.path.exists(path):
                lines = [ln for ln in log.splitlines() if ln.strip()]
                with open(failed, "w") as f:
                    f.write("\n".join(lines[-20:]) + "\n")
                raise OSError(f"building the native runtime failed: {' / '.join(lines[-3:])}")
        if os.path.exists(failed):
            os.unlink(failed)
        _log.debug("tileops: built %s in %.1f s", path, time.perf_counter() - t0)
        tmp = f"{path}.sha256.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(file_sha256(path) + "\n")
        os.replace(tmp, path + ".sha256")  # the checksum last: a build is intact once it is there
    return path


def _load(path: str) -> Any:
    spec = importlib.util.spec_from_file_location(_NAME, path)  # an extension module, by its suffix
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _has_gpu() -> bool:
    # device_count asks NVML first: it does not initialise CUDA (a process may still fork)
    return torch.version.cuda is not None and torch.cuda.device_count() > 0


def _load_at_import() -> None:
    global module, _status
    if not enabled():
        _status = "off"
        return
    try:
        path = library_path()
        if not _intact(path):
            if not _has_gpu():
                _status = "not built"
                return
            failed = os.path.join(os.path.dirname(path), "build.failed")
            if os.path.exists(failed):  # a build for this torch and source failed: not again at each import
                _status = f"failed: an earlier build did (see {failed}; python -m tileops.runtime.native retries)"
                return
            build(progress=True)
        module, _status = _load(path), "loaded"
    except Exception as e:  # noqa: BLE001 - no compiler or headers, an unwritable cache...: the Python runtime
        _status = f"failed: {e}"
        _log.debug("tileops: native runtime unavailable: %s", e)


def _main() -> int:
    """``python -m tileops.runtime.native``: build (if not cached); print where and how long."""
    t0 = time.perf_counter()
    try:
        path = build(progress=True)
    except OSError as e:
        print(f"failed: {e}", file=sys.stderr)
        return 1
    loaded = sys.modules["tileops.runtime.native"].module is not None  # the copy tileops imported
    here = "loaded in this process" if loaded else "a process started from now on loads it"
    print(f"built: {path} ({time.perf_counter() - t0:.1f} s; {here})")
    return 0


if __name__ == "__main__":  # run as a script, beside the module tileops imported (and loaded from)
    sys.exit(_main())
else:
    _load_at_import()
