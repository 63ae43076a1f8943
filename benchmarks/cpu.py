"""What a CPU call costs: tileops on the CPU against torch eager, side by side in one run.

    python -m benchmarks.cpu [--quick] [--out benchmarks/results]

Rows: every op's first manifest case (the demo's workload, shrunk for the CPU as ``tileops demo``
shrinks it) in each dtype it allows, and RoPEFwdOp (2d, neox) at small and large shapes, among
them the four a user reported (fp32 and bf16 ``[4, 2048, 32, 128]``, fp32 ``[2, 128, 8, 64]``,
fp16 ``[2, 32, 32, 128]``); each forward (``fwd``) and forward + backward (``fwd+bwd``: the float
inputs' gradients by ``torch.autograd.grad`` from fixed random output gradients).

Columns, timed in the same rounds (one sample of each per round, in turn, each round starting with
the next column, so that the machine's load
falls on all of them alike): ``target=None`` (what a user gets: ``op.serving_target`` names what
served it), ``BUILTIN`` (the C kernel, forced), the ``torch`` target, and torch eager: HF
transformers' ``apply_rotary_pos_emb`` (``x * cos + rotate_half(x) * sin`` in fp32, one cast back)
with cos/sin precomputed in fp32 outside the timed region, as a model caches them
(``benchmarks/baselines.py``, the GPU benchmark's eager column). Each figure is the median of the
rounds (at least 7, up to 101 within ``--budget`` seconds per row) after two warm-up calls; a round
times a batch of calls of at least ~0.5 ms (one call when a call takes longer). Ratios are
eager's time over the column's (> 1: faster than eager). Results: ``cpu.md`` and ``cpu.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from tileops import schedules
from tileops.manifest import registry
from tileops.targets import BUILTIN
from tileops.workloads import SHORT, op_class, workload

from .baselines import make_baseline

HERE = Path(__file__).resolve().parent
DTYPES = ("float32", "bfloat16", "float16")
#: RoPEFwdOp 2d shapes [batch, seq, heads, head_dim]: decode- and prefill-sized, and the reported ones
SHAPES = [(1, 1, 32, 128), (2, 32, 32, 128), (2, 128, 8, 64), (1, 512, 32, 128), (4, 2048, 32, 128)]
COLUMNS = ("none", "builtin", "torch", "eager")


def cpu_model() -> str:
    return schedules.cpu_model()


def _workloads(quick: bool) -> list[tuple[str, Any, dict[str, Any], dict[str, torch.Tensor]]]:
    """(op name, manifest, params, inputs) per row."""
    rows = []
    for name, m in registry().items():
        case = m.cases[0]
        for dtype in (d for d in DTYPES if d in case.dtypes):
            w = workload(m, case, dtype, "cpu", shrink=True)
            rows.append((name, f"{case.label}-{SHORT[dtype]}", w.params, w.inputs))
    m = registry()["RoPEFwdOp"]
    for shape in SHAPES[:3] if quick else SHAPES:
        for dtype in DTYPES:
            x = torch.randn(shape).to(getattr(torch, dtype))
            rows.append(("RoPEFwdOp", f"2d-{'x'.join(map(str, shape))}-{SHORT[dtype]}",
                         m.defaults() | {"input_layout": "2d"}, {"x": x}))
    return rows


def _fwd(fn: Callable[..., Any], inputs: dict[str, torch.Tensor]) -> Callable[[], Any]:
    return lambda: fn(**inputs)


def _fwd_bwd(fn: Callable[..., Any], inputs: dict[str, torch.Tensor]) -> Callable[[], Any]:
    """Forward, then the gradients of the float inputs from fixed output gradients. ``autograd.grad``,
    not ``backward``: nothing is accumulated into ``.grad``, a pass that is no part of the op."""
    leaves = {k: (v.detach().clone().requires_grad_(True) if v.is_floating_point() else v) for k, v in inputs.items()}
    wrt = [v for v in leaves.values() if v.requires_grad]
    out = fn(**leaves)
    grads = [torch.randn_like(o) for o in (out if isinstance(out, tuple) else (out,))]

    def step() -> None:
        got = fn(**leaves)
        torch.autograd.grad(got if isinstance(got, tuple) else (got,), wrt, grads)

    return step


def _eager(op: Any, inputs: dict[str, torch.Tensor]) -> Callable[..., Any]:
    """HF-style eager on inputs named as the op's, with cos/sin (and any table) bound once."""
    fn, args = make_baseline(op, inputs)
    names, rest = list(inputs), args[len(inputs):]
    return lambda **t: fn(*(t[n] for n in names), *rest)


def _batch(fn: Callable[[], Any]) -> int:
    """Calls per timed sample: enough for ~0.5 ms, well above the timer's resolution, and short, so
    that a sample the scheduler interrupts is one the median drops."""
    t0 = time.perf_counter()
    fn()
    one = time.perf_counter() - t0
    return max(1, min(100, int(5e-4 / max(one, 1e-7))))


def time_side_by_side(fns: dict[str, Callable[[], Any]], budget_s: float) -> dict[str, float]:
    """Median seconds per call of each function, timed in interleaved rounds after two warm-ups."""
    for fn in fns.values():
        fn(), fn()
    batch = {k: _batch(fn) for k, fn in fns.items()}
    samples: dict[str, list[float]] = {k: [] for k in fns}
    t_end = time.perf_counter() + budget_s
    rounds = 0
    names = list(fns)
    while rounds < 7 or (time.perf_counter() < t_end and rounds < 101):
        # each round starts with the next column: the first of a round ran 1.3-1.5x slower on
        # ~100 us calls (target=None and BUILTIN, the same code, measured 0.83x and 1.25x eager
        # with target=None always first)
        for k in names[rounds % len(names):] + names[:rounds % len(names)]:
            fn = fns[k]
            n = batch[k]
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            samples[k].append((time.perf_counter() - t0) / n)
        rounds += 1
    return {k: statistics.median(v) for k, v in samples.items()}


def run(quick: bool = False, budget_s: float = 1.5) -> dict[str, Any]:
    rows = []
    before = machine()
    for name, label, params, inputs in _workloads(quick):
        cls = op_class(name)
        ops = {"none": cls(**params), "builtin": cls(**params, target=BUILTIN), "torch": cls(**params, target="torch")}
        eager = _eager(ops["none"], inputs)
        for direction, wrap in (("fwd", _fwd), ("fwd+bwd", _fwd_bwd)):
            fns = {k: wrap(op, inputs) for k, op in ops.items()}
            fns["eager"] = wrap(eager, inputs)
            t = time_side_by_side(fns, budget_s)
            shape = "x".join(map(str, inputs["x"].shape))
            row = {"op": name, "case": label, "shape": shape, "dir": direction,
                   "serving_target": ops["none"].serving_target, "us": {k: t[k] * 1e6 for k in COLUMNS}}
            rows.append(row)
            print(f"{name:24s} {label:28s} {direction:8s} {row['serving_target']:8s} "
                  + "  ".join(f"{k} {row['us'][k]:10.1f}" for k in COLUMNS)
                  + f"  none/eager {t['eager'] / t['none']:.2f}x", flush=True)
    return {"machine": before, "load_average_1min_after": machine()["load_average_1min"], "date": datetime.date.today().isoformat(), "rows": rows,
            "command": "python -m benchmarks.cpu" + (" --quick" if quick else "")}


def machine() -> dict[str, Any]:
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
            "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def _us(v: float) -> str:
    return f"{v:.1f}" if v < 1000 else f"{v / 1000:.2f} ms"


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [  # no heading: the page that includes the table has its own (docs/benchmarks.md)
        f"Measured on {m['cpu']}, {m['cores']} cores, torch {m['torch']} with {m['torch_threads']} intra-op "
        f"threads, {result['date']}, by `{result['command']}`; the machine was shared with other work "
        f"(1-minute load average {m['load_average_1min']:.1f} before the run, "
        f"{result['load_average_1min_after']:.1f} after), so figures carry noise, torch's multi-threaded "
        f"ops most (a thread descheduled at a barrier stalls the op); every column of a row was timed in "
        f"the same interleaved rounds. Times are medians per "
        f"call in microseconds. `target=None` is what a user gets (`served by` names the target its "
        f"rule picked); `BUILTIN` forces the C kernel; `torch` is the plain-PyTorch target; eager is HF's "
        f"`x * cos + rotate_half(x) * sin` in fp32 with cos/sin precomputed outside the timed region. "
        f"Ratios are eager's time over the column's: above 1 is faster than eager.",
        "",
        "| op | case | shape | pass | served by | target=None | BUILTIN (C) | torch target | eager | None vs eager | BUILTIN vs eager |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        us = r["us"]
        lines.append(f"| {r['op']} | {r['case']} | {r['shape']} | {r['dir']} | {r['serving_target']} | "
                     f"{_us(us['none'])} | {_us(us['builtin'])} | {_us(us['torch'])} | {_us(us['eager'])} | "
                     f"{us['eager'] / us['none']:.2f}x | {us['eager'] / us['builtin']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="only the smaller RoPEFwdOp shapes")
    p.add_argument("--budget", type=float, default=1.5, help="seconds of rounds per row (at least 7 rounds)")
    p.add_argument("--out", type=Path, default=HERE / "results")
    args = p.parse_args(argv)
    result = run(args.quick, args.budget)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cpu.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "cpu.md").write_text(markdown(result))
    print(f"wrote {args.out / 'cpu.md'} and {args.out / 'cpu.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
