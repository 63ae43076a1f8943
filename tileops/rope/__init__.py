"""RoPE operators: rotary position embedding with base and scaled frequencies.

Every op is used the same way: construct once (the constructor takes what the kernel is compiled
with), then call it on tensors (``op(x)`` runs ``forward``). The classes are generated from the
manifests in ``manifests/rope/`` (:mod:`tileops.rope.ops`, every class it lists is exported here);
their behaviour is in :mod:`tileops.rope.hooks`.
"""

from . import ops
from .hf import from_hf_config
from .ops import *  # noqa: F401,F403 - the generated classes, as ops.__all__ lists them

__all__ = [*ops.__all__, "from_hf_config"]
