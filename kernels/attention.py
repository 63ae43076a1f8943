"""Attention forward (``softmax(q k^T * scale) v``) as TileLang tile programs, one pass over K/V.

One description, two schedules:

* ``cuda``: FlashAttention's: a block owns ``block_M`` query rows of one q head; K and V tiles of
  ``block_N`` keys stream through shared memory in a software pipeline of ``stages`` buffers
  (``T.Pipelined``; how the tiles are loaded is the ``pipeline`` knob, :data:`PIPELINES`: by default TMA
  from a producer warpgroup TileLang adds on sm_90, varlen by every thread); ``S = Q K^T`` and ``O += P V`` are
  ``T.gemm`` on tensor cores (TileLang picks wgmma on sm_90, mma on sm_80); the online softmax runs
  in fp32 register fragments. The causal and window masks bound the loop over K/V tiles (a tile no
  row of the block sees is never loaded), and only the tiles a mask cuts (``_needs_mask``) evaluate
  it per element. GQA maps q head ``h`` to kv head ``h // (HQ // HKV)``.
* ``c``: TileLang's C backend (no threads, no tensor cores): a query row per iteration, one key at a
  time, the same online softmax in fp32: the CPU's correctness path, which CI runs.

Scores: ``s = (q . k) * scale``; with ``softcap`` ``s = c * tanh(s / c)``; the softmax is taken in
base 2 (``s * log2(e)``), as FlashAttention does, and the log-sum-exp converted back to natural log.
A row that sees no key (causal with ``seq_q > seq_k``, a window, a sequence of length 0) writes
zeros and ``lse = -inf``.

Masks, with ``off = seq_k - seq_q`` (bottom-right alignment): causal hides key ``j > i + off``; a
window ``w`` hides ``j <= i + off - w``.

Addressing: element ``(b, t, h, d)`` of q/k/v/out lies at ``b * sb + t * ss + h * sh + d``, strides
in elements given as arguments (the C schedule's flat buffers) or as the dynamic strides of 4-D
tensors (CUDA: TileLang builds the TMA descriptors from them on the host, so they must be positive
multiples of ``stride_unit`` elements, 16 bytes, which the host checks); a view such as HF's
``[B, H, S, D]`` transposed is read where it lies. Varlen (``varlen``): ``sb = 0`` and sequence ``b``'s rows start at
``CUQ[b]`` / ``CUK[b]``; the grid's x walks ``ceil(total_q / block_M) + batch`` tiles, and a block
finds its sequence by bisecting ``floor(CUQ[b] / block_M) + b`` (a sequence of ``n`` rows owns at
least ``ceil(n / block_M)`` of those slots, so every tile has one; spare slots exit). Every
``CUQ``/``CUK`` value is clamped to the tokens before it is used, so a bad one addresses nothing out
of bounds; block 0 checks them (first 0, non-decreasing, last the token count) and reports the first
bad element (:mod:`tileops.kernels.report`; ``ERR`` word 0 for ``cu_seqlens_q``, 1 for ``cu_seqlens_k``).

lse (when ``LSE`` is given, ``has_lse``): fp32, element ``(b, h, row)`` at ``b * lsb + h * lsh + row``
(dense ``[B, HQ, seq_q]``; varlen ``[HQ, total_q]`` with ``lsb = 0`` and the row counted from the
first sequence).
"""

import math
from dataclasses import dataclass
from typing import Any

from .report import CUDA_SOURCE as REPORT_SOURCE
from .report import ENTRY, report
from .storage import load_f32, storage_dtype, to_storage

#: ``tilelang.language``, imported when a kernel is first built
T: Any = None

__all__ = ["AttnKernelSpec", "build_attention", "build", "Spec", "STATIC", "ARGS", "DEFAULT_TILES", "tile_defaults",
           "PIPELINES", "DEFAULT_PIPELINE", "PINGPONG_HEAD_DIMS", "PINGPONG_BARRIERS"]

#: The schedule choices a manifest's ``kernel.static`` may set (read without importing the module). 0
#: means "the default for the head_dim" (:data:`DEFAULT_TILES`); the C schedule has none.
STATIC = {
    "block_M": (0, 256, "query rows a block owns, a multiple of 16 (CUDA; 0: by head_dim)"),
    "block_N": (0, 256, "keys a K/V tile holds, a multiple of 16 (CUDA; 0: by head_dim)"),
    "stages": (0, 4, "K/V tiles in flight through shared memory, T.Pipelined's num_stages (CUDA; 0: by head_dim)"),
    "threads": (0, 512, "threads a block, 128 a warpgroup (CUDA; 0: by head_dim)"),
    "pipeline": (0, 4, "how K/V tiles reach shared memory (CUDA): 0 the default (4 at head_dim 128 with "
                       "block_M 128 and 256 threads, else 2), 1 every thread loads "
                       "(no TMA, no producer warpgroup), 2 TMA from TileLang's producer warpgroup, 3 as 2 with the "
                       "two consumer warpgroups in ping-pong, 4 as 3 with each tile's softmax under the previous "
                       "tile's P V (PIPELINES)"),
}

#: The CUDA schedule's ``pipeline`` knob -> the TileLang pass configs it lowers with. 2 is TileLang's
#: default on sm_90: TMA loads issued by a producer warpgroup it adds (warp specialisation). Its first
#: call on the H200 deadlocked (benchmarks/NOTES.md, "the forward's deadlock"): TileLang 0.1.15's
#: warp-specialisation pass gives the producer its own copy of every local buffer it reads but none
#: of the values stored into it before the pipelined loop, and the kernel then kept its sequence's
#: bounds in such a buffer, so the producer's K/V loop ran from uninitialised registers while the
#: consumers counted from ``sk``. The dense kernel now reads no register in the loop's bounds or
#: addresses (``_cuda``), and on the H200 pipeline 2 returned and agreed with SDPA (causal, 128 and
#: 2048 tokens); varlen, which finds its sequence by a bisection in registers, lowers as 1
#: (:attr:`AttnKernelSpec.loads`). 1 lowers with warp specialisation and TMA off: every thread loads
#: K/V tiles element by element (TileLang cannot prove a runtime stride a multiple of 8, so it neither
#: vectorises nor uses cp.async) and computes: correct on the H200, and slow (110 TFLOP/s at 1 x 16384
#: against cuDNN's 612, `benchmarks/NOTES.md`). On sm_80 both lower to that path (no TMA there).
#:
#: 3 lowers as 2 and orders the two consumer warpgroups' ``S = Q K^T`` issues with two named barriers
#: (:data:`PINGPONG_BARRIERS`), FlashAttention-3's inter-warpgroup schedule: a warpgroup issues its
#: ``Q K^T`` only after the other's has completed, so one warpgroup's softmax runs under the other's
#: GEMMs. Without it the two warpgroups run in lock step and the tensor cores idle through both
#: softmaxes (the generated loop is wgmma -> wait -> softmax -> wgmma -> wait in each; benchmarks/NOTES.md,
#: the fourth and fifth sessions: 457 TFLOP/s at 1 x 16384 against cuDNN's 610 on the H200). TileLang
#: 0.1.15 gives no intra-warpgroup overlap from ``T.gemm``: it waits on its wgmma at once, and under
#: warp specialisation ``T.Pipelined``'s ``order``/``stage`` leave that wait in place, as does its
#: ``role_based`` scheduler (all three lowered here; pipeline 4 writes the overlap out). The barriers
#: need exactly two consumer warpgroups of 64 rows: ``block_M`` 128 and 256 threads (checked).
#:
#: 4 is 3 with FlashAttention-3's intra-warpgroup overlap written out (``T.wgmma_gemm``, which does not
#: wait, and ``T.wait_wgmma``): a tile's softmax runs while the previous tile's ``P V`` is on the tensor
#: cores (:func:`_cuda`'s ``work``). Same constraints.
PIPELINES = {
    1: {"tl.disable_warp_specialized": True, "tl.disable_tma_lower": True},
    2: {},
    3: {},
    4: {},
}
#: the named barriers (of the 16 a CTA has) the ping-pong of pipelines 3 and 4 uses, one a consumer
#: warpgroup: the highest two, clear of the low ids TileLang 0.1.15 gives its own partial syncs
#: (``__sync_thread_partial(3, 256)`` before the epilogue's store, in the CUDA it emits)
PINGPONG_BARRIERS = (14, 15)
#: the knob's value when the spec leaves it 0, except at the head_dims of :data:`PINGPONG_HEAD_DIMS`
DEFAULT_PIPELINE = 2
#: head_dims whose default is pipeline 4 where the tile shape allows it (block_M 128, 256 threads):
#: at D 128 it was faster than pipeline 2 on each of issue 36's four rows, 1.03x at 1 x 16384, 1.15x
#: causal, 1.07x at 4 x 4096 causal and 1.03x at 16 x 1024 causal, and the H200's tuning chose it
#: where it searched (H100, one run, benchmarks/NOTES.md 2026-12-06). Other head_dims are unmeasured.
PINGPONG_HEAD_DIMS = frozenset({128})

#: CUDA tile shape per head_dim: (block_M, block_N, stages, threads). Shared memory per block is about
#: ``2 bytes * (2 * block_M + 2 * stages * block_N) * D`` (Q and the output tile, K and V per stage),
#: of the 227 KiB an H200 SM has: 128 x 128 at 2 stages is 192 KiB at D 128 (one block an SM, two
#: consumer warpgroups of 64 rows each for wgmma; with ``pipeline`` 2, plus the producer warpgroup TileLang
#: adds for the TMA loads: 384 threads), as TileLang's GQA example tunes it; 128 KiB at D 64. D 256 keeps
#: 64 x 64 (192 KiB; its 64 x 256 fp32 accumulator already takes 128 registers a thread of one
#: warpgroup: 240 registers, no spill, in the sm_90a build here). Starting points, not measured optima
#: (no GPU here): ``python -m benchmarks.attention --configs`` sweeps them on the H200.
DEFAULT_TILES = {
    # D 64 keeps 128 x 128 for every length. FlashAttention-3's 192 x 192 over three consumer warpgroups
    # was 1.06-1.08x at 4 x 4096 causal and even at 4 x 2048 on an H100, but 1.23x slower at 2 x 1024
    # causal (32.5 against 26.5 us; benchmarks/NOTES.md, the thirty-second session): the tune space holds
    # it, and a shape class of long sequences may choose it (tileops tune)
    64: (128, 128, 2, 256),
    80: (128, 64, 2, 256),  # 128 x 128 at D 80: TileLang 0.1.15 "cannot lower a required shared-memory
                            # sync inside a divergent region with 186 participating threads" (seen here)
    96: (128, 128, 2, 256),
    128: (128, 128, 2, 256),
    256: (64, 64, 2, 128),
}

#: the generated function's parameters, in order, for every spec (the launcher binds by name; a
#: kernel that does not read some, a dense one ``CUQ``, passes 0)
ARGS = ("Q", "K", "V", "O", "LSE", "CUQ", "CUK", "ERR", "tag", "batch", "nb", "sq", "sk", "tiles",
        "qsb", "qss", "qsh", "ksb", "kss", "ksh", "vsb", "vss", "vsh", "osb", "oss", "osh", "lsb", "lsh",
        "has_lse", "scale_bits", "cap_bits", "window")
#: the CUDA function's parameters: the rest of :data:`ARGS` are its tensors' dynamic extents (``nb``,
#: ``sq``, ``sk``) and strides, which the launcher passes after them, by the same names
CUDA_ARGS = ("Q", "K", "V", "O", "LSE", "CUQ", "CUK", "ERR", "tag", "batch", "tiles", "lsb", "lsh", "has_lse",
             "scale_bits", "cap_bits", "window")

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


#: ``ex2.approx.ftz``: exp2f without fast math is the same instruction behind a range check and two
#: predicated multiplies for results below 2^-126 (3 more instructions an element of S, a tile's
#: largest loop after the gemms); a p under 2^-126 flushes to 0, against a row sum of at least 1
EX2_SOURCE = """
__device__ __forceinline__ float tileops_ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
"""


def tile_defaults(head_dim: int) -> tuple[int, int, int, int]:
    """(block_M, block_N, stages, threads) for ``head_dim``: the table's, or the next larger one's."""
    for d in sorted(DEFAULT_TILES):
        if head_dim <= d:
            return DEFAULT_TILES[d]
    return DEFAULT_TILES[max(DEFAULT_TILES)]


@dataclass(frozen=True)
class AttnKernelSpec:
    """Everything one attention kernel is compiled for; two equal specs share one compiled kernel."""

    dtype: str  # q, k, v, out: float16 | bfloat16 | float32 (C only)
    head_dim: int
    hq: int
    hkv: int
    backend: str = "c"  # c | cuda
    kind: str = "fwd"
    causal: bool = False
    window: bool = False  # a sliding window (its width is the ``window`` argument)
    softcap: bool = False  # c * tanh(s / c) (c is ``cap_bits``'s float)
    varlen: bool = False
    block_M: int = 0
    block_N: int = 0
    stages: int = 0
    threads: int = 0
    pipeline: int = 0  # :data:`PIPELINES` (CUDA); 0: :attr:`default_pipeline`

    def __post_init__(self) -> None:
        if self.dtype not in ("float16", "bfloat16", "float32"):
            raise ValueError(f"dtype: expected float16, bfloat16 or float32, got {self.dtype!r}")
        if self.backend not in ("c", "cuda"):
            raise ValueError(f"backend: expected 'c' or 'cuda', got {self.backend!r}")
        if self.kind != "fwd":
            raise ValueError(f"kind: expected 'fwd' (the backward is kernels/attention_bwd.py's), got {self.kind!r}")
        for name in ("head_dim", "hq", "hkv"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
        if self.hq % self.hkv:
            raise ValueError(f"hq: expected a multiple of hkv={self.hkv}, got {self.hq}")
        if self.backend == "cuda":
            if self.dtype == "float32":
                raise ValueError("dtype: the CUDA schedule runs on tensor cores in float16 or bfloat16, got float32")
            if self.head_dim % 16:
                raise ValueError(f"head_dim: the CUDA schedule needs a multiple of 16, got {self.head_dim}")
            bm, bn, st, th = self.tiles
            if bm % 16 or bn % 16 or not 16 <= bm <= 256 or not 16 <= bn <= 256:
                raise ValueError(f"block_M, block_N: expected multiples of 16 in [16, 256], got {bm}, {bn}")
            if th % 128 or not 128 <= th <= 512:
                raise ValueError(f"threads: expected 128, 256, 384 or 512 (warpgroups), got {th}")
            if not 1 <= st <= 4:
                raise ValueError(f"stages: expected 1 to 4, got {st}")
            if st > 1 and self.loads == 1:
                raise ValueError(f"stages: with every thread loading (pipeline 1, or varlen) TileLang 0.1.15's "
                                 f"cp.async pipeline at 2 or more stages reads its last tile before the copy lands "
                                 f"(see AttnKernelSpec.tiles): expected 1 or 0 (the default), got {st}")
        if self.pipeline not in (0, *PIPELINES):
            raise ValueError(f"pipeline: expected 0 or one of {sorted(PIPELINES)}, got {self.pipeline!r}")
        if self.backend == "cuda" and self.pipeline in (3, 4) and self.tiles[::3] != (128, 256):
            bm, _, _, th = self.tiles
            raise ValueError(f"pipeline: {self.pipeline} (two consumer warpgroups in ping-pong) needs block_M 128 "
                             f"and 256 threads, got block_M {bm} and {th} threads")

    @property
    def tiles(self) -> tuple[int, int, int, int]:
        """(block_M, block_N, stages, threads), the zeros replaced by :func:`tile_defaults`'s."""
        d = tile_defaults(self.head_dim)
        # every thread loading (loads 1: varlen, pipeline 1): one stage by default. TileLang 0.1.15's
        # cp.async pipeline at 2+ stages over a dynamic trip count ends without waiting on its last
        # tile's copies (the epilogue's wait is guarded by a condition that is never true there, in the
        # CUDA it emits; the attention backward's dq read a tile before it landed on the H200). TMA's
        # producer warpgroup (loads 2) synchronises through mbarriers and keeps the table's stages
        stages = self.stages or (1 if self.backend == "cuda" and self.loads == 1 else d[2])
        return (self.block_M or d[0], self.block_N or d[1], stages, self.threads or d[3])

    @property
    def loads(self) -> int:
        """The :data:`PIPELINES` entry this kernel lowers with: the knob's, but 1 for varlen, whose block
        finds its sequence in registers before the K/V loop (a bisection), which TileLang 0.1.15's
        producer warpgroup would read uninitialised (see :data:`PIPELINES`)."""
        return 1 if self.varlen else (self.pipeline or self.default_pipeline)

    @property
    def default_pipeline(self) -> int:
        """The pipeline a spec that leaves it 0 lowers with: 4 at :data:`PINGPONG_HEAD_DIMS` on CUDA where
        the tiles have its two consumer warpgroups, else :data:`DEFAULT_PIPELINE`."""
        d = tile_defaults(self.head_dim)  # (not self.tiles, whose stages depend on this)
        if self.backend == "cuda" and self.head_dim in PINGPONG_HEAD_DIMS and (self.block_M or d[0],
                                                                               self.threads or d[3]) == (128, 256):
            return 4
        return DEFAULT_PIPELINE

    @property
    def pingpong(self) -> bool:
        """Whether the two consumer warpgroups take turns issuing ``Q K^T`` (pipelines 3 and 4; not
        varlen, which lowers as 1 and has no producer warpgroup)."""
        return self.backend == "cuda" and self.loads in (3, 4)

    @property
    def overlap(self) -> bool:
        """Whether a warpgroup also runs a tile's softmax under the previous tile's ``P V`` (pipeline 4,
        with the ping-pong of 3)."""
        return self.backend == "cuda" and self.loads == 4

    @property
    def pass_configs(self) -> dict[str, bool]:
        """The TileLang pass configs this kernel lowers with beyond tileops' own
        (:func:`tileops.compile.build.pass_configs`): those of :attr:`loads`; none for the C schedule."""
        if self.backend != "cuda":
            return {}
        return PIPELINES[self.loads]

    @property
    def stride_unit(self) -> int:
        """The elements every stride must be a multiple of: a 16-byte vector on CUDA (TMA), 1 on the CPU."""
        return 16 // _BYTES[self.dtype] if self.backend == "cuda" else 1

    @property
    def rows_per_tile(self) -> int:
        """Query rows a block (CUDA) or a grid cell (C: one) owns: the host's tile count uses it."""
        return self.tiles[0] if self.backend == "cuda" else 1

    @property
    def args(self) -> tuple[str, ...]:
        return CUDA_ARGS if self.backend == "cuda" else ARGS


Spec = AttnKernelSpec
_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


def _tl() -> Any:
    global T
    if T is None:
        import tilelang.language as tl

        T = tl
    return T


def build_attention(spec: AttnKernelSpec):
    """The ``T.prim_func`` for ``spec``; its parameters are ``spec.args`` (then the dynamic extents)."""
    _tl()
    st = storage_dtype(spec.dtype, spec.backend)
    NL, NC = T.dynamic("NL, NC")
    common = {"LSE": T.Tensor((NL,), "float32"), "CUQ": T.Tensor((NC,), "int32"), "CUK": T.Tensor((NC,), "int32"),
              "ERR": T.Tensor((ENTRY,), "int32")}
    if spec.backend == "cuda":
        return _cuda_func(spec, common)
    NQ, NK, NV, NO = T.dynamic("NQ, NK, NV, NO")
    sig = {"Q": T.Tensor((NQ,), st), "K": T.Tensor((NK,), st), "V": T.Tensor((NV,), st), "O": T.Tensor((NO,), st),
           **common}
    body = _c(spec, st)

    @T.prim_func
    def attn_fwd(Q: sig["Q"], K: sig["K"], V: sig["V"], O: sig["O"], LSE: sig["LSE"], CUQ: sig["CUQ"],
                 CUK: sig["CUK"], ERR: sig["ERR"], tag: T.int32, batch: T.int32, nb: T.int32, sq: T.int32,
                 sk: T.int32, tiles: T.int32,
                 qsb: T.int64, qss: T.int64, qsh: T.int64, ksb: T.int64, kss: T.int64, ksh: T.int64,
                 vsb: T.int64, vss: T.int64, vsh: T.int64, osb: T.int64, oss: T.int64, osh: T.int64,
                 lsb: T.int64, lsh: T.int64, has_lse: T.int32, scale_bits: T.int32, cap_bits: T.int32,
                 window: T.int32):
        body(Q, K, V, O, LSE, CUQ, CUK, ERR, tag, batch, nb, sq, sk, tiles, qsb, qss, qsh, ksb, kss,
             ksh, vsb, vss, vsh, osb, oss, osh, lsb, lsh, has_lse, scale_bits, cap_bits, window)

    return attn_fwd


def build(spec: AttnKernelSpec):
    """The prim_func of ``spec``, checked: its tensors' shapes and strides keep the extents' names."""
    func = build_attention(spec)
    if spec.backend == "cuda":
        _check_extent_names(func)
    return func


#: the names of the CUDA kernel's dynamic extents and strides: TileLang's launcher takes them by name
#: (``NL``, ``NC``: the lse's and the offsets' lengths, which no plan binds and the launcher passes as 0)
EXTENTS = ("nb", "sq", "sk", "qsb", "qss", "qsh", "ksb", "kss", "ksh", "vsb", "vss", "vsh", "osb", "oss", "osh",
           "NL", "NC")


def _check_extent_names(func) -> None:
    """Refuse a prim_func whose tensor shape or stride variable was renamed. In a macro, binding an
    extent to a name (``hi = sk``, or passing ``sq`` to a parameter ``nq``) renames the variable
    itself; the launcher then takes an argument of the new name, which no plan binds: every call of
    the first H200 run refused for it. Caught here, when a kernel is built, on any machine."""
    bad = set()
    for p in func.params:
        buf = func.buffer_map.get(p)
        if buf is None:
            continue
        for x in (*buf.shape, *buf.strides):
            name = getattr(x, "name", None)
            if name is not None and name not in EXTENTS:
                bad.add(f"{buf.name}: {name}")
    if bad:
        raise RuntimeError(f"attention kernel: an extent was renamed while building ({', '.join(sorted(bad))}; "
                           f"expected the names {EXTENTS}): a macro bound it to another name")


# ------------------------------------------------------------------------------ shared pieces
def _clamp(v, lo, hi):
    return T.max(T.min(v, hi), lo)


def _check_cu(spec: AttnKernelSpec):
    """Block 0's check of the offsets ``CUQ`` and ``CUK`` (``batch + 1`` entries each, ending at ``sq``
    and ``sk`` tokens): the first bad element of each reported in word 0 and 1 (its offset is its index:
    the host passes them contiguous). The macro's parameters are named as the kernels' own variables:
    TileLang names a variable after the macro parameter it is bound to."""
    rep = report(spec.backend)

    @T.macro
    def check(CUQ, CUK, ERR, tag, batch, sq, sk):
        for i in T.serial(batch + 1):
            badq = T.alloc_var("int32")
            badk = T.alloc_var("int32")
            badq = 0
            badk = 0
            if i == 0:
                if CUQ[0] != 0:
                    badq = 1
                if CUK[0] != 0:
                    badk = 1
            else:
                if CUQ[i] < CUQ[i - 1]:
                    badq = 1
                if CUK[i] < CUK[i - 1]:
                    badk = 1
            if i == batch:
                if CUQ[batch] != sq:
                    badq = 1
                if CUK[batch] != sk:
                    badk = 1
            if badq != 0:
                rep(ERR, 0, tag, i, CUQ[i])
            if badk != 0:
                rep(ERR, 1, tag, i, CUK[i])

    return check


def _span(spec: AttnKernelSpec, m0, m1, n_sk, off, window):
    """Keys ``[lo, hi)`` some row of ``[m0, m1)`` may see (``m1 > m0``), by the masks' bounds."""
    hi = n_sk
    # 0, written so that TVM cannot prove it (the window argument is >= 0, which only the host knows):
    # a T.Pipelined loop from a provable 0 to a dynamic end fails TileLang 0.1.15's cp.async pipeline
    # (sm_80, and sm_90 with pipeline 1: "Downcast from tirx.Sub to ir.IntImm" in a cp.async wait,
    # seen here for every non-windowed kernel); from an opaque start it lowers. Not min(0, the key
    # count): a shape variable is known >= 0, so TVM folds that to 0
    lo = T.min(0, window)
    if spec.causal:
        hi = _clamp(m1 - 1 + off + 1, 0, n_sk)
    if spec.window:
        lo = _clamp(m0 + off - window + 1, 0, n_sk)
    return lo, hi


def _visible(spec: AttnKernelSpec, i, j, n_sk, off, window):
    """Whether row ``i`` sees key ``j`` (``j`` may lie past the keys: then not)."""
    ok = j < n_sk
    if spec.causal:
        ok = T.And(ok, j <= i + off)
    if spec.window:
        ok = T.And(ok, j > i + off - window)
    return ok


def _score(spec: AttnKernelSpec, dot, scale, cap):
    """A raw dot product -> the base-2 logit: ``s = dot * scale``, softcapped, times log2(e)."""
    if spec.softcap:
        return cap * T.tanh(dot * scale / cap) * T.float32(_LOG2E)
    return dot * (scale * T.float32(_LOG2E))


# ------------------------------------------------------------------------------------ C schedule
def _c(spec: AttnKernelSpec, st: str):
    D, HQ, G = spec.head_dim, spec.hq, spec.hq // spec.hkv
    dt = spec.dtype
    check = _check_cu(spec)

    @T.macro
    def body(Q, K, V, O, LSE, CUQ, CUK, ERR, tag, batch, nb, sq, sk, tiles, qsb, qss, qsh, ksb, kss,
             ksh, vsb, vss, vsh, osb, oss, osh, lsb, lsh, has_lse, scale_bits, cap_bits, window):
        # grid: (query rows, heads, nb); dense: sq rows a sequence, nb = batch; varlen: every token
        # (sq = tiles = total_q, nb = 1), each finding its sequence by a scan of CUQ
        with T.Kernel(tiles, HQ, nb, threads=1) as (r, h, bz):
            qv = T.alloc_local((D,), "float32")
            acc = T.alloc_local((D,), "float32")
            st_ = T.alloc_local((4,), "float32")  # running max (base 2), running sum, score, rescale
            seq = T.alloc_local((6,), "int32")  # b, q0, nq, k0, nk, live
            scale = T.reinterpret(scale_bits, "float32")
            cap = T.reinterpret(cap_bits, "float32")
            if spec.varlen:
                if r == 0 and h == 0:
                    check(CUQ, CUK, ERR, tag, batch, sq, sk)
                # the sequence holding token r: the last b with clamp(CUQ[b]) <= r < clamp(CUQ[b + 1])
                seq[0] = -1
                for b in T.serial(batch):
                    a0 = _clamp(CUQ[b], 0, sq)
                    a1 = _clamp(CUQ[b + 1], a0, sq)
                    if a0 <= r and r < a1:
                        seq[0] = b
                seq[5] = T.if_then_else(seq[0] >= 0, 1, 0)
                if seq[5] == 1:
                    seq[1] = _clamp(CUQ[seq[0]], 0, sq)
                    seq[2] = _clamp(CUQ[seq[0] + 1], seq[1], sq) - seq[1]
                    seq[3] = _clamp(CUK[seq[0]], 0, sk)
                    seq[4] = _clamp(CUK[seq[0] + 1], seq[3], sk) - seq[3]
            else:
                seq[0] = bz
                seq[1] = 0
                seq[2] = sq
                seq[3] = 0
                seq[4] = sk
                seq[5] = 1
            if seq[5] == 1:
                # the batch strides step by bz (varlen: 0, one "batch" of every token; seq[0] is the
                # sequence, whose rows and keys start at its offsets instead)
                i = r - seq[1]  # the row within its sequence
                n_sk = seq[4]
                off = n_sk - seq[2]
                kvh = h // G
                qo = T.cast(bz, "int64") * qsb + T.cast(r, "int64") * qss + T.cast(h, "int64") * qsh
                for d in T.serial(D):
                    qv[d] = load_f32(Q, qo + d, st, dt)
                    acc[d] = T.float32(0)
                st_[0] = -T.infinity("float32")
                st_[1] = T.float32(0)
                lo, hi = _span(spec, i, i + 1, n_sk, off, window)
                for j in T.serial(lo, T.max(hi, lo)):
                    if _visible(spec, i, j, n_sk, off, window):
                        kr = T.cast(seq[3] + j, "int64")
                        ko = T.cast(bz, "int64") * ksb + kr * kss + T.cast(kvh, "int64") * ksh
                        vo = T.cast(bz, "int64") * vsb + kr * vss + T.cast(kvh, "int64") * vsh
                        st_[2] = T.float32(0)
                        for d in T.serial(D):
                            st_[2] = st_[2] + qv[d] * load_f32(K, ko + d, st, dt)
                        st_[2] = _score(spec, st_[2], scale, cap)
                        # online softmax, one key at a time: m' = max(m, s), acc and l rescaled by 2^(m - m').
                        # A score of -inf weighs 0: as a row's first key, 2^(s - m') was 2^(-inf + inf), NaN
                        # (a NaN score still gives NaN)
                        st_[3] = T.if_then_else(st_[2] > st_[0], T.exp2(st_[0] - st_[2]), T.float32(1))
                        st_[0] = T.max(st_[0], st_[2])
                        p = T.if_then_else(st_[2] == -T.infinity("float32"), T.float32(0), T.exp2(st_[2] - st_[0]))
                        st_[1] = st_[1] * st_[3] + p
                        for d in T.serial(D):
                            acc[d] = acc[d] * st_[3] + p * load_f32(V, vo + d, st, dt)
                oo = T.cast(bz, "int64") * osb + T.cast(r, "int64") * oss + T.cast(h, "int64") * osh
                # l != 0, not l > 0: only a row that saw no key (l exactly 0) outputs zeros; a NaN in q, k or
                # v makes l or acc NaN and the row NaN, as torch's attention gives, never a plausible zero
                for d in T.serial(D):
                    O[oo + d] = to_storage(T.if_then_else(st_[1] != 0, acc[d] / st_[1], T.float32(0)), st, dt)
                if has_lse != 0:
                    LSE[T.cast(bz, "int64") * lsb + T.cast(h, "int64") * lsh + T.cast(r, "int64")] = T.if_then_else(
                        st_[1] != 0, (st_[0] + T.log2(st_[1])) * T.float32(_LN2), -T.infinity("float32"))

    return body


# --------------------------------------------------------------------------------- CUDA schedule
def _cuda_func(spec: AttnKernelSpec, common: dict):
    """The CUDA ``T.prim_func``: q/k/v/out are 4-D strided tensors ``[nb, rows, heads, D]`` with dynamic
    extents and strides (the launcher passes them by name), so that tiles move with ``T.copy``: TMA on
    sm_90 (TileLang's descriptors, made on the host from the strides). On sm_80 the same program
    lowers to mma with predicated element-wise loads into shared memory: TileLang cannot prove a
    runtime stride a multiple of 8, so it neither vectorises nor uses cp.async there (strides written
    as ``s * 8`` to prove it could not be bound: TileLang's packed API takes only plain variables).
    Correct, and far from mma's speed: the H200 is the target."""
    D, HQ, HKV = spec.head_dim, spec.hq, spec.hkv
    dt = spec.dtype
    nb, sq, sk = T.dynamic("nb, sq, sk", "int32")
    qsb, qss, qsh, ksb, kss, ksh, vsb, vss, vsh, osb, oss, osh = T.dynamic(
        "qsb, qss, qsh, ksb, kss, ksh, vsb, vss, vsh, osb, oss, osh", "int64")
    sig = {"Q": T.StridedTensor((nb, sq, HQ, D), (qsb, qss, qsh, 1), dt),
           "K": T.StridedTensor((nb, sk, HKV, D), (ksb, kss, ksh, 1), dt),
           "V": T.StridedTensor((nb, sk, HKV, D), (vsb, vss, vsh, 1), dt),
           "O": T.StridedTensor((nb, sq, HQ, D), (osb, oss, osh, 1), dt), **common}
    body = _cuda(spec)

    @T.prim_func
    def attn_fwd(Q: sig["Q"], K: sig["K"], V: sig["V"], O: sig["O"], LSE: sig["LSE"], CUQ: sig["CUQ"],
                 CUK: sig["CUK"], ERR: sig["ERR"], tag: T.int32, batch: T.int32, tiles: T.int32, lsb: T.int64,
                 lsh: T.int64, has_lse: T.int32, scale_bits: T.int32, cap_bits: T.int32, window: T.int32):
        body(Q, K, V, O, LSE, CUQ, CUK, ERR, tag, batch, nb, sq, sk, tiles, lsb, lsh, has_lse, scale_bits, cap_bits,
             window)

    return attn_fwd


def _cuda(spec: AttnKernelSpec):
    D, HQ, G = spec.head_dim, spec.hq, spec.hq // spec.hkv
    dt = spec.dtype
    BM, BN, STAGES, THREADS = spec.tiles
    acc_t = "float32"
    check = _check_cu(spec)
    masked = spec.causal or spec.window
    # bisection steps that find a tile's sequence among up to 2^31 sequences
    steps = 31

    @T.macro
    def scores(S, m0, n0, sk, off, window, scale, cap):
        # only a tile a mask or the keys' end cuts is masked element by element, in a branch of its own:
        # one select an element for every tile (cut or visible) compiled to a branch an element, some 6
        # instructions each (BSSY/BRA/BSYNC, a third of a 16 x 1024 causal call's warp samples, H100)
        cut = n0 + BN > sk
        if spec.causal:
            cut = T.Or(cut, n0 + BN - 1 > m0 + off)
        if spec.window:
            cut = T.Or(cut, n0 <= m0 + BM - 1 + off - window)
        if spec.softcap:
            # the scale cannot move past tanh: the scores are made base-2 logits here (unit 1 below)
            for i, j in T.Parallel(BM, BN):
                S[i, j] = _score(spec, S[i, j], scale, cap)
        if cut:
            for i, j in T.Parallel(BM, BN):
                S[i, j] = T.if_then_else(_visible(spec, m0 + i, n0 + j, sk, off, window), S[i, j],
                                         -T.infinity(acc_t))

    @T.macro
    def softmax(S, m, m_prev, resc, rsum, lsum, unit):
        # S * unit is the base-2 logit (unit = scale * log2(e): S holds the raw dot products; 1 after a
        # softcap, which applied the scale itself), m is in base-2 logits. The scale rides in the
        # exponent's FFMA, exp2(S unit - m), as in FlashAttention-3, instead of a multiply an element
        # before the max (the row max commutes with it: scale > 0)
        T.copy(m, m_prev)
        T.reduce_max(S, rsum, dim=1, clear=True)
        # a row with no visible key so far keeps m = -inf: its rescale is 1 and its p are
        # exp2(-inf - 0) = 0, never exp2(-inf + inf) = NaN
        for i in T.Parallel(BM):
            m[i] = T.max(m_prev[i], rsum[i] * unit)
            resc[i] = T.if_then_else(m[i] == -T.infinity(acc_t), T.float32(1), T.exp2(m_prev[i] - m[i]))
        for i, j in T.Parallel(BM, BN):
            S[i, j] = T.call_extern(acc_t, "tileops_ex2", S[i, j] * unit - T.if_then_else(
                m[i] == -T.infinity(acc_t), T.float32(0), m[i]))
        T.reduce_sum(S, rsum, dim=1)
        for i in T.Parallel(BM):
            lsum[i] = lsum[i] * resc[i] + rsum[i]

    @T.macro
    def work(Q, K, V, O, LSE, Qs, Ks, Vs, Os, S, P, Acc, m, m_prev, resc, rsum, lsum, bz, h, q0, sq, k0, sk, tile,
             lsb, lsh, has_lse, scale, cap, window):
        # one q tile of one sequence: rows [q0 + tile * BM, + BM) of its sq against the keys [k0, k0 + sk).
        # The row and key counts are named as the kernel's extents on purpose: a macro's parameter
        # renames the variable it is given, and a dense call gives the extents themselves, which
        # TileLang's launcher then passes by the parameter's name (named otherwise, 'sq' went missing
        # from the kernel's arguments and the plan could not bind it: seen on the H200)
        off = sk - sq
        m0 = tile * BM
        kvh = h // G
        unit = T.float32(1) if spec.softcap else scale * T.float32(_LOG2E)
        # rows past the sequence but inside the buffer are read (another sequence's, varlen) and
        # never written back; past the buffer T.copy fills zeros
        T.copy(Q[bz, q0 + m0:q0 + m0 + BM, h, :], Qs)
        T.fill(Acc, 0)
        T.fill(lsum, 0)
        T.fill(m, -T.infinity(acc_t))
        # the K/V tiles [t0, t1) as expressions, never a name bound to the bare extent: assigning `sk`
        # to a name (``lo, hi = _span(...)``, hi being sk when nothing masks) renames the variable
        # itself, K's shape read [nb, hi, ...] and TileLang's launcher took "hi" for "sk" (seen on the
        # H200; :func:`build` now refuses a renamed extent)
        t0 = _span(spec, m0, T.min(m0 + BM, sq), sk, off, window)[0] // BN
        # At least one tile, even for rows that see no key (above a causal diagonal when seq_q > seq_k,
        # a window past the keys): that tile is cut, so masked whole (p = 0, lsum = 0: zeros and lse
        # -inf). A block that walked none never waited for its Q tile, which on sm_90 comes by TMA into
        # the shared memory the epilogue stages O in: the load landed over the staged zeros and Q's
        # values came out (seen on the H100 once the epilogue got fast). Skipping the load instead, in
        # an `if` around the loop, made ptxas serialise every wgmma (C7512: setmaxnreg under a branch)
        t1 = T.max(T.ceildiv(_span(spec, m0, T.min(m0 + BM, sq), sk, off, window)[1], BN), t0 + 1)
        if spec.overlap:
            # pipeline 4: iteration t issues Q K(t)^T and P(t-1) V(t-1) together (wgmma without its wait)
            # and runs tile t's softmax while P V runs, FlashAttention-3's intra-warpgroup overlap. One
            # iteration more than tiles, the first with no P V and the last with no softmax: its Q K^T
            # reads tile t1 - 1 again and is dropped (no loop peeling: TileLang 0.1.15 refuses a
            # multi-buffered K/V tile used outside its pipelined loop, "versioned buffer load escaped").
            # The Q K^T issue is unconditional and each wait sits in the branch that chose its count:
            # with either conditional, ptxas (13.0) saw a path where softmax wrote S under an unretired
            # wgmma and serialised every wgmma (C7515, seen here), which is the overlap undone.
            # The reads of Ks and Vs after the waits (``touch``) are where TileLang's warp
            # specialisation puts each tile's release to the producer: right after the last statement
            # that reads it, which an unwaited wgmma is not (checked in tests/test_attn_fwd.py).
            touch = T.alloc_local((2,), dt)
            per_thread_s, per_thread_acc = BM * BN // THREADS, BM * D // THREADS
            T.clear(P)  # (read by no wgmma before tile t0's softmax writes it; TileLang's check cannot tell)
            for t in T.Pipelined(t0, T.if_then_else(t1 > t0, t1 + 1, t0), num_stages=STAGES):
                tk = T.min(t, t1 - 1)
                tv = T.max(t - 1, t0)
                T.copy(K[bz, k0 + tk * BN:k0 + tk * BN + BN, kvh, :], Ks)
                T.copy(V[bz, k0 + tv * BN:k0 + tv * BN + BN, kvh, :], Vs)
                wg = T.get_thread_binding() // 128
                if T.And(wg == 1, t == t0):
                    T.named_barrier_arrive(PINGPONG_BARRIERS[0], 256)
                T.sync_threads(PINGPONG_BARRIERS[0] + wg, 256)
                T.wgmma_gemm(Qs, Ks, S, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                if t > t0:
                    T.wgmma_gemm(P, Vs, Acc, policy=T.GemmWarpPolicy.FullRow)
                    if T.Or(wg == 0, t < t1):
                        T.named_barrier_arrive(PINGPONG_BARRIERS[1] - wg, 256)
                    T.wait_wgmma(1)
                else:
                    if T.Or(wg == 0, t < t1):
                        T.named_barrier_arrive(PINGPONG_BARRIERS[1] - wg, 256)
                    T.wait_wgmma(0)
                # (the registers a wgmma wrote, read only after its wait: nvcc may not hoist the reads)
                T.warpgroup_fence_operand(S, 0, per_thread_s)
                touch[0] = Ks[0, 0]
                if t < t1:
                    scores(S, m0, t * BN, sk, off, window, scale, cap)
                    softmax(S, m, m_prev, resc, rsum, lsum, unit)
                T.wait_wgmma(0)
                T.warpgroup_fence_operand(Acc, 0, per_thread_acc)
                touch[1] = Vs[0, 0]
                if t < t1:
                    for i, d in T.Parallel(BM, D):
                        Acc[i, d] *= resc[i]
                    T.copy(S, P)
        else:
            for t in T.Pipelined(t0, t1, num_stages=STAGES):
                n0 = t * BN
                T.copy(K[bz, k0 + n0:k0 + n0 + BN, kvh, :], Ks)
                if spec.pingpong:
                    # warpgroup w waits on barrier w, issues its Q K^T (T.gemm waits for it), then lets
                    # the other go: 128 threads arrive and 128 wait on each, 256 a barrier. Warpgroup 1
                    # opens warpgroup 0's first turn and skips its last arrive, so that each barrier is
                    # arrived at as often as it is waited on (none is left half-arrived when the block
                    # exits). The thread index here is the consumers' own (0-255): TileLang renumbers
                    # it inside the warp-specialised loop (seen in the CUDA it emits)
                    wg = T.get_thread_binding() // 128
                    if T.And(wg == 1, t == t0):
                        T.named_barrier_arrive(PINGPONG_BARRIERS[0], 256)
                    T.sync_threads(PINGPONG_BARRIERS[0] + wg, 256)
                T.gemm(Qs, Ks, S, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                if spec.pingpong:
                    if T.Or(wg == 0, t < t1 - 1):
                        T.named_barrier_arrive(PINGPONG_BARRIERS[1] - wg, 256)
                scores(S, m0, n0, sk, off, window, scale, cap)
                softmax(S, m, m_prev, resc, rsum, lsum, unit)
                T.copy(S, P)
                for i, d in T.Parallel(BM, D):
                    Acc[i, d] *= resc[i]
                if spec.varlen:
                    # V rows past the sequence's keys are zeros, not the next sequence's values: their
                    # weight is an exact 0, but 0 x NaN (or Inf) is NaN, and a non-finite value of one
                    # sequence reached the last rows' outputs of the sequence packed before it. (K's
                    # rows there need nothing: a hidden score is replaced, not multiplied.) Dense calls
                    # read zeros past the keys already (T.copy's bound at the buffer's end). The loads
                    # are the ones T.copy made here before (predicated 2-byte loads: varlen has no TMA),
                    # now run just before P V instead of after the previous tile's; zeroing the rows
                    # after a T.copy instead, TileLang 0.1.15's pipeline planner refuses two writes to Vs
                    for j, d in T.Parallel(BN, D):
                        Vs[j, d] = T.if_then_else(n0 + j < sk, V[bz, k0 + n0 + j, kvh, d], T.cast(0, dt))
                else:
                    T.copy(V[bz, k0 + n0:k0 + n0 + BN, kvh, :], Vs)
                T.gemm(P, Vs, Acc, policy=T.GemmWarpPolicy.FullRow)
        # one reciprocal a row, then multiplies: a division an element was IEEE fdiv with its slow
        # path, some 10% of a 16 x 1024 causal call's warp samples (Nsight Compute, H100)
        for i in T.Parallel(BM):
            resc[i] = T.float32(1) / lsum[i]
        for i, d in T.Parallel(BM, D):
            # (lsum != 0, not > 0: a NaN input gives NaN rows, a row that saw no key zeros; see _c)
            Acc[i, d] = T.if_then_else(lsum[i] != 0, Acc[i, d] * resc[i], T.float32(0))
        T.copy(Acc, Os)
        if spec.varlen:
            # rows past the sequence belong to the next packed one: written element by element, guarded
            for i, d in T.Parallel(BM, D):
                if m0 + i < sq:
                    O[bz, q0 + m0 + i, h, d] = Os[i, d]
        else:
            # the tile at once (TMA on sm_90, which drops the rows past sq): the guarded element-wise
            # store it replaces, 64-bit index arithmetic an element, was a quarter of the same samples
            T.copy(Os, O[bz, m0:m0 + BM, h, :])
        if has_lse != 0:
            for i in T.Parallel(BM):
                if m0 + i < sq:
                    LSE[T.cast(bz, "int64") * lsb + T.cast(h, "int64") * lsh
                        + T.cast(q0 + m0 + i, "int64")] = T.if_then_else(
                        lsum[i] != 0, (m[i] + T.log2(lsum[i])) * T.float32(_LN2), -T.infinity(acc_t))

    @T.macro
    def body(Q, K, V, O, LSE, CUQ, CUK, ERR, tag, batch, nb, sq, sk, tiles, lsb, lsh, has_lse, scale_bits, cap_bits,
             window):
        with T.Kernel(tiles, HQ, nb, threads=THREADS) as (bx, h, bz):
            T.import_source(EX2_SOURCE + (REPORT_SOURCE if spec.varlen else ""))  # (one import a kernel)
            Qs = T.alloc_shared((BM, D), dt)
            Ks = T.alloc_shared((BN, D), dt)
            Vs = T.alloc_shared((BN, D), dt)
            Os = T.alloc_shared((BM, D), dt)
            S = T.alloc_fragment((BM, BN), acc_t)
            P = T.alloc_fragment((BM, BN), dt)
            Acc = T.alloc_fragment((BM, D), acc_t)
            m = T.alloc_fragment((BM,), acc_t)
            m_prev = T.alloc_fragment((BM,), acc_t)
            resc = T.alloc_fragment((BM,), acc_t)
            rsum = T.alloc_fragment((BM,), acc_t)
            lsum = T.alloc_fragment((BM,), acc_t)
            scale = T.reinterpret(scale_bits, "float32")
            cap = T.reinterpret(cap_bits, "float32")

            if spec.varlen:
                # the block's sequence and tile, in registers: b, q0, nq, k0, nk, tile, live, bisection scratch
                seq = T.alloc_local((8,), "int32")
                if bx == 0 and h == 0:
                    check(CUQ, CUK, ERR, tag, batch, sq, sk)
                # slot base(b) = floor(CUQ[b] / BM) + b is non-decreasing; the block's sequence is the
                # last b < batch with base(b) <= bx (bisection on [0, batch))
                seq[0] = 0
                seq[7] = batch
                for _ in T.serial(steps):
                    if seq[7] - seq[0] > 1:
                        mid = (seq[0] + seq[7]) // 2
                        if _clamp(CUQ[mid], 0, sq) // BM + mid <= bx:
                            seq[0] = mid
                        else:
                            seq[7] = mid
                seq[1] = _clamp(CUQ[seq[0]], 0, sq)
                seq[2] = _clamp(CUQ[seq[0] + 1], seq[1], sq) - seq[1]
                seq[3] = _clamp(CUK[seq[0]], 0, sk)
                seq[4] = _clamp(CUK[seq[0] + 1], seq[3], sk) - seq[3]
                seq[5] = bx - (seq[1] // BM + seq[0])
                seq[6] = T.if_then_else(T.And(seq[5] >= 0, seq[5] * BM < seq[2]), 1, 0)
                if seq[6] == 1:
                    work(Q, K, V, O, LSE, Qs, Ks, Vs, Os, S, P, Acc, m, m_prev, resc, rsum, lsum, bz, h, seq[1], seq[2],
                         seq[3], seq[4], seq[5], lsb, lsh, has_lse, scale, cap, window)
            else:
                # dense: what the K/V loop reads is an expression of the block's indices and the arguments,
                # never a register written first. TileLang 0.1.15's warp specialisation (pipeline 2) gives
                # its producer warpgroup a copy of each local buffer the loop reads, but not the values
                # stored into it before the loop: the producer's bounds were garbage and the first H200
                # call deadlocked (benchmarks/NOTES.md, "the forward's deadlock"). The last row tiles
                # go first: under a causal mask they have the most keys, so the longest blocks start in
                # the first wave.
                work(Q, K, V, O, LSE, Qs, Ks, Vs, Os, S, P, Acc, m, m_prev, resc, rsum, lsum, bz, h, 0, sq, 0, sk,
                     T.if_then_else(masked, tiles - 1 - bx, bx), lsb, lsh, has_lse, scale, cap, window)

    return body


def flops(batch: int, hq: int, sq: int, sk: int, head_dim: int, causal: bool) -> float:
    """The FLOPs the issue's table counts: ``4 * sq * sk * D * Hq`` a sequence, halved when causal."""
    f = 4.0 * batch * sq * sk * head_dim * hq
    return f / 2 if causal else f


assert math.isclose(_LOG2E * _LN2, 1.0)
