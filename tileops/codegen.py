"""Op classes from manifests: the one source of every signature and parameter doc.

``tileops generate`` writes ``tileops/<family>/ops.py`` from the family's manifests. Each op class
gets its constructor and ``forward`` with real signatures (so an IDE and mkdocstrings see them), its
docstrings (summary, description, references, examples, and an Args entry for every param, input
and output, each from its manifest declaration), and a body that hands the values to the base
class. The class inherits the hook class its manifest names (``hooks:``) in
``tileops/<family>/hooks.py``, which holds the family's behaviour and declares no parameter.

The generated module is kept in the repository; ``tileops generate --check`` (and a test) fails
when it differs from what the manifests give, so the two cannot drift. Nothing from a manifest is
executed: names are checked as identifiers by the loader, and every text is written through
``repr`` or into a docstring whose quotes are escaped.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Iterable

from .manifest import OpManifest
from .manifest.schema import ParamSpec, TensorSpec

__all__ = ["render_family", "family_module_path", "generate", "forward_signature", "init_signature"]

WIDTH = 110
_HEADER = '''"""The {family} ops, generated from ``manifests/{family}/`` by ``tileops generate``: do not edit.

Every signature, parameter list and parameter doc here comes from an op's manifest; the behaviour
comes from the hook class it inherits (:mod:`tileops.{family}.hooks`). Change a manifest, then run
``tileops generate``; a test fails while this file and the manifests disagree.
"""

from __future__ import annotations

from typing import Any

import torch

from ..targets import Target
from . import hooks

__all__ = [{names}]
'''

_PY_TYPES = {"str": "str", "int": "int", "float": "float", "bool": "bool",
             "ints": "tuple[int, ...] | list[int]", "tensor": "torch.Tensor", "op": "Op",
             "dtype": "torch.dtype"}
_TARGET_DOC = ("Which set of kernels serves this op: a registered target name, BUILTIN for the in-tree "
               "kernels, or None to decide from the input device at the first call. Default None.")


def family_module_path(family: str) -> Path:
    """Where the generated module of ``family`` lives: ``ops.py`` in its package ``tileops/<family>/``,
    in the tree or in the family root (``TILEOPS_FAMILY_PATH``) that holds it."""
    import importlib.util

    spec = importlib.util.find_spec(f"tileops.{family}")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"family {family!r} has manifests but no package tileops/{family}/ (with __init__.py "
                                f"and hooks.py) in the tree or in a TILEOPS_FAMILY_PATH root")
    return Path(list(spec.submodule_search_locations)[0]) / "ops.py"


def _annotation(p: ParamSpec) -> str:
    t = _PY_TYPES[p.type]
    return f"{t} | None" if (p.optional or p.type == "tensor") else t


def _uses_op_params(ops: list[OpManifest]) -> bool:
    return any(p.type == "op" for m in ops for p in m.params)


def _literal(value: object) -> str:
    if isinstance(value, str) and '"' not in value and "\\" not in value:
        return f'"{value}"'
    return repr(value)


def init_signature(m: OpManifest) -> list[tuple[str, str, str | None, bool]]:
    """(name, annotation, default literal or None for a required param, keyword-only) per
    constructor parameter, in order, ``target`` last."""
    out = [(p.name, _annotation(p), _literal(p.default) if p.has_default else None, p.keyword_only)
           for p in m.params]
    return out + [("target", "str | Target | None", "None", True)]


def forward_signature(m: OpManifest) -> list[tuple[str, str, str | None, bool]]:
    """The same for ``forward``: required inputs positional, then optional inputs marked
    ``positional`` (default None), then the other optional inputs and the outputs (``out=``-style)
    keyword-only with None."""
    out = [(t.name, "torch.Tensor", None, False) for t in m.inputs if not t.optional]
    out += [(t.name, "torch.Tensor | None", "None", False) for t in m.inputs if t.optional and t.positional]
    out += [(t.name, "torch.Tensor | None", "None", True) for t in m.inputs if t.optional and not t.positional]
    out += [(o.name, "torch.Tensor | None", "None", True) for o in m.outputs]
    out += [(f.name, "bool", "False", True) for f in m.flags]
    return out


def _names(names: Iterable[str]) -> str:
    """``x``, ``x and key``, ``x, weight and residual``, as a sentence lists them."""
    codes = [f"``{n}``" for n in names]
    return " and ".join(codes) if len(codes) < 3 else ", ".join(codes[:-1]) + " and " + codes[-1]


def _signature_text(name: str, args: list[tuple[str, str, str | None, bool]], returns: str) -> str:
    parts = ["self"]
    star = False
    for pname, ann, default, kw in args:
        if kw and not star:
            parts.append("*")
            star = True
        parts.append(f"{pname}: {ann}" + (f" = {default}" if default is not None else ""))
    head = f"    def {name}("
    lines, line = [], head
    for i, part in enumerate(parts):
        piece = part + (", " if i < len(parts) - 1 else f") -> {returns}:")
        if len(line) + len(piece.rstrip()) > WIDTH and line != head:
            lines.append(line.rstrip())
            line = " " * len(head)
        line += piece
    lines.append(line)
    return "\n".join(lines)


def _wrap(text: str, indent: int, first: str = "") -> list[str]:
    """``first`` + ``text`` wrapped at WIDTH, continuation lines indented four more spaces."""
    pad = " " * indent
    return textwrap.wrap(first + text, width=WIDTH, initial_indent=pad, subsequent_indent=pad + "    ",
                         break_long_words=False, break_on_hyphens=False)


def _paragraphs(text: str, indent: int) -> list[str]:
    out: list[str] = []
    for para in text.split("\n"):
        if para.strip():
            if out:
                out.append("")
            out += textwrap.wrap(para.strip(), width=WIDTH, initial_indent=" " * indent,
                                 subsequent_indent=" " * indent, break_long_words=False, break_on_hyphens=False)
    return out


def _shape_text(t: TensorSpec, m: OpManifest) -> str:
    def dims(shape: tuple[str, ...]) -> str:
        return "``[" + ", ".join(shape) + "]``"

    if t.shape_by is None:
        alts = t.alternatives.get("") or (t.shapes[""],)
        return " or ".join(dims(s) for s in alts)
    parts = []
    for key in t.shapes:
        alts = t.alternatives.get(key) or (t.shapes[key],)
        parts.append(" or ".join(dims(s) for s in alts) + f" (``{t.shape_by}={_literal(key)}``)")
    return "; ".join(parts)


def _docstring(lines: list[str], indent: int = 8) -> list[str]:
    """``lines`` as a docstring at ``indent`` (the first line opens it), backslashes and triple
    quotes escaped so that no manifest text can end it early."""
    text = "\n".join(lines).replace("\\", "\\\\").replace('"""', '\\"\\"\\"')
    body = text.split("\n")
    pad = " " * indent
    body[0] = pad + '"""' + body[0].lstrip()
    return [ln.rstrip() for ln in body] + [pad + '"""']


def _class_doc(m: OpManifest) -> list[str]:
    out = _paragraphs(m.summary, 4)
    out[0] = out[0].lstrip()
    if m.description:
        out += [""] + _paragraphs(m.description, 4)
    if m.references:
        out += [""] + _wrap("; ".join(m.references) + ".", 4, "References: ")
    if m.examples:
        out += ["", "    Examples:"] + [f"        {e}" for e in m.examples]
    return _docstring(out, indent=4)


def _init_method(m: OpManifest) -> list[str]:
    doc = ["Build the op; kernels are compiled at the first call.", "", "        Args:"]
    for p in m.params:
        text = ("Keyword-only. " if p.keyword_only else "") + p.doc.strip()
        if p.choices:
            text += " One of " + ", ".join(f"``{_literal(c)}``" for c in p.choices) + "."
        if p.has_default:
            text += f" Default ``{_literal(p.default)}``."
        else:
            text += " Required."
        doc += _wrap(text, 12, f"{p.name} ({_annotation(p)}): ")
    doc += _wrap(_TARGET_DOC, 12, "target (str | Target | None): ")
    checks = [f"{r.arg}: {r.message}" for r in m.rules if not r.needs_dims]
    doc += ["", "        Raises:"]
    doc += _wrap("A parameter has the wrong type.", 12, "TypeError: ")
    value = "A value outside its choices, an unknown ``target``"
    value += ("; or, by the manifest's rules: " + "; ".join(checks) + ".") if checks else "."
    doc += _wrap(value, 12, "ValueError: ")
    args = ", ".join(f"{p.name!r}: {p.name}" for p in m.params)
    body = _wrap(f"self._setup({{{args}}}, target)", 8)
    return ([_signature_text("__init__", init_signature(m), "None")] + _docstring(doc) + body)


def _forward_method(m: OpManifest) -> list[str]:
    doc = ["Run the op; ``op(...)`` calls this. Shapes and dtypes are taken from the first call, and inputs",
           "        are never modified (except by ``out=`` naming an input, which takes the result in place)."]
    if m.backward is not None:
        reduce = f" Summed over every row: the gradient of {_names(m.backward.reduce)}." if m.backward.reduce else ""
        doc += [""] + _paragraphs(f"Gradients: differentiable in {_names(m.backward.wrt)}; an output carries a "
                                  f"``grad_fn`` when an input it is computed from requires grad. "
                                  f"{m.backward.doc.strip()}{reduce} A gradient of that gradient (double "
                                  "backward) raises.", 8)
    doc += ["", "        Args:"]
    for t in m.inputs:
        text = ("Optional. " if t.positional else "Keyword-only. " if t.optional else "") + t.doc.strip()
        if t.like is not None:
            text += f" The shape and dtype of ``{t.like}``, exactly."
        else:
            text += f" Shape {_shape_text(t, m)}; dtype " + ", ".join(t.dtypes) + "."
        if t.written:
            text += " Written in place (never returned); it may share memory with no other argument."
        if t.range is not None:
            text += f" Each value in ``[{t.range[0]}, {t.range[1]})``."
        if t.optional:
            text += " Default None."
        ann = "torch.Tensor | None" if t.optional else "torch.Tensor"
        doc += _wrap(text, 12, f"{t.name} ({ann}): ")
    for o in m.outputs:
        typed = (f"Shaped like ``{o.like}`` and typed like it, or as ``{o.dtype_by}`` says when given"
                 if o.dtype_by else f"Shape ``[{', '.join(o.own_shape)}]``, typed like ``{o.like}``" if o.own_shape
                 else f"Shaped and typed like ``{o.like}``")
        text = (f"Keyword-only. Where to write the result ({o.doc.strip()}). {typed}, "
                "any strides; it may be its own input exactly (in place) but "
                "may not otherwise overlap another argument. Not while an input requires grad. Default None.")
        doc += _wrap(text, 12, f"{o.name} (torch.Tensor | None): ")
    first, rest = m.outputs[0], m.outputs[1:]
    ret = f"``{first.name}``, a new tensor unless given"
    for o in rest:
        ret += f"; with ``{o.like}``, the tuple ``({first.name}, {o.name})``"
    for f in m.flags:
        doc += _wrap(f"Keyword-only. {f.doc.strip()} Default False.", 12, f"{f.name} (bool): ")
    doc += ["", "        Returns:"] + _wrap(ret + (", unless a flag above says otherwise" if m.flags else "") + ".",
                                            12, "torch.Tensor | tuple: ")
    checks = [f"{r.arg}: {r.message}" for r in m.rules if r.needs_dims]
    ranged = [t.name for t in m.inputs if t.range is not None]
    doc += ["", "        Raises:"]
    doc += _wrap("An argument is not a tensor, or has a dtype not listed above.", 12, "TypeError: ")
    value = "A shape that does not match the ones above, tensors on different devices, an output that overlaps another argument"
    if checks:
        value += "; or, by the manifest's rules: " + "; ".join(checks)
    if ranged:
        value += ". A value of " + ", ".join(f"``{n}``" for n in ranged) + (
            " outside its range raises ValueError naming its index and value, without a host sync (see the API "
            "page, Positions and gradients)")
    doc += _wrap(value + ".", 12, "ValueError: ")
    if m.backward is not None:
        doc += _wrap("``out=`` or another output given while an input requires grad.", 12, "RuntimeError: ")
    tensors = ", ".join(f"{t.name!r}: {t.name}" for t in m.inputs)
    outs = ", ".join(f"{o.name!r}: {o.name}" for o in m.outputs)
    flags = ", ".join(f"{f.name!r}: {f.name}" for f in m.flags)
    body = _wrap(f"return self._call({{{tensors}}}, {{{outs}}}" + (f", {{{flags}}})" if flags else ")"), 8)
    return [_signature_text("forward", forward_signature(m), "Any")] + _docstring(doc) + body


def render_class(m: OpManifest) -> str:
    lines = [f"class {m.name}(hooks.{m.hooks}):"] + _class_doc(m) + [""] + _init_method(m) + [""]
    lines += _forward_method(m)
    return "\n".join(lines) + "\n"


def render_family(family: str, manifests: Iterable[OpManifest]) -> str:
    """The source of ``tileops/<family>/ops.py`` for the family's manifests (sorted by name)."""
    ops = sorted((m for m in manifests if m.family == family), key=lambda m: m.name)
    names = "\n".join(textwrap.wrap(", ".join(f'"{m.name}"' for m in ops), width=WIDTH - 4,
                                      initial_indent="    ", subsequent_indent="    "))
    out = _HEADER.format(family=family, names="\n" + names + ",\n")
    if _uses_op_params(ops):  # the annotation of an op param (the prologue's rope)
        out = out.replace("from ..targets import Target\n", "from ..op import Op\nfrom ..targets import Target\n")
    for m in ops:
        out += "\n\n" + render_class(m)
    return out


def generate(check: bool = False, families: Iterable[str] | None = None) -> list[str]:
    """Write the module of every family (or of the ``families`` named), or with ``check`` only
    compare. Returns the paths that changed (or would change); an unknown family is a KeyError."""
    from .manifest import registry

    ops = list(registry().values())
    known = sorted({m.family for m in ops})
    wanted = known if families is None else list(dict.fromkeys(families))
    unknown = [f for f in wanted if f not in known]
    if unknown:
        raise KeyError(f"unknown family {unknown[0]!r}; families with manifests: {', '.join(known)}")
    changed = []
    for family in wanted:
        path = family_module_path(family)
        text = render_family(family, ops)
        old = path.read_text(encoding="utf-8") if path.exists() else None
        if old != text:
            changed.append(str(path))
            if not check:
                path.write_text(text, encoding="utf-8")
    return changed
