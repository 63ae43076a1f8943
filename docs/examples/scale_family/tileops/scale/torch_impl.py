"""The ``"torch"`` target's scale: plain PyTorch, fp32 arithmetic, one rounding at the end."""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["implement"]


def implement(op: Any, spec: Any) -> Callable[..., torch.Tensor]:
    def run(x: torch.Tensor) -> torch.Tensor:
        return (x.float() * op.factor).to(x.dtype)

    return run
