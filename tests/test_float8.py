"""fp32 -> float8 e4m3fn bits (``kernels/float8.py``), bit for bit against torch's cast.

The reference is ``x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)``: the saturating
convention the helper implements (``clamp`` keeps NaN, with its sign). Nothing of the helper's code
is shared with it. The inputs:

* every fp32 value at and within 3 ulps of each e4m3fn value and of each rounding midpoint between
  two neighbours (the midpoints are exact in fp32, so ties to even are exercised), both signs, the
  midpoint past 448 (464) included;
* the subnormal range on a fine grid, fp32 subnormals, ``±0``, ``±inf``, NaNs of both signs and
  several payloads, values past 448 up to fp32's largest;
* random draws (the test's seed): uniformly random fp32 bit patterns (every binade, NaNs
  included) and values log-uniform over the binades around e4m3's range.

Test kernels are built here (they are not builders of the package) with the flags and pass configs
tileops compiles its own C kernels with (:data:`tileops.compile.build.PASS_CONFIGS`,
:func:`tileops.compile.build.c_flags`: ``-O3``). Every byte is some input's e4m3fn, so no fill marks
an unwritten output as NaN does a float one: each launch runs twice, on outputs filled with
:data:`FILLS`, and must give the same bytes (an element left unwritten keeps its fill). On CUDA (no GPU here) the
integer form's generated source runs on the CPU through ``tests/cuda_on_cpu.py``; the hardware
form (``cvt.rn.satfinite.e4m3x2.f32``) is only lowered and compiled with the CUDA toolkit, and its
semantics are checked through CUDA's own software model of it (``__nv_cvt_float_to_fp8`` from
``cuda_fp8.hpp``, compiled for the host).
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess

import pytest
import torch

from tests import cuda_on_cpu
from tests.test_lean_build import needs_toolchain
from tileops.compile import build, cuda_build
from tileops.kernels import float8

#: two fills of the output, one launch each: an element the kernel does not write differs between them
FILLS = (0x55, 0xAA)


# ------------------------------------------------------------------------------ the reference
def reference(x: torch.Tensor) -> torch.Tensor:
    """torch's e4m3fn bits of fp32 ``x`` with the saturating clamp (NaN kept)."""
    return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)


def edge_values() -> torch.Tensor:
    """The fixed inputs of the module's docstring (fp32, both signs)."""
    finite = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).double()  # 0 .. 448
    assert finite[-1] == 448.0 and (finite[1:] > finite[:-1]).all()
    mids = (finite[1:] + finite[:-1]) / 2
    points = torch.cat([finite, mids, torch.tensor([464.0, 480.0, 512.0, 1e4, 3.4e38])]).float()
    assert (points[:-5].double() == torch.cat([finite, mids])).all(), "a midpoint is not exact in fp32"
    around = [points]
    up, down = points.clone(), points.clone()
    for _ in range(3):
        up = torch.nextafter(up, torch.tensor(float("inf")))
        down = torch.nextafter(down, torch.tensor(0.0))
        around += [up, down]
    sub = torch.arange(0, 2**10 + 1, dtype=torch.float64) * 2.0**-16  # 0 .. 2^-6 in steps of 2^-16
    tiny = torch.tensor([2.0**-149, 2.0**-140, 2.0**-126, 2.0**-127, 2.0**-11, 2.0**-10, 2.0**-10 * 1.0000001,
                         2.0**-9 * 1.5, 2.0**-9 * 2.5, 2.0**-6 * (1 - 2.0**-24)], dtype=torch.float64)
    inf = torch.tensor([float("inf"), torch.finfo(torch.float32).max])
    pos = torch.cat([*around, sub.float(), tiny.float(), inf])
    nans = torch.tensor([0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0x7FA00000, 0xFFC00000, 0xFF800001, 0xFFFFFFFF],
                        dtype=torch.int64).to(torch.int32).view(torch.float32)  # wraps to the int32 bits
    return torch.cat([pos, -pos, nans])


def random_values(gen: torch.Generator, n: int = 1 << 21) -> torch.Tensor:
    """``n`` uniformly random fp32 bit patterns and ``n`` values log-uniform over ``[2^-14, 2^12)``
    with random signs: fresh draws."""
    bits = torch.randint(-2**31, 2**31, (n,), dtype=torch.int64, generator=gen).to(torch.int32)
    mag = torch.exp2(torch.rand(n, generator=gen, dtype=torch.float64) * 26 - 14)
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).double()
    return torch.cat([bits.view(torch.float32), (mag * sign).float()])


def scaled_points(scale: torch.Tensor, ulps: int) -> torch.Tensor:
    """Each e4m3fn value and midpoint (0 .. 448) times the fp32 ``scale``, rounded to fp32, and its
    ``ulps`` neighbours on either side: where ``x / scale`` lands next to a rounding boundary."""
    finite = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    near = [torch.cat([finite, (finite[1:] + finite[:-1]) / 2]).float() * scale]
    up, down = near[0].clone(), near[0].clone()
    for _ in range(ulps):
        up, down = torch.nextafter(up, torch.tensor(3e38)), torch.nextafter(down, torch.tensor(0.0))
        near += [up, down]
    return torch.cat(near)


def assert_bits(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, what: str) -> None:
    bad = (got != want).nonzero().flatten()
    if len(bad):
        rows = ", ".join(f"{x[i].item()!r} (0x{x[i:i+1].view(torch.int32).item() & 0xFFFFFFFF:08x}): "
                         f"got 0x{got[i].item():02x}, want 0x{want[i].item():02x}" for i in bad[:8])
        raise AssertionError(f"{what}: {len(bad)} of {len(x)} values differ: {rows}")


# ------------------------------------------------------------------------------ the C backend
@functools.cache
def _c_kernel(scaled: bool):
    """``Y[i] = e4m3_bits(X[i])`` (or of ``X[i] / SC[0]``), compiled for TileLang's C backend."""
    from tileops.compile import tilelang_api

    tilelang = tilelang_api.load()
    import tilelang.language as T

    N = T.dynamic("N")

    @T.prim_func
    def convert(X: T.Tensor((N,), "float32"), SC: T.Tensor((1,), "float32"), Y: T.Tensor((N,), "uint8")):
        with T.Kernel(1, threads=1):
            for i in T.serial(N):
                Y[i] = float8.e4m3_bits_scaled(X[i], SC) if scaled else float8.e4m3_bits(X[i])

    return tilelang.compile(convert, target="c", execution_backend="cython", pass_configs=build.PASS_CONFIGS,
                            compile_flags=list(build.c_flags()))


def _launch_c(x: torch.Tensor, scale: float = 1.0, scaled: bool = False) -> torch.Tensor:
    """The kernel's bytes for ``x``, launched once per fill of :data:`FILLS` (which must agree)."""
    outs = []
    for fill in FILLS:
        y = torch.full(x.shape, fill, dtype=torch.uint8)
        _c_kernel(scaled)(x.contiguous(), torch.tensor([scale], dtype=torch.float32), y)
        outs.append(y)
    assert (outs[0] == outs[1]).all(), f"{int((outs[0] != outs[1]).sum())} outputs not written"
    return outs[0]


def test_edges_match_torch_bit_for_bit():
    x = edge_values()
    assert_bits(_launch_c(x), reference(x), x, "edge values")


def test_specials():
    """The conventions the docstring names, spelled out (the edge test covers them too)."""
    x = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan"), 448.0, 464.0, 465.0,
                      2.0**-10, 2.0**-10 * 1.5, 2.0**-9 * 1.5, 2.0**-9 * 2.5, 2.0**-6, 2.0**-6 * (1 - 2.0**-10)])
    got = _launch_c(x).tolist()
    assert got == [0x00, 0x80, 0x7E, 0xFE, 0x7F, 0xFF, 0x7E, 0x7E, 0x7E, 0x00, 0x01, 0x02, 0x02, 0x08, 0x08], \
        [hex(g) for g in got]


def test_random_bit_patterns_and_binades(gen):
    x = random_values(gen)
    assert_bits(_launch_c(x), reference(x), x, "random values")


def test_scaled_divides_in_fp32(gen):
    """``e4m3_bits_scaled``: ``x / scale`` by one fp32 division, then the conversion, for 8 fresh
    scales. The inputs include ``x = point * scale`` rounded to fp32 (``point`` each e4m3 value and
    midpoint) and its neighbours, where a reciprocal multiply (``x * (1 / scale)``) lands on the other
    side of a midpoint for most scales: checked, so this test tells the two apart."""
    told_apart = 0
    for scale in torch.empty(8).uniform_(0.01, 4.0, generator=gen).tolist():
        s32 = torch.tensor(scale, dtype=torch.float32)
        x = torch.cat([scaled_points(s32, 4), torch.randn(1 << 16, generator=gen) * 100])
        x = torch.cat([x, -x])
        want = reference(x / s32)
        assert_bits(_launch_c(x, scale, scaled=True), want, x, f"x / {float(s32)!r}")
        told_apart += bool((reference(x * (1 / s32)) != want).any())
    if not told_apart:  # about 1 run in 10^4 (a third of scales give the same bits either way)
        pytest.skip("a reciprocal multiply gives the same bits as the division for all 8 scales drawn")


_DIV = r"""
#include <cmath>
#define __device__
#define __forceinline__ inline
static inline float __fmul_rn(float a, float b) { return a * b; }
%s
extern "C" void tileops_div_many(const float* x, float* y, long n, float s) {
  const float r = tileops_rcp_scale(s);
  for (long i = 0; i < n; ++i) y[i] = tileops_div_rn(x[i], s, r);
}
"""


@functools.cache
def _host_division(where: str):
    """:data:`float8.DIV_SOURCE` (the CUDA stores' reciprocal form of ``x / s``) compiled for the host,
    whose ``fmaf`` and product round as the GPU's ``fma.rn.f32`` and ``mul.rn.f32`` do."""
    src, lib = os.path.join(where, "div.cpp"), os.path.join(where, "div.so")
    with open(src, "w") as f:
        f.write(_DIV % float8.DIV_SOURCE)
    cxx = os.environ.get("CXX", "g++")
    subprocess.run([cxx, "-std=c++17", "-O2", "-ffp-contract=off", "-shared", "-fPIC", src, "-o", lib], check=True,
                   capture_output=True)
    model = ctypes.CDLL(lib)
    model.tileops_div_many.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_float]
    return model


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="no C++ compiler")
def test_reciprocal_form_gives_the_divisions_bits(tmp_path, gen):
    """``DIV_SOURCE``: ``x / s`` from ``1 / s`` by a multiply and Markstein's correction, against fp32
    division (torch's, correctly rounded), for random scales inside ``RCP_SCALES`` and past it (the
    division then), both signs: on every input whose quotient reaches e4m3fn's range (``>= 2^-12``)
    the same fp32 bits, everywhere the same e4m3fn bits, sign and NaN. The inputs: the edge values,
    e4m3's values and midpoints times the scale and their neighbours (where a plain reciprocal
    multiply rounds to the other side: checked, so the correction is what is tested), random bit
    patterns and log-uniform values."""
    lo, hi = float8.RCP_SCALES
    inside = torch.exp2(torch.rand(12, generator=gen, dtype=torch.float64) * 128 - 64)  # [2^-64, 2^64)
    kv = torch.empty(12, dtype=torch.float64).uniform_(0.005, 8.0, generator=gen)  # a KV cache's scales
    edges = torch.tensor([lo, hi, lo * (1 - 2.0**-24), hi * (1 + 2.0**-23), 2.0**-100, 2.0**90, 1e-40])
    scales = torch.cat([inside, kv, edges]).float()
    scales = torch.cat([scales, -scales[::5]])
    model = _host_division(str(tmp_path))
    told_apart = 0
    for s in scales.tolist():
        s32 = torch.tensor(s, dtype=torch.float32)
        x = torch.cat([edge_values(), scaled_points(s32, 3), random_values(gen, 1 << 16)])
        x = torch.cat([x, -x]).contiguous()
        got = torch.full_like(x, float("nan"))
        model.tileops_div_many(x.data_ptr(), got.data_ptr(), len(x), s)
        want = x / s32
        what = f"x / {s!r}"
        assert_bits(reference(got), reference(want), x, what + ", e4m3fn")
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan), what
        assert torch.equal(got.signbit()[~nan], want.signbit()[~nan]), what
        big = want.abs() >= 2.0**-12
        gb, wb = got[big].view(torch.int32), want[big].view(torch.int32)
        assert torch.equal(gb, wb), f"{what}: {int((gb != wb).sum())} fp32 quotients differ from the division's"
        told_apart += lo <= abs(s) <= hi and bool((reference(x * (1 / s32)) != reference(want)).any())
    assert told_apart, "a plain reciprocal multiply gave the division's bits on every scale: nothing was tested"


# ------------------------------------------------------------------------------ CUDA
def _cuda_kernel(cvt: bool):
    """The conversion as a 128-thread CUDA kernel (integer form, or the hardware one)."""
    from tileops.compile import tilelang_api

    tilelang_api.load()
    import tilelang.language as T

    N = T.dynamic("N")
    convert = float8.e4m3_bits_cvt if cvt else float8.e4m3_bits

    @T.prim_func
    def to_e4m3(X: T.Tensor((N,), "float32"), SC: T.Tensor((1,), "float32"), Y: T.Tensor((N,), "uint8")):
        with T.Kernel(T.ceildiv(N, 128), threads=128) as b:
            # Y is a uint8 buffer (`uchar*` in the source); CVT_SOURCE holds those typedefs too
            T.import_source(float8.CVT_SOURCE if cvt else float8.UNSIGNED_SOURCE)
            for i in T.Parallel(128):
                if b * 128 + i < N:
                    Y[b * 128 + i] = float8.e4m3_bits_scaled(X[b * 128 + i], SC, convert)

    return to_e4m3


def _lower(func, arch: str) -> str:
    from tileops.compile import tilelang_api

    tilelang = tilelang_api.load()
    from tvm import target as tvm_target
    from tvm import transform

    target = tvm_target.Target({"kind": "cuda", "arch": arch})
    with target, transform.PassContext(config=build.PASS_CONFIGS):
        return tilelang.lower(func, target=target).kernel_source


@needs_toolchain
@pytest.mark.parametrize("cvt, arch", [(False, "sm_90"), (False, f"sm_{cuda_build.MIN_SM}"),
                                       (True, f"sm_{float8.CVT_MIN_SM}"), (True, "sm_90")],
                         ids=["int-sm_90", "int-min_sm", "cvt-sm_89", "cvt-sm_90"])
def test_cuda_lowers_and_compiles_lean(cvt, arch, tmp_path):
    """Both forms lower for CUDA and the lean build (the one tileops uses: no TileLang templates)
    compiles them to a cubin and a launcher; no GPU is needed until a launch."""
    lean = cuda_build.build(_cuda_kernel(cvt), arch, build.PASS_CONFIGS, out_dir=str(tmp_path))
    assert os.path.exists(lean.libpath)
    assert ("cvt.rn.satfinite.e4m3x2.f32" in lean.device_source) == cvt
    assert "uchar* __restrict__ Y" in lean.device_source  # the cache is bytes, no fp8 template type


@needs_toolchain
def test_cvt_refused_below_sm89(tmp_path):
    """The hardware form needs sm_89: ptxas refuses it for sm_80, loudly (the builder must pick the
    integer form there)."""
    with pytest.raises(RuntimeError, match="e4m3x2|sm_89|not supported"):
        cuda_build.build(_cuda_kernel(True), "sm_80", build.PASS_CONFIGS, out_dir=str(tmp_path))


@pytest.mark.skipif(not cuda_on_cpu.available(), reason="no g++")
def test_cuda_integer_form_runs_on_cpu():
    """The integer form's generated CUDA source, run on the CPU (tests/cuda_on_cpu.py): the same
    bits as torch on the edge values, with a scale of 1 and of 0.5 (exact: the scaled reference is too)."""
    x = edge_values()
    emulated = cuda_on_cpu.CudaOnCpu(_lower(_cuda_kernel(False), "sm_90"))
    for scale in (1.0, 0.5):
        sc = torch.tensor([scale], dtype=torch.float32)
        outs = []
        for fill in FILLS:
            y = torch.full(x.shape, fill, dtype=torch.uint8)
            emulated.launch((len(x) + 127) // 128, 128, X=x.data_ptr(), SC=sc.data_ptr(), Y=y.data_ptr(), N=len(x))
            outs.append(y)
        assert (outs[0] == outs[1]).all(), "outputs not written"
        assert_bits(outs[0], reference(x / sc), x, f"CUDA source on the CPU, scale {scale}")


# ------------------------------------------------------------------------------ CUDA's model of the cvt
_MODEL = r"""
#include <cuda_fp8.h>
extern "C" void tileops_nv_e4m3(const float* x, unsigned char* y, long n) {
  for (long i = 0; i < n; ++i) y[i] = __nv_cvt_float_to_fp8(x[i], __NV_SATFINITE, __NV_E4M3);
}
"""


@functools.cache
def _nv_model(where: str):
    include = os.path.join(cuda_build.cuda_home(), "include")
    if not os.path.exists(os.path.join(include, "cuda_fp8.h")):
        pytest.skip("no cuda_fp8.h in the CUDA toolkit")
    src, lib = os.path.join(where, "model.cpp"), os.path.join(where, "model.so")
    with open(src, "w") as f:
        f.write(_MODEL)
    cxx = os.environ.get("CXX", "g++")
    subprocess.run([cxx, "-std=c++17", "-O1", "-shared", "-fPIC", f"-I{include}", src, "-o", lib], check=True,
                   capture_output=True)
    model = ctypes.CDLL(lib)
    model.tileops_nv_e4m3.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]
    return model


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="no C++ compiler")
def test_matches_cudas_model_of_the_hardware_conversion(tmp_path, gen):
    """``__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)`` compiled for the host (CUDA's software
    path, its model of ``cvt.rn.satfinite.e4m3x2.f32``) gives the integer form's bits on every
    non-NaN input; every NaN it makes ``0x7F`` (the one difference ``e4m3_bits_cvt`` documents)."""
    try:
        cuda_build.cuda_home()
    except cuda_build.Unsupported as e:
        pytest.skip(str(e))
    x = torch.cat([edge_values(), random_values(gen, 1 << 18)])
    model = _nv_model(str(tmp_path))
    nv = torch.full(x.shape, FILLS[0], dtype=torch.uint8)
    model.tileops_nv_e4m3(x.data_ptr(), nv.data_ptr(), len(x))
    ours = _launch_c(x)
    nan = x.isnan()
    assert (nv[nan] == 0x7F).all()
    assert_bits(ours[~nan], nv[~nan], x[~nan], "against __nv_cvt_float_to_fp8")
