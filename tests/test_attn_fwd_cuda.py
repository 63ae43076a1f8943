"""``AttnFwdOp`` on CUDA (skipped without a GPU; run on the H200): the FlashAttention tile program of
``kernels/attention.py`` over the CPU tests' matrix in bf16 and fp16, every head_dim, varlen, HF's
views, a view off the 16-byte vectors (copied), ``out=`` and the fast path.

Against the float64 reference of ``tests/references_attention.py``; outputs start as NaN. Tolerance
(``_tol``), from the arithmetic: the CPU's bound (``tests/test_attn_fwd.py``) with the GPU's exp2
(``ex2.approx``, about 2^-22 relative, in place of 2^-24) and one more rounding of the dtype: the
kernel rounds P to the dtype before ``P V`` on the tensor cores (as FlashAttention does), an error of
at most one half-ulp of each p, so ``u * sum_j p_j |v_j|`` on the output; the output's store adds
another ``u`` of the same magnitude.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import tileops
from tests.test_attn_fwd import value_nan_spread
from tileops.attention import AttnFwdOp

pytestmark = pytest.mark.cuda

_spec = importlib.util.spec_from_file_location("_attn_fwd_cuda_refs", Path(__file__).with_name("references_attention.py"))
refs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(refs)

DEV = "cuda"
_UNIT = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
DTYPES = [torch.bfloat16, torch.float16]


def _inputs(seed, q_shape, kv_shape, dtype):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(s, generator=g).to(dtype).to(DEV) for s in (q_shape, kv_shape, kv_shape))


def _check(op, q, k, v, cu_q=None, cu_k=None, out=None):
    kw = {} if cu_q is None else {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
    out = torch.full_like(q, float("nan")) if out is None else out.fill_(float("nan"))
    got, lse = op(q, k, v, out=out, return_lse=True, **kw)
    torch.cuda.synchronize()
    assert got is out
    cpu = {n: t.cpu() for n, t in {"q": q, "k": k, "v": v, **kw}.items()}
    ref = refs.attention(dict(op.params), cpu)
    fp32_terms = (2 * q.shape[-1] + 2 * k.shape[-3] + 64) * (1 + ref["smax"]) * 2.0**-22
    tol = (fp32_terms + 2 * _UNIT[q.dtype]) * ref["scale"] + 1e-30
    err = (got.cpu().double() - ref["out"]).abs()
    assert bool(torch.isfinite(got).all()), "a NaN or inf in out (an element never written?)"
    bad = err > tol
    assert not bool(bad.any()), (f"{int(bad.sum())} of {bad.numel()} off; max err {err.max().item():.3g}, "
                                 f"first at {bad.nonzero()[0].tolist()}")
    empty = torch.isinf(ref["lse"])
    lse = lse.cpu()
    assert torch.equal(torch.isneginf(lse), empty)
    lerr = (lse.double() - ref["lse"])[~empty].abs()
    assert lerr.numel() == 0 or lerr.max().item() <= fp32_terms + 2.0**-22 * ref["lse"][~empty].abs().max().item()
    return got


# (causal, window, seq_q, seq_k); lengths off the tiles (block_M 64/128, block_N 64/128)
MASKS = [(False, None, 200, 333), (True, None, 257, 257), (True, None, 130, 300), (True, None, 300, 130),
         (False, 70, 150, 260), (True, 50, 260, 260)]


@pytest.fixture(scope="module", autouse=True)
def warm():
    """Every forward kernel of this module's ops, compiled at once, a process a CPU (TileLang's build of
    one takes 16-18 s on the H200; one after another they held a run for minutes). Under pytest-xdist
    the first worker compiles and the others wait for it (:func:`tileops.compile.warmup.compile_jobs`).
    A kernel that fails to build fails its own test, where it is built again."""
    if not torch.cuda.is_available():
        return
    from tileops.compile.build import device_backend
    from tileops.compile.warmup import compile_jobs, op_kernel_jobs

    arch = device_backend(torch.device(DEV))[1]
    ops = ([(8, 2, 128, dict(causal=c, sliding_window=w), "bfloat16", False) for c, w, _, _ in MASKS]
           + [(8, 2, 128, dict(causal=True, softcap=20.0, softmax_scale=0.2), "bfloat16", False)]
           + [(4, 2, d, dict(causal=True), "float16", False) for d in (64, 80, 96, 128, 256)]
           + [(4, 4, 64, {}, dt, False) for dt in ("bfloat16", "float16")]
           + [(8, 2, 128, dict(causal=True), "bfloat16", True), (4, 2, 64, {}, "float16", False)])
    jobs = []
    for hq, hkv, d, kw, dtype, varlen in ops:
        op = AttnFwdOp(hq, hkv, d, **kw)
        jobs += op_kernel_jobs(op.name, dict(op.params), {"q_dim": d, "q_heads": hq, "kv_heads": hkv}, [dtype], arch,
                               with_inputs=("cu_seqlens_q", "cu_seqlens_k") if varlen else (), backward=False)
    compile_jobs(jobs, progress=False)


@pytest.mark.parametrize("causal,window,sq,sk", MASKS)
def test_masks_gqa_bf16(causal, window, sq, sk):
    op = AttnFwdOp(8, 2, 128, causal=causal, sliding_window=window)
    _check(op, *_inputs(31, (2, sq, 8, 128), (2, sk, 2, 128), torch.bfloat16))


def test_blocks_that_walk_no_tile_write_zeros():
    """Causal, seq_q 2048 against 64 keys: 15 of each head's 16 row tiles sit above the diagonal and see
    no key, so their rows are zeros and their lse -inf. Such a block walked no K/V tile. On sm_90 its
    output tile is staged in the shared memory of its Q tile, whose TMA load is waited for in the
    first tile's iteration: once the epilogue got fast, the unwaited load landed over the staged zeros
    and Q's values came out (seen on the H100, 2026-12-05). Each block now walks at least one tile,
    which such a block's masks hide whole (p = 0), so its Q load is waited for like any other's."""
    op = AttnFwdOp(8, 2, 128, causal=True)
    _check(op, *_inputs(37, (2, 2048, 8, 128), (2, 64, 2, 128), torch.bfloat16))


def test_softcap():
    op = AttnFwdOp(8, 2, 128, causal=True, softcap=20.0, softmax_scale=0.2)
    _check(op, *_inputs(32, (1, 190, 8, 128), (1, 250, 2, 128), torch.bfloat16))


@pytest.mark.parametrize("d", [64, 80, 96, 128, 256])
def test_head_dims_fp16(d):
    op = AttnFwdOp(4, 2, d, causal=True)
    _check(op, *_inputs(33, (2, 140, 4, d), (2, 211, 2, d), torch.float16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_mha_d64(dtype):
    op = AttnFwdOp(4, 4, 64)
    _check(op, *_inputs(34, (3, 77, 4, 64), (3, 129, 4, 64), dtype))


def test_varlen_with_empty_sequences():
    op = AttnFwdOp(8, 2, 128, causal=True)
    lens_q, lens_k = [130, 0, 64, 1, 0, 200], [200, 5, 0, 1, 0, 129]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    q, k, v = _inputs(35, (sum(lens_q), 8, 128), (sum(lens_k), 2, 128), torch.bfloat16)
    _check(op, q, k, v, cu_q, cu_k)


def test_varlen_a_non_finite_value_stays_in_its_sequence():
    """A NaN or Inf value of one packed sequence reaches no row of another. Sequence 0 has 100 keys, so
    its one K/V tile (128 keys) runs 28 keys into sequence 1; those rows of V are zeros in the tile,
    not sequence 1's values: their weight is an exact 0, but 0 x NaN = NaN and 0 x Inf = NaN, and
    before, column 9 of sequence 0's rows came out NaN (``docs/reliability.md`` listed it). Sequence
    1's rows get what the definition puts (a NaN in column 9 of the rows that see key 10), plus, in
    those columns of its own rows alone, the spread its own tiles allow (``test_a_nan_input_gives_nan_...``)."""
    op = AttnFwdOp(8, 2, 128, causal=True)
    cu = torch.tensor([0, 100, 160], dtype=torch.int32, device=DEV)
    q, k, v = _inputs(39, (160, 8, 128), (160, 2, 128), torch.bfloat16)
    v[110, 0, 9] = float("nan")  # sequence 1's key 10, kv head 0 (q heads 0-3)
    v[105, 1, 3] = float("inf")  # its key 5, kv head 1 (q heads 4-7)
    got = op(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, out=torch.full_like(q, float("nan"))).cpu()
    ref = refs.attention(dict(op.params), {"q": q.cpu(), "k": k.cpu(), "v": v.cpu(), "cu_seqlens_q": cu.cpu(),
                                           "cu_seqlens_k": cu.cpu()})
    assert bool(torch.isfinite(got[:100]).all()), torch.nonzero(~torch.isfinite(got[:100]))[:4].tolist()
    fp32_terms = (2 * 128 + 2 * 100 + 64) * (1 + ref["smax"]) * 2.0**-22
    tol = (fp32_terms + 2 * _UNIT[q.dtype]) * ref["scale"][:100] + 1e-30
    assert bool(((got[:100].double() - ref["out"][:100]).abs() <= tol).all())
    assert bool(got[110:160, 0:4, 9].isnan().all())  # the rows of sequence 1 that see key 10
    odd = ~torch.isfinite(got[100:])
    odd[:, 0:4, 9] = False
    odd[:, 4:8, 3] = False
    assert not bool(odd.any()), torch.nonzero(odd)[:4].tolist()


def test_bad_cu_seqlens_reported_with_index():
    op = AttnFwdOp(8, 2, 128, causal=True)
    q, k, v = _inputs(36, (100, 8, 128), (90, 2, 128), torch.bfloat16)
    cq = torch.tensor([0, 60, 40, 100], dtype=torch.int32, device=DEV)
    ck = torch.tensor([0, 30, 60, 90], dtype=torch.int32, device=DEV)
    op(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck)  # no host sync: it returns; the report comes later
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[2\] = 40"):
        op.check()
    # the keys' last offset 89, not k's 90 rows: index 3, raised at the call under strict
    with pytest.raises(ValueError, match=r"cu_seqlens_k\[3\] = 89"), tileops.strict():
        op(q, k, v, cu_seqlens_q=torch.tensor([0, 40, 60, 100], dtype=torch.int32, device=DEV),
           cu_seqlens_k=torch.tensor([0, 30, 60, 89], dtype=torch.int32, device=DEV))


def test_hf_views_out_given_and_fast_path():
    op = AttnFwdOp(8, 2, 128, causal=True)
    g = torch.Generator().manual_seed(37)
    qh, kh, vh = (torch.randn(2, h, s, 128, generator=g).to(torch.bfloat16).to(DEV)
                  for h, s in ((8, 300), (2, 300), (2, 300)))
    q, k, v = qh.transpose(1, 2), kh.transpose(1, 2), vh.transpose(1, 2)
    out = torch.empty(2, 8, 300, 128, dtype=torch.bfloat16, device=DEV).transpose(1, 2)
    _check(op, q, k, v, out=out)
    first = op(q, k, v)
    again = [op(q, k, v) for _ in range(3)]  # the native runtime serves these from its binding
    torch.cuda.synchronize()
    assert all(torch.equal(a, first) for a in again)
    assert torch.equal(first, op(q.contiguous(), k.contiguous(), v.contiguous()))


def test_view_off_the_vectors_is_copied():
    op = AttnFwdOp(4, 2, 64)
    big = torch.randn(2, 100, 4, 65, dtype=torch.float16, device=DEV)
    q = big[..., 1:]  # the last dim contiguous, the row stride 65 elements: off the 8-element vectors
    _, k, v = _inputs(38, (2, 100, 4, 64), (2, 120, 2, 64), torch.float16)
    _check(op, q, k, v)


def test_float32_refused_on_cuda():
    op = AttnFwdOp(4, 2, 64)
    q = torch.randn(1, 8, 4, 64, device=DEV)
    k = v = torch.randn(1, 8, 2, 64, device=DEV)
    with pytest.raises(TypeError, match="q: expected float16 or bfloat16 on CUDA"):
        op(q, k, v)


def test_matches_sdpa_at_scale():
    """One larger GQA call against torch's own SDPA (the benchmark's check, at a size the loop
    reference would take minutes for): bf16 both, compared in fp32 at 2 bf16 ulps of sum p|v| (~|v|)."""
    op = AttnFwdOp(32, 8, 128, causal=True)
    q, k, v = _inputs(39, (1, 2048, 32, 128), (1, 2048, 8, 128), torch.bfloat16)
    got = op(q, k, v)
    want = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                            is_causal=True, enable_gqa=True).transpose(1, 2)
    # both round P (or its equivalent) to bf16 and the output once: 4 half-ulps of |v| <= ~4.5
    assert (got.float() - want.float()).abs().max().item() <= 4 * 2.0**-8 * 4.5


def test_a_nan_input_gives_nan_where_the_definition_puts_it():
    """NaN in, NaN out (``tests/test_attn_fwd.py`` says why this is tested): a NaN in a visible key or a
    query makes the rows that read it NaN, a NaN value its column of those rows, and a NaN key the window
    hides is never seen, inside a tile the mask cuts or in a tile skipped whole.

    One spread beyond the definition, which torch's attention has too (its math path multiplies every
    masked weight, an exact 0, by the value, so a NaN value reaches its whole column): a NaN value
    element reaches, in its column, the rows of its sequence and kv group whose tile computes with its
    key's tile though their mask hides the key (the tensor cores take 0 x NaN = NaN: the kernel's P @ V,
    read from its source; on an H100 the test that required the definition's NaNs exactly found the
    masks unequal, without saying where). A tile skipped whole never does: rows 256 on start their keys
    at 207, past the first tile (block_N <= 176), whatever the schedule."""
    op = AttnFwdOp(8, 2, 128, causal=True, sliding_window=50)
    q, k, v = _inputs(38, (2, 260, 8, 128), (2, 260, 2, 128), torch.bfloat16)
    nan = float("nan")
    k[0, 100, 1, 7] = nan  # rows 100-149 of heads 4-7, sequence 0
    v[1, 20, 0, 9] = nan  # rows 20-69 of heads 0-3, column 9
    q[1, 200, 3, 0] = nan  # row 200 of head 3
    k[1, 0, 1, 4] = nan  # rows 0-49 of heads 4-7; rows 50 on do not see key 0
    got, lse = op(q, k, v, out=torch.full_like(q, nan), return_lse=True)
    ref = refs.attention(dict(op.params), {"q": q.cpu(), "k": k.cpu(), "v": v.cpu()})
    got, lse, want = got.cpu(), lse.cpu(), ref["out"]
    assert torch.equal(lse.isnan(), ref["lse"].isnan())
    assert value_nan_spread(got.isnan(), want.isnan(), 1, slice(0, 4), 9, 256) == []
    fine = ~got.isnan()
    fp32_terms = (2 * 128 + 2 * 260 + 64) * (1 + ref["smax"]) * 2.0**-22
    tol = (fp32_terms + 2 * _UNIT[q.dtype]) * ref["scale"] + 1e-30
    assert bool(((got.double() - want).abs()[fine] <= tol[fine]).all())


def test_a_key_scoring_minus_inf_weighs_nothing():
    """A key whose score is -inf weighs 0, as softmax gives it (``tests/test_attn_fwd.py``: the C
    schedule's online softmax had made it NaN as a row's first key). Key 1 of sequence 0 (in the first
    tile; row 1 sees keys 0 and 1) and key 100 of sequence 1, the first that the window of 50 shows row
    149, each for every q head of its kv head."""
    op = AttnFwdOp(8, 2, 128, causal=True, sliding_window=50)
    q, k, v = _inputs(40, (2, 260, 8, 128), (2, 260, 2, 128), torch.bfloat16)
    q[..., 0] = q[..., 0].abs() + 0.5  # every q element 0 positive: -inf in k[..., 0] scores -inf
    k[0, 1, 1, 0] = k[1, 100, 0, 0] = float("-inf")
    got, lse = op(q, k, v, out=torch.full_like(q, float("nan")), return_lse=True)
    cpu = {"q": q.cpu(), "k": k.cpu(), "v": v.cpu()}
    ref = refs.attention(dict(op.params), cpu)
    smax = refs.attention(dict(op.params), {**cpu, "k": cpu["k"].nan_to_num(neginf=0.0)})["smax"]
    got, lse = got.cpu(), lse.cpu()
    assert not ref["out"].isnan().any()
    assert not got.isnan().any() and not lse.isnan().any()
    fp32_terms = (2 * 128 + 2 * 260 + 64) * (1 + smax) * 2.0**-22
    tol = (fp32_terms + 2 * _UNIT[q.dtype]) * ref["scale"] + 1e-30
    assert bool(((got.double() - ref["out"]).abs() <= tol).all())
