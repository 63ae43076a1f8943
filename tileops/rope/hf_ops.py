"""RoPE ops for Hugging Face rope types that the five base ops do not cover exactly.

``RoPELinearFwdOp`` (HF ``linear``, and ``default`` with ``partial_rotary_factor < 1``) and
``Phi3LongRoPEFwdOp`` (HF ``longrope`` with its short/long switch). :func:`tileops.rope.from_hf_config`
picks them; they are ordinary ops (manifests in ``manifests/rope/``) and may be used directly.
"""

from __future__ import annotations

from typing import Any

import torch

from ..targets import Target
from . import freqs
from .ops import _RoPEBase

__all__ = ["RoPELinearFwdOp", "Phi3LongRoPEFwdOp"]


class _PartialRotary(_RoPEBase):
    """Neox pairing on the first ``rotary_dim`` columns; the rest are copied unchanged."""

    def rotated_width(self, head_dim: int) -> int:
        rd = self.params["rotary_dim"]
        return head_dim if rd is None else rd

    def forward(self, x: torch.Tensor, *, position_ids: torch.Tensor | None = None, key: torch.Tensor | None = None,
                out: torch.Tensor | None = None, key_out: torch.Tensor | None = None) -> Any:
        """Rotate ``x``; runs on ``op(x)``. Shapes and dtype are taken from the first call.

        Args:
            x (torch.Tensor): ``[seq_len, head_dim]`` (``input_layout="1d"``) or
                ``[batch, seq_len, num_heads, head_dim]`` (``"2d"``); float16, bfloat16 or float32;
                ``head_dim`` even and at least ``rotary_dim``. Not modified.
            position_ids (torch.Tensor | None): int32 or int64 on the device of ``x``, ``[seq_len]``
                (shared by the batch) or ``[batch, seq_len]`` (``"2d"``), each in ``[0, 2^24)``.
                None (default) means ``0 .. seq_len - 1``.
            key (torch.Tensor | None): Keyword-only. The attention key, rotated at the same positions
                in the same launch with cos/sin composed once: like ``x`` but with its own number of
                heads (GQA, MQA) and strides; same dtype. Not modified.
            out (torch.Tensor | None): Keyword-only. Where to write the result, shaped and typed like
                ``x``, any strides with a contiguous last dim; ``out=x`` rotates in place. It may not
                otherwise overlap another argument. Not with gradients.
            key_out (torch.Tensor | None): Keyword-only. Where to write the rotated key (with ``key``).

        Returns:
            torch.Tensor | tuple: ``out``, a new tensor like ``x`` unless ``out=`` is given; with
            ``key``, the pair ``(out, key_out)``.

        Raises:
            RuntimeError: ``out=``/``key_out=`` while an input requires grad.
            TypeError: ``x`` is not a tensor, or has a dtype outside those listed.
            ValueError: Wrong number of dims for ``input_layout``, an odd ``head_dim``,
                ``rotary_dim`` above ``head_dim``, or a position out of range.
        """
        return self._call({"x": x, "position_ids": position_ids, "key": key}, {"out": out, "key_out": key_out})


class RoPELinearFwdOp(_PartialRotary):
    """RoPE with linear position interpolation and partial rotary (neox pairing).

    ``inv_freq[i] = base^(-2i/D) / factor`` with ``D = rotary_dim`` (default ``head_dim``): position
    ``p`` turns by ``(p / factor) * base^(-2i/D)``. The first ``rotary_dim`` columns of each head
    rotate, pair ``(i, i + D/2)``; the others are copied unchanged. With ``factor=1`` this is plain
    RoPE with partial rotary (HF ``default`` with ``partial_rotary_factor < 1``, as Phi-3 uses it).

    References: HF transformers ``_compute_linear_scaling_rope_parameters``; Chen et al., 2023,
    arXiv:2306.15595 (position interpolation).

    Examples:
        >>> op = RoPELinearFwdOp(input_layout="2d", factor=4.0, rotary_dim=64)
        >>> out = op(torch.randn(2, 512, 8, 128))
    """

    def __init__(self, input_layout: str = "1d", base: float = 10000.0, factor: float = 1.0,
                 rotary_dim: int | None = None, *, target: str | Target | None = None) -> None:
        """Build the op; kernels are compiled at the first call.

        Args:
            input_layout (str): ``"1d"`` (x ``[seq_len, head_dim]``) or ``"2d"`` (x
                ``[batch, seq_len, num_heads, head_dim]``). Default ``"1d"``.
            base (float): The frequency base; > 0. Default ``10000.0``.
            factor (float): The interpolation factor (HF ``factor``); > 0. Default ``1.0``.
            rotary_dim (int | None): How many leading columns of each head rotate; even, > 0 and
                at most ``head_dim``. None (default) rotates all of them.
            target (str | None): Which set of kernels serves this op — a target name, BUILTIN
                for the in-tree kernels, or None to decide from the input device. Default None.

        Raises:
            ValueError: ``base`` or ``factor`` not finite or not > 0, ``rotary_dim`` odd or not
                positive, or an unknown ``target``.
            TypeError: A parameter has the wrong type.
        """
        self._setup({"input_layout": input_layout, "base": base, "factor": factor, "rotary_dim": rotary_dim},
                    target)

    def frequencies(self, rot: int) -> tuple[torch.Tensor, float]:
        p = self.params
        return freqs.base_inv_freq(p["base"], rot) / p["factor"], 1.0


class Phi3LongRoPEFwdOp(_PartialRotary):
    """HF's ``longrope`` (Phi-3, Phi-3.5, Phi-4-mini): short or long factors chosen per call.

    ``inv_freq[i] = 1 / (factor_i * base^(2i/D))`` with ``D = rotary_dim`` (default ``head_dim``),
    where ``factor`` is ``long_factor`` when ``max(position_ids) + 1 > original_max_position_embeddings``
    and ``short_factor`` otherwise; without ``position_ids`` the test is ``seq_len >
    original_max_position_embeddings``. The choice is one per call for the whole batch, as in HF's
    dynamic longrope update: a batch with one long row uses the long factors for every row. It is
    made on the device (a 0-dim index tensor picks one of two tables), so the positions are never read
    on the host. cos and sin are multiplied by ``attention_factor``; None computes HF's default,
    ``sqrt(1 + ln(s) / ln(original_max_position_embeddings))`` with ``s = max_position_embeddings /
    original_max_position_embeddings`` when ``s > 1``, else 1. Columns from ``rotary_dim`` on are
    copied unchanged.

    ``LongRoPEFwdOp`` is the single-table form (one set of factors, no switch).

    References: LongRoPE (Ding et al., 2024, arXiv:2402.13753); HF transformers
    ``_compute_longrope_parameters`` and ``dynamic_rope_update``.
    """

    def __init__(self, input_layout: str = "1d", base: float = 10000.0, short_factor: torch.Tensor | None = None,
                 long_factor: torch.Tensor | None = None, original_max_position_embeddings: int = 4096,
                 max_position_embeddings: int = 4096, attention_factor: float | None = None,
                 rotary_dim: int | None = None, *, target: str | Target | None = None) -> None:
        """Build the op; kernels are compiled at the first call.

        Args:
            input_layout (str): ``"1d"`` (x ``[seq_len, head_dim]``) or ``"2d"`` (x
                ``[batch, seq_len, num_heads, head_dim]``). Default ``"1d"``.
            base (float): The frequency base; > 0. Default ``10000.0``.
            short_factor (torch.Tensor | None): Shape ``(rotary_dim // 2,)``, the divisors used
                while positions stay below ``original_max_position_embeddings``; finite, non-zero;
                copied at construction. None (default) means all ones.
            long_factor (torch.Tensor | None): The same for longer positions. None means all ones.
            original_max_position_embeddings (int): The pre-training context length, where the
                switch happens; > 1. Default ``4096``.
            max_position_embeddings (int): The extended context length; sets the default
                ``attention_factor``; > 0. Default ``4096``.
            attention_factor (float | None): The amplitude of cos and sin; > 0. None (default)
                computes HF's default from the two lengths.
            rotary_dim (int | None): How many leading columns of each head rotate; even, > 0 and
                at most ``head_dim``. None (default) rotates all of them.
            target (str | None): Which set of kernels serves this op — a target name, BUILTIN
                for the in-tree kernels, or None to decide from the input device. Default None.

        Raises:
            ValueError: A zero or non-finite factor, a factor tensor that is not 1-D, a length not
                in range, ``attention_factor <= 0``, ``rotary_dim`` odd or not positive, or an
                unknown ``target``. A factor length other than ``rotary_dim // 2`` is reported at
                the first call.
            TypeError: A parameter has the wrong type.
        """
        self._setup({"input_layout": input_layout, "base": base, "short_factor": short_factor,
                     "long_factor": long_factor,
                     "original_max_position_embeddings": original_max_position_embeddings,
                     "max_position_embeddings": max_position_embeddings, "attention_factor": attention_factor,
                     "rotary_dim": rotary_dim}, target)
        for arg in ("short_factor", "long_factor"):
            self.params[arg] = freqs.factor_table(self.name, arg, self.params[arg], "rotary_dim // 2")

    def _check_more(self, tensors: Any, dims: Any) -> None:
        super()._check_more(tensors, dims)
        rot = self.rotated_width(dims["head_dim"])
        for arg in ("short_factor", "long_factor"):
            f = self.params[arg]
            if f is not None and f.shape[0] != rot // 2:
                raise ValueError(f"{self.name}: {arg}: expected length rotary_dim // 2 = {rot // 2} "
                                 f"(rotated width {rot} of head_dim {dims['head_dim']}), got length {f.shape[0]}")

    def amplitude(self) -> float:
        """``attention_factor``, or HF's default from the two lengths."""
        p = self.params
        if p["attention_factor"] is not None:
            return p["attention_factor"]
        return freqs.longrope_amplitude(p["max_position_embeddings"], p["original_max_position_embeddings"])

    def frequencies(self, rot: int) -> tuple[torch.Tensor, float]:
        """The short table: what a call at positions below the switch uses."""
        return freqs.longrope_inv_freq(self.params["base"], rot, self.params["short_factor"]), self.amplitude()

    def table_choices(self, rot: int) -> list[tuple[torch.Tensor, float]]:
        """``[short, long]``: :meth:`choose_table` picks one per call."""
        long = freqs.longrope_inv_freq(self.params["base"], rot, self.params["long_factor"])
        return [self.frequencies(rot), (long, self.amplitude())]

    def choose_table(self, position_ids: torch.Tensor | None, seq_len: int) -> int | torch.Tensor:
        """1 (long) when ``max(position_ids) + 1 > original_max_position_embeddings``, else 0; a
        0-dim int64 tensor on the positions' device, so nothing is read on the host."""
        omp = self.params["original_max_position_embeddings"]
        if position_ids is None:
            return int(seq_len > omp)
        return (position_ids.max() + 1 > omp).long()
