"""Ahead-of-time compilation: build the kernels a server (or a test run) will need, before any data.

``tileops warmup`` compiles, for every manifest case and dtype it lists (or only the ops named),
the forward kernel and, where the manifest declares a backward, the backward kernel, for one device
arch; several compiles run at once in separate processes (nvcc is single-threaded), and each lands
in the on-disk kernel cache, from which a later process's first call loads it.
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib
import itertools
import os
import time
from typing import Any, Iterable, Mapping

__all__ = ["kernel_jobs", "op_kernel_jobs", "compile_jobs", "warmup"]


def kernel_jobs(names: Iterable[str] | None, arch: str) -> list[tuple[str, Any, str, str]]:
    """``(builder, spec, backend, arch)`` for every case x dtype (x direction) of the ops ``names``
    (all when None), without duplicates, in manifest order."""
    from .manifest import registry
    from .workloads import case_dims, case_params

    reg = registry()
    unknown = sorted(set(names or ()) - set(reg))
    if unknown:
        raise KeyError(f"unknown op {unknown[0]!r}; known: {', '.join(reg)}")
    jobs: list[tuple[str, Any, str, str]] = []
    for name, m in reg.items():
        if names and name not in names:
            continue
        for case in m.cases:
            jobs += op_kernel_jobs(name, case_params(m, case), case_dims(m, case), case.dtypes, arch,
                                   with_inputs=case.with_inputs)
    return list(dict.fromkeys(jobs))


def op_kernel_jobs(name: str, params: Mapping[str, Any], dims: Mapping[str, int], dtypes: Iterable[str], arch: str,
                   with_inputs: Iterable[str] | None = None, every_index_dtype: bool = False,
                   backward: bool = True) -> list[tuple[str, Any, str, str]]:
    """The kernel jobs of op ``name`` built with ``params``, for calls with ``dims`` (at least those
    the manifest's ``kernel.specialize`` names) in each of ``dtypes``: forward and, where the
    manifest declares one and ``backward`` is true, backward. Optional inputs are the
    ``with_inputs`` given, or (None) every combination of present and absent; integer inputs take
    their workload dtype, or each of their dtypes with ``every_index_dtype``."""
    import torch

    from .manifest import registry
    from .op import CallSpec
    from .workloads import index_dtype, op_class

    backend = "c" if arch == "c" else "cuda"
    device = torch.device("cpu" if backend == "c" else "cuda")
    m = registry()[name]
    family = importlib.import_module(f"tileops.{m.family}.builtin")
    op = op_class(name)(**params)
    static = tuple(sorted((d, dims[d]) for d in m.kernel.specialize))
    optional = [t.name for t in m.inputs if t.optional]
    if with_inputs is not None:
        present_sets = [set(with_inputs)]
    else:
        present_sets = [{n for n, on in zip(optional, bits) if on}
                        for bits in itertools.product((False, True), repeat=len(optional))]
    jobs: list[tuple[str, Any, str, str]] = []
    for dtype in dtypes:
        for present in present_sets:
            given = [t for t in m.inputs if not t.optional or t.name in present]
            choices = [[(t.name, d) for d in (t.dtypes if every_index_dtype else [index_dtype(t)])]
                       if t.range is not None else [(t.name, dtype)] for t in given]
            for combo in itertools.product(*choices):
                call = CallSpec(device, tuple(combo), static)
                helpers = getattr(family, "helper_kernels", None)  # kernels a call launches besides its own
                jobs += [(b, spec, backend, arch) for b, spec in (helpers(op, call, backend) if helpers else [])]
                for inverse in (False, True) if m.backward and backward else (False,):
                    # a family may serve some views by other kernels (rope: long head-major 2d views)
                    specs = getattr(family, "kernel_specs", None)
                    for spec in (specs(op, call, backend, inverse=inverse) if specs else
                                 [family.kernel_spec(op, call, backend, inverse=inverse)]):
                        jobs.append((m.kernel.builder, spec, backend, arch))
    return list(dict.fromkeys(jobs))


def _compile(job: tuple[str, Any, str, str]) -> str | None:
    """Compile one kernel; None, or the first line of what went wrong."""
    import logging

    from .generate import index_kernel

    logging.getLogger("tilelang").setLevel(logging.ERROR)  # a worker's chatter helps nobody
    try:
        index_kernel(*job)
    except Exception as e:  # noqa: BLE001 - reported per kernel by warmup()
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    return None


def warmup(names: Iterable[str] | None = None, arch: str = "sm_90",
           jobs: int | None = None) -> tuple[int, float, list[tuple[Any, str]]]:
    """Compile every kernel of :func:`kernel_jobs` into the disk cache.

    Returns ``(kernels, seconds, failures)``, ``failures`` a list of ``(spec, error line)``.
    """
    return compile_jobs(kernel_jobs(names, arch), jobs)


def map_jobs(fn: Any, todo: list[Any], jobs: int | None = None) -> list[Any]:
    """``[fn(job) for job in todo]``, ``jobs`` processes at once (default: one per CPU): fresh
    interpreters, so no CUDA context or TileLang state is inherited. ``fn`` must be importable."""
    import multiprocessing

    workers = max(1, min(jobs or os.cpu_count() or 1, len(todo) or 1))
    if workers == 1:
        return [fn(job) for job in todo]
    with cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(fn, todo))


def compile_jobs(todo: list[tuple[str, Any, str, str]], jobs: int | None = None) -> tuple[int, float, list[tuple[Any, str]]]:
    """Compile the kernel jobs ``todo`` into the disk cache, ``jobs`` processes at once (default: one
    per CPU). Returns ``(kernels, seconds, failures)`` as :func:`warmup` does."""
    todo = list(dict.fromkeys(todo))
    t0 = time.perf_counter()
    errors = map_jobs(_compile, todo, jobs)
    failures = [(job[1], err) for job, err in zip(todo, errors) if err]
    return len(todo), time.perf_counter() - t0, failures
