"""RoPE operators: rotary position embedding with base and scaled frequencies.

Every op is used the same way: construct once (the constructor takes what the kernel is compiled
with), then call it on tensors (``op(x)`` runs ``forward``).
"""

from .ops import LongRoPEFwdOp, RoPEFwdOp, RoPELlama31FwdOp, RoPENeoxPositionIdsFwdOp, YaRNFwdOp

__all__ = ["RoPEFwdOp", "RoPENeoxPositionIdsFwdOp", "RoPELlama31FwdOp", "YaRNFwdOp", "LongRoPEFwdOp"]
from .hf_ops import Phi3LongRoPEFwdOp, RoPELinearFwdOp  # noqa: E402
from .hf import from_hf_config  # noqa: E402

__all__ += ["RoPELinearFwdOp", "Phi3LongRoPEFwdOp", "from_hf_config"]
