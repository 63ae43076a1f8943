"""How a plan's kernels see the call's tensors, and what the runtime does with a view they cannot address.

A kernel addresses a tensor by its data pointer and the strides of its dims. A plan declares, per
tensor, how its kernels see it, and the runtime computes every extent and stride a kernel argument
takes (the roles :class:`tileops.runtime.plan.Size` and :class:`tileops.runtime.plan.Stride`):

* :class:`Dims` names the tensor's dims by its rank (``Dims({4: "bshd", 3: "shd"})``: a 4-d tensor's
  dims are b, s, h and d); a dim its rank does not name has extent 1.
* :class:`Flat` sees a tensor as its elements in one dense run (dim ``n``).
* :class:`Rows` sees the leading dims of every tensor so declared as one run of rows reached with two
  strides: row ``r`` at ``(r // NH) * st + (r % NH) * sh`` (:func:`row_layout`). Its dims are ``m``
  (every row: extent ``M``, stride ``st``), ``h`` (the inner run: extent ``NH``, stride ``sh``) and
  ``d`` (the last).

The stride of a dim of extent 1 is never used, so it is 0 (it cannot spoil alignment). A tensor whose
last dim the kernels move in vectors (``vector``, the default) fits where it lies when that dim is
contiguous and, with a unit over 1 element (CUDA's 16-byte vectors), every other stride is a multiple
of the unit and its pointer of :func:`align` bytes; strides then count in units. The fit policy
(:func:`place`, what the general path runs) is declared with the tensor: a view that does not fit
is copied to a dense tensor (an input) or written through a dense buffer copied back after the
launches (an output), or, with ``refuse``, the call is refused with a ValueError naming it (a
tensor written in place, where a copy would lose the writes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

__all__ = ["Dims", "Rows", "Flat", "Misfit", "Units", "unit_of", "row_layout", "align", "extents", "layout", "place",
           "Placed"]


@dataclass(frozen=True)
class Dims:
    """A tensor's dims named outer to inner, one letter each, by its rank: a string for one rank, or a
    map from rank to names. ``vector``: the last dim is moved in vectors of the plan's unit (see the
    module's doc), else strides count in elements and any strides fit. ``dense``: the kernels read the
    tensor as one dense run (a strided or expanded view is copied first). ``refuse``: ``"any"`` refuses
    any view that does not fit; ``"alignment"`` refuses a pointer or stride off the unit (a last dim
    that is not contiguous is still copied); ``""`` copies."""

    names: str | Mapping[int, str]
    vector: bool = True
    dense: bool = False
    refuse: str = ""
    #: a dim of extent 1 (or one the rank lacks) takes the span of the dims inside it as its stride, and
    #: an expanded dim (stride 0) does not fit: what a TMA descriptor takes (positive strides only)
    span: bool = False

    def __post_init__(self) -> None:
        if self.refuse not in ("", "any", "alignment"):
            raise ValueError(f"Dims.refuse: expected '', 'any' or 'alignment', got {self.refuse!r}")

    def of(self, t: torch.Tensor) -> str:
        """The names of ``t``'s dims."""
        names = self.names
        if type(names) is str:
            names = names if len(names) == t.dim() else None
        else:
            names = names.get(t.dim())
        if names is None:
            raise ValueError(f"a {t.dim()}-d tensor where the plan names its dims {self.names!r}")
        return names


@dataclass(frozen=True)
class Rows:
    """A tensor whose leading dims are rows, reached with two strides together with every other tensor
    of the plan seen as Rows (:func:`row_layout`); ``vector`` and ``refuse`` as for :class:`Dims`."""

    vector: bool = True
    dense: bool = False
    refuse: str = ""


@dataclass(frozen=True)
class Flat:
    """A tensor read as one dense run of elements, whatever its shape (a strided or expanded view is
    copied first): one dim, ``n``, its element count."""

    vector: bool = False
    dense: bool = True
    refuse: str = ""


View = Dims | Rows | Flat


@dataclass(frozen=True)
class Misfit:
    """A tensor the kernels cannot address where it lies: its name, and why (``"last"``: its last dim
    is not contiguous; ``"alignment"``: a stride or its pointer off the unit; ``"rows"``: the rows need a
    third stride; ``"dense"``: it must be one dense run)."""

    name: str
    why: str


Units = int | Mapping[str, int]


def unit_of(unit: Units, name: str) -> int:
    """The vector elements tensor ``name`` is moved in: ``unit`` itself, or its entry (1 if none)."""
    return unit if isinstance(unit, int) else unit.get(name, 1)


def align(t: torch.Tensor, unit: int) -> int:
    """The bytes ``t``'s pointer must be a multiple of for vectors of ``unit`` elements: the vector's
    bytes, at most 16 (1 with no vectors: the C backend)."""
    return min(16, unit * t.element_size()) if unit > 1 else 1


def row_layout(lead: Sequence[int],
               strides: Mapping[str, Sequence[int]]) -> tuple[int, int, dict[str, tuple[int, int]]] | str:
    """How rows of tensors sharing the leading dims ``lead`` are reached, each with its own ``strides``
    of those dims (in elements): ``(M, NH, {name: (st, sh)})`` with row ``r`` of a tensor at
    ``(r // NH) * st + (r % NH) * sh`` (``M`` rows), or, where two strides per tensor do not reach
    every row, the name of the tensor to make dense (the one with the most breaks).

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


#: a tensor as the kernels see it: dim name -> (extent, stride in elements; 0 for an extent of 1)
Seen = dict[str, tuple[int, int]]


def layout(views: Mapping[str, View], tensors: Mapping[str, torch.Tensor | None], unit: Units,
           pointers: bool = True) -> dict[str, Seen] | Misfit:
    """Every declared tensor of ``tensors`` (None: absent) as the kernels see it, or the first that
    does not fit where it lies (``pointers``: its pointer checked too; else its strides alone).
    ``unit``: the elements of the kernels' vectors, one for all tensors or by name (:func:`unit_of`)."""
    # (the general path runs this every call: a few microseconds, so plain loops and no helper calls)
    seen: dict[str, Seen] = {}
    rows: dict[str, torch.Tensor] = {}
    for name, v in views.items():
        t = tensors.get(name)
        if t is None:
            continue
        shape = t.shape
        strides = t.stride()
        if v.dense and not t.is_contiguous():
            return Misfit(name, "dense")
        if v.vector and shape and shape[-1] > 1 and strides[-1] != 1:
            return Misfit(name, "last")
        kind = type(v)
        if kind is Rows:
            rows[name] = t
        elif kind is Flat:
            seen[name] = {"n": (t.numel(), 1)}
        elif v.span:
            seen[name] = _spanned(v, t)
        else:
            seen[name] = {d: (n, st if n != 1 else 0) for d, n, st in zip(v.of(t), shape, strides)}
    if rows:
        lead = next(iter(rows.values())).shape[:-1]
        lay = row_layout(lead, {n: t.stride()[:-1] for n, t in rows.items()})
        if isinstance(lay, str):
            return Misfit(lay, "rows")
        m, nh, strides = lay
        for n, (st, sh) in strides.items():
            seen[n] = {"m": (m, st), "h": (nh, sh), "d": (rows[n].shape[-1], 1)}
    if unit == 1:  # no vectors (the C backend): every stride and pointer fits
        return seen
    for name, dims in seen.items():
        u = unit_of(unit, name)
        v = views[name]
        if u == 1 or not v.vector:
            continue
        t = tensors[name]
        outer = list(dims.values())[:-1]  # the last dim is the vector's: stride 1
        span = type(v) is Dims and v.span
        if (any(st % u or (span and st == 0) for n, st in outer if n > 1)
                or (pointers and t.data_ptr() % align(t, u))):
            return Misfit(name, "alignment")
    return seen


def extents(views: Mapping[str, View], tensors: Mapping[str, torch.Tensor | None]) -> dict[str, int]:
    """The extents of the declared tensors present, named ``<tensor>_<dim>`` for a plan's expressions
    (a workspace's size, a value): every letter of a :class:`Dims` naming (1 for a dim the tensor's
    rank lacks), a :class:`Rows` tensor's ``m`` (its rows) and ``d``, a :class:`Flat` one's ``n``."""
    out: dict[str, int] = {}
    for name, v in views.items():
        t = tensors.get(name)
        if t is None:
            continue
        if type(v) is Rows:
            out[f"{name}_m"], out[f"{name}_d"] = math.prod(t.shape[:-1]), t.shape[-1]
        elif type(v) is Flat:
            out[f"{name}_n"] = t.numel()
        else:
            every = v.names.values() if isinstance(v.names, Mapping) else (v.names,)
            out.update({f"{name}_{d}": 1 for names in every for d in names})
            out.update({f"{name}_{d}": n for d, n in zip(v.of(t), t.shape)})
    return out


def _spanned(v: Dims, t: torch.Tensor) -> Seen:
    """``t`` seen through ``v`` (``span``): every dim of its longest naming, one its rank lacks of extent
    1; a dim of extent 1 strides over the span of the dims inside it (never read; positive)."""
    full = v.names if isinstance(v.names, str) else max(v.names.values(), key=len)
    mine = dict(zip(v.of(t), zip(t.shape, t.stride())))
    dims = [(d, *mine.get(d, (1, 0))) for d in full]
    out: Seen = {}
    inner = None
    for d, n, st in reversed(dims):
        if n == 1 and inner is not None:
            st = max(inner[0] * inner[1], inner[1], 1)  # the next dim's extent times its stride
        out[d] = (n, st)
        inner = (n, st)
    return dict(reversed(list(out.items())))


@dataclass
class Placed:
    """A call's tensors where the kernels can address them (:func:`place`)."""

    #: input name -> the tensor launched with (the caller's, or a dense copy)
    inputs: dict[str, torch.Tensor | None]
    #: output name -> the tensor the kernels write (the caller's, a new one, or a dense buffer)
    writes: dict[str, torch.Tensor | None]
    #: output name -> the tensor the call returns (the caller's, or a new one)
    outs: dict[str, torch.Tensor | None]
    #: every tensor as the kernels see it (:func:`layout`)
    seen: dict[str, Seen]

    def copy_back(self) -> None:
        """Each output written through a buffer of its own copied into the tensor the call returns."""
        for name, t in self.writes.items():
            g = self.outs.get(name)
            if t is not None and g is not None and t is not g:
                g.copy_(t)


def place(views: Mapping[str, View], tensors: Mapping[str, torch.Tensor | None],
          outs: Mapping[str, tuple[torch.Tensor | None, torch.Tensor | None]], unit: Units,
          refuse: Callable[[str, torch.Tensor, str], Exception]) -> Placed:
    """The fit policy: ``tensors`` (inputs) and ``outs`` (output name -> ``(given or None, like
    input)``, a new output made as ``torch.empty_like`` of its like input) placed where the kernels
    can address them. An input that does not fit is copied to a dense tensor; an output written
    through a dense buffer (:meth:`Placed.copy_back`), and so is one given as its own input (in place)
    when that input was copied; a tensor declared ``refuse`` raises ``refuse(name, tensor, why)``."""
    inputs = dict(tensors)
    writes: dict[str, torch.Tensor | None] = {}
    got: dict[str, torch.Tensor | None] = {}
    for name, (given, like) in outs.items():
        got[name] = writes[name] = given if given is not None or like is None else torch.empty_like(like)
    lay = layout(views, {**inputs, **writes}, unit)
    if not isinstance(lay, Misfit):  # the common case: everything is addressed where it lies
        return Placed(inputs, writes, got, lay)
    placed: set[str] = set()
    while isinstance(lay, Misfit):
        name, why = lay.name, lay.why
        if name in placed:  # a dense copy that still does not fit: the declaration, not the call, is wrong
            raise RuntimeError(f"place: {name} does not fit ({why}) even dense; its dims are declared {views[name]}")
        placed.add(name)
        t = inputs[name] if name in inputs else writes[name]
        r = views[name].refuse
        if r == "any" or (r == "alignment" and why == "alignment"):
            raise refuse(name, t, why)
        if name in inputs:
            inputs[name] = t.contiguous() if not t.is_contiguous() else t.clone()  # a clone lands aligned
            for o, (given, _) in outs.items():  # an output in place over it: written through a buffer
                if given is not None and given is tensors[name] and writes[o] is given:
                    writes[o] = torch.empty(given.shape, dtype=given.dtype, device=given.device)
        else:
            writes[name] = torch.empty(t.shape, dtype=t.dtype, device=t.device)
            if outs[name][0] is None:  # a new output: the dense one is what the call returns
                got[name] = writes[name]
        lay = layout(views, {**inputs, **writes}, unit)
    return Placed(inputs, writes, got, lay)
