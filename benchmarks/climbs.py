"""How often a call's tensors climb back up a layer: ``python -m benchmarks.climbs [--verbose]``.

A call should walk down: op -> runtime -> kernels. This follows a few calls on the CPU with a
profiler hook (:func:`sys.setprofile`) and places every function that receives the call's tensors
(a tensor argument, or a dict, list or tuple of them) in its layer (``tests/test_layers.py``'s
``LAYERS``); so are the native extension's entry points (``run``, ``execute``, ``add``) and the
``tileops::`` custom ops, both the runtime, whichever of C++ or Python serves them; torch's and the
standard library's frames belong to their caller's layer. A *stay* is a run of such calls in one
layer (in call order); a *climb* is a call from one layer into a higher one. Climbs from the runtime
are the ones issue 35's "one way down" is about: the runtime calling back up into an op or a family.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import tileops

ROOT = Path(tileops.__file__).resolve().parents[1]  # the tree measured: the tileops imported
_spec = importlib.util.spec_from_file_location("_layers", ROOT / "tests" / "test_layers.py")
_layers = sys.modules["_layers"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_layers)  # type: ignore[union-attr]
NAMES = [name for name, _ in _layers.LAYERS]
RUNTIME = NAMES.index("runtime")
_NATIVE_ENTRIES = {"run", "execute", "add"}


def _module(path: str) -> str | None:
    p = Path(path)
    for package, folder in _layers.PACKAGES.items():
        try:
            rel = p.relative_to(folder).with_suffix("")
        except ValueError:
            continue
        parts = [package, *rel.parts]
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    return None


def _holds_tensor(v: Any, depth: int = 2) -> bool:
    if isinstance(v, torch.Tensor):
        return True
    if depth and isinstance(v, dict):
        return any(_holds_tensor(x, depth - 1) for x in v.values())
    if depth and isinstance(v, (list, tuple)):
        return any(_holds_tensor(x, depth - 1) for x in v)
    return False


class Walk:
    """The layers one call's tensors pass through (see the module's doc)."""

    def __init__(self) -> None:
        self.stack: list[int | None] = []
        self.path: list[tuple[int, str]] = []  # (layer, function) of each call that received tensors
        self.climbs: list[tuple[int, int, str]] = []  # (from layer, to layer, function)

    def _here(self) -> int | None:
        return next((x for x in reversed(self.stack) if x is not None), None)

    def _enter(self, layer: int | None, name: str, tensors: bool) -> None:
        here = self._here()
        if layer is not None and tensors:
            self.path.append((layer, name))
            if here is not None and layer > here:
                self.climbs.append((here, layer, name))
        self.stack.append(layer)

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            module = _module(code.co_filename)
            layer = _layers.layer_of(module) if module else None
            if module is None and code.co_name == "__call__" and code.co_filename.endswith(("torch/_ops.py",)):
                op = frame.f_locals.get("self")
                if str(getattr(op, "_qualified_op_name", getattr(op, "name", lambda: ""))).startswith("tileops::") \
                        or "tileops::" in str(op):
                    layer, module = RUNTIME, f"torch.ops.{op}"
            name = f"{module}.{code.co_qualname}" if module else code.co_name
            self._enter(layer, name, any(_holds_tensor(v) for v in frame.f_locals.values()))
        elif event == "c_call":
            owner = getattr(arg, "__self__", None)
            native = type(owner).__module__.startswith("tileops._tileops_native") or \
                type(owner).__name__ == "Dispatch" and getattr(arg, "__name__", "") in _NATIVE_ENTRIES
            self._enter(RUNTIME if native else None, f"native Dispatch.{getattr(arg, '__name__', '?')}", native)
        elif event in ("return", "c_return", "c_exception") and self.stack:
            self.stack.pop()

    def stays(self) -> int:
        return sum(1 for i, (layer, _) in enumerate(self.path) if i == 0 or self.path[i - 1][0] != layer)


def walk(fn: Callable[[], Any]) -> Walk:
    w = Walk()
    sys.setprofile(w)
    try:
        fn()
    except ValueError:
        pass  # the bad-value scenario raises: its walk is what was measured
    finally:
        sys.setprofile(None)
    return w


def scenarios() -> dict[str, Callable[[], Any]]:
    """One call each, after whatever makes it the call it names (a first call binds, a repeat is served)."""
    from tileops.rope import Phi3LongRoPEFwdOp, RoPEFwdOp

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 64, generator=gen)
    pos = torch.arange(6)
    op = RoPEFwdOp()
    late = Phi3LongRoPEFwdOp(original_max_position_embeddings=8, max_position_embeddings=64)
    late(x, position_ids=pos)
    traced = RoPEFwdOp()  # the op of the custom ops' calls (which name it by its handle only)
    ops = torch.ops.tileops
    xg = x.clone().requires_grad_(True)

    def apply(inputs: list, names: str) -> Any:
        return ops.apply(traced._handle, inputs, names)

    def backward() -> None:
        (y,) = apply([xg, pos], "x,position_ids")
        y.sum().backward()

    def fake() -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode() as mode:
            apply([mode.from_tensor(x)], "x")

    return {
        "eager, first call (binds)": lambda: op(x, position_ids=pos),
        "eager, repeated call": lambda: op(x, position_ids=pos),
        "eager, late-bound tables": lambda: late(x, position_ids=pos),
        "eager, a bad position": lambda: op(x, position_ids=pos - 7),
        "tileops::apply, first call": lambda: apply([x, pos], "x,position_ids"),
        "tileops::apply_out": lambda: ops.apply_out(traced._handle, [x], "x", [torch.empty_like(x)]),
        "tileops::apply, fake": fake,
        "tileops::apply, forward and backward": backward,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--verbose", action="store_true", help="list every climb")
    args = ap.parse_args(argv)
    from tileops.runtime import native

    print(f"native runtime: {native.status()}")
    print(f"{'call':40} {'stays':>6} {'climbs':>7} {'from the runtime':>17}")
    total = [0, 0, 0]
    for label, fn in scenarios().items():
        w = walk(fn)
        up = sum(1 for a, _, _ in w.climbs if a == RUNTIME)
        row = [w.stays(), len(w.climbs), up]
        total = [t + r for t, r in zip(total, row)]
        print(f"{label:40} {row[0]:6} {row[1]:7} {row[2]:17}")
        if args.verbose:
            for a, b, name in w.climbs:
                print(f"    {NAMES[a]} -> {NAMES[b]}: {name}")
    print(f"{'all':40} {total[0]:6} {total[1]:7} {total[2]:17}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
