"""Compare the machine code of tileops' lean CUDA build with TileLang's own build, kernel by kernel.

    python -m benchmarks.lean_sass [--arch sm_90] [--jobs 2] [--only N]

For every kernel ``tileops warmup`` builds: the device source TileLang generates is compiled as
TileLang compiles it (``nvcc`` with TileLang's templates and CUTLASS), and the lean build's version of
it (:func:`tileops.compile.cuda_build.device_source`) as the lean build does (NVRTC, else ``nvcc -cubin``). The
two cubins are disassembled with ``cuobjdump -sass`` (``cuobjdump`` and ``nvdisasm`` on PATH: the
``nvidia-cuda-cuobjdump`` and ``nvidia-cuda-nvdisasm`` wheels carry them) and their instruction
streams compared, encodings included, addresses left out. Needs no GPU. Prints one line per kernel
and a count; exits 1 if any kernel differs.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import tempfile


def _sass(path: str) -> list[str]:
    text = subprocess.run(["cuobjdump", "-sass", path], capture_output=True, text=True, check=True).stdout
    return [re.sub(r"/\*[0-9a-f]{4,}\*/", "", line).strip() for line in text.splitlines() if "/*" in line and ";" in line]


def compare(job: tuple) -> tuple[str, str]:
    """(the spec, "same" or what differs) for one warmup job."""
    import tilelang
    from tvm import transform
    from tvm.target import Target

    from tileops.compile import cuda_build, build, tilelang_api

    builder, spec, _, arch = job
    func = build.prim_func(builder, spec)
    target = Target({"kind": "cuda", "arch": arch})
    with transform.PassContext(opt_level=3, config=build.PASS_CONFIGS), target:
        full = tilelang.lower(func, target=target).kernel_source
    try:
        lean = cuda_build.device_source(full)
    except cuda_build.Unsupported as e:
        return repr(spec), f"not lean ({e})"
    with tempfile.TemporaryDirectory(prefix="tileops-sass-") as d:
        with open(os.path.join(d, "full.cu"), "w") as f:
            f.write(full)
        num = arch.removeprefix("sm_")
        # TileLang's flags (tilelang/jit/adapter/libgen.py), device code only
        cmd = [os.path.join(cuda_build.cuda_home(), "bin", "nvcc"), "-cubin", "-std=c++20", "-w", "-Xcudafe",
               "--diag_suppress=177", "-lineinfo", "-gencode", f"arch=compute_{num},code={arch}",
               os.path.join(d, "full.cu"), "-o", os.path.join(d, "full.cubin"),
               *[f"-I{inc}" for inc in tilelang_api.template_include_dirs()]]
        subprocess.run(cmd, check=True, capture_output=True)
        blob, how = cuda_build.cubin(lean, arch, "kernel")
        with open(os.path.join(d, "lean.cubin"), "wb") as f:
            f.write(blob)
        a, b = _sass(os.path.join(d, "full.cubin")), _sass(os.path.join(d, "lean.cubin"))
    if not a:
        return repr(spec), "no SASS read from TileLang's cubin"
    if a == b:
        return repr(spec), f"same ({len(a)} instructions, {how})"
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return repr(spec), f"DIFFERENT ({len(a)} against {len(b)} instructions, first at {first}, {how})"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--only", type=int, help="the first N kernels only")
    args = p.parse_args()
    if not shutil.which("cuobjdump") or not shutil.which("nvdisasm"):
        print("cuobjdump and nvdisasm must be on PATH", file=sys.stderr)
        return 2
    from tileops.compile.warmup import kernel_jobs

    jobs = kernel_jobs(None, args.arch)[: args.only]
    counts: dict[str, int] = {}
    with cf.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        for spec, result in pool.map(compare, jobs):
            print(f"{result.split(' (')[0]:9s}  {result}  {spec}", flush=True)
            counts[result.split(" ")[0]] = counts.get(result.split(" ")[0], 0) + 1
    print(f"{len(jobs)} kernels: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    return 0 if set(counts) <= {"same", "not"} else 1


if __name__ == "__main__":
    sys.exit(main())
