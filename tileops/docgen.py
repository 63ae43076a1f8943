"""Markdown for the docs site, generated from the project's own data so the pages cannot drift.

Pure functions from the manifest model, the manifest schema, the target registry and the README to
Markdown text. The MkDocs hook (``docs/hooks.py``) expands markers in the pages with them; nothing
here imports MkDocs.
"""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import Any, Iterable, Sequence

__all__ = [
    "op_markdown", "ops_table_markdown", "family_title", "family_page_markdown", "schema_markdown",
    "rule_language_markdown", "targets_markdown",
    "readme_commands", "readme_commands_markdown",
]


def _code(text: Any) -> str:
    """Inline code that is safe inside a Markdown table cell (pipes included)."""
    return f"<code>{html.escape(str(text), quote=False).replace('|', '&#124;')}</code>"


def _text(text: str) -> str:
    """Prose for a table cell: one line, HTML-escaped, pipes escaped."""
    return html.escape(" ".join(text.split()), quote=False).replace("|", "&#124;")


def _table(head: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _value(value: Any) -> str:
    """A Python value as the signature shows it: ``"neox"``, ``10000.0``, ``None``."""
    return f'"{value}"' if isinstance(value, str) else repr(value)


def _shape(dims: Sequence[str]) -> str:
    return _code("[" + ", ".join(dims) + "]")


# ------------------------------------------------------------------------------------------ ops
def _words(names: Sequence[str]) -> str:
    """``x``, ``x and key``, ``x, key and y``: names as inline code, joined as a sentence does."""
    codes = [_code(n) for n in names]
    return " and ".join(codes) if len(codes) < 3 else ", ".join(codes[:-1]) + " and " + codes[-1]


def _role(t: Any, role: str) -> str:
    """What a tensor is to the call: an input (optional ones keyword only) or an output (an optional
    one exists when the input it is shaped like is given)."""
    if role == "input":
        return ("input, optional" + ("" if t.positional else " (keyword only)")) if t.optional else "input"
    if t.optional:
        return f"output, when {_code(t.like)} is given" if t.like else "output, optional"
    return "output"


def op_markdown(name: str, root: str | Path | None = None) -> str:
    """The manifest of op ``name`` beside its class's docstrings: each tensor's role, shapes and
    dtypes, the backward in words, and the rules.

    The constructor's parameters are not repeated: the class's ``__init__`` documents each one
    (generated from the same manifest). ``root`` (the repository root) only shortens the manifest's
    path in the lead-in line.
    """
    from tileops.manifest import get

    m = get(name)
    path = Path(m.file)
    if root is not None:
        try:
            path = path.resolve().relative_to(Path(root).resolve())
        except ValueError:
            pass
    out = [f"From {_code(path.as_posix())}, which the constructor's arguments (documented under "
           f"`__init__` above) and every call's tensors are checked against."]

    rows = []
    for role, tensors in (("input", m.inputs), ("output", m.outputs)):
        for t in tensors:
            if t.like:
                shape = dtypes = f"as {_code(t.like)}"
                if t.dtype_by:
                    dtypes += f", or {_code(t.dtype_by)}"
            else:
                alts = t.alternatives or {k: (v,) for k, v in t.shapes.items()}
                if t.shape_by is None:
                    shape = " or ".join(_shape(v) for v in alts[""])
                else:
                    shape = "<br>".join(f"{_code(f'{t.shape_by}={_value(k)}')}: "
                                        + " or ".join(_shape(v) for v in vs) for k, vs in alts.items())
                dtypes = ", ".join(t.dtypes)
                if t.range is not None:
                    dtypes += f"; values in {_code(f'[{t.range[0]}, {t.range[1]})')}"
            rows.append([_code(t.name), _role(t, role), shape, dtypes])
    out.append("**Tensors**\n\n" + _table(["Name", "Role", "Shape", "Dtypes"], rows))
    if m.backward is not None:
        reduce = f" Summed over every row: the gradient of {_words(m.backward.reduce)}." if m.backward.reduce else ""
        out.append(f"**Backward**: differentiable in {_words(m.backward.wrt)}. {_text(m.backward.doc)}{reduce}")

    if m.rules:
        rows = [[_code(r.check), _code(r.arg), "first call" if r.needs_dims else "construction",
                 _text(r.message)] for r in m.rules]
        out.append("**Rules**\n\n" + _table(["Check", "Argument", "Checked at", "Error says"], rows))
    return "\n\n".join(out) + "\n"


def ops_table_markdown(prefix: str = "", headers: Sequence[str] = ("Op", "Family", "What it computes")) -> str:
    """Every op with its summary, each name linked to its entry on its family's API page
    (``{prefix}api/<family>.md``).

    Links use the object's path as the anchor, which is the id mkdocstrings gives its heading.
    """
    from tileops.manifest import registry

    rows = [[f"[`{name}`]({prefix}api/{m.family}.md#tileops.{m.family}.{name})", m.family, _text(m.summary)]
            for name, m in sorted(registry().items(), key=lambda kv: (kv[1].family, kv[0]))]
    return _table(headers, rows) + "\n"


def _family_doc(family: str) -> str:
    """The docstring of ``tileops/<family>/__init__.py``, read from its source (nothing is imported)."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec(f"tileops.{family}")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"family {family!r} has manifests but no package tileops/{family}/")
    path = Path(spec.origin)
    return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"), str(path))) or ""


def _family_head(family: str) -> tuple[str, str, str]:
    """(title, lead, rest) of a family's package docstring: its first line is ``Title: lead``."""
    doc = re.sub(r":\w+:`([^`]+)`", r"`\1`", _family_doc(family)).replace("``", "`")  # reST roles -> Markdown
    first, _, rest = doc.strip().partition("\n")
    title, colon, lead = first.partition(":")
    if not colon:
        title, lead = first, ""
    return title.strip().rstrip(".") or f"{family} operators", lead.strip(), rest.strip()


def family_title(family: str) -> str:
    """A family's title: its package docstring's first line up to a colon (``"RoPE operators"``)."""
    return _family_head(family)[0]


def family_page_markdown(family: str) -> str:
    """The API page of a family that has none written: its package docstring, then for each op
    its class (a mkdocstrings block: signatures and docstrings, generated from the manifest) and
    its manifest's tables (the ``manifest`` marker)."""
    from tileops.manifest import registry

    title, lead, rest = _family_head(family)
    out = [f"# {title}", ""]
    out += [p for p in (lead[:1].upper() + lead[1:], rest) if p for p in (p, "")]
    for name in sorted(n for n, m in registry().items() if m.family == family):
        out += [f"::: tileops.{family}.{name}", "", f"<!-- manifest: {name} -->", ""]
    return "\n".join(out)


# ------------------------------------------------------------------------------------ manifests
#: Headings of the schema's sections; a section missing here is shown under its own key.
_SECTIONS = {
    "op": ("Op", "The top level of a manifest file maps each op's class name to one of these."),
    "param": ("Param", "Each entry of `params`: one constructor argument."),
    "tensor": ("Tensor", "Each entry of `inputs` and `outputs`."),
    "rule": ("Rule", "Each item of `rules`."),
    "kernel": ("Kernel", "The value of `kernel`."),
    "cpu_shrink": ("CPU shrink", "The value of `cpu_shrink`."),
    "case": ("Case", "Each item of `cases`."),
}


def schema_markdown(heading_level: int = 2) -> str:
    """Every key a manifest may hold, one table per section, from ``tileops.manifest.schema.SCHEMA``."""
    from tileops.manifest.schema import SCHEMA

    def linked(type_text: str) -> str:
        # Link the names of other sections (``list[rule]``) to their tables.
        parts = re.split(r"(\b(?:%s)\b)" % "|".join(map(re.escape, SCHEMA)), type_text)
        return "".join(f"[{_code(p)}](#schema-{p})" if p in SCHEMA else (_code(p) if p else "")
                       for p in parts)

    out = []
    hashes = "#" * heading_level
    for section, keys in SCHEMA.items():
        title, lead = _SECTIONS.get(section, (section, ""))
        rows = [[_code(key), "yes" if required else "no", linked(tdesc), meaning.replace("|", "&#124;")]
                for key, (required, tdesc, meaning) in keys.items()]
        out.append(f"{hashes} {title} {{#schema-{section}}}\n\n{lead}\n\n"
                   + _table(["Key", "Required", "Type", "Meaning"], rows))
    return "\n\n".join(out) + "\n"


def rule_language_markdown() -> str:
    """The rule language's grammar and functions, from :mod:`tileops.manifest.expr`."""
    from tileops.manifest import expr

    doc = expr.__doc__ or ""
    head, _, grammar = doc.partition("::")
    intro = "\n\n".join(" ".join(p.split()) for p in head.strip().split("\n\n")[1:-1])
    intro = re.sub(r"``([^`]+)``", r"`\1`", intro)
    grammar = "\n".join(line[4:] if line.startswith("    ") else line for line in grammar.strip("\n").splitlines())
    funcs = ", ".join(f"`{f}`" for f in expr.FUNCTIONS)
    return f"{intro}\n\n```text\n{grammar.strip()}\n```\n\nFunctions: {funcs}.\n"


# -------------------------------------------------------------------------------------- targets
def targets_markdown() -> str:
    """The registered targets (in-tree and from entry points) with their descriptions."""
    from tileops.targets import BUILTIN, get_target, target_names

    rows = []
    for name in target_names():
        t = get_target(name)
        how = "`target=BUILTIN`" if name == BUILTIN else f'`target="{name}"`'
        rows.append([_code(name), how, _text(t.description or "")])
    return _table(["Name", "Select with", "What it is"], rows) + "\n"


# --------------------------------------------------------------------------------------- README
def readme_commands(readme: str) -> list[str]:
    """The setup commands of the README: each line of it that creates a venv (``python3 -m venv``)."""
    found = []
    for line in readme.splitlines():
        line = line.strip().strip("`").strip()
        if line.startswith("$ "):
            line = line[2:]
        if line.startswith("python3 -m venv") and line not in found:
            found.append(line)
    return found


def readme_commands_markdown(readme: str) -> str:
    """The README's setup commands as shell blocks, each under what it does."""
    out = []
    for cmd in readme_commands(readme):
        if "pytest" in cmd:
            what = "Install with the test extra and run the tests:"
        elif "tileops demo" in cmd:
            what = "Install, then run every op once against a float64 reference (`tileops demo`):"
        else:
            what = "Install:"
        out.append(f"{what}\n\n```bash\n{cmd}\n```")
    return "\n\n".join(out) + "\n"
