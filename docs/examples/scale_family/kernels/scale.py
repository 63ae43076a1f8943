"""The ``scale`` builder: ``Y = c * X`` over a flat buffer of any length, fp32 arithmetic.

One kernel per dtype and backend serves every shape: the host hands it a contiguous ``X`` and
``Y`` of ``N`` elements (``N`` dynamic) and the factor ``c`` as an fp32 argument, so a new shape or a
new ``c`` never compiles again. The backward of ``y = c * x`` is ``c * g``: this kernel again.

* ``cuda``: one element per thread, ``threads`` per block.
* ``c``: TileLang's C backend has no threads: the same loop runs serially.
"""

from __future__ import annotations

from dataclasses import dataclass

from tileops.kernels.storage import load_f32, storage_dtype, to_storage

#: the schedule choices a manifest's ``kernel.static`` may set: key -> (low, high, what it is)
STATIC = {"threads": (32, 1024, "threads per block (CUDA)")}

#: the kernel's parameters, in order (then the dynamic extent N)
ARGS = ("X", "Y", "c")


@dataclass(frozen=True)
class Spec:
    """Everything a scale kernel is compiled for; two equal specs share one compiled kernel."""

    dtype: str  # float16 | bfloat16 | float32
    backend: str = "cuda"  # cuda | c
    threads: int = 256  # cuda: threads per block

    def __post_init__(self) -> None:
        if self.dtype not in ("float16", "bfloat16", "float32"):
            raise ValueError(f"dtype: expected float16, bfloat16 or float32, got {self.dtype!r}")
        if self.backend not in ("cuda", "c"):
            raise ValueError(f"backend: expected 'cuda' or 'c', got {self.backend!r}")

    @property
    def args(self) -> tuple[str, ...]:
        return ARGS


def build(spec: Spec):
    """The ``T.prim_func`` for ``spec``: ``Y[i] = c * X[i]`` for ``i < N``."""
    # TileLang is imported here, when a kernel is built: a process that loads compiled kernels from
    # tileops' index never imports it
    import tilelang.language as T

    dt, storage = spec.dtype, storage_dtype(spec.dtype, spec.backend)
    N = T.dynamic("N")

    if spec.backend == "c":
        @T.prim_func
        def scale_c(X: T.Tensor((N,), storage), Y: T.Tensor((N,), storage), c: T.float32):
            with T.Kernel(1, threads=1) as _:
                for i in T.serial(N):
                    Y[i] = to_storage(load_f32(X, i, storage, dt) * c, storage, dt)
        return scale_c

    threads = spec.threads

    @T.prim_func
    def scale_cuda(X: T.Tensor((N,), dt), Y: T.Tensor((N,), dt), c: T.float32):
        with T.Kernel(T.ceildiv(N, threads), threads=threads) as bx:
            i = bx * threads + T.get_thread_binding()  # int32: the manifest keeps N <= 2^31 - 1024
            if i < N:
                Y[i] = T.cast(T.cast(X[i], "float32") * c, dt)
    return scale_cuda
