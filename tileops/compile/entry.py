"""A lean launcher for compiled TileLang kernels.

TileLang's Python adapter validates every tensor on every call and spends 60-100 µs of host time
doing it, more than a RoPE kernel runs on a GPU. The ops have already checked their inputs against
the manifest, so they call the library's C entry point directly, as TileLang's own Cython wrapper
does: pointers and scalars in parameter order, then each dynamic extent, then the stream.

Converting ~30 arguments through ctypes costs 3-4 µs per call, so each kernel signature also gets
a small C *trampoline*, compiled once with the system C compiler and cached on disk: it takes one
``int64`` array of every argument (a float as its IEEE bits), casts each to its C type and calls
the entry point, then (for a call whose completion is tracked, :mod:`tileops.runtime.errors`)
says whether the stream is being captured into a graph and, unless it is, records a CUDA event on
the same stream. The
native runtime (:mod:`tileops.runtime.native`) calls it by its address, without Python. Without a
C compiler the launcher falls back to plain ctypes: correct, and slower.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import hashlib
import logging
import os
import struct
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from ..torch_private import current_raw_stream

__all__ = ["RawKernel", "raw_kernel", "raw_kernel_from", "kernel_record", "cache_root", "build_c_library",
           "encode_arg", "RECORD_FAILED", "CAPTURING", "C_TYPES"]

_log = logging.getLogger("tileops.compile.entry")


def cache_root() -> str:
    """tileops' own cache directory (``TILEOPS_CACHE_DIR``, default ``~/.cache/tileops``)."""
    return os.environ.get("TILEOPS_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tileops")


def file_sha256(path: str) -> str:
    """The sha256 of a file's bytes (hex): how every cached library in tileops' cache is checked."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@dataclass(frozen=True)
class RawKernel:
    """A compiled kernel's C entry point.

    ``call(*params, *extents, stream)``: ``params`` are the kernel's parameters in order (a
    tensor as its ``data_ptr()``, a scalar as a Python number), ``extents`` the values of the
    dynamic dims named in ``extent_names`` (in that order), ``stream`` a raw CUDA stream (0 on the CPU).
    ``device_index`` is the CUDA device the kernel must be launched on (None on the CPU).
    """

    call: Callable[..., int]
    extent_names: tuple[str, ...]
    device_index: int | None
    lib: Any
    param_names: tuple[str, ...] = ()
    #: the trampoline ``(entry, args, stream, record, event, capturing) -> rc`` (None: plain ctypes)
    packed: Any = None
    _slot: dict[str, int] = field(default_factory=dict)
    _entry: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "_slot", {n: i for i, n in enumerate(self.arg_names)})
        object.__setattr__(self, "_entry", ctypes.cast(self.call, ctypes.c_void_p).value or 0)

    @property
    def arg_names(self) -> tuple[str, ...]:
        """Every argument of :meth:`__call__`, in order: the parameters, then the extents."""
        return self.param_names + self.extent_names

    @property
    def arg_types(self) -> tuple[str, ...]:
        """The C type of each of :attr:`arg_names` (``void*``, ``int32_t``, ``int64_t``, ``float``, ``double``)."""
        return tuple(_TYPE_NAMES[t] for t in self.call.argtypes[:-1])

    @property
    def slot(self) -> dict[str, int]:
        """Argument name -> its index in :meth:`template` (and in :meth:`launch`'s ``args``)."""
        return self._slot

    def template(self, values: Mapping[str, Any]) -> array.array:
        """Every argument as :meth:`launch` takes it (see :func:`encode_arg`): ``values`` by name, the
        others 0, which is what the unused flat extents of tileops' kernels take."""
        args, kinds = array.array("q", bytes(8 * len(self._slot))), self.arg_types
        for name, value in values.items():
            args[self._slot[name]] = encode_arg(kinds[self._slot[name]], value)
        return args

    def bind(self, **values: Any) -> list[Any]:
        """The positional arguments for ``values`` keyed by name; a missing or unknown name raises."""
        unknown = set(values) - set(self.arg_names)
        if unknown:
            raise TypeError(f"kernel arguments {sorted(unknown)} are not among {list(self.arg_names)}")
        try:
            return [values[n] for n in self.arg_names]
        except KeyError as e:
            raise TypeError(f"kernel argument {e.args[0]!r} missing; the kernel takes {list(self.arg_names)}") from None

    def stream(self) -> int:
        """The current raw CUDA stream of the kernel's device (0 on the CPU)."""
        return 0 if self.device_index is None else current_raw_stream(self.device_index)

    def __call__(self, *args: Any) -> None:
        """Launch with ``args`` = params then extents (the stream is added here); raises on failure."""
        self.launch([encode_arg(t, v) for t, v in zip(self.arg_types, args)], self.stream())

    def launch(self, args: "list[int] | array.array", stream: int, record: int = 0, event: int = 0,
               capturing: int = 0) -> bool:
        """Launch with ``args`` (params then extents, all integers: see :func:`encode_arg`) on the raw ``stream``.

        With ``capturing`` (``cuStreamIsCapturing``'s address), a call whose values are checked asks
        whether the stream is being captured into a CUDA graph; with ``event`` too, its completion is
        tracked: the event is recorded on the stream right after the kernel with ``record``
        (``cuEventRecord``'s address), unless the stream is being captured. Returns whether the
        stream was capturing (then no event was recorded)."""
        # the C entry point launches on the current device
        switch = self.device_index is not None and torch.cuda.current_device() != self.device_index
        with torch.cuda.device(self.device_index) if switch else contextlib.nullcontext():
            rc = self._launch(args, stream, record, event, capturing)
        if rc == 0 or rc == CAPTURING:
            return rc == CAPTURING
        if rc == RECORD_FAILED:  # the native runtime raises these two errors alike
            raise RuntimeError("tileops: recording the CUDA event after a kernel failed")
        raise RuntimeError(f"TileLang kernel failed: {self.lib.get_last_error().decode('utf-8', 'replace')}")

    @property
    def addresses(self) -> tuple[int, int, int]:
        """(the trampoline's address, the entry point's, the library's ``get_last_error``'s): what
        the native runtime calls; the trampoline's is 0 without one (it then calls :meth:`launch`)."""
        packed, error = (ctypes.cast(f, ctypes.c_void_p).value or 0 for f in (self.packed, self.lib.get_last_error))
        return packed, self._entry, error

    def _launch(self, args: Any, stream: int, record: int, event: int, capturing: int) -> int:
        if self.packed is not None:
            a = args if isinstance(args, array.array) else array.array("q", args)
            return self.packed(self._entry, a.buffer_info()[0], stream, record, event, capturing)
        cap = bool(capturing) and _stream_capturing(capturing, stream)  # the same steps, through ctypes
        rc = self.call(*(_decode(t, v) for t, v in zip(self.arg_types, args)), stream)
        if rc != 0:
            return rc
        if cap:
            return CAPTURING
        if not event:
            return 0
        return RECORD_FAILED if _c_fn(record, 2)(event, stream) != 0 else 0


#: what a launch returns besides the entry point's own codes: the event could not be recorded; the
#: stream was being captured into a graph (the kernel was captured, no event recorded)
RECORD_FAILED = 0x7FFFFFF0
CAPTURING = 0x7FFFFFF1


def encode_arg(kind: str, value: Any) -> int:
    """An argument of C type ``kind`` as the int64 a launch takes (a float as its IEEE bits)."""
    if kind == "float":
        return struct.unpack("<i", struct.pack("<f", value))[0]
    if kind == "double":
        return struct.unpack("<q", struct.pack("<d", value))[0]
    return int(value)


def _decode(kind: str, value: int) -> Any:
    """An int64 argument as ctypes takes it: a float's IEEE bits back to the float."""
    if kind == "float":
        return struct.unpack("<f", struct.pack("<i", value))[0]
    if kind == "double":
        return struct.unpack("<d", struct.pack("<q", value))[0]
    return value


_c_fns: dict[tuple[int, int], Any] = {}


def _c_fn(address: int, nargs: int) -> Any:
    """A driver function ``int f(void*, ...)`` called through its address."""
    fn = _c_fns.get((address, nargs))
    if fn is None:
        fn = _c_fns[(address, nargs)] = ctypes.CFUNCTYPE(ctypes.c_int, *[ctypes.c_void_p] * nargs)(address)
    return fn


def _stream_capturing(capturing: int, stream: int) -> bool:
    status = ctypes.c_int()
    return _c_fn(capturing, 2)(stream, ctypes.addressof(status)) != 0 or status.value != 0


# ---------------------------------------------------------------------------------- trampolines
_trampolines: dict[tuple[str, ...], Any] = {}
_trampoline_lock = threading.Lock()


def _trampoline_source(ctypes_args: list[str]) -> str:
    params = ", ".join(ctypes_args + ["void*"])
    cast = {"void*": "(void*)(intptr_t)a[{}]", "float": "f32(a[{}])", "double": "f64(a[{}])"}
    casts = [cast.get(t, f"({t})a[{{}}]").format(i) for i, t in enumerate(ctypes_args)]
    return (
        "#include <stdint.h>\n"
        "#include <string.h>\n"
        "/* generated by tileops.compile.entry: one kernel signature's packed-argument trampoline */\n"
        "static inline float f32(int64_t v) { int32_t b = (int32_t)v; float f; memcpy(&f, &b, 4); return f; }\n"
        "static inline double f64(int64_t v) { double d; memcpy(&d, &v, 8); return d; }\n"
        f"typedef int32_t (*entry_t)({params});\n"
        "typedef int (*fn2_t)(void*, void*);\n"
        "int32_t tileops_launch(void* f, const int64_t* a, void* stream, void* record, void* event,\n"
        "                       void* capturing) {\n"
        "  int cap = 0;\n"
        "  if (capturing) {  /* a stream being captured gets no event: a graph replays the kernel later */\n"
        "    int status = 0;\n"
        "    cap = ((fn2_t)capturing)(stream, &status) != 0 || status != 0;\n"
        "  }\n"
        f"  int32_t rc = ((entry_t)f)({', '.join(casts + ['stream'])});\n"
        "  if (rc != 0) return rc;\n"
        f"  if (cap) return {CAPTURING};\n"
        "  if (!event) return 0;\n"
        f"  if (((fn2_t)record)(event, stream) != 0) return {RECORD_FAILED};\n"
        "  return 0;\n"
        "}\n"
    )


def _trampoline(ctypes_args: list[str]) -> Any:
    """The compiled trampoline for one signature (C type names), or None without a C compiler."""
    key = tuple(ctypes_args)
    with _trampoline_lock:  # once per kernel load, not per call
        if key in _trampolines:
            return _trampolines[key]
        fn = None
        try:
            fn = build_c_library(_trampoline_source(ctypes_args)).tileops_launch
            fn.argtypes = [ctypes.c_void_p] * 6
            fn.restype = ctypes.c_int32
        except Exception as e:  # no compiler, unwritable disk: plain ctypes still works
            _log.debug("tileops: packed launcher unavailable (%s); using plain ctypes", e)
        _trampolines[key] = fn
        return fn


def build_c_library(source: str) -> ctypes.CDLL:
    """``source`` (C) compiled into a shared library with the system compiler (``$CC``, else ``cc``),
    cached on disk by content under :func:`cache_root`; raises OSError when it cannot be built."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:20]
    dirs = [os.path.join(cache_root(), "launch"), os.path.join(tempfile.gettempdir(), f"tileops-launch-{os.getuid()}")]
    for d in dirs:
        path = os.path.join(d, f"trampoline-{digest}.so")
        if not os.path.exists(path):
            try:
                os.makedirs(d, exist_ok=True)
                fd, tmp_c = tempfile.mkstemp(suffix=".c", dir=d)
                with os.fdopen(fd, "w") as f:
                    f.write(source)
                tmp_so = tmp_c[:-2] + ".so"
                cc = os.environ.get("CC", "cc")
                subprocess.run([cc, "-O2", "-shared", "-fPIC", tmp_c, "-o", tmp_so], check=True,
                               capture_output=True, timeout=60)
                os.replace(tmp_so, path)  # atomic: another process sees the whole library or none
                os.unlink(tmp_c)
            except (OSError, subprocess.SubprocessError):
                continue
        try:
            lib = ctypes.CDLL(path)
        except OSError:  # a truncated file: build afresh next time
            try:
                os.unlink(path)
            except OSError:
                pass
            continue
        return lib
    raise OSError("no writable directory, or no C compiler, for the launcher")


#: C type names of kernel arguments as a kernel record writes them (each a type the trampoline passes)
_RECORD_TYPES = {"void*": ctypes.c_void_p, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64,
                 "float": ctypes.c_float, "double": ctypes.c_double}
_TYPE_NAMES = {v: k for k, v in _RECORD_TYPES.items()}
#: the C type of a scalar parameter, by its dtype's name
C_TYPES = {"int32": "int32_t", "int64": "int64_t", "float32": "float", "float64": "double"}


def kernel_record(kernel: Any) -> dict[str, Any]:
    """What launching ``kernel`` (compiled by TileLang with the Cython execution backend) takes, as
    plain data: ``args``, the C type of each parameter then of each dynamic extent, and
    ``extents``, the extents' names. With it, :func:`raw_kernel_from` launches the kernel's library
    in a later process without TileLang (:mod:`tileops.compile.build` keeps records on disk)."""
    from .tilelang_api import compiled_parts

    lib, params, dyn = compiled_parts(kernel)
    if lib is None or dyn is None:
        raise RuntimeError("tileops needs TileLang's Cython execution backend (the kernel has no C entry point)")
    # a dynamic extent is a shape (kind 0) or, for a strided tensor, a stride (kind 1: the attention
    # kernel's q/k/v strides, from which TileLang's host code builds TMA descriptors); either way the
    # launcher passes it by name (the family's plan gives every one), never reading it off a tensor
    if any(ref_kind not in (0, 1) for ref_kind, *_ in dyn.values()):
        raise RuntimeError("a dynamic extent that is neither a shape nor a stride: not supported by the launcher")
    args = [C_TYPES[str(dtype).removeprefix("torch.")] if dtype is not None else "void*" for dtype in params]
    args += ["int64_t" if str(v.dtype) == "int64" else "int32_t" for v in dyn]
    return {"args": args, "extents": [str(v) for v in dyn]}


def raw_kernel(kernel: Any, device: torch.device, param_names: tuple[str, ...] = ()) -> RawKernel:
    """The C entry point of ``kernel`` (compiled by TileLang with the Cython execution backend).

    ``param_names`` names the kernel's parameters in order (the builder's spec knows them), so
    arguments can be bound by name with :meth:`RawKernel.bind`.
    """
    from .tilelang_api import library

    return raw_kernel_from(library(kernel), kernel_record(kernel), device, param_names)


def _load_device_code(lib: Any) -> None:
    """A lean build's library (:mod:`tileops.compile.cuda_build`) loads its cubin at the first launch, or here,
    when the kernel is fetched: before the call that may be captured into a CUDA graph. Raises what
    loading reports (no GPU, a driver too old for the cubin)."""
    try:
        load = lib.load
    except AttributeError:  # TileLang's own build: nvcc registered the kernel with the runtime
        return
    load.restype = ctypes.c_int
    if load() != 0:
        raise RuntimeError(f"tileops: {lib.get_last_error().decode('utf-8', 'replace')}")


def raw_kernel_from(lib: Any, record: dict[str, Any], device: torch.device,
                    param_names: tuple[str, ...] = ()) -> RawKernel:
    """The C entry point ``call`` of a loaded kernel library, typed by its :func:`kernel_record`."""
    argtypes = [_RECORD_TYPES[t] for t in record["args"]]
    extents = tuple(record["extents"])
    if param_names and len(param_names) != len(argtypes) - len(extents):
        raise RuntimeError(f"the kernel has {len(argtypes) - len(extents)} parameters, its spec names "
                           f"{len(param_names)}")
    call = lib.call
    call.argtypes = argtypes + [ctypes.c_void_p]
    call.restype = ctypes.c_int32
    index = None
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        _load_device_code(lib)
    return RawKernel(call=call, extent_names=extents, device_index=index, lib=lib,
                     param_names=tuple(param_names), packed=_trampoline(list(record["args"])))
