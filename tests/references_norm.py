"""Independent float64 references for the norm family's ops (RMSNorm, LayerNorm), for the generated
tests, the fuzzer and the bad-input tests (``tests/family_references.py``).

Written from the definitions and from where Hugging Face's modules round, in float64 otherwise,
sharing no code with tileops or its kernels (the tests refuse to load a reference that imports them):
``h = x + residual`` rounded to x's dtype (torch's 16-bit add) when a residual is given, then RMSNorm
``h / sqrt(mean(h^2) + eps) * (offset + weight)`` or LayerNorm ``(h - mean) / sqrt(var + eps) * weight
+ bias`` (biased variance) over the last dim. With ``llama`` rounding (``rounding="llama"``, or None
with ``offset`` 0) RMSNorm's normalised value is rounded to x's dtype before the weight multiplies it,
as LlamaRMSNorm's ``weight * n.to(input_dtype)`` does. Both roundings (fp32 ones too) pass gradients unchanged, as
autograd through those modules does; they matter where a sum over many rows (the weight's gradient)
or a cancellation (LayerNorm of two nearly equal elements) would otherwise put a kernel that computes
what HF computes outside the tests' tolerances. The final rounding to the output dtype is not modelled.

x's dtype is that of ``inputs["x"]``, or ``params["input_dtypes"]["x"]`` when the caller passes the
inputs in float64 (gradients are float64 autograd of this function: ``family_references.grads``).

API:
    reference(op_name, params, inputs) -> {"out": float64 tensor, "residual_out": ...} (the latter with
    a residual)
    scale(op_name, params, inputs) -> {"out": ...} for LayerNorm: what its error is measured against
"""

from __future__ import annotations

import torch

F64 = torch.float64
DEFAULTS = {"RMSNormFwdOp": {"eps": 1e-6, "offset": 0.0}, "LayerNormFwdOp": {"eps": 1e-5}}


def rms_norm(h: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float = 0.0) -> torch.Tensor:
    y = h / torch.sqrt((h * h).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * (offset + weight)


def layer_norm(h: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    c = h - h.mean(-1, keepdim=True)
    y = c / torch.sqrt((c * c).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight
    return y if bias is None else y + bias


def rounded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` rounded to ``dtype`` (to nearest even) and back to float64; its gradient passes unchanged.
    float32 too: the kernel stores ``h = x + residual`` in fp32, and LayerNorm of two nearly equal
    elements with eps 0 turns that one rounding into 1.5e-4 of the output (the fuzzer found it)."""
    if dtype == F64:
        return t
    r = t.detach().to(dtype).to(F64)
    return t + (r - t).detach()  # the rounded value, with t's gradient


def _prepared(op_name: str, params: dict, inputs: dict) -> tuple[dict, torch.dtype, torch.Tensor]:
    """The params with their defaults, x's dtype, and ``h`` (x, or x + residual rounded to x's dtype)."""
    p = {**DEFAULTS[op_name], **{k: v for k, v in params.items() if v is not None}}
    dtype = params.get("input_dtypes", {}).get("x", inputs["x"].dtype)
    x, r = inputs["x"].to(F64), inputs.get("residual")
    return p, dtype, x if r is None else rounded(x + r.to(F64), dtype)


def _llama(op_name: str, p: dict) -> bool:
    return op_name == "RMSNormFwdOp" and p.get("rounding", "llama" if p["offset"] == 0 else "fp32") == "llama"


def reference(op_name: str, params: dict, inputs: dict) -> dict[str, torch.Tensor]:
    p, dtype, h = _prepared(op_name, params, inputs)

    def f64(name: str) -> torch.Tensor | None:
        t = inputs.get(name)
        return None if t is None else t.to(F64)

    if op_name == "RMSNormFwdOp":
        w = f64("weight")
        if _llama(op_name, p):
            out = rounded(rms_norm(h, None, p["eps"]), dtype) * w  # LlamaRMSNorm: weight * n.to(input_dtype)
        else:
            out = rms_norm(h, w, p["eps"], p["offset"])
    else:
        out = layer_norm(h, f64("weight"), f64("bias"), p["eps"])
    return {"out": out} if inputs.get("residual") is None else {"out": out, "residual_out": h}


def scale(op_name: str, params: dict, inputs: dict) -> dict[str, torch.Tensor]:
    """What LayerNorm's output error is measured against (:func:`family_references.scales`): ``|y| +
    |w| rstd |mean|``. Its ``h - mean`` cancels where a row's elements lie close to their mean (two
    nearly equal elements of a hidden-2 row), and the op's fp32 rounding of ``mean``, about 2^-24
    ``|mean|``, reaches the output times ``rstd``: with eps 0 the fuzzer saw 1.5e-4 against ``|y|``
    of 3.1, a correct fp32 result. On a row whose mean is small against its spread (any row of
    random normals with a few dozen elements) the added term is small and the bound stays ``|y|``'s.
    RMSNorm subtracts nothing: its own value."""
    if op_name != "LayerNormFwdOp":
        return {}
    p, _, h = _prepared(op_name, params, inputs)
    mean = h.mean(-1, keepdim=True)
    rstd = 1 / torch.sqrt(((h - mean) ** 2).mean(-1, keepdim=True) + p["eps"])
    w = inputs.get("weight")
    wmag = 1.0 if w is None else w.to(F64).abs()
    y = reference(op_name, params, inputs)["out"]
    return {"out": y.abs() + wmag * rstd * mean.abs()}

