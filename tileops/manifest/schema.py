"""The manifest model: frozen dataclasses for one op's YAML declaration.

Every key a manifest may hold is declared here, with its type and meaning, in ``SCHEMA``; the
loader (:mod:`tileops.manifest.loader`) rejects anything else, and the docs page on the manifest
format is generated from ``SCHEMA`` so the two cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from .expr import Expr

__all__ = [
    "SCHEMA", "PARAM_TYPES", "DTYPES", "LEAD", "DTYPE_PREFIX", "ParamSpec", "TensorSpec", "Rule", "KernelSpec",
    "Case", "Backward", "CpuShrink", "ComposeStage", "OpManifest", "FlagSpec", "TuneSpace", "Tuning",
]

#: Types a param may declare, and the Python types a value of it may have.
PARAM_TYPES: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "float": (float, int),
    "bool": (bool,),
    "ints": (list, tuple),  # a list of ints, held as a tuple (MRoPE's mrope_section)
    "tensor": (),  # a torch.Tensor, checked by the op; only None may be written in YAML
    "op": (),  # an op object of the family a `compose` stage names (the prologue's rope); None in YAML
    "dtype": (str,),  # a torch.dtype or its manifest name (held as the name), e.g. a cache's dtype
}

#: Dtype names a tensor may allow (torch's names).
DTYPES = ("float16", "bfloat16", "float32", "float64", "int32", "int64", "float8_e4m3fn")

#: The first entry of a shape that takes any number of leading dims (none included), which the
#: kernel sees as rows: ``["...", hidden]`` is ``[hidden]``, ``[tokens, hidden]``, ``[b, s, h, hidden]``.
LEAD = "..."
#: In ``kernel.tune.tokens``, the product of the leading dims (``LEAD``) of a call's first input that takes
#: them: the rows a norm normalises, the count its shape classes are bucketed by.
ROWS = "rows"

#: A rule names the dtype of input ``x`` as ``dtype_x``: its manifest name (``"bfloat16"``), or none
#: when the (optional) input is not given.
DTYPE_PREFIX = "dtype_"

# key -> (required, type description, meaning). Nested sections are keyed "section.key".
SCHEMA: dict[str, dict[str, tuple[bool, str, str]]] = {
    "op": {
        "family": (True, "str", "The op family; ops of one family share a package (`tileops.<family>`, in the tree "
                                "or in a `TILEOPS_FAMILY_PATH` root)."),
        "summary": (True, "str", "One line: what the op computes."),
        "description": (False, "str", "A paragraph or more for the docs."),
        "references": (False, "list[str]", "Public sources the op agrees with."),
        "examples": (False, "list[str]", "Doctest lines (`>>> ...`) for the class docstring's Examples section."),
        "hooks": (True, "str", "The class in `tileops/<family>/hooks.py` the generated op class inherits: the "
                               "family's behaviour (frequencies, checks the rules cannot express); it declares "
                               "no parameter."),
        "params": (True, "map[name -> param]", "Constructor parameters, in signature order."),
        "inputs": (True, "map[name -> tensor]", "Tensors `forward` takes, in call order."),
        "outputs": (True, "map[name -> tensor]", "Tensors `forward` returns."),
        "rules": (False, "list[rule]", "Constraints between params, dims and the inputs' dtypes, in the rule "
                                       "language."),
        "backward": (False, "backward", "The op's gradient: which inputs it is differentiable in, computed by "
                                        "the family's backward kernels."),
        "kernel": (True, "kernel", "The kernel builder in `kernels/` that serves the op."),
        "cpu_shrink": (False, "cpu_shrink", "How cases are scaled down when tests run on the CPU."),
        "cases": (True, "list[case]", "Labelled workloads used by tests, benchmarks and `tileops demo`."),
        "flags": (False, "map[name -> flag]",
                  ("Bool keyword-only arguments of `forward`, after the outputs, default false, each asking for "
                   "something the call returns besides its outputs (attention's `return_lse`). The family's hooks "
                   "serve a call that sets one (`_flagged_call`); a call that sets none runs as any other.")),
        "compose": (False, "map[stage -> compose]",
                    "The stages a fused op is composed of, each naming the manifests it comes from (see "
                    "\"Adding an op\", composed ops). Every reference is resolved when the manifests are "
                    "loaded: an unknown family or op, or a cycle, is an error at FILE:LINE naming the key."),
    },
    "compose": {
        "from": (False, "str", "Where the stage comes from: a family (`rope`: any op of it, passed as the "
                               "constructor param `param` names) or one op, `family/OpName` "
                               "(`norm/RMSNormFwdOp`). Absent: a stage of the op's own builder, declared by "
                               "no other manifest yet (the prologue's cache write)."),
        "param": (False, "str", "The constructor param (of type `op`) holding the stage's op object; its "
                                "family must be the one `from` names."),
        "when": (False, "str", "A `bool` param: the stage runs only when it is true (default: always)."),
        "inputs": (False, "list[str]", "The call's inputs the stage reads beyond the op's main ones (a norm's "
                                       "weights, a cache's scales)."),
        "doc": (True, "str", "What the stage does in the fused op, for the API reference."),
    },
    "flag": {
        "doc": (True, "str", "What the flag asks for and what the call then returns, for the API reference."),
    },
    "param": {
        "type": (True, "str", f"One of {', '.join(PARAM_TYPES)}."),
        "default": (False, "value", "The default; a param without one is required."),
        "optional": (False, "bool", "Whether None is accepted (default false)."),
        "choices": (False, "list", "The only values accepted."),
        "doc": (True, "str", "What the param means, for the API reference."),
        "keyword_only": (False, "bool", "Whether the param comes after `*` in the signature (default false). A "
                                        "param added to an op after its signature was published is keyword-only, "
                                        "so calls written against the published signature keep their meaning; "
                                        "keyword-only params follow every positional one (else an error at "
                                        "FILE:LINE)."),
    },
    "backward": {
        "wrt": (True, "str | list[str]", "The inputs the op is differentiable in, the first one required; their "
                                         "gradients are the backward's outputs. Each is an input some output is "
                                         "like, or one `reduce` names."),
        "reduce": (False, "list[str]", "Inputs of `wrt` no output is like (a norm's weight and bias): each one's "
                                       "gradient has the input's shape and sums a contribution of every row "
                                       "(computed on the device by the family's kernels)."),
        "saves": (False, "list[str | list[str]]",
                  "Inputs and outputs the backward kernels read: kept for the backward by autograd, which then "
                  "refuses a backward after one of them was modified in place. An entry that is a list keeps the "
                  "first of its names the call has (a norm's `[residual_out, x]`: the sum it normalised when "
                  "the residual was given, else x). Inputs not in `wrt` are always kept."),
        "doc": (True, "str", "What the backward computes, for the API reference."),
    },
    "tensor": {
        "doc": (True, "str", "What the tensor holds."),
        "optional": (False, "bool", "For inputs: may be omitted (None), a keyword-only argument of `forward` "
                                    "(see `positional`)."),
        "positional": (False, "bool", "For optional inputs: a positional-or-keyword argument of `forward`, "
                                      "default None, after the required inputs (which it must follow in the "
                                      "manifest), rather than a keyword-only one (default false)."),
        "dtypes": (False, "list[str]", f"Allowed dtypes, among {', '.join(DTYPES)}."),
        "shape": (False, "list[dim] | map[layout -> list[dim]]",
                  "Shape over named dims; a map keyed by the value of the `shape_by` param. A list of lists "
                  "gives alternatives told apart by their number of dims; workloads use the first. A first "
                  "entry `\"...\"` stands for any number of leading dims, none included (`[\"...\", hidden]`: "
                  "`[hidden]`, `[tokens, hidden]`, `[batch, seq, heads, hidden]`); they have no names, and a "
                  "case gives their sizes as `lead`."),
        "shape_by": (False, "str", "The param whose value picks the shape from `shape`."),
        "like": (False, "str", "The input this tensor is shaped and typed like. An output: same shape and "
                               "dtype (see `dtype_by`), produced when that input is given. An input: exactly "
                               "that earlier input's shape and dtype when both are given (leading dims "
                               "included), checked at every call; it takes the other's `shape` and `dtypes`. "
                               "An output may give its own `shape` with `like` (over dims and int params: "
                               "the prologue's q, `[tokens, num_q_heads, head_dim]`): then only its dtype and "
                               "its presence follow the like input."),
        "dtype_by": (False, "str", "For outputs: the `str` param whose value, a dtype name, is the output's "
                                   "dtype; None means the `like` input's. For inputs: the `dtype` or `str` "
                                   "param that, when set, is the input's dtype in the generated cases "
                                   "(the prologue's caches follow `cache_dtype`; None: the case's dtype). "
                                   "The op's rules still say what a call may pass."),
        "range": (False, "list[expr, expr]",
                  "For integer inputs: valid values lie in [low, high), two expressions over params and dims (the "
                  "tensor's own and those of earlier inputs)."),
        "distinct": (False, "bool", "For integer inputs with a `range`: the non-negative values of one call are "
                                    "pairwise distinct (a slot mapping; a negative value may repeat). Not "
                                    "checked at run time: it tells the generated inputs to draw without "
                                    "replacement and documents the contract (default false)."),
        "written": (False, "bool", "For inputs: the op writes into it in place (a KV cache): it is never "
                                   "returned, and may share memory with no other argument (default false)."),
    },
    "rule": {
        "check": (True, "expr", "An expression over params, dims and the inputs' dtypes that must be true. "
                                "`dtype_<input>` is an input's dtype name (`'bfloat16'`), or none when an "
                                "optional input is not given; a rule naming a dim or a dtype is checked at "
                                "the call, the others at construction."),
        "arg": (True, "str", "The argument an error names when the rule fails."),
        "message": (True, "str", "What is expected, in words."),
    },
    "kernel": {
        "builder": (True, "str", "The builder: the name of a module `kernels/<builder>.py` (in the tree or a family "
                                 "root) that defines `build`, `Spec` and `STATIC`."),
        "static": (False, "map", "The builder's schedule choices, each an integer in the range the builder's "
                                 "`STATIC` declares (`tileops.kernels.STATIC`; for `rope`: `threads`, "
                                 "`head_lanes`, `tokens_per_thread`), or a bool where the range is `(False, True)` "
                                 "(a switch); unknown keys and values out of range are errors at FILE:LINE. A "
                                 "value may instead map every `input_layout` choice to one."),
        "specialize": (False, "list[dim]", "Dims a kernel is compiled for (e.g. head_dim); every other dim is "
                                           "dynamic, so new sizes of it reuse the compiled kernel."),
        "tune": (False, "map", "The schedule space `tileops tune` searches, and the shape classes a tuned "
                               "choice is kept for (`docs/tuning.md`): a `tune` section."),
    },
    "tune": {
        "tokens": (False, "list[expr]", "The token count a shape class is bucketed by: the first of these "
                                        "expressions over dims whose every name a call has (`batch * seq_q`, "
                                        "then `total_q` for a varlen call)."),
        "buckets": (False, "list[int]", "Rising upper edges of the token buckets (`[2048, 16384]`: up to 2,048, up "
                                        "to 16,384, and more); a class is also keyed by the specialized dims and "
                                        "the dtypes."),
        "dim_buckets": (False, "map[dim -> list[int]]", "Dims a shape class is also bucketed by, each with its rising "
                                                        "upper edges (`{seq_k: [2048]}`: the keys a sequence has, "
                                                        "which the token count cannot tell: 16 x 1,024 and "
                                                        "1 x 16,384 are both 16,384 tokens); a dim a call lacks "
                                                        "(a varlen call's `seq_k`) adds nothing."),
        "by": (False, "list[param]", "Params a shape class is also keyed by, where they change the kernels "
                                     "(`causal`, `input_layout`): a choice tuned for one value never serves another."),
        "cuda": (False, "map", "The CUDA schedule space: a `tune_space` section."),
        "c": (False, "map", "The C (CPU) schedule space: a `tune_space` section."),
    },
    "tune_space": {
        "knobs": (True, "map[builder -> map[knob -> list[int]]]", "Candidate values of schedule knobs, by the "
                                                                  "builder that declares them in its `STATIC` (the "
                                                                  "op's own, or another its kernels launch: "
                                                                  "`attention_bwd`); each value in the knob's range."),
        "rules": (False, "list[expr]", "Expressions over the knobs (bare names) that a candidate must satisfy, "
                                       "e.g. `dkdv_block_kv >= dkdv_block_q`."),
    },
    "cpu_shrink": {
        "dims": (True, "list[str]", "Dims halved, in turn, until a case fits; `\"...\"` halves the largest "
                                    "leading dim."),
        "max_elements": (True, "int", "The largest input (elements) a CPU test runs."),
    },
    "case": {
        "label": (True, "str", "A unique readable name, e.g. `neox-2d-2k-bf16`."),
        "params": (False, "map", "Param values; the rest take their defaults."),
        "dims": (True, "map[dim -> int]", "The size of every dim the inputs use."),
        "lead": (False, "list[int]", "The sizes of the leading dims of the inputs whose shape starts with "
                                     "`\"...\"` (default none: a single row)."),
        "dtypes": (False, "list[str]", "Dtypes the case runs in (default: all allowed)."),
        "bench": (False, "bool", "Whether the benchmark runner times it (default true)."),
        "with": (False, "list[str]", "Optional inputs the case passes (default none)."),
    },
}


@dataclass(frozen=True)
class ParamSpec:
    name: str
    type: str
    doc: str
    default: Any = None
    has_default: bool = False
    optional: bool = False
    choices: tuple | None = None
    keyword_only: bool = False
    line: int = 0


@dataclass(frozen=True)
class FlagSpec:
    """A bool keyword-only argument of ``forward`` (``flags``), default False."""

    name: str
    doc: str
    line: int = 0


@dataclass(frozen=True)
class TensorSpec:
    name: str
    doc: str
    dtypes: tuple[str, ...] = ()
    shapes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # "" when not by a param
    shape_by: str | None = None
    like: str | None = None
    range: tuple | None = None  # (low Expr, high Expr) for integer inputs
    line: int = 0
    optional: bool = False
    #: every accepted shape per key of ``shapes`` (whose value is the first of them)
    alternatives: Mapping[str, tuple[tuple[str, ...], ...]] = field(default_factory=dict)
    #: outputs: the param whose value (a dtype name, or None for the like input's) is the dtype
    dtype_by: str | None = None
    #: optional inputs: a positional argument of ``forward`` (default None) rather than keyword-only
    positional: bool = False
    #: inputs: written in place by the op (a KV cache), never returned
    written: bool = False
    #: ranged inputs: the non-negative values of one call are pairwise distinct (a slot mapping)
    distinct: bool = False
    #: outputs with ``like``: their own shape (dims and int params), not the like input's; () when none
    own_shape: tuple[str, ...] = ()

    def case_dtype(self, dtype: str, params: Mapping[str, Any]) -> str:
        """The dtype a case in ``dtype`` (its floating inputs' dtype) gives this input: an integer input
        int64 where allowed, else its first dtype; one whose ``dtype_by`` param is set, that param's
        dtype (the prologue's float8 caches); else ``dtype`` where the input allows it, else its first
        dtype (a float32 scale of a bf16 case)."""
        if self.range is not None:
            return "int64" if "int64" in self.dtypes else self.dtypes[0]
        if self.dtype_by is not None and params.get(self.dtype_by) is not None:
            return str(params[self.dtype_by]).replace("torch.", "")
        return dtype if dtype in self.dtypes else self.dtypes[0]

    def shape_for(self, params: Mapping[str, Any]) -> tuple[str, ...]:
        """The dims of this tensor for the given param values (the first alternative)."""
        key = "" if self.shape_by is None else str(params[self.shape_by])
        return self.shapes[key]

    def shapes_for(self, params: Mapping[str, Any]) -> tuple[tuple[str, ...], ...]:
        """Every accepted shape for the given param values; they differ in their number of dims."""
        key = "" if self.shape_by is None else str(params[self.shape_by])
        return self.alternatives.get(key) or (self.shapes[key],)

    @property
    def all_dims(self) -> frozenset[str]:
        """Every named dim of every shape (not the leading ``"..."``)."""
        alts = self.alternatives.values() or [(v,) for v in self.shapes.values()]
        return frozenset(d for shapes in alts for dims in shapes for d in dims if d != LEAD)

    @property
    def leading(self) -> bool:
        """Whether a shape of this tensor takes leading dims (starts with ``"..."``)."""
        alts = self.alternatives.values() or [(v,) for v in self.shapes.values()]
        return any(dims[:1] == (LEAD,) for shapes in alts for dims in shapes)


@dataclass(frozen=True)
class Rule:
    check: Expr
    arg: str
    message: str
    line: int = 0
    needs_dims: bool = False  # false: checked at construction; true: at the call (it names a dim or a dtype)


@dataclass(frozen=True)
class Backward:
    wrt: tuple[str, ...]
    doc: str
    line: int = 0
    #: inputs of ``wrt`` whose gradient is summed over rows (no output is like them)
    reduce: tuple[str, ...] = ()
    #: what the backward kernels read, kept by autograd until the backward: per entry, names of inputs
    #: or outputs of which the first a call has is kept
    saves: tuple[tuple[str, ...], ...] = ()

    def saved(self, has: Any) -> list[str]:
        """The names kept for a call: per entry of ``saves``, the first for which ``has(name)`` is true."""
        found = (next((n for n in entry if has(n)), None) for entry in self.saves)
        return [n for n in found if n is not None]


@dataclass(frozen=True)
class TuneSpace:
    """One backend's schedule space: candidate values per ``(builder, knob)`` and the rules between them."""

    knobs: tuple[tuple[str, str, tuple[Any, ...]], ...]
    rules: tuple[Expr, ...] = ()


@dataclass(frozen=True)
class Tuning:
    """A manifest's ``kernel.tune``: the spaces by backend and how a call's shape class is made."""

    spaces: Mapping[str, TuneSpace]
    tokens: tuple[Expr, ...] = ()
    buckets: tuple[int, ...] = ()
    #: ``kernel.tune.dim_buckets``: ``((dim, rising edges), ...)``
    dim_buckets: tuple[tuple[str, tuple[int, ...]], ...] = ()
    by: tuple[str, ...] = ()
    line: int = 0


@dataclass(frozen=True)
class KernelSpec:
    builder: str
    static: Mapping[str, Any] = field(default_factory=dict)
    specialize: tuple[str, ...] = ()
    line: int = 0
    tune: Tuning | None = None


@dataclass(frozen=True)
class Case:
    label: str
    dims: Mapping[str, int]
    params: Mapping[str, Any] = field(default_factory=dict)
    dtypes: tuple[str, ...] = ()
    bench: bool = True
    line: int = 0
    with_inputs: tuple[str, ...] = ()
    #: the sizes of the leading dims (``"..."``) of the inputs that take them
    lead: tuple[int, ...] = ()


@dataclass(frozen=True)
class ComposeStage:
    """One stage of a composed op: where it comes from and what drives it (``compose`` in SCHEMA)."""

    name: str
    source: str  # the ``from`` text: a family, or ``family/OpName``; "" for a stage of the op's own
    doc: str
    param: str | None = None
    when: str | None = None
    inputs: tuple[str, ...] = ()
    line: int = 0
    #: the manifests ``source`` resolves to (op names), filled by the loader once every file is read
    ops: tuple[str, ...] = ()

    @property
    def family(self) -> str:
        """The family ``source`` names ("" for none)."""
        return self.source.split("/", 1)[0]

    @property
    def op(self) -> str | None:
        """The one op ``source`` names (``family/OpName``), or None for a whole family."""
        return self.source.split("/", 1)[1] if "/" in self.source else None


@dataclass(frozen=True)
class CpuShrink:
    dims: tuple[str, ...]
    max_elements: int


@dataclass(frozen=True)
class OpManifest:
    name: str
    family: str
    summary: str
    params: tuple[ParamSpec, ...]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    rules: tuple[Rule, ...]
    kernel: KernelSpec
    cases: tuple[Case, ...]
    description: str = ""
    references: tuple[str, ...] = ()
    examples: tuple[str, ...] = ()
    hooks: str = ""
    cpu_shrink: CpuShrink | None = None
    file: str = ""
    line: int = 0
    backward: Backward | None = None
    #: the stages of a composed op (``compose``), in the manifest's order; () for any other op
    compose: tuple[ComposeStage, ...] = ()
    #: the bool keyword-only arguments of ``forward`` (``flags``), in order; () for most ops
    flags: tuple[FlagSpec, ...] = ()

    def param(self, name: str) -> ParamSpec:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)

    def input(self, name: str) -> TensorSpec:
        for t in self.inputs:
            if t.name == name:
                return t
        raise KeyError(name)

    def case(self, label: str) -> Case:
        for c in self.cases:
            if c.label == label:
                return c
        known = ", ".join(c.label for c in self.cases)
        raise KeyError(f"{self.name} has no case {label!r}; its cases: {known}")

    def defaults(self) -> dict[str, Any]:
        return {p.name: p.default for p in self.params if p.has_default}

    @property
    def dims(self) -> frozenset[str]:
        out: set[str] = set()
        for t in self.inputs:
            out |= t.all_dims
        return frozenset(out)

    def where(self, line: int | None = None) -> str:
        return f"{self.file}:{self.line if line is None else line}"
