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

def kernel_spec(op: Any, call: Any, backend: str, inverse: bool = False) -> Any:
    """The :class:`kernels.rope.RopeKernelSpec` serving ``op`` for one call specialization."""
    from tileops.kernels.rope import RopeKernelSpec

    # a static choice is one value, or a map from input layout to value (schedules differ by layout)
    static = {k: (v[op.layout] if isinstance(v, dict) else v) for k, v in op.manifest.kernel.static.items()}
    head_dim = call.dim("head_dim")
    return RopeKernelSpec(dtype=call.dtype("x"), head_dim=head_dim, rot=op.rotated_width(head_dim),
                          pairing=op.pairing, positions=call.position_dtype, inverse=inverse, backend=backend,
                          **static)


class RopeKernels:
    """The kernels of one op specialization, and how a call's tensors are handed to them."""

    def __init__(self, op: Any, spec: Any):
        self.op = op
        self.spec = spec
        self.device = spec.device
        self.backend, self.arch = device_backend(self.device)
        self.kspec = kernel_spec(op, spec, self.backend)
        self._kernels: dict[bool, Any] = {}
        self._kernel(False)  # compile the forward now: the first call pays for it, not a later one
        self.unit = self.kspec.stride_unit
        self.layout = op.layout
        # the tables a call may use: one set, or several that a call picks from on the device
        rot = self.kspec.rot
        self.tables = op._tables(rot)
        self._stacked: torch.Tensor | None = None  # every set, for a choice made on the device
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

    def forward(self, tables: torch.Tensor, tensors: dict, outs: dict) -> Any:
        """x rotated (and the key, in the same launch): ``out`` or ``(out, key_out)``."""
        key = tensors.get("key")
        out, key_out = self.run(tensors["x"], tensors.get("position_ids"), tables, key=key,
                                out=outs.get("out"), key_out=outs.get("key_out"))
        return out if key is None else (out, key_out)

    def backward(self, tables: torch.Tensor, grads: tuple, tensors: dict) -> tuple:
        """The gradients of x (and key): each output's gradient rotated by the negated angle, times
        the amplitude, in one launch."""
        gx, gk = grads[0], (grads[1] if len(grads) > 1 else None)
        dx, dk = self.run(gx, tensors.get("position_ids"), tables, key=gk, inverse=True)
        return (dx,) if gk is None else (dx, dk)

    def tables_for(self, x: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        choice = self.op.choose_table(position_ids, self._seq_len(x))
        sets = [t.on(self.device) for t in self.tables]
        if len(sets) == 1:
            return sets[0]
        if isinstance(choice, int):
            return sets[choice]
        if self._stacked is None:  # built once (this object serves one device): no stack per call
            self._stacked = torch.stack(sets)
        # picked on the device, no host read
        return self._stacked.index_select(0, choice.reshape(1).to(self.device, torch.int64))[0]

    def _seq_len(self, x: torch.Tensor) -> int:
        return x.shape[1] if self.layout == "2d" else x.shape[0]

    def _view4(self, t: torch.Tensor) -> tuple[int, int, int, int, int, int]:
        """``(B, S, H, stride_b, stride_s, stride_h)`` of ``t`` seen as ``[B, S, H, D]``, strides in
        elements; the stride of a dim of size 1 is never used, so it is 0 (it cannot spoil alignment)."""
        n, st = t.shape, t.stride()
        if self.layout == "2d":
            b, s, h = n[0], n[1], n[2]
            return b, s, h, (st[0] if b > 1 else 0), (st[1] if s > 1 else 0), (st[2] if h > 1 else 0)
        if self.layout == "1d":
            return 1, n[0], 1, 0, (st[0] if n[0] > 1 else 0), 0
        return 1, n[0], n[1], 0, (st[0] if n[0] > 1 else 0), (st[1] if n[1] > 1 else 0)  # ids

    def _fits(self, t: torch.Tensor, v: tuple[int, ...]) -> bool:
        """Whether the kernel can read or write ``t`` (seen as ``v``) where it lies: a contiguous last
        dim and, on CUDA, a pointer and strides on ``stride_unit`` elements (16 bytes)."""
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            return False
        u = self.unit
        if u == 1:
            return True
        return t.data_ptr() % (u * t.element_size()) == 0 and not (v[3] % u or v[4] % u or v[5] % u)

    def _source(self, t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
        """``t`` where the kernel can read it, and its view; the one fallback is a dense copy."""
        v = self._view4(t)
        if not self._fits(t, v):
            t = t.contiguous() if not t.is_contiguous() else t.clone()  # a clone lands 16-byte aligned
            v = self._view4(t)
        return t, v

    def _dest(self, like: torch.Tensor, given: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """(what the kernel writes, what the caller gets, its view): ``given`` itself when the
        kernel can write it where it lies, else a dense buffer copied into ``given`` afterwards."""
        if given is not None:
            v = self._view4(given)
            if self._fits(given, v):
                return given, given, v
            buf = torch.empty(like.shape, dtype=like.dtype, device=like.device)
            return buf, given, self._view4(buf)
        out = torch.empty_like(like)
        v = self._view4(out)
        if not self._fits(out, v):
            out = torch.empty(like.shape, dtype=like.dtype, device=like.device)
            v = self._view4(out)
        return out, out, v

    def run(self, x: torch.Tensor, position_ids: torch.Tensor | None, tables: torch.Tensor,
            inverse: bool = False, key: torch.Tensor | None = None, out: torch.Tensor | None = None,
            key_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rotate ``x`` and ``key`` (by the negated angle with ``inverse``) in one launch; returns
        ``(out, key_out)``, new tensors unless given. ``out is x`` rotates in place."""
        src_x, vx = self._source(x)
        y, out, vy = self._dest(x, out)
        if src_x is not x and y is x:  # in place through the fallback: the kernel writes the buffer
            y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            vy = self._view4(y)
        ky = None
        if key is not None:
            src_k, vk = self._source(key)
            ky, key_out, vky = self._dest(key, key_out)
            if src_k is not key and ky is key:
                ky = torch.empty(key.shape, dtype=key.dtype, device=key.device)
                vky = self._view4(ky)
        if x.numel() == 0 and (key is None or key.numel() == 0):
            return out, key_out
        u = self.unit
        kernel = self._kernel(inverse)
        a = kernel.slots()
        put = kernel.slot
        a[put["X"]], a[put["Y"]], a[put["TD"]] = src_x.data_ptr(), y.data_ptr(), tables.data_ptr()
        a[put["B"]], a[put["S"]] = vx[0], vx[1]
        a[put["H"]] = vx[2] if x.numel() else 0
        a[put["xsb"]], a[put["xss"]], a[put["xsh"]] = vx[3] // u, vx[4] // u, vx[5] // u
        a[put["ysb"]], a[put["yss"]], a[put["ysh"]] = vy[3] // u, vy[4] // u, vy[5] // u
        if key is not None and key.numel():
            a[put["K"]], a[put["KY"]], a[put["HK"]] = src_k.data_ptr(), ky.data_ptr(), vk[2]
            a[put["ksb"]], a[put["kss"]], a[put["ksh"]] = vk[3] // u, vk[4] // u, vk[5] // u
            a[put["kysb"]], a[put["kyss"]], a[put["kysh"]] = vky[3] // u, vky[4] // u, vky[5] // u
        else:
            a[put["K"]] = a[put["KY"]] = 0  # HK = 0: the key loop never runs
        word = None
        if position_ids is not None:
            if position_ids.dim() == 2:
                psb = position_ids.stride(0) if position_ids.shape[0] > 1 else 0
                pss = position_ids.stride(1)
            else:
                psb, pss = 0, position_ids.stride(0)
            # a position out of range reads as 0 (nothing is indexed out of bounds) and the kernel
            # writes this call's tag into its error word: reported without a host sync (tileops.errors)
            word = self.op._error_word(self.device, position_ids)
            a[put["P"]], a[put["ERR"]], a[put["tag"]] = position_ids.data_ptr(), word.dev.data_ptr(), word.tag
            a[put["psb"]], a[put["pss"]], a[put["limit"]] = psb, pss, self.limit
        kernel(*a)
        if word is not None:
            self.op._launched(word)
        if y is not out:
            out.copy_(y)
        if key is not None and ky is not key_out:
            key_out.copy_(ky)
        return out, key_out


def implement(op: Any, spec: Any) -> RopeKernels:
    return RopeKernels(op, spec)

