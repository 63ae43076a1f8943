"""Workloads from manifest cases: the params, dims and random inputs of one case.

The demo, the generated tests and the benchmarks all build their inputs here, so a case means the
same thing everywhere. A case's params and dims are read by :mod:`tileops.manifest.cases` (what
``tileops warmup`` compiles for, too), whose functions this module re-exports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from .manifest import DTYPES, Case, OpManifest
from .manifest.cases import case_dims, case_params, index_dtype, passes, tensor_shape

__all__ = ["Workload", "index_dtype", "case_params", "case_dims", "make_inputs", "draw_distinct", "workload", "op_class",
           "op_params", "bytes_moved"]

SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


@dataclass
class Workload:
    manifest: OpManifest
    case: Case
    dtype: str
    params: dict[str, Any]
    dims: dict[str, Any]
    inputs: dict[str, torch.Tensor]

    @property
    def label(self) -> str:
        return f"{self.case.label}-{SHORT.get(self.dtype, self.dtype)}"


def op_class(name: str) -> type:
    """The op class of manifest ``name`` (``tileops.<family>.<name>``)."""
    from . import ops

    return ops()[name]


def op_params(m: OpManifest, params: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` with each ``op`` param a case gives as ``{op: OpName, params: {...}}`` built into that
    op (the prologue's ``rope``); every other value as it is."""
    out = dict(params)
    for p in m.params:
        value = out.get(p.name)
        if p.type == "op" and isinstance(value, Mapping):
            out[p.name] = op_class(value["op"])(**value.get("params", {}))
    return out


def make_inputs(m: OpManifest, params: Mapping[str, Any], dims: Mapping[str, Any], dtype: str,
                device: torch.device | str = "cpu", generator: torch.Generator | None = None,
                case: Case | None = None, every: bool = False) -> dict[str, torch.Tensor]:
    """Fresh random inputs: normal floats in ``dtype``, integers uniform over the tensor's ``range``.
    Optional inputs are made only when ``case`` lists them under ``with``, or all with ``every``.
    Leading dims (a shape's ``"..."``) are ``dims["..."]``, none when it is absent."""
    env = dict(params) | dict(dims)
    out: dict[str, torch.Tensor] = {}
    for t in m.inputs:
        if not passes(t, case, every):
            continue
        shape = tensor_shape(t, params, dims)
        if t.range is not None:
            low, high = (int(b.evaluate(env)) for b in t.range)
            idt = DTYPES[index_dtype(t)]
            v = draw_distinct(low, high, shape, generator) if t.distinct else \
                torch.randint(low, high, shape, generator=generator)
            out[t.name] = v.to(device=device, dtype=idt)
        else:
            x = torch.randn(shape, generator=generator, dtype=torch.float32)
            out[t.name] = x.to(device=device, dtype=DTYPES[t.case_dtype(dtype, params)])
    return out


def draw_distinct(low: int, high: int, shape: Sequence[int], generator: torch.Generator | None = None,
                  first: Sequence[int] = ()) -> torch.Tensor:
    """int64 values of ``[low, high)`` of which no non-negative one repeats (a ``distinct`` input, a slot
    mapping): a random draw without replacement; where the shape holds more values than the range,
    the rest are ``low``, which must then be negative (padding). ``first`` (at most the shape's
    count, each in the range, no non-negative one twice: a fuzzer's values at the ends of the range)
    are the first values in that order; the others are drawn from the values they leave."""
    n = math.prod(shape)
    span = max(high - low, 0)
    first = [int(f) for f in first]
    taken = [f for f in first if f >= 0]
    if len(first) > n or any(not low <= f < high for f in first) or len(set(taken)) != len(taken):
        raise ValueError(f"first: expected at most {n} values in [{low}, {high}), no non-negative one twice, "
                         f"got {first}")
    pool = torch.randperm(span, generator=generator) + low
    if taken:
        pool = pool[~torch.isin(pool, torch.tensor(taken, dtype=torch.int64))]
    rest = n - len(first)
    if rest > pool.numel() and low >= 0:
        raise ValueError(f"{n} distinct values do not fit in [{low}, {high})")
    v = torch.full((rest,), low, dtype=torch.int64)
    take = min(rest, pool.numel())
    v[:take] = pool[:take]
    v = v[torch.randperm(rest, generator=generator)]
    return torch.cat([torch.tensor(first, dtype=torch.int64), v]).reshape(tuple(shape))


def workload(m: OpManifest, case: Case, dtype: str, device: torch.device | str = "cpu", shrink: bool = False,
             generator: torch.Generator | None = None) -> Workload:
    params = op_params(m, case_params(m, case))
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
