"""The target registry: which set of kernels serves an op.

``target=`` on every op takes

* ``BUILTIN``: tileops' own TileLang kernels, lowered to CUDA for the input's GPU or to C for the CPU;
* a registered name: ``"torch"`` (plain PyTorch, any device; in-tree) or one a package registers
  through the ``tileops.targets`` entry-point group;
* ``None``: decided at the first call from the input's device: a registered target that claims
  that device, else ``BUILTIN``.

A target implements op *families*: ``implement(op, spec)`` returns a callable for one
specialization of one op (its dtype, head_dim, layout and device), which the op caches.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import importlib.metadata
import logging
import threading
from typing import Any, Callable

import torch

__all__ = [
    "BUILTIN", "ENTRY_POINT_GROUP", "Target", "FamilyTarget", "register_target", "get_target",
    "target_names", "resolve_target", "TargetError",
]

log = logging.getLogger("tileops.targets")

#: The name of the in-tree TileLang kernels; pass it as ``target=BUILTIN``.
BUILTIN = "builtin"
#: Packages register targets under this entry-point group: ``name = "pkg.module:attr"``, where the
#: attribute is a :class:`Target` instance, or a class or function that returns one.
ENTRY_POINT_GROUP = "tileops.targets"


class TargetError(ValueError):
    """An unknown target name, or a target that cannot serve an op on a device. Raised for an op,
    its message starts with the op's name, as every other error of an op does."""


class Target:
    """Base class of a set of kernels.

    Subclasses set `name` and implement `implement(op, spec)`, which returns a callable taking the
    op's input tensors as keywords (``op`` is a :class:`tileops.op.Op`; this module, which the op
    imports, does not import it back); `claims(device)` says whether the target wants to serve a device
    when ops are built with `target=None` (default: never).
    """

    name: str = ""
    description: str = ""

    def claims(self, device: torch.device) -> bool:
        return False

    def supports(self, op_name: str, family: str, device: torch.device) -> bool:
        return True

    def implement(self, op: Any, spec: Any) -> Callable[..., Any]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<tileops target {self.name!r}>"


class FamilyTarget(Target):
    """A target whose implementations are looked up per op family.

    ``families`` maps a family name to ``"module:function"``; the function is imported on first
    use and called as ``function(op, spec)``.
    """

    families: dict[str, str] = {}

    def supports(self, op_name: str, family: str, device: torch.device) -> bool:
        return family in self.families

    def implement(self, op: Any, spec: Any) -> Callable[..., Any]:
        family = op.manifest.family
        if family not in self.families:
            raise TargetError(f"{op.name}: target: {self.name!r} has no kernels for the {family!r} family; "
                              f"it serves: {', '.join(self.families) or 'nothing'}")
        module, func = self.families[family].split(":")
        return getattr(importlib.import_module(module), func)(op, spec)


class _InTree(FamilyTarget):
    """An in-tree target found by convention: family ``f`` is served when ``tileops/f/<module>.py``
    exists and defines ``implement(op, spec)``; a new family needs no edit here."""

    module = ""

    @property
    def families(self) -> dict[str, str]:  # type: ignore[override]
        return _in_tree_families(self.module)


@functools.lru_cache(maxsize=None)
def _in_tree_families(module: str) -> dict[str, str]:
    from .manifest import registry

    found = {}
    for family in sorted({m.family for m in registry().values()}):
        name = f"tileops.{family}.{module}"
        try:
            exists = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # no tileops.<family> package at all
            exists = False
        if exists:
            found[family] = f"{name}:implement"
    return found


class _Builtin(_InTree):
    name = BUILTIN
    description = "tileops' TileLang kernels: CUDA for the input's GPU (its sm arch), C on the CPU"
    module = "builtin"

    def supports(self, op_name: str, family: str, device: torch.device) -> bool:
        return family in self.families and device.type in ("cuda", "cpu")


class _Torch(_InTree):
    name = "torch"
    description = "plain PyTorch on any device (fp32 arithmetic, float64-derived cos/sin); used only when named"
    module = "torch_impl"


_lock = threading.Lock()
_registry: dict[str, Target] = {}
_entry_points_loaded = False


def register_target(target: Target, *, replace: bool = False) -> Target:
    """Register ``target`` under ``target.name``; a second one of that name needs ``replace=True``."""
    if not isinstance(target, Target):
        raise TypeError(f"target: expected a tileops.targets.Target, got {type(target).__name__}")
    if not isinstance(target.name, str) or not target.name:
        raise ValueError("target.name: expected a non-empty string")
    with _lock:
        if target.name in _registry and not replace and _registry[target.name] is not target:
            raise ValueError(f"target {target.name!r} is already registered ({_registry[target.name]!r}); "
                             f"pass replace=True to replace it")
        _registry[target.name] = target
    return target


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
            target = obj if isinstance(obj, Target) else obj()
            if not isinstance(target, Target):
                raise TypeError(f"{ep.value} gave {type(target).__name__}, not a Target")
            if not target.name:
                target.name = ep.name
            register_target(target)
            log.info("tileops: loaded target %r from entry point %s", target.name, ep.value)
        except Exception as e:  # a broken plug-in must not break tileops itself
            log.warning("tileops: skipped entry point %s = %s: %s", ep.name, ep.value, e)


def target_names() -> list[str]:
    """Names of every registered target, in-tree and from entry points."""
    _load_entry_points()
    return sorted(_registry)


def get_target(name: str, *, op_name: str = "") -> Target:
    """The target registered as ``name``; unknown names fail with the list of known ones (the
    message starting with ``op_name`` when one is given)."""
    _load_entry_points()
    try:
        return _registry[name]
    except KeyError:
        prefix = f"{op_name}: " if op_name else ""
        raise TargetError(f"{prefix}target: unknown target {name!r}; known targets: "
                          f"{', '.join(sorted(_registry))} (or None to decide from the input device)") from None


def check_target_arg(target: Any, op_name: str) -> Target | None:
    """Validate the ``target=`` argument of ``op_name`` at construction: a known name, a Target, or None."""
    if target is None:
        return None
    if isinstance(target, Target):
        return target
    if not isinstance(target, str):
        raise TypeError(f"{op_name}: target: expected a target name (str), BUILTIN or None, "
                        f"got {type(target).__name__}")
    return get_target(target, op_name=op_name)


_logged: set[tuple[str, str, str]] = set()


def resolve_target(op_name: str, family: str, device: torch.device) -> tuple[Target, str]:
    """For ``target=None``: the target serving ``op_name`` on ``device``, and why it was chosen."""
    _load_entry_points()
    for name in sorted(_registry):
        t = _registry[name]
        if name != BUILTIN and t.claims(device) and t.supports(op_name, family, device):
            reason = f"target {name!r} claims {device.type} devices"
            break
    else:
        t = _registry[BUILTIN]
        kind = "CUDA for this GPU's sm arch" if device.type == "cuda" else "C on the CPU"
        reason = f"no registered target claims {device.type}; BUILTIN TileLang kernels ({kind})"
    key = (op_name, str(device), t.name)
    if key not in _logged:
        _logged.add(key)
        log.info("tileops: %s on %s is served by %r: %s", op_name, device, t.name, reason)
    return t, reason


register_target(_Builtin())
register_target(_Torch())
