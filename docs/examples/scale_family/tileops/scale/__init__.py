"""Scale operators: a tensor times a constant.

The example family of the adding-an-op page, outside the tree: found through ``TILEOPS_FAMILY_PATH``.
The classes are generated from ``manifests/scale/`` (:mod:`tileops.scale.ops`); their behaviour is in
:mod:`tileops.scale.hooks`.
"""

from . import ops
from .ops import *  # noqa: F401,F403 - the generated classes, as ops.__all__ lists them

__all__ = list(ops.__all__)
