"""A float64 evaluation of a norm op, for ``tileops demo`` (the tests have their own, in ``tests/``)."""

from __future__ import annotations

from typing import Any, Mapping

import torch

__all__ = ["reference"]


def reference(op: Any, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The op's first output, ``out``, in float64 on the CPU."""
    def f64(name: str) -> torch.Tensor | None:
        t = inputs.get(name)
        return None if t is None else t.detach().cpu().to(torch.float64)

    x, w, b, r = f64("x"), f64("weight"), f64("bias"), f64("residual")
    h = x if r is None else x + r
    if op.norm == "layer":
        h = h - h.mean(-1, keepdim=True)
    y = h / torch.sqrt((h * h).mean(-1, keepdim=True) + op.params["eps"])
    if w is not None:
        y = y * (op.params.get("offset", 0.0) + w)
    return y if b is None else y + b
