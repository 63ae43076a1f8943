"""The paged decode programs of ``kernels/paged_decode.py`` (split-KV ``partial``, then ``merge``),
launched directly on the CPU against a float64 reference written from the definition, sharing no code
with the kernels: the C schedule, and the CUDA schedule's generated source run on the CPU
(``tests/cuda_on_cpu.py``: its lane groups, shuffles, shared-memory merge and barriers; not its speed).

The reference (:func:`reference`) reads each sequence's keys through its block table from the caches
as given (NHD or HND; a float8 cache's bytes as torch reads them, times the scale), skips a key whose
block-table entry lies outside the cache and clamps a length into the table (the kernels' documented
answer for a bad value, which they also report), applies the window and softcap, and takes the
softmax in float64. Outputs start as NaN.

The bound (:func:`bound`), from the arithmetic (``u = 2^-24``, fp32 throughout): a logit is a dot
product of D fp32 products, scaled twice: its absolute error is at most ``(D + 4) u`` times ``A``, the
largest ``scale * sum_d |q_d k_d|`` (a softcap's tanh has slope at most 1 and adds a few ulps of
``c``); ``2^(s - m)`` then has relative error at most that plus ``2 u A`` for the subtraction and a
few ``u`` for exp2: ``e_p <= (D + 8) u (A + c) + 4 u``. The output, a convex combination of the
value rows with weights off by ``e_p`` relatively, moves at most ``2 e_p max|v|``; the running
rescales and sums add about ``3 u`` of ``max|v|`` per key and per split; then one rounding to the
output's dtype (its unit roundoff times the fp32 value's magnitude).
"""

from __future__ import annotations

import functools
import math
import re
import struct

import pytest
import torch

from tests import cuda_on_cpu
from tileops.compile.build import emit_source, load_kernel
from tileops.kernels import get_spec
from tileops.kernels.paged_decode import LENS_WORD, TABLES_WORD
from tileops.kernels.report import CHECKS, ENTRY, RECORD_MAX

CPU = torch.device("cpu")
U = 2.0**-24
#: each output dtype's unit roundoff: a rounding to nearest moves a value by at most this, relatively
#: (half an ulp of the smallest value of its binade: 2^-p for p bits of precision)
UNIT = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
         torch.float8_e4m3fn: "float8_e4m3fn"}


# ------------------------------------------------------------------------------ the reference
def reference(q, kc, vc, bt, sl, layout, scale, softcap=None, window=None, k_scale=1.0, v_scale=1.0):
    """``(out, terms)``: out float64 ``[B, Hq, D]``; terms the magnitudes :func:`bound` needs (A, max|v|,
    the most keys a query saw)."""
    B, hq, d = q.shape
    hkv = kc.shape[2] if layout == "NHD" else kc.shape[1]
    bs = kc.shape[1] if layout == "NHD" else kc.shape[2]
    nblocks, g = kc.shape[0], hq // hkv
    kf = kc.to(torch.float32).double() * k_scale
    vf = vc.to(torch.float32).double() * v_scale
    if layout == "HND":  # [blocks, Hkv, bs, D] -> [blocks, bs, Hkv, D]
        kf, vf = kf.transpose(1, 2), vf.transpose(1, 2)
    out = torch.zeros(B, hq, d, dtype=torch.float64)
    a_max, v_max, n_max = 0.0, 0.0, 0
    for b in range(B):
        n = min(max(int(sl[b]), 0), bt.shape[1] * bs)
        lo = max(n - window, 0) if window else 0
        rows = [(int(bt[b, j // bs]), j % bs) for j in range(lo, n)]
        rows = [(p, r) for p, r in rows if 0 <= p < nblocks]
        n_max = max(n_max, len(rows))
        if not rows:
            continue
        for h in range(hq):
            keys = torch.stack([kf[p, r, h // g] for p, r in rows])
            vals = torch.stack([vf[p, r, h // g] for p, r in rows])
            qh = q[b, h].to(torch.float32).double()
            s = keys @ qh * scale
            a_max = max(a_max, float((keys.abs() @ qh.abs()).max()) * scale)
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            out[b, h] = torch.softmax(s, 0) @ vals
            v_max = max(v_max, float(vals.abs().max()))
    return out, dict(a=a_max, v=v_max, n=n_max)


def bound(terms: dict, d: int, splits: int, softcap: float | None, out: torch.Tensor, dtype) -> torch.Tensor:
    """The module docstring's bound on ``|kernel - reference|``, elementwise."""
    e_p = (d + 8) * U * (terms["a"] + (softcap or 0.0)) + 4 * U
    fp32 = terms["v"] * (2 * e_p + 3 * (terms["n"] + splits + 4) * U)
    return fp32 + UNIT[dtype] * (out.abs() + fp32) + 1e-300


# ------------------------------------------------------------------------------ launching
def spec(kind: str, dtype, cache_dtype=None, d=64, hq=8, hkv=2, **fields):
    return get_spec("paged_decode")(kind=kind, dtype=NAMES[dtype], cache_dtype=NAMES[cache_dtype or dtype],
                                    head_dim=d, hq=hq, hkv=hkv, **fields)


def bits(x: float) -> int:
    """The int32 whose bits are fp32 ``x`` (the programs take the scale and softcap so)."""
    return struct.unpack("<i", struct.pack("<f", x))[0]


@functools.lru_cache(maxsize=None)
def _emulated(s):
    """The CUDA schedule's source for spec ``s`` (its backend "c" replaced), run on the CPU
    (``tests/cuda_on_cpu.py``)."""
    import dataclasses

    return cuda_on_cpu.CudaOnCpu(emit_source("paged_decode", dataclasses.replace(s, backend="cuda"), "cuda", "sm_90"))


def _launch(s, cuda: bool, grid: int = 0, **args) -> None:
    if cuda:
        _emulated(s).launch(grid, s.threads, **args)
        return
    k = load_kernel("paged_decode", s, "c", "c", CPU, s.args)
    k(*k.bind(**args, **dict.fromkeys(k.extent_names, 0)))


def run(q, kc, vc, bt, sl, *, layout="NHD", splits=1, scale=0.125, softcap=None, window=None, k_scale=None,
        v_scale=None, tag=7, fields=None, cuda=False, direct=False):
    """``(out, err)``: both programs on the CPU (workspaces and out NaN-filled first), and the error
    entry they wrote. ``cuda``: the CUDA schedule's source run on the CPU, strides in its vectors.
    ``direct``: one split, the partial writing out itself (the runtime's plan for such calls), no merge;
    its workspaces stay NaN."""
    B, hq, d = q.shape
    hkv = kc.shape[2] if layout == "NHD" else kc.shape[1]
    bs = kc.shape[1] if layout == "NHD" else kc.shape[2]
    cache_dtype = kc.dtype
    if layout == "NHD":
        csb, csr, csh = kc.stride(0), kc.stride(1), kc.stride(2)
    else:
        csb, csr, csh = kc.stride(0), kc.stride(2), kc.stride(1)
    assert vc.stride() == kc.stride()
    fields = dict(window=window is not None, softcap=softcap is not None, **(fields or {}))
    max_blocks = bt.shape[1]
    chunk = max(1, math.ceil(max_blocks * bs / splits))
    op_ws = torch.full((B * hq * splits * d,), float("nan"), dtype=torch.float32)
    lp_ws = torch.full((B * hq * splits,), float("nan"), dtype=torch.float32)
    err = torch.zeros(ENTRY, dtype=torch.int32)
    ks = torch.tensor([k_scale or 1.0], dtype=torch.float32)
    vs = torch.tensor([v_scale or 1.0], dtype=torch.float32)
    raw = (lambda t: t.view(torch.uint8)) if cache_dtype == torch.float8_e4m3fn else (lambda t: t)
    part = spec("partial", q.dtype, cache_dtype, d, hq, hkv, **fields)
    merge = spec("merge", q.dtype, cache_dtype, d, hq, hkv, **fields)
    out = torch.full_like(q, float("nan"))
    u, uo = (part.vec, merge.vec) if cuda else (1, 1)  # the CUDA programs take strides in their vectors
    qsb, qsh, csb, csr, csh = (x // u for x in (q.stride(0), q.stride(1), csb, csr, csh))
    osb, osh = out.stride(0) // uo, out.stride(1) // uo
    grid = splits * hkv * (hq // hkv // part.heads_per_block) * B
    assert splits == 1 or not direct, "a direct call has one split"
    _launch(part, cuda, grid, Q=q.data_ptr(), KC=raw(kc).data_ptr(), VC=raw(vc).data_ptr(), BT=bt.data_ptr(),
            SL=sl.data_ptr(),
            KS=ks.data_ptr(), VS=vs.data_ptr(), OP=op_ws.data_ptr(), LP=lp_ws.data_ptr(), O=out.data_ptr(),
            ERR=err.data_ptr(), tag=tag,
            batch=B, splits=splits, chunk=chunk, nblocks=kc.shape[0], bs=bs, max_blocks=max_blocks,
            btb=bt.stride(0), qsb=qsb, qsh=qsh, csb=csb, csr=csr, csh=csh, scale_bits=bits(scale),
            softcap_bits=bits(softcap or 1.0), window=window or 0, osb=osb, osh=osh, direct=int(direct))
    if direct:
        assert op_ws.isnan().all() and lp_ws.isnan().all(), "a direct partial wrote a workspace"
    else:
        assert out.isnan().all(), "the partial wrote out without direct"
        _launch(merge, cuda, -(-B * hq // (merge.threads // merge.lanes)), OP=op_ws.data_ptr(), LP=lp_ws.data_ptr(),
                O=out.data_ptr(), batch=B, splits=splits, osb=osb, osh=osh)
    return out, err


def record(err: torch.Tensor, k: int) -> tuple[int, int] | None:
    """(offset, value) of check ``k``'s first bad element in an error entry, or None."""
    lo, hi = int(err[CHECKS + 2 * k]) & 0xFFFFFFFF, int(err[CHECKS + 2 * k + 1]) & 0xFFFFFFFF
    held = hi << 32 | lo
    if held == 0:
        return None
    packed = RECORD_MAX - held
    value = packed & 0xFFFFFFFF
    return packed >> 32, value - (1 << 32) if value >= 1 << 31 else value


# ------------------------------------------------------------------------------ inputs
def make(seed, *, lens, bs, layout="NHD", hq=8, hkv=2, d=64, dtype=torch.float32, cache_dtype=None, spare=3):
    """q ``[B, Hq, D]``, caches of ``sum(blocks) + spare`` blocks, each sequence's blocks scattered
    through them (a shuffled table), int32 block tables ``[B, max_blocks]`` (unused entries -1, which
    no length reaches) and lengths."""
    g = torch.Generator().manual_seed(seed)
    per = [max(1, math.ceil(n / bs)) for n in lens]
    nblocks = sum(per) + spare
    shape = (nblocks, bs, hkv, d) if layout == "NHD" else (nblocks, hkv, bs, d)
    kc, vc = (torch.randn(shape, generator=g) for _ in range(2))
    if cache_dtype == torch.float8_e4m3fn:
        kc, vc = (x.mul(40).clamp(-448, 448).to(torch.float8_e4m3fn) for x in (kc, vc))
    else:
        kc, vc = kc.to(dtype), vc.to(dtype)
    order = torch.randperm(nblocks, generator=g).to(torch.int32)
    bt = torch.full((len(lens), max(per) + 1), -1, dtype=torch.int32)
    at = 0
    for b, n in enumerate(per):
        bt[b, :n] = order[at:at + n]
        at += n
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    return q, kc, vc, bt, torch.tensor(lens, dtype=torch.int32)


def check(q, kc, vc, bt, sl, *, layout="NHD", splits=1, scale=0.125, softcap=None, window=None, k_scale=1.0,
          v_scale=1.0, fields=None, cuda=False):
    fp8 = kc.dtype == torch.float8_e4m3fn
    got, err = run(q, kc, vc, bt, sl, layout=layout, splits=splits, scale=scale, softcap=softcap, window=window,
                   k_scale=k_scale if fp8 else None, v_scale=v_scale if fp8 else None, fields=fields, cuda=cuda)
    want, terms = reference(q, kc, vc, bt, sl, layout, scale, softcap, window, k_scale if fp8 else 1.0,
                            v_scale if fp8 else 1.0)
    assert not got.isnan().any(), "a NaN in out (an element never written?)"
    e = (got.double() - want).abs()
    tol = bound(terms, q.shape[-1], splits, softcap, want, q.dtype)
    bad = e > tol
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} off; worst {e.max().item():.3e}, "
                           f"{(e / tol).max().item():.2f} x its bound, first at {bad.nonzero()[0].tolist()}")
    return got, err


# ------------------------------------------------------------------------------ tests
#: both schedules: the C one, and the CUDA one's generated source run on the CPU
NO_CXX = pytest.mark.skipif(not cuda_on_cpu.available(), reason="no C++ compiler to run the CUDA source on the CPU")
SCHEDULES = pytest.mark.parametrize("cuda", [False, pytest.param(True, marks=NO_CXX)], ids=["c", "cuda-on-cpu"])
LENS = [37, 0, 1, 16, 64, 23]  # an empty sequence, one token, a block exactly, blocks and a part


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("bs", [1, 16, 5])
@pytest.mark.parametrize("splits", [1, 3])
@SCHEDULES
def test_layouts_block_sizes_and_splits(layout, bs, splits, cuda):
    t = make(41, lens=LENS, bs=bs, layout=layout)
    got, err = check(*t, layout=layout, splits=splits, cuda=cuda)
    assert bool((got[1] == 0).all()), "a sequence of no token outputs zeros"
    assert int(err[0]) == 0 and int(err[1]) == 0, "nothing reported for good tables"


@SCHEDULES
def test_splits_agree_with_one_split(cuda):
    """More splits than a sequence has tokens: splits that see no key weigh nothing in the merge."""
    t = make(42, lens=[3, 40], bs=4)
    check(*t, splits=7, cuda=cuda)  # chunks of 7 tokens over a table of 11 blocks: sequence 0 has one split of keys


@pytest.mark.parametrize("splits", [8, 11, 17])
@SCHEDULES
def test_many_splits_merge_in_rounds(splits, cuda):
    """The CUDA merge reads the splits MERGE_SPLITS (8) a round: one whole round, a second round cut at 3
    splits, three rounds; a split past the last weighs 0. Sequence 1's 5 tokens leave most splits empty."""
    from tileops.kernels.paged_decode import MERGE_SPLITS

    assert MERGE_SPLITS == 8
    check(*make(47, lens=[200, 5], bs=16), splits=splits, cuda=cuda)


@pytest.mark.parametrize("case", ["fp32", "bf16-hnd", "fp16-window-softcap", "float8", "bad-table"])
@SCHEDULES
def test_one_split_written_directly_is_the_merge_to_the_bit(case, cuda):
    """A call of one split (the runtime's DIRECT plan): the partial program writes out itself, no merge
    and no workspace written; the same bits as the partial and merge of one split, and the same report
    of a bad table entry."""
    dtype = {"fp32": torch.float32, "fp16-window-softcap": torch.float16}.get(case, torch.bfloat16)
    layout = "HND" if case in ("bf16-hnd", "float8") else "NHD"
    t = list(make(47, lens=LENS, bs=16, layout=layout, dtype=dtype,
                  cache_dtype=torch.float8_e4m3fn if case == "float8" else None))
    if case == "bad-table":
        t[3] = t[3].clone()
        t[3][4, 1] = 10**6  # sequence 4's second block: outside the cache
    kw = dict(layout=layout, cuda=cuda, **({"window": 9, "softcap": 5.0, "scale": 0.3} if "window" in case else {}),
              **({"k_scale": 0.03, "v_scale": 0.5} if case == "float8" else {}))
    merged, err = run(*t, **kw)
    direct, err_direct = run(*t, direct=True, **kw)
    assert not direct.isnan().any() and torch.equal(direct, merged)
    assert torch.equal(err_direct, err) and (int(err[TABLES_WORD]) != 0) == (case == "bad-table")


@pytest.mark.parametrize("splits,direct", [(1, True), (1, False), (3, False)],
                         ids=["direct", "one-split-merged", "three-splits"])
@SCHEDULES
def test_a_nan_in_q_or_the_caches_gives_nan_where_the_definition_puts_it(splits, direct, cuda):
    """NaN in, NaN out, as torch's attention gives: the programs had tested ``l > 0`` for "this head saw a
    key", so a NaN score made a plausible head of zeros (and the merge dropped a NaN split). Now only a head
    that saw no key (l exactly 0) is zeros; a NaN key element or a NaN in q makes the heads that read it
    NaN, a NaN value element their column; a NaN in a block no table reaches is never read."""
    q, kc, vc, bt, sl = make(48, lens=LENS, bs=16)  # LENS = [37, 0, 1, 16, 64, 23]; kv heads 2 of 4 q heads
    nan = float("nan")
    kc[bt[0, 0], 5, 0, 7] = nan  # sequence 0, token 5, kv head 0: q heads 0-3 of sequence 0
    vc[bt[4, 2], 8, 1, 3] = nan  # sequence 4, token 40, kv head 1: column 3 of q heads 4-7
    q[5, 2, 11] = nan  # sequence 5, q head 2
    unread = sorted(set(range(kc.shape[0])) - set(bt.flatten().tolist()))
    kc[unread[0]] = nan  # a spare block: no table reaches it
    got, err = run(q, kc, vc, bt, sl, splits=splits, direct=direct, cuda=cuda)
    want, terms = reference(q, kc, vc, bt, sl, "NHD", 0.125)
    assert torch.equal(got.isnan(), want.isnan()) and 0 < int(want.isnan().sum()) < want.numel() // 4
    fine = ~want.isnan()
    tol = bound(terms, q.shape[-1], splits, None, want.nan_to_num(), q.dtype)
    assert bool(((got.double() - want).abs()[fine] <= tol[fine]).all())
    assert int(err[0]) == 0 and int(err[1]) == 0


@pytest.mark.parametrize("tok", [0, 9, 32], ids=["first-key", "a-later-key", "token-32"])
@pytest.mark.parametrize("splits", [1, 2])
@SCHEDULES
def test_a_key_scoring_minus_inf_weighs_nothing(tok, splits, cuda):
    """A key whose score is -inf (an infinite key element against positive q elements) weighs 0, as softmax
    gives it. The C schedule's online softmax took 2^(s - m') = 2^(-inf + inf), NaN, where it was a split's
    first key: token 0, and token 32 of sequence 0 with two splits (its table of 4 blocks in chunks of 32
    tokens)."""
    q, kc, vc, bt, sl = make(50, lens=[37, 16, 10], bs=16)
    q[..., 0] = q[..., 0].abs() + 0.5  # every q head's first element positive
    hit = []
    for b, n in enumerate([37, 16, 10]):
        if tok < n:  # sequence b's token tok, kv head 0 (q heads 0-3)
            kc[bt[b, tok // 16], tok % 16, 0, 0] = float("-inf")
            hit.append(b)
    got, err = run(q, kc, vc, bt, sl, splits=splits, cuda=cuda)
    want, _ = reference(q, kc, vc, bt, sl, "NHD", 0.125)
    _, terms = reference(q, kc.nan_to_num(neginf=0.0), vc, bt, sl, "NHD", 0.125)  # the bound's magnitudes
    assert not want.isnan().any() and hit
    assert not got.isnan().any(), f"NaN at {got.isnan().nonzero()[0].tolist()}"
    tol = bound(terms, q.shape[-1], splits, None, want, q.dtype)
    assert bool(((got.double() - want).abs() <= tol).all())
    assert int(err[0]) == 0 and int(err[1]) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@SCHEDULES
def test_half_dtypes(dtype, cuda):
    check(*make(43, lens=LENS, bs=16, dtype=dtype), splits=2, cuda=cuda)


@SCHEDULES
def test_float8_cache_with_scales(cuda):
    t = make(44, lens=LENS, bs=16, layout="HND", dtype=torch.bfloat16, cache_dtype=torch.float8_e4m3fn)
    check(*t, layout="HND", splits=2, k_scale=0.03, v_scale=0.5, cuda=cuda)


@pytest.mark.parametrize("window", [1, 7, 100])
@SCHEDULES
def test_window_and_softcap(window, cuda):
    check(*make(45, lens=LENS, bs=16), splits=3, window=window, softcap=5.0, scale=0.3, cuda=cuda)


@SCHEDULES
def test_mha_head_dim_128(cuda):
    check(*make(46, lens=[70, 2], bs=16, hq=4, hkv=4, d=128), splits=2, cuda=cuda)


# The CUDA schedule's shapes of lanes, heads and tokens: head_dim 256 (a warp a token), 80 (10 vectors in
# a group of 16 lanes, 6 idle), fp32 (4-element vectors), a group of 16 q heads (two programs of 8
# heads a kv head), 64 and 256 threads, 1 and 4 tokens a lane group a step, the next step's loads
# issued early (prefetch), steps copied ahead into shared memory (stages; the harness copies at once, and
# starts each block's shared memory as NaN bytes, so a token not read must be zeroed, not left stale)
@NO_CXX
@pytest.mark.parametrize("d,dtype,hq,hkv,fields", [
    (256, torch.bfloat16, 4, 2, {}),
    (80, torch.float16, 6, 2, {}),
    (64, torch.float32, 8, 2, {}),
    (64, torch.bfloat16, 16, 1, {}),
    (128, torch.bfloat16, 8, 2, {"threads": 64, "unroll": 1}),
    (64, torch.float16, 8, 2, {"threads": 256, "unroll": 4}),
    (128, torch.bfloat16, 8, 2, {"prefetch": 1}),
    (64, torch.float16, 8, 2, {"prefetch": 1, "unroll": 1, "threads": 64}),
    (128, torch.bfloat16, 8, 2, {"stages": 2}),
    (80, torch.float16, 6, 2, {"stages": 1, "unroll": 1, "threads": 64}),
    (64, torch.float32, 8, 2, {"stages": 4, "unroll": 3}),
], ids=["d256", "d80-spare-lanes", "fp32", "group16", "64-threads-unroll1", "256-threads-unroll4", "prefetch",
        "prefetch-unroll1", "stages2", "stages1-spare-lanes", "stages4-fp32"])
def test_cuda_schedule_shapes(d, dtype, hq, hkv, fields):
    t = make(48, lens=[150, 0, 1, 33], bs=16, hq=hq, hkv=hkv, d=d, dtype=dtype, layout="HND")
    got, _ = check(*t, layout="HND", splits=2, fields=fields, cuda=True)
    assert bool((got[1] == 0).all())


@NO_CXX
def test_cuda_stages_with_a_float8_cache_bad_entries_and_a_window():
    """Copies ahead of 8-byte float8 vectors; a bad table entry inside a step copied ahead is reported
    and its token skipped (its slot zeroed), as the register schedule does."""
    q, kc, vc, bt, sl = make(49, lens=[90, 3, 47], bs=8, layout="HND", dtype=torch.bfloat16,
                             cache_dtype=torch.float8_e4m3fn)
    bt[0, 4] = kc.shape[0]  # one past the cache: tokens 32-39 of sequence 0
    fields = {"stages": 3, "unroll": 2}
    got, err = check(q, kc, vc, bt, sl, layout="HND", splits=2, k_scale=0.03, v_scale=0.5, window=60,
                     fields=fields, cuda=True)
    assert record(err, TABLES_WORD) == (4, kc.shape[0])


@SCHEDULES
def test_bad_block_table_entries_and_lengths_are_reported_and_skipped(cuda):
    """An entry outside the cache (negative, or at num_blocks) is skipped and reported, the first one by
    its offset in the table; a length past the table reads the table's tokens and is reported; the
    other sequences are untouched."""
    q, kc, vc, bt, sl = make(47, lens=[40, 30, 20], bs=8)
    nblocks = kc.shape[0]
    bt[0, 2] = nblocks  # sequence 0's third block (tokens 16-23)
    bt[0, 4] = -5
    sl[2] = bt.shape[1] * 8 + 9  # sequence 2: past its table (whose unused entries are -1: skipped too)
    got, err = check(q, kc, vc, bt, sl, splits=2, cuda=cuda)
    assert int(err[LENS_WORD]) == 7 and int(err[TABLES_WORD]) == 7, "the call's tag in both words"
    assert record(err, TABLES_WORD) == (0 * bt.stride(0) + 2, nblocks), record(err, TABLES_WORD)
    assert record(err, LENS_WORD) == (2, int(sl[2])), record(err, LENS_WORD)
    *_, bt0, sl0 = make(47, lens=[40, 30, 20], bs=8)
    good, _ = run(q, kc, vc, bt0, sl0, splits=2, cuda=cuda)
    assert torch.equal(got[1], good[1]), "sequence 1, whose table and length are good, is as it was"


def test_e4m3_decode_every_bit_pattern():
    """The float8 read, alone: every one of the 256 bit patterns against torch's float8 -> float32."""
    from tileops.compile import build, tilelang_api
    from tileops.kernels import paged_decode

    tilelang = tilelang_api.load()
    paged_decode._tl()
    import tilelang.language as T

    @T.prim_func
    def decode(X: T.Tensor((256,), "uint8"), Y: T.Tensor((256,), "float32")):
        with T.Kernel(1, threads=1):
            for i in T.serial(256):
                Y[i] = paged_decode.e4m3_f32(X[i])

    k = tilelang.compile(decode, target="c", execution_backend="cython", pass_configs=build.PASS_CONFIGS,
                         compile_flags=list(build.c_flags()))
    x = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    y = torch.full((256,), 12345.0)
    k(x, y)
    want = x.view(torch.float8_e4m3fn).to(torch.float32)
    nan = want.isnan()
    assert torch.equal(y.isnan(), nan)
    assert torch.equal(y[~nan], want[~nan]) and torch.equal(y[~nan].signbit(), want[~nan].signbit())


def test_spec_refuses_what_it_cannot_build():
    with pytest.raises(ValueError, match=r"head_dim: the CUDA paged decode reads a row as vectors of 8 elements, "
                                         r"one a lane of a warp: expected a multiple of 8 up to 256, got 260"):
        spec("partial", torch.bfloat16, d=260, backend="cuda")
    with pytest.raises(ValueError, match=r"head_dim: .* expected a multiple of 4 up to 128, got 66"):
        spec("partial", torch.float32, d=66, backend="cuda")
    with pytest.raises(ValueError, match=r"backend: expected 'c' or 'cuda', got 'metal'"):
        spec("partial", torch.float32, backend="metal")
    with pytest.raises(ValueError, match=r"cache_dtype: expected the query's dtype 'bfloat16' or 'float8_e4m3fn'"):
        spec("partial", torch.bfloat16, torch.float16)
    with pytest.raises(ValueError, match=r"hq: expected a multiple of hkv=3, got 8"):
        spec("partial", torch.float32, hq=8, hkv=3)
    with pytest.raises(ValueError, match=r"kind: expected 'partial' or 'merge'"):
        spec("fwd", torch.float32)


# ------------------------------------------------------------------------------ the tensor-core schedule
# (``mma=1``: mma.sync and ldmatrix, which the CPU harness cannot run; its results are checked on the
# GPU, ``tests/test_paged_decode_cuda.py``. Here: what it accepts, how a call keys it, and that TileLang
# lowers it into tensor-core products fed by 16-byte gathers.)
def test_tensor_core_schedule_refuses_what_it_cannot_take():
    with pytest.raises(ValueError, match=r"mma: the tensor-core products take 16-bit operands.*got float32"):
        spec("partial", torch.float32, backend="cuda", mma=1)
    with pytest.raises(ValueError, match=r"tile: expected 16, 32, 64 or 128, got 48"):
        spec("partial", torch.bfloat16, backend="cuda", mma=1, tile=48)
    with pytest.raises(ValueError, match=r"tile: .* at least 8 \(mma's n8\) a warp: expected tile >= 32 at "
                                         r"threads=128, got 16"):
        spec("partial", torch.bfloat16, backend="cuda", mma=1, tile=16, threads=128)
    with pytest.raises(ValueError, match=r"TileLang 0.1.15 cannot lower .* threads=256 with tile=128"):
        spec("partial", torch.bfloat16, backend="cuda", mma=1, tile=128, threads=256)
    with pytest.raises(ValueError, match=r"mma: expected 0 or 1, got 2"):
        spec("partial", torch.bfloat16, backend="cuda", mma=2)
    assert spec("partial", torch.bfloat16, hq=32, hkv=1, mma=1).heads_per_block == 16  # MMA_ROWS, not 8
    assert spec("partial", torch.bfloat16, hq=32, hkv=1).heads_per_block == 8


def test_a_call_keys_each_program_by_the_knobs_it_reads():
    """With ``mma`` in the manifest's schedule: a 16-bit call's partial takes it and drops the CUDA cores'
    token-loop knobs, an fp32 call's keeps the CUDA cores' schedule, and the merge is keyed by its
    threads alone (one merge for every partial schedule)."""
    import dataclasses

    from tileops.attention import PagedAttnDecodeFwdOp
    from tileops.attention.decode_builtin import kernel_specs
    from tileops.manifest import call_specs

    op = PagedAttnDecodeFwdOp(8, 2, 128)
    static = {"threads": 128, "unroll": 4, "stages": 2, "mma": 1, "tile": 32}
    m = dataclasses.replace(op.manifest, kernel=dataclasses.replace(op.manifest.kernel, static=static))
    dims = {"q_dim": 128, "q_heads": 8, "cache_heads": 2}
    got = {}
    for dt in ("bfloat16", "float32"):
        [call] = call_specs(m, dims, [dt], torch.device("cuda"), (), params=op.params)
        got[dt] = {s.kind: s for _, s in kernel_specs(m, op.params, call, "cuda")}
    bf, f32 = got["bfloat16"], got["float32"]
    assert (bf["partial"].mma, bf["partial"].tile, bf["partial"].unroll, bf["partial"].stages) == (1, 32, 2, 0)
    assert (f32["partial"].mma, f32["partial"].unroll, f32["partial"].stages) == (0, 4, 2)
    plain = spec("merge", torch.bfloat16, d=128, backend="cuda", threads=128)
    assert bf["merge"] == plain and f32["merge"] == dataclasses.replace(plain, dtype="float32",
                                                                        cache_dtype="float32")


@pytest.mark.parametrize("d,cache,want", [(128, "bfloat16", (128, 1)), (64, "float16", (128, 1)),
                                          (128, "float8_e4m3fn", (64, 1)), (256, "bfloat16", (64, 0)),
                                          (128, "float32", None)])
def test_the_manifests_tensor_core_tile_and_where_it_narrows(d, cache, want):
    """The manifest's tensor-core partial (tiles of 128 tokens, the next one loaded during the products)
    for 16-bit caches up to head_dim 128; a float8 cache, which the manifest widens eight elements at
    once, takes tiles of 64 with the prefetch (``decode_builtin._MMA_FLOAT8_WIDENED``); head_dim 256 takes
    tiles of 64 without the prefetch (``_MMA_NARROW``: tiles of 128 spill there), as would a float8 cache
    read one element at a time. fp32 q
    takes the CUDA cores' loop, its copies ahead the manifest's ``stages``, none of the tensor-core knobs
    (its ``prefetch`` with ``stages`` would be refused)."""
    from tileops.attention import PagedAttnDecodeFwdOp
    from tileops.attention.decode_builtin import kernel_specs, target_programs
    from tileops.manifest import call_specs

    op = PagedAttnDecodeFwdOp(8, 2, d, cache_dtype=cache if cache.startswith("float8") else None)
    dims = {"q_dim": d, "q_heads": 8, "cache_heads": 2}
    dtypes = ["bfloat16" if cache.startswith("float8") else cache]
    [call] = call_specs(op.manifest, dims, dtypes, torch.device("cuda"), ("k_scale", "v_scale") if cache.startswith(
        "float8") else (), params=op.params)
    partial = {s.kind: s for _, s in kernel_specs(op.manifest, op.params, call, "cuda")}["partial"]
    if want is None:
        assert (partial.mma, partial.prefetch, partial.stages) == (0, 0, op.manifest.kernel.static["stages"])
        assert target_programs(partial) == 264
        return
    assert (partial.mma, partial.cache_dtype, partial.head_dim) == (1, cache, d)
    assert (partial.tile, partial.prefetch) == want
    assert partial.widen == (1 if cache.startswith("float8") else 0)
    # the split rule aims for one wave of the schedule's programs: 2 an SM at tiles of 128 or head_dim 256, 4
    # at tiles of 64 up to head_dim 128
    assert target_programs(partial) == 132 * (4 if want[0] == 64 and d <= 128 else 2)


@pytest.mark.parametrize("cache_dtype,prefetch", [(torch.bfloat16, 0), (torch.float8_e4m3fn, 0), (torch.bfloat16, 1)])
def test_tensor_core_schedule_lowers_to_mma_fed_by_16_byte_gathers(cache_dtype, prefetch):
    src = emit_source("paged_decode", spec("partial", torch.bfloat16, cache_dtype, d=128, hq=32, hkv=8,
                                           backend="cuda", mma=1, tile=64, prefetch=prefetch), "cuda", "sm_90")
    assert src.count("tl::mma_sync<tl::DataType::kBFloat16") >= 2  # S = Q K^T and O += P V
    loads = re.findall(r"\*\((uint\d)\*\)\((?:KC|VC) \+", src)
    # every key and value vector one load: 16 bytes of bf16, 8 of float8 (a T.Parallel copy moved 4)
    assert loads and set(loads) == {"uint4" if cache_dtype == torch.bfloat16 else "uint2"}, loads


def test_min_blocks_asks_nvcc_for_programs_an_sm_and_the_split_rule_aims_at_them():
    """``min_blocks`` (the tensor-core partial): ``__launch_bounds__(threads, min_blocks)`` in the source,
    which caps ptxas's registers a thread, and the split rule's programs an SM at least that many; 1 (the
    default) leaves the source as it was. Refused for the merge and the CUDA cores' program."""
    from tileops.attention.decode_builtin import target_programs

    fields = dict(d=128, hq=32, hkv=8, backend="cuda", mma=1, tile=128, prefetch=1, widen=1)
    three = spec("partial", torch.bfloat16, torch.float8_e4m3fn, **fields, min_blocks=3)
    assert "__launch_bounds__(128, 3)" in emit_source("paged_decode", three, "cuda", "sm_90")
    one = spec("partial", torch.bfloat16, torch.float8_e4m3fn, **fields)
    assert "__launch_bounds__(128, 1)" in emit_source("paged_decode", one, "cuda", "sm_90")
    assert (target_programs(one), target_programs(three)) == (2 * 132, 3 * 132)
    with pytest.raises(ValueError, match=r"min_blocks: the tensor-core partial's programs an SM"):
        spec("merge", torch.bfloat16, d=128, backend="cuda", min_blocks=2)
    with pytest.raises(ValueError, match=r"min_blocks: the tensor-core partial's programs an SM"):
        spec("partial", torch.float32, d=128, backend="cuda", min_blocks=2)
    with pytest.raises(ValueError, match=r"min_blocks: expected an int in \[1, 8\], got 9"):
        spec("partial", torch.bfloat16, d=128, backend="cuda", mma=1, min_blocks=9)


# ``widen=1`` (the tensor-core partial with a float8 cache): eight e4m3fn bytes widened at once
# (``kernels/paged_decode.py`` E4M3X8_HELPER) and stored as one 16-byte vector into the products' tile.
def _widening_program():
    """E4M3X8_HELPER's widening as deposit_widened calls it: 256 threads, each 8 bytes of X (loaded as one
    vector into registers) and its OK flag, into 8 fp16 elements of Y (one vector store)."""
    from tileops.compile import tilelang_api
    from tileops.kernels import paged_decode

    tilelang_api.load()
    paged_decode._tl()
    import tilelang.language as T

    widen = paged_decode.WIDEN_FUNCTION

    @T.prim_func
    def widening(X: T.Tensor((2048,), "uint8"), OK: T.Tensor((256,), "int32"), Y: T.Tensor((2048,), "float16")):
        with T.Kernel(1, threads=256):
            T.import_source(paged_decode.E4M3X8_HELPER)
            tx = T.get_thread_binding()
            xb = T.alloc_local((8,), "uint8")
            yb = T.alloc_local((8,), "float16")
            for v in T.vectorized(8):
                xb[v] = X[tx * 8 + v]
            T.evaluate(T.call_extern("handle", widen, T.address_of(yb[0]), T.address_of(xb[0]), OK[tx]))
            for v in T.vectorized(8):
                Y[tx * 8 + v] = yb[v]

    return widening


@NO_CXX
def test_float8_widening_reads_every_code_as_torch_does():
    """Each of the 256 e4m3fn codes at each of the 8 places of a vector, widened on the CPU (the helper's
    ``#else`` model stands for the hardware's e4m3x2 -> f16x2 conversion): torch's float8 -> float32 value
    exactly (rounded to fp16: exact, e4m3's values are fp16 values), -0 kept, NaN for NaN; eight zeros for a
    vector whose flag is 0."""
    dtype = torch.float16
    from tileops.compile import build, tilelang_api

    tilelang = tilelang_api.load()
    from tvm import target as tvm_target
    from tvm import transform

    target = tvm_target.Target({"kind": "cuda", "arch": "sm_90"})
    with target, transform.PassContext(config=build.PASS_CONFIGS):
        src = tilelang.lower(_widening_program(), target=target).kernel_source
    # one 16-byte store of the widened vector, as in the decode's shared tile
    assert re.search(r"\*\(uint4\*\)\(Y \+ .*\) = \*\(uint4\*\)\(yb \+ 0\)", src), src
    emulated = cuda_on_cpu.CudaOnCpu(src)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    x = torch.cat([codes.view(32, 8).roll(r, dims=1).flatten() for r in range(8)])
    ok = torch.tensor([0 if i % 37 == 5 else 1 for i in range(256)], dtype=torch.int32)  # 7 vectors not read
    y = torch.full((2048,), float("nan"), dtype=dtype)
    emulated.launch(1, 256, X=x.data_ptr(), OK=ok.data_ptr(), Y=y.data_ptr())
    want = x.view(torch.float8_e4m3fn).to(torch.float32).to(dtype)
    read = ok.repeat_interleave(8).bool()
    assert torch.equal(y[~read].float(), torch.zeros(int((~read).sum()))) and not y[~read].signbit().any()
    got, want = y[read].double(), want[read].double()
    nan = want.isnan()
    assert int(nan.sum()) >= 14 and torch.equal(got.isnan(), nan)  # 0x7F and 0xFF at every place, but where not read
    assert torch.equal(got[~nan], want[~nan]) and torch.equal(got[~nan].signbit(), want[~nan].signbit())


def test_widening_is_the_tensor_core_partials_alone():
    """``widen`` is read by the tensor-core partial with a float8 cache only: the spec refuses it elsewhere,
    and a call's kernels drop it where nothing reads it (a sweep may set it for every cache). Widened, a
    float8 cache is not narrowed to tiles of 64 without the prefetch."""
    from tileops.attention import PagedAttnDecodeFwdOp
    from tileops.attention.decode_builtin import kernel_specs
    from tileops.manifest import call_specs

    with pytest.raises(ValueError, match=r"widen: the tensor-core partial's float8 widening; expected widen=0 "
                                         r"with mma=1, kind 'partial' and cache_dtype 'bfloat16'"):
        spec("partial", torch.bfloat16, backend="cuda", mma=1, widen=1)
    with pytest.raises(ValueError, match=r"widen: .* with mma=0"):
        spec("partial", torch.bfloat16, torch.float8_e4m3fn, backend="cuda", widen=1)
    with pytest.raises(ValueError, match=r"widen: expected 0 or 1, got 2"):
        spec("partial", torch.bfloat16, torch.float8_e4m3fn, backend="cuda", mma=1, widen=2)
    from benchmarks.decode import with_schedule

    dims = {"q_dim": 128, "q_heads": 8, "cache_heads": 2}
    for cache, given, dtype, want in ((None, (), "bfloat16", 0), (torch.float8_e4m3fn, ("k_scale", "v_scale"),
                                                                  "bfloat16", 1),
                                      (torch.float8_e4m3fn, ("k_scale", "v_scale"), "float32", 0)):
        op = with_schedule(PagedAttnDecodeFwdOp(8, 2, 128, cache_dtype=cache), {"widen": 1})
        (call,) = call_specs(op.manifest, dims, [dtype], torch.device("cuda"), given, params=op.params)
        partial, merge = [s for _, s in kernel_specs(op.manifest, op.params, call, "cuda")]
        assert (partial.widen, merge.widen) == (want, 0), (cache, dtype)
        if want:  # widened, a float8 cache keeps the manifest's prefetch at tiles of 64 (not _MMA_NARROW's 64, 0)
            static = op.manifest.kernel.static
            assert (partial.tile, partial.prefetch) == (64, static["prefetch"]) == (64, 1)


@pytest.mark.parametrize("dtype,tile,prefetch", [(torch.bfloat16, 64, 0), (torch.float16, 64, 0),
                                                 (torch.bfloat16, 128, 1), (torch.bfloat16, 64, 1)])
def test_widened_tensor_core_partial_lowers_to_16_byte_shared_stores(dtype, tile, prefetch):
    """With ``widen``, the float8 tile reaches shared memory in 16-byte stores of fp16 through the helper,
    not element by element through three conversions (``E4M3_HELPER`` gone from the source). The products
    are fp16 for either q; a bf16 q's rows are rescaled into them by a power of two each, undone on the
    scores (``rowf``), and out stays bf16."""
    src = emit_source("paged_decode", spec("partial", dtype, torch.float8_e4m3fn, d=128, hq=32, hkv=8, backend="cuda",
                                           mma=1, tile=tile, prefetch=prefetch, widen=1), "cuda", "sm_90")
    assert src.count("  tileops_e4m3x8_f16((&(w") == 2 and "tileops_e4m3_f32(" not in src  # keys and values, once each
    stores = re.findall(r"\*\(uint4\*\)\(\(\(half_t\*\)(Ks|Vs)\) \+ .*?\) = \*\(uint4\*\)\((wk|wv) \+ 0\)", src)
    assert sorted(set(stores)) == [("Ks", "wk"), ("Vs", "wv")], stores
    operands = set(re.findall(r"\(\((\w+)\*\)(?:Qs|Ks|Vs|Ps)\)", src))
    assert operands == {"half_t"}, operands  # every product's operand fp16
    bf16 = dtype == torch.bfloat16
    assert ("rowf[" in src) == bf16 and ("tl::AllReduce<tl::MaxOp" in src.split("for (int it")[0]) == bf16
    assert re.search(r"\b" + ("bfloat16_t" if bf16 else "half_t") + r" O_local_cast", src)  # out in q's dtype
