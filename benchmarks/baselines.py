"""The alternatives tileops is timed against, written as users write them.

``hf_style``: HF transformers' ``apply_rotary_pos_emb`` with cos/sin tables given (fp32, computed
outside the timed region, as a model caches them), arithmetic in fp32, one cast back. Timed eager and
under ``torch.compile``. Liger-Kernel's Triton RoPE is timed where its layout fits (q and k as
[batch, heads, seq, head_dim]). An op of another family is timed against its own ``torch`` target
(``tileops/<family>/torch_impl.py``, plain PyTorch), eager and compiled: no edit here for a new family.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["make_baseline", "liger_baseline", "functional_baseline"]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * cos + _rotate_half(xf) * sin).to(x.dtype)


def _rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float().unflatten(-1, (-1, 2))
    a, b = xf[..., 0], xf[..., 1]
    return torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2).to(x.dtype)


def _rope_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int) -> torch.Tensor:
    return torch.cat((_rope_neox(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)


def make_baseline(op: Any, inputs: dict[str, torch.Tensor]) -> tuple[Callable[..., torch.Tensor], tuple]:
    """(function, args) computing ``op`` on ``inputs`` the HF way, with its cos/sin precomputed.

    The tensors of ``inputs`` come first in ``args``, in the op's input order, so a caller can swap
    in another input set of the same shapes: ``(*new_inputs.values(), *args[len(inputs):])``.
    """
    if op.manifest.family != "rope":
        return _torch_target(op, inputs)
    x = inputs["x"]
    rot = op.rotated_width(x.shape[-1])
    inv, amp = op.frequencies(rot)
    inv = inv.to(x.device)
    if op.name == "MRoPEFwdOp" and inputs.get("position_ids") is not None:
        return _mrope_baseline(op, inputs, inv, amp)
    if op.layout == "ids":
        pos = inputs["position_ids"]
        table = torch.arange(op.params["max_position"], device=x.device, dtype=torch.float64)[:, None] * inv
        cos_t, sin_t = (table.cos() * amp).float(), (table.sin() * amp).float()

        def ids(x: torch.Tensor, pos: torch.Tensor, cos_t: torch.Tensor, sin_t: torch.Tensor) -> torch.Tensor:
            c, s = cos_t[pos][:, None, :], sin_t[pos][:, None, :]
            c, s = torch.cat((c, c), -1), torch.cat((s, s), -1)
            return _rope_partial(x, c, s, rot)

        return ids, (x, pos, cos_t, sin_t)
    seq = x.shape[0] if op.layout == "1d" else x.shape[1]
    angle = torch.arange(seq, device=x.device, dtype=torch.float64)[:, None] * inv
    c, s = (angle.cos() * amp).float(), (angle.sin() * amp).float()
    if op.layout == "2d":
        c, s = c[:, None, :], s[:, None, :]
    if op.pairing == "neox":
        c, s = torch.cat((c, c), -1), torch.cat((s, s), -1)
        return _rope_neox, (x, c, s)
    return _rope_interleaved, (x, c, s)


def _torch_target(op: Any, inputs: dict[str, torch.Tensor]) -> tuple[Callable[..., Any], tuple]:
    """The family's ``torch`` target for ``op`` on inputs shaped like ``inputs``, called directly (so
    ``torch.compile`` traces its PyTorch ops, not tileops' custom op)."""
    twin = type(op)(**op.params, target="torch")
    impl = twin._impl_for(twin._check_call(inputs))
    names = list(inputs)
    return (lambda *tensors: impl(**dict(zip(names, tensors)))), tuple(inputs.values())


def _mrope_baseline(op: Any, inputs: dict[str, torch.Tensor], inv: torch.Tensor, amp: float) -> tuple[Callable, tuple]:
    """MRoPE as Qwen2-VL's modeling code runs it: cos/sin per token with the sections folded in
    (the rotary embedding's output, computed outside the timed region), then ``apply_rotary_pos_emb``
    on x and, when given, the key."""
    x, pos, key = inputs["x"], inputs["position_ids"], inputs.get("key")
    angle = op.angles(pos, inv, True)  # [rows..., R/2]: each pair at its stream's position
    c, s = (angle.cos() * amp).float(), (angle.sin() * amp).float()
    c, s = torch.cat((c, c), -1), torch.cat((s, s), -1)
    if op.layout != "1d":
        c, s = c[..., None, :], s[..., None, :]  # over the heads
    if key is None:
        return (lambda x, pos, c, s: _rope_neox(x, c, s)), (x, pos, c, s)
    return (lambda x, pos, k, c, s: (_rope_neox(x, c, s), _rope_neox(k, c, s))), (x, pos, key, c, s)


def liger_baseline(op: Any, inputs: dict[str, torch.Tensor]) -> tuple[Callable[..., Any], tuple, int] | None:
    """``(function, args, calls)``: Liger-Kernel's kernel for ``op`` on the same data where one fits,
    moving the bytes of ``calls`` op calls; else None.

    RoPE: ``liger_rotary_pos_emb`` (neox, 2d) rotates q and k together in [batch, heads, seq,
    head_dim]; we hand it x as q and as k (transposed views made contiguous outside the timed
    region), so it moves the bytes of two op calls. Norm: ``LigerRMSNormFunction`` (its ``llama`` or
    ``gemma`` casting mode, the one that rounds as the op does), ``LigerFusedAddRMSNormFunction`` with
    a residual, ``LigerLayerNormFunction`` with a weight and a bias: one call's bytes.
    """
    if op.manifest.family == "norm":
        return _liger_norm(op, inputs)
    if op.manifest.family != "rope" or op.layout != "2d" or op.pairing != "neox" or op.name == "MRoPEFwdOp":
        return None
    try:
        from liger_kernel.ops.rope import LigerRopeFunction
    except Exception:
        return None
    fn, (x, c, s) = make_baseline(op, inputs)
    q = x.transpose(1, 2).contiguous()
    k = q.clone()
    cos = c[:, 0, :][None].to(x.dtype).contiguous()
    sin = s[:, 0, :][None].to(x.dtype).contiguous()
    return (lambda q, k, cos, sin: LigerRopeFunction.apply(q, k, cos, sin)), (q, k, cos, sin), 2


def _liger_norm(op: Any, inputs: dict[str, torch.Tensor]) -> tuple[Callable[..., Any], tuple, int] | None:
    x, w, r = inputs["x"], inputs.get("weight"), inputs.get("residual")
    eps = op.params["eps"]
    try:
        if op.name == "LayerNormFwdOp":
            if w is None or inputs.get("bias") is None or r is not None:
                return None
            from liger_kernel.ops.layer_norm import LigerLayerNormFunction

            return (lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, eps)), (x, w, inputs["bias"]), 1
        if w is None or op.params.get("out_dtype"):
            return None
        # the op's own choice of rounding (its hooks resolve rounding=None from the offset and x's dtype)
        mode = "llama" if op.rounding_of(op.params, str(x.dtype).removeprefix("torch.")) == "llama" else "gemma"
        offset = float(op.params.get("offset") or 0.0)
        if r is None:
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction

            return (lambda x, w: LigerRMSNormFunction.apply(x, w, eps, offset, mode, False)), (x, w), 1
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

        return (lambda x, r, w: LigerFusedAddRMSNormFunction.apply(x, r, w, eps, offset, mode, False)), (x, r, w), 1
    except ImportError:
        return None


def functional_baseline(op: Any, inputs: dict[str, torch.Tensor]) -> tuple[Callable[..., Any], tuple] | None:
    """``(function, args)``: PyTorch's own fused kernel for ``op``, where it has one: for the norm family
    ``torch.nn.functional.rms_norm`` / ``layer_norm`` (after ``x + residual`` with a residual), which
    a user would call instead of a module's Python; else None."""
    if op.manifest.family != "norm":
        return None
    x, w, r = inputs["x"], inputs.get("weight"), inputs.get("residual")
    eps, shape = op.params["eps"], (x.shape[-1],)
    if op.name == "LayerNormFwdOp":
        norm = lambda h, w, b: torch.nn.functional.layer_norm(h, shape, w, b, eps)  # noqa: E731
        b = inputs.get("bias")
    else:
        if op.params.get("offset"):  # no offset in F.rms_norm: (1 + w) would be a second kernel
            return None
        norm = lambda h, w, b: torch.nn.functional.rms_norm(h, shape, w, eps)  # noqa: E731
        b = None
    if r is None:
        return (lambda x, w, b: norm(x, w, b)), (x, w, b)

    def fused(x: torch.Tensor, w: Any, b: Any, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x + r
        return norm(h, w, b), h

    return fused, (x, w, b, r)
