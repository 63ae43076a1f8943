"""BUILTIN implementation of the scale family: the TileLang kernel of ``kernels/scale.py``.

The kernel reads and writes flat contiguous buffers: a strided ``x`` is copied to a dense tensor
first, and an ``out=`` that is not contiguous is written through a dense buffer. The backward is the
same kernel applied to the output's gradient.

How a call's tensors meet the kernel's parameters is declared once, as the plan :data:`STEPS` (every
kernel argument by its role: :mod:`tileops.runtime.plan`) and how the kernel sees its tensors
(:data:`DIMS`: flat, dense runs): the runtime binds it per call signature and serves a repeated
eager call from it without Python (:meth:`ScaleKernels.binding`); the general path places the call
by the plan's fit policy (the copies) and binds into the runtime's cache.
"""

from __future__ import annotations

from typing import Any

import torch

from tileops.compile.build import device_backend, load_kernel
from tileops.runtime.binding import Binding
from tileops.runtime.plan import Flat, Plan, Ptr, Size, Step, Value
from tileops.runtime.views import Misfit

__all__ = ["implement", "kernel_specs", "ScaleKernels"]


def kernel_specs(manifest: Any, params: Any, call: Any, backend: str, backward: bool = True) -> list[tuple[str, Any]]:
    """Every ``(builder, spec)`` a call of one specialization may launch (what ``tileops warmup``
    builds ahead): one :class:`kernels.scale.Spec`, forward and backward alike (the backward is the
    same kernel); ``c`` is a runtime argument, so ``params`` change nothing."""
    from tileops.kernels import get_spec

    builder = manifest.kernel.builder
    return [(builder, get_spec(builder)(dtype=call.dtype("x"), backend=backend, **manifest.kernel.static))]


#: ``Y[i] = c * X[i]`` for ``i < N``: the kernel's pointers are the data of ``x`` and ``out``
STEPS = (Step("scale", {"X": Ptr("x"), "Y": Ptr("out"), "c": Value("c"), "N": Size("x", "n")}),)
#: the kernel reads and writes both as flat dense runs: any other view is copied (or written through a buffer)
DIMS = {"x": Flat(), "out": Flat()}


class ScaleKernels:
    """The kernel of one op specialization, as a kernel set (:mod:`tileops.autograd`)."""

    def __init__(self, op: Any, spec: Any):
        backend, arch = device_backend(spec.device)
        (_, kspec), = kernel_specs(op.manifest, op.params, spec, backend)
        # compiled once, then loaded from tileops' index by later processes (no TileLang import there)
        self.kernel = load_kernel(op.manifest.kernel.builder, kspec, backend, arch, spec.device, kspec.args)
        self.op = op
        self.plan = Plan.of(op.manifest, STEPS, dims=DIMS)

    def _binding(self, tensors: dict, outs: dict, views: dict) -> Binding:
        return self.plan.bind({"scale": self.kernel}, tensors, outs, env={"c": self.op.factor}, views=views)

    def binding(self, tensors: dict, outs: dict) -> Binding | None:
        """The binding of every later call shaped like this one: contiguous ``x`` and ``out`` (a new
        output of a contiguous ``x`` is contiguous); None for others, which the general path copies."""
        x, out = tensors["x"], outs.get("out")
        views = {"out": out if out is not None else torch.empty_like(x)}
        if x.numel() == 0 or isinstance(self.plan.layout({**tensors, **views}, 1), Misfit):
            return None
        return self._binding(tensors, outs, views)

    def run(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``c * x`` into ``out`` or a new tensor: a view the kernel cannot address is copied first."""
        placed = self.plan.place({"x": x}, {"out": out}, 1)
        if x.numel():
            launch, writes = placed.inputs, placed.writes
            self.op.run_plan(self, self.plan.key(launch, writes), lambda: self._binding(launch, writes, {}),
                             launch, writes)
            placed.copy_back()
        return placed.outs["out"]

    def prepare(self, tensors: dict) -> None:
        return None

    def forward(self, state: None, tensors: dict, outs: dict) -> torch.Tensor:
        return self.run(tensors["x"], outs.get("out"))

    def backward(self, state: None, grads: tuple, tensors: dict) -> tuple:
        return (self.run(grads[0]),)


def implement(op: Any, spec: Any) -> ScaleKernels:
    return ScaleKernels(op, spec)
