"""The two small cos/sin tables a RoPE kernel composes by angle addition.

Position ``p = hi * LO + lo``. ``TH[hi] = (cos, sin)(hi * LO * f)`` and
``TL[lo] = A * (cos, sin)(lo * f)`` are evaluated in float64 and rounded once to fp32, so that
``cos(p f) = ch cl - sh sl`` in fp32 stays within a few ulps at any position: an fp32 angle would
be off by ``p * 2^-24`` rad (0.06 rad at p = 1e6). The amplitude ``A`` rides in the low table.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["RopeTables"]


def _cos_sin(angle: torch.Tensor, amplitude: float = 1.0) -> torch.Tensor:
    return (torch.stack([angle.cos(), angle.sin()], dim=1) * amplitude).to(torch.float32).contiguous()


class RopeTables:
    """Tables for one frequency vector, per device, grown (doubling) as longer positions come."""

    def __init__(self, inv_freq: torch.Tensor, amplitude: float, lo: int):
        self.lo = lo  # the kernel's split, ``kernels.rope.LO``
        self.inv_freq = inv_freq.to(torch.float64).cpu()
        self.amplitude = float(amplitude)
        self._low: dict[torch.device, torch.Tensor] = {}
        self._high: dict[torch.device, torch.Tensor] = {}
        self._lock = threading.Lock()

    def low(self, device: torch.device) -> torch.Tensor:
        """``[lo, 2, R/2]`` fp32: amplitude * (cos, sin) of ``lo * f``."""
        t = self._low.get(device)
        if t is None:
            with self._lock:
                t = self._low.get(device)
                if t is None:
                    angle = torch.arange(self.lo, dtype=torch.float64)[:, None] * self.inv_freq
                    t = self._low[device] = _cos_sin(angle, self.amplitude).to(device)
        return t

    def high(self, device: torch.device, positions: int) -> torch.Tensor:
        """``[NH, 2, R/2]`` fp32 covering positions ``0 .. positions - 1`` (NH >= ceil(positions / LO))."""
        rows = max(1, -(-positions // self.lo))
        t = self._high.get(device)
        if t is None or t.shape[0] < rows:
            with self._lock:
                t = self._high.get(device)
                if t is None or t.shape[0] < rows:
                    cap = 1 << (rows - 1).bit_length()  # grow by doubling: few rebuilds over a run
                    angle = (torch.arange(cap, dtype=torch.float64) * self.lo)[:, None] * self.inv_freq
                    t = self._high[device] = _cos_sin(angle).to(device)
        return t
