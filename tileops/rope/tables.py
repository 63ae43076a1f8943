"""The fixed-size cos/sin digit tables a RoPE kernel composes by angle addition.

A position ``p < 2^24`` is ``d2 * 2^16 + d1 * 2^8 + d0``. For each digit ``k`` there is one table of
256 rows, ``TD[k, d] = (cos, sin)(d * 256^k * f)``, evaluated in float64 and rounded once to fp32,
with the amplitude ``A`` folded into ``TD[0]``. The kernel composes the three by angle addition, so
fp32 results stay within a few ulps at any position: an fp32 angle would be off by ``p * 2^-24``
rad (0.06 rad at p = 1e6).

The tables do not depend on the positions a call passes: built once per device (0.4 MB for a
rotated width of 128), they are never grown, reallocated or copied at call time.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["RopeTables", "digit_tables"]

#: rows per digit table and the number of digits: positions below 256^3 = 2^24
LO = 256
DIGITS = 3


def digit_tables(inv_freq: torch.Tensor, amplitude: float) -> torch.Tensor:
    """``[DIGITS, LO, 2, R/2]`` fp32 on ``inv_freq``'s device: ``(cos, sin)(d * LO^k * f)``, evaluated in
    float64, amplitude in digit 0."""
    inv = inv_freq.to(torch.float64)
    d = torch.arange(LO, dtype=torch.float64, device=inv.device)
    out = []
    for k in range(DIGITS):
        angle = (d * float(LO**k))[:, None] * inv
        a = float(amplitude) if k == 0 else 1.0
        out.append(torch.stack([angle.cos() * a, angle.sin() * a], dim=1))
    return torch.stack(out).to(torch.float32).contiguous()


class RopeTables:
    """The digit tables of one frequency vector, one copy per device, built at first use."""

    def __init__(self, inv_freq: torch.Tensor, amplitude: float):
        self.inv_freq = inv_freq.to(torch.float64).cpu()
        self.amplitude = float(amplitude)
        self._host = digit_tables(self.inv_freq, self.amplitude)
        self._on: dict[torch.device, torch.Tensor] = {}
        self._lock = threading.Lock()

    def on(self, device: torch.device) -> torch.Tensor:
        """``[DIGITS, LO, 2, R/2]`` fp32 on ``device``."""
        t = self._on.get(device)
        if t is None:
            with self._lock:
                t = self._on.get(device)
                if t is None:
                    t = self._on[device] = self._host.to(device)
        return t
