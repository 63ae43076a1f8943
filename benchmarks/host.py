"""Host time per eager call beside a bare torch elementwise op (issue 10 item 6: at most 1.2x).

    python -m benchmarks.serving --host [--device cpu|cuda]    (this table, and the graph row on CUDA)
    python -m benchmarks.hostprof [--device cpu|cuda]          (the layers, then a cProfile)

The serving calls of ``benchmarks.serving`` (ids q+k in place with positions, ids q alone, 2d q+k
on HF views, 2d q alone), each on both paths: the native extension's (:mod:`tileops.runtime.native`) and
the Python one (ops made with the extension off, as ``TILEOPS_NATIVE=0`` or a machine without a
compiler gets), next to the bare torch op that does the same kind of write (in place: ``x.add_``;
a new tensor: ``x.mul``) on a tensor of x's size. Each round times every contender once (the best
of three windows of calls), in turn, so drift on a shared host hits all of them; a row is the
median over the rounds. On a GPU the calls only queue (nothing waits for the kernels); on the CPU
the kernel runs inside the call, so the figure includes it (small sizes keep it short).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Callable

import torch

from tileops.op import Op

try:
    from tileops.runtime import native
except ImportError:
    native = None  # type: ignore[assignment]
if not hasattr(Op, "_native_run"):  # a tileops without the native path (measuring an older commit)
    native = None  # type: ignore[assignment]

from tileops.rope import RoPEFwdOp, RoPENeoxPositionIdsFwdOp

#: decode size on a GPU; on the CPU one token, whose kernel time stays small next to the host's
SIZES = {"cuda": dict(tokens=32, Hq=32, Hk=8, D=128, dtype=torch.bfloat16),
         "cpu": dict(tokens=1, Hq=2, Hk=1, D=128, dtype=torch.float32)}


def python_path() -> Any:
    """Ops made and called inside take the Python path (the native extension looks absent)."""
    return native.disabled() if native is not None else contextlib.nullcontext()


def native_available() -> bool:
    return native is not None and native.build() is not None


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


def cases(device: torch.device) -> tuple[list[tuple[str, Callable[[], Callable[[], Any]], str]], dict]:
    """``(name, make, bare)``: ``make()`` builds the ops and returns the call to time; ``bare`` names
    the torch op it is set beside. Inputs are shared by both paths."""
    s = SIZES[device.type]
    T, Hq, Hk, D, dt = s["tokens"], s["Hq"], s["Hk"], s["D"], s["dtype"]
    q = torch.randn(T, Hq, D, device=device, dtype=dt)
    k = torch.randn(T, Hk, D, device=device, dtype=dt)
    pos = torch.randint(0, 1 << 20, (T,), device=device)
    qh = torch.randn(1, Hq, T, D, device=device, dtype=dt)  # HF's [B, H, S, D]
    kh = torch.randn(1, Hk, T, D, device=device, dtype=dt)
    pos2 = pos[None]
    qt, kt = qh.transpose(1, 2), kh.transpose(1, 2)

    def ids_qk() -> Callable[[], Any]:
        op = RoPENeoxPositionIdsFwdOp(1 << 20)
        return lambda: op(q, pos, key=k, out=q, key_out=k)

    def ids_q() -> Callable[[], Any]:
        op = RoPENeoxPositionIdsFwdOp(1 << 20)
        return lambda: op(q, pos)

    def hf_qk() -> Callable[[], Any]:
        op = RoPEFwdOp(input_layout="2d")
        return lambda: op(qh.transpose(1, 2), position_ids=pos2, key=kh.transpose(1, 2))

    def hf_qk_views() -> Callable[[], Any]:
        op = RoPEFwdOp(input_layout="2d")
        return lambda: op(qt, position_ids=pos2, key=kt)

    def hf_q() -> Callable[[], Any]:
        op = RoPEFwdOp(input_layout="2d")
        return lambda: op(qh.transpose(1, 2))

    def hf_q_view() -> Callable[[], Any]:
        op = RoPEFwdOp(input_layout="2d")
        return lambda: op(qt)

    rows = [("ids q+k in place, positions", ids_qk, "add_"),
            ("ids q alone, new tensor, positions", ids_q, "mul"),
            ("2d q+k on HF views, new tensors, positions", hf_qk, "mul"),
            ("  the same, views made before the call", hf_qk_views, "mul"),
            ("2d q alone, new tensor", hf_q, "mul"),
            ("  the same, view made before the call", hf_q_view, "mul")]
    return rows, {**s, "dtype": str(dt).replace("torch.", "")}


def host_rows(device: torch.device, rounds: int = 7, calls: int | None = None) -> tuple[list[dict], dict]:
    """One row per call kind: host us on the native path, on the Python path, and the bare op's."""
    calls = calls or (2000 if device.type == "cuda" else 4000)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    x = torch.randn(SIZES[device.type]["tokens"], SIZES[device.type]["Hq"], SIZES[device.type]["D"],
                    device=device, dtype=SIZES[device.type]["dtype"])
    bare = {"add_": lambda: x.add_(1.0), "mul": lambda: x.mul(2.0)}
    have_native = native_available()
    specs, size = cases(device)
    contenders: list[tuple[str, str, Callable[[], Any], bool]] = []  # (row, kind, fn, python path)
    for name, make, bare_name in specs:
        with python_path():
            fn = make()
            for _ in range(3):  # the first call makes the plans
                fn()
        contenders.append((name, "python", fn, True))
        if have_native:
            fn = make()
            for _ in range(3):
                fn()
            contenders.append((name, "native", fn, False))
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):
        for b, fn in bare.items():
            times.setdefault(("bare", b), []).append(window_us(fn, sync, calls))
        for name, kind, fn, py in contenders:
            ctx = python_path() if py else contextlib.nullcontext()
            with ctx:
                times.setdefault((name, kind), []).append(window_us(fn, sync, calls))
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = []
    for name, _, bare_name in specs:
        b = med[("bare", bare_name)]
        row = {"row": name, "bare": bare_name, "bare_host_us": b, "python_host_us": med[(name, "python")]}
        if have_native:
            row["native_host_us"] = med[(name, "native")]
        rows.append(row)
    return rows, {**size, "device": str(device), "rounds": rounds, "calls": calls, "native": have_native,
                  "native_status": native.status() if native is not None else "absent"}


def markdown(rows: list[dict], info: dict) -> str:
    out = [f"Host time per call on {info['device']} ({info['tokens']} tokens, {info['Hq']}/{info['Hk']} heads, "
           f"D {info['D']}, {info['dtype']}; median of {info['rounds']} rounds, each the best of 3 windows of "
           f"{info['calls']} calls; native extension: {info['native_status']}):", "",
           "| call | native us | ratio | Python path us | ratio | bare op | its us |", "|---|---|---|---|---|---|---|"]
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
    dispatch alone, and on the Python path ``Op._eager_call``."""
    calls = calls or (2000 if device.type == "cuda" else 4000)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    s = SIZES[device.type]
    q = torch.randn(s["tokens"], s["Hq"], s["D"], device=device, dtype=s["dtype"])
    k = torch.randn(s["tokens"], s["Hk"], s["D"], device=device, dtype=s["dtype"])
    pos = torch.randint(0, 1 << 20, (s["tokens"],), device=device)
    qt = torch.randn(1, s["Hq"], s["tokens"], s["D"], device=device, dtype=s["dtype"]).transpose(1, 2)
    x = q.clone()
    fns: list[tuple[str, Callable[[], Any], bool]] = [("bare x.add_(1.0)", lambda: x.add_(1.0), False),
                                                      ("bare x.mul(2.0)", lambda: x.mul(2.0), False)]
    have_native = native_available()
    for kind in (["native"] if have_native else []) + ["python"]:
        py = kind == "python"
        with python_path() if py else contextlib.nullcontext():
            ids = RoPENeoxPositionIdsFwdOp(1 << 20)
            hf = RoPEFwdOp(input_layout="2d")
            d1, o1 = {"x": q, "position_ids": pos, "key": k}, {"out": q, "key_out": k}
            d2, o2 = {"x": qt, "position_ids": None, "key": None}, {"out": None, "key_out": None}
            for _ in range(3):
                ids(q, pos, key=k, out=q, key_out=k)
                hf(qt)
            fns += [(f"{kind}: ids q+k in place: op(...)", lambda ids=ids: ids(q, pos, key=k, out=q, key_out=k), py),
                    (f"{kind}: ids q+k in place: op.forward(...)",
                     lambda ids=ids: ids.forward(q, pos, key=k, out=q, key_out=k), py),
                    (f"{kind}: ids q+k in place: op._call(dicts)", lambda ids=ids: ids._call(d1, o1), py),
                    (f"{kind}: 2d q alone: op(...)", lambda hf=hf: hf(qt), py),
                    (f"{kind}: 2d q alone: op._call(dicts)", lambda hf=hf: hf._call(d2, o2), py)]
            if py:
                fns += [("python: ids q+k in place: op._eager_call(dicts)", lambda ids=ids: ids._eager_call(d1, o1), py),
                        ("python: 2d q alone: op._eager_call(dicts)", lambda hf=hf: hf._eager_call(d2, o2), py)]
            else:
                fns += [("native: ids q+k in place: dispatch.run(dicts)", lambda ids=ids: ids._native_run(d1, o1), py),
                        ("native: 2d q alone: dispatch.run(dicts)", lambda hf=hf: hf._native_run(d2, o2), py)]
    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, fn, py in fns:
            with python_path() if py else contextlib.nullcontext():
                times.setdefault(name, []).append(window_us(fn, sync, calls))
    return [(name, statistics.median(times[name])) for name, _, _ in fns]
