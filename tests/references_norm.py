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
    grad_scale(op_name, params, inputs, grad_outs) -> {"weight": ..., "bias": ...}: what the error of
    a gradient summed over rows is measured against, where it is not its own value
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


def _normalised(op_name: str, p: dict, h: torch.Tensor) -> torch.Tensor:
    """``n`` before any rounding: ``h * rstd`` (RMSNorm), ``(h - mean) * rstd`` (LayerNorm)."""
    return rms_norm(h, None, p["eps"]) if op_name == "RMSNormFwdOp" else layer_norm(h, None, None, p["eps"])


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


#: How far (relative) the op's fp32 normalised value may lie from the float64 ``h * rstd``: 16 units
#: of fp32 rounding (2^-24). The op's ``n`` carries rstd's error (CUDA's rsqrtf within 2 ulp: up to 4
#: units; half the relative error of the fp32 sum of squares, whose CUDA schedule adds at most 16
#: squares a thread in sequence, then a tree across lanes) and half a unit each for the eps add and
#: the product ``h * rstd``. Measured on the CPU: at most 2.4 units (C backend) and 3.1 (torch
#: target) over 2^18 elements at hidden 184 to 16384, about 0.7 on average; 8.0 at most (2.6 on
#: average) over 16,384 rows of 1024 with rstd moved a further 2 fp32 ulps in every row (rsqrtf's
#: bound). Larger, more terms are allowed to round either way (the bound grows as the square root
#: of their number); smaller, a term that did could be one the bound leaves out.
TAU = 2.0**-20


def either_way(n: torch.Tensor, dtype: torch.dtype, tau: float = TAU) -> torch.Tensor:
    """Where rounding ``n`` to ``dtype`` may go either way for a value off ``n`` by a relative ``tau``:
    a rounding boundary of ``dtype`` (the midpoint of two neighbouring values) lies within ``tau |n|``."""
    return (n * (1 - tau)).to(dtype) != (n * (1 + tau)).to(dtype)


def grad_scale(op_name: str, params: dict, inputs: dict, grad_outs: dict) -> dict[str, torch.Tensor]:
    """What the error of a gradient summed over rows (the weight's and the bias's, ``backward.reduce``)
    is measured against (:func:`family_references.grad_scales`), per column: ``|sum_r t_r| + 2
    sqrt(sum_r t_r^2)``, the second sum over the terms ``t_r`` the op may round differently at its
    dtype's precision; ``t = dy * n`` for the weight (``dy * round(n)`` with llama rounding), ``dy``
    for the bias. The sum's own magnitude alone fails a correct op where a column cancels.

    * 16-bit x with llama rounding: the weight's terms whose ``n`` lies within ``TAU |n|`` of a
      rounding boundary of x's dtype (:func:`either_way`). There the op's fp32 ``n`` may round to the
      neighbouring value, one step ``s <= eps |n|`` away (eps 2^-7 bf16, 2^-10 fp16), so the term is
      ``|dy| s <= eps |t|`` off. Seen on an H200, llama-4k bf16 (16,384 rows of 4096): one dw of
      4096 off by 0.026 (-0.4785 for -0.4521), against 0.016 + 0.016 * 0.45 = 0.023 from |dw| alone.

      The tests' rtol is 2.05 eps (1.6e-2 bf16, 2e-3 fp16), so the factor 2 makes the allowance
      ``4.1 eps sqrt(sum t^2)``: by Cauchy-Schwarz, any k of those terms stepping, in any
      directions, move the column by at most ``eps sqrt(k) sqrt(sum t^2)``, so any 16 are covered.
      More step in long columns, in directions independent of each other (dy's signs). Simulated
      with rstd 2 fp32 ulps off in every row (``tests/test_reduce_grad_tolerance.py``; 1024
      columns, 16 draws): 16,384 rows take 0.47 steps a column in bf16 (5 at most) and 3.7 in fp16
      (13), 65,536 rows 1.8 (8) and 14.7 (30); the largest error was 0.24 of the bound, and |dw|
      alone failed a correct fp16 gradient in 4 of the 16 draws at 16,384 rows.

      Only about 2 TAU |n| / s of the terms are that close (1 in 2,900 bf16, 1 in 360 fp16), so
      the allowance stays small: on average 0.066 a column at 16,384 rows in bf16 and 0.027 in
      fp16 (0.15 and 0.054 at 65,536); ``eps sum |t|`` over all terms would be 80 (bf16). A row dropped
      from the sum moves columns by |dy n| (up to about 10 in 4096), the unrounded n of the llama
      form by 0.32 (bf16) and 0.040 (fp16) a column at 16,384 rows, a wrong sign by 2 |dw|: each
      fails.
    * float32 x: every term, its own roundings (``n`` to a few units of 2^-24, the product, the fp32
      sums) being the dtype's: ``2 rtol = 4e-5 = 671 * 2^-24`` of the terms' root sum of squares,
      ``671 * 2^-24 sqrt(rows)`` for unit terms, against about ``0.4 * 2^-24 * rows`` for one
      sequential fp32 sum of them (covered to 2.8 million rows); at 4096 rows the allowance is
      2.6e-3, and a row dropped moves a column by its |t|, about 1.
    * otherwise (16-bit x; LayerNorm, RMSNorm's fp32 form, the bias): nothing beyond ``|dw|`` (no
      entry). Each term is exact in fp32 (16-bit by 16-bit) or within 2^-24 of it, summed in fp32
      partial sums: a single sequential sum of 65,536 unit terms would be off by about 2^-24 * 65536 *
      0.4 = 1.6e-3, inside atol (1.6e-2 bf16); the kernels' per-block partials are far closer.
    """
    p, dtype, h = _prepared(op_name, params, inputs)
    llama = _llama(op_name, p)
    if dtype != torch.float32 and not llama:
        return {}
    hidden = h.shape[-1]
    n = _normalised(op_name, p, h).reshape(-1, hidden)
    dy = grad_outs["out"].to(F64).reshape(-1, hidden)
    terms = {"weight": dy * (rounded(n, dtype) if llama else n), "bias": dy}
    loose = torch.ones_like(n, dtype=torch.bool) if dtype == torch.float32 else either_way(n, dtype)
    return {name: t.sum(0).abs() + 2 * (t * t * loose).sum(0).sqrt() for name, t in terms.items()
            if inputs.get(name) is not None}
