"""A float64 evaluation of a RoPE op, for ``tileops demo``.

It follows ``rope-semantics`` directly: angles and cos/sin in float64, no tables, no kernels. (The
test suite has its own references in ``tests/``, written without any of tileops' code.)
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .hooks import SEQ_AXIS

__all__ = ["reference", "grads"]


def reference(op: Any, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The op's first output, ``out`` (x rotated), in float64 on the CPU."""
    return _rotated(op, inputs["x"].detach().cpu().to(torch.float64), inputs)


def grads(op: Any, inputs: Mapping[str, torch.Tensor], grad_out: torch.Tensor) -> dict[str, torch.Tensor]:
    """The gradients of ``sum(out * grad_out)`` with respect to x (and key, which ``out`` does not read:
    zeros), by float64 autograd of the rotation above (what ``tileops tune`` checks a candidate's
    backward against: the backward is built by the same builder, with the same knobs)."""
    x = inputs["x"].detach().cpu().to(torch.float64).requires_grad_(True)
    (gx,) = torch.autograd.grad(_rotated(op, x, inputs), x, grad_out.detach().cpu().to(torch.float64))
    out = {"x": gx}
    if inputs.get("key") is not None:
        out["key"] = torch.zeros(inputs["key"].shape, dtype=torch.float64)
    return out


def _rotated(op: Any, x: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    head_dim = x.shape[-1]
    rot = op.rotated_width(head_dim)
    inv_freq, amplitude = op.frequencies(rot)
    given = inputs.get("position_ids")
    if given is not None:
        pos = given.detach().cpu().to(torch.float64)
    else:
        pos = torch.arange(x.shape[SEQ_AXIS[op.layout]], dtype=torch.float64)
    if hasattr(op, "dynamic_inv_freq"):  # dynamic NTK: the frequencies of this call's length
        from .hooks import ntk_inv_freq

        p = op.params
        seq = int(pos.max()) + 1 if pos.numel() else 0
        mpe = p["max_position_embeddings"]
        inv_freq = ntk_inv_freq(p["base"], rot, p["factor"], max(mpe, seq), mpe)
    angle = op.angles(pos, inv_freq, given is not None)  # MRoPE: each pair at its stream's position
    c, s = angle.cos() * amplitude, angle.sin() * amplitude
    if op.layout == "2d":
        c, s = (c[..., None, :], s[..., None, :]) if c.dim() == 3 else (c[None, :, None, :], s[None, :, None, :])
    elif op.layout == "bhsd":  # [(batch,) seq, R/2] against [batch, heads, seq, D]
        c, s = c.unsqueeze(-3), s.unsqueeze(-3)
    elif op.layout == "ids":
        c, s = c[:, None, :], s[:, None, :]
    out = x.clone()
    if op.pairing == "neox":
        a, b = x[..., : rot // 2], x[..., rot // 2 : rot]
        out[..., : rot // 2], out[..., rot // 2 : rot] = a * c - b * s, b * c + a * s
    else:
        a, b = x[..., 0:rot:2], x[..., 1:rot:2]
        out[..., 0:rot:2], out[..., 1:rot:2] = a * c - b * s, b * c + a * s
    return out
