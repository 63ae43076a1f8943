"""Attention operators: the attention prologue (per-head q/k RMSNorm, RoPE at positions and the paged
KV-cache write) fused into one launch.

The op is a composition declared in its manifest (``manifests/attention/AttnPrologueFwdOp.yaml``,
``compose:``): a norm stage (the norm family's ``RMSNormFwdOp``), a rope stage (any op of the rope
family, passed as the constructor's ``rope``: its own frequency tables and kernel-spec fields) and
the cache write. The class is generated from that manifest (:mod:`tileops.attention.ops`); its
behaviour is in :mod:`tileops.attention.hooks`, the BUILTIN kernel's host side in
:mod:`tileops.attention.builtin`.
"""

from . import ops
from .ops import *  # noqa: F401,F403 - the generated classes, as ops.__all__ lists them

__all__ = list(ops.__all__)
