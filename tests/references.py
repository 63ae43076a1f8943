"""Independent float64 references for the tileops RoPE operators.

Written straight from `rope-semantics.md` (the project's statement of the maths), in plain PyTorch
and float64 throughout, so that a test comparing a kernel against these numbers compares against the
mathematics and not against a second copy of the kernel's own arithmetic. For that reason nothing
here imports `tileops` or `kernels`.

API:
    inv_freq_and_amplitude(op_name, params, rot_dim) -> (float64 inv_freq of shape (rot_dim//2,), amplitude)
    reference(op_name, params, inputs) -> float64 tensor shaped like inputs["x"]
    REFERENCES[op_name](params, inputs) -> same as reference(op_name, params, inputs)

`params` are the op's constructor arguments; missing keys take the documented defaults and keys this
module does not know (dtype, shapes, ...) are ignored, so callers may pass an op's full kwargs.
"""

from __future__ import annotations

import functools
import math

import torch

F64 = torch.float64

# Defaults of every parameter the maths depends on, per op (rope-semantics.md and the op docs).
_COMMON = {"input_layout": "1d", "base": 10000.0}
DEFAULTS: dict[str, dict] = {
    "RoPEFwdOp": {**_COMMON, "rope_layout": "neox"},
    "RoPENeoxPositionIdsFwdOp": {"base": 10000.0, "rotary_dim": None},  # max_position is required
    "RoPELlama31FwdOp": {
        **_COMMON,
        "scale_factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position": 8192,
    },
    "YaRNFwdOp": {
        **_COMMON,
        "scale": 16.0,
        "original_max_position": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "attn_factor": 1.0,
        "rope_layout": "neox",
    },
    "LongRoPEFwdOp": {
        **_COMMON,
        "rescale_factors": None,
        "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096,
    },
    "RoPELinearFwdOp": {**_COMMON, "factor": 1.0, "rotary_dim": None},
    "Phi3LongRoPEFwdOp": {
        **_COMMON,
        "short_factor": None,
        "long_factor": None,
        "original_max_position_embeddings": 4096,
        "max_position_embeddings": 4096,
        "attention_factor": None,
        "rotary_dim": None,
        # not an op parameter: the largest position of the call, which picks short or long factors
        "max_position_id": None,
    },
    # MRoPE (Qwen2-VL / Qwen3-VL): mrope_section is required; position_ids are [3, ...]
    "MRoPEFwdOp": {"input_layout": "2d", "base": 10000.0, "mrope_section": None, "mrope_interleaved": False},
    "RoPEDynamicNTKFwdOp": {
        **_COMMON,
        "factor": 1.0,
        "max_position_embeddings": 2048,
        "rotary_dim": None,
        # not an op parameter: the largest position of the call, which sets the scaled base
        "max_position_id": None,
    },
}


def _params(op_name: str, params: dict | None) -> dict:
    """Defaults overlaid with the caller's params; None values in params mean 'use the default'
    only where the default itself is None-able (rotary_dim, rescale_factors)."""
    if op_name not in DEFAULTS:
        raise KeyError(f"no reference for op {op_name!r}; known: {sorted(DEFAULTS)}")
    merged = dict(DEFAULTS[op_name])
    merged.update(params or {})
    return merged


def base_inv_freq(base: float, rot_dim: int) -> torch.Tensor:
    """inv_freq[i] = base ** (-2 i / D), i = 0 .. D/2-1, evaluated in float64."""
    if rot_dim <= 0 or rot_dim % 2:
        raise ValueError(f"rotated width must be positive and even, got {rot_dim}")
    i = torch.arange(rot_dim // 2, dtype=F64)
    return torch.tensor(float(base), dtype=F64) ** (-2.0 * i / rot_dim)


# --------------------------------------------------------------------------- scaled frequency tables


def llama31_inv_freq(p: dict, rot_dim: int) -> torch.Tensor:
    """Llama 3.1 three-band rescaling (HF _compute_llama3_parameters, Meta apply_scaling)."""
    lo_f, hi_f = float(p["low_freq_factor"]), float(p["high_freq_factor"])
    if lo_f == hi_f:
        # The medium-band smoothing divides by (high - low); the semantics say reject it.
        raise ValueError("low_freq_factor == high_freq_factor divides by zero")
    inv = base_inv_freq(p["base"], rot_dim)
    omp, factor = float(p["original_max_position"]), float(p["scale_factor"])
    wavelen = 2.0 * math.pi / inv
    low_wl, high_wl = omp / lo_f, omp / hi_f
    s = (omp / wavelen - lo_f) / (hi_f - lo_f)
    medium = (1.0 - s) * inv / factor + s * inv
    out = torch.where(wavelen > low_wl, inv / factor, medium)
    # High band last so that it wins on any overlap: short wavelengths are never touched.
    return torch.where(wavelen < high_wl, inv, out)


def yarn_correction_range(rot_dim: int, base: float, omp: float, beta_fast: float, beta_slow: float):
    """(low, high) pair indices of the YaRN ramp, floor/ceil truncated and clamped to [0, D-1]."""

    def correction_dim(r: float) -> float:
        return rot_dim * math.log(omp / (r * 2.0 * math.pi)) / (2.0 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), rot_dim - 1)
    return low, high


def yarn_inv_freq_and_mscale(p: dict, rot_dim: int):
    """YaRN (vLLM YaRNScalingRotaryEmbedding / HF _compute_yarn_parameters with truncate=True)."""
    inv = base_inv_freq(p["base"], rot_dim)
    scale = float(p["scale"])
    low, high = yarn_correction_range(
        rot_dim, float(p["base"]), float(p["original_max_position"]), float(p["beta_fast"]), float(p["beta_slow"])
    )
    if low == high:
        high += 0.001  # avoid 0/0 in the ramp, as both anchors do
    i = torch.arange(rot_dim // 2, dtype=F64)
    ramp = ((i - low) / (high - low)).clamp(0.0, 1.0)
    extrap = 1.0 - ramp  # 1 -> keep the original frequency, 0 -> fully interpolated (divided by scale)
    inv = (inv / scale) * (1.0 - extrap) + inv * extrap
    # mscale multiplies attn_factor (vLLM's convention); see test_references.py for HF's.
    mscale = (0.1 * math.log(scale) + 1.0 if scale > 1.0 else 1.0) * float(p["attn_factor"])
    return inv, mscale


def longrope_inv_freq_and_amplitude(p: dict, rot_dim: int):
    """LongRoPE: per-pair rescale factors multiply the divisor; amplitude from the context ratio."""
    inv = base_inv_freq(p["base"], rot_dim)
    factors = p["rescale_factors"]
    if factors is not None:
        factors = torch.as_tensor(factors).to(F64).reshape(-1)
        if factors.numel() != rot_dim // 2:
            raise ValueError(f"rescale_factors must have {rot_dim // 2} entries, got {factors.numel()}")
        if bool((factors == 0).any()) or bool(torch.isnan(factors).any()):
            raise ValueError("rescale_factors must be non-zero and not NaN")
        i = torch.arange(rot_dim // 2, dtype=F64)
        divisor = torch.tensor(float(p["base"]), dtype=F64) ** (2.0 * i / rot_dim)
        inv = 1.0 / (factors * divisor)  # the factors multiply the divisor, not the frequency
    omp = float(p["original_max_position_embeddings"])
    scale = float(p["max_position_embeddings"]) / omp
    amp = math.sqrt(1.0 + math.log(scale) / math.log(omp)) if scale > 1.0 else 1.0
    return inv, amp


def phi3_longrope_inv_freq_and_amplitude(p: dict, rot_dim: int):
    """HF longrope: long factors when max(position_ids) + 1 > original_max_position_embeddings (one
    choice for the whole call), else short; amplitude attention_factor or HF's default."""
    omp = int(p["original_max_position_embeddings"])
    short, long = p["short_factor"], p["long_factor"]
    same = (short is None and long is None) or (
        short is not None and long is not None and torch.equal(torch.as_tensor(short, dtype=F64), torch.as_tensor(long, dtype=F64)))
    if p["max_position_id"] is None and not same:
        raise ValueError("Phi3LongRoPEFwdOp: the factors depend on the positions: pass params['max_position_id']")
    use_long = p["max_position_id"] is not None and int(p["max_position_id"]) + 1 > omp
    factors = long if use_long else short
    inv, amp = longrope_inv_freq_and_amplitude(
        {"base": p["base"], "rescale_factors": factors, "original_max_position_embeddings": omp,
         "max_position_embeddings": p["max_position_embeddings"]}, rot_dim)
    return inv, (amp if p["attention_factor"] is None else float(p["attention_factor"]))


def inv_freq_and_amplitude(op_name: str, params: dict, rot_dim: int) -> tuple[torch.Tensor, float]:
    """float64 inverse frequencies, shape (rot_dim//2,), and the amplitude (1.0 when none)."""
    p = _params(op_name, params)
    if op_name in ("RoPEFwdOp", "RoPENeoxPositionIdsFwdOp"):
        return base_inv_freq(p["base"], rot_dim), 1.0
    if op_name == "RoPELlama31FwdOp":
        return llama31_inv_freq(p, rot_dim), 1.0  # Llama 3.1 has no amplitude factor
    if op_name == "YaRNFwdOp":
        return yarn_inv_freq_and_mscale(p, rot_dim)
    if op_name == "LongRoPEFwdOp":
        return longrope_inv_freq_and_amplitude(p, rot_dim)
    # The two HF ops rotate rotary_dim columns when it is set, whatever rot_dim the caller passes.
    if op_name == "RoPELinearFwdOp":  # HF linear: positions divided by factor
        return base_inv_freq(p["base"], p["rotary_dim"] or rot_dim) / float(p["factor"]), 1.0
    if op_name == "Phi3LongRoPEFwdOp":
        return phi3_longrope_inv_freq_and_amplitude(p, p["rotary_dim"] or rot_dim)
    if op_name == "MRoPEFwdOp":  # base frequencies; the streams only pick each pair's position
        return base_inv_freq(p["base"], rot_dim), 1.0
    if op_name == "RoPEDynamicNTKFwdOp":  # HF dynamic: the base grows with the call's length
        D = p["rotary_dim"] or rot_dim
        mpe = float(p["max_position_embeddings"])
        # one call on a fresh op: the cached length is max(trained length, max position + 1)
        cached = max(mpe, float(p["max_position_id"]) + 1.0)
        scaled = p["base"] * (p["factor"] * cached / mpe - (p["factor"] - 1.0)) ** (D / (D - 2.0))
        return scaled ** (-torch.arange(0, D, 2, dtype=F64) / D), 1.0
    raise KeyError(op_name)  # unreachable: _params already checked


# --------------------------------------------------------------------------- applying the rotation


def rotate(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, amplitude: float, pairing: str) -> torch.Tensor:
    """Rotate the first D = 2*len(inv_freq) columns of x (float64); copy the rest bit for bit.

    pos must broadcast against x.shape[:-1] (it holds the position of every row of x).
    """
    D = 2 * inv_freq.numel()
    if D > x.shape[-1]:
        raise ValueError(f"rotated width {D} exceeds head_dim {x.shape[-1]}")
    angle = pos.to(F64).unsqueeze(-1) * inv_freq  # float64 angle: no precision loss at long positions
    cos, sin = torch.cos(angle) * amplitude, torch.sin(angle) * amplitude
    out = x.clone()  # the tail (columns >= D) stays exactly x
    if pairing == "neox":  # pairs (i, i + D/2)
        x1, x2 = x[..., : D // 2], x[..., D // 2 : D]
        out[..., : D // 2] = x1 * cos - x2 * sin
        out[..., D // 2 : D] = x2 * cos + x1 * sin
    elif pairing == "interleaved":  # pairs (2i, 2i+1)
        x1, x2 = x[..., 0:D:2], x[..., 1:D:2]
        out[..., 0:D:2] = x1 * cos - x2 * sin
        out[..., 1:D:2] = x2 * cos + x1 * sin
    else:
        raise ValueError(f"unknown pairing {pairing!r}")
    return out


def _sequence_positions(x: torch.Tensor, input_layout: str) -> torch.Tensor:
    """Positions for the sequence layouts: the seq index, broadcast over batch and heads."""
    if input_layout == "1d":
        if x.dim() != 2:
            raise ValueError(f"1d layout wants x [seq_len, head_dim], got {tuple(x.shape)}")
        return torch.arange(x.shape[0], dtype=F64)
    if input_layout == "2d":
        if x.dim() != 4:
            raise ValueError(f"2d layout wants x [batch, seq_len, heads, head_dim], got {tuple(x.shape)}")
        return torch.arange(x.shape[1], dtype=F64).view(1, -1, 1)
    raise ValueError(f"unknown input_layout {input_layout!r}")


def mrope_pair_streams(section, interleaved: bool, pairs: int) -> list[int]:
    """The position stream (0 temporal, 1 height, 2 width) of each of the ``pairs`` frequency pairs.

    Consecutive (HF Qwen2-VL ``recomposition_frequencies``: the frequencies split by
    ``mrope_section``, chunk c from stream c): section[0] zeros, section[1] ones, section[2] twos.
    Interleaved (HF Qwen3-VL): stream 0 everywhere, then every third pair from 1 below
    3 * section[1] is stream 1 and every third pair from 2 below 3 * section[2] is stream 2.
    """
    section = [int(n) for n in section]
    if len(section) != 3 or min(section) < 1 or sum(section) != pairs:
        raise ValueError(f"mrope_section must be 3 positive counts summing to {pairs}, got {section}")
    if not interleaved:
        return [c for c, n in enumerate(section) for _ in range(n)]
    streams = [0] * pairs
    for c in (1, 2):
        for j in range(c, min(3 * section[c], pairs), 3):
            streams[j] = c
    return streams


def mrope_reference(p: dict, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """MRoPE: neox pairs (i, i + D/2), pair i turning by position_ids[stream(i)] * base^(-2i/D)."""
    x = inputs["x"].double()
    D, layout = x.shape[-1], p["input_layout"]
    if p["mrope_section"] is None:
        raise ValueError("MRoPEFwdOp needs mrope_section")
    streams = mrope_pair_streams(p["mrope_section"], bool(p["mrope_interleaved"]), D // 2)
    rows = {"1d": x.shape[:1], "2d": x.shape[:2], "packed": x.shape[:1]}[layout]  # one position per row
    given = inputs.get("position_ids")
    if given is None:
        if layout == "packed":
            raise ValueError("packed MRoPE needs position_ids")
        seq = torch.arange(x.shape[0] if layout == "1d" else x.shape[1], dtype=F64)
        pos = seq.expand(3, *rows)  # text-only: every stream is the sequence index
    else:
        if given.dtype not in (torch.int32, torch.int64) or tuple(given.shape) != (3, *rows):
            raise ValueError(f"position_ids must be int32/int64 of shape {(3, *rows)}, got {tuple(given.shape)}")
        if given.numel() and (int(given.min()) < 0 or int(given.max()) >= 2**24):
            raise ValueError("position_ids outside [0, 2^24)")
        pos = given.to(F64)
    inv = base_inv_freq(p["base"], D)
    angle = torch.zeros(*rows, D // 2, dtype=F64)
    for i, c in enumerate(streams):
        angle[..., i] = pos[c] * inv[i]
    if layout != "1d":
        angle = angle.unsqueeze(-2)  # broadcast over heads
    cos, sin = torch.cos(angle), torch.sin(angle)
    out = x.clone()
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    out[..., : D // 2] = x1 * cos - x2 * sin
    out[..., D // 2:] = x2 * cos + x1 * sin
    return out


def reference(op_name: str, params: dict, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """float64 output of the op for those constructor params and call inputs."""
    p = _params(op_name, params)
    if p.get("input_layout") == "bhsd":  # transformers' [batch, heads, seq, D]: the 2d rotation of its transpose
        if inputs["x"].dim() != 4:
            raise ValueError(f"bhsd layout wants x [batch, heads, seq_len, head_dim], got {tuple(inputs['x'].shape)}")
        x2d = inputs["x"].transpose(1, 2)
        return reference(op_name, {**p, "input_layout": "2d"}, {**inputs, "x": x2d}).transpose(1, 2)
    if op_name == "MRoPEFwdOp":
        return mrope_reference(p, inputs)
    x = inputs["x"].double()
    head_dim = x.shape[-1]
    if op_name == "RoPENeoxPositionIdsFwdOp":
        if "max_position" not in p:
            raise ValueError("RoPENeoxPositionIdsFwdOp needs max_position")
        if x.dim() != 3:
            raise ValueError(f"x must be [tokens, heads, head_dim], got {tuple(x.shape)}")
        pos = inputs["position_ids"]
        if pos.dtype not in (torch.int32, torch.int64) or pos.shape != x.shape[:1]:
            raise ValueError("position_ids must be int32/int64 of shape [tokens]")
        # The anchors never bounds-check (vLLM #14404); the reference refuses to define such output.
        if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= int(p["max_position"])):
            raise ValueError("position_ids outside [0, max_position)")
        rot_dim = head_dim if p["rotary_dim"] is None else int(p["rotary_dim"])
        inv, amp = inv_freq_and_amplitude(op_name, p, rot_dim)
        return rotate(x, pos.view(-1, 1), inv, amp, "neox")  # one position per token, all heads
    pairing = p["rope_layout"] if "rope_layout" in DEFAULTS[op_name] else "neox"  # only some ops choose
    given = inputs.get("position_ids")
    if given is None:
        pos = _sequence_positions(x, p["input_layout"])
    else:
        if given.dtype not in (torch.int32, torch.int64):
            raise ValueError("position_ids must be int32 or int64")
        if given.numel() and (int(given.min()) < 0 or int(given.max()) >= 2**24):
            raise ValueError("position_ids outside [0, 2^24)")
        seq = x.shape[0] if p["input_layout"] == "1d" else x.shape[1]
        if given.shape[-1] != seq or given.dim() > (1 if p["input_layout"] == "1d" else 2):
            raise ValueError(f"position_ids of shape {tuple(given.shape)} do not fit x {tuple(x.shape)}")
        if p["input_layout"] == "1d":
            pos = given.view(-1)
        else:  # [seq] shared by the batch, or [batch, seq]; broadcast over heads
            pos = given.view(*given.shape, 1) if given.dim() == 2 else given.view(1, -1, 1)
    if op_name in ("Phi3LongRoPEFwdOp", "RoPEDynamicNTKFwdOp") and p.get("max_position_id") is None:
        p = {**p, "max_position_id": int(pos.max()) if pos.numel() else 0}
    inv, amp = inv_freq_and_amplitude(op_name, p, head_dim)
    return rotate(x, pos, inv, amp, pairing)


def reference_grad(op_name: str, params: dict, inputs: dict[str, torch.Tensor], grad_out: torch.Tensor) -> torch.Tensor:
    """float64 gradient of sum(reference * grad_out) with respect to x, by autograd of the reference."""
    x = inputs["x"].detach().double().requires_grad_(True)
    out = reference(op_name, params, {**inputs, "x": x})
    (g,) = torch.autograd.grad(out, x, grad_out.double())
    return g


REFERENCES: dict[str, callable] = {name: functools.partial(reference, name) for name in DEFAULTS}
