"""The attention ops, generated from ``manifests/attention/`` by ``tileops generate``: do not edit.

Every signature, parameter list and parameter doc here comes from an op's manifest; the behaviour
comes from the hook class it inherits (:mod:`tileops.attention.hooks`). Change a manifest, then run
``tileops generate``; a test fails while this file and the manifests disagree.
"""

from __future__ import annotations

from typing import Any

import torch

from ..op import Op
from ..targets import Target
from . import hooks

__all__ = [
    "AttnFwdOp", "AttnPrologueFwdOp", "PagedAttnDecodeFwdOp",
]


class AttnFwdOp(hooks.AttnFwdHooks):
    """Attention forward on tensor cores (FlashAttention-class), dense or varlen, masks, softcap, GQA.

    ``out[b, i, h] = sum_j softmax_j(s[b, h, i, j]) v[b, j, h // (Hq / Hkv)]`` with ``s = (q . k) *
    softmax_scale`` (default ``1 / sqrt(head_dim)``), then ``softcap * tanh(s / softcap)`` with a softcap
    (Gemma 2). Inputs in FlashAttention's layout: q ``[batch, seq_q, Hq, D]``, k and v ``[batch, seq_k, Hkv,
    D]``; Hugging Face's ``[batch, heads, seq, D]`` passed as ``.transpose(1, 2)`` views is read where it lies
    (the strides are kernel arguments; only the last dim must be contiguous). Varlen: q ``[total_q, Hq, D]``,
    k and v ``[total_k, Hkv, D]`` with int32 ``cu_seqlens_q``/``cu_seqlens_k`` of ``batch + 1`` offsets;
    sequences of length 0 are allowed. The offsets are checked on the device without a host synchronisation
    (first 0, non-decreasing, last the token count): a bad one is reported as a ValueError naming its index,
    at a later call or ``op.check()`` (``tileops.strict()``: at the call), as positions are; its sequences are
    computed on the offsets clamped into the tokens, so nothing is addressed out of bounds.

    Masks are aligned bottom-right when ``seq_q != seq_k``: with ``causal`` query ``i`` sees key ``j`` iff ``j
    <= i + seq_k - seq_q``; ``sliding_window=w`` also hides ``j <= i + seq_k - seq_q - w`` (Mistral, Gemma
    2/3). A query that sees no key outputs zeros, and its lse is ``-inf``. Arithmetic in fp32, the softmax
    online in one pass over K and V (in base 2, as FlashAttention; the lse is returned in natural log).
    ``return_lse=True`` returns ``(out, lse)``, lse fp32 ``[batch, Hq, seq_q]`` (varlen ``[Hq, total_q]``):
    the contract of the backward.

    Built: the C schedule on the CPU (a query row per iteration, fp32/fp16/bf16) and on CUDA a FlashAttention
    tile program (``kernels/attention.py``): Q K^T and P V with ``T.gemm`` on tensor cores (wgmma on sm_90,
    mma on sm_80), K/V tiles through a shared-memory pipeline (TMA with a producer warpgroup on sm_90), online
    softmax in fp32 fragments, causal and window masks skipping whole tiles and evaluated only on the tiles
    they cut. CUDA: fp16 and bf16, every stride a multiple of 8 elements (16 bytes; a view off it is copied
    first). The forward's CUDA tests passed on the H200, and so did the backward's (every head dim, mask,
    softcap, MHA, varlen, HF's views, determinism). ``target="torch"`` computes attention and its gradients
    with PyTorch on any device; ``TILEOPS_ATTENTION_CUDA=0`` refuses CUDA calls that will take gradients
    (``NotImplementedError`` before any kernel runs).

    CUDA kernels are built by TileLang's own nvcc build, not tileops' lean one, which refuses their dynamic
    shared memory: the cold first call of a new specialization compiles for 16-18 s on the H200 (the forward;
    the backward's three programs 7-23 s each), and needs nvcc there. ``op.compile(...)`` or ``tileops
    warmup`` compiles them ahead of time, in parallel, into the disk cache that later processes load from.

    Gradients of q, k and v (``backward``; ``kernels/attention_bwd.py``): FlashAttention-2's backward as three
    programs of one plan, without atomics (the same inputs give the same bits). A dense CUDA call's tiles come
    by TMA from a producer warpgroup, two stages deep; a varlen call's are loaded by every thread, one stage
    deep (``loads`` 1 in ``kernels/attention_bwd.py``, which a schedule may set for a dense call too).
    ``return_lse=True`` is refused while an input requires grad (lse's gradient is not taken).

    References: Dao et al., FlashAttention-2 (2023) and FlashAttention-3 (2024); TileLang
        examples/flash_attention (GQA forward, varlen); torch.nn.functional.scaled_dot_product_attention
        (enable_gqa); flash_attn_varlen_func.

    Examples:
        >>> import torch
        >>> from tileops.attention import AttnFwdOp
        >>> op = AttnFwdOp(8, 2, 64, causal=True)
        >>> q = torch.randn(1, 6, 8, 64)   # [batch, seq_q, Hq, D]
        >>> k, v = torch.randn(2, 1, 9, 2, 64)   # [batch, seq_k, Hkv, D]
        >>> out, lse = op(q, k, v, return_lse=True)
        >>> out.shape, lse.shape
        (torch.Size([1, 6, 8, 64]), torch.Size([1, 8, 6]))
    """

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, *, causal: bool = False,
                 softmax_scale: float | None = None, sliding_window: int | None = None,
                 softcap: float | None = None, target: str | Target | None = None) -> None:
        """Build the op; kernels are compiled at the first call.

        Args:
            num_q_heads (int): Hq, the query heads. Required.
            num_kv_heads (int): Hkv, the key and value heads; Hq a multiple of it (GQA: q head h reads kv head
                h // (Hq / Hkv)). Required.
            head_dim (int): D, the elements of a head: 64, 80, 96, 128 or 256. Required.
            causal (bool): Keyword-only. Query i sees key j only when j <= i + seq_k - seq_q (bottom-right
                aligned). Default ``False``.
            softmax_scale (float | None): Keyword-only. The scores' scale; None: 1 / sqrt(head_dim). Default
                ``None``.
            sliding_window (int | None): Keyword-only. w: also hides key j when j <= i + seq_k - seq_q - w
                (each query sees at most its w latest keys under causal). Default ``None``.
            softcap (float | None): Keyword-only. c: the scaled scores become c * tanh(s / c) (Gemma 2's
                attn_logit_softcapping). Default ``None``.
            target (str | Target | None): Which set of kernels serves this op: a registered target name,
                BUILTIN for the in-tree kernels, or None to decide from the input device at the first call.
                Default None.

        Raises:
            TypeError: A parameter has the wrong type.
            ValueError: A value outside its choices, an unknown ``target``; or, by the manifest's rules:
                num_q_heads: expected num_q_heads > 0; num_kv_heads: expected num_kv_heads > 0; num_q_heads:
                expected num_q_heads a multiple of num_kv_heads (each kv head serves as many q heads);
                head_dim: expected a head_dim of 64, 80, 96, 128 or 256; sliding_window: expected a window of
                at least 1 key (or None); softcap: expected softcap > 0 (or None); softmax_scale: expected
                softmax_scale > 0 (or None).
        """
        self._setup({'num_q_heads': num_q_heads, 'num_kv_heads': num_kv_heads, 'head_dim': head_dim, 'causal':
            causal, 'softmax_scale': softmax_scale, 'sliding_window': sliding_window, 'softcap': softcap},
            target)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
                out: torch.Tensor | None = None, return_lse: bool = False) -> Any:
        """Run the op; ``op(...)`` calls this. Shapes and dtypes are taken from the first call, and inputs
        are never modified (except by ``out=`` naming an input, which takes the result in place).

        Gradients: differentiable in ``q``, ``k`` and ``v``; an output carries a ``grad_fn`` when an input it
        is computed from requires grad. dq, dk and dv (new tensors laid out like q, k, v; dk and dv summed
        over each kv head's group of q heads) from out's gradient, with the forward's lse, as one plan: delta
        = rowsum(dO * out) in fp32 (a per-call workspace laid out like lse), then a program per kv block and
        kv head writing dk and dv once, then a program per q block writing dq once: no atomics, so the same
        inputs give the same bits. Both recompute the scores and their probabilities from the lse (the masks
        and softcap as the forward applies them); a query that sees no key has zero gradient. Varlen calls
        bound each sequence by the token counts (no host synchronisation); views the kernels cannot address (a
        stride off 8 elements on CUDA, an expanded dO) are copied to dense tensors first. Not differentiable
        twice; lse's gradient is not taken (return_lse=True is refused while an input requires grad). Summed
        over every row: the gradient of ``k`` and ``v``. A gradient of that gradient (double backward) raises.

        Args:
            q (torch.Tensor): The queries; the last dim contiguous, any other strides. Shape ``[batch, seq_q,
                q_heads, q_dim]`` or ``[total_q, q_heads, q_dim]``; dtype float16, bfloat16, float32.
            k (torch.Tensor): The keys; q's dtype, as many dims as q. Shape ``[batch, seq_k, kv_heads,
                k_dim]`` or ``[total_k, kv_heads, k_dim]``; dtype float16, bfloat16, float32.
            v (torch.Tensor): The values, shaped as k. The shape and dtype of ``k``, exactly.
            cu_seqlens_q (torch.Tensor | None): Keyword-only. Varlen: sequence b's queries are rows
                cu_seqlens_q[b] to cu_seqlens_q[b + 1] of q (3-D q); int32, batch + 1 entries. Shape
                ``[cu_len]``; dtype int32. Default None.
            cu_seqlens_k (torch.Tensor | None): Keyword-only. Varlen: sequence b's keys and values are rows
                cu_seqlens_k[b] to cu_seqlens_k[b + 1] of k and v. The shape and dtype of ``cu_seqlens_q``,
                exactly. Default None.
            out (torch.Tensor | None): Keyword-only. Where to write the result (the attention output, shaped
                and typed like q). Shaped and typed like ``q``, any strides; it may be its own input exactly
                (in place) but may not otherwise overlap another argument. Not while an input requires grad.
                Default None.
            return_lse (bool): Keyword-only. Return ``(out, lse)``: lse fp32 [batch, Hq, seq_q] (varlen [Hq,
                total_q]), the natural log of each query's softmax denominator (its scores' log-sum-exp), -inf
                for a query that sees no key. Default False.

        Returns:
            torch.Tensor | tuple: ``out``, a new tensor unless given, unless a flag above says otherwise.

        Raises:
            TypeError: An argument is not a tensor, or has a dtype not listed above.
            ValueError: A shape that does not match the ones above, tensors on different devices, an output
                that overlaps another argument; or, by the manifest's rules: q: expected num_q_heads heads
                (dim -2); q: expected head_dim as the last dim; k: expected num_kv_heads heads (dim -2); k:
                expected head_dim as the last dim; k: expected q's dtype; cu_seqlens_q: expected None with a
                4-D (dense) q; varlen calls pass q [total_q, Hq, D]; cu_seqlens_k: expected None with a 4-D
                (dense) q; varlen calls pass q [total_q, Hq, D]; cu_seqlens_q: expected int32 offsets [batch +
                1] with a 3-D (varlen) q; cu_seqlens_k: expected int32 offsets [batch + 1] with a 3-D (varlen)
                q.
            RuntimeError: ``out=`` or another output given while an input requires grad.
        """
        return self._call({'q': q, 'k': k, 'v': v, 'cu_seqlens_q': cu_seqlens_q, 'cu_seqlens_k':
            cu_seqlens_k}, {'out': out}, {'return_lse': return_lse})


class AttnPrologueFwdOp(hooks.AttnPrologueFwdHooks):
    """The attention prologue in one launch, q/k RMSNorm, RoPE and the paged KV-cache write.

    Row ``t`` of ``qkv`` holds ``num_q_heads`` q heads, then ``num_kv_heads`` k heads and as many v heads of
    ``head_dim`` each. With ``qk_norm`` every q and k head is RMS-normalised over ``head_dim`` with its weight
    (the norm family's ``RMSNormFwdOp``, ``llama`` rounding, the result rounded to qkv's dtype as the unfused
    chain stores it); q and k are then rotated by the ``rope`` op's own angles at ``positions[t]`` (its
    frequencies, amplitude, pairing and rotated width: the rope family's digit tables, the one copy the rope
    op uses); q is returned, and k and v are written to the caches at slot ``s = slot_mapping[t]``: block ``s
    // block_size``, row ``s % block_size``. A negative slot skips the token's cache write (vLLM's padding); q
    is written whatever the slot.

    Frequencies that HF picks per call from the call's length are one fixed choice for the deployment here, as
    vLLM fixes them, so that keys written into the cache stay valid as the sequence grows:
    ``Phi3LongRoPEFwdOp`` uses its long factors when ``max_position_embeddings`` exceeds
    ``original_max_position_embeddings`` (else its short ones), and ``RoPEDynamicNTKFwdOp`` the NTK base at
    the deployment's maximum length ``factor * max_position_embeddings``. The rope ops themselves keep HF's
    per-call behaviour.

    Positions and slots are checked on the device: a position outside the rope op's range reads as 0, a slot
    at or past ``num_blocks * block_size`` writes nothing, so nothing is addressed out of bounds; the
    ValueError naming ``positions`` or ``slot_mapping`` is raised without a host synchronisation, at a later
    call or at ``op.check()`` (``tileops.strict()`` raises at the call itself), as the RoPE ops report
    positions.

    A float8 cache (``cache_dtype=torch.float8_e4m3fn``) holds ``saturate(x / scale)`` with the per-tensor
    fp32 ``k_scale`` and ``v_scale``, read on the device (a CUDA graph replays with the scales the tensors
    hold then): k is rounded to qkv's dtype first, as the unfused chain (rope, then vLLM's cache write) stores
    it, divided in fp32 and converted to the nearest e4m3 value, ties to even; values past 448 store 448
    (vLLM's convention), not the NaN of an unsaturated cast. On CUDA this is the hardware's conversion: sm_89
    and later (an older GPU is refused at the first call).

    Built: the C schedule on the CPU and the CUDA schedule on the GPU (a lane group per head row, every row's
    loads issued before the position, its cos/sin and the slot are read), every pairing and MRoPE's three
    position streams (through the rope family's own stages). On CUDA, qkv (its data pointer and row stride),
    both caches and the norm weights must lie on 16-byte vectors of the dtype (a ValueError names the one that
    does not; ``q_out`` off them is written through a copy), and a head row must fit one warp (at 16-byte
    vectors, head_dim up to 512 in bf16/fp16, 256 in fp32). On the H200, Qwen3's 32/8 heads of 128 in bf16 run
    at 90-93% of a same-bytes copy from 2,048 tokens up, YaRN and MRoPE's per-pair streams included, and at
    88-93% with float8 caches; 2.3 us a decode call of 64 tokens replayed in a CUDA graph
    (``benchmarks/prologue.py``).

    References: vLLM fused_qk_norm_rope and reshape_and_cache_flash; flashinfer
        rope_quantize_fp8_append_paged_kv_cache.

    Examples:
        >>> import torch
        >>> from tileops.attention import AttnPrologueFwdOp
        >>> from tileops.rope import RoPENeoxPositionIdsFwdOp
        >>> rope = RoPENeoxPositionIdsFwdOp(max_position=8192, base=1e6)
        >>> op = AttnPrologueFwdOp(4, 2, 64, rope, qk_norm=True)
        >>> qkv = torch.randn(5, (4 + 2 * 2) * 64, dtype=torch.bfloat16)
        >>> kc, vc = torch.zeros(2, 3, 16, 2, 64, dtype=torch.bfloat16)   # [blocks, block_size, kv heads, head_dim]
        >>> w = torch.ones(64, dtype=torch.bfloat16)
        >>> q = op(qkv, torch.arange(5), kc, vc, torch.tensor([0, 1, 2, -1, 17]), q_norm_weight=w, k_norm_weight=w)
        >>> q.shape
        torch.Size([5, 4, 64])
    """

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, rope: Op, *, qk_norm: bool = False,
                 eps: float = 1e-06, cache_layout: str = "NHD", cache_dtype: torch.dtype | None = None,
                 target: str | Target | None = None) -> None:
        """Build the op; kernels are compiled at the first call.

        Args:
            num_q_heads (int): Hq, the q heads of a row of qkv. Required.
            num_kv_heads (int): Hkv, the k heads (and as many v heads) of a row of qkv and of the caches.
                Required.
            head_dim (int): D, the elements of one head. Required.
            rope (Op): The rotary embedding: any op of the rope family that takes positions (its frequencies,
                amplitude, pairing and rotated width are composed into the kernel), or what
                tileops.rope.from_hf_config returns. Required.
            qk_norm (bool): Keyword-only. Per-head RMSNorm of q and k before the rotation (Qwen3), with
                q_norm_weight and k_norm_weight. Default ``False``.
            eps (float): Keyword-only. The norm's eps, added to the mean square (as an fp32 value). Default
                ``1e-06``.
            cache_layout (str): Keyword-only. NHD: caches [num_blocks, block_size, num_kv_heads, head_dim]
                (vLLM's flash layout); HND: [num_blocks, num_kv_heads, block_size, head_dim] (transformers'
                static cache, one block per sequence). One of ``"NHD"``, ``"HND"``. Default ``"NHD"``.
            cache_dtype (torch.dtype | None): Keyword-only. The caches' dtype: None (or qkv's dtype) for
                qkv's; torch.float8_e4m3fn stores x / scale, saturated at 448, with k_scale and v_scale. One
                of ``"float16"``, ``"bfloat16"``, ``"float32"``, ``"float8_e4m3fn"``. Default ``None``.
            target (str | Target | None): Which set of kernels serves this op: a registered target name,
                BUILTIN for the in-tree kernels, or None to decide from the input device at the first call.
                Default None.

        Raises:
            TypeError: A parameter has the wrong type.
            ValueError: A value outside its choices, an unknown ``target``; or, by the manifest's rules:
                num_q_heads: expected num_q_heads > 0; num_kv_heads: expected num_kv_heads > 0; num_q_heads:
                expected a multiple of num_kv_heads (every kv head serves as many q heads); head_dim: expected
                an even head_dim in [2, 1024]; eps: expected eps >= 0.
        """
        self._setup({'num_q_heads': num_q_heads, 'num_kv_heads': num_kv_heads, 'head_dim': head_dim, 'rope':
            rope, 'qk_norm': qk_norm, 'eps': eps, 'cache_layout': cache_layout, 'cache_dtype': cache_dtype},
            target)

    def forward(self, qkv: torch.Tensor, positions: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                q_out: torch.Tensor | None = None) -> Any:
        """Run the op; ``op(...)`` calls this. Shapes and dtypes are taken from the first call, and inputs
        are never modified (except by ``out=`` naming an input, which takes the result in place).

        Args:
            qkv (torch.Tensor): The projection's output: q, k and v heads of every token; the last dim
                contiguous, any row stride (a column slice of a wider buffer). fp16 or bf16 as served; fp32 as
                a model run in fp32 has it. Shape ``[tokens, width]``; dtype float16, bfloat16, float32.
            positions (torch.Tensor): The position of each token, in [0, the rope op's limit: its
                max_position, else 2^24); MRoPE takes [3, tokens]. Shape ``[tokens]`` or ``[streams,
                tokens]``; dtype int32, int64. Each value in ``[0, 16777216)``.
            key_cache (torch.Tensor): The paged key cache, written at the tokens' slots. Shape ``[num_blocks,
                block_size, cache_heads, cache_dim]`` (``cache_layout="NHD"``); ``[num_blocks, cache_heads,
                block_size, cache_dim]`` (``cache_layout="HND"``); dtype float16, bfloat16, float32,
                float8_e4m3fn. Written in place (never returned); it may share memory with no other argument.
            value_cache (torch.Tensor): The paged value cache, laid out as key_cache. The shape and dtype of
                ``key_cache``, exactly. Written in place (never returned); it may share memory with no other
                argument.
            slot_mapping (torch.Tensor): The cache slot of each token: block slot // block_size, row slot %
                block_size; negative skips the token (padding). Each slot at most once per call, as a serving
                engine's slot mapping has it: a slot named twice holds one of those tokens' rows (on the CPU
                the later one's; on a GPU whichever block writes last). Shape ``[tokens]``; dtype int32,
                int64. Each value in ``[-1, num_blocks * block_size)``.
            q_norm_weight (torch.Tensor | None): Keyword-only. The q heads' RMSNorm weight (with qk_norm), in
                qkv's dtype, contiguous (a strided one is refused by name). Shape ``[norm_dim]``; dtype
                float16, bfloat16, float32. Default None.
            k_norm_weight (torch.Tensor | None): Keyword-only. The k heads' RMSNorm weight (with qk_norm), in
                qkv's dtype. The shape and dtype of ``q_norm_weight``, exactly. Default None.
            k_scale (torch.Tensor | None): Keyword-only. The key cache's per-tensor scale (fp8 caches only):
                stored value = k / k_scale, saturated; read on the device. It must be positive and finite,
                which the op does not check (a check of a device value would wait for the GPU at every call):
                a scale of 0 stores +-448. Shape ``[]`` or ``[scale_len]``; dtype float32. Default None.
            v_scale (torch.Tensor | None): Keyword-only. The value cache's per-tensor scale (fp8 caches only).
                The shape and dtype of ``k_scale``, exactly. Default None.
            q_out (torch.Tensor | None): Keyword-only. Where to write the result (q normalised (with qk_norm)
                and rotated, [tokens, num_q_heads, head_dim] in qkv's dtype; q_out= writes into a given
                tensor). Shape ``[tokens, num_q_heads, head_dim]``, typed like ``qkv``, any strides; it may be
                its own input exactly (in place) but may not otherwise overlap another argument. Not while an
                input requires grad. Default None.

        Returns:
            torch.Tensor | tuple: ``q_out``, a new tensor unless given.

        Raises:
            TypeError: An argument is not a tensor, or has a dtype not listed above.
            ValueError: A shape that does not match the ones above, tensors on different devices, an output
                that overlaps another argument; or, by the manifest's rules: qkv: expected a last dim of
                (num_q_heads + 2 * num_kv_heads) * head_dim; key_cache: expected num_kv_heads heads in the
                cache's heads dim (dim 2 for NHD, dim 1 for HND: is cache_layout right?); key_cache: expected
                head_dim as the cache's last dim; key_cache: expected at least one block of at least one row;
                qkv: expected qkv in cache_dtype, or cache_dtype None or float8_e4m3fn (the kernel converts to
                float8 and to nothing else); key_cache: expected the cache in cache_dtype (None: qkv's dtype);
                q_norm_weight: expected a [head_dim] weight; q_norm_weight: expected the weight in qkv's
                dtype; q_norm_weight: expected no norm weights without qk_norm=True; k_norm_weight: expected
                no norm weights without qk_norm=True; q_norm_weight: expected q_norm_weight and k_norm_weight
                with qk_norm=True; k_norm_weight: expected k_norm_weight with qk_norm=True; k_scale: expected
                one scale per tensor, [] or [1]; k_scale: expected no k_scale or v_scale without an fp8 cache
                (cache_dtype=torch.float8_e4m3fn); k_scale: expected k_scale and v_scale with an fp8 cache. A
                value of ``positions``, ``slot_mapping`` outside its range raises ValueError naming its index
                and value, without a host sync (see the API page, Positions and gradients).
        """
        return self._call({'qkv': qkv, 'positions': positions, 'key_cache': key_cache, 'value_cache':
            value_cache, 'slot_mapping': slot_mapping, 'q_norm_weight': q_norm_weight, 'k_norm_weight':
            k_norm_weight, 'k_scale': k_scale, 'v_scale': v_scale}, {'q_out': q_out})


class PagedAttnDecodeFwdOp(hooks.PagedAttnDecodeFwdHooks):
    """Decode attention over the paged KV cache the prologue writes, split-KV and merged, GQA, float8 caches.

    One query token a sequence: ``out[b, h] = sum_j softmax_j(s[b, h, j]) v[b, j, h // (Hq / Hkv)]`` over the
    ``L = seq_lens[b]`` tokens of sequence ``b`` in the caches (the current one included: the prologue has
    written it), ``s = (q . k) * softmax_scale`` (default ``1 / sqrt(head_dim)``), then ``softcap * tanh(s /
    softcap)`` with a softcap. Token ``j`` of sequence ``b`` lies in cache block ``block_tables[b, j //
    block_size]`` at row ``j % block_size``: the caches are exactly what ``AttnPrologueFwdOp`` writes, with
    the same ``cache_layout`` (NHD ``[num_blocks, block_size, Hkv, D]``, vLLM's; HND ``[num_blocks, Hkv,
    block_size, D]``, a transformers static cache with one block a sequence) and ``cache_dtype`` (a float8
    cache reads as ``e4m3 * k_scale`` and ``e4m3 * v_scale``). ``sliding_window=w`` hides the keys ``j < L -
    w`` (the query is token ``L - 1``: bottom-right, as ``AttnFwdOp``). A sequence of no visible key outputs
    zeros.

    The block tables and lengths are checked on the device, without a host synchronisation: an entry outside
    ``[0, num_blocks)`` that a sequence reaches is skipped (nothing is read out of bounds) and a length
    outside ``[0, max_blocks * block_size]`` is read clamped into its table; each is reported as a ValueError
    naming ``block_tables[b, i]`` or ``seq_lens[b]``, at a later call or ``op.check()`` (``tileops.strict()``:
    at the call), as the prologue reports slots.

    A call is a plan of two programs (``kernels/paged_decode.py``): ``partial``, a program per (split, kv
    head, sequence) that reads its split of the sequence's tokens once, every key serving the kv head's group
    of q heads, into per-split outputs and log-sum-exps (the plan's workspaces, fp32); then ``merge``, a
    program per (q head, sequence) that weighs the splits. The splits come from the shapes alone (no
    synchronisation): as many programs as fill the device in one wave at small batches, none finer than 256
    tokens. A call of one split (a large batch, or short contexts) is one launch: the partial writes out
    itself, the merge's answer to the bit, with no workspace. Arithmetic in fp32, the softmax online.

    Built: the C schedule on the CPU (fp32, fp16, bf16; float8 caches), tested in CI, and two CUDA schedules.
    For fp16 and bf16 q, tensor cores (``mma``): a program's q heads (up to 16 of the kv head's group) are the
    rows of ``mma.sync`` products over tiles of 128 tokens, the next tile's loaded during this one's products
    (a float8 cache: tiles of 64; head_dim 256: tiles of 64, loaded in turn), each tile's key and value rows
    gathered through the block table into shared memory as 16-byte vectors (a float8 cache's eight elements a
    vector widened together to fp16 by the hardware's conversion, exactly, its scales applied to the fp32
    scores and output; the products are then fp16, a bf16 q's head rows rescaled into fp16 by a power of two
    each, exactly, and the scores by its inverse); ``q . k`` and ``p . v`` accumulate in fp32, p is rounded to
    the products' type for ``p . v``, and the softmax is ``AttnFwdOp``'s, one rescale a tile. For fp32 q, CUDA
    cores: lane groups of ``head_dim / 8`` lanes (4-element vectors for fp32), a token a group, each lane
    loading a 16-byte vector of the token's key and value rows for 2 tokens, copied into shared memory by
    ``cp.async`` a step ahead; the group's dot products summed by xor-shuffles; a program serves up to 8 q
    heads. head_dim: a multiple of 8 (4 for fp32) up to 256 (128 for fp32) on CUDA, else
    ``NotImplementedError`` at the first call naming ``target="torch"``. q and out off the 16-byte vectors go
    through a dense copy; a cache off them is a ValueError naming it. The tensor-core program is built by
    TileLang's own nvcc build, not tileops' lean one, which refuses its dynamic shared memory: the cold first
    call of a new specialization compiles it (10-30 s a program on a 2-core machine; not timed on the H200)
    and needs nvcc there; the merge and the fp32 program take the lean build. ``op.compile(...)`` or ``tileops
    warmup`` compiles them ahead of time into the disk cache. The schedules' GPU tests passed on the H200;
    ``TILEOPS_ATTENTION_CUDA=0`` refuses CUDA calls (``NotImplementedError`` before anything runs, naming
    ``target="torch"``).

    References: vLLM paged_attention (v1/v2: split-KV partitions and their reduce); flashinfer
        BatchDecodeWithPagedKVCache; Dao et al., Flash-Decoding (2023).

    Examples:
        >>> import torch
        >>> from tileops.attention import PagedAttnDecodeFwdOp
        >>> op = PagedAttnDecodeFwdOp(8, 2, 64)
        >>> kc, vc = torch.randn(2, 6, 16, 2, 64)   # [num_blocks, block_size, Hkv, D] (NHD)
        >>> tables = torch.tensor([[4, 0], [5, -1]], dtype=torch.int32)   # sequence 1 holds one block
        >>> out = op(torch.randn(2, 8, 64), kc, vc, tables, torch.tensor([20, 3], dtype=torch.int32))
        >>> out.shape
        torch.Size([2, 8, 64])
    """

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, *,
                 softmax_scale: float | None = None, sliding_window: int | None = None,
                 softcap: float | None = None, cache_layout: str = "NHD",
                 cache_dtype: torch.dtype | None = None, target: str | Target | None = None) -> None:
        """Build the op; kernels are compiled at the first call.

        Args:
            num_q_heads (int): Hq, the query heads. Required.
            num_kv_heads (int): Hkv, the caches' heads; Hq a multiple of it (q head h reads kv head h // (Hq /
                Hkv)). Required.
            head_dim (int): D, the elements of a head: 64, 128 or 256. Required.
            softmax_scale (float | None): Keyword-only. The scores' scale; None: 1 / sqrt(head_dim). Default
                ``None``.
            sliding_window (int | None): Keyword-only. w: the query (token L - 1) sees the keys j >= L - w
                only. Default ``None``.
            softcap (float | None): Keyword-only. c: the scaled scores become c * tanh(s / c) (Gemma 2).
                Default ``None``.
            cache_layout (str): Keyword-only. NHD: caches [num_blocks, block_size, num_kv_heads, head_dim];
                HND: [num_blocks, num_kv_heads, block_size, head_dim] (AttnPrologueFwdOp's meanings). One of
                ``"NHD"``, ``"HND"``. Default ``"NHD"``.
            cache_dtype (torch.dtype | None): Keyword-only. The caches' dtype: None (or q's dtype) for q's;
                torch.float8_e4m3fn reads e4m3 * scale with k_scale and v_scale. One of ``"float16"``,
                ``"bfloat16"``, ``"float32"``, ``"float8_e4m3fn"``. Default ``None``.
            target (str | Target | None): Which set of kernels serves this op: a registered target name,
                BUILTIN for the in-tree kernels, or None to decide from the input device at the first call.
                Default None.

        Raises:
            TypeError: A parameter has the wrong type.
            ValueError: A value outside its choices, an unknown ``target``; or, by the manifest's rules:
                num_q_heads: expected num_q_heads > 0; num_kv_heads: expected num_kv_heads > 0; num_q_heads:
                expected num_q_heads a multiple of num_kv_heads (each kv head serves as many q heads);
                head_dim: expected a head_dim of 64, 128 or 256; sliding_window: expected a window of at least
                1 key (or None); softcap: expected softcap > 0 (or None); softmax_scale: expected
                softmax_scale > 0 (or None).
        """
        self._setup({'num_q_heads': num_q_heads, 'num_kv_heads': num_kv_heads, 'head_dim': head_dim,
            'softmax_scale': softmax_scale, 'sliding_window': sliding_window, 'softcap': softcap,
            'cache_layout': cache_layout, 'cache_dtype': cache_dtype}, target)

    def forward(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                block_tables: torch.Tensor, seq_lens: torch.Tensor, *, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None, out: torch.Tensor | None = None) -> Any:
        """Run the op; ``op(...)`` calls this. Shapes and dtypes are taken from the first call, and inputs
        are never modified (except by ``out=`` naming an input, which takes the result in place).

        Args:
            q (torch.Tensor): The current token of each sequence, [batch, Hq, D]; the last dim contiguous, any
                other strides. Shape ``[batch, q_heads, q_dim]``; dtype float16, bfloat16, float32.
            key_cache (torch.Tensor): The paged key cache, as AttnPrologueFwdOp writes it (read here, never
                written). Shape ``[num_blocks, block_size, cache_heads, cache_dim]`` (``cache_layout="NHD"``);
                ``[num_blocks, cache_heads, block_size, cache_dim]`` (``cache_layout="HND"``); dtype float16,
                bfloat16, float32, float8_e4m3fn.
            value_cache (torch.Tensor): The paged value cache, laid out as key_cache (the same strides). The
                shape and dtype of ``key_cache``, exactly.
            block_tables (torch.Tensor): Sequence b's cache blocks in order: token j in block block_tables[b,
                j // block_size]; int32 [batch, max_blocks]. Entries past a sequence's length are not read
                (any value). Shape ``[batch, max_blocks]``; dtype int32. Each value in ``[0, num_blocks)``.
            seq_lens (torch.Tensor): The tokens of each sequence in the caches, the current one included;
                int32 [batch], at most max_blocks * block_size. Shape ``[batch]``; dtype int32. Each value in
                ``[0, max_blocks * block_size + 1)``.
            k_scale (torch.Tensor | None): Keyword-only. The key cache's per-tensor scale (fp8 caches only): a
                key reads as e4m3 * k_scale; read on the device. Shape ``[]`` or ``[scale_len]``; dtype
                float32. Default None.
            v_scale (torch.Tensor | None): Keyword-only. The value cache's per-tensor scale (fp8 caches only).
                The shape and dtype of ``k_scale``, exactly. Default None.
            out (torch.Tensor | None): Keyword-only. Where to write the result (the attention output [batch,
                Hq, D], typed like q). Shaped and typed like ``q``, any strides; it may be its own input
                exactly (in place) but may not otherwise overlap another argument. Not while an input requires
                grad. Default None.

        Returns:
            torch.Tensor | tuple: ``out``, a new tensor unless given.

        Raises:
            TypeError: An argument is not a tensor, or has a dtype not listed above.
            ValueError: A shape that does not match the ones above, tensors on different devices, an output
                that overlaps another argument; or, by the manifest's rules: q: expected num_q_heads heads
                (dim 1); q: expected head_dim as the last dim; key_cache: expected num_kv_heads heads in the
                cache's heads dim (dim 2 for NHD, dim 1 for HND: is cache_layout right?); key_cache: expected
                head_dim as the cache's last dim; key_cache: expected at least one block of at least one row;
                q: expected q in cache_dtype, or cache_dtype None or float8_e4m3fn; key_cache: expected the
                cache in cache_dtype (None: q's dtype); block_tables: expected at least one block a sequence;
                k_scale: expected one scale per tensor, [] or [1]; k_scale: expected no k_scale or v_scale
                without an fp8 cache (cache_dtype=torch.float8_e4m3fn); k_scale: expected k_scale and v_scale
                with an fp8 cache. A value of ``block_tables``, ``seq_lens`` outside its range raises
                ValueError naming its index and value, without a host sync (see the API page, Positions and
                gradients).
        """
        return self._call({'q': q, 'key_cache': key_cache, 'value_cache': value_cache, 'block_tables':
            block_tables, 'seq_lens': seq_lens, 'k_scale': k_scale, 'v_scale': v_scale}, {'out': out})
