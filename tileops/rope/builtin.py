"""BUILTIN implementation of the RoPE family: TileLang kernels from ``kernels/rope.py``.

One object per (op, call specialization) holds the compiled forward kernel (the backward, the same
builder with ``inverse=True``, is compiled at the first backward) and launches it on views as they
come: x, the output and positions are passed as pointers and strides, so a transposed or sliced
view is rotated where it lies. The one fallback: a view whose last dim is not contiguous, or (on
CUDA) whose pointer or strides are not multiples of 16 bytes, is copied to a dense tensor first,
because the kernel moves 16 bytes per access.
"""

from __future__ import annotations

from typing import Any

import torch

from ..generate import compile_kernel, device_backend
from ..launch import raw_kernel
from .tables import DIGITS, LO

__all__ = ["implement", "kernel_spec", "RopeKernels"]

#: flat extents are declared to the kernel (it does not read them); the C entry point takes int32
_INT32_MAX = 2**31 - 1


def kernel_spec(op: Any, call: Any, backend: str, inverse: bool = False) -> Any:
    """The :class:`kernels.rope.RopeKernelSpec` serving ``op`` for one call specialization."""
    from tileops.kernels.rope import RopeKernelSpec

    # a static choice is one value, or a map from input layout to value (schedules differ by layout)
    static = {k: (v[op.layout] if isinstance(v, dict) else v) for k, v in op.manifest.kernel.static.items()}
    head_dim = call.dim("head_dim")
    return RopeKernelSpec(dtype=call.dtype("x"), head_dim=head_dim, rot=op.rotated_width(head_dim),
                          pairing=op.pairing, positions=call.position_dtype, inverse=inverse, backend=backend,
                          **static)


def _span(t: torch.Tensor) -> int:
    return min(_INT32_MAX, 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())))


class RopeKernels:
    """The kernels of one op specialization, and how a call's tensors are handed to them."""

    def __init__(self, op: Any, spec: Any):
        self.op = op
        self.spec = spec
        self.device = spec.device
        self.backend, self.arch = device_backend(self.device)
        self.kspec = kernel_spec(op, spec, self.backend)
        self._kernels: dict[bool, Any] = {}
        self.forward_kernel = self._kernel(False)
        self.unit = self.kspec.stride_unit
        self.layout = op.layout
        # the tables a call may use: one set, or several that a call picks from on the device
        rot = self.kspec.rot
        self.tables = op._tables(rot)
        self.limit = op.position_limit()
        from tileops.kernels.rope import DIGITS as KDIGITS, LO as KLO

        if (KLO, KDIGITS) != (LO, DIGITS):
            raise RuntimeError("tileops.rope.tables and kernels/rope.py split positions differently")

    def _kernel(self, inverse: bool) -> Any:
        k = self._kernels.get(inverse)
        if k is None:
            kspec = self.kspec if not inverse else kernel_spec(self.op, self.spec, self.backend, inverse=True)
            compiled = compile_kernel(self.op.manifest.kernel.builder, kspec, self.backend, self.arch)
            k = self._kernels[inverse] = raw_kernel(compiled, self.device, kspec.args)
        return k

    # ------------------------------------------------------------------------------ per call
    def prepare(self, tensors: dict) -> torch.Tensor:
        """The digit tables this call uses (``[DIGITS, LO, 2, R/2]`` on the device); no host sync."""
        return self.tables_for(tensors["x"], tensors.get("position_ids"))

    def forward(self, tables: torch.Tensor, tensors: dict) -> torch.Tensor:
        return self.run(tensors["x"], tensors.get("position_ids"), tables)

    def backward(self, tables: torch.Tensor, grad: torch.Tensor, tensors: dict) -> torch.Tensor:
        """The gradient of x: ``grad`` rotated by the negated angle, times the amplitude."""
        return self.run(grad, tensors.get("position_ids"), tables, inverse=True)

    def tables_for(self, x: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        choice = self.op.choose_table(position_ids, self._seq_len(x))
        sets = [t.on(self.device) for t in self.tables]
        if len(sets) == 1:
            return sets[0]
        if isinstance(choice, int):
            return sets[choice]
        stacked = torch.stack(sets)  # small (3 x 256 rows): picked on the device, no host read
        return stacked.index_select(0, choice.reshape(1).to(self.device, torch.int64))[0]

    def _seq_len(self, x: torch.Tensor) -> int:
        return x.shape[1] if self.layout == "2d" else x.shape[0]

    def _view4(self, t: torch.Tensor) -> tuple[int, int, int, tuple[int, int, int]]:
        """(B, S, H, strides of b, s, h in elements) of ``t`` seen as ``[B, S, H, D]``."""
        if self.layout == "2d":
            b, s, h = t.shape[0], t.shape[1], t.shape[2]
            st = (t.stride(0), t.stride(1), t.stride(2))
        elif self.layout == "1d":
            b, s, h = 1, t.shape[0], 1
            st = (0, t.stride(0), 0)
        else:  # ids: [tokens, heads, D]
            b, s, h = 1, t.shape[0], t.shape[1]
            st = (0, t.stride(0), t.stride(1))
        # the stride of a dim of size 1 is never used: zero it so it cannot spoil alignment
        st = tuple(0 if n == 1 else v for n, v in zip((b, s, h), st))
        return b, s, h, st

    def _usable(self, t: torch.Tensor) -> bool:
        """Whether the kernel can read or write ``t`` where it lies."""
        if t.dim() and t.stride(-1) != 1 and t.shape[-1] > 1:
            return False
        if self.backend != "cuda":
            return True
        _, _, _, st = self._view4(t)
        esize = t.element_size()
        return t.data_ptr() % (self.unit * esize) == 0 and all(v % self.unit == 0 for v in st)

    def run(self, x: torch.Tensor, position_ids: torch.Tensor | None, tables: torch.Tensor,
            inverse: bool = False) -> torch.Tensor:
        """Rotate ``x`` (by the negated angle with ``inverse``) into a new tensor."""
        if not self._usable(x):
            x = x.contiguous() if x.data_ptr() % 16 == 0 or not x.is_contiguous() else x.clone()
            if not self._usable(x):  # a contiguous tensor off a 16-byte boundary
                x = x.clone()
        out = torch.empty_like(x)
        if not self._usable(out):
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if x.numel() == 0:
            return out
        b, s, h, (xsb, xss, xsh) = self._view4(x)
        _, _, _, (ysb, yss, ysh) = self._view4(out)
        u = self.unit
        kernel = self._kernel(inverse)
        args = dict(X=x.data_ptr(), Y=out.data_ptr(), K=x.data_ptr(), KY=out.data_ptr(), TD=tables.data_ptr(),
                    B=b, S=s, H=h, HK=0, xsb=xsb // u, xss=xss // u, xsh=xsh // u, ysb=ysb // u, yss=yss // u,
                    ysh=ysh // u, ksb=0, kss=0, ksh=0, kysb=0, kyss=0, kysh=0,
                    NX=_span(x), NY=_span(out), NK=_span(x), NKY=_span(out))
        err = None
        if position_ids is not None:
            if position_ids.dim() == 2:
                psb, pss = (position_ids.stride(0) if position_ids.shape[0] > 1 else 0), position_ids.stride(1)
            else:
                psb, pss = 0, position_ids.stride(0)
            err = torch.zeros(1, dtype=torch.int32, device=self.device)
            args.update(P=position_ids.data_ptr(), ERR=err.data_ptr(), psb=psb, pss=pss, limit=self.limit,
                        NP=_span(position_ids))
        kernel(*kernel.bind(**args))
        # One 4-byte read when positions are given: the kernel sets the flag for a position out of
        # range (which it reads as 0, so no table is indexed out of bounds).
        if err is not None and err.item():
            self.op._raise_bad_position(position_ids)
        return out


def implement(op: Any, spec: Any) -> RopeKernels:
    return RopeKernels(op, spec)

