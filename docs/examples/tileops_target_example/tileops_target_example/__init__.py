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
        checked against the op's manifest; the op itself handles ``out=``. The output must be
        differentiable in ``x`` when it requires grad: plain PyTorch ops are, and the op refuses an
        output without a ``grad_fn``.
        """
        rot = op.rotated_width(spec.dim("head_dim"))  # the columns that rotate
        # float64 [rot // 2] inverse frequencies and the factor on cos and sin; most ops have one
        # such set, Phi3LongRoPEFwdOp two, of which choose_table picks one per call
        choices = op.table_choices(rot)
        # RoPEDynamicNTKFwdOp's frequencies follow the longest sequence seen so far (HF's dynamic NTK):
        # the op keeps that length and gives each call its frequencies
        dynamic = getattr(op, "dynamic_inv_freq", None)
        seq_axis = {"1d": 0, "2d": 1, "bhsd": 2, "ids": 0}[op.layout]
        limit = op.position_limit()
        half = rot // 2

        def cos_sin(x: torch.Tensor, position_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
            given = position_ids is not None
            pos = position_ids if given else torch.arange(x.shape[seq_axis], device=x.device)
            if given and bool(((pos < 0) | (pos >= limit)).any()):
                op._raise_bad_position(pos)  # the op's own error, naming the first bad position
            if dynamic is not None:
                angle, amplitude = pos.to(torch.float64)[..., None] * dynamic(position_ids, pos.shape[-1], rot,
                                                                               x.device), 1.0
            else:
                inv_freq, amplitude = choices[int(op.choose_table(position_ids, pos.shape[-1]))]
                # [(batch,) rows, rot // 2]; MRoPE's angles take each pair's position from its stream of [3, ...]
                angle = op.angles(pos, inv_freq.to(x.device), given)
            cos, sin = (angle.cos() * amplitude).float(), (angle.sin() * amplitude).float()
            if op.layout == "2d":  # x: [batch, seq_len, num_heads, head_dim]
                return cos[..., None, :], sin[..., None, :]
            if op.layout == "bhsd":  # x: [batch, num_heads, seq_len, head_dim]
                return cos.unsqueeze(-3), sin.unsqueeze(-3)
            if op.layout == "ids":  # x: [tokens, heads, head_dim]
                return cos[:, None, :], sin[:, None, :]
            return cos, sin  # "1d": x [seq_len, head_dim]

        def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            xf = x.float()
            out = xf.clone()
            if op.pairing == "neox":  # pairs (i, i + rot/2)
                a, b = xf[..., :half], xf[..., half:rot]
                out[..., :half], out[..., half:rot] = a * cos - b * sin, b * cos + a * sin
            else:  # interleaved: pairs (2i, 2i + 1)
                a, b = xf[..., 0:rot:2], xf[..., 1:rot:2]
                out[..., 0:rot:2], out[..., 1:rot:2] = a * cos - b * sin, b * cos + a * sin
            return out.to(x.dtype)

        def run(x: torch.Tensor, position_ids: torch.Tensor | None = None, key: torch.Tensor | None = None):
            cos, sin = cos_sin(x, position_ids)
            if key is None:
                return rotate(x, cos, sin)
            return rotate(x, cos, sin), rotate(key, cos, sin)  # (out, key_out)

        return run
