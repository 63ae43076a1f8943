"""Hypothesis fuzzing of every op: random valid specs against the float64 reference, and random
invalid specs that must fail with a clear error.

A valid spec is an op, params within its rules, dims (lengths from 1, 1..80 heads, batch 1..4, an
even head_dim, and 0 to 3 leading dims where a shape starts with ``"..."``: the norms' rows), a dtype,
and each input laid out contiguously or not (a slice of a wider last dim, one element off a
16-byte boundary, every other row; inputs ``like`` another share its layout); every input holds at
most ``MAX_ELEMENTS`` (20k) elements, so an example takes milliseconds once its kernel exists.
Integer inputs lie anywhere in their range, the ends drawn on purpose; a ``distinct`` one (the
prologue's slot mapping) names each non-negative value once per call, ends included. Specs run
through the BUILTIN kernels on the CPU (TileLang's C backend), one call per op, and also several
calls of one op (new lengths, now and then a new dtype). Invalid specs are drawn per kind of mistake
(wrong param type, non-finite float, value outside choices, broken rule, wrong input
dtype/rank/type, index out of range, bad rescale factors, unknown target), each a separate pytest
item.

Each valid spec is called in one of four modes: new outputs, ``out=`` into NaN-filled tensors laid
out like the inputs (so an element the kernel skips shows), in place (``out=x``, ``key_out=key``),
or backward (gradients of x and key against float64 autograd of the reference). In place needs an
output shaped like its input and backward a manifest that declares one, so the attention prologue
(whose q is ``[tokens, Hq, D]`` from qkv ``[tokens, width]``, forward only) takes the first two.

The attention prologue composes an op: its ``rope`` param is drawn as a spec of its own, any op its
manifest's ``compose`` stage takes (the rope family's ops with positions: neox or interleaved
pairing, partial rotary, MRoPE's three position streams) with params within that op's own rules at
the prologue's head_dim, given as ``{op: Name, params: {...}}`` and built by
:func:`tileops.workloads.op_params`. Positions lie below the rope op's own limit. The inputs the op
writes in place (the caches) are NaN-filled before the call: after it, the elements the float64
reference writes must match it, and every other element must keep its NaN bits. A norm weight laid
out every other element must be refused with a ValueError naming it (the op reads it as one dense
row), before anything is written.

Cost and knobs:

* Every new (dtype, head_dim, rotary width, pairing, layout, position dtype, direction) compiles a
  kernel, about 1.5 s on the CPU (a prologue kernel about 5 s; then cached in memory and on disk by
  TileLang). With the default ``max_examples`` (4 per op for the valid test, 2 per rope op for the
  prologue's, 20 for the many-calls one, 10 per kind of mistake) head_dim is drawn from a small set,
  ``SMALL_HEAD_DIMS``, so the default run takes about a minute and a half (96 s here from an empty
  kernel cache, 71 s before the prologue was drawn). Every dim a manifest compiles kernels for
  (``kernel.specialize``: RoPE's head_dim, the norms' hidden) and the prologue's head_dim param are
  drawn from that set.
* ``TILEOPS_FUZZ_EXAMPLES=N`` sets ``max_examples`` to N in all (N / ops per op for the valid
  test, shared by the prologue's rope ops; N/2, N/4 for the others); ``TILEOPS_FUZZ_WIDE=1`` draws
  head_dim from every even value in 2..512, so most examples compile a kernel: about 2.5 minutes
  for N=300 here.
* Every test here is marked ``slow``, so run the module as ``python -m pytest -m slow tests/test_fuzz.py``.
* The examples are the same every run (the derandomized hypothesis profile of ``tests/conftest.py``);
  ``TILEOPS_EXPLORE=1`` draws new ones, and a failure prints the ``@reproduce_failure`` line that
  replays it.
* ``TILEOPS_FUZZ_DEVICE=cuda`` runs the specs on the GPU (``python -m pytest -m slow tests/test_fuzz.py``
  with ``TILEOPS_FUZZ_EXAMPLES=2000`` is issue 12's GPU fuzz run). There head_dim comes from
  ``GPU_HEAD_DIMS`` and the rotary width from three choices, and every kernel those draws can need
  is compiled first, in parallel processes (:func:`tileops.compile.warmup.compile_jobs`): nvcc takes
  seconds a kernel, the examples themselves milliseconds. The prologue's CUDA kernel moves qkv, the
  caches and the norm weights in 16-byte vectors where they lie: a wider last dim is padded by a
  whole vector there, and a view one element off a boundary must raise the ValueError naming the
  input.
* ``TILEOPS_FUZZ_OPS=A,B`` draws only those ops (and compiles ahead only their kernels on a GPU),
  e.g. ``AttnPrologueFwdOp`` and the rope ops it composes, for a GPU run of one family within a
  few minutes.
* ``max_position`` is drawn up to the manifest's cap, 2**24 (``2**28 // rotary_dim`` by default).

Run with ``--hypothesis-show-statistics`` to see how examples spread over ops, dtypes, layouts and
rope variants.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, event, given, note, settings
from hypothesis import strategies as st

from tileops import target_names
from tileops.manifest import registry
from tileops.manifest.expr import Expr, ExprError
from tileops.manifest.schema import LEAD
from tileops.testing import TOLERANCES
from tileops.workloads import DTYPES, draw_distinct, op_class, op_params

try:  # pytest puts tests/ on sys.path when it is not a package, the repo root when it is
    import family_references
except ImportError:  # pragma: no cover
    from tests import family_references

# Every test here is a hypothesis run (kernels compiled as draws need them: about a minute with the
# defaults on a free 2-core machine), so the module is deselected by default: `-m slow` runs it.
pytestmark = pytest.mark.slow

#: ops the fuzzer does not draw yet, and why (their own tests cover them meanwhile): none today
NOT_FUZZED: dict[str, str] = {}
ALL = registry()
ONLY = [n for n in os.environ.get("TILEOPS_FUZZ_OPS", "").split(",") if n.strip()]
if unknown := [n for n in ONLY if n.strip() not in ALL]:
    raise ValueError(f"TILEOPS_FUZZ_OPS: expected op names among {', '.join(sorted(ALL))}, got {unknown}")
REGISTRY = {n: m for n, m in ALL.items() if n not in NOT_FUZZED and (not ONLY or n in {o.strip() for o in ONLY})}
FULL = os.environ.get("TILEOPS_FUZZ_WIDE", "") not in ("", "0")
DEVICE = os.environ.get("TILEOPS_FUZZ_DEVICE", "cpu")
EXAMPLES = int(os.environ.get("TILEOPS_FUZZ_EXAMPLES", "40"))
MAX_ELEMENTS = 20_000
SMALL_HEAD_DIMS = (2, 6, 64, 96, 128)
GPU_HEAD_DIMS = (2, 96)
if DEVICE != "cpu":
    HEAD_DIMS = st.sampled_from(GPU_HEAD_DIMS)
else:
    HEAD_DIMS = st.integers(1, 256).map(lambda n: 2 * n) if FULL else st.sampled_from(SMALL_HEAD_DIMS)
MODES = ("new", "out", "in-place", "backward")
#: inputs the prologue's CUDA kernel moves in 16-byte vectors where they lie, in the order it checks
#: them (the manifest's description: a ValueError names the first whose pointer or strides are off)
CUDA_VECTOR_INPUTS = {"AttnPrologueFwdOp": ("qkv", "key_cache", "value_cache", "q_norm_weight", "k_norm_weight")}
#: inputs an op reads as one dense row and refuses strided, with a ValueError naming them, at the
#: call's checks (the prologue's per-head norm weights: AttnPrologueFwdHooks._check_more)
DENSE_INPUTS = {"AttnPrologueFwdOp": ("q_norm_weight", "k_norm_weight")}


def _rotary_choices(head_dim: int) -> list[int | None]:
    """The rotary widths drawn on a GPU: whole, and about half."""
    return [None, max(2, head_dim // 4 * 2)]


def _mrope_choices(head_dim: int) -> list[tuple[int, int, int]]:
    """The MRoPE sections drawn on a GPU (each section is its own kernel): one even, one uneven split
    of head_dim / 2 pairs; none below head_dim 6 (three sections of at least one pair)."""
    half = head_dim // 2
    if half < 3:
        return []
    return sorted({(half - 2 * (half // 3), half // 3, half // 3), (half - 2 * (half // 4), half // 4, half // 4)})


SETTINGS = settings(max_examples=EXAMPLES, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])

# Param values where the maths stays well conditioned; anything else falls back on its type.
_FLOATS = {"scale_factor": (0.1, 64.0), "low_freq_factor": (0.1, 16.0), "high_freq_factor": (0.1, 16.0),
           "scale": (0.1, 64.0), "beta_fast": (0.1, 128.0), "beta_slow": (0.1, 64.0), "attn_factor": (-4.0, 4.0),
           # an amplitude: the tolerances are for outputs of the inputs' size (97.5 left one element 5.7e-5 off)
           "attention_factor": (-4.0, 4.0),
           # a norm's: large enough to matter for rows near 0, small next to unit-variance rows
           "eps": (0.0, 0.01),
           # attention's: an absolute error d in a logit is a relative error d in its softmax weight, and
           # fp32's logit error grows with the logit (scale 23 at D 64 left an fp32 output 1.7e-4 off, past
           # the generic 2e-5); models use 1/sqrt(D) <= 0.125, tests/test_attn_fwd.py derives its own bound
           "softmax_scale": (0.01, 1.0)}
_INTS = {"original_max_position": (1, 2**20), "max_position_embeddings": (1, 2**20),
         "original_max_position_embeddings": (2, 2**20)}
_BASE = st.one_of(st.sampled_from([10000.0, 500000.0, 1e6, 2.0]), st.floats(0.05, 1e7))
#: the prologue's most kv heads, and q heads per kv head (Llama 3 70B: 8 and 8; Qwen3-235B-A22B: 4 and 16)
_KV_HEADS, _GROUP = 8, 16


def _pinned_dims(m, params: Mapping[str, Any]) -> dict[str, int]:
    """Dims a rule of the form ``dim == expr`` fixes, ``expr`` evaluated over ``params`` (MRoPE's
    ``streams == 3``; the prologue's ``width == (num_q_heads + 2 * num_kv_heads) * head_dim``,
    ``cache_dim == head_dim``): drawn as that value."""
    out = {}
    for r in m.rules:
        t = r.check.tree
        if t[0] == "cmp" and t[2] == ("==",) and t[1][0] == "name" and t[1][1] in m.dims:
            try:
                value = Expr("", t[3][0], frozenset()).evaluate(params)
            except ExprError:  # it names a dim or a dtype: the params do not fix it
                continue
            if isinstance(value, int) and not isinstance(value, bool):
                out[t[1][1]] = value
    return out


def _composed_ops(m, p) -> list[str]:
    """The ops op param ``p`` of ``m`` takes: those of its ``compose`` stage with a ``position_ids``
    input (the prologue's rope stage reads positions; its hooks refuse a rope op without them)."""
    stage = next(s for s in m.compose if s.param == p.name)
    return [n for n in stage.ops if any(t.name == "position_ids" for t in ALL[n].inputs)]


def _composed(m, params: Mapping[str, Any]) -> list[tuple[Any, dict[str, Any]]]:
    """``(manifest, params)`` of each op a spec's params compose (``{op: Name, params: {...}}``)."""
    return [(ALL[params[p.name]["op"]], params[p.name]["params"]) for p in m.params
            if p.type == "op" and isinstance(params.get(p.name), Mapping)]


def _index_range(m, t, params: Mapping[str, Any], dims: Mapping[str, Any]) -> tuple[int, int]:
    """``[low, high)`` of integer input ``t``: its manifest's range, within the range of every composed
    op's integer input (the prologue's positions below the rope op's own limit: max_position of
    RoPENeoxPositionIdsFwdOp, 2^24 for the others)."""
    low, high = (int(b.evaluate(dict(params) | dict(dims))) for b in t.range)
    for stage in m.compose:
        if t.name not in stage.inputs:
            continue
        for inner, inner_params in _composed(m, {k: v for k, v in params.items() if k == stage.param}):
            for u in inner.inputs:
                if u.range is not None:
                    lo, hi = (int(b.evaluate(inner.defaults() | inner_params)) for b in u.range)
                    low, high = max(low, lo), min(high, hi)
    return low, high


@dataclass
class Spec:
    op: str
    params: dict[str, Any]  # a composed op as {"op": name, "params": {...}}: see op_params
    dims: dict[str, int]
    dtype: str
    seed: int
    edges: dict[str, list[int]] = field(default_factory=dict)  # per integer input: values put first
    views: dict[str, str] = field(default_factory=dict)  # per input and output: see _as_view (else contiguous)
    mode: str = "new"  # how the op is called: see MODES and check_call
    passed: tuple[str, ...] = ()  # the inputs the call passes: see _passed

    def shape(self, t) -> list[int]:
        """The sizes of input ``t``: the longest of its shapes whose every dim is drawn (the prologue's
        positions are ``[streams, tokens]`` where its rope op pins streams, MRoPE's, else ``[tokens]``)."""
        alts = [a for a in t.shapes_for(self.params) if all(d == LEAD or d in self.dims for d in a)]
        out: list[int] = []
        for d in max(alts, key=len):
            out += list(self.dims.get(LEAD, ())) if d == LEAD else [self.dims[d]]
        return out

    def inputs(self) -> dict[str, Any]:
        """Fresh inputs from the seed: normal floats; integers uniform over their range (a ``distinct``
        one drawn without replacement), the edges first; those the op writes NaN-filled (an element it
        should not write shows); each laid out as its view says."""
        m, g = REGISTRY[self.op], torch.Generator().manual_seed(self.seed)
        out = {}
        for t in m.inputs:
            if t.name not in self.passed:
                continue
            shape = self.shape(t)
            if t.range is not None:
                low, high = _index_range(m, t, self.params, self.dims)
                edges = self.edges.get(t.name, [])[: math.prod(shape)]
                if t.distinct:
                    v = draw_distinct(low, high, shape, g, first=edges)
                else:
                    v = torch.randint(low, high, shape, generator=g, dtype=torch.int64)
                    v.view(-1)[: len(edges)] = torch.tensor(edges, dtype=torch.int64)
                v = v.to(DTYPES[self.dtype_of(t)])
            elif t.written:  # a cache of cache_dtype's (t.dtype_by), else the spec's dtype
                v = torch.full(shape, math.nan, dtype=DTYPES[t.case_dtype(self.dtype, self.params)])
            else:  # the spec's dtype, or the input's own where it allows only others (fp32 scales)
                v = torch.randn(shape, generator=g).to(DTYPES[t.case_dtype(self.dtype, self.params)])
            out[t.name] = self.lay_out(t.name, v.to(DEVICE))
        return out

    def lay_out(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """``t`` laid out as ``name``'s view says; on a GPU an input the kernel moves in 16-byte vectors
        is padded by a whole vector (3 elements would put every row but the first off them)."""
        vector = DEVICE != "cpu" and name in CUDA_VECTOR_INPUTS.get(self.op, ())
        return _as_view(t, self.views.get(name, "contiguous"), 16 // t.element_size() if vector else 3)

    def dtype_of(self, t) -> str:
        return self.params.get(f"__{t.name}_dtype", t.dtypes[-1])

    def op_params(self) -> dict[str, Any]:
        """The constructor's arguments: a composed op built (tileops.workloads.op_params)."""
        return op_params(REGISTRY[self.op], {k: v for k, v in self.params.items() if not k.startswith("__")})


VIEWS = ("contiguous", "padded", "offset", "every-other-row")


def _as_view(t: torch.Tensor, view: str, pad: int = 3) -> torch.Tensor:
    """The same values as ``t``, laid out as callers lay them out: a slice of a wider last dim (q
    and k split from one qkv tensor), one element past a 16-byte boundary, or every other row."""
    if view == "padded" and t.dim() > 1:
        wide = torch.zeros(*t.shape[:-1], t.shape[-1] + pad, dtype=t.dtype, device=t.device)
        wide[..., : t.shape[-1]] = t
        return wide[..., : t.shape[-1]]
    if view == "offset":
        buf = torch.zeros(t.numel() + 1, dtype=t.dtype, device=t.device)
        buf[1:] = t.reshape(-1)
        return buf[1:].view(t.shape)
    if view == "every-other-row" and t.dim() > 0:
        tall = torch.zeros(2 * t.shape[0], *t.shape[1:], dtype=t.dtype, device=t.device)
        tall[::2] = t
        return tall[::2]
    return t


def _applies(r, env) -> bool:
    """Whether rule ``r`` is checked for ``env``: the op checks a rule when the call has its dims (a
    rule about the dims of another layout is not)."""
    return r.check.names <= env.keys()


def _rules_hold(m, env, needs_dims: bool | None = None) -> bool:
    for r in m.rules:
        if (needs_dims is None or r.needs_dims == needs_dims) and _applies(r, env):
            try:
                if not r.check.evaluate(env):
                    return False
            except (ArithmeticError, TypeError, ValueError):  # a rule that cannot be evaluated fails
                return False
    return True


def _param(draw, m, p, head_dim: int, dtype: str) -> Any:
    if p.type == "dtype":
        # None (the inputs' dtype), that dtype named, or float8_e4m3fn (the prologue's caches, with
        # scales); not another float dtype: the rules refuse a cache of a third dtype (a bad input,
        # tests/test_attention_prologue.py::test_a_cache_dtype_other_than_qkvs_or_float8_is_refused)
        fp8 = ["float8_e4m3fn"] if "float8_e4m3fn" in (p.choices or ()) else []
        return draw(st.sampled_from([None, dtype, *fp8] if p.optional else [dtype, *fp8]))
    if p.choices is not None:
        return draw(st.sampled_from([*p.choices, *([None] if p.optional else [])]))
    if p.name == "head_dim":  # the prologue's: a param, drawn as the ops' head_dim dim
        return head_dim
    if p.name == "offset":  # compiled into a norm kernel: values exact in fp32 and in 7 digits
        return draw(st.sampled_from([0.0, 0.0, 1.0, 0.5]))
    if p.name == "base":
        return draw(_BASE)
    if p.name == "rotary_dim":
        if DEVICE != "cpu":
            return draw(st.sampled_from(_rotary_choices(head_dim)))
        return draw(st.one_of(st.none(), st.integers(1, head_dim // 2).map(lambda n: 2 * n)))
    if p.name == "mrope_section":  # three positive counts summing to head_dim / 2 (else the rule rejects it)
        assume(head_dim >= 6)  # the op's check: sum(mrope_section) == head_dim // 2
        if DEVICE != "cpu":  # only the sections compiled ahead (a new one would be a nvcc run mid-test)
            return draw(st.sampled_from(_mrope_choices(head_dim)))
        half = head_dim // 2
        a = draw(st.integers(1, half - 2))
        b = draw(st.integers(1, half - a - 1))
        return (a, b, half - a - b)
    if p.optional and p.default is None and draw(st.booleans()):  # Phi-3's attention_factor: HF's default
        return None
    if p.type == "float":
        return draw(st.floats(*_FLOATS.get(p.name, (0.1, 100.0))))
    if p.type == "int":
        return draw(st.integers(*_INTS.get(p.name, (1, 2**16))))
    if p.type == "bool":
        return draw(st.booleans())
    return p.default


def _factors(n: int):
    """A tensor param: one finite, non-zero divisor per rotated pair (LongRoPE's rescale_factors,
    Phi-3's short and long factors), or None (all ones)."""
    factors = st.one_of(st.floats(0.25, 64.0), st.floats(-4.0, -0.25))
    values = st.lists(factors, min_size=n, max_size=n).map(lambda v: torch.tensor(v, dtype=torch.float64))
    return st.one_of(st.none(), values)


def _params(draw, m, head_dim: int, dtype: str, max_elements: int, composed: str | None = None) -> dict[str, Any]:
    """Params of ``m`` for ``head_dim``: plain values first (:func:`_param`), then those that depend
    on them: max_position (capped by the rotated width), the per-pair factor tensors (one per pair of
    the rotated width), the prologue's heads (a qkv row of at most ``max_elements``) and a composed op
    (``{op, params}``, drawn as a spec of its own whose rules hold at this head_dim)."""
    later = {"max_position", "num_q_heads", "num_kv_heads"}
    params = {p.name: _param(draw, m, p, head_dim, dtype) for p in m.params
              if p.name not in later and p.type not in ("tensor", "op")}
    names = {p.name for p in m.params}
    for p in m.params:
        if p.type == "tensor":
            params[p.name] = draw(_factors((params.get("rotary_dim") or head_dim) // 2))
    if "max_position" in names:
        rot = params.get("rotary_dim") or head_dim
        cap = 2**24 if FULL else min(2**24, 2**28 // rot)
        params["max_position"] = draw(st.one_of(st.integers(1, cap), st.sampled_from([1, 2, 8192, cap])))
    if "num_kv_heads" in names:  # num_q_heads a multiple of it (the rule), qkv's row within the budget
        row = max(3, max_elements // head_dim)  # heads of head_dim in a row of max_elements
        hkv = draw(st.integers(1, max(1, min(_KV_HEADS, row // 3))))
        params["num_kv_heads"] = hkv
        params["num_q_heads"] = hkv * draw(st.integers(1, max(1, min(_GROUP, (row - 2 * hkv) // hkv))))
    for p in m.params:
        if p.type == "op":
            name = composed or draw(st.sampled_from(_composed_ops(m, p)))
            inner = ALL[name]
            inner_params = _params(draw, inner, head_dim, dtype, max_elements)
            # its rules at this head_dim: rotary_dim <= head_dim, NTK's rotated width >= 4
            assume(_rules_hold(inner, inner_params | {"head_dim": head_dim}))
            params[p.name] = {"op": name, "params": inner_params}
    return params


def _dims(draw, m, params, head_dim: int, max_elements: int) -> dict[str, Any]:
    # the dims kernels are compiled for (head_dim, a norm's hidden) and those the params fix first
    # (with a composed op's, where the op shares them: MRoPE's streams), then per input, longest
    # first, the small dims (heads, batch, block size) and what the budget leaves to the others
    # (lengths, blocks); leading dims ("...") last
    pinned = _pinned_dims(m, params)
    for inner, inner_params in _composed(m, params):
        pinned |= {d: v for d, v in _pinned_dims(inner, inner_params).items() if d in m.dims}
    dims: dict[str, Any] = {**{d: head_dim for d in m.kernel.specialize if d not in pinned}, **pinned}
    limits = {"heads": 80, "num_heads": 80, "key_heads": 80, "batch": 4, "block_size": 64}
    for t in sorted(m.inputs, key=lambda t: -len(t.shape_for(params))):
        shape = [d for d in t.shape_for(params) if d != LEAD]
        for d in sorted((d for d in shape if d not in dims), key=lambda d: d not in limits):
            room = max(1, max_elements // math.prod(dims[e] for e in shape if e in dims))
            dims[d] = draw(st.integers(1, min(limits.get(d, room), room)))
    if any(t.leading for t in m.inputs):
        lead = []
        for _ in range(draw(st.integers(0, 3))):
            room = max(1, max_elements // math.prod([*lead, *(v for v in dims.values() if isinstance(v, int))]))
            lead.append(draw(st.integers(1, min(room, 40))))
        dims[LEAD] = tuple(lead)
    return dims


def _passed(m, params, dims, dtype_of) -> tuple[str, ...] | None:
    """The inputs a call passes: every required one and the largest set of optional ones the rules
    allow with their dtypes (``dtype_<input>``, None for one not passed), an input ``like`` another
    only with it: RoPE's position_ids and key and the norms' residual always; the prologue's norm
    weights with qk_norm only, its fp8 scales with a float8 cache only. None when no set is allowed."""
    optional = [t for t in m.inputs if t.optional]
    required = {t.name for t in m.inputs if not t.optional}
    for k in range(len(optional), -1, -1):
        for combo in itertools.combinations(optional, k):
            names = required | {t.name for t in combo}
            if any(t.like is not None and t.like not in names for t in combo):
                continue
            env = params | dims | {f"dtype_{t.name}": dtype_of(t) if t.name in names else None for t in m.inputs}
            if _rules_hold(m, env):
                return tuple(t.name for t in m.inputs if t.name in names)
    return None


@st.composite
def valid_specs(draw, max_elements: int = MAX_ELEMENTS, ops: tuple[str, ...] = tuple(sorted(REGISTRY)),
                composed: str | None = None) -> Spec:
    """A valid spec of one of ``ops``; ``composed``: the op its op param takes (else any its stage takes)."""
    name = draw(st.sampled_from(ops))
    m = REGISTRY[name]
    head_dim = draw(HEAD_DIMS)
    dtype = draw(st.sampled_from(m.inputs[0].dtypes))
    params = _params(draw, m, head_dim, dtype, max_elements, composed)
    dims = _dims(draw, m, params, head_dim, max_elements)
    assume(_rules_hold(m, params | dims))  # e.g. low_freq_factor == high_freq_factor: rare
    edges: dict[str, list[int]] = {}
    for t in m.inputs:  # integer inputs: a dtype, and a few values at or near the ends of the range
        if t.range is not None:
            params[f"__{t.name}_dtype"] = draw(st.sampled_from(t.dtypes))
            low, high = _index_range(m, t, params, dims)
            edge = st.one_of(st.sampled_from([low, high - 1]), st.integers(low, high - 1))
            # a distinct input (a slot mapping) names a non-negative value once: its edges too (the
            # negative padding value may repeat)
            unique = (lambda v: v if v >= 0 else object()) if t.distinct else None
            edges[t.name] = draw(st.lists(edge, max_size=4, unique_by=unique))
    passed = _passed(m, params, dims, lambda t: params.get(f"__{t.name}_dtype", dtype) if t.range else
                     t.case_dtype(dtype, params))
    assume(passed is not None)
    views: dict[str, str] = {}
    for t in m.inputs:  # an input like another is laid out as it is (the op wants the caches' strides equal)
        if t.name in passed:
            views[t.name] = views[t.like] if t.like in views else draw(st.sampled_from(VIEWS))
    for o in m.outputs:  # out= tensors (NaN-filled in the out mode)
        views[o.name] = draw(st.sampled_from(VIEWS))
    # in place needs an output shaped like its input (the prologue's q is not); backward a manifest
    # that declares one (the prologue does not)
    modes = [md for md in MODES if (md != "backward" or m.backward)
             and (md != "in-place" or not any(o.own_shape for o in m.outputs))]
    return Spec(name, params, dims, dtype, draw(st.integers(0, 2**32 - 1)), edges, views, draw(st.sampled_from(modes)),
                passed)


def _gpu_params(m, head_dim: int) -> list[dict[str, Any]]:
    """Every set of params whose kernels the GPU draws of ``m`` at ``head_dim`` can need: each choice
    and bool param's values (a dtype param only None: the valid draws give it qkv's dtype or None, one
    kernel), the rotary widths and MRoPE sections drawn on a GPU, the prologue's head_dim, and for an
    op param every op its stage takes with each of its own sets; only sets whose rules hold at
    head_dim, as the draws' (NTK's rotated width of 2 at head_dim 2 has no kernel: its spec refuses it)."""
    names = {p.name for p in m.params}
    axes = [[(p.name, c) for c in ((None,) if p.type == "dtype" else (*p.choices, *([None] if p.optional else [])))]
            for p in m.params if p.choices is not None]
    axes += [[(p.name, False), (p.name, True)] for p in m.params if p.type == "bool"]
    if "rotary_dim" in names:
        axes.append([("rotary_dim", r) for r in _rotary_choices(head_dim)])
    if "mrope_section" in names:  # none below head_dim 6: no kernel (the draws reject those)
        axes.append([("mrope_section", s) for s in _mrope_choices(head_dim)])
    if "head_dim" in names:
        axes.append([("head_dim", head_dim)])
    for p in m.params:
        if p.type == "op":
            axes.append([(p.name, {"op": n, "params": inner}) for n in _composed_ops(m, p)
                         for inner in _gpu_params(ALL[n], head_dim)])
    sets = (dict(combo) for combo in itertools.product(*axes))
    return [c for c in sets if _rules_hold(m, c | {"head_dim": head_dim})]


@pytest.fixture(scope="module", autouse=True)
def _gpu_kernels():
    """On a GPU, every kernel the draws can need, compiled first in parallel (see the module doc)."""
    if DEVICE == "cpu":
        return
    from tileops.compile.warmup import compile_jobs, op_kernel_jobs

    jobs = []
    for name, m in REGISTRY.items():
        base = m.defaults() | dict(m.cases[0].params)
        for head_dim in GPU_HEAD_DIMS:
            for params in _gpu_params(m, head_dim):
                jobs += [j for j in op_kernel_jobs(name, base | params, {d: head_dim for d in m.kernel.specialize},
                                                   m.inputs[0].dtypes, "sm_90", every_index_dtype=True)
                         # the head-major kernel serves 8192+ tokens, more than MAX_ELEMENTS allows
                         if not getattr(j[1], "transposed", False)]
    n, seconds, failures = compile_jobs(list(dict.fromkeys(jobs)))
    print(f"\nfuzz: {n} kernels ready in {seconds:.0f} s")
    assert not failures, failures[:3]


def _events(spec: Spec) -> None:
    event(f"dtype: {spec.dtype}")
    event(f"views: {', '.join(sorted(set(spec.views.values())))}")
    event(f"mode: {spec.mode}")
    m = REGISTRY[spec.op]
    for p in m.params:  # the choices a kernel or a layout depends on (qk_norm, cache_layout, rope_layout)
        if p.choices is not None or p.type == "bool":
            event(f"{p.name}: {spec.params.get(p.name)}")
    for inner, inner_params in _composed(m, spec.params):
        partial = inner_params.get("rotary_dim") is not None
        event(f"composed: {inner.name}{' partial' if partial else ''}")
        for p in inner.params:
            if p.choices is not None or p.type == "bool":
                event(f"composed {p.name}: {inner_params.get(p.name)}")


#: examples of each op's hypothesis run (every op gets its share)
SHARE = max(4, -(-EXAMPLES // len(REGISTRY)))
#: (op, the op its op param takes) of the ops that compose one (the prologue's rope): a run each,
#: sharing the op's share, since hypothesis favours the first choices of sampled_from (a run of 22
#: prologue examples drew 5 of the 9 rope ops, one of them 12 times)
COMPOSED_RUNS = [(n, c) for n, m in sorted(REGISTRY.items()) for p in m.params if p.type == "op"
                 for c in _composed_ops(m, p)]
#: at least 2: the first example hypothesis generates is the simplest (head_dim 2, one token), the
#: same every run
COMPOSED_EXAMPLES = max(2, -(-SHARE // max(Counter(n for n, _ in COMPOSED_RUNS).values(), default=1)))


def _check_valid(data, op_name: str, composed: str | None = None) -> None:
    spec = data.draw(valid_specs(ops=(op_name,), composed=composed), label="spec")
    _events(spec)
    check_call(op_class(spec.op)(**spec.op_params(), target="builtin"), spec)


@pytest.mark.parametrize("op_name", sorted(set(REGISTRY) - {n for n, _ in COMPOSED_RUNS}))
@settings(SETTINGS, max_examples=SHARE)
@given(data=st.data())
def test_valid_specs_match_the_reference(op_name, data):
    # One hypothesis run per op, so that every op gets its share of the examples.
    _check_valid(data, op_name)


@pytest.mark.parametrize("op_name,composed", [pytest.param(n, c, id=f"{n}-{c}") for n, c in COMPOSED_RUNS])
@settings(SETTINGS, max_examples=COMPOSED_EXAMPLES)
@given(data=st.data())
def test_valid_composed_specs_match_the_reference(op_name, composed, data):
    # One hypothesis run per op a composed op may take (see COMPOSED_RUNS).
    _check_valid(data, op_name, composed)


def _head_dim(m, spec: Spec) -> int:
    """The head_dim a spec was drawn at: the prologue's param, else the first dim kernels are
    compiled for (0 for none)."""
    if "head_dim" in spec.params:
        return spec.params["head_dim"]
    return spec.dims[m.kernel.specialize[0]] if m.kernel.specialize else 0


@st.composite
def call_sequences(draw) -> list[Spec]:
    """A spec, then 1..3 more calls of the same op: new lengths and heads (new caches for the
    prologue), now and then a new dtype (not where a dtype param names the caches' dtype)."""
    spec = draw(valid_specs())
    event(f"op: {spec.op}")
    m = REGISTRY[spec.op]
    pinned = any(p.type == "dtype" and spec.params.get(p.name) is not None for p in m.params)
    later = []
    for _ in range(draw(st.integers(1, 3))):
        dims = _dims(draw, m, spec.params, _head_dim(m, spec), MAX_ELEMENTS)
        dtype = spec.dtype if pinned else draw(st.sampled_from([spec.dtype] * 3 + list(m.inputs[0].dtypes)))
        later.append(replace(spec, dims=dims, dtype=dtype, seed=draw(st.integers(0, 2**32 - 1)), edges={}))
    return [spec, *later]


@settings(SETTINGS, max_examples=max(10, EXAMPLES // 2))
@given(specs=call_sequences())
def test_one_op_serves_many_calls(specs):
    # One op object, called with longer and shorter inputs (its cos/sin tables grow) and other dtypes
    # (a second kernel): every call must still match the reference.
    op = op_class(specs[0].op)(**specs[0].op_params(), target="builtin")
    state = {}
    for spec in specs:
        check_call(op, spec, state)


def _dynamic_ntk_length(params: dict, inputs: dict, state: dict) -> int:
    """HF's dynamic NTK keeps the longest length seen (back to max_position_embeddings when a call is
    shorter): the length this call rotates with, the op's history followed here, independently."""
    mpe = params.get("max_position_embeddings", 2048)
    seq = int(inputs["position_ids"].max()) + 1
    cached = state.get("ntk", mpe)
    cached = seq if seq > cached else (mpe if seq < mpe else cached)
    state["ntk"] = cached
    return cached


def _refused_layout(op, spec: Spec, inputs: Mapping[str, Any]) -> str | None:
    """The input whose drawn layout the op refuses, with a ValueError naming it before any kernel
    runs, or None: a dense-row input strided (the prologue's norm weights), else on a GPU an input
    moved in 16-byte vectors where it lies, one element off a vector (the ``offset`` view), when the
    kernel's unit is more than one element (its ``stride_unit``: 16 bytes, narrower where head_dim
    or the rotated half-width is)."""
    for name in DENSE_INPUTS.get(spec.op, ()):
        if name in inputs and inputs[name].stride(-1) != 1:
            return name
    if DEVICE == "cpu" or spec.op not in CUDA_VECTOR_INPUTS:
        return None
    from tileops.attention.hooks import kernel_spec

    unit = kernel_spec(op.manifest, op.params, spec.dtype, str(inputs["positions"].dtype).replace("torch.", ""),
                       str(inputs["slot_mapping"].dtype).replace("torch.", ""), "cuda").stride_unit
    return next((n for n in CUDA_VECTOR_INPUTS[spec.op] if n in inputs and spec.views.get(n) == "offset"
                 and unit > 1), None)


def check_call(op, spec: Spec, state: dict | None = None) -> None:
    """Every input the spec passes (position_ids and key too), in the spec's mode: the outputs (and in
    backward mode the gradients of x and key) against the reference, the inputs the op writes (the
    prologue's caches) against the reference's state after the call, every other input unchanged."""
    inputs = spec.inputs()
    before = {k: v.clone() for k, v in inputs.items()}
    params = spec.op_params()
    note(f"op: {op!r}")
    if spec.op == "RoPEDynamicNTKFwdOp":  # stateful: the reference is told the length the op has seen
        params = {**params, "max_position_id": _dynamic_ntk_length(params, inputs, {} if state is None else state) - 1}
    m = REGISTRY[spec.op]
    specs = [o for o in m.outputs if o.like in inputs]
    dtypes = {o.name: family_references.output_dtype(m, params, o.name, inputs) for o in specs}
    shapes = {o.name: family_references.output_shape(m, params, o.name, spec.dims) or inputs[o.like].shape
              for o in specs}
    given_outs: dict[str, torch.Tensor] = {}
    leaves: dict[str, torch.Tensor] = {}
    mode = spec.mode
    if mode == "in-place" and any(dtypes[o.name] != inputs[o.like].dtype for o in specs):
        mode = "out"  # an output of another dtype (out_dtype) cannot be its input
    if mode == "out":  # NaN-filled, laid out as drawn: an unwritten element shows
        for o in specs:
            given_outs[o.name] = spec.lay_out(o.name, torch.full(shapes[o.name], math.nan, dtype=dtypes[o.name],
                                                                 device=inputs[o.like].device))
    elif mode == "in-place":
        given_outs = {o.name: inputs[o.like] for o in specs}
    elif mode == "backward":
        leaves = {n: inputs[n].detach().clone().requires_grad_(True) for n in m.backward.wrt if n in inputs}
    refused = _refused_layout(op, spec, inputs)
    if refused is not None:
        with pytest.raises(ValueError) as info:
            op(**{**inputs, **leaves}, **given_outs)
            op.check()
        msg = str(info.value)
        note(msg)
        assert re.search(rf"(?<![\w.]){re.escape(refused)}(?!\w)", msg), f"the error does not name {refused}: {msg}"
        assert all(_same_bits(inputs[k], before[k]) for k in inputs), "an input changed before the refusal"
        return
    result = op(**{**inputs, **leaves}, **given_outs)
    op.check()  # on a GPU a bad position would be reported here; none is drawn
    outs = result if isinstance(result, tuple) else (result,)
    assert len(outs) == len(specs)
    changed = {o.like for o in specs} if mode == "in-place" else set()
    written = {t.name for t in m.inputs if t.written and t.name in inputs}
    unchanged = [k for k in inputs if k not in changed | written and not torch.equal(inputs[k], before[k])]
    assert not unchanged, f"inputs modified: {unchanged}"
    cpu = {k: v.cpu() for k, v in before.items()}
    refs = family_references.outputs(m, params, cpu)
    scales = family_references.scales(m, params, cpu)
    for o, out in zip(specs, outs):
        assert (out.shape, out.dtype) == (shapes[o.name], dtypes[o.name])
        if o.name in given_outs:
            assert out is given_outs[o.name]  # written where it was asked
        else:
            assert out.untyped_storage().data_ptr() != inputs[o.like].untyped_storage().data_ptr()  # a new tensor
        _assert_matches(out, refs[o.name], spec.dtype, o.name, scales.get(o.name))
    for name, ref in family_references.written(m, params, cpu).items():  # a float8 cache at e4m3's precision
        tol = "float8_e4m3fn" if inputs[name].dtype == torch.float8_e4m3fn else spec.dtype
        _assert_matches(inputs[name], ref, tol, name, scales.get(name), before=cpu[name])
    if leaves:
        assert all(out.grad_fn is not None for out in outs)
        g = torch.Generator().manual_seed(spec.seed ^ 0x5EED)
        grads_out = [torch.randn(out.shape, generator=g).to(out.dtype).to(out.device) for out in outs]
        got = torch.autograd.grad(outs, list(leaves.values()), grads_out)
        gouts = {o.name: g.cpu() for o, g in zip(specs, grads_out)}
        refs = family_references.grads(m, params, cpu, list(leaves), gouts)
        gscales = family_references.grad_scales(m, params, cpu, list(leaves), gouts)
        for (n, leaf), gr in zip(leaves.items(), got):
            assert (gr.shape, gr.dtype) == (leaf.shape, leaf.dtype)
            _assert_matches(gr, refs[n], spec.dtype, f"grad of {n}", gscales.get(n))


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to the bit (NaN included)."""
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(_BITS[a.element_size()]),
                                                                     b.view(_BITS[b.element_size()]))


def _assert_matches(got: torch.Tensor, ref: torch.Tensor, dtype: str, what: str, scale: torch.Tensor | None = None,
                    before: torch.Tensor | None = None) -> None:
    """``|got - ref| <= atol + rtol * scale``, ``scale`` the reference's own magnitude unless the
    family's reference gives another (:func:`family_references.scales`,
    :func:`family_references.grad_scales`). For an input written in place, ``before`` is its
    NaN-filled state: where the reference keeps that NaN (nothing written there), ``got`` must keep
    its bits. Where an output's definition is undefined, the reference's NaN (0 / 0:
    LayerNorm of a row whose elements round to one value, with eps 0), ``got`` must be NaN too, as
    torch's layer_norm gives."""
    got = got.detach().cpu()
    keep = torch.isnan(ref)
    if before is not None:
        bits = _BITS[got.element_size()]
        moved = keep & (got.contiguous().view(bits) != before.contiguous().view(bits))
        assert not bool(moved.any()), (f"{what}: {int(moved.sum())} elements the call must not write changed, first "
                                       f"at {moved.nonzero()[0].tolist()}")
    else:
        defined = ~torch.isnan(got.double()[keep])
        assert not bool(defined.any()), f"{what}: {int(defined.sum())} elements the definition leaves undefined (NaN)"
    got = got.double()
    assert bool(torch.isfinite(got[~keep]).all()), f"{what}: non-finite elements"
    err = (got - ref).abs()
    atol, rtol = TOLERANCES[dtype]
    bad = ~keep & (err > atol + rtol * (ref.abs() if scale is None else scale))
    note(f"{what}: max err {err[~keep].max().item() if bool((~keep).any()) else 0:.3g}")
    if bool(bad.any()):
        i = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} elements off, first at {list(i)}: got "
                             f"{got[i].item()}, want {ref[i].item()}")


# --------------------------------------------------------------------------- invalid specs

_OTHER_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int16,
                 torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64]
_WRONG_TYPES = {"int": st.one_of(st.floats(), st.text(max_size=4), st.booleans()),  # 8.0 is no int either
                "float": st.one_of(st.text(max_size=4), st.booleans(), st.complex_numbers(allow_nan=False)),
                "str": st.one_of(st.integers(), st.floats(allow_nan=False), st.booleans()),
                "bool": st.one_of(st.integers(), st.text(max_size=4)),
                "tensor": st.one_of(st.floats(allow_nan=False), st.text(max_size=4), st.integers()),
                "ints": st.one_of(st.integers(), st.text(max_size=4), st.lists(st.floats(allow_nan=False), min_size=1,
                                                                               max_size=3)),
                # a str names a dtype ("float16"): not a wrong type
                "dtype": st.one_of(st.integers(), st.floats(allow_nan=False), st.booleans(), st.just([torch.float16])),
                # a name or a case's {op: ...} is not an op object, nor is an op of another family
                "op": st.one_of(st.text(max_size=4), st.integers(), st.just({"op": "RoPEFwdOp"}),
                                st.builds(lambda: op_class("RMSNormFwdOp")()))}


def _violated(m, env) -> list:
    out = []
    for r in sorted(m.rules, key=lambda r: r.needs_dims):  # construction-time rules are checked first
        if not _applies(r, env):
            continue
        try:
            ok = r.check.evaluate(env)
        except (ArithmeticError, TypeError, ValueError):  # a rule that cannot be evaluated fails
            ok = False
        if not ok:
            out.append(r)
    return out


# kind of mistake -> which manifests it applies to
_KINDS = {
    "param-type": lambda m: bool(m.params), "input-dtype": lambda m: True, "input-rank": lambda m: True,
    "input-type": lambda m: True, "target": lambda m: True,
    # head_dim as a dim (the prologue's is a param: its rules about dims are qkv's and the caches', which
    # the input-rank and param-rule kinds and tests/test_bad_inputs.py break)
    "dim-rule": lambda m: "head_dim" in m.dims and any(r.needs_dims and "head_dim" in r.check.names for r in m.rules),
    "param-nonfinite": lambda m: any(p.type == "float" for p in m.params),
    "param-choice": lambda m: any(p.choices for p in m.params),
    "param-rule": lambda m: any(not r.needs_dims for r in m.rules),
    "input-range": lambda m: any(t.range is not None for t in m.inputs),
    "tensor-param": lambda m: any(p.type == "tensor" for p in m.params),
}


@st.composite
def invalid_specs(draw, kind: str):
    """(spec, what to change, expected exception type, name the message must contain, or names one of
    which it must contain)."""
    ops = tuple(n for n in sorted(REGISTRY) if _KINDS[kind](REGISTRY[n]))
    spec = _accepted_layouts(draw(valid_specs(max_elements=2000, ops=ops)))
    m = REGISTRY[spec.op]
    params = spec.op_params()
    event(f"invalid: {kind}")
    if kind.startswith("param") or kind == "tensor-param":
        pool = {"param-type": m.params, "param-nonfinite": [p for p in m.params if p.type == "float"],
                "param-choice": [p for p in m.params if p.choices], "tensor-param": [p for p in m.params if p.type == "tensor"],
                "param-rule": [p for p in m.params if any(p.name in r.check.names and not r.needs_dims for r in m.rules)]}[kind]
        p = draw(st.sampled_from(pool))
        if kind == "param-type":
            return spec, {"param": (p.name, draw(_WRONG_TYPES[p.type]))}, TypeError, p.name
        if kind == "param-nonfinite":
            return spec, {"param": (p.name, draw(st.sampled_from([math.nan, math.inf, -math.inf])))}, ValueError, p.name
        if kind == "param-choice":
            bad = draw(st.text(max_size=8).filter(lambda s: s not in p.choices))
            return spec, {"param": (p.name, bad)}, ValueError, p.name
        if kind == "tensor-param":
            # the factors' length the op expects: one per rotated pair (rotary_dim // 2 where the op
            # has a rotary_dim, as Phi-3's factors do; head_dim // 2 otherwise)
            n = (spec.params.get("rotary_dim") or spec.dims["head_dim"]) // 2
            length = draw(st.integers(0, 2 * n + 2).filter(lambda k: k != n))
            vals = torch.ones(length, dtype=torch.float64)
            if draw(st.booleans()):  # a bad value instead of a bad length
                vals = torch.ones(n, dtype=torch.float64)
                vals[draw(st.integers(0, n - 1))] = draw(st.sampled_from([0.0, math.nan, math.inf, -math.inf]))
            return spec, {"param": (p.name, vals)}, ValueError, p.name
        number = st.one_of(st.integers(-2**40, 2**40), st.sampled_from([0, -1, 1, 2**31, 2**31 - 1]),
                           st.sampled_from([v for v in params.values() if isinstance(v, (int, float))] or [0]))
        value = draw(number.map(float if p.type == "float" else int))
        rules = _violated(m, params | spec.dims | {p.name: value})
        assume(rules)
        if p.name == "head_dim" and rules[0].needs_dims and _composed(m, spec.params):
            # a head_dim the construction rules allow: the composed op may not fit it (the rope's
            # rotated width, MRoPE's sections, LongRoPE's factors), refused naming that param first
            return spec, {"param": (p.name, value)}, ValueError, (rules[0].arg, *(q.name for q in m.params
                                                                                  if q.type == "op"))
        return spec, {"param": (p.name, value)}, ValueError, rules[0].arg
    if kind == "target":
        name = draw(st.text(min_size=1, max_size=8).filter(lambda s: s not in target_names()))
        return spec, {"target": name}, ValueError, "target"
    t = draw(st.sampled_from([t for t in m.inputs if t.name in spec.passed]))
    if kind == "input-dtype":
        allowed = {DTYPES[d] for d in t.dtypes}
        return spec, {"dtype": (t.name, draw(st.sampled_from([d for d in _OTHER_DTYPES if d not in allowed])))}, TypeError, t.name
    if kind == "input-rank":
        rank = len(spec.shape(t))
        if t.like is not None:  # exactly the other input's shape: any other rank is wrong
            return spec, {"rank": (t.name, draw(st.sampled_from([-1, 1, 2])))}, ValueError, t.name
        if t.leading:  # any number of leading dims: only fewer dims than the named ones is wrong
            return spec, {"rank": (t.name, len(t.shape_for(params)) - 2 - rank)}, ValueError, t.name
        ok = {len(a) for a in t.shapes_for(params)}  # alternative shapes are not mistakes
        delta = draw(st.sampled_from([d for d in (-1, 1, 2) if rank + d not in ok]))
        return spec, {"rank": (t.name, delta)}, ValueError, t.name
    if kind == "input-type":
        bad = draw(st.one_of(st.none().filter(lambda _: not t.optional), st.integers(), st.floats(), st.text(max_size=3), st.tuples(st.integers()),
                             st.lists(st.floats(), max_size=3), st.just(spec.inputs()[t.name].tolist()),
                             st.just(spec.inputs()[t.name].float().cpu().numpy())))  # numpy has no bf16
        return spec, {"value": (t.name, bad)}, TypeError, t.name
    if kind == "input-range":
        t = draw(st.sampled_from([t for t in m.inputs if t.range is not None and t.name in spec.passed]))
        low, high = _index_range(m, t, spec.params, spec.dims)
        info = torch.iinfo(DTYPES[spec.dtype_of(t)])
        above = st.integers(high, max(high, info.max))
        # a range from a negative value names padding (the prologue's slot -1): every negative value
        # is padding, skipped, so only values above the range are mistakes
        bad = draw(above if low < 0 else st.one_of(st.integers(info.min, low - 1), above))
        shape = spec.shape(t)
        i = draw(st.integers(0, math.prod(shape) - 1))
        index = ", ".join(str(int(j)) for j in torch.unravel_index(torch.tensor(i), shape))
        return spec, {"position": (t.name, i, bad)}, ValueError, f"{t.name}[{index}]"
    # dim-rule: a head_dim that breaks a rule about dims (odd, or above the limit)
    hd = draw(st.one_of(st.integers(1, 1100), st.integers(1025, 4096)))
    rules = _violated(m, params | spec.dims | {"head_dim": hd})
    assume(rules)
    dims = {d: 1 for d in spec.dims} | {"head_dim": hd}
    return replace(spec, dims=dims, edges={}), {}, ValueError, rules[0].arg


@pytest.mark.parametrize("mistake", sorted(_KINDS))
def test_invalid_specs_fail_clearly(mistake):
    # One hypothesis run per kind of mistake: drawing the kind inside would leave some kinds untried
    # in a short run (hypothesis favours the first choices of sampled_from).
    settings(SETTINGS, max_examples=max(5, EXAMPLES // 4))(given(case=invalid_specs(mistake))(check_invalid))()


def _accepted_layouts(spec: Spec) -> Spec:
    """``spec`` with contiguous inputs where the op would refuse the drawn layout (see
    :func:`_refused_layout`): a mistake drawn on top must be the one reported."""
    refusable = {n: "every-other-row" for n in DENSE_INPUTS.get(spec.op, ())}
    if DEVICE != "cpu":
        refusable |= {n: "offset" for n in CUDA_VECTOR_INPUTS.get(spec.op, ())}
    views = {n: "contiguous" if refusable.get(n) == v else v for n, v in spec.views.items()}
    return replace(spec, views=views)


def check_invalid(case):
    spec, change, kind, names = case
    names = (names,) if isinstance(names, str) else names
    m = REGISTRY[spec.op]
    params = spec.op_params()
    if "param" in change:
        params[change["param"][0]] = change["param"][1]
    inputs = spec.inputs()
    if "dtype" in change:
        arg, dt = change["dtype"]
        inputs[arg] = inputs[arg].to(dt)
    if "rank" in change:
        arg, delta = change["rank"]
        t = inputs[arg]
        inputs[arg] = t.reshape(*([1] * delta), *t.shape) if delta > 0 else t[(0,) * -delta]  # the first dims dropped
    if "value" in change:
        inputs[change["value"][0]] = change["value"][1]
    if "position" in change:
        arg, i, bad = change["position"]
        t = inputs[arg]  # the only value out of range: the error must name its index
        t[tuple(int(j) for j in torch.unravel_index(torch.tensor(i), t.shape))] = bad
    with pytest.raises((TypeError, ValueError)) as info:
        op = op_class(spec.op)(**params, target=change.get("target", "builtin"))
        op(**inputs)
        op.check()  # on a GPU, a bad position is reported here (no host sync at the call)
    msg = str(info.value)
    note(msg)
    assert isinstance(info.value, kind), msg
    assert any(re.search(rf"(?<![\w.]){re.escape(n)}(?!\w)", msg) for n in names), \
        f"the error does not name {' or '.join(names)}: {msg}"
    assert m.name in msg or names == ("target",), msg
