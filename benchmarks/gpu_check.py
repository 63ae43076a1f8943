"""On a GPU: every op x case x dtype against the float64 reference, plus emitted-source facts.

    python -m benchmarks.gpu_check
"""

from __future__ import annotations

import sys

import torch

from tileops.cli import TOLERANCES
from tileops.manifest import registry
from tileops.rope.reference import reference
from tileops.workloads import op_class, workload


def main() -> int:
    bad = 0
    for m in registry().values():
        for case in m.cases:
            for dtype in case.dtypes:
                w = workload(m, case, dtype, "cuda")
                op = op_class(m.name)(**w.params)
                out = op(**w.inputs)
                ref = reference(op, w.inputs)
                got = out.cpu().double()
                atol, rtol = TOLERANCES[dtype]
                err = (got - ref).abs()
                ok = bool(torch.isfinite(got).all()) and bool((err <= atol + rtol * ref.abs()).all())
                bad += not ok
                print(f"{'ok ' if ok else 'BAD'} {m.name:26} {case.label:20} {dtype:9} max err {err.max().item():.2e}")
    print(f"{bad} mismatched")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
