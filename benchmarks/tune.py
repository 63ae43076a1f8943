"""Sweep the CUDA schedule of the RoPE kernel (threads, head lanes, tokens per thread, head unroll) on a GPU.

    python -m benchmarks.tune [--quick]

Kernels are compiled in a process pool first (each lands in TileLang's disk cache), then loaded
and timed here with CUDA events over rotated input sets (``benchmarks/timing.py``). Prints, per workload, every
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

from tileops.compile import build
from tileops.kernels import report
from tileops.kernels.rope import RoPEKernelSpec
from tileops.compile.entry import raw_kernel
from tileops.rope.tables import RoPETables

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

# q and k of HF's [B, H, S, D] layout rotated in one launch through transposed views, in place:
# (name, dtype, B, S, H, HK, D)
HF_WORKLOADS = [
    ("hf-qk-8k", "bfloat16", 1, 8192, 32, 8, 128),
    ("hf-qk-fp32-8k", "float32", 1, 8192, 32, 32, 128),
    ("hf-qk-fp32-2k", "float32", 2, 2048, 32, 32, 128),
    ("hf-qk-fp32-small", "float32", 4, 256, 8, 8, 64),
    ("hf-qk-decode", "bfloat16", 1, 32, 32, 8, 128),
]


def configs(layout: str, quick: bool):
    if layout == "hf":
        return [dict(threads=t, head_lanes=h, tokens_per_thread=k) for t, h, k in
                itertools.product((128, 256, 512), (1, 2, 4, 8, 16), (1,) if quick else (1, 2))
                if t >= 8 * h]
    if layout == "1d":  # head_unroll 0 (nvcc unrolls the one-head loop) against 1 (kept rolled): kernel v7
        return [dict(threads=t, head_lanes=1, tokens_per_thread=k, head_unroll=u) for t, k, u in
                itertools.product((128, 256), (2, 4) if quick else (2, 4, 8), (0, 1))]
    return [dict(threads=t, head_lanes=h, tokens_per_thread=k) for t, h, k in
            itertools.product((128,) if quick else (128, 256, 512), (4, 8) if quick else (2, 4, 8), (1, 2))]


def spec_of(w, cfg) -> RoPEKernelSpec:
    _, dtype, _, _, _, _, D, rot, pairing, positions = w
    return RoPEKernelSpec(dtype=dtype, head_dim=D, rot=rot, pairing=pairing, positions=positions,
                          backend="cuda", **cfg)


def hf_spec(w, cfg) -> RoPEKernelSpec:
    _, dtype, _, _, _, _, D = w
    return RoPEKernelSpec(dtype=dtype, head_dim=D, rot=D, pairing="neox", positions=None, backend="cuda", **cfg)


def _compile(spec: RoPEKernelSpec) -> str:
    build.compile_kernel("rope", spec, "cuda", "sm_90")
    return str(spec)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", help="comma-separated workload names")
    args = p.parse_args()
    want = args.only.split(",") if args.only else None
    wl = [w for w in WORKLOADS if not want or w[0] in want]
    hf = [w for w in HF_WORKLOADS if not want or w[0] in want]
    specs = {spec_of(w, c) for w in wl for c in configs(w[2], args.quick)}
    specs |= {hf_spec(w, c) for w in hf for c in configs("hf", args.quick)}
    specs = sorted(specs, key=str)
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
        td = RoPETables(inv, 1.0).on(dev)
        nbytes = 2 * x.numel() * x.element_size()
        extra = {}
        if positions:
            pos = torch.randint(0, 8192, (S,), device=dev)
            err = torch.zeros(report.ENTRY, dtype=torch.int32, device=dev)  # a call's error entry
            extra = dict(P=pos.data_ptr(), ERR=err.data_ptr(), psb=0, pss=1, limit=8192, tag=1, NP=S)
            nbytes += pos.numel() * 8
        results = []
        for cfg in configs(layout, args.quick):
            spec = spec_of(w, cfg)
            k = raw_kernel(build.compile_kernel("rope", spec, "cuda", "sm_90"), dev, spec.args)
            u = spec.stride_unit
            st = [v // u for v in (S * H * D, H * D, D)]  # contiguous [B, S, H, D], in units of u

            def launch(i, k=k, st=st):
                k(*k.bind(**dict.fromkeys(k.arg_names, 0) | dict(  # what a call does not set is 0
                    X=xs[i].data_ptr(), Y=ys[i].data_ptr(), K=xs[i].data_ptr(), KY=ys[i].data_ptr(),
                    TD=td.data_ptr(), B=B, S=S, H=H, HK=0, xsb=st[0], xss=st[1], xsh=st[2], ysb=st[0],
                    yss=st[1], ysh=st[2], **extra)))

            t = gpu_time(launch, n)[0] * 1e-6
            results.append((t, cfg))
        results.sort(key=lambda r: r[0])
        floor = nbytes / rate
        print(f"\n{name} {dtype} {tuple(x.shape)}: {nbytes / 1e6:.1f} MB, floor {floor * 1e6:.1f} us")
        for t, cfg in results:
            print(f"  {t * 1e6:8.1f} us  {100 * floor / t:5.1f}% copy  {cfg}")
    for w in hf:
        tune_hf(w, args.quick, rate)
    return 0


def tune_hf(w, quick: bool, rate: float) -> None:
    """Time every schedule on q and k of HF's layout, rotated in place through transposed views,
    against a same-bytes copy timed here too."""
    from .timing import gpu_time, rotation, same_bytes_copy_us

    name, dtype, B, S, H, HK, D = w
    dev = torch.device("cuda")
    dt = getattr(torch, dtype)
    one = B * S * (H + HK) * D * dt.itemsize * 2
    n = rotation(one)
    qs = [torch.randn(B, H, S, D, device=dev).to(dt) for _ in range(n)]
    ks = [torch.randn(B, HK, S, D, device=dev).to(dt) for _ in range(n)]
    inv = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    td = RoPETables(inv, 1.0).on(dev)
    floor = one / rate
    copy = same_bytes_copy_us(one)
    results = []
    for cfg in configs("hf", quick):
        spec = hf_spec(w, cfg)
        k = raw_kernel(build.compile_kernel("rope", spec, "cuda", "sm_90"), dev, spec.args)
        u = spec.stride_unit
        # [B, H, S, D] seen as [B, S, H, D]: batch, token and head strides, in units of u
        qst = [v // u for v in (H * S * D, D, S * D)]
        kst = [v // u for v in (HK * S * D, D, S * D)]

        def launch(i, k=k, qst=qst, kst=kst):
            q, kk = qs[i].data_ptr(), ks[i].data_ptr()
            k(*k.bind(**dict.fromkeys(k.arg_names, 0) | dict(
                X=q, Y=q, K=kk, KY=kk, TD=td.data_ptr(), B=B, S=S, H=H, HK=HK,
                xsb=qst[0], xss=qst[1], xsh=qst[2], ysb=qst[0], yss=qst[1], ysh=qst[2],
                ksb=kst[0], kss=kst[1], ksh=kst[2], kysb=kst[0], kyss=kst[1], kysh=kst[2])))

        results.append((gpu_time(launch, n)[0], cfg))
    results.sort(key=lambda r: r[0])
    print(f"\n{name} {dtype} q [{B}, {H}, {S}, {D}] k [{B}, {HK}, {S}, {D}] in place: {one / 1e6:.1f} MB, "
          f"floor {floor * 1e6:.1f} us, same-bytes copy {copy:.1f} us")
    for t, cfg in results:
        print(f"  {t:8.1f} us  {100 * floor * 1e6 / t:5.1f}% copy  {100 * copy / t:5.1f}% same-bytes  {cfg}")


if __name__ == "__main__":
    sys.exit(main())
