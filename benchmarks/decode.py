"""Paged decode attention (``PagedAttnDecodeFwdOp``) against a copy of the KV bytes and SDPA over a
contiguous cache, side by side in one process (issue 37's table).

    python -m benchmarks.decode [--rows 0,1] [--block-sizes 16,1] [--no-fp8] [--no-sdpa]
    python -m benchmarks.decode --sweep 128x2,128x2x1,128x2x0x2 --rows 1,3   # THREADSxUNROLL[xPREFETCH[xSTAGES]]
    python -m benchmarks.decode --sweep 128x2x0x1,128m64,128m32 --rows 1,3    # THREADSmTILE: tensor cores
    python -m benchmarks.decode --splits 264:256,528:128,1056:64 --rows 1,3  # PROGRAMS:MIN_TOKENS
    python -m benchmarks.decode --kernels --rows 3   # each kernel's time in a call replayed from a graph

Rows: bf16, GQA 32/8, head_dim 128, one query token a sequence, ``batch x context`` tokens in the
cache. Columns, medians in us (``benchmarks.timing.gpu_time``: back-to-back calls between events, the
host queued ahead): a device copy moving the KV bytes (half read, half written: the floor), ours on a
paged NHD cache of shuffled blocks (eager, and a call replayed from a CUDA graph), ours on a float8
cache (against its own halved bytes), and SDPA's cuDNN and flash kernels on a contiguous
``[batch, Hkv, context, D]`` cache. Inputs rotate through enough copies that a small row is not served
from L2. A sweep's schedules also give their largest error against a float32 reference of the first
input set (every schedule must agree to the output's bf16 rounding). Needs a GPU; a sweep's kernels can
be compiled off it first (``python -m benchmarks.device_cache --decode-sweep ...``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import statistics
import sys

import torch

from benchmarks.timing import captured, gpu_time, graph_us_per_call, rotation, same_bytes_copy_us

ROWS = [(64, 1024), (64, 4096), (8, 32768), (1, 4096)]
HQ, HKV, D = 32, 8, 128


def _paged(batch: int, ctx: int, bs: int, dtype, gen) -> dict:
    per = math.ceil(ctx / bs)
    blocks = batch * per
    kc = torch.randn(blocks, bs, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    vc = torch.randn_like(kc)
    if dtype == torch.float8_e4m3fn:
        kc, vc = kc.to(dtype), vc.to(dtype)
    order = torch.randperm(blocks, device="cuda", generator=gen).to(torch.int32)
    return {"q": torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen),
            "key_cache": kc, "value_cache": vc, "block_tables": order.view(batch, per),
            "seq_lens": torch.full((batch,), ctx, dtype=torch.int32, device="cuda")}


def _reference(s: dict, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """The decode of one input set in float32 from the definition: each sequence's keys gathered through
    its block table (a float8 cache's times its scales), softmax(q k^T / sqrt(D)) v, GQA by repeating the
    kv heads."""
    batch, per = s["block_tables"].shape
    k = s["key_cache"][s["block_tables"].long()].float().reshape(batch, -1, HKV, D) * k_scale  # [B, ctx, Hkv, D]
    v = s["value_cache"][s["block_tables"].long()].float().reshape(batch, -1, HKV, D) * v_scale
    k, v = k.repeat_interleave(HQ // HKV, dim=2), v.repeat_interleave(HQ // HKV, dim=2)
    w = torch.einsum("bhd,bthd->bht", s["q"].float(), k) / math.sqrt(D)
    return torch.einsum("bht,bthd->bhd", w.softmax(-1), v)


def with_schedule(op, static: dict | None):
    """``op`` with its manifest's CUDA schedule updated by ``static`` (an op reads its own manifest
    object: a copy with another ``kernel.static``)."""
    if static:
        kernel = dataclasses.replace(op.manifest.kernel, static={**op.manifest.kernel.static, **static})
        op.manifest = dataclasses.replace(op.manifest, kernel=kernel)
    return op


def schedule_specs(static: dict) -> list[tuple]:
    """The kernel jobs (builder, spec, backend, arch) a sweep's schedule ``static`` makes the op build for
    this benchmark's rows on sm_90, bf16 q on a bf16 and a float8 cache (``benchmarks.device_cache
    --decode-sweep``): the op's own ``kernel_specs``, as a call would make them."""
    from tileops.attention import PagedAttnDecodeFwdOp
    from tileops.attention.decode_builtin import kernel_specs
    from tileops.manifest import call_specs

    dims = {"q_dim": D, "q_heads": HQ, "cache_heads": HKV}
    jobs = []
    for cache, given in ((None, ()), (torch.float8_e4m3fn, ("k_scale", "v_scale"))):  # the table's two caches
        op = with_schedule(PagedAttnDecodeFwdOp(HQ, HKV, D, cache_dtype=cache), static)
        jobs += [(b, spec, "cuda", "sm_90")
                 for call in call_specs(op.manifest, dims, ["bfloat16"], torch.device("cuda"), given, params=op.params)
                 for b, spec in kernel_specs(op.manifest, op.params, call, "cuda")]
    return list(dict.fromkeys(jobs))


def parse_sweep(text: str) -> list[dict]:
    """``--sweep``'s schedules, comma-separated: THREADSxUNROLL[xPREFETCH[xSTAGES]] (CUDA cores), or
    THREADSmTILE[pPREFETCH][wWIDEN][bMIN_BLOCKS] (tensor cores, ``mma``: tokens a tile; p1: the next tile's
    rows loaded during this tile's products; w1: a float8 cache widened eight elements at a time; b3: three
    programs an SM asked of nvcc, ``__launch_bounds__``, and aimed at by the split rule). A float8 cache
    read one element at a time takes tiles of 64 without the prefetch whatever the sweep says
    (``decode_builtin._MMA_NARROW``); widened, tiles of 64 and the sweep's prefetch
    (``_MMA_FLOAT8_WIDENED``)."""
    keys = ("threads", "unroll", "prefetch", "stages")
    configs = []
    for c in text.split(","):
        if "m" in c:
            m = re.fullmatch(r"(\d+)m(\d+)(?:p([01]))?(?:w([01]))?(?:b([1-8]))?", c)
            if not m:
                raise SystemExit(f"--sweep: expected THREADSmTILE[pPREFETCH][wWIDEN][bMIN_BLOCKS] (integers), "
                                 f"got {c!r}")
            configs.append({"threads": int(m[1]), "mma": 1, "tile": int(m[2]), "prefetch": int(m[3] or 0),
                            **({"widen": int(m[4])} if m[4] else {}), **({"min_blocks": int(m[5])} if m[5] else {})})
            continue
        parts = c.split("x")
        if not 2 <= len(parts) <= 4 or not all(p.isdigit() for p in parts):
            raise SystemExit(f"--sweep: expected THREADSxUNROLL[xPREFETCH[xSTAGES]] or THREADSmTILE (integers), "
                             f"got {c!r}")
        configs.append(dict(zip(keys, map(int, parts))))
    return configs


def _scales() -> dict:
    """The float8 cache's per-tensor scales (k, v) every row here calls with."""
    return {"k_scale": torch.tensor([0.02], device="cuda"), "v_scale": torch.tensor([0.5], device="cuda")}


def _op(dtype, static: dict | None = None) -> tuple:
    """The op over a ``dtype`` cache with the manifest's schedule updated by ``static``, and the scales its
    calls take (none for a bf16 cache)."""
    from tileops.attention import PagedAttnDecodeFwdOp

    fp8 = dtype == torch.float8_e4m3fn
    op = with_schedule(PagedAttnDecodeFwdOp(HQ, HKV, D, cache_dtype=dtype if fp8 else None), static)
    return op, (_scales() if fp8 else {})


def _ours(batch: int, ctx: int, bs: int, dtype, gen, static: dict | None = None,
          checked: list | None = None) -> tuple[float, float]:
    """Eager and graph medians of the op on ``batch x ctx``; with ``checked``, the largest error of the
    first set's output against :func:`_reference` is appended to it."""
    fp8 = dtype == torch.float8_e4m3fn
    op, extra = _op(dtype, static)
    kv = 2 * batch * ctx * HKV * D * (1 if fp8 else 2)
    sets = [_paged(batch, ctx, bs, dtype, gen) for _ in range(rotation(kv))]
    outs = [torch.empty_like(s["q"]) for s in sets]
    eager = gpu_time(lambda i: op(**sets[i], **extra, out=outs[i]), len(sets))[0]
    graph = graph_us_per_call(lambda: op(**sets[0], **extra, out=outs[0]), calls=20)
    op.check()
    if checked is not None:
        outs[0].fill_(float("nan"))
        op(**sets[0], **extra, out=outs[0])
        want = _reference(sets[0], *(float(extra[n]) for n in ("k_scale", "v_scale"))) if fp8 else _reference(sets[0])
        checked.append(float((outs[0].float() - want).abs().max()))
    return eager, graph


def _sdpa(batch: int, ctx: int, backend) -> float:
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    kv = 2 * batch * ctx * HKV * D * 2
    sets = [(torch.randn(batch, HQ, 1, D, device="cuda", dtype=torch.bfloat16),
             torch.randn(batch, HKV, ctx, D, device="cuda", dtype=torch.bfloat16),
             torch.randn(batch, HKV, ctx, D, device="cuda", dtype=torch.bfloat16)) for _ in range(rotation(kv))]
    try:
        with sdpa_kernel(backend):
            return gpu_time(lambda i: sdpa(*sets[i], enable_gqa=True), len(sets))[0]
    except RuntimeError as e:  # a backend that refuses the shape
        print(f"  ({backend}: {str(e).splitlines()[0][:80]})", file=sys.stderr)
        return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="", help="comma-separated row indices (default: all)")
    ap.add_argument("--block-sizes", default="16,1")
    ap.add_argument("--no-fp8", action="store_true")
    ap.add_argument("--no-sdpa", action="store_true")
    ap.add_argument("--sweep-cache", choices=("bf16", "fp8"), default="bf16",
                    help="the cache a --sweep reads: bf16, or float8 e4m3fn with scales (its copy: the halved bytes)")
    ap.add_argument("--sweep", default="", help="THREADSxUNROLL[xPREFETCH[xSTAGES]] or THREADSmTILE[pP][wW][bB] "
                                                "(tensor cores), comma-separated: ours alone at each (bf16, block "
                                                "size 16)")
    ap.add_argument("--splits", default="", help="PROGRAMS:MIN_TOKENS,...: ours alone (bf16, block size 16, "
                                                 "the manifest's schedule) with the split rule aiming at PROGRAMS "
                                                 "programs, no split under MIN_TOKENS tokens")
    ap.add_argument("--kernels", action="store_true",
                    help="each kernel's device time (and the gap before it) in one call replayed from a CUDA graph, "
                         "bf16 and float8 caches at block size 16 (torch.profiler; default row: 1 x 4096)")
    a = ap.parse_args()
    modes = [f for f, on in (("--kernels", a.kernels), ("--sweep", a.sweep), ("--splits", a.splits)) if on]
    if len(modes) > 1:  # each is a run of its own: one would silently not run
        ap.error(f"{' and '.join(modes)}: expected at most one of --kernels, --sweep and --splits")
    if a.kernels:
        return kernel_times(a)
    if a.sweep:
        return sweep(a)
    if a.splits:
        return split_sweep(a)
    from torch.nn.attention import SDPBackend

    rows = _rows(a.rows)
    sizes = a.block_sizes.split(",")
    if not all(b.isdigit() and int(b) > 0 for b in sizes):
        raise SystemExit(f"--block-sizes: expected positive integers, comma-separated, got {a.block_sizes!r}")
    sizes = [int(b) for b in sizes]
    gen = torch.Generator(device="cuda").manual_seed(0)
    print("| batch x context | KV MB | copy | block size | ours | ours, graph | % of copy | fp8 ours | fp8 % of its "
          "copy | SDPA cuDNN | SDPA flash |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for batch, ctx in rows:
        kv = 2 * batch * ctx * HKV * D * 2
        copy, copy8 = same_bytes_copy_us(kv), same_bytes_copy_us(kv // 2)
        cudnn = flash = float("nan")
        if not a.no_sdpa:
            cudnn, flash = _sdpa(batch, ctx, SDPBackend.CUDNN_ATTENTION), _sdpa(batch, ctx, SDPBackend.FLASH_ATTENTION)
        for bs in sizes:
            eager, graph = _ours(batch, ctx, bs, torch.bfloat16, gen)
            f8 = _ours(batch, ctx, bs, torch.float8_e4m3fn, gen)[0] if not a.no_fp8 else float("nan")
            print(f"| {batch} x {ctx} | {kv / 1e6:.1f} | {copy:.1f} | {bs} | {eager:.1f} | {graph:.1f} | "
                  f"{100 * copy / eager:.0f}% | {f8:.1f} | {100 * copy8 / f8:.0f}% | {cudnn:.1f} | {flash:.1f} |",
                  flush=True)


def _rows(text: str) -> list[tuple[int, int]]:
    """``--rows``: indices into :data:`ROWS`, comma-separated (empty: all)."""
    if not text:
        return ROWS
    if not all(i.isdigit() and int(i) < len(ROWS) for i in text.split(",")):
        raise SystemExit(f"--rows: expected indices 0-{len(ROWS) - 1}, comma-separated, got {text!r}")
    return [ROWS[int(i)] for i in text.split(",")]


def built_knobs(static: dict, cache) -> dict:
    """The knobs the partial program is built with for a sweep's ``static`` on ``cache`` (the table's
    bf16 q; :func:`schedule_specs`' jobs): ``kernel_specs``' rules may override the sweep's (a float8
    cache's tile), and a column must say what ran."""
    name = str(cache).removeprefix("torch.")
    partial = next(s for _, s, _, _ in schedule_specs(static) if s.kind == "partial" and s.cache_dtype == name)
    return {k: getattr(partial, k) for k in static}


def sweep_label(static: dict, cache) -> str:
    """A sweep column's title: the knobs as built, each one a rule changed named with what was asked."""
    built = built_knobs(static, cache)
    return ", ".join(f"{k} {built[k]}" + (f" (asked {v})" if built[k] != v else "") for k, v in static.items())


def sweep(a: argparse.Namespace) -> None:
    rows = _rows(a.rows)
    configs = parse_sweep(a.sweep)
    gen = torch.Generator(device="cuda").manual_seed(0)
    cache = torch.float8_e4m3fn if a.sweep_cache == "fp8" else torch.bfloat16
    print("eager us (% of copy) / graph us, max abs error against float32")
    print("| batch x context | copy | " + " | ".join(sweep_label(c, cache) for c in configs) + " |")
    print("|---|---|" + "---|" * len(configs))
    for batch, ctx in rows:
        copy = same_bytes_copy_us(2 * batch * ctx * HKV * D * cache.itemsize)
        errs: list[float] = []
        got = [_ours(batch, ctx, 16, cache, gen, c, errs) for c in configs]
        print(f"| {batch} x {ctx} | {copy:.1f} | " + " | ".join(
            f"{e:.1f} ({100 * copy / e:.0f}%) / {g:.1f}, {err:.1e}" for (e, g), err in zip(got, errs)) + " |",
              flush=True)


def kernel_rows(events: list[tuple[str, float, float]]) -> list[tuple[str, int, float, float]]:
    """Per kernel name, in order of first launch: (name, launches, median duration, median gap between the
    previous kernel's end and its start), from ``(name, start, end)`` of each kernel run on the device (us).
    In replays of a call of two launches, the first one's gap is between replays and the second's is the
    one inside the call."""
    events = sorted(events, key=lambda e: e[1])
    durations: dict[str, list[float]] = {}
    gaps: dict[str, list[float]] = {}
    for i, (name, start, end) in enumerate(events):
        durations.setdefault(name, []).append(end - start)
        if i:
            gaps.setdefault(name, []).append(start - events[i - 1][2])

    def median(xs: list[float]) -> float:
        return statistics.median(xs) if xs else float("nan")
    return [(n, len(d), median(d), median(gaps.get(n, []))) for n, d in durations.items()]


def kernel_times(a: argparse.Namespace) -> None:
    """Where a call's time goes on the device: one call captured in a CUDA graph, replayed 50 times under
    torch.profiler, each kernel's median time and the median gap before it, next to the graph's time a
    call (``graph_us_per_call``, without the profiler). bf16 and float8 caches, block size 16."""
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator(device="cuda").manual_seed(0)
    print("| batch x context | cache | kernel | launches | median us | gap before it, us | graph, us a call |")
    print("|---|---|---|---|---|---|---|")
    for batch, ctx in _rows(a.rows or "3"):
        for dtype in (torch.bfloat16, torch.float8_e4m3fn):
            op, extra = _op(dtype)
            s = _paged(batch, ctx, 16, dtype, gen)
            out = torch.empty_like(s["q"])
            per_call = graph_us_per_call(lambda: op(**s, **extra, out=out), calls=20)
            g = captured(lambda: op(**s, **extra, out=out))
            for _ in range(20):
                g.replay()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(50):
                    g.replay()
                torch.cuda.synchronize()
            op.check()
            events = [(e.name.split("(")[0], e.time_range.start, e.time_range.end) for e in prof.events()
                      if e.device_type.name == "CUDA"]
            for name, n, us, gap in kernel_rows(events):
                print(f"| {batch} x {ctx} | {'float8' if extra else 'bf16'} | {name} | {n} | {us:.2f} | {gap:.2f} | "
                      f"{per_call:.1f} |", flush=True)


def split_sweep(a: argparse.Namespace) -> None:
    """The split rule's two numbers (the programs it aims for, ``decode_builtin.target_programs``, read
    when an op's kernels load, and ``MIN_SPLIT_TOKENS``, read at each call), set in turn."""
    from tileops.attention import decode_builtin

    rows = _rows(a.rows)
    pairs = []
    for c in a.splits.split(","):
        parts = c.split(":")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise SystemExit(f"--splits: expected PROGRAMS:MIN_TOKENS (positive integers), got {c!r}")
        pairs.append(tuple(map(int, parts)))
    saved = decode_builtin.target_programs, decode_builtin.MIN_SPLIT_TOKENS
    gen = torch.Generator(device="cuda").manual_seed(0)
    print("| batch x context | copy | " + " | ".join(f"{p} programs, >= {t} tokens" for p, t in pairs) + " |")
    print("|---|---|" + "---|" * len(pairs))
    try:
        for batch, ctx in rows:
            copy = same_bytes_copy_us(2 * batch * ctx * HKV * D * 2)
            got = []
            for p, t in pairs:
                decode_builtin.target_programs, decode_builtin.MIN_SPLIT_TOKENS = (lambda _, p=p: p), t
                n = decode_builtin.splits(batch, HKV, ctx, p)
                eager, graph = _ours(batch, ctx, 16, torch.bfloat16, gen)
                got.append(f"{eager:.1f} / {graph:.1f} graph ({100 * copy / eager:.0f}%, {n} splits)")
            print(f"| {batch} x {ctx} | {copy:.1f} | " + " | ".join(got) + " |", flush=True)
    finally:
        decode_builtin.target_programs, decode_builtin.MIN_SPLIT_TOKENS = saved


if __name__ == "__main__":
    main()
