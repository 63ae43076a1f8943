"""Sweep the CUDA schedule of the RoPE kernel (threads, head lanes, tokens per thread) on a GPU.

    python -m benchmarks.tune [--quick]

Kernels are compiled in a process pool first (each lands in TileLang's disk cache), then loaded
and timed here with ``triton.testing.do_bench`` (median, L2 flushed). Prints, per workload, every
configuration's time and the best; the chosen static values go into the manifests.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import torch

from tileops import generate
from tileops.kernels.rope import LO, RopeKernelSpec
from tileops.launch import raw_kernel
from tileops.rope.tables import RopeTables

# (name, dtype, layout, B, S, H, D, rot, pairing, positions)
WORKLOADS = [
    ("neox-2d-2k", "float16", "2d", 2, 2048, 32, 128, 128, "neox", None),
    ("interleaved-2d-2k", "bfloat16", "2d", 2, 2048, 32, 128, 128, "interleaved", None),
    ("neox-2d-32k", "bfloat16", "2d", 1, 32768, 32, 128, 128, "neox", None),
    ("neox-2d-small", "float32", "2d", 4, 256, 8, 64, 64, "neox", None),
    ("neox-1d-256k", "float16", "1d", 1, 262144, 1, 128, 128, "neox", None),
    ("neox-1d-8k", "bfloat16", "1d", 1, 8192, 1, 128, 128, "neox", None),
    ("ids-4k", "bfloat16", "ids", 1, 4096, 32, 128, 128, "neox", "int64"),
    ("ids-partial-4k", "float16", "ids", 1, 4096, 32, 128, 64, "neox", "int64"),
    ("ids-decode", "float16", "ids", 1, 32, 32, 128, 128, "neox", "int64"),
]


def configs(layout: str, quick: bool):
    if layout == "1d":
        return [dict(threads=t, head_lanes=1, tokens_per_thread=k, blocks_per_sm=g) for t, k, g in
                itertools.product((128, 256), (4, 8), (0, 8))]
    if layout == "ids":
        return [dict(threads=128, head_lanes=8, tokens_per_thread=k, blocks_per_sm=g) for k, g in
                itertools.product((1, 2), (0, 8))]
    return [dict(threads=128, head_lanes=8, tokens_per_thread=k, blocks_per_sm=g) for k, g in
            itertools.product((1, 2), (0, 8, 16))]


def spec_of(w, cfg) -> RopeKernelSpec:
    _, dtype, _, _, _, _, D, rot, pairing, positions = w
    return RopeKernelSpec(dtype=dtype, head_dim=D, rot=rot, pairing=pairing, positions=positions,
                          backend="cuda", **cfg)


def _compile(spec: RopeKernelSpec) -> str:
    generate.compile_kernel("rope", spec, "cuda", "sm_90")
    return str(spec)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", help="comma-separated workload names")
    args = p.parse_args()
    wl = [w for w in WORKLOADS if not args.only or w[0] in args.only.split(",")]
    specs = sorted({spec_of(w, c) for w in wl for c in configs(w[2], args.quick)}, key=str)
    print(f"compiling {len(specs)} kernels", flush=True)
    with ProcessPoolExecutor(max_workers=min(12, os.cpu_count() or 4)) as pool:
        list(pool.map(_compile, specs))
    from .timing import copy_rate, gpu_time, rotation

    dev = torch.device("cuda")
    rate = copy_rate() * 1e9
    print(f"copy rate {rate / 1e9:.0f} GB/s")
    for w in wl:
        name, dtype, layout, B, S, H, D, rot, pairing, positions = w
        one = B * S * H * D * torch.tensor([], dtype=getattr(torch, dtype)).element_size() * 2
        n = rotation(one)
        xs = [torch.randn(B, S, H, D, device=dev).to(getattr(torch, dtype)) for _ in range(n)]
        ys = [torch.empty_like(x) for x in xs]
        x = xs[0]
        inv = 10000.0 ** (-torch.arange(0, rot, 2, dtype=torch.float64) / rot)
        tabs = RopeTables(inv, 1.0, LO)
        nbytes = 2 * x.numel() * x.element_size()
        extra = ()
        if positions:
            pos = torch.randint(0, 8192, (S,), device=dev)
            err = torch.zeros(1, dtype=torch.int32, device=dev)
            extra = (pos.data_ptr(), err.data_ptr(), 8192)
            nbytes += pos.numel() * 8
        th, tl = tabs.high(dev, 8192 if positions else S), tabs.low(dev)
        results = []
        for cfg in configs(layout, args.quick):
            k = raw_kernel(generate.compile_kernel("rope", spec_of(w, cfg), "cuda", "sm_90"), dev)
            tp, lp, nh = th.data_ptr(), tl.data_ptr(), th.shape[0]
            spec = spec_of(w, cfg)
            g = ()
            if spec.blocks_per_sm:
                sms = torch.cuda.get_device_properties(dev).multi_processor_count
                g = (max(1, min(-(-S // spec.group), sms * spec.blocks_per_sm // B)),)
            t = gpu_time(lambda i: k(xs[i].data_ptr(), ys[i].data_ptr(), tp, lp, *extra, *g, B, S, H, nh), n)[0] * 1e-6
            results.append((t, cfg))
        results.sort(key=lambda r: r[0])
        floor = nbytes / rate
        print(f"\n{name} {dtype} {tuple(x.shape)}: {nbytes / 1e6:.1f} MB, floor {floor * 1e6:.1f} us")
        for t, cfg in results:
            print(f"  {t * 1e6:8.1f} us  {100 * floor / t:5.1f}% copy  {cfg}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
