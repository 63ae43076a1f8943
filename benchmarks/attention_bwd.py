"""The attention backward's tile programs (``kernels/attention_bwd.py``) against SDPA's flash and cuDNN
backward, on the H200.

    python -m benchmarks.attention_bwd                  # the issue's rows, the default tiles
    python -m benchmarks.attention_bwd --configs        # and a sweep of tile shapes, each checked
    python -m benchmarks.attention_bwd --configs "default,every thread"   # some of them, side by side
    python -m benchmarks.attention_bwd --rows 0 --configs --quick   # one row, fewer samples
    python -m benchmarks.attention_bwd --dry            # anywhere: rows, configs and their specs
    python -m benchmarks.attention_bwd --rows 4 --heads 16/4 --head-dim 64 --configs "default,d64 dq kv128"
                                                        # HF Llama's training shape (8 layers of 16/4 heads of 64)

Rows (issue 36's table): GQA 32 q / 8 kv heads, head_dim 128, bf16: 1 x 16384 not causal and causal,
4 x 4096 causal, 16 x 1024 causal (the default rows); row 4, 4 x 2048 causal, is the HF Llama training step
of ``benchmarks.hf_generate`` with ``--heads 16/4 --head-dim 64``. TFLOP/s counts 2.5 x the forward's
``4 * Sq * Sk * D * Hq`` (halved when causal), the issue's convention; ``%`` is of the H200's dense bf16
peak, 989 TFLOP/s.

Ours is delta + dk/dv + dq launched back to back (the three kernels' own times are given too), from
the o and lse of SDPA's flash forward (``aten._scaled_dot_product_flash_attention``, whose lse is
fp32 ``[B, H, S]``, natural log: the forward's contract). SDPA's backward is timed as
``torch.autograd.grad`` of its output with the same dO. Times are medians of
:func:`benchmarks.timing.gpu_time` samples (10 calls a sample, host queued ahead).

Every config's kernels are compiled first, in parallel (:func:`tileops.compile.warmup.compile_jobs`);
each config's gradients are compared with SDPA flash's (``err``: the largest ``|ours - flash|`` over
the largest ``|flash|`` of dq, dk, dv; both are bf16 computations, so this is a check that the
kernels compute the gradient, near 1e-2, not a bound: the CPU tests bound the C schedule, and the
CUDA tests the CUDA one, against float64).
"""

from __future__ import annotations

import argparse
import sys

import torch

from tileops.compile.build import device_backend, load_kernel
from tileops.kernels import get_spec
from tileops.kernels.attention_bwd import HEAD_DIMS

PEAK = 989.0
#: (label, batch, seq, causal)
ROWS = [("1 x 16384", 1, 16384, False), ("1 x 16384 causal", 1, 16384, True), ("4 x 4096 causal", 4, 4096, True),
        ("16 x 1024 causal", 16, 1024, True), ("4 x 2048 causal", 4, 2048, True)]
#: the rows run without ``--rows``: the issue's four
DEFAULT_ROWS = 4
#: q heads, kv heads, head_dim (``--heads``, ``--head-dim``)
HQ, HKV, D = 32, 8, 128
#: config -> spec fields over the defaults ("default": the H200 defaults of ``kernels/attention_bwd.py``)
CONFIGS = {
    "default": {},  # dense: the tiles by TMA from a producer warpgroup, two stages (dk/dv q step 64 at D 128)
    # the products' overlap (kernels/attention_bwd.py, `overlap`; the default, 1, waits on each where it is issued)
    "overlap scores": dict(overlap=2),  # the two score products together, p's exp2 under the second
    "overlap dv": dict(overlap=3),  # dk/dv also issues dV += pT dO before ds (dq takes 2: it has no dV)
    "every thread": dict(loads=1),  # every thread's cp.async, one stage: varlen's programs
    "tma dkdv q32": dict(dkdv_block_q=32),
    "tma dq kv128": dict(dq_block_kv=128),
    "ds via shared": dict(ds_shared=2),
    "every thread dkdv q64": dict(loads=1, dkdv_block_q=64),
    "every thread dkdv kv64 q64": dict(loads=1, dkdv_block_kv=64, dkdv_block_q=64, dkdv_threads=128),
    "every thread dq q64 kv64 t128": dict(loads=1, dq_block_q=64, dq_threads=128),
    "every thread dq kv128": dict(loads=1, dq_block_kv=128),
    "every thread dkdv t128 dq t128": dict(loads=1, dkdv_threads=128, dq_threads=128),
    # head_dim 64 (--head-dim 64), each knob spelled out (the defaults moved): a wider dq K/V step (the H100's
    # 9% on dq at the Llama shape, the thirtieth session) and a wider dk/dv q step, D 64's defaults since the
    # thirty-second session, and what was measured against them (benchmarks/NOTES.md)
    "d64 before": dict(dkdv_block_q=64, dq_block_kv=64),  # D 64's defaults until the thirty-second session
    "d64 dq kv128": dict(dkdv_block_q=64, dq_block_kv=128),
    "d64 dkdv q128": dict(dkdv_block_q=128, dq_block_kv=64),
    "d64 dkdv q128 dq kv128": dict(dkdv_block_q=128, dq_block_kv=128),  # the defaults since then
    "d64 dkdv kv64 t128": dict(dkdv_block_kv=64, dkdv_threads=128, dkdv_block_q=64, dq_block_kv=64),
    "d64 3 stages dq kv128": dict(stages=3, dkdv_block_q=64, dq_block_kv=128),
    "d64 dkdv q128 dq kv128 3 stages": dict(dkdv_block_q=128, dq_block_kv=128, stages=3),
    "d64 dkdv kv64 q128 t128 dq kv128": dict(dkdv_block_kv=64, dkdv_block_q=128, dkdv_threads=128, dq_block_kv=128),
}


def flops(batch: int, seq: int, causal: bool) -> float:
    """The backward's FLOPs by the issue's convention."""
    f = 4.0 * seq * seq * D * HQ * batch * 2.5
    return f / 2 if causal else f


def specs(causal: bool, fields: dict) -> dict:
    """The three kernels' specs of a config: each kind takes its own knobs (``dkdv_*``, ``dq_*``) and
    the shared ones (``stages``, ``ds_shared``, ``loads``, ``overlap``; the prep ``loads`` alone), so that a
    config changing one program shares the other's compiled kernel."""
    S = get_spec("attention_bwd")

    def own(kind):
        shared = ("stages", "ds_shared", "loads", "overlap")
        return {k: v for k, v in fields.items() if k.startswith(kind + "_") or k in shared}

    dq = own("dq")
    if dq.get("overlap") == 3:  # (level 3 adds dV's product, which the dq program has not: its highest is 2)
        dq["overlap"] = 2
    return {"prep": S(kind="prep", head_dim=D, dtype="bfloat16", **{k: v for k, v in fields.items() if k == "loads"}),
            "dkdv": S(kind="dkdv", head_dim=D, dtype="bfloat16", causal=causal, **own("dkdv")),
            "dq": S(kind="dq", head_dim=D, dtype="bfloat16", causal=causal, **dq)}


def _strides(prefix: str, t: torch.Tensor, unit: int) -> dict[str, int]:
    """``<prefix>s{b,s,h}``: a ``[B, S, H, D]`` tensor's first three strides in ``unit`` elements."""
    return {f"{prefix}s{n}": x // unit for n, x in zip("bsh", t.stride()[:3])}


class Ours:
    """The three kernels of one config bound to one row's tensors: ``prep()``, ``dkdv()``, ``dq()``."""

    def __init__(self, kinds: dict, q, k, v, o, do, lse):
        dev = q.device
        backend, arch = device_backend(dev)
        self.k = {n: load_kernel("attention_bwd", s, backend, arch, dev, s.args) for n, s in kinds.items()}
        u = kinds["dq"].stride_unit
        self.dq, self.dk, self.dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self.delta = torch.empty_like(lse)
        b, sq, hq, _ = q.shape
        if kinds["dkdv"].tma:
            self._tma(q, k, v, o, do, lse)
            return

        def st(p, t):
            return _strides(p, t, u)

        lse_st = dict(lsb=lse.stride(0), lsh=lse.stride(1))
        self.args = {
            "prep": dict(O=o.data_ptr(), DO=do.data_ptr(), DELTA=self.delta.data_ptr(), CUQ=0, B=b, Hq=hq, Sq=sq,
                         **st("o", o), **st("do", do), **lse_st)}
        common = dict(Q=q.data_ptr(), K=k.data_ptr(), V=v.data_ptr(), DO=do.data_ptr(), LSE=lse.data_ptr(),
                      DELTA=self.delta.data_ptr(), CUQ=0, CUK=0, B=b, Hkv=k.shape[2], G=hq // k.shape[2], Sq=sq,
                      Sk=k.shape[1], W=0, scale=D ** -0.5, softcap=0.0, **st("q", q), **st("k", k), **st("v", v),
                      **st("do", do), **lse_st)
        self.args["dkdv"] = dict(common, DK=self.dk.data_ptr(), DV=self.dv.data_ptr(), **st("dk", self.dk),
                                 **st("dv", self.dv))
        self.args["dq"] = dict(common, DQ=self.dq.data_ptr(), **st("dq", self.dq))
        self.bound = {n: self.k[n].bind(**a, **dict.fromkeys(self.k[n].extent_names, 0)) for n, a in self.args.items()}

    def _tma(self, q, k, v, o, do, lse) -> None:
        """The arguments of TMA programs (``loads`` 2): lse2 and delta in rows padded to ``dlh``, the
        gradient programs' sizes and element strides as their tensors' extents (by name)."""
        from tileops.kernels.attention_bwd import padded_rows

        b, sq, hq, _ = q.shape
        dlh = padded_rows(sq)
        self.lse2 = torch.empty(b, hq, dlh, device=q.device)
        self.delta = torch.empty(b, hq, dlh, device=q.device)
        st = _strides

        self.args = {"prep": dict(O=o.data_ptr(), DO=do.data_ptr(), LSE=lse.data_ptr(), LSE2=self.lse2.data_ptr(),
                                  DELTA=self.delta.data_ptr(), CUQ=0, B=b, Hq=hq, Sq=sq, **st("o", o, 8),
                                  **st("do", do, 8), lsb=lse.stride(0), lsh=lse.stride(1), dlh=dlh)}
        common = dict(Q=q.data_ptr(), K=k.data_ptr(), V=v.data_ptr(), DO=do.data_ptr(), LSE2=self.lse2.data_ptr(),
                      DELTA=self.delta.data_ptr(), G=hq // k.shape[2], W=0, scale=D ** -0.5, softcap=0.0, B=b, Sq=sq,
                      Sk=k.shape[1], Hq=hq, Hkv=k.shape[2], dlb=hq * dlh, dlh=dlh, **st("q", q, 1), **st("k", k, 1),
                      **st("v", v, 1), **st("do", do, 1))
        self.args["dkdv"] = dict(common, DK=self.dk.data_ptr(), DV=self.dv.data_ptr(), **st("dk", self.dk, 1),
                                 **st("dv", self.dv, 1))
        self.args["dq"] = dict(common, DQ=self.dq.data_ptr(), **st("dq", self.dq, 1))
        self.bound = {n: self.k[n].bind(**{**dict.fromkeys(self.k[n].extent_names, 0), **a})
                      for n, a in self.args.items()}

    def run(self, *names: str) -> None:
        for n in names or ("prep", "dkdv", "dq"):
            self.k[n](*self.bound[n])


def inputs(batch: int, seq: int, causal: bool, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, seq, HQ, D, generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, seq, HKV, D, generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch, seq, HKV, D, generator=g, device="cuda", dtype=torch.bfloat16)
    do = torch.randn(batch, seq, HQ, D, generator=g, device="cuda", dtype=torch.bfloat16)
    rep = HQ // HKV
    out = torch.ops.aten._scaled_dot_product_flash_attention(
        q.transpose(1, 2), k.repeat_interleave(rep, 2).transpose(1, 2), v.repeat_interleave(rep, 2).transpose(1, 2),
        0.0, causal, False, scale=D ** -0.5)
    o = out[0].transpose(1, 2).contiguous()
    lse = out[1][..., :seq].float().contiguous()  # (a padded lse: its first seq columns)
    assert lse.shape == (batch, HQ, seq), lse.shape
    return q, k, v, o, do, lse


def sdpa_grads(q, k, v, do, causal, backend):
    """(a function running SDPA's backward with ``backend``, its dq/dk/dv in our layout)."""
    from torch.nn.attention import sdpa_kernel

    qh, kh, vh = (t.transpose(1, 2).detach().requires_grad_(True) for t in (q, k, v))
    with sdpa_kernel(backend):
        out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, enable_gqa=True)
    dout = do.transpose(1, 2)

    def run():
        return torch.autograd.grad(out, (qh, kh, vh), dout, retain_graph=True)

    with sdpa_kernel(backend):
        grads = run()
    return run, tuple(g.transpose(1, 2) for g in grads)


def time_us(fn, quick: bool) -> float:
    from benchmarks.timing import gpu_time

    return gpu_time(lambda i: fn(), 1, batches=5 if quick else 15, per_batch=3)[0]


def main() -> int:
    global HQ, HKV, D
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", nargs="?", const="all", default="",
                    help="sweep CONFIGS, not only the default (or NAME,NAME: those of them)")
    ap.add_argument("--rows", type=str, default="", help="comma-separated row indices (default: all)")
    ap.add_argument("--quick", action="store_true", help="fewer samples")
    ap.add_argument("--dry", action="store_true", help="print the rows, configs and specs; no GPU")
    ap.add_argument("--jobs", type=int, default=None, help="parallel compiles (default: one per CPU)")
    ap.add_argument("--heads", default=f"{HQ}/{HKV}", help=f"q heads / kv heads (default {HQ}/{HKV})")
    ap.add_argument("--head-dim", type=int, default=D, choices=HEAD_DIMS, help=f"head_dim (default {D})")
    a = ap.parse_args()
    try:
        HQ, HKV = (int(x) for x in a.heads.split("/"))
    except ValueError:
        ap.error(f"--heads: expected Q/KV, two ints, got {a.heads!r}")
    if HQ < 1 or HKV < 1 or HQ % HKV:
        ap.error(f"--heads: expected positive q heads that are a multiple of the kv heads, got {HQ}/{HKV}")
    D = a.head_dim
    rows = [ROWS[int(i)] for i in a.rows.split(",")] if a.rows else ROWS[:DEFAULT_ROWS]
    if a.configs and a.configs != "all":
        names = [n.strip() for n in a.configs.split(",")]
        unknown = [n for n in names if n not in CONFIGS]
        if unknown:
            ap.error(f"--configs: {unknown} are not among {list(CONFIGS)}")
        configs = {n: CONFIGS[n] for n in names}
    else:
        configs = CONFIGS if a.configs else {"default": {}}
    if a.dry:
        for label, b, s, c in rows:
            print(label, f"{flops(b, s, c) / 1e12:.2f} TFLOP")
        for name, fields in configs.items():
            got = specs(True, fields)
            print(name, {k: (got[k].block_q, got[k].block_kv, got[k].threads, got[k].tile("stages"),
                             got[k].tile("overlap")) for k in ("dkdv", "dq")},
                  "(block_q, block_kv, threads, stages, overlap)")
        return 0
    if not torch.cuda.is_available():
        print("no GPU: nothing to time (--dry prints the plan)")
        return 1
    from torch.nn.attention import SDPBackend

    from tileops.compile.warmup import compile_jobs

    arch = device_backend(torch.device("cuda"))[1]
    todo = [("attention_bwd", s, "cuda", arch) for c in {r[3] for r in rows} for f in configs.values()
            for s in specs(c, f).values()]
    n, secs, failed = compile_jobs(todo, a.jobs, progress=False)
    print(f"compiled {n} kernels in {secs:.0f} s; {len(failed)} failed", flush=True)
    bad = {str(spec) for spec, _ in failed}
    for spec, err in failed:
        print("FAILED", spec, err.splitlines()[-1][:300] if err else "", flush=True)
    print("| row | config | ours us | TFLOP/s | % of 989 | prep | dk/dv | dq | err vs flash | flash | cuDNN |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for label, b, s, causal in rows:
        q, k, v, o, do, lse = inputs(b, s, causal)
        f = flops(b, s, causal)
        base = {}
        ref = None
        for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cuDNN", SDPBackend.CUDNN_ATTENTION)):
            try:
                run, grads = sdpa_grads(q, k, v, do, causal, be)
                base[name] = time_us(run, a.quick)
                ref = grads if name == "flash" else ref
            except RuntimeError as e:
                base[name] = float("nan")
                print(f"{label}: SDPA {name} failed: {str(e).splitlines()[0][:200]}", flush=True)
        for cname, fields in configs.items():
            kinds = specs(causal, fields)
            if any(str(sp) in bad for sp in kinds.values()):
                print(f"| {label} | {cname} | build failed |")
                continue
            ours = Ours(kinds, q, k, v, o, do, lse)
            ours.run()
            torch.cuda.synchronize()
            err = float("nan")
            if ref is not None:
                err = max(((x.float() - r.float()).abs().max() / r.float().abs().max()).item()
                          for x, r in zip((ours.dq, ours.dk, ours.dv), ref))
            total = time_us(ours.run, a.quick)
            parts = [time_us(lambda n=n, o=ours: o.run(n), a.quick) for n in ("prep", "dkdv", "dq")]
            tf = f / total / 1e6
            print(f"| {label} | {cname} | {total:.0f} | {tf:.0f} | {100 * tf / PEAK:.0f}% | {parts[0]:.0f} | "
                  f"{parts[1]:.0f} | {parts[2]:.0f} | {err:.1e} | {f / base['flash'] / 1e6:.0f} | "
                  f"{f / base['cuDNN'] / 1e6:.0f} |", flush=True)
        del q, k, v, o, do, lse
        torch.cuda.empty_cache()
    print("TFLOP/s of flash and cuDNN by the same count; medians of", "5" if a.quick else "15", "samples of 3 calls")
    return 0


if __name__ == "__main__":
    sys.exit(main())
