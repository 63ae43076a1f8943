"""References for the norm family's kernels (``kernels/norm.py``); no code shared with them.

Two kinds:

* float64 math (``rms_norm``, ``layer_norm`` and their gradients by float64 autograd): what a
  kernel approximates, used with a tolerance;
* the Hugging Face modules as they compute, written out in torch (``hf_rms_norm``): the roundings
  a bf16/fp16 model sees, which a kernel must reproduce to the last bit on almost every element.
  ``tests/test_norm_kernels.py`` checks these against the installed ``transformers`` classes
  bit for bit, so the kernels are held to the modules themselves, not to a paraphrase.
"""

from __future__ import annotations

import torch

#: HF RMSNorm flavours: where each rounds (``transformers/models/<model>/modeling_<model>.py``)
#: llama (Llama, Mistral, Qwen2, Qwen3 incl. q_norm/k_norm, Phi-3): ``weight * n.to(input_dtype)``;
#: gemma (Gemma 1/2/3, Qwen3-Next): ``(n * (1.0 + weight.float())).type_as(x)``;
#: olmo2: ``(weight * n).to(input_dtype)``.
HF_STYLES = ("llama", "gemma", "olmo2")


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float = 0.0) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * (offset + weight)`` in float64, over the last dim."""
    x = x.double()
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * (offset + weight.double())


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` in float64 (biased variance), over the last dim."""
    x = x.double()
    c = x - x.mean(-1, keepdim=True)
    y = c / torch.sqrt((c * c).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.double()
    return y if bias is None else y + bias.double()


def grads(fn, x: torch.Tensor, dy: torch.Tensor, *params: torch.Tensor | None) -> list[torch.Tensor | None]:
    """Float64 autograd of ``fn(x, *params).sum(dy * .)``: the gradients of x and of each param
    (None where the param is None)."""
    xd = x.detach().double().requires_grad_(True)
    pd = [None if p is None else p.detach().double().requires_grad_(True) for p in params]
    y = fn(xd, *pd)
    y.backward(dy.double())
    return [xd.grad] + [None if p is None else p.grad for p in pd]


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, style: str) -> torch.Tensor:
    """The output of HF's RMSNorm module of ``style`` (:data:`HF_STYLES`) on ``x``, computed as its
    ``forward`` does, in torch, on x's device."""
    dtype = x.dtype
    h = x.to(torch.float32)
    n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if style == "llama":
        return weight * n.to(dtype)
    if style == "gemma":
        return (n * (1.0 + weight.float())).type_as(x)
    if style == "olmo2":
        return (weight * n).to(dtype)
    raise ValueError(f"style: expected one of {HF_STYLES}, got {style!r}")


def hf_module(style: str, hidden: int, eps: float):
    """The installed ``transformers`` module of ``style`` (LlamaRMSNorm, Gemma3RMSNorm, Olmo2RMSNorm),
    or None without transformers."""
    try:
        if style == "llama":
            from transformers.models.llama.modeling_llama import LlamaRMSNorm as cls
        elif style == "gemma":
            from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm as cls
        else:
            from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm as cls
    except ImportError:
        return None
    return cls(hidden, eps=eps)


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable values of their (16-bit float) dtype lie between ``a`` and ``b``,
    elementwise (the bit patterns mapped to a monotone integer line); 0 where equal, +0 = -0."""
    assert a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16)

    def line(t: torch.Tensor) -> torch.Tensor:
        i = t.view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -(i & 0x7FFF), i)

    return (line(a) - line(b)).abs()
