"""What a kernel launch costs on the host, by launch style: ``python -m benchmarks.launch_cost``.

Builds one trivial kernel (nvcc) with three C entry points: TileLang's style (``cudaLaunchKernelEx``
with programmatic stream serialisation allowed), ``cudaLaunchKernelEx`` with no attribute, and the
triple-chevron launch; times each through ctypes beside a bare torch op."""

from __future__ import annotations

import ctypes
import os
import subprocess
import tempfile
import time

import torch

SRC = r"""
#include <cuda_runtime.h>
extern "C" __global__ void k(float* y, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) y[i] += 1.0f; }
extern "C" int pdl(float* y, int n, cudaStream_t s) {
  cudaLaunchConfig_t c; cudaLaunchAttribute a[1];
  a[0].id = cudaLaunchAttributeProgrammaticStreamSerialization; a[0].val.programmaticStreamSerializationAllowed = 1;
  c.attrs = a; c.numAttrs = 1; c.stream = s; c.gridDim = dim3((n + 127) / 128); c.blockDim = dim3(128); c.dynamicSmemBytes = 0;
  cudaLaunchKernelEx(&c, k, y, n); return cudaGetLastError() != cudaSuccess;
}
extern "C" int ex(float* y, int n, cudaStream_t s) {
  cudaLaunchConfig_t c; c.attrs = 0; c.numAttrs = 0; c.stream = s; c.gridDim = dim3((n + 127) / 128); c.blockDim = dim3(128);
  c.dynamicSmemBytes = 0; cudaLaunchKernelEx(&c, k, y, n); return cudaGetLastError() != cudaSuccess;
}
extern "C" int chevron(float* y, int n, cudaStream_t s) { k<<<(n + 127) / 128, 128, 0, s>>>(y, n); return cudaGetLastError() != cudaSuccess; }
"""


def per_call_us(fn, n: int = 20000) -> float:
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n // 5):
            fn()
        best = min(best, (time.perf_counter() - t0) / (n // 5))
        torch.cuda.synchronize()
    return best * 1e6


def main() -> None:
    d = tempfile.mkdtemp()
    cu, so = os.path.join(d, "k.cu"), os.path.join(d, "k.so")
    open(cu, "w").write(SRC)
    subprocess.run(["nvcc", "-shared", "-Xcompiler", "-fPIC", "-arch=sm_90", cu, "-o", so], check=True)
    lib = ctypes.CDLL(so)
    y = torch.zeros(4096, device="cuda")
    s = torch._C._cuda_getCurrentRawStream(0)
    rows = []
    for name in ("pdl", "ex", "chevron"):
        f = getattr(lib, name)
        f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p], ctypes.c_int
        p = y.data_ptr()
        rows.append((name, per_call_us(lambda: f(p, 4096, s))))
    rows.append(("y.add_(1.0)", per_call_us(lambda: y.add_(1.0))))
    for name, us in rows:
        print(f"{us:7.2f} us  {name}")


if __name__ == "__main__":
    main()
