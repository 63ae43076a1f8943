"""The fixed-size cos/sin digit tables a RoPE kernel composes by angle addition.

A position ``p < 2^24`` is ``d2 * 2^16 + d1 * 2^8 + d0``. For each digit ``k`` there is one table of
256 rows, ``TD[k, d] = (cos, sin)(d * 256^k * f)``, evaluated in float64 and rounded once to fp32,
with the amplitude ``A`` folded into ``TD[0]``. The kernel composes the three by angle addition, so
fp32 results stay within a few ulps at any position: an fp32 angle would be off by ``p * 2^-24``
rad (0.06 rad at p = 1e6).

The tables do not depend on the positions a call passes: built once per device (0.4 MB for a
rotated width of 128), they are never grown, reallocated or copied at call time. Dynamic NTK's
depend on its cached length: :class:`DynamicNTKTables` keeps them on the device and has a kernel
(``kernels/ntk.py``) rewrite them there when a call changes that length.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Callable

import torch

from ..compile.entry import encode_arg
from ..runtime.memory import persistent
from ..runtime.plan import Dims, Plan, Ptr, Scalar, Size, Step, Stride, Value, signature

__all__ = ["RoPETables", "DynamicNTKTables", "digit_tables"]

#: rows per digit table and the number of digits: positions below 256^3 = 2^24
LO = 256
DIGITS = 3


def digit_tables(inv_freq: torch.Tensor, amplitude: float) -> torch.Tensor:
    """``[DIGITS, LO, 2, R/2]`` fp32 on ``inv_freq``'s device: ``(cos, sin)(d * LO^k * f)``, evaluated in
    float64, amplitude in digit 0.

    The angles go through the C library's ``cos`` and ``sin`` (:mod:`math`), one at a time, not torch's:
    torch's float64 ``cos`` splits a call of 4,096 elements or more over its CPU threads, and the first
    such call of a process gave half of them values up to 6.8e-9 off (torch 2.13, this repository's
    2-core CI CPU: 5 processes of 25, never with one thread). Rounded to fp32, that moved some table
    entries by an ulp, so two ops with the same frequencies gave results a bit apart in some
    processes (``tests/test_native.py``'s bit-for-bit comparison of the two runtimes failed 6 runs of
    20). From :mod:`math` the tables are the same bits in every process: 3 x 256 x R/2 angles, some
    20 ms at R = 128, once per op and frequency set."""
    inv = inv_freq.detach().to(torch.float64).cpu().tolist()
    table = []
    for k in range(DIGITS):
        a = float(amplitude) if k == 0 else 1.0
        for d in range(LO):
            step = d * float(LO**k)  # exact; each angle then rounded once, as torch's tensors took it
            angles = [step * f for f in inv]
            for fn in (math.cos, math.sin):
                values = list(map(fn, angles))
                table.append(values if a == 1.0 else [v * a for v in values])  # (times 1.0 is exact)
    out = torch.tensor(table, dtype=torch.float64).view(DIGITS, LO, 2, len(inv))
    return out.to(torch.float32).to(inv_freq.device).contiguous()


class RoPETables:
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
                    t = self._on[device] = persistent(lambda: self._host.to(device), device)
        return t


class DynamicNTKTables:
    """Dynamic NTK's digit tables for one rotated width on one device, and the launch that keeps
    them and the op's cached length current: ``kernels/ntk.py``, one small kernel per call in the
    call's stream, ahead of the RoPE kernel, run by the op's runtime as the plan :data:`NTK_UPDATE`.
    This is the tables' holder at run time; what that kernel is compiled for is a
    :class:`kernels.ntk.NTKKernelSpec`. It updates the length (a float64 tensor on the device, the
    op's state) from the call's ``seq_len`` or ``max(position_ids) + 1`` and rewrites the
    tables only where the length changed; nothing is read on the host, so a call can be captured in
    a CUDA graph and replayed with other positions.

    One set per op, device and width, rewritten in place: calls of one op on two streams at once
    whose lengths move the state race on it (the torch-op version built fresh tables per call).
    Order such calls between the streams, or give each stream its own op."""

    def __init__(self, state: torch.Tensor, rot: int, device: torch.device, base: float, factor: float,
                 max_position_embeddings: int, limit: int):
        from tileops.compile.build import device_backend
        from tileops.kernels.ntk import DIGITS as KDIGITS, LO as KLO, NTKKernelSpec

        if (KLO, KDIGITS) != (LO, DIGITS):
            raise RuntimeError("tileops.rope.tables and kernels/ntk.py split positions differently")
        self.state, self.rot, self.device = state, rot, device
        self.backend, self.arch = device_backend(device)
        self.tables = persistent(lambda: torch.empty((DIGITS, LO, 2, rot // 2), dtype=torch.float32, device=device),
                                 device)
        # the length each block's share of the tables was built for; NaN: not built yet
        blocks = NTKKernelSpec(rot, backend=self.backend).blocks
        self.stamps = persistent(lambda: torch.full((blocks,), float("nan"), dtype=torch.float64, device=device),
                                 device)
        # doubles travel as their bits (the kernel's ``*_bits`` arguments are int64)
        doubles = {"base": base, "factor": factor, "mpe": max_position_embeddings, "power": rot / (rot - 2)}
        self._env = {f"{n}_bits": encode_arg("double", float(v)) for n, v in doubles.items()}
        self.limit = limit
        self._kernels: dict[str | None, Any] = {}

    def _kernel(self, positions: str | None) -> Any:
        got = self._kernels.get(positions)
        if got is None:
            from tileops.compile.build import load_kernel
            from tileops.kernels.ntk import NTKKernelSpec

            spec = NTKKernelSpec(self.rot, positions=positions, backend=self.backend)
            got = self._kernels[positions] = load_kernel("ntk", spec, self.backend, self.arch, self.device, spec.args)
        return got

    def update(self, position_ids: torch.Tensor | None, seq_len: int, run_plan: Callable[..., Any]) -> torch.Tensor:
        """Launch the update for a call of ``seq_len`` rows, or at ``position_ids`` (``[S]`` or
        ``[B, S]``, on this device), through ``run_plan`` (the op's :meth:`tileops.op.Op.run_plan`: its
        runtime, bound once per signature into its cache); returns the tables (``[DIGITS, LO, 2, R/2]``
        fp32), which the next call may rewrite."""
        if position_ids is not None and position_ids.numel() == 0:  # no position, no length: all stays
            return self.tables
        tensors = {"tables": self.tables, "state": self.state, "stamps": self.stamps, "position_ids": position_ids}
        # a length that changes every call (a decode step's) is a per-call scalar, not a new binding
        run_plan(self, signature(NTK_UPDATE.inputs, tensors), lambda: self._binding(tensors), tensors, {},
                 (seq_len if position_ids is None else 0,))
        return self.tables

    def _binding(self, tensors: dict) -> Any:
        p = tensors["position_ids"]
        env = {**self._env, "limit": 0 if p is None else self.limit}
        kernel = self._kernel(None if p is None else str(p.dtype).replace("torch.", ""))
        return NTK_UPDATE.bind({"ntk": kernel}, tensors, {}, env=env)


#: The dynamic-NTK update (``kernels/ntk.py``): the length from ``seq`` (a per-call scalar) or from
#: ``max(position_ids) + 1``, and the tables' blocks whose stamp differs rewritten; the tables, the
#: length (``state``) and the stamps are the holder's, written in place.
NTK_UPDATE = Plan(
    "dynamic NTK tables", inputs=("tables", "state", "stamps", "position_ids"), outputs=(), scalars=("seq",),
    # position_ids: [S] or [B, S] (a batch of one, or one shared, is B = 1 with stride 0), read one at a time
    dims={"position_ids": Dims({1: "s", 2: "bs"}, vector=False)},
    steps=(Step("ntk", {"TD": Ptr("tables"), "ST": Ptr("state"), "STAMP": Ptr("stamps"), "P": Ptr("position_ids"),
                        "B": Size("position_ids", "b"), "S": Size("position_ids", "s"),
                        "psb": Stride("position_ids", "b"), "pss": Stride("position_ids", "s"),
                        "limit": Value("limit"), "seq": Scalar("seq"), "base_bits": Value("base_bits"),
                        "factor_bits": Value("factor_bits"), "mpe_bits": Value("mpe_bits"),
                        "power_bits": Value("power_bits")}),))
