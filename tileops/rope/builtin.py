"""BUILTIN implementation of the RoPE family: TileLang kernels from ``kernels/rope.py``."""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..generate import compile_kernel, device_backend
from ..launch import raw_kernel

__all__ = ["implement", "kernel_spec"]


def kernel_spec(op: Any, call: Any, backend: str) -> Any:
    """The :class:`kernels.rope.RopeKernelSpec` serving ``op`` for one call specialization."""
    from tileops.kernels.rope import RopeKernelSpec

    # a static choice is one value, or a map from input layout to value (schedules differ by layout)
    static = {k: (v[op.layout] if isinstance(v, dict) else v) for k, v in op.manifest.kernel.static.items()}
    head_dim = call.dim("head_dim")
    positions = call.dtype("position_ids") if op.layout == "ids" else None
    return RopeKernelSpec(dtype=call.dtype("x"), head_dim=head_dim, rot=op.rotated_width(head_dim),
                          pairing=op.pairing, positions=positions, backend=backend, **static)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    # The kernels read and write x in 16-byte vectors: they need a dense tensor on a 16-byte boundary.
    if not t.is_contiguous():
        return t.contiguous()
    if t.data_ptr() % 16:
        return t.clone()
    return t


def implement(op: Any, spec: Any) -> Callable[..., torch.Tensor]:
    device = spec.device
    backend, arch = device_backend(device)
    by_ids = op.layout == "ids"
    kspec = kernel_spec(op, spec, backend)
    kernel = raw_kernel(compile_kernel(op.manifest.kernel.builder, kspec, backend, arch), device)
    # kernels/rope.py declares X[B, S, H, D] first and the high table's NH after: the extents
    # come in that order. (The C kernel takes bf16 as int16 bits: pointers do not care.)
    if kernel.extent_names != ("B", "S", "H", "NH"):
        raise RuntimeError(f"unexpected dynamic dims {kernel.extent_names} in the RoPE kernel")
    from tileops.kernels.rope import LO

    tables = op._tables(kspec.rot, LO)
    # blocks_per_sm > 0: the grid is sized from the SM count and blocks loop over token groups
    grid_cap = 0
    if kspec.blocks_per_sm and device.type == "cuda":
        grid_cap = torch.cuda.get_device_properties(device).multi_processor_count * kspec.blocks_per_sm
    group = kspec.group

    def grid(b: int, s: int) -> tuple:
        if not grid_cap:
            return ()
        return (max(1, min(-(-s // group), grid_cap // max(b, 1))),)
    low = tables.low(device)
    low_ptr = low.data_ptr()

    if by_ids:
        max_position = op.params["max_position"]
        high = tables.high(device, max_position)
        high_ptr, nh = high.data_ptr(), high.shape[0]
        err = torch.zeros(1, dtype=torch.int32, device=device)
        err_ptr = err.data_ptr()

        def run_ids(x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
            x = _aligned(x)
            out = torch.empty_like(x)
            tokens, heads = x.shape[0], x.shape[1]
            if tokens == 0 or heads == 0:
                return out
            pos = position_ids if position_ids.is_contiguous() else position_ids.contiguous()
            kernel(x.data_ptr(), out.data_ptr(), high_ptr, low_ptr, pos.data_ptr(), err_ptr, max_position,
                   *grid(1, tokens), 1, tokens, heads, nh)
            # One 4-byte read: the kernel sets the flag when any position is out of range (and
            # clamps it, so nothing is read out of bounds). It is zero unless an error was raised.
            if err.item():
                err.zero_()
                op._raise_bad_position(position_ids)
            return out

        return run_ids

    two_d = op.layout == "2d"

    def run(x: torch.Tensor) -> torch.Tensor:
        x = _aligned(x)
        out = torch.empty_like(x)
        if x.numel() == 0:
            return out
        if two_d:
            b, s, h = x.shape[0], x.shape[1], x.shape[2]
        else:
            b, s, h = 1, x.shape[0], 1
        high = tables.high(device, s)
        kernel(x.data_ptr(), out.data_ptr(), high.data_ptr(), low_ptr, *grid(b, s), b, s, h, high.shape[0])
        return out

    return run
