"""The ``"torch"`` target's norms: plain PyTorch on any device, computed as Hugging Face's modules
compute them (fp32 arithmetic; ``llama`` rounding rounds the normalised value to x's dtype before
the weight multiply). Ordinary PyTorch ops, so autograd differentiates them as they are."""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..manifest import DTYPES

__all__ = ["implement"]


def implement(op: Any, spec: Any) -> Callable[..., Any]:
    layer = op.norm == "layer"
    eps = op.params["eps"]
    out_dtype = op.params.get("out_dtype")
    rounding = op.rounding_of(op.params, spec.dtype("x"))
    offset = op.params.get("offset", 0.0)

    def run(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
            residual: torch.Tensor | None = None) -> Any:
        h = x if residual is None else x + residual  # in x's dtype, as HF's decoder layers add it
        f = h.float()
        if layer:
            f = f - f.mean(-1, keepdim=True)
        n = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)
        if rounding == "llama":
            n = n.to(x.dtype).float()  # HF: weight * n.to(input_dtype), the product exact in fp32
        if weight is not None:
            n = n * (weight.float() + offset) if offset else n * weight.float()
        if bias is not None:
            n = n + bias.float()
        y = n.to(DTYPES[out_dtype] if out_dtype else x.dtype)
        return y if residual is None else (y, h)

    return run
