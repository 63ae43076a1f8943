"""The norm ops, generated from ``manifests/norm/`` by ``tileops generate``: do not edit.

Every signature, parameter list and parameter doc here comes from an op's manifest; the behaviour
comes from the hook class it inherits (:mod:`tileops.norm.hooks`). Change a manifest, then run
``tileops generate``; a test fails while this file and the manifests disagree.
"""

from __future__ import annotations

from typing import Any

import torch

from ..targets import Target
from . import hooks

__all__ = [
    "LayerNormFwdOp", "RMSNormFwdOp",
]


class LayerNormFwdOp(hooks.LayerNormFwdHooks):
    """Layer normalisation over the last dim (weight and bias optional), with an optional fused residual add.

    ``y = (x - mean) / sqrt(var + eps) * weight + bias`` over the last dim of any leading shape, the variance
    biased (``torch.nn.LayerNorm``'s); ``weight`` and ``bias`` each optional (CohereLayerNorm has no bias).
    Arithmetic is fp32 whatever the dtypes, with one rounding at the store (the mean is subtracted before the
    variance is taken, so a large mean costs no precision). With ``residual``, ``h = x + residual`` is
    computed in x's dtype, normalised, and returned as ``residual_out`` (written over ``residual`` with
    ``residual_out=residual``).

    References: Ba, Kiros & Hinton, 2016, arXiv:1607.06450 (Layer Normalization); torch.nn.LayerNorm; HF
        transformers CohereLayerNorm.
    """

    def __init__(self, eps: float = 1e-05, *, target: str | Target | None = None) -> None:
        """Build the op; kernels are compiled at the first call.

        Args:
            eps (float): Added to the (biased) variance before the reciprocal square root (as an fp32 value,
                as torch adds it). Default ``1e-05``.
            target (str | Target | None): Which set of kernels serves this op: a registered target name,
                BUILTIN for the in-tree kernels, or None to decide from the input device at the first call.
                Default None.

        Raises:
            TypeError: A parameter has the wrong type.
            ValueError: A value outside its choices, an unknown ``target``; or, by the manifest's rules: eps:
                expected eps >= 0.
        """
        self._setup({'eps': eps}, target)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                *, residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
                residual_out: torch.Tensor | None = None) -> Any:
        """Run the op; ``op(...)`` calls this. Shapes and dtypes are taken from the first call, and inputs
        are never modified (except by ``out=`` naming an input, which takes the result in place).

        Gradients: differentiable in ``x``, ``weight``, ``bias`` and ``residual``; an output carries a
        ``grad_fn`` when an input it is computed from requires grad. The gradient of x (which is also the
        residual's) in one launch, and the weight's and bias's summed over every row on the device: fp32
        partial sums per block, then a second kernel adding them in a fixed order (the same rows give the same
        bits). Summed over every row: the gradient of ``weight`` and ``bias``. A gradient of that gradient
        (double backward) raises.

        Args:
            x (torch.Tensor): The tensor to normalise over its last dim. Shape ``[..., hidden]``; dtype
                float16, bfloat16, float32.
            weight (torch.Tensor | None): Optional. The scale, one per element of the last dim; x's dtype or
                float32. None: no scale. Shape ``[hidden]``; dtype float16, bfloat16, float32. Default None.
            bias (torch.Tensor | None): Optional. The shift, one per element of the last dim; x's dtype or
                float32. None: no shift. Shape ``[hidden]``; dtype float16, bfloat16, float32. Default None.
            residual (torch.Tensor | None): Keyword-only. Added to x (in x's dtype) before the norm; the sum
                is returned as residual_out. The shape and dtype of ``x``, exactly. Default None.
            out (torch.Tensor | None): Keyword-only. Where to write the result (the normalised tensor, in x's
                dtype). Shaped and typed like ``x``, any strides; it may be its own input exactly (in place)
                but may not otherwise overlap another argument. Not while an input requires grad. Default
                None.
            residual_out (torch.Tensor | None): Keyword-only. Where to write the result (x + residual in x's
                dtype, when residual is given; residual_out=residual writes it over the residual). Shaped and
                typed like ``residual``, any strides; it may be its own input exactly (in place) but may not
                otherwise overlap another argument. Not while an input requires grad. Default None.

        Returns:
            torch.Tensor | tuple: ``out``, a new tensor unless given; with ``residual``, the tuple ``(out,
                residual_out)``.

        Raises:
            TypeError: An argument is not a tensor, or has a dtype not listed above.
            ValueError: A shape that does not match the ones above, tensors on different devices, an output
                that overlaps another argument; or, by the manifest's rules: x: expected a last dim of at most
                65536; weight: expected weight in x's dtype or float32; bias: expected bias in x's dtype or
                float32.
            RuntimeError: ``out=`` or another output given while an input requires grad.
        """
        return self._call({'x': x, 'weight': weight, 'bias': bias, 'residual': residual}, {'out': out,
            'residual_out': residual_out})


class RMSNormFwdOp(hooks.RMSNormFwdHooks):
    """Root-mean-square normalisation over the last dim, with an optional fused residual add.

    ``y = x / sqrt(mean(x^2) + eps) * (offset + weight)`` over the last dim of any leading shape: ``[tokens,
    hidden]``, ``[batch, seq, hidden]``, and per head ``[tokens, heads, head_dim]`` with a ``[head_dim]``
    weight (Qwen3 and Gemma 3 q/k norm). Arithmetic is fp32 whatever the dtypes, and the output rounds where
    Hugging Face's modules round: ``rounding="llama"`` (LlamaRMSNorm, Mistral, Qwen2/3, Phi-3) rounds the
    normalised value to x's dtype before the weight multiply; ``"fp32"`` (Gemma with ``offset=1``, Olmo2)
    computes ``n * (offset + weight)`` in fp32 and rounds once. With ``residual``, ``h = x + residual`` is
    computed in x's dtype (as vLLM's ``fused_add_rms_norm`` and HF's decoder layers do), normalised, and
    returned as ``residual_out`` (written over ``residual`` with ``residual_out=residual``). Views whose rows
    lie at two strides (the q slice of a fused qkv buffer, every other head) are read and written where they
    lie; deeper views are copied first.

    References: Zhang & Sennrich, 2019, arXiv:1910.07467 (RMSNorm); HF transformers LlamaRMSNorm,
        Gemma3RMSNorm, Olmo2RMSNorm; vLLM csrc/layernorm_kernels.cu fused_add_rms_norm.

    Examples:
        >>> import torch
        >>> from tileops.norm import RMSNormFwdOp
        >>> device = "cuda" if torch.cuda.is_available() else "cpu"
        >>> op = RMSNormFwdOp(eps=1e-6)
        >>> x = torch.randn(4, 256, 1024, dtype=torch.bfloat16, device=device)   # [batch, seq, hidden]
        >>> w = torch.ones(1024, dtype=torch.bfloat16, device=device)
        >>> y = op(x, w)
        >>> r = torch.randn_like(x)
        >>> y2, h = op(x, w, residual=r)   # h = x + r, the next layer's residual
        >>> y.shape, y.dtype, torch.equal(h, x + r)
        (torch.Size([4, 256, 1024]), torch.bfloat16, True)
    """

    def __init__(self, eps: float = 1e-06, offset: float = 0.0, *, rounding: str | None = None,
                 out_dtype: str | None = None, target: str | Target | None = None) -> None:
        """Build the op; kernels are compiled at the first call.

        Args:
            eps (float): Added to the mean square before the reciprocal square root (as an fp32 value, as
                torch adds it). Default ``1e-06``.
            offset (float): The weight term is offset + weight, in fp32 (Gemma: 1.0); compiled into the
                kernel, so a value exact in fp32 and in 7 significant digits (0.0, 1.0, 0.5). Default ``0.0``.
            rounding (str | None): Keyword-only. Where the output rounds: llama rounds the normalised value to
                x's dtype before the weight multiply (Llama, Mistral, Qwen, Phi-3); fp32 rounds once at the
                end (Gemma, Olmo2). None: llama when offset is 0, else fp32. One of ``"llama"``, ``"fp32"``.
                Default ``None``.
            out_dtype (str | None): Keyword-only. float32: the output is fp32, as HF's LlamaRMSNorm returns
                with an fp32 weight and a 16-bit x. None: x's dtype. One of ``"float32"``. Default ``None``.
            target (str | Target | None): Which set of kernels serves this op: a registered target name,
                BUILTIN for the in-tree kernels, or None to decide from the input device at the first call.
                Default None.

        Raises:
            TypeError: A parameter has the wrong type.
            ValueError: A value outside its choices, an unknown ``target``; or, by the manifest's rules: eps:
                expected eps >= 0; rounding: expected rounding 'fp32' (or None) with an offset: llama rounding
                has none (Gemma's form is fp32).
        """
        self._setup({'eps': eps, 'offset': offset, 'rounding': rounding, 'out_dtype': out_dtype}, target)

    def forward(self, x: torch.Tensor, weight: torch.Tensor, *, residual: torch.Tensor | None = None,
                out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None) -> Any:
        """Run the op; ``op(...)`` calls this. Shapes and dtypes are taken from the first call, and inputs
        are never modified (except by ``out=`` naming an input, which takes the result in place).

        Gradients: differentiable in ``x``, ``weight`` and ``residual``; an output carries a ``grad_fn`` when
        an input it is computed from requires grad. The gradient of x (which is also the residual's: the
        gradient reaching residual_out is added) in one launch, and the weight's summed over every row on the
        device: fp32 partial sums per block, then a second kernel adding them in a fixed order (the same rows
        give the same bits). With llama rounding the weight's gradient sums dy times the rounded normalised
        value, as autograd through HF's module does. Summed over every row: the gradient of ``weight``. A
        gradient of that gradient (double backward) raises.

        Args:
            x (torch.Tensor): The tensor to normalise over its last dim. Shape ``[..., hidden]``; dtype
                float16, bfloat16, float32.
            weight (torch.Tensor): The scale, one per element of the last dim; x's dtype or float32. Shape
                ``[hidden]``; dtype float16, bfloat16, float32.
            residual (torch.Tensor | None): Keyword-only. Added to x (in x's dtype) before the norm; the sum
                is returned as residual_out. The shape and dtype of ``x``, exactly. Default None.
            out (torch.Tensor | None): Keyword-only. Where to write the result (the normalised tensor, in x's
                dtype or out_dtype). Shaped like ``x`` and typed like it, or as ``out_dtype`` says when given,
                any strides; it may be its own input exactly (in place) but may not otherwise overlap another
                argument. Not while an input requires grad. Default None.
            residual_out (torch.Tensor | None): Keyword-only. Where to write the result (x + residual in x's
                dtype, when residual is given; residual_out=residual writes it over the residual). Shaped and
                typed like ``residual``, any strides; it may be its own input exactly (in place) but may not
                otherwise overlap another argument. Not while an input requires grad. Default None.

        Returns:
            torch.Tensor | tuple: ``out``, a new tensor unless given; with ``residual``, the tuple ``(out,
                residual_out)``.

        Raises:
            TypeError: An argument is not a tensor, or has a dtype not listed above.
            ValueError: A shape that does not match the ones above, tensors on different devices, an output
                that overlaps another argument; or, by the manifest's rules: x: expected a last dim of at most
                65536; weight: expected weight in x's dtype or float32.
            RuntimeError: ``out=`` or another output given while an input requires grad.
        """
        return self._call({'x': x, 'weight': weight, 'residual': residual}, {'out': out, 'residual_out':
            residual_out})
