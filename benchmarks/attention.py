"""The attention forward against SDPA's flash and cuDNN backends and torch.compile, side by side in one
run (issue 36's table), and a sweep of the CUDA tile shape.

    python -m benchmarks.attention                    # the table's rows, bf16 (+ fp16 on two rows)
    python -m benchmarks.attention --rows all         # also MHA, head_dim 64/256, varlen
    python -m benchmarks.attention --configs 128x64x2x256,128x128x2x256,128x128x2x256x2 --rows 16k
                                                      # schedules: block_M x block_N x stages x threads
                                                      # [x pipeline], beside the baselines
    python -m benchmarks.attention --backward         # the backward through the op: vs SDPA flash and cuDNN's
    python -m benchmarks.attention --tune 150 --rows 4x4k,4x4k-causal,16x1k-causal
                                                      # op.tune on each row's shape class (seconds each;
                                                      # kept in this machine's table), then the table
    python -m benchmarks.attention --configs builtin,derived
                                                      # target=BUILTIN beside target=None (the tables')
    python -m benchmarks.attention --dry              # anywhere: the rows, configs and kernel specs

TFLOP/s counts ``4 * Sq * Sk * D * Hq`` per sequence, halved when causal (the issue's convention), and
% of the H200's 989 TFLOP/s dense bf16/fp16 peak. Times are medians of
:func:`benchmarks.timing.gpu_time` (batches of back-to-back calls between events; an attention call is
milliseconds, so L2 and launch effects are noise). Before a row is timed, every config's output is
compared with SDPA's (cuDNN, else flash) on the same inputs: the largest difference must stay within
4 half-ulps of the dtype times max |v| (both round P to the dtype and the output once), else the row
says FAIL and is not timed. Every kernel of the run is compiled first, in parallel
(:func:`tileops.compile.warmup.compile_jobs`: TileLang's nvcc build, ~10-30 s a kernel).

Varlen rows have no SDPA counterpart: the baselines run one SDPA call per sequence (what a caller
without a varlen kernel does), and the FLOPs sum each sequence's.

``--backward`` times the backward instead: ``torch.autograd.grad`` of the op's output (q, k, v
requiring grad; the graph kept, so each timed call is the backward plan alone: delta, dk/dv, dq, and
any copy its views need) and of SDPA flash's and cuDNN's outputs, with the same dO. TFLOP/s counts
2.5x the forward's FLOPs (the issue's convention). ``err`` is the largest ``|ours - SDPA|`` of dq, dk,
dv over the largest ``|SDPA|``: both are 16-bit computations, so it is a check that the op computes
the gradient (near 1e-2), not a bound; ``tests/test_attn_bwd_cuda.py`` bounds it against float64.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

import torch

PEAK_TFLOPS = 989.0
#: row name -> (batch, seq, Hq, Hkv, D, causal, varlen lengths or None)
ROWS: dict[str, tuple] = {
    "16k": (1, 16384, 32, 8, 128, False, None),
    "16k-causal": (1, 16384, 32, 8, 128, True, None),
    "4x4k": (4, 4096, 32, 8, 128, False, None),
    "4x4k-causal": (4, 4096, 32, 8, 128, True, None),
    "16x1k-causal": (16, 1024, 32, 8, 128, True, None),
    "mha-16k": (1, 16384, 32, 32, 128, False, None),
    "4x4k-causal-d64": (4, 4096, 32, 8, 64, True, None),
    # the HF Llama training step of benchmarks.hf_generate (16 q / 4 kv heads of 64)
    "llama-4x2k-causal-d64": (4, 2048, 16, 4, 64, True, None),
    "4x4k-causal-d256": (4, 4096, 32, 8, 256, True, None),
    "varlen-causal": (0, 0, 32, 8, 128, True, [8192, 3000, 2048, 1500, 1024, 700, 256, 100]),
}
DEFAULT_ROWS = ["16k", "16k-causal", "4x4k-causal", "16x1k-causal"]
#: rows also timed in fp16 by default
FP16_ROWS = ["16k", "4x4k-causal"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def flops(row: tuple) -> float:
    b, s, hq, _, d, causal, lens = row
    pairs = sum(n * n for n in lens) if lens else b * s * s
    return 4.0 * pairs * d * hq / (2 if causal else 1)


def backward_call(forward: Any, t: dict[str, torch.Tensor], dout: torch.Tensor) -> tuple[Any, tuple]:
    """``(call, grads)``: ``call()`` runs the backward of one forward of ``forward(leaves)`` (q, k, v of
    ``t`` requiring grad) with ``dout``, the graph kept so that it can run again; ``grads`` its first
    result (dq, dk, dv)."""
    leaves = {n: t[n].detach().requires_grad_(True) for n in ("q", "k", "v")}
    out = forward({**t, **leaves})
    wrt = [leaves[n] for n in ("q", "k", "v")]

    def call():
        return torch.autograd.grad(out, wrt, dout, retain_graph=True)

    return call, call()


#: ``--configs`` words that are not tile shapes: the op built with ``target=BUILTIN`` (the manifest's
#: schedule) and with ``target=None`` (this device's tuned or shipped choice for the row's shape class)
TARGETS = ("builtin", "derived")


def parse_config(text: str) -> "dict[str, int] | str":
    """``128x64x2x256`` -> the manifest's ``kernel.static`` keys; a fifth number is the ``pipeline``
    knob (``128x128x2x256x2``: TMA loads from TileLang's producer warpgroup). ``builtin`` and
    ``derived`` (:data:`TARGETS`) are kept as words."""
    if text.strip().lower() in TARGETS:
        return text.strip().lower()
    try:
        parts = [int(p) for p in text.lower().split("x")]
    except ValueError:
        parts = []
    if len(parts) not in (4, 5):
        raise SystemExit(f"--configs: expected block_M x block_N x stages x threads [x pipeline], or one of "
                         f"{', '.join(TARGETS)}; got {text!r}")
    return dict(zip(("block_M", "block_N", "stages", "threads", "pipeline"), parts))


def make_op(row: tuple, static: "dict[str, int] | str | None") -> Any:
    """The op for ``row``, its manifest's tile shape replaced by ``static`` (None: the manifest's;
    ``"builtin"`` / ``"derived"``: built with ``target=BUILTIN`` / ``None``)."""
    from tileops.attention import AttnFwdOp
    from tileops.targets import BUILTIN

    _, _, hq, hkv, d, causal, _ = row
    if isinstance(static, str):
        return AttnFwdOp(hq, hkv, d, causal=causal, target=BUILTIN if static == "builtin" else None)
    op = AttnFwdOp(hq, hkv, d, causal=causal)
    if static is not None:  # an op reads its own manifest object: a copy with another schedule
        kernel = dataclasses.replace(op.manifest.kernel, static={**op.manifest.kernel.static, **static})
        op.manifest = dataclasses.replace(op.manifest, kernel=kernel)
    return op


def config_label(c: "dict[str, int] | str | None", op: Any = None) -> str:
    """A config's name in the table; a ``builtin`` / ``derived`` op that has run also says which
    schedule served it and where it came from (``tuned on this machine at ...``)."""
    if isinstance(c, dict):
        return "x".join(str(v) for v in c.values())
    if c is None:
        return "manifest"
    if op is None or op.schedule is None:
        return c
    knobs = "x".join(str(v) for b, _, v in op.schedule.knobs if b == "attention") or "kernel.static"
    return f"{c}: {knobs} ({op.schedule.source})"


def tune_rows(work: list[tuple[str, str]], budget: float) -> None:
    """``--tune``: ``op.tune`` on each row's inputs (``budget`` seconds each; a row whose shape class an
    earlier row of the run tuned is not tuned again), kept in this machine's table, so that the table's
    ``derived`` ops take it. The tuner checks each candidate against the float64 reference first."""
    done: dict[str, str] = {}
    for n, dt in work:
        row = ROWS[n]
        op = make_op(row, "builtin")
        t = inputs(row, DTYPES[dt])
        kw = {k: v for k, v in t.items() if k.startswith("cu_")}
        # one call first, outside the budget (it also names the class): a fresh process's one-off builds
        # (the native runtime's 23 s on the H100, 2026-12-06) ate the first class's 75 s before any
        # candidate was tried
        op(t["q"], t["k"], t["v"], **kw)
        torch.cuda.synchronize()
        cls = op.schedule.shape_class
        if cls in done:
            print(f"tune {n} {dt}: class tuned by row {done[cls]}", flush=True)
            continue
        done[cls] = f"{n} {dt}"
        t0 = time.perf_counter()
        got = op.tune(t["q"], t["k"], t["v"], **kw, budget=budget, progress=True)
        print(f"tune {n} {dt}: {got} in {time.perf_counter() - t0:.0f} s", flush=True)
        del t
        torch.cuda.empty_cache()


def inputs(row: tuple, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    b, s, hq, hkv, d, _, lens = row
    g = torch.Generator(device="cuda").manual_seed(seed)
    if lens:
        tq = sum(lens)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        return {"q": torch.randn(tq, hq, d, generator=g, device="cuda", dtype=dtype),
                "k": torch.randn(tq, hkv, d, generator=g, device="cuda", dtype=dtype),
                "v": torch.randn(tq, hkv, d, generator=g, device="cuda", dtype=dtype),
                "cu_seqlens_q": cu, "cu_seqlens_k": cu}
    return {"q": torch.randn(b, s, hq, d, generator=g, device="cuda", dtype=dtype),
            "k": torch.randn(b, s, hkv, d, generator=g, device="cuda", dtype=dtype),
            "v": torch.randn(b, s, hkv, d, generator=g, device="cuda", dtype=dtype)}


def sdpa_fn(backend: str | None, row: tuple, t: dict[str, torch.Tensor], compiled: bool = False) -> Any:
    """A call of SDPA on ``t`` (HF's layout as views of ours) with ``backend`` forced (None: torch's
    choice); per sequence for a varlen row. None when the backend refuses the row."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    causal, lens = row[5], row[6]
    f = torch.nn.functional.scaled_dot_product_attention
    if compiled:
        f = torch.compile(f, dynamic=False)
    which = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION, None: None}[backend]

    def one(q, k, v):
        return f(q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2), is_causal=causal,
                 enable_gqa=q.shape[-2] != k.shape[-2]).transpose(-3, -2)

    if lens:
        cu = t["cu_seqlens_q"].tolist()
        parts = [(t["q"][a:e][None], t["k"][a:e][None], t["v"][a:e][None]) for a, e in zip(cu, cu[1:])]

        def call():
            return torch.cat([one(*p)[0] for p in parts])
    else:
        def call():
            return one(t["q"], t["k"], t["v"])

    def run():
        if which is None:
            return call()
        with sdpa_kernel([which]):
            return call()

    try:
        run()
        torch.cuda.synchronize()
    except RuntimeError as e:
        print(f"  ({backend or 'compile'} refused: {str(e).splitlines()[0][:100]})", flush=True)
        return None
    return run


def work_list(rows: str = ",".join(DEFAULT_ROWS), dtypes: str | None = None) -> list[tuple[str, str]]:
    """``(row, dtype)`` pairs of ``--rows`` and ``--dtypes``; an unknown row or dtype is refused by name."""
    names = list(ROWS) if rows == "all" else [r.strip() for r in rows.split(",") if r.strip()]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        raise SystemExit(f"--rows: unknown {unknown}; rows: {', '.join(ROWS)}")
    unknown = [d for d in (dtypes.split(",") if dtypes else ()) if d not in DTYPES]
    if unknown:  # (else a KeyError once the kernels are listed, or after the baselines ran)
        raise SystemExit(f"--dtypes: unknown {unknown}; dtypes: {', '.join(DTYPES)}")
    work = []
    for n in names:
        dts = dtypes.split(",") if dtypes else (["bf16", "fp16"] if n in FP16_ROWS else ["bf16"])
        work += [(n, dt) for dt in dts]
    return work


def kernel_jobs(work: list[tuple[str, str]], configs: list, arch: str, backward: bool = False) -> list[tuple]:
    """The kernels a run of ``work`` x ``configs`` launches on ``arch`` (no GPU needed: what
    ``python -m benchmarks.device_cache --attention-configs`` compiles ahead of a device call)."""
    from tileops.compile.warmup import op_kernel_jobs

    todo = []
    for n, dt in work:
        for c in configs:
            op = make_op(ROWS[n], c)
            row = ROWS[n]
            dims = {"q_dim": row[4], "q_heads": row[2], "kv_heads": row[3]}
            jobs = op_kernel_jobs("AttnFwdOp", op.params, dims, [{"bf16": "bfloat16", "fp16": "float16"}[dt]], arch,
                                  with_inputs=("cu_seqlens_q", "cu_seqlens_k") if row[6] else (),
                                  backward=backward)
            if isinstance(c, dict):  # the sweep's specs: the forward's with the config's schedule (the
                # backward's programs keep their own tiles: their spec has none of these fields)
                jobs = [(b, dataclasses.replace(s, **c) if b == "attention" else s, be, ar) for b, s, be, ar in jobs]
            todo += jobs
    return list(dict.fromkeys(todo))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"comma-separated of {', '.join(ROWS)}, or all")
    ap.add_argument("--dtypes", default=None, help="bf16,fp16 (default: bf16, and fp16 on " + ", ".join(FP16_ROWS) + ")")
    ap.add_argument("--configs", default=None, help="schedules to sweep, BMxBNxSTAGESxTHREADS[xPIPELINE],... "
                                                     "(default: the manifest's)")
    ap.add_argument("--no-baselines", action="store_true", help="time tileops alone")
    ap.add_argument("--no-compile", action="store_true", help="leave out the torch.compile baseline (its compile "
                                                              "takes ~20 s a row)")
    ap.add_argument("--batches", type=int, default=10, help="timed batches of 3 calls a config (default 10)")
    ap.add_argument("--jobs", type=int, default=None, help="parallel kernel compiles (default: a CPU each)")
    ap.add_argument("--backward", action="store_true", help="time the backward (autograd.grad with one dO) against "
                                                            "SDPA flash's and cuDNN's; TFLOP/s count 2.5x the forward")
    ap.add_argument("--tune", type=float, default=None, metavar="SECONDS",
                    help="first op.tune each row's shape class (at most SECONDS each), kept in this machine's "
                         "table; then the table (with --configs builtin,derived: the two side by side)")
    ap.add_argument("--dry", action="store_true", help="print the rows, configs and specs; no GPU needed")
    a = ap.parse_args(argv)
    work = work_list(a.rows, a.dtypes)
    configs = [parse_config(c) for c in a.configs.split(",")] if a.configs else [None]
    if a.dry:
        from tileops.attention.attn_builtin import kernel_specs
        from tileops.manifest import CallSpec

        for n, dt in work:
            for c in configs:
                op = make_op(ROWS[n], c)
                name = {"bf16": "bfloat16", "fp16": "float16"}[dt]
                cu = (("cu_seqlens_q", "int32"), ("cu_seqlens_k", "int32")) if ROWS[n][6] else ()
                call = CallSpec(torch.device("cuda"), (("q", name), ("k", name), ("v", name), *cu),
                                (("kv_heads", ROWS[n][3]), ("q_dim", ROWS[n][4]), ("q_heads", ROWS[n][2])))
                for _, spec in kernel_specs(op.manifest, op.params, call, "cuda", backward=a.backward):
                    print(n, dt, c, spec)
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.attention times CUDA kernels: no GPU here (--dry prints the plan)")
    from benchmarks.timing import gpu_time
    from tileops.compile.build import device_backend
    from tileops.compile.warmup import compile_jobs

    todo = kernel_jobs(work, configs, device_backend(torch.device("cuda"))[1], a.backward)
    t0 = time.perf_counter()
    count, _, failures = compile_jobs(todo, a.jobs, progress=True)
    print(f"compiled {count} kernels in {time.perf_counter() - t0:.0f} s"
          + (f"; {len(failures)} failed: {failures[0][1][:300]}" if failures else ""), flush=True)
    if a.tune is not None:
        tune_rows(work, a.tune)
    baselines = not a.no_baselines
    if a.backward:
        return backward_table(work, configs, baselines, a.batches)
    head = ["row", "dtype", "config", "tileops"] + (["flash", "cudnn", "compile"] if baselines else [])
    print("| " + " | ".join(head) + " |  (TFLOP/s, % of 989; us)", flush=True)
    for n, dt in work:
        row, dtype = ROWS[n], DTYPES[dt]
        t = inputs(row, dtype)
        kw = {k: v for k, v in t.items() if k.startswith("cu_")}
        f = flops(row)
        ref_fn = (sdpa_fn("cudnn", row, t) or sdpa_fn("flash", row, t))
        ref = ref_fn() if ref_fn is not None else None
        vmax = float(t["v"].abs().max())
        tol = 4 * (2.0**-8 if dtype == torch.bfloat16 else 2.0**-11) * vmax
        cells = []
        for c in configs:
            op = make_op(row, c)
            label = config_label(c)
            try:  # a tile shape TileLang cannot build (or the device cannot launch) fails its cell only
                got = op(t["q"], t["k"], t["v"], **kw)
                torch.cuda.synchronize()
                label = config_label(c, op)
            except Exception as e:  # noqa: BLE001 - reported, and the sweep goes on
                cells.append((label, f"FAIL {type(e).__name__}: {str(e).splitlines()[0][:120]}"))
                print(f"SWEEP {json.dumps({'row': n, 'dtype': dt, 'config': label, 'error': str(e)[:300]})}",
                      flush=True)
                continue
            err = float((got.float() - ref.float()).abs().max()) if ref is not None else float("nan")
            if ref is not None and not err <= tol:
                cells.append((label, f"FAIL max err {err:.3g} > {tol:.3g}"))
                print(f"SWEEP {json.dumps({'row': n, 'dtype': dt, 'config': label, 'fail': err})}", flush=True)
                continue
            us = gpu_time(lambda i, op=op, t=t, kw=kw: op(t["q"], t["k"], t["v"], **kw), 1, batches=a.batches,
                          per_batch=3)[0]
            tf = f / us / 1e6
            cells.append((label, f"{tf:.0f} ({100 * tf / PEAK_TFLOPS:.0f}%, {us:.0f} us, err {err:.2g})"))
            print(f"SWEEP {json.dumps({'row': n, 'dtype': dt, 'config': label, 'us': us, 'tflops': tf})}", flush=True)
        extra = []
        if baselines:
            for name, fn in (("flash", sdpa_fn("flash", row, t)), ("cudnn", sdpa_fn("cudnn", row, t)),
                             ("compile", None if a.no_compile else sdpa_fn(None, row, t, compiled=True))):
                if fn is None:
                    extra.append("-")
                    continue
                us = gpu_time(lambda i, fn=fn: fn(), 1, batches=a.batches, per_batch=3)[0]
                tf = f / us / 1e6
                extra.append(f"{tf:.0f} ({100 * tf / PEAK_TFLOPS:.0f}%)")
        for label, cell in cells:
            print(f"| {n} | {dt} | {label} | {cell} | " + " | ".join(extra) + " |", flush=True)
        del t, ref
        torch.cuda.empty_cache()
    return 0


def backward_table(work: list, configs: list, baselines: bool, batches: int) -> int:
    """``--backward``'s table: the op's backward (per config) and SDPA flash's and cuDNN's, one dO."""
    from benchmarks.timing import gpu_time

    head = ["row", "dtype", "config", "tileops bwd"] + (["flash bwd", "cudnn bwd"] if baselines else [])
    print("| " + " | ".join(head) + " |  (TFLOP/s at 2.5x the forward's FLOPs, % of 989; us)", flush=True)
    for n, dt in work:
        row, dtype = ROWS[n], DTYPES[dt]
        t = inputs(row, dtype)
        kw = {k: v for k, v in t.items() if k.startswith("cu_")}
        dout = torch.randn(t["q"].shape, generator=torch.Generator(device="cuda").manual_seed(1), device="cuda",
                           dtype=dtype)
        f = 2.5 * flops(row)
        ref = None
        extra = []
        for backend in ("cudnn", "flash"):  # cuDNN's gradients are the reference of err when it serves the row
            if not (baselines or ref is None) or sdpa_fn(backend, row, t) is None:
                extra.append("-")
                continue
            call, grads = backward_call(lambda x, b=backend: sdpa_fn(b, row, x)(), t, dout)
            ref = grads if ref is None else ref
            us = gpu_time(lambda i, call=call: call(), 1, batches=batches, per_batch=3)[0]
            extra.append(f"{f / us / 1e6:.0f} ({100 * f / us / 1e6 / PEAK_TFLOPS:.0f}%, {us:.0f} us)")
        extra = extra[::-1] if baselines else []  # (flash, cudnn) as the header orders them
        for c in configs:
            op = make_op(row, c)
            label = config_label(c)
            try:
                call, got = backward_call(lambda x, op=op: op(x["q"], x["k"], x["v"], **kw), t, dout)
                torch.cuda.synchronize()
                label = config_label(c, op)
            except Exception as e:  # noqa: BLE001 - reported, and the sweep goes on
                cell = f"FAIL {type(e).__name__}: {str(e).splitlines()[0][:120]}"
            else:
                err = max(float((g.float() - r.float()).abs().max()) / max(float(r.float().abs().max()), 1e-30)
                          for g, r in zip(got, ref)) if ref is not None else float("nan")
                us = gpu_time(lambda i, call=call: call(), 1, batches=batches, per_batch=3)[0]
                tf = f / us / 1e6
                cell = f"{tf:.0f} ({100 * tf / PEAK_TFLOPS:.0f}%, {us:.0f} us, err {err:.2g})"
                rec = {"row": n, "dtype": dt, "config": label, "backward_us": us, "tflops": tf, "err": err}
                print(f"SWEEP {json.dumps(rec)}", flush=True)
            print(f"| {n} | {dt} | {label} | {cell} | " + " | ".join(extra) + " |", flush=True)
        del t, ref
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
