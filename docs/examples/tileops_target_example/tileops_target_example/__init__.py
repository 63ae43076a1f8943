"""An example tileops target: the RoPE family in plain PyTorch, registered through an entry point.

Once the package is installed, ``tileops.target_names()`` lists ``"example"`` and any RoPE op built
with ``target="example"`` runs here.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from tileops.targets import Target

__all__ = ["ExampleTarget"]


class ExampleTarget(Target):
    name = "example"
    description = "the RoPE family in plain PyTorch (the tileops_target_example package)"

    def claims(self, device: torch.device) -> bool:
        # True would make this target serve ops built with target=None on `device`.
        return False

    def supports(self, op_name: str, family: str, device: torch.device) -> bool:
        return family == "rope"

    def implement(self, op: Any, spec: Any) -> Callable[..., torch.Tensor]:
        """The function serving one specialization of ``op``: its device, dtypes and dims.

        The op caches what this returns and calls it with the op's inputs as keywords: ``x`` (and
        ``position_ids`` for the position-ids op), already checked against the op's manifest.
        """
        rot = op.rotated_width(spec.dim("head_dim"))  # the columns that rotate
        inv_freq, amplitude = op.frequencies(rot)  # float64 [rot // 2]; the factor on cos and sin
        inv_freq = inv_freq.to(spec.device)
        half = rot // 2

        def rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            angle = positions.to(torch.float64)[:, None] * inv_freq  # [rows, rot // 2]
            cos, sin = (angle.cos() * amplitude).float(), (angle.sin() * amplitude).float()
            if op.layout == "2d":  # x: [batch, seq_len, num_heads, head_dim]
                cos, sin = cos[None, :, None, :], sin[None, :, None, :]
            elif op.layout == "ids":  # x: [tokens, heads, head_dim]
                cos, sin = cos[:, None, :], sin[:, None, :]
            xf = x.float()
            out = xf.clone()
            if op.pairing == "neox":  # pairs (i, i + rot/2)
                a, b = xf[..., :half], xf[..., half:rot]
                out[..., :half], out[..., half:rot] = a * cos - b * sin, b * cos + a * sin
            else:  # interleaved: pairs (2i, 2i + 1)
                a, b = xf[..., 0:rot:2], xf[..., 1:rot:2]
                out[..., 0:rot:2], out[..., 1:rot:2] = a * cos - b * sin, b * cos + a * sin
            return out.to(x.dtype)

        if op.layout == "ids":
            max_position = op.params["max_position"]

            def run_ids(x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
                if bool(((position_ids < 0) | (position_ids >= max_position)).any()):
                    raise ValueError(f"{op.name}: position_ids: expected every value in [0, {max_position})")
                return rotate(x, position_ids)

            return run_ids

        seq_axis = 0 if op.layout == "1d" else 1

        def run(x: torch.Tensor) -> torch.Tensor:
            return rotate(x, torch.arange(x.shape[seq_axis], device=x.device))

        return run
