"""Where the host time of one call goes, on a GPU (idle): ``python -m benchmarks.hostprof``.

Prints each serving call's host time beside a bare torch op, then a cProfile of many calls (the
profiler inflates Python-level costs; read it for the distribution, not the totals)."""

from __future__ import annotations

import cProfile
import pstats
import sys

import torch

from tileops.rope import RoPEFwdOp, RoPENeoxPositionIdsFwdOp

from .runner import host_time_us


def main() -> None:
    dt = torch.bfloat16
    ids = RoPENeoxPositionIdsFwdOp(1 << 20)
    q = torch.randn(32, 32, 128, device="cuda", dtype=dt)
    k = torch.randn(32, 8, 128, device="cuda", dtype=dt)
    pos = torch.randint(0, 1 << 20, (32,), device="cuda")
    hf = RoPEFwdOp(input_layout="2d")
    x = torch.randn(32, 32, 128, device="cuda", dtype=dt)
    cases = {
        "ids q+k in place": lambda: ids(q, pos, key=k, out=q, key_out=k),
        "ids q new": lambda: ids(q, pos),
        "2d q new": lambda: hf(q[None]),
        "x.add_(1.0)": lambda: x.add_(1.0),
        "x.mul(2.0)": lambda: x.mul(2.0),
    }
    for name, fn in cases.items():
        fn()
        print(f"{host_time_us(fn):8.2f} us  {name}")
    which = sys.argv[1:] or ["ids q+k in place", "2d q new"]
    for name in which:
        fn = cases[name]
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(5000):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        print(f"--- {name}: cProfile of 5000 calls")
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
