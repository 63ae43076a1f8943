"""Time tileops' ops against torch eager, torch.compile and Liger, with the copy rate as the ceiling.

    python -m benchmarks [--ops RoPEFwdOp,...] [--cases LABEL,...] [--out benchmarks/results]
    python -m benchmarks --schedules [--ops ...] [--cases ...]   # built-in against derived schedules

Workloads are the manifests' cases marked ``bench`` (each in its first dtype). Every timing is the
median of 200 calls timed with CUDA events, p20/p80 beside it, rotating through enough input sets
to exceed L2 three times (``benchmarks/timing.py``). Two ceilings, both timed in the same run: a
1 GiB device-to-device copy (the copy rate), and per row a copy of the same bytes, rotated the same
way, which pays the launch and ramp a small kernel pays. Results go to ``results/latest.{json,md}``, and
the figures and ``summary.md`` the docs page leads with are drawn from them (``benchmarks/plots.py``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from tileops.manifest import DTYPES, registry
from tileops.workloads import bytes_moved, op_class, workload

from . import plots
from .baselines import functional_baseline, liger_baseline, make_baseline
from .timing import copy_rate, gpu_time, graph_us_per_call, rotation, same_bytes_copy_us

HERE = Path(__file__).resolve().parent




def host_time_us(fn: Callable[[], Any], calls: int = 2000) -> float:
    """Host time of one call with the GPU idle: launches queue without waiting for the GPU."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        n = calls // 10
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
        torch.cuda.synchronize()
    return best * 1e6


def end_to_end_us(fn: Callable[[], Any], calls: int = 200) -> float:
    """Median wall time of one call including its completion (host + launch + kernel)."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def fresh_compile(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile(fn)`` with Dynamo's caches emptied first. One baseline function serves many
    rows; each new shape recompiles it, and past Dynamo's recompile limit (8) a call silently runs
    eagerly: the "compile" column then timed torch eager on every later row."""
    torch._dynamo.reset()
    return torch.compile(fn, dynamic=False)


def _bind(args: tuple, inputs: dict[str, torch.Tensor]) -> tuple:
    return (*inputs.values(), *args[len(inputs):])


def run(ops: list[str] | None, cases: list[str] | None, progress: bool = True) -> dict[str, Any]:
    ceiling = copy_rate()
    rows = []
    todo = [(m, c) for m in registry().values() if not ops or m.name in ops
            for c in m.cases if c.bench and (not cases or c.label in cases)]
    bar = None
    if progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(todo), desc="benchmarks", file=sys.stderr)
        except ImportError:
            pass
    for m, case in todo:
        dtype = case.dtypes[0]
        w = workload(m, case, dtype, "cuda")
        op = op_class(m.name)(**w.params)
        t0 = time.perf_counter()
        op(**w.inputs)
        torch.cuda.synchronize()
        first_call = time.perf_counter() - t0
        nbytes = bytes_moved(w)
        n = rotation(nbytes)
        sets = [w.inputs] + [workload(m, case, dtype, "cuda").inputs for _ in range(n - 1)]
        ours = gpu_time(lambda i: op(**sets[i]), n)  # no call waits for the host (positions included)
        base_fn, base_args = make_baseline(op, w.inputs)
        bargs = [_bind(base_args, x) for x in sets]
        eager = gpu_time(lambda i: base_fn(*bargs[i]), n)
        try:
            cfn = fresh_compile(base_fn)
            compiled = gpu_time(lambda i: cfn(*bargs[i]), n)
        except Exception as e:  # torch.compile may be unavailable (no compiler on the host)
            print(f"torch.compile failed on {case.label}: {e}", file=sys.stderr)
            compiled = (float("nan"),) * 3
        liger = None
        lg = liger_baseline(op, w.inputs)
        if lg is not None:
            lfn, _, calls = lg
            lsets = [liger_baseline(op, x)[1] for x in sets[: max(2, n // calls)]]
            t = gpu_time(lambda i: lfn(*lsets[i]), len(lsets))
            liger = tuple(v / calls for v in t)  # RoPE: it rotates q and k, two op calls' worth of bytes
        fn_time = None
        if functional_baseline(op, w.inputs) is not None:
            fsets = [functional_baseline(op, x) for x in sets]
            fn_time = gpu_time(lambda i: fsets[i][0](*fsets[i][1]), n)
        row = {
            "op": m.name, "family": m.family, "direction": "forward", "case": case.label, "dtype": dtype,
            "shape": [list(t.shape) for t in w.inputs.values()], "bytes": nbytes,
            "floor_us": nbytes / (ceiling * 1e9) * 1e6,
            "ours_us": ours, "eager_us": eager, "compile_us": compiled, "liger_us": liger, "fn_us": fn_time,
            "gbps": nbytes / (ours[0] * 1e-6) / 1e9,
            "first_call_s": first_call,
        }
        row["pct_copy"] = 100 * row["gbps"] / ceiling
        row["copy_us"] = same_bytes_copy_us(nbytes)
        row["pct_same_copy"] = 100 * row["copy_us"] / ours[0]
        if nbytes < (1 << 20) or case.label.endswith("small"):
            row["host_us"] = host_time_us(lambda: op(**w.inputs))
            row["end_to_end_us"] = end_to_end_us(lambda: op(**w.inputs))
        rows.append(row)
        if m.backward is not None:
            back = _backward_row(m, case, dtype, op, sets, base_fn, bargs, ceiling, n)
            back["copy_us"] = row["copy_us"] if back["bytes"] == nbytes else same_bytes_copy_us(back["bytes"])
            back["pct_same_copy"] = 100 * back["copy_us"] / back["ours_us"][0]
            rows.append(back)
        for r in rows[-2 if m.backward is not None else -1:]:  # a run cut short still leaves its rows in the log
            print("row " + json.dumps(r), file=sys.stderr, flush=True)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return {"meta": _meta(ceiling), "rows": rows}


def _grad_timer(fn: Callable[..., torch.Tensor], arg_sets: list[tuple], n: int,
                wrt: tuple[int, ...] = (0,)) -> tuple[float, float, float]:
    """GPU time of the backward alone: one graph per input set is built once, then
    ``autograd.grad(..., retain_graph=True)`` replays only the backward. The arguments at ``wrt``
    (x, and the key where one is given) require grad, and every output gets a gradient: a q+k call's
    backward rotates both gradients, as in training."""
    graphs = [_grad_call(fn, args, wrt) for args in arg_sets]  # (out, key_out) for a q+k call
    return gpu_time(lambda i: torch.autograd.grad(*graphs[i], retain_graph=True), n)


def _backward_bytes(m: Any, op: Any, inputs: dict[str, torch.Tensor], wrt: tuple[int, ...]) -> int:
    """Bytes the backward must move: each output's gradient read, each distinct gradient written
    (a norm's residual gets x's: one tensor), and each tensor ``backward.saves`` keeps read once.
    RoPE's backward rotates the gradient alone, the forward's bytes; a norm's also reads x (or h)."""
    def size(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    names = list(inputs)
    leaves = {names[i]: inputs[names[i]].detach().requires_grad_(True) for i in wrt}
    outs = op(**{**inputs, **leaves})
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = torch.autograd.grad(outs, list(leaves.values()), [torch.ones_like(o) for o in outs])
    made = {o.name: inputs[o.like] for o in m.outputs if inputs.get(o.like) is not None}
    saved = m.backward.saved(lambda k: inputs.get(k) is not None or k in made)
    return (sum(size(o) for o in outs) + sum(size(g) for g in {g.data_ptr(): g for g in grads}.values())
            + sum(size(inputs[k] if k in inputs else made[k]) for k in saved))


def _backward_row(m: Any, case: Any, dtype: str, op: Any, sets: list[dict], base_fn: Callable[..., Any],
                  bargs: list[tuple], ceiling: float, n: int) -> dict[str, Any]:
    """The backward of ``case``: the gradients of the inputs ``backward.wrt`` names that the case
    gives (x, RoPE's key, a norm's weight, bias and residual); bytes by :func:`_backward_bytes`."""
    names = list(sets[0])
    # the inputs that get a gradient (x, and key where the case gives one): the same positions in
    # our arguments and the baselines' (their inputs come first, in the op's order)
    wrt = tuple(i for i, k in enumerate(names) if k in m.backward.wrt and sets[0][k] is not None)
    ours = _grad_timer(lambda *args: op(**dict(zip(names, args))), [tuple(s_.values()) for s_ in sets], n, wrt)
    nbytes = _backward_bytes(m, op, sets[0], wrt)
    eager = _grad_timer(base_fn, bargs, n, wrt)
    try:
        compiled = _grad_timer(fresh_compile(base_fn), bargs, n, wrt)
    except Exception as e:  # torch.compile may be unavailable (no compiler on the host)
        print(f"torch.compile failed on {case.label} (backward): {e}", file=sys.stderr)
        compiled = (float("nan"),) * 3
    liger = None
    lg = liger_baseline(op, sets[0])
    if lg is not None:  # RoPE: Liger's backward rotates the gradients of q and k, two op calls' worth of bytes
        try:
            calls = lg[2]
            lsets = [liger_baseline(op, x)[1] for x in sets[: max(2, n // calls)]]
            liger = tuple(v / calls for v in _grad_timer(lg[0], lsets, len(lsets), (0, 1)))
        except Exception as e:  # noqa: BLE001 - Liger is optional; its backward is timed where it runs
            print(f"liger backward failed on {case.label}: {e}", file=sys.stderr)
    row = {"op": m.name, "family": m.family, "direction": "backward",
           "case": f"{case.label}{plots.BACKWARD_SUFFIX}", "dtype": dtype,
           "shape": [list(t.shape) for t in sets[0].values()], "bytes": nbytes,
           "floor_us": nbytes / (ceiling * 1e9) * 1e6, "ours_us": ours, "eager_us": eager, "compile_us": compiled,
           "liger_us": liger, "gbps": nbytes / (ours[0] * 1e-6) / 1e9, "first_call_s": float("nan")}
    row["pct_copy"] = 100 * row["gbps"] / ceiling
    if nbytes < (1 << 20) or case.label.endswith("small"):
        # decode sizes: the host time of one autograd backward (a bare one beside it: what any
        # differentiable op pays), and the backward kernels alone replayed from a CUDA graph
        graph, leaves, grads = _grad_call(lambda *args: op(**dict(zip(names, args))), tuple(sets[0].values()), wrt)
        row["host_us"] = host_time_us(lambda: torch.autograd.grad(graph, leaves, grads, retain_graph=True))
        bare = sets[0][names[wrt[0]]].detach().requires_grad_(True)
        doubled = bare * 2
        row["bare_grad_host_us"] = host_time_us(lambda: torch.autograd.grad(doubled, [bare], grads[0],
                                                                             retain_graph=True))
        saved = {**sets[0], **{o.name: t for o, t in zip(m.outputs, graph)}}
        row["graph_us"] = graph_us_per_call(lambda: op._eager_backward(tuple(grads), saved))
    return row


def _grad_call(fn: Callable[..., torch.Tensor], args: tuple, wrt: tuple[int, ...]) -> tuple[tuple, list, list]:
    """``(outputs, leaves, output gradients)`` of one call of ``fn`` on ``args`` whose arguments at
    ``wrt`` require grad: what ``torch.autograd.grad`` takes."""
    args = list(args)
    for i in wrt:
        args[i] = args[i].detach().requires_grad_(True)
    out = fn(*args)
    outs = out if isinstance(out, tuple) else (out,)
    return outs, [args[i] for i in wrt], [torch.randn_like(o) for o in outs]


def schedule_rows(ops: list[str] | None, cases: list[str] | None, rounds: int = 5,
                  dtypes: list[str] | None = None) -> list[dict[str, Any]]:
    """Issue 38's proof: each bench case of each op with a CUDA schedule space (``kernel.tune.cuda``), in
    its first dtype (or each of its dtypes named in ``dtypes``, ``["all"]`` for all: the dtype is part
    of a shape class, so a class tuned in a case's second dtype shows only so), served by
    ``target=BUILTIN`` (the manifest's ``kernel.static``) and by ``target=None`` (the tuned or shipped
    schedule of this device for the case's shape class), forward and, where the op has one, backward.
    The two ops are timed in turn in each of ``rounds`` rounds (each a :func:`gpu_time` median over
    the same rotated input sets): a row's figure is the median of its rounds, so that a drift of the
    shared machine reaches both alike."""
    from tileops.targets import BUILTIN

    rows = []
    todo = [(m, c) for m in registry().values() if (not ops or m.name in ops) and m.kernel.tune is not None
            and "cuda" in m.kernel.tune.spaces for c in m.cases if c.bench and (not cases or c.label in cases)]
    todo = [(m, c, dt) for m, c in todo
            for dt in (c.dtypes[:1] if not dtypes else [d for d in c.dtypes if "all" in dtypes or d in dtypes])]
    for m, case, dtype in todo:
        w = workload(m, case, dtype, "cuda")
        pair = {"built-in": op_class(m.name)(**w.params, target=BUILTIN), "derived": op_class(m.name)(**w.params)}
        n = rotation(bytes_moved(w))
        sets = [w.inputs] + [workload(m, case, dtype, "cuda").inputs for _ in range(n - 1)]
        names = list(sets[0])
        wrt = tuple(i for i, k in enumerate(names) if m.backward is not None and k in m.backward.wrt
                    and sets[0][k] is not None)
        for op in pair.values():
            op(**w.inputs)
        derived = pair["derived"].schedule

        def forward(op: Any) -> tuple[float, float, float]:
            return gpu_time(lambda i: op(**sets[i]), n)

        def backward(op: Any) -> tuple[float, float, float]:
            return _grad_timer(lambda *a: op(**dict(zip(names, a))), [tuple(x.values()) for x in sets], n, wrt)

        for direction, timer in (("forward", forward), ("backward", backward))[: 2 if wrt else 1]:
            got: dict[str, list[float]] = {k: [] for k in pair}
            for _ in range(rounds):
                for k, op in pair.items():
                    got[k].append(timer(op)[0])
            b, d = statistics.median(got["built-in"]), statistics.median(got["derived"])
            row = {"op": m.name, "case": case.label, "dtype": dtype, "direction": direction,
                   "class": derived.shape_class, "derived": str(derived), "source": derived.source,
                   "knobs": [list(k) for k in derived.knobs], "builtin_us": b, "derived_us": d,
                   "builtin_rounds": got["built-in"], "derived_rounds": got["derived"], "speedup": b / d}
            rows.append(row)
            print("schedule row " + json.dumps(row), file=sys.stderr, flush=True)
    return rows


def schedule_markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    out = ["# Built-in against derived schedules, side by side (`python -m benchmarks --schedules`)", "",
           f"{meta.get('gpu', '')}, {meta.get('date', '')}, commit {meta.get('commit', '')}. Each figure: the "
           "median of 5 rounds, the two ops timed in turn in each round (CUDA events over rotated input sets, "
           "as the main table). built-in: `target=BUILTIN`, the manifest's `kernel.static`; derived: "
           "`target=None`, the schedule this device's tuned or shipped table gives the case's shape class.", "",
           "| op | case | dtype | direction | derived schedule | source | built-in us | derived us "
           "| built-in / derived |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        knobs = ", ".join(f"{b}.{k}={v}" for b, k, v in r["knobs"]) or "(the built-in's)"
        out.append(f"| {r['op']} | {r['case']} | {r['dtype']} | {r['direction']} | {knobs} | {r['source']} | "
                   f"{r['builtin_us']:.2f} | {r['derived_us']:.2f} | {r['speedup']:.3f} |")
    return "\n".join(out) + "\n"


def _meta(ceiling: float) -> dict[str, Any]:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=HERE, check=False).stdout.strip()
    except OSError:
        commit = ""
    # TILEOPS_COMMIT wins: a copy of the tree without .git, or with stale git metadata (the device's copy)
    commit = os.environ.get("TILEOPS_COMMIT", "") or commit
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        driver = ""
    versions = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for mod in ("tilelang", "triton", "liger_kernel"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:
            pass
    return {"gpu": torch.cuda.get_device_name(), "driver": driver, "versions": versions, "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "copy_gbps": ceiling}


def markdown(result: dict[str, Any]) -> str:
    meta = result["meta"]
    lines = [f"GPU {meta['gpu']} (driver {meta['driver']}), "
             + ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
             + f", commit {meta['commit']}, {meta['date']}. Copy rate {meta['copy_gbps']:.0f} GB/s."]
    lines += [f"Rows of {', '.join(u['ops'])} re-measured later: commit {u['commit']}, {u['date']}, copy rate "
              f"{u['copy_gbps']:.0f} GB/s (`python -m benchmarks --splice`)." for u in meta.get("updated", [])]
    lines += ["",
             "| op | case | dtype | MB | floor us | ours us (p20-p80) | GB/s | % copy | same-bytes copy us "
             "| % same-bytes copy | eager us | compile us | liger us | torch fn us | x eager | x compile | x liger "
             "| x torch fn |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        o, e, c, lg, fn = r["ours_us"], r["eager_us"], r["compile_us"], r["liger_us"], r.get("fn_us")
        lig = f"{lg[0]:.1f}" if lg else "-"
        xl = f"{lg[0] / o[0]:.2f}" if lg else "-"
        lines.append(f"| {r['op']} | {r['case']} | {r['dtype']} | {r['bytes'] / 1e6:.1f} | {r['floor_us']:.1f} "
                     f"| {o[0]:.1f} ({o[1]:.1f}-{o[2]:.1f}) | {r['gbps']:.0f} | {r['pct_copy']:.0f} "
                     f"| {r.get('copy_us', float('nan')):.1f} | {r.get('pct_same_copy', float('nan')):.0f} | {e[0]:.1f} "
                     f"| {c[0]:.1f} | {lig} | {f'{fn[0]:.1f}' if fn else '-'} | {e[0] / o[0]:.1f} | {c[0] / o[0]:.2f} "
                     f"| {xl} | {f'{fn[0] / o[0]:.2f}' if fn else '-'} |")
    small = [r for r in result["rows"] if "host_us" in r]
    if small:
        def us(r: dict, key: str) -> str:
            return f"{r[key]:.1f}" if key in r else "-"

        lines += ["", "| op | case | host us / call (GPU idle) | end to end us / call | bare autograd.grad host us "
                      "| backward kernels in a CUDA graph, us / call |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['op']} | {r['case']} | {r['host_us']:.1f} | {us(r, 'end_to_end_us')} "
                  f"| {us(r, 'bare_grad_host_us')} | {us(r, 'graph_us')} |" for r in small]
    lines += ["", "| op | case | first call s (compile included) |", "|---|---|---|"]
    lines += [f"| {r['op']} | {r['case']} | {r['first_call_s']:.2f} |" for r in result["rows"]
              if r["first_call_s"] == r["first_call_s"]]  # backward rows have none (NaN)
    return "\n".join(lines) + "\n"


def splice(base: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``base`` with the rows of the ops ``new`` measured replaced by ``new``'s, where the first of
    them stood (a later run of a few ops, e.g. after a change to one op); ``meta['updated']`` records
    which rows come from which run, and the tables and figures say so."""
    ops = list(dict.fromkeys(r["op"] for r in new["rows"]))
    rows, placed = [], False
    for r in base["rows"]:
        if r["op"] in ops:
            if not placed:
                rows += new["rows"]
                placed = True
            continue
        rows.append(r)
    if not placed:
        rows += new["rows"]
    nm = new["meta"]
    updated = [u for u in base["meta"].get("updated", []) if not set(u["ops"]) <= set(ops)]
    updated.append({"ops": ops, "commit": nm["commit"], "date": nm["date"], "copy_gbps": nm["copy_gbps"]})
    return {"meta": {**base["meta"], "updated": updated}, "rows": rows}


def _write(result: dict[str, Any], out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / "latest.json").write_text(json.dumps(result, indent=1))
    md = markdown(result)
    (out / "latest.md").write_text(md)
    try:
        plots.write(result, out)
    except ImportError as e:  # matplotlib is in the bench extra; the results above are saved either way
        print(f"figures not drawn ({e}): pip install -e '.[bench]', then python -m benchmarks.plots", file=sys.stderr)
    return md


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks")
    p.add_argument("--ops", help="comma-separated op names (default: all)")
    p.add_argument("--cases", help="comma-separated case labels (default: all marked bench)")
    p.add_argument("--out", default=str(HERE / "results"), help="folder for latest.json/.md, figures, summary.md")
    p.add_argument("--splice", metavar="JSON", help="no run: replace the rows of the ops in JSON (a later run's "
                   "latest.json) in OUT/latest.json, and redraw the tables and figures")
    p.add_argument("--schedules", action="store_true", help="instead: each op with a CUDA schedule space, built-in "
                   "against derived schedule side by side (OUT/schedules.{json,md})")
    p.add_argument("--dtypes", help="with --schedules: comma-separated dtypes of each case to time, or 'all' "
                   "(default: each case's first)")
    args = p.parse_args(argv)
    dtypes = args.dtypes.split(",") if args.dtypes else None
    if dtypes and not set(dtypes) <= {"all", *DTYPES}:
        p.error(f"--dtypes: expected 'all' or dtypes from {', '.join(DTYPES)}, got {args.dtypes!r}")
    if dtypes and not args.schedules:
        p.error("--dtypes: expected with --schedules (the main table times each case in its first dtype)")
    if args.schedules:
        if not torch.cuda.is_available():
            print("benchmarks need a CUDA GPU", file=sys.stderr)
            return 2
        rows = schedule_rows(args.ops.split(",") if args.ops else None,
                             args.cases.split(",") if args.cases else None, dtypes=dtypes)
        meta = _meta(copy_rate())
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "schedules.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
        text = schedule_markdown(rows, meta)
        (out / "schedules.md").write_text(text)
        print(text)
        return 0
    if args.splice:
        out = Path(args.out)
        result = splice(json.loads((out / "latest.json").read_text()), json.loads(Path(args.splice).read_text()))
        print(_write(result, out))
        return 0
    if not torch.cuda.is_available():
        print("benchmarks need a CUDA GPU", file=sys.stderr)
        return 2
    result = run(args.ops.split(",") if args.ops else None, args.cases.split(",") if args.cases else None)
    print(_write(result, Path(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
