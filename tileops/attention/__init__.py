"""Attention operators: attention forward and backward on tensor cores, the attention prologue (per-head
q/k RMSNorm, RoPE at positions and the paged KV-cache write) fused into one launch, and paged decode over
the cache the prologue writes.

``AttnFwdOp`` (``manifests/attention/AttnFwdOp.yaml``) is softmax attention in one pass over K/V,
FlashAttention's layout, dense or varlen, causal (bottom-right), sliding window, softcap and GQA; its
kernels are ``kernels/attention.py`` (a C schedule for the CPU; on CUDA a tile program with ``T.gemm``
on tensor cores and K/V tiles pipelined through shared memory), its host side
:mod:`tileops.attention.attn_builtin`. ``return_lse=True`` also returns the fp32 log-sum-exp the
backward reads. Gradients of q, k and v: ``kernels/attention_bwd.py``'s three programs as one plan
(``TILEOPS_ATTENTION_CUDA=0`` refuses them on CUDA: ``attn_builtin.cuda_enabled``).

``PagedAttnDecodeFwdOp`` (``manifests/attention/PagedAttnDecodeFwdOp.yaml``) reads the paged KV cache
the prologue writes, one query token a sequence, as a plan of two programs (``kernels/paged_decode.py``:
split-KV partials, then their merge; one launch when a call has one split); its host side is
:mod:`tileops.attention.decode_builtin`. A C schedule for the CPU; on CUDA, tensor cores (``mma.sync``
over tiles of tokens gathered from the pages) for fp16 and bf16 q, and CUDA cores (16-byte vectors, a
lane group a token) for fp32 (``TILEOPS_ATTENTION_CUDA=0`` refuses them:
:func:`tileops.attention.decode_builtin.cuda_enabled`).

The prologue is a composition declared in its manifest (``manifests/attention/AttnPrologueFwdOp.yaml``,
``compose:``): a norm stage (the norm family's ``RMSNormFwdOp``), a rope stage (any op of the rope
family, passed as the constructor's ``rope``: its own frequency tables and kernel-spec fields) and
the cache write. The class is generated from that manifest (:mod:`tileops.attention.ops`); its
behaviour is in :mod:`tileops.attention.hooks`, the BUILTIN kernel's host side in
:mod:`tileops.attention.builtin`.
"""

from . import ops
from .ops import *  # noqa: F401,F403 - the generated classes, as ops.__all__ lists them

__all__ = list(ops.__all__)
