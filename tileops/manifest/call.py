"""What one call of an op specializes on (:class:`CallSpec`), and the dtype names manifests use."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CallSpec", "DTYPES", "DTYPE_NAMES"]

#: dtype names as manifests write them
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float64": torch.float64, "int32": torch.int32, "int64": torch.int64,
          "float8_e4m3fn": torch.float8_e4m3fn}
#: the manifest's name of each torch dtype
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class CallSpec:
    """What a call specializes on: the device, each input's dtype, and the dims the manifest's
    ``kernel.specialize`` lists (head_dim for RoPE); every other dim is dynamic."""

    device: torch.device
    dtypes: tuple[tuple[str, str], ...]  # (input name, dtype name)
    dims: tuple[tuple[str, int], ...]
    #: the schedule knobs chosen for the call over the manifest's ``kernel.static``, as
    #: ``((builder, knob, value), ...)`` (:mod:`tileops.schedules`); empty: the built-in schedule
    schedule: tuple[tuple[str, str, object], ...] = ()

    def dtype(self, name: str) -> str:
        return dict(self.dtypes)[name]

    def dim(self, name: str) -> int:
        return dict(self.dims)[name]

    @property
    def position_dtype(self) -> str | None:
        """The dtype name of ``position_ids`` when the call passes them, else None."""
        return dict(self.dtypes).get("position_ids")
