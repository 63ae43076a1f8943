"""Run a TileLang kernel's generated CUDA source on the CPU, one OS thread per CUDA thread.

Without a GPU, a CUDA schedule is otherwise only lowered and compiled: nothing checks that its
indexing, predicates, shuffles and barriers compute the right thing. This harness compiles the
device source TileLang emits (``tileops.compile.build.emit_source``) as C++ with g++ and runs it:
the blocks of the grid one after another, the threads of a block as cooperative contexts
(``ucontext``) on one OS thread, each run to its next barrier in turn, with

* ``threadIdx``/``blockIdx`` set for the context that runs, ``__syncthreads`` a barrier of the
  block, ``__shared__`` arrays ``static`` (one block runs at a time);
* ``__shfl_xor_sync`` through a per-warp exchange array between two barriers of the warp's 32
  threads (so every lane of a warp must reach each shuffle, as on the GPU, or the run hangs);
* ``bfloat16_t``/``half_t`` converted with round-to-nearest-even (``_Float16`` for fp16), as the
  GPU's ``cvt.rn`` does; ``rsqrtf`` is ``1 / sqrtf`` (the GPU's is within 2 ulp of it); ``fmaf``
  and ``__fmul_rn`` the host's IEEE ``fmaf`` and product (the GPU's give the same bits);
  ``min``/``max`` of two values of one type, and TileLang's ``uchar``/``ushort``/``uint``;
  ``atomicMax`` on ``unsigned long long`` (a bad value's record, ``tileops/kernels/report.py``);
  the float8 conversion's ``cvt.rn.satfinite.e4m3x2.f32`` by a search over e4m3fn's values;
  ``prefetch.global.L2`` (a hint, no data) as nothing;
* a helper's ``#ifdef __CUDA_ARCH__`` branch dropped for its ``#else`` (``kernels/norm.py``'s ``cp.async``
  copies are then plain copies, done when issued, and the waits nothing);
* dynamic shared memory (``extern __shared__ T name[]``) a ``static`` array of 256 KB, past the
  227 KB a block of an H100/H200 may take, filled with 0xFF bytes (NaN in every float type) as each
  block starts: on the GPU it holds what the last block left, so a read of a byte no thread of the
  block wrote shows as NaN here instead of passing as a zero.

What it cannot show: speed, memory ordering between blocks, and the GPU's approximate ``rsqrtf``.
A kernel that uses anything else of CUDA fails to compile here, which is itself a finding.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile

__all__ = ["available", "CudaOnCpu"]

_PRELUDE = r"""
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <ucontext.h>
#include <vector>
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
struct Dim3 { unsigned x, y, z; };
static Dim3 threadIdx, blockIdx;
struct uint4 { unsigned x, y, z, w; };
struct float4 { float x, y, z, w; };
struct uint2 { unsigned x, y; };
struct float2 { float x, y; };
struct bfloat16_t {
  uint16_t storage;
  bfloat16_t() = default;
  explicit bfloat16_t(float f) {
    uint32_t u; std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) { storage = (uint16_t)((u >> 16) | 0x40); return; }
    u += 0x7fffu + ((u >> 16) & 1u);
    storage = (uint16_t)(u >> 16);
  }
  operator float() const { uint32_t u = (uint32_t)storage << 16; float f; std::memcpy(&f, &u, 4); return f; }
};
struct half_t {
  _Float16 v;
  half_t() = default;
  explicit half_t(float f) : v((_Float16)f) {}
  operator float() const { return (float)v; }
};
static inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
static inline float __fmul_rn(float a, float b) { return a * b; }  // fmaf, fabsf, copysignf: <cmath>
/* TileLang's names for uint8/16/32 (macros of its common.h) and CUDA's integer min/max */
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
template <typename T> static inline T min(T a, T b) { return b < a ? b : a; }
template <typename T> static inline T max(T a, T b) { return a < b ? b : a; }
template <typename T> static inline void __stcg(T* p, T v) { *p = v; }
// one context runs at a time and none yields inside this: a plain read-compare-store is atomic here
static inline unsigned long long atomicMax(unsigned long long* p, unsigned long long v) {
  unsigned long long old = *p;
  if (v > old) *p = v;
  return old;
}
/* the threads of one block: cooperative contexts on this OS thread, switched at barriers */
struct TileopsBarrier { int count, arrived; unsigned gen; };
static ucontext_t tileops_main;
static std::vector<ucontext_t> tileops_ctx;
static std::vector<char> tileops_done;
static int tileops_cur;
static TileopsBarrier tileops_block_bar;
static std::vector<TileopsBarrier> tileops_warp_bar;
static float tileops_lanes[32][32];
static inline void tileops_yield() { swapcontext(&tileops_ctx[tileops_cur], &tileops_main); }
static inline void tileops_wait(TileopsBarrier& b) {
  unsigned g = b.gen;
  if (++b.arrived == b.count) { b.arrived = 0; b.gen++; return; }
  while (b.gen == g) tileops_yield();
}
static inline void __syncthreads() { tileops_wait(tileops_block_bar); }
static inline float __shfl_xor_sync(unsigned, float v, int mask, int width = 32) {
  int t = threadIdx.x, w = t / 32, l = t % 32;
  tileops_lanes[w][l] = v;
  tileops_wait(tileops_warp_bar[w]);
  float got = tileops_lanes[w][(l ^ mask) % width + (l / width) * width];
  tileops_wait(tileops_warp_bar[w]);
  return got;
}
/* cvt.rn.satfinite.e4m3x2.f32 of one value (the float8 caches' conversion): the nearest of e4m3fn's
   finite values, ties to the even code, saturated at +-448, NaN as 0x7F; found by looking at every
   code, so it shares nothing with the kernels' bit arithmetic */
static inline unsigned short tileops_cvt_e4m3(float x) {
  if (std::isnan(x)) return 0x7F;
  unsigned short sign = std::signbit(x) ? 0x80 : 0;
  if (std::isinf(x)) return sign | 0x7E;  // every code is infinitely far: the search below would keep 0
  double a = std::fabs((double)x), best = 1e300;
  unsigned short code = 0;
  for (unsigned short c = 0; c <= 0x7E; ++c) {
    double v = c < 8 ? c * std::ldexp(1.0, -9) : (8 + (c & 7)) * std::ldexp(1.0, (c >> 3) - 10);
    double d = std::fabs(v - a);
    if (d < best || (d == best && (c & 1) == 0)) { best = d; code = c; }
  }
  return sign | code;
}
static std::function<void()> tileops_body;
static void tileops_entry() { tileops_body(); tileops_done[tileops_cur] = 1; }
/* run body() as `threads` CUDA threads of each of `grid` blocks; a round-robin scheduler resumes
   every unfinished thread in turn (each runs to its next barrier or its end) */
static void tileops_grid(int grid, int threads) {
  const size_t stack = 1 << 16;
  std::vector<char> stacks((size_t)threads * stack);
  tileops_ctx.assign(threads, ucontext_t());
  tileops_warp_bar.assign((threads + 31) / 32, TileopsBarrier{32, 0, 0});
  for (int b = 0; b < grid; ++b) {
    tileops_block_bar = TileopsBarrier{threads, 0, 0};
    tileops_done.assign(threads, 0);
    for (int t = 0; t < threads; ++t) {
      getcontext(&tileops_ctx[t]);
      tileops_ctx[t].uc_stack.ss_sp = stacks.data() + (size_t)t * stack;
      tileops_ctx[t].uc_stack.ss_size = stack;
      tileops_ctx[t].uc_link = &tileops_main;
      makecontext(&tileops_ctx[t], tileops_entry, 0);
    }
    for (int left = threads; left > 0;) {
      left = 0;
      for (int t = 0; t < threads; ++t) {
        if (tileops_done[t]) continue;
        tileops_cur = t;
        threadIdx = Dim3{(unsigned)t, 0, 0};
        blockIdx = Dim3{(unsigned)b, 0, 0};
        swapcontext(&tileops_main, &tileops_ctx[t]);
        left += !tileops_done[t];
      }
    }
  }
}
"""

#: the float8 conversion's inline PTX (``tileops.kernels.float8.CVT_SOURCE``), run by ``tileops_cvt_e4m3``
#: an L2 prefetch (``kernels/norm.py`` ``PREFETCH_HELPER``): a hint that moves no data, dropped here
_PREFETCH = re.compile(r'asm volatile\("prefetch\.global\.L2 \[%0\];" :: "l"\(\w+\)\);')
#: a device-only branch of a helper (``#ifdef __CUDA_ARCH__ ... [#else ...] #endif``, not nested): its
#: ``#else`` part, or nothing
_DEVICE_ONLY = re.compile(r"^[ \t]*#ifdef __CUDA_ARCH__\n.*?^[ \t]*(?:#else\n(.*?)^[ \t]*)?#endif[^\n]*\n", re.DOTALL | re.MULTILINE)
#: dynamic shared memory, sized at launch on the GPU: here one static array of 256 KB
_DYN_SHARED = re.compile(r"extern __shared__ (__align__\(\d+\) )?(\w+) (\w+)\[\];")
_CVT_E4M3 = re.compile(r'asm\("\{cvt\.rn\.satfinite\.e4m3x2\.f32.*?"=h"\((\w+)\)\s*:\s*"f"\((\w+)\).*?\);')
_DECL = re.compile(r'extern "C" __global__ void (\w+)\(([^)]*)\);')


def available() -> bool:
    """Whether a C++ compiler is here (``$CXX``, else ``g++``)."""
    return shutil.which(os.environ.get("CXX", "g++")) is not None


def _params(decl: str) -> list[tuple[str, str]]:
    """(C type, name) of each parameter of a kernel declaration."""
    out = []
    for part in (p.strip() for p in decl.split(",") if p.strip()):
        words = part.replace("__restrict__", "").split()
        out.append((" ".join(words[:-1]), words[-1]))
    return out


class CudaOnCpu:
    """One kernel's device source, compiled for the CPU; ``launch(grid, block, **args)``."""

    def __init__(self, device_source: str):
        found = _DECL.search(device_source)
        if found is None:
            raise ValueError("no extern \"C\" __global__ kernel declaration in the source")
        self.name, self.params = found.group(1), _params(found.group(2))
        device_source = _DEVICE_ONLY.sub(lambda m: m.group(1) or "", device_source)
        # (thread 0 runs first in each block: it poisons the block's memory before any thread uses it)
        device_source = _DYN_SHARED.sub(r"static \1\2 \3[(256 << 10) / sizeof(\2)]; "
                                        r"if (threadIdx.x == 0) memset(\3, 0xFF, sizeof(\3));", device_source)
        body = "\n".join(line for line in device_source.splitlines()
                         if not line.lstrip().startswith("#") or line.lstrip().startswith("#pragma"))
        body = _CVT_E4M3.sub(r"\1 = tileops_cvt_e4m3(\2);", body)
        body = _PREFETCH.sub("", body)
        casts = ", ".join(f"({t})(intptr_t)a[{i}]" if "*" in t else f"({t})a[{i}]"
                          for i, (t, _) in enumerate(self.params))
        runner = (
            'extern "C" int tileops_run(const int64_t* a, int grid, int threads) {\n'
            f"  tileops_body = [a] {{ {self.name}({casts}); }};\n"
            "  tileops_grid(grid, threads);\n"
            "  return 0;\n"
            "}\n")
        source = _PRELUDE + body + "\n" + runner
        digest = hashlib.sha256(source.encode()).hexdigest()[:20]
        where = os.path.join(tempfile.gettempdir(), f"tileops-cuda-on-cpu-{os.getuid()}")
        os.makedirs(where, exist_ok=True)
        lib = os.path.join(where, f"{digest}.so")
        if not os.path.exists(lib):
            src = os.path.join(where, f"{digest}.{os.getpid()}.cpp")
            with open(src, "w") as f:
                f.write(source)
            tmp = f"{lib}.{os.getpid()}.tmp"
            cmd = [os.environ.get("CXX", "g++"), "-std=c++17", "-O1", "-shared", "-fPIC", "-fno-strict-aliasing",
                   "-Wno-unknown-pragmas", src, "-o", tmp]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
            os.replace(tmp, lib)
            os.unlink(src)
        self.lib = ctypes.CDLL(lib)
        self.lib.tileops_run.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]

    def launch(self, grid: int, threads: int, **args: int) -> None:
        """Run the grid (x only) of ``threads``-thread blocks; ``args`` by parameter name (a pointer
        as an int). Every parameter of the device kernel must be given; others are ignored (TileLang
        drops the parameters a kernel never reads from the device function)."""
        names = [n for _, n in self.params]
        missing = set(names) - set(args)
        if missing:
            raise TypeError(f"{self.name} needs {sorted(missing)}")
        values = (ctypes.c_int64 * len(names))(*[int(args[n]) for n in names])
        if grid > 0:
            self.lib.tileops_run(values, grid, threads)
