"""RoPE as TileLang tile programs: one builder for every op of the family, forward and backward.

What varies between the RoPE ops is only the frequency table and an amplitude, which the host
folds into three small float64-derived tables; the kernel itself knows four things:

* the pairing: ``neox`` pairs ``(i, i + R/2)``, ``interleaved`` pairs ``(2i, 2i + 1)``;
* where positions come from: the sequence index (``positions=None``) or an int32/int64 tensor
  ``P`` read through two strides (``[S]`` shared by the batch, or ``[B, S]``), bounds-checked on
  the device; with ``mrope_section`` (multimodal RoPE, Qwen2-VL / Qwen3-VL) ``P`` holds three
  position streams (temporal, height, width) read through a third stride, and each pair takes its
  angle from the stream the section map gives it (see ``_pick``);
* the rotated width ``R`` (``rot``), at most ``D``; columns ``R..D`` are copied unchanged;
* the direction: ``inverse=True`` rotates by the negated angle. The backward of
  ``y = A R(θ) x`` is ``A R(-θ) g``, so the gradient is this same kernel with sin negated.

Accuracy. cos/sin of ``p * f`` are never evaluated in fp32 from an fp32 angle (error ``p * 2^-24``
rad, 0.06 rad at p = 1e6). A position ``p < 2^24`` is split into three 8-bit digits,
``p = d2 * 2^16 + d1 * 2^8 + d0``, and the host builds one 256-row table per digit in float64,
rounded once to fp32: ``TD[k, d] = (cos, sin)(d * 256^k * f)``, with the amplitude ``A`` folded
into ``TD[0]``. The kernel composes them by angle addition, ``cos(a+b) = ca*cb - sa*sb``,
``sin(a+b) = sa*cb + ca*sb``: a handful of fp32 roundings whatever the position. The tables are
``3 x 256`` rows of ``R/2`` pairs (0.4 MB for R = 128) whatever the positions are, so nothing is
grown, allocated or copied at call time.

Layout. Every input is seen as ``X[B, S, H, D]`` through a base pointer and three element strides
(batch, sequence, head; the last dim is contiguous): 1d is ``B = H = 1``, position ids ``B = 1``,
``S`` = tokens. ``Y`` has strides of its own, so the output may be a new tensor, a given ``out=``
or ``X`` itself (in place: each element is read before it is written, by the same thread). A second
tensor ``K[B, S, HK, D]`` (the key, ``HK = 0`` when there is none) is rotated in the same launch
with the cos/sin composed once. B, S, H, HK and every stride are runtime scalars: one compiled kernel
serves every length, head count and view.

Two schedules from one description:

* ``cuda``: SIMT. A thread owns one chunk of ``VEC`` pairs (16 bytes of x) of one token, composes
  its cos/sin once and reuses them across the heads it walks (``H / HL`` of them, then the key's)
  and across both halves of each pair. Loads and stores of x are 16 bytes wide: the host checks
  that every pointer and stride is a multiple of ``VEC`` elements. Blocks tile the tokens along
  the grid's x and the batch along y, continued along z above the 65535 rows y may have (a block
  past the batch does nothing): no loop around the body, which measured 12% slower at 32k tokens
  than a grid that covers the batch. A thread walks the query's heads, then the key's, in two
  loops (one loop over both with a branch per head was 5-15% slower). A kernel made for head-major
  views (``transposed``: HF's ``[B, H, S, D]`` seen as ``[B, S, H, D]``, where a head's tokens are
  one contiguous run) uses ``transposed_head_lanes`` head lanes, so a block covers more tokens of
  each head.
* ``c``: TileLang's C backend has no threads, so the same math runs as plain loops per token.

MRoPE. A token has three positions; all three are read and bounds-checked by every thread of the
token. Where every section is a multiple of ``VEC`` pairs and the map is not interleaved (Qwen2-VL's
``[16, 24, 24]`` in any dtype), a thread's ``VEC`` pairs share one stream and the table loads stay
as wide as without MRoPE; otherwise (Qwen3-VL's interleaved map) each pair gathers its own table
rows. The loads and stores of x are the same 16-byte accesses either way.
"""



from dataclasses import dataclass
from typing import Any

from .report import CUDA_SOURCE as REPORT_SOURCE
from .report import ENTRY, report
from .storage import load_f32, storage_dtype, to_storage

#: ``tilelang.language``, imported when a kernel is first built (:func:`_tl`): the spec class and the
#: constants here are read without TileLang, so a process that loads cached kernels never imports it
T: Any = None

__all__ = ["RoPEKernelSpec", "build_rope", "build", "Spec", "STATIC", "LO", "DIGITS", "MAX_POSITION", "ARGS",
           "MAX_BLOCK_THREADS", "MAX_GRID_Y", "position", "angles", "rotate", "rotate_one", "copy_one", "rotate_vals",
           "lane_angles", "pair_angle", "store_one", "pair_offsets",
           "CUDA_HELPERS"]

#: The schedule choices a manifest's ``kernel.static`` may set (:mod:`tileops.kernels` reads this literal
#: without importing the module): key -> (low, high, what it is). Every other field of
#: :class:`RoPEKernelSpec` the op derives from the call.
STATIC = {
    "threads": (32, 1024, "target threads per block (CUDA)"),
    "head_lanes": (1, 64, "threads that split one token's heads (CUDA)"),
    "tokens_per_thread": (1, 64, "tokens each thread walks (CUDA)"),
    "transposed_head_lanes": (1, 64, "head lanes instead, for a long view whose heads lie farther apart than its "
                                     "tokens, such as HF's [B, H, S, D] through a transpose (CUDA)"),
    "head_unroll": (0, 8, "the unroll factor nvcc is given for the head loops: 0 leaves it to nvcc, 1 keeps them "
                          "rolled (a view with one head per token, where an unrolled copy only holds registers) (CUDA)"),
}

#: rows of each digit table: positions are split into 8-bit digits
LO = 256
#: digit tables: positions below LO ** DIGITS = 2^24 are supported
DIGITS = 3
MAX_POSITION = LO**DIGITS
_ELEM_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
#: CUDA's limits: threads per block, and blocks along the grid's y (which holds the batch; a larger
#: batch is walked by each block row in steps of this)
MAX_BLOCK_THREADS = 1024
MAX_GRID_Y = 65535

#: the generated function's parameters, in order, the same for every spec: one ``T.prim_func`` per
#: backend. A kernel without positions reads none of ``P``, ``ERR``, ``psb``, ``pss``, ``psc``,
#: ``limit``, ``tag`` (its body is that of a function without them), one without ``mrope_section``
#: never reads ``psc`` (the stride between the three position streams); the launcher binds arguments
#: by these names and passes 0 for those a call does not set.
ARGS = ("X", "Y", "K", "KY", "TD", "P", "ERR", "B", "S", "H", "HK",
        "xsb", "xss", "xsh", "ysb", "yss", "ysh", "ksb", "kss", "ksh", "kysb", "kyss", "kysh",
        "psb", "pss", "psc", "limit", "tag")


@dataclass(frozen=True)
class RoPEKernelSpec:
    """Everything a RoPE kernel is compiled for; two equal specs share one compiled kernel."""

    dtype: str  # float16 | bfloat16 | float32
    head_dim: int  # D
    rot: int  # rotated width R, even, <= D
    pairing: str = "neox"  # neox | interleaved
    positions: "str | None" = None  # None (position = sequence index) | "int32" | "int64"
    inverse: bool = False  # rotate by -angle (the backward)
    backend: str = "cuda"  # cuda | c
    head_lanes: int = 4  # cuda: threads that split one token's heads
    threads: int = 128  # cuda: target threads per block
    tokens_per_thread: int = 1  # cuda: tokens each thread walks
    #: cuda: the head lanes of a kernel made for head-major views (``transposed``): each head's tokens
    #: are one contiguous run there, so fewer lanes and more tokens a block read longer runs
    transposed_head_lanes: int = 2
    transposed: bool = False  # serve views whose head stride exceeds their token stride (the op decides)
    #: cuda: ``#pragma unroll head_unroll`` on the head loops; 0: nvcc's own choice (it unrolls fp16's twice)
    head_unroll: int = 0
    #: MRoPE: pairs per position stream (temporal, height, width), summing to rot // 2; needs positions
    mrope_section: "tuple[int, int, int] | None" = None
    mrope_interleaved: bool = False  # the stream map of Qwen3-VL instead of consecutive sections

    def __post_init__(self) -> None:
        if self.dtype not in _ELEM_BYTES:
            raise ValueError(f"dtype: expected one of {', '.join(_ELEM_BYTES)}, got {self.dtype!r}")
        if self.rot < 2 or self.rot % 2 or self.rot > self.head_dim:
            raise ValueError(f"rot: expected an even width in [2, {self.head_dim}], got {self.rot}")
        if self.pairing not in ("neox", "interleaved"):
            raise ValueError(f"pairing: expected 'neox' or 'interleaved', got {self.pairing!r}")
        if self.positions not in (None, "int32", "int64"):
            raise ValueError(f"positions: expected None, 'int32' or 'int64', got {self.positions!r}")
        if self.backend not in ("cuda", "c"):
            raise ValueError(f"backend: expected 'cuda' or 'c', got {self.backend!r}")
        sec = self.mrope_section
        if sec is not None:
            if (not isinstance(sec, tuple) or len(sec) != 3 or any(type(n) is not int or n < 1 for n in sec)
                    or sum(sec) != self.rot // 2):
                raise ValueError(f"mrope_section: expected a tuple of 3 positive ints summing to rot // 2 = "
                                 f"{self.rot // 2}, got {sec!r}")
            if self.positions is None:
                raise ValueError("mrope_section: expected positions (three streams are read from P), got None")
        elif self.mrope_interleaved:
            raise ValueError("mrope_interleaved: expected mrope_section with it, got None")

    @property
    def group(self) -> int:
        """Tokens one CUDA block handles (token slots x tokens per thread)."""
        return self._slots * max(1, self.tokens_per_thread)

    @property
    def _lanes(self) -> int:
        return (self.rot // 2) // self.vec + (self.head_dim - self.rot) // self.vec

    @property
    def _head_lanes(self) -> int:
        """Threads that split one token's heads: ``head_lanes``, or fewer where a token's lanes times
        that would pass the 1024 threads a block may have (a vector width of 1 on a wide head: fp16
        head_dim 258 has 129 lanes, so at most 7 head lanes). ``_lanes <= head_dim - rot / 2 < 1024``
        for every head_dim the manifests allow (at most 1024), so one head lane always fits."""
        lanes = self.transposed_head_lanes if self.transposed else self.head_lanes
        return max(1, min(max(1, lanes), MAX_BLOCK_THREADS // self._lanes))

    @property
    def _slots(self) -> int:
        return max(1, self.threads // (self._lanes * self._head_lanes))

    @property
    def block_threads(self) -> int:
        """Threads of one CUDA block (at most 1024)."""
        return self._lanes * self._head_lanes * self._slots

    @property
    def vec(self) -> int:
        """Elements per 16-byte access, shrunk until it divides both D and R/2."""
        v = 16 // _ELEM_BYTES[self.dtype]
        while v > 1 and (self.head_dim % v or (self.rot // 2) % v):
            v //= 2
        return v

    @property
    def stride_unit(self) -> int:
        """The unit of the x/y/key strides the kernel takes: ``vec`` elements on CUDA, so that the
        compiler can prove every row starts on a vector boundary and keep 16-byte accesses (the
        host checks that each stride divides); one element on the C backend."""
        return self.vec if self.backend == "cuda" else 1

    @property
    def uniform_streams(self) -> bool:
        """MRoPE on CUDA: whether each thread's ``vec`` pairs all take one stream (consecutive
        sections, each a multiple of ``vec``), so its table loads stay vectorized."""
        sec = self.mrope_section
        return sec is not None and not self.mrope_interleaved and all(n % self.vec == 0 for n in sec)

    @property
    def args(self) -> tuple[str, ...]:
        """The generated function's parameter names, in order (:data:`ARGS`, whatever the spec)."""
        return ARGS


def _pick(spec: RoPEKernelSpec, j, pt, ph, pw):
    """The position pair ``j`` (a TIR expression) rotates by: that of stream 0 (temporal, ``pt``), 1
    (height, ``ph``) or 2 (width, ``pw``). Consecutive sections (Qwen2-VL, Qwen2.5-VL): the first
    ``section[0]`` pairs take stream 0, the next ``section[1]`` stream 1, the rest stream 2.
    Interleaved (Qwen3-VL): stream 1 when ``j % 3 == 1`` and ``j < 3 * section[1]``, stream 2 when
    ``j % 3 == 2`` and ``j < 3 * section[2]``, else stream 0 (``tileops.rope.freqs.mrope_streams``
    is the same map on the host)."""
    s0, s1, s2 = spec.mrope_section
    if spec.mrope_interleaved:
        return T.if_then_else(T.And(j % 3 == 1, j < 3 * s1), ph,
                              T.if_then_else(T.And(j % 3 == 2, j < 3 * s2), pw, pt))
    return T.if_then_else(j < s0, pt, T.if_then_else(j < s0 + s1, ph, pw))


def build_rope(spec: RoPEKernelSpec):
    """The ``T.prim_func`` for ``spec``; its parameters are :data:`ARGS`.

    ``X``, ``Y``, ``K``, ``KY`` are flat buffers of the element type addressed through the strides
    that follow, in units of ``spec.stride_unit`` elements; ``TD[3, 256, 2, R/2]`` the fp32 digit
    tables; with positions ``P`` (flat, int32/int64, element ``(b, s)`` at ``b * psb + s * pss``, plus
    ``stream * psc`` with MRoPE), ``ERR`` (the call's error entry: a position outside ``[0, limit)``
    is reported there, :mod:`tileops.kernels.report`, and reads as 0, so no table is ever indexed
    out of bounds), ``limit``
    and ``tag``; without positions these are not read (``P`` is then declared int32).
    """
    _tl()
    if spec.backend == "cuda":
        return _build_cuda(spec)
    return _build_c(spec)


def _tl() -> Any:
    """Import TileLang's language (once); returns it."""
    global T
    if T is None:
        import tilelang.language as tl

        T = tl
    return T


# ----------------------------------------------------------------------------------- the stages
# Each is a factory: it takes the spec (the compile-time choices) and returns a ``T.macro`` that
# closes over them. The rope kernels below are built from them, and so is any kernel that fuses
# RoPE with other stages (``kernels/prologue.py``, which declares ``USES``): one copy of the math.
# Macro parameters that receive a kernel parameter or a named variable carry its exact name:
# TVMScript renames a variable bound to a new name (and two kernel parameters of one name do not
# compile), so renaming one would change the generated code of every kernel that calls it.


def position(spec: RoPEKernelSpec):
    """The position read: a macro ``p = position(P, ERR, psb, pss, limit, tag, b, s, stream=None,
    psc=None, word=0)``, the position of row ``(b, s)``: ``s`` itself (``spec.positions`` None), or
    ``P[b * psb + s * pss]`` checked against ``[0, limit)``; one outside reads as 0 (so no table row
    past the end is ever indexed) and is reported as checked input ``word`` of the call's entry ``ERR``
    (:func:`tileops.kernels.report.report`: the tag, the element's offset and value). With ``stream``
    (MRoPE), the position of that stream, ``P[stream * psc + b * psb + s * pss]``."""
    _tl()
    by_ids = spec.positions is not None
    bad = report(spec.backend)

    @T.macro
    def position(P, ERR, psb, pss, limit, tag, b, s, stream=None, psc=None, word=0):
        p = T.alloc_var("int64")
        if by_ids:
            if stream is None:
                at = T.cast(b, "int64") * psb + T.cast(s, "int64") * pss
            else:
                at = stream * psc + T.cast(b, "int64") * psb + T.cast(s, "int64") * pss
            raw = T.cast(P[at], "int64")
            if raw < 0 or raw >= limit:
                bad(ERR, word, tag, at, raw)
                p = 0
            else:
                p = raw
        else:
            p = T.cast(s, "int64")
        return p

    return position


def _compose(spec: RoPEKernelSpec):
    """C (and :func:`pair_angle`): a macro ``compose(TD, cst, j, d0, d1, d2, at=None)``: ``cst[0, j],
    cst[1, j]`` = cos, sin of pair ``j``'s angle at the position of digits ``d2 d1 d0`` (times the
    amplitude folded into ``TD[0]``; sin negated for ``inverse``), by angle addition over the three
    digit tables; with ``at``, ``cst[at, 0, j], cst[at, 1, j]`` (a block's buffer of several tokens).
    The same fp32 operations in the same order as :func:`lane_angles`' composition."""
    sgn = -1.0 if spec.inverse else 1.0

    @T.macro
    def compose(TD, cst, j, d0, d1, d2, at=None):
        c2, s2 = TD[2, d2, 0, j], TD[2, d2, 1, j]
        c1, s1 = TD[1, d1, 0, j], TD[1, d1, 1, j]
        c0, s0 = TD[0, d0, 0, j], TD[0, d0, 1, j]
        c12 = c2 * c1 - s2 * s1
        s12 = s2 * c1 + c2 * s1
        if at is None:
            cst[0, j] = c12 * c0 - s12 * s0
            cst[1, j] = (s12 * c0 + c12 * s0) * sgn
        else:
            cst[at, 0, j] = c12 * c0 - s12 * s0
            cst[at, 1, j] = (s12 * c0 + c12 * s0) * sgn

    return compose


def angles(spec: RoPEKernelSpec):
    """The position read and the cos/sin composition of one token (C schedule): a macro
    ``angles(TD, cst, P, ERR, psb, pss, psc, limit, tag, b, s, word=0)`` that fills the local fp32
    ``cst[2, R/2]`` with cos and sin of each pair's angle at row ``(b, s)``'s position
    (:func:`position`, a bad one reported in ``ERR[word]``). With ``mrope_section`` the token's
    three positions are read (streams ``psc`` apart) and each pair takes its stream's (``_pick``)."""
    _tl()
    half = spec.rot // 2
    mrope = spec.mrope_section is not None
    pos, compose = position(spec), _compose(spec)

    @T.macro
    def angles(TD, cst, P, ERR, psb, pss, psc, limit, tag, b, s, word=0):
        if mrope:  # three positions; each pair takes its stream's
            pt = pos(P, ERR, psb, pss, limit, tag, b, s, 0, psc, word)
            ph = pos(P, ERR, psb, pss, limit, tag, b, s, 1, psc, word)
            pw = pos(P, ERR, psb, pss, limit, tag, b, s, 2, psc, word)
            for j in T.serial(half):
                pj = _pick(spec, j, pt, ph, pw)
                compose(TD, cst, j, pj % LO, (pj // LO) % LO, pj // (LO * LO))
        else:
            p = pos(P, ERR, psb, pss, limit, tag, b, s, None, None, word)
            d0 = p % LO
            d1 = (p // LO) % LO
            d2 = p // (LO * LO)
            for j in T.serial(half):
                compose(TD, cst, j, d0, d1, d2)

    return angles


def rotate(spec: RoPEKernelSpec, row: bool = False):
    """The rotation of one head row (C schedule): a macro ``rotate(X, Y, xh, yh, cst)`` that reads
    the head at ``X[xh : xh + D]``, rotates each pair (``spec.pairing``: neox ``(j, j + R/2)``,
    interleaved ``(2j, 2j + 1)``) by ``cst`` (:func:`angles`) in fp32, copies the columns past
    ``R`` and stores the row at ``Y[yh : yh + D]`` in ``spec.dtype``. ``X`` is a buffer of the
    spec's storage (the columns past ``R`` copied as stored), or with ``row`` a local fp32 row a
    fused kernel holds (say, normalised by an earlier stage; those columns rounded to the dtype)."""
    _tl()
    D, R, half = spec.head_dim, spec.rot, spec.rot // 2
    dt = spec.dtype
    storage = storage_dtype(dt, spec.backend)

    def load(X, i):
        return X[i] if row else load_f32(X, i, storage, dt)

    @T.macro
    def one_head(X, Y, xh, yh, cst):
        for j in T.serial(half):
            i1, i2 = _pair_index(spec, j)
            a = load(X, xh + i1)
            c = load(X, xh + i2)
            Y[yh + i1] = to_storage(a * cst[0, j] - c * cst[1, j], storage, dt)
            Y[yh + i2] = to_storage(c * cst[0, j] + a * cst[1, j], storage, dt)
        for i in T.serial(D - R):
            if row:
                Y[yh + R + i] = to_storage(X[xh + R + i], storage, dt)
            else:
                Y[yh + R + i] = X[xh + R + i]

    return one_head


def _pair_index(spec: RoPEKernelSpec, j):
    """Element indices (first, second) of pair ``j`` within a head."""
    if spec.pairing == "neox":
        return j, j + spec.rot // 2
    return 2 * j, 2 * j + 1


def _offset(b, s, h, sb, ss, sh, unit: int = 1):
    """Element offset of row ``(b, s, h)`` from strides given in units of ``unit`` elements."""
    return (T.cast(b, "int64") * sb + T.cast(s, "int64") * ss + T.cast(h, "int64") * sh) * unit


def _signature(spec: RoPEKernelSpec, storage: str):
    """Buffer declarations shared by both backends (flat extents are dynamic)."""
    half = spec.rot // 2
    NX, NY, NK, NKY, NP = T.dynamic("NX, NY, NK, NKY, NP")
    return dict(
        X=T.Tensor((NX,), storage), Y=T.Tensor((NY,), storage), K=T.Tensor((NK,), storage),
        KY=T.Tensor((NKY,), storage), TD=T.Tensor((DIGITS, LO, 2, half), "float32"),
        P=T.Tensor((NP,), spec.positions or "int32"),
        # a kernel with positions reports a bad one in its call's error entry (kernels/report.py)
        ERR=T.Tensor((ENTRY if spec.positions else 1,), "int32"),
    )


def _build_c(spec: RoPEKernelSpec):
    half = spec.rot // 2
    storage = storage_dtype(spec.dtype, "c")
    sig = _signature(spec, storage)
    angles_of, one_head = angles(spec), rotate(spec)

    @T.macro
    def body(X, Y, K, KY, TD, P, ERR, H, HK, xsb, xss, xsh, ysb, yss, ysh, ksb, kss, ksh, kysb, kyss, kysh,
             psb, pss, psc, limit, tag, b, s):
        cst = T.alloc_local((2, half), "float32")
        angles_of(TD, cst, P, ERR, psb, pss, psc, limit, tag, b, s)
        for h in T.serial(H + HK):
            if h < H:
                one_head(X, Y, _offset(b, s, h, xsb, xss, xsh), _offset(b, s, h, ysb, yss, ysh), cst)
            else:
                one_head(K, KY, _offset(b, s, h - H, ksb, kss, ksh), _offset(b, s, h - H, kysb, kyss, kysh), cst)

    @T.prim_func
    def rope_c(X: sig["X"], Y: sig["Y"], K: sig["K"], KY: sig["KY"], TD: sig["TD"], P: sig["P"], ERR: sig["ERR"],
               B: T.int32, S: T.int32, H: T.int32, HK: T.int32,
               xsb: T.int64, xss: T.int64, xsh: T.int64, ysb: T.int64, yss: T.int64, ysh: T.int64,
               ksb: T.int64, kss: T.int64, ksh: T.int64, kysb: T.int64, kyss: T.int64, kysh: T.int64,
               psb: T.int64, pss: T.int64, psc: T.int64, limit: T.int64, tag: T.int32):
        with T.Kernel(S, B, threads=1) as (bs, bb):
            body(X, Y, K, KY, TD, P, ERR, H, HK, xsb, xss, xsh, ysb, yss, ysh, ksb, kss, ksh, kysb, kyss,
                 kysh, psb, pss, psc, limit, tag, bb, bs)
    return rope_c


# 16-byte stores through st.global.cg: written as plain uint4 stores, nvcc split the first of the
# two output vectors of each head into four 4-byte stores (seen in the PTX for sm_90 and sm_80).
# .cg also keeps the streamed output out of L1, which holds the cos/sin tables.
CUDA_HELPERS = """
template <typename T> __device__ __forceinline__ void tileops_st16(T* dst, const T* src) {
  __stcg(reinterpret_cast<uint4*>(dst), *reinterpret_cast<const uint4*>(src));
}
"""


def store_one(spec: RoPEKernelSpec):
    """CUDA: a macro ``store(Y, o, vals)``: ``Y[o : o + V] = vals``, one 16-byte ``tileops_st16`` where
    the vector is a full 16 bytes (the kernel imports :data:`CUDA_HELPERS`), else a vectorized loop."""
    V, dt = spec.vec, spec.dtype
    wide = V * _ELEM_BYTES[dt] == 16  # a vector is a full 16 bytes: store it with tileops_st16

    @T.macro
    def store(Y, o, vals):
        if wide:
            T.call_extern("handle", "tileops_st16", T.address_of(Y[o]), T.address_of(vals[0]))
        else:
            for v in T.vectorized(V):
                Y[o + v] = vals[v]

    return store


def rotate_vals(spec: RoPEKernelSpec):
    """CUDA: the pairing's arithmetic on one lane's vectors, a macro ``rotate_vals(xa, xb, cs, sn, ya,
    yb)``: ``xa``, ``xb`` (``V`` elements of the dtype each: neox, the first and second halves' ``V``
    pairs; interleaved, ``2V`` contiguous elements, ``V`` pairs) rotated by ``cs``/``sn`` (``V`` cos
    and sin, the lane's pairs, :func:`lane_angles`) in fp32, rounded once into ``ya``, ``yb``."""
    _tl()
    V, dt = spec.vec, spec.dtype
    neox = spec.pairing == "neox"

    @T.macro
    def rotate_vals(xa, xb, cs, sn, ya, yb):
        if neox:
            for v in T.serial(V):
                a = T.cast(xa[v], "float32")
                c = T.cast(xb[v], "float32")
                ya[v] = T.cast(a * cs[v] - c * sn[v], dt)
                yb[v] = T.cast(c * cs[v] + a * sn[v], dt)
        elif V == 1:
            a = T.cast(xa[0], "float32")
            c = T.cast(xb[0], "float32")
            ya[0] = T.cast(a * cs[0] - c * sn[0], dt)
            yb[0] = T.cast(c * cs[0] + a * sn[0], dt)
        else:
            for v in T.serial(V // 2):
                a = T.cast(xa[2 * v], "float32")
                c = T.cast(xa[2 * v + 1], "float32")
                ya[2 * v] = T.cast(a * cs[v] - c * sn[v], dt)
                ya[2 * v + 1] = T.cast(c * cs[v] + a * sn[v], dt)
                a2 = T.cast(xb[2 * v], "float32")
                c2 = T.cast(xb[2 * v + 1], "float32")
                yb[2 * v] = T.cast(a2 * cs[V // 2 + v] - c2 * sn[V // 2 + v], dt)
                yb[2 * v + 1] = T.cast(c2 * cs[V // 2 + v] + a2 * sn[V // 2 + v], dt)

    return rotate_vals


def pair_offsets(spec: RoPEKernelSpec, j0):
    """CUDA: ``(o1, o2)``, the element offsets within a head of the two vectors holding the ``V``
    pairs from pair ``j0`` on (a multiple of ``V``): neox ``x[j0 : j0 + V]`` and ``x[R/2 + j0 : ...]``;
    interleaved the ``2V`` contiguous elements ``x[2 j0 : 2 j0 + 2V]``, split in two vectors
    (element ``e`` of the run is vector ``e // V``, slot ``e % V``)."""
    half = spec.rot // 2
    if spec.pairing == "neox":
        return j0, half + j0
    return 2 * j0, 2 * j0 + spec.vec


def rotate_one(spec: RoPEKernelSpec):
    """The rotation of one lane's pairs of one head row (CUDA schedule): a macro ``rotate_one(X, Y,
    xh, yh, o1, o2, cs, sn, xa, xb, ya, yb)`` that loads the two ``V``-element vectors at ``X[xh +
    o1]`` and ``X[xh + o2]`` (:func:`pair_offsets`), rotates them (:func:`rotate_vals`) and stores
    them in ``spec.dtype`` at ``Y[yh + o1]``, ``Y[yh + o2]`` (``xa``, ``xb``, ``ya``, ``yb``: local
    vectors of ``V`` elements of the dtype). A fused kernel imports :data:`CUDA_HELPERS`
    (``T.import_source``) as the rope kernel does, or a source that defines ``tileops_st16`` the same."""
    _tl()
    V = spec.vec
    store = store_one(spec)
    rotated = rotate_vals(spec)

    @T.macro
    def rotate_one(X, Y, xh, yh, o1, o2, cs, sn, xa, xb, ya, yb):
        for v in T.vectorized(V):
            xa[v] = X[xh + o1 + v]
        for v in T.vectorized(V):
            xb[v] = X[xh + o2 + v]
        rotated(xa, xb, cs, sn, ya, yb)
        store(Y, yh + o1, ya)
        store(Y, yh + o2, yb)

    return rotate_one


def copy_one(spec: RoPEKernelSpec):
    """CUDA: a macro ``copy_one(X, Y, xh, yh, o, xa)``: the vector at ``X[xh + o]`` stored unchanged at
    ``Y[yh + o]`` (the columns past ``R`` of partial rotary)."""
    _tl()
    V = spec.vec
    store = store_one(spec)

    @T.macro
    def copy_one(X, Y, xh, yh, o, xa):
        for v in T.vectorized(V):
            xa[v] = X[xh + o + v]
        store(Y, yh + o, xa)

    return copy_one


def lane_angles(spec: RoPEKernelSpec):
    """CUDA: cos and sin of one lane's ``V`` pairs from pair ``j0`` on, a macro ``lane_angles(TD, j0,
    p, pt, ph, pw, c2, s2, c1, s1, c0, s0, cs, sn)``: the digit tables' rows of the position ``p``
    (:func:`position`; with MRoPE ``p`` is None and ``pt``, ``ph``, ``pw`` are the three streams'
    positions, each pair taking its stream's, ``_pick``) loaded as vectors into ``c2 .. s0`` (local
    fp32, ``V`` each) and composed by angle addition into ``cs``, ``sn`` (sin negated for
    ``inverse``). Where every section is a multiple of ``V`` pairs (``uniform_streams``) the ``V``
    pairs share one stream and the loads stay vectors; otherwise each pair gathers its own rows
    (``6 V`` scalar loads). Loading each stream's rows as vectors and picking per pair instead (``18``
    vector loads) measured slower on the H200 (57-71% of a copy for the prologue's MRoPE rows against
    80% for the gather, ``benchmarks/prologue_schedules.py``), and was removed."""
    _tl()
    V = spec.vec
    mrope = spec.mrope_section is not None
    gather = mrope and not spec.uniform_streams  # each pair of a lane's V may take its own stream
    sgn = -1.0 if spec.inverse else 1.0

    @T.macro
    def lane_angles(TD, j0, p, pt, ph, pw, c2, s2, c1, s1, c0, s0, cs, sn):
        if gather:  # per pair: its stream's position, its own table rows
            for v in T.unroll(V):
                pv = T.alloc_var("int64")  # a variable: the pick is not repeated in each load
                pv = _pick(spec, j0 + v, pt, ph, pw)
                e0 = pv % LO
                e1 = (pv // LO) % LO
                e2 = pv // (LO * LO)
                c2[v] = TD[2, e2, 0, j0 + v]
                s2[v] = TD[2, e2, 1, j0 + v]
                c1[v] = TD[1, e1, 0, j0 + v]
                s1[v] = TD[1, e1, 1, j0 + v]
                c0[v] = TD[0, e0, 0, j0 + v]
                s0[v] = TD[0, e0, 1, j0 + v]
        else:
            if mrope:  # the V pairs share one stream
                p = T.alloc_var("int64")
                p = _pick(spec, j0, pt, ph, pw)
            d0 = p % LO
            d1 = (p // LO) % LO
            d2 = p // (LO * LO)
            for v in T.vectorized(V):
                c2[v] = TD[2, d2, 0, j0 + v]
            for v in T.vectorized(V):
                s2[v] = TD[2, d2, 1, j0 + v]
            for v in T.vectorized(V):
                c1[v] = TD[1, d1, 0, j0 + v]
            for v in T.vectorized(V):
                s1[v] = TD[1, d1, 1, j0 + v]
            for v in T.vectorized(V):
                c0[v] = TD[0, d0, 0, j0 + v]
            for v in T.vectorized(V):
                s0[v] = TD[0, d0, 1, j0 + v]
        for v in T.serial(V):
            c12 = c2[v] * c1[v] - s2[v] * s1[v]
            s12 = s2[v] * c1[v] + c2[v] * s1[v]
            cs[v] = c12 * c0[v] - s12 * s0[v]
            sn[v] = (s12 * c0[v] + c12 * s0[v]) * sgn

    return lane_angles


def pair_angle(spec: RoPEKernelSpec):
    """CUDA, cos/sin shared by a block: a macro ``pair_angle(TD, cst, P, ERR, psb, pss, psc, limit,
    tag, b, s, j, at, word=0)`` that composes pair ``j`` alone into ``cst[at, 0, j]``, ``cst[at, 1,
    j]`` (a buffer of the block's tokens, say shared memory): the position of row ``(b, s)``
    (:func:`position`; with MRoPE only the stream pair ``j`` takes, ``_pick``, read and checked, a bad
    one reported in ``ERR[word]``) and 6 scalar table loads composed as :func:`lane_angles` composes
    them (the C schedule's ``_compose``): the same cos/sin, each thread of a block one pair."""
    _tl()
    mrope = spec.mrope_section is not None
    pos, compose = position(spec), _compose(spec)

    @T.macro
    def pair_angle(TD, cst, P, ERR, psb, pss, psc, limit, tag, b, s, j, at, word=0):
        if mrope:  # pair j's stream alone
            stream = T.alloc_var("int64")  # a variable: the pick is not repeated in each use
            stream = _pick(spec, j, T.int64(0), T.int64(1), T.int64(2))
            p = pos(P, ERR, psb, pss, limit, tag, b, s, stream, psc, word)
        else:
            p = pos(P, ERR, psb, pss, limit, tag, b, s, None, None, word)
        compose(TD, cst, j, p % LO, (p // LO) % LO, p // (LO * LO), at)

    return pair_angle


def _build_cuda(spec: RoPEKernelSpec):
    D, R, half = spec.head_dim, spec.rot, spec.rot // 2
    dt = spec.dtype
    V = spec.vec
    C = half // V  # lanes that rotate: each owns V pairs (2 * V elements of x)
    HL = spec._head_lanes
    CL = spec._lanes
    TOK = spec._slots  # token slots per block
    TPT = max(1, spec.tokens_per_thread)  # tokens each thread walks, TOK apart
    threads = spec.block_threads
    GROUP = spec.group
    mrope = spec.mrope_section is not None
    by_ids = spec.positions is not None
    sig = _signature(spec, dt)

    def heads(n):
        """A head loop: ``#pragma unroll head_unroll`` where the spec sets it, else nvcc decides."""
        if spec.head_unroll:
            from tilelang.cuda.language import unroll

            return unroll(n, unroll_factor=spec.head_unroll)
        return T.serial(n)

    pos, rotate_vec, copy_vec = position(spec), rotate_one(spec), copy_one(spec)
    angles_of = lane_angles(spec)

    @T.macro
    def token(X, Y, K, KY, TD, P, ERR, H, HK, xsb, xss, xsh, ysb, yss, ysh, ksb, kss, ksh, kysb, kyss, kysh,
              psb, pss, psc, limit, tag, bb, s, lane, hl, c2, s2, c1, s1, c0, s0, cs, sn, xa, xb, ya, yb):
        if mrope:  # every thread reads (and checks) the token's three positions
            pt = pos(P, ERR, psb, pss, limit, tag, bb, s, 0, psc)
            ph = pos(P, ERR, psb, pss, limit, tag, bb, s, 1, psc)
            pw = pos(P, ERR, psb, pss, limit, tag, bb, s, 2, psc)
        else:
            p = pos(P, ERR, psb, pss, limit, tag, bb, s)
        xo = _offset(bb, s, 0, xsb, xss, xsh, V)
        yo = _offset(bb, s, 0, ysb, yss, ysh, V)
        ko = _offset(bb, s, 0, ksb, kss, ksh, V)
        kyo = _offset(bb, s, 0, kysb, kyss, kysh, V)
        if lane < C:
            j0 = lane * V
            if mrope:
                angles_of(TD, j0, None, pt, ph, pw, c2, s2, c1, s1, c0, s0, cs, sn)
            else:
                angles_of(TD, j0, p, None, None, None, c2, s2, c1, s1, c0, s0, cs, sn)
            o1, o2 = pair_offsets(spec, j0)
            for k in heads(T.ceildiv(H - hl, HL)):
                h = T.cast(hl + k * HL, "int64")
                rotate_vec(X, Y, xo + h * xsh * V, yo + h * ysh * V, o1, o2, cs, sn, xa, xb, ya, yb)
            for k in heads(T.ceildiv(HK - hl, HL)):
                h = T.cast(hl + k * HL, "int64")
                rotate_vec(K, KY, ko + h * ksh * V, kyo + h * kysh * V, o1, o2, cs, sn, xa, xb, ya, yb)
        else:
            o = R + (lane - C) * V
            for k in heads(T.ceildiv(H - hl, HL)):
                h = T.cast(hl + k * HL, "int64")
                copy_vec(X, Y, xo + h * xsh * V, yo + h * ysh * V, o, xa)
            for k in heads(T.ceildiv(HK - hl, HL)):
                h = T.cast(hl + k * HL, "int64")
                copy_vec(K, KY, ko + h * ksh * V, kyo + h * kysh * V, o, xa)

    @T.macro
    def body(X, Y, K, KY, TD, P, ERR, S, H, HK, xsb, xss, xsh, ysb, yss, ysh, ksb, kss, ksh, kysb, kyss, kysh,
             psb, pss, psc, limit, tag, bx, bb):
        T.import_source(CUDA_HELPERS + (REPORT_SOURCE if by_ids else ""))  # one import_source a kernel
        tx = T.get_thread_binding()
        lane = tx % CL
        tok = (tx // CL) % TOK
        hl = tx // (CL * TOK)
        cs = T.alloc_local((V,), "float32")
        sn = T.alloc_local((V,), "float32")
        c2 = T.alloc_local((V,), "float32")
        s2 = T.alloc_local((V,), "float32")
        c1 = T.alloc_local((V,), "float32")
        s1 = T.alloc_local((V,), "float32")
        c0 = T.alloc_local((V,), "float32")
        s0 = T.alloc_local((V,), "float32")
        xa = T.alloc_local((V,), dt)
        xb = T.alloc_local((V,), dt)
        ya = T.alloc_local((V,), dt)
        yb = T.alloc_local((V,), dt)
        for kt in T.unroll(TPT):
            s = bx * GROUP + kt * TOK + tok
            if s < S:
                token(X, Y, K, KY, TD, P, ERR, H, HK, xsb, xss, xsh, ysb, yss, ysh, ksb, kss, ksh, kysb, kyss,
                      kysh, psb, pss, psc, limit, tag, bb, s, lane, hl, c2, s2, c1, s1, c0, s0, cs, sn, xa, xb, ya,
                      yb)

    @T.prim_func
    def rope_cuda(X: sig["X"], Y: sig["Y"], K: sig["K"], KY: sig["KY"], TD: sig["TD"], P: sig["P"], ERR: sig["ERR"],
                  B: T.int32, S: T.int32, H: T.int32, HK: T.int32,
                  xsb: T.int64, xss: T.int64, xsh: T.int64, ysb: T.int64, yss: T.int64, ysh: T.int64,
                  ksb: T.int64, kss: T.int64, ksh: T.int64, kysb: T.int64, kyss: T.int64, kysh: T.int64,
                  psb: T.int64, pss: T.int64, psc: T.int64, limit: T.int64, tag: T.int32):
        with T.Kernel(T.ceildiv(S, GROUP), T.min(B, MAX_GRID_Y), T.ceildiv(B, MAX_GRID_Y),
                      threads=threads) as (bx, by, bz):
            if bz * MAX_GRID_Y + by < B:
                body(X, Y, K, KY, TD, P, ERR, S, H, HK, xsb, xss, xsh, ysb, yss, ysh, ksb, kss, ksh, kysb, kyss,
                     kysh, psb, pss, psc, limit, tag, bx, bz * MAX_GRID_Y + by)
    return rope_cuda


#: the names :mod:`tileops.kernels` looks up in a builder module
build = build_rope
Spec = RoPEKernelSpec
