"""tileops: LLM operators written as TileLang tile programs, behind a small PyTorch API.

    >>> import torch
    >>> import tileops
    >>> device = "cuda" if torch.cuda.is_available() else "cpu"
    >>> op = tileops.rope.RoPEFwdOp(rope_layout="neox", input_layout="2d")   # target=None
    >>> x = torch.randn(2, 128, 8, 64, device=device)   # [batch, seq_len, num_heads, head_dim]
    >>> out = op(x)       # served by the first call's device: the GPU or the CPU

Every family is a subpackage, ``tileops.<family>``: the in-tree ones and those of the family roots
named by ``TILEOPS_FAMILY_PATH`` (:mod:`tileops.families`), whose ``tileops/`` folders extend this
package's path. ``tileops.<family>`` is imported on first access.
"""

from .families import extend_path

__path__ = extend_path(__path__, "tileops")  # noqa: F821 - a package's own __path__

from . import rope  # noqa: E402
from .runtime import errors  # noqa: E402
from .runtime.errors import strict  # noqa: E402
from .targets import BUILTIN, Target, register_target, target_names  # noqa: E402

__version__ = "0.1.0"
__all__ = ["BUILTIN", "Target", "register_target", "target_names", "rope", "ops", "family_names", "strict",
           "__version__"]


def ops() -> dict[str, type]:
    """Every op class, keyed by its name (one per manifest)."""
    from .manifest import registry

    classes = {}
    for name, m in registry().items():
        module = __import__(f"tileops.{m.family}", fromlist=[name])
        classes[name] = getattr(module, name)
    return classes


def family_names() -> list[str]:
    """The name of every family with a manifest, in-tree and from ``TILEOPS_FAMILY_PATH``."""
    from .manifest import registry

    return sorted({m.family for m in registry().values()})


def __getattr__(name: str):
    """``tileops.<family>`` for a family not imported yet (``tileops.rope`` is imported eagerly)."""
    if not name.startswith("_") and name in family_names():
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'tileops' has no attribute {name!r}")
