"""A float64 evaluation of the attention prologue's q, for ``tileops demo`` (the tests have their own,
in ``tests/``)."""

from __future__ import annotations

from typing import Any, Mapping

import torch

__all__ = ["reference"]


def reference(op: Any, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The op's q ``[tokens, Hq, D]`` in float64 on the CPU (norm, then the rope op's rotation)."""
    p = op.params
    hq, hkv, d = p["num_q_heads"], p["num_kv_heads"], p["head_dim"]
    x = inputs["qkv"].detach().cpu().to(torch.float64)
    q = x.reshape(x.shape[0], hq + 2 * hkv, d)[:, :hq]
    if p["qk_norm"]:
        w = inputs["q_norm_weight"].detach().cpu().to(torch.float64)
        q = q / torch.sqrt((q * q).mean(-1, keepdim=True) + p["eps"]) * w
    rope = p["rope"]
    rot = rope.rotated_width(d)
    tables = rope.deployment_tables(rot)
    ang = inputs["positions"].detach().cpu().to(torch.float64)[:, None] * tables.inv_freq
    c, s = (ang.cos() * tables.amplitude)[:, None, :], (ang.sin() * tables.amplitude)[:, None, :]
    out = q.clone()
    a, b = q[..., : rot // 2], q[..., rot // 2: rot]
    out[..., : rot // 2], out[..., rot // 2: rot] = a * c - b * s, b * c + a * s
    return out
