"""The float64 reference of the scale family for the generated tests: ``y = c * x``.

Written from the op's definition alone; it imports nothing from tileops or its kernels.
"""

from __future__ import annotations

import torch

DEFAULTS = {"ScaleFwdOp": {"c": 2.0}}


def reference(op_name: str, params: dict, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """float64 ``out`` of the op for those constructor params and call inputs."""
    c = {**DEFAULTS[op_name], **params}["c"]
    return inputs["x"].to(torch.float64) * c
