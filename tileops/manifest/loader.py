"""Load manifests: safe YAML -> nodes with line numbers -> checked, frozen :mod:`schema` objects.

Every error is a :class:`ManifestError` whose text starts ``FILE:LINE:`` and names the key.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from .expr import Expr, ExprError, parse_expr
from .schema import (
    DTYPE_PREFIX, DTYPES, LEAD, PARAM_TYPES, ROWS, SCHEMA, Backward, Case, ComposeStage, CpuShrink, KernelSpec,
    OpManifest, FlagSpec, ParamSpec, Rule, TensorSpec, TuneSpace, Tuning,
)

__all__ = ["ManifestError", "add_op", "load_file", "load_files", "resolve_compose", "packaged_files", "manifest_files"]


class ManifestError(ValueError):
    """A manifest that breaks the schema; ``str()`` reads ``FILE:LINE: message``."""

    def __init__(self, file: str, line: int, message: str):
        super().__init__(f"{file}:{line}: {message}")
        self.file, self.line, self.message = file, line, message


class _Ctx:
    def __init__(self, file: str):
        self.file = file
        # YAML's safe constructor builds plain values from nodes; one per file (building a whole
        # SafeLoader per scalar cost 0.2 s of the packaged manifests' 0.4 s)
        self._construct = yaml.constructor.SafeConstructor().construct_object

    def err(self, node: yaml.Node | int, message: str) -> ManifestError:
        line = node if isinstance(node, int) else node.start_mark.line + 1
        return ManifestError(self.file, line, message)

    def mapping(self, node: yaml.Node, what: str) -> dict[str, tuple[yaml.Node, yaml.Node]]:
        """A mapping node as {key: (key_node, value_node)}, rejecting duplicate and non-str keys."""
        if not isinstance(node, yaml.MappingNode):
            raise self.err(node, f"{what}: expected a mapping, found {_kind(node)}")
        out: dict[str, tuple[yaml.Node, yaml.Node]] = {}
        for k, v in node.value:
            if not isinstance(k, yaml.ScalarNode) or not isinstance(self.scalar(k), str):
                raise self.err(k, f"{what}: keys must be strings")
            key = str(k.value)
            if key in out:
                raise self.err(k, f"{what}: duplicate key {key!r}")
            out[key] = (k, v)
        return out

    def section(self, node: yaml.Node, kind: str, what: str,
                owner: yaml.Node | None = None) -> dict[str, tuple[yaml.Node, yaml.Node]]:
        """A mapping checked against SCHEMA[kind]: unknown keys and missing required ones fail.

        A missing key is reported at ``owner`` (the key naming this section) when given: the
        mapping itself starts at its first key, which is not where the reader looks.
        """
        m = self.mapping(node, what)
        allowed = SCHEMA[kind]
        for key, (knode, _) in m.items():
            if key not in allowed:
                raise self.err(knode, f"{what}: unknown key {key!r}; allowed: {', '.join(allowed)}")
        for key, (required, _, _) in allowed.items():
            if required and key not in m:
                raise self.err(owner if owner is not None else node, f"{what}: missing required key {key!r}")
        return m

    def scalar(self, node: yaml.Node) -> Any:
        if not isinstance(node, yaml.ScalarNode):
            raise self.err(node, f"expected a scalar, found {_kind(node)}")
        return self._construct(node, deep=True)

    def plain(self, node: yaml.Node) -> Any:
        """Any node as plain Python (scalars, lists, dicts) via the safe constructor."""
        return self._construct(node, deep=True)

    def typed(self, node: yaml.Node, types: tuple[type, ...], what: str, tname: str) -> Any:
        value = self.scalar(node)
        if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
            raise self.err(node, f"{what}: expected {tname}, found {_show(value)}")
        return value

    def string(self, node: yaml.Node, what: str) -> str:
        return self.typed(node, (str,), what, "a string")

    def strings(self, node: yaml.Node, what: str) -> tuple[str, ...]:
        if not isinstance(node, yaml.SequenceNode):
            raise self.err(node, f"{what}: expected a list of strings, found {_kind(node)}")
        return tuple(self.string(n, what) for n in node.value)


def _kind(node: yaml.Node) -> str:
    return {"MappingNode": "a mapping", "SequenceNode": "a list"}.get(type(node).__name__, "a scalar")


def _show(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def _param(ctx: _Ctx, name: str, node: yaml.Node) -> ParamSpec:
    what = f"params.{name}"
    m = ctx.section(node, "param", what)
    ptype = ctx.string(m["type"][1], f"{what}.type")
    if ptype not in PARAM_TYPES:
        raise ctx.err(m["type"][1], f"{what}.type: expected one of {', '.join(PARAM_TYPES)}, found {ptype!r}")
    optional = ctx.typed(m["optional"][1], (bool,), f"{what}.optional", "true or false") if "optional" in m else False
    kw = ctx.typed(m["keyword_only"][1], (bool,), f"{what}.keyword_only", "true or false") if "keyword_only" in m else False
    choices = None
    if "choices" in m:
        cnode = m["choices"][1]
        if not isinstance(cnode, yaml.SequenceNode) or not cnode.value:
            raise ctx.err(cnode, f"{what}.choices: expected a non-empty list")
        choices = tuple(_value_of_type(ctx, n, ptype, False, f"{what}.choices") for n in cnode.value)
    has_default = "default" in m
    default = None
    if has_default:
        default = _value_of_type(ctx, m["default"][1], ptype, optional, f"{what}.default")
        if choices is not None and default not in choices and not (default is None and optional):
            raise ctx.err(m["default"][1], f"{what}.default: {default!r} is not among choices {list(choices)}")
    return ParamSpec(name=name, type=ptype, doc=ctx.string(m["doc"][1], f"{what}.doc"), default=default,
                     has_default=has_default, optional=optional, choices=choices, keyword_only=kw,
                     line=node.start_mark.line + 1)


def _check_signature_order(ctx: _Ctx, params: tuple[ParamSpec, ...]) -> None:
    """The params in order must make a Python signature that means what the manifest says: the
    generator puts ``*`` before the first keyword-only param, so a positional one after it would
    silently become keyword-only, and a required positional param after one with a default is a
    SyntaxError in the generated module."""
    first_kw: ParamSpec | None = None
    first_default: ParamSpec | None = None
    for p in params:
        if p.keyword_only:
            first_kw = first_kw or p
            continue
        if first_kw is not None:
            raise ctx.err(p.line, f"params.{p.name}: a positional param after keyword-only {first_kw.name!r} "
                                  f"(line {first_kw.line}); mark it keyword_only: true or move it before")
        if not p.has_default and first_default is not None:
            raise ctx.err(p.line, f"params.{p.name}: a required positional param after {first_default.name!r}, "
                                  f"which has a default (line {first_default.line}); give it a default or move "
                                  "it before")
        if p.has_default:
            first_default = first_default or p


def _value_of_type(ctx: _Ctx, node: yaml.Node, ptype: str, optional: bool, what: str) -> Any:
    if ptype == "ints" and isinstance(node, yaml.SequenceNode):
        items = [ctx.scalar(n) for n in node.value]
        if any(not isinstance(v, int) or isinstance(v, bool) for v in items):
            raise ctx.err(node, f"{what}: expected a list of integers, found {_show(items)}")
        return tuple(items)
    if ptype == "op" and isinstance(node, yaml.MappingNode):
        return _op_value(ctx, node, what)
    value = ctx.scalar(node)
    if value is None:
        if optional or ptype in ("tensor", "op"):
            return None
        raise ctx.err(node, f"{what}: null given but the param is not optional")
    if ptype == "tensor":
        raise ctx.err(node, f"{what}: a tensor param can only default to null")
    if ptype == "op":
        raise ctx.err(node, f"{what}: an op param is null, or in a case {{op: OpName, params: {{...}}}}, found "
                            f"{_show(value)}")
    if ptype == "dtype" and value not in DTYPES:
        raise ctx.err(node, f"{what}: expected a dtype name among {', '.join(DTYPES)}, found {_show(value)}")
    if ptype == "ints":
        raise ctx.err(node, f"{what}: expected a list of integers, found {_show(value)}")
    types = PARAM_TYPES[ptype]
    if not isinstance(value, types) or (ptype != "bool" and isinstance(value, bool)):
        raise ctx.err(node, f"{what}: expected {ptype}, found {_show(value)}")
    if ptype == "float":
        value = float(value)
    return value


def _op_value(ctx: _Ctx, node: yaml.Node, what: str) -> dict[str, Any]:
    """A case's value of an ``op`` param: ``{op: OpName, params: {...}}``, the op a workload builds
    (checked against its manifest when every file is read, :func:`resolve_compose`)."""
    m = ctx.mapping(node, what)
    unknown = sorted(set(m) - {"op", "params"})
    if unknown or "op" not in m:
        raise ctx.err(node, f"{what}: expected {{op: OpName, params: {{...}}}}, found keys {sorted(m)}")
    name = ctx.string(m["op"][1], f"{what}.op")
    params = ctx.plain(m["params"][1]) if "params" in m else {}
    if not isinstance(params, dict):
        raise ctx.err(m["params"][1], f"{what}.params: expected a mapping, found {_kind(m['params'][1])}")
    return {"op": name, "params": params, "line": node.start_mark.line + 1}


def _tensor(ctx: _Ctx, name: str, node: yaml.Node, section: str, params: Mapping[str, ParamSpec],
            inputs: Mapping[str, TensorSpec]) -> TensorSpec:
    what = f"{section}.{name}"
    m = ctx.section(node, "tensor", what)
    doc = ctx.string(m["doc"][1], f"{what}.doc")
    line = node.start_mark.line + 1
    optional = ctx.typed(m["optional"][1], (bool,), f"{what}.optional", "true or false") if "optional" in m else False
    if optional and section != "inputs":
        raise ctx.err(m["optional"][0], f"{what}: 'optional' is for inputs")
    positional = ctx.typed(m["positional"][1], (bool,), f"{what}.positional", "true or false") \
        if "positional" in m else False
    if "positional" in m and not optional:
        raise ctx.err(m["positional"][0], f"{what}: 'positional' is for optional inputs (required ones are positional)")
    written = ctx.typed(m["written"][1], (bool,), f"{what}.written", "true or false") if "written" in m else False
    if written and section != "inputs":
        raise ctx.err(m["written"][0], f"{what}: 'written' is for inputs (an output is always written)")
    distinct = ctx.typed(m["distinct"][1], (bool,), f"{what}.distinct", "true or false") if "distinct" in m else False
    if distinct and "range" not in m:
        raise ctx.err(m["distinct"][0], f"{what}: 'distinct' is for integer inputs with a 'range'")
    if written and optional:  # a traced call passes the written inputs by position after the outputs
        raise ctx.err(m["written"][0], f"{what}: 'written' is for required inputs, not optional ones")
    dtype_by = None
    if "dtype_by" in m:
        dtype_by = ctx.string(m["dtype_by"][1], f"{what}.dtype_by")
        p = params.get(dtype_by)
        if p is None or p.type not in (("str",) if section == "outputs" else ("str", "dtype")):
            raise ctx.err(m["dtype_by"][1], f"{what}.dtype_by: {dtype_by!r} is not a str param"
                                            + ("" if section == "outputs" else " or a dtype param"))
        if p.choices is None or not set(p.choices) <= set(DTYPES):
            raise ctx.err(m["dtype_by"][1], f"{what}.dtype_by: param {dtype_by!r} needs choices among "
                                            f"{', '.join(DTYPES)}")
        like_input = inputs.get(ctx.string(m["like"][1], f"{what}.like")) if "like" in m else None
        own_dtypes = (like_input.dtypes if like_input is not None else
                      ctx.strings(m["dtypes"][1], f"{what}.dtypes") if "dtypes" in m else None)
        if section == "inputs" and own_dtypes is not None and not set(p.choices) <= set(own_dtypes):
            raise ctx.err(m["dtype_by"][1], f"{what}.dtype_by: param {dtype_by!r} may choose "
                                            f"{', '.join(sorted(set(p.choices) - set(own_dtypes)))}, which the "
                                            f"input does not allow (its dtypes: {', '.join(own_dtypes)})")
    if "like" in m:
        like = ctx.string(m["like"][1], f"{what}.like")
        if like not in inputs:
            earlier = " (an input may be like an earlier input only)" if section == "inputs" else ""
            raise ctx.err(m["like"][1], f"{what}.like: {like!r} is not an input{earlier}; inputs: "
                                        f"{', '.join(inputs) or 'none'}")
        own: tuple[str, ...] = ()
        for key in ("shape", "shape_by", "dtypes", "range"):
            if key in m and not (key == "shape" and section == "outputs"):
                raise ctx.err(m[key][0], f"{what}: {key!r} cannot be given with 'like'")
        if "shape" in m:  # an output shaped its own way, typed like its input
            own = _dims(ctx, m["shape"][1], f"{what}.shape")
            names = {p for p, spec in params.items() if spec.type == "int"}
            names |= {d for t in inputs.values() for d in t.all_dims}
            unknown = [d for d in own if d not in names]
            if unknown or LEAD in own:
                raise ctx.err(m["shape"][1], f"{what}.shape: {(unknown or [LEAD])[0]!r} is neither a dim of an "
                                             f"input nor an int param")
        src = inputs[like]
        if section == "inputs" and dtype_by is None:  # an input like another takes its dtype the same way
            dtype_by = src.dtype_by
        return TensorSpec(name=name, doc=doc, dtypes=src.dtypes, shapes=src.shapes, shape_by=src.shape_by,
                          like=like, line=line, optional=optional if section == "inputs" else src.optional,
                          alternatives=src.alternatives, dtype_by=dtype_by, positional=positional,
                          written=written, own_shape=own)
    if dtype_by is not None and section == "outputs":
        raise ctx.err(m["dtype_by"][0], f"{what}: 'dtype_by' needs 'like' (the output's shape)")
    if "shape" not in m or "dtypes" not in m:
        raise ctx.err(node, f"{what}: needs 'shape' and 'dtypes' (or 'like')")
    dtypes = ctx.strings(m["dtypes"][1], f"{what}.dtypes")
    for d in dtypes:
        if d not in DTYPES:
            raise ctx.err(m["dtypes"][1], f"{what}.dtypes: unknown dtype {d!r}; known: {', '.join(DTYPES)}")
    shape_by = ctx.string(m["shape_by"][1], f"{what}.shape_by") if "shape_by" in m else None
    vrange = None
    if "range" in m:
        rnode = m["range"][1]
        if not isinstance(rnode, yaml.SequenceNode) or len(rnode.value) != 2:
            raise ctx.err(rnode, f"{what}.range: expected [low, high], two expressions")
        vrange = tuple(_parsed(ctx, n, str(ctx.scalar(n)), f"{what}.range") for n in rnode.value)
    snode = m["shape"][1]
    if shape_by is None:
        alternatives = {"": _shape_alternatives(ctx, snode, f"{what}.shape")}
    else:
        if shape_by not in params:
            raise ctx.err(m["shape_by"][1], f"{what}.shape_by: unknown param {shape_by!r}")
        sm = ctx.mapping(snode, f"{what}.shape")
        alternatives = {k: _shape_alternatives(ctx, v, f"{what}.shape.{k}") for k, (_, v) in sm.items()}
        choices = params[shape_by].choices
        if choices is not None and set(map(str, choices)) != set(alternatives):
            raise ctx.err(snode, f"{what}.shape: keys {sorted(alternatives)} must be the choices of {shape_by!r}: "
                                 f"{sorted(map(str, choices))}")
    shapes = {k: v[0] for k, v in alternatives.items()}
    if vrange is not None:
        dims = {d for alts in alternatives.values() for dd in alts for d in dd}
        dims |= {d for t in inputs.values() for d in t.all_dims}  # an earlier input's (a cache's slots)
        for b in vrange:
            unknown = sorted(b.names - set(params) - dims)
            if unknown:
                raise ctx.err(m["range"][1], f"{what}.range: {b.text!r} names unknown {', '.join(map(repr, unknown))}")
    return TensorSpec(name=name, doc=doc, dtypes=dtypes, shapes=shapes, shape_by=shape_by, range=vrange,
                      line=line, optional=optional, alternatives=alternatives, positional=positional,
                      written=written, distinct=distinct, dtype_by=dtype_by)


def _shape_alternatives(ctx: _Ctx, node: yaml.Node, what: str) -> tuple[tuple[str, ...], ...]:
    """``[d, ...]`` is one shape; ``[[d, ...], [d, ...]]`` alternatives told apart by their rank."""
    if isinstance(node, yaml.SequenceNode) and node.value and all(isinstance(v, yaml.SequenceNode) for v in node.value):
        alts = tuple(_dims(ctx, v, what) for v in node.value)
        if any(a[:1] == (LEAD,) for a in alts):  # ranks from len(a) - 1 up: no rank tells them apart
            raise ctx.err(node, f"{what}: a shape with leading {LEAD!r} takes every rank from its own up; it "
                                f"cannot have alternatives")
        ranks = [len(a) for a in alts]
        if len(set(ranks)) != len(ranks):
            raise ctx.err(node, f"{what}: alternative shapes must differ in their number of dims, got {ranks}")
        return alts
    return (_dims(ctx, node, what),)


def _dims(ctx: _Ctx, node: yaml.Node, what: str) -> tuple[str, ...]:
    dims = ctx.strings(node, what)
    for i, d in enumerate(dims):
        if d == LEAD and i == 0:
            continue
        if d == LEAD:
            raise ctx.err(node, f"{what}: {LEAD!r} (any leading dims) may only come first")
        if not d.isidentifier():
            raise ctx.err(node, f"{what}: dim names must be identifiers (or a first {LEAD!r}), found {d!r}")
    return dims


def _parsed(ctx: _Ctx, node: yaml.Node, text: str, what: str) -> Expr:
    """``text`` (of ``node``) parsed as an expression of the manifests' rule language, or the error of
    ``what`` that says why it does not parse."""
    try:
        return parse_expr(text)
    except ExprError as e:
        raise ctx.err(node, f"{what}: {_clip(text)} does not parse: {e}") from None


def _rule(ctx: _Ctx, node: yaml.Node, params: Mapping[str, ParamSpec], dims: frozenset[str],
          args: set[str], inputs: Iterable[str] = ()) -> Rule:
    m = ctx.section(node, "rule", "rules[]")
    cnode = m["check"][1]
    text = ctx.string(cnode, "rules[].check")
    expr = _parsed(ctx, cnode, text, "rules[].check")
    dtypes = {DTYPE_PREFIX + n for n in inputs}
    unknown = sorted(expr.names - set(params) - dims - dtypes)
    if unknown:
        raise ctx.err(cnode, f"rules[].check: {text!r} names unknown {', '.join(map(repr, unknown))}; "
                             f"params: {', '.join(params)}; dims: {', '.join(sorted(dims))}; dtypes: "
                             f"{', '.join(sorted(dtypes)) or 'none'}")
    arg = ctx.string(m["arg"][1], "rules[].arg")
    if arg not in args:
        raise ctx.err(m["arg"][1], f"rules[].arg: {arg!r} is neither a param nor an input")
    return Rule(check=expr, arg=arg, message=ctx.string(m["message"][1], "rules[].message"),
                line=node.start_mark.line + 1, needs_dims=bool(expr.names & (dims | dtypes)))


def _case(ctx: _Ctx, node: yaml.Node, op: dict[str, Any]) -> Case:
    m = ctx.section(node, "case", "cases[]")
    label = ctx.string(m["label"][1], "cases[].label")
    what = f"cases[{label}]"
    params: dict[str, Any] = {}
    if "params" in m:
        for key, (knode, vnode) in ctx.mapping(m["params"][1], f"{what}.params").items():
            if key not in op["params"]:
                raise ctx.err(knode, f"{what}.params: unknown param {key!r}")
            spec = op["params"][key]
            params[key] = _value_of_type(ctx, vnode, spec.type, spec.optional, f"{what}.params.{key}")
            if spec.choices is not None and params[key] not in spec.choices:
                raise ctx.err(vnode, f"{what}.params.{key}: {params[key]!r} is not among {list(spec.choices)}")
    full = {p.name: p.default for p in op["params"].values() if p.has_default} | params
    missing = [p.name for p in op["params"].values() if not p.has_default and p.name not in params]
    if missing:
        raise ctx.err(node, f"{what}: required params not given: {', '.join(missing)}")
    with_inputs = ctx.strings(m["with"][1], f"{what}.with") if "with" in m else ()
    for w in with_inputs:
        if w not in op["inputs"] or not op["inputs"][w].optional:
            optional = [t.name for t in op["inputs"].values() if t.optional]
            raise ctx.err(m["with"][1], f"{what}.with: {w!r} is not an optional input; optional inputs: "
                                        f"{', '.join(optional) or 'none'}")
    needed: set[str] = set()
    for t in op["inputs"].values():
        if not t.optional or t.name in with_inputs:
            needed |= set(t.shape_for(full)) - {LEAD}
    lead: tuple[int, ...] = ()
    if "lead" in m:
        lnode = m["lead"][1]
        if not any(t.leading for t in op["inputs"].values()):
            raise ctx.err(m["lead"][0], f"{what}.lead: no input's shape starts with {LEAD!r}")
        if not isinstance(lnode, yaml.SequenceNode):
            raise ctx.err(lnode, f"{what}.lead: expected a list of sizes, found {_kind(lnode)}")
        lead = tuple(ctx.typed(n, (int,), f"{what}.lead", "an integer") for n in lnode.value)
        if any(v < 1 for v in lead):
            raise ctx.err(lnode, f"{what}.lead: expected positive sizes, found {list(lead)}")
    dims: dict[str, int] = {}
    for key, (knode, vnode) in ctx.mapping(m["dims"][1], f"{what}.dims").items():
        if key not in op["dims"]:
            raise ctx.err(knode, f"{what}.dims: unknown dim {key!r}; dims: {', '.join(sorted(op['dims']))}")
        val = ctx.typed(vnode, (int,), f"{what}.dims.{key}", "an integer")
        if val < 1:
            raise ctx.err(vnode, f"{what}.dims.{key}: expected a positive size, found {val}")
        dims[key] = val
    if needed - set(dims):
        raise ctx.err(m["dims"][1], f"{what}.dims: missing {', '.join(sorted(needed - set(dims)))}")
    allowed = op["inputs"][next(iter(op["inputs"]))].dtypes if op["inputs"] else ()
    dtypes = ctx.strings(m["dtypes"][1], f"{what}.dtypes") if "dtypes" in m else tuple(allowed)
    for d in dtypes:
        if d not in allowed:
            raise ctx.err(m["dtypes"][1], f"{what}.dtypes: {d!r} is not allowed; allowed: {', '.join(allowed)}")
    bench = ctx.typed(m["bench"][1], (bool,), f"{what}.bench", "true or false") if "bench" in m else True
    for dtype in dtypes:  # the case's inputs: each floating one in the case's dtype, integers in int64
        given = [t for t in op["inputs"].values() if not t.optional or t.name in with_inputs]
        env = full | dims | {DTYPE_PREFIX + t.name: None for t in op["inputs"].values()} | {
            DTYPE_PREFIX + t.name: t.case_dtype(dtype, full) for t in given}
        for rule in op["rules"]:
            if not rule.check.names <= env.keys():
                continue  # about dims of another layout: the op checks a rule when the call has its dims
            try:
                ok = rule.check.evaluate(env)
            except ExprError as e:
                raise ctx.err(node, f"{what}: rule {rule.check.text!r} cannot be evaluated: {e}") from None
            if not ok:
                raise ctx.err(node, f"{what}: breaks rule {rule.check.text!r} ({rule.message}) "
                                    f"(rule at line {rule.line})")
    return Case(label=label, dims=dims, params=params, dtypes=dtypes, bench=bench, line=node.start_mark.line + 1,
                with_inputs=with_inputs, lead=lead)


def _op(ctx: _Ctx, name: str, key: yaml.Node, node: yaml.Node, builders: Iterable[str]) -> OpManifest:
    if not name.isidentifier():
        raise ctx.err(key, f"op name {name!r} must be a class name")
    m = ctx.section(node, "op", name, owner=key)
    params: dict[str, ParamSpec] = {}
    for pname, (knode, vnode) in ctx.mapping(m["params"][1], "params").items():
        if not pname.isidentifier():
            raise ctx.err(knode, f"params: {pname!r} is not an identifier")
        params[pname] = _param(ctx, pname, vnode)
    _check_signature_order(ctx, tuple(params.values()))
    inputs: dict[str, TensorSpec] = {}
    for tname, (_, vnode) in ctx.mapping(m["inputs"][1], "inputs").items():
        inputs[tname] = _tensor(ctx, tname, vnode, "inputs", params, dict(inputs))
        t, before = inputs[tname], list(inputs.values())[:-1]
        if not t.optional and any(b.optional for b in before):  # forward's positional order is the manifest's
            raise ctx.err(vnode, f"inputs.{tname}: a required input after optional "
                                 f"{next(b.name for b in before if b.optional)!r}; required inputs come first")
        if t.positional and any(b.optional and not b.positional for b in before):
            raise ctx.err(vnode, f"inputs.{tname}: a positional optional input after keyword-only "
                                 f"{next(b.name for b in before if b.optional and not b.positional)!r}")
    outputs = {t: _tensor(ctx, t, v, "outputs", params, inputs)
               for t, (_, v) in ctx.mapping(m["outputs"][1], "outputs").items()}
    clash = set(params) & set(inputs)
    if clash:
        raise ctx.err(m["inputs"][1], f"inputs: {', '.join(sorted(clash))} is also a param")
    clash = set(params) & {DTYPE_PREFIX + n for n in inputs}
    if clash:
        raise ctx.err(m["params"][1], f"params: {', '.join(sorted(clash))} is the name rules give an input's dtype")
    dims: frozenset[str] = frozenset().union(*(t.all_dims for t in inputs.values())) if inputs else frozenset()
    rules: list[Rule] = []
    if "rules" in m:
        rnode = m["rules"][1]
        if not isinstance(rnode, yaml.SequenceNode):
            raise ctx.err(rnode, f"rules: expected a list, found {_kind(rnode)}")
        rules = [_rule(ctx, r, params, dims, set(params) | set(inputs), inputs) for r in rnode.value]
    backward = _backward(ctx, m["backward"][1], inputs, outputs) if "backward" in m else None
    km = ctx.section(m["kernel"][1], "kernel", "kernel")
    builder = ctx.string(km["builder"][1], "kernel.builder")
    builders = tuple(builders)
    if builder not in builders:
        raise ctx.err(km["builder"][1], f"kernel.builder: unknown builder {builder!r}; known: {', '.join(builders)}")
    static = _static(ctx, km["static"][1], builder, params) if "static" in km else {}
    specialize = ctx.strings(km["specialize"][1], "kernel.specialize") if "specialize" in km else ()
    for d in specialize:
        if d not in dims:
            raise ctx.err(km["specialize"][1], f"kernel.specialize: unknown dim {d!r}; dims: {', '.join(sorted(dims))}")
    # `rows` in kernel.tune.tokens: the product of an input's leading dims (a norm's rows)
    tune_dims = dims | {ROWS} if any(spec.leading for spec in inputs.values()) else dims
    tune = _tune(ctx, km["tune"][1], frozenset(tune_dims), params) if "tune" in km else None
    kernel = KernelSpec(builder=builder, static=static, specialize=specialize,
                        line=m["kernel"][1].start_mark.line + 1, tune=tune)
    shrink = None
    if "cpu_shrink" in m:
        sm = ctx.section(m["cpu_shrink"][1], "cpu_shrink", "cpu_shrink")
        sdims = ctx.strings(sm["dims"][1], "cpu_shrink.dims")
        leading = any(t.leading for t in inputs.values())
        for d in sdims:
            if d not in dims and not (d == LEAD and leading):
                raise ctx.err(sm["dims"][1], f"cpu_shrink.dims: unknown dim {d!r}")
        shrink = CpuShrink(dims=sdims, max_elements=ctx.typed(sm["max_elements"][1], (int,),
                                                                "cpu_shrink.max_elements", "an integer"))
    cnode = m["cases"][1]
    if not isinstance(cnode, yaml.SequenceNode) or not cnode.value:
        raise ctx.err(cnode, "cases: expected a non-empty list")
    partial = {"params": params, "inputs": inputs, "rules": rules, "dims": dims}
    cases = []
    seen: set[str] = set()
    for c in cnode.value:
        case = _case(ctx, c, partial)
        if case.label in seen:
            raise ctx.err(c, f"cases: duplicate label {case.label!r}")
        seen.add(case.label)
        cases.append(case)
    compose = _compose_section(ctx, m["compose"][1], params, inputs) if "compose" in m else ()
    flags = _flags(ctx, m["flags"][1], set(params) | set(inputs) | set(outputs)) if "flags" in m else ()
    return OpManifest(
        name=name, family=ctx.string(m["family"][1], "family"), summary=ctx.string(m["summary"][1], "summary"),
        description=ctx.string(m["description"][1], "description") if "description" in m else "",
        references=ctx.strings(m["references"][1], "references") if "references" in m else (),
        examples=ctx.strings(m["examples"][1], "examples") if "examples" in m else (),
        hooks=_hooks(ctx, m["hooks"][1]),
        params=tuple(params.values()), inputs=tuple(inputs.values()), outputs=tuple(outputs.values()),
        rules=tuple(rules), kernel=kernel, cases=tuple(cases), cpu_shrink=shrink, file=ctx.file,
        line=key.start_mark.line + 1, backward=backward, compose=compose, flags=flags,
    )


def _flags(ctx: _Ctx, node: yaml.Node, taken: set[str]) -> tuple[FlagSpec, ...]:
    """``flags``: each an identifier no param, input or output has, with its doc."""
    out = []
    for fname, (knode, vnode) in ctx.mapping(node, "flags").items():
        if not fname.isidentifier() or fname in taken:
            raise ctx.err(knode, f"flags: {fname!r} must be an identifier no param, input or output has")
        f = ctx.section(vnode, "flag", f"flags.{fname}", owner=knode)
        out.append(FlagSpec(fname, ctx.string(f["doc"][1], f"flags.{fname}.doc"), knode.start_mark.line + 1))
    return tuple(out)


def _compose_section(ctx: _Ctx, node: yaml.Node, params: Mapping[str, ParamSpec],
                     inputs: Mapping[str, TensorSpec]) -> tuple[ComposeStage, ...]:
    """``compose``: each stage checked against this file (its param, switch and inputs); where it
    comes from is resolved once every file is read (:func:`resolve_compose`)."""
    stages = []
    for sname, (knode, vnode) in ctx.mapping(node, "compose").items():
        what = f"compose.{sname}"
        m = ctx.section(vnode, "compose", what, owner=knode)
        source = ctx.string(m["from"][1], f"{what}.from") if "from" in m else ""
        parts = source.split("/")
        if source and (len(parts) > 2 or not all(p.isidentifier() for p in parts)):
            raise ctx.err(m["from"][1], f"{what}.from: expected a family or family/OpName, found {source!r}")
        param = ctx.string(m["param"][1], f"{what}.param") if "param" in m else None
        if param is not None and (param not in params or params[param].type != "op"):
            raise ctx.err(m["param"][1], f"{what}.param: {param!r} is not a param of type op")
        when = ctx.string(m["when"][1], f"{what}.when") if "when" in m else None
        if when is not None and (when not in params or params[when].type != "bool"):
            raise ctx.err(m["when"][1], f"{what}.when: {when!r} is not a bool param")
        used = ctx.strings(m["inputs"][1], f"{what}.inputs") if "inputs" in m else ()
        for n in used:
            if n not in inputs:
                raise ctx.err(m["inputs"][1], f"{what}.inputs: {n!r} is not an input; inputs: {', '.join(inputs)}")
        stages.append(ComposeStage(name=sname, source=source, doc=ctx.string(m["doc"][1], f"{what}.doc"),
                                   param=param, when=when, inputs=used, line=knode.start_mark.line + 1))
    return tuple(stages)


def resolve_compose(ops: dict[str, OpManifest]) -> dict[str, OpManifest]:
    """``ops`` with every ``compose`` stage resolved to the manifests it names (``ComposeStage.ops``):
    an unknown family or op, an op of another family, a case's op of another family, or a cycle
    (an op composed, directly or through others, of itself) is a :class:`ManifestError` at the
    stage's line naming its key."""
    families: dict[str, list[str]] = {}
    for m in ops.values():
        families.setdefault(m.family, []).append(m.name)
    out = dict(ops)
    for m in ops.values():
        if not m.compose:
            continue
        stages = []
        for st in m.compose:
            what = f"{m.name}: compose.{st.name}.from"
            if not st.source:  # the op's own stage
                stages.append(st)
                continue
            if st.family not in families:
                raise ManifestError(m.file, st.line, f"{what}: unknown family {st.family!r}; families: "
                                                     f"{', '.join(sorted(families))}")
            if st.op is not None and (st.op not in ops or ops[st.op].family != st.family):
                raise ManifestError(m.file, st.line, f"{what}: no op {st.op!r} in family {st.family!r}; its ops: "
                                                     f"{', '.join(sorted(families[st.family]))}")
            stages.append(dataclasses.replace(st, ops=(st.op,) if st.op else tuple(sorted(families[st.family]))))
        for case in m.cases:  # a case's op for a stage's param: an op of that stage's family
            for st in stages:
                value = case.params.get(st.param) if st.param else None
                if isinstance(value, dict) and value["op"] not in st.ops:
                    raise ManifestError(m.file, value["line"], f"{m.name}: cases[{case.label}].params.{st.param}: "
                                                               f"{value['op']!r} is not among compose.{st.name}'s "
                                                               f"ops ({', '.join(st.ops)})")
        out[m.name] = dataclasses.replace(m, compose=tuple(stages))
    for name in out:  # a cycle: an op reachable from itself through the stages' ops
        path = _cycle(out, name, [name])
        if path:
            first = out[name]
            st = next(s for s in first.compose if path[1] in s.ops)
            raise ManifestError(first.file, st.line, f"{name}: compose.{st.name}.from: a cycle: {' -> '.join(path)}")
    return out


def _cycle(ops: Mapping[str, OpManifest], start: str, path: list[str]) -> list[str] | None:
    """A path of composition from ``path[-1]`` back to ``start``, or None."""
    for st in ops[path[-1]].compose:
        for nxt in st.ops:
            if nxt == start:
                return [*path, nxt]
            if nxt not in path and ops.get(nxt) is not None and ops[nxt].compose:
                found = _cycle(ops, start, [*path, nxt])
                if found:
                    return found
    return None


def _backward(ctx: _Ctx, node: yaml.Node, inputs: Mapping[str, TensorSpec],
              outputs: Mapping[str, TensorSpec]) -> Backward:
    bm = ctx.section(node, "backward", "backward")
    wnode = bm["wrt"][1]
    wrt = ctx.strings(wnode, "backward.wrt") if isinstance(wnode, yaml.SequenceNode) else (
        ctx.string(wnode, "backward.wrt"),)
    reduce = ctx.strings(bm["reduce"][1], "backward.reduce") if "reduce" in bm else ()
    for r in reduce:
        if r not in wrt:
            raise ctx.err(bm["reduce"][1], f"backward.reduce: {r!r} is not in backward.wrt ({', '.join(wrt)})")
    for w in wrt:
        if w not in inputs:
            raise ctx.err(wnode, f"backward.wrt: {w!r} is not an input; inputs: {', '.join(inputs)}")
        if not set(inputs[w].dtypes) <= {"float16", "bfloat16", "float32", "float64"}:
            raise ctx.err(wnode, f"backward.wrt: {w!r} is not a floating-point input")
        if w not in reduce and not any(o.like == w for o in outputs.values()):
            raise ctx.err(wnode, f"backward.wrt: no output is like {w!r}, so it has no gradient to take (an input "
                                 f"whose gradient sums over rows is listed in backward.reduce)")
    if inputs[wrt[0]].optional:
        raise ctx.err(wnode, f"backward.wrt: the first, {wrt[0]!r}, must be a required input")
    saves: list[tuple[str, ...]] = []
    if "saves" in bm:
        snode = bm["saves"][1]
        if not isinstance(snode, yaml.SequenceNode):
            raise ctx.err(snode, f"backward.saves: expected a list, found {_kind(snode)}")
        for entry in snode.value:
            names = ctx.strings(entry, "backward.saves[]") if isinstance(entry, yaml.SequenceNode) else (
                ctx.string(entry, "backward.saves[]"),)
            if not names:
                raise ctx.err(entry, "backward.saves[]: expected a name or a non-empty list of names")
            for n in names:
                if n not in inputs and n not in outputs:
                    raise ctx.err(entry, f"backward.saves: {n!r} is neither an input nor an output; inputs: "
                                         f"{', '.join(inputs)}; outputs: {', '.join(outputs)}")
            saves.append(names)
    return Backward(wrt=wrt, doc=ctx.string(bm["doc"][1], "backward.doc"), line=node.start_mark.line + 1,
                    reduce=reduce, saves=tuple(saves))


def _hooks(ctx: _Ctx, node: yaml.Node) -> str:
    name = ctx.string(node, "hooks")
    if not name.isidentifier():
        raise ctx.err(node, f"hooks: expected a class name in tileops/<family>/hooks.py, found {name!r}")
    return name


def _static(ctx: _Ctx, node: yaml.Node, builder: str, params: dict) -> dict[str, Any]:
    """``kernel.static`` checked against the builder's schedule choices (``tileops.kernels.STATIC``):
    known keys only, each an integer in its range or a map from every ``input_layout`` choice to one; a
    key whose range is ``(False, True)`` is a switch, and takes a bool (``true``/``false``)."""
    from tileops.kernels import STATIC

    allowed = STATIC.get(builder, {})
    out: dict[str, Any] = {}

    def choice(vnode: yaml.Node, what: str, low: int, high: int) -> int:
        if low is False and high is True:
            return ctx.typed(vnode, (bool,), what, "a bool (true or false)")
        value = ctx.typed(vnode, (int,), what, "an integer")
        if not low <= value <= high:
            raise ctx.err(vnode, f"{what}: expected an integer in [{low}, {high}], found {value}")
        return value

    for key, (knode, vnode) in ctx.mapping(node, "kernel.static").items():
        if key not in allowed:
            known = ", ".join(allowed) or "none"
            raise ctx.err(knode, f"kernel.static: unknown key {key!r} for builder {builder!r}; allowed: {known}")
        low, high, _ = allowed[key]
        what = f"kernel.static.{key}"
        if not isinstance(vnode, yaml.MappingNode):
            out[key] = choice(vnode, what, low, high)
            continue
        layout = params.get("input_layout")
        choices = getattr(layout, "choices", None)
        if not choices:
            raise ctx.err(vnode, f"{what}: a map by layout needs a param `input_layout` with choices; give one integer")
        by_layout = {}
        for lk, (lknode, lvnode) in ctx.mapping(vnode, what).items():
            if lk not in choices:
                raise ctx.err(lknode, f"{what}: {lk!r} is not an input_layout; choices: {', '.join(map(str, choices))}")
            by_layout[lk] = choice(lvnode, f"{what}.{lk}", low, high)
        missing = [c for c in choices if c not in by_layout]
        if missing:
            raise ctx.err(vnode, f"{what}: no value for input_layout {', '.join(map(repr, missing))}")
        out[key] = by_layout
    return out


def _expr_over(ctx: _Ctx, node: yaml.Node, what: str, names: "set[str] | frozenset[str]", kind: str) -> Expr:
    """An expression of ``kernel.tune`` that parses and names only ``names`` (``kind`` says what they are)."""
    text = ctx.string(node, f"{what}[]")
    expr = _parsed(ctx, node, text, what)
    unknown = sorted(expr.names - names)
    if unknown:
        raise ctx.err(node, f"{what}: {text!r} names {', '.join(map(repr, unknown))}, which is not {kind}: "
                            f"{', '.join(sorted(names))}")
    return expr


def _tune(ctx: _Ctx, node: yaml.Node, dims: frozenset[str], params: Mapping[str, ParamSpec]) -> Tuning:
    """``kernel.tune``: each backend's knobs checked against their builder's ``STATIC`` (known builder
    and knob, every candidate in range, no knob name twice in a backend: rules name knobs bare), its
    rules parsed and naming knobs only; the token expressions naming dims only; the buckets rising, and
    those of ``dim_buckets`` each of a dim of the inputs."""
    from tileops.kernels import STATIC

    tm = ctx.section(node, "tune", "kernel.tune")
    tokens: list[Expr] = []
    for tnode in (tm["tokens"][1].value if "tokens" in tm and isinstance(tm["tokens"][1], yaml.SequenceNode)
                  else [tm["tokens"][1]] if "tokens" in tm else []):
        tokens.append(_expr_over(ctx, tnode, "kernel.tune.tokens", dims, "a dim; dims"))
    buckets: tuple[int, ...] = ()
    if "buckets" in tm:
        buckets = _edges(ctx, tm["buckets"][1], "kernel.tune.buckets")
        if not tokens:
            raise ctx.err(tm["buckets"][1], "kernel.tune.buckets: given without `tokens`, the count they bucket")
    dim_buckets: list[tuple[str, tuple[int, ...]]] = []
    if "dim_buckets" in tm:
        for dim, (dknode, dvnode) in ctx.mapping(tm["dim_buckets"][1], "kernel.tune.dim_buckets").items():
            if dim not in dims:
                raise ctx.err(dknode, f"kernel.tune.dim_buckets: {dim!r} is not a dim of the op's inputs; dims: "
                                      f"{', '.join(sorted(dims))}")
            edges = _edges(ctx, dvnode, f"kernel.tune.dim_buckets.{dim}")
            if not edges:
                raise ctx.err(dvnode, f"kernel.tune.dim_buckets.{dim}: expected at least one edge, found none")
            dim_buckets.append((dim, edges))
    spaces: dict[str, TuneSpace] = {}
    for backend in ("cuda", "c"):
        if backend not in tm:
            continue
        what = f"kernel.tune.{backend}"
        sm = ctx.section(tm[backend][1], "tune_space", what, tm[backend][0])
        knobs: list[tuple[str, str, tuple[Any, ...]]] = []
        for builder, (bknode, bvnode) in ctx.mapping(sm["knobs"][1], f"{what}.knobs").items():
            if builder not in STATIC:
                raise ctx.err(bknode, f"{what}.knobs: unknown builder {builder!r}; known: {', '.join(STATIC)}")
            allowed = STATIC[builder]
            for knob, (kknode, kvnode) in ctx.mapping(bvnode, f"{what}.knobs.{builder}").items():
                kwhat = f"{what}.knobs.{builder}.{knob}"
                if knob not in allowed:
                    raise ctx.err(kknode, f"{kwhat}: unknown knob for builder {builder!r}; its knobs: "
                                          f"{', '.join(allowed) or 'none'}")
                if any(k == knob for _, k, _ in knobs):
                    raise ctx.err(kknode, f"{kwhat}: a knob of this name is already in {what} (rules name knobs "
                                          f"bare, so a backend's names must differ)")
                if not isinstance(kvnode, yaml.SequenceNode) or not kvnode.value:
                    raise ctx.err(kvnode, f"{kwhat}: expected a non-empty list of candidate values, "
                                          f"found {_kind(kvnode)}")
                low, high, _ = allowed[knob]
                values = []
                for v in kvnode.value:
                    if low is False and high is True:
                        values.append(ctx.typed(v, (bool,), f"{kwhat}[]", "a bool (true or false)"))
                        continue
                    value = ctx.typed(v, (int,), f"{kwhat}[]", "an integer")
                    if not low <= value <= high:
                        raise ctx.err(v, f"{kwhat}: expected integers in [{low}, {high}], found {value}")
                    values.append(value)
                if len(set(values)) != len(values):
                    raise ctx.err(kvnode, f"{kwhat}: a candidate value is listed twice: {values}")
                knobs.append((builder, knob, tuple(values)))
        rules: list[Expr] = []
        names = {k for _, k, _ in knobs}
        for rnode in (sm["rules"][1].value if "rules" in sm else []):
            rules.append(_expr_over(ctx, rnode, f"{what}.rules", names, "a knob of this space; knobs"))
        spaces[backend] = TuneSpace(knobs=tuple(knobs), rules=tuple(rules))
    by = ctx.strings(tm["by"][1], "kernel.tune.by") if "by" in tm else ()
    for name in by:
        if name not in params or params[name].type in ("tensor", "op"):
            raise ctx.err(tm["by"][1], f"kernel.tune.by: {name!r} is not a param of a plain value; params: "
                                       f"{', '.join(n for n, p in params.items() if p.type not in ('tensor', 'op'))}")
    return Tuning(spaces=spaces, tokens=tuple(tokens), buckets=buckets, dim_buckets=tuple(dim_buckets), by=by,
                  line=node.start_mark.line + 1)


def _edges(ctx: _Ctx, node: yaml.Node, what: str) -> tuple[int, ...]:
    """A bucket's upper edges: a list of rising positive integers."""
    if not isinstance(node, yaml.SequenceNode):
        raise ctx.err(node, f"{what}: expected a list of integers, found {_kind(node)}")
    edges = tuple(ctx.typed(b, (int,), f"{what}[]", "an integer") for b in node.value)
    if any(b < 1 for b in edges) or list(edges) != sorted(set(edges)):
        raise ctx.err(node, f"{what}: expected rising positive integers, found {list(edges)}")
    return edges


def _builders() -> tuple[str, ...]:
    from tileops.kernels import BUILDERS  # light: names only, no TileLang import

    return tuple(BUILDERS)


def load_file(path: str | Path, builders: Iterable[str] | None = None) -> list[OpManifest]:
    """Parse one manifest file (one or more ops keyed by class name)."""
    path = Path(path)
    ctx = _Ctx(str(path))
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise ManifestError(str(path), 0, f"cannot read: {e.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ManifestError(str(path), raw[: e.start].count(b"\n") + 1, "not UTF-8 text") from None
    _screen(str(path), text, len(raw) > MAX_FILE_BYTES)
    try:
        root = _compose(text, str(path))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 0
        raise ManifestError(str(path), line, f"not valid YAML: {getattr(e, 'problem', e)}") from None
    if root is None:
        raise ManifestError(str(path), 1, "empty manifest")
    names = tuple(builders) if builders is not None else _builders()
    return [_op(ctx, name, knode, vnode, names) for name, (knode, vnode) in ctx.mapping(root, "manifest").items()]


#: a manifest is data from a user's path: bounded before anything is built from it
MAX_FILE_BYTES = 1 << 20
MAX_LINE_CHARS = 16 * 1024
MAX_DEPTH = 16
#: the only tags a manifest may carry, explicit or resolved: YAML's plain data types
_PLAIN_TAGS = {None, "!"} | {f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null", "seq", "map")}


def _clip(text: str, n: int = 80) -> str:
    """``repr(text)``, cut to about ``n`` characters for an error message."""
    return repr(text) if len(text) <= n else repr(text[:n]) + f"... ({len(text)} characters)"


def _screen(file: str, text: str, too_big: bool) -> None:
    """Refuse, with FILE:LINE, what a data file has no business holding, before YAML reads it:
    overlong lines (a 10 MB string) and a file over ``MAX_FILE_BYTES``. Tags, anchors, aliases and
    nesting are refused while the file is composed (:class:`_ScreeningLoader`)."""
    for number, line in enumerate(text.split("\n"), 1):
        if len(line) > MAX_LINE_CHARS:
            raise ManifestError(file, number, f"line of {len(line)} characters; a manifest line may have at most "
                                              f"{MAX_LINE_CHARS}")
    if too_big:
        raise ManifestError(file, 1, f"file larger than {MAX_FILE_BYTES} bytes; a manifest is at most that")


def _compose(text: str, file: str) -> Any:
    """The document's root node, screened (:func:`_screen_event`) before any node is built. With
    libyaml, two passes in C: the events are screened, then the nodes composed (the packaged
    manifests in about a fifth of the time of one pass in Python). Without libyaml, and for a file
    libyaml finds invalid (whose error, and its line, should read the same everywhere), one pass in
    Python."""
    if getattr(yaml, "__with_libyaml__", False):
        try:
            return _compose_c(text, file)
        except yaml.YAMLError:
            pass  # the Python pass below reports it
    loader = _ScreeningLoader(text, file)
    try:
        return loader.get_single_node()
    finally:
        loader.dispose()


def _compose_c(text: str, file: str) -> Any:
    events = yaml.CSafeLoader(text)
    try:
        depth = 0
        while events.check_event():
            ev = events.get_event()
            if isinstance(ev, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
                continue
            depth = _screen_event(ev, file, depth)
    finally:
        events.dispose()
    loader = yaml.CSafeLoader(text)
    try:
        return loader.get_single_node()
    finally:
        loader.dispose()


def _screen_event(ev: Any, file: str, depth: int) -> int:
    """Refuse an alias, an anchor, a tag other than plain data's, or nesting deeper than
    ``MAX_DEPTH``, at the event's line; returns the depth below a node that starts here."""
    line = ev.start_mark.line + 1
    if isinstance(ev, yaml.AliasEvent):
        raise ManifestError(file, line, f"YAML alias *{ev.anchor} is not allowed in a manifest (anchors "
                                        f"and aliases can expand exponentially); write the value out")
    if getattr(ev, "anchor", None):
        raise ManifestError(file, line, f"YAML anchor &{ev.anchor} is not allowed in a manifest; write "
                                        f"the value out where it is used")
    tag = getattr(ev, "tag", None)
    if tag not in _PLAIN_TAGS:
        raise ManifestError(file, line, f"YAML tag {tag!r} is not allowed: a manifest holds plain data "
                                        f"(strings, numbers, booleans, null, lists, mappings)")
    if not isinstance(ev, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
        return depth
    depth += 1
    if depth > MAX_DEPTH:
        raise ManifestError(file, line, f"nested {depth} deep; a manifest nests at most {MAX_DEPTH} deep")
    return depth


class _ScreeningLoader(yaml.SafeLoader):
    """YAML's safe loader composing nodes, refusing before each node is built: tags that would
    construct objects, anchors and aliases (which can expand exponentially: "billion laughs"), and
    nesting deeper than ``MAX_DEPTH`` (refused on the way down, before Python's recursion limit)."""

    def __init__(self, stream: str, file: str):
        super().__init__(stream)
        self._file, self._depth = file, 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        ev = self.peek_event()
        depth = _screen_event(ev, self._file, self._depth)
        if depth == self._depth:  # not a collection
            return super().compose_node(parent, index)
        self._depth = depth
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def add_op(ops: dict[str, OpManifest], op: OpManifest) -> None:
    """Add ``op`` to ``ops``; a name declared twice is an error at the second declaration."""
    if op.name in ops:
        raise ManifestError(op.file, op.line, f"duplicate op {op.name!r}: first declared at {ops[op.name].where()}")
    ops[op.name] = op


def load_files(paths: Iterable[str | Path]) -> dict[str, OpManifest]:
    """Parse many files into {op name: manifest}; a name declared twice is an error."""
    out: dict[str, OpManifest] = {}
    for path in paths:
        for op in load_file(path):
            add_op(out, op)
    return resolve_compose(out)


def packaged_files() -> list[Path]:
    """The manifests shipped in the package (``manifests/`` in the source tree)."""
    root = importlib.resources.files("tileops.manifests")
    return sorted(Path(str(p)) for p in _walk(root) if str(p).endswith((".yaml", ".yml")))


def manifest_files() -> list[Path]:
    """Every family's manifests: the packaged ones, then those of each family root named by
    ``TILEOPS_FAMILY_PATH`` (``<root>/manifests/<family>/*.yaml``, :mod:`tileops.families`)."""
    from tileops.families import root_manifest_files

    return packaged_files() + root_manifest_files()


def _walk(root: Any) -> Iterable[Any]:
    for child in root.iterdir():
        if child.is_dir():
            yield from _walk(child)
        else:
            yield child


