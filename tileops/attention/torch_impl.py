"""The ``"torch"`` target's attention prologue: the unfused chain in plain PyTorch, any device.

Norm as the norm family's ``torch`` target computes it (fp32, ``llama`` rounding, stored in qkv's
dtype), the rotation in fp32 with cos/sin from the rope op's own float64 frequencies (its
``deployment_tables``), the cache write by index (a float8 cache's ``x / scale``, saturated). Bad
positions and slots are checked on the host here (this target is the plain reference path, not the
fused one). Several launches, as the unfused chain is; used only when named (``target="torch"``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["implement"]


def implement(op: Any, spec: Any) -> Callable[..., Any]:
    if op.name == "AttnFwdOp":
        return _attention(op)
    if op.name == "PagedAttnDecodeFwdOp":
        return _decode(op)
    p = op.params
    hq, hkv, d, eps = p["num_q_heads"], p["num_kv_heads"], p["head_dim"], p["eps"]
    rope = p["rope"]
    if "mrope_section" in rope.kernel_fields("int64") or rope.pairing != "neox":
        raise NotImplementedError(f"{op.name}: rope: the torch target rotates neox pairs at one position stream; "
                                  f"{rope.name} with pairing {rope.pairing!r} is not written for it")
    rot = rope.rotated_width(d)
    tables = rope.deployment_tables(rot)
    limit = op.position_limit()

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        f = x.float()
        n = (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype).float()
        return (n * w.float()).to(x.dtype)

    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        f = x.float()
        a, b = f[..., : rot // 2], f[..., rot // 2: rot]
        out = f.clone()
        out[..., : rot // 2] = a * cos - b * sin
        out[..., rot // 2: rot] = b * cos + a * sin
        return out.to(x.dtype)

    def run(qkv: torch.Tensor, positions: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            slot_mapping: torch.Tensor, q_norm_weight: torch.Tensor | None = None,
            k_norm_weight: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
            v_scale: torch.Tensor | None = None) -> torch.Tensor:
        t = qkv.shape[0]
        x = qkv.reshape(t, hq + 2 * hkv, d)
        q, k, v = x[:, :hq], x[:, hq:hq + hkv], x[:, hq + hkv:]
        if p["qk_norm"]:
            q, k = norm(q, q_norm_weight), norm(k, k_norm_weight)
        bad = ((positions < 0) | (positions >= limit)).nonzero()
        if bad.shape[0]:
            op._raise_bad_value("positions", positions.cpu())
        ang = positions.to(torch.float64)[:, None] * tables.inv_freq.to(qkv.device)
        cos = (ang.cos() * tables.amplitude).float()[:, None, :]
        sin = (ang.sin() * tables.amplitude).float()[:, None, :]
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if p["cache_dtype"] == "float8_e4m3fn":  # x / scale in fp32, saturated at 448 as vLLM stores it
            k, v = ((t.float() / s.float().reshape(())).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
                    for t, s in ((k, k_scale), (v, v_scale)))
        if p["cache_layout"] == "NHD":
            blocks, bs = key_cache.shape[0], key_cache.shape[1]
        else:
            blocks, bs = key_cache.shape[0], key_cache.shape[2]
        slots = slot_mapping.to(torch.int64)
        op.note_slot_limit(blocks * bs)
        if bool((slots >= blocks * bs).any()):
            op._raise_bad_value("slot_mapping", slot_mapping.cpu())
        for i in range(t):  # in token order: a slot named twice keeps the later token's row
            s = int(slots[i])
            if s < 0:
                continue
            blk, row = divmod(s, bs)
            if p["cache_layout"] == "NHD":
                key_cache[blk, row], value_cache[blk, row] = k[i], v[i]
            else:
                key_cache[blk, :, row], value_cache[blk, :, row] = k[i], v[i]
        return q.contiguous()

    return run


def _attention(op: Any) -> Callable[..., Any]:
    """``AttnFwdOp`` in plain PyTorch: scores in fp32 per sequence, the masks as the op defines them
    (bottom-right causal, the window), softcap, a row with no visible key zeros (lse -inf). One
    sequence at a time for varlen (offsets read on the host: this target is the plain path)."""
    p = op.params
    hq, hkv, d = p["num_q_heads"], p["num_kv_heads"], p["head_dim"]
    scale = p["softmax_scale"] if p["softmax_scale"] is not None else d ** -0.5
    cap, w, causal = p["softcap"], p["sliding_window"], p["causal"]

    def one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q [Sq, Hq, D], k/v [Sk, Hkv, D] -> out [Sq, Hq, D] (fp32), lse [Hq, Sq]
        g = hq // hkv
        kf = k.float().repeat_interleave(g, 1)
        vf = v.float().repeat_interleave(g, 1)
        s = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
        if cap is not None:
            s = cap * torch.tanh(s / cap)
        sq, sk = q.shape[0], k.shape[0]
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        seen = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
        if causal:
            seen &= j <= i + sk - sq
        if w is not None:
            seen &= j > i + sk - sq - w
        s = s.masked_fill(~seen, float("-inf"))
        lse = torch.logsumexp(s, -1)
        # a row that sees no key (lse -inf) gets zeros; a NaN stays NaN (a nan_to_num here once gave a
        # NaN input's row zeros, a plausible answer where the kernels give NaN)
        pr = torch.where(torch.isneginf(lse)[..., None], 0.0, torch.exp(s - lse[..., None]))
        return torch.einsum("hqk,khd->qhd", pr, vf), lse

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor | None = None,
            cu_seqlens_k: torch.Tensor | None = None, return_lse: bool = False) -> Any:
        if q.dim() == 4:
            got = [one(q[b], k[b], v[b]) for b in range(q.shape[0])]
            out = torch.stack([o for o, _ in got]) if got else torch.empty(q.shape, device=q.device)
            lse = torch.stack([x for _, x in got]) if got else torch.empty(0, hq, q.shape[1], device=q.device)
        else:
            cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
            op.__dict__["_totals"] = {"cu_seqlens_q": q.shape[0], "cu_seqlens_k": k.shape[0]}
            if cq[0] != 0 or cq[-1] != q.shape[0] or any(b < a for a, b in zip(cq, cq[1:])):
                op._raise_bad_value("cu_seqlens_q", cu_seqlens_q.cpu())
            if ck[0] != 0 or ck[-1] != k.shape[0] or any(b < a for a, b in zip(ck, ck[1:])):
                op._raise_bad_value("cu_seqlens_k", cu_seqlens_k.cpu())
            out = torch.zeros(q.shape, device=q.device)
            lse = torch.full((hq, q.shape[0]), float("-inf"), device=q.device)
            for b in range(len(cq) - 1):
                o, x = one(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]])
                out[cq[b]:cq[b + 1]], lse[:, cq[b]:cq[b + 1]] = o, x
        out = out.to(q.dtype)
        if out.numel() == 0 and torch.is_grad_enabled() and not out.requires_grad:
            # no query row (batch 0, or every sequence empty): the output still hangs on the inputs
            # that take gradients, which come back zero-size or zero, as the kernels' do (a bare empty
            # tensor has no grad_fn, which the op's autograd refuses). Nothing is added to a value
            live = [t.float().sum() * 0 for t in (q, k, v) if t.requires_grad]
            if live:
                out = out + sum(live).to(out.dtype)
        return (out, lse.float()) if return_lse else out

    return run


def _decode(op: Any) -> Callable[..., Any]:
    """``PagedAttnDecodeFwdOp`` in plain PyTorch: each sequence's keys gathered through its block table
    (read on the host: this target is the plain path, and checks the tables and lengths there), scores
    and softmax in fp32, a float8 cache times its scale."""
    p = op.params
    hq, hkv, d = p["num_q_heads"], p["num_kv_heads"], p["head_dim"]
    scale = p["softmax_scale"] if p["softmax_scale"] is not None else d ** -0.5
    cap, w = p["softcap"], p["sliding_window"]

    def run(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
            seq_lens: torch.Tensor, k_scale: torch.Tensor | None = None,
            v_scale: torch.Tensor | None = None) -> torch.Tensor:
        kc, vc = key_cache.float(), value_cache.float()
        if k_scale is not None:
            kc, vc = kc * k_scale.float().reshape(()), vc * v_scale.float().reshape(())
        if p["cache_layout"] == "HND":
            kc, vc = kc.transpose(1, 2), vc.transpose(1, 2)
        blocks, bs = kc.shape[0], kc.shape[1]
        limit = block_tables.shape[1] * bs
        op.note_decode_limits(blocks, limit)
        lens = seq_lens.tolist()
        if any(n < 0 or n > limit for n in lens):
            op._raise_bad_value("seq_lens", seq_lens.cpu())
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        for b, n in enumerate(lens):
            lo = max(n - w, 0) if w else 0
            if n <= lo:
                continue
            j = torch.arange(lo, n, device=q.device)
            pages = block_tables[b].to(q.device).long()[j // bs]
            if bool(((pages < 0) | (pages >= blocks)).any()):
                op._raise_bad_value("block_tables", None, found=_first_bad(block_tables, b, j // bs, blocks))
            k, v = kc[pages, j % bs], vc[pages, j % bs]  # [n, Hkv, D]
            g = hq // hkv
            s = torch.einsum("hd,nhd->hn", q[b].float(), k.repeat_interleave(g, 1)) * scale
            if cap is not None:
                s = cap * torch.tanh(s / cap)
            out[b] = torch.einsum("hn,nhd->hd", torch.softmax(s, -1), v.repeat_interleave(g, 1))
        return out.to(q.dtype)

    return run


def _first_bad(tables: torch.Tensor, b: int, idx: torch.Tensor, blocks: int) -> Any:
    """The first entry of row ``b`` at ``idx`` outside ``[0, blocks)``, as the kernels' record names it."""
    from ..runtime.errors import BadValue

    row = tables[b].cpu().long()
    for i in idx.cpu().tolist():
        if not 0 <= int(row[i]) < blocks:
            return BadValue((b, i), int(row[i]))
    return None
