"""Fused kernels made from the ops their manifest's ``compose:`` section names.

A stage that comes from another manifest (``from: rope``, any op of the family, held by the
constructor param ``param``; ``from: norm/RMSNormFwdOp``, that one op) brings into the fused kernel
the very spec that op's own kernel is compiled for: its family's ``kernel_spec(cls, manifest,
params, call, backend)`` (``tileops/<family>/builtin.py``) for the call the stage sees inside the
fused op. The fused builder's ``Spec`` holds that spec in a field named as the stage, and reads the
stage's options (a pairing, a rotated width, a rounding, whatever the family adds later) from it, by
way of the stage functions the stage's builder exports; it copies none of them. A variant or option
the family adds reaches the fused kernel with no edit to the fused op.

The stage's spec is taken as the stage's builder would compile it, less its schedule: the fields its
builder's ``STATIC`` lists (threads, vector counts: how the stage's own kernel is laid out on a GPU)
are set back to their defaults, since the fused kernel has a schedule of its own, and two ops that
differ only there compose into one fused kernel. What the fused schedule fixes in a stage (the
rotation's direction, a norm without residual) is its ``Spec.stages``, ``{stage: {field: values it
builds}}``: a stage spec with another value is refused here, a ValueError naming the op's argument
that brings the stage, before anything is built.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .manifest import CallSpec, OpManifest
from .manifest.schema import ComposeStage
from .op import Op

__all__ = ["StageOp", "stage_op", "stage_specs", "kernel_spec"]


@dataclass(frozen=True)
class StageOp:
    """The op a stage composes: the class whose hooks give its kernel spec, its manifest, its params."""

    cls: type
    manifest: OpManifest
    params: Mapping[str, Any]

    @property
    def name(self) -> str:
        return self.manifest.name


def stage_op(stage: ComposeStage, params: Mapping[str, Any]) -> StageOp | None:
    """The op ``stage`` composes in an op built with ``params``, or None where it composes none (a
    stage of the op's own builder, or one whose ``when`` param is false).

    With a ``param``: the op object it holds, or a case's ``{op: Name, params: {...}}`` (``tileops
    warmup`` names kernels without constructing ops): the hook class its manifest names, with the
    manifest's defaults under the case's params. Else the one op ``from`` names, with its defaults."""
    if not stage.source or (stage.when is not None and not params[stage.when]):
        return None
    from . import manifest

    if stage.param is not None:
        value = params[stage.param]
        if isinstance(value, Op):  # its own class: a variant's overrides count
            return StageOp(type(value), value.manifest, value.params)
        m = manifest.get(value["op"])
        given = value.get("params", {})
    else:
        m, given = manifest.get(stage.op), {}
    hooks = importlib.import_module(f"tileops.{m.family}.hooks")
    return StageOp(getattr(hooks, m.hooks), m, {**m.defaults(), **given})


def stage_specs(m: OpManifest, params: Mapping[str, Any], calls: Mapping[str, CallSpec],
                backend: str) -> dict[str, Any]:
    """``{stage: spec}`` for every stage of ``m.compose`` that comes from another manifest: the spec
    its family gives the stage's op for ``calls[stage]`` (the call the stage sees inside the fused
    op: its inputs' dtypes, its dims), less its schedule; None for a stage whose ``when`` is false.
    A stage the fused builder does not build is a ValueError naming the argument that brings it."""
    from tileops.kernels import STATIC, get_spec

    fixed = getattr(get_spec(m.kernel.builder), "stages", {})
    out: dict[str, Any] = {}
    for stage in m.compose:
        if not stage.source:
            continue
        op = stage_op(stage, params)
        if op is None:
            out[stage.name] = None
            continue
        arg = stage.param or stage.when or stage.name  # what the user set to bring this stage in
        family = importlib.import_module(f"tileops.{op.manifest.family}.builtin")
        try:
            spec = family.kernel_spec(op.cls, op.manifest, op.params, calls[stage.name], backend)
        except ValueError as e:
            raise ValueError(f"{m.name}: {arg}: the fused kernel cannot compose {op.name} yet: {e}") from None
        schedule = STATIC.get(op.manifest.kernel.builder, {})
        spec = dataclasses.replace(spec, **{f.name: f.default for f in dataclasses.fields(spec) if f.name in schedule})
        for name, values in fixed.get(stage.name, {}).items():
            if getattr(spec, name) not in values:
                raise ValueError(f"{m.name}: {arg}: the fused kernel cannot compose {op.name} yet: its {stage.name} "
                                 f"stage has {name}={getattr(spec, name)!r}, {m.kernel.builder} builds "
                                 f"{' or '.join(map(repr, values))}")
        out[stage.name] = spec
    return out


def kernel_spec(m: OpManifest, params: Mapping[str, Any], calls: Mapping[str, CallSpec], backend: str,
                **fields: Any) -> Any:
    """The fused op's kernel spec: its builder's ``Spec`` of the stage specs (:func:`stage_specs`) and
    the op's own ``fields`` (its own stages', and what the call fixes besides). A value the builder
    refuses is a ValueError naming the op."""
    from tileops.kernels import get_spec

    stages = stage_specs(m, params, calls, backend)
    try:
        return get_spec(m.kernel.builder)(**stages, **fields)
    except ValueError as e:
        raise ValueError(f"{m.name}: {e}") from None
