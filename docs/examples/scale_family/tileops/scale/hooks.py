"""The scale family's hooks: what an op does besides its signature (which is generated)."""

from __future__ import annotations

from tileops.op import Op

__all__ = ["ScaleFwdHooks"]


class ScaleFwdHooks(Op):
    """``ScaleFwdOp``: the factor the kernel multiplies by."""

    @property
    def factor(self) -> float:
        return self.params["c"]
