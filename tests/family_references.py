"""Every family's float64 reference, for the tests that run every op (generated tests, fuzzer, bad inputs).

A family's reference is a module of the tests, found by convention in the family root that holds the
family (:mod:`tileops.families`): ``tests/references_<family>.py``, in this repository's ``tests/`` or
in a ``TILEOPS_FAMILY_PATH`` root's. RoPE's, the first family's, is ``tests/references.py``. A
reference module defines

    reference(op_name, params, inputs) -> a float64 tensor (the op's output), or a dict of them by
                                          output name when the op has several

where ``params`` are the op's constructor arguments and ``inputs`` the call's tensors by name, on
the CPU. Gradients are float64 autograd of it. Optionally, what errors are measured against where
that is not an element's own value: ``scale(op_name, params, inputs)`` for outputs (:func:`scales`),
``grad_scale(op_name, params, inputs, grad_outs)`` for gradients (:func:`grad_scales`). A reference
is written from the mathematics and must share no code with the package or its kernels: loading one
that imports ``tileops`` or ``kernels`` fails here, before any test compares against it.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from tileops.families import roots

__all__ = ["reference_module", "outputs", "written", "scales", "grads", "grad_scales", "check_independent",
           "output_dtype", "output_shape"]

HERE = Path(__file__).resolve().parent
#: the first family's reference predates the convention
_NAMED = {"rope": "references.py"}
_FORBIDDEN = ("tileops", "kernels")


def check_independent(path: Path) -> None:
    """Raise when the module at ``path`` imports tileops or kernels (read from its source)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        for name in names:
            if name.split(".")[0] in _FORBIDDEN:
                raise ImportError(f"{path}:{node.lineno}: a test reference imports {name}; it must share no code "
                                  f"with the package or its kernels")


@functools.lru_cache(maxsize=None)
def reference_module(family: str) -> ModuleType:
    """The reference module of ``family``, loaded once (after :func:`check_independent`)."""
    name = _NAMED.get(family, f"references_{family}.py")
    places = [HERE / name, *(r / "tests" / name for r in roots())]
    path = next((p for p in places if p.is_file()), None)
    if path is None:
        raise FileNotFoundError(f"no float64 reference for the {family!r} family: expected tests/{name} in the "
                                f"family root that holds it; looked at {', '.join(map(str, places))}")
    check_independent(path)
    spec = importlib.util.spec_from_file_location(f"_tileops_test_{path.stem}_{family}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def written(m: Any, params: Mapping[str, Any], inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The float64 state after the call of every input the op writes in place (``written``: a KV
    cache), from ``inputs`` as they were before it; the family's reference returns them in its dict
    by input name."""
    names = [t.name for t in m.inputs if t.written and inputs.get(t.name) is not None]
    if not names:
        return {}
    got = reference_module(m.family).reference(m.name, dict(params), dict(inputs))
    return {n: got[n] for n in names}


def scales(m: Any, params: Mapping[str, Any], inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What each element's error is measured against, by output or written input name, where the
    family's reference says (its ``scale``): the magnitude the op's roundings act on when that is not
    the element's own (a rotation that cancels). Absent: the element's own value."""
    fn = getattr(reference_module(m.family), "scale", None)
    return {} if fn is None else fn(m.name, dict(params), dict(inputs))


def output_shape(m: Any, params: Mapping[str, Any], name: str, dims: Mapping[str, Any]) -> torch.Size | None:
    """The shape of output ``name`` when its manifest gives it one of its own (dims, then int params)."""
    spec = next(o for o in m.outputs if o.name == name)
    if not spec.own_shape:
        return None
    return torch.Size([dims[d] if d in dims else params[d] for d in spec.own_shape])


def outputs(m: Any, params: Mapping[str, Any], inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The float64 value of every output of op manifest ``m`` that a call with ``inputs`` produces
    (those whose ``like`` input is given), by output name."""
    made = [o for o in m.outputs if inputs.get(o.like) is not None]
    ref = reference_module(m.family).reference
    if m.family == "rope":  # RoPE's reference rotates "x": each output is its `like` input rotated
        return {o.name: ref(m.name, dict(params), {**inputs, "x": inputs[o.like]}) for o in made}
    got = ref(m.name, dict(params), dict(inputs))
    if isinstance(got, Mapping):
        return {o.name: got[o.name] for o in made}
    if len(made) != 1:
        raise TypeError(f"the {m.family} reference returned one tensor for {m.name}, which makes "
                        f"{', '.join(o.name for o in made)}: return a dict by output name")
    return {made[0].name: got}


def grads(m: Any, params: Mapping[str, Any], inputs: Mapping[str, torch.Tensor], wrt: list[str],
          grad_outs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """float64 gradients of ``sum(output * grad_outs[output])`` over the outputs, with respect to the
    inputs ``wrt``, by autograd of :func:`outputs`."""
    leaves = {n: inputs[n].detach().double().requires_grad_(True) for n in wrt}
    # the leaves are float64: a reference that rounds where the op's model rounds (the norms') reads
    # the inputs' own dtypes here
    dtypes = {n: t.dtype for n, t in inputs.items() if isinstance(t, torch.Tensor)}
    outs = outputs(m, {**params, "input_dtypes": dtypes}, {**inputs, **leaves})
    names = [n for n in outs if n in grad_outs]
    got = torch.autograd.grad([outs[n] for n in names], [leaves[n] for n in wrt],
                              [grad_outs[n].double() for n in names], allow_unused=True)
    return {n: (g if g is not None else torch.zeros_like(leaves[n])) for n, g in zip(wrt, got)}


def grad_scales(m: Any, params: Mapping[str, Any], inputs: Mapping[str, torch.Tensor], wrt: list[str],
                grad_outs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the error of each gradient of :func:`grads` is measured against, by input name, where the
    family's reference says (its ``grad_scale``, given the same inputs and output gradients): for a
    gradient summed over rows (``backward.reduce``: a norm's weight), the magnitudes of the terms the
    op may round differently, not only the sum's own value, which cancels. Absent: the element's own
    value."""
    fn = getattr(reference_module(m.family), "grad_scale", None)
    if fn is None:
        return {}
    got = fn(m.name, dict(params), dict(inputs), dict(grad_outs))
    return {n: got[n] for n in wrt if n in got}


def output_dtype(m: Any, params: Mapping[str, Any], name: str, inputs: Mapping[str, torch.Tensor]) -> torch.dtype:
    """The dtype of output ``name``: its ``dtype_by`` param's value when set, else its like input's."""
    o = next(o for o in m.outputs if o.name == name)
    value = params.get(o.dtype_by) if o.dtype_by else None
    return getattr(torch, value) if value else inputs[o.like].dtype

