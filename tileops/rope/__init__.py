"""RoPE operators: rotary position embedding with base and scaled frequencies.

Every op is used the same way: construct once (the constructor takes what the kernel is compiled
with), then call it on tensors (``op(x)`` runs ``forward``). The classes are generated from the
manifests in ``manifests/rope/`` (:mod:`tileops.rope.ops`); their behaviour is in
:mod:`tileops.rope.hooks`.
"""

from .hf import from_hf_config
from .ops import (LongRoPEFwdOp, Phi3LongRoPEFwdOp, RoPEFwdOp, RoPELinearFwdOp, RoPELlama31FwdOp,
                  RoPENeoxPositionIdsFwdOp, YaRNFwdOp)

__all__ = ["RoPEFwdOp", "RoPENeoxPositionIdsFwdOp", "RoPELlama31FwdOp", "YaRNFwdOp", "LongRoPEFwdOp",
           "RoPELinearFwdOp", "Phi3LongRoPEFwdOp", "from_hf_config"]
