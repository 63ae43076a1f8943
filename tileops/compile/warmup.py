"""Ahead-of-time compilation: build the kernels a server (or a test run) will need, before any data.

``tileops warmup`` compiles, for one device arch, the forward kernel of every manifest case and dtype
(or only the ops named) and, where the manifest declares one, the backward kernel, several at once in
separate processes (nvcc is single-threaded), into the on-disk kernel cache a later process's first
call loads from. ``tileops lowered`` lowers the same list and writes the sources tileops ships
(:func:`write_lowered`, :mod:`tileops.compile.lowered`).

Which kernels an op needs is the op's family's to say, not an op's: the family's BUILTIN module
(``tileops.<family>.builtin``, found by the manifest's family) defines
``kernel_specs(manifest, params, call, backend, backward=True)``, every ``(builder, spec)`` a call
of one specialization (:class:`tileops.manifest.CallSpec`) may launch. Nothing here constructs an op.

The processes are fresh interpreters running ``python -m tileops.compile.warmup``, fed jobs through a pipe
(:func:`map_jobs`), not a ``multiprocessing`` pool: a spawned pool's workers re-import the caller's
``__main__``, so ``op.compile(...)`` in a script without an ``if __name__ == "__main__":`` guard
ran the script again in every worker and died with ``BrokenProcessPool``.
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from . import cuda_build, lowered
from .cuda_build import MIN_SM

__all__ = ["kernel_jobs", "op_kernel_jobs", "schedule_jobs", "compile_jobs", "warmup", "write_lowered", "map_jobs",
           "default_arch", "arch_problem"]


def default_arch() -> str:
    """The arch ``--arch`` defaults to: this machine's GPU's (``sm_90`` on an H200), else ``c``."""
    import torch

    from .build import device_backend

    return device_backend(torch.device("cuda"))[1] if torch.cuda.is_available() else "c"


def arch_problem(arch: str, cpu: bool = True, build: bool = False) -> str | None:
    """Why ``arch`` cannot be used, or None: the one check behind every ``--arch``.

    ``c`` (the CPU) when ``cpu`` allows it; else ``sm_XX`` with XX >= :data:`MIN_SM`. With ``build``
    (kernels are compiled, not only lowered), a CUDA arch also needs what the lean build compiles
    with: the CUDA toolkit's headers and static runtime, NVRTC or nvcc, and a C++ compiler. No GPU and
    no driver: the lean build links the static runtime, not ``libcuda`` (``tileops warmup --arch
    sm_90`` builds every kernel on a machine without a GPU), and every kernel of the manifests is one
    it serves (``tileops lowered`` reports any that is not).
    """
    if arch == "c":
        return None if cpu else f"expected sm_XX with XX >= {MIN_SM}, got 'c' (this command is for CUDA only)"
    num = arch.removeprefix("sm_")
    if not (arch.startswith("sm_") and num.isdigit()):
        return f"expected sm_XX{' or c' if cpu else ''}, got {arch!r}"
    if int(num) < MIN_SM:
        return (f"expected sm_XX with XX >= {MIN_SM} (bfloat16 conversions and the lean build need sm_80), "
                f"got {arch!r}")
    if build:
        try:
            cuda_build.check_toolchain()
        except cuda_build.Unsupported as e:
            return f"building for {arch} needs the CUDA toolkit, and here: {e} (the CPU's kernels: --arch c)"
    return None


#: ``(manifest, call, dims, params) -> schedules``: the schedules (knob tuples, ``CallSpec.schedule``)
#: whose kernels a warm-up builds for a call besides the built-in one's (``tileops.schedules.shipped_for``)
Schedules = Callable[[Any, Any, Mapping[str, Any], Mapping[str, Any]], Iterable[tuple]]


def kernel_jobs(names: Iterable[str] | None, arch: str, schedules: Schedules | None = None,
                cases: Iterable[str] | None = None) -> list[tuple[str, Any, str, str]]:
    """``(builder, spec, backend, arch)`` for every case (or those labelled ``cases``) x dtype (x
    direction) of the ops ``names`` (all when None), without duplicates, in manifest order; with
    ``schedules``, also the kernels of the schedules it names for each case's calls."""
    from ..manifest import case_dims, case_params, registry

    reg = registry()
    unknown = sorted(set(names or ()) - set(reg))
    if unknown:
        raise KeyError(f"unknown op {unknown[0]!r}; known: {', '.join(reg)}")
    labels = None if cases is None else set(cases)
    jobs: list[tuple[str, Any, str, str]] = []
    for name, m in reg.items():
        if names and name not in names:
            continue
        for case in m.cases:
            if labels is not None and case.label not in labels:
                continue
            jobs += op_kernel_jobs(name, case_params(m, case), case_dims(m, case), case.dtypes, arch,
                                   with_inputs=case.with_inputs, schedules=schedules)
    return list(dict.fromkeys(jobs))


def op_kernel_jobs(name: str, params: Mapping[str, Any], dims: Mapping[str, int], dtypes: Iterable[str], arch: str,
                   with_inputs: Iterable[str] | None = None, every_index_dtype: bool = False,
                   backward: bool = True, schedules: Schedules | None = None) -> list[tuple[str, Any, str, str]]:
    """The kernel jobs of op ``name`` built with ``params`` (the manifest's defaults fill the rest),
    for calls with ``dims`` (at least those the manifest's ``kernel.specialize`` names) in each of
    ``dtypes``: forward and, where the manifest declares one and ``backward`` is true, backward.
    Optional inputs are the ``with_inputs`` given, or (None) every combination of present and
    absent; integer inputs take their workload dtype, or each of their dtypes with
    ``every_index_dtype`` (:func:`tileops.manifest.call_specs`). The family's ``kernel_specs``
    names the kernels of each call; ``schedules``, where given, the schedules besides the built-in one
    whose kernels each call also needs."""
    import torch

    from ..manifest import call_specs, registry

    backend = "c" if arch == "c" else "cuda"
    m = registry()[name]
    params = {**m.defaults(), **params}
    jobs: list[tuple[str, Any, str, str]] = []
    for call in call_specs(m, dims, dtypes, torch.device("cpu" if backend == "c" else "cuda"), with_inputs,
                           every_index_dtype, params):
        knobs = ((), *(schedules(m, call, dims, params) if schedules is not None else ()))
        jobs += schedule_jobs(m, params, call, knobs, arch, backward)
    return list(dict.fromkeys(jobs))


def schedule_jobs(manifest: Any, params: Mapping[str, Any], call: Any, schedules: Iterable[tuple], arch: str,
                  backward: bool = True) -> list[tuple[str, Any, str, str]]:
    """The kernel jobs of one call (a :class:`tileops.manifest.CallSpec`) of an op built with ``params``
    under each of ``schedules`` (knobs ``((builder, knob, value), ...)``; ``()``: the built-in one), as the
    family's ``kernel_specs`` names them: the forward's and, with ``backward``, the backward's."""
    import dataclasses

    backend = "c" if arch == "c" else "cuda"
    specs = importlib.import_module(f"tileops.{manifest.family}.builtin").kernel_specs
    return [(builder, spec, backend, arch) for knobs in schedules
            for builder, spec in specs(manifest, params, dataclasses.replace(call, schedule=knobs) if knobs else call,
                                       backend, backward)]


def _compile(job: tuple[str, Any, str, str]) -> str | None:
    """Compile one kernel; None, or the first line of what went wrong."""
    from .build import index_kernel

    try:
        index_kernel(*job)
    except Exception as e:  # noqa: BLE001 - reported per kernel by warmup()
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    return None


def warmup(names: Iterable[str] | None = None, arch: str = "sm_90", jobs: int | None = None,
           progress: bool | None = None,
           schedules: Schedules | None = None) -> tuple[int, float, list[tuple[Any, str]]]:
    """Compile every kernel of :func:`kernel_jobs` into the disk cache (``progress``: see
    :func:`tileops.progress.wanted`).

    Returns ``(kernels, seconds, failures)``, ``failures`` a list of ``(spec, error line)``.
    """
    return compile_jobs(kernel_jobs(names, arch, schedules), jobs, progress)


def _lower(job: tuple[str, Any, str, str]) -> tuple[str, dict[str, Any] | None]:
    """Lower one kernel for the lean build: its lean index key, and its sources as
    :mod:`tileops.compile.lowered` keeps them, with the digest of its TIR (``tir``: what
    :func:`tileops.compile.build.lowering_digest` gives); None for a kernel the lean build does not serve."""
    from .build import index_key, lowering_digest, pass_configs, prim_func

    logging.getLogger("tilelang").setLevel(logging.ERROR)
    builder, spec, backend, arch = job
    key = index_key(builder, spec, backend, arch, lean=True)
    func = prim_func(builder, spec)
    try:
        src = cuda_build.lower_sources(func, arch, pass_configs(spec))
    except cuda_build.Unsupported as e:
        # kept in the file as such (no sources: lowered.lookup gives None and TileLang's own build serves
        # it), so a later run keeps it rather than lowering it again, and the file accounts for every
        # warmup kernel (the attention forward's TMA descriptors: ~10-40 s to lower on 2 cores)
        return key, {"spec": repr(spec), "unserved": str(e), "tir": lowering_digest(func, arch, pass_configs(spec))}
    return key, {"spec": repr(spec), "device": src.device, "host": src.host, "record": src.record, "name": src.name,
                 "tir": lowering_digest(func, arch, pass_configs(spec))}


def _tir(job: tuple[str, Any, str, str]) -> tuple[str, str]:
    """One kernel's lean index key and :func:`tileops.compile.build.lowering_digest` (its prim_func
    built, not lowered: 0.17 s a kernel here, against 8 s to lower one on 2 cores)."""
    from .build import index_key, lowering_digest, pass_configs, prim_func

    logging.getLogger("tilelang").setLevel(logging.ERROR)
    builder, spec, backend, arch = job
    digest = lowering_digest(prim_func(builder, spec), arch, pass_configs(spec))
    return index_key(builder, spec, backend, arch, lean=True), digest


def write_lowered(arch: str = "sm_90", jobs: int | None = None, names: Any = None,
                  progress: bool | None = None, schedules: Schedules | None = None) -> tuple[Path, dict[str, int]]:
    """Lower every CUDA kernel of :func:`kernel_jobs` for ``arch`` (``jobs`` processes, ``progress``
    as :func:`tileops.progress.wanted`) and write the file tileops ships
    (:func:`tileops.compile.lowered.write`); returns its path and how many kernels were ``kept``
    (shipped under their key), ``carried`` (shipped under an old key, their TIR unchanged),
    ``lowered``, and ``unserved`` (in the file as kernels the lean build does not serve: no sources).

    An entry shipped under its key is what lowering would give again (the key digests the spec, the
    builder's files, TileLang and the lean build): kept, so adding a family lowers its kernels only.
    An edit to a builder or to a helper every builder imports moves every key of the family, or of
    all of them; where the kernel's TIR is what it was (:func:`tileops.compile.build.lowering_digest`
    equal to the shipped entry's ``tir``), the entry moves to the new key instead of being lowered
    again: a refactor that leaves the generated code alone costs 0.17 s a kernel, not 8 s."""
    from .build import index_key

    todo = {index_key(*j, lean=True): j for j in kernel_jobs(names, arch, schedules) if j[2] == "cuda"}
    shipped = lowered.shipped(arch)
    kernels = {k: v for k, v in shipped.items() if k in todo and "tir" in v}
    kept = len(kernels)
    rest = [j for k, j in todo.items() if k not in kernels]
    by_tir = {v["tir"]: v for v in shipped.values() if "tir" in v}
    again, carried = [], 0
    for key, tir in map_jobs(_tir, rest, jobs, progress=progress, what="reading kernels' TIR"):
        if key in shipped:  # shipped under its key before entries held their TIR's digest
            kernels[key] = {**shipped[key], "tir": tir}
            kept += 1
        elif tir in by_tir:
            kernels[key] = {**by_tir[tir], "spec": repr(todo[key][1])}
            carried += 1
        else:
            again.append(todo[key])
    results = map_jobs(_lower, again, jobs, progress=progress, what="lowering kernels")
    kernels.update(dict(results))
    counts = {"kept": kept, "carried": carried, "lowered": len(results),
              "unserved": sum("unserved" in v for v in kernels.values())}
    return lowered.write(arch, dict(sorted(kernels.items()))), counts


def _job_label(job: Any) -> str:
    """A kernel job in a few words, for a progress line."""
    from .build import kernel_label

    if isinstance(job, tuple) and len(job) == 4:
        builder, spec, _, arch = job
        return f"{kernel_label(builder, spec)} {arch}"
    return str(job)


def map_jobs(fn: Callable[[Any], Any], todo: list[Any], jobs: int | None = None, progress: bool | None = None,
             what: str = "jobs") -> list[Any]:
    """``[fn(job) for job in todo]``, ``jobs`` processes at once (default: one per CPU), one
    progress step per job (``progress``: :func:`tileops.progress.wanted`). ``fn`` must be a
    module-level function of an importable module, ``todo`` picklable.

    Workers are fresh interpreters (no CUDA context or TileLang state inherited) started as
    ``python -m tileops.compile.warmup``, so they import tileops and never the caller's ``__main__``.
    """
    from ..progress import Progress, wanted

    results: list[Any] = [None] * len(todo)
    workers = max(1, min(jobs or os.cpu_count() or 1, len(todo) or 1))
    with Progress(len(todo), what, wanted(progress)) as bar:
        if workers == 1:
            for i, job in enumerate(todo):
                t0 = time.perf_counter()
                results[i] = fn(job)
                bar.step(_job_label(job), time.perf_counter() - t0)
            return results
        lock = threading.Lock()
        order = iter(range(len(todo)))
        env = dict(os.environ)
        # the folder this tileops package imports from (tileops/compile/warmup.py: three levels up)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        env["TILEOPS_NATIVE"] = "0"  # workers only compile kernels: none may build or load the runtime

        def drive() -> None:
            proc = subprocess.Popen([sys.executable, "-m", "tileops.compile.warmup"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, env=env)
            assert proc.stdin is not None and proc.stdout is not None
            try:
                while True:
                    with lock:
                        i = next(order, None)
                    if i is None:
                        return
                    pickle.dump((fn, todo[i]), proc.stdin)
                    proc.stdin.flush()
                    try:
                        ok, value, seconds = pickle.load(proc.stdout)
                    except EOFError:
                        raise RuntimeError(f"a tileops worker died (exit code {proc.wait()}) on "
                                           f"{_job_label(todo[i])}; its stderr is above") from None
                    if not ok:
                        raise RuntimeError(f"{_job_label(todo[i])}: {value}")
                    results[i] = value
                    with lock:
                        bar.step(_job_label(todo[i]), seconds)
            finally:
                proc.stdin.close()
                proc.wait()

        with cf.ThreadPoolExecutor(workers, thread_name_prefix="tileops-worker") as pool:
            for f in [pool.submit(drive) for _ in range(workers)]:
                f.result()
    return results


def _serve() -> None:
    """A :func:`map_jobs` worker: ``(fn, job)`` pickles from stdin, ``(ok, result or error, seconds)``
    pickles to stdout, until stdin closes. What compilers or TileLang print goes to stderr."""
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    logging.getLogger("tilelang").setLevel(logging.ERROR)  # a worker's chatter helps nobody
    logging.getLogger("tileops").setLevel(logging.WARNING)  # nor a "compiled ..." line per kernel
    jobs = sys.stdin.buffer
    while True:
        try:
            fn, job = pickle.load(jobs)
        except EOFError:
            return
        t0 = time.perf_counter()
        try:
            answer = (True, fn(job))
        except Exception as e:  # noqa: BLE001 - the parent raises it, with the job named
            answer = (False, f"{type(e).__name__}: {e}")
        pickle.dump((*answer, time.perf_counter() - t0), answers)
        answers.flush()


def compile_jobs(todo: list[tuple[str, Any, str, str]], jobs: int | None = None,
                 progress: bool | None = None) -> tuple[int, float, list[tuple[Any, str]]]:
    """Compile the kernel jobs ``todo`` into the disk cache, ``jobs`` processes at once (default: one
    per CPU), one progress step per kernel. Returns ``(kernels, seconds, failures)`` as :func:`warmup` does.

    Kernels the index already has are not compiled again, and no process is started for them. One
    batch compiles at a time per cache (a lock file, :func:`tileops.compile.build.index_lock`): a second caller (a test
    module's warm-up in each of pytest-xdist's 14 workers, two servers warming up) waits for the first,
    then compiles what is still missing. Without it, each worker compiled every kernel of the module
    in a process per CPU: 14 x 16 TileLang builds of the same 65 kernels, and the H200 run of the
    attention backward's tests spent its 600 s on them (``benchmarks/NOTES.md``, 2026-12-03)."""
    from ..progress import wanted
    from .build import index_lock, indexed

    todo = list(dict.fromkeys(todo))
    t0 = time.perf_counter()
    with index_lock(progress):
        missing = [job for job in todo if not indexed(*job)]
        if len(missing) < len(todo) and wanted(progress):
            print(f"tileops: {len(todo) - len(missing)} of {len(todo)} kernels already in the cache", file=sys.stderr,
                  flush=True)
        errors = map_jobs(_compile, missing, jobs, progress=progress, what="compiling kernels") if missing else []
    failures = [(job[1], err) for job, err in zip(missing, errors) if err]
    return len(todo), time.perf_counter() - t0, failures


if __name__ == "__main__":
    _serve()
