"""A manifest's cases as calls: the params and dims of one case, and the call specializations
(:class:`tileops.manifest.call.CallSpec`) that calls with given dims and dtypes make.

What ``tileops warmup`` and ``op.compile`` compile ahead, the workloads (:mod:`tileops.workloads`)
the tests and benchmarks run, and the demo all read cases through here, so a case means the same
thing everywhere.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Iterable, Mapping

import torch

from .call import CallSpec
from .schema import LEAD, Case, OpManifest, TensorSpec

__all__ = ["case_params", "case_dims", "passes", "index_dtype", "call_specs", "tensor_shape"]


def case_params(m: OpManifest, case: Case) -> dict[str, Any]:
    """The op's params for ``case``: the manifest's defaults, then the case's own."""
    return m.defaults() | dict(case.params)


def passes(t: TensorSpec, case: Case | None, every: bool = False) -> bool:
    """Whether a call of ``case`` passes input ``t``: every required one, and the optional ones the
    case lists under ``with`` (all of them with ``every``)."""
    return every or not t.optional or (case is not None and t.name in case.with_inputs)


def tensor_shape(t: TensorSpec, params: Mapping[str, Any], dims: Mapping[str, Any]) -> list[int]:
    """The sizes of input ``t`` for ``params`` and ``dims`` (dim name -> size); a leading ``"..."``
    takes the sizes ``dims["..."]`` holds (none when absent)."""
    out: list[int] = []
    for d in t.shape_for(params):
        out += list(dims.get(LEAD, ())) if d == LEAD else [dims[d]]
    return out


def case_dims(m: OpManifest, case: Case, shrink: bool = False) -> dict[str, Any]:
    """The case's dims, and under ``"..."`` its ``lead`` (a tuple) when an input takes leading dims;
    with ``shrink``, halved along ``cpu_shrink.dims`` (``"..."``: the largest leading dim) until the
    largest input fits."""
    dims: dict[str, Any] = dict(case.dims)
    if any(t.leading for t in m.inputs):
        dims[LEAD] = tuple(case.lead)
    if not shrink or m.cpu_shrink is None:
        return dims
    params = case_params(m, case)

    def elements() -> int:
        return max(math.prod(tensor_shape(t, params, dims)) for t in m.inputs if passes(t, case))

    def size(d: str) -> int:
        return max(dims.get(LEAD, ()), default=1) if d == LEAD else dims.get(d, 1)

    order = list(m.cpu_shrink.dims)
    while elements() > m.cpu_shrink.max_elements and any(size(d) > 1 for d in order):
        d = max((d for d in order if size(d) > 1), key=size)
        if d == LEAD:
            lead = list(dims[LEAD])
            i = lead.index(max(lead))
            lead[i] = max(1, lead[i] // 2)
            dims[LEAD] = tuple(lead)
        else:
            dims[d] = max(1, dims[d] // 2)
    return dims


def index_dtype(t: TensorSpec) -> str:
    """The dtype a case gives an integer input: int64 where allowed, else its first dtype."""
    return "int64" if "int64" in t.dtypes else t.dtypes[0]


def call_specs(m: OpManifest, dims: Mapping[str, int], dtypes: Iterable[str], device: torch.device,
               with_inputs: Iterable[str] | None = None, every_index_dtype: bool = False,
               params: Mapping[str, Any] | None = None) -> list[CallSpec]:
    """The call specializations of calls on ``device`` with ``dims`` (at least those the manifest's
    ``kernel.specialize`` names) in each of ``dtypes`` (the floating inputs' dtype). Optional inputs
    are the ``with_inputs`` given, or (None) every combination of present and absent; integer inputs
    take :func:`index_dtype`, or each of their dtypes with ``every_index_dtype``. In manifest order,
    without duplicates."""
    static = tuple(sorted((d, dims[d]) for d in m.kernel.specialize))
    optional = [t.name for t in m.inputs if t.optional]
    if with_inputs is not None:
        present_sets = [set(with_inputs)]
    else:
        present_sets = [{n for n, on in zip(optional, bits) if on}
                        for bits in itertools.product((False, True), repeat=len(optional))]
    out: list[CallSpec] = []
    for dtype in dtypes:
        for present in present_sets:
            given = [t for t in m.inputs if not t.optional or t.name in present]
            choices = [[(t.name, d) for d in (t.dtypes if every_index_dtype else [index_dtype(t)])]
                       if t.range is not None else [(t.name, t.case_dtype(dtype, params or {}))] for t in given]
            out += [CallSpec(device, tuple(combo), static) for combo in itertools.product(*choices)]
    return list(dict.fromkeys(out))
