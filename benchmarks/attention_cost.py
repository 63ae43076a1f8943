"""Where a block of the attention forward spends its time: a fixed cost and a cost per K/V tile,
fitted from calls whose blocks all walk the same number of tiles.

    python -m benchmarks.attention_cost                        # the manifest's schedule, bf16, D 128
    python -m benchmarks.attention_cost --configs 128x128x2x256x2,128x128x2x256x4
    python -m benchmarks.attention_cost --dry                  # anywhere: the calls and the kernels

Why: on an H100 (2026-12-05, ``benchmarks/NOTES.md``) the forward's TFLOP/s fall with the number of
tiles a block walks: 471 at 1 x 16384 (128 tiles a block), 166 at 16 x 1024 causal (1-8). If a block
costs ``F + n T`` for ``n`` tiles on its SM, those rows give ``T`` near 2.2 us and ``F`` near 17 us,
against some 8 us for a whole block of cuDNN's at 16 x 1024. Measured here: F 12.3 us and T 2.2 us,
cuDNN's 2.4 and 1.6; after the epilogue and the mask were fixed, F 4.3 us and T 1.7 us (the same H100,
2026-12-05). The model is measured, not inferred:
one q tile a (batch, head) (``seq_q`` = block_M = 128), ``seq_k = 128 n`` for each ``n`` of ``--tiles``,
not causal, so that every block walks exactly ``n`` tiles; the batch gives ``--waves`` blocks per SM.
A call's time times the SMs over the blocks is a block's time on its SM (one block an SM: the kernel
takes 160 KB of shared memory); a least-squares line through those gives ``F`` (launch, Q load,
pipeline fill, epilogue) and ``T``. SDPA's cuDNN backend runs the same calls, for its line beside ours.
Each config's output is first checked against cuDNN's (else flash's), within 4 half-ulps of the dtype
times max |v|, as ``benchmarks.attention`` does.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.attention import DTYPES, ROWS, kernel_jobs, make_op, parse_config, sdpa_fn

#: the table's 1 x 16384 row: its heads, head_dim and mask (the kernels do not depend on the lengths)
BASE = "16k"
HQ, HKV, D = ROWS[BASE][2:5]


def calls(tiles: list[int], waves: int, sms: int) -> list[tuple]:
    """The calls, each a row of :data:`benchmarks.attention.ROWS`' form with ``seq_q`` apart:
    ``(batch, seq_k, Hq, Hkv, D, causal, None)``; ``batch * Hq`` blocks = ``waves`` blocks an SM."""
    batch = max(1, -(-waves * sms // HQ))
    return [(batch, 128 * n, HQ, HKV, D, False, None) for n in tiles]


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """``(F, T)`` of the least-squares line ``us = F + n T`` through ``(n, us)``."""
    k = len(points)
    sx = sum(n for n, _ in points)
    sy = sum(u for _, u in points)
    sxx = sum(n * n for n, _ in points)
    sxy = sum(n * u for n, u in points)
    slope = (k * sxy - sx * sy) / (k * sxx - sx * sx)
    return (sy - slope * sx) / k, slope


def _inputs(row: tuple, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    b, sk, hq, hkv, d, _, _ = row
    g = torch.Generator(device="cuda").manual_seed(0)
    return {"q": torch.randn(b, 128, hq, d, generator=g, device="cuda", dtype=dtype),
            "k": torch.randn(b, sk, hkv, d, generator=g, device="cuda", dtype=dtype),
            "v": torch.randn(b, sk, hkv, d, generator=g, device="cuda", dtype=dtype)}


def main(argv: "list[str] | None" = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=None, help="BMxBNxSTAGESxTHREADS[xPIPELINE],... (default: the manifest's)")
    ap.add_argument("--tiles", default="1,2,4,8,16,32", help="K/V tiles a block walks, one call each")
    ap.add_argument("--waves", type=int, default=8, help="blocks an SM in each call (default 8)")
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--batches", type=int, default=10, help="timed batches of 3 calls (default 10)")
    ap.add_argument("--dry", action="store_true", help="print the calls and kernels; no GPU needed")
    a = ap.parse_args(argv)
    try:
        tiles = sorted({int(n) for n in a.tiles.split(",")})
    except ValueError:
        raise SystemExit(f"--tiles: expected counts like 1,2,4,8, got {a.tiles!r}") from None
    if len(tiles) < 2 or tiles[0] < 1:
        raise SystemExit(f"--tiles: a line needs two or more counts of at least 1, got {a.tiles!r}")
    for flag, value in (("--waves", a.waves), ("--batches", a.batches)):
        if value < 1:
            raise SystemExit(f"{flag}: expected a count of at least 1, got {value}")
    configs = [parse_config(c) for c in a.configs.split(",")] if a.configs else [None]
    dtype = DTYPES[a.dtype]
    sms = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132
    rows = calls(tiles, a.waves, sms)
    if a.dry:
        for row in rows:
            print(f"batch {row[0]} x {HQ} heads ({row[0] * HQ} blocks), seq_q 128, seq_k {row[1]}")
        for job in kernel_jobs([(BASE, a.dtype)], configs, "sm_90"):
            print(job[0], job[1])
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.attention_cost times CUDA kernels: no GPU here (--dry prints the plan)")
    from benchmarks.timing import gpu_time
    from tileops.compile.build import device_backend
    from tileops.compile.warmup import compile_jobs

    jobs = kernel_jobs([(BASE, a.dtype)], configs, device_backend(torch.device("cuda"))[1])
    t0 = time.perf_counter()
    count, _, failures = compile_jobs(jobs, None, progress=True)
    print(f"compiled {count} kernels in {time.perf_counter() - t0:.0f} s" +
          (f"; {len(failures)} failed: {failures[0][1][:300]}" if failures else ""), flush=True)
    ops = [make_op(ROWS[BASE], c) for c in configs]
    labels = ["x".join(str(v) for v in c.values()) if c else "manifest" for c in configs] + ["cudnn"]
    points: dict[str, list] = {k: [] for k in labels}
    print(f"us a block on its SM ({sms} SMs, {a.waves} blocks an SM, {a.dtype}, GQA {HQ}/{HKV}, D {D}):", flush=True)
    print("| tiles a block | " + " | ".join(labels) + " |\n|" + "---|" * (len(labels) + 1), flush=True)
    for n, row in zip(tiles, rows):
        t = _inputs(row, dtype)
        blocks = row[0] * HQ
        ref_fn = sdpa_fn("cudnn", row, t) or sdpa_fn("flash", row, t)  # (it reads the row's mask alone)
        ref = ref_fn() if ref_fn is not None else None
        tol = 4 * (2.0**-8 if dtype == torch.bfloat16 else 2.0**-11) * float(t["v"].abs().max())
        cells = []
        fns = [(lab, (lambda op=op, t=t: op(t["q"], t["k"], t["v"]))) for lab, op in zip(labels, ops)]
        fns.append(("cudnn", ref_fn))
        for lab, fn in fns:
            if fn is None:
                cells.append("-")
                continue
            if lab != "cudnn" and ref is not None:
                err = float((fn().float() - ref.float()).abs().max())
                if not err <= tol:
                    cells.append(f"FAIL err {err:.3g} > {tol:.3g}")
                    continue
            us = gpu_time(lambda i, fn=fn: fn(), 1, batches=a.batches, per_batch=3)[0]
            per_block = us * sms / blocks
            points[lab].append((n, per_block))
            cells.append(f"{per_block:.2f}")
        print(f"| {n} | " + " | ".join(cells) + " |", flush=True)
        del t, ref
        torch.cuda.empty_cache()
    print("\nfit us = F + n T (a block on its SM):", flush=True)
    for lab, pts in points.items():
        if len(pts) >= 2:
            f, tile = fit(pts)
            print(f"  {lab}: F {f:.2f} us, T {tile:.3f} us a tile", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
