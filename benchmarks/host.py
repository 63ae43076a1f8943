"""Host time per eager call beside a bare torch elementwise op (issue 10 item 6: at most 1.2x).

    python -m benchmarks.serving --host [--device cpu|cuda]    (this table, and the graph row on CUDA)
    python -m benchmarks.hostprof [--device cpu|cuda]          (the layers, then a cProfile)

The serving calls of ``benchmarks.serving`` (ids q+k in place with positions, ids q alone, 2d q+k
on HF views, 2d q alone), each on both runtimes: the native extension's (:mod:`tileops.runtime.native`)
and the Python one (ops given :class:`tileops.runtime.executor.PythonRuntime`, what ``TILEOPS_NATIVE=0``
or a machine without a compiler gets), next to the bare torch op that does the same kind of write
(in place: ``x.add_``; a new tensor: ``x.mul``) on a tensor of x's size; the q+k rows with new
outputs also beside ``torch.empty_like(q)``, ``torch.empty_like(k)`` and one ``x.mul`` together,
what any such call must do at least. The HF-view row (the two ``transpose`` calls that make the views
inside the timed call) is also set beside the bare op that makes the same two views, then ``x.mul``:
the views are the caller's, a whole torch op each, which the plain ``mul`` does not make. The
``bhsd`` row is the call a patched model makes now: ``input_layout="bhsd"`` takes HF's q and k as
they come (transposes of ``[B, S, H, D]`` projections), so no view is made at all. Two more
rows take the q+k call on views made before apart: without positions (no value checked, so no error
word and no event) and in place (no new output). The last row is the example family of
``docs/examples/scale_family`` (a copy generated in a temporary directory and measured in a process
of its own, the family being on its ``TILEOPS_FAMILY_PATH``): a second family's eager calls through
the same runtime, which names no family. Each round times every contender once (the best of three
windows of calls), in turn, so drift on a shared host hits all of them; a row is the median over
the rounds. On a GPU the calls only queue (nothing waits for the kernels); on the CPU the kernel
runs inside the call, so the figure includes it (small sizes keep it short).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from tileops.runtime import executor, native
from tileops.rope import RoPEFwdOp, RoPENeoxPositionIdsFwdOp

ROOT = Path(__file__).resolve().parent.parent

#: decode size on a GPU; on the CPU one token, whose kernel time stays small next to the host's
SIZES = {"cuda": dict(tokens=32, Hq=32, Hk=8, D=128, dtype=torch.bfloat16),
         "cpu": dict(tokens=1, Hq=2, Hk=1, D=128, dtype=torch.float32)}

Make = Callable[[Callable[[Any], Any]], Callable[[], Any]]


def on_python(op: Any) -> Any:
    """``op`` served by the Python runtime (as without the extension)."""
    op._use_runtime(executor.PythonRuntime(op._handle))
    return op


def native_available() -> bool:
    return native.module is not None


def window_us(fn: Callable[[], Any], sync: Callable[[], None], calls: int) -> float:
    """Host time of one call: the best of three windows of ``calls`` calls (launches only queue)."""
    best = float("inf")
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    sync()
    return best * 1e6


def cases(device: torch.device) -> tuple[list[tuple[str, Make, str]], dict, dict]:
    """``(name, make, bare)``: ``make(on)`` builds the ops (each passed through ``on``, which picks
    the runtime) and returns the call to time; ``bare`` names the torch op it is set beside, of
    ``bares``. Inputs are shared by both runtimes."""
    s = SIZES[device.type]
    T, Hq, Hk, D, dt = s["tokens"], s["Hq"], s["Hk"], s["D"], s["dtype"]
    q = torch.randn(T, Hq, D, device=device, dtype=dt)
    k = torch.randn(T, Hk, D, device=device, dtype=dt)
    pos = torch.randint(0, 1 << 20, (T,), device=device)
    qh = torch.randn(1, Hq, T, D, device=device, dtype=dt)  # HF's [B, H, S, D]
    kh = torch.randn(1, Hk, T, D, device=device, dtype=dt)
    pos2 = pos[None]
    qt, kt = qh.transpose(1, 2), kh.transpose(1, 2)
    # what a patched model's apply_rotary_pos_emb gets: [B, H, S, D] transposes of its projections
    qp = torch.randn(1, T, Hq, D, device=device, dtype=dt).transpose(1, 2)
    kp = torch.randn(1, T, Hk, D, device=device, dtype=dt).transpose(1, 2)
    x = q.clone()

    def ids_qk(on: Callable[[Any], Any]) -> Callable[[], Any]:
        op = on(RoPENeoxPositionIdsFwdOp(1 << 20))
        return lambda: op(q, pos, key=k, out=q, key_out=k)

    def ids_q(on: Callable[[Any], Any]) -> Callable[[], Any]:
        op = on(RoPENeoxPositionIdsFwdOp(1 << 20))
        return lambda: op(q, pos)

    def hf_qk(on: Callable[[Any], Any]) -> Callable[[], Any]:
        op = on(RoPEFwdOp(input_layout="2d"))
        return lambda: op(qh.transpose(1, 2), position_ids=pos2, key=kh.transpose(1, 2))

    def hf_qk_bhsd(on: Callable[[Any], Any]) -> Callable[[], Any]:
        op = on(RoPEFwdOp(input_layout="bhsd"))
        return lambda: op(qp, position_ids=pos2, key=kp)

    def hf_qk_views(on: Callable[[Any], Any]) -> Callable[[], Any]:
        op = on(RoPEFwdOp(input_layout="2d"))
        return lambda: op(qt, position_ids=pos2, key=kt)

    def hf_qk_views_no_pos(on: Callable[[Any], Any]) -> Callable[[], Any]:
        op = on(RoPEFwdOp(input_layout="2d"))
        return lambda: op(qt, key=kt)

    qi, ki = qh.clone().transpose(1, 2), kh.clone().transpose(1, 2)  # rotated in place, call after call

    def hf_qk_in_place(on: Callable[[Any], Any]) -> Callable[[], Any]:
        op = on(RoPEFwdOp(input_layout="2d"))
        return lambda: op(qi, position_ids=pos2, key=ki, out=qi, key_out=ki)

    def hf_q(on: Callable[[Any], Any]) -> Callable[[], Any]:
        op = on(RoPEFwdOp(input_layout="2d"))
        return lambda: op(qh.transpose(1, 2))

    def hf_q_view(on: Callable[[Any], Any]) -> Callable[[], Any]:
        op = on(RoPEFwdOp(input_layout="2d"))
        return lambda: op(qt)

    bares = {"add_": lambda: x.add_(1.0), "mul": lambda: x.mul(2.0),
             "2 empty_like + mul": lambda: (torch.empty_like(qt), torch.empty_like(kt), x.mul(2.0)),
             "2 transpose + mul": lambda: (qh.transpose(1, 2), kh.transpose(1, 2), x.mul(2.0))}
    rows = [("ids q+k in place, positions", ids_qk, "add_"),
            ("ids q alone, new tensor, positions", ids_q, "mul"),
            ("2d q+k on HF views, new tensors, positions", hf_qk, "mul"),
            ("  the same, beside a bare op that makes the same two views", hf_qk, "2 transpose + mul"),
            ("  the same, views made before the call", hf_qk_views, "mul"),
            ("  the same, beside what it must do at least", hf_qk_views, "2 empty_like + mul"),
            ("  views made before, no positions", hf_qk_views_no_pos, "mul"),
            ("  views made before, in place", hf_qk_in_place, "add_"),
            ("bhsd q+k on HF's q and k as they come (the patch's call), new tensors, positions", hf_qk_bhsd,
             "mul"),
            ("2d q alone, new tensor", hf_q, "mul"),
            ("  the same, view made before the call", hf_q_view, "mul")]
    return rows, bares, {**s, "dtype": str(dt).replace("torch.", "")}


def _measure(specs: list[tuple[str, Make, str]], bares: dict, device: torch.device, rounds: int,
             calls: int) -> list[dict]:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    have_native = native_available()
    contenders: dict[tuple[Make, str], Callable[[], Any]] = {}  # a call set beside two bare ops is timed once
    for _, make, _ in specs:
        for kind, on in [("python", on_python)] + ([("native", lambda op: op)] if have_native else []):
            if (make, kind) not in contenders:
                fn = contenders[make, kind] = make(on)
                for _ in range(3):  # the first call binds the signature
                    fn()
    times: dict[Any, list[float]] = {}
    for _ in range(rounds):
        for b, fn in bares.items():
            times.setdefault(("bare", b), []).append(window_us(fn, sync, calls))
        for key, fn in contenders.items():
            times.setdefault(key, []).append(window_us(fn, sync, calls))
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = []
    for name, make, bare_name in specs:
        row = {"row": name, "bare": bare_name, "bare_host_us": med[("bare", bare_name)],
               "python_host_us": med[(make, "python")]}
        if have_native:
            row["native_host_us"] = med[(make, "native")]
        rows.append(row)
    return rows


def host_rows(device: torch.device, rounds: int = 7, calls: int | None = None,
              scale: bool = True) -> tuple[list[dict], dict]:
    """One row per call kind: host us on the native runtime, on the Python one, and the bare op's;
    with ``scale``, the example family's row last (None in its place where it cannot be made)."""
    calls = calls or (2000 if device.type == "cuda" else 4000)
    specs, bares, size = cases(device)
    rows = _measure(specs, bares, device, rounds, calls)
    if scale:
        got = scale_row(device, rounds, calls)
        if got is not None:
            rows.append(got)
    return rows, {**size, "device": str(device), "rounds": rounds, "calls": calls, "native": native_available(),
                  "native_status": native.status()}


def _scale_cases(device: torch.device) -> tuple[list[tuple[str, Make, str]], dict]:
    """The example family's call (a process whose ``TILEOPS_FAMILY_PATH`` names it)."""
    from tileops.scale import ScaleFwdOp  # type: ignore[import-not-found]

    s = SIZES[device.type]
    x = torch.randn(s["tokens"] * s["Hq"] * s["D"], device=device, dtype=s["dtype"])

    def scale(on: Callable[[Any], Any]) -> Callable[[], Any]:
        op = on(ScaleFwdOp(c=0.5))
        return lambda: op(x)

    return [("scale family (docs/examples): 1d x, new tensor", scale, "mul")], {"mul": lambda: x.mul(2.0)}


def scale_row(device: torch.device, rounds: int, calls: int) -> dict | None:
    """The example family's row, measured in a process of its own (the family on its path)."""
    with tempfile.TemporaryDirectory(prefix="tileops-scale-") as tmp:
        family = Path(tmp) / "scale_family"
        shutil.copytree(ROOT / "docs" / "examples" / "scale_family", family,
                        ignore=shutil.ignore_patterns("ops.py", "__pycache__"))
        env = {**os.environ, "TILEOPS_FAMILY_PATH": str(family)}
        gen = subprocess.run([sys.executable, "-m", "tileops", "generate", "scale"], env=env, cwd=ROOT,
                             capture_output=True, text=True)
        run = subprocess.run([sys.executable, "-m", "benchmarks.host", "--scale", device.type, str(rounds), str(calls)],
                             env=env, cwd=ROOT, capture_output=True, text=True) if gen.returncode == 0 else gen
    if run.returncode != 0:
        print(f"the scale family's row: {(run.stderr or run.stdout).strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return json.loads(run.stdout.strip().splitlines()[-1])


def markdown(rows: list[dict], info: dict) -> str:
    out = [f"Host time per call on {info['device']} ({info['tokens']} tokens, {info['Hq']}/{info['Hk']} heads, "
           f"D {info['D']}, {info['dtype']}; median of {info['rounds']} rounds, each the best of 3 windows of "
           f"{info['calls']} calls; native runtime: {info['native_status']}):", "",
           "| call | native us | ratio | Python runtime us | ratio | bare op | its us |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        b = r["bare_host_us"]
        nat = r.get("native_host_us")
        n_us, n_ratio = (f"{nat:.2f}", f"{nat / b:.2f}x") if nat is not None else ("-", "-")
        out.append(f"| {r['row']} | {n_us} | {n_ratio} | {r['python_host_us']:.2f} | {r['python_host_us'] / b:.2f}x "
                   f"| `{r['bare']}` | {b:.2f} |")
    return "\n".join(out) + "\n"


def layers(device: torch.device, rounds: int = 7, calls: int | None = None) -> list[tuple[str, float]]:
    """What each layer between ``op(...)`` and the launch adds, for the ids q+k in-place call and
    the 2d q alone call: the full call, ``forward``, ``Op._call`` (dicts built outside), the native
    runtime's ``run`` alone, and on the Python runtime ``Op._eager_call``."""
    calls = calls or (2000 if device.type == "cuda" else 4000)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    s = SIZES[device.type]
    q = torch.randn(s["tokens"], s["Hq"], s["D"], device=device, dtype=s["dtype"])
    k = torch.randn(s["tokens"], s["Hk"], s["D"], device=device, dtype=s["dtype"])
    pos = torch.randint(0, 1 << 20, (s["tokens"],), device=device)
    qt = torch.randn(1, s["Hq"], s["tokens"], s["D"], device=device, dtype=s["dtype"]).transpose(1, 2)
    x = q.clone()
    fns: list[tuple[str, Callable[[], Any]]] = [("bare x.add_(1.0)", lambda: x.add_(1.0)),
                                                ("bare x.mul(2.0)", lambda: x.mul(2.0))]
    for kind in (["native"] if native_available() else []) + ["python"]:
        on = on_python if kind == "python" else (lambda op: op)
        ids = on(RoPENeoxPositionIdsFwdOp(1 << 20))
        hf = on(RoPEFwdOp(input_layout="2d"))
        d1, o1 = {"x": q, "position_ids": pos, "key": k}, {"out": q, "key_out": k}
        d2, o2 = {"x": qt, "position_ids": None, "key": None}, {"out": None, "key_out": None}
        for _ in range(3):
            ids(q, pos, key=k, out=q, key_out=k)
            hf(qt)
        fns += [(f"{kind}: ids q+k in place: op(...)", lambda ids=ids: ids(q, pos, key=k, out=q, key_out=k)),
                (f"{kind}: ids q+k in place: op.forward(...)",
                 lambda ids=ids: ids.forward(q, pos, key=k, out=q, key_out=k)),
                (f"{kind}: ids q+k in place: op._call(dicts)", lambda ids=ids: ids._call(d1, o1)),
                (f"{kind}: 2d q alone: op(...)", lambda hf=hf: hf(qt)),
                (f"{kind}: 2d q alone: op._call(dicts)", lambda hf=hf: hf._call(d2, o2))]
        if kind == "python":
            fns += [("python: ids q+k in place: op._eager_call(dicts)", lambda ids=ids: ids._eager_call(d1, o1)),
                    ("python: 2d q alone: op._eager_call(dicts)", lambda hf=hf: hf._eager_call(d2, o2))]
        else:
            fns += [("native: ids q+k in place: runtime.run(dicts)", lambda ids=ids: ids._native_run(d1, o1)),
                    ("native: 2d q alone: runtime.run(dicts)", lambda hf=hf: hf._native_run(d2, o2))]
    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, fn in fns:
            times.setdefault(name, []).append(window_us(fn, sync, calls))
    return [(name, statistics.median(times[name])) for name, _ in fns]


if __name__ == "__main__":  # python -m benchmarks.host --scale DEVICE ROUNDS CALLS: the scale row, as JSON
    if sys.argv[1:2] != ["--scale"] or len(sys.argv) != 5:
        sys.exit("usage: python -m benchmarks.host --scale cpu|cuda ROUNDS CALLS (run by host_rows)")
    dev = torch.device(sys.argv[2])
    specs, bares = _scale_cases(dev)
    print(json.dumps(_measure(specs, bares, dev, int(sys.argv[3]), int(sys.argv[4]))[0]))
