"""Plans: a call's kernels in order, the workspaces they share, and every kernel argument by its role.

A family declares a :class:`Plan` once, as data: the tensors of the call (inputs, then outputs, each
output like an input or of a shape of its own), the workspaces (sized by expressions, allocated per
call or kept), and the steps, each a kernel of the family's kernel set with every argument given a
role:

* :class:`Ptr` the data pointer of a tensor of the call or of a workspace, by name;
* :class:`Value` a number from an expression (:mod:`tileops.manifest.expr`, never ``eval``) over
  the inputs' extents (``x_s``: dim ``s`` of x) and the names the family hands to :meth:`Plan.bind`:
  params, a block count;
* :class:`Size` and :class:`Stride` an extent or a stride of a tensor of the call, by the names
  its :attr:`Plan.dims` declaration gives its dims (:mod:`tileops.runtime.views`: what the runtime
  computes from each call's views, and its fit policy);
* :class:`Scalar` an integer each call brings (a decode step's length), not part of the signature;
* :class:`ErrorWord` and :class:`Tag` the call's error word and tag (:mod:`tileops.runtime.errors`),
  for a step that checks the values of the inputs ``Plan.checks`` names.

:meth:`Plan.bind` turns a declaration, the kernels and one call's tensors into a
:class:`tileops.runtime.binding.Binding`: every launch's argument array filled but for the pointers,
which each call of that signature brings. Both executors run it (:mod:`tileops.runtime.executor`):
the outputs allocated, one allocation for the per-call workspaces, the launches queued in order on
the current stream. The op's :class:`tileops.runtime.cache.Bindings` keeps them, by :meth:`Plan.key`:
the one cache of an op's bindings, its calls' and its general path's.

Example: two kernels sharing a workspace (``docs/examples/two_kernel_plan.py``, which
``tests/test_plans.py`` runs on the CPU)::

    SUM_ROWS = Plan(
        "sum rows", inputs=("x",), outputs=(Output("y", like="x", shape=("x_n",)),),
        workspaces=(Workspace("partial", "float32", "G * x_n"),), dims={"x": Dims("mn", vector=False)},
        steps=(Step("partials", {"X": Ptr("x"), "P": Ptr("partial"), "M": Size("x", "m"), "N": Size("x", "n"),
                                 "xs": Stride("x", "m"), "G": Value("G")}),
               Step("reduce", {"P": Ptr("partial"), "Y": Ptr("y"), "N": Size("x", "n"), "G": Value("G")})))
    binding = SUM_ROWS.bind({"partials": k1, "reduce": k2}, {"x": x}, {}, env={"G": 4})
    y = runtime.execute(binding, {"x": x}, {})
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from ..manifest.expr import Expr, ExprError, parse_expr
from .binding import ABSENT, GIVEN, IN_PLACE, NEW, Binding, Launch, device_of
from .views import Dims, Flat, Misfit, Placed, Rows, Units, View, align as align_of, extents, layout, place, unit_of

__all__ = ["Plan", "Step", "Output", "Workspace", "Ptr", "Value", "Size", "Stride", "strides", "Scalar", "ErrorWord",
           "Tag", "PlanError", "WORK_ALIGN", "Dims", "Rows", "Flat", "Placed", "signature"]

#: the bytes each per-call workspace starts on within the call's one allocation: the allocator's own
#: 512 is more than a kernel's widest access needs; 256 keeps fp32 rows on a TMA/vector boundary
WORK_ALIGN = 256


class PlanError(ValueError):
    """A plan that does not fit its kernels or the call: an argument the kernel lacks, a name no
    role gives, an expression that does not evaluate."""


# ---------------------------------------------------------------------------------------- roles
@dataclass(frozen=True)
class Ptr:
    """The data pointer of the call's tensor or workspace ``name`` (0 when it is absent)."""

    name: str


@dataclass(frozen=True)
class Value:
    """A number computed from ``expr`` over the names :meth:`Plan.bind` is given: an int, or a float
    for a kernel's float argument (encoded by the argument's type)."""

    expr: str
    tree: Expr = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tree", parse_expr(str(self.expr)))


@dataclass(frozen=True)
class Size:
    """The product of the extents of ``dims`` (letters of the :class:`tileops.runtime.views.Dims` the
    plan declares for ``tensor``; a dim its rank lacks counts 1); 0 when the tensor is absent."""

    tensor: str
    dims: str


@dataclass(frozen=True)
class Stride:
    """The stride of ``tensor``'s dim ``dim`` in the plan's unit (in elements for a tensor not moved in
    vectors, or with ``elements``); 0 for a dim of extent 1, one its rank lacks, or an absent tensor
    (unless its dims are declared ``span``: :class:`tileops.runtime.views.Dims`)."""

    tensor: str
    dim: str
    elements: bool = False


@dataclass(frozen=True)
class Scalar:
    """The call's per-call scalar ``name`` (one of :attr:`Plan.scalars`), given to ``execute`` each call."""

    name: str


@dataclass(frozen=True)
class ErrorWord:
    """The address of the call's error words (the kernel's ``ERR``)."""


@dataclass(frozen=True)
class Tag:
    """The call's tag, which the kernel writes into a word for a bad value."""


Role = Ptr | Value | Size | Stride | Scalar | ErrorWord | Tag


def strides(tensor: str, prefix: str, dims: str, elements: bool = False) -> dict[str, Stride]:
    """``tensor``'s stride arguments named ``<prefix><dim>``, one for each of ``dims``:
    ``strides("x", "xs", "bsh")`` is ``{"xsb": Stride("x", "b"), "xss": ..., "xsh": ...}``."""
    return {f"{prefix}{d}": Stride(tensor, d, elements) for d in dims}


# ---------------------------------------------------------------------------------- declarations
@dataclass(frozen=True)
class Output:
    """An output of the call: a new tensor unless given, laid out like input ``like`` (absent with
    it), or of a shape of its own (``shape``: expressions, C-contiguous); in the dtype of input
    ``dtype_of`` when it is not ``like``'s, or in ``dtype`` (a name: ``"float32"``) whatever the inputs'."""

    name: str
    like: str
    shape: tuple[str, ...] | None = None
    dtype_of: str | None = None
    dtype: str | None = None


@dataclass(frozen=True)
class Workspace:
    """Memory the steps share that the call neither takes nor returns: ``numel`` elements of ``dtype``
    (an expression), present when input ``when`` is given (None: always). Per call by default (one
    allocation for all of a call's workspaces, freed once the launches are queued: the allocator
    reuses it in stream order); ``kept``: allocated when the signature is bound and reused by every
    call of it (calls on two streams at once then share it: only for state the kernels own)."""

    name: str
    dtype: str
    numel: str
    when: str | None = None
    kept: bool = False


@dataclass(frozen=True)
class Step:
    """One launch: kernel ``kernel`` of the kernel set given to :meth:`Plan.bind`, each of ``args``
    (the kernel's argument name -> its role; the others are 0) bound by its role. Launched when any
    of the inputs ``when`` names is given (empty: always)."""

    kernel: str
    args: Mapping[str, Role]
    when: tuple[str, ...] = ()


@dataclass(frozen=True)
class Plan:
    """A call's tensors, workspaces and kernels in order (the module's doc)."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[Output, ...]
    steps: tuple[Step, ...]
    workspaces: tuple[Workspace, ...] = ()
    #: per-call scalars, in the order ``execute`` takes them
    scalars: tuple[str, ...] = ()
    #: input name -> the error word its values are judged by (the step holding :class:`ErrorWord`)
    checks: Mapping[str, int] = field(default_factory=dict)
    #: tensor name -> how the kernels see it (:mod:`tileops.runtime.views`), for :class:`Size` and
    #: :class:`Stride` and the fit policy (:meth:`place`)
    dims: Mapping[str, View] = field(default_factory=dict)

    def __post_init__(self) -> None:
        names = [*self.inputs, *(o.name for o in self.outputs), *(w.name for w in self.workspaces)]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise PlanError(f"plan {self.name!r}: names used twice: {', '.join(sorted(dup))}")
        for o in self.outputs:
            for n in (o.like, o.dtype_of):
                if n is not None and n not in self.inputs:
                    raise PlanError(f"plan {self.name!r}: output {o.name}: {n!r} is not an input")
            if o.dtype is not None and (o.dtype_of is not None or o.dtype not in _ELEMENT):
                raise PlanError(f"plan {self.name!r}: output {o.name}: dtype {o.dtype!r}: expected one of "
                                f"{', '.join(_ELEMENT)}, and no dtype_of beside it")
        for w in self.workspaces:
            if w.when is not None and w.when not in self.inputs:
                raise PlanError(f"plan {self.name!r}: workspace {w.name}: when {w.when!r} is not an input")
            if w.dtype not in _ELEMENT:
                raise PlanError(f"plan {self.name!r}: workspace {w.name}: dtype {w.dtype!r} is not one of "
                                f"{', '.join(_ELEMENT)}")
        from .errors import WORDS

        if any(not 0 <= w < WORDS for w in self.checks.values()):
            raise PlanError(f"plan {self.name!r}: checks: error words are 0 .. {WORDS - 1}, got {dict(self.checks)}")
        # whether an expression names an input's extent (``x_s``), which :meth:`bind` then computes
        said = {n for s in self.steps for r in s.args.values() if isinstance(r, Value) for n in r.tree.names}
        said |= {n for w in self.workspaces for n in parse_expr(w.numel).names}
        said |= {n for o in self.outputs for d in (o.shape or ()) for n in parse_expr(d).names}
        object.__setattr__(self, "_extents", any(n.startswith(f"{t}_") for t in self.dims for n in said))
        object.__setattr__(self, "_likes", {o.name: o.like for o in self.outputs})  # (for place, every call)
        known = set(names)
        checking = [i for i, s in enumerate(self.steps) if any(isinstance(r, ErrorWord) for r in s.args.values())]
        if len(checking) > 1 or (self.checks and not checking):
            raise PlanError(f"plan {self.name!r}: checks need exactly one step taking the ErrorWord")
        for s in self.steps:
            for arg, role in s.args.items():
                if isinstance(role, Ptr) and role.name not in known:
                    raise PlanError(f"plan {self.name!r}: {s.kernel}.{arg}: no tensor or workspace {role.name!r}")
                if isinstance(role, Scalar) and role.name not in self.scalars:
                    raise PlanError(f"plan {self.name!r}: {s.kernel}.{arg}: {role.name!r} is not among its scalars")
                if isinstance(role, (Size, Stride)) and role.tensor not in self.dims:
                    raise PlanError(f"plan {self.name!r}: {s.kernel}.{arg}: no dims declared for {role.tensor!r}")
            for n in s.when:
                if n not in self.inputs:
                    raise PlanError(f"plan {self.name!r}: step {s.kernel}: when {n!r} is not an input")

    @classmethod
    def of(cls, manifest: Any, steps: tuple[Step, ...], **kw: Any) -> "Plan":
        """The plan of a call of an op: its manifest's inputs and outputs (each output like its like
        input), and ``steps``. A step's pointer to a tensor the op does not have is left out (its
        argument stays 0): one family's steps serve ops with and without it (LayerNorm's bias)."""
        names = {t.name for t in (*manifest.inputs, *manifest.outputs)}
        names |= {w.name for w in kw.get("workspaces", ())}
        kw["dims"] = {n: v for n, v in kw.get("dims", {}).items() if n in names}
        gone = lambda r: ((isinstance(r, Ptr) and r.name not in names)  # noqa: E731
                          or (isinstance(r, (Size, Stride)) and r.tensor not in names))
        steps = tuple(Step(s.kernel, {a: r for a, r in s.args.items() if not gone(r)}, s.when) for s in steps)
        return cls(manifest.name, tuple(t.name for t in manifest.inputs),
                   tuple(Output(o.name, like=o.like) for o in manifest.outputs), steps, **kw)

    def key(self, tensors: Mapping[str, Any], outs: Mapping[str, Any]) -> tuple:
        """What a binding of this plan for inputs ``tensors`` and written ``outs`` depends on (for
        :meth:`tileops.runtime.cache.Bindings.bind`): every tensor's :func:`signature`, and which outputs are their like input."""
        return (signature(self.names, {**tensors, **outs}),
                tuple(outs.get(o.name) is not None and outs.get(o.name) is tensors.get(o.like) for o in self.outputs))

    @property
    def names(self) -> tuple[str, ...]:
        """The call's tensors as a binding numbers them: the inputs, then the outputs."""
        return (*self.inputs, *(o.name for o in self.outputs))

    def bind(self, kernels: Mapping[str, Any], tensors: Mapping[str, Any], outs: Mapping[str, Any], *,
             env: Mapping[str, Any], align: Mapping[str, int] | None = None,
             late: Mapping[str, Callable[[dict], torch.Tensor]] | None = None,
             views: Mapping[str, torch.Tensor] | None = None, keep: tuple[torch.Tensor, ...] = (),
             unit: Units = 1) -> Binding:
        """The :class:`tileops.runtime.binding.Binding` of this plan for calls shaped like this one.

        Args:
            kernels: Step kernel name -> the :class:`tileops.compile.entry.RawKernel` it launches.
            tensors: Input name -> the tensor (None: not given).
            outs: Output name -> the tensor written (given), the like input itself (in place), or
                None (a new tensor per call).
            env: The names :class:`Value` expressions and the sizes of workspaces and own-shape
                outputs are computed from, besides the inputs' extents, which are there already as
                ``<tensor>_<dim>`` (a dim of their :attr:`dims`: ``q_h``, ``x_m``).
            align: Tensor name -> the bytes its data pointer must be a multiple of (checked per call:
                a call off it is refused, and its caller copies); by default, that of its vectors
                for a tensor :attr:`dims` declares moved in vectors.
            late: Argument name of the first step -> ``fn(inputs)``, a tensor chosen per call.
            views: Output name -> a tensor laid out as a new output of this signature is (default:
                ``torch.empty_like`` of its like input, or C-contiguous for an own shape).
            keep: Tensors whose addresses ``env`` holds.
            unit: The elements of the kernels' vectors (1: none), which :class:`Stride` counts in: one for
                every tensor, or by name (:func:`tileops.runtime.views.unit_of`).
        """
        views = dict(views or {})
        ins, names = self.inputs, self.names
        # the inputs' extents by name (``x_s``: :func:`tileops.runtime.views.extents`), for every expression
        env = {**extents(self.dims, tensors), **env} if self._extents else env
        at = {n: i for i, n in enumerate(names)}
        modes, strides, sizes, dtypes = [], [], [], []
        for o in self.outputs:
            src, dst = tensors.get(o.like), outs.get(o.name)
            mode = ABSENT if src is None else NEW if dst is None else IN_PLACE if dst is src else GIVEN
            modes.append(mode)
            dtype = (getattr(torch, o.dtype) if o.dtype is not None
                     else None if o.dtype_of is None or tensors.get(o.dtype_of) is None else tensors[o.dtype_of].dtype)
            dtypes.append(None if mode != NEW or dtype == src.dtype else dtype)
            if mode != NEW:
                strides.append(())
                sizes.append(())
                continue
            ref = views.get(o.name)
            if ref is None and o.shape is not None:
                shape = tuple(self._int(parse_expr(d), env, f"output {o.name}'s shape") for d in o.shape)
                ref = torch.empty(shape, device="meta")  # C-contiguous; no memory, only its strides
            if ref is None:
                ref = torch.empty_like(src, device="meta")  # the strides empty_like gives src
            strides.append(tuple(ref.stride()))
            sizes.append(() if tuple(ref.shape) == tuple(src.shape) else tuple(ref.shape))
            views[o.name] = ref
        # every tensor as the kernels see it: inputs, outputs given, in place or laid out as new ones
        seen_as = {n: tensors.get(n) for n in ins}
        for o, mode in zip(self.outputs, modes):
            seen_as[o.name] = (None if mode == ABSENT else views[o.name] if mode == NEW
                               else tensors[o.like] if mode == IN_PLACE else outs[o.name])
        seen = layout(self.dims, seen_as, unit, pointers=False) if self.dims else {}
        if isinstance(seen, Misfit):
            raise PlanError(f"plan {self.name!r}: {seen.name} does not fit ({seen.why}); place the call first")
        auto = {n: align_of(t, unit_of(unit, n)) for n, t in seen_as.items() if t is not None and n in self.dims
                and self.dims[n].vector and unit_of(unit, n) > 1}
        align = {**auto, **(align or {})}
        # workspaces: the kept ones allocated now, the per-call ones laid out in one allocation
        present_work: dict[str, int] = {}
        work: list[int] = []
        kept: list[torch.Tensor] = []
        kept_at: dict[str, int] = {}
        offset = 0
        device = device_of(next(iter(kernels.values()))) if kernels else torch.device("cpu")
        for w in self.workspaces:
            if w.when is not None and tensors.get(w.when) is None:
                continue
            nbytes = self._int(parse_expr(w.numel), env, f"workspace {w.name}'s size") * _ELEMENT[w.dtype]
            if w.kept:
                t = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
                kept.append(t)
                kept_at[w.name] = t.data_ptr()
                continue
            present_work[w.name] = len(names) + len(work)
            work.append(offset)
            offset += -(-max(nbytes, 1) // WORK_ALIGN) * WORK_ALIGN
        launches, scalars = [], []
        checked, word_slot, tag_slot = 0, -1, -1
        present = {n for n in ins if tensors.get(n) is not None}
        present |= {o.name for o, m in zip(self.outputs, modes) if m != ABSENT}
        for s in self.steps:
            if s.when and not any(tensors.get(n) is not None for n in s.when):
                continue
            kernel = kernels.get(s.kernel)
            if kernel is None:
                raise PlanError(f"plan {self.name!r}: no kernel {s.kernel!r} among {', '.join(kernels)}")
            slot = kernel.slot
            values: dict[str, Any] = {}
            pointers = []
            for arg, role in s.args.items():
                if arg not in slot:
                    raise PlanError(f"plan {self.name!r}: kernel {s.kernel} has no argument {arg!r}")
                kind = type(role)
                if kind is Stride:  # (by type, most frequent first: a plan binds ~40 arguments)
                    values[arg] = self._stride(seen, role, unit)
                elif kind is Ptr:
                    if role.name in kept_at:
                        values[arg] = kept_at[role.name]
                    elif role.name in present_work:
                        pointers.append((present_work[role.name], slot[arg], 1))
                    elif role.name in present:
                        pointers.append((at[role.name], slot[arg], max(1, align.get(role.name, 1))))
                elif kind is Value:
                    values[arg] = self._int(role.tree, env, f"{s.kernel}.{arg}", real=True)
                elif kind is Size:
                    dims = seen.get(role.tensor)
                    values[arg] = 0 if dims is None else math.prod(dims[d][0] if d in dims else 1 for d in role.dims)
                elif kind is Scalar:
                    scalars.append((len(launches), slot[arg], self.scalars.index(role.name)))
                elif kind is ErrorWord:
                    checked, word_slot = len(launches), slot[arg]
                elif kind is Tag:
                    tag_slot = slot[arg]
            launches.append(Launch(kernel, kernel.template(values), tuple(pointers)))
        checks = tuple((at[n], w) for n, w in self.checks.items() if tensors.get(n) is not None)
        if checks and (word_slot < 0 or tag_slot < 0):
            raise PlanError(f"plan {self.name!r}: checks need the ErrorWord and the Tag of one step")
        first = launches[0].kernel.slot if launches else {}
        return Binding(tuple(launches), names, len(ins), tuple(modes), tuple(ins.index(o.like) for o in self.outputs),
                       tuple(strides), tuple(sizes), tuple(dtypes),
                       late=tuple((first[a], fn) for a, fn in (late or {}).items()),
                       checks=checks, checked=checked, word_slot=word_slot if checks else -1,
                       tag_slot=tag_slot if checks else -1, work=tuple(work), work_bytes=offset,
                       scalars=tuple(scalars), keep=(*keep, *kept))

    def _stride(self, seen: Mapping[str, Any], role: Stride, units: Units) -> int:
        """:class:`Stride` ``role``'s value in the call's :func:`tileops.runtime.views.layout` ``seen``."""
        dims = seen.get(role.tensor)
        st = 0 if dims is None or role.dim not in dims else dims[role.dim][1]
        unit = unit_of(units, role.tensor)
        if not self.dims[role.tensor].vector or unit == 1 or role.elements:
            return st
        if st % unit:
            raise PlanError(f"plan {self.name!r}: {role.tensor}'s {role.dim} stride {st} is not a multiple of {unit}")
        return st // unit

    def layout(self, tensors: Mapping[str, torch.Tensor | None], unit: Units, pointers: bool = False) -> Any:
        """:func:`tileops.runtime.views.layout` of the call's tensors (inputs and outputs by name) for this
        plan's :attr:`dims`: each as the kernels see it, or the :class:`tileops.runtime.views.Misfit`."""
        return layout(self.dims, tensors, unit, pointers)

    def place(self, tensors: Mapping[str, torch.Tensor | None], outs: Mapping[str, torch.Tensor | None],
              unit: Units) -> Placed:
        """The call's inputs and outputs (given, the like input itself for in place, or None for a new
        one) where the kernels can address them: :func:`tileops.runtime.views.place`, the plan's
        declared fit policy (a copy, a buffer, or a ValueError naming the tensor)."""
        return place(self.dims, tensors, {n: (g, tensors.get(self._likes[n])) for n, g in outs.items()}, unit,
                     lambda name, t, why: self._refusal(name, t, why, unit_of(unit, name)))

    def _refusal(self, name: str, t: torch.Tensor, why: str, unit: int) -> ValueError:
        """The error for ``t`` (the call's ``name``), which the kernels cannot address where it lies
        (``why``: :class:`tileops.runtime.views.Misfit`) and which its dims declare refused."""
        if why == "alignment":
            return ValueError(
                f"{self.name}: {name}: expected its data pointer and strides on a multiple of {unit} elements "
                f"({align_of(t, unit)} bytes: the CUDA kernel's vectors), got data pointer offset "
                f"{t.data_ptr() % 256} bytes mod 256, strides {list(t.stride())} (a view that starts or steps inside "
                f"a vector; it is used where it lies, so no copy hides it: .clone() gives an aligned copy)")
        need = {"last": "a contiguous last dim", "rows": "rows reached with two strides", "dense": "one dense run"}
        return ValueError(f"{self.name}: {name}: expected {need[why]}, got strides {list(t.stride())} (it is used "
                          f"where it lies, so no copy hides it)")

    def _int(self, expr: Expr, env: Mapping[str, Any], what: str, real: bool = False) -> Any:
        """``expr``'s value: an int (with ``real``, a float too: a kernel's float argument, which
        :meth:`tileops.compile.entry.RawKernel.template` encodes by the argument's type)."""
        try:
            v = expr.evaluate(env)
        except ExprError as e:
            raise PlanError(f"plan {self.name!r}: {what}: `{expr}`: {e}") from None
        if isinstance(v, bool) or not isinstance(v, (int, float) if real else int):
            raise PlanError(f"plan {self.name!r}: {what}: `{expr}` gave {v!r}, not {'a number' if real else 'an int'}")
        return v


def signature(names: tuple[str, ...], tensors: Mapping[str, Any]) -> tuple:
    """What a binding of tensors ``names`` depends on: each one's shape, strides and dtype, or None."""
    return tuple(None if (t := tensors.get(n)) is None else (t.shape, t.stride(), t.dtype) for n in names)


#: bytes an element of a workspace's dtype takes
_ELEMENT = {"float32": 4, "float64": 8, "int32": 4, "int64": 8, "uint8": 1, "float16": 2, "bfloat16": 2}
