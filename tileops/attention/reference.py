"""Float64 evaluations of the attention ops, for ``tileops demo`` (the tests have their own, in
``tests/``): the prologue's q, ``AttnFwdOp``'s output and ``PagedAttnDecodeFwdOp``'s."""

from __future__ import annotations

from typing import Any, Mapping

import torch

__all__ = ["reference", "scale", "grads"]


def _normed_q(op: Any, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """q ``[tokens, Hq, D]`` in float64, RMS-normalised with its weight under ``qk_norm``."""
    p = op.params
    hq, hkv, d = p["num_q_heads"], p["num_kv_heads"], p["head_dim"]
    x = inputs["qkv"].detach().cpu().to(torch.float64)
    q = x.reshape(x.shape[0], hq + 2 * hkv, d)[:, :hq]
    if p["qk_norm"]:
        w = inputs["q_norm_weight"].detach().cpu().to(torch.float64)
        q = q / torch.sqrt((q * q).mean(-1, keepdim=True) + p["eps"]) * w
    return q


def _attention(op: Any, inputs: Mapping[str, torch.Tensor],
               graph: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``AttnFwdOp``'s output in float64 and ``sum_j p_j |v_j|`` per element (what its roundings act
    on), a sequence and a q head at a time, the masks as the op defines them. ``graph``: q, k and v
    are float64 CPU tensors taken as they are, so that autograd can differentiate the output."""
    p = op.params
    hq, hkv, d = p["num_q_heads"], p["num_kv_heads"], p["head_dim"]
    sc = p["softmax_scale"] or d ** -0.5
    q, k, v = (inputs[n] if graph else inputs[n].detach().cpu().to(torch.float64) for n in ("q", "k", "v"))
    if q.dim() == 4:
        seqs = [(q[b], k[b], v[b], b, None) for b in range(q.shape[0])]
    else:
        cq, ck = inputs["cu_seqlens_q"].tolist(), inputs["cu_seqlens_k"].tolist()
        seqs = [(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]], None, cq[b]) for b in range(len(cq) - 1)]
    out, mag = torch.zeros_like(q), torch.zeros_like(q)
    for qs, ks, vs, b, q0 in seqs:
        nq, nk = qs.shape[0], ks.shape[0]
        i, j = torch.arange(nq)[:, None], torch.arange(nk)[None, :]
        seen = torch.ones(nq, nk, dtype=torch.bool)
        if p["causal"]:
            seen &= j <= i + nk - nq
        if p["sliding_window"] is not None:
            seen &= j > i + nk - nq - p["sliding_window"]
        for h in range(hq):
            g = h // (hq // hkv)
            s = qs[:, h] @ ks[:, g].T * sc
            if p["softcap"] is not None:
                s = p["softcap"] * torch.tanh(s / p["softcap"])
            # a query that sees no key has p = 0 (and a zero gradient: no NaN of an all -inf row)
            live = seen.any(-1, keepdim=True)
            pr = torch.softmax(torch.where(live, s.masked_fill(~seen, float("-inf")), 0.0), -1) * live
            o, m = pr @ vs[:, g], pr @ vs[:, g].abs()
            if b is not None:
                out[b, :, h], mag[b, :, h] = o, m
            else:
                out[q0:q0 + nq, h], mag[q0:q0 + nq, h] = o, m
    return out, mag


def _decode(op: Any, inputs: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``PagedAttnDecodeFwdOp``'s output in float64 and ``sum_j p_j |v_j|``: each sequence's keys read
    through its block table (an entry outside the cache skipped, a length clamped into the table, as the
    op defines them), a float8 cache times its scale."""
    p = op.params
    hq, hkv, d = p["num_q_heads"], p["num_kv_heads"], p["head_dim"]
    sc = p["softmax_scale"] or d ** -0.5
    q = inputs["q"].detach().cpu().to(torch.float64)
    kc, vc = (inputs[n].detach().cpu().to(torch.float32).to(torch.float64) for n in ("key_cache", "value_cache"))
    if p["cache_dtype"] == "float8_e4m3fn":
        kc = kc * float(inputs["k_scale"].reshape(()))
        vc = vc * float(inputs["v_scale"].reshape(()))
    if p["cache_layout"] == "HND":  # -> [blocks, bs, Hkv, D]
        kc, vc = kc.transpose(1, 2), vc.transpose(1, 2)
    bt, lens = inputs["block_tables"].cpu(), inputs["seq_lens"].cpu()
    blocks, bs = kc.shape[0], kc.shape[1]
    out, mag = torch.zeros_like(q), torch.zeros_like(q)
    for b in range(q.shape[0]):
        n = min(max(int(lens[b]), 0), bt.shape[1] * bs)
        lo = max(n - p["sliding_window"], 0) if p["sliding_window"] else 0
        rows = [(int(bt[b, j // bs]), j % bs) for j in range(lo, n)]
        rows = [(k, r) for k, r in rows if 0 <= k < blocks]
        if not rows:
            continue
        ks, vs = torch.stack([kc[k, r] for k, r in rows]), torch.stack([vc[k, r] for k, r in rows])
        for h in range(hq):
            g = h // (hq // hkv)
            s = ks[:, g] @ q[b, h] * sc
            if p["softcap"] is not None:
                s = p["softcap"] * torch.tanh(s / p["softcap"])
            pr = torch.softmax(s, 0)
            out[b, h], mag[b, h] = pr @ vs[:, g], pr @ vs[:, g].abs()
    return out, mag


def scale(op: Any, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """What each element of q's error is measured against (``tileops demo``'s tolerance): ``|a| + |c|``
    of its rotation pair (times the amplitude), not its own value. The op rounds the normalised q to
    qkv's dtype before rotating it, so a rotation that cancels carries the rounding of both elements:
    measured against the element alone, one demo run in six failed in bf16 (seen here). For
    ``AttnFwdOp``: ``sum_j p_j |v_j|``, the magnitude of the convex combination its roundings act on."""
    if op.name == "AttnFwdOp":
        return _attention(op, inputs)[1]
    if op.name == "PagedAttnDecodeFwdOp":
        return _decode(op, inputs)[1]
    q = _normed_q(op, inputs)
    rope = op.params["rope"]
    rot = rope.rotated_width(q.shape[-1])
    amp = abs(float(rope.deployment_tables(rot).amplitude))
    if rope.pairing == "neox":
        first, second = slice(0, rot // 2), slice(rot // 2, rot)
    else:
        first, second = slice(0, rot, 2), slice(1, rot, 2)
    out = q.abs()
    pair = (q[..., first].abs() + q[..., second].abs()) * max(1.0, amp)
    out[..., first], out[..., second] = pair, pair
    return out


def reference(op: Any, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The prologue's q ``[tokens, Hq, D]`` in float64 on the CPU (norm, then the rope op's rotation);
    ``AttnFwdOp``'s output."""
    if op.name == "AttnFwdOp":
        return _attention(op, inputs)[0]
    if op.name == "PagedAttnDecodeFwdOp":
        return _decode(op, inputs)[0]
    q = _normed_q(op, inputs)
    rope = op.params["rope"]
    rot = rope.rotated_width(q.shape[-1])
    tables = rope.deployment_tables(rot)
    ang = inputs["positions"].detach().cpu().to(torch.float64)[:, None] * tables.inv_freq
    c, s = (ang.cos() * tables.amplitude)[:, None, :], (ang.sin() * tables.amplitude)[:, None, :]
    out = q.clone()
    a, b = q[..., : rot // 2], q[..., rot // 2: rot]
    out[..., : rot // 2], out[..., rot // 2: rot] = a * c - b * s, b * c + a * s
    return out


def grads(op: Any, inputs: Mapping[str, torch.Tensor], grad_out: torch.Tensor) -> dict[str, torch.Tensor]:
    """``AttnFwdOp``'s gradients of ``sum(out * grad_out)`` with respect to q, k and v, by float64
    autograd of the output above, on the CPU (what ``tileops tune`` checks a backward schedule against)."""
    if op.name != "AttnFwdOp":
        raise ValueError(f"{op.name}: no float64 gradient reference")
    leaves = {n: inputs[n].detach().cpu().to(torch.float64).requires_grad_(True) for n in ("q", "k", "v")}
    out = _attention(op, {**inputs, **leaves}, graph=True)[0]
    got = torch.autograd.grad(out, list(leaves.values()), grad_out.detach().cpu().to(torch.float64))
    return dict(zip(leaves, got))
