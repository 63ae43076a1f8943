"""``AttnFwdOp`` on the CPU (the C schedule of ``kernels/attention.py``): every mask, softcap, GQA and
MHA, varlen with empty sequences, HF's transposed views, ``return_lse``, ``out=``, fp32/fp16/bf16, and
the errors. Against the float64 reference of ``tests/references_attention.py`` (a loop over rows,
sharing no code with the kernels); outputs start as NaN so an element the kernel skips fails.

Tolerances, from the arithmetic (``tol``): the inputs are exact in their dtype and the reference is
float64, so the error is the fp32 arithmetic's plus the output's one rounding. A row's dot products
(D terms), its running max and sum (Sk terms) and the exp of scores up to ``smax`` in size carry at
most ``(2 D + 2 Sk + 64) * (1 + smax)`` fp32 roundings of 2^-24 relative to ``sum_j p_j |v_j|`` (the
magnitude the output is a convex combination of), and the store one half-ulp of the dtype (2^-24
fp32, 2^-11 fp16, 2^-8 bf16) of the same magnitude; lse gets the first term alone, absolute.
Small shapes (a few compiled kernels of ~2 s each on the CPU, one row a grid cell): CI has 2 cores.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

import tileops
from tileops.attention import AttnFwdOp

_spec = importlib.util.spec_from_file_location("_attn_fwd_refs", Path(__file__).with_name("references_attention.py"))
refs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(refs)

#: the unit roundoff of each dtype's store (round to nearest: half an ulp at 1)
_UNIT = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def _inputs(seed: int, q_shape, kv_shape, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(q_shape, generator=g).to(dtype)
    k = torch.randn(kv_shape, generator=g).to(dtype)
    v = torch.randn(kv_shape, generator=g).to(dtype)
    return q, k, v


def _params(op: AttnFwdOp) -> dict:
    return dict(op.params)


def _check(op: AttnFwdOp, q, k, v, cu_q=None, cu_k=None, transposed=False) -> None:
    """Run with a NaN-filled ``out=`` and ``return_lse``; compare out and lse with the reference."""
    kw = {} if cu_q is None else {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
    out = torch.full_like(q, float("nan"))
    got, lse = op(q, k, v, out=out, return_lse=True, **kw)
    assert got is out
    ref = refs.attention(_params(op), {"q": q, "k": k, "v": v, **kw})
    nk = k.shape[-3]
    fp32_terms = (2 * q.shape[-1] + 2 * nk + 64) * (1 + ref["smax"]) * 2.0**-24
    tol = (fp32_terms + _UNIT[q.dtype]) * ref["scale"] + 1e-30
    err = (got.double() - ref["out"]).abs()
    assert bool(torch.isfinite(got).all()), "a NaN or inf in out (an element never written?)"
    assert bool((err <= tol).all()), f"out off by {err.max().item():.3g}, tolerance {tol.max().item():.3g}"
    assert lse.dtype == torch.float32 and lse.shape == ref["lse"].shape
    empty = torch.isinf(ref["lse"])
    assert torch.equal(torch.isneginf(lse), empty), "lse is -inf exactly where a row sees no key"
    rows = empty.permute(0, 2, 1) if q.dim() == 4 else empty.T  # [.., rows, Hq] as out indexes them
    assert bool((got[rows] == 0).all()), "a row that sees no key is zeros"
    lerr = (lse.double() - ref["lse"])[~empty].abs()
    assert lerr.numel() == 0 or lerr.max().item() <= fp32_terms + 2.0**-24 * ref["lse"][~empty].abs().max().item()


# (causal, window, seq_q, seq_k): none; causal square, seq_q < seq_k, seq_q > seq_k (rows that see no key);
# a window alone; causal with a window
MASKS = [(False, None, 5, 9), (True, None, 8, 8), (True, None, 5, 9), (True, None, 9, 5), (False, 3, 6, 9),
         (True, 2, 7, 7), (True, 3, 4, 11)]


@pytest.mark.parametrize("causal,window,sq,sk", MASKS)
def test_masks_gqa(causal, window, sq, sk):
    op = AttnFwdOp(4, 2, 64, causal=causal, sliding_window=window)
    q, k, v = _inputs(11, (2, sq, 4, 64), (2, sk, 2, 64))
    _check(op, q, k, v)


def test_rows_that_see_nothing_are_zeros():
    # causal with seq_q > seq_k: query i sees j <= i - 4; rows 0..3 see no key
    op = AttnFwdOp(4, 2, 64, causal=True)
    q, k, v = _inputs(12, (1, 9, 4, 64), (1, 5, 2, 64))
    out, lse = op(q, k, v, return_lse=True)
    assert bool((out[:, :4] == 0).all()) and bool(torch.isneginf(lse[:, :, :4]).all())
    assert bool(torch.isfinite(lse[:, :, 4:]).all())


def nan_case(op: AttnFwdOp, q, k, v) -> None:
    """Run with NaN-filled ``out=`` after putting NaNs into q, k, v (rows of 8 tokens, GQA 4/2, causal with
    a window of 3): out and lse NaN exactly where the float64 reference's are, the rest as without them."""
    nan = float("nan")
    k[0, 5, 1, 7] = nan  # a visible key: rows 5-7 of heads 2 and 3 of sequence 0, every column
    v[1, 2, 0, 9] = nan  # a value: rows 2-4 of heads 0 and 1 of sequence 1, column 9 alone
    q[1, 6, 3, 0] = nan  # a query: row 6 of head 3 of sequence 1
    k[1, 0, 1, 4] = nan  # key 0: rows 3-7 do not see it (the window), rows 0-2 of heads 2 and 3 do
    out = torch.full_like(q, nan)
    got, lse = op(q, k, v, out=out, return_lse=True)
    ref = refs.attention(_params(op), {"q": q, "k": k, "v": v})
    want = ref["out"]
    assert torch.equal(got.isnan(), want.isnan()), "NaN rows differ from the definition's"
    assert torch.equal(lse.isnan(), ref["lse"].isnan())
    assert 4 * 64 < int(want.isnan().sum()) < want.numel() // 4  # (the NaNs reach rows, not everything)
    fine = ~want.isnan()
    tol = (2 * 64 + 2 * 8 + 64) * (1 + ref["smax"]) * 2.0**-24 * ref["scale"] + 1e-30
    assert bool(((got.double() - want).abs()[fine] <= tol[fine]).all())


def test_a_nan_input_gives_nan_where_the_definition_puts_it():
    """NaN in, NaN out, as torch's attention gives: the kernels had tested ``l > 0`` for "this row saw a
    key", so a NaN score made a plausible row of zeros. Now only a row that saw no key (l exactly 0) is
    zeros; a NaN key or query makes its rows NaN, a NaN value its column of those rows, and a NaN the
    window hides is not seen."""
    op = AttnFwdOp(4, 2, 64, causal=True, sliding_window=3)
    nan_case(op, *_inputs(16, (2, 8, 4, 64), (2, 8, 2, 64)))


def test_the_torch_target_keeps_nan_where_the_definition_puts_it():
    """The same for ``target="torch"``, whose probabilities went through ``nan_to_num`` (meant for a row
    that sees no key): a NaN query's rows came out zeros, a plausible answer. A row that sees no key is
    still zeros, and its lse -inf."""
    op = AttnFwdOp(4, 2, 64, causal=True, sliding_window=3, target="torch")
    q, k, v = _inputs(16, (2, 8, 4, 64), (2, 8, 2, 64))
    clean = op(q, k, v)
    q[1, 6, 3, 0] = k[0, 5, 1, 7] = float("nan")  # a query's row; a key that rows 5-7 of heads 2, 3 see
    got = op(q, k, v)
    want = torch.zeros_like(got, dtype=torch.bool)
    want[1, 6, 3] = True
    want[0, 5:8, 2:4] = True
    assert torch.equal(got.isnan(), want)
    assert torch.equal(got[~want], clean[~want])
    q, k, v = _inputs(17, (1, 6, 4, 64), (1, 2, 2, 64))
    out, lse = AttnFwdOp(4, 2, 64, causal=True, target="torch")(q, k, v, return_lse=True)
    assert bool((out[0, :4] == 0).all()) and bool(torch.isneginf(lse[0, :, :4]).all())  # 6 queries, 2 keys


@pytest.mark.parametrize("target", [None, "torch"])
@pytest.mark.parametrize("causal,window,key", [(False, None, (0, 0, 1)), (True, 3, (1, 3, 0))],
                         ids=["first-of-every-row", "first-of-a-window"])
def test_a_key_scoring_minus_inf_weighs_nothing(target, causal, window, key):
    """A key whose score is -inf (an infinite key element against a positive q element) weighs 0, as
    softmax gives it. The C schedule's online softmax took 2^(s - m') = 2^(-inf + inf), NaN, where the
    row's first key scored -inf: key 0 of sequence 0, kv head 1 (every row of q heads 2 and 3, no mask),
    and key 3 of sequence 1, kv head 0 (the first a causal window of 3 shows row 5; rows 3 and 4 see it
    among others). A row whose every visible key scores -inf is left out: softmax is 0/0 there."""
    q, k, v = _inputs(18, (2, 6, 4, 64), (2, 6, 2, 64))
    q[..., 0] = q[..., 0].abs() + 0.5  # every q element 0 positive: -inf in k[..., 0] scores -inf
    k[(*key, 0)] = float("-inf")
    op = AttnFwdOp(4, 2, 64, causal=causal, sliding_window=window, target=target)
    ref = refs.attention(_params(op), {"q": q, "k": k, "v": v})
    assert not ref["out"].isnan().any()
    out = torch.full_like(q, float("nan"))
    got, lse = op(q, k, v, out=out, return_lse=True)
    assert not got.isnan().any(), f"NaN at {got.isnan().nonzero()[0].tolist()}"
    assert not lse.isnan().any()
    clean = k.nan_to_num(neginf=0.0)  # the bound's magnitudes: the -inf key's score left out
    smax = refs.attention(_params(op), {"q": q, "k": clean, "v": v})["smax"]
    tol = (2 * 64 + 2 * 6 + 64) * (1 + smax) * 2.0**-24 * ref["scale"] + 1e-30
    assert bool(((got.double() - ref["out"]).abs() <= tol).all())


@pytest.mark.parametrize("target", [None, "torch"])
def test_an_empty_call_takes_gradients(target):
    """No query row (a batch of 0, or every sequence empty): the output is empty and the inputs'
    gradients come back zero-size (q) or zeros (k, v of sequences with keys), from either target. The
    torch target's empty output had no grad_fn, which the op's autograd refused."""
    op = AttnFwdOp(4, 2, 64, causal=True, target=target)
    cu_q, cu_k = torch.tensor([0, 0, 0], dtype=torch.int32), torch.tensor([0, 2, 5], dtype=torch.int32)
    for q, k, extra in ((torch.zeros(0, 3, 4, 64), torch.ones(0, 5, 2, 64), {}),
                        (torch.zeros(0, 4, 64), torch.ones(5, 2, 64), dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k))):
        q, k = q.requires_grad_(), k.requires_grad_()
        v = k.detach().clone().requires_grad_()
        out = op(q, k, v, **extra)
        dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
        assert out.shape == q.shape and dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        assert not bool(dk.any()) and not bool(dv.any())


def value_nan_spread(got_nan: torch.Tensor, want_nan: torch.Tensor, b: int, heads: slice, col: int,
                     rows: int) -> list:
    """What separates ``got_nan`` from ``want_nan`` (NaN masks ``[B, S, H, D]``) beyond the one spread the
    tensor cores allow: a NaN value element (sequence ``b``, the q heads ``heads`` of its kv head, column
    ``col``) also reaching rows below ``rows`` that hide its key, in its column alone. Empty when the
    difference is that alone; else the places that break it, as lists of indices."""
    missing = want_nan & ~got_nan
    extra = got_nan & ~want_nan
    allowed = torch.zeros_like(extra)
    allowed[b, :rows, heads, col] = True
    return [*missing.nonzero().tolist()[:5], *(extra & ~allowed).nonzero().tolist()[:5]]


def test_value_nan_spread_tells_the_allowed_spread_from_a_fault():
    """The check below is not vacuous: it accepts the tensor cores' spread and nothing else."""
    want = torch.zeros(2, 260, 8, 128, dtype=torch.bool)
    want[1, 20:70, 0:4, 9] = True
    got = want.clone()
    got[1, 0:128, 0:4, 9] = True  # a tile of 128 rows that computes key 20's tile
    assert value_nan_spread(got, want, 1, slice(0, 4), 9, 256) == []
    for where in ((1, 256, 0, 9), (1, 30, 4, 9), (0, 30, 0, 9), (1, 30, 0, 10)):
        bad = got.clone()
        bad[where] = True
        assert value_nan_spread(bad, want, 1, slice(0, 4), 9, 256) == [list(where)]
    lost = got.clone()
    lost[1, 40, 2, 9] = False
    assert value_nan_spread(lost, want, 1, slice(0, 4), 9, 256) == [[1, 40, 2, 9]]


def test_softcap_and_scale():
    op = AttnFwdOp(4, 2, 64, causal=True, softcap=2.5, softmax_scale=0.3)
    q, k, v = _inputs(13, (2, 6, 4, 64), (2, 8, 2, 64))
    _check(op, q, k, v)


def test_mha_head_dim_80():
    op = AttnFwdOp(3, 3, 80)
    q, k, v = _inputs(14, (2, 5, 3, 80), (2, 7, 3, 80))
    _check(op, q, k, v)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_dtypes(dtype):
    op = AttnFwdOp(4, 2, 64, causal=True)
    q, k, v = _inputs(15, (2, 6, 4, 64), (2, 9, 2, 64), dtype)
    _check(op, q, k, v)


def test_varlen_with_empty_sequences():
    op = AttnFwdOp(4, 2, 64, causal=True)
    # sequence 1 has no queries, sequence 2 no keys (its queries output zeros), sequence 3 both empty
    cu_q = torch.tensor([0, 3, 3, 7, 7, 12], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 6, 6, 6, 15], dtype=torch.int32)
    q, k, v = _inputs(16, (12, 4, 64), (15, 2, 64))
    _check(op, q, k, v, cu_q, cu_k)
    out, lse = op(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=True)
    assert lse.shape == (4, 12) and bool((out[3:7] == 0).all()) and bool(torch.isneginf(lse[:, 3:7]).all())


def test_hf_transposed_views_are_read_where_they_lie():
    op = AttnFwdOp(4, 2, 64, causal=True)
    g = torch.Generator().manual_seed(17)
    qh, kh, vh = (torch.randn(2, h, s, 64, generator=g) for h, s in ((4, 6), (2, 9), (2, 9)))
    q, k, v = qh.transpose(1, 2), kh.transpose(1, 2), vh.transpose(1, 2)  # [B, S, H, D] views, no copy
    assert not q.is_contiguous()
    _check(op, q, k, v)
    dense = op(q.contiguous(), k.contiguous(), v.contiguous())
    assert torch.equal(op(q, k, v), dense)  # the same arithmetic whatever the strides


def test_out_given_with_strides_and_no_lse():
    op = AttnFwdOp(4, 2, 64)
    q, k, v = _inputs(18, (2, 5, 4, 64), (2, 7, 2, 64))
    big = torch.full((2, 4, 5, 64), float("nan")).transpose(1, 2)  # an out= view in HF's layout
    got = op(q, k, v, out=big)
    assert got is big
    ref = refs.attention(_params(op), {"q": q, "k": k, "v": v})
    assert bool(((got.double() - ref["out"]).abs() <= 1e-4 * ref["scale"] + 1e-30).all())


def _plans_calling(monkeypatch, method: str) -> list[str]:
    """The names of the plans whose ``method`` (``Plan.bind``, ``Plan.place``) is called from now on, in order."""
    from tileops.runtime.plan import Plan

    names: list[str] = []
    real = getattr(Plan, method)

    def counting(plan, *a, **kw):
        names.append(plan.name)
        return real(plan, *a, **kw)

    monkeypatch.setattr(Plan, method, counting)
    return names


def test_a_forward_with_its_lse_binds_once_a_signature(monkeypatch):
    """A call that keeps its lse (a training step's forward, or ``return_lse``) is bound once a
    signature, as a plain call is: its lse is the plan's second output, a new tensor a call. It was
    bound anew at every such call, with the lse's address as a value: the host's whole binding in
    every training step's forward (on an H100, 4 x 2048 at head_dim 64, the forward's 124 us kernel
    took 267-468 us a call with gradients on, timed between CUDA events)."""
    bound = _plans_calling(monkeypatch, "bind")
    op = AttnFwdOp(4, 2, 64, causal=True)
    q, k, v = _inputs(31, (2, 9, 4, 64), (2, 9, 2, 64))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    lses = []
    for _ in range(4):
        out = op(*leaves)
        torch.autograd.grad(out.sum(), leaves)
        lses.append(op(q, k, v, return_lse=True)[1])
    assert sorted(set(bound)) == sorted(bound), bound  # each plan bound once: forward with lse, backward
    assert any("lse" in n for n in bound) and any("backward" in n for n in bound), bound
    assert len({lse.data_ptr() for lse in lses}) == 4  # each call's own tensor, kept: not one rewritten
    assert all(torch.equal(lse, lses[0]) for lse in lses)  # the same inputs, the same bits
    _check(op, q, k, v)  # and right (a signature of its own: out= given)


def test_a_view_placed_first_on_the_lse_path_every_call(monkeypatch):
    """A forward that keeps its lse tries its binding where the views lie, as the backward does, and
    places (copies) only a view its kernel cannot address. It placed every call's views in Python
    first: about half a training forward's host time (170-229 -> 96-120 us a call on a 2-core CPU,
    HF's views of a tiny shape; on an H100 at 4 x 2048, 158-192 -> 67-78 us)."""
    placed = _plans_calling(monkeypatch, "place")
    op = AttnFwdOp(4, 2, 64, causal=True)
    g = torch.Generator().manual_seed(23)
    qh, kh, vh = (torch.randn(2, h, 7, 64, generator=g) for h in (4, 2, 2))
    views = [t.transpose(1, 2) for t in (qh, kh, vh)]  # HF's layout: read where they lie
    dense = op(*(t.contiguous() for t in views), return_lse=True)
    for _ in range(3):
        leaves = [t.detach().requires_grad_() for t in views]
        out = op(*leaves)
        torch.autograd.grad(out, leaves, torch.ones_like(out))  # (out.sum()'s expanded dO the backward copies)
        out_l, lse = op(*views, return_lse=True)
        assert torch.equal(out_l, dense[0]) and torch.equal(lse, dense[1])
    assert placed == [], placed
    # a last dim not contiguous: no kernel addresses it, so the plan's fit policy copies it
    wide = torch.randn(2, 7, 4, 128, generator=g)
    q = wide[..., ::2]
    got = op(q, *(t.contiguous() for t in views[1:]), return_lse=True)
    want = op(q.contiguous(), *(t.contiguous() for t in views[1:]), return_lse=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert placed and all("lse" in n for n in placed), placed


def test_no_keys_gives_zeros():
    op = AttnFwdOp(4, 2, 64)
    q = torch.randn(1, 3, 4, 64)
    k = v = torch.randn(1, 0, 2, 64)
    out, lse = op(q, k, v, return_lse=True)
    assert bool((out == 0).all()) and bool(torch.isneginf(lse).all())


# --------------------------------------------------------------------------- errors, before any kernel


def test_heads_not_a_multiple_names_both():
    with pytest.raises(ValueError, match=r"num_q_heads.*num_kv_heads=3.*num_q_heads=8"):
        AttnFwdOp(8, 3, 64)


@pytest.mark.parametrize("d", [32, 100, 512])
def test_head_dim_refused(d):
    with pytest.raises(ValueError, match="head_dim"):
        AttnFwdOp(4, 2, d)


def test_cuda_spec_takes_one_stage_where_every_thread_loads():
    """Varlen and pipeline 1 load K/V by cp.async from every thread, whose pipeline TileLang 0.1.15
    ends without waiting on the last tile at 2+ stages: such a spec defaults to 1 stage and refuses
    more; the TMA pipeline keeps the table's 2."""
    from tileops.kernels import get_spec

    S = get_spec("attention")
    base = dict(dtype="bfloat16", head_dim=128, hq=4, hkv=2, backend="cuda")
    assert S(**base, varlen=True).tiles[2] == 1 and S(**base, pipeline=1).tiles[2] == 1
    assert S(**base).tiles[2] == 2
    for fields in (dict(varlen=True, stages=2), dict(pipeline=1, stages=3)):
        with pytest.raises(ValueError, match=r"^stages: .*expected 1 or 0"):
            S(**base, **fields)


@pytest.mark.parametrize("pipeline", [3, 4])
def test_pingpong_needs_two_consumer_warpgroups(pipeline):
    """Pipelines 3 and 4 order two consumer warpgroups of 64 rows: another tile shape is refused by
    name, and varlen (which lowers as pipeline 1, no producer warpgroup) takes neither."""
    from tileops.kernels import get_spec

    S = get_spec("attention")
    base = dict(dtype="bfloat16", head_dim=128, hq=4, hkv=2, backend="cuda", pipeline=pipeline)
    assert S(**base).pingpong and S(**base).overlap == (pipeline == 4) and S(**base).pass_configs == {}
    assert not S(**base, varlen=True).pingpong and not S(**base, varlen=True).overlap
    assert S(**base, varlen=True).loads == 1
    assert not S(**{**base, "pipeline": 2}).pingpong
    for fields, got in ((dict(block_M=64), "block_M 64 and 256"), (dict(threads=384), "block_M 128 and 384")):
        with pytest.raises(ValueError, match=rf"^pipeline: {pipeline} .*needs block_M 128 and 256 threads, got {got}"):
            S(**base, **fields)


def test_default_pipeline_is_the_overlap_at_head_dim_128_only():
    """A spec that leaves ``pipeline`` 0 lowers with 4 (ping-pong and overlap) at head_dim 128 where its
    tiles have the two consumer warpgroups, and with 2 everywhere else: another head_dim, a tile shape
    the ping-pong refuses (never an error for a knob the user did not set), and varlen (1)."""
    from tileops.kernels import get_spec

    S = get_spec("attention")
    base = dict(dtype="bfloat16", hq=4, hkv=2, backend="cuda")
    d128 = S(**base, head_dim=128)
    assert (d128.loads, d128.pingpong, d128.overlap, d128.tiles) == (4, True, True, (128, 128, 2, 256))
    assert S(**base, head_dim=128, block_N=176).loads == 4
    for fields in (dict(head_dim=64), dict(head_dim=96), dict(head_dim=256), dict(head_dim=128, block_M=64),
                   dict(head_dim=128, threads=128), dict(head_dim=128, pipeline=2)):
        assert S(**base, **fields).loads == 2 and not S(**base, **fields).pingpong, fields
    assert S(**base, head_dim=128, varlen=True).loads == 1


def _pingpong_turns(tiles: int) -> list[tuple[int, str]]:
    """The order in which two warpgroups issue ``Q K^T`` under the protocol of pipeline 3 (what
    ``kernels/attention.py`` emits: warpgroup 1 arrives at barrier 0 before its first tile; each
    warpgroup waits on its own barrier, issues, and arrives at the other's, warpgroup 1 not after its
    last tile), run as a scheduler of two threads; ``bar.sync`` completes once both of its 256
    threads have come (128 arriving, 128 waiting). Fails on a deadlock or a barrier left arrived."""
    pending = [0, 0]  # arrivals at each barrier not yet matched by a wait
    pc = [0, 0]  # next step of each warpgroup's program
    prog = {w: [] for w in (0, 1)}
    if tiles:
        prog[1].append(("arrive", 0))
    for t in range(tiles):
        for w in (0, 1):
            prog[w] += [("wait", w), ("issue", t)]
            if w == 0 or t < tiles - 1:
                prog[w].append(("arrive", 1 - w))
    turns = []
    while pc[0] < len(prog[0]) or pc[1] < len(prog[1]):
        moved = False
        for w in (0, 1):
            while pc[w] < len(prog[w]):
                op, arg = prog[w][pc[w]]
                if op == "wait":
                    if not pending[arg]:
                        break
                    pending[arg] -= 1
                elif op == "arrive":
                    pending[arg] += 1
                else:
                    turns.append((arg, f"wg{w}"))
                pc[w] += 1
                moved = True
        assert moved, f"deadlock at {pc} over {tiles} tiles"
    assert pending == [0, 0], f"barriers left arrived: {pending}"
    return turns


@pytest.mark.parametrize("tiles", [0, 1, 2, 5])
def test_pingpong_protocol_alternates_and_leaves_no_barrier_arrived(tiles):
    """The protocol alone: the warpgroups take turns, warpgroup 0 first at every tile, none waits
    forever, and each barrier is waited on as often as it is arrived at (a block exits clean)."""
    turns = _pingpong_turns(tiles)
    assert turns == [(t, w) for t in range(tiles) for w in ("wg0", "wg1")]


def _consumers(src: str) -> str:
    """The consumer warpgroups' part of a warp-specialised CUDA kernel (TileLang: after their
    ``warpgroup_reg_alloc``)."""
    return src[src.index("warpgroup_reg_alloc"):]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_pingpong_is_emitted_in_the_consumers_loop(causal):
    """Lowered for sm_90 (no GPU): pipeline 3's CUDA holds the protocol above, in the consumers'
    numbering (TileLang runs them as threads 128-383: warpgroup 0 is ``threadIdx.x >> 7 == 1``), around
    the one ``Q K^T`` wgmma of the loop; pipeline 2's holds no named barrier of the two."""
    pytest.importorskip("tilelang")
    import re

    from tileops.kernels.attention import PINGPONG_BARRIERS
    from tileops.compile.build import emit_source
    from tileops.kernels import get_spec

    S = get_spec("attention")
    base = dict(dtype="bfloat16", head_dim=128, hq=4, hkv=2, backend="cuda", causal=causal)
    b0, b1 = PINGPONG_BARRIERS
    plain = emit_source("attention", S(**base, pipeline=2), "cuda", "sm_90")
    src = emit_source("attention", S(**base, pipeline=3), "cuda", "sm_90")
    assert "__named_barrier_arrive" not in plain and "__sync_thread_partial(((((int)threadIdx.x) >> 7)" not in plain
    consumers = _consumers(src)
    opening = re.findall(r"if \(\(\(\(\(int\)threadIdx.x\) >> 7\) == 2\) && \(t_1 == [^{]*\{\s*"
                         rf"tl::__named_barrier_arrive\({b0}, 256\);", consumers)
    waits = re.findall(rf"tl::__sync_thread_partial\(\(\(\(\(int\)threadIdx.x\) >> 7\) \+ {b0 - 1}\), 256\);",
                       consumers)
    handoffs = re.findall(r"if \(\(\(\(\(int\)threadIdx.x\) >> 7\) == 1\) \|\| [^{]*\{\s*"
                          rf"tl::__named_barrier_arrive\(\({b1 + 1} - \(\(\(int\)threadIdx.x\) >> 7\)\), 256\);",
                          consumers)
    assert len(opening) == len(waits) == len(handoffs) == 1, (opening, waits, handoffs)
    # the wait comes before the Q K^T wgmma (shared A and B) and the handoff after its wait
    w, qk, h = consumers.index(waits[0]), consumers.index("tl::wgmma_ss"), consumers.index(handoffs[0])
    assert w < qk < h and consumers.count("tl::wgmma_ss") == 1
    assert "warpgroup_wait<0>" in consumers[qk:h]


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_varlen_loads_no_value_past_its_sequence(arch):
    """Lowered (no GPU): the varlen kernel loads a row of V only where the row is a key of the block's
    own sequence (its count, the register ``seq[4]``) and writes zeros in the tile elsewhere, never
    the next packed sequence's values, whose NaN or Inf the exact-0 weight would still carry (0 x NaN);
    ``tests/test_attn_fwd_cuda.py`` checks the outputs. The dense kernel's bound is the buffer's end."""
    pytest.importorskip("tilelang")
    from tileops.compile.build import emit_source
    from tileops.kernels import get_spec

    S = get_spec("attention")
    base = dict(dtype="bfloat16", head_dim=128, hq=8, hkv=2, backend="cuda", causal=True)
    src = emit_source("attention", S(**base, varlen=True), "cuda", arch).splitlines()
    loads = [i for i, line in enumerate(src) if re.search(r"= V\[", line)]
    assert loads, "no load of V in the varlen kernel's source"
    for i in loads:
        guard = next(line for line in reversed(src[:i]) if line.strip().startswith("if ("))
        assert "seq[4]" in guard and " sk" not in guard, (arch, guard.strip()[:200])
        assert re.search(r"= bfloat16_t\(0x0p\+0f", src[i + 2]), src[i + 2]  # else: zero


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_overlap_releases_each_tile_after_the_wgmma_that_reads_it(causal):
    """Pipeline 4 issues ``Q K(t)^T`` and ``P(t-1) V(t-1)`` without waiting: a K/V tile may go back to
    the producer (its ``empty`` mbarrier's arrive) only after the wait that retires the wgmma reading
    it, else the next TMA load overwrites a tile still being read. Lowered for sm_90: in the
    consumers' loop, the one Q K^T and the one P V issue, the K tile's release after the ``wait<1>``
    (or ``wait<0>`` of the first tile) that retires Q K^T, the V tile's after ``wait<0>``, and the
    ping-pong's turn handed over after the issues."""
    pytest.importorskip("tilelang")
    import re

    from tileops.compile.build import emit_source
    from tileops.kernels import get_spec

    S = get_spec("attention")
    src = _consumers(emit_source("attention", S(dtype="bfloat16", head_dim=128, hq=4, hkv=2, backend="cuda",
                                                causal=causal, pipeline=4), "cuda", "sm_90"))
    assert src.count("tl::wgmma_ss") == 1 and src.count("tl::wgmma_rs") == 1
    qk, pv = src.index("tl::wgmma_ss"), src.index("tl::wgmma_rs")
    releases = [m.start() for m in re.finditer(r"mbarrier\[[^\]]*\]\.arrive\(\);", src)]
    assert len(releases) == 2, releases  # K's, then V's
    k_rel, v_rel = releases
    # the branch that issued P V waits for 1 group left, the other (the first tile) for none
    w1, w0_first = src.index("tl::wait_wgmma<1>();"), src.index("tl::wait_wgmma<0>();")
    assert qk < pv < w1 < w0_first < k_rel, "the K tile goes back before Q K^T is retired"
    assert k_rel < src.find("tl::wait_wgmma<0>();", k_rel) < v_rel and src.count("tl::wait_wgmma<0>();") == 2, (
        "the V tile goes back before P V is retired")
    # the turn goes to the other warpgroup once both products are issued, on either branch
    handoffs = [m.start() for m in re.finditer(r"__named_barrier_arrive\(\(16 - ", src)]
    assert len(handoffs) == 2 and pv < handoffs[0] < w1 < handoffs[1] < w0_first


#: kernels whose wgmma ptxas must leave asynchronous: the forward's default (pipeline 2) and overlap
#: (pipeline 4) schedules, masked and not, and the backward's two gradient programs (by TMA, ``loads`` 2,
#: the dense default, and at the overlap levels that can replace its default: dk/dv 3 and 2, dq 2, and head_dim
#: 64's dk/dv 2, its best; and every thread loading, ``loads`` 1, dense and varlen's default)
_PTXAS_CASES = {
    "fwd-p2-causal": ("attention", dict(dtype="bfloat16", head_dim=128, hq=4, hkv=2, backend="cuda", causal=True)),
    "fwd-p2-full": ("attention", dict(dtype="bfloat16", head_dim=128, hq=4, hkv=2, backend="cuda")),
    "fwd-p2-window": ("attention", dict(dtype="float16", head_dim=64, hq=4, hkv=2, backend="cuda", causal=True,
                                        window=True)),
    "fwd-p4-causal": ("attention", dict(dtype="bfloat16", head_dim=128, hq=4, hkv=2, backend="cuda", causal=True,
                                        pipeline=4)),
    "bwd-dkdv-causal": ("attention_bwd", dict(kind="dkdv", head_dim=128, dtype="bfloat16", causal=True,
                                              backend="cuda", loads=1)),
    "bwd-dq-causal": ("attention_bwd", dict(kind="dq", head_dim=128, dtype="bfloat16", causal=True, backend="cuda",
                                            loads=1)),
    "bwd-dkdv-tma-causal": ("attention_bwd", dict(kind="dkdv", head_dim=128, dtype="bfloat16", causal=True,
                                                  backend="cuda", loads=2)),
    "bwd-dq-tma-causal": ("attention_bwd", dict(kind="dq", head_dim=128, dtype="bfloat16", causal=True,
                                                backend="cuda", loads=2)),
    "bwd-dkdv-tma-overlap3": ("attention_bwd", dict(kind="dkdv", head_dim=128, dtype="bfloat16", causal=True,
                                                    backend="cuda", loads=2, overlap=3)),
    "bwd-dkdv-tma-overlap2": ("attention_bwd", dict(kind="dkdv", head_dim=128, dtype="bfloat16", causal=True,
                                                    backend="cuda", loads=2, overlap=2)),
    "bwd-dq-tma-overlap2": ("attention_bwd", dict(kind="dq", head_dim=128, dtype="bfloat16", causal=True,
                                                  backend="cuda", loads=2, overlap=2)),
    "bwd-dkdv-tma-d64-overlap2": ("attention_bwd", dict(kind="dkdv", head_dim=64, dtype="bfloat16", causal=True,
                                                        backend="cuda", loads=2, overlap=2)),
    "bwd-dkdv-tma-softcap-d256": ("attention_bwd", dict(kind="dkdv", head_dim=256, dtype="bfloat16", causal=True,
                                                        softcap=True, backend="cuda", loads=2)),
    "bwd-dq-tma-d256": ("attention_bwd", dict(kind="dq", head_dim=256, dtype="bfloat16", causal=True, backend="cuda",
                                              loads=2)),
    "bwd-dq-varlen": ("attention_bwd", dict(kind="dq", head_dim=128, dtype="bfloat16", causal=True, varlen=True,
                                            backend="cuda")),
}
#: Left out: the dense dq program by TMA without a mask, or with a window at head_dim 64, spills 32 bytes (ptxas 13.0),
#: all of it in TileLang's producer warpgroup (after its ``setmaxnreg`` down to 24 registers: the SASS's
#: local stores lie past ``USETMAXREG.DEALLOC``, around its 4x-unrolled K/V address arithmetic), not in the
#: consumers' loop this test guards


@pytest.mark.slow
@pytest.mark.parametrize("case", list(_PTXAS_CASES))
def test_wgmmas_stay_asynchronous_in_ptxas(case):
    """ptxas serialises every wgmma of a kernel where it sees a path on which other instructions
    touch the accumulator of an unretired wgmma (C7514/C7515), or where it lacks the registers
    (C7512), which undoes the tensor cores' overlap without a wrong answer to show for it (its
    "info" lines are all the build says). Seen here: pipeline 4 with its Q K^T issue under a
    condition (C7515), and the forward with an ``if`` around its K/V loop (C7512 and 1.4 KB of
    spills; ``setmaxnreg`` under a branch). The kernels as built must have none, and no spills."""
    tilelang = pytest.importorskip("tilelang")
    import shutil
    import subprocess
    import tempfile

    from tileops.compile.build import emit_source
    from tileops.kernels import get_spec

    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not Path(nvcc).exists():
        pytest.skip("needs nvcc")
    builder, fields = _PTXAS_CASES[case]
    src = emit_source(builder, get_spec(builder)(**fields), "cuda", "sm_90")
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "k.cu").write_text(src)
        cmd = [nvcc, "-std=c++17", "-O3", "-arch=sm_90a", "-cubin", "-Xptxas", "-v", "-w",
               f"-I{Path(tilelang.__file__).parent / 'src'}",
               f"-I{Path(tilelang.__file__).parent / '3rdparty' / 'cutlass' / 'include'}",
               "-DCUTE_ENABLE_SYNC_SUPPRESSION",
               "-o", str(Path(d) / "k.cubin"), str(Path(d) / "k.cu")]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "C751" not in out.stderr, out.stderr[-2000:]  # C7510-C7515: wgmma serialised
    spills = re.findall(r"(\d+) bytes spill stores", out.stderr)  # a line a function
    assert spills and set(spills) == {"0"}, out.stderr[-2000:]


def _no_kernel(op):
    assert not op._impls, "a kernel was made before the error"


@pytest.mark.parametrize("case,kind,match", [
    ("q heads", ValueError, r"q: expected num_q_heads heads"),
    ("k dim", ValueError, r"k: expected head_dim"),
    ("k dtype", ValueError, r"k: expected q's dtype; got dtype_k='float16', dtype_q='float32'"),
    ("v shape", ValueError, r"v: expected shape"),
    ("batch", ValueError, r"batch"),
    ("k rank", ValueError, r"k: expected"),
    ("cu with dense", ValueError, r"cu_seqlens_q: expected None with a 4-D"),
    ("cu_k with dense", ValueError, r"cu_seqlens_k: expected None with a 4-D"),
    ("varlen no cu_k", ValueError, r"cu_seqlens_k: expected int32 offsets"),
    ("varlen no cu_q", ValueError, r"cu_seqlens_q: expected int32 offsets"),
    ("cu dtype", TypeError, r"cu_seqlens_q: expected dtype int32"),
    ("lse with grad", RuntimeError, r"return_lse=True while q requires grad"),
])
def test_bad_inputs_are_named(case, kind, match):
    op = AttnFwdOp(4, 2, 64)
    q, k, v = _inputs(19, (2, 5, 4, 64), (2, 7, 2, 64))
    cu = torch.tensor([0, 5], dtype=torch.int32)
    args, kw = [q, k, v], {}
    if case == "q heads":
        args[0] = torch.randn(2, 5, 3, 64)
    elif case == "k dim":
        args[1] = args[2] = torch.randn(2, 7, 2, 32)
    elif case == "k dtype":
        args[1], args[2] = k.half(), v.half()
    elif case == "v shape":
        args[2] = torch.randn(2, 8, 2, 64)
    elif case == "batch":
        args[1] = args[2] = torch.randn(3, 7, 2, 64)
    elif case == "k rank":
        args[1] = args[2] = torch.randn(14, 2, 64)
    elif case == "cu with dense":
        kw = {"cu_seqlens_q": cu, "cu_seqlens_k": cu}
    elif case == "cu_k with dense":
        kw = {"cu_seqlens_k": cu}
    elif case == "varlen no cu_k":
        args = [q[0], k[0], v[0]]
        kw = {"cu_seqlens_q": cu}
    elif case == "varlen no cu_q":
        args = [q[0], k[0], v[0]]
        kw = {"cu_seqlens_k": torch.tensor([0, 7], dtype=torch.int32)}
    elif case == "cu dtype":
        args = [q[0], k[0], v[0]]
        kw = {"cu_seqlens_q": cu.long(), "cu_seqlens_k": cu.long()}
    elif case == "lse with grad":
        args[0] = q.clone().requires_grad_(True)
        kw = {"return_lse": True}
    with pytest.raises(kind, match=match):
        op(*args, **kw)
    _no_kernel(op)


@pytest.mark.parametrize("cu_q,cu_k,name,index,value", [
    ([0, 3, 2, 7], [0, 4, 6, 6], "cu_seqlens_q", 2, 2),   # decreasing
    ([1, 3, 5, 7], [0, 4, 6, 6], "cu_seqlens_q", 0, 1),   # not starting at 0
    ([0, 3, 5, 7], [0, 4, 6, 5], "cu_seqlens_k", 3, 5),   # not ending at the keys' count (6)
])
def test_bad_cu_seqlens_reported_with_index(cu_q, cu_k, name, index, value):
    op = AttnFwdOp(4, 2, 64, causal=True)
    q, k, v = _inputs(20, (7, 4, 64), (6, 2, 64))
    cq, ck = torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32)
    with pytest.raises(ValueError, match=rf"{name}: expected offsets starting at 0.*{name}\[{index}\] = {value}"), \
            tileops.strict():
        op(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck)
    # without strict: at the call (the CPU's runtime judges its calls there) or at op.check() (a GPU's
    # deferred report); the kernel ran on the offsets clamped into the tokens, reading nothing out of bounds
    with pytest.raises(ValueError, match=rf"{name}\[{index}\] = {value}"):
        op(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck)
        op.check()


def test_cuda_gradients_are_refused_when_the_variable_says_0(monkeypatch):
    """``TILEOPS_ATTENTION_CUDA=0``: a CUDA call (here the backend the op sees on this machine, made
    CUDA) whose inputs require grad refuses before any kernel is built or run, naming the variable,
    no_grad and the torch target."""
    from tileops.attention import attn_builtin

    monkeypatch.setenv(attn_builtin.CUDA_ENV, "0")
    monkeypatch.setattr(attn_builtin, "device_backend", lambda device: ("cuda", "sm_90"))
    monkeypatch.setattr(attn_builtin, "load_kernel", lambda *a, **k: object())  # no GPU here: nothing to build
    monkeypatch.setattr(attn_builtin.AttnKernels, "binding", lambda *a, **k: None)  # (its fast path: no launch)
    monkeypatch.setattr(attn_builtin.AttnKernels, "_bind", lambda *a, **k: pytest.fail("a kernel was bound"))
    op = AttnFwdOp(4, 2, 64)
    q, k, v = _inputs(3, (1, 4, 4, 64), (1, 4, 2, 64), torch.bfloat16)
    with pytest.raises(NotImplementedError, match=r"CUDA gradients: the attention backward's tile programs are "
                                                   r"refused by TILEOPS_ATTENTION_CUDA=0.*no_grad.*target='torch'"):
        op(q.requires_grad_(), k, v)


@pytest.mark.cuda
def test_cuda_gradients_are_refused_on_a_gpu_when_the_variable_says_0(monkeypatch):
    """On a GPU with ``TILEOPS_ATTENTION_CUDA=0`` the forward runs; a call that will take gradients is
    refused, and the torch target serves it."""
    from tileops.attention.attn_builtin import CUDA_ENV

    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    monkeypatch.setenv(CUDA_ENV, "0")
    q, k, v = (t.to("cuda", torch.bfloat16) for t in _inputs(4, (1, 4, 4, 64), (1, 4, 2, 64)))
    op = AttnFwdOp(4, 2, 64)
    want = AttnFwdOp(4, 2, 64, target="torch")(q, k, v)
    assert bool(torch.isfinite(op(q, k, v)).all())
    with pytest.raises(NotImplementedError, match=r"CUDA gradients"):
        op(q.requires_grad_(), k, v)
    out = AttnFwdOp(4, 2, 64, target="torch")(q, k, v)  # the named alternative serves the call
    out.float().sum().backward()
    assert q.grad is not None and out.shape == want.shape


@pytest.mark.parametrize("fields", [dict(), dict(pipeline=2), dict(causal=True, pipeline=2),
                                    dict(causal=True, window=True, pipeline=3), dict(causal=True, pipeline=4),
                                    dict(causal=True, window=True, varlen=True), dict(causal=True, loads=1)],
                         ids=["dense", "dense-tma", "dense-causal-tma", "dense-window-pingpong", "dense-causal-overlap",
                              "varlen-window", "dense-causal-bwd-every-thread"])
def test_cuda_kernels_take_every_argument_their_plan_binds(fields):
    """Each CUDA kernel of a call (the forward, then the backward's three) takes every argument its
    plan step binds by name: a parameter of its prim_func, or a variable of a tensor's shape or
    strides (TileLang's launcher takes those as extents, by name). A macro parameter renames the
    variable it is handed: the forward handed the extent ``sq`` to a parameter named ``nq``, its Q
    took the shape ``[nb, nq, ...]``, and every call of the first H200 run refused with "kernel fwd
    has no argument 'sq'" (then, with the TMA loads, 'sk': ``hi = sk``). Built here, not lowered
    (the names are the prim_func's); ``build`` itself now refuses a renamed extent, so this test
    fails on either check."""
    pytest.importorskip("tilelang")
    from tileops.attention.attn_builtin import FORWARD, backward_plan, backward_specs
    from tileops.compile.build import prim_func
    from tileops.kernels import get_spec

    pipeline = fields.get("pipeline", 0)
    base = dict(dtype="bfloat16", head_dim=64, varlen=fields.get("varlen", False), causal=fields.get("causal", False),
                window=fields.get("window", False), softcap=False)
    fwd = get_spec("attention")(backend="cuda", hq=4, hkv=2, pipeline=pipeline, **base)
    jobs = [("attention", fwd, FORWARD.steps[0])]
    specs = backward_specs(base, "cuda", {"loads": fields["loads"]} if "loads" in fields else None)
    # (a schedule's loads reaches all three programs: the plan is chosen by them together)
    assert len({s.tma for s in specs}) == 1, specs
    for s in specs:
        jobs.append(("attention_bwd", s, {t.kernel: t for t in backward_plan(s.tma).steps}[s.kind]))
    for builder, spec, step in jobs:
        func = prim_func(builder, spec)
        takes = set()
        for p in func.params:
            buf = func.buffer_map.get(p)
            if buf is None:
                takes.add(p.name)
                continue
            takes.add(buf.name)
            takes |= {str(x) for x in (*buf.shape, *buf.strides) if not str(x).isdigit()}
        missing = sorted(set(step.args) - takes)
        assert not missing, f"{builder} {spec}: the plan binds {missing}, which the kernel does not take"
