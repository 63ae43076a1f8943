"""Where a compiled static-cache ``generate`` spends its host and GPU time, per variant of
:mod:`benchmarks.hf_generate` (unpatched, rope+norm, prologue by default): wall-time medians of
interleaved runs, then one profiled generate each (``torch.profiler``), summarised as host CPU self
time, GPU time, kernel launches and the busiest ops; the full tables go to ``--out``.

    python -m benchmarks.hf_profile                  # on a GPU: Qwen3 of hf_generate, 8 x (256 + 24)
    python -m benchmarks.hf_profile --quick          # the CPU: the --quick model (Inductor's C++ kernels)

Written for the question a wall-clock run on a shared host could not answer (NOTES.md, 2026-12-02):
the compiled decode step is bound by the host's launches, and one variant's generates spread over
60-90 ms of about 170 there, more than the variants' difference. What the profiler counts (work)
does not move with the host's load as the wall time does.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from benchmarks import hf_generate as H

#: the launch calls the profiler records on the host (CUDA runtime and driver)
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.hf_profile")
    p.add_argument("--model", choices=list(H.MODELS), default="qwen3")
    p.add_argument("--variants", default="unpatched,rope+norm,prologue", help="comma-separated hf_generate variants")
    p.add_argument("--new", type=int, default=24, help="new tokens a generate (default 24)")
    p.add_argument("--reps", type=int, default=5, help="timed generates a variant, interleaved (default 5)")
    p.add_argument("--quick", action="store_true", help="hf_generate's --quick model, on the CPU")
    p.add_argument("--out", default=None, help="a folder for each variant's full profiler tables")
    a = p.parse_args(argv)
    for flag in ("new", "reps"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag}: expected an integer >= 1, got {getattr(a, flag)}")
    dev = torch.device("cuda" if torch.cuda.is_available() and not a.quick else "cpu")
    if dev.type != "cuda" and not a.quick:
        print("the full run needs a CUDA GPU (--quick runs on the CPU)", file=sys.stderr)
        return 2
    names = a.variants.split(",")
    unknown = [n for n in names if n not in H.MODELS[a.model].variants]
    if unknown:
        p.error(f"--variants: {', '.join(unknown)} not among {', '.join(H.MODELS[a.model].variants)}")
    size = {**H.sizes(a.model, a.quick), "new": a.new}
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    models = {k: m for k, m in H.build_models(a.model, size, dev, dtype).items() if k in names}
    prompt, kw = H.greedy_inputs(size, dev, torch.Generator().manual_seed(1))
    kw.update(cache_implementation="static", disable_compile=True)

    def generate(m) -> None:
        with torch.no_grad():
            m.generate(prompt, **kw)
        if dev.type == "cuda":
            torch.cuda.synchronize()

    t0 = time.perf_counter()
    for name, m in models.items():  # Inductor's compile: tens of seconds a model on a GPU's host
        print(f"compiling and warming up {name} ...", flush=True)
        m.forward = torch.compile(m.forward)
        generate(m)
        generate(m)
    print(f"compiled and warmed up in {time.perf_counter() - t0:.0f} s", flush=True)
    times: dict[str, list[float]] = {n: [] for n in models}
    for _ in range(a.reps):
        for name, m in models.items():
            t = time.perf_counter()
            generate(m)
            times[name].append((time.perf_counter() - t) * 1e3)
    for name, ts in times.items():
        print(f"{name}: wall median {statistics.median(ts):.1f} ms, runs {', '.join(f'{t:.1f}' for t in ts)}")
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                          if dev.type == "cuda" else [])
    for name, m in models.items():
        with torch.profiler.profile(activities=activities) as prof:
            generate(m)
        events = prof.key_averages()
        cpu = sum(e.self_cpu_time_total for e in events) / 1e3
        gpu = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e3
        launches = sum(e.count for e in events if e.key in LAUNCHES)
        mm = sum(e.count for e in events if e.key == "aten::mm")
        print(f"{name}: host CPU self {cpu:.1f} ms, GPU {gpu:.1f} ms, launches {launches}, aten::mm {mm}")
        for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:10]:
            print(f"    {e.key[:64]:64s} {e.self_cpu_time_total / 1e3:8.2f} ms x{e.count}")
        if a.out:
            os.makedirs(a.out, exist_ok=True)
            with open(os.path.join(a.out, f"hf_profile_{name.replace('+', '_')}.txt"), "w") as f:
                f.write(events.table(sort_by="self_cpu_time_total", row_limit=50, max_name_column_width=70))
    return 0


if __name__ == "__main__":
    sys.exit(main())
