"""The ``"torch"`` target's RoPE: plain PyTorch on any device.

fp32 arithmetic on cos/sin evaluated from float64 angles and rounded once, like the BUILTIN
kernels; no TileLang. Useful as a portable fallback and to compare targets. Ordinary PyTorch ops,
so autograd differentiates it as it is.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .hooks import SEQ_AXIS

__all__ = ["implement"]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int, pairing: str) -> torch.Tensor:
    xf = x.float()
    if pairing == "neox":
        a, b = xf[..., : rot // 2], xf[..., rot // 2 : rot]
        parts = [a * cos - b * sin, b * cos + a * sin]
    else:
        a, b = xf[..., 0:rot:2], xf[..., 1:rot:2]
        parts = [torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)]
    return torch.cat([*parts, xf[..., rot:]], dim=-1).to(x.dtype)


def implement(op: Any, spec: Any) -> Callable[..., torch.Tensor]:
    rot = op.rotated_width(spec.dim("head_dim"))
    choices = [(inv.to(torch.float64), float(amp)) for inv, amp in op.table_choices(rot)]
    limit = op.position_limit()
    host = spec.device.type == "mps"  # no float64 there: evaluate the angles on the host

    def cos_sin(pos: torch.Tensor, choice: Any, given: bool) -> tuple[torch.Tensor, torch.Tensor]:
        dev = torch.device("cpu") if host else spec.device
        out = []
        for inv, amp in choices:
            angle = op.angles(pos.to(device=dev), inv.to(dev), given)
            out.append(torch.stack([angle.cos() * amp, angle.sin() * amp]))
        cs = out[0] if len(out) == 1 else torch.stack(out)[torch.as_tensor(choice, device=dev)]
        cs = cs.float().to(spec.device)
        return cs[0], cs[1]

    def run(x: torch.Tensor, position_ids: torch.Tensor | None = None, key: torch.Tensor | None = None) -> Any:
        if op.layout == "ids" or position_ids is not None:
            bad = (position_ids < 0) | (position_ids >= limit)
            if bool(bad.any()):
                op._raise_bad_position(position_ids)
            pos = position_ids
        else:
            pos = torch.arange(x.shape[SEQ_AXIS[op.layout]], device=x.device)
        dynamic = getattr(op, "dynamic_inv_freq", None)
        if dynamic is not None:  # this call's frequencies, from the op's state on the device
            angle = pos.to(torch.float64)[..., None] * dynamic(position_ids, pos.shape[-1], rot, x.device)
            c, s = angle.cos().float(), angle.sin().float()
        else:
            c, s = cos_sin(pos, op.choose_table(position_ids, pos.shape[-1]), position_ids is not None)
        if op.layout == "ids":
            c, s = c[:, None, :], s[:, None, :]  # [tokens, 1, R/2] against [tokens, heads, D]
        elif op.layout == "2d":
            c, s = c[..., None, :], s[..., None, :]  # [(batch,) seq, 1, R/2]
        elif op.layout == "bhsd":
            c, s = c.unsqueeze(-3), s.unsqueeze(-3)  # [(batch,) 1, seq, R/2]
        out = _rotate(x, c, s, rot, op.pairing)
        return out if key is None else (out, _rotate(key, c, s, rot, op.pairing))

    return run
