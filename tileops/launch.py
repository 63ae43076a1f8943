"""A lean launcher for compiled TileLang kernels.

TileLang's Python adapter validates every tensor on every call (dtype, device, static shapes,
strides) and spends 60-100 µs of host time doing it, more than a RoPE kernel runs on a GPU. The ops
have already checked their inputs against the manifest, so they call the library's C entry point
directly: pointers and scalars in parameter order, then each dynamic extent, then the stream. That
is the calling convention TileLang's own Cython wrapper uses. With ``argtypes`` declared, ctypes
converts plain ints in C, which keeps a call near 1 µs of Python.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["RawKernel", "raw_kernel"]

_CTYPES = {torch.int32: ctypes.c_int32, torch.int64: ctypes.c_int64, torch.float32: ctypes.c_float,
           torch.float64: ctypes.c_double}


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
    _slots: tuple[dict[str, int], tuple[int, ...]] = ({}, ())

    def __post_init__(self) -> None:
        names = self.arg_names
        object.__setattr__(self, "_slots", ({n: i for i, n in enumerate(names)}, (0,) * len(names)))

    @property
    def arg_names(self) -> tuple[str, ...]:
        """Every argument of :meth:`__call__`, in order: the parameters, then the extents."""
        return self.param_names + self.extent_names

    @property
    def slot(self) -> dict[str, int]:
        """Argument name -> its index in the positional list :meth:`slots` makes."""
        return self._slots[0]

    def slots(self) -> list[Any]:
        """A fresh positional argument list to fill by :attr:`slot` (the fast path of :meth:`bind`):
        every argument 0 to begin with, which is what the unused flat extents of tileops' kernels take."""
        return list(self._slots[1])

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
        if self.device_index is None:
            return 0
        return torch._C._cuda_getCurrentRawStream(self.device_index)

    def __call__(self, *args: Any) -> None:
        """Launch with ``args`` = params then extents (the stream is added here); raises on failure."""
        if self.device_index is not None and torch.cuda.current_device() != self.device_index:
            with torch.cuda.device(self.device_index):  # the C entry point launches on the current device
                rc = self.call(*args, self.stream())
        else:
            rc = self.call(*args, self.stream())
        if rc != 0:
            raise RuntimeError(f"TileLang kernel failed: {self.lib.get_last_error().decode('utf-8', 'replace')}")


def raw_kernel(kernel: Any, device: torch.device, param_names: tuple[str, ...] = ()) -> RawKernel:
    """The C entry point of ``kernel`` (compiled by TileLang with the Cython execution backend).

    ``param_names`` names the kernel's parameters in order (the builder's spec knows them), so
    arguments can be bound by name with :meth:`RawKernel.bind`.
    """
    adapter = kernel.adapter
    lib = getattr(adapter, "lib", None)
    dyn = getattr(adapter, "dynamic_symbolic_map", None)
    if lib is None or dyn is None:
        raise RuntimeError("tileops needs TileLang's Cython execution backend (the kernel has no C entry point)")
    if any(ref_kind != 0 for ref_kind, *_ in dyn.values()):
        raise RuntimeError("a dynamic stride in a tileops kernel: not supported by the launcher")
    if param_names and len(param_names) != len(adapter.params):
        raise RuntimeError(f"the kernel has {len(adapter.params)} parameters, its spec names {len(param_names)}")
    argtypes = [(_CTYPES[p.torch_dtype()] if p.is_scalar() else ctypes.c_void_p) for p in adapter.params]
    argtypes += [ctypes.c_int64] * len(dyn) + [ctypes.c_void_p]
    call = lib.call
    call.argtypes = argtypes
    call.restype = ctypes.c_int32
    index = None
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
    return RawKernel(call=call, extent_names=tuple(str(v) for v in dyn), device_index=index, lib=lib,
                     param_names=tuple(param_names))
