"""Paged decode attention: one query token a sequence against its keys and values in a paged KV cache,
the cache ``kernels/prologue.py`` writes, as two tile programs (split-KV, then the merge).

A sequence ``b`` holds ``L = seq_lens[b]`` tokens, the current one included; token ``j`` lies in cache
block ``BT[b, j // block_size]`` at row ``j % block_size``, element ``(block, row, kv head, d)`` at
``block * csb + row * csr + head * csh + d`` (strides in elements: NHD ``[num_blocks, block_size, Hkv,
D]`` and HND ``[num_blocks, Hkv, block_size, D]`` are both just strides). The query is ``q[b, h]``
(``[batch, Hq, D]``), q head ``h`` reading kv head ``h // (Hq / Hkv)``. With a sliding window ``w``
the token sees keys ``j >= L - w`` only (the current token is ``L - 1``: causal, bottom-right, as
``AttnFwdOp`` aligns it); ``softcap`` and the scale are ``AttnFwdOp``'s. A float8 cache
(``cache_dtype`` ``float8_e4m3fn``, stored as ``uint8`` bits: :mod:`tileops.kernels.float8`) holds
``x / scale``: an element reads as ``e4m3(bits) * KS[0]`` (``VS[0]`` for values).

``kind``:

* ``partial``: a program per (split, kv head, sequence) walks its split's tokens, ``[s * chunk,
  (s + 1) * chunk)`` of the visible ones, once, and every key it loads serves the ``G = Hq / Hkv``
  q heads of the kv head's group (GQA). It writes, per q head and split, the normalised partial output
  ``OP[b, h, s, :]`` (fp32) and its base-2 log-sum-exp ``LP[b, h, s]`` (``-inf`` for a split that saw
  no key): the workspaces of the plan.
* ``merge``: a program per (q head, sequence) combines the splits: ``out = sum_s 2^(LP_s - M) OP_s /
  sum_s 2^(LP_s - M)``, ``M = max_s LP_s``; zeros for a sequence of no visible key.

Checks on the device, reported with their index (:mod:`tileops.kernels.report`): word
:data:`LENS_WORD` ``seq_lens`` (outside ``[0, max_blocks * block_size]``: the sequence is read clamped
into its table), word :data:`TABLES_WORD` ``block_tables`` (an entry a split reads outside ``[0,
num_blocks)``: its keys are skipped, nothing is read out of bounds). A length is judged first: a bad
one makes the split read table entries past the sequence (its padding), whose report would name the
symptom and not the cause. The offset reported is the element's from the tensor's pointer (``b *
btb + i`` for a block-table entry, ``b`` for a length).

Schedules: ``c`` (TileLang's C backend, one program at a time, the CPU's correctness path, which CI
runs) and ``cuda`` (:func:`_partial_cuda`, :func:`_merge_cuda`: CUDA cores, 16-byte vectors, lane
groups a token, xor-shuffle sums, the groups merged through shared memory; strides in vectors). The
CUDA one's generated source runs on the CPU in the tests (``tests/cuda_on_cpu.py``), so CI checks its
indexing, shuffles and barriers too. Both take the scale and softcap as their fp32 bits (int32), one
kind of scalar on every launcher.
"""

from dataclasses import dataclass
from typing import Any

from .report import ENTRY, report
from .storage import load_f32, storage_dtype, to_storage

#: the error words of the two checked inputs (the runtime judges the lower word first)
LENS_WORD, TABLES_WORD = 0, 1

#: the CUDA schedule takes norm's lane helpers (``CUDA_HELPERS``): an edit there re-keys these kernels
USES = ("norm",)

#: ``tilelang.language``, imported when a kernel is first built
T: Any = None

__all__ = ["PagedDecodeSpec", "Spec", "build", "STATIC", "USES", "PARTIAL_ARGS", "MERGE_ARGS", "CACHE_DTYPES",
           "LENS_WORD", "TABLES_WORD", "cuda_problem", "vector"]

#: the CUDA schedule's choices a manifest's ``kernel.static`` may set (the C schedule has none)
STATIC = {
    "threads": (64, 512, "threads a program of the CUDA partial and merge (64, 128, 256 or 512)"),
    "unroll": (1, 8, "tokens a lane group loads before it waits on any (CUDA)"),
    "prefetch": (0, 1, "1: each step's loads issued while the step before computes (CUDA cores: measured slower, "
                       "its registers cost the SM a program; mma: the next tile's pages and rows, not yet measured)"),
    "stages": (0, 4, "steps whose keys and values are copied ahead into shared memory by cp.async, no register "
                     "holding them in flight (CUDA; 0: loaded into registers a step at a time)"),
    "mma": (0, 1, "1: the group's q heads as the rows of tensor-core products over tiles of tokens (CUDA, 16-bit "
                  "q; unroll, prefetch and stages then do not apply)"),
    "tile": (16, 128, "tokens a tile of the mma schedule (16, 32, 64 or 128)"),
    "widen": (0, 1, "1: a float8 cache's elements widened eight at a time into one 16-byte shared store by the "
                    "e4m3x2 -> f16x2 conversion, the products in fp16 (bf16 q: each head's row rescaled into fp16 "
                    "by a power of two); 0: one at a time through fp16 and fp32 into q's dtype (mma with a float8 "
                    "cache; fp16 products: 1.43x the bf16 bit moves, H100, 2026-12-06)"),
    "min_blocks": (1, 8, "programs an SM must hold at once, asked of nvcc (__launch_bounds__) for the tensor-core "
                         "partial: it caps the registers a thread at 65536 / (min_blocks * threads) (CUDA)"),
}

#: the caches' element types: the query's, or float8 e4m3fn with per-tensor scales
CACHE_DTYPES = ("float16", "bfloat16", "float32", "float8_e4m3fn")

#: the partial program's parameters, in order (the launcher binds by name)
PARTIAL_ARGS = ("Q", "KC", "VC", "BT", "SL", "KS", "VS", "OP", "LP", "O", "ERR", "tag", "batch", "splits", "chunk",
                "nblocks", "bs", "max_blocks", "btb", "qsb", "qsh", "csb", "csr", "csh", "scale_bits", "softcap_bits",
                "window", "osb", "osh", "direct")
#: the merge program's parameters
MERGE_ARGS = ("OP", "LP", "O", "batch", "splits", "osb", "osh")

_LOG2E = 1.4426950408889634
#: mma: the rows of a tensor-core product (mma.sync's m16): a program's q heads, padded with zero rows
MMA_ROWS = 16


@dataclass(frozen=True)
class PagedDecodeSpec:
    """Everything one paged-decode program is compiled for; two equal specs share one compiled kernel."""

    dtype: str  # q and out: float16 | bfloat16 | float32
    cache_dtype: str  # :data:`CACHE_DTYPES`: dtype, or float8_e4m3fn
    head_dim: int
    hq: int
    hkv: int
    backend: str = "c"
    kind: str = "partial"  # partial | merge
    window: bool = False  # a sliding window (its width is the ``window`` argument)
    softcap: bool = False  # c * tanh(s / c) (c is the ``softcap`` argument)
    # CUDA schedule (ignored by the C one): threads a block, and tokens each lane group keeps in flight
    threads: int = 128
    unroll: int = 2
    prefetch: int = 0  # 1: a step's loads issued while the step before it computes
    stages: int = 0  # S >= 1: steps it+1..it+S copied global -> shared by cp.async while step it computes
    mma: int = 0  # 1: tensor-core products, the group's heads as rows (:func:`_partial_mma`)
    tile: int = 64  # mma: tokens a tile
    widen: int = 0  # mma, float8 cache: 1 widens eight elements at once (:data:`E4M3X8_HELPER`)
    min_blocks: int = 1  # mma partial: programs an SM asked of nvcc (``__launch_bounds__(threads, min_blocks)``)

    def __post_init__(self) -> None:
        if self.dtype not in ("float16", "bfloat16", "float32"):
            raise ValueError(f"dtype: expected float16, bfloat16 or float32, got {self.dtype!r}")
        if self.cache_dtype not in (self.dtype, "float8_e4m3fn"):
            raise ValueError(f"cache_dtype: expected the query's dtype {self.dtype!r} or 'float8_e4m3fn', "
                             f"got {self.cache_dtype!r}")
        if self.backend not in ("c", "cuda"):
            raise ValueError(f"backend: expected 'c' or 'cuda', got {self.backend!r}")
        if self.kind not in ("partial", "merge"):
            raise ValueError(f"kind: expected 'partial' or 'merge', got {self.kind!r}")
        if type(self.unroll) is not int or not 1 <= self.unroll <= 8:
            raise ValueError(f"unroll: expected an int in [1, 8], got {self.unroll!r}")
        for name in ("head_dim", "hq", "hkv"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
        if self.hq % self.hkv:
            raise ValueError(f"hq: expected a multiple of hkv={self.hkv}, got {self.hq}")
        if self.prefetch not in (0, 1):
            raise ValueError(f"prefetch: expected 0 or 1, got {self.prefetch!r}")
        if type(self.stages) is not int or not 0 <= self.stages <= 4:
            raise ValueError(f"stages: expected an int in [0, 4], got {self.stages!r}")
        if self.stages and self.prefetch:
            raise ValueError(f"stages: the copies ahead replace prefetch's register loads; expected prefetch=0 with "
                             f"stages={self.stages}, got prefetch={self.prefetch}")
        if self.threads not in (64, 128, 256, 512):
            raise ValueError(f"threads: expected 64, 128, 256 or 512, got {self.threads!r}")
        if self.mma not in (0, 1):
            raise ValueError(f"mma: expected 0 or 1, got {self.mma!r}")
        if self.tile not in (16, 32, 64, 128):
            raise ValueError(f"tile: expected 16, 32, 64 or 128, got {self.tile!r}")
        if self.mma and self.tile < 8 * (self.threads // 32):
            raise ValueError(f"tile: the tensor-core products split a tile's tokens over the warps, at least 8 "
                             f"(mma's n8) a warp: expected tile >= {8 * (self.threads // 32)} at threads="
                             f"{self.threads}, got {self.tile}")
        if self.mma and (self.threads, self.tile) == (256, 128):
            raise ValueError("tile: TileLang 0.1.15 cannot lower the score tile's row reduction at threads=256 "
                             "with tile=128 (16 tokens a warp over 8 warps; seen lowering it): expected tile 64 "
                             "at 256 threads, or 128 at 128 or 512")
        if self.widen not in (0, 1):
            raise ValueError(f"widen: expected 0 or 1, got {self.widen!r}")
        if self.widen and not (self.mma and self.fp8 and self.kind == "partial"):
            raise ValueError(f"widen: the tensor-core partial's float8 widening; expected widen=0 with mma={self.mma}, "
                             f"kind {self.kind!r} and cache_dtype {self.cache_dtype!r}")
        if type(self.min_blocks) is not int or not 1 <= self.min_blocks <= 8:
            raise ValueError(f"min_blocks: expected an int in [1, 8], got {self.min_blocks!r}")
        if self.min_blocks != 1 and not (self.mma and self.kind == "partial"):
            raise ValueError(f"min_blocks: the tensor-core partial's programs an SM; expected min_blocks=1 with "
                             f"mma={self.mma} and kind {self.kind!r}, got {self.min_blocks}")
        if self.mma and self.dtype == "float32":
            raise ValueError("mma: the tensor-core products take 16-bit operands; expected dtype float16 or "
                             "bfloat16 with mma=1, got float32 (mma=0 reads fp32)")
        if self.backend == "cuda":
            problem = cuda_problem(self.dtype, self.cache_dtype, self.head_dim)
            if problem:
                raise ValueError(problem)

    @property
    def fp8(self) -> bool:
        return self.cache_dtype == "float8_e4m3fn"

    @property
    def products(self) -> str:
        """The tensor-core products' operand type: q's, but fp16 for a widened float8 cache (its elements
        reach fp16 by one conversion instruction a pair, bf16 only by bit moves that made the program
        ALU-bound; :func:`_partial_mma` rescales a bf16 q row into fp16)."""
        return "float16" if self.widen else self.dtype

    @property
    def args(self) -> tuple[str, ...]:
        return PARTIAL_ARGS if self.kind == "partial" else MERGE_ARGS

    @property
    def vec(self) -> int:
        """CUDA: elements a lane moves at once (:func:`vector`): of a cache row (``partial``, which reads
        q so too) or of an output row (``merge``); the unit its strides are passed in (``stride_unit``)."""
        return vector(self.cache_dtype if self.kind == "partial" else self.dtype)

    @property
    def stride_unit(self) -> int:
        return self.vec if self.backend == "cuda" else 1

    @property
    def group(self) -> int:
        """q heads a kv head serves (GQA)."""
        return self.hq // self.hkv

    @property
    def heads_per_block(self) -> int:
        """CUDA: the q heads of one kv head a partial program serves: all of the group where it has at
        most 8 (every key and value loaded serves each), else the largest divisor of the group <= 8 (its
        registers hold a q row and an output row per head; a group of 16 or 32, MQA, reads each kv row
        once per 8 heads, the rereads from L2). With ``mma`` up to :data:`MMA_ROWS`, the rows of its
        products."""
        most = MMA_ROWS if self.mma and self.kind == "partial" else 8
        return max(h for h in range(1, most + 1) if self.group % h == 0)

    @property
    def lanes(self) -> int:
        """CUDA: lanes that hold one row, a token's (``partial``) or an output's (``merge``): a power of
        two, its spare lanes idle."""
        return 1 << (self.head_dim // self.vec - 1).bit_length()


Spec = PagedDecodeSpec


def _tl() -> Any:
    global T
    if T is None:
        import tilelang.language as tl

        T = tl
    return T


def vector(dtype: str) -> int:
    """CUDA: the elements of ``dtype`` a lane moves at once: 8 (16 bytes of a 16-bit type, 8 of float8),
    4 of fp32."""
    return 4 if dtype == "float32" else 8


def cuda_problem(dtype: str, cache_dtype: str, head_dim: int) -> str | None:
    """Why the CUDA schedule cannot serve these (None if it can): a cache row is read in vectors
    (:func:`vector`) by at most a warp's 32 lanes."""
    vec = vector(cache_dtype)
    if head_dim % vec or head_dim // vec > 32:
        return (f"head_dim: the CUDA paged decode reads a row as vectors of {vec} elements, one a lane of a "
                f"warp: expected a multiple of {vec} up to {32 * vec}, got {head_dim}")
    return None


def build(spec: PagedDecodeSpec):
    """The ``T.prim_func`` for ``spec``; its parameters are ``spec.args`` (then the dynamic extents)."""
    _tl()
    if spec.backend == "cuda":
        if spec.kind == "merge":
            return _merge_cuda(spec)
        return _partial_mma(spec) if spec.mma else _partial_cuda(spec)
    return _partial(spec) if spec.kind == "partial" else _merge(spec)


def e4m3_f32(bits):
    """The fp32 value of float8 e4m3fn ``bits`` (a uint8 expression): ``(8 + m) * 2^(e - 10)`` for a
    normal (exponent field ``e`` 1-15), ``m * 2^-9`` for a subnormal; ``e = 15, m = 7`` is NaN (e4m3fn
    has no infinity). Exact: every e4m3 value is an fp32 one; the power of two is built from its bits."""
    b = T.cast(bits, "int32")
    e = (b >> 3) & 15
    m = b & 7
    two = T.reinterpret(T.cast((T.max(e, 1) + 117) << 23, "int32"), "float32")  # 2^(max(e, 1) - 10)
    mag = T.cast(T.if_then_else(e == 0, m, m + 8), "float32") * two
    # NaN with the pattern's sign, from its bits (an expression: TileLang's C backend cannot take the
    # address of a constant it reinterprets)
    nan = T.reinterpret((T.cast(b & 128, "uint32") << T.uint32(24)) | T.uint32(0x7FC00000), "float32")
    val = T.if_then_else((b & 128) != 0, -mag, mag)
    return T.if_then_else(T.And(e == 15, m == 7), nan, val)


def _load(spec: PagedDecodeSpec, buf, idx, st: str, scale):
    """A cache element as fp32 (dequantised with ``scale`` from a float8 cache)."""
    if spec.fp8:
        return e4m3_f32(buf[idx]) * scale
    return load_f32(buf, idx, st, spec.dtype)


def _partial_buffers(st: str, cst: str) -> dict:
    """The partial program's buffer parameters, both schedules (flat, dynamic extents). ``O`` is the
    call's output, which a call of one split writes directly (``direct``; no merge): a split's own
    normalised output is the merged one then, to the bit."""
    NQ, NC, NBT, NS, NO, NL, NOUT = T.dynamic("NQ, NC, NBT, NS, NO, NL, NOUT")
    return dict(Q=T.Tensor((NQ,), st), KC=T.Tensor((NC,), cst), VC=T.Tensor((NC,), cst), BT=T.Tensor((NBT,), "int32"),
                SL=T.Tensor((NS,), "int32"), KS=T.Tensor((1,), "float32"), VS=T.Tensor((1,), "float32"),
                OP=T.Tensor((NO,), "float32"), LP=T.Tensor((NL,), "float32"), O=T.Tensor((NOUT,), st),
                ERR=T.Tensor((ENTRY,), "int32"))


def _partial(spec: PagedDecodeSpec):
    D, HQ, HKV, G = spec.head_dim, spec.hq, spec.hkv, spec.group
    st = storage_dtype(spec.dtype, spec.backend)
    cst = "uint8" if spec.fp8 else st
    rep = report(spec.backend)
    sig = _partial_buffers(st, cst)

    @T.prim_func
    def paged_decode_partial(Q: sig["Q"], KC: sig["KC"], VC: sig["VC"], BT: sig["BT"], SL: sig["SL"], KS: sig["KS"],
                             VS: sig["VS"], OP: sig["OP"], LP: sig["LP"], O: sig["O"], ERR: sig["ERR"], tag: T.int32,
                             batch: T.int32, splits: T.int32, chunk: T.int32, nblocks: T.int32, bs: T.int32,
                             max_blocks: T.int32, btb: T.int64,
                             qsb: T.int64, qsh: T.int64, csb: T.int64, csr: T.int64, csh: T.int64,
                             scale_bits: T.int32, softcap_bits: T.int32, window: T.int32,
                             osb: T.int64, osh: T.int64, direct: T.int32):
        with T.Kernel(splits, HKV, batch, threads=1) as (s, kvh, b):
            scale = T.reinterpret(scale_bits, "float32")
            softcap = T.reinterpret(softcap_bits, "float32")
            qv = T.alloc_local((G * D,), "float32")
            acc = T.alloc_local((G * D,), "float32")
            kv = T.alloc_local((2 * D,), "float32")  # the key's row, then the value's
            m = T.alloc_local((G,), "float32")  # running max of the base-2 logits
            l = T.alloc_local((G,), "float32")  # running sum  # noqa: E741
            sc = T.alloc_local((2,), "float32")  # a logit, its rescale
            rng = T.alloc_local((4,), "int32")  # L, lo, t0, t1
            ks = T.float32(1)
            vs = T.float32(1)
            if spec.fp8:
                ks = KS[0]
                vs = VS[0]
            # the sequence's length, clamped into its table (a bad one reported once: split 0, kv head 0)
            rng[0] = T.max(T.min(SL[b], max_blocks * bs), 0)
            if s == 0 and kvh == 0:
                if SL[b] < 0 or SL[b] > max_blocks * bs:
                    rep(ERR, LENS_WORD, tag, b, SL[b])
            rng[1] = 0
            if spec.window:
                rng[1] = T.max(rng[0] - window, 0)
            rng[2] = T.max(rng[1], s * chunk)
            rng[3] = T.min(rng[0], s * chunk + chunk)
            for g in T.serial(G):
                qo = T.cast(b, "int64") * qsb + T.cast(kvh * G + g, "int64") * qsh
                for d in T.serial(D):
                    qv[g * D + d] = load_f32(Q, qo + d, st, spec.dtype)
                    acc[g * D + d] = T.float32(0)
                m[g] = -T.infinity("float32")
                l[g] = T.float32(0)
            for j in T.serial(rng[2], T.max(rng[3], rng[2])):
                at = T.cast(b, "int64") * btb + T.cast(j // bs, "int64")
                page = BT[at]
                if page < 0 or page >= nblocks:
                    if kvh == 0:
                        rep(ERR, TABLES_WORD, tag, at, page)
                else:
                    base = T.cast(page, "int64") * csb + T.cast(j % bs, "int64") * csr + T.cast(kvh, "int64") * csh
                    for d in T.serial(D):  # one load of the key and value rows serves the group's G heads
                        kv[d] = _load(spec, KC, base + d, cst, ks)
                        kv[D + d] = _load(spec, VC, base + d, cst, vs)
                    for g in T.serial(G):
                        sc[0] = T.float32(0)
                        for d in T.serial(D):
                            sc[0] = sc[0] + qv[g * D + d] * kv[d]
                        if spec.softcap:
                            sc[0] = softcap * T.tanh(sc[0] * scale / softcap) * T.float32(_LOG2E)
                        else:
                            sc[0] = sc[0] * (scale * T.float32(_LOG2E))
                        # online softmax: m' = max(m, s); the sum and the output rescaled by 2^(m - m').
                        # A score of -inf weighs 0: as a head's first key, 2^(s - m') was 2^(-inf + inf),
                        # NaN (a NaN score still gives NaN)
                        sc[1] = T.if_then_else(sc[0] > m[g], T.exp2(m[g] - sc[0]), T.float32(1))
                        m[g] = T.max(m[g], sc[0])
                        p = T.if_then_else(sc[0] == -T.infinity("float32"), T.float32(0), T.exp2(sc[0] - m[g]))
                        l[g] = l[g] * sc[1] + p
                        for d in T.serial(D):
                            acc[g * D + d] = acc[g * D + d] * sc[1] + p * kv[D + d]
            # l != 0, not l > 0: only a head that saw no key (l exactly 0) outputs zeros; a NaN in q or the
            # caches makes l or acc NaN and the head NaN (its log-sum-exp too, which the merge then spreads),
            # as torch's attention gives, never a plausible zero
            for g in T.serial(G):
                if direct != 0:  # one split: its normalised output is the call's (what the merge would give)
                    oo = T.cast(b, "int64") * osb + T.cast(kvh * G + g, "int64") * osh
                    for d in T.serial(D):
                        O[oo + d] = to_storage(T.if_then_else(l[g] != 0, acc[g * D + d] / l[g], T.float32(0)), st,
                                               spec.dtype)
                else:
                    row = (T.cast(b, "int64") * HQ + T.cast(kvh * G + g, "int64")) * T.cast(splits, "int64") + s
                    for d in T.serial(D):
                        OP[row * D + d] = T.if_then_else(l[g] != 0, acc[g * D + d] / l[g], T.float32(0))
                    LP[row] = T.if_then_else(l[g] != 0, m[g] + T.log2(l[g]), -T.infinity("float32"))

    return paged_decode_partial


def _merge(spec: PagedDecodeSpec):
    D, HQ = spec.head_dim, spec.hq
    st = storage_dtype(spec.dtype, spec.backend)
    NO, NL, NOUT = T.dynamic("NO, NL, NOUT")

    @T.prim_func
    def paged_decode_merge(OP: T.Tensor((NO,), "float32"), LP: T.Tensor((NL,), "float32"),
                           O: T.Tensor((NOUT,), st), batch: T.int32, splits: T.int32, osb: T.int64, osh: T.int64):
        with T.Kernel(HQ, batch, threads=1) as (h, b):
            acc = T.alloc_local((D,), "float32")
            w = T.alloc_local((3,), "float32")  # max, sum of weights, a weight
            row = (T.cast(b, "int64") * HQ + T.cast(h, "int64")) * T.cast(splits, "int64")
            w[0] = -T.infinity("float32")
            for s in T.serial(splits):
                w[0] = _nan_max(w[0], LP[row + s])
            w[1] = T.float32(0)
            for d in T.serial(D):
                acc[d] = T.float32(0)
            if w[0] != -T.infinity("float32"):  # (a NaN split: its weight NaN, and the output)
                for s in T.serial(splits):
                    w[2] = T.exp2(LP[row + s] - w[0])  # 0 for a split that saw no key
                    w[1] = w[1] + w[2]
                    for d in T.serial(D):
                        acc[d] = acc[d] + w[2] * OP[(row + s) * D + d]
            oo = T.cast(b, "int64") * osb + T.cast(h, "int64") * osh
            for d in T.serial(D):
                O[oo + d] = to_storage(T.if_then_else(w[1] != 0, acc[d] / w[1], T.float32(0)), st, spec.dtype)

    return paged_decode_merge


# ------------------------------------------------------------------------------ CUDA schedule
# A decode step reads every key and value of the cache once and does 2 * G flops a cached element:
# memory-bound at any batch, so CUDA cores, no tensor cores (FlashInfer's and vLLM's decode kernels
# read it the same way). What the schedule must get right is the bytes in flight: a lane loads a
# vector of a key row and of a value row for each of ``unroll`` tokens before it waits on any of them.


def _cuda_helpers(copies: bool = False) -> str:
    """norm's lane helpers, the report's, and with ``copies`` norm's ``cp.async`` ones."""
    from .norm import ASYNC_HELPER, CUDA_HELPERS
    from .report import CUDA_SOURCE

    return CUDA_HELPERS + CUDA_SOURCE + (ASYNC_HELPER if copies else "")


#: CUDA (sm_89 and later: the tensor-core schedule's float8 cache): an e4m3fn byte's value, by the
#: hardware's conversion to fp16 (``cvt.rn.f16x2.e4m3x2``; exact, every e4m3 value is an fp16 one, NaN
#: kept). :func:`e4m3_f32`'s ~12 integer operations an element made the float8 rows ALU-bound (9-10% of
#: their copy on the H200, ``benchmarks/NOTES.md``); the C schedule and the CUDA cores' keep it (the CPU
#: harness runs their source).
E4M3_HELPER = r"""
#include <cuda_fp8.h>
__device__ __forceinline__ float tileops_e4m3_f32(unsigned char bits) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(bits, __NV_E4M3)));
}
"""

#: CUDA (sm_89 and later; the tensor-core partial with ``widen``): eight float8 e4m3fn bytes of a cache row
#: (``in``, 8 bytes) as eight fp16 (``out``, 16 bytes), or eight zeros where ``ok`` is 0 (a token not read),
#: by the hardware's ``cvt.rn.f16x2.e4m3x2``, two elements an instruction (exact: e4m3's values are fp16
#: values; NaN kept). The products are then fp16 whatever q's dtype (:attr:`PagedDecodeSpec.products`): a
#: bf16 widening by bit moves (each byte into a half's high byte, shifted to bf16's exponent, one
#: ``fma.rn.bf16x2`` by 2^120, NaN set apart) cost ~15 integer operations a 4 bytes, and left the program
#: ALU-bound (Nsight Compute, H100, 64 x 4096: ALU pipe 59% of peak, 166 M instructions against bf16's
#: 71 M for twice the bytes; long-scoreboard stalls 4% of samples). The ``#else`` model is for
#: ``tests/cuda_on_cpu.py``, which runs it on the CPU (plain C++: nvcc's host pass parses it too).
E4M3X8_HELPER = r"""
__device__ __forceinline__ unsigned tileops_e4m3x2_f16x2(unsigned pair) {
#ifdef __CUDA_ARCH__
  unsigned d;
  asm("{\n .reg .b16 p;\n cvt.u16.u32 p, %1;\n cvt.rn.f16x2.e4m3x2 %0, p;\n}" : "=r"(d) : "r"(pair));
  return d;
#else
  unsigned d = 0;
  for (int k = 0; k < 2; ++k) {
    unsigned b = (pair >> (8 * k)) & 0xFFu, e = (b >> 3) & 15u, m = b & 7u, h = 0;
    if (e == 15 && m == 7) {
      h = 0x7E00u;  // NaN
    } else if (e) {
      h = ((e + 8) << 10) | (m << 7);  // a normal: exponent bias 7 -> 15
    } else if (m) {  // a subnormal m * 2^-9 = 2^(top - 9) * (m / 2^top): an fp16 normal
      unsigned top = m >= 4 ? 2 : m >= 2 ? 1 : 0;
      h = ((top + 6) << 10) | ((m << (10 - top)) & 0x3FFu);
    }
    d |= (h | ((b & 0x80u) << 8)) << (16 * k);
  }
  return d;
#endif
}
__device__ __forceinline__ void tileops_e4m3x8_f16(void* out, const void* in, int ok) {
  const unsigned* w = (const unsigned*)in;
  unsigned* r = (unsigned*)out;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    unsigned x = ok ? w[i] : 0u;
    r[2 * i] = tileops_e4m3x2_f16x2(x & 0xFFFFu);
    r[2 * i + 1] = tileops_e4m3x2_f16x2(x >> 16);
  }
}
"""
#: the widening function of :data:`E4M3X8_HELPER`
WIDEN_FUNCTION = "tileops_e4m3x8_f16"


def _program_setup(spec: PagedDecodeSpec):
    """The CUDA partial programs' common start, a macro: ``sc[0]``, ``sc[1]`` the key and value scales
    (1, or a float8 cache's), ``rng[0]``, ``rng[1]`` the split's visible tokens ``[t0, t1)``: its share
    of the sequence's, the length clamped into its table and reported when bad by the sequence's
    ``first`` program's first thread (word :data:`LENS_WORD`), a window's keys from ``L - window``."""
    rep = report("cuda")

    @T.macro
    def setup(SL, KS, VS, ERR, tag, sc, rng, b, s, first, chunk, max_blocks, bs, window):
        sc[0] = T.float32(1)
        sc[1] = T.float32(1)
        if spec.fp8:
            sc[0] = KS[0]
            sc[1] = VS[0]
        L = T.alloc_var("int32")
        L = T.max(T.min(SL[b], max_blocks * bs), 0)
        if first:
            if SL[b] < 0 or SL[b] > max_blocks * bs:
                rep(ERR, LENS_WORD, tag, b, SL[b])
        lo = T.alloc_var("int32")
        lo = 0
        if spec.window:
            lo = T.max(L - window, 0)
        rng[0] = T.max(lo, s * chunk)
        rng[1] = T.min(L, s * chunk + chunk)

    return setup


def _partial_cuda(spec: PagedDecodeSpec):
    """A program per (sequence, kv head, head chunk, split), 1-D grid (split fastest). The block's
    threads form lane groups of :attr:`~PagedDecodeSpec.lanes` lanes; group ``g`` takes tokens ``j0 +
    u * NG + g`` of each step of ``NG * U`` tokens (neighbouring groups read neighbouring rows of one
    page), each lane a vector of the row. Per token and head, the lanes' partial dot products are summed
    by ``log2(lanes)`` xor-shuffles; the group keeps an online softmax (max, sum, output vector) per head,
    rescaled once a step. At the end the groups' states are merged through shared memory into the
    split's normalised output and base-2 log-sum-exp. Strides are in units of ``vec`` elements."""
    D, HQ, HKV, G = spec.head_dim, spec.hq, spec.hkv, spec.group
    GH, VEC, LG, TPB, U = spec.heads_per_block, spec.vec, spec.lanes, spec.threads, spec.unroll
    NV = D // VEC  # lanes of a group that hold a vector
    OV = vector(spec.dtype)  # out's vector, the unit of its strides (a call of one split writes it: direct)
    NG = TPB // LG  # lane groups a block
    NHC = G // GH  # head chunks a kv head
    st = storage_dtype(spec.dtype, "cuda")
    cst = "uint8" if spec.fp8 else st
    S = spec.stages
    rep = report("cuda")
    helpers = _cuda_helpers(copies=bool(S))
    setup = _program_setup(spec)
    sig = _partial_buffers(st, cst)
    vb_bytes = VEC * (1 if spec.fp8 else 2 if st != "float32" else 4)  # a lane's vector of a cache row
    ninf = _neg_inf()

    def row_at(page, row, kvh, csb, csr, csh, lane):
        """A lane's vector of cache row ``(page, row, kvh)``, in elements (strides in vectors)."""
        return ((T.cast(page, "int64") * csb + T.cast(row, "int64") * csr + T.cast(kvh, "int64") * csh) * VEC
                + T.cast(lane * VEC, "int64"))

    @T.macro
    def fetch_step(BT, KC, VC, ERR, kd, vd, okd, it, t0, t1, b, kvh, hc, tx, lane, grp, vl, btb, bs, nblocks, csb, csr,
                   csh, tag):
        """Step ``it``'s tokens ``t0 + it * NG * U + u * NG + grp``: their pages checked (a bad one reported,
        its token skipped, flag 0), their key and value vectors fetched (zeros where not read).

        Without ``stages``, loaded into the registers ``kd``/``vd`` (flags ``okd``). With them, copied by
        ``cp.async`` into shared slot ``it % (S + 1)`` of ``kd``/``vd``/``okd``: the slot of step ``it - 1``,
        whose values this thread read back the step before, so no copy lands on a slot still to be read.
        Each thread copies its own vectors and reads back only those (no barrier); a token not read is
        zeroed there, so stale bytes (NaN, maybe) never meet its weight of 0. One commit group a step,
        empty past the sequence, so that every thread counts its groups alike."""
        div, mod = T.truncdiv, T.truncmod
        for u in T.unroll(U):
            j = t0 + it * (NG * U) + u * NG + grp
            at = T.cast(b, "int64") * btb + T.cast(div(j, bs), "int64")
            page = T.alloc_var("int32")
            page = 0
            if j < t1:
                page = BT[at]
            good = j < t1 and page >= 0 and page < nblocks
            if j < t1 and (page < 0 or page >= nblocks) and kvh == 0 and hc == 0 and lane == 0:
                rep(ERR, TABLES_WORD, tag, at, page)
            if S:
                e = ((mod(it, S + 1) * U + u) * TPB + tx) * VEC
                okd[(mod(it, S + 1) * U + u) * TPB + tx] = T.if_then_else(good, 1, 0)
                if good and vl:
                    T.call_extern("handle", f"tileops_cp_async<{vb_bytes}>", T.address_of(kd[e]),
                                  T.address_of(KC[row_at(page, mod(j, bs), kvh, csb, csr, csh, lane)]))
                    T.call_extern("handle", f"tileops_cp_async<{vb_bytes}>", T.address_of(vd[e]),
                                  T.address_of(VC[row_at(page, mod(j, bs), kvh, csb, csr, csh, lane)]))
                elif vl:
                    for v in T.unroll(VEC):
                        kd[e + v] = T.cast(0, cst)
                        vd[e + v] = T.cast(0, cst)
            else:
                okd[u] = T.if_then_else(good, 1, 0)
                if good and vl:
                    # (an expression, not a variable: a bound variable hides its multiple of VEC from the
                    # vectoriser, which then loads element by element)
                    for v in T.vectorized(VEC):
                        kd[u * VEC + v] = KC[row_at(page, mod(j, bs), kvh, csb, csr, csh, lane) + v]
                    for v in T.vectorized(VEC):
                        vd[u * VEC + v] = VC[row_at(page, mod(j, bs), kvh, csb, csr, csh, lane) + v]
                else:
                    for v in T.unroll(VEC):
                        kd[u * VEC + v] = T.cast(0, cst)
                        vd[u * VEC + v] = T.cast(0, cst)
        if S:
            T.call_extern("handle", "tileops_cp_async_commit")

    @T.prim_func
    def paged_decode_partial_cuda(Q: sig["Q"], KC: sig["KC"], VC: sig["VC"], BT: sig["BT"], SL: sig["SL"],
                                  KS: sig["KS"], VS: sig["VS"], OP: sig["OP"], LP: sig["LP"], O: sig["O"], ERR: sig["ERR"],
                                  tag: T.int32, batch: T.int32, splits: T.int32,
                                  chunk: T.int32, nblocks: T.int32, bs: T.int32, max_blocks: T.int32, btb: T.int64,
                                  qsb: T.int64, qsh: T.int64, csb: T.int64, csr: T.int64, csh: T.int64,
                                  scale_bits: T.int32, softcap_bits: T.int32, window: T.int32,
                             osb: T.int64, osh: T.int64, direct: T.int32):
        with T.Kernel(splits * (HKV * NHC) * batch, threads=TPB) as bx:
            T.import_source(helpers)
            tx = T.get_thread_binding()
            div, mod = T.truncdiv, T.truncmod  # every operand >= 0: no floor-division sign fixes
            s = mod(bx, splits)
            hc = mod(div(bx, splits), NHC)
            kvh = mod(div(bx, splits * NHC), HKV)
            b = div(bx, splits * NHC * HKV)
            lane = tx % LG
            grp = tx // LG
            vl = lane < NV
            scale = T.reinterpret(scale_bits, "float32")
            softcap = T.reinterpret(softcap_bits, "float32")
            qv = T.alloc_local((GH * VEC,), "float32")
            acc = T.alloc_local((GH * VEC,), "float32")
            qb = T.alloc_local((VEC,), st)
            kb = T.alloc_local((U * VEC,), cst)
            vb = T.alloc_local((U * VEC,), cst)
            kf = T.alloc_local((U * VEC,), "float32")
            vf = T.alloc_local((U * VEC,), "float32")
            sc = T.alloc_local((U * GH,), "float32")
            ok = T.alloc_local((U,), "int32")  # the loaded step's tokens that are read (in range, page good)
            okc = T.alloc_local((U,), "int32")  # the computed step's
            m = T.alloc_local((GH,), "float32")
            l = T.alloc_local((GH,), "float32")  # noqa: E741
            w = T.alloc_local((4,), "float32")  # a step's max, its rescale, a weight, a dot product
            SM = T.alloc_shared((NG * GH,), "float32")
            SLS = T.alloc_shared((NG * GH,), "float32")
            SACC = T.alloc_shared((NG * GH * NV * VEC,), "float32")
            if S:  # S + 1 slots of a step's vectors, every thread its own: 24 KB at 128 threads, 2 tokens, S 2
                ksh = T.alloc_shared(((S + 1) * U * TPB * VEC,), cst, scope="shared.dyn")
                vsh = T.alloc_shared(((S + 1) * U * TPB * VEC,), cst, scope="shared.dyn")
                oks = T.alloc_shared(((S + 1) * U * TPB,), "int32", scope="shared.dyn")
            scales = T.alloc_local((2,), "float32")  # the key and value scales
            rng = T.alloc_local((2,), "int32")  # the split's visible tokens [t0, t1)
            setup(SL, KS, VS, ERR, tag, scales, rng, b, s, s == 0 and kvh == 0 and hc == 0 and tx == 0, chunk,
                  max_blocks, bs, window)
            ks, vs, t0, t1 = scales[0], scales[1], rng[0], rng[1]
            # q: the chunk's heads, this lane's vector of each (scaled here when no softcap follows)
            qk = T.float32(_LOG2E) if spec.softcap else scale * T.float32(_LOG2E)
            for h in T.unroll(GH):
                qo = (T.cast(b, "int64") * qsb + T.cast(kvh * G + hc * GH + h, "int64") * qsh) * VEC
                for v in T.unroll(VEC):
                    qv[h * VEC + v] = T.float32(0)
                    acc[h * VEC + v] = T.float32(0)
                if vl:
                    for v in T.vectorized(VEC):  # a 16-byte load; widened below, element by element
                        qb[v] = Q[qo + lane * VEC + v]
                    for v in T.unroll(VEC):
                        qv[h * VEC + v] = T.cast(qb[v], "float32")
                if not spec.softcap:
                    for v in T.unroll(VEC):
                        qv[h * VEC + v] = qv[h * VEC + v] * qk
                m[h] = ninf
                l[h] = T.float32(0)
            steps = T.ceildiv(T.max(t1 - t0, 0), NG * U)
            if spec.prefetch:
                fetch_step(BT, KC, VC, ERR, kb, vb, ok, 0, t0, t1, b, kvh, hc, tx, lane, grp, vl, btb, bs, nblocks,
                           csb, csr, csh, tag)
            if S:
                for d in T.unroll(S):
                    fetch_step(BT, KC, VC, ERR, ksh, vsh, oks, d, t0, t1, b, kvh, hc, tx, lane, grp, vl, btb, bs,
                               nblocks, csb, csr, csh, tag)
            for it in T.serial(steps):
                # 1. every token's key and value vectors of the step, loaded before any is used; with
                # ``stages``, step it + S's copies started and step it's read back from its slot
                if S:
                    fetch_step(BT, KC, VC, ERR, ksh, vsh, oks, it + S, t0, t1, b, kvh, hc, tx, lane, grp, vl, btb,
                               bs, nblocks, csb, csr, csh, tag)
                    T.call_extern("handle", f"tileops_cp_async_wait<{S}>")  # step it's group is done
                    for u in T.unroll(U):
                        e = ((T.truncmod(it, S + 1) * U + u) * TPB + tx) * VEC
                        ok[u] = oks[(T.truncmod(it, S + 1) * U + u) * TPB + tx]
                        if vl:
                            for v in T.vectorized(VEC):
                                kb[u * VEC + v] = ksh[e + v]
                            for v in T.vectorized(VEC):
                                vb[u * VEC + v] = vsh[e + v]
                        else:
                            for v in T.unroll(VEC):
                                kb[u * VEC + v] = T.cast(0, cst)
                                vb[u * VEC + v] = T.cast(0, cst)
                elif not spec.prefetch:
                    fetch_step(BT, KC, VC, ERR, kb, vb, ok, it, t0, t1, b, kvh, hc, tx, lane, grp, vl, btb, bs,
                               nblocks, csb, csr, csh, tag)
                # 2. widened once for every head (a float8 element's decode is ~12 integer operations: done
                # per head, it was 4-8 times the work); with ``prefetch`` the next step's loads are issued
                # into the freed registers here, in flight while this step computes
                for u in T.unroll(U):
                    okc[u] = ok[u]
                    for v in T.unroll(VEC):
                        kf[u * VEC + v] = _kv_f32(spec, kb[u * VEC + v], ks)
                        vf[u * VEC + v] = _kv_f32(spec, vb[u * VEC + v], vs)
                if spec.prefetch:
                    fetch_step(BT, KC, VC, ERR, kb, vb, ok, it + 1, t0, t1, b, kvh, hc, tx, lane, grp, vl, btb, bs,
                               nblocks, csb, csr, csh, tag)
                # the logits, base 2: a lane's partial dot products summed over its group's lanes
                for u in T.unroll(U):
                    for h in T.unroll(GH):
                        w[3] = T.float32(0)
                        for v in T.unroll(VEC):
                            w[3] = w[3] + qv[h * VEC + v] * kf[u * VEC + v]
                        for k in T.unroll(LG.bit_length() - 1):
                            w[3] = w[3] + T.call_extern("float32", "tileops_xor_lane", w[3], 1 << k)
                        if spec.softcap:
                            w[3] = softcap * T.tanh(w[3] * scale / softcap) * T.float32(_LOG2E)
                        sc[u * GH + h] = T.if_then_else(okc[u] == 1, w[3], ninf)
                # 3. the online softmax, one rescale a step and head
                for h in T.unroll(GH):
                    w[0] = m[h]
                    for u in T.unroll(U):
                        w[0] = _nan_max(w[0], sc[u * GH + h])
                    if w[0] != ninf:  # (else nothing seen yet: the state stays empty)
                        w[1] = T.exp2(m[h] - w[0])  # 0 while m is -inf
                        l[h] = l[h] * w[1]
                        for v in T.unroll(VEC):
                            acc[h * VEC + v] = acc[h * VEC + v] * w[1]
                        for u in T.unroll(U):
                            w[2] = T.exp2(sc[u * GH + h] - w[0])
                            l[h] = l[h] + w[2]
                            for v in T.unroll(VEC):
                                acc[h * VEC + v] = acc[h * VEC + v] + w[2] * vf[u * VEC + v]
                        m[h] = w[0]
            # 4. the groups' states merged: the block's max and sum per head, each group's output scaled
            if lane == 0:
                for h in T.unroll(GH):
                    SM[grp * GH + h] = m[h]
                    SLS[grp * GH + h] = l[h]
            T.sync_threads()
            for h in T.unroll(GH):
                w[0] = ninf
                for g in T.serial(NG):
                    w[0] = T.max(w[0], SM[g * GH + h])
                w[1] = T.if_then_else(m[h] != ninf, T.exp2(m[h] - w[0]), T.float32(0))
                if vl:
                    for v in T.unroll(VEC):
                        SACC[(grp * GH + h) * (NV * VEC) + lane * VEC + v] = acc[h * VEC + v] * w[1]
            T.sync_threads()
            for k in T.serial(T.ceildiv(GH * NV * VEC, TPB)):
                e = k * TPB + tx
                if e < GH * NV * VEC:
                    h = e // (NV * VEC)
                    w[0] = ninf
                    for g in T.serial(NG):
                        w[0] = T.max(w[0], SM[g * GH + h])
                    w[1] = T.float32(0)  # the sum of the groups' rescaled sums
                    w[2] = T.float32(0)  # of their rescaled outputs
                    for g in T.serial(NG):
                        if SM[g * GH + h] != ninf:
                            w[3] = T.exp2(SM[g * GH + h] - w[0])
                            w[1] = w[1] + SLS[g * GH + h] * w[3]
                        w[2] = w[2] + SACC[(g * GH + h) * (NV * VEC) + e % (NV * VEC)]
                    if direct != 0:  # one split: the call's output (O's strides in its own vectors, OV)
                        O[(T.cast(b, "int64") * osb + T.cast(kvh * G + hc * GH + h, "int64") * osh) * OV
                          + e % (NV * VEC)] = T.cast(T.if_then_else(w[1] != 0, w[2] / w[1], T.float32(0)), st)
                    else:
                        row = ((T.cast(b, "int64") * HQ + T.cast(kvh * G + hc * GH + h, "int64"))
                               * T.cast(splits, "int64") + s)
                        OP[row * D + e % (NV * VEC)] = T.if_then_else(w[1] != 0, w[2] / w[1], T.float32(0))
                        if e % (NV * VEC) == 0:
                            LP[row] = T.if_then_else(w[1] != 0, w[0] + T.log2(w[1]), ninf)

    return paged_decode_partial_cuda


def _partial_mma(spec: PagedDecodeSpec):
    """The partial program on tensor cores: a program per (sequence, kv head, head chunk, split), as
    :func:`_partial_cuda`'s, walks its tokens in tiles of ``tile``. A tile's tokens are looked up in the
    block table once each (page checked, a bad one reported and its token masked), their key and value
    rows gathered into shared memory as 16-byte vectors by all the block's threads, and then ``S = Q
    K^T`` and ``O += P V`` are ``T.gemm`` (mma) with the chunk's q heads as the rows of Q, padded with
    zero rows to :data:`MMA_ROWS`: the ``2 G`` multiply-adds a cached element costs are the tensor
    cores', and a lane's work a token is a share of one row's load. The online softmax is the
    forward's (``kernels/attention.py``), one rescale a tile. A token not read (past the split, or its
    page bad) is read from the kv head's row of page 0 (memory that exists, whatever it holds) and
    zeroed in shared memory, its score -inf: no NaN of stale memory meets a weight of 0. Strides are in
    units of ``vec`` elements, as the other CUDA schedule's."""
    D, HQ, HKV, G = spec.head_dim, spec.hq, spec.hkv, spec.group
    GH, VEC, TPB, BN, BM = spec.heads_per_block, spec.vec, spec.threads, spec.tile, MMA_ROWS
    OV = vector(spec.dtype)  # out's vector, the unit of its strides (a call of one split writes it: direct)
    NHC = G // GH
    NVR = D // VEC  # vectors a cache row
    NE = -(-BN * NVR // TPB)  # vectors of a tile's keys (and of its values) a thread gathers
    SLOTS = 2 if spec.prefetch else 1  # tiles whose token flags and rows are held at once

    def slot_of(it):
        """The slot of tile ``it``'s token flags and rows."""
        return T.truncmod(it, 2) if spec.prefetch else 0
    dt = spec.dtype
    pt = spec.products  # the tensor-core operands' type: dt, or fp16 for a widened float8 cache
    rescale = pt != dt  # bf16 q rows rescaled into fp16 by a power of two each (undone on the scores)
    cst = "uint8" if spec.fp8 else dt
    rep = report("cuda")
    helpers = _cuda_helpers() + ((E4M3X8_HELPER if spec.widen else E4M3_HELPER) if spec.fp8 else "")
    setup = _program_setup(spec)
    sig = _partial_buffers(dt, cst)
    ninf = _neg_inf()

    def cache_f(x):
        """A cache element in the products' type: a float8 one's e4m3 value, exact in fp16 and bf16 (3
        mantissa bits, exponents 2^-9 to 2^8), by the hardware's conversion (:data:`E4M3_HELPER`); its
        scale is applied in fp32 to the scores (k_scale) and the output (v_scale), not rounded in."""
        return T.cast(T.call_extern("float32", "tileops_e4m3_f32", x), dt) if spec.fp8 else x

    @T.macro
    def lookup(BT, ERR, okS, rowv, it, slot, t0, t1, b, kvh, hc, tx, btb, bs, nblocks, csb, csr, csh, tag):
        """Tile ``it``'s tokens into ``slot``: each one's page looked up and checked once (a bad one
        reported by its offset, its token not read), its cache row in vectors (page 0's first where not
        read: memory that exists)."""
        div, mod = T.truncdiv, T.truncmod
        for r0 in T.serial(T.ceildiv(BN, TPB)):
            r = r0 * TPB + tx
            if r < BN:
                j = t0 + it * BN + r
                at = T.cast(b, "int64") * btb + T.cast(div(T.min(j, t1 - 1), bs), "int64")
                page = BT[at]
                good = j < t1 and page >= 0 and page < nblocks
                if j < t1 and (page < 0 or page >= nblocks) and kvh == 0 and hc == 0:
                    rep(ERR, TABLES_WORD, tag, at, page)
                okS[slot * BN + r] = T.if_then_else(good, 1, 0)
                rowv[slot * BN + r] = T.if_then_else(
                    good, T.cast(page, "int64") * csb + T.cast(mod(T.min(j, t1 - 1), bs), "int64") * csr,
                    T.int64(0)) + T.cast(kvh, "int64") * csh

    @T.macro
    def fetch(KC, VC, kb, vb, rowv, slot, tx, nblocks):
        """The rows of ``slot``'s tile into this thread's registers, NE vectors of keys and of values: every
        load issued before any is used (no branch between them: a token not read loads page 0's row)."""
        if nblocks > 0:  # (uniform: a cache of no block has no row to read)
            for e0 in T.unroll(NE):
                e = e0 * TPB + tx  # vector e % NVR of the tile's row e // NVR
                if e < BN * NVR:
                    for v in T.vectorized(VEC):
                        kb[e0 * VEC + v] = KC[rowv[slot * BN + e // NVR] * VEC + e % NVR * VEC + v]
                    for v in T.vectorized(VEC):
                        vb[e0 * VEC + v] = VC[rowv[slot * BN + e // NVR] * VEC + e % NVR * VEC + v]
        else:
            for v in T.unroll(NE * VEC):
                kb[v] = T.cast(0, cst)
                vb[v] = T.cast(0, cst)

    @T.macro
    def deposit(Ks, Vs, kb, vb, okS, slot, tx):
        """The registers' rows into the products' shared tiles, a token not read zeroed (a T.Parallel copy
        moved 4 bytes a load here: laid out for the products' swizzle, not for the gather)."""
        zero = T.cast(0, dt)
        # (a float8 element's conversion is a call the vectoriser cannot plan: element by element)
        store = T.unroll if spec.fp8 else T.vectorized
        for e0 in T.unroll(NE):
            e = e0 * TPB + tx
            if e < BN * NVR:
                for v in store(VEC):
                    Ks[e // NVR, e % NVR * VEC + v] = T.if_then_else(okS[slot * BN + e // NVR] != 0,
                                                                     cache_f(kb[e0 * VEC + v]), zero)
                for v in store(VEC):
                    Vs[e // NVR, e % NVR * VEC + v] = T.if_then_else(okS[slot * BN + e // NVR] != 0,
                                                                     cache_f(vb[e0 * VEC + v]), zero)

    @T.macro
    def deposit_widened(Ks, Vs, kb, vb, okS, slot, tx):
        """:func:`deposit` for a float8 cache with ``widen``: each vector of 8 elements widened whole into
        ``wk`` / ``wv`` (registers; a value row zeroed for a token not read) by :data:`E4M3X8_HELPER`, then
        stored as one 16-byte vector. The products' swizzle moves 16-byte chunks whole, so a vector stays
        together. A key row not read is kept as loaded: its scores are replaced by -inf whatever they are
        (NaN included), where its value row would meet a weight of 0."""
        wk = T.alloc_local((VEC,), pt)
        wv = T.alloc_local((VEC,), pt)
        for e0 in T.unroll(NE):
            e = e0 * TPB + tx
            if e < BN * NVR:
                T.evaluate(T.call_extern("handle", WIDEN_FUNCTION, T.address_of(wk[0]), T.address_of(kb[e0 * VEC]), 1))
                T.evaluate(T.call_extern("handle", WIDEN_FUNCTION, T.address_of(wv[0]), T.address_of(vb[e0 * VEC]),
                                         okS[slot * BN + e // NVR]))
                for v in T.vectorized(VEC):
                    Ks[e // NVR, e % NVR * VEC + v] = wk[v]
                for v in T.vectorized(VEC):
                    Vs[e // NVR, e % NVR * VEC + v] = wv[v]

    put = deposit_widened if spec.widen else deposit

    def q_elem(Q, b, h0, i, d, qsb, qsh):
        """Element ``d`` of row ``i`` of the chunk's q heads (from head ``h0``): a row past them reads the
        last head's, in bounds, for the caller to replace by zero."""
        return Q[(T.cast(b, "int64") * qsb + T.cast(h0 + T.min(i, GH - 1), "int64") * qsh) * VEC + d]

    @T.macro
    def q_rows(Q, Qs, rowf, b, h0, qsb, qsh):
        """Q's rows into the fp16 products for a bf16 q (``rescale``): each head's row times 2^-e, e from its
        largest magnitude's fp32 exponent bits so that it lands in [2^13, 2^14) (exact: a power of two and
        11 bits for bf16's 8; fp16's largest finite is 65504, and an element under 2^-27 of the largest goes
        subnormal, its share of q . k under 2^-24 of the largest term's); ``rowf`` gets 2^e for the scores.
        A row whose largest is inf or NaN is taken as it is (e = 0): its scores are inf or NaN either way;
        e >= -126 keeps 2^-e and 2^e normal fp32 (a row under 2^-113 then lands under 2^13)."""
        Qf = T.alloc_fragment((BM, D), "float32")
        qmax = T.alloc_fragment((BM,), "float32")
        qinv = T.alloc_fragment((BM,), "float32")
        qe = T.alloc_shared((BM,), "int32")
        for i, d in T.Parallel(BM, D):
            Qf[i, d] = T.if_then_else(
                i < GH, T.cast(q_elem(Q, b, h0, i, d, qsb, qsh), "float32"), T.float32(0))
        T.reduce_absmax(Qf, qmax, dim=1)
        for i in T.Parallel(BM):
            be = T.shift_right(T.reinterpret(qmax[i], "int32"), 23)  # the biased exponent (qmax >= 0)
            qe[i] = T.if_then_else(be == 255, 0, T.max(be - (127 + 13), -126))
        T.sync_threads()
        for i in T.Parallel(BM):
            qinv[i] = T.reinterpret(T.shift_left(127 - qe[i], 23), "float32")
        for i, d in T.Parallel(BM, D):
            Qs[i, d] = T.cast(Qf[i, d] * qinv[i], pt)
        for i in T.Parallel(BM):
            rowf[i] = T.reinterpret(T.shift_left(127 + qe[i], 23), "float32")

    @T.prim_func
    def paged_decode_partial_mma(Q: sig["Q"], KC: sig["KC"], VC: sig["VC"], BT: sig["BT"], SL: sig["SL"],
                                 KS: sig["KS"], VS: sig["VS"], OP: sig["OP"], LP: sig["LP"], O: sig["O"], ERR: sig["ERR"],
                                 tag: T.int32, batch: T.int32, splits: T.int32,
                                 chunk: T.int32, nblocks: T.int32, bs: T.int32, max_blocks: T.int32, btb: T.int64,
                                 qsb: T.int64, qsh: T.int64, csb: T.int64, csr: T.int64, csh: T.int64,
                                 scale_bits: T.int32, softcap_bits: T.int32, window: T.int32,
                             osb: T.int64, osh: T.int64, direct: T.int32):
        with T.Kernel(splits * (HKV * NHC) * batch, threads=TPB) as bx:
            T.import_source(helpers)
            if spec.min_blocks > 1:
                # registers a thread capped at 65536 / (min_blocks * TPB): the widened float8 program at
                # tiles of 128 with the prefetch takes 171 (2 programs an SM), 161 with 3 and no spill
                # (ptxas, sm_90a, bf16 q, D 128)
                T.annotate_min_blocks_per_sm(spec.min_blocks)
            tx = T.get_thread_binding()
            div, mod = T.truncdiv, T.truncmod  # every operand >= 0
            s = mod(bx, splits)
            hc = mod(div(bx, splits), NHC)
            kvh = mod(div(bx, splits * NHC), HKV)
            b = div(bx, splits * NHC * HKV)
            scale = T.reinterpret(scale_bits, "float32")
            softcap = T.reinterpret(softcap_bits, "float32")
            Qs = T.alloc_shared((BM, D), pt)
            Ks = T.alloc_shared((BN, D), pt)
            Vs = T.alloc_shared((BN, D), pt)
            Ps = T.alloc_shared((BM, BN), pt)
            # a tile's tokens: each one's cache row in vectors, and 1 where it is read (two tiles' with prefetch)
            rowv = T.alloc_shared((SLOTS * BN,), "int64")
            okS = T.alloc_shared((SLOTS * BN,), "int32")
            kb = T.alloc_local((NE * VEC,), cst)  # a thread's loaded vectors of the tile
            vb = T.alloc_local((NE * VEC,), cst)
            S = T.alloc_fragment((BM, BN), "float32")
            Acc = T.alloc_fragment((BM, D), "float32")
            m = T.alloc_fragment((BM,), "float32")
            m_prev = T.alloc_fragment((BM,), "float32")
            resc = T.alloc_fragment((BM,), "float32")
            L = T.alloc_fragment((BM, BN), "float32")
            lsum = T.alloc_fragment((BM,), "float32")
            # rescale: 2^e a row, undoing its q row's factor 2^-e on the scores (q_rows)
            rowf = T.alloc_fragment((BM,), "float32") if rescale else None
            scales = T.alloc_local((2,), "float32")  # the key and value scales
            rng = T.alloc_local((2,), "int32")  # the split's visible tokens [t0, t1)
            setup(SL, KS, VS, ERR, tag, scales, rng, b, s, s == 0 and kvh == 0 and hc == 0 and tx == 0, chunk,
                  max_blocks, bs, window)
            ks, vs, t0, t1 = scales[0], scales[1], rng[0], rng[1]
            h0 = kvh * G + hc * GH  # the chunk's first q head
            # Q's rows: the chunk's heads, zeros below them (a row past them reads the last head's, in bounds)
            if rescale:
                q_rows(Q, Qs, rowf, b, h0, qsb, qsh)
            else:
                for i, d in T.Parallel(BM, D):
                    Qs[i, d] = T.if_then_else(
                        i < GH, q_elem(Q, b, h0, i, d, qsb, qsh), T.cast(0, dt))
            T.fill(Acc, 0)
            T.fill(L, 0)
            T.fill(m, ninf)
            ntiles = T.ceildiv(T.max(t1 - t0, 0), BN)
            if spec.prefetch:  # tile 0's rows in flight before the loop
                if ntiles > 0:
                    lookup(BT, ERR, okS, rowv, 0, 0, t0, t1, b, kvh, hc, tx, btb, bs, nblocks, csb, csr, csh, tag)
                    T.sync_threads()
                    fetch(KC, VC, kb, vb, rowv, 0, tx, nblocks)
            for it in T.serial(ntiles):
                if not spec.prefetch:  # (TileLang's sync planner places this path's barriers)
                    lookup(BT, ERR, okS, rowv, it, 0, t0, t1, b, kvh, hc, tx, btb, bs, nblocks, csb, csr, csh, tag)
                    T.sync_threads()
                    fetch(KC, VC, kb, vb, rowv, 0, tx, nblocks)
                    put(Ks, Vs, kb, vb, okS, 0, tx)
                else:
                    T.sync_threads()  # the tile before is done with Ks, Vs and its slot's flags
                    if it + 1 < ntiles:  # the next tile's tokens into the other slot (the tile before's, read)
                        lookup(BT, ERR, okS, rowv, it + 1, 1 - slot_of(it), t0, t1, b, kvh, hc, tx, btb, bs,
                               nblocks, csb, csr, csh, tag)
                    put(Ks, Vs, kb, vb, okS, slot_of(it), tx)
                    # (one barrier for both, on every path: TileLang's sync planner let a barrier inside
                    # the branch above stand for one here, and the last tile's products read Ks
                    # unsynchronised)
                    T.sync_threads()
                    if it + 1 < ntiles:  # the next tile's rows into the freed registers during the products
                        fetch(KC, VC, kb, vb, rowv, 1 - slot_of(it), tx, nblocks)
                T.gemm(Qs, Ks, S, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullCol)
                for i, j in T.Parallel(BM, BN):
                    sij = S[i, j] * rowf[i] if rescale else S[i, j]
                    if spec.softcap:
                        S[i, j] = T.if_then_else(okS[slot_of(it) * BN + j] != 0,
                                                 softcap * T.tanh(sij * ks * scale / softcap) * T.float32(_LOG2E),
                                                 ninf)
                    else:
                        S[i, j] = T.if_then_else(okS[slot_of(it) * BN + j] != 0, sij * (ks * scale * T.float32(_LOG2E)),
                                                 ninf)
                T.copy(m, m_prev)
                # a thread's two rows (mma's r and r + 8) in one exchange across the warps: 5 barriers, not 10
                T.reduce_max(S, m, dim=1, clear=False, batch=2)
                # a row that saw no key keeps m = -inf: rescale 1 and p = exp2(-inf - 0) = 0, never NaN
                for i in T.Parallel(BM):
                    resc[i] = T.if_then_else(m[i] == ninf, T.float32(1), T.exp2(m_prev[i] - m[i]))
                for i, j in T.Parallel(BM, BN):
                    S[i, j] = T.exp2(S[i, j] - T.if_then_else(m[i] == ninf, T.float32(0), m[i]))
                    # each thread's share of the row sums, rescaled with the row: summed across the warps
                    # once, after the last tile (a reduction a tile cost ten barriers)
                    L[i, j] = L[i, j] * resc[i] + S[i, j]
                T.copy(S, Ps)
                for i, d in T.Parallel(BM, D):
                    Acc[i, d] *= resc[i]
                T.gemm(Ps, Vs, Acc, policy=T.GemmWarpPolicy.FullCol)
            T.reduce_sum(L, lsum, dim=1)
            for i, d in T.Parallel(BM, D):
                if i < GH and direct != 0:  # one split: the call's output (O's strides in its own vectors, OV)
                    O[(T.cast(b, "int64") * osb + T.cast(h0 + i, "int64") * osh) * OV + d] = T.cast(
                        T.if_then_else(lsum[i] != 0, Acc[i, d] * vs / lsum[i], T.float32(0)), dt)
            for i, d in T.Parallel(BM, D):
                if i < GH and direct == 0:
                    OP[((T.cast(b, "int64") * HQ + T.cast(h0 + i, "int64")) * T.cast(splits, "int64") + s) * D + d] = (
                        T.if_then_else(lsum[i] != 0, Acc[i, d] * vs / lsum[i], T.float32(0)))
            for i in T.Parallel(BM):
                if i < GH and direct == 0:
                    LP[(T.cast(b, "int64") * HQ + T.cast(h0 + i, "int64")) * T.cast(splits, "int64") + s] = (
                        T.if_then_else(lsum[i] != 0, m[i] + T.log2(lsum[i]), ninf))

    return paged_decode_partial_mma


def _kv_f32(spec: PagedDecodeSpec, x, scale):
    """A key's or value's element, loaded into a register, as fp32 (a float8 one dequantised)."""
    if spec.fp8:
        return e4m3_f32(x) * scale
    return T.cast(x, "float32")


#: splits the CUDA merge reads a round, every load of a round issued before any is used: one split
#: at a time, each a dependent wait on memory, the merge took 5.3 us of a 14 us call at 1 x 4096 (16
#: splits, bf16 GQA 32/8 D 128, H100, torch.profiler over a CUDA graph's replays; the partial 9.1)
MERGE_SPLITS = 8


def _merge_cuda(spec: PagedDecodeSpec):
    """Rows ``(sequence, q head)`` in lane groups of ``next_pow2(D / 8)`` lanes, each lane 8 elements of
    the row (two float4 of each split's partial output, one 16-byte store of a 16-bit out); ``osb`` and
    ``osh`` in units of 8 elements (4 for fp32)."""
    D, HQ, TPB, VEC, LG = spec.head_dim, spec.hq, spec.threads, spec.vec, spec.lanes
    NV = D // VEC
    RPB = TPB // LG
    st = storage_dtype(spec.dtype, "cuda")
    NO, NL, NOUT = T.dynamic("NO, NL, NOUT")
    ninf = _neg_inf()

    @T.prim_func
    def paged_decode_merge_cuda(OP: T.Tensor((NO,), "float32"), LP: T.Tensor((NL,), "float32"),
                                O: T.Tensor((NOUT,), st), batch: T.int32, splits: T.int32, osb: T.int64,
                                osh: T.int64):
        with T.Kernel(T.ceildiv(batch * HQ, RPB), threads=TPB) as bx:
            tx = T.get_thread_binding()
            lane = tx % LG
            r = bx * RPB + tx // LG
            acc = T.alloc_local((VEC,), "float32")
            ov = T.alloc_local((VEC,), st)
            w = T.alloc_local((3,), "float32")  # max, sum of weights, a weight
            lb = T.alloc_local((MERGE_SPLITS,), "float32")  # a round's log-sum-exps
            ob = T.alloc_local((MERGE_SPLITS * VEC,), "float32")  # and this lane's elements of their outputs
            if r < batch * HQ and lane < NV:
                row = T.cast(r, "int64") * T.cast(splits, "int64")
                rounds = T.ceildiv(splits, MERGE_SPLITS)
                w[0] = ninf
                for k in T.serial(rounds):
                    for u in T.unroll(MERGE_SPLITS):  # the round's loads issued before any is used
                        lb[u] = T.if_then_else(k * MERGE_SPLITS + u < splits,
                                               LP[row + T.min(k * MERGE_SPLITS + u, splits - 1)], ninf)
                    for u in T.unroll(MERGE_SPLITS):
                        w[0] = _nan_max(w[0], lb[u])
                w[1] = T.float32(0)
                for v in T.unroll(VEC):
                    acc[v] = T.float32(0)
                if w[0] != ninf:  # (a NaN split: its weight NaN, and the output)
                    for k in T.serial(rounds):
                        for u in T.unroll(MERGE_SPLITS):
                            # a split past the last reads the last's row (in bounds) and weighs 0
                            sr = row + T.min(k * MERGE_SPLITS + u, splits - 1)
                            lb[u] = T.if_then_else(k * MERGE_SPLITS + u < splits, LP[sr], ninf)
                            for v in T.vectorized(VEC // 2):
                                ob[u * VEC + v] = OP[sr * D + lane * VEC + v]
                            for v in T.vectorized(VEC // 2):
                                ob[u * VEC + VEC // 2 + v] = OP[sr * D + lane * VEC + VEC // 2 + v]
                        for u in T.unroll(MERGE_SPLITS):
                            w[2] = T.exp2(lb[u] - w[0])  # 0 for a split that saw no key, or past the last
                            w[1] = w[1] + w[2]
                            for v in T.unroll(VEC):
                                acc[v] = acc[v] + w[2] * ob[u * VEC + v]
                for v in T.unroll(VEC):
                    ov[v] = T.cast(T.if_then_else(w[1] != 0, acc[v] / w[1], T.float32(0)), st)
                oo = (T.cast(r // HQ, "int64") * osb + T.cast(r % HQ, "int64") * osh) * VEC + lane * VEC
                for v in T.vectorized(VEC):
                    O[oo + v] = ov[v]

    return paged_decode_merge_cuda


def _nan_max(a, b):
    """``max(a, b)``, NaN if either is: CUDA's ``max`` of floats (``fmaxf``) drops a NaN, and a running
    max that drops them lets a NaN split or step look empty, its NaN then never reaching the output."""
    return T.if_then_else(T.Or(T.isnan(a), T.isnan(b)), a + b, T.max(a, b))  # (TVM folds x != x to false)


def _neg_inf():
    """-inf as fp32 bits: ``-T.infinity`` prints CUDART_INF_F, whose header the lean build (NVRTC, no
    include path) does not give."""
    return T.reinterpret(T.int32(-8388608), "float32")  # 0xFF800000
