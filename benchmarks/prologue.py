"""The attention prologue (issue 24): q/k RMSNorm + RoPE + the paged KV-cache write, fused in one
launch by ``AttnPrologueFwdOp``, against the same chain in PyTorch.

    python -m benchmarks.prologue [--out benchmarks/results] [--rows NAME,...]
    python -m benchmarks.prologue --smoke        # the CPU: every column computes the same, no timing

The workload is a Qwen3-style layer (``shared/perf-baselines.md``): bf16 qkv ``[T, (32 + 2*8) * 128]``
from the projection, per-head RMSNorm of q and k, RoPE at explicit positions (base 1e6), k and v
written into a paged cache ``[4096, 16, 8, 128]`` (NHD) at a random slot mapping. Columns, timed side
by side in one run (medians of ``benchmarks/timing.py``'s batches, rotating input sets past L2):

* ``copy``: a device-to-device copy of the bytes the fused op must move (qkv read; q, k and v
  written; positions and slots read), the ceiling;
* ``ours``: one ``AttnPrologueFwdOp`` call;
* ``compile``: ``torch.compile`` of the PyTorch chain (compiled fresh per row);
* ``rope between``: the chain with tileops' RoPE op (q and k in one launch, in place) in the middle;
* ``eager``: the PyTorch chain as written.

The chain is what a PyTorch serving stack runs: the norm as HF's Llama form (``weight *
(x * rsqrt(mean(x^2) + eps)).to(dtype)``), RoPE from a float32 cos/sin cache indexed by position
(vLLM's), the cache written by indexing its flat slots. Rows of another RoPE variant (YaRN, MRoPE)
build their cos/sin cache from that rope op's own frequencies, so every column computes one thing;
``--smoke`` checks that on the CPU (and is a test: ``tests/test_benchmarks.py``).

Decode rows capture 100 calls in one CUDA graph and replay it (per call), as a server does.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Row:
    name: str
    tokens: int
    rope: str = "neox"  # neox | yarn | mrope
    cache_dtype: str | None = None  # None (qkv's) | "float8_e4m3fn"
    graph: bool = False  # decode: 100 calls in one CUDA graph
    hq: int = 32
    hkv: int = 8
    head_dim: int = 128
    blocks: int = 4096
    block_size: int = 16
    extra: dict = field(default_factory=dict, compare=False)


ROWS = [Row("qwen3 64 tok", 64), Row("qwen3 2048 tok", 2048), Row("qwen3 16384 tok", 16384),
        Row("decode batch 64 x 1 tok, graph of 100", 64, graph=True),
        Row("decode batch 64 x 64 tok, graph of 100", 4096, graph=True),
        Row("yarn 2048 tok", 2048, rope="yarn"), Row("mrope (Qwen3-VL) 2048 tok", 2048, rope="mrope"),
        Row("fp8 cache 2048 tok", 2048, cache_dtype="float8_e4m3fn"),
        Row("fp8 cache 16384 tok", 16384, cache_dtype="float8_e4m3fn")]
SMOKE = [Row("smoke neox", 7, hq=4, hkv=2, head_dim=64, blocks=8, block_size=4),
         Row("smoke yarn", 5, rope="yarn", hq=4, hkv=1, head_dim=64, blocks=4, block_size=2),
         Row("smoke mrope", 6, rope="mrope", hq=2, hkv=2, head_dim=128, blocks=3, block_size=4)]
MAX_POSITION = 1 << 17


def rope_op(kind: str) -> Any:
    """The row's RoPE op (what the fused op composes and the chain's cos/sin cache is built from)."""
    from tileops.rope import MRoPEFwdOp, RoPENeoxPositionIdsFwdOp, YaRNFwdOp

    if kind == "neox":
        return RoPENeoxPositionIdsFwdOp(MAX_POSITION, 1e6)
    if kind == "yarn":
        return YaRNFwdOp("2d", 1e6, 4.0, 32768, 32.0, 1.0)
    if kind == "mrope":  # Qwen3-VL: sections [24, 20, 20] interleaved
        return MRoPEFwdOp((24, 20, 20), "packed", 5e6, True)
    raise KeyError(kind)


def cos_sin_cache(rope: Any, head_dim: int, device: torch.device) -> torch.Tensor:
    """``[MAX_POSITION, 2, R/2]`` float32 cos/sin (amplitude folded in), from the op's own frequencies."""
    inv, amp = rope.frequencies(rope.rotated_width(head_dim))
    ang = torch.arange(MAX_POSITION, dtype=torch.float64)[:, None] * inv[None, :].double()
    return torch.stack([ang.cos() * amp, ang.sin() * amp], 1).float().to(device)


def inputs(row: Row, device: torch.device, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One input set: qkv, positions, caches (NaN-free zeros), a slot mapping of distinct slots."""
    t, d, w = row.tokens, row.head_dim, (row.hq + 2 * row.hkv) * row.head_dim
    qkv = torch.randn(t, w, generator=gen).to(torch.bfloat16).to(device)
    pos = torch.randint(0, MAX_POSITION, (3, t) if row.rope == "mrope" else (t,), generator=gen).to(device)
    slots = torch.randperm(row.blocks * row.block_size, generator=gen)[:t].to(device)
    cdt = getattr(torch, row.cache_dtype) if row.cache_dtype else torch.bfloat16
    shape = (row.blocks, row.block_size, row.hkv, d)
    kc, vc = torch.zeros(shape, dtype=cdt, device=device), torch.zeros(shape, dtype=cdt, device=device)
    qw = (1 + 0.3 * torch.randn(d, generator=gen)).to(torch.bfloat16).to(device)
    kw = (1 + 0.3 * torch.randn(d, generator=gen)).to(torch.bfloat16).to(device)
    out = {"qkv": qkv, "positions": pos, "key_cache": kc, "value_cache": vc, "slot_mapping": slots,
           "q_norm_weight": qw, "k_norm_weight": kw}
    if row.cache_dtype:
        out["k_scale"] = torch.tensor([0.05], device=device)
        out["v_scale"] = torch.tensor([0.04], device=device)
    return out


def moved_bytes(row: Row) -> int:
    """What the fused op must move: qkv read, q written, k and v written into the cache (their
    dtype's bytes), positions and slots read (8 bytes each)."""
    t, d = row.tokens, row.head_dim
    cache_elem = 1 if row.cache_dtype else 2
    return (t * (row.hq + 2 * row.hkv) * d * 2 + t * row.hq * d * 2 + t * 2 * row.hkv * d * cache_elem
            + t * 8 * (3 if row.rope == "mrope" else 1) + t * 8)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate(x: torch.Tensor, cs: torch.Tensor, pairing: str) -> torch.Tensor:
    """x ``[T, H, D]`` rotated by cs ``[T, 2, R/2]`` (fp32), the rest of each head copied."""
    half = cs.shape[-1]
    cos, sin = cs[:, None, 0], cs[:, None, 1]
    h = x.float()
    if pairing == "neox":
        a, b = h[..., :half], h[..., half:2 * half]
        rot = torch.cat([a * cos - b * sin, b * cos + a * sin], -1)
    else:
        a, b = h[..., 0:2 * half:2], h[..., 1:2 * half:2]
        rot = torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)
    return torch.cat([rot.to(x.dtype), x[..., 2 * half:]], -1)


def chain(row: Row, rope: Any, table: torch.Tensor, streams: torch.Tensor | None) -> Callable[..., torch.Tensor]:
    """The PyTorch chain (``fn(**inputs) -> q``): split, per-head norms, RoPE from ``table``, cache write."""
    hq, hkv, d = row.hq, row.hkv, row.head_dim
    pairing = rope.pairing

    def fn(qkv, positions, key_cache, value_cache, slot_mapping, q_norm_weight, k_norm_weight, k_scale=None,
           v_scale=None):
        t = qkv.shape[0]
        q, k, v = qkv.view(t, hq + 2 * hkv, d).split([hq, hkv, hkv], 1)
        q, k = _rms(q, q_norm_weight), _rms(k, k_norm_weight)
        if streams is None:
            cs = table[positions]
        else:  # MRoPE: pair j at the position of its stream
            pairs = torch.arange(streams.numel(), device=qkv.device)[:, None]
            cs = table[positions[streams], :, pairs].permute(1, 2, 0)  # [R/2, T, 2] -> [T, 2, R/2]
        q, k = _rotate(q, cs, pairing), _rotate(k, cs, pairing)
        _write(key_cache, value_cache, slot_mapping, k, v, k_scale, v_scale)
        return q

    return fn


def _write(key_cache, value_cache, slot_mapping, k, v, k_scale, v_scale) -> None:
    kc = key_cache.view(-1, *key_cache.shape[2:])
    vc = value_cache.view(-1, *value_cache.shape[2:])
    if k_scale is not None:  # fp8: x / scale, saturated
        k = (k.float() / k_scale).clamp(-448, 448)
        v = (v.float() / v_scale).clamp(-448, 448)
    kc[slot_mapping] = k.to(kc.dtype)
    vc[slot_mapping] = v.to(vc.dtype)


def rope_between(row: Row, rope: Any) -> Callable[..., torch.Tensor]:
    """The chain with tileops' RoPE op in the middle (q and k in one launch, in place)."""
    hq, hkv, d = row.hq, row.hkv, row.head_dim

    def fn(qkv, positions, key_cache, value_cache, slot_mapping, q_norm_weight, k_norm_weight, k_scale=None,
           v_scale=None):
        t = qkv.shape[0]
        q, k, v = qkv.view(t, hq + 2 * hkv, d).split([hq, hkv, hkv], 1)
        q, k = _rms(q, q_norm_weight), _rms(k, k_norm_weight)
        # [tokens, heads, D] as the op's layout takes it: as is (position ids, packed MRoPE) or one batch
        qv, kv = (q, k) if rope.layout in ("ids", "packed") else (q[None], k[None])
        rope.forward(qv, position_ids=positions, key=kv, out=qv, key_out=kv)
        _write(key_cache, value_cache, slot_mapping, k, v, k_scale, v_scale)
        return q

    return fn


def fused(row: Row, rope: Any) -> Callable[..., torch.Tensor]:
    from tileops.attention import AttnPrologueFwdOp

    op = AttnPrologueFwdOp(row.hq, row.hkv, row.head_dim, rope, qk_norm=True, eps=1e-6,
                           cache_dtype=getattr(torch, row.cache_dtype) if row.cache_dtype else None)
    return op


def columns(row: Row, device: torch.device) -> dict[str, Callable[..., torch.Tensor] | str]:
    """The row's columns by name; a column that cannot be made for the row is the reason, a string."""
    rope = rope_op(row.rope)
    table = cos_sin_cache(rope, row.head_dim, device)
    streams = rope.streams().to(device) if row.rope == "mrope" else None
    try:
        ours: Any = fused(row, rope)
    except (NotImplementedError, ValueError, TypeError) as e:  # a configuration the op refuses, by name
        ours = f"{type(e).__name__}: {e}"
    return {"ours": ours, "eager": chain(row, rope, table, streams), "rope between": rope_between(row, rope)}


def smoke() -> list[str]:
    """Every column of every smoke row on the CPU from one input set: the same q and the same cache
    rows (within a bf16 ulp: the chains round cos/sin from an fp32 cache, the op composes them).
    Returns the problems found (empty: none)."""
    problems = []
    gen = torch.Generator().manual_seed(0)
    for row in SMOKE:
        x = inputs(row, torch.device("cpu"), gen)
        got = {}
        for name, fn in columns(row, torch.device("cpu")).items():
            if isinstance(fn, str):
                problems.append(f"{row.name}: {name}: {fn}")
                continue
            xs = {k: v.clone() for k, v in x.items()}
            q = fn(**xs)
            got[name] = (q.float(), xs["key_cache"].float(), xs["value_cache"].float())
        ref = got["eager"]
        for name, (q, kc, vc) in got.items():
            for what, a, b in (("q", q, ref[0]), ("key_cache", kc, ref[1]), ("value_cache", vc, ref[2])):
                err = float(((a - b).abs() / (b.abs() + 1e-2)).max())
                if not err <= 2 ** -6:
                    problems.append(f"{row.name}: {name} {what} differs from the eager chain by {err:.3g} relative")
    return problems


def time_row(row: Row) -> dict[str, Any]:
    from .runner import fresh_compile
    from .timing import gpu_time, graph_us_per_call, rotation, same_bytes_copy_us

    dev = torch.device("cuda")
    nbytes = moved_bytes(row)
    n = 1 if row.graph else rotation(nbytes)
    gen = torch.Generator().manual_seed(1)
    sets = [inputs(row, dev, gen) for _ in range(n)]
    cols = columns(row, dev)
    cols["compile"] = fresh_compile(cols["eager"])
    out = {"row": row.name, "bytes": nbytes, "copy_us": same_bytes_copy_us(nbytes)}
    for name, fn in cols.items():
        if isinstance(fn, str):
            print(f"{row.name}: {name} not run: {fn}", file=sys.stderr)
            out[f"{name}_us"] = float("nan")
            continue
        try:
            if row.graph:
                out[f"{name}_us"] = graph_us_per_call(lambda: fn(**sets[0]))
            else:
                out[f"{name}_us"] = gpu_time(lambda i: fn(**sets[i]), n)[0]
        except Exception as e:  # a column that cannot run this row (say, fp8 in the chain of an old torch)
            print(f"{row.name}: {name} failed: {type(e).__name__}: {e}", file=sys.stderr)
            out[f"{name}_us"] = float("nan")
    if hasattr(cols["ours"], "check"):
        cols["ours"].check()
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    out = ["| row | MB | copy us | ours us | % copy | torch.compile us | x compile | rope between us | eager us |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ours = r["ours_us"]
        out.append(f"| {r['row']} | {r['bytes'] / 1e6:.1f} | {r['copy_us']:.1f} | {ours:.1f} | "
                   f"{100 * r['copy_us'] / ours:.0f} | {r['compile_us']:.1f} | {r['compile_us'] / ours:.2f} | "
                   f"{r['rope between_us']:.1f} | {r['eager_us']:.1f} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.prologue")
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--rows", help="comma-separated row names (default: all)")
    p.add_argument("--smoke", action="store_true", help="the CPU: check every column computes the same, no timing")
    a = p.parse_args(argv)
    if a.smoke:
        problems = smoke()
        print("\n".join(problems) or f"ok: {len(SMOKE)} rows, every column agrees")
        return 1 if problems else 0
    if not torch.cuda.is_available():
        print("benchmarks.prologue: needs a CUDA device (--smoke runs on the CPU)", file=sys.stderr)
        return 2
    want = set(a.rows.split(",")) if a.rows else None
    rows = []
    for row in ROWS:
        if want is None or row.name in want:
            rows.append(time_row(row))
            print("row " + json.dumps(rows[-1]), file=sys.stderr, flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prologue.json").write_text(json.dumps(rows, indent=1))
    md = markdown(rows)
    (out / "prologue.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
