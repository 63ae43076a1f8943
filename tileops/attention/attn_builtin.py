"""BUILTIN implementation of ``AttnFwdOp``: the attention kernels of ``kernels/attention.py``.

One object per (op, call specialization) holds the compiled forward kernel (compiled at
construction) and hands a call's views to it through a plan (:data:`FORWARD`): q, k, v and out by
their pointers, every stride (in the kernel's units) and size by value. Views are read where they lie
(HF's ``[B, H, S, D]`` transposed, a slice along the sequence): only a last dim that is not
contiguous, a stride off the CUDA kernel's 16-byte vectors, or (CUDA) a pointer off them is copied
first (an output written through a buffer and copied back: :func:`tileops.runtime.plan.fit`).

``return_lse`` (:meth:`AttnKernels.forward` with ``lse``) binds the lse tensor's address as a value
for that one call (``keep``), so the runtime's cached bindings (the fast path, which the native
runtime serves without Python) never write one. Varlen calls check ``cu_seqlens_q``/``cu_seqlens_k``
on the device: error words 0 and 1 of the plan (:mod:`tileops.kernels.report`).
"""

from __future__ import annotations

import math
import struct
from typing import Any

import torch

from ..compile.build import device_backend, load_kernel
from ..runtime.binding import Binding
from ..runtime.plan import (
    Bound,
    ErrorWord,
    Output,
    Plan,
    Ptr,
    Step,
    Tag,
    Value,
    copy_back,
    fit,
    signature,
)

__all__ = ["AttnKernels", "implement", "kernel_specs"]

#: the kernel's integer arguments, each bound by value from :meth:`AttnKernels._env` (the CUDA kernel
#: takes the sizes and strides as its tensors' dynamic extents, the C one as parameters: by name alike)
_VALUES = ("batch", "nb", "sq", "sk", "tiles", "qsb", "qss", "qsh", "ksb", "kss", "ksh", "vsb", "vss", "vsh",
           "osb", "oss", "osh", "lsb", "lsh", "has_lse", "scale_bits", "cap_bits", "window")
#: the window is compared as ``j <= i + off - w`` in int32: a wider window than this hides nothing
#: that 2^30 does not (sequences hold fewer than 2^31 tokens)
_MAX_WINDOW = 2**30

#: The forward: out (and, with ``lse_ptr``, the lse) from q, k, v; varlen calls check their offsets
#: (error word 0 for cu_seqlens_q, 1 for cu_seqlens_k)
FORWARD = Plan("attention forward", inputs=("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"),
               outputs=(Output("out", like="q"),),
               steps=(Step("fwd", {"Q": Ptr("q"), "K": Ptr("k"), "V": Ptr("v"), "O": Ptr("out"),
                                   "LSE": Value("lse_ptr"), "CUQ": Ptr("cu_seqlens_q"), "CUK": Ptr("cu_seqlens_k"),
                                   "ERR": ErrorWord(), "tag": Tag(), **{a: Value(a) for a in _VALUES}}),),
               checks={"cu_seqlens_q": 0, "cu_seqlens_k": 1})


def kernel_specs(manifest: Any, params: Any, call: Any, backend: str, backward: bool = True) -> list[tuple[str, Any]]:
    """The ``(builder, spec)`` a call of one specialization launches (the forward; the backward is not
    declared yet), for ``tileops warmup``, ``op.compile`` and ``tileops emit``."""
    from tileops.kernels import get_spec

    from .hooks import AttnFwdHooks

    fields = AttnFwdHooks.kernel_fields_of(params, call)
    static = dict(manifest.kernel.static or {}) if backend == "cuda" else {}
    return [(manifest.kernel.builder, get_spec(manifest.kernel.builder)(backend=backend, **fields, **static))]


class AttnKernels:
    """The forward kernel of one op specialization, and how a call's tensors are handed to it."""

    def __init__(self, op: Any, call: Any):
        self.op = op
        self.device = call.device
        # (an sm_90 device's kernels are built as sm_90a: tileops.compile.build._tvm_target)
        self.backend, self.arch = device_backend(self.device)
        self.spec = kernel_specs(op.manifest, op.params, call, self.backend)[0][1]
        self.varlen = self.spec.varlen
        self.unit = self.spec.stride_unit
        self.kernel = load_kernel(op.manifest.kernel.builder, self.spec, self.backend, self.arch, self.device,
                                  self.spec.args, op_name=op.name)
        p = op.params
        scale = p["softmax_scale"] if p["softmax_scale"] is not None else 1.0 / math.sqrt(p["head_dim"])
        self.scale_bits = _f32_bits(scale)
        self.cap_bits = _f32_bits(p["softcap"] if p["softcap"] is not None else 1.0)
        self.window = min(p["sliding_window"] or 0, _MAX_WINDOW)
        self._bound = Bound()

    # ------------------------------------------------------------------------------ layouts
    def _layout(self, views: dict) -> Any:
        """0 when the kernel addresses every view where it lies, else the name of one to make dense:
        a last dim that is not contiguous, a stride off the kernel's unit (CUDA: 8 elements, 16 bytes,
        as TMA takes them) or 0, a pointer off 16 bytes (CUDA)."""
        for n, t in views.items():
            if t is None or t.numel() == 0:
                continue
            if t.stride(-1) != 1 and t.shape[-1] > 1:
                return n
            if any(s % self.unit or (s == 0 and self.backend == "cuda")
                   for s, d in zip(t.stride()[:-1], t.shape[:-1]) if d > 1):
                return n  # (an expanded view's stride 0: TMA takes positive strides only)
            if self.backend == "cuda" and t.data_ptr() % 16:
                return n
        return 0  # anything but a str: fit's "it fits"

    def _env(self, t: dict, lse: torch.Tensor | None) -> dict[str, int]:
        q, k, v, o = t["q"], t["k"], t["v"], t["out"]

        def strides(x: torch.Tensor) -> tuple[int, int, int]:
            """(batch, row, head) strides in elements. A dim of size 1 (varlen's batch is one) is
            given the span of the dims inside it instead of whatever stride torch keeps for it: never
            read, and a TMA descriptor (CUDA) takes only positive multiples of 16 bytes."""
            shape, st = (x.shape, x.stride()) if x.dim() == 4 else ((1, *x.shape), (0, *x.stride()))
            out = list(st[:3])
            for i in (2, 1, 0):
                if shape[i] == 1:
                    inner = out[i + 1] * shape[i + 1] if i < 2 else shape[3]
                    out[i] = max(inner, out[i + 1] if i < 2 else 1, 1)
            return out[0], out[1], out[2]

        hq = self.spec.hq
        if self.varlen:
            batch, nb, sq, sk = t["cu_seqlens_q"].shape[0] - 1, 1, q.shape[0], k.shape[0]
            tiles = sq if self.backend == "c" else -(-sq // self.spec.rows_per_tile) + batch
            lsb, lsh = 0, sq
        else:
            batch, nb, sq, sk = q.shape[0], q.shape[0], q.shape[1], k.shape[1]
            tiles = -(-sq // self.spec.rows_per_tile)
            lsb, lsh = hq * sq, sq
        env = {"batch": batch, "nb": nb, "sq": sq, "sk": sk, "tiles": tiles, "lsb": lsb, "lsh": lsh,
               "has_lse": int(lse is not None), "lse_ptr": 0 if lse is None else lse.data_ptr(),
               "scale_bits": self.scale_bits, "cap_bits": self.cap_bits, "window": self.window}
        for name, x in (("q", q), ("k", k), ("v", v), ("o", o)):
            env[f"{name}sb"], env[f"{name}ss"], env[f"{name}sh"] = strides(x)
        return env

    def _empty(self, t: dict) -> bool:
        """Whether the call launches nothing: no query rows, or (the CUDA kernel's TMA descriptors
        need a row) no keys at all. With no keys every output row is zeros and every lse -inf; the
        offsets of such a varlen call are not checked (there is no kernel to check them)."""
        q, k = t["q"], t["k"]
        rows = q.shape[0] * q.shape[1] if q.dim() == 4 else q.shape[0]
        keys = k.shape[0] * k.shape[1] if k.dim() == 4 else k.shape[0]
        return rows == 0 or keys == 0 or q.shape[-2] == 0

    # ------------------------------------------------------------------------------ calls
    def prepare(self, tensors: dict) -> None:
        return None

    def forward(self, state: None, tensors: dict, outs: dict, lse: bool = False) -> Any:
        """out (new unless given), or ``(out, lse)`` with ``lse``."""
        q = tensors["q"]
        out = outs.get("out")
        out = self.op._new_output("out", tensors) if out is None else out
        lse_t = None
        if lse:
            shape = (q.shape[0], self.spec.hq, q.shape[1]) if q.dim() == 4 else (self.spec.hq, q.shape[0])
            lse_t = torch.empty(shape, dtype=torch.float32, device=q.device)
        if self._empty(tensors):
            out.zero_()
            if lse_t is not None:
                lse_t.fill_(-math.inf)
            return out if lse_t is None else (out, lse_t)
        views, _ = fit({"q": q, "k": tensors["k"], "v": tensors["v"], "out": out}, ("out",), self._layout)
        launch = {**tensors, **{n: views[n] for n in ("q", "k", "v")}}
        if self.varlen:
            launch.update({n: tensors[n].contiguous() for n in ("cu_seqlens_q", "cu_seqlens_k")})
        writes = {"out": views["out"]}
        if lse_t is None:
            key = ("forward", signature(FORWARD.names, {**launch, **writes}))
            b = self._bound.get(key, lambda: self._bind(launch, writes, None))
        else:
            b = self._bind(launch, writes, lse_t)  # the lse's address is this call's alone
        self.op._runtime.execute(b, launch, writes)
        copy_back(writes, {"out": out})
        return out if lse_t is None else (out, lse_t)

    def _bind(self, tensors: dict, outs: dict, lse: torch.Tensor | None) -> Binding:
        align = {n: 16 for n in ("q", "k", "v", "out")} if self.backend == "cuda" else {}
        return FORWARD.bind({"fwd": self.kernel}, tensors, outs, env=self._env({**tensors, **outs}, lse),
                            align=align, keep=() if lse is None else (lse,))

    def binding(self, tensors: dict, outs: dict) -> Binding | None:
        """The binding of every later call shaped like this one (without lse), or None where the call
        must copy a view first, launches nothing, or needs its offsets made contiguous."""
        out = outs.get("out")
        view = out if out is not None else self.op._new_output("out", tensors)
        if self._empty(tensors) or isinstance(self._layout({"q": tensors["q"], "k": tensors["k"],
                                                              "v": tensors["v"], "out": view}), str):
            return None
        if self.varlen and not all(tensors[n].is_contiguous() for n in ("cu_seqlens_q", "cu_seqlens_k")):
            return None
        return self._bind(tensors, {"out": out}, None) if out is not None else FORWARD.bind(
            {"fwd": self.kernel}, tensors, {"out": None}, env=self._env({**tensors, "out": view}, None),
            align={n: 16 for n in ("q", "k", "v", "out")} if self.backend == "cuda" else {},
            views={"out": view})

    def backward(self, state: Any, grads: tuple, tensors: dict) -> tuple:  # pragma: no cover - none declared
        raise NotImplementedError(f"{self.op.name}: the backward is not available yet")


def _f32_bits(x: float) -> int:
    """The bits of ``float32(x)`` as a signed int32 (the kernel reinterprets them)."""
    return struct.unpack("<i", struct.pack("<f", x))[0]


def implement(op: Any, spec: Any) -> AttnKernels:
    return AttnKernels(op, spec)
