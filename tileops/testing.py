"""The generated test matrix: every manifest case x dtype x target, as plain data.

``tests/test_generated.py`` parametrizes over :func:`generated_cases` and ``tileops coverage``
counts the same list, so the coverage table can never disagree with what the tests run. Adding a
manifest (or a case, or a dtype to a case) adds items here with no new test code.

    >>> from tileops.manifest import registry
    >>> from tileops.testing import generated_cases
    >>> [c.id for c in generated_cases({"RoPEFwdOp": registry()["RoPEFwdOp"]})][:2]
    ['RoPEFwdOp[neox-2d-2k-fp16-cpu]', 'RoPEFwdOp[neox-2d-2k-fp16-torch]']
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .manifest import OpManifest
from .tolerances import TOLERANCES, tolerance
from .workloads import SHORT

__all__ = ["COLUMNS", "GeneratedCase", "generated_cases", "runnable_columns", "TOLERANCES", "tolerance"]

#: column -> (target name, device, id suffix). A column is one way of running a case: the BUILTIN
#: TileLang kernels on the CPU (C backend) or on a GPU, or the plain-PyTorch "torch" target.
COLUMNS: dict[str, tuple[str, str, str]] = {
    "builtin-cpu": ("builtin", "cpu", "cpu"),
    "torch": ("torch", "cpu", "torch"),
    "builtin-cuda": ("builtin", "cuda", "cuda"),
}


@dataclass(frozen=True)
class GeneratedCase:
    """One generated test: run case ``case`` of op ``op`` in ``dtype`` through one column."""

    op: str
    case: str
    dtype: str
    column: str
    backward: bool = False  # the gradient of the manifest's ``backward.wrt`` instead of the output

    @property
    def target(self) -> str:
        return COLUMNS[self.column][0]

    @property
    def device(self) -> str:
        return COLUMNS[self.column][1]

    @property
    def param_id(self) -> str:
        """The id within the op: ``neox-2d-2k-bf16-cpu`` (``...-cpu-bwd`` for the backward)."""
        bwd = "-bwd" if self.backward else ""
        return f"{self.case}-{SHORT.get(self.dtype, self.dtype)}-{COLUMNS[self.column][2]}{bwd}"

    @property
    def id(self) -> str:
        """The full readable id: ``RoPEFwdOp[neox-2d-2k-bf16-cpu]``."""
        return f"{self.op}[{self.param_id}]"

    @property
    def marks(self) -> tuple[str, ...]:
        """pytest marker names: GPU items carry ``cuda`` so they skip on machines without one."""
        return ("cuda",) if self.device == "cuda" else ()

    @property
    def shrink(self) -> bool:
        """Whether the case is scaled down by the manifest's ``cpu_shrink`` rule (CPU only)."""
        return self.device == "cpu"


def generated_cases(registry: Mapping[str, OpManifest],
                    columns: Iterable[str] = tuple(COLUMNS)) -> list[GeneratedCase]:
    """Every (op, case, dtype, column) of ``registry``, in manifest order, and the same again for
    the backward of ops whose manifest declares one; ids are unique."""
    columns = tuple(columns)
    unknown = [c for c in columns if c not in COLUMNS]
    if unknown:
        raise ValueError(f"columns: unknown {', '.join(map(repr, unknown))}; known: {', '.join(COLUMNS)}")
    out = [GeneratedCase(name, case.label, dtype, col, bwd)
           for name, m in registry.items() for bwd in ((False, True) if m.backward else (False,))
           for case in m.cases for dtype in case.dtypes for col in columns]
    seen: set[str] = set()
    for c in out:  # labels are unique per op (the loader checks), so this guards the id format itself
        if c.id in seen:
            raise ValueError(f"two generated tests share the id {c.id!r}")
        seen.add(c.id)
    return out


def runnable_columns() -> tuple[str, ...]:
    """The columns that can run on this machine (``builtin-cuda`` needs a GPU)."""
    import torch

    return tuple(c for c in COLUMNS if COLUMNS[c][1] != "cuda" or torch.cuda.is_available())
