"""BUILTIN implementation of the RoPE family: TileLang kernels from ``kernels/rope.py``."""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..generate import compile_kernel, device_backend
from ..launch import launcher

__all__ = ["implement", "kernel_spec"]


def kernel_spec(op: Any, call: Any, backend: str) -> Any:
    """The :class:`kernels.rope.RopeKernelSpec` serving ``op`` for one call specialization."""
    from tileops.kernels.rope import RopeKernelSpec

    static = dict(op.manifest.kernel.static)
    lanes = static.pop("head_lanes", 4)
    if isinstance(lanes, dict):
        lanes = lanes[op.layout]
    head_dim = call.dim("head_dim")
    positions = call.dtype("position_ids") if op.layout == "ids" else None
    return RopeKernelSpec(dtype=call.dtype("x"), head_dim=head_dim, rot=op.rotated_width(head_dim),
                          pairing=op.pairing, positions=positions, backend=backend, head_lanes=int(lanes),
                          **static)


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
    dtype = spec.dtype("x")
    by_ids = op.layout == "ids"
    kspec = kernel_spec(op, spec, backend)
    kernel = launcher(compile_kernel(op.manifest.kernel.builder, kspec, backend, arch), device)
    from tileops.kernels.rope import LO

    tables = op._tables(kspec.rot, LO)
    low = tables.low(device)
    # TileLang's C backend has no bfloat16 type: the C kernel takes the bits as int16.
    bits = backend == "c" and dtype == "bfloat16"

    def as4d(t: torch.Tensor) -> torch.Tensor:
        if op.layout == "1d":
            t = t.view(1, t.shape[0], 1, t.shape[1])
        elif by_ids:
            t = t.view(1, *t.shape)
        return t.view(torch.int16) if bits else t

    if by_ids:
        max_position = op.params["max_position"]
        high = tables.high(device, max_position)
        err = torch.zeros(1, dtype=torch.int32, device=device)

        def run_ids(x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
            x = _aligned(x)
            out = torch.empty_like(x)
            if x.numel() == 0:
                return out
            kernel(as4d(x), as4d(out), high, low, position_ids.contiguous(), err, max_position)
            # One 4-byte read: the kernel sets the flag when any position is out of range (and
            # clamps it, so nothing is read out of bounds). It is zero unless an error was raised.
            if err.item():
                err.zero_()
                op._raise_bad_position(position_ids)
            return out

        return run_ids

    seq_axis = 0 if op.layout == "1d" else 1

    def run(x: torch.Tensor) -> torch.Tensor:
        x = _aligned(x)
        out = torch.empty_like(x)
        if x.numel() == 0:
            return out
        kernel(as4d(x), as4d(out), tables.high(device, x.shape[seq_axis]), low)
        return out

    return run
