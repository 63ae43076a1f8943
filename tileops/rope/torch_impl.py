"""The ``"torch"`` target's RoPE: plain PyTorch on any device.

fp32 arithmetic on cos/sin evaluated from float64 angles and rounded once, like the BUILTIN
kernels; no TileLang. Useful as a portable fallback and to compare targets.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["implement"]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int, pairing: str) -> torch.Tensor:
    xf = x.float()
    out = xf.clone()
    if pairing == "neox":
        a, b = xf[..., : rot // 2], xf[..., rot // 2 : rot]
        out[..., : rot // 2] = a * cos - b * sin
        out[..., rot // 2 : rot] = b * cos + a * sin
    else:
        a, b = xf[..., 0:rot:2], xf[..., 1:rot:2]
        out[..., 0:rot:2] = a * cos - b * sin
        out[..., 1:rot:2] = b * cos + a * sin
    return out.to(x.dtype)


def implement(op: Any, spec: Any) -> Callable[..., torch.Tensor]:
    rot = op.rotated_width(spec.dim("head_dim"))
    inv_freq, amplitude = op.frequencies(rot)
    inv_freq = inv_freq.to(spec.device) if spec.device.type != "mps" else inv_freq

    def cos_sin(pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angle = pos.to(device=inv_freq.device, dtype=torch.float64)[:, None] * inv_freq
        c = (angle.cos() * amplitude).float().to(spec.device)
        s = (angle.sin() * amplitude).float().to(spec.device)
        return c, s

    if op.layout == "ids":
        max_position = op.params["max_position"]

        def run_ids(x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
            bad = (position_ids < 0) | (position_ids >= max_position)
            if bool(bad.any()):
                op._raise_bad_position(position_ids)
            c, s = cos_sin(position_ids)
            return _rotate(x, c[:, None, :], s[:, None, :], rot, op.pairing)

        return run_ids

    def run(x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[0] if op.layout == "1d" else x.shape[1]
        c, s = cos_sin(torch.arange(seq))
        if op.layout == "2d":
            c, s = c[None, :, None, :], s[None, :, None, :]
        return _rotate(x, c, s, rot, op.pairing)

    return run
