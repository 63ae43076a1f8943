"""The manifest is the op: every class's signatures and docstring parameters come from its
manifest (``tileops generate``), so the two cannot drift."""

from __future__ import annotations

import importlib
import inspect
import re

import pytest

from tileops.codegen import generate
from tileops.manifest import registry

OPS = sorted(registry().values(), key=lambda m: m.name)


def _cls(m):
    return getattr(importlib.import_module(f"tileops.{m.family}"), m.name)


def _doc_args(fn) -> list[str]:
    """The names in a Google-style docstring's Args section, in order."""
    doc = inspect.getdoc(fn) or ""
    section = doc.split("Args:", 1)[1].split("\n\n", 1)[0]
    return re.findall(r"^    (\w+) \(", section, flags=re.M)


def test_generated_modules_match_the_manifests():
    assert generate(check=True) == [], "run `tileops generate`: a generated module differs from its manifests"
    assert generate(check=True, families=["rope"]) == []
    with pytest.raises(KeyError, match="unknown family 'nosuch'; families with manifests: .*rope"):
        generate(check=True, families=["nosuch"])


@pytest.mark.parametrize("m", OPS, ids=[m.name for m in OPS])
def test_constructor_signature_and_doc_come_from_the_manifest(m):
    cls = _cls(m)
    assert type(cls).__mro__ and cls.__mro__[1].__name__ == m.hooks, "not the hook class the manifest names"
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    want = [p.name for p in m.params] + ["target"]
    assert [p.name for p in params] == want
    for p, spec in zip(params, m.params):
        assert p.kind is (inspect.Parameter.KEYWORD_ONLY if spec.keyword_only else inspect.Parameter.POSITIONAL_OR_KEYWORD)
        if spec.has_default:
            assert p.default == spec.default and type(p.default) is type(spec.default), p.name
        else:
            assert p.default is inspect.Parameter.empty, p.name
    assert params[-1].kind is inspect.Parameter.KEYWORD_ONLY and params[-1].default is None
    assert _doc_args(cls.__init__) == want
    doc = inspect.getdoc(cls.__init__)
    for spec in m.params:
        assert spec.doc.strip().split(".")[0] in " ".join(doc.split()), f"{spec.name}'s manifest doc is not in the docstring"


@pytest.mark.parametrize("m", OPS, ids=[m.name for m in OPS])
def test_forward_signature_and_doc_come_from_the_manifest(m):
    cls = _cls(m)
    params = list(inspect.signature(cls.forward).parameters.values())[1:]
    required = [t.name for t in m.inputs if not t.optional]
    positional = [t.name for t in m.inputs if t.optional and t.positional]  # LayerNorm's weight and bias
    keyword = [t.name for t in m.inputs if t.optional and not t.positional] + [o.name for o in m.outputs]
    flags = [f.name for f in m.flags]  # bool keyword-only arguments after the outputs (attention's return_lse)
    assert [p.name for p in params] == required + positional + keyword + flags
    for p in params:
        if p.name in required:
            assert p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and p.default is inspect.Parameter.empty
        elif p.name in positional:
            assert p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and p.default is None
        elif p.name in flags:
            assert p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is False
        else:
            assert p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is None
    assert _doc_args(cls.forward) == required + positional + keyword + flags
    summary = inspect.getdoc(cls).splitlines()[0]
    assert summary == " ".join(m.summary.split())


def test_a_changed_manifest_shows_in_the_generated_class(tmp_path):
    """The generator is the path from a manifest to a class: a new param in a manifest is a new
    argument in the rendered signature and an Args entry (rendered, not written to the tree)."""
    import dataclasses

    from tileops.codegen import render_family
    from tileops.manifest.schema import ParamSpec

    m = registry()["RoPEFwdOp"]
    extra = ParamSpec(name="tilt", type="float", doc="A made-up parameter.", default=0.5, has_default=True)
    changed = dataclasses.replace(m, params=m.params + (extra,))
    src = render_family("rope", [changed])
    assert "base: float = 10000.0, tilt: float = 0.5, *, target" in " ".join(src.split())
    assert "tilt (float): A made-up parameter. Default ``0.5``." in src
    assert "'tilt': tilt" in src
    compile(src, "ops.py", "exec")
