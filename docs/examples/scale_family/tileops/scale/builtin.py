"""BUILTIN implementation of the scale family: the TileLang kernel of ``kernels/scale.py``.

The kernel reads and writes flat contiguous buffers: a strided ``x`` is copied to a dense tensor
first, and an ``out=`` that is not contiguous is written through a dense buffer. The backward is the
same kernel applied to the output's gradient.
"""

from __future__ import annotations

from typing import Any

import torch

from tileops.compile.build import device_backend, load_kernel

__all__ = ["implement", "kernel_specs", "ScaleKernels"]


def kernel_specs(manifest: Any, params: Any, call: Any, backend: str, backward: bool = True) -> list[tuple[str, Any]]:
    """Every ``(builder, spec)`` a call of one specialization may launch (what ``tileops warmup``
    builds ahead): one :class:`kernels.scale.Spec`, forward and backward alike (the backward is the
    same kernel); ``c`` is a runtime argument, so ``params`` change nothing."""
    from tileops.kernels import get_spec

    builder = manifest.kernel.builder
    return [(builder, get_spec(builder)(dtype=call.dtype("x"), backend=backend, **manifest.kernel.static))]


class ScaleKernels:
    """The kernel of one op specialization, as a kernel set (:mod:`tileops.autograd`)."""

    def __init__(self, op: Any, spec: Any):
        backend, arch = device_backend(spec.device)
        (_, kspec), = kernel_specs(op.manifest, op.params, spec, backend)
        # compiled once, then loaded from tileops' index by later processes (no TileLang import there)
        self.kernel = load_kernel(op.manifest.kernel.builder, kspec, backend, arch, spec.device, kspec.args)
        self.factor = op.factor

    def run(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        src = x.contiguous()
        y = out if out is not None and out.is_contiguous() else torch.empty_like(src)
        if src.numel():
            self.kernel(src.data_ptr(), y.data_ptr(), self.factor, src.numel())
        if out is not None and y is not out:
            out.copy_(y)
            return out
        return y

    def prepare(self, tensors: dict) -> None:
        return None

    def forward(self, state: None, tensors: dict, outs: dict) -> torch.Tensor:
        return self.run(tensors["x"], outs.get("out"))

    def backward(self, state: None, grads: tuple, tensors: dict) -> tuple:
        return (self.run(grads[0]),)


def implement(op: Any, spec: Any) -> ScaleKernels:
    return ScaleKernels(op, spec)
