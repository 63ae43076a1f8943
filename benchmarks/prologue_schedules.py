"""The prologue's CUDA schedule variants of its cos/sin step against the default, on four rows of
``benchmarks/prologue.py``, side by side in one run, each variant's q and caches compared bit for bit
with the default's on the same inputs.

    python -m benchmarks.prologue_schedules            # on a GPU; prints one SWEEP line per row
    python -m benchmarks.prologue_schedules --dry      # anywhere: the rows' specs and the configs
    python -m benchmarks.prologue_schedules --dry --lower   # and lower every config's kernel for sm_90
    python -m benchmarks.prologue_schedules --cpu      # the plumbing on the CPU (the C kernel: the
                                                       # fields are CUDA's), wall-clock times, 1 round

The variants are :class:`kernels.prologue.PrologueKernelSpec` fields: ``share_angles`` (one lane
group composes the token's cos/sin into shared memory, one barrier, every group reads them),
``pair_angles`` (with it: thread j composes pair j alone, one stream's position each under MRoPE),
``reciprocal_scale`` (a float8 cache's ``x / scale`` by the reciprocal and a correction, the same
bits) and ``min_blocks``. The manifest's ``kernel.static`` sets ``share_angles``,
``reciprocal_scale`` and ``min_blocks`` 7 (the lowest row's best in the last sweep); the other
configs change them. The script patches ``tileops.attention.builtin._spec`` per config.

Per row, one line ``SWEEP {json}``: the same-bytes copy (us), us per config (the median over
``ROUNDS`` rounds of :func:`benchmarks.timing.gpu_time`'s median; the configs interleaved within each
round, all on the same input sets), % of the copy, and for each config other than the default the
elements of q, key_cache and value_cache whose bits differ from the default config's output (want 0),
plus the error words (``op.check()``). Every config's kernel is compiled first, in parallel
(:func:`tileops.compile.warmup.compile_jobs`). Results: ``results/prologue_schedules.md``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch

import tileops.attention.builtin as B
from benchmarks import prologue as P

ROWS = ("mrope (Qwen3-VL) 2048 tok", "fp8 cache 2048 tok", "fp8 cache 16384 tok", "qwen3 2048 tok",
        "qwen3 16384 tok")
#: config -> the spec fields it sets over the manifest's (the first, "manifest", sets none: the others'
#: bits are compared with its); "plain/mb6" is the schedule the manifest had before the switches
CONFIGS = {
    "manifest": {},
    "plain/mb6": dict(share_angles=False, pair_angles=False, reciprocal_scale=False, min_blocks=6),
    "pairs/mb7": dict(share_angles=True, pair_angles=True, min_blocks=7),
    "mb8": dict(min_blocks=8),
    "no-rcp": dict(reciprocal_scale=False),
}
#: configs that change only a float8 cache's kernel: run on those rows alone
FP8_ONLY = ("no-rcp",)
ROUNDS = 3
ORIG = B._spec


def default_spec(op, backend="cuda"):
    """The kernel spec the op's first call builds (qkv bf16, positions and slots int64: benchmarks.prologue.inputs)."""
    return ORIG(op.manifest, op.params, "bfloat16", "int64", "int64", backend, op.name)


def row_configs(op) -> dict:
    """config -> its kernel spec for this row's op (or why it could not be made)."""
    base = default_spec(op)
    out = {}
    for name, fields in CONFIGS.items():
        if name in FP8_ONLY and not base.fp8:
            continue
        try:
            out[name] = dataclasses.replace(base, **fields)
        except (TypeError, ValueError) as e:  # a tree without the fields, or a refused combination
            out[name] = f"{type(e).__name__}: {e}"
    return out


def patch(fields: dict) -> None:
    B._spec = lambda *a, **k: (dataclasses.replace(ORIG(*a, **k), **fields) if a[5] == "cuda" else ORIG(*a, **k))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def run_once(op, inputs: dict) -> dict:
    x = {k: v.clone() for k, v in inputs.items()}
    q = op(**x)
    if q.is_cuda:
        torch.cuda.synchronize()
    return {"q": q, "key_cache": x["key_cache"], "value_cache": x["value_cache"]}


def wall_time(fn, sets: int) -> tuple[float]:
    """--cpu: microseconds of one call, the median of 5 (a stand-in for benchmarks.timing.gpu_time)."""
    ts = []
    for i in range(5):
        t0 = time.perf_counter()
        fn(i % sets)
        ts.append((time.perf_counter() - t0) * 1e6)
    return (statistics.median(ts),)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry", action="store_true", help="no GPU: print the rows' configs (and with --lower lower them)")
    ap.add_argument("--lower", action="store_true", help="with --dry: lower every kernel for sm_90")
    ap.add_argument("--cpu", action="store_true", help="the whole loop on the CPU (C kernels), to check the script")
    ap.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1))
    a = ap.parse_args()
    rows = [r for r in P.ROWS if r.name in ROWS]
    assert len(rows) == len(ROWS), [r.name for r in rows]
    ops = {r.name: P.fused(r, P.rope_op(r.rope)) for r in rows}
    specs = {r.name: row_configs(ops[r.name]) for r in rows}
    builder = next(iter(ops.values())).manifest.kernel.builder
    if a.dry or not (a.cpu or torch.cuda.is_available()):
        for r in rows:
            print("DRY " + json.dumps({"row": r.name, "configs": {n: s if isinstance(s, str) else {
                f.name: getattr(s, f.name) for f in dataclasses.fields(s) if f.name in (
                    "min_blocks", "share_angles", "pair_angles", "reciprocal_scale", "cache", "mrope_section")}
                for n, s in specs[r.name].items()}}, default=str), flush=True)
        if a.lower:
            from tileops.compile import build, cuda_build
            for s in dict.fromkeys(s for c in specs.values() for s in c.values() if not isinstance(s, str)):
                t0 = time.perf_counter()
                src = cuda_build.lower_sources(build.prim_func(builder, s), "sm_90", build.PASS_CONFIGS)
                print(f"lowered in {time.perf_counter() - t0:.1f} s: {'__syncthreads' in src.device and 'barrier' or 'no barrier'}"
                      f", {s}", flush=True)
        return 0

    from benchmarks.timing import gpu_time, rotation, same_bytes_copy_us
    from tileops.compile.warmup import compile_jobs

    t0 = time.perf_counter()
    bad = {}
    if a.cpu:
        dev, timer, rounds = torch.device("cpu"), wall_time, 1
    else:
        from tileops.compile.build import device_backend

        dev, timer, rounds = torch.device("cuda"), gpu_time, ROUNDS
        arch = device_backend(dev)[1]
        jobs = [(builder, s, "cuda", arch) for c in specs.values() for s in c.values() if not isinstance(s, str)]
        n, secs, failures = compile_jobs(jobs, jobs=a.jobs, progress=False)
        bad = {s: err for s, err in failures}
        print("COMPILE " + json.dumps({"kernels": n, "seconds": round(secs, 1),
                                       "failures": [f"{s}: {e}" for s, e in failures]}), flush=True)
    for row in rows:
        nbytes = P.moved_bytes(row)
        nsets = rotation(nbytes)
        gen = torch.Generator().manual_seed(1)
        sets = [P.inputs(row, dev, gen) for _ in range(nsets)]
        pristine = {k: v.clone() for k, v in sets[0].items()}
        copy_us = same_bytes_copy_us(nbytes) if dev.type == "cuda" else float("nan")
        res = {"row": row.name, "copy_us": round(copy_us, 2), "us": {}, "pct_copy": {}, "mismatch": {}, "errors": {}}
        live, ref = {}, None
        for name, spec in specs[row.name].items():
            if isinstance(spec, str):
                res["errors"][name] = spec
                continue
            if spec in bad:
                res["errors"][name] = bad[spec][:200]
                continue
            patch(CONFIGS[name])
            try:
                op = P.fused(row, P.rope_op(row.rope))
                got = run_once(op, pristine)
                op.check()
            except Exception as e:  # noqa: BLE001 - reported per config
                res["errors"][name] = f"{type(e).__name__}: {e}"[:200]
                continue
            finally:
                B._spec = ORIG
            if ref is None:
                ref = got  # the first config is the manifest's
            else:
                res["mismatch"][name] = {k: int((bits(got[k]) != bits(ref[k])).sum()) for k in ref}
            live[name] = op
        times = {name: [] for name in live}
        for _ in range(rounds):  # the configs interleaved, so that a drift of the clocks hits them alike
            for name, op in live.items():
                patch(CONFIGS[name])
                try:
                    times[name].append(timer(lambda i, op=op: op(**sets[i]), nsets)[0])
                finally:
                    B._spec = ORIG
        for name, op in live.items():
            op.check()
            us = statistics.median(times[name])
            res["us"][name] = round(us, 2)
            res["pct_copy"][name] = round(100 * copy_us / us, 1)
        print("SWEEP " + json.dumps(res), flush=True)
        del sets, pristine, live, ref
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    print(f"total {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
