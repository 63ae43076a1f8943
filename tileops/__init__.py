"""tileops: LLM operators written as TileLang tile programs, behind a small PyTorch API.

    >>> import tileops
    >>> op = tileops.rope.RoPEFwdOp(rope_layout="neox", input_layout="2d")   # target=None
    >>> out = op(x)       # x: [batch, seq_len, num_heads, head_dim], on a GPU or the CPU
"""

from . import errors, rope
from .errors import strict
from .targets import BUILTIN, Target, register_target, target_names

__version__ = "0.1.0"
__all__ = ["BUILTIN", "Target", "register_target", "target_names", "rope", "ops", "strict", "__version__"]


def ops() -> dict[str, type]:
    """Every op class, keyed by its name (one per manifest)."""
    from .manifest import registry

    classes = {}
    for name, m in registry().items():
        module = __import__(f"tileops.{m.family}", fromlist=[name])
        classes[name] = getattr(module, name)
    return classes
