"""Workloads from manifest cases: the params, dims and random inputs of one case.

The demo, the generated tests and the benchmarks all build their inputs here, so a case means the
same thing everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from .manifest import Case, OpManifest, TensorSpec
from .manifest import DTYPES

__all__ = ["Workload", "index_dtype", "case_params", "case_dims", "make_inputs", "workload", "op_class", "bytes_moved"]

SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


@dataclass
class Workload:
    manifest: OpManifest
    case: Case
    dtype: str
    params: dict[str, Any]
    dims: dict[str, int]
    inputs: dict[str, torch.Tensor]

    @property
    def label(self) -> str:
        return f"{self.case.label}-{SHORT.get(self.dtype, self.dtype)}"


def op_class(name: str) -> type:
    """The op class of manifest ``name`` (``tileops.<family>.<name>``)."""
    from . import ops

    return ops()[name]


def index_dtype(t: TensorSpec) -> str:
    """The dtype workloads give an integer input: int64 where allowed, else its first dtype."""
    return "int64" if "int64" in t.dtypes else t.dtypes[0]


def case_params(m: OpManifest, case: Case) -> dict[str, Any]:
    return m.defaults() | dict(case.params)


def case_dims(m: OpManifest, case: Case, shrink: bool = False) -> dict[str, int]:
    """The case's dims; with ``shrink``, halved along ``cpu_shrink.dims`` until the largest input fits."""
    dims = dict(case.dims)
    if not shrink or m.cpu_shrink is None:
        return dims
    params = case_params(m, case)

    def elements() -> int:
        return max(math.prod(dims[d] for d in t.shape_for(params)) for t in m.inputs if _passed(t, case))

    order = list(m.cpu_shrink.dims)
    while elements() > m.cpu_shrink.max_elements and any(dims.get(d, 1) > 1 for d in order):
        d = max((d for d in order if dims.get(d, 1) > 1), key=lambda d: dims[d])
        dims[d] = max(1, dims[d] // 2)
    return dims


def _passed(t: TensorSpec, case: Case | None, every: bool = False) -> bool:
    """Whether a workload of ``case`` passes input ``t``: every required one, and the optional ones
    the case lists under ``with`` (all of them with ``every``)."""
    return every or not t.optional or (case is not None and t.name in case.with_inputs)


def make_inputs(m: OpManifest, params: Mapping[str, Any], dims: Mapping[str, int], dtype: str,
                device: torch.device | str = "cpu", generator: torch.Generator | None = None,
                case: Case | None = None, every: bool = False) -> dict[str, torch.Tensor]:
    """Fresh random inputs: normal floats in ``dtype``, integers uniform over the tensor's ``range``.
    Optional inputs are made only when ``case`` lists them under ``with``, or all with ``every``."""
    env = dict(params) | dict(dims)
    out: dict[str, torch.Tensor] = {}
    for t in m.inputs:
        if not _passed(t, case, every):
            continue
        shape = [dims[d] for d in t.shape_for(params)]
        if t.range is not None:
            low, high = (int(b.evaluate(env)) for b in t.range)
            idt = DTYPES[index_dtype(t)]
            out[t.name] = torch.randint(low, high, shape, generator=generator, dtype=idt).to(device)
        else:
            x = torch.randn(shape, generator=generator, dtype=torch.float32)
            out[t.name] = x.to(device=device, dtype=DTYPES[dtype])
    return out


def workload(m: OpManifest, case: Case, dtype: str, device: torch.device | str = "cpu", shrink: bool = False,
             generator: torch.Generator | None = None) -> Workload:
    params = case_params(m, case)
    dims = case_dims(m, case, shrink)
    return Workload(m, case, dtype, params, dims, make_inputs(m, params, dims, dtype, device, generator, case))


def bytes_moved(w: Workload) -> int:
    """Bytes that must move: each input read once, each output written once (no tables); an output
    shaped like an input the workload does not pass (``key_out`` without ``key``) is not written."""
    n = sum(t.numel() * t.element_size() for t in w.inputs.values())
    for o in w.manifest.outputs:
        src = w.inputs.get(o.like) if o.like else None
        if src is not None:
            n += src.numel() * src.element_size()
    return n
