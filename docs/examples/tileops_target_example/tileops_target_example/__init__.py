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

        The op caches what this returns and calls it with the op's inputs as keywords: ``x``,
        ``position_ids`` (None when the caller gave none, except for the position-ids op) and
        ``key`` (None, or a second tensor to rotate the same way: then return both), already
        checked against the op's manifest; the op itself handles ``out=``. The output must be differentiable in ``x`` when it
        requires grad: plain PyTorch ops are, and the op refuses an output without a ``grad_fn``.
        """
        rot = op.rotated_width(spec.dim("head_dim"))  # the columns that rotate
        # float64 [rot // 2] inverse frequencies and the factor on cos and sin; most ops have one
        # such set, Phi3LongRoPEFwdOp two, of which choose_table picks one per call
        choices = op.table_choices(rot)
        half = rot // 2

        def rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            inv_freq, amplitude = choices[int(op.choose_table(positions, positions.shape[-1]))]
            angle = positions.to(torch.float64)[..., None] * inv_freq.to(x.device)  # [(batch,) rows, rot // 2]
            cos, sin = (angle.cos() * amplitude).float(), (angle.sin() * amplitude).float()
            if op.layout == "2d":  # x: [batch, seq_len, num_heads, head_dim]; positions [seq] or [batch, seq]
                cos, sin = cos[..., None, :], sin[..., None, :]
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

            def run_ids(x: torch.Tensor, position_ids: torch.Tensor, key: torch.Tensor | None = None):
                if bool(((position_ids < 0) | (position_ids >= max_position)).any()):
                    raise ValueError(f"{op.name}: position_ids: expected every value in [0, {max_position})")
                if key is None:
                    return rotate(x, position_ids)
                return rotate(x, position_ids), rotate(key, position_ids)

            return run_ids

        seq_axis = 0 if op.layout == "1d" else 1
        limit = op.position_limit()

        def run(x: torch.Tensor, position_ids: torch.Tensor | None = None, key: torch.Tensor | None = None):
            if position_ids is None:
                position_ids = torch.arange(x.shape[seq_axis], device=x.device)
            elif bool(((position_ids < 0) | (position_ids >= limit)).any()):
                op._raise_bad_position(position_ids)
            if key is None:
                return rotate(x, position_ids)
            return rotate(x, position_ids), rotate(key, position_ids)  # (out, key_out)

        return run
