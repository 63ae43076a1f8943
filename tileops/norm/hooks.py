"""The norm family's hooks: everything an op of the family does besides its signature.

Each op class in :mod:`tileops.norm.ops` is generated from its manifest (``tileops generate``) and
inherits the hook class its manifest names (``hooks:``), defined here: which kernel a call needs
(:meth:`NormHooks.kernel_fields_of`, a function of the params and the call's dtypes alone, so that
``tileops warmup`` names an op's kernels without constructing it) and the checks the rule language
does not express. Nothing here declares a parameter.
"""

from __future__ import annotations

import math
import struct
from typing import Any

from ..op import Op

__all__ = ["NormHooks", "RMSNormFwdHooks", "LayerNormFwdHooks", "MAX_ROWS"]

#: the kernels count rows in int32 (``M``, and the row index of each block)
MAX_ROWS = 2**31 - 1


class NormHooks(Op):
    """What both norms share: one kernel builder (``kernels/norm.py``), its spec's fields from the
    op's params and a call's dtypes."""

    #: the builder's ``norm`` field
    norm = "rms"

    @classmethod
    def rounding_of(cls, params: Any, dtype: str) -> str:
        """Where the output rounds (the builder's ``rounding``): ``"fp32"`` for LayerNorm."""
        return "fp32"

    @classmethod
    def kernel_fields_of(cls, params: Any, call: Any) -> dict[str, Any]:
        """The fields of :class:`kernels.norm.NormKernelSpec` (less ``kind``, ``backend`` and the
        manifest's ``kernel.static``) for a call of specialization ``call`` to an op built with ``params``."""
        given = dict(call.dtypes)
        dtype = given["x"]
        out = params.get("out_dtype")
        return {"hidden": call.dim("hidden"), "dtype": dtype, "weight": given.get("weight"), "bias": given.get("bias"),
                "out_dtype": None if out in (None, dtype) else out, "norm": cls.norm,
                "rounding": cls.rounding_of(params, dtype), "offset": float(params.get("offset", 0.0)),
                "residual": "residual" in given}

    def _check_more(self, tensors: Any, dims: Any) -> None:
        x = tensors["x"]
        rows = math.prod(x.shape[:-1])
        if rows > MAX_ROWS:
            raise ValueError(f"{self.name}: x: expected at most 2^31 - 1 rows (the product of the dims before the "
                             f"last; the kernels count rows in int32), got {rows} in shape {list(x.shape)}")


class RMSNormFwdHooks(NormHooks):
    """``RMSNormFwdOp``: Hugging Face's two roundings, and a Gemma-style offset compiled in."""

    @classmethod
    def rounding_of(cls, params: Any, dtype: str) -> str:
        """``rounding``, or by default ``llama`` without an offset and ``fp32`` with one. For an fp32
        x both compute the same values (rounding to fp32 changes nothing): one kernel, ``fp32``'s."""
        rounding = params["rounding"] or ("llama" if params["offset"] == 0 else "fp32")
        return "fp32" if dtype == "float32" else rounding

    def _check_params(self, params: dict[str, Any]) -> dict[str, Any]:
        params = super()._check_params(params)
        offset = params["offset"]
        # compiled into the kernel as a float constant: it must survive fp32, and TileLang's C
        # backend, which prints float constants with 7 significant digits
        if struct.unpack("<f", struct.pack("<f", offset))[0] != offset or float(f"{offset:.6e}") != offset:
            raise ValueError(f"{self.name}: offset: expected a value exact in fp32 and in 7 significant digits "
                             f"(0.0, 1.0, 0.5 ...), got {offset!r}")
        return params


class LayerNormFwdHooks(NormHooks):
    """``LayerNormFwdOp``: the mean subtracted, weight and bias optional, one rounding."""

    norm = "layer"
