"""BUILTIN implementation of the scale family: the TileLang kernel of ``kernels/scale.py``.

The kernel reads and writes flat contiguous buffers: a strided ``x`` is copied to a dense tensor
first, and an ``out=`` that is not contiguous is written through a dense buffer. The backward is the
same kernel applied to the output's gradient.

How a call's tensors meet the kernel's parameters is said once, in :meth:`ScaleKernels._binding`
(a :class:`tileops.runtime.binding.Binding`): the runtime keeps it per call signature and serves a
repeated eager call from it without Python (:meth:`ScaleKernels.binding`), and the general path
launches through it too.
"""

from __future__ import annotations

from typing import Any

import torch

from tileops.compile.build import device_backend, load_kernel
from tileops.runtime.binding import Binding, bind

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
        self.op = op
        self.factor = op.factor

    def _binding(self, tensors: dict, outs: dict) -> Binding:
        """``X`` and ``Y`` are the data pointers of ``x`` and ``out``; ``c`` the factor, ``N`` the length."""
        return bind(self.kernel, self.op.manifest, tensors, outs, args={"c": self.factor, "N": tensors["x"].numel()},
                    pointers={"X": "x", "Y": "out"})

    def binding(self, tensors: dict, outs: dict) -> Binding | None:
        """The binding of every later call shaped like this one: contiguous ``x`` and ``out`` (a new
        output of a contiguous ``x`` is contiguous); None for others, which take :meth:`run`."""
        x, out = tensors["x"], outs.get("out")
        if x.numel() == 0 or not x.is_contiguous() or (out is not None and not out.is_contiguous()):
            return None
        return self._binding(tensors, outs)

    def run(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        src = x.contiguous()
        y = out if out is not None and out.is_contiguous() else torch.empty_like(src)
        if src.numel():
            self.op._runtime.execute(self._binding({"x": src}, {"out": y}), {"x": src}, {"out": y})
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
