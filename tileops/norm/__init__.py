"""Normalisation operators: RMSNorm and LayerNorm over the last dim, with a fused residual add.

Every op is used the same way: construct once (the constructor takes what the kernel is compiled
with), then call it on tensors (``op(x, weight)`` runs ``forward``). The classes are generated from
the manifests in ``manifests/norm/`` (:mod:`tileops.norm.ops`, every class it lists is exported
here); their behaviour is in :mod:`tileops.norm.hooks`, the BUILTIN kernels' host side in
:mod:`tileops.norm.builtin`.

A row is the last dim of ``x``; any leading dims are rows, so one op serves ``[tokens, hidden]``,
``[batch, seq, hidden]`` and per-head ``[tokens, heads, head_dim]`` with a ``[head_dim]`` weight.
Views are read and written where they lie when their rows sit at two strides (``(r // NH) * st +
(r % NH) * sh``: the q slice of a fused qkv buffer, every other head, a slice along seq); a view that
needs three strides, or whose last dim is not contiguous (or, on CUDA, whose pointer or strides are
not multiples of 16 bytes), is copied to a dense tensor first, and an output that is such a view is
written through a dense buffer: never computed where the kernel cannot address it.
"""

from . import ops
from .ops import *  # noqa: F401,F403 - the generated classes, as ops.__all__ lists them

__all__ = list(ops.__all__)
