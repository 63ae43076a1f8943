"""The rope ops, generated from ``manifests/rope/`` by ``tileops generate``: do not edit.

Every signature, parameter list and parameter doc here comes from an op's manifest; the behaviour
comes from the hook class it inherits (:mod:`tileops.rope.hooks`). Change a manifest, then run
``tileops generate``; a test fails while this file and the manifests disagree.
"""

from __future__ import annotations

from typing import Any

import torch

from ..targets import Target
from . import hooks

__all__ = [
    "LongRoPEFwdOp", "MRoPEFwdOp", "Phi3LongRoPEFwdOp", "RoPEDynamicNTKFwdOp", "RoPEFwdOp",
    "RoPELinearFwdOp", "RoPELlama31FwdOp", "RoPENeoxPositionIdsFwdOp", "YaRNFwdOp",
]


class LongRoPEFwdOp(hooks.LongRoPEFwdHooks):
    """RoPE with LongRoPE per-frequency rescaling and amplitude (neox pairing).

    ``inv_freq[i] = 1 / (rescale_factors[i] * base^(2i/D))``; with ``scale = max_position_embeddings /
    original_max_position_embeddings``, cos and sin are multiplied by ``sqrt(1 + ln(scale) /
    ln(original_max_position_embeddings))`` when ``scale > 1``.

    References: LongRoPE: Ding et al., 2024, arXiv:2402.13753; HF transformers _compute_longrope_parameters;
        Apache TVM rope_freq_longrope.
    """

    def __init__(self, input_layout: str = "1d", base: float = 10000.0,
                 rescale_factors: torch.Tensor | None = None, max_position_embeddings: int = 4096,
                 original_max_position_embeddings: int = 4096, *, target: str | Target | None = None) -> None:
        """Build the op; kernels are compiled at the first call.

        Args:
            input_layout (str): 1d: x is [seq_len, head_dim]; 2d: x is [batch, seq_len, num_heads, head_dim];
                bhsd: x is [batch, num_heads, seq_len, head_dim], transformers' layout (its transposed q and k
                as they come, no copy). One of ``"1d"``, ``"2d"``, ``"bhsd"``. Default ``"1d"``.
            base (float): The frequency base. Default ``10000.0``.
            rescale_factors (torch.Tensor | None): Shape (head_dim // 2,): one divisor per frequency, finite
                and non-zero; None means all ones. Default ``None``.
            max_position_embeddings (int): The extended context length. Default ``4096``.
            original_max_position_embeddings (int): The pre-training context length. Default ``4096``.
            target (str | Target | None): Which set of kernels serves this op: a registered target name,
                BUILTIN for the in-tree kernels, or None to decide from the input device at the first call.
                Default None.

        Raises:
            TypeError: A parameter has the wrong type.
            ValueError: A value outside its choices, an unknown ``target``; or, by the manifest's rules: base:
                expected a base > 0; max_position_embeddings: expected max_position_embeddings > 0;
                original_max_position_embeddings: expected original_max_position_embeddings > 1 (the amplitude
                divides by its log).
        """
        self._setup({'input_layout': input_layout, 'base': base, 'rescale_factors': rescale_factors,
            'max_position_embeddings': max_position_embeddings, 'original_max_position_embeddings':
            original_max_position_embeddings}, target)

    def forward(self, x: torch.Tensor, *, position_ids: torch.Tensor | None = None,
                key: torch.Tensor | None = None, out: torch.Tensor | None = None,
                key_out: torch.Tensor | None = None) -> Any:
        """Run the op; ``op(...)`` calls this. Shapes and dtypes are taken from the first call, and inputs
        are never modified (except by ``out=`` naming an input, which takes the result in place).

        Gradients: differentiable in ``x`` and ``key``; an output carries a ``grad_fn`` when an input it is
        computed from requires grad. The gradients of x (and key): each output's gradient rotated by the
        negated angle, times the amplitude; one launch of the same kernel builder for both. A gradient of that
        gradient (double backward) raises.

        Args:
            x (torch.Tensor): The tensor to rotate; the position of a row is position_ids, or its index along
                seq_len when they are not given. Shape ``[seq_len, head_dim]`` (``input_layout="1d"``);
                ``[batch, seq_len, num_heads, head_dim]`` (``input_layout="2d"``); ``[batch, num_heads,
                seq_len, head_dim]`` (``input_layout="bhsd"``); dtype float16, bfloat16, float32.
            position_ids (torch.Tensor | None): Keyword-only. The position of each row, in [0, 2^24):
                [seq_len] (1d, or 2d and bhsd shared by the batch) or [batch, seq_len] (2d, bhsd); omitted
                means 0 .. seq_len - 1. Shape ``[seq_len]`` (``input_layout="1d"``); ``[batch, seq_len]`` or
                ``[seq_len]`` (``input_layout="2d"``); ``[batch, seq_len]`` or ``[seq_len]``
                (``input_layout="bhsd"``); dtype int32, int64. Each value in ``[0, 16777216)``. Default None.
            key (torch.Tensor | None): Keyword-only. A second tensor rotated at the same positions in the same
                launch (the attention key): like x, with its own number of heads (GQA, MQA) and its own
                strides; the op then returns (out, key_out). Shape ``[seq_len, head_dim]``
                (``input_layout="1d"``); ``[batch, seq_len, key_heads, head_dim]`` (``input_layout="2d"``);
                ``[batch, key_heads, seq_len, head_dim]`` (``input_layout="bhsd"``); dtype float16, bfloat16,
                float32. Default None.
            out (torch.Tensor | None): Keyword-only. Where to write the result (x rotated: a new tensor shaped
                and typed like x, or the out= tensor (out=x rotates in place).). Shaped and typed like ``x``,
                any strides; it may be its own input exactly (in place) but may not otherwise overlap another
                argument. Not while an input requires grad. Default None.
            key_out (torch.Tensor | None): Keyword-only. Where to write the result (key rotated, when key is
                given: a new tensor like key, or the key_out= tensor.). Shaped and typed like ``key``, any
                strides; it may be its own input exactly (in place) but may not otherwise overlap another
                argument. Not while an input requires grad. Default None.

        Returns:
            torch.Tensor | tuple: ``out``, a new tensor unless given; with ``key``, the tuple ``(out,
                key_out)``.

        Raises:
            TypeError: An argument is not a tensor, or has a dtype not listed above.
            ValueError: A shape that does not match the ones above, tensors on different devices, an output
                that overlaps another argument; or, by the manifest's rules: x: expected an even head_dim (the
                last dim); x: expected head_dim <= 1024; x: expected seq_len <= 2^24 (positions are 24-bit:
                three 256-row cos/sin tables). A value of ``position_ids`` outside its range raises ValueError
                naming its index and value, without a host sync (see the API page, Positions and gradients).
            RuntimeError: ``out=`` or another output given while an input requires grad.
        """
        return self._call({'x': x, 'position_ids': position_ids, 'key': key}, {'out': out, 'key_out':
            key_out})


class MRoPEFwdOp(hooks.MRoPEFwdHooks):
    """Multimodal RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) with three position streams, neox pairing.

    Each token has three positions, temporal, height and width: ``position_ids[0]``, ``[1]`` and ``[2]``.
    ``inv_freq[j] = base^(-2j/D)`` as in plain RoPE, and pair ``(j, j + D/2)`` turns by ``position_ids[c(j)] *
    inv_freq[j]``, where ``mrope_section`` (three counts summing to ``D/2``) gives the stream ``c(j)`` of each
    pair. Consecutive sections (Qwen2-VL, Qwen2.5-VL): the first ``mrope_section[0]`` pairs take the temporal
    position, the next ``mrope_section[1]`` the height, the rest the width. Interleaved
    (``mrope_interleaved=True``, Qwen3-VL): pair ``j`` takes the height when ``j % 3 == 1`` and ``j < 3 *
    mrope_section[1]``, the width when ``j % 3 == 2`` and ``j < 3 * mrope_section[2]``, else the temporal
    position. Text tokens carry equal positions in the three streams, which is plain RoPE; ``position_ids``
    left out means ``0 .. seq_len - 1`` in every stream (plain RoPE), as transformers does for a text-only
    call. Every stream's positions are checked on the device, like those of the other ops.

    References: Qwen2-VL: Wang et al., 2024, arXiv:2409.12191 (M-RoPE); HF transformers
        Qwen2VLRotaryEmbedding, Qwen3VLTextRotaryEmbedding (recomposition_frequencies).

    Examples:
        >>> import torch
        >>> from tileops.rope import MRoPEFwdOp
        >>> device = "cuda" if torch.cuda.is_available() else "cpu"
        >>> op = MRoPEFwdOp([16, 24, 24], input_layout="2d", base=1e6)
        >>> pos = torch.randint(0, 64, (3, 2, 300), device=device)   # [3, batch, seq]: temporal, height, width
        >>> q = torch.randn(2, 300, 28, 128, device=device)   # [batch, seq, heads, head_dim]
        >>> k = torch.randn(2, 300, 4, 128, device=device)
        >>> q_rot, k_rot = op(q, position_ids=pos, key=k)
        >>> q_rot.shape, k_rot.shape
        (torch.Size([2, 300, 28, 128]), torch.Size([2, 300, 4, 128]))
    """

    def __init__(self, mrope_section: tuple[int, ...] | list[int], input_layout: str = "2d",
                 base: float = 10000.0, mrope_interleaved: bool = False, *,
                 target: str | Target | None = None) -> None:
        """Build the op; kernels are compiled at the first call.

        Args:
            mrope_section (tuple[int, ...] | list[int]): Pairs per position stream (temporal, height, width):
                3 positive ints summing to head_dim / 2, e.g. [16, 24, 24] (Qwen2-VL) or [24, 20, 20]
                (Qwen3-VL). Required.
            input_layout (str): 1d: x is [seq_len, head_dim]; 2d: x is [batch, seq_len, num_heads, head_dim];
                bhsd: x is [batch, num_heads, seq_len, head_dim], transformers' layout (its transposed q and k
                as they come, no copy); packed: x is [tokens, heads, head_dim] (position_ids required). One of
                ``"1d"``, ``"2d"``, ``"bhsd"``, ``"packed"``. Default ``"2d"``.
            base (float): The frequency base: inv_freq[j] = base^(-2j/head_dim). Default ``10000.0``.
            mrope_interleaved (bool): false: consecutive sections (Qwen2-VL, Qwen2.5-VL); true: the
                interleaved map of Qwen3-VL. Default ``False``.
            target (str | Target | None): Which set of kernels serves this op: a registered target name,
                BUILTIN for the in-tree kernels, or None to decide from the input device at the first call.
                Default None.

        Raises:
            TypeError: A parameter has the wrong type.
            ValueError: A value outside its choices, an unknown ``target``; or, by the manifest's rules: base:
                expected a base > 0.
        """
        self._setup({'mrope_section': mrope_section, 'input_layout': input_layout, 'base': base,
            'mrope_interleaved': mrope_interleaved}, target)

    def forward(self, x: torch.Tensor, *, position_ids: torch.Tensor | None = None,
                key: torch.Tensor | None = None, out: torch.Tensor | None = None,
                key_out: torch.Tensor | None = None) -> Any:
        """Run the op; ``op(...)`` calls this. Shapes and dtypes are taken from the first call, and inputs
        are never modified (except by ``out=`` naming an input, which takes the result in place).

        Gradients: differentiable in ``x`` and ``key``; an output carries a ``grad_fn`` when an input it is
        computed from requires grad. The gradients of x (and key): each output's gradient rotated by the
        negated angle; one launch of the same kernel builder for both. A gradient of that gradient (double
        backward) raises.

        Args:
            x (torch.Tensor): The tensor to rotate (the attention query, or any tensor of that layout). Shape
                ``[seq_len, head_dim]`` (``input_layout="1d"``); ``[batch, seq_len, num_heads, head_dim]``
                (``input_layout="2d"``); ``[batch, num_heads, seq_len, head_dim]`` (``input_layout="bhsd"``);
                ``[tokens, heads, head_dim]`` (``input_layout="packed"``); dtype float16, bfloat16, float32.
            position_ids (torch.Tensor | None): Keyword-only. The temporal, height and width position of each
                row, each in [0, 2^24): [3, seq_len] (1d), [3, batch, seq_len] (2d, bhsd; expand a
                batch-shared [3, 1, seq_len] to it: no copy) or [3, tokens] (packed); any strides. Omitted
                (1d, 2d, bhsd): 0 .. seq_len - 1 in every stream, which is plain RoPE. Shape ``[streams,
                seq_len]`` (``input_layout="1d"``); ``[streams, batch, seq_len]`` (``input_layout="2d"``);
                ``[streams, batch, seq_len]`` (``input_layout="bhsd"``); ``[streams, tokens]``
                (``input_layout="packed"``); dtype int32, int64. Each value in ``[0, 16777216)``. Default
                None.
            key (torch.Tensor | None): Keyword-only. A second tensor rotated at the same positions in the same
                launch (the attention key): like x, with its own number of heads (GQA, MQA) and its own
                strides; the op then returns (out, key_out). Shape ``[seq_len, head_dim]``
                (``input_layout="1d"``); ``[batch, seq_len, key_heads, head_dim]`` (``input_layout="2d"``);
                ``[batch, key_heads, seq_len, head_dim]`` (``input_layout="bhsd"``); ``[tokens, key_heads,
                head_dim]`` (``input_layout="packed"``); dtype float16, bfloat16, float32. Default None.
            out (torch.Tensor | None): Keyword-only. Where to write the result (x rotated: a new tensor shaped
                and typed like x, or the out= tensor (out=x rotates in place).). Shaped and typed like ``x``,
                any strides; it may be its own input exactly (in place) but may not otherwise overlap another
                argument. Not while an input requires grad. Default None.
            key_out (torch.Tensor | None): Keyword-only. Where to write the result (key rotated, when key is
                given: a new tensor like key, or the key_out= tensor.). Shaped and typed like ``key``, any
                strides; it may be its own input exactly (in place) but may not otherwise overlap another
                argument. Not while an input requires grad. Default None.

        Returns:
            torch.Tensor | tuple: ``out``, a new tensor unless given; with ``key``, the tuple ``(out,
                key_out)``.

        Raises:
            TypeError: An argument is not a tensor, or has a dtype not listed above.
            ValueError: A shape that does not match the ones above, tensors on different devices, an output
                that overlaps another argument; or, by the manifest's rules: x: expected an even head_dim (the
                last dim); x: expected head_dim <= 1024; x: expected seq_len <= 2^24 (positions are 24-bit:
                three 256-row cos/sin tables); position_ids: expected 3 position streams (temporal, height,
                width) along dim 0. A value of ``position_ids`` outside its range raises ValueError naming its
                index and value, without a host sync (see the API page, Positions and gradients).
            RuntimeError: ``out=`` or another output given while an input requires grad.
        """
        return self._call({'x': x, 'position_ids': position_ids, 'key': key}, {'out': out, 'key_out':
            key_out})


class Phi3LongRoPEFwdOp(hooks.Phi3LongRoPEFwdHooks):
    """HF's longrope (Phi-3) with its short/long factor switch per call, and partial rotary (neox pairing).

    ``inv_freq[i] = 1 / (factor_i * base^(2i/D))`` with ``D = rotary_dim`` (default ``head_dim``), where
    ``factor`` is ``long_factor`` when ``max(position_ids) + 1 > original_max_position_embeddings`` and
    ``short_factor`` otherwise; without ``position_ids`` the test is ``seq_len >
    original_max_position_embeddings``. The choice is one per call for the whole batch, as in HF's dynamic
    longrope update: a batch with one long row uses the long factors for every row. It is made on the device
    (a 0-dim index tensor picks one of two tables), so the positions are never read on the host. cos and sin
    are multiplied by ``attention_factor``; None computes HF's default, ``sqrt(1 + ln(s) /
    ln(original_max_position_embeddings))`` with ``s = max_position_embeddings /
    original_max_position_embeddings`` when ``s > 1``, else 1. Columns from ``rotary_dim`` on are copied
    unchanged.

    ``LongRoPEFwdOp`` is the single-table form (one set of factors, no switch).

    References: LongRoPE: Ding et al., 2024, arXiv:2402.13753; HF transformers _compute_longrope_parameters
        and dynamic_rope_update (longrope_frequency_update).
    """

    def __init__(self, input_layout: str = "1d", base: float = 10000.0,
                 short_factor: torch.Tensor | None = None, long_factor: torch.Tensor | None = None,
                 original_max_position_embeddings: int = 4096, max_position_embeddings: int = 4096,
                 attention_factor: float | None = None, rotary_dim: int | None = None, *,
                 target: str | Target | None = None) -> None:
        """Build the op; kernels are compiled at the first call.

        Args:
            input_layout (str): 1d: x is [seq_len, head_dim]; 2d: x is [batch, seq_len, num_heads, head_dim];
                bhsd: x is [batch, num_heads, seq_len, head_dim], transformers' layout (its transposed q and k
                as they come, no copy). One of ``"1d"``, ``"2d"``, ``"bhsd"``. Default ``"1d"``.
            base (float): The frequency base. Default ``10000.0``.
            short_factor (torch.Tensor | None): Shape (rotary_dim // 2,): the divisors used up to
                original_max_position_embeddings; finite and non-zero; None means all ones. Default ``None``.
            long_factor (torch.Tensor | None): Shape (rotary_dim // 2,): the divisors used beyond
                original_max_position_embeddings; finite and non-zero; None means all ones. Default ``None``.
            original_max_position_embeddings (int): The pre-training context length; the switch point. Default
                ``4096``.
            max_position_embeddings (int): The extended context length (sets the default attention_factor).
                Default ``4096``.
            attention_factor (float | None): The amplitude of cos and sin; None computes it from the two
                lengths as HF does. Default ``None``.
            rotary_dim (int | None): How many leading columns of each head rotate; even, at most head_dim.
                None rotates all. Default ``None``.
            target (str | Target | None): Which set of kernels serves this op: a registered target name,
                BUILTIN for the in-tree kernels, or None to decide from the input device at the first call.
                Default None.

        Raises:
            TypeError: A parameter has the wrong type.
            ValueError: A value outside its choices, an unknown ``target``; or, by the manifest's rules: base:
                expected a base > 0; max_position_embeddings: expected max_position_embeddings > 0;
                original_max_position_embeddings: expected original_max_position_embeddings > 1 (the amplitude
                divides by its log); attention_factor: expected attention_factor > 0, or None; rotary_dim:
                expected an even rotary_dim > 0, or None.
        """
        self._setup({'input_layout': input_layout, 'base': base, 'short_factor': short_factor, 'long_factor':
            long_factor, 'original_max_position_embeddings': original_max_position_embeddings,
            'max_position_embeddings': max_position_embeddings, 'attention_factor': attention_factor,
            'rotary_dim': rotary_dim}, target)

    def forward(self, x: torch.Tensor, *, position_ids: torch.Tensor | None = None,
                key: torch.Tensor | None = None, out: torch.Tensor | None = None,
                key_out: torch.Tensor | None = None) -> Any:
        """Run the op; ``op(...)`` calls this. Shapes and dtypes are taken from the first call, and inputs
        are never modified (except by ``out=`` naming an input, which takes the result in place).

        Gradients: differentiable in ``x`` and ``key``; an output carries a ``grad_fn`` when an input it is
        computed from requires grad. The gradients of x (and key): each output's gradient rotated by the
        negated angle, times the amplitude; one launch of the same kernel builder for both. A gradient of that
        gradient (double backward) raises.

        Args:
            x (torch.Tensor): The tensor to rotate; the position of a row is position_ids, or its index along
                seq_len when they are not given. Shape ``[seq_len, head_dim]`` (``input_layout="1d"``);
                ``[batch, seq_len, num_heads, head_dim]`` (``input_layout="2d"``); ``[batch, num_heads,
                seq_len, head_dim]`` (``input_layout="bhsd"``); dtype float16, bfloat16, float32.
            position_ids (torch.Tensor | None): Keyword-only. The position of each row, in [0, 2^24):
                [seq_len] (1d, or 2d and bhsd shared by the batch) or [batch, seq_len] (2d, bhsd); omitted
                means 0 .. seq_len - 1. Shape ``[seq_len]`` (``input_layout="1d"``); ``[batch, seq_len]`` or
                ``[seq_len]`` (``input_layout="2d"``); ``[batch, seq_len]`` or ``[seq_len]``
                (``input_layout="bhsd"``); dtype int32, int64. Each value in ``[0, 16777216)``. Default None.
            key (torch.Tensor | None): Keyword-only. A second tensor rotated at the same positions in the same
                launch (the attention key): like x, with its own number of heads (GQA, MQA) and its own
                strides; the op then returns (out, key_out). Shape ``[seq_len, head_dim]``
                (``input_layout="1d"``); ``[batch, seq_len, key_heads, head_dim]`` (``input_layout="2d"``);
                ``[batch, key_heads, seq_len, head_dim]`` (``input_layout="bhsd"``); dtype float16, bfloat16,
                float32. Default None.
            out (torch.Tensor | None): Keyword-only. Where to write the result (x rotated: a new tensor shaped
                and typed like x, or the out= tensor (out=x rotates in place).). Shaped and typed like ``x``,
                any strides; it may be its own input exactly (in place) but may not otherwise overlap another
                argument. Not while an input requires grad. Default None.
            key_out (torch.Tensor | None): Keyword-only. Where to write the result (key rotated, when key is
                given: a new tensor like key, or the key_out= tensor.). Shaped and typed like ``key``, any
                strides; it may be its own input exactly (in place) but may not otherwise overlap another
                argument. Not while an input requires grad. Default None.

        Returns:
            torch.Tensor | tuple: ``out``, a new tensor unless given; with ``key``, the tuple ``(out,
                key_out)``.

        Raises:
            TypeError: An argument is not a tensor, or has a dtype not listed above.
            ValueError: A shape that does not match the ones above, tensors on different devices, an output
                that overlaps another argument; or, by the manifest's rules: x: expected an even head_dim (the
                last dim); x: expected head_dim <= 1024; x: expected seq_len <= 2^24 (positions are 24-bit:
                three 256-row cos/sin tables); rotary_dim: expected rotary_dim <= head_dim. A value of
                ``position_ids`` outside its range raises ValueError naming its index and value, without a
                host sync (see the API page, Positions and gradients).
            RuntimeError: ``out=`` or another output given while an input requires grad.
        """
        return self._call({'x': x, 'position_ids': position_ids, 'key': key}, {'out': out, 'key_out':
            key_out})


class RoPEDynamicNTKFwdOp(hooks.RoPEDynamicNTKFwdHooks):
    """RoPE with dynamic NTK scaling (HF rope_type dynamic) and partial rotary (neox pairing).

    Each call takes ``seq = max(position_ids) + 1`` (``seq_len`` without positions) and updates, on the
    device, the longest length seen, as HF's ``dynamic_rope_update`` does: ``cached`` starts at
    ``max_position_embeddings``, grows to ``seq`` when ``seq`` exceeds it, and goes back to
    ``max_position_embeddings`` when a call's ``seq`` is below that. The call then rotates with ``base' = base
    * (factor * cached / max_position_embeddings - (factor - 1)) ^ (D / (D - 2))``, ``inv_freq[i] =
    base'^(-2i/D)``, ``D = rotary_dim`` (default ``head_dim``); the other columns are copied unchanged.

    The length is known without a host synchronisation: one small kernel, in the call's stream before the
    rotation, takes the maximum, updates the cached length and, when the length changed, rewrites the cos/sin
    tables for the new base, so a call never waits for the GPU (and can be captured in a CUDA graph, whose
    replays follow the positions they are given). The state is per op and per device, shared by the threads
    and streams that use the op, as HF's module state is.

    References: HF transformers _compute_dynamic_ntk_parameters and dynamic_rope_update; bloc97 and emozilla,
        dynamically scaled NTK-aware RoPE (2023).
    """

    def __init__(self, input_layout: str = "1d", base: float = 10000.0, factor: float = 1.0,
                 max_position_embeddings: int = 2048, rotary_dim: int | None = None, *,
                 target: str | Target | None = None) -> None:
        """Build the op; kernels are compiled at the first call.

        Args:
            input_layout (str): 1d: x is [seq_len, head_dim]; 2d: x is [batch, seq_len, num_heads, head_dim];
                bhsd: x is [batch, num_heads, seq_len, head_dim], transformers' layout (its transposed q and k
                as they come, no copy). One of ``"1d"``, ``"2d"``, ``"bhsd"``. Default ``"1d"``.
            base (float): The frequency base before scaling. Default ``10000.0``.
            factor (float): The scaling factor (HF rope_scaling factor). Default ``1.0``.
            max_position_embeddings (int): The trained context length; longer calls scale the base. Default
                ``2048``.
            rotary_dim (int | None): How many leading columns of each head rotate; even, at most head_dim.
                None rotates all. Default ``None``.
            target (str | Target | None): Which set of kernels serves this op: a registered target name,
                BUILTIN for the in-tree kernels, or None to decide from the input device at the first call.
                Default None.

        Raises:
            TypeError: A parameter has the wrong type.
            ValueError: A value outside its choices, an unknown ``target``; or, by the manifest's rules: base:
                expected a base > 0; factor: expected factor >= 1 (HF's dynamic NTK scaling only extends the
                context); max_position_embeddings: expected max_position_embeddings > 0; rotary_dim: expected
                an even rotary_dim > 0, or None.
        """
        self._setup({'input_layout': input_layout, 'base': base, 'factor': factor, 'max_position_embeddings':
            max_position_embeddings, 'rotary_dim': rotary_dim}, target)

    def forward(self, x: torch.Tensor, *, position_ids: torch.Tensor | None = None,
                key: torch.Tensor | None = None, out: torch.Tensor | None = None,
                key_out: torch.Tensor | None = None) -> Any:
        """Run the op; ``op(...)`` calls this. Shapes and dtypes are taken from the first call, and inputs
        are never modified (except by ``out=`` naming an input, which takes the result in place).

        Gradients: differentiable in ``x`` and ``key``; an output carries a ``grad_fn`` when an input it is
        computed from requires grad. The gradients of x (and key): each output's gradient rotated by the
        negated angle, times the amplitude; one launch of the same kernel builder for both. A gradient of that
        gradient (double backward) raises.

        Args:
            x (torch.Tensor): The tensor to rotate; the position of a row is position_ids, or its index along
                seq_len when they are not given. Shape ``[seq_len, head_dim]`` (``input_layout="1d"``);
                ``[batch, seq_len, num_heads, head_dim]`` (``input_layout="2d"``); ``[batch, num_heads,
                seq_len, head_dim]`` (``input_layout="bhsd"``); dtype float16, bfloat16, float32.
            position_ids (torch.Tensor | None): Keyword-only. The position of each row, in [0, 2^24):
                [seq_len] (1d, or 2d and bhsd shared by the batch) or [batch, seq_len] (2d, bhsd); omitted
                means 0 .. seq_len - 1. Shape ``[seq_len]`` (``input_layout="1d"``); ``[batch, seq_len]`` or
                ``[seq_len]`` (``input_layout="2d"``); ``[batch, seq_len]`` or ``[seq_len]``
                (``input_layout="bhsd"``); dtype int32, int64. Each value in ``[0, 16777216)``. Default None.
            key (torch.Tensor | None): Keyword-only. A second tensor rotated at the same positions in the same
                launch (the attention key): like x, with its own number of heads (GQA, MQA) and its own
                strides; the op then returns (out, key_out). Shape ``[seq_len, head_dim]``
                (``input_layout="1d"``); ``[batch, seq_len, key_heads, head_dim]`` (``input_layout="2d"``);
                ``[batch, key_heads, seq_len, head_dim]`` (``input_layout="bhsd"``); dtype float16, bfloat16,
                float32. Default None.
            out (torch.Tensor | None): Keyword-only. Where to write the result (x rotated: a new tensor shaped
                and typed like x, or the out= tensor (out=x rotates in place).). Shaped and typed like ``x``,
                any strides; it may be its own input exactly (in place) but may not otherwise overlap another
                argument. Not while an input requires grad. Default None.
            key_out (torch.Tensor | None): Keyword-only. Where to write the result (key rotated, when key is
                given: a new tensor like key, or the key_out= tensor.). Shaped and typed like ``key``, any
                strides; it may be its own input exactly (in place) but may not otherwise overlap another
                argument. Not while an input requires grad. Default None.

        Returns:
            torch.Tensor | tuple: ``out``, a new tensor unless given; with ``key``, the tuple ``(out,
                key_out)``.

        Raises:
            TypeError: An argument is not a tensor, or has a dtype not listed above.
            ValueError: A shape that does not match the ones above, tensors on different devices, an output
                that overlaps another argument; or, by the manifest's rules: x: expected an even head_dim (the
                last dim); x: expected head_dim <= 1024; x: expected seq_len <= 2^24 (positions are 24-bit:
                three 256-row cos/sin tables); rotary_dim: expected rotary_dim <= head_dim; x: expected a
                rotated width (rotary_dim, else head_dim) of at least 4 (the scaled base is raised to D / (D -
                2)). A value of ``position_ids`` outside its range raises ValueError naming its index and
                value, without a host sync (see the API page, Positions and gradients).
            RuntimeError: ``out=`` or another output given while an input requires grad.
        """
        return self._call({'x': x, 'position_ids': position_ids, 'key': key}, {'out': out, 'key_out':
            key_out})


class RoPEFwdOp(hooks.RoPEFwdHooks):
    """Rotary position embedding with the base frequencies, neox or interleaved pairing.

    Rotates each pair of elements of every head by the angle ``p * base^(-2i/D)``, where ``p`` is the row's
    position and ``i`` the pair index: with ``rope_layout="neox"`` (GPT-NeoX, HF ``rotate_half``) pair ``i``
    is ``(x[i], x[i + D/2])``; with ``"interleaved"`` (GPT-J, RoFormer, Meta's Llama) it is ``(x[2i],
    x[2i+1])``. One op serves both conventions. Arithmetic is fp32 whatever the input dtype, with one rounding
    at the store; cos/sin come from float64 angles, so accuracy does not degrade with position.

    References: GPT-NeoX / HF transformers rotate_half; RoFormer: Su et al., 2021, arXiv:2104.09864.

    Examples:
        >>> import torch
        >>> from tileops.rope import RoPEFwdOp
        >>> device = "cuda" if torch.cuda.is_available() else "cpu"
        >>> op = RoPEFwdOp(rope_layout="neox", input_layout="2d")
        >>> x = torch.randn(2, 512, 32, 128, dtype=torch.bfloat16, device=device)   # [batch, seq, heads, head_dim]
        >>> out = op(x)
        >>> out.shape, out.dtype
        (torch.Size([2, 512, 32, 128]), torch.bfloat16)
    """

    def __init__(self, rope_layout: str = "neox", input_layout: str = "1d", base: float = 10000.0, *,
                 target: str | Target | None = None) -> None:
        """Build the op; kernels are compiled at the first call.

        Args:
            rope_layout (str): Which elements pair up: neox pairs (i, i + D/2), interleaved pairs (2i, 2i+1).
                One of ``"neox"``, ``"interleaved"``. Default ``"neox"``.
            input_layout (str): 1d: x is [seq_len, head_dim]; 2d: x is [batch, seq_len, num_heads, head_dim];
                bhsd: x is [batch, num_heads, seq_len, head_dim], transformers' layout (its transposed q and k
                as they come, no copy). One of ``"1d"``, ``"2d"``, ``"bhsd"``. Default ``"1d"``.
            base (float): The frequency base: inv_freq[i] = base^(-2i/D). Default ``10000.0``.
            target (str | Target | None): Which set of kernels serves this op: a registered target name,
                BUILTIN for the in-tree kernels, or None to decide from the input device at the first call.
                Default None.

        Raises:
            TypeError: A parameter has the wrong type.
            ValueError: A value outside its choices, an unknown ``target``; or, by the manifest's rules: base:
                expected a base > 0.
        """
        self._setup({'rope_layout': rope_layout, 'input_layout': input_layout, 'base': base}, target)

    def forward(self, x: torch.Tensor, *, position_ids: torch.Tensor | None = None,
                key: torch.Tensor | None = None, out: torch.Tensor | None = None,
                key_out: torch.Tensor | None = None) -> Any:
        """Run the op; ``op(...)`` calls this. Shapes and dtypes are taken from the first call, and inputs
        are never modified (except by ``out=`` naming an input, which takes the result in place).

        Gradients: differentiable in ``x`` and ``key``; an output carries a ``grad_fn`` when an input it is
        computed from requires grad. The gradients of x (and key): each output's gradient rotated by the
        negated angle, times the amplitude; one launch of the same kernel builder for both. A gradient of that
        gradient (double backward) raises.

        Args:
            x (torch.Tensor): The tensor to rotate; the position of a row is position_ids, or its index along
                seq_len when they are not given. Shape ``[seq_len, head_dim]`` (``input_layout="1d"``);
                ``[batch, seq_len, num_heads, head_dim]`` (``input_layout="2d"``); ``[batch, num_heads,
                seq_len, head_dim]`` (``input_layout="bhsd"``); dtype float16, bfloat16, float32.
            position_ids (torch.Tensor | None): Keyword-only. The position of each row, in [0, 2^24):
                [seq_len] (1d, or 2d and bhsd shared by the batch) or [batch, seq_len] (2d, bhsd); omitted
                means 0 .. seq_len - 1. Shape ``[seq_len]`` (``input_layout="1d"``); ``[batch, seq_len]`` or
                ``[seq_len]`` (``input_layout="2d"``); ``[batch, seq_len]`` or ``[seq_len]``
                (``input_layout="bhsd"``); dtype int32, int64. Each value in ``[0, 16777216)``. Default None.
            key (torch.Tensor | None): Keyword-only. A second tensor rotated at the same positions in the same
                launch (the attention key): like x, with its own number of heads (GQA, MQA) and its own
                strides; the op then returns (out, key_out). Shape ``[seq_len, head_dim]``
                (``input_layout="1d"``); ``[batch, seq_len, key_heads, head_dim]`` (``input_layout="2d"``);
                ``[batch, key_heads, seq_len, head_dim]`` (``input_layout="bhsd"``); dtype float16, bfloat16,
                float32. Default None.
            out (torch.Tensor | None): Keyword-only. Where to write the result (x rotated: a new tensor shaped
                and typed like x, or the out= tensor (out=x rotates in place).). Shaped and typed like ``x``,
                any strides; it may be its own input exactly (in place) but may not otherwise overlap another
                argument. Not while an input requires grad. Default None.
            key_out (torch.Tensor | None): Keyword-only. Where to write the result (key rotated, when key is
                given: a new tensor like key, or the key_out= tensor.). Shaped and typed like ``key``, any
                strides; it may be its own input exactly (in place) but may not otherwise overlap another
                argument. Not while an input requires grad. Default None.

        Returns:
            torch.Tensor | tuple: ``out``, a new tensor unless given; with ``key``, the tuple ``(out,
                key_out)``.

        Raises:
            TypeError: An argument is not a tensor, or has a dtype not listed above.
            ValueError: A shape that does not match the ones above, tensors on different devices, an output
                that overlaps another argument; or, by the manifest's rules: x: expected an even head_dim (the
                last dim); x: expected head_dim <= 1024; x: expected seq_len <= 2^24 (positions are 24-bit:
                three 256-row cos/sin tables). A value of ``position_ids`` outside its range raises ValueError
                naming its index and value, without a host sync (see the API page, Positions and gradients).
            RuntimeError: ``out=`` or another output given while an input requires grad.
        """
        return self._call({'x': x, 'position_ids': position_ids, 'key': key}, {'out': out, 'key_out':
            key_out})


class RoPELinearFwdOp(hooks.RoPELinearFwdHooks):
    """RoPE with linear position interpolation (HF rope_type linear) and partial rotary (neox pairing).

    ``inv_freq[i] = base^(-2i/D) / factor`` with ``D = rotary_dim`` (default ``head_dim``): position ``p``
    turns by ``(p / factor) * base^(-2i/D)``. The first ``rotary_dim`` columns of each head rotate, pair ``(i,
    i + D/2)``; the others are copied unchanged. With ``factor=1`` this is plain RoPE with partial rotary (HF
    ``default`` with ``partial_rotary_factor < 1``, as Phi-3 uses it).

    References: HF transformers _compute_linear_scaling_rope_parameters; kaiokendev, linear position
        interpolation (SuperHOT); Chen et al., 2023, arXiv:2306.15595.

    Examples:
        >>> import torch
        >>> from tileops.rope import RoPELinearFwdOp
        >>> device = "cuda" if torch.cuda.is_available() else "cpu"
        >>> op = RoPELinearFwdOp(input_layout="2d", factor=4.0, rotary_dim=64)
        >>> out = op(torch.randn(2, 512, 8, 128, device=device))   # the first 64 columns of each head rotate
        >>> out.shape
        torch.Size([2, 512, 8, 128])
    """

    def __init__(self, input_layout: str = "1d", base: float = 10000.0, factor: float = 1.0,
                 rotary_dim: int | None = None, *, target: str | Target | None = None) -> None:
        """Build the op; kernels are compiled at the first call.

        Args:
            input_layout (str): 1d: x is [seq_len, head_dim]; 2d: x is [batch, seq_len, num_heads, head_dim];
                bhsd: x is [batch, num_heads, seq_len, head_dim], transformers' layout (its transposed q and k
                as they come, no copy). One of ``"1d"``, ``"2d"``, ``"bhsd"``. Default ``"1d"``.
            base (float): The frequency base: inv_freq[i] = base^(-2i/D) / factor. Default ``10000.0``.
            factor (float): The interpolation factor: positions are divided by it. Default ``1.0``.
            rotary_dim (int | None): How many leading columns of each head rotate; even, at most head_dim.
                None rotates all. Default ``None``.
            target (str | Target | None): Which set of kernels serves this op: a registered target name,
                BUILTIN for the in-tree kernels, or None to decide from the input device at the first call.
                Default None.

        Raises:
            TypeError: A parameter has the wrong type.
            ValueError: A value outside its choices, an unknown ``target``; or, by the manifest's rules: base:
                expected a base > 0; factor: expected factor > 0; rotary_dim: expected an even rotary_dim > 0,
                or None.
        """
        self._setup({'input_layout': input_layout, 'base': base, 'factor': factor, 'rotary_dim': rotary_dim},
            target)

    def forward(self, x: torch.Tensor, *, position_ids: torch.Tensor | None = None,
                key: torch.Tensor | None = None, out: torch.Tensor | None = None,
                key_out: torch.Tensor | None = None) -> Any:
        """Run the op; ``op(...)`` calls this. Shapes and dtypes are taken from the first call, and inputs
        are never modified (except by ``out=`` naming an input, which takes the result in place).

        Gradients: differentiable in ``x`` and ``key``; an output carries a ``grad_fn`` when an input it is
        computed from requires grad. The gradients of x (and key): each output's gradient rotated by the
        negated angle, times the amplitude; one launch of the same kernel builder for both. A gradient of that
        gradient (double backward) raises.

        Args:
            x (torch.Tensor): The tensor to rotate; the position of a row is position_ids, or its index along
                seq_len when they are not given. Shape ``[seq_len, head_dim]`` (``input_layout="1d"``);
                ``[batch, seq_len, num_heads, head_dim]`` (``input_layout="2d"``); ``[batch, num_heads,
                seq_len, head_dim]`` (``input_layout="bhsd"``); dtype float16, bfloat16, float32.
            position_ids (torch.Tensor | None): Keyword-only. The position of each row, in [0, 2^24):
                [seq_len] (1d, or 2d and bhsd shared by the batch) or [batch, seq_len] (2d, bhsd); omitted
                means 0 .. seq_len - 1. Shape ``[seq_len]`` (``input_layout="1d"``); ``[batch, seq_len]`` or
                ``[seq_len]`` (``input_layout="2d"``); ``[batch, seq_len]`` or ``[seq_len]``
                (``input_layout="bhsd"``); dtype int32, int64. Each value in ``[0, 16777216)``. Default None.
            key (torch.Tensor | None): Keyword-only. A second tensor rotated at the same positions in the same
                launch (the attention key): like x, with its own number of heads (GQA, MQA) and its own
                strides; the op then returns (out, key_out). Shape ``[seq_len, head_dim]``
                (``input_layout="1d"``); ``[batch, seq_len, key_heads, head_dim]`` (``input_layout="2d"``);
                ``[batch, key_heads, seq_len, head_dim]`` (``input_layout="bhsd"``); dtype float16, bfloat16,
                float32. Default None.
            out (torch.Tensor | None): Keyword-only. Where to write the result (x rotated: a new tensor shaped
                and typed like x, or the out= tensor (out=x rotates in place).). Shaped and typed like ``x``,
                any strides; it may be its own input exactly (in place) but may not otherwise overlap another
                argument. Not while an input requires grad. Default None.
            key_out (torch.Tensor | None): Keyword-only. Where to write the result (key rotated, when key is
                given: a new tensor like key, or the key_out= tensor.). Shaped and typed like ``key``, any
                strides; it may be its own input exactly (in place) but may not otherwise overlap another
                argument. Not while an input requires grad. Default None.

        Returns:
            torch.Tensor | tuple: ``out``, a new tensor unless given; with ``key``, the tuple ``(out,
                key_out)``.

        Raises:
            TypeError: An argument is not a tensor, or has a dtype not listed above.
            ValueError: A shape that does not match the ones above, tensors on different devices, an output
                that overlaps another argument; or, by the manifest's rules: x: expected an even head_dim (the
                last dim); x: expected head_dim <= 1024; x: expected seq_len <= 2^24 (positions are 24-bit:
                three 256-row cos/sin tables); rotary_dim: expected rotary_dim <= head_dim. A value of
                ``position_ids`` outside its range raises ValueError naming its index and value, without a
                host sync (see the API page, Positions and gradients).
            RuntimeError: ``out=`` or another output given while an input requires grad.
        """
        return self._call({'x': x, 'position_ids': position_ids, 'key': key}, {'out': out, 'key_out':
            key_out})


class RoPELlama31FwdOp(hooks.RoPELlama31FwdHooks):
    """RoPE with Llama 3.1 frequency scaling (neox pairing).

    With ``wavelen = 2π / inv_freq``, ``low_wl = original_max_position / low_freq_factor`` and ``high_wl =
    original_max_position / high_freq_factor``: components with ``wavelen < high_wl`` keep their frequency,
    those with ``wavelen > low_wl`` are divided by ``scale_factor``, and the band between blends the two with
    ``s = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)``. No
    amplitude factor.

    References: Meta Llama 3.1: llama-models apply_scaling; HF transformers _compute_llama3_parameters.
    """

    def __init__(self, input_layout: str = "1d", base: float = 10000.0, scale_factor: float = 8.0,
                 low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                 original_max_position: int = 8192, *, target: str | Target | None = None) -> None:
        """Build the op; kernels are compiled at the first call.

        Args:
            input_layout (str): 1d: x is [seq_len, head_dim]; 2d: x is [batch, seq_len, num_heads, head_dim];
                bhsd: x is [batch, num_heads, seq_len, head_dim], transformers' layout (its transposed q and k
                as they come, no copy). One of ``"1d"``, ``"2d"``, ``"bhsd"``. Default ``"1d"``.
            base (float): The frequency base. Default ``10000.0``.
            scale_factor (float): Divisor of the low frequencies. Default ``8.0``.
            low_freq_factor (float): Sets the long-wavelength edge of the blended band. Default ``1.0``.
            high_freq_factor (float): Sets the short-wavelength edge of the blended band. Default ``4.0``.
            original_max_position (int): The pre-training context length. Default ``8192``.
            target (str | Target | None): Which set of kernels serves this op: a registered target name,
                BUILTIN for the in-tree kernels, or None to decide from the input device at the first call.
                Default None.

        Raises:
            TypeError: A parameter has the wrong type.
            ValueError: A value outside its choices, an unknown ``target``; or, by the manifest's rules: base:
                expected a base > 0; scale_factor: expected scale_factor > 0; low_freq_factor: expected
                low_freq_factor > 0; high_freq_factor: expected high_freq_factor > 0; high_freq_factor:
                expected high_freq_factor != low_freq_factor (the band's blend divides by their difference);
                original_max_position: expected original_max_position > 0.
        """
        self._setup({'input_layout': input_layout, 'base': base, 'scale_factor': scale_factor,
            'low_freq_factor': low_freq_factor, 'high_freq_factor': high_freq_factor, 'original_max_position':
            original_max_position}, target)

    def forward(self, x: torch.Tensor, *, position_ids: torch.Tensor | None = None,
                key: torch.Tensor | None = None, out: torch.Tensor | None = None,
                key_out: torch.Tensor | None = None) -> Any:
        """Run the op; ``op(...)`` calls this. Shapes and dtypes are taken from the first call, and inputs
        are never modified (except by ``out=`` naming an input, which takes the result in place).

        Gradients: differentiable in ``x`` and ``key``; an output carries a ``grad_fn`` when an input it is
        computed from requires grad. The gradients of x (and key): each output's gradient rotated by the
        negated angle, times the amplitude; one launch of the same kernel builder for both. A gradient of that
        gradient (double backward) raises.

        Args:
            x (torch.Tensor): The tensor to rotate; the position of a row is position_ids, or its index along
                seq_len when they are not given. Shape ``[seq_len, head_dim]`` (``input_layout="1d"``);
                ``[batch, seq_len, num_heads, head_dim]`` (``input_layout="2d"``); ``[batch, num_heads,
                seq_len, head_dim]`` (``input_layout="bhsd"``); dtype float16, bfloat16, float32.
            position_ids (torch.Tensor | None): Keyword-only. The position of each row, in [0, 2^24):
                [seq_len] (1d, or 2d and bhsd shared by the batch) or [batch, seq_len] (2d, bhsd); omitted
                means 0 .. seq_len - 1. Shape ``[seq_len]`` (``input_layout="1d"``); ``[batch, seq_len]`` or
                ``[seq_len]`` (``input_layout="2d"``); ``[batch, seq_len]`` or ``[seq_len]``
                (``input_layout="bhsd"``); dtype int32, int64. Each value in ``[0, 16777216)``. Default None.
            key (torch.Tensor | None): Keyword-only. A second tensor rotated at the same positions in the same
                launch (the attention key): like x, with its own number of heads (GQA, MQA) and its own
                strides; the op then returns (out, key_out). Shape ``[seq_len, head_dim]``
                (``input_layout="1d"``); ``[batch, seq_len, key_heads, head_dim]`` (``input_layout="2d"``);
                ``[batch, key_heads, seq_len, head_dim]`` (``input_layout="bhsd"``); dtype float16, bfloat16,
                float32. Default None.
            out (torch.Tensor | None): Keyword-only. Where to write the result (x rotated: a new tensor shaped
                and typed like x, or the out= tensor (out=x rotates in place).). Shaped and typed like ``x``,
                any strides; it may be its own input exactly (in place) but may not otherwise overlap another
                argument. Not while an input requires grad. Default None.
            key_out (torch.Tensor | None): Keyword-only. Where to write the result (key rotated, when key is
                given: a new tensor like key, or the key_out= tensor.). Shaped and typed like ``key``, any
                strides; it may be its own input exactly (in place) but may not otherwise overlap another
                argument. Not while an input requires grad. Default None.

        Returns:
            torch.Tensor | tuple: ``out``, a new tensor unless given; with ``key``, the tuple ``(out,
                key_out)``.

        Raises:
            TypeError: An argument is not a tensor, or has a dtype not listed above.
            ValueError: A shape that does not match the ones above, tensors on different devices, an output
                that overlaps another argument; or, by the manifest's rules: x: expected an even head_dim (the
                last dim); x: expected head_dim <= 1024; x: expected seq_len <= 2^24 (positions are 24-bit:
                three 256-row cos/sin tables). A value of ``position_ids`` outside its range raises ValueError
                naming its index and value, without a host sync (see the API page, Positions and gradients).
            RuntimeError: ``out=`` or another output given while an input requires grad.
        """
        return self._call({'x': x, 'position_ids': position_ids, 'key': key}, {'out': out, 'key_out':
            key_out})


class RoPENeoxPositionIdsFwdOp(hooks.RoPENeoxPositionIdsFwdHooks):
    """RoPE on packed tokens at explicit positions, neox pairing, with partial rotary.

    For token ``t`` at position ``p = position_ids[t]``, the first ``rotary_dim`` columns of every head rotate
    neox-style, pair ``(i, i + rotary_dim/2)`` by angle ``p * base^(-2i/rotary_dim)``; columns from
    ``rotary_dim`` on are copied unchanged. This is vLLM's ``rotary_embedding`` and flashinfer's
    ``apply_rope_pos_ids`` on the packed (THD) layout.

    Positions are checked on the device: the kernel reads any position outside ``[0, max_position)`` as 0 (so
    nothing is read out of bounds) and marks the call; the ValueError naming the index is raised without a
    host synchronisation, at a later call of the op or at ``op.check()`` (see the API page, "Positions and
    gradients"; ``tileops.strict()`` raises at the call itself).

    References: GPT-NeoX / HF transformers rotate_half; vLLM rotary_embedding; flashinfer apply_rope_pos_ids.
    """

    def __init__(self, max_position: int, base: float = 10000.0, rotary_dim: int | None = None, *,
                 target: str | Target | None = None) -> None:
        """Build the op; kernels are compiled at the first call.

        Args:
            max_position (int): Positions must lie in [0, max_position). Required.
            base (float): The frequency base: inv_freq[i] = base^(-2i/rotary_dim). Default ``10000.0``.
            rotary_dim (int | None): How many leading columns of each head rotate (even, at most head_dim);
                None rotates all. Default ``None``.
            target (str | Target | None): Which set of kernels serves this op: a registered target name,
                BUILTIN for the in-tree kernels, or None to decide from the input device at the first call.
                Default None.

        Raises:
            TypeError: A parameter has the wrong type.
            ValueError: A value outside its choices, an unknown ``target``; or, by the manifest's rules:
                max_position: expected max_position > 0; max_position: expected max_position <= 2^24
                (positions are 24-bit: three 256-row cos/sin tables); base: expected a base > 0; rotary_dim:
                expected an even rotary_dim > 0, or None.
        """
        self._setup({'max_position': max_position, 'base': base, 'rotary_dim': rotary_dim}, target)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, *, key: torch.Tensor | None = None,
                out: torch.Tensor | None = None, key_out: torch.Tensor | None = None) -> Any:
        """Run the op; ``op(...)`` calls this. Shapes and dtypes are taken from the first call, and inputs
        are never modified (except by ``out=`` naming an input, which takes the result in place).

        Gradients: differentiable in ``x`` and ``key``; an output carries a ``grad_fn`` when an input it is
        computed from requires grad. The gradients of x (and key): each output's gradient rotated by the
        negated angle, times the amplitude; one launch of the same kernel builder for both. A gradient of that
        gradient (double backward) raises.

        Args:
            x (torch.Tensor): Packed tokens (THD layout). Shape ``[tokens, heads, head_dim]``; dtype float16,
                bfloat16, float32.
            position_ids (torch.Tensor): The position of each token, in [0, max_position). Shape ``[tokens]``;
                dtype int32, int64. Each value in ``[0, max_position)``.
            key (torch.Tensor | None): Keyword-only. A second tensor rotated at the same positions in the same
                launch (the attention key): like x, with its own number of heads (GQA, MQA) and its own
                strides; the op then returns (out, key_out). Shape ``[tokens, key_heads, head_dim]``; dtype
                float16, bfloat16, float32. Default None.
            out (torch.Tensor | None): Keyword-only. Where to write the result (x rotated: a new tensor shaped
                and typed like x, or the out= tensor (out=x rotates in place).). Shaped and typed like ``x``,
                any strides; it may be its own input exactly (in place) but may not otherwise overlap another
                argument. Not while an input requires grad. Default None.
            key_out (torch.Tensor | None): Keyword-only. Where to write the result (key rotated, when key is
                given: a new tensor like key, or the key_out= tensor.). Shaped and typed like ``key``, any
                strides; it may be its own input exactly (in place) but may not otherwise overlap another
                argument. Not while an input requires grad. Default None.

        Returns:
            torch.Tensor | tuple: ``out``, a new tensor unless given; with ``key``, the tuple ``(out,
                key_out)``.

        Raises:
            TypeError: An argument is not a tensor, or has a dtype not listed above.
            ValueError: A shape that does not match the ones above, tensors on different devices, an output
                that overlaps another argument; or, by the manifest's rules: x: expected an even head_dim (the
                last dim); x: expected head_dim <= 1024; rotary_dim: expected rotary_dim <= head_dim. A value
                of ``position_ids`` outside its range raises ValueError naming its index and value, without a
                host sync (see the API page, Positions and gradients).
            RuntimeError: ``out=`` or another output given while an input requires grad.
        """
        return self._call({'x': x, 'position_ids': position_ids, 'key': key}, {'out': out, 'key_out':
            key_out})


class YaRNFwdOp(hooks.YaRNFwdHooks):
    """RoPE with YaRN frequency interpolation and attention scaling; neox or interleaved pairing.

    ``correction_dim(r) = D ln(original_max_position / (2π r)) / (2 ln base)``; pairs below ``low =
    max(floor(correction_dim(beta_fast)), 0)`` keep their frequency, pairs above ``high =
    min(ceil(correction_dim(beta_slow)), D - 1)`` are divided by ``scale``, with a linear ramp between. cos
    and sin are multiplied by ``mscale = (0.1 ln(scale) + 1) * attn_factor`` (``attn_factor`` alone when
    ``scale <= 1``), as vLLM's ``YaRNScalingRotaryEmbedding`` does.

    References: YaRN: Peng et al., 2023, arXiv:2309.00071; vLLM YaRNScalingRotaryEmbedding; HF transformers
        _compute_yarn_parameters.
    """

    def __init__(self, input_layout: str = "1d", base: float = 10000.0, scale: float = 16.0,
                 original_max_position: int = 4096, beta_fast: float = 32.0, beta_slow: float = 1.0,
                 attn_factor: float = 1.0, *, rope_layout: str = "neox",
                 target: str | Target | None = None) -> None:
        """Build the op; kernels are compiled at the first call.

        Args:
            input_layout (str): 1d: x is [seq_len, head_dim]; 2d: x is [batch, seq_len, num_heads, head_dim];
                bhsd: x is [batch, num_heads, seq_len, head_dim], transformers' layout (its transposed q and k
                as they come, no copy). One of ``"1d"``, ``"2d"``, ``"bhsd"``. Default ``"1d"``.
            base (float): The frequency base. Default ``10000.0``.
            scale (float): The context extension factor. Default ``16.0``.
            original_max_position (int): The pre-training context length. Default ``4096``.
            beta_fast (float): Rotations per original context above which a pair keeps its frequency. Default
                ``32.0``.
            beta_slow (float): Rotations per original context below which a pair is fully interpolated.
                Default ``1.0``.
            attn_factor (float): Extra factor on the amplitude of cos and sin. Default ``1.0``.
            rope_layout (str): Keyword-only. Which elements pair up: neox pairs (i, i + D/2) (HF rotate_half);
                interleaved pairs (2i, 2i+1), as DeepSeek-V2/V3 lay out their rope part (HF rope_interleave).
                One of ``"neox"``, ``"interleaved"``. Default ``"neox"``.
            target (str | Target | None): Which set of kernels serves this op: a registered target name,
                BUILTIN for the in-tree kernels, or None to decide from the input device at the first call.
                Default None.

        Raises:
            TypeError: A parameter has the wrong type.
            ValueError: A value outside its choices, an unknown ``target``; or, by the manifest's rules: base:
                expected a base > 0 and != 1 (YaRN divides by ln base); scale: expected scale > 0;
                original_max_position: expected original_max_position > 0; beta_fast: expected beta_fast > 0;
                beta_slow: expected beta_slow > 0.
        """
        self._setup({'input_layout': input_layout, 'base': base, 'scale': scale, 'original_max_position':
            original_max_position, 'beta_fast': beta_fast, 'beta_slow': beta_slow, 'attn_factor': attn_factor,
            'rope_layout': rope_layout}, target)

    def forward(self, x: torch.Tensor, *, position_ids: torch.Tensor | None = None,
                key: torch.Tensor | None = None, out: torch.Tensor | None = None,
                key_out: torch.Tensor | None = None) -> Any:
        """Run the op; ``op(...)`` calls this. Shapes and dtypes are taken from the first call, and inputs
        are never modified (except by ``out=`` naming an input, which takes the result in place).

        Gradients: differentiable in ``x`` and ``key``; an output carries a ``grad_fn`` when an input it is
        computed from requires grad. The gradients of x (and key): each output's gradient rotated by the
        negated angle, times the amplitude; one launch of the same kernel builder for both. A gradient of that
        gradient (double backward) raises.

        Args:
            x (torch.Tensor): The tensor to rotate; the position of a row is position_ids, or its index along
                seq_len when they are not given. Shape ``[seq_len, head_dim]`` (``input_layout="1d"``);
                ``[batch, seq_len, num_heads, head_dim]`` (``input_layout="2d"``); ``[batch, num_heads,
                seq_len, head_dim]`` (``input_layout="bhsd"``); dtype float16, bfloat16, float32.
            position_ids (torch.Tensor | None): Keyword-only. The position of each row, in [0, 2^24):
                [seq_len] (1d, or 2d and bhsd shared by the batch) or [batch, seq_len] (2d, bhsd); omitted
                means 0 .. seq_len - 1. Shape ``[seq_len]`` (``input_layout="1d"``); ``[batch, seq_len]`` or
                ``[seq_len]`` (``input_layout="2d"``); ``[batch, seq_len]`` or ``[seq_len]``
                (``input_layout="bhsd"``); dtype int32, int64. Each value in ``[0, 16777216)``. Default None.
            key (torch.Tensor | None): Keyword-only. A second tensor rotated at the same positions in the same
                launch (the attention key): like x, with its own number of heads (GQA, MQA) and its own
                strides; the op then returns (out, key_out). Shape ``[seq_len, head_dim]``
                (``input_layout="1d"``); ``[batch, seq_len, key_heads, head_dim]`` (``input_layout="2d"``);
                ``[batch, key_heads, seq_len, head_dim]`` (``input_layout="bhsd"``); dtype float16, bfloat16,
                float32. Default None.
            out (torch.Tensor | None): Keyword-only. Where to write the result (x rotated: a new tensor shaped
                and typed like x, or the out= tensor (out=x rotates in place).). Shaped and typed like ``x``,
                any strides; it may be its own input exactly (in place) but may not otherwise overlap another
                argument. Not while an input requires grad. Default None.
            key_out (torch.Tensor | None): Keyword-only. Where to write the result (key rotated, when key is
                given: a new tensor like key, or the key_out= tensor.). Shaped and typed like ``key``, any
                strides; it may be its own input exactly (in place) but may not otherwise overlap another
                argument. Not while an input requires grad. Default None.

        Returns:
            torch.Tensor | tuple: ``out``, a new tensor unless given; with ``key``, the tuple ``(out,
                key_out)``.

        Raises:
            TypeError: An argument is not a tensor, or has a dtype not listed above.
            ValueError: A shape that does not match the ones above, tensors on different devices, an output
                that overlaps another argument; or, by the manifest's rules: x: expected an even head_dim (the
                last dim); x: expected head_dim <= 1024; x: expected seq_len <= 2^24 (positions are 24-bit:
                three 256-row cos/sin tables). A value of ``position_ids`` outside its range raises ValueError
                naming its index and value, without a host sync (see the API page, Positions and gradients).
            RuntimeError: ``out=`` or another output given while an input requires grad.
        """
        return self._call({'x': x, 'position_ids': position_ids, 'key': key}, {'out': out, 'key_out':
            key_out})
