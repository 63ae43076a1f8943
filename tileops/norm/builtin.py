"""BUILTIN implementation of the norm family: the TileLang kernels of ``kernels/norm.py``.

One object per (op, call specialization) holds the three kernels of ``kernels/norm.py``: ``fwd``
(compiled at construction), ``bwd`` and ``wsum`` (at the first backward). Tensors are passed as
pointers and two row strides each: row ``r`` of a tensor lies at ``(r // NH) * st + (r % NH) * sh``
(:func:`row_layout` finds ``NH`` and every tensor's two strides from the leading dims, one grouping
for all the tensors of a launch), so a per-head view of a fused qkv buffer, every other head or a
slice along seq is read and written where it lies, and ``out=x`` writes in place. A tensor the
kernels cannot address is never computed wrongly: an input is copied to a dense tensor first, an
output is written through a dense buffer and copied after. That happens to a view that needs a
third stride, a last dim that is not contiguous, a weight or bias that is not contiguous, and on
CUDA to a pointer or a row stride that is not a multiple of the kernel's vector (16 bytes, less
for a narrow row).

What a call's views mean to the forward kernel is said once, in :meth:`NormKernels._binding` (a
:class:`tileops.runtime.binding.Binding`): the runtime keeps it per call signature and serves later
calls from it without Python (:meth:`NormKernels.binding`); the general path binds the tensors it
launches with, copies included, through the same code and the same executor. The backward runs
``bwd`` on ``G`` blocks, each summing its rows' weight (and bias) gradient in fp32 partial rows,
then ``wsum`` adding the partial rows in a fixed order: ``G`` follows the row count and the device
alone, so the same rows give the same bits. Both launches come from a :class:`_BackwardPlan` kept per
shape and strides (both kernels' argument arrays, filled but for the pointers), so a later backward
encodes no argument in Python; the runtime's executor does not run them, as it takes the tensors
the op's manifest names and the backward's are gradients and partial rows.
"""

from __future__ import annotations

import array
import dataclasses
import math
from typing import Any, Mapping, Sequence

import torch

from ..compile.build import device_backend, load_kernel
from ..manifest import DTYPES as DTYPE
from ..runtime.binding import Binding, bind
from . import hooks

__all__ = ["implement", "kernel_spec", "kernel_specs", "NormKernels", "row_layout", "RESIDENT_THREADS", "C_BLOCKS"]

#: CUDA: the threads of the backward's persistent blocks an SM holds at once (kernels/norm.py asks
#: nvcc for at most 64 registers a thread, so that 1024 fit): ``G`` is at most one wave of them
RESIDENT_THREADS = 1024
#: CUDA: the fewest row groups a backward block takes once every SM has a block
ROWS_PER_BLOCK = 8
#: the C backend's backward blocks (its "blocks" run one after another): each sums at most
#: ``ceil(rows / 32)`` rows' weight gradient in sequence in fp32, 2048 for 65,536 rows
C_BLOCKS = 32
#: the forward kernel's pointer parameters, by the manifest's tensor names
_POINTERS = {"X": "x", "R": "residual", "W": "weight", "B": "bias", "Y": "out", "RO": "residual_out"}
#: each row-addressed tensor's two stride parameters, per kernel kind
_STRIDES = {"fwd": {"x": ("xst", "xsh"), "residual": ("rst", "rsh"), "out": ("yst", "ysh"),
                    "residual_out": ("rost", "rosh")},
            "bwd": {"x": ("xst", "xsh"), "dy": ("dyst", "dysh"), "dro": ("drost", "drosh"), "dx": ("dxst", "dxsh")}}


def kernel_specs(manifest: Any, params: Any, call: Any, backend: str, backward: bool = True) -> list[tuple[str, Any]]:
    """Every ``(builder, spec)`` a call of one specialization (``call``, a
    :class:`tileops.manifest.CallSpec`) of the op ``manifest`` built with ``params`` may launch on
    ``backend``: the forward kernel (what ``tileops emit`` prints), then, with ``backward`` and a
    manifest that declares one, the backward kernel and the kernel summing the weight (and bias)
    gradient's partial rows. What ``tileops warmup`` and ``op.compile`` build ahead, without
    constructing the op."""
    builder = manifest.kernel.builder
    fwd = kernel_spec(getattr(hooks, manifest.hooks), manifest, params, call, backend)
    out = [(builder, fwd)]
    if backward and manifest.backward is not None:
        out.append((builder, dataclasses.replace(fwd, kind="bwd")))
        if fwd.weight is not None or fwd.bias is not None:
            out.append((builder, _wsum_spec(fwd)))
    return out


def kernel_spec(cls: type, manifest: Any, params: Any, call: Any, backend: str) -> Any:
    """The forward :class:`kernels.norm.NormKernelSpec` serving an op of hook class ``cls`` (the op's
    class, or the class its manifest's ``hooks:`` names) built with ``params``, for one call
    specialization: the first of :func:`kernel_specs`, and the norm stage of a fused op that composes
    the op (:mod:`tileops.compose`)."""
    from tileops.kernels import get_spec

    return get_spec(manifest.kernel.builder)(kind="fwd", backend=backend, **cls.kernel_fields_of(params, call),
                                             **manifest.kernel.static)


def _wsum_spec(spec: Any) -> Any:
    """The ``wsum`` kernel of a forward or backward spec. It reads the fp32 partial rows alone, so every
    field but the hidden size, the weight's and bias's dtypes and the backend is set alike: RMSNorm
    and LayerNorm, every rounding and every dtype of x share one kernel."""
    return dataclasses.replace(spec, kind="wsum", dtype="float32", out_dtype=None, norm="layer" if spec.bias else "rms",
                               rounding="fp32", offset=0.0, residual=False)


def row_layout(lead: Sequence[int], strides: Mapping[str, Sequence[int]]) -> tuple[int, int, dict[str, tuple[int, int]]] | str:
    """How the kernels address the rows of tensors sharing the leading dims ``lead``, each with its
    own ``strides`` of those dims (in elements): ``(M, NH, {name: (st, sh)})`` with row ``r`` of a
    tensor at ``(r // NH) * st + (r % NH) * sh`` (``M`` rows), or, where two strides per tensor do
    not reach every row, the name of the tensor to make dense (the one with the most breaks).

    Dims of size 1 are left out (their stride is never used). Neighbouring dims merge into one when
    every tensor steps over the inner one's extent with the outer one's stride; what is left must be
    at most two groups: the outer one's rows step by ``st``, the inner one's (``NH`` rows) by ``sh``.
    """
    dims = [i for i, n in enumerate(lead) if n != 1]

    def merges(st: Sequence[int], outer: int, inner: int) -> bool:
        return st[outer] == st[inner] * lead[inner]

    groups: list[list[int]] = []
    for i in dims:
        if groups and all(merges(st, groups[-1][-1], i) for st in strides.values()):
            groups[-1].append(i)
        else:
            groups.append([i])
    if len(groups) > 2:
        breaks = {n: sum(not merges(st, a, b) for a, b in zip(dims, dims[1:])) for n, st in strides.items()}
        return max(breaks, key=lambda n: breaks[n])
    rows = math.prod(lead)
    if not groups:
        return rows, 1, {n: (0, 0) for n in strides}
    if len(groups) == 1:
        return rows, 1, {n: (st[groups[0][-1]], 0) for n, st in strides.items()}
    nh = math.prod(lead[i] for i in groups[1])
    return rows, nh, {n: (st[groups[0][-1]], st[groups[1][-1]]) for n, st in strides.items()}


class NormKernels:
    """The kernels of one op specialization, and how a call's tensors are handed to them (a kernel
    set: :mod:`tileops.autograd`)."""

    def __init__(self, op: Any, call: Any):
        self.op = op
        self.call = call
        self.device = call.device
        self.backend, self.arch = device_backend(self.device)
        self.given = dict(call.dtypes)  # the inputs a call of this specialization passes
        self.hidden = call.dim("hidden")
        self._kernels: dict[Any, Any] = {}
        self.spec = self.bwd_spec = self.wsum_spec = None
        self.unit = 1
        if self.hidden:  # a last dim of 0 has no element to compute, and no kernel
            specs = [s for _, s in kernel_specs(op.manifest, op.params, call, self.backend)]
            self.spec = specs[0]
            self.bwd_spec = specs[1] if len(specs) > 1 else None
            self.wsum_spec = specs[2] if len(specs) > 2 else None
            self._kernel(self.spec)  # compile the forward now: the first call pays for it, not a later one
            self.unit = self.spec.stride_unit
        from tileops.kernels.norm import eps_bits

        self.eps_bits = eps_bits(op.params["eps"])
        self._bindings: dict[tuple, Binding] = {}  # the general path's, by what they depend on
        self._bwd_plans: dict[tuple, _BackwardPlan | None] = {}  # by shape and strides; None: copied
        self._sms = 0

    def _kernel(self, spec: Any) -> Any:
        k = self._kernels.get(spec)
        if k is None:
            k = self._kernels[spec] = load_kernel(self.op.manifest.kernel.builder, spec, self.backend, self.arch,
                                                  self.device, spec.args, op_name=self.op.name)
        return k

    # ------------------------------------------------------------------------------ layouts
    def _align(self, t: torch.Tensor) -> int:
        """The bytes ``t``'s pointer must be a multiple of: a vector of ``unit`` elements, at most 16 (CUDA)."""
        return min(16, self.unit * t.element_size()) if self.backend == "cuda" else 1

    def _layout(self, views: Mapping[str, torch.Tensor | None],
                pointers: bool = True) -> tuple[int, int, dict[str, tuple[int, int]]] | str:
        """``(M, NH, {name: (st, sh)})`` (:func:`row_layout`) for the row-addressed tensors of
        ``views`` (None: absent), or the name of one the kernel cannot address where it lies: a last
        dim that is not contiguous, a third stride, and on CUDA a stride (or, with ``pointers``, a
        pointer) off the kernel's vector."""
        present = {n: t for n, t in views.items() if t is not None}
        for n, t in present.items():
            if t.shape[-1] > 1 and t.stride(-1) != 1:
                return n
        lay = row_layout(next(iter(present.values())).shape[:-1], {n: t.stride()[:-1] for n, t in present.items()})
        if isinstance(lay, str) or self.unit == 1:
            return lay
        for n, (st, sh) in lay[2].items():
            if st % self.unit or sh % self.unit or (pointers and present[n].data_ptr() % self._align(present[n])):
                return n
        return lay

    def _fit(self, views: dict[str, torch.Tensor | None], outputs: tuple[str, ...]) -> tuple[dict, tuple]:
        """``views`` with every tensor the kernel cannot address where it lies replaced by a dense one
        (an input by a copy, one of ``outputs`` by a new buffer, to be copied into the original after
        the launch), and their layout."""
        views = dict(views)
        while True:
            lay = self._layout(views)
            if not isinstance(lay, str):
                return views, lay
            t = views[lay]
            views[lay] = (torch.empty(t.shape, dtype=t.dtype, device=t.device) if lay in outputs
                          else t.contiguous() if not t.is_contiguous() else t.clone())  # a clone lands aligned

    def _param_fits(self, t: torch.Tensor | None, pointer: bool = True) -> bool:
        """Whether a weight or bias can be read where it lies: contiguous (and aligned, on CUDA)."""
        return t is None or ((t.stride(0) == 1 or t.shape[0] == 1)
                             and (not pointer or t.data_ptr() % self._align(t) == 0))

    def _param(self, t: torch.Tensor | None) -> torch.Tensor | None:
        return t if self._param_fits(t) else t.clone(memory_format=torch.contiguous_format)

    # ------------------------------------------------------------------------------ forward
    def prepare(self, tensors: dict) -> None:
        return None

    def forward(self, state: None, tensors: dict, outs: dict) -> Any:
        """``out``, or ``(out, residual_out)`` with a residual: new tensors unless given."""
        x, r = tensors["x"], tensors.get("residual")
        y = outs.get("out")
        y = self.op._new_output("out", tensors) if y is None else y
        h = None if r is None else outs.get("residual_out")
        h = torch.empty_like(r) if r is not None and h is None else h
        if x.numel():
            views, lay = self._fit({"x": x, "residual": r, "out": y, "residual_out": h}, ("out", "residual_out"))
            launch = {n: views[n] if n in views else self._param(tensors.get(n)) for n in tensors}
            writes = {"out": views["out"], "residual_out": views["residual_out"]}
            key = (*(None if t is None else (t.shape, t.stride(), t.dtype) for t in (*launch.values(), *writes.values())),
                   writes["out"] is launch["x"], writes["residual_out"] is not None and writes["residual_out"] is launch["residual"])
            b = self._bindings.get(key)
            if b is None:
                if len(self._bindings) > 256:
                    self._bindings.clear()
                b = self._bindings[key] = self._binding(launch, writes, {**launch, **writes}, lay)
            self.op._runtime.execute(b, launch, writes)
            if writes["out"] is not y:
                y.copy_(writes["out"])
            if h is not None and writes["residual_out"] is not h:
                h.copy_(writes["residual_out"])
        return y if r is None else (y, h)

    def _binding(self, tensors: dict, outs: dict, views: dict, lay: tuple) -> Binding:
        """The :class:`tileops.runtime.binding.Binding` of the forward kernel for these inputs and
        outputs (``outs``: a tensor, the input itself for in place, or None for a new one); ``views``:
        the tensor each name is seen as, ``lay`` their layout (:meth:`_layout`)."""
        rows, nh, strides = lay
        args: dict[str, Any] = {"M": rows, "NH": nh, "eps_bits": self.eps_bits}
        for name, (st, sh) in strides.items():
            a, b = _STRIDES["fwd"][name]
            args[a], args[b] = st // self.unit, sh // self.unit
        align = {n: self._align(t) for n, t in views.items() if t is not None}
        m = self.op.manifest
        names = {t.name for t in (*m.inputs, *m.outputs)}  # LayerNorm's bias; RMSNorm has none
        return bind(self._kernel(self.spec), m, tensors, outs, args=args, align=align,
                    pointers={k: v for k, v in _POINTERS.items() if v in names},
                    views={n: views[n] for n in ("out", "residual_out") if views.get(n) is not None})

    def binding(self, tensors: dict, outs: dict) -> Binding | None:
        """The binding of every later call shaped like this one, or None (such calls take the general
        path: views the kernel cannot address where they lie, no rows)."""
        x, r = tensors["x"], tensors.get("residual")
        if x.numel() == 0 or not (self._param_fits(tensors.get("weight"), False)
                                  and self._param_fits(tensors.get("bias"), False)):
            return None
        views = {"x": x, "residual": r,
                 "out": outs["out"] if outs.get("out") is not None else self.op._new_output("out", tensors),
                 "residual_out": None if r is None else outs["residual_out"] if outs.get("residual_out") is not None
                 else torch.empty_like(r)}
        lay = self._layout(views, pointers=False)
        if isinstance(lay, str):
            return None
        return self._binding(tensors, outs, {**tensors, **views}, lay)

    # ------------------------------------------------------------------------------ backward
    def _blocks(self, rows: int) -> int:
        """``G``, the backward's blocks: from the row count and the device alone (so the weight
        gradient's summation order, and its bits, are the same for the same rows): one wave of
        resident blocks on CUDA, at most ``C_BLOCKS`` on the CPU."""
        if self.backend == "c":
            return max(1, min(rows, C_BLOCKS))
        if not self._sms:
            self._sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        s = self.bwd_spec
        resident = self._sms * max(1, RESIDENT_THREADS // s.block_threads)
        groups = -(-rows // s.rows_per_block)
        # past one block an SM, at least ROWS_PER_BLOCK row groups a block: each block writes a full
        # fp32 partial row that wsum reads back, which at 1024 x 4096 bf16 on 528 blocks was 8.6 MB
        # each way against 25 MB of rows (54% of the copy; 64% on 264 blocks)
        return max(1, min(groups, resident, max(self._sms, -(-groups // ROWS_PER_BLOCK))))

    def backward(self, state: None, grads: tuple, tensors: dict) -> tuple:
        """The gradients of the given inputs ``backward.wrt`` names, in its order: x's (and the
        residual's, the same tensor), then the weight's and bias's summed over the rows."""
        given = self.given
        dy = grads[0]
        dro = grads[1] if "residual" in given else None
        h = tensors["residual_out"] if "residual" in given else tensors["x"]
        dx = torch.empty_like(dy, dtype=DTYPE[given["x"]])
        # wsum writes every column of dw and db; with no rows it is not launched and they are zeros
        new = torch.empty if dx.numel() else torch.zeros
        dw = new(self.hidden, dtype=DTYPE[given["weight"]], device=self.device) if "weight" in given else None
        db = new(self.hidden, dtype=DTYPE[given["bias"]], device=self.device) if "bias" in given else None
        if dx.numel():
            self._run_backward(h, dy, dro, self._param(tensors.get("weight")), dx, dw, db)
        by_name = {"x": dx, "weight": dw, "bias": db, "residual": dx}
        return tuple(by_name[n] for n in self.op.manifest.backward.wrt if n in given)

    def _run_backward(self, h: torch.Tensor, dy: torch.Tensor, dro: torch.Tensor | None, w: torch.Tensor | None,
                      dx: torch.Tensor, dw: torch.Tensor | None, db: torch.Tensor | None) -> None:
        """``bwd`` into ``dx`` and fp32 partial rows, then ``wsum`` into ``dw`` and ``db``: from the
        :class:`_BackwardPlan` of this call's shape and strides (made at its first call), unless a
        view must be copied first (its strides, or on CUDA a pointer, off the kernel's vector)."""
        key = (h.shape, h.stride(), dy.stride(), None if dro is None else dro.stride(), dx.stride())
        plan = self._bwd_plans.get(key, False)
        if plan is False:
            lay = self._layout({"x": h, "dy": dy, "dro": dro, "dx": dx}, pointers=False)
            if len(self._bwd_plans) > 256:
                self._bwd_plans.clear()
            plan = self._bwd_plans[key] = None if isinstance(lay, str) else self._backward_plan((h, dy, dro, dx), lay)
        if plan is not None and all(t is None or t.data_ptr() % a == 0 for t, a in zip((h, dy, dro, dx), plan.align)):
            plan.launch(h, dy, dro, w, dx, dw, db)
            return
        views, lay = self._fit({"x": h, "dy": dy, "dro": dro, "dx": dx}, ("dx",))
        rows_of = (views["x"], views["dy"], views["dro"], views["dx"])
        self._backward_plan(rows_of, lay).launch(*rows_of[:3], w, rows_of[3], dw, db)
        if views["dx"] is not dx:
            dx.copy_(views["dx"])

    def _backward_plan(self, rows_of: tuple[torch.Tensor | None, ...],
                       lay: tuple[int, int, dict[str, tuple[int, int]]]) -> "_BackwardPlan":
        """The two launches of the row-addressed tensors ``rows_of`` (x or residual_out, dy, dro,
        dx) laid out as ``lay`` (their :meth:`_layout`)."""
        rows, nh, strides = lay
        g = self._blocks(rows)
        args: dict[str, Any] = {"M": rows, "NH": nh, "G": g, "eps_bits": self.eps_bits}
        for name, (st, sh) in strides.items():
            a, b = _STRIDES["bwd"][name]
            args[a], args[b] = st // self.unit, sh // self.unit
        bwd = self._kernel(self.bwd_spec)
        wsum = None if self.wsum_spec is None else self._kernel(self.wsum_spec)
        parts = g * self.bwd_spec.partials_per_block
        align = tuple(1 if t is None else self._align(t) for t in rows_of)
        align = align if max(align) > 1 else ()  # the C backend's: none to check per call
        return _BackwardPlan(bwd, bwd.template(args), tuple(bwd.slot[n] for n in _BWD_POINTERS), wsum,
                             None if wsum is None else wsum.template({"P": parts}),
                             () if wsum is None else tuple(wsum.slot[n] for n in _WSUM_POINTERS),
                             parts, self.hidden, self.device, align)


#: the backward kernels' pointer parameters, in the order :meth:`_BackwardPlan.launch` fills them
_BWD_POINTERS = ("X", "DY", "DRO", "W", "DX", "DWP", "DBP")
_WSUM_POINTERS = ("DWP", "DBP", "DW", "DB")


@dataclasses.dataclass(frozen=True)
class _BackwardPlan:
    """One backward signature's two launches, everything but the pointers: each kernel's whole
    argument array (:meth:`tileops.compile.entry.RawKernel.template`) with the rows, strides, ``G``
    and ``P`` filled, and the slots the call's pointers go into. A call copies the arrays, writes
    its pointers and launches: no argument is encoded per call. (The runtime's executor cannot run
    it: the module's doc says why.)"""

    bwd: Any
    bwd_args: array.array
    bwd_slots: tuple[int, ...]
    wsum: Any
    wsum_args: array.array | None
    wsum_slots: tuple[int, ...]
    #: the fp32 partial rows bwd writes for each of the weight and the bias, and their length
    parts: int
    hidden: int
    device: torch.device
    #: the bytes the pointer of x (or residual_out), dy, dro and dx must be a multiple of (CUDA;
    #: () on the C backend, which reads any address)
    align: tuple[int, ...]

    def launch(self, x: torch.Tensor, dy: torch.Tensor, dro: torch.Tensor | None, w: torch.Tensor | None,
               dx: torch.Tensor, dw: torch.Tensor | None, db: torch.Tensor | None) -> None:
        """bwd into ``dx`` and the partial rows, then wsum into ``dw`` and ``db``, on the current stream."""
        dwp = dbp = 0
        if dw is not None or db is not None:
            # the weight's and the bias's partial rows in one allocation, the bias's from a 256-byte
            # boundary (64 floats): each had an allocation of its own, aligned to 512 by the allocator
            n = self.parts * self.hidden
            off = -(-n // 64) * 64 if dw is not None else 0
            buf = torch.empty(off + (n if db is not None else 0), dtype=torch.float32, device=self.device)
            dwp = 0 if dw is None else buf.data_ptr()
            dbp = 0 if db is None else buf.data_ptr() + 4 * off
        # an absent tensor's slot keeps the template's 0 (the kernel does not read it)
        args, (sx, sdy, sdro, sw, sdx, sdwp, sdbp) = self.bwd_args[:], self.bwd_slots
        args[sx], args[sdy], args[sdx], args[sdwp], args[sdbp] = x.data_ptr(), dy.data_ptr(), dx.data_ptr(), dwp, dbp
        if dro is not None:
            args[sdro] = dro.data_ptr()
        if w is not None:
            args[sw] = w.data_ptr()
        self.bwd.launch(args, self.bwd.stream())
        if self.wsum is not None:
            args, (sdwp, sdbp, sdw, sdb) = self.wsum_args[:], self.wsum_slots
            args[sdwp], args[sdbp] = dwp, dbp
            if dw is not None:
                args[sdw] = dw.data_ptr()
            if db is not None:
                args[sdb] = db.data_ptr()
            self.wsum.launch(args, self.wsum.stream())


def implement(op: Any, spec: Any) -> NormKernels:
    return NormKernels(op, spec)
