"""Host time of one call of the custom op a compiled graph makes: ``python -m benchmarks.library_call [--device cpu|cuda]``.

A patched model under ``torch.compile`` calls ``torch.ops.tileops.apply.default(handle, inputs,
names)`` once per layer and step (:mod:`tileops.runtime.library`). This times that call from Python
for a signature the op has served before (q alone and q+k with positions, new outputs), beside
aten ops called the same way (``torch.ops.aten.mul.Tensor``) and as methods: issue 21 measured
112 us per call for the Python custom op on the H200's host, against about 7 us for the eager
native call. Each contender: the median over rounds of the best of three windows of calls.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

import tileops
from tileops.rope import RoPEFwdOp

from .host import window_us


def rows(device: torch.device, rounds: int = 7, calls: int = 2000) -> list[tuple[str, float]]:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    op = RoPEFwdOp(input_layout="2d")
    q = torch.randn(1, 1, 2, 128, device=device)
    k = torch.randn(1, 1, 1, 128, device=device)
    pos = torch.zeros(1, dtype=torch.int64, device=device)
    h = op._handle
    apply = torch.ops.tileops.apply.default
    with torch.no_grad():
        op(q), op(q, position_ids=pos, key=k)  # the signatures a compiled graph's calls will have
        fns = {"tileops::apply, q alone": lambda: apply(h, [q], "x"),
               "tileops::apply, q+k with positions": lambda: apply(h, [q, pos, k], "x,position_ids,key"),
               "torch.ops.aten.mul.Tensor(q, q)": lambda: torch.ops.aten.mul.Tensor(q, q),
               "q.mul(2.0)": lambda: q.mul(2.0),
               "eager op(q)": lambda: op(q)}
        for fn in fns.values():
            fn()
        times: dict[str, list[float]] = {}
        for _ in range(rounds):
            for name, fn in fns.items():
                times.setdefault(name, []).append(window_us(fn, sync, calls))
    return [(name, statistics.median(t)) for name, t in times.items()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.library_call")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    native = getattr(tileops.runtime, "native", None)
    print(f"host us per call on {device} (native runtime: {native.status() if native else '?'}; medians):")
    for name, us in rows(device):
        print(f"{us:8.2f} us  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
