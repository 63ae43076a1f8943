"""Where the host time of one call goes: ``python -m benchmarks.hostprof [--device cpu|cuda] [--profile]``.

Prints what each layer between ``op(...)`` and the launch costs (``benchmarks/host.py``: the full
call, ``forward``, ``Op._call`` with the argument dicts built outside, the native dispatch alone,
and on the Python runtime ``Op._eager_call``), beside the bare torch ops; with ``--profile``, a
cProfile of many Python-runtime calls (the profiler inflates Python-level costs: read it for the
distribution, not the totals)."""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys

import torch

from . import host


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.hostprof")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None)
    p.add_argument("--profile", action="store_true", help="also a cProfile of the Python path's calls")
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    print(f"host time per call on {device} ({host.SIZES[device.type]}; native: "
          f"{'yes' if host.native_available() else 'no'}, medians):")
    for name, us in host.layers(device):
        print(f"{us:8.2f} us  {name}")
    if args.profile:
        specs, _, _ = host.cases(device)
        for name, make, _ in specs[:2]:
            fn = make(host.on_python)
            fn()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(5000):
                fn()
            prof.disable()
            if device.type == "cuda":
                torch.cuda.synchronize()
            print(f"--- {name} (Python runtime): cProfile of 5000 calls")
            pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    return 0


if __name__ == "__main__":
    sys.exit(main())
