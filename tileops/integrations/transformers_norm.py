"""The RMSNorm part of :mod:`tileops.integrations.transformers`: which Hugging Face norm modules the
norm family serves, the ops they are routed through, and the ``forward`` that routes one.

HF's RMSNorm classes compute one of three forms (read from each class's ``forward`` in
transformers 5.24; the tests check every one against the class itself, bit for bit in bf16):

* Llama's (Llama, Mistral, Qwen2, Qwen3 incl. ``q_norm``/``k_norm``, Phi-3, and the text models
  of Qwen2-VL, Qwen2.5-VL, Qwen3-VL): ``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``, the
  normalised value rounded to x's dtype before the weight multiply; the product follows torch's
  promotion, so an fp32 weight with a 16-bit x returns fp32. eps in ``variance_epsilon``.
* Gemma's (Gemma, Gemma 2, Gemma 3 incl. ``q_norm``/``k_norm``): ``(n * (1 + weight.float()))``
  in fp32, rounded once to x's dtype; the weight is stored as ``weight - 1`` (initialised to
  zeros). eps in ``eps``.
* Olmo2's: ``(weight * n).to(x.dtype)``: fp32 product (the weight promoted), rounded once, no
  offset. eps in ``variance_epsilon``.

Only these exact classes (name and a ``transformers.models`` module) are routed: a subclass, or a
class of the same name elsewhere, may compute something else and is left alone.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import torch

from ..norm import RMSNormFwdOp

__all__ = ["RMSNORM_CLASSES", "NormForm", "NormOps", "left_alone", "norm_form", "routed_forward"]


@dataclass(frozen=True)
class NormForm:
    """How one HF RMSNorm class computes: the op's ``offset`` and ``rounding``, and the attribute
    that holds its eps."""

    offset: float
    rounding: str  # "llama" | "fp32": RMSNormFwdOp's rounding keyword
    eps_attr: str  # "variance_epsilon" | "eps"


LLAMA = NormForm(0.0, "llama", "variance_epsilon")
GEMMA = NormForm(1.0, "fp32", "eps")
OLMO2 = NormForm(0.0, "fp32", "variance_epsilon")

#: HF class name -> its form. Classes absent from the installed transformers (Olmo2 before 4.47)
#: simply never match.
RMSNORM_CLASSES: dict[str, NormForm] = {
    "LlamaRMSNorm": LLAMA, "MistralRMSNorm": LLAMA, "Qwen2RMSNorm": LLAMA, "Qwen3RMSNorm": LLAMA,
    "Phi3RMSNorm": LLAMA, "Qwen2VLRMSNorm": LLAMA, "Qwen2_5_VLRMSNorm": LLAMA, "Qwen3VLTextRMSNorm": LLAMA,
    "GemmaRMSNorm": GEMMA, "Gemma2RMSNorm": GEMMA, "Gemma3RMSNorm": GEMMA,
    "Olmo2RMSNorm": OLMO2,
}

#: the dtypes RMSNormFwdOp takes for x; a weight must be x's dtype or float32
_OP_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def norm_form(module: torch.nn.Module) -> NormForm | None:
    """The form of ``module`` if its class is one of :data:`RMSNORM_CLASSES` as transformers defines it."""
    cls = type(module)
    if not cls.__module__.startswith("transformers.models."):
        return None
    return RMSNORM_CLASSES.get(cls.__name__)


def left_alone(model: torch.nn.Module) -> dict[str, int]:
    """The norm modules of ``model`` (a class name holding ``Norm``) that are not routed, by class
    name: what a user should know stays transformers' (a vision tower's ``LayerNorm``, ...)."""
    out: dict[str, int] = {}
    for m in model.modules():
        name = type(m).__name__
        if "Norm" in name and norm_form(m) is None:
            out[name] = out.get(name, 0) + 1
    return out


def _eps(module: torch.nn.Module, form: NormForm) -> float:
    eps = getattr(module, form.eps_attr, None)
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise NotImplementedError(f"tileops.integrations.transformers.patch: {type(module).__name__}."
                                  f"{form.eps_attr}: expected a number (the eps the module adds), got "
                                  f"{type(eps).__name__} {eps!r}")
    return float(eps)


class NormOps:
    """The ops of one patched model: one per distinct (eps, offset, rounding, out_dtype)."""

    def __init__(self) -> None:
        self.ops: dict[tuple, Any] = {}

    def _op(self, eps: float, form: NormForm, out_dtype: str | None) -> Any:
        key = (eps, form.offset, form.rounding, out_dtype)
        op = self.ops.get(key)
        if op is None:
            op = self.ops[key] = RMSNormFwdOp(eps, form.offset, rounding=form.rounding, out_dtype=out_dtype)
        return op

    def for_module(self, module: torch.nn.Module, form: NormForm) -> tuple[Any, Any]:
        """(the op for x in the weight's dtype, the op for an fp32 weight with a 16-bit x): with
        Llama's form HF returns fp32 then (torch promotes the product), with the others x's dtype."""
        eps = _eps(module, form)
        same = self._op(eps, form, None)
        return same, (self._op(eps, form, "float32") if form.rounding == "llama" else same)


def routed_forward(module: torch.nn.Module, ops: tuple[Any, Any], original: Any) -> Any:
    """``module``'s forward through ``ops`` (:meth:`NormOps.for_module`).

    A call the op does not take (x float64, or a weight neither x's dtype nor float32, e.g. a bf16
    weight with an fp32 x) goes to ``original``, transformers' forward, which computes what the
    module always did. The weight is read at each call (``model.to(dtype)`` after the patch is
    followed)."""
    same, to_fp32 = ops

    def forward(hidden_states):
        w = module.weight
        x = hidden_states
        # Traced by torch.compile, the module's own code: Inductor fuses an RMSNorm with the add
        # before it and the cast after it, which a custom op would fence off (H200, Llama 8 x 1024
        # bf16, compiled generate 8 x (256 + 128): 1,103 ms with the norms as tileops ops against
        # 1,046 with RoPE alone and 1,021 unpatched, one run). Eager calls take the op (0.71x
        # unpatched in the same run).
        if torch.compiler.is_compiling() or x.dtype not in _OP_DTYPES or (
                w.dtype != x.dtype and w.dtype != torch.float32):
            return original(hidden_states)
        op = to_fp32 if w.dtype != x.dtype else same
        perm = _memory_order(x)
        if perm is None:
            # forward, not op(...): Op.__call__ only re-packs the arguments
            return op.forward(x, w)
        inverse = [0] * len(perm)
        for i, p in enumerate(perm):
            inverse[p] = i
        return op.forward(x.permute(perm), w).permute(inverse)

    return forward


def _memory_order(x: torch.Tensor) -> list[int] | None:
    """A permutation of x's leading dims that puts them in memory order (strides descending), or
    None when they are in it already.

    The op normalises each row of the last dim whatever the leading dims' order, and reads a view
    in place when its rows lie at two strides; otherwise it copies. Gemma 3 norms q and k as
    ``[batch, heads, seq, head_dim]`` transposes of ``[batch, seq, heads, head_dim]`` projections:
    three strides in that order, two (``batch * seq``, ``heads``) in memory order. The output,
    permuted back, has the strides HF's elementwise result has (those of x)."""
    nd = x.dim()
    if nd < 3:
        return None
    st = x.stride()
    if all(st[i] >= st[i + 1] for i in range(nd - 2)):
        return None
    lead = sorted(range(nd - 1), key=lambda i: -st[i])  # stable: equal strides keep their order
    return [*lead, nd - 1]
