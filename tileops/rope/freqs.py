"""Inverse frequencies and amplitudes of the RoPE ops, in float64 on the host.

These are the op's mathematics (see ``rope-semantics``); the kernels only see the two tables that
:mod:`tileops.rope.tables` derives from them. Everything here runs once per (op, rotated width).
"""

from __future__ import annotations

import math

import torch

__all__ = ["base_inv_freq", "llama31_inv_freq", "yarn_inv_freq", "yarn_amplitude", "longrope_inv_freq", "factor_table",
           "longrope_amplitude", "mrope_streams"]


def base_inv_freq(base: float, rot: int) -> torch.Tensor:
    """``base ** (-2i / rot)`` for ``i < rot / 2``, float64."""
    return base ** (-torch.arange(0, rot, 2, dtype=torch.float64) / rot)


def llama31_inv_freq(base: float, rot: int, scale_factor: float, low_freq_factor: float,
                     high_freq_factor: float, original_max_position: int) -> torch.Tensor:
    """Llama 3.1: high frequencies kept, low ones divided by ``scale_factor``, a smooth band between."""
    inv = base_inv_freq(base, rot)
    wavelen = 2 * math.pi / inv
    low_wl = original_max_position / low_freq_factor
    high_wl = original_max_position / high_freq_factor
    s = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    medium = (1 - s) * inv / scale_factor + s * inv
    out = torch.where(wavelen > low_wl, inv / scale_factor, medium)
    return torch.where(wavelen < high_wl, inv, out)


def _yarn_correction_dim(r: float, rot: int, base: float, original_max_position: int) -> float:
    return rot * math.log(original_max_position / (r * 2 * math.pi)) / (2 * math.log(base))


def yarn_inv_freq(base: float, rot: int, scale: float, original_max_position: int, beta_fast: float,
                  beta_slow: float) -> torch.Tensor:
    """YaRN (vLLM ``YaRNScalingRotaryEmbedding``): a linear ramp between interpolation and extrapolation."""
    inv = base_inv_freq(base, rot)
    low = max(math.floor(_yarn_correction_dim(beta_fast, rot, base, original_max_position)), 0)
    high = min(math.ceil(_yarn_correction_dim(beta_slow, rot, base, original_max_position)), rot - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rot // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrap = 1 - ramp
    return (inv / scale) * (1 - extrap) + inv * extrap


def yarn_amplitude(scale: float, attn_factor: float) -> float:
    """vLLM's mscale: ``(0.1 ln(scale) + 1) * attn_factor`` for scale > 1, else ``attn_factor``."""
    return (0.1 * math.log(scale) + 1.0 if scale > 1 else 1.0) * attn_factor


def longrope_inv_freq(base: float, rot: int, rescale_factors: torch.Tensor | None) -> torch.Tensor:
    """LongRoPE: the factors multiply the divisor, ``1 / (factor_i * base^(2i/rot))``."""
    inv = base_inv_freq(base, rot)
    if rescale_factors is None:
        return inv
    return inv / rescale_factors.detach().to(device="cpu", dtype=torch.float64)


def longrope_amplitude(max_position_embeddings: int, original_max_position_embeddings: int) -> float:
    """``sqrt(1 + ln(scale) / ln(original))`` for ``scale = max / original > 1``, else 1."""
    scale = max_position_embeddings / original_max_position_embeddings
    if scale <= 1:
        return 1.0
    return math.sqrt(1 + math.log(scale) / math.log(original_max_position_embeddings))


def factor_table(op_name: str, arg: str, value: torch.Tensor | None, length: str) -> torch.Tensor | None:
    """``value`` checked as a 1-D real tensor of finite non-zero factors and copied to float64 on
    the CPU (None stays None); ``length`` says in words what its length must be."""
    if value is None:
        return None
    if value.dim() != 1 or value.is_complex() or not (value.is_floating_point() or value.dtype in (torch.int32, torch.int64)):
        raise ValueError(f"{op_name}: {arg}: expected a 1-D real tensor of shape ({length},), "
                         f"got shape {list(value.shape)} dtype {value.dtype}")
    t = value.detach().to(device="cpu", dtype=torch.float64).clone()
    bad = (~torch.isfinite(t)) | (t == 0)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"{op_name}: {arg}: expected finite non-zero factors, got {arg}[{i}] = {float(t[i])}")
    return t


def mrope_streams(section: tuple[int, ...], interleaved: bool) -> torch.Tensor:
    """MRoPE: the position stream (0 temporal, 1 height, 2 width) of each of the ``sum(section)``
    pairs, int64. Consecutive (Qwen2-VL): ``section[c]`` pairs in a row take stream ``c``.
    Interleaved (Qwen3-VL): pair ``j`` takes stream 1 when ``j % 3 == 1`` and ``j < 3 * section[1]``,
    stream 2 when ``j % 3 == 2`` and ``j < 3 * section[2]``, else stream 0 (``kernels/rope.py``'s
    ``_pick`` is the same map on the device)."""
    j = torch.arange(sum(section))
    if interleaved:
        out = torch.zeros_like(j)
        out[(j % 3 == 1) & (j < 3 * section[1])] = 1
        out[(j % 3 == 2) & (j < 3 * section[2])] = 2
        return out
    return (j >= section[0]).long() + (j >= section[0] + section[1]).long()
