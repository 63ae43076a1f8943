"""The RoPE ops: rotary position embedding with base and scaled frequencies."""

from __future__ import annotations

from typing import Any

import torch

from ..op import Op
from ..targets import Target
from . import freqs
from .tables import DIGITS, LO, RopeTables

#: positions the digit tables cover: [0, 2^24)
MAX_POSITION = LO**DIGITS

__all__ = ["RoPEFwdOp", "RoPENeoxPositionIdsFwdOp", "RoPELlama31FwdOp", "YaRNFwdOp", "LongRoPEFwdOp"]



class _RoPEBase(Op):
    """What the five RoPE ops share: frequencies -> tables -> one kernel builder."""

    pairing = "neox"

    @property
    def layout(self) -> str:
        """``"1d"``, ``"2d"`` or ``"ids"`` (position ids)."""
        return self.params["input_layout"]

    def rotated_width(self, head_dim: int) -> int:
        return head_dim

    def frequencies(self, rot: int) -> tuple[torch.Tensor, float]:
        """float64 inverse frequencies ``(rot // 2,)`` and the amplitude applied to cos and sin."""
        return freqs.base_inv_freq(self.params["base"], rot), 1.0

    def table_choices(self, rot: int) -> list[tuple[torch.Tensor, float]]:
        """The frequency sets a call may pick from (:meth:`choose_table`); most ops have one."""
        return [self.frequencies(rot)]

    def choose_table(self, position_ids: torch.Tensor | None, seq_len: int) -> "int | torch.Tensor":
        """Which of :meth:`table_choices` a call uses: an int, or a 0-dim int64 tensor on the
        device when the choice depends on position values (never read on the host)."""
        return 0

    def _check_more(self, tensors: Any, dims: Any) -> None:
        key, x = tensors.get("key"), tensors["x"]
        if key is not None and key.dtype != x.dtype:
            raise TypeError(f"{self.name}: key: expected dtype {str(x.dtype).replace('torch.', '')} (that of x), "
                            f"got {str(key.dtype).replace('torch.', '')}")

    def position_limit(self) -> int:
        """Positions must lie in ``[0, position_limit())``: 2^24, what the digit tables cover."""
        return MAX_POSITION

    def _tables(self, rot: int) -> list[RopeTables]:
        # kept on the op (not in a class-level cache), so tables go when the op goes
        cache = self.__dict__.setdefault("_table_cache", {})
        t = cache.get(rot)
        if t is None:
            t = cache[rot] = [RopeTables(inv, amp) for inv, amp in self.table_choices(rot)]
        return t

    def _raise_bad_position(self, position_ids: torch.Tensor, when: str = "") -> None:
        """Raise the ValueError naming the first position outside ``[0, position_limit())``;
        ``when`` says which call it was, if not this one."""
        limit = self.position_limit()
        bound = "max_position" if "max_position" in self.params else "2^24"
        bad = ((position_ids < 0) | (position_ids >= limit)).nonzero()
        if bad.shape[0] == 0:  # the caller changed the tensor since the kernel read it
            raise ValueError(f"{self.name}: position_ids: expected every value in [0, {bound}={limit}); "
                             f"{when or 'this call'} read one outside (the tensor has changed since)")
        idx = tuple(int(i) for i in bad[0])
        raise ValueError(f"{self.name}: position_ids: expected every value in [0, {bound}={limit}), "
                         f"got position_ids[{', '.join(map(str, idx))}] = {int(position_ids[idx])}"
                         + (f" ({when})" if when else ""))


class RoPEFwdOp(_RoPEBase):
    """Rotary position embedding (RoPE) with the base frequencies, neox or interleaved pairing.

    Rotates each pair of elements of every head by the angle ``p * base^(-2i/D)``, where ``p`` is
    the row's position in the sequence and ``i`` the pair index: with ``rope_layout="neox"`` (GPT-NeoX,
    HF ``rotate_half``) pair ``i`` is ``(x[i], x[i + D/2])``; with ``"interleaved"`` (GPT-J,
    RoFormer, Meta's Llama) it is ``(x[2i], x[2i+1])``. One op serves both conventions. Arithmetic is
    fp32 whatever the input dtype, with one rounding at the store; cos/sin come from float64 angles,
    so accuracy does not degrade with position.

    References: GPT-NeoX and HF transformers (``rotate_half``); RoFormer (Su et al., 2021,
    arXiv:2104.09864).

    Examples:
        >>> op = RoPEFwdOp(rope_layout="neox", input_layout="2d")
        >>> out = op(torch.randn(2, 2048, 32, 128, dtype=torch.bfloat16, device="cuda"))
    """

    def __init__(self, rope_layout: str = "neox", input_layout: str = "1d", base: float = 10000.0, *,
                 target: str | Target | None = None) -> None:
        """Build the op; kernels are compiled at the first call.

        Args:
            rope_layout (str): Which elements pair up: ``"neox"`` pairs ``(i, i + D/2)``,
                ``"interleaved"`` pairs ``(2i, 2i+1)``. Default ``"neox"``.
            input_layout (str): ``"1d"``: x is ``[seq_len, head_dim]``; ``"2d"``: x is
                ``[batch, seq_len, num_heads, head_dim]``. Default ``"1d"``.
            base (float): The frequency base, ``inv_freq[i] = base^(-2i/D)``; must be > 0.
                Default ``10000.0``.
            target (str | None): Which set of kernels serves this op — a target name, BUILTIN
                for the in-tree kernels, or None to decide from the input device. Default None.

        Raises:
            ValueError: ``rope_layout`` or ``input_layout`` is not one of its choices, ``base``
                is not a finite number > 0, or ``target`` names no registered target.
            TypeError: A parameter has the wrong type.
        """
        self._setup({"rope_layout": rope_layout, "input_layout": input_layout, "base": base}, target)
        self.pairing = self.params["rope_layout"]

    def forward(self, x: torch.Tensor, *, position_ids: torch.Tensor | None = None, key: torch.Tensor | None = None,
                out: torch.Tensor | None = None, key_out: torch.Tensor | None = None) -> Any:
        """Rotate ``x``; runs on ``op(x)``. Shapes and dtype are taken from the first call.

        Gradients: the output is differentiable in ``x`` (it carries a ``grad_fn`` when ``x``
        requires grad); the backward is the inverse rotation times the amplitude, one kernel launch
        from the same builder. A gradient of that gradient (double backward) raises.

        Args:
            x (torch.Tensor): ``[seq_len, head_dim]`` (``input_layout="1d"``) or
                ``[batch, seq_len, num_heads, head_dim]`` (``"2d"``); float16, bfloat16 or
                float32; ``head_dim`` even. Not modified.
            position_ids (torch.Tensor | None): Keyword-only. The position of each row: ``[seq_len]``
                (1d, or 2d shared by the batch) or ``[batch, seq_len]`` (2d); int32 or int64 on the
                device of ``x``, each in ``[0, 2^24)``. None (default) means ``0 .. seq_len - 1``.
                With a KV cache, chunked prefill or left padding, pass the real positions.
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
            TypeError: ``x`` is not a tensor, or its dtype is not float16, bfloat16 or float32.
            ValueError: ``x`` has the wrong number of dims for ``input_layout``, or an odd ``head_dim``.
                A position outside ``[0, 2^24)`` raises ValueError naming its index and value.
        """
        return self._call({"x": x, "position_ids": position_ids, "key": key}, {"out": out, "key_out": key_out})


class RoPENeoxPositionIdsFwdOp(_RoPEBase):
    """RoPE on packed tokens at explicit positions, neox pairing, with partial rotary.

    For token ``t`` at position ``p = position_ids[t]``, the first ``rotary_dim`` columns of every
    head rotate neox-style, pair ``(i, i + rotary_dim/2)`` by angle ``p * base^(-2i/rotary_dim)``;
    columns from ``rotary_dim`` on are copied unchanged. This is vLLM's ``rotary_embedding`` and
    flashinfer's ``apply_rope_pos_ids`` on the packed (THD) layout.

    Positions are checked on the device: the kernel reads any position outside ``[0, max_position)``
    as 0 (so nothing is read out of bounds) and marks the call; the ValueError naming the index is
    raised without a host synchronisation, at a later call of the op or at ``op.check()`` (see the
    API page, "Positions and gradients"; ``tileops.strict()`` raises at the call itself). The
    kernel runs as fast as the 2d one (4096 tokens x 32 heads x 128, bf16: 19.8 µs on an H200,
    80% of the copy rate).

    References: GPT-NeoX and HF transformers (``rotate_half``); vLLM ``rotary_embedding``;
    flashinfer ``apply_rope_pos_ids``.
    """

    def __init__(self, max_position: int, base: float = 10000.0, rotary_dim: int | None = None, *,
                 target: str | Target | None = None) -> None:
        """Build the op; kernels are compiled at the first call.

        Args:
            max_position (int): Positions must lie in ``[0, max_position)``; > 0.
            base (float): The frequency base; must be > 0. Default ``10000.0``.
            rotary_dim (int | None): How many leading columns of each head rotate; even, > 0 and
                at most ``head_dim``. None (default) rotates all of them.
            target (str | None): Which set of kernels serves this op — a target name, BUILTIN
                for the in-tree kernels, or None to decide from the input device. Default None.

        Raises:
            ValueError: ``max_position <= 0``, ``base <= 0`` or not finite, ``rotary_dim`` odd or
                not positive, or an unknown ``target``.
            TypeError: A parameter has the wrong type.
        """
        self._setup({"max_position": max_position, "base": base, "rotary_dim": rotary_dim}, target)

    @property
    def layout(self) -> str:
        return "ids"

    def rotated_width(self, head_dim: int) -> int:
        rd = self.params["rotary_dim"]
        return head_dim if rd is None else rd

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, *, key: torch.Tensor | None = None,
                out: torch.Tensor | None = None, key_out: torch.Tensor | None = None) -> Any:
        """Rotate ``x`` at ``position_ids``; runs on ``op(x, position_ids)``. Shapes and dtypes
        are taken from the first call.

        Args:
            x (torch.Tensor): ``[tokens, heads, head_dim]``; float16, bfloat16 or float32;
                ``head_dim`` even and at least ``rotary_dim``. Not modified.
            position_ids (torch.Tensor): ``[tokens]``, int32 or int64, each in ``[0, max_position)``,
                on the device of ``x``.
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
            TypeError: An argument is not a tensor or has a dtype outside those listed.
            ValueError: Wrong number of dims, ``tokens`` differing between the two, ``rotary_dim``
                above ``head_dim``, tensors on different devices, or a position outside
                ``[0, max_position)`` (the message names its index).
        """
        return self._call({"x": x, "position_ids": position_ids, "key": key}, {"out": out, "key_out": key_out})

    def position_limit(self) -> int:
        return self.params["max_position"]


class RoPELlama31FwdOp(_RoPEBase):
    """RoPE with Llama 3.1's frequency scaling (neox pairing).

    With ``wavelen = 2π / inv_freq``, ``low_wl = original_max_position / low_freq_factor`` and
    ``high_wl = original_max_position / high_freq_factor``: components with ``wavelen < high_wl``
    keep their frequency, those with ``wavelen > low_wl`` are divided by ``scale_factor``, and the
    band between blends the two with ``s = (original_max_position / wavelen - low_freq_factor) /
    (high_freq_factor - low_freq_factor)``. No amplitude factor.

    References: Meta Llama 3.1 (llama-models ``apply_scaling``); HF transformers
    ``_compute_llama3_parameters``.
    """

    def __init__(self, input_layout: str = "1d", base: float = 10000.0, scale_factor: float = 8.0,
                 low_freq_factor: float = 1.0, high_freq_factor: float = 4.0, original_max_position: int = 8192,
                 *, target: str | Target | None = None) -> None:
        """Build the op; kernels are compiled at the first call.

        Args:
            input_layout (str): ``"1d"`` (x ``[seq_len, head_dim]``) or ``"2d"`` (x
                ``[batch, seq_len, num_heads, head_dim]``). Default ``"1d"``.
            base (float): The frequency base; > 0. Default ``10000.0``.
            scale_factor (float): Divisor of the low frequencies; > 0. Default ``8.0``.
            low_freq_factor (float): Sets the long-wavelength edge of the band; > 0. Default ``1.0``.
            high_freq_factor (float): Sets the short-wavelength edge; > 0 and != ``low_freq_factor``.
                Default ``4.0``.
            original_max_position (int): The pre-training context length; > 0. Default ``8192``.
            target (str | None): Which set of kernels serves this op — a target name, BUILTIN
                for the in-tree kernels, or None to decide from the input device. Default None.

        Raises:
            ValueError: A factor is not finite or not > 0, ``low_freq_factor == high_freq_factor``
                (the band's blend divides by their difference), or an unknown ``target``.
            TypeError: A parameter has the wrong type.
        """
        self._setup({"input_layout": input_layout, "base": base, "scale_factor": scale_factor,
                     "low_freq_factor": low_freq_factor, "high_freq_factor": high_freq_factor,
                     "original_max_position": original_max_position}, target)

    def frequencies(self, rot: int) -> tuple[torch.Tensor, float]:
        p = self.params
        return freqs.llama31_inv_freq(p["base"], rot, p["scale_factor"], p["low_freq_factor"],
                                      p["high_freq_factor"], p["original_max_position"]), 1.0

    def forward(self, x: torch.Tensor, *, position_ids: torch.Tensor | None = None, key: torch.Tensor | None = None,
                out: torch.Tensor | None = None, key_out: torch.Tensor | None = None) -> Any:
        """Rotate ``x``; runs on ``op(x)``. Shapes and dtype are taken from the first call.

        Gradients: the output is differentiable in ``x`` (it carries a ``grad_fn`` when ``x``
        requires grad); the backward is the inverse rotation times the amplitude, one kernel launch
        from the same builder. A gradient of that gradient (double backward) raises.

        Args:
            x (torch.Tensor): ``[seq_len, head_dim]`` (``"1d"``) or
                ``[batch, seq_len, num_heads, head_dim]`` (``"2d"``); float16, bfloat16 or float32;
                ``head_dim`` even. Not modified.
            position_ids (torch.Tensor | None): Keyword-only. The position of each row: ``[seq_len]``
                (1d, or 2d shared by the batch) or ``[batch, seq_len]`` (2d); int32 or int64 on the
                device of ``x``, each in ``[0, 2^24)``. None (default) means ``0 .. seq_len - 1``.
                With a KV cache, chunked prefill or left padding, pass the real positions.
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
            ValueError: Wrong number of dims for ``input_layout``, or an odd ``head_dim``.
                A position outside ``[0, 2^24)`` raises ValueError naming its index and value.
        """
        return self._call({"x": x, "position_ids": position_ids, "key": key}, {"out": out, "key_out": key_out})


class YaRNFwdOp(_RoPEBase):
    """RoPE with YaRN frequency interpolation and attention scaling (neox pairing).

    ``correction_dim(r) = D ln(original_max_position / (2π r)) / (2 ln base)``; pairs below
    ``low = max(floor(correction_dim(beta_fast)), 0)`` keep their frequency, pairs above
    ``high = min(ceil(correction_dim(beta_slow)), D - 1)`` are divided by ``scale``, with a linear
    ramp between. cos and sin are multiplied by ``mscale = (0.1 ln(scale) + 1) * attn_factor``
    (``attn_factor`` alone when ``scale <= 1``), as vLLM's ``YaRNScalingRotaryEmbedding`` does.

    References: YaRN (Peng et al., 2023, arXiv:2309.00071); vLLM ``YaRNScalingRotaryEmbedding``;
    HF transformers ``_compute_yarn_parameters``.
    """

    def __init__(self, input_layout: str = "1d", base: float = 10000.0, scale: float = 16.0,
                 original_max_position: int = 4096, beta_fast: float = 32.0, beta_slow: float = 1.0,
                 attn_factor: float = 1.0, *, target: str | Target | None = None) -> None:
        """Build the op; kernels are compiled at the first call.

        Args:
            input_layout (str): ``"1d"`` (x ``[seq_len, head_dim]``) or ``"2d"`` (x
                ``[batch, seq_len, num_heads, head_dim]``). Default ``"1d"``.
            base (float): The frequency base; > 0. Default ``10000.0``.
            scale (float): The context extension factor; > 0. Default ``16.0``.
            original_max_position (int): The pre-training context length; > 0. Default ``4096``.
            beta_fast (float): Rotations per context above which a pair extrapolates; > 0. Default ``32.0``.
            beta_slow (float): Rotations per context below which a pair interpolates; > 0. Default ``1.0``.
            attn_factor (float): Extra factor on the amplitude; finite. Default ``1.0``.
            target (str | None): Which set of kernels serves this op — a target name, BUILTIN
                for the in-tree kernels, or None to decide from the input device. Default None.

        Raises:
            ValueError: ``scale``, ``base``, ``beta_fast``, ``beta_slow`` or
                ``original_max_position`` not > 0, a non-finite float, or an unknown ``target``.
            TypeError: A parameter has the wrong type.
        """
        self._setup({"input_layout": input_layout, "base": base, "scale": scale,
                     "original_max_position": original_max_position, "beta_fast": beta_fast,
                     "beta_slow": beta_slow, "attn_factor": attn_factor}, target)

    def frequencies(self, rot: int) -> tuple[torch.Tensor, float]:
        p = self.params
        inv = freqs.yarn_inv_freq(p["base"], rot, p["scale"], p["original_max_position"], p["beta_fast"],
                                  p["beta_slow"])
        return inv, freqs.yarn_amplitude(p["scale"], p["attn_factor"])

    def forward(self, x: torch.Tensor, *, position_ids: torch.Tensor | None = None, key: torch.Tensor | None = None,
                out: torch.Tensor | None = None, key_out: torch.Tensor | None = None) -> Any:
        """Rotate and scale ``x``; runs on ``op(x)``. Shapes and dtype are taken from the first call.

        Gradients: the output is differentiable in ``x`` (it carries a ``grad_fn`` when ``x``
        requires grad); the backward is the inverse rotation times the amplitude, one kernel launch
        from the same builder. A gradient of that gradient (double backward) raises.

        Args:
            x (torch.Tensor): ``[seq_len, head_dim]`` (``"1d"``) or
                ``[batch, seq_len, num_heads, head_dim]`` (``"2d"``); float16, bfloat16 or float32;
                ``head_dim`` even. Not modified.
            position_ids (torch.Tensor | None): Keyword-only. The position of each row: ``[seq_len]``
                (1d, or 2d shared by the batch) or ``[batch, seq_len]`` (2d); int32 or int64 on the
                device of ``x``, each in ``[0, 2^24)``. None (default) means ``0 .. seq_len - 1``.
                With a KV cache, chunked prefill or left padding, pass the real positions.
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
            ValueError: Wrong number of dims for ``input_layout``, or an odd ``head_dim``.
                A position outside ``[0, 2^24)`` raises ValueError naming its index and value.
        """
        return self._call({"x": x, "position_ids": position_ids, "key": key}, {"out": out, "key_out": key_out})


class LongRoPEFwdOp(_RoPEBase):
    """RoPE with LongRoPE per-frequency rescaling and amplitude (neox pairing).

    ``inv_freq[i] = 1 / (rescale_factors[i] * base^(2i/D))``; with ``scale =
    max_position_embeddings / original_max_position_embeddings``, cos and sin are multiplied by
    ``sqrt(1 + ln(scale) / ln(original_max_position_embeddings))`` when ``scale > 1``.

    References: LongRoPE (Ding et al., 2024, arXiv:2402.13753); HF transformers
    ``_compute_longrope_parameters``; Apache TVM ``rope_freq_longrope``.
    """

    def __init__(self, input_layout: str = "1d", base: float = 10000.0,
                 rescale_factors: torch.Tensor | None = None, max_position_embeddings: int = 4096,
                 original_max_position_embeddings: int = 4096, *, target: str | Target | None = None) -> None:
        """Build the op; kernels are compiled at the first call.

        Args:
            input_layout (str): ``"1d"`` (x ``[seq_len, head_dim]``) or ``"2d"`` (x
                ``[batch, seq_len, num_heads, head_dim]``). Default ``"1d"``.
            base (float): The frequency base; > 0. Default ``10000.0``.
            rescale_factors (torch.Tensor | None): Shape ``(head_dim // 2,)``, one divisor per
                frequency, each finite and non-zero; copied at construction. None (default) means all ones.
            max_position_embeddings (int): The extended context length; > 0. Default ``4096``.
            original_max_position_embeddings (int): The pre-training context length; > 1.
                Default ``4096``.
            target (str | None): Which set of kernels serves this op — a target name, BUILTIN
                for the in-tree kernels, or None to decide from the input device. Default None.

        Raises:
            ValueError: A zero, NaN or infinite rescale factor, a ``rescale_factors`` that is not
                1-D, a length not > 0, or an unknown ``target``. A ``rescale_factors`` length other
                than ``head_dim // 2`` is reported at the first call.
            TypeError: A parameter has the wrong type.
        """
        self._setup({"input_layout": input_layout, "base": base, "rescale_factors": rescale_factors,
                     "max_position_embeddings": max_position_embeddings,
                     "original_max_position_embeddings": original_max_position_embeddings}, target)
        self.params["rescale_factors"] = freqs.factor_table(self.name, "rescale_factors",
                                                            self.params["rescale_factors"], "head_dim // 2")

    def _check_more(self, tensors: Any, dims: Any) -> None:
        super()._check_more(tensors, dims)
        rf = self.params["rescale_factors"]
        if rf is not None and rf.shape[0] != dims["head_dim"] // 2:
            raise ValueError(f"{self.name}: rescale_factors: expected length head_dim // 2 = "
                             f"{dims['head_dim'] // 2} (head_dim {dims['head_dim']} of x), got length {rf.shape[0]}")

    def frequencies(self, rot: int) -> tuple[torch.Tensor, float]:
        p = self.params
        return (freqs.longrope_inv_freq(p["base"], rot, p["rescale_factors"]),
                freqs.longrope_amplitude(p["max_position_embeddings"], p["original_max_position_embeddings"]))

    def forward(self, x: torch.Tensor, *, position_ids: torch.Tensor | None = None, key: torch.Tensor | None = None,
                out: torch.Tensor | None = None, key_out: torch.Tensor | None = None) -> Any:
        """Rotate and scale ``x``; runs on ``op(x)``. Shapes and dtype are taken from the first call.

        Gradients: the output is differentiable in ``x`` (it carries a ``grad_fn`` when ``x``
        requires grad); the backward is the inverse rotation times the amplitude, one kernel launch
        from the same builder. A gradient of that gradient (double backward) raises.

        Args:
            x (torch.Tensor): ``[seq_len, head_dim]`` (``"1d"``) or
                ``[batch, seq_len, num_heads, head_dim]`` (``"2d"``); float16, bfloat16 or float32;
                ``head_dim`` even and equal to ``2 * len(rescale_factors)`` when given. Not modified.
            position_ids (torch.Tensor | None): Keyword-only. The position of each row: ``[seq_len]``
                (1d, or 2d shared by the batch) or ``[batch, seq_len]`` (2d); int32 or int64 on the
                device of ``x``, each in ``[0, 2^24)``. None (default) means ``0 .. seq_len - 1``.
                With a KV cache, chunked prefill or left padding, pass the real positions.
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
            ValueError: Wrong number of dims for ``input_layout``, an odd ``head_dim``, or a
                ``rescale_factors`` length other than ``head_dim // 2``.
                A position outside ``[0, 2^24)`` raises ValueError naming its index and value.
        """
        return self._call({"x": x, "position_ids": position_ids, "key": key}, {"out": out, "key_out": key_out})


