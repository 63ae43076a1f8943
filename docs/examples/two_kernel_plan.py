"""A plan of two kernels sharing a workspace, run on the CPU: the column sums of ``x [M, N]``.

``partials`` sums each of ``G`` blocks of rows (rows ``g, g + G, ...``) into a row of a per-call fp32
workspace; ``reduce`` adds the ``G`` rows into ``y [N]`` times a per-call scalar. The plan declares the
call's tensors and how the kernels see x (its dims named ``m`` and ``n``: the runtime computes its
extents and row stride), the workspace (sized by an expression) and each kernel argument by its role;
the runtime binds it once per call signature and runs it (``tests/test_plans.py`` runs this file's
plan on both executors).

    python docs/examples/two_kernel_plan.py
"""
# (no `from __future__ import annotations`: TileLang reads the prim_funcs' annotations as objects)
import logging
import threading

import torch

from tileops.runtime.executor import PythonRuntime
from tileops.runtime.plan import Dims, Output, Plan, Ptr, Scalar, Size, Step, Stride, Value, Workspace

G = 4  # the partial rows: a block sums rows g, g + G, g + 2G, ...

SUM_ROWS = Plan(
    "sum rows", inputs=("x",), outputs=(Output("y", like="x", shape=("x_n",), dtype_of="x"),), scalars=("scale",),
    # sizes by expression over params and the inputs' extents (x_n: x's dim n)
    workspaces=(Workspace("part", "float32", "G * x_n"),),
    # x is read element by element (no vectors): any row stride, a contiguous row
    dims={"x": Dims("mn", vector=False)},
    steps=(Step("partials", {"X": Ptr("x"), "P": Ptr("part"), "M": Size("x", "m"), "N": Size("x", "n"),
                             "xs": Stride("x", "m"), "G": Value("G")}),
           Step("reduce", {"P": Ptr("part"), "Y": Ptr("y"), "N": Size("x", "n"), "G": Value("G"),
                           "scale": Scalar("scale")})))

_lock = threading.Lock()
_kernels: dict = {}


def kernels() -> dict:
    """The two kernels, compiled for the C backend once per process."""
    with _lock:
        if not _kernels:
            _kernels.update(_compile())
    return _kernels


def _compile() -> dict:
    from tileops.compile import tilelang_api
    from tileops.compile.build import PASS_CONFIGS, c_flags
    from tileops.compile.entry import raw_kernel

    tilelang = tilelang_api.load()
    # TileLang logs two INFO lines per compile to stdout (tileops drops them from its own compiles)
    logging.getLogger("tilelang").setLevel(logging.WARNING)
    from tilelang import language as T

    NX, NP, NY = T.dynamic("NX"), T.dynamic("NP"), T.dynamic("NY")

    @T.prim_func
    def partials(X: T.Tensor((NX,), "float32"), P: T.Tensor((NP,), "float32"), M: T.int64, N: T.int64,
                 xs: T.int64, G: T.int64):
        with T.Kernel(1, threads=1) as _:
            for g in T.serial(G):
                for n in T.serial(N):
                    acc = T.alloc_var("float32")
                    acc = 0.0
                    for r in T.serial((M - g + G - 1) // G):
                        acc = acc + X[(g + r * G) * xs + n]
                    P[g * N + n] = acc

    @T.prim_func
    def reduce(P: T.Tensor((NP,), "float32"), Y: T.Tensor((NY,), "float32"), N: T.int64, G: T.int64,
               scale: T.int64):
        with T.Kernel(1, threads=1) as _:
            for n in T.serial(N):
                acc = T.alloc_var("float32")
                acc = 0.0
                for g in T.serial(G):
                    acc = acc + P[g * N + n]
                Y[n] = acc * T.cast(scale, "float32")

    out = {}
    for name, func, params in (("partials", partials, ("X", "P", "M", "N", "xs", "G")),
                               ("reduce", reduce, ("P", "Y", "N", "G", "scale"))):
        k = tilelang.compile(func, target="c", execution_backend="cython", pass_configs=PASS_CONFIGS,
                             compile_flags=list(c_flags()))
        out[name] = raw_kernel(k, torch.device("cpu"), params)
    return out


def bind(x, outs=None):
    """SUM_ROWS bound for calls shaped like ``x`` (``outs``: ``{"y": tensor}`` to write into)."""
    return SUM_ROWS.bind(kernels(), {"x": x}, outs or {}, env={"G": G})


if __name__ == "__main__":
    x = torch.arange(12.0).reshape(6, 2)
    runtime = PythonRuntime(0)  # a runtime of no op: the plan's names are its own, nothing is checked
    binding = bind(x)
    print("launches:", len(binding.launches), "workspace bytes:", binding.work_bytes)
    for scale in (1, 10):
        print("scale", scale, "y:", runtime.execute(binding, {"x": x}, {}, (scale,)).tolist())
