"""GPU timing without an L2 flush: rotate through input sets, time batches of back-to-back calls.

``triton.testing.do_bench`` zeroes a 256 MB buffer before every run to flush L2. That leaves L2
full of dirty lines which the timed kernel then has to write back: on an H200 a 4 MB RoPE measured
6 us that way. Here instead every call reads a different input set (together several times the
50 MB L2, so nothing is served from L2 by accident), and a spin kernel holds the GPU while the host
queues all timed calls, so host time does not count; each sample is a batch of 10 calls between two
events, so a kernel's launch overlaps the previous one's tail as it does in a model (the spin is
sized from the host time of a few calls, :func:`spin_cycles`, so that a host-heavy call, an
autograd backward, is timed on the GPU too). Calls that
synchronise the host themselves (a device flag read) cannot be queued ahead: for those the spin is
skipped and their time includes the host's.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

__all__ = ["gpu_time", "spin_cycles", "rotation", "copy_rate", "same_bytes_copy_us", "graph_us_per_call"]

L2_BYTES = 60 * 2**20


def rotation(nbytes: int, budget: int = 2 * 2**30) -> int:
    """How many input sets make ``3 x L2`` at least, within ``budget`` bytes."""
    want = -(-3 * L2_BYTES // max(nbytes, 1))
    return int(max(2, min(want, budget // max(nbytes, 1), 512)))


def gpu_time(fn: Callable[[int], Any], sets: int, batches: int = 30, per_batch: int = 10,
             queue_ahead: bool = True) -> tuple[float, float, float]:
    """(median, p20, p80) microseconds per call of ``fn(i)``, ``i`` cycling over ``sets`` input sets.

    Each sample is a batch of ``per_batch`` back-to-back calls between two events, divided by
    ``per_batch``: what a model running the op in a stream sees, without an event between calls.
    """
    for i in range(max(sets, 10)):  # warm up: compile, allocate, touch every set
        fn(i % sets)
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(batches)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(batches)]
    if queue_ahead:
        torch.cuda._sleep(spin_cycles(fn, sets, batches * per_batch))  # the host queues every call meanwhile
    i = 0
    for r in range(batches):
        starts[r].record()
        for _ in range(per_batch):
            fn(i % sets)
            i += 1
        ends[r].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) * 1e3 / per_batch for s, e in zip(starts, ends))
    q = statistics.quantiles(times, n=10)
    return statistics.median(times), q[1], q[7]


#: GPU clock cycles a second the spin is sized by (an H200 boosts to 1.98 GHz; a faster clock only
#: shortens the spin, which :func:`spin_cycles`' margin covers)
SPIN_HZ = 2.0e9


def spin_cycles(fn: Callable[[int], Any], sets: int, calls: int) -> int:
    """Cycles of ``torch.cuda._sleep`` that hold the GPU while the host queues ``calls`` calls of
    ``fn``: the host time of a few calls (measured with the GPU free, so they only queue), times
    ``calls``, twice over, and never under 100 M (~50 ms). A fixed 50 ms held the GPU for 300 calls of
    up to ~160 us of host time; an autograd backward of a decode-size row takes ~120 us on the H200's
    host, so the later batches of such a row timed the host instead of the GPU (the runner's
    decode-4k backward: median 153.6 us, p20 6.3 us, when its GPU time is 3.7 us)."""
    n = min(20, calls)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(n):
        fn(i % sets)
    per_call = (time.perf_counter() - t0) / n
    torch.cuda.synchronize()
    return int(min(max(1e8, 2 * per_call * calls * SPIN_HZ), 8e9))


def copy_rate(nbytes: int = 2**30) -> float:
    """Device-to-device copy rate, GB/s counting bytes read plus written (median of 200)."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    med, _, _ = gpu_time(lambda i: dst.copy_(src), 1, batches=10)
    return 2 * src.numel() * 2 / (med * 1e-6) / 1e9




def same_bytes_copy_us(nbytes: int) -> float:
    """Median microseconds of a device-to-device copy moving ``nbytes`` (half read, half written),
    rotating through as many buffers as a row of that size does (:func:`rotation`), so that a small
    copy pays what a small op pays (launch, ramp, no L2 hits) and is the fair ceiling for it."""
    n = rotation(nbytes)
    half = max(2, nbytes // 2 // 2 * 2)
    srcs = [torch.empty(half // 2, dtype=torch.float16, device="cuda").normal_() for _ in range(n)]
    dsts = [torch.empty_like(s) for s in srcs]
    med, _, _ = gpu_time(lambda i: dsts[i].copy_(srcs[i]), n)
    return med


def captured(fn: Callable[[], Any], calls: int = 1) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of ``calls`` calls of ``fn()``, captured on a side stream after one warm-up call (what
    a server's decode step does)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return g


def graph_us_per_call(fn: Callable[[], Any], calls: int = 100) -> float:
    """Median microseconds per call of ``fn()`` replayed from one CUDA graph holding ``calls`` calls
    (:func:`captured`)."""
    g = captured(fn, calls)
    return gpu_time(lambda i: g.replay(), 1, batches=20, per_batch=1)[0] / calls
