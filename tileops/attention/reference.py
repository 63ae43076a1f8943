"""A float64 evaluation of the attention prologue's q, for ``tileops demo`` (the tests have their own,
in ``tests/``)."""

from __future__ import annotations

from typing import Any, Mapping

import torch

__all__ = ["reference", "scale"]


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


def scale(op: Any, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """What each element of q's error is measured against (``tileops demo``'s tolerance): ``|a| + |c|``
    of its rotation pair (times the amplitude), not its own value. The op rounds the normalised q to
    qkv's dtype before rotating it, so a rotation that cancels carries the rounding of both elements:
    measured against the element alone, one demo run in six failed in bf16 (seen here)."""
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
    """The op's q ``[tokens, Hq, D]`` in float64 on the CPU (norm, then the rope op's rotation)."""
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
