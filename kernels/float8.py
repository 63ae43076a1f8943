"""fp32 -> float8 e4m3fn, as a tile program stores it: the 8 bits as a ``uint8`` TIR expression.

A paged KV cache of ``torch.float8_e4m3fn`` holds ``saturate(x / scale)`` with a per-tensor fp32
``scale`` (issue 24; vLLM's ``reshape_and_cache_flash``). A kernel declares such a cache as a
``uint8`` buffer on every backend (the host passes ``cache.view(torch.uint8)``'s pointer) and stores
:func:`e4m3_bits` of each value into it:

* TileLang's C backend has no fp8 type, so the conversion is integer arithmetic on the fp32's bits,
  the same way :func:`tileops.kernels.storage.to_storage` rounds bf16 by hand.
* On CUDA the same integer arithmetic is used, on purpose: TileLang 0.1.15 does have a
  ``float8_e4m3fn`` buffer type there, but it emits CUTLASS's ``fp8_e4_t`` (from
  ``tl_templates/cuda/cuda_fp8.h``), which :mod:`tileops.compile.cuda_build`'s lean build does not
  provide (such a kernel falls back to TileLang's own nvcc build, 4-5 s a compile, and that build
  links ``libcuda``). :func:`e4m3_bits_cvt` is the hardware conversion instead, one
  ``cvt.rn.satfinite.e4m3x2.f32`` (sm_89 and later, what ``__nv_cvt_float_to_fp8(v, __NV_SATFINITE,
  __NV_E4M3)`` compiles to), brought in as a device function of the kernel's own source; it differs
  from :func:`e4m3_bits` only on negative NaN (below). The integer form costs about 30 PTX
  instructions an element more than the hardware one (54 against 24 for the whole of
  ``tests/test_float8.py``'s sm_90 test kernel), next to a memory-bound one-byte store.

The conversion (:func:`e4m3_bits`): round to nearest, ties to even, on e4m3fn's 3-bit mantissa
(exponent bias 7; normals from ``2^-6``, subnormals ``m * 2^-9`` below it); **saturating**: a finite
value past the largest finite e4m3fn, ``448``, and ``±inf``, store ``±448`` (``0x7E``/``0xFE``) --
the convention of vLLM's fp8 caches and of CUDA's ``__NV_SATFINITE``, the same bits as
``x.clamp(-448, 448).to(torch.float8_e4m3fn)``, not the NaN an unsaturated conversion gives (e4m3fn
has no infinity). NaN stays NaN with its sign (``0x7F``/``0xFF``, as torch's cast gives); ``-0``
stays ``-0`` (``0x80``). fp32 subnormals (below ``2^-126``) store ``±0``, as anything below
``2^-10`` (half the smallest e4m3fn subnormal) does.

The scale (:func:`e4m3_bits_scaled`) is applied to the value the caller gives it, by one fp32
division. Order of roundings: the unfused chain (rope writes k in the model's dtype, then the cache
write reads it, divides by the scale in fp32 and converts, as vLLM's cache kernels do) rounds k to
the model's dtype first. A fused kernel that means to store what that chain stores must round its
fp32 result to the model's dtype before calling this (``to_storage`` then back to fp32): the double
rounding differs from one rounding of the fp32 value whenever the bf16 value lands on an e4m3
midpoint the fp32 value was not on. This module does not round for the caller: it cannot know the
model's dtype's storage on the C backend, and a caller that wants one rounding (an fp32 model) says
so by passing the fp32 value.

TileLang is imported by the first conversion, while a kernel is built: importing this module imports
no TileLang (:mod:`tileops.kernels` reads helpers' sources without executing them).
"""

from __future__ import annotations

__all__ = ["CVT_FUNCTION", "CVT_MIN_SM", "CVT_SOURCE", "DIV_SOURCE", "E4M3_MAX", "RCP_SCALES", "STORE_SOURCE",
           "UNSIGNED_SOURCE", "e4m3_bits", "e4m3_bits_cvt", "e4m3_bits_scaled", "reciprocal_scale", "store_e4m3"]

#: the largest finite float8 e4m3fn, ``1.75 * 2^8``: where the saturating conversion stops
E4M3_MAX = 448.0

#: fp32 bit patterns the integer conversion compares against (``|x|``'s bits order as ``|x|`` does)
_F32_INF = 0x7F800000  # +inf; above it, NaN
_F32_MAX = 0x43E00000  # 448.0 = 1.75 * 2^8: the saturation point, whose low 20 bits are 0 (no round-up past it)
_F32_MIN_NORMAL = 0x3C800000  # 2^-6, e4m3fn's smallest normal
#: re-biasing an fp32 exponent (bias 127) to e4m3fn's (bias 7): 120 binades, in the exponent field
_REBIAS = 120 << 23
#: fp32 keeps 23 mantissa bits, e4m3 3: a normal value drops the low 20
_DROP = 20
#: a subnormal e4m3 is ``q * 2^-9``: ``q = mant * 2^(e - 150) / 2^-9 = mant >> (141 - e)`` for the
#: 24-bit fp32 significand ``mant`` at biased exponent ``e``
_SUB_SHIFT = 141
#: shifts past 25 give 0 already (``mant < 2^24``); capped so the shift stays below the word's 32 bits
_MAX_SHIFT = 31

#: TileLang's CUDA codegen names a uint8 buffer ``uchar*`` (uint16/32 ``ushort``/``uint``), macros of
#: its ``common.h``, which the lean build (:mod:`tileops.compile.cuda_build`) does not include. A kernel
#: that declares a uint8 buffer (an fp8 cache's bytes) brings these in with
#: ``T.import_source(UNSIGNED_SOURCE)`` inside its ``T.Kernel`` block (or :data:`CVT_SOURCE`, which
#: holds it: TileLang takes one ``import_source`` per kernel): defined once, before the
#: kernel, where a build did not define them already (TileLang's own build does, as macros). Kept here,
#: not in the lean build's prelude: the prelude is part of every shipped kernel's key and source.
UNSIGNED_SOURCE = """\
#ifndef uchar
typedef unsigned char uchar;
#endif
#ifndef ushort
typedef unsigned short ushort;
#endif
#ifndef uint
typedef unsigned int uint;
#endif
"""


#: the lowest CUDA arch with ``cvt.rn.satfinite.e4m3x2.f32`` (PTX ISA: sm_89)
CVT_MIN_SM = 89
#: the device function :func:`e4m3_bits_cvt` calls, and its source (the hardware conversion CUDA's
#: ``__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)`` is on sm_89+, without ``cuda_fp8.h``:
#: the lean build includes no header). ``x`` goes in the low byte; the high one converts 0.
CVT_FUNCTION = "tileops_f32_to_e4m3_satfinite"
CVT_SOURCE = UNSIGNED_SOURCE + f"""\
__device__ __forceinline__ unsigned char {CVT_FUNCTION}(float x) {{
  unsigned short pair;
  asm("{{cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;}}\\n" : "=h"(pair) : "f"(x), "f"(0.0f));
  return (unsigned char)pair;
}}
"""

#: the scales :data:`DIV_SOURCE`'s reciprocal form serves, ``[2^-64, 2^64]``: inside it the correction
#: step's residual is exact wherever the quotient can reach e4m3fn's range (``|x / s| >= 2^-10``
#: needs ``|x| >= 2^-74``, whose residual is a multiple of ``2^-121``, above fp32's ``2^-149``), and
#: ``1 / s`` is a normal number. On the host, 10^9 random pairs (a tenth of them outside the range,
#: which take the division): the fp32 bits differed from the division's in 486,266, every one with
#: ``|x| < 2^-120`` and a quotient below ``2^-70`` (e4m3fn's 0 either way); none where ``|x / s| >=
#: 2^-12``, and none in sign or NaN (``tests/test_float8.py`` draws fresh ones each run)
RCP_SCALES = (2.0 ** -64, 2.0 ** 64)

#: CUDA: ``x / s`` rounded to nearest, bit for bit what ``div.rn.f32`` gives, from ``r = 1 / s``
#: (``tileops_rcp_scale``: correctly rounded, once a thread; 0 for a scale outside
#: :data:`RCP_SCALES`, which takes the division) by a multiply and Markstein's correction
#: (``tileops_div_fast``): ``q = x r`` is within an ulp of ``x / s``, the residual ``x - q s`` is exact
#: in one FMA, and ``q + e r`` rounded once is the correctly rounded quotient (Markstein 1990; Muller
#: et al., *Handbook of Floating-Point Arithmetic*, the theorem on Markstein's iteration) while nothing
#: underflows or overflows. Where that cannot be promised the division runs instead
#: (``tileops_div_rn``): ``r`` 0, or a quotient that is not finite (``x`` infinite or NaN, or ``x r``
#: overflowing: the FMAs would give NaN where the division gives the infinity that saturates to 448).
#: The sign is ``q``'s (``x``'s times ``s``'s, the division's; ``q + e r`` of ``x = -0`` is ``+0``).
#: ``__fmul_rn``: a multiply nvcc never contracts into an FMA. sm_90: the division is a reciprocal,
#: four FMAs and a range check with an out-of-line slow path an element; this is a multiply, two FMAs,
#: a sign and a compare.
DIV_SOURCE = """\
__device__ __forceinline__ float tileops_rcp_scale(float s) {
  return fabsf(s) >= %rf && fabsf(s) <= %rf ? 1.0f / s : 0.0f;
}
__device__ __forceinline__ float tileops_div_fast(float x, float s, float r) {
  const float q = __fmul_rn(x, r);
  return copysignf(fmaf(fmaf(-q, s, x), r, q), q);
}
__device__ __forceinline__ float tileops_div_rn(float x, float s, float r) {
  if (r != 0.0f) {
    const float q = tileops_div_fast(x, s, r);
    if (fabsf(q) <= 3.402823466e38f) return q;
  }
  return x / s;
}
""" % RCP_SCALES

#: CUDA: ``n`` values (``n`` of 1, 2, 4, 8 or 16, a constant at the call) converted by
#: :data:`CVT_FUNCTION` after one IEEE division by ``scale`` each, or, with ``rscale`` (the kernel's
#: ``tileops_rcp_scale(scale)``) not 0, the same quotients by :data:`DIV_SOURCE`'s reciprocal form
#: (all ``n`` divided instead where one is not finite: ``tileops_div_rn``'s values, one branch a
#: store), stored as one ``n``-byte access (``dst`` on an ``n``-byte boundary). TileLang lowers a
#: vectorized loop of single-byte stores of converted values as ``n`` byte stores (it finds no
#: vectorization plan for them); a cache row of bf16 at 16-byte vectors is 8 bytes a lane, one 8-byte
#: store here. Holds :data:`CVT_SOURCE`.
STORE_SOURCE = CVT_SOURCE + DIV_SOURCE + f"""\
template <typename T>
__device__ __forceinline__ void tileops_st_e4m3(uchar* dst, const T* src, float scale, float rscale, int n) {{
  float q[16];
  bool fast = rscale != 0.0f;
  if (fast) {{
#pragma unroll
    for (int i = 0; i < 16; ++i)
      if (i < n) {{
        q[i] = tileops_div_fast((float)src[i], scale, rscale);
        fast &= fabsf(q[i]) <= 3.402823466e38f;
      }}
  }}
  if (!fast) {{
#pragma unroll
    for (int i = 0; i < 16; ++i)
      if (i < n) q[i] = (float)src[i] / scale;
  }}
  uint w[4] = {{0u, 0u, 0u, 0u}};
#pragma unroll
  for (int i = 0; i < 16; ++i)
    if (i < n) w[i >> 2] |= (uint){CVT_FUNCTION}(q[i]) << ((i & 3) * 8);
  if (n == 16) {{
    uint4 v; v.x = w[0]; v.y = w[1]; v.z = w[2]; v.w = w[3];
    *reinterpret_cast<uint4*>(dst) = v;
  }} else if (n == 8) {{
    uint2 v; v.x = w[0]; v.y = w[1];
    *reinterpret_cast<uint2*>(dst) = v;
  }} else if (n == 4) {{
    *reinterpret_cast<uint*>(dst) = w[0];
  }} else {{
    for (int i = 0; i < n; ++i) dst[i] = (uchar)(w[i >> 2] >> ((i & 3) * 8));
  }}
}}
"""


def store_e4m3(dst, offset, vals, scale, n: int, rscale=None):
    """CUDA: ``dst[offset : offset + n]`` (a ``uint8`` buffer, the cache's bytes) = the e4m3fn bits of
    ``vals[0 : n] / scale`` (a local buffer of any float type; ``scale`` an fp32 expression), one
    ``n``-byte store (:data:`STORE_SOURCE`, which the kernel imports). ``rscale``: the kernel's
    :func:`reciprocal_scale` of ``scale`` (the same quotients without a division an element), or None
    for the division."""
    import tilelang.language as T

    return T.call_extern("handle", "tileops_st_e4m3", T.address_of(dst[offset]), T.address_of(vals[0]), scale,
                         T.float32(0) if rscale is None else rscale, n)


def reciprocal_scale(scale):
    """CUDA: ``1 / scale`` for :func:`store_e4m3`'s ``rscale`` (``tileops_rcp_scale``: 0 outside
    :data:`RCP_SCALES`), an fp32 expression; computed once a thread, not once a store."""
    import tilelang.language as T

    return T.call_extern("float32", "tileops_rcp_scale", scale)


def _u32(v: int):
    import tilelang.language as T

    return T.uint32(v)


def e4m3_bits(value):
    """The float8 e4m3fn bits of fp32 ``value`` (a TIR expression), as ``uint8``: round to nearest
    even, saturating to ``±448``, NaN kept with its sign (the module's docstring). Integer arithmetic
    on the fp32's bits, so the same bits on every backend."""
    import tilelang.language as T

    u = T.reinterpret(value, "uint32")
    sign = T.shift_left(T.shift_right(u, _u32(31)), _u32(7))
    a = T.bitwise_and(u, _u32(0x7FFFFFFF))
    # saturate first: 448 and everything past it (inf too) convert as 448; NaN is chosen apart below
    s = T.min(a, _u32(_F32_MAX))
    # normal: re-bias the exponent, then drop 20 mantissa bits rounding to nearest even (add half an
    # e4m3 ulp less one, plus the kept lsb); a carry out of the mantissa bumps the exponent, as it should
    lsb = T.bitwise_and(T.shift_right(s, _u32(_DROP)), _u32(1))
    normal = T.shift_right(s - _u32(_REBIAS) + _u32((1 << (_DROP - 1)) - 1) + lsb, _u32(_DROP))
    # subnormal: the significand with its implicit bit, shifted right by 141 - e with the same
    # rounding; q = 8 (a round-up to 2^-6) is 0x08, the smallest normal's encoding
    e = T.shift_right(s, _u32(23))
    mant = T.bitwise_or(T.bitwise_and(s, _u32(0x7FFFFF)), _u32(0x800000))
    shift = T.min(_u32(_SUB_SHIFT) - e, _u32(_MAX_SHIFT))  # e <= 135 after the clamp: no wrap
    half_less_one = T.shift_left(_u32(1), shift - _u32(1)) - _u32(1)
    sub = T.shift_right(mant + half_less_one + T.bitwise_and(T.shift_right(mant, shift), _u32(1)), shift)
    magnitude = T.if_then_else(a > _u32(_F32_INF), _u32(0x7F),
                               T.if_then_else(s >= _u32(_F32_MIN_NORMAL), normal, sub))
    return T.cast(T.bitwise_or(sign, magnitude), "uint8")


def e4m3_bits_cvt(value):
    """:func:`e4m3_bits` by the hardware conversion (CUDA, sm_89 and later): one
    ``cvt.rn.satfinite.e4m3x2.f32``. The same bits but for a negative NaN, which it stores as
    ``0x7F`` (CUDA's model of the instruction, ``__nv_cvt_float_to_fp8`` in ``cuda_fp8.hpp``, makes
    every NaN the canonical positive one). The kernel must bring :data:`CVT_SOURCE` into its source
    with ``T.import_source(CVT_SOURCE)`` inside its ``T.Kernel`` block (TileLang 0.1.15 puts it
    before the kernel, once however many times it is imported), and be built for sm_89 or later
    (:data:`CVT_MIN_SM`: ptxas refuses the instruction for sm_80)."""
    import tilelang.language as T

    return T.call_extern("uint8", CVT_FUNCTION, value)


def e4m3_bits_scaled(value, scale_buf, convert=e4m3_bits):
    """``convert(value / scale_buf[0])``: the e4m3fn bits of ``value`` divided by a per-tensor scale
    read from the 1-element fp32 buffer ``scale_buf`` on the device (no host read: a CUDA graph
    replays with whatever scale the buffer holds). One IEEE fp32 division, correctly rounded, as
    torch's ``x / scale`` and vLLM's cache kernels compute it (the lean CUDA build compiles without
    fast math; a reciprocal multiply would differ in the last bit, which can move a value across an
    e4m3 midpoint). ``value`` is taken as given: round it to the model's dtype first to store what
    the unfused chain stores (the module's docstring, "Order of roundings")."""
    import tilelang.language as T

    return convert(value / T.cast(scale_buf[0], "float32"))
