"""The lean CUDA build against TileLang's own build, on a GPU, side by side.

    python -m benchmarks.lean_ab steps    # where a cold lean build's time goes (run it in a new process)
    python -m benchmarks.lean_ab launch   # host time per launch, both builds of one kernel, alternating
    python -m benchmarks.lean_ab graph    # decode q+k in a CUDA graph of 100, alternating processes

``steps`` needs empty caches to mean "cold" (set ``TILEOPS_CACHE_DIR`` and ``TILELANG_CACHE_DIR`` to
fresh folders); the other two make their own. Medians, as everywhere in ``benchmarks/``.
"""

from __future__ import annotations

import array
import os
import statistics
import subprocess
import sys
import tempfile
import time

SPEC = dict(dtype="float16", head_dim=128, rot=128, head_lanes=8)


def steps() -> None:
    t0 = time.perf_counter()
    import torch

    torch.zeros(1, device="cuda")
    t1 = time.perf_counter()
    import tilelang  # noqa: F401

    t2 = time.perf_counter()
    from tileops.compile import cuda_build, build
    from tileops.kernels.rope import RoPEKernelSpec
    from tileops.compile.entry import raw_kernel_from

    spec = RoPEKernelSpec(**SPEC)
    func = build.prim_func("rope", spec)
    t3 = time.perf_counter()
    lean = cuda_build.build(func, "sm_90", build.PASS_CONFIGS)
    t4 = time.perf_counter()
    raw_kernel_from(build._init_library(lean.libpath), lean.record, torch.device("cuda"), spec.args)
    t5 = time.perf_counter()
    parts = " | ".join(f"{k} {v:.2f}" for k, v in lean.seconds.items())
    print(f"import torch + CUDA {t1 - t0:.2f} s | import tilelang {t2 - t1:.2f} | trace the prim_func {t3 - t2:.2f} | "
          f"{parts} | build {t4 - t3:.2f} | open + load the cubin {t5 - t4:.2f} | {lean.compiler}")


def launch(rounds: int = 22, calls: int = 500) -> None:
    """Each build's raw launch (:meth:`tileops.compile.entry.RawKernel.launch`) ``calls`` times per round,
    the two alternating; batches stay below the launch queue's depth, so the host is what is timed."""
    import torch

    from tileops.compile import cuda_build, build
    from tileops.kernels.rope import RoPEKernelSpec
    from tileops.compile.entry import raw_kernel, raw_kernel_from
    from tileops.rope.tables import RoPETables

    dev = torch.device("cuda")
    spec = RoPEKernelSpec(dtype="float32", head_dim=64, rot=64, head_lanes=8)
    theirs = raw_kernel(build.compile_kernel("rope", spec, "cuda", "sm_90"), dev, spec.args)
    lean = cuda_build.build(build.prim_func("rope", spec), "sm_90", build.PASS_CONFIGS)
    ours = raw_kernel_from(build._init_library(lean.libpath), lean.record, dev, spec.args)
    x = torch.randn(1, 16, 8, 64, device=dev)
    y = torch.empty_like(x)
    td = RoPETables(10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64), 1.0).on(dev)
    st = list(x.stride()[:3])

    def args(k):
        return array.array("q", k.bind(**dict.fromkeys(k.arg_names, 0) | dict(  # what a call does not set is 0
            X=x.data_ptr(), Y=y.data_ptr(), K=x.data_ptr(), KY=y.data_ptr(), TD=td.data_ptr(), B=1, S=16, H=8,
            HK=0, xsb=st[0], xss=st[1], xsh=st[2], ysb=st[0], yss=st[1], ysh=st[2])))

    runs = {"TileLang's build": (theirs, args(theirs)), "lean build": (ours, args(ours))}
    stream = torch.cuda.current_stream().cuda_stream
    got: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(rounds):
        for name, (k, a) in runs.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                k.launch(a, stream)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            if r >= 2:  # the first two rounds warm up
                got[name].append((t1 - t0) / calls * 1e6)
    for name, v in got.items():
        print(f"{name}: host us per launch, median {statistics.median(v):.2f} (min {min(v):.2f}, max {max(v):.2f})")


GRAPH = """
from benchmarks.serving import decode_graph_row
rows = [decode_graph_row() for _ in range(3)]
print(" ".join(f"{r['graph_us_per_call']:.2f}" for r in rows), "|", " ".join(f"{r['eager_us_per_call']:.2f}" for r in rows))
"""


def graph(rounds: int = 3) -> None:
    """``benchmarks.serving``'s decode graph row, three times per process, in processes alternating
    between the builds (``TILEOPS_LEAN_BUILD``), each build with its own kernel index."""
    with tempfile.TemporaryDirectory() as d:
        for _ in range(rounds):
            for lean in ("1", "0"):
                env = {**os.environ, "TILEOPS_LEAN_BUILD": lean, "TILEOPS_CACHE_DIR": os.path.join(d, lean),
                       "TILEOPS_NATIVE": "0"}  # a fresh cache: an import would build the native runtime first
                out = subprocess.run([sys.executable, "-c", GRAPH], env=env, capture_output=True, text=True, check=True)
                name = "lean build" if lean == "1" else "TileLang's build"
                print(f"{name}: graph us per call {out.stdout.strip().splitlines()[-1].replace('|', '; eager us')}")


if __name__ == "__main__":
    {"steps": steps, "launch": launch, "graph": graph}[sys.argv[1] if len(sys.argv) > 1 else "steps"]()
