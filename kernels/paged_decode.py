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

Checks on the device, reported with their index (:mod:`tileops.kernels.report`): word 0
``block_tables`` (an entry a split reads outside ``[0, num_blocks)``: its keys are skipped, nothing is
read out of bounds), word 1 ``seq_lens`` (outside ``[0, max_blocks * block_size]``: the sequence is
read clamped into its table). The offset reported is the element's from the tensor's pointer (``b *
btb + i`` for a block-table entry, ``b`` for a length).

Schedules: ``c`` (TileLang's C backend, one program at a time, the CPU's correctness path, which CI
runs). The CUDA schedule is not written yet: a CUDA spec is refused by name.
"""

from dataclasses import dataclass
from typing import Any

from .report import ENTRY, report
from .storage import load_f32, storage_dtype, to_storage

#: ``tilelang.language``, imported when a kernel is first built
T: Any = None

__all__ = ["PagedDecodeSpec", "Spec", "build", "STATIC", "PARTIAL_ARGS", "MERGE_ARGS", "CACHE_DTYPES"]

#: no schedule choices yet (the C schedule has none)
STATIC = {}

#: the caches' element types: the query's, or float8 e4m3fn with per-tensor scales
CACHE_DTYPES = ("float16", "bfloat16", "float32", "float8_e4m3fn")

#: the partial program's parameters, in order (the launcher binds by name)
PARTIAL_ARGS = ("Q", "KC", "VC", "BT", "SL", "KS", "VS", "OP", "LP", "ERR", "tag", "batch", "splits", "chunk",
                "nblocks", "bs", "max_blocks", "btb", "qsb", "qsh", "csb", "csr", "csh", "scale", "softcap", "window")
#: the merge program's parameters
MERGE_ARGS = ("OP", "LP", "O", "batch", "splits", "osb", "osh")

_LOG2E = 1.4426950408889634


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

    def __post_init__(self) -> None:
        if self.dtype not in ("float16", "bfloat16", "float32"):
            raise ValueError(f"dtype: expected float16, bfloat16 or float32, got {self.dtype!r}")
        if self.cache_dtype not in (self.dtype, "float8_e4m3fn"):
            raise ValueError(f"cache_dtype: expected the query's dtype {self.dtype!r} or 'float8_e4m3fn', "
                             f"got {self.cache_dtype!r}")
        if self.backend == "cuda":
            raise ValueError("backend: the paged decode's CUDA schedule is not written yet (the C schedule only)")
        if self.backend != "c":
            raise ValueError(f"backend: expected 'c', got {self.backend!r}")
        if self.kind not in ("partial", "merge"):
            raise ValueError(f"kind: expected 'partial' or 'merge', got {self.kind!r}")
        for name in ("head_dim", "hq", "hkv"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
        if self.hq % self.hkv:
            raise ValueError(f"hq: expected a multiple of hkv={self.hkv}, got {self.hq}")

    @property
    def fp8(self) -> bool:
        return self.cache_dtype == "float8_e4m3fn"

    @property
    def args(self) -> tuple[str, ...]:
        return PARTIAL_ARGS if self.kind == "partial" else MERGE_ARGS


Spec = PagedDecodeSpec


def _tl() -> Any:
    global T
    if T is None:
        import tilelang.language as tl

        T = tl
    return T


def build(spec: PagedDecodeSpec):
    """The ``T.prim_func`` for ``spec``; its parameters are ``spec.args`` (then the dynamic extents)."""
    _tl()
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


def _partial(spec: PagedDecodeSpec):
    D, HQ, HKV, G = spec.head_dim, spec.hq, spec.hkv, spec.hq // spec.hkv
    st = storage_dtype(spec.dtype, spec.backend)
    cst = "uint8" if spec.fp8 else st
    rep = report(spec.backend)
    NQ, NC, NBT, NS, NO, NL = T.dynamic("NQ, NC, NBT, NS, NO, NL")

    @T.prim_func
    def paged_decode_partial(Q: T.Tensor((NQ,), st), KC: T.Tensor((NC,), cst), VC: T.Tensor((NC,), cst),
                             BT: T.Tensor((NBT,), "int32"), SL: T.Tensor((NS,), "int32"),
                             KS: T.Tensor((1,), "float32"), VS: T.Tensor((1,), "float32"),
                             OP: T.Tensor((NO,), "float32"), LP: T.Tensor((NL,), "float32"),
                             ERR: T.Tensor((ENTRY,), "int32"), tag: T.int32, batch: T.int32, splits: T.int32,
                             chunk: T.int32, nblocks: T.int32, bs: T.int32, max_blocks: T.int32, btb: T.int64,
                             qsb: T.int64, qsh: T.int64, csb: T.int64, csr: T.int64, csh: T.int64,
                             scale: T.float32, softcap: T.float32, window: T.int32):
        with T.Kernel(splits, HKV, batch, threads=1) as (s, kvh, b):
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
                    rep(ERR, 1, tag, b, SL[b])
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
                        rep(ERR, 0, tag, at, page)
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
                        # online softmax: m' = max(m, s); the sum and the output rescaled by 2^(m - m')
                        sc[1] = T.if_then_else(sc[0] > m[g], T.exp2(m[g] - sc[0]), T.float32(1))
                        m[g] = T.max(m[g], sc[0])
                        p = T.exp2(sc[0] - m[g])
                        l[g] = l[g] * sc[1] + p
                        for d in T.serial(D):
                            acc[g * D + d] = acc[g * D + d] * sc[1] + p * kv[D + d]
            for g in T.serial(G):
                row = (T.cast(b, "int64") * HQ + T.cast(kvh * G + g, "int64")) * T.cast(splits, "int64") + s
                for d in T.serial(D):
                    OP[row * D + d] = T.if_then_else(l[g] > 0, acc[g * D + d] / l[g], T.float32(0))
                LP[row] = T.if_then_else(l[g] > 0, m[g] + T.log2(l[g]), -T.infinity("float32"))

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
                w[0] = T.max(w[0], LP[row + s])
            w[1] = T.float32(0)
            for d in T.serial(D):
                acc[d] = T.float32(0)
            if w[0] > -T.infinity("float32"):
                for s in T.serial(splits):
                    w[2] = T.exp2(LP[row + s] - w[0])  # 0 for a split that saw no key
                    w[1] = w[1] + w[2]
                    for d in T.serial(D):
                        acc[d] = acc[d] + w[2] * OP[(row + s) * D + d]
            oo = T.cast(b, "int64") * osb + T.cast(h, "int64") * osh
            for d in T.serial(D):
                O[oo + d] = to_storage(T.if_then_else(w[1] > 0, acc[d] / w[1], T.float32(0)), st, spec.dtype)

    return paged_decode_merge
