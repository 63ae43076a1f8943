"""A float64 evaluation of a scale op, for ``tileops demo`` (the tests have their own, in ``tests/``)."""

from __future__ import annotations

from typing import Any, Mapping

import torch

__all__ = ["reference"]


def reference(op: Any, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return inputs["x"].detach().cpu().to(torch.float64) * op.factor
