"""Bad arguments, generated from each manifest's signature and rules: every one must raise
TypeError or ValueError whose message names the argument, before any kernel runs.

Calls are made with target ``NO_KERNEL``, a target whose ``implement`` fails the test: an error
that comes from a kernel (or no error at all) cannot pass. Rule violations are found generically:
for each rule, values derived from its literals and from the case's values (``x > 0`` tries 0 and
-1, ``head_dim <= 1024`` tries 1025 and 2048, ``a != b`` tries b's value) are kept when they break
that rule and no other, so the error must name that rule's ``arg``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tileops import target_names
from tileops.manifest import registry, tensor_shape
from tileops.targets import FamilyTarget, Target, TargetError
from tileops.manifest.schema import DTYPE_PREFIX, LEAD
from tileops.workloads import DTYPES, case_params, index_dtype, make_inputs, op_class, op_params

try:  # pytest puts tests/ on sys.path when it is not a package, the repo root when it is
    import family_references
except ImportError:  # pragma: no cover
    from tests import family_references

REGISTRY = registry()
ERRORS = (TypeError, ValueError)
EXTRA_DTYPES = {"bool": torch.bool, "uint8": torch.uint8, "int16": torch.int16, "complex64": torch.complex64}


class _NoKernel(Target):
    name = "no-kernel"

    def implement(self, op, spec):
        raise AssertionError(f"{op.name}: a kernel was reached; the bad argument was not caught first")


NO_KERNEL = _NoKernel()


def names(arg: str, message: str) -> bool:
    """Whether ``message`` names ``arg`` as a word (``x`` must not match inside ``max_position``)."""
    return re.search(rf"(?<![\w.]){re.escape(arg)}(?!\w)", message) is not None


def raises_naming(arg: str, fn, *args, kinds=ERRORS, **kwargs) -> str:
    with pytest.raises(kinds) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert names(arg, msg), f"the error does not name {arg!r}: {msg}"
    return msg


def _holds(rule, env) -> bool:
    try:
        return bool(rule.check.evaluate(env))
    except (ArithmeticError, TypeError, ValueError):  # a rule that cannot be evaluated fails
        return False


def base(m) -> tuple[dict[str, Any], dict[str, int]]:
    """The first case's params, and small dims: 2 for dims no rule reads, the case's size otherwise."""
    in_rules = set().union(*(r.check.names for r in m.rules))
    dims: dict[str, int] = {}
    for case in m.cases:
        for d, v in case.dims.items():
            dims.setdefault(d, v if d in in_rules else 2)
    for d in m.dims:  # dims of optional inputs no case passes: 2, or 1 where a rule on it alone says so
        if d not in dims:
            alone = [r for r in m.rules if r.check.names == {d}]
            dims[d] = next((v for v in (2, 1) if all(_holds(r, {d: v}) for r in alone)), 2)
    return op_params(m, case_params(m, m.cases[0])), dims  # an op param (the prologue's rope) built


#: optional inputs the first case's params refuse, left out of the valid base call: the prologue's
#: scales need an fp8 cache, and its first case's caches are bf16; attention's offsets need a varlen
#: (3-D) q, and the cases' q is dense (the first shape of each input)
NOT_WITH_BASE = {"AttnPrologueFwdOp": {"k_scale", "v_scale"}, "AttnFwdOp": {"cu_seqlens_q", "cu_seqlens_k"},
                 "PagedAttnDecodeFwdOp": {"k_scale", "v_scale"}}


def dtypes(m) -> dict[str, str]:
    """``dtype_<input>`` of every input as :func:`call` makes them (floats in float32), for rules."""
    return {DTYPE_PREFIX + t.name: None if t.name in NOT_WITH_BASE.get(m.name, ()) else
            index_dtype(t) if t.range is not None else "float32" for t in m.inputs}


def every_input(m, params, dims) -> dict[str, Any]:
    """Every input of ``m`` (optional ones too) as a valid call passes them, random."""
    inputs = make_inputs(m, params, dims, "float32", every=True)
    return {k: v for k, v in inputs.items() if k not in NOT_WITH_BASE.get(m.name, ())}


def call(m, params, dims, replace, target=NO_KERNEL):
    """Build the op and call it on fresh valid inputs, with ``replace`` swapped in."""
    op = op_class(m.name)(**params, target=target)
    return op(**(every_input(m, params, dims) | replace))


def _ids(items):
    return [pytest.param(*it[1:], id=it[0]) for it in items]


def _layouts(m) -> Iterator[tuple[str, dict[str, Any]]]:
    params, _ = base(m)
    by = {t.shape_by for t in m.inputs} - {None}
    if not by:
        yield "", params
    for p in sorted(by):
        for choice in m.param(p).choices or (params[p],):
            yield f"-{choice}", params | {p: choice}


# --------------------------------------------------------------------------- tensors


def _accepts_rank(t, params, rank: int) -> bool:
    """Whether input ``t`` may have ``rank`` dims. One ``like`` another input takes that one's shape
    exactly: any other rank is wrong, though the shape alone would allow it."""
    if t.like is not None:
        return False
    return any(rank == len(s) or (s[:1] == (LEAD,) and rank >= len(s) - 1) for s in t.shapes_for(params))


def _based_inputs(m) -> list:
    """``m``'s inputs a valid base call passes (every one but :data:`NOT_WITH_BASE`'s; the op's own
    tests cover those)."""
    return [t for t in m.inputs if t.name not in NOT_WITH_BASE.get(m.name, ())]


def _tensor_items():
    rank, dtype, notensor, device = [], [], [], []
    for m in REGISTRY.values():
        for suffix, params in _layouts(m):
            for t in _based_inputs(m):
                good = len(tensor_shape(t, params, base(m)[1]))  # a leading "...": none of those dims
                for delta in (1, -1):
                    if _accepts_rank(t, params, good + delta):
                        continue  # an alternative shape, or more leading dims: not wrong
                    rank.append((f"{m.name}{suffix}-{t.name}-rank{delta:+d}", m, params, t.name, delta))
        for t in _based_inputs(m):
            for d in [*DTYPES, *EXTRA_DTYPES]:
                if d not in t.dtypes:
                    dtype.append((f"{m.name}-{t.name}-{d}", m, t.name, d))
            for kind in ("list", "ndarray", "None", "float"):
                if kind == "None" and t.optional:
                    continue  # None is how an optional input is left out
                notensor.append((f"{m.name}-{t.name}-{kind}", m, t.name, kind))
        if len(m.inputs) >= 2:
            for t in _based_inputs(m):
                device.append((f"{m.name}-{t.name}", m, t.name))
    return rank, dtype, notensor, device


RANK, DTYPE, NOTENSOR, DEVICE = _tensor_items()


@pytest.mark.parametrize("m, params, arg, delta", _ids(RANK))
def test_wrong_rank(m, params, arg, delta):
    _, dims = base(m)
    good = every_input(m, params, dims)[arg]
    bad = good.unsqueeze(0) if delta > 0 else good[0]
    raises_naming(arg, call, m, params, dims, {arg: bad}, kinds=ValueError)


@pytest.mark.parametrize("m, arg, dtype", _ids(DTYPE))
def test_dtype_outside_the_allowed_set(m, arg, dtype):
    params, dims = base(m)
    good = every_input(m, params, dims)[arg]
    bad = good.to({**DTYPES, **EXTRA_DTYPES}[dtype])
    msg = raises_naming(arg, call, m, params, dims, {arg: bad}, kinds=TypeError)
    assert dtype in msg


class _Reached(Exception):
    """Raised by :data:`REACHED` where a kernel would run: every check of the call passed."""


class _ReachedTarget(Target):
    name = "reached"

    def implement(self, op, spec):
        raise _Reached(spec)


REACHED = _ReachedTarget()
_LEADING = [pytest.param(m, t, id=f"{m.name}-{t.name}") for m in REGISTRY.values() for t in m.inputs
            if t.leading and t.like is None]


@pytest.mark.parametrize("m, arg", _LEADING)
def test_leading_dims_take_any_rank_and_a_like_input_must_match_them(m, arg):
    """An input whose shape starts with ``"..."`` is accepted with 0 to 3 leading dims (the
    generated rank test gives it none, then a rank below that); an input ``like`` it must have its
    exact shape, leading dims included, and its dtype."""
    params, dims = base(m)
    for lead in ((), (3,), (2, 5), (2, 1, 3)):
        with pytest.raises(_Reached):
            call(m, params, dims | {LEAD: lead}, {}, target=REACHED)
    likes = [t.name for t in m.inputs if t.like == arg]
    for other in likes:
        inputs = every_input(m, params, dims | {LEAD: (2, 5)})
        msg = raises_naming(other, call, m, params, dims, inputs | {other: inputs[other].reshape(5, 2, -1)},
                            kinds=ValueError)
        assert f"(that of {arg})" in msg and "[2, 5, " in msg, msg
        wrong = next(d for d in ("bfloat16", "float16") if d in m.input(other).dtypes)
        msg = raises_naming(other, call, m, params, dims, inputs | {other: inputs[other].to(DTYPES[wrong])},
                            kinds=TypeError)
        assert f"(that of {arg})" in msg and wrong in msg, msg


# A list or an ndarray is unhashable: Op._call once put it in its cache key and failed with
# "unhashable type: 'list'", naming no argument (fixed in 5c66ea1).
@pytest.mark.parametrize("m, arg, kind", _ids(NOTENSOR))
def test_not_a_tensor(m, arg, kind):
    params, dims = base(m)
    good = every_input(m, params, dims)[arg]
    bad = {"list": good.tolist(), "ndarray": good.numpy(), "None": None, "float": 1.0}[kind]
    raises_naming(arg, call, m, params, dims, {arg: bad}, kinds=TypeError)


@pytest.mark.parametrize("m, arg", _ids(DEVICE))
def test_tensors_on_different_devices(m, arg):
    # The first input fixes the device; moving any input away must name the one that disagrees and
    # both devices. Without a GPU, "meta" tensors (shape and dtype, no data) make the mismatch.
    params, dims = base(m)
    other = "cuda" if torch.cuda.is_available() else "meta"
    inputs = every_input(m, params, dims)
    moved = inputs[arg].to(other)
    first, second = m.inputs[0].name, m.inputs[1].name
    # moving the first input makes the next one disagree with it; moving another names that one
    msg = raises_naming(second if arg == first else arg, call, m, params, dims, {arg: moved}, kinds=ValueError)
    assert names(first, msg) and other in msg and "cpu" in msg


# --------------------------------------------------------------------------- rules, found generically


_TAGS = {"lit", "name", "and", "or", "not", "neg", "bin", "cmp", "call"}


def _literals(node: tuple) -> list:
    """Every literal in a parsed rule (the tree of ``tileops.manifest.expr``)."""
    if node[0] == "lit":
        return [node[1]]
    out = []
    for sub in node[1:]:
        if isinstance(sub, tuple) and sub and sub[0] in _TAGS:
            out += _literals(sub)
        elif isinstance(sub, tuple):  # the operand lists of "cmp" and "call"
            out += [v for s in sub if isinstance(s, tuple) for v in _literals(s)]
    return out


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _candidates(rule, name: str, env: dict) -> list:
    nums = [v for v in _literals(rule.check.tree) if _number(v)]
    out = []
    for v in nums:
        out += [v, v - 1, v + 1, 2 * v, -v]
    out += [0, -1]
    near = sorted((env[k] for k in env if k != name and _number(env[k])), key=abs)
    for v in [env[name]] * _number(env.get(name)) + near:  # its own value, then the others' (a != b)
        out += [v, v + 1, v - 1, v + 2, v - 2, 2 * v, -v]
    seen, uniq = set(), []
    for v in out:
        if v not in seen and v != env.get(name):
            seen.add(v)
            uniq.append(v)
    return uniq


def _typed(m, name: str, v):
    """``v`` as a value of the param's (or dim's, or an input's dtype's) type, or None when it cannot be one."""
    if name.startswith(DTYPE_PREFIX):
        return v if isinstance(v, str) else None
    ptype = next((p.type for p in m.params if p.name == name), "dim")
    if ptype == "float":
        return float(v)
    if ptype in ("int", "dim") and float(v).is_integer():
        v = int(v)
        return v if ptype == "int" or v >= 1 else None
    return None


def _params_for(m, rule) -> dict[str, Any]:
    """The first case's params, in a layout whose inputs have every dim ``rule`` names (the op checks
    a rule only when the call has its dims: ``rows * cols`` is no rule of a 1d call)."""
    params = base(m)[0]
    for _, p in [("", params), *_layouts(m)]:
        if rule.check.names & m.dims <= {d for t in m.inputs for s in t.shapes_for(p) for d in s}:
            return p
    return params


def _rule_items(needs_dims: bool, per_name: int = 4):
    items = []
    for m in REGISTRY.values():
        _, dims = base(m)
        dims = dims | dtypes(m)  # a rule checked at the call may name an input's dtype
        for rule in m.rules:
            if rule.needs_dims != needs_dims:
                continue
            params = _params_for(m, rule)
            # the rules the call checks besides: the op checks a rule only when the call has every dim it
            # names, and the base call has the dims of each input's first shape (attention: dense q, so
            # its varlen rules, on total_q, do not apply)
            call_dims = {d for t in m.inputs if t.name not in NOT_WITH_BASE.get(m.name, ())
                         for d in t.shapes_for(params)[0]}
            if (rule.check.names & m.dims) - call_dims:
                continue  # a rule on another shape's dims (a varlen q): the op's own tests break it
            others = [r for r in m.rules if r is not rule and (needs_dims or not r.needs_dims)
                      and not (r.check.names & m.dims) - call_dims]
            left_out = NOT_WITH_BASE.get(m.name, set())
            left_dims = {d for t in m.inputs if t.name in left_out for alts in t.alternatives.values() for sh in alts
                         for d in sh}
            for name in sorted(rule.check.names):
                if name not in params and name not in dims:
                    continue
                if name in left_dims or name[len(DTYPE_PREFIX):] in left_out:
                    continue  # an input left out of the base call: the op's own tests break these
                found = 0
                cands = _candidates(rule, name, params | dims)
                if name.startswith(DTYPE_PREFIX):  # an input's dtype: each it allows
                    cands = [d for d in m.input(name[len(DTYPE_PREFIX):]).dtypes if d != dims[name]]
                for v in cands:
                    v = _typed(m, name, v)
                    env = params | dims | {name: v}
                    if v is None or _holds(rule, env) or not all(_holds(r, env) for r in others):
                        continue
                    text = rule.check.text.replace(" ", "")
                    items.append((f"{m.name}-{text}-{name}={v}", m, rule, name, v))
                    found += 1
                    if found == per_name:
                        break
    return items


PARAM_RULES, DIM_RULES = _rule_items(False), _rule_items(True)


#: rules the generator here cannot break, each broken by an op's own tests instead: whether an
#: optional input is passed at all (a dtype of ``none``), and a zero-sized dim of a tensor every
#: case passes. (op, rule) -> the test that breaks it
BROKEN_ELSEWHERE = {
    ("AttnPrologueFwdOp", "qk_norm or dtype_q_norm_weight == none"):
        "tests/test_attention_prologue.py::test_bad_call_names_the_argument[weight-without-qk-norm]",
    ("AttnPrologueFwdOp", "qk_norm or dtype_k_norm_weight == none"):
        "tests/test_attention_prologue.py::test_a_k_norm_weight_without_qk_norm_is_refused",
    ("AttnPrologueFwdOp", "not qk_norm or dtype_q_norm_weight != none"):
        "tests/test_attention_prologue.py::test_missing_norm_weights_named",
    ("AttnPrologueFwdOp", "not qk_norm or dtype_k_norm_weight != none"):
        "tests/test_attention_prologue.py::test_missing_norm_weights_named",
    ("AttnPrologueFwdOp", "block_size > 0 and num_blocks > 0"):
        "tests/test_attention_prologue.py::test_bad_call_names_the_argument[cache-no-blocks]",
    ("AttnPrologueFwdOp", "scale_len == 1"):
        "tests/test_attention_prologue.py::test_float8_scales_named",
    ("AttnPrologueFwdOp", "cache_dtype == 'float8_e4m3fn' or (dtype_k_scale == none and dtype_v_scale == none)"):
        "tests/test_attention_prologue.py::test_bad_call_names_the_argument[scale-without-fp8]",
    # the base call's caches are bf16 (its first case): an fp8 op's calls are tested there
    ("AttnPrologueFwdOp", "cache_dtype != 'float8_e4m3fn' or (dtype_k_scale != none and dtype_v_scale != none)"):
        "tests/test_attention_prologue.py::test_float8_scales_named",
    ("AttnPrologueFwdOp", "cache_dtype == none or cache_dtype == 'float8_e4m3fn' or cache_dtype == dtype_qkv"):
        "tests/test_attention_prologue.py::test_a_cache_dtype_other_than_qkvs_or_float8_is_refused",
    # the base call's q is dense, and passes no offsets (NOT_WITH_BASE)
    # the base call's caches are its first case's (no fp8, blocks and tables of it): broken there
    ("PagedAttnDecodeFwdOp", "block_size > 0 and num_blocks > 0"):
        "tests/test_paged_decode.py::test_bad_inputs_are_refused_before_any_kernel[cache-no-blocks]",
    ("PagedAttnDecodeFwdOp", "max_blocks > 0"):
        "tests/test_paged_decode.py::test_bad_inputs_are_refused_before_any_kernel[table-no-blocks]",
    ("PagedAttnDecodeFwdOp", "cache_dtype == none or cache_dtype == 'float8_e4m3fn' or cache_dtype == dtype_q"):
        "tests/test_paged_decode.py::test_bad_inputs_are_refused_before_any_kernel[q-not-cache-dtype]",
    ("PagedAttnDecodeFwdOp", "cache_dtype != 'float8_e4m3fn' or (dtype_k_scale != none and dtype_v_scale != none)"):
        "tests/test_paged_decode.py::test_bad_inputs_are_refused_before_any_kernel[fp8-without-scales]",
    ("PagedAttnDecodeFwdOp", "cache_dtype == 'float8_e4m3fn' or (dtype_k_scale == none and dtype_v_scale == none)"):
        "tests/test_paged_decode.py::test_bad_inputs_are_refused_before_any_kernel[scale-without-fp8]",
    ("PagedAttnDecodeFwdOp", "scale_len == 1"):
        "tests/test_paged_decode.py::test_bad_inputs_are_refused_before_any_kernel[fp8-two-scales]",
    ("AttnFwdOp", "batch >= 0 and dtype_cu_seqlens_q == none"):
        "tests/test_attn_fwd.py::test_bad_inputs_are_named[cu with dense-ValueError-...]",
    ("AttnFwdOp", "batch >= 0 and dtype_cu_seqlens_k == none"):
        "tests/test_attn_fwd.py::test_bad_inputs_are_named[cu_k with dense-ValueError-...]",
    ("AttnFwdOp", "total_q >= 0 and dtype_cu_seqlens_q != none"):
        "tests/test_attn_fwd.py::test_bad_inputs_are_named[varlen no cu_q-ValueError-...]",
    ("AttnFwdOp", "total_q >= 0 and dtype_cu_seqlens_k != none"):
        "tests/test_attn_fwd.py::test_bad_inputs_are_named[varlen no cu_k-ValueError-...]",
}


def test_every_rule_gets_a_violation():
    covered = {(it[1].name, it[2].check.text) for it in PARAM_RULES + DIM_RULES} | set(BROKEN_ELSEWHERE)
    assert covered == {(m.name, r.check.text) for m in REGISTRY.values() for r in m.rules}
    # The ones the semantics call out by name are among them.
    ids = {it[0] for it in PARAM_RULES + DIM_RULES}
    for want in ("RoPEFwdOp-head_dim<=1024-head_dim=2048", "RoPEFwdOp-base>0-base=0.0",
                 "RoPELlama31FwdOp-low_freq_factor!=high_freq_factor-high_freq_factor=1.0",
                 "RoPENeoxPositionIdsFwdOp-max_position>0-max_position=0"):
        assert want in ids, sorted(ids)
    assert any(i.startswith("RoPEFwdOp-head_dim%2==0-head_dim=") for i in ids)
    assert any(i.startswith("RoPENeoxPositionIdsFwdOp-rotary_dim==noneorrotary_dim<=head_dim-rotary_dim=")
               for i in ids)


@pytest.mark.parametrize("m, rule, name, value", _ids(PARAM_RULES))
def test_param_rule_broken_at_construction(m, rule, name, value):
    params, _ = base(m)
    raises_naming(rule.arg, op_class(m.name), **(params | {name: value}), target=NO_KERNEL, kinds=ValueError)


@pytest.mark.slow  # measured 5-38 s on 2 cores (pytest --durations); CI runs -m slow
@pytest.mark.parametrize("m, rule, name, value", _ids(DIM_RULES))
def test_dim_rule_broken_at_the_call(m, rule, name, value):
    params, dims = _params_for(m, rule), base(m)[1]
    if name in params:
        params = params | {name: value}
    elif not name.startswith(DTYPE_PREFIX):
        dims = dims | {name: value}
    inputs = _shaped_inputs(m, params, dims)
    if name.startswith(DTYPE_PREFIX):  # an input's dtype: that input converted, and those `like` it
        arg = name[len(DTYPE_PREFIX):]
        for t in m.inputs:
            if t.name == arg or (t.like == arg and t.name in inputs):
                inputs[t.name] = inputs[t.name].to(DTYPES[value])
    op = op_class(m.name)(**params, target=NO_KERNEL)  # the params alone are fine
    raises_naming(rule.arg, op, **inputs, kinds=ValueError)


def _shaped_inputs(m, params, dims):
    """Inputs of the right shapes; past 2^24 elements, stride-0 views of a small random row (a rule
    like ``seq_len <= 2^24`` is checked on shapes alone, before any kernel runs)."""
    small = {d: min(v, 4) for d, v in dims.items()}
    tiny = every_input(m, params, small)
    out = {}
    for t in m.inputs:
        if t.name not in tiny:  # left out of the base call (NOT_WITH_BASE)
            continue
        shape = tensor_shape(t, params, dims)
        v = tiny[t.name]
        out[t.name] = (v.reshape(-1)[:1].reshape([1] * len(shape)).expand(shape) if math.prod(shape) > 2**24
                       else every_input(m, params, dims)[t.name])
    return out


# --------------------------------------------------------------------------- params: types and values

_WRONG = {"str": [1, b"neox"], "int": [1.5, "8", True], "float": ["1.0", True, 1j], "bool": [1, "true"],
          "tensor": [[1.0, 2.0], 3.0], "ints": [16, "16,24,24", [16.0, 24, 24], (True, 24, 24)],
          # an op param takes an op object (a name or a class is not one); a dtype, a torch.dtype or its name
          "op": ["RoPEFwdOp", 3, torch.nn.Identity()], "dtype": [3, 1.5, [torch.float16]]}
#: a value of each type outside any choices list: a str no op declares, a dtype no op takes
_UNCHOSEN = {"str": "bogus", "dtype": torch.complex64}


def _param_items():
    choice, wrong, nonfinite, missing = [], [], [], []
    for m in REGISTRY.values():
        for p in m.params:
            if p.choices is not None:
                bad = _UNCHOSEN.get(p.type) if p.type in _UNCHOSEN else max(c for c in p.choices) + 1
                choice.append((f"{m.name}-{p.name}={bad}", m, p.name, bad))
            for v in _WRONG[p.type] + ([] if p.optional or p.type == "tensor" else [None]):
                wrong.append((f"{m.name}-{p.name}={v!r}", m, p.name, v))
            if p.type == "float":
                for v in (math.nan, math.inf, -math.inf):
                    nonfinite.append((f"{m.name}-{p.name}={v}", m, p.name, v))
            if not p.has_default:
                missing.append((f"{m.name}-{p.name}", m, p.name))
    return choice, wrong, nonfinite, missing


CHOICE, WRONG, NONFINITE, MISSING = _param_items()


@pytest.mark.parametrize("m, arg, value", _ids(CHOICE))
def test_value_outside_choices(m, arg, value):
    raises_naming(arg, op_class(m.name), **(base(m)[0] | {arg: value}), kinds=ValueError)


@pytest.mark.parametrize("m, arg, value", _ids(WRONG))
def test_wrong_param_type(m, arg, value):
    raises_naming(arg, op_class(m.name), **(base(m)[0] | {arg: value}), kinds=TypeError)


@pytest.mark.parametrize("m, arg, value", _ids(NONFINITE))
def test_non_finite_float(m, arg, value):
    raises_naming(arg, op_class(m.name), **(base(m)[0] | {arg: value}), kinds=ValueError)


@pytest.mark.parametrize("m, arg", _ids(MISSING))
def test_missing_required_param(m, arg):
    params = {k: v for k, v in base(m)[0].items() if k != arg}
    raises_naming(arg, op_class(m.name), **params, kinds=TypeError)


def test_unknown_target_lists_the_known_ones():
    for m in REGISTRY.values():
        msg = raises_naming("target", op_class(m.name), **base(m)[0], target="no-such-target", kinds=ValueError)
        assert "no-such-target" in msg
        for known in target_names():
            assert known in msg
        raises_naming("target", op_class(m.name), **base(m)[0], target=3, kinds=TypeError)


class _Nowhere(Target):
    """A target that serves no device."""

    name = "serves-nothing"

    def supports(self, op_name, family, device):
        return False


class _NoFamily(FamilyTarget):
    """A target that claims every device but implements no family (its implement() refuses)."""

    name = "no-families"
    families: dict[str, str] = {}

    def supports(self, op_name, family, device):
        return True


# TargetError's messages once lacked the "OpName: " that starts every other error of an op.
@pytest.mark.parametrize("m", list(REGISTRY.values()), ids=list(REGISTRY))
def test_target_errors_start_with_the_op_name(m):
    params, dims = base(m)
    prefix = f"{m.name}: target: "
    for target, kind in (("no-such-target", TargetError), (3, TypeError)):
        with pytest.raises(kind) as info:
            op_class(m.name)(**params, target=target)
        assert str(info.value).startswith(prefix), str(info.value)
    for target, words in ((_Nowhere(), "cannot serve cpu tensors"), (_NoFamily(), "has no kernels")):
        with pytest.raises(TargetError) as info:
            call(m, params, dims, {}, target=target)
        msg = str(info.value)
        assert msg.startswith(prefix) and words in msg, msg


# --------------------------------------------------------------------------- out= tensors

_OUTS = [pytest.param(m, o, id=f"{m.name}-{o.name}") for m in REGISTRY.values() for o in m.outputs]


# A wrong out= dtype once raised ValueError where a wrong input dtype raises TypeError.
@pytest.mark.parametrize("m, spec", _OUTS)
def test_bad_out_tensor_is_named_with_the_kind_of_an_input_error(m, spec):
    params, dims = base(m)
    like = every_input(m, params, dims)[spec.like]
    that = spec.like
    if spec.own_shape:  # an output of its own shape (the prologue's q): the like input gives the dtype only
        shape = [params[d] if d in params else dims[d] for d in spec.own_shape]
        like, that = like.new_empty(shape), f"[{', '.join(spec.own_shape)}]"
    wrong = {
        "dtype": (torch.empty_like(like, dtype=torch.float64), TypeError),
        "shape": (like.new_empty((*like.shape[:-1], like.shape[-1] + 2)), ValueError),
        "device": (torch.empty_like(like, device="meta"), ValueError),
    }
    for what, (bad, kind) in wrong.items():
        msg = raises_naming(spec.name, call, m, params, dims, {spec.name: bad}, kinds=kind)
        of = that if what == "shape" else spec.like  # the output's own shape; the like input's dtype and device
        assert msg.startswith(f"{m.name}: {spec.name}: expected {what} ") and f"(that of {of})" in msg, msg


# --------------------------------------------------------------------------- values checked at the call

_RANGED = [(m, t) for m in REGISTRY.values() for t in m.inputs if t.range is not None]


@pytest.mark.slow  # measured 5-38 s on 2 cores (pytest --durations); CI runs -m slow
@pytest.mark.parametrize("target", ["builtin", "torch"])
@pytest.mark.parametrize("m, spec", [pytest.param(m, t, id=f"{m.name}-{t.name}") for m, t in _RANGED])
def test_values_out_of_range_name_the_index(m, spec, target):
    # Real kernels here: the BUILTIN kernel flags bad positions on the device (and clamps them).
    params, dims = base(m)
    for d in spec.shape_for(params):  # 6 wherever the rules allow it (MRoPE's streams stay 3)
        if all(_holds(r, params | dims | dtypes(m) | {d: 6}) for r in m.rules):
            dims = dims | {d: 6}
    env = params | dims
    low, high = (int(b.evaluate(env)) for b in spec.range)
    for dtype in spec.dtypes:
        # a fresh op per dtype: its bad calls, then one good call (a stateful op, dynamic NTK, would
        # otherwise carry the length of one dtype's good call into the next)
        op = op_class(m.name)(**params, target=target)
        info = torch.iinfo(DTYPES[dtype])
        if (m.name, spec.name) in UNREACHED:
            pytest.skip(UNREACHED[(m.name, spec.name)])
        below = () if (m.name, spec.name) in BELOW_ALLOWED else (low - 1, info.min)
        for bad in {b for b in (*below, high, info.max) if not low <= b < high}:
            if not info.min <= bad <= info.max:
                continue
            inputs = every_input(m, params, dims)
            vals = inputs[spec.name].to(DTYPES[dtype])
            flat = vals.view(-1)  # the 4th and 6th elements, whatever the rank
            flat[3] = bad
            flat[5] = high + 7 if high + 7 <= info.max else low - 7
            msg = raises_naming(spec.name, op, **(inputs | {spec.name: vals}), kinds=ValueError)
            index = ", ".join(str(int(i)) for i in torch.unravel_index(torch.tensor(3), vals.shape))
            assert f"{spec.name}[{index}] = {bad}" in msg, msg
        # After the error the op still works (the device flag was reset).
        good = every_input(m, params, dims)
        good[spec.name] = good[spec.name].to(DTYPES[dtype])
        out = op(**good)
        out = out[0] if isinstance(out, tuple) else out  # (out, key_out): the key is passed too
        ref = family_references.outputs(m, params, good)[m.outputs[0].name]
        assert torch.allclose(out.double(), ref, atol=2e-5, rtol=2e-5)


#: ranged inputs whose values below the range are accepted by design (the range's low end is what
#: the tests draw): (op, input) -> why
BELOW_ALLOWED = {("AttnPrologueFwdOp", "slot_mapping"): "every negative slot is padding, skipped (vLLM's -1)"}
#: ranged inputs whose elements are checked only where the call reaches them, so a bad value at a fixed
#: index need not be one: (op, input) -> why, and where the reached ones are broken
UNREACHED = {("PagedAttnDecodeFwdOp", "block_tables"):
             "entries past a sequence's length are padding, never read or checked; "
             "tests/test_paged_decode.py breaks the entries a length reaches"}


def test_longrope_bad_rescale_factors():
    m = REGISTRY["LongRoPEFwdOp"]
    cls = op_class(m.name)
    for bad in (0.0, math.nan, math.inf):
        rf = torch.ones(64)
        rf[5] = bad
        msg = raises_naming("rescale_factors", cls, rescale_factors=rf, kinds=ValueError)
        assert "rescale_factors[5]" in msg
    raises_naming("rescale_factors", cls, rescale_factors=torch.ones(4, 16), kinds=ValueError)
    raises_naming("rescale_factors", cls, rescale_factors=torch.ones(32, dtype=torch.complex64), kinds=ValueError)
    op = cls(rescale_factors=torch.full((32,), 2.0), target=NO_KERNEL)  # fine until head_dim is known
    msg = raises_naming("rescale_factors", op, torch.randn(3, 128), kinds=ValueError)
    assert re.search(r"\b64\b", msg) and re.search(r"\b32\b", msg), msg
