"""RoPE as TileLang tile programs: one builder for every op of the family.

What varies between the five RoPE ops is only the frequency table and an amplitude, which the host
folds into two small float64-derived tables; the kernel itself knows three things:

* the pairing: ``neox`` pairs ``(i, i + R/2)``, ``interleaved`` pairs ``(2i, 2i + 1)``;
* where positions come from: the sequence index (``positions=None``) or an int32/int64 tensor,
  bounds-checked on the device;
* the rotated width ``R`` (``rot``), at most ``D``; columns ``R..D`` are copied unchanged.

Accuracy. cos/sin of ``p * f`` are never evaluated in fp32 from an fp32 angle (error ``p * 2^-24``
rad, 0.06 rad at p = 1e6). Instead ``p = hi * LO + lo`` and the host builds two tables in float64,
rounded once to fp32: ``TH[hi] = (cos, sin)(hi * LO * f)`` and ``TL[lo] = A * (cos, sin)(lo * f)``.
The kernel composes them by angle addition, ``cos = ch*cl - sh*sl``, ``sin = sh*cl + ch*sl``: about
three fp32 roundings whatever the position. With LO = 256 the tables hold (P/256 + 256) rows of
R/2 pairs: 0.3 MB for R = 128 at P = 2^16, instead of 32 MB for a full table.

Layout. Every input is seen as ``X[B, S, H, D]`` (1d: B = H = 1; position ids: B = 1, S = tokens),
with B, S, H dynamic: one compiled kernel serves every length and head count. ``Y`` is a separate
buffer, so in-place rotation is ``Y = X`` and a second tensor (the key) is a second pair of buffers.

Two schedules from one description:

* ``cuda``: SIMT. A thread owns one chunk of ``VEC`` pairs (16 bytes of x) of one token, composes
  its cos/sin once and reuses them across the heads it walks (``H / HL`` of them) and across both
  halves of each pair. Loads and stores of x are 16 bytes wide.
* ``c``: TileLang's C backend has no threads, so the same math runs as plain loops per token.
"""



from dataclasses import dataclass

import tilelang.language as T

__all__ = ["RopeKernelSpec", "build_rope", "LO"]

#: rows of the low table: positions are split as hi * LO + lo
LO = 256
_ELEM_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


@dataclass(frozen=True)
class RopeKernelSpec:
    """Everything a RoPE kernel is compiled for; two equal specs share one compiled kernel."""

    dtype: str  # float16 | bfloat16 | float32
    head_dim: int  # D
    rot: int  # rotated width R, even, <= D
    pairing: str = "neox"  # neox | interleaved
    positions: "str | None" = None  # None (position = sequence index) | "int32" | "int64"
    backend: str = "cuda"  # cuda | c
    head_lanes: int = 4  # cuda: threads that split one token's heads
    threads: int = 128  # cuda: target threads per block
    tokens_per_thread: int = 1  # cuda: tokens each thread walks
    # cuda: >0 sizes the grid from the SM count (an extra scalar argument G) and blocks loop over
    # token groups; measured on the H200 it cost 2d 5-9% and helped no workload enough to keep on.
    blocks_per_sm: int = 0

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

    @property
    def group(self) -> int:
        """Tokens one CUDA block handles per step (token slots x tokens per thread)."""
        lanes = (self.rot // 2) // self.vec + (self.head_dim - self.rot) // self.vec
        return max(1, self.threads // (lanes * max(1, self.head_lanes))) * max(1, self.tokens_per_thread)

    @property
    def vec(self) -> int:
        """Elements per 16-byte access, shrunk until it divides both D and R/2."""
        v = 16 // _ELEM_BYTES[self.dtype]
        while v > 1 and (self.head_dim % v or (self.rot // 2) % v):
            v //= 2
        return v


def _load_f32(buf, idx, storage: str, dtype: str):
    """An element of ``buf`` as fp32. bf16 on the C backend is stored as int16 bits."""
    if dtype == "bfloat16" and storage == "int16":
        bits = T.shift_left(T.cast(T.cast(buf[idx], "uint16"), "uint32"), T.uint32(16))
        return T.reinterpret(bits, "float32")
    return T.cast(buf[idx], "float32")


def _to_storage(value, storage: str, dtype: str):
    """fp32 -> the stored type, rounding to nearest even (bf16 bits by hand on the C backend)."""
    if dtype == "bfloat16" and storage == "int16":
        u = T.reinterpret(value, "uint32")
        rounded = T.shift_right(u + T.uint32(0x7FFF) + T.bitwise_and(T.shift_right(u, T.uint32(16)), T.uint32(1)),
                                T.uint32(16))
        return T.cast(T.cast(rounded, "uint16"), "int16")
    return T.cast(value, dtype)


def build_rope(spec: RopeKernelSpec):
    """The ``T.prim_func`` for ``spec``.

    Arguments of the generated function, in order: ``X[B, S, H, D]``, ``Y[B, S, H, D]``,
    ``TH[NH, 2, R/2]``, ``TL[LO, 2, R/2]`` (fp32 cos/sin tables), then for position ids
    ``P[S]`` (int32/int64), ``ERR[1]`` (int32, set to 1 when a position is out of range) and the
    scalar ``max_position``.
    """
    if spec.backend == "cuda":
        return _build_cuda(spec)
    return _build_c(spec)


@T.macro
def _position(by_ids, P, ERR, max_position, s):
    """The position of sequence row ``s``: ``s`` itself, or ``P[s]`` checked against
    ``[0, max_position)``. A position outside sets ``ERR[0]`` and reads as 0, so no table is ever
    indexed out of bounds; the op turns the flag into a ValueError."""
    p = T.alloc_var("int64")
    if by_ids:
        raw = T.cast(P[s], "int64")
        if raw < 0 or raw >= T.cast(max_position, "int64"):
            ERR[0] = 1
            p = 0
        else:
            p = raw
    else:
        p = T.cast(s, "int64")
    return p


def _pair_index(spec: RopeKernelSpec, j):
    """Element indices (first, second) of pair ``j`` within a head."""
    if spec.pairing == "neox":
        return j, j + spec.rot // 2
    return 2 * j, 2 * j + 1


def _build_c(spec: RopeKernelSpec):
    D, R, half = spec.head_dim, spec.rot, spec.rot // 2
    storage = "int16" if spec.dtype == "bfloat16" else spec.dtype
    dt = spec.dtype
    B, S, H, NH = T.dynamic("B, S, H, NH")
    by_ids = spec.positions is not None
    pdt = spec.positions or "int32"

    @T.macro
    def body(X, Y, TH, TL, P, ERR, max_position, b, s):
        cst = T.alloc_local((2, half), "float32")
        p = _position(by_ids, P, ERR, max_position, s)
        hi = p // LO
        lo = p % LO
        for j in T.serial(half):
            ch, sh = TH[hi, 0, j], TH[hi, 1, j]
            cl, sl = TL[lo, 0, j], TL[lo, 1, j]
            cst[0, j] = ch * cl - sh * sl
            cst[1, j] = sh * cl + ch * sl
        for h in T.serial(H):
            for j in T.serial(half):
                i1, i2 = _pair_index(spec, j)
                a = _load_f32(X, (b, s, h, i1), storage, dt)
                c = _load_f32(X, (b, s, h, i2), storage, dt)
                Y[b, s, h, i1] = _to_storage(a * cst[0, j] - c * cst[1, j], storage, dt)
                Y[b, s, h, i2] = _to_storage(c * cst[0, j] + a * cst[1, j], storage, dt)
            for i in T.serial(D - R):
                Y[b, s, h, R + i] = X[b, s, h, R + i]

    if by_ids:
        @T.prim_func
        def rope_ids_c(X: T.Tensor((B, S, H, D), storage), Y: T.Tensor((B, S, H, D), storage),
                       TH: T.Tensor((NH, 2, half), "float32"), TL: T.Tensor((LO, 2, half), "float32"),
                       P: T.Tensor((S,), pdt), ERR: T.Tensor((1,), "int32"), max_position: T.int32):
            with T.Kernel(S, B, threads=1) as (bs, bb):
                body(X, Y, TH, TL, P, ERR, max_position, bb, bs)
        return rope_ids_c

    @T.prim_func
    def rope_c(X: T.Tensor((B, S, H, D), storage), Y: T.Tensor((B, S, H, D), storage),
               TH: T.Tensor((NH, 2, half), "float32"), TL: T.Tensor((LO, 2, half), "float32")):
        with T.Kernel(S, B, threads=1) as (bs, bb):
            body(X, Y, TH, TL, None, None, 0, bb, bs)
    return rope_c


# 16-byte stores through st.global.cg: written as plain uint4 stores, nvcc split the first of the
# two output vectors of each head into four 4-byte stores (seen in the PTX for sm_90 and sm_80).
# .cg also keeps the streamed output out of L1, which holds the cos/sin tables.
_CUDA_HELPERS = """
template <typename T> __device__ __forceinline__ void tileops_st16(T* dst, const T* src) {
  __stcg(reinterpret_cast<uint4*>(dst), *reinterpret_cast<const uint4*>(src));
}
"""


def _build_cuda(spec: RopeKernelSpec):
    D, R, half = spec.head_dim, spec.rot, spec.rot // 2
    dt = spec.dtype
    V = spec.vec
    wide = V * _ELEM_BYTES[dt] == 16  # a vector is a full 16 bytes: store it with tileops_st16
    C = half // V  # lanes that rotate: each owns V pairs (2 * V elements of x)
    CP = (D - R) // V  # lanes that copy the unrotated tail, one V-vector each
    CL = C + CP
    HL = max(1, spec.head_lanes)
    TOK = max(1, spec.threads // (CL * HL))  # token slots per block
    TPT = max(1, spec.tokens_per_thread)  # tokens each thread walks, TOK apart
    threads = CL * HL * TOK
    B, S, H, NH = T.dynamic("B, S, H, NH")
    by_ids = spec.positions is not None
    pdt = spec.positions or "int32"
    neox = spec.pairing == "neox"

    @T.macro
    def store(Y, bb, s, h, o, vals):
        if wide:
            T.call_extern("handle", "tileops_st16", T.address_of(Y[bb, s, h, o]), T.address_of(vals[0]))
        else:
            for v in T.vectorized(V):
                Y[bb, s, h, o + v] = vals[v]

    GROUP = TOK * TPT  # tokens one block handles per step
    persistent = spec.blocks_per_sm > 0

    @T.macro
    def token(X, Y, TH, TL, P, ERR, max_position, bb, s, lane, hl, ch, sh, cl, sl, cs, sn, xa, xb, ya, yb):
        p = _position(by_ids, P, ERR, max_position, s)
        if lane < C:
            j0 = lane * V
            # Loading the high row once per token group instead (it is shared by 256 positions) was
            # measured slower on the H200: 1d 256k fp16 went from 82% to 75% of the copy rate.
            for v in T.vectorized(V):
                ch[v] = TH[p // LO, 0, j0 + v]
            for v in T.vectorized(V):
                sh[v] = TH[p // LO, 1, j0 + v]
            for v in T.vectorized(V):
                cl[v] = TL[p % LO, 0, j0 + v]
            for v in T.vectorized(V):
                sl[v] = TL[p % LO, 1, j0 + v]
            for v in T.serial(V):
                cs[v] = ch[v] * cl[v] - sh[v] * sl[v]
                sn[v] = sh[v] * cl[v] + ch[v] * sl[v]
            # neox: the V pairs are x[j0 : j0+V] with x[half+j0 : ...];
            # interleaved: they are the 2V contiguous elements x[2*j0 : 2*j0 + 2V], split in
            # two vectors; element e of the pair run is (vector e // V, slot e % V).
            o1 = j0 if neox else 2 * j0
            o2 = half + j0 if neox else 2 * j0 + V
            for k in T.serial(T.ceildiv(H - hl, HL)):
                h = hl + k * HL
                for v in T.vectorized(V):
                    xa[v] = X[bb, s, h, o1 + v]
                for v in T.vectorized(V):
                    xb[v] = X[bb, s, h, o2 + v]
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
                store(Y, bb, s, h, o1, ya)
                store(Y, bb, s, h, o2, yb)
        else:
            o = R + (lane - C) * V
            for k in T.serial(T.ceildiv(H - hl, HL)):
                h = hl + k * HL
                for v in T.vectorized(V):
                    xa[v] = X[bb, s, h, o + v]
                store(Y, bb, s, h, o, xa)

    @T.macro
    def body(X, Y, TH, TL, P, ERR, max_position, G, bx, bb):
        T.import_source(_CUDA_HELPERS)
        tx = T.get_thread_binding()
        lane = tx % CL
        tok = (tx // CL) % TOK
        hl = tx // (CL * TOK)
        cs = T.alloc_local((V,), "float32")
        sn = T.alloc_local((V,), "float32")
        ch = T.alloc_local((V,), "float32")
        sh = T.alloc_local((V,), "float32")
        cl = T.alloc_local((V,), "float32")
        sl = T.alloc_local((V,), "float32")
        xa = T.alloc_local((V,), dt)
        xb = T.alloc_local((V,), dt)
        ya = T.alloc_local((V,), dt)
        yb = T.alloc_local((V,), dt)
        steps = T.ceildiv(T.ceildiv(S, GROUP) - bx, G) if persistent else 1
        for it in T.serial(steps):
            group = bx + it * G if persistent else bx
            for kt in T.unroll(TPT):
                s = group * GROUP + kt * TOK + tok
                if s < S:
                    token(X, Y, TH, TL, P, ERR, max_position, bb, s, lane, hl, ch, sh, cl, sl, cs, sn, xa, xb,
                          ya, yb)

    if by_ids and persistent:
        @T.prim_func
        def rope_ids_cuda_p(X: T.Tensor((B, S, H, D), dt), Y: T.Tensor((B, S, H, D), dt),
                            TH: T.Tensor((NH, 2, half), "float32"), TL: T.Tensor((LO, 2, half), "float32"),
                            P: T.Tensor((S,), pdt), ERR: T.Tensor((1,), "int32"), max_position: T.int32,
                            G: T.int32):
            with T.Kernel(G, B, threads=threads) as (bx, bb):
                body(X, Y, TH, TL, P, ERR, max_position, G, bx, bb)
        return rope_ids_cuda_p
    if by_ids:
        @T.prim_func
        def rope_ids_cuda(X: T.Tensor((B, S, H, D), dt), Y: T.Tensor((B, S, H, D), dt),
                          TH: T.Tensor((NH, 2, half), "float32"), TL: T.Tensor((LO, 2, half), "float32"),
                          P: T.Tensor((S,), pdt), ERR: T.Tensor((1,), "int32"), max_position: T.int32):
            with T.Kernel(T.ceildiv(S, GROUP), B, threads=threads) as (bx, bb):
                body(X, Y, TH, TL, P, ERR, max_position, 1, bx, bb)
        return rope_ids_cuda
    if persistent:
        @T.prim_func
        def rope_cuda_p(X: T.Tensor((B, S, H, D), dt), Y: T.Tensor((B, S, H, D), dt),
                        TH: T.Tensor((NH, 2, half), "float32"), TL: T.Tensor((LO, 2, half), "float32"),
                        G: T.int32):
            with T.Kernel(G, B, threads=threads) as (bx, bb):
                body(X, Y, TH, TL, None, None, 0, G, bx, bb)
        return rope_cuda_p

    @T.prim_func
    def rope_cuda(X: T.Tensor((B, S, H, D), dt), Y: T.Tensor((B, S, H, D), dt),
                  TH: T.Tensor((NH, 2, half), "float32"), TL: T.Tensor((LO, 2, half), "float32")):
        with T.Kernel(T.ceildiv(S, GROUP), B, threads=threads) as (bx, bb):
            body(X, Y, TH, TL, None, None, 0, 1, bx, bb)
    return rope_cuda
