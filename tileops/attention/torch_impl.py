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
