"""Dynamic NTK's length state and cos/sin digit tables, updated on the device in one launch.

HF's dynamic NTK (``dynamic_rope_update``) keeps one number per module, the cached length: it grows
to a call's ``seq = max(position_ids) + 1`` (``seq_len`` without positions) when ``seq`` exceeds it,
and goes back to ``max_position_embeddings`` (``mpe``) when ``seq`` is below that. The frequencies
follow from it: ``inv_freq[j] = b'^(-2j/R)``, ``b' = base * (factor * cached / mpe - (factor - 1))
^ (R / (R - 2))``. The RoPE kernel (``kernels/rope.py``) reads them only through the three digit
tables ``TD[k, d] = (cos, sin)(d * 256^k * inv_freq)`` (float64, rounded once to fp32; see that module).

This kernel runs before the RoPE kernel of every call, in the same stream, and

* takes ``seq`` from ``seq`` (known on the host) or from the positions: every block reduces them
  (max, and whether any lies outside ``[0, limit)``: such a call raises, and leaves the length alone);
* updates ``ST[0]``, the cached length (float64, one per op and device, shared by the torch target).
  Every block computes the same new length from ``seq`` and the old one, and block 0 writes it; a block
  that reads the length block 0 has already written gets the same answer, since the update is
  idempotent (``f(seq, f(seq, c)) = f(seq, c)``), so the blocks need no ordering among themselves;
* rewrites the tables only where they are stale: block ``i`` owns ``threads`` table entries and the
  stamp ``STAMP[i]``, the length its entries were built for (NaN before the first build). A call whose
  length did not change (the common case: a long prompt followed by calls of the same length, or any
  call no longer than ``mpe``) reads its stamp and returns; one that changed it costs one float64
  ``pow`` and one ``sincos`` per entry, one entry per thread (3 x 256 x R/2 entries: 96 blocks of 512
  threads for R = 128).

Nothing is read on the host and the launch's arguments are fixed for a given shape, so a call can be
captured in a CUDA graph and replayed with other positions: the state and the tables follow them.
Doubles travel as their int64 bits (``*_bits``), so that the launcher's integer-only fast path serves
this kernel as it serves the RoPE kernel; the exponent ``R / (R - 2)`` is one of them, not a constant
in the source, because TileLang's C backend prints float constants with 7 digits (``1.090909e+00``
for 12 / 11: a relative error of 1e-7 in the exponent, 0.2 rad in a digit-2 angle at length 1.6e7).

``c`` backend: TileLang's C backend has no threads; one serial loop does the same, with one stamp.
"""


from dataclasses import dataclass
from typing import Any

T: Any = None

__all__ = ["NTKKernelSpec", "build", "Spec", "STATIC", "LO", "DIGITS"]

#: The schedule choices a manifest's ``kernel.static`` may set (read without importing this module)
STATIC = {
    "threads": (32, 1024, "threads per block, a power of two; each thread owns one table entry (CUDA)"),
}

#: the digit split of kernels/rope.py and tileops.rope.tables (which checks they agree): 256-row tables,
#: positions below 256^3
LO = 256
DIGITS = 3

#: the generated function's parameters, in order, the same for every spec: one ``T.prim_func`` per
#: backend. A kernel with positions never reads ``seq``, one without reads none of ``P`` to ``limit``
#: (the launcher passes 0 for what a call does not set)
ARGS = ("TD", "ST", "STAMP", "P", "B", "S", "psb", "pss", "limit", "seq",
        "base_bits", "factor_bits", "mpe_bits", "power_bits")


@dataclass(frozen=True)
class NTKKernelSpec:
    """Everything the state kernel is compiled for; the op's parameters are runtime arguments."""

    rot: int  # rotated width R, even, >= 4 (the scaled base is raised to R / (R - 2))
    positions: "str | None" = None  # None (seq given) | "int32" | "int64"
    backend: str = "cuda"  # cuda | c
    threads: int = 512  # cuda: threads per block, a power of two (96 blocks for R = 128: one wave)

    def __post_init__(self) -> None:
        if self.rot < 4 or self.rot % 2:
            raise ValueError(f"rot: expected an even width >= 4, got {self.rot}")
        if self.positions not in (None, "int32", "int64"):
            raise ValueError(f"positions: expected None, 'int32' or 'int64', got {self.positions!r}")
        if self.backend not in ("cuda", "c"):
            raise ValueError(f"backend: expected 'cuda' or 'c', got {self.backend!r}")
        if self.threads < 32 or self.threads > 1024 or self.threads & (self.threads - 1):
            raise ValueError(f"threads: expected a power of two in [32, 1024], got {self.threads}")

    @property
    def entries(self) -> int:
        """Table entries, one (cos, sin) pair each: ``DIGITS x LO x R/2``."""
        return DIGITS * LO * (self.rot // 2)

    @property
    def blocks(self) -> int:
        """Blocks of the launch, and stamps in ``STAMP``."""
        return -(-self.entries // self.threads) if self.backend == "cuda" else 1

    @property
    def args(self) -> tuple[str, ...]:
        """The generated function's parameter names, in order (:data:`ARGS`, whatever the spec)."""
        return ARGS


def _tl() -> Any:
    global T
    if T is None:
        import tilelang.language as tl

        T = tl
    return T


def _length(ST, seq, ok, mpe_bits):
    """The cached length after a call of length ``seq``, as HF's ``dynamic_rope_update`` makes it
    (``ST[0]`` unchanged when the call is not ``ok``: a position out of range)."""
    old = ST[0]
    mpe = T.reinterpret(mpe_bits, "float64")
    return T.if_then_else(ok, T.if_then_else(seq > old, seq, T.if_then_else(seq < mpe, mpe, old)), old)


def _entry_macro(spec: NTKKernelSpec):
    """The macro writing table entry ``e`` (digit ``k``, row ``d``, pair ``j``) for the cached
    ``length``, in float64 as :func:`tileops.rope.hooks.ntk_inv_freq` and
    :func:`tileops.rope.tables.digit_tables` compute it, rounded once to fp32."""
    R, half = spec.rot, spec.rot // 2

    @T.macro
    def entry(TD, e, length, base_bits, factor_bits, mpe_bits, power_bits):
        base = T.reinterpret(base_bits, "float64")
        factor = T.reinterpret(factor_bits, "float64")
        mpe = T.reinterpret(mpe_bits, "float64")
        power = T.reinterpret(power_bits, "float64")  # R / (R - 2)
        k = e // (LO * half)
        d = (e // half) % LO
        j = e % half
        scaled = base * T.pow(factor * length / mpe - (factor - 1.0), power)
        angle = T.alloc_var("float64")  # one variable: cos and sin share one evaluation of the pows
        angle = T.cast(T.shift_left(T.cast(d, "int64"), T.cast(8 * k, "int64")), "float64") * T.pow(
            scaled, T.cast(-2 * j, "float64") / T.float64(R))  # d * 256^k: exact
        TD[k, d, 0, j] = T.cast(T.cos(angle), "float32")
        TD[k, d, 1, j] = T.cast(T.sin(angle), "float32")

    return entry


def build(spec: NTKKernelSpec):
    """The ``T.prim_func`` for ``spec``; its parameters are :data:`ARGS`. ``TD[3, 256, 2, R/2]`` fp32,
    ``ST[1]`` and ``STAMP[spec.blocks]`` float64, ``P`` flat positions (element ``(b, s)`` at
    ``b * psb + s * pss``, ``B x S`` of them)."""
    _tl()
    return _build_cuda(spec) if spec.backend == "cuda" else _build_c(spec)


def _signature(spec: NTKKernelSpec):
    NP = T.dynamic("NP")
    return dict(TD=T.Tensor((DIGITS, LO, 2, spec.rot // 2), "float32"), ST=T.Tensor((1,), "float64"),
                STAMP=T.Tensor((spec.blocks,), "float64"), P=T.Tensor((NP,), spec.positions or "int32"))


def _build_c(spec: NTKKernelSpec):
    sig = _signature(spec)
    n = spec.entries
    entry = _entry_macro(spec)

    @T.macro
    def rebuild(TD, ST, STAMP, seq, base_bits, factor_bits, mpe_bits, power_bits, ok):
        cached = T.alloc_var("float64")  # not "new": TileLang keeps the name, and C++ reserves it
        cached = _length(ST, seq, ok, mpe_bits)
        ST[0] = cached
        if STAMP[0] != cached:
            for e in T.serial(n):
                entry(TD, e, cached, base_bits, factor_bits, mpe_bits, power_bits)
            STAMP[0] = cached

    @T.prim_func
    def ntk_c(TD: sig["TD"], ST: sig["ST"], STAMP: sig["STAMP"], P: sig["P"], B: T.int32, S: T.int32, psb: T.int64,
              pss: T.int64, limit: T.int64, seq: T.int64, base_bits: T.int64, factor_bits: T.int64,
              mpe_bits: T.int64, power_bits: T.int64):
        with T.Kernel(1, threads=1) as _:
            if spec.positions is None:  # decided here, while the function is built: one body or the other
                rebuild(TD, ST, STAMP, T.cast(seq, "float64"), base_bits, factor_bits, mpe_bits, power_bits, True)
            else:
                top = T.alloc_var("int64")
                bad = T.alloc_var("int32")
                top = -1
                bad = 0
                for b in T.serial(B):
                    for s in T.serial(S):
                        p = T.cast(P[T.cast(b, "int64") * psb + T.cast(s, "int64") * pss], "int64")
                        top = T.max(top, p)
                        if p < 0 or p >= limit:
                            bad = 1
                rebuild(TD, ST, STAMP, T.cast(top + 1, "float64"), base_bits, factor_bits, mpe_bits, power_bits,
                        bad == 0)
    return ntk_c


def _build_cuda(spec: NTKKernelSpec):
    sig = _signature(spec)
    n, threads = spec.entries, spec.threads
    entry = _entry_macro(spec)
    levels = threads.bit_length() - 1  # the tree reduction's steps: threads is a power of two

    @T.macro
    def rebuild(TD, ST, STAMP, seq, base_bits, factor_bits, mpe_bits, power_bits, ok, bx, tx):
        cached = T.alloc_var("float64")  # not "new": TileLang keeps the name, and C++ reserves it
        cached = _length(ST, seq, ok, mpe_bits)
        stale = T.alloc_var("int32")
        stale = T.if_then_else(STAMP[bx] != cached, 1, 0)  # NaN before the first build: stale
        if bx == 0 and tx == 0:
            ST[0] = cached  # idempotent: a block reading it now computes the same length
        T.sync_threads()  # every thread has read its block's stamp before thread 0 rewrites it
        if stale == 1:
            e = bx * threads + tx
            if e < n:
                entry(TD, e, cached, base_bits, factor_bits, mpe_bits, power_bits)
            if tx == 0:
                STAMP[bx] = cached

    @T.prim_func
    def ntk_cuda(TD: sig["TD"], ST: sig["ST"], STAMP: sig["STAMP"], P: sig["P"], B: T.int32, S: T.int32,
                 psb: T.int64, pss: T.int64, limit: T.int64, seq: T.int64, base_bits: T.int64, factor_bits: T.int64,
                 mpe_bits: T.int64, power_bits: T.int64):
        with T.Kernel(spec.blocks, threads=threads) as bx:
            tx = T.get_thread_binding()
            if spec.positions is None:  # decided here, while the function is built: one body or the other
                rebuild(TD, ST, STAMP, T.cast(seq, "float64"), base_bits, factor_bits, mpe_bits, power_bits, True,
                        bx, tx)
            else:
                # static shared memory: the lean build (tileops.compile.cuda_build) takes no dynamic shared memory
                top = T.alloc_shared((threads,), "int64", scope="shared")
                bad = T.alloc_shared((threads,), "int32", scope="shared")
                mine = T.alloc_var("int64")
                wrong = T.alloc_var("int32")
                mine = -1
                wrong = 0
                # every block reduces all positions (64 KB of int64 for 8k tokens, from L2 after the first
                # block): cheaper than a second launch or a grid-wide barrier. Rows by (b, s), no 64-bit
                # division per position.
                for b in T.serial(B):
                    for r in T.serial(T.ceildiv(S - tx, threads)):
                        p = T.cast(P[T.cast(b, "int64") * psb + T.cast(tx + r * threads, "int64") * pss], "int64")
                        mine = T.max(mine, p)
                        if p < 0 or p >= limit:
                            wrong = 1
                top[tx] = mine
                bad[tx] = wrong
                T.sync_threads()
                for lvl in T.unroll(levels):
                    step = T.shift_right(threads, lvl + 1)
                    if tx < step:
                        top[tx] = T.max(top[tx], top[tx + step])
                        bad[tx] = T.max(bad[tx], bad[tx + step])
                    T.sync_threads()
                rebuild(TD, ST, STAMP, T.cast(top[0] + 1, "float64"), base_bits, factor_bits, mpe_bits, power_bits,
                        bad[0] == 0, bx, tx)
    return ntk_cuda


Spec = NTKKernelSpec
