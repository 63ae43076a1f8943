"""``AttnFwdOp``'s gradients on the CPU (the forward's C schedule, then the backward plan's three C
programs of ``kernels/attention_bwd.py``): every mask, softcap, GQA and MHA, varlen with an empty
sequence, HF's transposed views with a strided and an expanded dO, fp32/fp16/bf16, determinism, and
the refusals. Against float64 autograd through the definition (``tests/references_attention.py``:
:func:`attention_grads`, which shares no code with the kernels). The op's gradients are new tensors
the plan allocates: each is checked finite, and an element left unwritten fails its bound wherever
the true gradient is not (within the bound) zero.

Bounds (:func:`bounds`), per element, from the arithmetic; ``u = 2^-24`` (fp32), ``U`` the dtype's
unit roundoff (2^-24 fp32, 2^-11 fp16, 2^-8 bf16):

* the forward (``tests/test_attn_fwd.py``'s bound): o within ``(n_f u + U) * sum_j p_j |v_j|`` and
  lse within ``n_f u`` (plus its own rounding to fp32, ``u |lse|``), ``n_f = (2 D + 2 Sk + 64)(1 + smax)``
  (CUDA: ``u`` 2^-22 for ex2.approx, and ``2 U``: the forward rounds P to the dtype before P V);
* the backward's fp32 sums (a sum of n products within ``n u sum |terms|``, Higham's gamma_n),
  ``n_b = D + G * Sq + Sk + 8``: s over D, dk/dv over the G * Sq rows of a kv head's group, dq over
  Sk, 8 for exp/tanh and the scalings (a few ulps each);
* s - lse is then within ``e_s = n_b u * scale |q|.|k| + n_f u + u |lse| + 4 u``, so p = exp(s - lse)
  within ``p e_s``; delta = dO . o within ``n_b u sum |dO o| + (n_f u + U) sum |dO| omag``, dp = dO . v
  within ``n_b u |dO|.|v|``; ds = p (dp - delta) within ``p e_s |dp - delta| + p (err dp + err delta)``
  (softcap: times ``1 - t^2 <= 1``, plus ``2 e_s / c`` relative for the error of ``1 - t^2``);
* dv = sum p dO, dk = scale sum ds q, dq = scale sum ds k carry those errors term by term, their own
  sums' ``n_b u``, and the store's ``U`` of the result; on CUDA (tensor cores) p and ds are rounded
  to the dtype before the products: ``U`` of ``sum p |dO|``, ``scale sum |ds| |q|``, ``scale sum |ds| |k|``;
* gradual underflow: a value rounded below the normal range is off by half its subnormal spacing
  (``TINY``), absolute: p and ds in fp32 (2^-150 each, carried through the sums like their other
  errors), each of a sum's ``n_b`` additions, and the store in the dtype (fp16's 2^-25 matters: a
  large scale leaves gradients near 1e-6, below fp16's normal range).

Small shapes (each distinct op compiles four C kernels, ~2 s each): CI has 2 cores.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from tileops.attention import AttnFwdOp

_spec = importlib.util.spec_from_file_location("_attn_bwd_refs", Path(__file__).with_name("references_attention.py"))
refs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(refs)

U32 = 2.0**-24
UNIT = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
#: half the spacing of each dtype's subnormals: a result rounded to nearest below the normal range is
#: off by at most this much, absolute, not U relative (fp16's subnormals start at 6.1e-5, so a large
#: scale's tiny gradients land there: 1.9e-6 stored with an error of 1.2e-8)
TINY = {torch.float32: 2.0**-150, torch.float16: 2.0**-25, torch.bfloat16: 2.0**-134}


def draw(seed: int, shapes: dict, dtype=torch.float32) -> dict:
    """Inputs drawn in fp32 from a seeded generator, rounded to ``dtype`` (exact in it)."""
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(dtype) for n, s in shapes.items()}


def spans(q: torch.Tensor, k: torch.Tensor, cu_q, cu_k) -> list:
    """(index into q's rows, index into k's rows) of each sequence."""
    if q.dim() == 4:
        return [((b,), (b,)) for b in range(q.shape[0])]
    cq, ck = cu_q.tolist(), cu_k.tolist()
    return [((slice(cq[b], cq[b + 1]),), (slice(ck[b], ck[b + 1]),)) for b in range(len(cq) - 1)]


def bounds(params: dict, t: dict, tensor_cores: bool = False) -> dict:
    """The per-element bound of each gradient (the module's doc), from float64 magnitudes; with
    ``tensor_cores`` (the CUDA schedules) p and ds rounded to the dtype, and the GPU's exp2
    (``ex2.approx``, 2^-22 relative, as ``tests/test_attn_fwd_cuda.py`` takes it) in the forward's
    count and each exp."""
    q, k, v, do = (t[n].detach().cpu().double() for n in ("q", "k", "v", "dout"))
    u_exp = 2.0**-22 if tensor_cores else U32
    dtype = t["q"].dtype
    hq, hkv, d = params["num_q_heads"], params["num_kv_heads"], params["head_dim"]
    grp = hq // hkv
    sc = params.get("softmax_scale") or d ** -0.5
    cap, w, causal = params.get("softcap"), params.get("sliding_window"), params.get("causal")
    fwd = refs.attention(params, t)
    fwd_err = (2 * d + 2 * k.shape[-3] + 64) * (1 + fwd["smax"]) * u_exp  # the forward's, o relative and lse
    parts = spans(q, k, *(t[n].cpu() if n in t else None for n in ("cu_seqlens_q", "cu_seqlens_k")))
    max_q = max((q[a].shape[0] for a, _ in parts), default=0)
    max_k = max((k[b].shape[0] for _, b in parts), default=0)
    n_b = d + grp * max_q + max_k + 8
    out = {n: torch.zeros_like(x) for n, x in (("dq", q), ("dk", k), ("dv", v))}
    unit = UNIT[dtype]
    for a, b in parts:
        qh, doh = q[a].transpose(0, 1), do[a].transpose(0, 1)  # [Hq, nq, D]
        kh, vh = (x[b].repeat_interleave(grp, dim=1).transpose(0, 1) for x in (k, v))  # [Hq, nk, D]
        nq, nk = qh.shape[1], kh.shape[1]
        if nq == 0 or nk == 0:
            continue
        i, j = torch.arange(nq)[:, None], torch.arange(nk)[None, :]
        seen = torch.ones(nq, nk, dtype=torch.bool)
        if causal:
            seen &= j <= i + nk - nq
        if w is not None:
            seen &= j > i + nk - nq - w
        s = sc * qh @ kh.transpose(1, 2)
        tanh = torch.tanh(s / cap) if cap else None
        s = cap * tanh if cap else s
        lse = torch.logsumexp(s.masked_fill(~seen, -math.inf), -1, keepdim=True)
        p = torch.where(seen & torch.isfinite(lse), torch.exp(s - lse), torch.zeros_like(s))
        o, omag = p @ vh, p @ vh.abs()
        e_s = n_b * U32 * sc * (qh.abs() @ kh.abs().transpose(1, 2)) + fwd_err + 4 * u_exp + U32 * torch.where(
            torch.isfinite(lse), lse.abs(), torch.zeros_like(lse))
        err_p = p * e_s + torch.where(seen, TINY[torch.float32], 0.0)
        dp = doh @ vh.transpose(1, 2)
        gap = dp - (doh * o).sum(-1, keepdim=True)
        err_delta = (n_b * U32 * (doh.abs() * o.abs()).sum(-1, keepdim=True)
                     + (fwd_err + unit * (2 if tensor_cores else 1)) * (doh.abs() * omag).sum(-1, keepdim=True))
        err_dp = n_b * U32 * (doh.abs() @ vh.abs().transpose(1, 2))
        dcap = 1 - tanh * tanh if cap else torch.ones_like(s)
        ds = p * gap * dcap
        err_ds = ((err_p * gap.abs() + p * (err_dp + err_delta)) * dcap + (2 * p * gap.abs() * e_s / cap if cap else 0)
                  + torch.where(seen, TINY[torch.float32], 0.0))
        err_dv = err_p.transpose(1, 2) @ doh.abs() + n_b * U32 * p.transpose(1, 2) @ doh.abs()
        err_dk = sc * (err_ds.transpose(1, 2) @ qh.abs() + n_b * U32 * ds.abs().transpose(1, 2) @ qh.abs())
        err_dq = sc * (err_ds @ kh.abs() + n_b * U32 * ds.abs() @ kh.abs())
        if tensor_cores:
            err_dv = err_dv + unit * p.transpose(1, 2) @ doh.abs()
            err_dk = err_dk + unit * sc * ds.abs().transpose(1, 2) @ qh.abs()
            err_dq = err_dq + unit * sc * ds.abs() @ kh.abs()

        def per_kv(x):  # [Hq, nk, D] -> [nk, Hkv, D], summed over each kv head's group
            return x.reshape(hkv, grp, nk, d).sum(1).transpose(0, 1)

        out["dq"][a] += err_dq.transpose(0, 1)
        out["dk"][b] += per_kv(err_dk)
        out["dv"][b] += per_kv(err_dv)
    return {n: x + n_b * TINY[torch.float32] + TINY[dtype] for n, x in out.items()}


def run(op: AttnFwdOp, t: dict) -> tuple:
    """The op's (dq, dk, dv) of ``sum(out * dout)``, q, k and v requiring grad."""
    leaves = {n: t[n].detach().requires_grad_(True) for n in ("q", "k", "v")}
    kw = {n: t[n] for n in ("cu_seqlens_q", "cu_seqlens_k") if n in t}
    out = op(leaves["q"], leaves["k"], leaves["v"], **kw)
    assert out.grad_fn is not None
    return torch.autograd.grad(out, [leaves[n] for n in ("q", "k", "v")], t["dout"])


def check(op: AttnFwdOp, t: dict, tensor_cores: bool = False) -> tuple:
    """The op's gradients against float64 autograd's, each element within its bound (:func:`bounds`,
    plus the store's ``U`` of the true value); ``t`` may live on CUDA (the references read it on the CPU)."""
    got = run(op, t)
    params = dict(op.params)
    want = refs.attention_grads(params, t, t["dout"])
    allowed = bounds(params, t, tensor_cores)
    unit = UNIT[t["q"].dtype]
    for name, g in zip(("dq", "dk", "dv"), got):
        src = t[name[1:]]
        assert g.shape == src.shape and g.dtype == src.dtype, name
        assert bool(torch.isfinite(g).all()), f"{name}: a NaN or inf (an element never written?)"
        ref = want[name]
        tol = allowed[name] + unit * ref.abs() + 1e-300
        err = (g.detach().cpu().double() - ref).abs()
        bad = err > tol
        assert not bad.any(), (f"{name}: {int(bad.sum())} of {bad.numel()} off; worst {err.max().item():.3e}, "
                               f"{(err / tol).max().item():.2f} x its bound")
    return got


def dense(seed: int, b: int, sq: int, sk: int, hq: int, hkv: int, d: int = 64, dtype=torch.float32) -> dict:
    return draw(seed, {"q": (b, sq, hq, d), "k": (b, sk, hkv, d), "v": (b, sk, hkv, d), "dout": (b, sq, hq, d)}, dtype)


# Sequences of 21 to 37 rows cross the C backward's 16-row tiles and end inside one.
# (causal, window, softcap, scale, sq, sk)
CASES = {
    "none": (False, None, None, None, 21, 37),
    "causal-square": (True, None, None, None, 33, 33),
    "causal-sq<sk": (True, None, None, None, 21, 37),
    "causal-sq>sk": (True, None, None, None, 37, 21),  # the first 16 queries see no key: zero dq
    "window": (False, 7, None, None, 33, 40),
    "causal+window": (True, 7, None, None, 33, 40),
    # Gemma 2's 50 with an amplified scale: tanh saturates for part of the scores
    "softcap": (True, None, 50.0, 6.0, 24, 30),
}


@pytest.mark.parametrize("name", list(CASES))
def test_gqa_masks(name):
    causal, window, cap, scale, sq, sk = CASES[name]
    op = AttnFwdOp(4, 2, 64, causal=causal, sliding_window=window, softcap=cap, softmax_scale=scale)
    t = dense(31, 2, sq, sk, 4, 2)
    dq, _, _ = check(op, t)
    if name == "causal-sq>sk":
        assert bool((dq[:, : sq - sk] == 0).all())


def test_mha_head_dim_80():
    op = AttnFwdOp(3, 3, 80, causal=True)
    check(op, dense(32, 2, 19, 26, 3, 3, d=80))


def test_varlen_with_an_empty_sequence():
    """Four sequences: the second empty on both sides, the third with keys but no queries, the last
    with more queries than keys (its first queries see no key)."""
    op = AttnFwdOp(4, 2, 64, causal=True)
    lq, lk = [19, 0, 0, 23], [26, 0, 5, 17]
    t = draw(33, {"q": (sum(lq), 4, 64), "k": (sum(lk), 2, 64), "v": (sum(lk), 2, 64), "dout": (sum(lq), 4, 64)})
    t["cu_seqlens_q"] = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32)
    t["cu_seqlens_k"] = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], dtype=torch.int32)
    _, dk, dv = check(op, t)
    assert bool((dk[26:31] == 0).all()) and bool((dv[26:31] == 0).all())  # keys no query reads


def test_hf_transposed_views_and_strided_dout():
    """q, k, v as HF's ``[B, H, S, D]`` transposed; dO a transposed view too, then an expanded one
    (``out.sum()``'s, stride 0: copied to a dense tensor first). The gradients come back laid out like
    the inputs, and equal (bit for bit) those of dense inputs."""
    op = AttnFwdOp(4, 2, 64, causal=True)
    h = draw(34, {"q": (2, 4, 21, 64), "k": (2, 2, 30, 64), "v": (2, 2, 30, 64), "dout": (2, 4, 21, 64)})
    t = {n: x.transpose(1, 2) for n, x in h.items()}
    got = check(op, t)
    for g, n in zip(got, "qkv"):
        assert g.stride() == t[n].stride(), f"d{n} laid out like {n}"
    flat = run(op, {n: x.contiguous() for n, x in t.items()})
    assert all(torch.equal(a, b) for a, b in zip(got, flat))
    leaves = [t[n].detach().requires_grad_(True) for n in "qkv"]
    op(*leaves).sum().backward()
    ones = {**t, "dout": torch.ones_like(t["dout"])}
    want = refs.attention_grads(dict(op.params), ones, ones["dout"])
    allowed = bounds(dict(op.params), ones)
    for x, n in zip(leaves, "qkv"):
        assert bool(((x.grad.double() - want[f"d{n}"]).abs() <= allowed[f"d{n}"] + U32 * want[f"d{n}"].abs()).all())


def test_16_bit():
    """bf16 with a window; fp16 with a softcap and an amplified scale, which leaves gradients near 1e-6,
    below fp16's normal range (``TINY``)."""
    check(AttnFwdOp(4, 2, 64, causal=True, sliding_window=20), dense(35, 2, 18, 35, 4, 2, dtype=torch.bfloat16))
    check(AttnFwdOp(4, 2, 64, causal=True, softcap=50.0, softmax_scale=6.0),
          dense(35, 2, 24, 30, 4, 2, dtype=torch.float16))


def test_some_inputs_only_and_no_keys():
    """Only q requires grad: its gradient alone; no keys at all: every gradient is zeros."""
    op = AttnFwdOp(4, 2, 64)
    t = dense(36, 1, 9, 12, 4, 2)
    q = t["q"].clone().requires_grad_(True)
    (dq,) = torch.autograd.grad(op(q, t["k"], t["v"]), [q], t["dout"])
    assert torch.equal(dq, run(op, t)[0])
    e = dense(37, 1, 9, 0, 4, 2)
    assert all(bool((g == 0).all()) for g in run(op, e))


def test_deterministic():
    """Two backwards of the same inputs: the same bits (no atomics: every gradient a sum in a fixed order)."""
    op = AttnFwdOp(4, 1, 64, causal=True)
    t = dense(38, 2, 25, 25, 4, 1)
    first, second = run(op, t), run(op, t)
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(first, second))


def test_lse_is_computed_only_for_a_gradient():
    """A call that needs a gradient keeps its lse (equal to return_lse's) in its per-call state; a
    no-grad call has no state, so its forward computes none."""
    op = AttnFwdOp(4, 2, 64, causal=True)
    t = dense(39, 1, 10, 12, 4, 2)
    with torch.no_grad():
        out, lse = op(t["q"], t["k"], t["v"], return_lse=True)
    impl = next(iter(op._impls.values()))
    none = {"cu_seqlens_q": None, "cu_seqlens_k": None}
    plain = {"q": t["q"], "k": t["k"], "v": t["v"], **none}
    assert impl.prepare(plain) is None
    leaves = {**{n: t[n].clone().requires_grad_(True) for n in "qkv"}, **none}
    state = impl.prepare(leaves)
    assert state == {}
    with torch.no_grad():
        assert torch.equal(impl.forward(state, leaves, {}), out)
    assert torch.equal(state["lse"], lse)


def test_return_lse_refused_while_a_gradient_is_needed():
    op = AttnFwdOp(4, 2, 64)
    t = dense(40, 1, 5, 7, 4, 2)
    with pytest.raises(RuntimeError, match=r"return_lse=True while k requires grad: the backward does not take "
                                           r"lse's gradient"):
        op(t["q"], t["k"].requires_grad_(True), t["v"], return_lse=True)


def test_compiled_gradients_equal_eager():
    """Under torch.compile the forward runs as the library's custom op and keeps no lse: the backward
    computes it again with a forward (``AttnKernels.backward``), and gives the eager gradients' bits."""
    op = AttnFwdOp(4, 2, 64, causal=True)
    t = dense(41, 2, 9, 12, 4, 2)

    def loss(q, k, v):
        return (op(q, k, v) * t["dout"]).sum()

    eager = [x.clone().requires_grad_(True) for x in (t["q"], t["k"], t["v"])]
    loss(*eager).backward()
    compiled = [x.clone().requires_grad_(True) for x in (t["q"], t["k"], t["v"])]
    torch.compile(loss, fullgraph=True, backend="aot_eager")(*compiled).backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(eager, compiled))
