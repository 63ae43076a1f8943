"""The ``tileops`` command: list, show, check, emit, warmup, generate, demo and coverage."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

from . import cli_coverage
from .compile.warmup import arch_problem, default_arch
from .progress import Progress
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
            opt = ("  (optional" + (", positional" if t.positional else "") + ")") if t.optional else ""
            if t.like:
                by = f", dtype from {t.dtype_by}" if t.dtype_by else ""
                print(f"  {t.name}: like {t.like}{by}{opt}\n      {t.doc}")
                continue
            shapes = "; ".join(f"{k or 'shape'}: [{', '.join(v)}]" for k, v in t.shapes.items())
            extra = f"  values in [{t.range[0]}, {t.range[1]})" if t.range else ""
            print(f"  {t.name}: {', '.join(t.dtypes)}  {shapes}{extra}{opt}\n      {t.doc}")
    if m.backward is not None:
        b = m.backward
        print(f"backward: wrt {', '.join(b.wrt)}" + (f"; summed over rows: {', '.join(b.reduce)}" if b.reduce else "")
              + (f"; saves: {', '.join(' or '.join(e) for e in b.saves)}" if b.saves else ""))
    print("rules:")
    for r in m.rules:
        print(f"  {r.check}    ({r.arg}: {r.message})")
    print(f"kernel: {m.kernel.builder}  {dict(m.kernel.static)}")
    print("cases:")
    for c in m.cases:
        dims = ", ".join([*(f"{k}={v}" for k, v in c.dims.items()), *([f"lead={list(c.lead)}"] if c.lead else [])])
        params = ", ".join(f"{k}={v!r}" for k, v in c.params.items())
        print(f"  {c.label:<22} {dims}{'  ' + params if params else ''}  [{', '.join(c.dtypes)}]")
    _show_schedules(m, args.device or _default_device())
    return 0


def _default_device() -> Any:
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _show_schedules(m: Any, device: Any) -> None:
    """``tileops show``'s schedule part: the declared spaces, then which schedule serves each case on
    ``device`` (an op built with target=None) and where it came from (tileops.schedules)."""
    import torch

    from . import schedules
    from .workloads import op_class, workload

    tune = m.kernel.tune
    if tune is None:
        print("schedules: the manifest's kernel.static only (no kernel.tune space)")
        return
    print("schedule spaces (kernel.tune):")
    for backend, space in tune.spaces.items():
        knobs = ", ".join(f"{b}.{k} in {list(v)}" for b, k, v in space.knobs)
        rules = f"; rules: {', '.join(str(r) for r in space.rules)}" if space.rules else ""
        print(f"  {backend}: {knobs}{rules}  ({len(schedules.candidates(m, backend))} candidates)")
    identity = schedules.device_identity(device)
    print(f"schedules on {device} ({identity['name']}), for an op built with target=None:")
    for c in m.cases:
        dtype = next((d for d in c.dtypes if device.type == "cuda" or d != "float8_e4m3fn"), None)
        if dtype is None:
            continue
        w = workload(m, c, dtype, device, shrink=device.type == "cpu", generator=torch.Generator().manual_seed(0))
        op = op_class(m.name)(**w.params)
        try:
            op._check_call(w.inputs)
        except (TypeError, ValueError) as e:
            print(f"  {c.label:<22} refused: {e}")
            continue
        print(f"  {c.label + '-' + dtype:<30} {op.schedule}")


def cmd_tune(args: argparse.Namespace) -> int:
    """``tileops tune``: every named op's (default: every op with a space for the device's backend)
    manifest cases, grouped by shape class, each class tuned once over all its cases."""
    import torch

    from . import schedules, tuning
    from .manifest import registry
    from .workloads import op_class, workload

    device = args.device or _default_device()
    backend = "cuda" if device.type == "cuda" else "c"
    reg = registry()
    names = args.ops or [n for n, m in reg.items() if m.kernel.tune and backend in m.kernel.tune.spaces]
    unknown = [n for n in names if n not in reg]
    if unknown:
        print(f"tileops tune: unknown op {unknown[0]!r}; `tileops list` names them", file=sys.stderr)
        return 2
    if args.budget is not None and args.budget <= 0:
        print(f"tileops tune: --budget: expected seconds > 0, got {args.budget}", file=sys.stderr)
        return 2
    labels = {c.label for n in names for c in reg[n].cases}
    unknown = [c for c in (args.cases or ()) if c not in labels]
    if unknown:
        print(f"tileops tune: --cases: {unknown[0]!r} is no case of {', '.join(names)}; cases: "
              f"{', '.join(sorted(labels))}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    failed = 0
    for name in names:
        m = reg[name]
        if not schedules.candidates(m, backend):
            print(f"tileops tune: {name}: no schedule space for the {backend} backend (kernel.tune.{backend}); "
                  f"skipped", file=sys.stderr)
            continue
        # the cases of each shape class, their inputs seeded by their order (the same draws every run)
        classes: dict[tuple, list] = {}
        for i, c in enumerate(m.cases):
            if args.cases and c.label not in args.cases:
                continue
            for j, dtype in enumerate(c.dtypes):
                if device.type == "cpu" and dtype == "float8_e4m3fn":
                    continue
                w = workload(m, c, dtype, device, shrink=device.type == "cpu",
                             generator=torch.Generator().manual_seed(7919 * i + j))
                op = op_class(name)(**w.params)
                try:
                    op._check_call(w.inputs)
                except (TypeError, ValueError):
                    continue  # a case this device refuses (a dtype the C backend lacks)
                key = (repr(sorted(w.params.items(), key=lambda kv: kv[0])), op.schedule.shape_class)
                classes.setdefault(key, []).append((op, w))
        op_t0, done = time.monotonic(), 0
        for (_, cls), members in classes.items():
            op = members[0][0]
            labels = "+".join(w.label for _, w in members)
            left = None if args.budget is None else args.budget - (time.monotonic() - t0)
            if left is not None and left <= 0:
                # (each class's built-in schedule is built and timed before its search: on the H200, 5-20 s
                # a class, which a spent budget would otherwise go on paying for classes it cannot search)
                print(f"tileops tune: {name} {labels}: not tuned, the budget ({args.budget:g} s) is spent",
                      file=sys.stderr)
                continue
            try:
                r = tuning.tune_calls(op, [w.inputs for _, w in members], budget=left, progress=args.progress,
                                      label=labels)
            except ValueError as e:
                failed += 1
                print(f"tileops tune: {name} {labels}: {e}", file=sys.stderr)
                continue
            best = r.best
            again = (f"; timed again, alternated: {r.confirmed[1] * 1e6:.1f} us against the built-in's "
                     f"{r.confirmed[2] * 1e6:.1f}" if r.confirmed else "")
            print(f"{name}  {labels}  class {cls}\n    built-in {r.baseline.seconds * 1e6:.1f} us; the search's best "
                  f"{best.label()} {best.seconds * 1e6:.1f} us{again}; kept: {r.chosen}; {len(r.trials)} of "
                  f"{len(schedules.candidates(m, backend))} candidates tried, {len(r.dropped)} dropped, "
                  f"{r.seconds:.0f} s")
            done += bool(r.trials)
        print(f"{name}: {done} of {len(classes)} shape classes tuned in {time.monotonic() - op_t0:.0f} s")
    if names:
        print(f"table: {schedules.tuned_path(schedules.device_identity(device))}")
    return 1 if failed else 0


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
            print(str(e), file=sys.stderr)
            bad += 1
    if not bad:
        print(f"ok: {len(seen)} ops in {len(files)} files")
    return 1 if bad else 0


def _op_and_call(name: str, label: str | None, device: str = "cpu"):
    """(manifest, case, op, the call specialization of the case's first dtype) for ``tileops emit``;
    the op is constructed so that the case's params are checked as a user's would be."""
    import torch

    from .manifest import call_specs, case_dims, case_params, get
    from .workloads import op_class, op_params

    m = get(name)
    case = m.case(label) if label else m.cases[0]
    op = op_class(name)(**op_params(m, case_params(m, case)))
    call = call_specs(m, case_dims(m, case), case.dtypes[:1], torch.device(device), case.with_inputs,
                      params=op.params)[0]
    return m, case, op, call


def cmd_emit(args: argparse.Namespace) -> int:
    from .compile.build import emit_source

    try:
        m, case, op, call = _op_and_call(args.op, args.case)
    except KeyError as e:
        print(f"tileops emit: {e.args[0]}", file=sys.stderr)
        return 2
    arch = args.arch or default_arch()
    problem = arch_problem(arch)  # CUDA source is only lowered: no toolkit needed
    if problem:
        print(f"tileops emit: --arch: {problem}", file=sys.stderr)
        return 2
    backend = "c" if arch == "c" else "cuda"
    family = importlib.import_module(f"tileops.{m.family}.builtin")
    builder, spec = family.kernel_specs(m, op.params, call, backend, backward=False)[0]  # the forward kernel
    print(f"// {m.name} case {case.label}, {arch}: {spec}")
    print(emit_source(builder, spec, backend, arch))
    return 0


def _bad_arch_or_jobs(command: str, problem: str | None, jobs: int | None) -> bool:
    """Say on stderr what is wrong with ``--arch`` (``problem``, :func:`arch_problem`'s) or ``--jobs``;
    whether anything is."""
    if problem:
        print(f"tileops {command}: --arch: {problem}", file=sys.stderr)
    elif jobs is not None and jobs < 1:
        print(f"tileops {command}: --jobs: expected a positive number, got {jobs}", file=sys.stderr)
    return bool(problem) or (jobs is not None and jobs < 1)


def cmd_warmup(args: argparse.Namespace) -> int:
    from . import schedules
    from .runtime import native
    from .compile.warmup import warmup

    arch = args.arch or default_arch()
    if _bad_arch_or_jobs("warmup", arch_problem(arch, build=True), args.jobs):
        return 2
    try:
        # the shipped tables' choices too: a fresh process on such a device takes them
        n, seconds, failures = warmup(args.ops or None, arch, args.jobs, progress=True,
                                      schedules=schedules.shipped_for(arch))
    except KeyError as e:
        print(f"tileops warmup: {e.args[0]}", file=sys.stderr)
        return 2
    # one line per distinct error: a missing tool fails every kernel the same way
    by_error: dict[str, list[Any]] = {}
    for spec, err in failures:
        by_error.setdefault(err, []).append(spec)
    for err, specs in by_error.items():
        more = f" (and {len(specs) - 1} more kernels)" if len(specs) > 1 else ""
        print(f"tileops warmup: {specs[0]}{more}: {err}", file=sys.stderr)
    print(f"{n - len(failures)} of {n} kernels for {arch} in the cache ({seconds:.1f} s)")
    t0 = time.perf_counter()
    try:  # the native runtime's extension, which later processes load when they import tileops
        where = f"built: {native.build(progress=True)}"
    except OSError as e:  # no compiler or headers: the Python runtime serves
        where = f"not built ({e})"
    print(f"native runtime: {where} ({time.perf_counter() - t0:.1f} s)")
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

    device = args.device or _default_device()
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    rows = []
    failed = 0
    reg = _manifests()
    bar = Progress(len(reg), "first calls")
    for name, m in reg.items():
        case = m.cases[0]
        dtype = case.dtypes[0]
        w = workload(m, case, dtype, device, shrink=device.type == "cpu")
        op = op_class(name)(**w.params)
        t0 = time.perf_counter()
        with _no_compile_lines():  # the step's line says it, with the first call's time
            out = op(**w.inputs)
            sync()
        first = time.perf_counter() - t0
        bar.step(f"{name} {case.label} {dtype} on {device}: first call", first)
        med = _time(lambda: op(**w.inputs), sync, 20 if device.type == "cuda" else 3)
        family = importlib.import_module(f"tileops.{m.family}.reference")
        ref = family.reference(op, w.inputs)
        got = (out[0] if isinstance(out, tuple) else out).detach().cpu().double()  # (out, key_out): x's
        atol, rtol = TOLERANCES[dtype]
        err = (got - ref).abs()
        # a family may measure errors against another magnitude than each element's (the prologue:
        # its rotation pair's, reference.scale)
        mag = family.scale(op, w.inputs) if hasattr(family, "scale") else ref.abs()
        ok = bool(torch.isfinite(got).all()) and bool((err <= atol + rtol * mag).all())
        failed += not ok
        shape = "x".join(str(s) for s in w.inputs[m.inputs[0].name].shape)
        rows.append((name, f"{case.label}-{dtype}", shape, str(device), op.serving_target or "-",
                     f"{err.max().item():.2e}", f"{first:.2f} s", f"{med * 1e6:.1f} us", "ok" if ok else "MISMATCH"))
    bar.close()
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
    from . import schedules
    from .compile.warmup import write_lowered

    # lowering only: no GPU, no CUDA toolkit
    if _bad_arch_or_jobs("lowered", arch_problem(args.arch, cpu=False), args.jobs):
        return 2
    out, n = write_lowered(args.arch, jobs=args.jobs, progress=True, schedules=schedules.shipped_for(args.arch))
    print(f"{out}: {n['kept'] + n['carried'] + n['lowered']} kernels for {args.arch}: {n['kept']} kept, "
          f"{n['carried']} carried over to new keys (TIR unchanged), {n['lowered']} lowered"
          + (f" ({n['unserved']} not served by the lean build)" if n["unserved"] else ""))
    return 0


@contextlib.contextmanager
def _no_compile_lines() -> Iterator[None]:
    """Within: no "tileops: compiled ..." lines (a command that reports its own progress)."""
    from .compile.build import compile_log

    level = compile_log.level
    compile_log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        compile_log.setLevel(level)


def _version() -> str:
    try:
        return importlib.metadata.version("tileops")
    except importlib.metadata.PackageNotFoundError:  # a checkout on sys.path, not installed
        return "unknown (not installed)"


_ARCH_DEFAULT = "default: this machine's GPU's arch (sm_90 on an H100/H200), else c"


def _command(sub: Any, name: str, fn: Any, help: str, description: str) -> argparse.ArgumentParser:
    """A subcommand: ``help`` is its line in ``tileops --help``, ``description`` heads its own ``--help``."""
    p = sub.add_parser(name, help=help, description=description)
    p.set_defaults(fn=fn)
    return p


def parser() -> argparse.ArgumentParser:
    """The ``tileops`` argument parser (every subcommand with its help)."""
    top = argparse.ArgumentParser(prog="tileops", description="LLM operators as TileLang tile programs: list and "
                                  "inspect the ops, compile their kernels ahead of time, check them against "
                                  "float64 references.")
    top.add_argument("--version", action="version", version=f"tileops {_version()}")
    sub = top.add_subparsers(dest="cmd", metavar="COMMAND")
    _command(sub, "list", cmd_list, "ops, family and summary",
             "List every op the manifests define: its name, family and one-line summary.")
    p = _command(sub, "show", cmd_show, "one op's manifest, readable",
                 "Print one op's manifest in readable form: parameters, inputs and outputs with their dtypes "
                 "and shapes, the rules a call is checked against, the kernel and the test cases.")
    p.add_argument("op", help="op name, e.g. RoPEFwdOp (`tileops list` names them)")
    p.add_argument("--device", type=_device, help="the device whose schedules are shown: cpu, cuda or cuda:N "
                                                  "(default: cuda if there is a GPU, else cpu)")
    p = _command(sub, "tune", cmd_tune, "tune ops' schedules on this device, over their manifest cases",
                 "Tune the schedules of the ops named (default: every op whose manifest declares a space for the "
                 "device's backend, kernel.tune) on the device at hand, over the manifest's cases grouped by shape "
                 "class: every candidate is checked against the float64 reference before it is timed (a wrong one "
                 "is dropped and reported), and the fastest, or the built-in schedule when no candidate beats it "
                 "by 3%, is kept in this machine's table (TILEOPS_CACHE_DIR/schedules/), which ops built with "
                 "target=None then use.")
    p.add_argument("ops", nargs="*", help="op names (default: every op with a space for the backend)")
    p.add_argument("--device", type=_device, help="cpu, cuda or cuda:N (default: cuda if there is a GPU, else cpu)")
    p.add_argument("--budget", type=float, default=None, help="seconds to spend at most, over all ops (default: "
                                                               "the whole spaces); the best found by then is kept")
    p.add_argument("--cases", nargs="*", default=None, help="only these case labels")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a line per candidate on stderr (default: when stderr is a terminal)")
    p = _command(sub, "check", cmd_check, "validate manifests: every family's (TILEOPS_FAMILY_PATH's too), "
                 "or the files given", "Validate op manifests (every packaged family's and TILEOPS_FAMILY_PATH's, "
                 "or the files given). Each error is printed on stderr with its file and line; the exit status "
                 "is 1 when any file is bad.")
    p.add_argument("files", nargs="*", help="manifest YAML files (default: every family's)")
    p = _command(sub, "emit", cmd_emit, "print the kernel source generated for a case",
                 "Print the kernel source TileLang generates for one of an op's cases: CUDA C for an sm arch "
                 "(only lowered: no GPU or CUDA toolkit needed), C for the CPU.")
    p.add_argument("op", help="op name")
    p.add_argument("--case", help="case label (default: the first case)")
    p.add_argument("--arch", default=None, help=f"sm_XX (XX >= 80) or c for the CPU ({_ARCH_DEFAULT})")
    p = _command(sub, "warmup", cmd_warmup, "compile the kernels of every case (or of the ops named) ahead of time",
                 "Compile ahead of time, into the disk cache, the kernels of every manifest case (or of the ops "
                 "named), several at once, then build the native runtime; a later process's first calls load "
                 "them. A CUDA arch needs the CUDA toolkit, not a GPU or its driver: a build machine fills a cache "
                 "(TILEOPS_CACHE_DIR) that GPU machines of that arch load from.")
    p.add_argument("ops", nargs="*", help="op names (default: all)")
    p.add_argument("--arch", default=None, help=f"sm_XX (XX >= 80), or c for the CPU ({_ARCH_DEFAULT})")
    p.add_argument("--jobs", type=int, default=None, help="compiles at once (default: one per CPU core)")
    p = _command(sub, "lowered", cmd_lowered, "lower every case's kernels and write the sources tileops ships "
                 "(kernels/lowered/ARCH.json.xz), so their cold first calls skip TileLang",
                 "Lower every case's kernels with TileLang for a CUDA arch and write the lean build's sources "
                 "that tileops ships (kernels/lowered/ARCH.json.xz), so that their cold first calls skip TileLang. "
                 "Lowering needs no GPU.")
    p.add_argument("--arch", default="sm_90", help="sm_XX with XX >= 80 (default sm_90, the file tileops ships)")
    p.add_argument("--jobs", type=int, default=None, help="processes (default: one per CPU)")
    p = _command(sub, "generate", cmd_generate, "write each family's op classes (tileops/<family>/ops.py) from "
                 "its manifests", "Write each family's op classes (tileops/<family>/ops.py) from its manifests, "
                 "or with --check only compare them.")
    p.add_argument("families", nargs="*", help="family names (default: every family)")
    p.add_argument("--check", action="store_true", help="only compare; exit 1 if a file differs from its manifests")
    p = _command(sub, "demo", cmd_demo, "run every op's first case against a float64 reference",
                 "Run every op's first case, compare it with a float64 reference and print the error, the first "
                 "call's time (a compile when the kernel is not cached) and the median call time.")
    p.add_argument("--device", type=_device, help="cpu, cuda or cuda:N (default: cuda if there is a GPU, else cpu)")
    cli_coverage.register(sub)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    top = parser()
    args = top.parse_args(argv)
    if args.cmd is None:  # bare `tileops`: what it can do, as pip and cargo answer; nothing failed
        top.print_help()
        return 0
    try:
        return int(args.fn(args) or 0)
    except BrokenPipeError:  # `tileops emit ... | head`: the reader left, nothing more to say
        sys.stdout = None  # type: ignore[assignment]  # no flush of the closed pipe at exit
        return 0


if __name__ == "__main__":
    sys.exit(main())
