"""Serving-shaped rows on a GPU: q and k in one launch on HF-layout views, decode under CUDA graphs,
the position-ids op without a host sync, and host time per call.

    python -m benchmarks.serving [--out benchmarks/results]
    python -m benchmarks.serving --host [--device cpu|cuda]

``--host`` prints only host time per call (``benchmarks/host.py``: each serving call on the native
and the Python path beside a bare torch op; on the CPU too) and, on a GPU, the decode graph row.

Every row times tileops and its alternatives side by side in one run (medians; the machines are
shared and noisy). Copy rates: a large device-to-device copy, and one of the same bytes as the row.
Writes ``serving.md`` and ``serving.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import torch

from tileops.rope import RoPEFwdOp, RoPENeoxPositionIdsFwdOp

from . import host, plots
from .baselines import _rotate_half
from .runner import fresh_compile, end_to_end_us, host_time_us as host_us
from .timing import copy_rate, gpu_time, graph_us_per_call, rotation, same_bytes_copy_us

HERE = Path(__file__).resolve().parent


def hf_apply(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
    """HF's ``apply_rotary_pos_emb`` (q, k ``[B, H, S, D]``; cos, sin ``[B, S, D]``)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def qk_row(name: str, B: int, Hq: int, Hk: int, S: int, D: int, dtype: torch.dtype, in_place: bool,
           layout: str = "2d") -> dict:
    """q and k in HF's [B, H, S, D], rotated in one launch: through transposed views made in the call
    (``layout="2d"``), or as they are (``"bhsd"``, what a patched model calls)."""
    op = RoPEFwdOp(input_layout=layout)
    nbytes = 2 * (Hq + Hk) * B * S * D * torch.tensor([], dtype=dtype).element_size()
    n = rotation(nbytes)
    qs = [torch.randn(B, Hq, S, D, device="cuda", dtype=dtype) for _ in range(n)]
    ks = [torch.randn(B, Hk, S, D, device="cuda", dtype=dtype) for _ in range(n)]
    pos = torch.arange(S, device="cuda")

    def ours(i: int) -> Any:
        q, k = (qs[i], ks[i]) if layout == "bhsd" else (qs[i].transpose(1, 2), ks[i].transpose(1, 2))
        if in_place:
            return op(q, position_ids=pos, key=k, out=q, key_out=k)
        return op(q, position_ids=pos, key=k)

    inv = 10000.0 ** (-torch.arange(0, D, 2, device="cuda", dtype=torch.float64) / D)
    ang = pos.double()[:, None] * inv
    cos = torch.cat((ang.cos(), ang.cos()), -1)[None].to(dtype).expand(B, S, D)
    sin = torch.cat((ang.sin(), ang.sin()), -1)[None].to(dtype).expand(B, S, D)
    compiled = fresh_compile(hf_apply)
    row = {"row": name, "bytes": nbytes, "ours_us": gpu_time(ours, n)[0],
           "compile_us": gpu_time(lambda i: compiled(qs[i], ks[i], cos, sin), n)[0],
           "same_bytes_copy_us": same_bytes_copy_us(nbytes)}
    try:
        from liger_kernel.ops.rope import LigerRopeFunction

        cc, ss = cos[:1].contiguous(), sin[:1].contiguous()
        row["liger_us"] = gpu_time(lambda i: LigerRopeFunction.apply(qs[i], ks[i], cc, ss), n)[0]
    except Exception as e:  # noqa: BLE001 - Liger is optional
        row["liger_us"] = float("nan")
        print(f"liger: {e}", file=sys.stderr)
    q0, k0 = qs[0], ks[0]
    row["end_to_end_us"] = end_to_end_us(lambda: ours(0))
    row["compile_end_to_end_us"] = end_to_end_us(lambda: compiled(q0, k0, cos, sin))
    return row


def decode_graph_row(tokens: int = 32, Hq: int = 32, Hk: int = 8, D: int = 128) -> dict:
    """q+k at decode size, 100 back-to-back calls captured in one CUDA graph, replayed."""
    op = RoPENeoxPositionIdsFwdOp(1 << 20)
    q = torch.randn(tokens, Hq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(tokens, Hk, D, device="cuda", dtype=torch.bfloat16)
    pos = torch.randint(0, 1 << 20, (tokens,), device="cuda")
    per_call = graph_us_per_call(lambda: op(q, pos, key=k, out=q, key_out=k))
    op.check()
    eager = gpu_time(lambda i: op(q, pos, key=k, out=q, key_out=k), 1)[0]
    host = host_us(lambda: op(q, pos, key=k, out=q, key_out=k))
    x = torch.randn(tokens, Hq, D, device="cuda", dtype=torch.bfloat16)
    bare = host_us(lambda: x.add_(1.0))
    return {"row": f"decode q+k {tokens} tok {Hq}/{Hk} heads, graph of 100", "graph_us_per_call": per_call,
            "eager_us_per_call": eager, "host_us": host, "bare_add_host_us": bare}


def ids_row(tokens: int, dtype: torch.dtype) -> dict:
    """The position-ids op, no host sync: q alone, new tensor, queued back to back."""
    op = RoPENeoxPositionIdsFwdOp(8192)
    nbytes = 2 * tokens * 32 * 128 * torch.tensor([], dtype=dtype).element_size() + tokens * 8
    n = rotation(nbytes)
    xs = [torch.randn(tokens, 32, 128, device="cuda", dtype=dtype) for _ in range(n)]
    ps = [torch.randint(0, 8192, (tokens,), device="cuda") for _ in range(n)]
    cos_t = torch.randn(8192, 128, device="cuda", dtype=torch.float32)

    def eager_ref(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        c = cos_t[p][:, None, :]
        return (x.float() * c + _rotate_half(x.float()) * c).to(x.dtype)

    compiled = fresh_compile(eager_ref)
    return {"row": f"position ids {tokens}x32x128 {str(dtype)[6:]}", "bytes": nbytes,
            "ours_us": gpu_time(lambda i: op(xs[i], ps[i]), n)[0],
            "compile_us": gpu_time(lambda i: compiled(xs[i], ps[i]), n)[0],
            "same_bytes_copy_us": same_bytes_copy_us(nbytes)}


def markdown(rows: list[dict], ceiling: float) -> str:
    out = [f"Copy rate (1 GiB) {ceiling:.0f} GB/s.", "",
           "| row | MB | ours us | % same-bytes copy | % 1 GiB copy | torch.compile us | x compile | Liger us | x Liger "
           "| ours end to end us | compile end to end us |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "ours_us" not in r:
            continue
        floor_big = r["bytes"] / (ceiling * 1e3)
        lg = r.get("liger_us", float("nan"))
        out.append(f"| {r['row']} | {r['bytes'] / 1e6:.1f} | {r['ours_us']:.1f} | "
                   f"{100 * r['same_bytes_copy_us'] / r['ours_us']:.0f} | {100 * floor_big / r['ours_us']:.0f} | "
                   f"{r['compile_us']:.1f} | {r['compile_us'] / r['ours_us']:.2f} | {lg:.1f} | {lg / r['ours_us']:.2f} | "
                   f"{r.get('end_to_end_us', float('nan')):.1f} | {r.get('compile_end_to_end_us', float('nan')):.1f} |")
    for r in rows:
        if "graph_us_per_call" in r:
            out += ["", f"{r['row']}: {r['graph_us_per_call']:.2f} us per call replayed, {r['eager_us_per_call']:.2f} "
                        f"us eager (queued); host {r['host_us']:.1f} us per call against {r['bare_add_host_us']:.1f} us "
                        f"for a bare x.add_(1.0) ({r['host_us'] / r['bare_add_host_us']:.2f}x)."]
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    """The q+k and position-ids rows: tileops, torch.compile and Liger, each as its speed relative to
    a copy of the row's own bytes (``benchmarks/plots.py``'s bars, sized for the docs page)."""
    rows = [r for r in rows if "ours_us" in r]
    bars = {name: [plots.relative(r["same_bytes_copy_us"], r.get(key)) for r in rows]
            for name, key in (("tileops", "ours_us"), ("torch.compile", "compile_us"), ("Liger", "liger_us"))}
    plots.draw([textwrap.fill(r["row"], 30) for r in rows], bars,
               "q+k in one launch, position ids (python -m benchmarks.serving)", path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving")
    p.add_argument("--replot", metavar="JSON", help="only draw serving.png (into --out) from a saved serving.json")
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--host", action="store_true", help="only host time per call (and the decode graph row on CUDA)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="--host: where the tensors live (default: cuda when there is one)")
    args = p.parse_args(argv)
    if args.replot:
        saved = json.loads(Path(args.replot).read_text())
        plot(saved["rows"], Path(args.out) / "serving.png")
        return 0
    if args.host:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and not torch.cuda.is_available():
            print("--device cuda: no CUDA GPU here", file=sys.stderr)
            return 2
        rows, info = host.host_rows(device)
        text = host.markdown(rows, info)
        if device.type == "cuda":
            text = markdown([decode_graph_row()], copy_rate()) + "\n" + text
        print(text)
        return 0
    if not torch.cuda.is_available():
        print("benchmarks need a CUDA GPU (--host also runs on the CPU)", file=sys.stderr)
        return 2
    ceiling = copy_rate()
    rows = [
        qk_row("q+k HF layout in place, B1 32/8 heads S8192 D128 bf16", 1, 32, 8, 8192, 128, torch.bfloat16, True),
        qk_row("q+k HF layout [4, 8, 256, 64] fp32", 4, 8, 8, 256, 64, torch.float32, False),
        qk_row("q+k HF layout [4, 8, 256, 64] fp32, bhsd (no views)", 4, 8, 8, 256, 64, torch.float32, False,
               "bhsd"),
        qk_row("q+k HF layout [2, 32, 2048, 128] fp32", 2, 32, 32, 2048, 128, torch.float32, False),
        qk_row("q+k HF layout [1, 32, 8192, 128] fp32", 1, 32, 32, 8192, 128, torch.float32, False),
        ids_row(2048, torch.float16),
        ids_row(4096, torch.bfloat16),
        decode_graph_row(),
    ]
    host_table, info = host.host_rows(torch.device("cuda"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serving.json").write_text(json.dumps({"rows": rows, "host": host_table, "host_info": info,
                                                  "copy_gbps": ceiling}, indent=1))
    md = markdown(rows, ceiling) + "\n" + host.markdown(host_table, info)
    (out / "serving.md").write_text(md)
    plot(rows, out / "serving.png")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
