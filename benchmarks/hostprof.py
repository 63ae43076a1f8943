"""Where the host time of one call goes, on a GPU (idle): ``python -m benchmarks.hostprof``."""

from __future__ import annotations

import time

import torch

from tileops.rope import RoPEFwdOp, RoPENeoxPositionIdsFwdOp


def per_call_us(fn, n: int = 3000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n // 5):
            fn()
        best = min(best, (time.perf_counter() - t0) / (n // 5))
    torch.cuda.synchronize()
    return best * 1e6


def main() -> None:
    x = torch.randn(4, 256, 8, 64, device="cuda")
    op = RoPEFwdOp(input_layout="2d")
    op(x)
    impl = next(iter(op._impls.values()))
    out = torch.empty_like(x)
    rows = [
        ("op(x)", lambda: op(x)),
        ("impl(x=x) (no signature check)", lambda: impl(x=x)),
        ("torch.empty_like(x)", lambda: torch.empty_like(x)),
        ("x.add(1.0) (a torch kernel)", lambda: x.add(1.0)),
        ("out.copy_(x)", lambda: out.copy_(x)),
    ]
    ids = RoPENeoxPositionIdsFwdOp(8192)
    xi = torch.randn(32, 32, 128, device="cuda", dtype=torch.float16)
    pos = torch.randint(0, 8192, (32,), device="cuda")
    ids(xi, pos)
    rows += [("ids op(x, pos) (reads the flag)", lambda: ids(xi, pos)),
             ("flag read alone: t.item()", lambda: pos[0].item())]
    for name, fn in rows:
        print(f"{per_call_us(fn):8.2f} us  {name}")


if __name__ == "__main__":
    main()
