"""The attention family's float64 reference, for the generated tests and the fuzzer
(:mod:`family_references`): the unfused chain written from the definition, sharing no code with the
package or its kernels.

``reference("AttnFwdOp", params, inputs)`` returns attention's output (:func:`attention`: a loop over
sequences and heads, the masks written out as matrices, no code shared with the kernels);
:func:`attention_grads` its gradients, by float64 autograd through the same definition.
``reference("AttnPrologueFwdOp", params, inputs)`` returns ``{"q_out": q, "key_cache": ...,
"value_cache": ...}``: q ``[tokens, Hq, D]`` and the caches after the call (from the caches given,
which are the state before it). The rope stage's frequencies come from the rope family's own float64
reference (``references.py``), by the rope op's name and params (read off the object, nothing of it
is called), with the deployment's fixed choice where HF picks per call (Phi-3's long factors when
max_position_embeddings exceeds the original; dynamic NTK's base at factor * max_position_embeddings).
Tokens naming one slot write it in token order: the later one stays. A float8 cache (``cache_dtype``)
holds ``x / scale`` saturated at 448: the reference gives that value in float64 and its error scale
over the scale too; the generated tests compare it at e4m3's precision.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

_spec = importlib.util.spec_from_file_location("_attention_rope_references", Path(__file__).with_name("references.py"))
rope_references = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rope_references)


def rope_params(name: str, params: dict) -> dict:
    """The rope op's params with ``max_position_id`` standing for the deployment's length."""
    p = dict(params)
    if name == "Phi3LongRoPEFwdOp":
        longer = p["max_position_embeddings"] > p["original_max_position_embeddings"]
        p["max_position_id"] = p["max_position_embeddings"] - 1 if longer else 0
    if name == "RoPEDynamicNTKFwdOp":
        p["max_position_id"] = p["factor"] * p["max_position_embeddings"] - 1
    return p


def reference(op_name: str, params: dict, inputs: dict) -> "dict | torch.Tensor":
    if op_name == "PagedAttnDecodeFwdOp":
        return paged_decode(params, inputs)[0]
    if op_name == "AttnFwdOp":  # differentiable when the caller's float64 leaves ask (family_references.grads)
        return attention(params, inputs, differentiable=any(inputs[n].requires_grad for n in ("q", "k", "v")))["out"]
    return _chain(op_name, params, inputs)[0]


def grad_scale(op_name: str, params: dict, inputs: dict, grad_outs: dict) -> dict:
    """What ``AttnFwdOp``'s gradients' errors are measured against (:func:`family_references.grad_scales`):
    the magnitudes of the terms each one sums, which bound it and every rounding of its sums. With
    ``dO`` out's gradient and p the probabilities: dv ``sum_i p_ij |dO_i|``; ds's terms
    ``m_ij = p_ij (|dO_i| . |v_j| + |dO_i| . |o_i|)`` (dp = dO . v less delta = dO . o; a softcap's
    ``1 - t^2`` is at most 1); dk ``scale sum_i m_ij |q_i|``, dq ``scale sum_j m_ij |k_j|``; dk and dv summed
    over each kv head's group."""
    if op_name != "AttnFwdOp":
        return {}
    hq, hkv, d = params["num_q_heads"], params["num_kv_heads"], params["head_dim"]
    grp, sc = hq // hkv, params.get("softmax_scale") or 1.0 / d ** 0.5
    q, k, v = (inputs[n].detach().cpu().double() for n in ("q", "k", "v"))
    do = grad_outs["out"].detach().cpu().double()
    fwd = attention(params, inputs)
    o = fwd["out"]
    mags = {n: torch.zeros_like(t) for n, t in (("q", q), ("k", k), ("v", v))}
    if q.dim() == 4:
        parts = [((b,), (b,)) for b in range(q.shape[0])]
    else:
        cq, ck = inputs["cu_seqlens_q"].tolist(), inputs["cu_seqlens_k"].tolist()
        parts = [((slice(cq[b], cq[b + 1]),), (slice(ck[b], ck[b + 1]),)) for b in range(len(cq) - 1)]
    for a, b in parts:
        lse = (fwd["lse"][b[0]] if q.dim() == 4 else fwd["lse"][:, a[0]]).unsqueeze(-1)  # [Hq, nq, 1]
        qa, doa, oa = (t[a].abs().transpose(0, 1) for t in (q, do, o))  # [Hq, nq, D]
        ks, vs = (t[b].repeat_interleave(grp, dim=1).transpose(0, 1) for t in (k, v))  # [Hq, nk, D]
        if qa.shape[1] == 0 or ks.shape[1] == 0:
            continue
        s = sc * q[a].transpose(0, 1) @ ks.transpose(1, 2)
        if params.get("softcap") is not None:
            s = params["softcap"] * torch.tanh(s / params["softcap"])
        nq, nk = s.shape[1], s.shape[2]
        i, j = torch.arange(nq)[:, None], torch.arange(nk)[None, :]
        seen = torch.ones(nq, nk, dtype=torch.bool)
        if params.get("causal"):
            seen &= j <= i + nk - nq
        if params.get("sliding_window") is not None:
            seen &= j > i + nk - nq - params["sliding_window"]
        # p from the reference's lse: 0 where key j is hidden from query i, and in a row that sees nothing
        p = torch.where(seen & torch.isfinite(lse), torch.exp(s - lse.nan_to_num(neginf=0.0)), torch.zeros_like(s))
        m = p * (doa @ vs.abs().transpose(1, 2) + (doa * oa).sum(-1, keepdim=True))

        def per_kv(x):  # [Hq, nk, D] -> [nk, Hkv, D]
            return x.reshape(hkv, grp, *x.shape[1:]).sum(1).transpose(0, 1)

        mags["v"][b] += per_kv(p.transpose(1, 2) @ doa)
        mags["k"][b] += per_kv(sc * m.transpose(1, 2) @ qa)
        mags["q"][a] += (sc * m @ ks.abs()).transpose(0, 1)
    return mags


def scale(op_name: str, params: dict, inputs: dict) -> dict:
    """What each element's error is measured against (:func:`family_references.scales`): for a
    rotated element, ``|a| + |c|`` of its pair (times the amplitude's size, at least 1: YaRN's
    attn_factor may be negative, and -3 left an fp16 q 0.0077 off at a scale of 1), not its own
    value. The op rounds the normalised q and k to qkv's dtype before rotating them, as the unfused
    chain stores them, so a rotation that cancels (``a cos - c sin`` small) carries the rounding of
    ``a`` and ``c``: up to ``2^-9 (|a| + |c|)``, 0.02-0.08 against a value of 0.1-0.3 (seen in bf16:
    one element in 65,536 off the value's own tolerance in 8 of 10 runs).

    ``AttnFwdOp``'s output is a convex combination of v's rows: each rounding the op makes (the CUDA
    kernel's P rounded to the dtype before P V, the output's own) is relative to ``sum_j p_j |v_j|``,
    not to the output, which cancels towards 0 when v's signs mix."""
    if op_name == "AttnFwdOp":
        return {"out": attention(params, inputs)["scale"]}
    if op_name == "PagedAttnDecodeFwdOp":
        return {"out": paged_decode(params, inputs)[1]}
    return _chain(op_name, params, inputs)[1]


def attention_grads(params: dict, inputs: dict, dout: torch.Tensor) -> dict:
    """The gradients ``dq``, ``dk``, ``dv`` (float64, shaped as q, k, v) of ``sum(out * dout)``: float64
    autograd through :func:`attention`, the definition itself (for ``AttnFwdOp``'s backward)."""
    leaves = {n: inputs[n].detach().cpu().double().requires_grad_(True) for n in ("q", "k", "v")}
    with torch.enable_grad():
        out = attention(params, {**inputs, **leaves}, differentiable=True)["out"]
        got = torch.autograd.grad(out, [leaves[n] for n in ("q", "k", "v")], dout.detach().cpu().double(),
                                  allow_unused=True)
    return {f"d{n}": torch.zeros_like(leaves[n]) if g is None else g for n, g in zip(("q", "k", "v"), got)}


def attention(params: dict, inputs: dict, differentiable: bool = False) -> dict:
    """``AttnFwdOp`` in float64 from its definition, one sequence and one q head at a time (the scores
    of a whole sequence as a matrix: the generated CUDA tests run the cases at their full size):
    ``out``, ``lse`` (natural log, -inf for a row that sees no key), ``scale`` (``sum_j p_j |v_j|`` per
    element, the magnitude its roundings act on) and ``smax`` (the largest ``|s|`` of a visible scaled
    score, which the fp32 exp's error grows with). ``differentiable``: q, k, v are float64 CPU tensors
    taken as they are (leaves of the caller's graph), so that ``out`` is differentiable in them."""
    hq, hkv, d = params["num_q_heads"], params["num_kv_heads"], params["head_dim"]
    scale = params.get("softmax_scale") or 1.0 / d ** 0.5
    cap, w, causal = params.get("softcap"), params.get("sliding_window"), params.get("causal", False)
    q, k, v = (inputs[n] if differentiable else inputs[n].detach().cpu().double() for n in ("q", "k", "v"))
    dense = q.dim() == 4
    if dense:  # sequence b is row block b
        spans = [(b, (0, q.shape[1]), (0, k.shape[1])) for b in range(q.shape[0])]
    else:
        cq, ck = inputs["cu_seqlens_q"].tolist(), inputs["cu_seqlens_k"].tolist()
        spans = [(None, (cq[b], cq[b + 1]), (ck[b], ck[b + 1])) for b in range(len(cq) - 1)]
    out = torch.zeros(q.shape, dtype=torch.float64)
    err = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((q.shape[0], hq, q.shape[1]) if dense else (hq, q.shape[0]), float("-inf"), dtype=torch.float64)
    smax = 0.0
    for b, (q0, q1), (k0, k1) in spans:
        qs = q[b, q0:q1] if dense else q[q0:q1]  # [nq, Hq, D]
        ks, vs = (k[b, k0:k1], v[b, k0:k1]) if dense else (k[k0:k1], v[k0:k1])
        nq, nk = q1 - q0, k1 - k0
        if nq == 0 or nk == 0:  # no rows, or rows that see nothing: zeros and -inf, as initialised
            continue
        i = torch.arange(nq)[:, None]
        j = torch.arange(nk)[None, :]
        seen = torch.ones(nq, nk, dtype=torch.bool)
        if causal:
            seen &= j <= i + nk - nq
        if w is not None:
            seen &= j > i + nk - nq - w
        some = seen.any(-1)  # rows that see at least one key
        for h in range(hq):
            g = h // (hq // hkv)
            s = (qs[:, h] @ ks[:, g].T) * scale  # [nq, nk]
            if cap is not None:
                s = cap * torch.tanh(s / cap)
            if bool(seen.any()):
                smax = max(smax, float(s.detach()[seen].abs().max()))
            s = s.masked_fill(~seen, float("-inf"))
            m = torch.where(some, s.max(-1).values, torch.zeros(nq, dtype=torch.float64))
            e = torch.exp(s - m[:, None])  # exp(-inf) = 0 where hidden
            total = e.sum(-1)
            p = e / torch.where(some, total, torch.ones_like(total))[:, None]
            vg = vs[:, g]
            bad = vg.isnan()
            if bool(bad.any()):  # a NaN value reaches the rows that see its key (p * NaN), never the others
                vg = vg.masked_fill(bad, 0.0)
                hit = (seen.to(torch.float64) @ bad.to(torch.float64)) > 0  # [nq, D]: a row sees a NaN there
                row, mag = (p @ vg).masked_fill(hit, float("nan")), p @ vg.abs()
            else:
                row, mag = p @ vg, p @ vg.abs()
            ls = torch.where(some, m + torch.log(torch.where(some, total, torch.ones_like(total))),
                             torch.full_like(total, float("-inf")))
            if dense:
                out[b, :, h], err[b, :, h], lse[b, h] = row, mag, ls
            else:
                out[q0:q1, h], err[q0:q1, h], lse[h, q0:q1] = row, mag, ls
    return {"out": out, "lse": lse, "scale": err, "smax": smax}


def _chain(op_name: str, params: dict, inputs: dict) -> tuple[dict, dict]:
    if op_name != "AttnPrologueFwdOp":
        raise KeyError(op_name)
    hq, hkv, d, eps = params["num_q_heads"], params["num_kv_heads"], params["head_dim"], params.get("eps", 1e-6)
    qkv = inputs["qkv"].double()
    x = qkv.reshape(qkv.shape[0], hq + 2 * hkv, d)
    q, k, v = x[:, :hq], x[:, hq:hq + hkv], x[:, hq + hkv:]
    if params.get("qk_norm"):
        q = q / torch.sqrt((q * q).mean(-1, keepdim=True) + eps) * inputs["q_norm_weight"].double()
        k = k / torch.sqrt((k * k).mean(-1, keepdim=True) + eps) * inputs["k_norm_weight"].double()
    rope = params["rope"]
    p = rope_params(rope.name, rope.params)
    rot = d if p.get("rotary_dim") is None else p["rotary_dim"]
    inv, amp = rope_references.inv_freq_and_amplitude(rope.name, p, rot)
    pairing = "interleaved" if p.get("rope_layout") == "interleaved" else "neox"
    h = rot // 2
    first, second = (slice(0, h), slice(h, rot)) if pairing == "neox" else (slice(0, rot, 2), slice(1, rot, 2))

    def pair_magnitude(t):
        m = t.abs()
        s = (t[..., first].abs() + t[..., second].abs()) * max(1.0, abs(amp))
        m[..., first], m[..., second] = s, s
        return m

    q_mag, k_mag = pair_magnitude(q), pair_magnitude(k)
    positions = inputs["positions"]
    if positions.dim() == 2:  # MRoPE [3, tokens]: pair j turns by its stream's position
        streams = rope_references.mrope_pair_streams(p["mrope_section"], p["mrope_interleaved"], rot // 2)
        q, k = (_rotate_by(t, (positions.double().T[:, streams] * inv)[:, None, :], amp, rot) for t in (q, k))
    else:
        pos = positions.view(-1, 1)
        q = rope_references.rotate(q, pos, inv, amp, pairing)
        k = rope_references.rotate(k, pos, inv, amp, pairing)
    if params.get("cache_dtype") == "float8_e4m3fn":  # stored over the per-tensor scales, saturated
        ks, vs = inputs["k_scale"].double().reshape(()), inputs["v_scale"].double().reshape(())
        k, k_mag = (k / ks).clamp(-448.0, 448.0), k_mag / ks.abs()
        v = (v / vs).clamp(-448.0, 448.0)
    kc, vc = inputs["key_cache"].double().clone(), inputs["value_cache"].double().clone()
    kc_mag, vc_mag = kc.abs(), vc.abs()
    nhd = params.get("cache_layout", "NHD") == "NHD"
    bs = kc.shape[1] if nhd else kc.shape[2]
    for t, s in enumerate(inputs["slot_mapping"].tolist()):
        if 0 <= s < kc.shape[0] * bs:
            blk, row = divmod(s, bs)
            at = (blk, row) if nhd else (blk, slice(None), row)
            kc[at], vc[at], kc_mag[at], vc_mag[at] = k[t], v[t], k_mag[t], v[t].abs()
    return ({"q_out": q, "key_cache": kc, "value_cache": vc},
            {"q_out": q_mag, "key_cache": kc_mag, "value_cache": vc_mag})


def _rotate_by(x: torch.Tensor, angle: torch.Tensor, amp: float, rot: int) -> torch.Tensor:
    """MRoPE's neox rotation of the first ``rot`` columns by per-pair angles ``[tokens, 1, rot/2]``."""
    out, h = x.clone(), rot // 2
    a, c = x[..., :h], x[..., h:rot]
    out[..., :h] = (a * angle.cos() - c * angle.sin()) * amp
    out[..., h:rot] = (c * angle.cos() + a * angle.sin()) * amp
    return out


def paged_decode(params: dict, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``PagedAttnDecodeFwdOp`` in float64 from its definition: ``(out, sum_j p_j |v_j|)``, both ``[batch,
    Hq, D]``. Sequence b's token j is row ``j % block_size`` of block ``block_tables[b, j // block_size]``
    (an entry outside the cache is skipped and a length clamped into the table: the op's documented
    answer to a value it reports); the window keeps the keys ``j >= L - w``; a float8 cache's values
    times the scale."""
    hq, hkv, d = params["num_q_heads"], params["num_kv_heads"], params["head_dim"]
    sc = params.get("softmax_scale") or d ** -0.5
    cap, w = params.get("softcap"), params.get("sliding_window")
    q = inputs["q"].detach().cpu().double()
    kc, vc = (inputs[n].detach().cpu().float().double() for n in ("key_cache", "value_cache"))
    if params.get("cache_dtype") == "float8_e4m3fn":
        kc = kc * float(inputs["k_scale"].reshape(()))
        vc = vc * float(inputs["v_scale"].reshape(()))
    if params.get("cache_layout", "NHD") == "HND":
        kc, vc = kc.transpose(1, 2), vc.transpose(1, 2)
    bt, lens = inputs["block_tables"].cpu(), inputs["seq_lens"].cpu()
    blocks, bs = kc.shape[0], kc.shape[1]
    out, mag = torch.zeros_like(q), torch.zeros_like(q)
    for b in range(q.shape[0]):
        n = min(max(int(lens[b]), 0), bt.shape[1] * bs)
        lo = max(n - w, 0) if w else 0
        pairs = [(int(bt[b, j // bs]), j % bs) for j in range(lo, n)]
        pairs = [(k, r) for k, r in pairs if 0 <= k < blocks]
        if not pairs:
            continue
        keys = torch.stack([kc[k, r] for k, r in pairs])
        vals = torch.stack([vc[k, r] for k, r in pairs])
        for h in range(hq):
            g = h // (hq // hkv)
            s = keys[:, g] @ q[b, h] * sc
            if cap:
                s = cap * torch.tanh(s / cap)
            pr = torch.softmax(s, 0)
            out[b, h], mag[b, h] = pr @ vals[:, g], pr @ vals[:, g].abs()
    return out, mag
