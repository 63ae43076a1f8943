"""BUILTIN implementation of the RoPE family: TileLang kernels from ``kernels/rope.py``.

One object per (op, call specialization) holds the compiled forward kernel (the backward, the same
builder with ``inverse=True``, is compiled at the first backward) and launches it on views as they
come: x, the output and positions are passed as pointers and strides, so a transposed or sliced
view is rotated where it lies. The one fallback: a view whose last dim is not contiguous, or (on
CUDA) whose pointer or strides are not multiples of 16 bytes, is copied to a dense tensor first,
because the kernel moves 16 bytes per access.

What a call's views mean to the kernel is said once, in :meth:`RoPEKernels._binding` (a
:class:`tileops.runtime.binding.Binding`): the runtime keeps it per call signature and runs later
calls from it (:meth:`RoPEKernels.binding`), and the general path (:meth:`RoPEKernels.run`) binds
the tensors it launches with, copies included, through the same code and the same executor.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..compile.build import device_backend, load_kernel
from ..manifest import DTYPES as DTYPE
from ..runtime.binding import Binding
from ..runtime.memory import persistent
from ..runtime.plan import Bound, ErrorWord, Plan, Ptr, Step, Tag, Value, copy_back, signature
from . import hooks
from .tables import DIGITS, LO

__all__ = ["implement", "kernel_spec", "kernel_specs", "RoPEKernels", "TRANSPOSED_MIN_TOKENS", "CPU_WIDEN_FP16_MIN"]

#: a 2d view of at least this many tokens (B x S) whose head stride exceeds its token stride (HF's
#: ``[B, H, S, D]`` through a transpose) is served on CUDA by the kernel made for head-major views
#: (``RoPEKernelSpec.transposed``); a shorter one keeps the usual schedule, whose many head lanes
#: are what a few tokens need (H200: decode-size q+k on such views 4.7 us with 8 head lanes, 11.9
#: us with 2; 8192 tokens 46.7 us with 8, 44.3 us with 2)
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
        for transposed in (False, True) if backend == "cuda" and cls.layout_of(params) == "2d" else (False,):
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
    static = {k: (v[key] if isinstance(v, dict) else v) for k, v in manifest.kernel.static.items()}
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
        self.plan = Plan.of(op.manifest, FORWARD, checks={"position_ids": 0})
        self._bound = Bound()
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

    def _head_major(self, v: tuple[int, ...]) -> bool:
        """Whether the view ``v`` of x (:meth:`_view4`) takes the kernel made for head-major views."""
        b, s, h, _, ss, sh = v
        return (self.backend == "cuda" and self.layout == "2d" and h > 1 and s > 1 and sh > ss
                and b * s >= TRANSPOSED_MIN_TOKENS)

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
        return self._strides_fit(t, v) and t.data_ptr() % (self.unit * t.element_size()) == 0

    def _strides_fit(self, t: torch.Tensor, v: tuple[int, ...]) -> bool:
        """The part of :meth:`_fits` that depends on the strides alone, not on the pointer."""
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            return False
        u = self.unit
        return u == 1 or not (v[3] % u or v[4] % u or v[5] % u)

    def _position_strides(self, position_ids: torch.Tensor) -> tuple[int, ...]:
        """(batch stride, sequence stride) of ``position_ids``; 0 for a batch it is shared across.
        MRoPE: ``position_ids`` is ``[3, ...]``: those of ``position_ids[0]``, then the stride between
        the streams."""
        if self.kspec.mrope_section is not None:
            return (*self._position_strides_of(position_ids[0]), position_ids.stride(0))
        return self._position_strides_of(position_ids)

    @staticmethod
    def _position_strides_of(position_ids: torch.Tensor) -> tuple[int, int]:
        if position_ids.dim() == 2:
            return (position_ids.stride(0) if position_ids.shape[0] > 1 else 0), position_ids.stride(1)
        return 0, position_ids.stride(0)

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
        if self.widens(x, key):
            return self._run_wide(x, position_ids, tables, inverse, key, out, key_out)
        src_x, vx = self._source(x)
        y, out, _ = self._dest(x, out)
        if src_x is not x and y is x:  # in place through the fallback: the kernel writes the buffer
            y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        src_k = ky = None
        if key is not None:
            src_k, _ = self._source(key)
            ky, key_out, _ = self._dest(key, key_out)
            if src_k is not key and ky is key:
                ky = torch.empty(key.shape, dtype=key.dtype, device=key.device)
        if x.numel() == 0 and (key is None or key.numel() == 0):
            return out, key_out
        kernel = self._kernel(inverse, self._head_major(vx), wide=x.dtype != DTYPE[self.kspec.dtype])
        launch = {"x": src_x, "position_ids": position_ids, "key": src_k}
        writes = {"out": y, "key_out": ky}
        # the same views with the op's fixed tables bind the same way: bound once
        cached = len(self.tables) == 1 and tables is self.tables[0].on(self.device)
        make = lambda: self._binding(kernel, launch, writes, {**launch, **writes}, tables)  # noqa: E731
        b = self._bound.get((id(kernel), signature(self.plan.names, {**launch, **writes}), y is src_x,
                             ky is not None and ky is src_k), make) if cached else make()
        self.op._runtime.execute(b, launch, writes)
        copy_back({"out": y, "key_out": ky}, {"out": out, "key_out": key_out})
        return out, key_out

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
        itself for in place, or None for a new one); ``views``: the tensor each name is seen as (a new
        output's strides are those of ``torch.empty_like``); ``tables`` fixed, or None: picked per call
        (:meth:`tables_for`)."""
        u = self.unit
        x, key, pos = views["x"], views["key"], views["position_ids"]
        env = dict.fromkeys(("HK", "ksb", "kss", "ksh", "kysb", "kyss", "kysh", "limit", "psb", "pss", "psc", "TD"), 0)
        for prefix, name in (("x", "x"), ("y", "out"), ("k", "key"), ("ky", "key_out")):
            if views.get(name) is not None:
                _, _, _, sb, ss, sh = self._view4(views[name])
                env.update({f"{prefix}sb": sb // u, f"{prefix}ss": ss // u, f"{prefix}sh": sh // u})
        b, s, h = self._view4(x)[:3]
        env.update(B=b, S=s, H=h if x.numel() else 0)
        if key is not None and key.numel():  # else HK = 0: the key loop never runs
            env["HK"] = self._view4(key)[2]
        if pos is not None:
            env["limit"] = self.limit
            env.update(zip(("psb", "pss", "psc"), self._position_strides(pos)))
        late, keep = {}, ()
        if tables is None:
            late["TD"] = lambda named: self.tables_for(named["x"], named["position_ids"])  # picked on the device
        else:
            env["TD"], keep = tables.data_ptr(), (tables,)
        align = u * x.element_size()
        return self.plan.bind({"rope": kernel}, tensors, outs, env=env, late=late, keep=keep, views=views,
                              align={"x": align, "out": align, "key": align, "key_out": align})

    def binding(self, tensors: dict, outs: dict) -> Binding | None:
        """The binding of every later call shaped like this one, or None (such calls take the
        general path: views that need a copy, empty tensors, widened fp16)."""
        x, key = tensors["x"], tensors.get("key")
        if x.numel() == 0 or (key is not None and key.numel() == 0) or self.widens(x, key):
            return None
        views = dict(tensors)
        for name, like in (("out", "x"), ("key_out", "key")):
            src = tensors.get(like)
            views[name] = None if src is None else outs[name] if outs.get(name) is not None else torch.empty_like(src)
        if not all(t is None or self._strides_fit(t, self._view4(t)) for n, t in views.items() if n != "position_ids"):
            return None
        single = len(self.tables) == 1 and not hasattr(self.op, "device_tables")
        kernel = self._kernel(False, self._head_major(self._view4(x)))
        return self._binding(kernel, tensors, outs, views, self.tables[0].on(self.device) if single else None)


def _strides(prefix: str) -> dict:
    """A tensor's three strides in the kernel's units (``<prefix>sb``, ``ss``, ``sh``: batch, sequence, head)."""
    return {f"{prefix}{d}": Value(f"{prefix}{d}") for d in ("sb", "ss", "sh")}


#: The rotation: x (and the key, in the same launch) at the positions into out (and key_out), each
#: tensor seen as ``[B, S, H, D]`` by its strides (:meth:`RoPEKernels._view4`); ``TD`` the digit
#: tables' address (or bound per call); a position out of range is read as 0 (nothing is indexed out
#: of bounds) and the kernel writes the call's tag into its error word: reported without a host sync.
FORWARD = (Step("rope", {"X": Ptr("x"), "Y": Ptr("out"), "K": Ptr("key"), "KY": Ptr("key_out"), "P": Ptr("position_ids"),
                         "TD": Value("TD"), "B": Value("B"), "S": Value("S"), "H": Value("H"), "HK": Value("HK"),
                         **_strides("x"), **_strides("y"), **_strides("k"), **_strides("ky"), "psb": Value("psb"),
                         "pss": Value("pss"), "psc": Value("psc"), "limit": Value("limit"), "ERR": ErrorWord(),
                         "tag": Tag()}),)


def implement(op: Any, spec: Any) -> RoPEKernels:
    return RoPEKernels(op, spec)

