"""The op that reproduces a Hugging Face transformers config's rotary embedding.

The rules are transformers' own (``modeling_rope_utils.py``: ``standardize_rope_params`` and the
``ROPE_INIT_FUNCTIONS``), read without importing transformers and without modifying the config.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ..targets import Target
from .hooks import BATCHED, RoPEHooks
from .ops import (MRoPEFwdOp, Phi3LongRoPEFwdOp, RoPEDynamicNTKFwdOp, RoPEFwdOp, RoPELinearFwdOp,
                  RoPELlama31FwdOp, YaRNFwdOp)

__all__ = ["from_hf_config", "SUPPORTED_ROPE_TYPES", "MROPE_MODEL_TYPES"]

#: rope types :func:`from_hf_config` serves, and the op each maps to
SUPPORTED_ROPE_TYPES = {
    "default": "RoPEFwdOp (RoPELinearFwdOp with partial rotary)",
    "linear": "RoPELinearFwdOp",
    "llama3": "RoPELlama31FwdOp",
    "yarn": "YaRNFwdOp",
    "longrope": "Phi3LongRoPEFwdOp",
    "dynamic": "RoPEDynamicNTKFwdOp",
    "mrope": "MRoPEFwdOp (default rope of the model types in MROPE_MODEL_TYPES)",
}

#: model types whose rotary embedding is MRoPE whatever the rope block says, as transformers codes
#: them: (interleaved, the mrope_section transformers takes when the config has none). The
#: composite configs (``qwen2_vl``, ...) hold the text model's settings in ``text_config``.
MROPE_MODEL_TYPES: dict[str, tuple[bool, tuple[int, int, int]]] = {
    "qwen2_vl": (False, (16, 24, 24)), "qwen2_vl_text": (False, (16, 24, 24)),
    "qwen2_5_vl": (False, (16, 24, 24)), "qwen2_5_vl_text": (False, (16, 24, 24)),
    "qwen3_vl": (True, (24, 20, 20)), "qwen3_vl_text": (True, (24, 20, 20)),
    "qwen3_vl_moe": (True, (24, 20, 20)), "qwen3_vl_moe_text": (True, (24, 20, 20)),
}

_NAME = "from_hf_config"


class _Config:
    """Reads a config object or a config.json mapping; errors name the field as the config spells it."""

    def __init__(self, config: Any) -> None:
        self._get = self._reader(config)
        self.model_type = self.get("model_type")
        text = self.get("text_config")
        if text is not None and self.model_type in MROPE_MODEL_TYPES:
            # a vision-language model's config: its text model's rope settings (a flat config.json
            # of the same model type keeps them at the top level, and is read as it is)
            self._get = self._reader(text)
        rp, self.block = self.get("rope_parameters"), "rope_parameters"
        if not rp:
            rp, self.block = self.get("rope_scaling"), "rope_scaling"
        if rp is None:
            rp = {}
        if not isinstance(rp, Mapping):
            raise TypeError(f"{_NAME}: config.{self.block}: expected a dict or None, got {type(rp).__name__}")
        labels = self.get("_rope_type_labels") or self.get("layer_types") or ()
        nested = [k for k in rp if k in labels]
        if nested:
            raise NotImplementedError(f"{_NAME}: config.{self.block}: per-layer-type rope parameters "
                                      f"(keys {nested}) are not supported")
        self.rp = dict(rp)

    @staticmethod
    def _reader(config: Any) -> Any:
        if isinstance(config, Mapping):
            return config.get
        if hasattr(config, "__dict__") or hasattr(config, "__getattr__"):
            return lambda name, default=None: getattr(config, name, default)
        raise TypeError(f"{_NAME}: config: expected a transformers PretrainedConfig or a config.json "
                        f"dict, got {type(config).__name__}")

    def get(self, name: str, default: Any = None) -> Any:
        value = self._get(name, default)
        return default if value is None else value

    def field(self, key: str) -> str:
        return f"config.{self.block}[{key!r}]"

    def number(self, key: str, value: Any, *, positive: bool = True) -> float:
        """A finite real number (> 0 when ``positive``), the error naming ``key``."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{_NAME}: {key}: expected a number, got {type(value).__name__} {value!r}")
        v = float(value)
        if not math.isfinite(v) or (positive and v <= 0):
            raise ValueError(f"{_NAME}: {key}: expected a finite number{' > 0' if positive else ''}, got {value!r}")
        return v

    def whole(self, key: str, value: Any) -> int:
        """A whole number > 0 (an integral float is accepted: configs are JSON)."""
        v = self.number(key, value)
        if v != int(v):
            raise ValueError(f"{_NAME}: {key}: expected a whole number, got {value!r}")
        return int(v)

    def required(self, key: str) -> Any:
        if self.rp.get(key) is None:
            raise ValueError(f"{_NAME}: {self.field(key)}: expected a value for rope_type "
                             f"{self.rp.get('rope_type', self.rp.get('type'))!r}, got none")
        return self.rp[key]

    def factors(self, key: str, n: int) -> list[float]:
        value = self.required(key)
        if isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__len__"):
            raise TypeError(f"{_NAME}: {self.field(key)}: expected a list of {n} numbers, got {type(value).__name__}")
        out = [self.number(f"{self.field(key)}[{i}]", v) for i, v in enumerate(value)]
        if len(out) != n:
            raise ValueError(f"{_NAME}: {self.field(key)}: expected {n} numbers (rotary dim // 2), got {len(out)}")
        return out


def from_hf_config(config: Any, *, target: str | Target | None = None, input_layout: str = "2d") -> RoPEHooks:
    """The tileops op reproducing a transformers config's rotary embedding.

    Reads ``config.rope_parameters`` (transformers 5, ``rope_theta`` inside) or
    ``config.rope_scaling`` with ``config.rope_theta`` (transformers 4), ``partial_rotary_factor``
    and ``head_dim`` (else ``hidden_size // num_attention_heads``), with transformers' rules for
    defaults (``original_max_position_embeddings`` from the config's own attribute first, as for
    Phi-3, then the rope block, then ``max_position_embeddings``). The config is not modified.

    | rope type | op |
    |---|---|
    | ``default`` | ``RoPEFwdOp``; ``RoPELinearFwdOp(factor=1, rotary_dim=...)`` with partial rotary |
    | ``linear`` | ``RoPELinearFwdOp`` |
    | ``llama3`` | ``RoPELlama31FwdOp`` |
    | ``yarn`` | ``YaRNFwdOp``, ``attn_factor`` set so the amplitude equals HF's ``attention_factor`` |
    | ``default``, ``yarn`` with ``rope_interleave`` (DeepSeek-V2/V3) | the same ops with ``rope_layout="interleaved"`` |
    | ``longrope`` | ``Phi3LongRoPEFwdOp`` (short/long switch per call, on the device) |
    | ``dynamic`` | ``RoPEDynamicNTKFwdOp`` (HF's length state kept on the device) |
    | Qwen2-VL, Qwen2.5-VL (``default``/``mrope``) | ``MRoPEFwdOp`` with the config's ``mrope_section`` |
    | Qwen3-VL (``default``) | ``MRoPEFwdOp(mrope_interleaved=True)`` |

    Args:
        config: A ``transformers.PretrainedConfig`` (or any object with those attributes), or a
            ``config.json`` dict.
        target (str | None): Passed to the op. Default None (decided by the first call's device).
        input_layout (str): The op's layout: ``"2d"``, x ``[batch, seq, heads, head_dim]``, or
            ``"bhsd"``, transformers' own ``[batch, heads, seq, head_dim]`` (what its attention hands
            ``apply_rotary_pos_emb``: rotated where it lies, no transposes). Default ``"2d"``.

    The MRoPE model types (:data:`MROPE_MODEL_TYPES`, read from ``config.model_type``; a composite
    vision-language config is read through its ``text_config``) get ``MRoPEFwdOp``, called with
    ``position_ids`` ``[3, batch, seq]`` as their rotary embedding receives them.

    Returns:
        The op; call it as ``op(x, position_ids=...)`` with x ``[batch, seq, heads, head_dim]``
        (``[batch, heads, seq, head_dim]`` with ``input_layout="bhsd"``).
        With ``rope_interleave`` (DeepSeek's rope part, ``head_dim`` being ``qk_rope_head_dim``) the
        op rotates the pairs ``(2i, 2i+1)`` where they lie; transformers returns the same values
        de-interleaved (``cat(evens, odds)``). q and k come out in the same order either way, so
        their dot products, and attention, are the same.

    Raises:
        NotImplementedError: A rope type other than those above (``proportional``, ``mrope`` on a
            model type whose MRoPE layout is not known, a scaled rope type with MRoPE, ...),
            per-layer-type rope parameters, ``partial_rotary_factor < 1`` with ``llama3`` or
            ``yarn``, ``rope_interleave`` with another rope type or with partial rotary, an odd
            rotary width, YaRN with ``truncate=False``, or rotary settings in a spelling not read
            (``rotary_dim`` of GPT-J/CodeGen, ``rotary_pct``/``rotary_emb_base`` of a transformers 4
            GPT-NeoX config.json, a ``rotary_dim`` the rope block contradicts).
        ValueError: A config whose model has no rotary embedding: none of ``rope_parameters``,
            ``rope_scaling``, ``rope_theta``, ``partial_rotary_factor`` and the older spellings
            (GPT-2, BERT, T5, OPT, Bloom, ...), or ``alibi`` set (Falcon); the message names the
            model type.
        TypeError, ValueError: A config field of the wrong type or value; the message names it.
    """
    if input_layout not in BATCHED:  # the layouts with a batch and a heads dim, which HF's tensors have
        raise ValueError(f"{_NAME}: input_layout: expected one of {', '.join(map(repr, BATCHED))}, "
                         f"got {input_layout!r}")
    c = _Config(config)
    _check_rotary(c)
    rp = c.rp
    rope_type = rp.get("rope_type", rp.get("type")) or "default"
    if not isinstance(rope_type, str):
        raise TypeError(f"{_NAME}: {c.field('rope_type')}: expected a str, got {type(rope_type).__name__}")
    if c.model_type in MROPE_MODEL_TYPES:
        return _mrope(c, rope_type, target, input_layout)
    if rope_type == "mrope":
        raise NotImplementedError(f"{_NAME}: {c.field('rope_type')}: rope type 'mrope' is served for the model "
                                  f"types {', '.join(MROPE_MODEL_TYPES)}, got config.model_type "
                                  f"{c.model_type!r} (whose MRoPE layout is not known)")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(f"{_NAME}: {c.field('rope_type')}: rope type {rope_type!r} is not supported; "
                                  f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")

    base = _base(c)

    head_dim, head_key = _head_dim(c)

    prf = rp.get("partial_rotary_factor")
    prf_key = c.field("partial_rotary_factor")
    if prf is None:
        prf, prf_key = c.get("partial_rotary_factor", 1.0), "config.partial_rotary_factor"
    prf = c.number(prf_key, prf)
    if prf > 1:
        raise ValueError(f"{_NAME}: {prf_key}: expected a value in (0, 1], got {prf!r}")
    dim = int(head_dim * prf)
    if dim <= 0 or dim % 2:
        raise NotImplementedError(f"{_NAME}: {prf_key}: rotary width int({head_key} {head_dim} * "
                                  f"partial_rotary_factor {prf}) = {dim} is not a positive even number "
                                  f"(HF rotates {dim + dim % 2} columns with exponents over {dim}; no op does)")
    rotary_dim = None if dim == head_dim else dim
    given_dim = c.get("rotary_dim")
    if given_dim is not None and given_dim != dim:  # MiniMax-M2's config.json spelling of partial rotary
        raise NotImplementedError(f"{_NAME}: config.rotary_dim: {given_dim} rotated columns are not read "
                                  f"(transformers 5 turns it into partial_rotary_factor; load the config with "
                                  f"transformers); the rope block gives {dim} of {head_key} {head_dim}")
    if rotary_dim is not None and rope_type in ("llama3", "yarn"):
        raise NotImplementedError(f"{_NAME}: {prf_key}: partial_rotary_factor {prf} with rope type "
                                  f"{rope_type!r} is not supported (only default, linear and longrope)")

    def original_max() -> int:
        # transformers' standardize_rope_params: the config's own attribute wins (Phi-3), then the
        # rope block, then max_position_embeddings.
        for key, value in (("config.original_max_position_embeddings", c.get("original_max_position_embeddings")),
                           (c.field("original_max_position_embeddings"), rp.get("original_max_position_embeddings")),
                           ("config.max_position_embeddings", c.get("max_position_embeddings"))):
            if value is not None:
                return c.whole(key, value)
        raise ValueError(f"{_NAME}: {c.field('original_max_position_embeddings')}: expected a value "
                         f"(or config.max_position_embeddings), got none")

    def max_positions() -> int:
        value = c.get("max_position_embeddings")
        if value is None:
            raise ValueError(f"{_NAME}: config.max_position_embeddings: expected a value for rope type "
                             f"{rope_type!r}, got none")
        return c.whole("config.max_position_embeddings", value)

    interleave = c.get("rope_interleave", False)
    if not isinstance(interleave, bool):
        raise TypeError(f"{_NAME}: config.rope_interleave: expected a bool, got {type(interleave).__name__}")
    if interleave and (rope_type not in ("default", "yarn") or rotary_dim is not None):
        what = f"rope type {rope_type!r}" if rotary_dim is None else f"partial_rotary_factor {prf}"
        raise NotImplementedError(f"{_NAME}: config.rope_interleave: interleaved pairs with {what} are not "
                                  f"supported (only default and yarn on the whole head)")
    pairing = "interleaved" if interleave else "neox"

    if rope_type == "default":
        if rotary_dim is None:
            return RoPEFwdOp(pairing, input_layout, base, target=target)
        return RoPELinearFwdOp(input_layout, base, 1.0, rotary_dim, target=target)

    if rope_type == "linear":
        factor = c.number(c.field("factor"), c.required("factor"))
        return RoPELinearFwdOp(input_layout, base, factor, rotary_dim, target=target)

    if rope_type == "llama3":
        factor = c.number(c.field("factor"), c.required("factor"))
        low = c.number(c.field("low_freq_factor"), c.required("low_freq_factor"))
        high = c.number(c.field("high_freq_factor"), c.required("high_freq_factor"))
        if low == high:
            raise ValueError(f"{_NAME}: {c.field('high_freq_factor')}: expected a value != low_freq_factor "
                             f"(the band's blend divides by their difference), got both {low}")
        return RoPELlama31FwdOp(input_layout, base, factor, low, high, original_max(), target=target)

    if rope_type == "yarn":
        return _yarn(c, base, original_max, max_positions, target, pairing, input_layout)

    if rope_type == "dynamic":
        factor = c.number(c.field("factor"), c.required("factor"))
        if factor < 1:
            raise ValueError(f"{_NAME}: {c.field('factor')}: expected a factor >= 1 for dynamic NTK, got {factor}")
        return RoPEDynamicNTKFwdOp(input_layout, base, factor, max_positions(), rotary_dim, target=target)

    # longrope
    omp = original_max()
    mpe = max_positions()
    factor = rp.get("factor")
    factor = mpe / omp if factor is None else c.number(c.field("factor"), factor)
    attention = rp.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(omp))
    else:
        attention = c.number(c.field("attention_factor"), attention)
    import torch

    short = torch.tensor(c.factors("short_factor", dim // 2), dtype=torch.float64)
    long = torch.tensor(c.factors("long_factor", dim // 2), dtype=torch.float64)
    return Phi3LongRoPEFwdOp(input_layout, base, short, long, omp, mpe, attention, rotary_dim, target=target)


#: what a transformers config holds when its model has rotary embeddings: the rope block
#: (``rope_parameters``, version 5; ``rope_scaling`` and ``rope_theta``, version 4), and the older
#: spellings ``partial_rotary_factor`` (Phi), ``rotary_dim`` (GPT-J, CodeGen) and ``rotary_pct``,
#: ``rotary_emb_base`` (GPT-NeoX before version 5)
_ROPE_KEYS = ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor", "rotary_dim", "rotary_pct",
              "rotary_emb_base")


def _check_rotary(c: _Config) -> None:
    """Refuse a config whose model has no rotary embedding (GPT-2, BERT, T5, OPT, Bloom, MPT, ... hold
    none of :data:`_ROPE_KEYS`; Falcon with ``alibi`` uses ALiBi biases instead), and the rotary
    settings this module does not read, rather than return a RoPE with default settings. The MRoPE
    model types are rotary by type (a flat config.json of theirs may hold no rope key)."""
    kind = f"a {c.model_type!r} config" if c.model_type else "a config"
    if c.get("alibi"):  # Falcon's switch (its config carries rope_parameters either way)
        raise ValueError(f"{_NAME}: config: expected the config of a model with rotary position embeddings, got "
                         f"{kind} with config.alibi set: its attention uses ALiBi biases, not RoPE")
    if c.model_type not in MROPE_MODEL_TYPES and not any(c.get(k) not in (None, {}) for k in _ROPE_KEYS):
        text = c.get("text_config")
        hint = " (its text_config has them: pass config.text_config)" if text is not None and any(
            _Config._reader(text)(k) not in (None, {}) for k in _ROPE_KEYS) else ""
        raise ValueError(f"{_NAME}: config: expected the config of a model with rotary position embeddings "
                         f"(rope_parameters, or rope_scaling/rope_theta), got {kind} with no rotary settings: "
                         f"its model has no RoPE{hint}")
    legacy = [k for k in ("rotary_pct", "rotary_emb_base") if c.get(k) is not None]
    if c.get("rotary_dim") is not None and not any(c.get(k) is not None for k in _ROPE_KEYS[:3]):
        legacy.append("rotary_dim")  # GPT-J, CodeGen: interleaved pairs on part of the head, no rope block
    if legacy:
        raise NotImplementedError(f"{_NAME}: config.{legacy[0]}: {kind}'s rotary settings in the spelling of "
                                  f"{', '.join(legacy)} are not read (GPT-J and CodeGen rotate interleaved pairs "
                                  f"of the first rotary_dim columns, which no op serves; a transformers 4 "
                                  f"GPT-NeoX config.json: load it with transformers 5, which moves them into "
                                  f"rope_parameters)")


def _head_dim(c: _Config) -> tuple[int, str]:
    """(head_dim, how the config gives it): ``head_dim``, else ``hidden_size // num_attention_heads``."""
    head_dim = c.get("head_dim")
    if head_dim is not None:
        return c.whole("config.head_dim", head_dim), "head_dim"
    hidden, heads = c.get("hidden_size"), c.get("num_attention_heads")
    if hidden is None or heads is None:
        raise ValueError(f"{_NAME}: config.head_dim: expected head_dim, or hidden_size and "
                         f"num_attention_heads, got none of them")
    return (c.whole("config.hidden_size", hidden) // c.whole("config.num_attention_heads", heads),
            "hidden_size // num_attention_heads")


def _base(c: _Config) -> float:
    """``rope_theta`` from the rope block, else the config's attribute, else its class default."""
    theta_key = c.field("rope_theta") if c.rp.get("rope_theta") is not None else "config.rope_theta"
    theta = c.rp.get("rope_theta")
    if theta is None:
        theta = c.get("rope_theta", c.get("default_theta", 10000.0))
    return c.number(theta_key, theta)


def _mrope(c: _Config, rope_type: str, target: Any, layout: str) -> MRoPEFwdOp:
    """Qwen2-VL / Qwen2.5-VL / Qwen3-VL: MRoPE on base frequencies, as their rotary embeddings
    compute it. They use the whole head (``head_dim``, else ``hidden_size // num_attention_heads``;
    ``partial_rotary_factor`` is not read), ``mrope_section`` from the rope block or the model type's
    default, and the layout of the model type (Qwen3-VL interleaves whatever
    ``mrope_interleaved`` says)."""
    interleaved, default_section = MROPE_MODEL_TYPES[c.model_type]
    if rope_type not in ("default", "mrope"):
        raise NotImplementedError(f"{_NAME}: {c.field('rope_type')}: rope type {rope_type!r} with MRoPE "
                                  f"({c.model_type}) is not supported; only the default frequencies")
    head_dim, _ = _head_dim(c)
    key = c.field("mrope_section")
    section = c.rp.get("mrope_section")
    if section is None:
        section, key = default_section, f"{key} (the default of {c.model_type})"
    if isinstance(section, (str, bytes, Mapping)) or not hasattr(section, "__len__") or len(section) != 3:
        raise ValueError(f"{_NAME}: {key}: expected 3 counts (temporal, height, width), got {section!r}")
    section = [c.whole(f"{key}[{i}]", n) for i, n in enumerate(section)]
    if 2 * sum(section) != head_dim:
        raise ValueError(f"{_NAME}: {key}: expected counts summing to head_dim / 2 = {head_dim / 2:g}, got "
                         f"{section} (sum {sum(section)})")
    return MRoPEFwdOp(section, layout, _base(c), interleaved, target=target)


def _yarn(c: _Config, base: float, original_max: Any, max_positions: Any, target: Any, pairing: str,
          layout: str) -> YaRNFwdOp:
    """HF's yarn on YaRNFwdOp: same ramp (truncated), amplitude mapped through ``attn_factor``."""
    rp = c.rp
    if base == 1:
        raise ValueError(f"{_NAME}: rope_theta: expected a base != 1 for yarn (it divides by ln base), got 1")
    if not rp.get("truncate", True):
        raise NotImplementedError(f"{_NAME}: {c.field('truncate')}: yarn with truncate=False (an unrounded "
                                  f"correction range) is not supported; YaRNFwdOp floors and ceils it")
    omp = original_max()
    factor = rp.get("factor")
    factor = max_positions() / omp if factor is None else c.number(c.field("factor"), factor)

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention = rp.get("attention_factor")
    if attention is not None:
        attention = c.number(c.field("attention_factor"), attention)
    else:
        mscale, mscale_all = rp.get("mscale"), rp.get("mscale_all_dim")
        if mscale and mscale_all:  # HF's test: both given and non-zero
            mscale = c.number(c.field("mscale"), mscale, positive=False)
            mscale_all = c.number(c.field("mscale_all_dim"), mscale_all, positive=False)
            attention = get_mscale(factor, mscale) / get_mscale(factor, mscale_all)
        else:
            attention = get_mscale(factor)
    # YaRNFwdOp's amplitude is get_mscale(scale) * attn_factor (vLLM); HF's attention_factor replaces it
    attn_factor = attention / get_mscale(factor)
    beta_fast = c.number(c.field("beta_fast"), rp.get("beta_fast") or 32)  # HF: `or 32`, so 0 means 32
    beta_slow = c.number(c.field("beta_slow"), rp.get("beta_slow") or 1)
    return YaRNFwdOp(layout, base, factor, omp, beta_fast, beta_slow, attn_factor, rope_layout=pairing,
                     target=target)
