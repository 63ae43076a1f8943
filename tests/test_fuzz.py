"""Hypothesis fuzzing of every op: random valid specs against the float64 reference, and random
invalid specs that must fail with a clear error.

A valid spec is an op, params within its rules, dims (lengths from 1, 1..80 heads, batch 1..4, an
even head_dim, and 0 to 3 leading dims where a shape starts with ``"..."``: the norms' rows), a dtype,
and inputs laid out contiguously or not (a slice of a wider last dim, one
element off a 16-byte boundary, every other row); the largest input holds at most ``MAX_ELEMENTS``
(20k) elements, so an example takes milliseconds once its kernel exists. Positions of the
position-ids op lie anywhere in ``[0, max_position)``, the ends drawn on purpose. Specs run through
the BUILTIN kernels on the CPU (TileLang's C backend), one call per op, and also several calls of
one op (new lengths, now and then a new dtype). Invalid specs are drawn per kind of mistake (wrong
param type, non-finite float, value outside choices, broken rule, wrong input dtype/rank/type,
position out of range, bad rescale factors, unknown target), each a separate pytest item.

Each valid spec is called in one of four modes: new outputs, ``out=`` into NaN-filled tensors laid
out like the inputs (so an element the kernel skips shows), in place (``out=x``, ``key_out=key``),
or backward (gradients of x and key against float64 autograd of the reference).

Cost and knobs:

* Every new (dtype, head_dim, rotary width, pairing, layout, position dtype, direction) compiles a
  kernel, about 1.5 s on the CPU (then cached in memory and on disk by TileLang). With the default
  ``max_examples`` (4 per op for the valid test, 20 for the many-calls one, 10 per kind of mistake)
  head_dim is drawn from a small set, ``SMALL_HEAD_DIMS``, so the default run takes about a minute.
  Every dim a manifest compiles kernels for (``kernel.specialize``: RoPE's head_dim, the norms'
  hidden) is drawn from that set.
* ``TILEOPS_FUZZ_EXAMPLES=N`` sets ``max_examples`` to N in all (N / ops per op for the valid
  test; N/2, N/4 for the others); ``TILEOPS_FUZZ_WIDE=1`` draws head_dim from every even value in
  2..512, so most examples compile a kernel: about 2.5 minutes for N=300 here.
* Every test here is marked ``slow``, so run the module as ``python -m pytest -m slow tests/test_fuzz.py``.
* ``TILEOPS_FUZZ_DEVICE=cuda`` runs the specs on the GPU (``python -m pytest -m slow tests/test_fuzz.py``
  with ``TILEOPS_FUZZ_EXAMPLES=2000`` is issue 12's GPU fuzz run). There head_dim comes from
  ``GPU_HEAD_DIMS`` and the rotary width from three choices, and every kernel those draws can need
  is compiled first, in parallel processes (:func:`tileops.compile.warmup.compile_jobs`): nvcc takes
  seconds a kernel, the examples themselves milliseconds.
* ``max_position`` is drawn up to the manifest's cap, 2**24 (``2**28 // rotary_dim`` by default).

Run with ``--hypothesis-show-statistics`` to see how examples spread over ops, dtypes and layouts.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, event, given, note, settings
from hypothesis import strategies as st

from tileops import target_names
from tileops.manifest import registry, tensor_shape
from tileops.manifest.schema import LEAD
from tileops.testing import TOLERANCES
from tileops.workloads import DTYPES, op_class

try:  # pytest puts tests/ on sys.path when it is not a package, the repo root when it is
    import family_references
except ImportError:  # pragma: no cover
    from tests import family_references

# Every test here is a hypothesis run (kernels compiled as draws need them: about a minute with the
# defaults on a free 2-core machine), so the module is deselected by default: `-m slow` runs it.
pytestmark = pytest.mark.slow

#: ops the fuzzer does not draw yet, and why (their own tests cover them meanwhile)
NOT_FUZZED = {"AttnPrologueFwdOp": "an op param (the rope object) and inputs written in place (the caches) are not "
                                   "drawn yet; tests/test_attention_prologue.py and the generated tests cover it"}
REGISTRY = {n: m for n, m in registry().items() if n not in NOT_FUZZED}
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
           "eps": (0.0, 0.01)}
_INTS = {"original_max_position": (1, 2**20), "max_position_embeddings": (1, 2**20),
         "original_max_position_embeddings": (2, 2**20)}
_BASE = st.one_of(st.sampled_from([10000.0, 500000.0, 1e6, 2.0]), st.floats(0.05, 1e7))


def _pinned_dims(m) -> dict[str, int]:
    """Dims a rule of the form ``dim == N`` fixes (MRoPE's ``streams == 3``): drawn as N."""
    dims = m.dims
    out = {}
    for r in m.rules:
        t = r.check.tree
        if (t[0] == "cmp" and t[2] == ("==",) and t[1][0] == "name" and t[1][1] in dims
                and t[3][0][0] == "lit" and isinstance(t[3][0][1], int)):
            out[t[1][1]] = t[3][0][1]
    return out


@dataclass
class Spec:
    op: str
    params: dict[str, Any]
    dims: dict[str, int]
    dtype: str
    seed: int
    edges: list[int] = field(default_factory=list)  # positions put first, so the ends get drawn
    view: str = "contiguous"  # how inputs are laid out in memory: see _as_view
    mode: str = "new"  # how the op is called: see MODES and check_call

    def inputs(self) -> dict[str, Any]:
        m, g = REGISTRY[self.op], torch.Generator().manual_seed(self.seed)
        env = self.params | self.dims
        out = {}
        for t in m.inputs:
            shape = tensor_shape(t, self.params, self.dims)
            if t.range is not None:
                low, high = (int(b.evaluate(env)) for b in t.range)
                v = torch.randint(low, high, shape, generator=g, dtype=torch.int64)
                v.view(-1)[: len(self.edges)] = torch.tensor(self.edges[: v.numel()], dtype=torch.int64)
                out[t.name] = _as_view(v.to(DTYPES[self.dtype_of(t)]).to(DEVICE), self.view)
            else:
                out[t.name] = _as_view(torch.randn(shape, generator=g).to(DTYPES[self.dtype]).to(DEVICE), self.view)
        return out

    def dtype_of(self, t) -> str:
        return self.params.get(f"__{t.name}_dtype", t.dtypes[-1])

    def op_params(self) -> dict[str, Any]:
        return {k: v for k, v in self.params.items() if not k.startswith("__")}


VIEWS = ("contiguous", "padded", "offset", "every-other-row")


def _as_view(t: torch.Tensor, view: str) -> torch.Tensor:
    """The same values as ``t``, laid out as callers lay them out: a slice of a wider last dim (q
    and k split from one qkv tensor), one element past a 16-byte boundary, or every other row."""
    if view == "padded" and t.dim() > 1:
        wide = torch.zeros(*t.shape[:-1], t.shape[-1] + 3, dtype=t.dtype, device=t.device)
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


def _param(draw, m, p, head_dim: int) -> Any:
    if p.choices is not None:
        return draw(st.sampled_from([*p.choices, *([None] if p.optional else [])]))
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
    if p.name == "rescale_factors":
        factors = st.one_of(st.floats(0.25, 64.0), st.floats(-4.0, -0.25))
        values = st.lists(factors, min_size=head_dim // 2, max_size=head_dim // 2)
        return draw(st.one_of(st.none(), values.map(lambda v: torch.tensor(v, dtype=torch.float64))))
    if p.type == "float":
        return draw(st.floats(*_FLOATS.get(p.name, (0.1, 100.0))))
    if p.type == "int":
        return draw(st.integers(*_INTS.get(p.name, (1, 2**16))))
    if p.type == "bool":
        return draw(st.booleans())
    return p.default


def _dims(draw, m, params, head_dim: int, max_elements: int) -> dict[str, Any]:
    # the dims kernels are compiled for (head_dim, a norm's hidden) first, then the small dims
    # (heads, batch), then the length takes what the budget leaves; leading dims ("...") last
    dims: dict[str, Any] = {**{d: head_dim for d in m.kernel.specialize}, **_pinned_dims(m)}
    shape = max((t.shape_for(params) for t in m.inputs), key=len)
    limits = {"heads": 80, "num_heads": 80, "batch": 4}
    for d in sorted((d for d in shape if d != LEAD), key=lambda d: d not in limits):
        if d not in dims:
            room = max(1, max_elements // math.prod(v for v in dims.values() if isinstance(v, int)))
            dims[d] = draw(st.integers(1, min(limits.get(d, room), room)))
    for d in {d for t in m.inputs for d in t.shape_for(params)} - set(dims) - {LEAD}:
        dims[d] = 1
    if any(t.leading for t in m.inputs):
        lead = []
        for _ in range(draw(st.integers(0, 3))):
            room = max(1, max_elements // math.prod([*lead, *(v for v in dims.values() if isinstance(v, int))]))
            lead.append(draw(st.integers(1, min(room, 40))))
        dims[LEAD] = tuple(lead)
    return dims


@st.composite
def valid_specs(draw, max_elements: int = MAX_ELEMENTS, ops: tuple[str, ...] = tuple(sorted(REGISTRY))) -> Spec:
    name = draw(st.sampled_from(ops))
    m = REGISTRY[name]
    head_dim = draw(HEAD_DIMS)
    params = {p.name: _param(draw, m, p, head_dim) for p in m.params if p.name != "max_position"}
    rot = params.get("rotary_dim") or head_dim
    if any(p.name == "max_position" for p in m.params):
        cap = 2**24 if FULL else min(2**24, 2**28 // rot)
        params["max_position"] = draw(st.one_of(st.integers(1, cap), st.sampled_from([1, 2, 8192, cap])))
    dims = _dims(draw, m, params, head_dim, max_elements)
    assume(_rules_hold(m, params | dims))  # e.g. low_freq_factor == high_freq_factor: rare
    edges: list[int] = []
    for t in m.inputs:  # integer inputs: a dtype, and a few values at or near the ends of the range
        if t.range is not None:
            params[f"__{t.name}_dtype"] = draw(st.sampled_from(t.dtypes))
            low, high = (int(b.evaluate(params | dims)) for b in t.range)
            edge = st.one_of(st.sampled_from([low, high - 1]), st.integers(low, high - 1))
            edges = draw(st.lists(edge, max_size=4))
    dtype = draw(st.sampled_from(m.inputs[0].dtypes))
    mode = draw(st.sampled_from([md for md in MODES if md != "backward" or m.backward]))
    return Spec(name, params, dims, dtype, draw(st.integers(0, 2**32 - 1)), edges, draw(st.sampled_from(VIEWS)),
                mode)


@pytest.fixture(scope="module", autouse=True)
def _gpu_kernels():
    """On a GPU, every kernel the draws can need, compiled first in parallel (see the module doc)."""
    if DEVICE == "cpu":
        return
    from tileops.compile.warmup import compile_jobs, op_kernel_jobs

    jobs = []
    for name, m in REGISTRY.items():
        params = m.defaults() | dict(m.cases[0].params)
        choices = [[(p.name, c) for c in (*p.choices, *([None] if p.optional else []))]
                   for p in m.params if p.choices is not None]
        names = {p.name for p in m.params}
        for combo in itertools.product(*choices):
            for head_dim in GPU_HEAD_DIMS:
                rots = _rotary_choices(head_dim) if "rotary_dim" in names else [None]
                sections = _mrope_choices(head_dim) if "mrope_section" in names else [None]
                for rot, sec in itertools.product(rots, sections):
                    extra = ({"rotary_dim": rot} if rot is not None else {}) | (
                        {"mrope_section": sec} if sec is not None else {})
                    jobs += [j for j in op_kernel_jobs(name, params | dict(combo) | extra,
                                                       {d: head_dim for d in m.kernel.specialize},
                                                       m.inputs[0].dtypes, "sm_90", every_index_dtype=True)
                             # the head-major kernel serves 8192+ tokens, more than MAX_ELEMENTS allows
                             if not getattr(j[1], "transposed", False)]
    n, seconds, failures = compile_jobs(jobs)
    print(f"\nfuzz: {n} kernels ready in {seconds:.0f} s")
    assert not failures, failures[:3]


@pytest.mark.parametrize("op_name", sorted(REGISTRY))
@settings(SETTINGS, max_examples=max(4, -(-EXAMPLES // len(REGISTRY))))
@given(data=st.data())
def test_valid_specs_match_the_reference(op_name, data):
    # One hypothesis run per op, so that every op gets its share of the examples.
    spec = data.draw(valid_specs(ops=(op_name,)), label="spec")
    event(f"dtype: {spec.dtype}")
    event(f"view: {spec.view}")
    event(f"mode: {spec.mode}")
    check_call(op_class(spec.op)(**spec.op_params(), target="builtin"), spec)


@st.composite
def call_sequences(draw) -> list[Spec]:
    """A spec, then 1..3 more calls of the same op: new lengths and heads, now and then a new dtype."""
    spec = draw(valid_specs())
    m = REGISTRY[spec.op]
    later = []
    for _ in range(draw(st.integers(1, 3))):
        dims = _dims(draw, m, spec.params, spec.dims[m.kernel.specialize[0]] if m.kernel.specialize else 0,
                     MAX_ELEMENTS)
        dtype = draw(st.sampled_from([spec.dtype] * 3 + list(m.inputs[0].dtypes)))
        later.append(replace(spec, dims=dims, dtype=dtype, seed=draw(st.integers(0, 2**32 - 1)), edges=[]))
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


def check_call(op, spec: Spec, state: dict | None = None) -> None:
    """Every input is passed (position_ids and key too), in the spec's mode: out and key_out (and in
    backward mode the gradients of x and key) against the reference."""
    inputs = spec.inputs()
    before = {k: v.clone() for k, v in inputs.items()}
    params = spec.op_params()
    if spec.op == "RoPEDynamicNTKFwdOp":  # stateful: the reference is told the length the op has seen
        params = {**params, "max_position_id": _dynamic_ntk_length(params, inputs, {} if state is None else state) - 1}
    m = REGISTRY[spec.op]
    specs = [o for o in m.outputs if o.like in inputs]
    dtypes = {o.name: family_references.output_dtype(m, params, o.name, inputs) for o in specs}
    given_outs: dict[str, torch.Tensor] = {}
    leaves: dict[str, torch.Tensor] = {}
    mode = spec.mode
    if mode == "in-place" and any(dtypes[o.name] != inputs[o.like].dtype for o in specs):
        mode = "out"  # an output of another dtype (out_dtype) cannot be its input
    if mode == "out":  # NaN-filled, laid out like the inputs: an unwritten element shows
        for o in specs:
            src = inputs[o.like]
            given_outs[o.name] = _as_view(torch.full(src.shape, math.nan, dtype=dtypes[o.name], device=src.device),
                                          spec.view)
    elif mode == "in-place":
        given_outs = {o.name: inputs[o.like] for o in specs}
    elif mode == "backward":
        leaves = {n: inputs[n].detach().clone().requires_grad_(True) for n in m.backward.wrt if n in inputs}
    result = op(**{**inputs, **leaves}, **given_outs)
    op.check()  # on a GPU a bad position would be reported here; none is drawn
    outs = result if isinstance(result, tuple) else (result,)
    assert len(outs) == len(specs)
    changed = {o.like for o in specs} if mode == "in-place" else set()
    assert all(torch.equal(inputs[k], before[k]) for k in inputs if k not in changed)
    cpu = {k: v.cpu() for k, v in before.items()}
    refs = family_references.outputs(m, params, cpu)
    for o, out in zip(specs, outs):
        src = before[o.like]
        assert (out.shape, out.dtype) == (src.shape, dtypes[o.name])
        if o.name in given_outs:
            assert out is given_outs[o.name]  # written where it was asked
        else:
            assert out.untyped_storage().data_ptr() != inputs[o.like].untyped_storage().data_ptr()  # a new tensor
        _assert_matches(out, refs[o.name], spec.dtype, o.name)
    if leaves:
        assert all(out.grad_fn is not None for out in outs)
        g = torch.Generator().manual_seed(spec.seed ^ 0x5EED)
        grads_out = [torch.randn(out.shape, generator=g).to(out.dtype).to(out.device) for out in outs]
        got = torch.autograd.grad(outs, list(leaves.values()), grads_out)
        refs = family_references.grads(m, params, cpu, list(leaves), {o.name: g.cpu() for o, g in zip(specs, grads_out)})
        for (n, leaf), gr in zip(leaves.items(), got):
            assert (gr.shape, gr.dtype) == (leaf.shape, leaf.dtype)
            _assert_matches(gr, refs[n], spec.dtype, f"grad of {n}")


def _assert_matches(got: torch.Tensor, ref: torch.Tensor, dtype: str, what: str) -> None:
    got = got.detach().double().cpu()
    assert bool(torch.isfinite(got).all()), f"{what}: non-finite elements"
    err = (got - ref).abs()
    atol, rtol = TOLERANCES[dtype]
    bad = err > atol + rtol * ref.abs()
    note(f"{what}: max err {err.max().item() if err.numel() else 0:.3g}")
    assert not bool(bad.any()), (f"{what}: {int(bad.sum())} of {bad.numel()} elements off, first at "
                                 f"{bad.nonzero()[0].tolist()}")


# --------------------------------------------------------------------------- invalid specs

_OTHER_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int16,
                 torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64]
_WRONG_TYPES = {"int": st.one_of(st.floats(), st.text(max_size=4), st.booleans()),  # 8.0 is no int either
                "float": st.one_of(st.text(max_size=4), st.booleans(), st.complex_numbers(allow_nan=False)),
                "str": st.one_of(st.integers(), st.floats(allow_nan=False), st.booleans()),
                "bool": st.one_of(st.integers(), st.text(max_size=4)),
                "tensor": st.one_of(st.floats(allow_nan=False), st.text(max_size=4), st.integers()),
                "ints": st.one_of(st.integers(), st.text(max_size=4), st.lists(st.floats(allow_nan=False), min_size=1,
                                                                               max_size=3))}


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
    "dim-rule": lambda m: any(r.needs_dims and "head_dim" in r.check.names for r in m.rules),
    "param-nonfinite": lambda m: any(p.type == "float" for p in m.params),
    "param-choice": lambda m: any(p.choices for p in m.params),
    "param-rule": lambda m: any(not r.needs_dims for r in m.rules),
    "input-range": lambda m: any(t.range is not None for t in m.inputs),
    "tensor-param": lambda m: any(p.type == "tensor" for p in m.params),
}


@st.composite
def invalid_specs(draw, kind: str):
    """(spec, what to change, expected exception type, name the message must contain)."""
    ops = tuple(n for n in sorted(REGISTRY) if _KINDS[kind](REGISTRY[n]))
    spec = draw(valid_specs(max_elements=2000, ops=ops))
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
        return spec, {"param": (p.name, value)}, ValueError, rules[0].arg
    if kind == "target":
        name = draw(st.text(min_size=1, max_size=8).filter(lambda s: s not in target_names()))
        return spec, {"target": name}, ValueError, "target"
    t = draw(st.sampled_from(m.inputs))
    if kind == "input-dtype":
        allowed = {DTYPES[d] for d in t.dtypes}
        return spec, {"dtype": (t.name, draw(st.sampled_from([d for d in _OTHER_DTYPES if d not in allowed])))}, TypeError, t.name
    if kind == "input-rank":
        rank = len(tensor_shape(t, params, spec.dims))
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
        t = next(t for t in m.inputs if t.range is not None)
        low, high = (int(b.evaluate(params | spec.dims)) for b in t.range)
        info = torch.iinfo(DTYPES[spec.dtype_of(t)])
        bad = draw(st.one_of(st.integers(info.min, low - 1), st.integers(high, max(high, info.max))))
        shape = [spec.dims[d] for d in t.shape_for(params)]
        i = draw(st.integers(0, math.prod(shape) - 1))
        index = ", ".join(str(int(j)) for j in torch.unravel_index(torch.tensor(i), shape))
        return spec, {"position": (t.name, i, bad)}, ValueError, f"{t.name}[{index}]"
    # dim-rule: a head_dim that breaks a rule about dims (odd, or above the limit)
    hd = draw(st.one_of(st.integers(1, 1100), st.integers(1025, 4096)))
    rules = _violated(m, params | spec.dims | {"head_dim": hd})
    assume(rules)
    dims = {d: 1 for d in spec.dims} | {"head_dim": hd}
    return Spec(spec.op, spec.params, dims, spec.dtype, spec.seed, view=spec.view), {}, ValueError, rules[0].arg


@pytest.mark.parametrize("mistake", sorted(_KINDS))
def test_invalid_specs_fail_clearly(mistake):
    # One hypothesis run per kind of mistake: drawing the kind inside would leave some kinds untried
    # in a short run (hypothesis favours the first choices of sampled_from).
    settings(SETTINGS, max_examples=max(5, EXAMPLES // 4))(given(case=invalid_specs(mistake))(check_invalid))()


def check_invalid(case):
    spec, change, kind, name = case
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
    assert re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", msg), f"the error does not name {name!r}: {msg}"
    assert m.name in msg or name == "target", msg
