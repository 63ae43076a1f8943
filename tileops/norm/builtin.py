"""BUILTIN implementation of the norm family: the TileLang kernels of ``kernels/norm.py``.

One object per (op, call specialization) holds the three kernels of ``kernels/norm.py``: ``fwd``
(compiled at construction), ``bwd`` and ``wsum`` (at the first backward). Tensors are passed as
pointers and two row strides each: row ``r`` of a tensor lies at ``(r // NH) * st + (r % NH) * sh``
(:func:`tileops.runtime.views.row_layout` finds ``NH`` and every tensor's two strides from the leading
dims, one grouping for all the tensors of a launch), so a per-head view of a fused qkv buffer, every other head or a
slice along seq is read and written where it lies, and ``out=x`` writes in place. A tensor the
kernels cannot address is never computed wrongly: an input is copied to a dense tensor first, an
output is written through a dense buffer and copied after. That happens to a view that needs a
third stride, a last dim that is not contiguous, a weight or bias that is not contiguous, and on
CUDA to a pointer or a row stride that is not a multiple of the kernel's vector (16 bytes, less
for a narrow row).

What a call's views mean to the kernels is declared once, as plans (:data:`FORWARD`,
:data:`BACKWARD`; :mod:`tileops.runtime.plan`): every kernel argument by its role, the rows and their
strides computed by the runtime from the tensors seen as rows (:class:`tileops.runtime.views.Rows`).
The runtime binds them per call signature and serves later forward calls without Python
(:meth:`NormKernels.binding`); the general path places the call's tensors by the plans' fit policy
(copies, :meth:`tileops.runtime.plan.Plan.place`) and binds what it launches with into the same
cache (the op's :class:`tileops.runtime.cache.Bindings`) and runs them on the same executor. The backward runs
``bwd`` on ``G`` blocks, each summing its rows' weight (and bias) gradient in fp32 partial rows,
then ``wsum`` adding the partial rows in a fixed order: ``G`` follows the row count and the device
alone, so the same rows give the same bits. Both launches are one plan, :data:`BACKWARD` (a
:class:`tileops.runtime.plan.Plan`: the fp32 partial rows its per-call workspace), bound once per
call signature and run by the op's runtime, so a later backward encodes no argument in Python.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..compile.build import device_backend, load_kernel
from ..manifest import DTYPES as DTYPE
from ..runtime.binding import Binding
from ..schedules import static_for
from ..runtime.plan import Dims, Output, Plan, Ptr, Rows, Size, Step, Stride, Value, Workspace
from ..runtime.views import Misfit
from . import hooks

__all__ = ["implement", "kernel_spec", "kernel_specs", "WIDE_BACKWARD_MIN_HIDDEN", "NormKernels", "RESIDENT_THREADS",
           "C_BLOCKS"]

#: CUDA: the threads of the backward's persistent blocks an SM holds at once (kernels/norm.py asks
#: nvcc for at most 64 registers a thread, so that 1024 fit): ``G`` is at most one wave of them
RESIDENT_THREADS = 1024
#: CUDA: the fewest row groups a backward block takes once every SM has a block
ROWS_PER_BLOCK = 8
#: the C backend's backward blocks (its "blocks" run one after another): each sums at most
#: ``ceil(rows / 32)`` rows' weight gradient in sequence in fp32, 2048 for 65,536 rows
C_BLOCKS = 32
#: the row-per-block backward keeps the weight in shared memory and syncs once a row (``bwd_w_shared``
#: and ``bwd_one_sync``, which the manifest sets) on rows of at least this many elements, or with a
#: residual; narrower plain rows keep the weight in registers. H200, bf16, with ``nh1_path``
#: (``python -m benchmarks.norm_schedules --configs nh1,ws+1sync,ws+1sync+nh1 --rounds 5``), % of a
#: same-bytes copy with them and without: 4096 x 8192 87 / 81, 2048 x 16384 85 / 72, 16384 x 4096 with
#: a residual 90 / 71, but 16384 x 4096 alone 82 / 85 (65536 x 2048: 86 / 85)
WIDE_BACKWARD_MIN_HIDDEN = 8192


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
        bwd = dataclasses.replace(fwd, kind="bwd")
        if bwd.hidden < WIDE_BACKWARD_MIN_HIDDEN and not bwd.residual:
            bwd = dataclasses.replace(bwd, bwd_w_shared=0, bwd_one_sync=0)
        out.append((builder, bwd))
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
                                             **static_for(manifest, call))


def _wsum_spec(spec: Any) -> Any:
    """The ``wsum`` kernel of a forward or backward spec. It reads the fp32 partial rows alone, so every
    field but the hidden size, the weight's and bias's dtypes and the backend is set alike: RMSNorm
    and LayerNorm, every rounding and every dtype of x share one kernel."""
    return dataclasses.replace(spec, kind="wsum", dtype="float32", out_dtype=None, norm="layer" if spec.bias else "rms",
                               rounding="fp32", offset=0.0, residual=False)


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
        #: the forward's plan (:data:`FORWARD` for this op's tensors)
        rows = dict.fromkeys(("x", "residual", "out", "residual_out"), _ROWS)
        self.plan = Plan.of(op.manifest, FORWARD, dims={**rows, "weight": _PARAM, "bias": _PARAM})
        # the backward's stand-in for the bias, which it does not read (nor keep): its dtype, db's
        self._bias_stand_in = (torch.empty(0, dtype=DTYPE[self.given["bias"]], device=self.device)
                            if "bias" in self.given else None)
        self._sms = 0

    def _kernel(self, spec: Any) -> Any:
        k = self._kernels.get(spec)
        if k is None:
            k = self._kernels[spec] = load_kernel(self.op.manifest.kernel.builder, spec, self.backend, self.arch,
                                                  self.device, spec.args, op_name=self.op.name)
        return k

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
            placed = self.plan.place(tensors, {"out": y, "residual_out": h}, self.unit)
            launch, writes = placed.inputs, placed.writes
            self.op.run_plan(self, ("forward", *self.plan.key(launch, writes)),
                             lambda: self._binding(launch, writes, {}), launch, writes)
            placed.copy_back()
        return y if r is None else (y, h)

    def _binding(self, tensors: dict, outs: dict, views: dict) -> Binding:
        """:attr:`plan` bound for these inputs and outputs (``outs``: a tensor, the input itself for in
        place, or None for a new one laid out as ``views`` has it)."""
        return self.plan.bind({"fwd": self._kernel(self.spec)}, tensors, outs, env=self._env(), views=views,
                              unit=self.unit)

    def _env(self) -> dict[str, int]:
        """The names a plan's values are computed from besides the tensors' rows and strides."""
        return {"eps_bits": self.eps_bits}

    def binding(self, tensors: dict, outs: dict) -> Binding | None:
        """The binding of every later call shaped like this one, or None (such calls take the general
        path: views the kernel cannot address where they lie, no rows)."""
        x, r = tensors["x"], tensors.get("residual")
        if x.numel() == 0:
            return None
        views = {"out": outs["out"] if outs.get("out") is not None else self.op._new_output("out", tensors),
                 "residual_out": None if r is None else outs["residual_out"] if outs.get("residual_out") is not None
                 else torch.empty_like(r)}
        if isinstance(self.plan.layout({**tensors, **views}, self.unit), Misfit):
            return None
        return self._binding(tensors, outs, views)

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
        launch = {"x": tensors["residual_out"] if "residual" in given else tensors["x"], "dy": dy,
                  "dro": grads[1] if "residual" in given else None, "weight": tensors.get("weight"),
                  "bias": self._bias_stand_in}
        if dy.numel():
            dx, dw, db = self._run_backward(launch)
        else:  # no rows: nothing to launch; the weight's and bias's gradients are zeros
            dx = torch.empty_like(dy, dtype=DTYPE[given["x"]])
            dw, db = (None if n not in given else torch.zeros(self.hidden, dtype=DTYPE[given[n]], device=self.device)
                      for n in ("weight", "bias"))
        by_name = {"x": dx, "weight": dw, "bias": db, "residual": dx}
        return tuple(by_name[n] for n in self.op.manifest.backward.wrt if n in given)

    def _run_backward(self, launch: dict) -> tuple:
        """:data:`BACKWARD` on ``launch`` (x or residual_out, dy, dro, weight, bias): ``(dx, dw, db)``,
        from the binding of this call's shape and strides (made at its first call), unless a view must
        be copied first (the plan's fit policy: its strides, or on CUDA a pointer, off the kernel's vector)."""
        got = self.op.run_plan(self, ("backward", *BACKWARD.key(launch, {})),
                               lambda: self._backward_binding(launch, {}), launch, {})
        if got is not NotImplemented:
            return _gradients(got, launch)
        dx = torch.empty_like(launch["dy"], dtype=launch["x"].dtype)
        placed = BACKWARD.place(launch, {"dx": dx}, self.unit)
        fitted, writes = placed.inputs, placed.writes  # (the dense copies' signature: bound once too)
        got = _gradients(self.op.run_plan(self, ("backward", *BACKWARD.key(fitted, writes)),
                                          lambda: self._backward_binding(fitted, writes), fitted, writes), fitted)
        placed.copy_back()
        return dx, got[1], got[2]

    def _backward_binding(self, launch: dict, outs: dict) -> Binding | None:
        """:data:`BACKWARD` bound for tensors shaped as ``launch`` (and ``outs``: dx given, or None for
        a new one); None when their layout is not one the kernels address."""
        dx = outs.get("dx")
        dx = dx if dx is not None else torch.empty_like(launch["dy"], dtype=launch["x"].dtype, device="meta")
        seen = BACKWARD.layout({**launch, "dx": dx}, self.unit)
        if isinstance(seen, Misfit):
            return None
        g = self._blocks(seen["x"]["m"][0])
        env = {**self._env(), "G": g, "P": g * self.bwd_spec.partials_per_block}
        kernels = {"bwd": self._kernel(self.bwd_spec)}
        if self.wsum_spec is not None:
            kernels["wsum"] = self._kernel(self.wsum_spec)
        return BACKWARD.bind(kernels, launch, outs, env=env, unit=self.unit)


def _gradients(got: Any, launch: dict) -> tuple:
    """``(dx, dw, db)`` from what :data:`BACKWARD`'s binding returns (dx, then those of the weight and
    the bias that are given)."""
    got = list(got) if isinstance(got, tuple) else [got]
    dx = got.pop(0)
    dw = got.pop(0) if launch.get("weight") is not None else None
    db = got.pop(0) if launch.get("bias") is not None else None
    return dx, dw, db


def _rows(name: str, st: str, sh: str) -> dict:
    """A row-addressed tensor's two stride arguments: row ``r`` at ``(r // NH) * st + (r % NH) * sh``."""
    return {st: Stride(name, "m"), sh: Stride(name, "h")}


#: How the kernels see a row-addressed tensor (its rows in two strides, :class:`tileops.runtime.views.Rows`,
#: one grouping for all of a launch's) and a weight or bias (read whole, in vectors)
_ROWS, _PARAM = Rows(), Dims("d")


#: The forward: ``fwd`` on ``M`` rows of x (and the residual) into out (and residual_out), with the
#: weight (and bias). RMSNorm has no bias: :meth:`tileops.runtime.plan.Plan.of` leaves its pointer out.
FORWARD = (Step("fwd", {"X": Ptr("x"), "R": Ptr("residual"), "W": Ptr("weight"), "B": Ptr("bias"), "Y": Ptr("out"),
                        "RO": Ptr("residual_out"), "M": Size("x", "m"), "NH": Size("x", "h"),
                        "eps_bits": Value("eps_bits"), **_rows("x", "xst", "xsh"), **_rows("residual", "rst", "rsh"),
                        **_rows("out", "yst", "ysh"), **_rows("residual_out", "rost", "rosh")}),)


#: The backward: ``bwd`` on ``G`` blocks writes dx and each block's fp32 partial rows of the weight's
#: (and bias's) gradient, then ``wsum`` adds the ``P`` partial rows in a fixed order into dw (and db).
#: ``x`` is the forward's x, or its residual_out with a residual; ``dro`` residual_out's gradient;
#: ``bias`` an empty tensor of the bias's dtype, for its gradient's presence and dtype alone.
BACKWARD = Plan(
    "norm backward", inputs=("x", "dy", "dro", "weight", "bias"),
    outputs=(Output("dx", like="dy", dtype_of="x"), Output("dw", like="weight", shape=("x_d",)),
             Output("db", like="bias", shape=("x_d",))),
    # the weight's and the bias's partial rows: per call, each from a 256-byte boundary of one allocation
    workspaces=(Workspace("dwp", "float32", "P * x_d", when="weight"),
                Workspace("dbp", "float32", "P * x_d", when="bias")),
    steps=(Step("bwd", {"X": Ptr("x"), "DY": Ptr("dy"), "DRO": Ptr("dro"), "W": Ptr("weight"), "DX": Ptr("dx"),
                        "DWP": Ptr("dwp"), "DBP": Ptr("dbp"), "M": Size("x", "m"), "NH": Size("x", "h"),
                        "G": Value("G"), "eps_bits": Value("eps_bits"), **_rows("x", "xst", "xsh"),
                        **_rows("dy", "dyst", "dysh"), **_rows("dro", "drost", "drosh"),
                        **_rows("dx", "dxst", "dxsh")}),
           Step("wsum", {"DWP": Ptr("dwp"), "DBP": Ptr("dbp"), "DW": Ptr("dw"), "DB": Ptr("db"), "P": Value("P")},
                when=("weight", "bias"))),
    dims={**dict.fromkeys(("x", "dy", "dro", "dx"), _ROWS), "weight": _PARAM})


def implement(op: Any, spec: Any) -> NormKernels:
    return NormKernels(op, spec)
