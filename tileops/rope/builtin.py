"""BUILTIN implementation of the RoPE family: TileLang kernels from ``kernels/rope.py``.

One object per (op, call specialization) holds the compiled forward kernel (the backward, the same
builder with ``inverse=True``, is compiled at the first backward) and launches it on views as they
come: x, the output and positions are passed as pointers and strides, so a transposed or sliced
view is rotated where it lies. The one fallback: a view whose last dim is not contiguous, or (on
CUDA) whose pointer or strides are not multiples of 16 bytes, is copied to a dense tensor first,
because the kernel moves 16 bytes per access.

What a call's views mean to the kernel is declared once, as the plan :data:`FORWARD` and the dims
of its tensors (:mod:`tileops.runtime.views`): the runtime computes every extent and stride from them,
keeps the binding per call signature and runs later calls from it (:meth:`RoPEKernels.binding`); the
general path (:meth:`RoPEKernels.run`) places the call's tensors by the plan's fit policy (the one
copy) and binds what it launches with through the same plan and the same executor.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..compile.build import device_backend, load_kernel
from ..manifest import DTYPES as DTYPE
from ..runtime.binding import Binding
from ..runtime.memory import persistent
from ..runtime.plan import Dims, ErrorWord, Plan, Ptr, Size, Step, Tag, Value, strides
from ..runtime.views import Misfit
from ..schedules import static_for
from . import hooks
from .tables import DIGITS, LO

__all__ = ["implement", "kernel_spec", "kernel_specs", "RoPEKernels", "TRANSPOSED_MIN_TOKENS", "CPU_WIDEN_FP16_MIN"]

#: a 2d view of at least this many tokens (B x S) whose head stride exceeds its token stride (HF's
#: ``[B, H, S, D]`` through a transpose; under ``"bhsd"``, such a tensor dense) is served on CUDA by
#: the kernel made for head-major views (``RoPEKernelSpec.transposed``); a shorter one keeps the
#: usual schedule, whose many head lanes are what a few tokens need (H200: decode-size q+k on such
#: views 4.7 us with 8 head lanes, 11.9 us with 2; 8192 tokens 46.7 us with 8, 44.3 us with 2)
TRANSPOSED_MIN_TOKENS = 8192

#: fp16 on the CPU: from this many elements of x (and key) a call converts them to fp32 with torch,
#: rotates the copies into new fp32 tensors with the fp32 C kernel (:meth:`RoPEKernels._run_wide`)
#: and rounds the result back into the output.
#: The same bits as the fp16 kernel: that kernel also widens each element exactly, computes in fp32
#: in the same order and rounds to nearest even, which is what ``copy_`` into fp16 does. The fp16
#: kernel itself converts one element at a time (GCC 12 vectorizes no _Float16 conversion short of
#: AVX512-FP16), 4.3x the fp32 kernel's time (331 against 77 us on [2, 32, 32, 128]), while torch's
#: conversions are vectorized. Below the threshold the two extra passes' fixed costs are not worth it.
CPU_WIDEN_FP16_MIN = 16384


def kernel_specs(manifest: Any, params: Any, call: Any, backend: str, backward: bool = True) -> list[tuple[str, Any]]:
    """Every ``(builder, spec)`` a call of one specialization (``call``, a
    :class:`tileops.manifest.CallSpec`) of the op ``manifest`` describes, built with ``params``, may
    launch on ``backend``: what ``tileops warmup`` and ``op.compile`` build ahead, without
    constructing the op. The first is the RoPE kernel of a forward call on the usual views (what
    ``tileops emit`` prints); then the kernel for long head-major 2d views on CUDA
    (:data:`TRANSPOSED_MIN_TOKENS`), the same for the backward (``backward`` and the manifest
    declares one), and the kernels a forward call launches besides: dynamic NTK's state kernel."""
    cls = getattr(hooks, manifest.hooks)
    out = []
    for inverse in (False, True) if backward and manifest.backward else (False,):
        for transposed in (False, True) if backend == "cuda" and cls.layout_of(params) in hooks.BATCHED else (False,):
            out.append((manifest.kernel.builder, kernel_spec(cls, manifest, params, call, backend, inverse, transposed)))
    if hasattr(cls, "device_tables"):  # tables that depend on the call's positions: built by a kernel
        from tileops.kernels import get_spec

        rot = cls.rotated_width_of(params, call.dim("head_dim"))
        out.append(("ntk", get_spec("ntk")(rot, positions=call.position_dtype, backend=backend)))
    return out


def kernel_spec(cls: type, manifest: Any, params: Any, call: Any, backend: str, inverse: bool = False,
                transposed: bool = False) -> Any:
    """The :class:`kernels.rope.RoPEKernelSpec` serving an op of hook class ``cls`` (the op's class,
    or the class its manifest's ``hooks:`` names) built with ``params``, for one call
    specialization (``transposed``: the kernel for long head-major 2d views, see
    :data:`TRANSPOSED_MIN_TOKENS`)."""
    from tileops.kernels import get_spec

    RoPEKernelSpec = get_spec("rope")
    # a static choice is one value, or a map from input layout to value (schedules differ by layout)
    # keyed by the input_layout choices the manifest spells (MRoPE's "packed" is the "ids" layout)
    key = params.get("input_layout", cls.layout_of(params))
    static = {k: (v[key] if isinstance(v, dict) else v) for k, v in static_for(manifest, call).items()}
    head_dim = call.dim("head_dim")
    return RoPEKernelSpec(dtype=call.dtype("x"), head_dim=head_dim, rot=cls.rotated_width_of(params, head_dim),
                          pairing=cls.pairing_of(params), positions=call.position_dtype, inverse=inverse,
                          backend=backend, transposed=transposed, **static,
                          **cls.kernel_fields_of(params, call.position_dtype))


def _spec_for(op: Any, call: Any, backend: str, inverse: bool = False, transposed: bool = False) -> Any:
    """:func:`kernel_spec` for ``op`` itself."""
    return kernel_spec(type(op), op.manifest, op.params, call, backend, inverse, transposed)


class RoPEKernels:
    """The kernels of one op specialization, and how a call's tensors are handed to them."""

    def __init__(self, op: Any, spec: Any):
        self.op = op
        self.spec = spec
        self.device = spec.device
        self.backend, self.arch = device_backend(self.device)
        self.kspec = _spec_for(op, spec, self.backend)
        self._kernels: dict[tuple[bool, bool], Any] = {}
        self._wide_kernels: dict[tuple[bool, bool], Any] = {}  # fp32 kernels of an fp16 spec (widens)
        self._kernel(False)  # compile the forward now: the first call pays for it, not a later one
        self.unit = self.kspec.stride_unit
        self.layout = op.layout
        # the tables a call may use: one set, or several that a call picks from on the device
        rot = self.kspec.rot
        self.tables = op._tables(rot)
        self._stacked: torch.Tensor | None = None  # every set, for a choice made on the device
        self.limit = op.position_limit()
        #: the call's plan (:data:`FORWARD` for this op's tensors), and its bindings by signature
        positions = MROPE_POSITIONS if self.kspec.mrope_section is not None else POSITIONS
        rotated = _HEADS_FIRST if self.layout == "bhsd" else _ROTATED
        self.plan = Plan.of(op.manifest, FORWARD, checks={"position_ids": 0},
                            dims={**dict.fromkeys(("x", "out", "key", "key_out"), rotated), "position_ids": positions})
        from tileops.kernels.rope import DIGITS as KDIGITS, LO as KLO

        if (KLO, KDIGITS) != (LO, DIGITS):
            raise RuntimeError("tileops.rope.tables and kernels/rope.py split positions differently")

    def _kernel(self, inverse: bool, transposed: bool = False, wide: bool = False) -> Any:
        """The kernel for one direction and view; ``wide``: the fp32 kernel of this spec (see :meth:`widens`)."""
        kernels = self._wide_kernels if wide else self._kernels
        k = kernels.get((inverse, transposed))
        if k is None:
            kspec = (self.kspec if not (inverse or transposed)
                     else _spec_for(self.op, self.spec, self.backend, inverse=inverse, transposed=transposed))
            if wide:
                kspec = dataclasses.replace(kspec, dtype="float32")
            k = kernels[inverse, transposed] = load_kernel(
                self.op.manifest.kernel.builder, kspec, self.backend, self.arch, self.device, kspec.args,
                op_name=self.op.name)
        return k

    def widens(self, x: torch.Tensor, key: torch.Tensor | None = None) -> bool:
        """Whether a call on ``x`` (and ``key``) runs the fp32 kernel on fp32 copies
        (:data:`CPU_WIDEN_FP16_MIN`): fp16 on the CPU, from that many elements."""
        return (self.backend == "c" and x.dtype == torch.float16
                and x.numel() + (key.numel() if key is not None else 0) >= CPU_WIDEN_FP16_MIN)

    # ------------------------------------------------------------------------------ per call
    def prepare(self, tensors: dict) -> torch.Tensor:
        """The digit tables this call uses (``[DIGITS, LO, 2, R/2]`` on the device); no host sync."""
        tables = self.tables_for(tensors["x"], tensors.get("position_ids"))
        if hasattr(self.op, "device_tables") and torch.is_grad_enabled() and any(
                t is not None and t.requires_grad for t in (tensors["x"], tensors.get("key"))):
            # dynamic NTK rewrites its tables in place when a later call changes the length; the
            # backward must rotate by this call's frequencies (a 0.4 MB copy, on the autograd path only)
            tables = tables.clone()
        return tables

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
        built = getattr(self.op, "device_tables", None)
        if built is not None:  # tables that depend on this call's positions, built on the device
            return built(position_ids, self._seq_len(x), self.kspec.rot, self.device)
        choice = self.op.choose_table(position_ids, self._seq_len(x))
        sets = [t.on(self.device) for t in self.tables]
        if len(sets) == 1:
            return sets[0]
        if isinstance(choice, int):
            return sets[choice]
        if self._stacked is None:  # built once (this object serves one device): no stack per call
            self._stacked = persistent(lambda: torch.stack(sets), self.device)
        # picked on the device, no host read
        return self._stacked.index_select(0, choice.reshape(1).to(self.device, torch.int64))[0]

    def _seq_len(self, x: torch.Tensor) -> int:
        return x.shape[hooks.SEQ_AXIS[self.layout]]

    def _head_major(self, x: dict) -> bool:
        """Whether x, as the kernel sees it (``{dim: (extent, stride)}``), takes the kernel made for
        head-major views."""
        (b, _), (s, ss), (h, sh) = (x.get(d, (1, 0)) for d in "bsh")
        return (self.backend == "cuda" and self.layout in hooks.BATCHED and h > 1 and s > 1 and sh > ss
                and b * s >= TRANSPOSED_MIN_TOKENS)

    def run(self, x: torch.Tensor, position_ids: torch.Tensor | None, tables: torch.Tensor,
            inverse: bool = False, key: torch.Tensor | None = None, out: torch.Tensor | None = None,
            key_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rotate ``x`` and ``key`` (by the negated angle with ``inverse``) in one launch; returns
        ``(out, key_out)``, new tensors unless given. ``out is x`` rotates in place."""
        if self.widens(x, key):
            return self._run_wide(x, position_ids, tables, inverse, key, out, key_out)
        placed = self.plan.place({"x": x, "position_ids": position_ids, "key": key}, {"out": out, "key_out": key_out},
                                 self.unit)
        if x.numel() == 0 and (key is None or key.numel() == 0):
            return placed.outs["out"], placed.outs["key_out"]
        kernel = self._kernel(inverse, self._head_major(placed.seen["x"]), wide=x.dtype != DTYPE[self.kspec.dtype])
        launch, writes = placed.inputs, placed.writes
        # the same views with the op's fixed tables bind the same way: bound once
        cached = len(self.tables) == 1 and tables is self.tables[0].on(self.device)
        make = lambda: self._binding(kernel, launch, writes, {}, tables)  # noqa: E731
        self.op.run_plan(self, (id(kernel), *self.plan.key(launch, writes)) if cached else None, make, launch, writes)
        placed.copy_back()
        return placed.outs["out"], placed.outs["key_out"]

    def _run_wide(self, x: torch.Tensor, position_ids: torch.Tensor | None, tables: torch.Tensor, inverse: bool,
                  key: torch.Tensor | None, out: torch.Tensor | None,
                  key_out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`run` through fp32 copies (:meth:`widens`): rotated by the fp32 kernel into new fp32
        tensors, then rounded to nearest even into the outputs (which may be the inputs themselves).
        Not in place: the C kernel rotating its own input ran 2.3x slower than into another buffer
        (241 against 107 us at [2, 32, 32, 128] fp32, 2-core Xeon), which made the widened path
        slower than torch eager (359 us against 318)."""
        xw = x.float()
        kw = key.float() if key is not None else None
        yw, kyw = self.run(xw, position_ids, tables, inverse, kw)
        out = yw.to(x.dtype) if out is None else out.copy_(yw)
        if key is not None:
            key_out = kyw.to(key.dtype) if key_out is None else key_out.copy_(kyw)
        return out, key_out

    # ------------------------------------------------------------------------------ bindings
    def _binding(self, kernel: Any, tensors: dict, outs: dict, views: dict, tables: torch.Tensor | None) -> Binding:
        """:attr:`plan` bound with ``kernel`` for these inputs and outputs (``outs``: a tensor, the input
        itself for in place, or None for a new one laid out as ``views`` has it); ``tables`` fixed, or
        None: picked per call (:meth:`tables_for`)."""
        env = {"limit": self.limit if tensors.get("position_ids") is not None else 0, "TD": 0}
        late, keep = {}, ()
        if tables is None:
            late["TD"] = lambda named: self.tables_for(named["x"], named["position_ids"])  # picked on the device
        else:
            env["TD"], keep = tables.data_ptr(), (tables,)
        return self.plan.bind({"rope": kernel}, tensors, outs, env=env, late=late, keep=keep, views=views,
                              unit=self.unit)

    def binding(self, tensors: dict, outs: dict) -> Binding | None:
        """The binding of every later call shaped like this one, or None (such calls take the
        general path: views that need a copy, empty tensors, widened fp16)."""
        x, key = tensors["x"], tensors.get("key")
        if x.numel() == 0 or (key is not None and key.numel() == 0) or self.widens(x, key):
            return None
        views = {name: None if tensors.get(like) is None else outs[name] if outs.get(name) is not None
                 else torch.empty_like(tensors[like]) for name, like in (("out", "x"), ("key_out", "key"))}
        seen = self.plan.layout({**tensors, **views}, self.unit)
        if isinstance(seen, Misfit):
            return None
        single = len(self.tables) == 1 and not hasattr(self.op, "device_tables")
        kernel = self._kernel(False, self._head_major(seen["x"]))
        return self._binding(kernel, tensors, outs, views, self.tables[0].on(self.device) if single else None)


#: How the kernel sees x, out, key and key_out: ``[B, S, H, D]`` (2d), ``[T, H, D]`` (ids), ``[S, D]`` (1d)
_ROTATED = Dims({4: "bshd", 3: "shd", 2: "sd"})
#: ... and with ``input_layout="bhsd"``: transformers' ``[B, H, S, D]``, the same kernel through strides
_HEADS_FIRST = Dims("bhsd")
#: position_ids: ``[B, S]`` or ``[S]``, read one element at a time (any strides); MRoPE's ``[3, ...]``
#: streams lie ``c`` apart
POSITIONS = Dims({1: "s", 2: "bs"}, vector=False)
MROPE_POSITIONS = Dims({2: "cs", 3: "cbs"}, vector=False)


#: The rotation: x (and the key, in the same launch) at the positions into out (and key_out), each
#: tensor seen as ``[B, S, H, D]`` by its strides; ``TD`` the digit tables' address (or bound per
#: call); a position out of range is read as 0 (nothing is indexed out of bounds) and the kernel writes
#: the call's tag into its error word: reported without a host sync.
FORWARD = (Step("rope", {"X": Ptr("x"), "Y": Ptr("out"), "K": Ptr("key"), "KY": Ptr("key_out"),
                         "P": Ptr("position_ids"), "TD": Value("TD"), "B": Size("x", "b"), "S": Size("x", "s"),
                         "H": Size("x", "h"), "HK": Size("key", "h"), **strides("x", "xs", "bsh"),
                         **strides("out", "ys", "bsh"), **strides("key", "ks", "bsh"),
                         **strides("key_out", "kys", "bsh"), **strides("position_ids", "ps", "bsc"),
                         "limit": Value("limit"), "ERR": ErrorWord(), "tag": Tag()}),)


def implement(op: Any, spec: Any) -> RoPEKernels:
    return RoPEKernels(op, spec)

