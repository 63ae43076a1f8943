"""The ``tileops`` command: list, show, check, emit, warmup, generate, demo and coverage."""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from .testing import TOLERANCES

__all__ = ["main"]


def _manifests(files: Sequence[str] | None = None):
    from .manifest import load_files, registry

    return registry() if not files else load_files(files)


def cmd_list(args: argparse.Namespace) -> int:
    reg = _manifests()
    width = max(len(n) for n in reg)
    for name, m in reg.items():
        print(f"{name:<{width}}  {m.family:<6}  {m.summary}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from .manifest import get

    try:
        m = get(args.op)
    except KeyError as e:
        print(f"tileops show: {e.args[0]}", file=sys.stderr)
        return 2
    print(f"{m.name}  ({m.family})  {m.file}:{m.line}")
    print(f"  {m.summary}")
    if m.references:
        print("  references: " + "; ".join(m.references))
    print("params:")
    for p in m.params:
        default = f" = {p.default!r}" if p.has_default else " (required)"
        choices = f"  one of {list(p.choices)}" if p.choices else ""
        print(f"  {p.name}: {p.type}{'?' if p.optional else ''}{default}{choices}\n      {p.doc}")
    for title, tensors in (("inputs", m.inputs), ("outputs", m.outputs)):
        print(f"{title}:")
        for t in tensors:
            if t.like:
                print(f"  {t.name}: like {t.like}\n      {t.doc}")
                continue
            shapes = "; ".join(f"{k or 'shape'}: [{', '.join(v)}]" for k, v in t.shapes.items())
            extra = f"  values in [{t.range[0]}, {t.range[1]})" if t.range else ""
            print(f"  {t.name}: {', '.join(t.dtypes)}  {shapes}{extra}\n      {t.doc}")
    print("rules:")
    for r in m.rules:
        print(f"  {r.check}    ({r.arg}: {r.message})")
    print(f"kernel: {m.kernel.builder}  {dict(m.kernel.static)}")
    print("cases:")
    for c in m.cases:
        dims = ", ".join(f"{k}={v}" for k, v in c.dims.items())
        params = ", ".join(f"{k}={v!r}" for k, v in c.params.items())
        print(f"  {c.label:<22} {dims}{'  ' + params if params else ''}  [{', '.join(c.dtypes)}]")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from .manifest import ManifestError, load_file, manifest_files
    from .manifest.loader import add_op

    files = [Path(f) for f in args.files] if args.files else manifest_files()
    seen: dict = {}
    bad = 0
    for f in files:  # every file is checked: one bad file does not hide the next one's errors
        try:
            for op in load_file(f):
                add_op(seen, op)
        except ManifestError as e:
            print(str(e))
            bad += 1
    if not bad:
        print(f"ok: {len(seen)} ops in {len(files)} files")
    return 1 if bad else 0


def _op_and_call(name: str, label: str | None, device: str = "cpu"):
    import torch

    from .manifest import get
    from .op import CallSpec
    from .workloads import case_dims, case_params, index_dtype, op_class

    m = get(name)
    case = m.case(label) if label else m.cases[0]
    params = case_params(m, case)
    op = op_class(name)(**params)
    dims = case_dims(m, case)
    dtypes = [(t.name, index_dtype(t) if t.range is not None else case.dtypes[0]) for t in m.inputs
              if not t.optional or t.name in case.with_inputs]
    return m, case, op, CallSpec(torch.device(device), tuple(dtypes), tuple(sorted(dims.items())))


def cmd_emit(args: argparse.Namespace) -> int:
    from .generate import emit_source

    try:
        m, case, op, call = _op_and_call(args.op, args.case)
    except KeyError as e:
        print(f"tileops emit: {e.args[0]}", file=sys.stderr)
        return 2
    backend = "c" if args.arch == "c" else "cuda"
    family = importlib.import_module(f"tileops.{m.family}.builtin")
    spec = family.kernel_spec(op, call, backend)
    print(f"// {m.name} case {case.label}, {args.arch}: {spec}")
    print(emit_source(m.kernel.builder, spec, backend, args.arch))
    return 0


def cmd_warmup(args: argparse.Namespace) -> int:
    import torch

    from .warmup import warmup

    arch = args.arch
    if arch is None:
        arch = "c"
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            arch = f"sm_{major}{minor}"
    if arch != "c" and not (arch.startswith("sm_") and arch[3:].isdigit()):
        print(f"tileops warmup: --arch: expected sm_XX or c, got {arch!r}", file=sys.stderr)
        return 2
    if args.jobs is not None and args.jobs < 1:
        print(f"tileops warmup: --jobs: expected a positive number, got {args.jobs}", file=sys.stderr)
        return 2
    try:
        n, seconds, failures = warmup(args.ops or None, arch, args.jobs)
    except KeyError as e:
        print(f"tileops warmup: {e.args[0]}", file=sys.stderr)
        return 2
    for spec, err in failures:
        print(f"tileops warmup: {spec}: {err}", file=sys.stderr)
    print(f"{n - len(failures)} of {n} kernels for {arch} in the cache ({seconds:.1f} s)")
    from . import native

    t0 = time.perf_counter()
    native.build()  # the eager fast path's extension; without a compiler the Python path serves
    print(f"native fast path: {native.status()} ({time.perf_counter() - t0:.1f} s)")
    return 1 if failures else 0


def _time(fn: Any, sync: Any, reps: int) -> float:
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _device(text: str):
    """``--device``: a torch device string on which BUILTIN kernels run (cpu, cuda, cuda:N)."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r} was asked for, but torch sees no CUDA GPU")
    return device


def cmd_demo(args: argparse.Namespace) -> int:
    import torch

    from .workloads import op_class, workload

    device = args.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    rows = []
    failed = 0
    for name, m in _manifests().items():
        case = m.cases[0]
        dtype = case.dtypes[0]
        w = workload(m, case, dtype, device, shrink=device.type == "cpu")
        op = op_class(name)(**w.params)
        t0 = time.perf_counter()
        out = op(**w.inputs)
        sync()
        first = time.perf_counter() - t0
        med = _time(lambda: op(**w.inputs), sync, 20 if device.type == "cuda" else 3)
        family = importlib.import_module(f"tileops.{m.family}.reference")
        ref = family.reference(op, w.inputs)
        got = (out[0] if isinstance(out, tuple) else out).detach().cpu().double()  # (out, key_out): x's
        atol, rtol = TOLERANCES[dtype]
        err = (got - ref).abs()
        ok = bool(torch.isfinite(got).all()) and bool((err <= atol + rtol * ref.abs()).all())
        failed += not ok
        shape = "x".join(str(s) for s in w.inputs[m.inputs[0].name].shape)
        rows.append((name, f"{case.label}-{dtype}", shape, str(device), op.serving_target or "-",
                     f"{err.max().item():.2e}", f"{first:.2f} s", f"{med * 1e6:.1f} us", "ok" if ok else "MISMATCH"))
    head = ("op", "case", "shape", "device", "target", "max err", "first call", "median", "")
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    for r in [head] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
    print(f"{len(rows) - failed} ok, {failed} mismatched")
    return 1 if failed else 0


def cmd_generate(args: argparse.Namespace) -> int:
    from .codegen import generate

    try:
        changed = generate(check=args.check, families=args.families or None)
    except (KeyError, FileNotFoundError) as e:
        print(f"tileops generate: {e.args[0]}", file=sys.stderr)
        return 2
    for path in changed:
        print(f"{path}: {'differs from its manifests (run `tileops generate`)' if args.check else 'written'}")
    if not changed:
        print("ok: every generated module matches its manifests")
    return 1 if (args.check and changed) else 0


def cmd_lowered(args: argparse.Namespace) -> int:
    from . import lowered

    num = args.arch.removeprefix("sm_")
    if not (args.arch.startswith("sm_") and num.isdigit() and int(num) >= 80):
        print(f"tileops lowered: --arch: expected sm_XX with XX >= 80 (the lean build's archs), got {args.arch!r}",
              file=sys.stderr)
        return 2
    if args.jobs is not None and args.jobs < 1:
        print(f"tileops lowered: --jobs: expected a positive number, got {args.jobs}", file=sys.stderr)
        return 2
    out, n, skipped = lowered.write(args.arch, jobs=args.jobs)
    print(f"{out}: {n} kernels lowered for {args.arch}" + (f" ({skipped} not served by the lean build)" if skipped else ""))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tileops", description="LLM operators as TileLang tile programs.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="ops, family and summary").set_defaults(fn=cmd_list)
    p = sub.add_parser("show", help="one op's manifest, readable")
    p.add_argument("op")
    p.set_defaults(fn=cmd_show)
    p = sub.add_parser("check", help="validate manifests: every family's (TILEOPS_FAMILY_PATH's too), or the files given")
    p.add_argument("files", nargs="*")
    p.set_defaults(fn=cmd_check)
    p = sub.add_parser("emit", help="print the kernel source generated for a case")
    p.add_argument("op")
    p.add_argument("--case", help="case label (default: the first case)")
    p.add_argument("--arch", default="sm_90", choices=["sm_90", "sm_80", "c"],
                   help="CUDA C for an sm arch, or C for the CPU (default sm_90)")
    p.set_defaults(fn=cmd_emit)
    p = sub.add_parser("warmup", help="compile the kernels of every case (or of the ops named) ahead of time")
    p.add_argument("ops", nargs="*", help="op names (default: all)")
    p.add_argument("--arch", default=None, help="sm_XX, or c for the CPU (default: this machine's GPU, else c)")
    p.add_argument("--jobs", type=int, default=None, help="compiles at once (default: one per CPU core)")
    p.set_defaults(fn=cmd_warmup)
    p = sub.add_parser("lowered", help="lower every case's kernels and write the sources tileops ships "
                                       "(kernels/lowered/ARCH.json.xz), so their cold first calls skip TileLang")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--jobs", type=int, default=None, help="processes (default: one per CPU)")
    p.set_defaults(fn=cmd_lowered)
    p = sub.add_parser("generate", help="write each family's op classes (tileops/<family>/ops.py) from its manifests")
    p.add_argument("families", nargs="*", help="family names (default: every family)")
    p.add_argument("--check", action="store_true", help="only compare; exit 1 if a file differs from its manifests")
    p.set_defaults(fn=cmd_generate)
    p = sub.add_parser("demo", help="run every op's first case against a float64 reference")
    p.add_argument("--device", type=_device, help="cpu, cuda or cuda:N (default: cuda if there is a GPU, else cpu)")
    p.set_defaults(fn=cmd_demo)
    importlib.import_module("tileops.cli_coverage").register(sub)
    args = parser.parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except BrokenPipeError:  # `tileops emit ... | head`: the reader left, nothing more to say
        sys.stdout = None  # type: ignore[assignment]  # no flush of the closed pipe at exit
        return 0


if __name__ == "__main__":
    sys.exit(main())
