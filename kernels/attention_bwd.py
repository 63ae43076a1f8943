"""The backward of attention as TileLang tile programs: ``delta``, then ``dk``/``dv``, then ``dq``.

One builder serves the three kernels of FlashAttention-2's backward; a spec's ``kind`` picks the
program:

* ``prep``: ``delta[b, h, i] = sum_d dO[b, i, h, d] * O[b, i, h, d]`` in fp32, laid out like lse;
* ``dkdv``: one program per (kv block, kv head, batch). It loads its K and V rows once, then walks
  the q blocks that can see them (whole tiles outside the causal/window band are skipped: the loop's
  bounds, :func:`_q_blocks`) for every q head of its GQA group, and accumulates ``dk``, ``dv`` in
  fp32, written once: each kv head's gradient is the sum over its group, and no other program
  touches its rows;
* ``dq``: one program per (q block, q head, batch) over the kv blocks its rows can see
  (:func:`_kv_blocks`), ``dq`` accumulated in fp32 and written once.

Both gradient programs recompute ``s = q.k`` and ``dp = dO.v`` (seven tile products a tile where an
atomic ``dq`` needs five), so that every gradient element is a sum in a fixed order: the same inputs
give the same bits, as the norm's backward does.

The math, per visible (i, j) (``lse``: the forward's natural-log row sums; ``c``: the softcap)::

    s = scale * q_i . k_j;  with softcap: t = tanh(s / c), s = c * t
    p = exp(s - lse_i)                   (0 where j is hidden from i: masked, never exp'd)
    dv_j += p * dO_i
    ds = p * (dO_i . v_j - delta_i);     with softcap: ds *= 1 - t^2  (d/ds c tanh(s / c))
    dk_j += scale * ds * q_i;  dq_i += scale * ds * k_j

Masks (the forward's contract): with ``off = Sk - Sq`` of the sequence, causal shows key j to query
i iff ``j <= i + off``; a window ``W`` (runtime scalar) hides ``j <= i + off - W``; rows past a
sequence's length are hidden. A query that sees no key gets p = 0 everywhere, so zero gradients,
whatever its lse (-inf).

Layout. q, o, dO, dq ``[B, Sq, Hq, D]`` and k, v, dk, dv ``[B, Sk, Hkv, D]`` with any strides on the
first three dims (``*sb``, ``*ss``, ``*sh``; head_dim contiguous), or varlen ``[total, H, D]`` with
int32 ``CUQ``/``CUK`` of ``B + 1`` offsets (the batch strides are then unused; a sequence's rows
are ``CU[b] .. CU[b + 1]``, length 0 allowed). lse and delta are fp32 ``[B, Hq, Sq]`` (``lsb``,
``lsh``; varlen ``[Hq, total_q]``: ``lsh`` alone), their token stride 1. ``Sq``/``Sk`` are the
dense lengths, or for varlen an upper bound of every sequence's length (``max_seqlen``; ``total``
serves, at the cost of programs that find no rows and return). q head ``h`` reads kv head
``h // G``; ``Hq = Hkv * G``. ``scale`` and ``softcap`` are fp32 runtime scalars.

Two schedules from one description (the same tile bounds and masks, :func:`_q_blocks`,
:func:`_kv_blocks`, :func:`_visible`):

* ``cuda``: tensor cores through ``T.gemm`` (wgmma on sm_90, mma on sm_80). dk/dv works transposed
  as TileLang's own example does: ``sT = K Q^T`` and ``dpT = V dO^T`` are ``[block_kv, block_q]``
  fragments, so ``pT`` and ``dsT`` are already the A operands of ``dV += pT dO`` and
  ``dK += dsT Q``. Q/dO tiles (dk/dv) and K/V tiles (dq) stream through shared memory under
  ``T.Pipelined`` (``cp.async``). A tile's rows past its sequence load the sequence's last row again
  (:func:`_last`): memory past the tensor may hold a NaN, which would survive ``0 * x`` in a tile
  product; a real row is finite, and the mask zeroes its p and ds. Strides are in units of 8
  elements (16 bytes), so that the compiler can prove every row's alignment and keep 16-byte copies
  (the host checks pointers and strides divide). Arithmetic fp32; ``p`` and ``ds`` are rounded to the input dtype for the tensor
  cores, as FlashAttention does. ``exp`` through ``exp2`` with log2(e) folded into the scale.
* ``c``: TileLang's C backend (``T.gemm`` does not lower for target ``c``: its fragment layouts
  need threads), plain loops in fp32 over the same tiles, one program per tile, for CPU correctness.

Workspace: ``delta``, fp32, one element per (q row, q head): ``B * Hq * Sq`` dense, ``Hq * total_q``
varlen. Nothing else: dq, dk, dv are written once, in their own dtype and layout.

Run by ``AttnFwdOp``'s backward, one plan of the three (``tileops/attention/attn_builtin.py``:
``BACKWARD``): delta the plan's per-call workspace, lse the forward's, ``Sq``/``Sk`` the token counts
for varlen calls (no host synchronisation for the max length), ``W`` 0 without a window.
"""

from dataclasses import dataclass
from typing import Any

from .attention import EX2_SOURCE
from .storage import load_f32, storage_dtype, to_storage

#: ``tilelang.language``, imported when a kernel is first built (:func:`_tl`)
T: Any = None

__all__ = ["AttnBwdKernelSpec", "build_attention_bwd", "build", "Spec", "STATIC", "PREP_ARGS", "DKDV_ARGS",
           "DQ_ARGS", "PREP_TMA_ARGS", "DKDV_TMA_ARGS", "DQ_TMA_ARGS", "TMA_EXTENTS", "HEAD_DIMS", "delta_numel",
           "padded_rows"]

#: The schedule choices a manifest's ``kernel.static`` may set; 0 takes the H200 default for the head
#: dim (:data:`_DEFAULTS`). Every other field of :class:`AttnBwdKernelSpec` the op derives from the call.
STATIC = {
    "dkdv_block_kv": (0, 256, "kv rows of a dk/dv program (its tile of K, V, dK, dV); 0: the default (CUDA, C)"),
    "dkdv_block_q": (0, 256, "q rows the dk/dv program takes a step (its Q/dO tile); 0: the default (CUDA, C)"),
    "dkdv_threads": (0, 512, "threads of a dk/dv program, a multiple of 128 (a warpgroup); 0: the default (CUDA)"),
    "dq_block_q": (0, 256, "q rows of a dq program; 0: the default (CUDA, C)"),
    "dq_block_kv": (0, 256, "kv rows the dq program takes a step (its K/V tile); 0: the default (CUDA, C)"),
    "dq_threads": (0, 512, "threads of a dq program, a multiple of 128; 0: the default (CUDA)"),
    "stages": (0, 4, "shared-memory stages of the streamed tiles (T.Pipelined; CUDA: 1, see _DEFAULTS); 0: the "
                     "default"),
    "ds_shared": (0, 2, "where p and ds meet the tensor cores: 1 registers (the A operand of wgmma/mma), 2 shared "
                        "memory; 0: the default (shared at head_dim 256) (CUDA)"),
    "loads": (0, 2, "how the streamed tiles reach shared memory (CUDA): 1 every thread (cp.async, one stage), 2 TMA "
                    "from a producer warpgroup TileLang adds on sm_90 (dense calls only); 0: the default (2 for a "
                    "dense call, 1 for varlen)"),
    "overlap": (0, 3, "which tile products a step leaves running while it computes (TMA programs, sm_90): 1 none, "
                      "each waited on where issued; 2 the two score products issued together, p's exp2 under the "
                      "second; 3 (dk/dv) also dV += pT dO issued before ds, ds under it; 0: the default, 1 "
                      "(_DEFAULT_OVERLAP)"),
}

HEAD_DIMS = (64, 80, 96, 128, 256)
_KINDS = ("prep", "dkdv", "dq")
_DTYPES = ("float16", "bfloat16", "float32")
#: elements a CUDA stride unit holds: 16 bytes of a 16-bit dtype (every head dim divides by 8)
_VEC = 8
#: rows of a ``prep`` program
_PREP_ROWS = 32
_LOG2E = 1.4426950408889634

#: H200 defaults per head dim: (dkdv_block_kv, dkdv_block_q, dkdv_threads, dq_block_q, dq_block_kv,
#: dq_threads, stages, ds_shared). The dk/dv program keeps two fp32 [block_kv, D] accumulators in registers:
#: at D 128, 128 rows over 256 threads are 128 registers a thread, so its q step stays at 32
#: (sT and dpT, [128, 32] fp32: 32 more), as TileLang's GQA backward example chooses; D 256 halves
#: the kv rows. The dq program holds one [block_q, D] accumulator and two [block_q, block_kv]
#: score tiles. At D 256 the 64-row tiles split over two warpgroups by columns, so p and ds, the
#: A operand of the next products, would be needed whole in both: TileLang 0.1.15 refused that
#: fragment layout (sm_90), and they pass through shared memory (``ds_shared`` 2; the default
#: wherever a tile splits so: ``AttnBwdKernelSpec.split_by_columns``). Starting points
#: for ``benchmarks/attention_bwd.py --configs``, not yet measured. One stage: TileLang 0.1.15's
#: ``T.Pipelined`` at 2 stages over a dynamic trip count ends without waiting on the last tile's
#: ``cp.async`` (its epilogue's wait is guarded by ``t < end``, never true there; read in the CUDA it
#: emits), so the last K/V or q tile could be read before it landed: sanitize's shrunk cases on the
#: H200, one tile each, had dq off by up to 1.9 in 634 of 65536 elements. At one stage every compute
#: waits on its copies.
_DEFAULTS = {64: (128, 64, 256, 128, 64, 256, 1, 1), 80: (128, 32, 256, 128, 64, 256, 1, 1),
             96: (128, 32, 256, 128, 64, 256, 1, 1), 128: (128, 32, 256, 128, 64, 256, 1, 1),
             256: (64, 32, 256, 64, 64, 256, 1, 2)}
#: TMA programs (``loads`` 2): the knobs whose default differs from :data:`_DEFAULTS`, per head dim. The dk/dv
#: program's q step at 64 rows: with the step's loads behind mbarriers, a wider wgmma N (64, not 32) paid
#: on the H100, dk/dv 17.9 -> 14.7 ms at 1 x 16384 and 727 -> 576 us at 16 x 1024 causal (GQA 32/8, bf16;
#: benchmarks/NOTES.md, the twentieth session); 168 registers, no spill (ptxas 13.0) at D 96 and 128. The dq
#: program's K/V step at 128 keys: 1.01-1.07x the backward at D 128 on the H200's four rows, side by side
#: (dq 11.45 -> 10.04 ms at 1 x 16384, 460 -> 430 us at 16 x 1024 causal; the twenty-first session).
#: At D 64 both are 128 wide: the dk/dv program's [128, 128] sT and dpT fit beside its 64-wide accumulators,
#: and the backward went 456 -> 406 us at HF Llama's 4 x 2048 causal (16/4 heads; dk/dv 277 -> 239, dq
#: 166 -> 151) and 2588 -> 2261 us at 4 x 4096 causal (32/8), side by side on an H100 (benchmarks.attention_bwd
#: --head-dim 64; the thirty-second session). Three stages, 64 kv rows over 128 threads, and (tried before
#: the tiles were held to powers of two again) 192 kv rows over 384 threads were each slower there
_TMA_DEFAULTS = {"dkdv_block_q": {64: 128, 96: 64, 128: 64}, "dq_block_kv": {64: 128, 128: 128}}
#: the C schedule's default tiles: small, so that the CPU tests cross tile edges with short sequences
_C_DEFAULTS = (16, 16, 1, 16, 16, 1, 1, 1)
#: ``overlap``'s default. Levels 2 and 3 are written and checked without a GPU (the CUDA, ptxas and the SASS for
#: sm_90a; benchmarks/NOTES.md, the thirty-sixth and thirty-seventh sessions), not yet run on one: until their CUDA
#: tests pass and they measure faster, the default stays the program every earlier figure was measured on, whose
#: CUDA level 1 emits byte for byte. :attr:`AttnBwdKernelSpec.overlap_best` is the level that would replace it
_DEFAULT_OVERLAP = 1
#: fp32 registers a consumer thread may hold live in the dk/dv program for ``overlap`` 3 to be its best: the
#: dk and dv accumulators, sT and dpT, and pT and dsT (half words, bf16/fp16) all at once, ds being computed while
#: dV's product reads pT. 224 admits head_dim 80 to 128 (128: 224 words; 168 registers, no spill, nvcc 13.0
#: sm_90a); head_dim 64's 128-row q step needs 256, and ptxas 13.0 serialised every wgmma of that build
#: (C7512, TileLang's 240-register consumers): it takes 2
_OVERLAP_WORDS = 224

_STRIDES = {"Q": "q", "K": "k", "V": "v", "O": "o", "DO": "do", "DQ": "dq", "DK": "dk", "DV": "dv"}


def _strides(*tensors: str) -> tuple[str, ...]:
    return tuple(f"{_STRIDES[t]}s{x}" for t in tensors for x in ("b", "s", "h"))


#: the generated functions' parameters, in order, per kind. The launcher binds arguments by these
#: names; a pointer the spec does not use (CUQ/CUK of a dense call) is passed as 0.
PREP_ARGS = ("O", "DO", "DELTA", "CUQ", "B", "Hq", "Sq", *_strides("O", "DO"), "lsb", "lsh")
_GRAD_IN = ("Q", "K", "V", "DO", "LSE", "DELTA")
_SCALARS = ("CUQ", "CUK", "B", "Hkv", "G", "Sq", "Sk", "W", "scale", "softcap")
DKDV_ARGS = (*_GRAD_IN, "DK", "DV", *_SCALARS, *_strides("Q", "K", "V", "DO"), "lsb", "lsh",
             *_strides("DK", "DV"))
DQ_ARGS = (*_GRAD_IN, "DQ", *_SCALARS, *_strides("Q", "K", "V", "DO"), "lsb", "lsh", *_strides("DQ"))


#: TMA programs (``loads`` 2): the prep's parameters (it reads the forward's lse by its strides and writes
#: ``lse * log2(e)`` and delta padded, :func:`padded_rows`); the gradient programs' (their tensors' sizes
#: and strides are the dynamic extents :data:`TMA_EXTENTS`)
PREP_TMA_ARGS = ("O", "DO", "LSE", "LSE2", "DELTA", "CUQ", "B", "Hq", "Sq", *_strides("O", "DO"), "lsb", "lsh", "dlh")
DKDV_TMA_ARGS = ("Q", "K", "V", "DO", "LSE2", "DELTA", "DK", "DV", "G", "W", "scale", "softcap")
DQ_TMA_ARGS = ("Q", "K", "V", "DO", "LSE2", "DELTA", "DQ", "G", "W", "scale", "softcap")
#: the TMA gradient programs' dynamic extents and strides (in elements), by name
TMA_EXTENTS = ("B", "Sq", "Sk", "Hq", "Hkv", "dlb", "dlh", *_strides("Q", "K", "V", "DO", "DQ", "DK", "DV"))
#: lse2 and delta rows are padded to a multiple of this many fp32 elements: 16 bytes, TMA's stride unit
_PAD = 4


def padded_rows(seq_q: int) -> int:
    """``dlh``: the row stride of the padded ``[B, Hq, dlh]`` lse2 and delta of the TMA programs."""
    return -(-seq_q // _PAD) * _PAD


def delta_numel(batch: int, num_q_heads: int, seq_q: int, total_q: "int | None" = None) -> int:
    """Elements of the fp32 ``delta`` workspace: one per (q row, q head), laid out like lse."""
    return num_q_heads * total_q if total_q is not None else batch * num_q_heads * seq_q


@dataclass(frozen=True)
class AttnBwdKernelSpec:
    """Everything an attention-backward kernel is compiled for; two equal specs share one kernel."""

    kind: str  # prep | dkdv | dq
    head_dim: int  # D, compiled in
    dtype: str = "bfloat16"  # q, k, v, o, dO and the gradients (fp32 on the C backend only)
    causal: bool = False
    window: bool = False  # a sliding window, its width the runtime scalar W
    softcap: bool = False  # c * tanh(s / c), c the runtime scalar softcap
    varlen: bool = False  # rows located through CUQ/CUK
    backend: str = "cuda"  # cuda | c
    dkdv_block_kv: int = 0
    dkdv_block_q: int = 0
    dkdv_threads: int = 0
    dq_block_q: int = 0
    dq_block_kv: int = 0
    dq_threads: int = 0
    stages: int = 0
    ds_shared: int = 0
    loads: int = 0
    overlap: int = 0

    def __post_init__(self) -> None:
        for name, value, choices in (("kind", self.kind, _KINDS), ("dtype", self.dtype, _DTYPES),
                                     ("backend", self.backend, ("cuda", "c")),
                                     ("head_dim", self.head_dim, HEAD_DIMS)):
            if value not in choices:
                raise ValueError(f"{name}: expected one of {', '.join(map(repr, choices))}, got {value!r}")
        for name in ("causal", "window", "softcap", "varlen"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        if self.backend == "cuda" and self.dtype == "float32":
            raise ValueError("dtype: the CUDA schedule's tensor cores take float16 or bfloat16, got 'float32'")
        for key, (low, high, _) in STATIC.items():
            v = getattr(self, key)
            if type(v) is not int or not low <= v <= high:
                raise ValueError(f"{key}: expected an int in [{low}, {high}], got {v!r}")
        for name in ("dkdv_block_kv", "dkdv_block_q", "dq_block_q", "dq_block_kv"):
            v = self.tile(name)
            # powers of two: a dk/dv q step of 112 rows (a multiple of the wgmma's 16) stopped the H100 with
            # "misaligned address" while 96 and 192 ran (benchmarks/NOTES.md, the thirty-second session);
            # every tile measured faster was a power of two
            if v < 1 or v & (v - 1) or (self.backend == "cuda" and v < 16):
                raise ValueError(f"{name}: expected a power of two (at least 16 on CUDA), got {v}")
        for name in ("dkdv_threads", "dq_threads"):
            if self.backend == "cuda" and self.tile(name) % 128:
                raise ValueError(f"{name}: expected a multiple of 128 (a warpgroup), got {self.tile(name)}")
        if self.loads == 2 and self.varlen:
            raise ValueError("loads: 2 (TMA) addresses a dense [batch, seq, heads, head_dim] tensor; a varlen call's "
                             "tiles cross its sequences' ends, where TMA would read the next sequence's rows: "
                             "expected 1 or 0 (chosen), got 2")
        if self.backend == "cuda" and self.stages > 1 and not self.tma:
            raise ValueError(f"stages: TileLang 0.1.15's cp.async pipeline at 2 or more stages reads its last tile "
                             f"before the copy lands (see _DEFAULTS; loads 2, TMA, synchronises through mbarriers "
                             f"and takes more): expected 1 or 0 (the default, 1), got {self.stages}")
        if self.ds_shared == 1 and self.split_by_columns:
            rows, threads = self.score_rows, self.threads
            raise ValueError(f"ds_shared: 1 (p and ds in registers) needs the {self.kind} program's {rows}-row tile "
                             f"in slices of 64 rows a warpgroup; {threads} threads split it by columns, which "
                             f"TileLang 0.1.15 cannot lay out: expected 2 (shared memory) or 0 (chosen), got 1")
        if self.overlap >= 2:
            if self.kind == "prep":
                raise ValueError(f"overlap: the prep program has no tile products to overlap: expected 1 or 0, got "
                                 f"{self.overlap}")
            if self.overlap == 3 and self.kind == "dq":
                raise ValueError("overlap: 3 issues dV's product under ds, which the dq program has not: expected 0, "
                                 "1 or 2, got 3")
            if not self.overlaps_possible:
                why = ("the C schedule (no tensor cores)" if self.backend == "c" else
                       "a softcap (its tanh feeds p and ds both)" if self.softcap else
                       "p and ds through shared memory (ds_shared 2)" if self.tile("ds_shared") == 2 else
                       "tiles loaded by every thread (overlap needs loads 2, TMA, and sm_90's wgmma)")
                raise ValueError(f"overlap: {self.overlap} leaves tile products running, which this {self.kind} "
                                 f"program cannot with {why}: expected 1 or 0 (chosen), got {self.overlap}")

    def tile(self, name: str) -> int:
        """A schedule knob's value: the field, or (0) the default for the head dim and backend;
        ``ds_shared``'s default is 2 wherever the tile is split by columns (:attr:`split_by_columns`),
        ``overlap``'s :data:`_DEFAULT_OVERLAP`."""
        v = getattr(self, name)
        if v:
            return v
        if name == "overlap":
            return _DEFAULT_OVERLAP
        if name == "ds_shared" and self.split_by_columns:
            return 2
        if name == "loads":
            # TMA (2) wherever it can address the tensors, dense CUDA calls (faster than every thread's loads on
            # every row measured: benchmarks/NOTES.md); a varlen call's rows are not a box TMA can describe
            return 2 if self.backend == "cuda" and not self.varlen else 1
        if name == "stages" and self.tma:
            return 2
        if self.tma and self.head_dim in _TMA_DEFAULTS.get(name, {}):
            return _TMA_DEFAULTS[name][self.head_dim]
        table = _C_DEFAULTS if self.backend == "c" else _DEFAULTS[self.head_dim]
        return table[tuple(STATIC).index(name)]

    @property
    def overlaps_possible(self) -> bool:
        """Whether this program can leave a tile product running while it computes (``overlap`` 2 or 3): a
        dk/dv or dq program with its tiles by TMA (``T.wgmma_gemm``, Hopper's asynchronous wgmma), p and ds
        in registers (``ds_shared`` 1: through shared memory the next product waits on its copy anyway) and
        no softcap (its tanh feeds p and ds both, so p could not go ahead of dp's product)."""
        return self.kind != "prep" and self.tma and not self.softcap and self.tile("ds_shared") == 1

    @property
    def overlap_words(self) -> int:
        """fp32 registers a dk/dv consumer thread holds live at ``overlap`` 3 (:data:`_OVERLAP_WORDS`): dk and dv,
        sT and dpT, and pT and dsT in the 16-bit dtype (half a register an element)."""
        bn, bm, d = self.block_kv, self.block_q, self.head_dim
        return (2 * bn * d + 3 * bn * bm) // self.threads

    @property
    def overlap_best(self) -> int:
        """The highest ``overlap`` that applies and fits this program: 1 where no product can be left running
        (:attr:`overlaps_possible`), dq's 2, dk/dv's 3 where :attr:`overlap_words` fit :data:`_OVERLAP_WORDS`, else
        2. Not yet the default (:data:`_DEFAULT_OVERLAP`)."""
        if not self.overlaps_possible:
            return 1
        return 3 if self.kind == "dkdv" and self.overlap_words <= _OVERLAP_WORDS else 2

    @property
    def tma(self) -> bool:
        """Whether this CUDA program's tiles come by TMA (``loads`` 2, dense calls): q, k, v, dO and the
        gradients as 4-D strided tensors, lse and delta as the padded ``[B, Hq, dlh]`` rows ``prep``
        writes (:func:`padded_rows`), the streamed tiles pipelined at ``stages`` (2 by default) through
        the mbarriers of the producer warpgroup TileLang adds, as the forward's are."""
        return self.backend == "cuda" and self.tile("loads") == 2

    @property
    def split_by_columns(self) -> bool:
        """CUDA dk/dv and dq programs: whether their warpgroups share the score tile's rows (fewer than
        64 a warpgroup, the wgmma's M), so that each holds a slice of columns. p and ds, the A operand of
        the next products, are then needed whole in every warpgroup: TileLang 0.1.15 refuses that
        fragment layout ("Layout infer conflict between s_f and ds_f", the H200 with ``dq_block_q`` 64
        at 256 threads), so they must pass through shared memory (``ds_shared`` 2)."""
        if self.backend != "cuda" or self.kind == "prep":
            return False
        rows = self.score_rows
        return rows // (self.threads // 128) < 64

    @property
    def score_rows(self) -> int:
        """Rows of the score tile the program's warpgroups share: kv rows in dk/dv (``sT``), q rows in dq."""
        return self.block_kv if self.kind == "dkdv" else self.block_q

    @property
    def block_q(self) -> int:
        """q rows of a tile of this kind's program."""
        return _PREP_ROWS if self.kind == "prep" else self.tile(f"{self.kind}_block_q")

    @property
    def block_kv(self) -> int:
        """kv rows of a tile of this kind's program (``prep``: none)."""
        return 0 if self.kind == "prep" else self.tile(f"{self.kind}_block_kv")

    @property
    def threads(self) -> int:
        """Threads of one program (C: 1)."""
        if self.backend == "c":
            return 1
        return 128 if self.kind == "prep" else self.tile(f"{self.kind}_threads")

    @property
    def stride_unit(self) -> int:
        """The unit of the tensor strides the kernel takes (lse's are in elements): 8 elements on CUDA,
        1 on the C backend."""
        return _VEC if self.backend == "cuda" else 1

    def grid(self, batch: int, num_q_heads: int, num_kv_heads: int, seq_q: int, seq_k: int) -> tuple[int, int, int]:
        """The launch grid ``(x, y, z)`` for these sizes (``seq_*``: the ``Sq``/``Sk`` arguments)."""
        if self.kind == "dkdv":
            return -(-seq_k // self.block_kv), num_kv_heads, batch
        return -(-seq_q // self.block_q), num_q_heads, batch

    @property
    def args(self) -> tuple[str, ...]:
        """The generated function's parameter names, in order (TMA programs: then their tensors' dynamic
        extents and strides, :data:`TMA_EXTENTS`, which the launcher passes by name)."""
        if self.tma:
            return {"prep": PREP_TMA_ARGS, "dkdv": DKDV_TMA_ARGS, "dq": DQ_TMA_ARGS}[self.kind]
        return {"prep": PREP_ARGS, "dkdv": DKDV_ARGS, "dq": DQ_ARGS}[self.kind]


def _tl() -> Any:
    global T
    if T is None:
        import tilelang.language as tl

        T = tl
    return T


def build_attention_bwd(spec: AttnBwdKernelSpec):
    """The ``T.prim_func`` for ``spec``; its parameters are ``spec.args`` (the module's doc)."""
    _tl()
    return {"prep": _prep, "dkdv": _dkdv, "dq": _dq}[spec.kind](spec)


# ------------------------------------------------------------------------------ shared pieces
def _flat(*tensors: str):
    """The dynamic extents of flat buffers, one per tensor, named ``N<tensor>`` (the launcher passes
    them after the parameters; the kernels never read them)."""
    got = T.dynamic(", ".join(f"N{t}" for t in tensors))
    return got if len(tensors) > 1 else (got,)


def _i64(x):
    return T.cast(x, "int64")


class _Seq:
    """Where batch ``b``'s rows lie: its first row (varlen: ``CU[b]``; dense: 0) and its length."""

    def __init__(self, spec: AttnBwdKernelSpec, CU, b, S):
        if spec.varlen:
            self.first, self.len = CU[b], CU[b + 1] - CU[b]
        else:
            self.first, self.len = 0, S
        self.varlen, self.b = spec.varlen, b

    def row(self, i, h, sb, ss, sh, unit: int):
        """Offset (elements) of row ``i`` of head ``h`` in a tensor of strides ``sb, ss, sh`` (in ``unit``)."""
        if self.varlen:
            return (_i64(self.first + i) * ss + _i64(h) * sh) * unit
        return (_i64(self.b) * sb + _i64(i) * ss + _i64(h) * sh) * unit

    def lse(self, i, h, lsb, lsh):
        """Offset of row ``i`` of head ``h`` in lse (and delta): ``[B, Hq, S]`` or varlen ``[Hq, total]``."""
        if self.varlen:
            return _i64(h) * lsh + _i64(self.first + i)
        return _i64(self.b) * lsb + _i64(h) * lsh + _i64(i)


def _visible(spec: AttnBwdKernelSpec, i, j, sq, sk, W):
    """Whether query ``i`` sees key ``j`` of a sequence of ``sq`` queries and ``sk`` keys."""
    off = sk - sq
    cond = T.And(i < sq, j < sk)
    if spec.causal:
        cond = T.And(cond, j <= i + off)
    if spec.window:
        cond = T.And(cond, j > i + off - W)
    return cond


def _clamp(x, hi):
    return T.max(T.min(x, hi), 0)


def _zero(W):
    """0 for the first tile of a loop that starts at the first tile, as an expression of the window
    scalar ``W`` (the host passes ``W >= 0``, 0 without a window) that the compiler cannot fold: a
    pipelined loop (CUDA) starting at a literal 0 made TileLang 0.1.15's codegen refuse its stage
    waits ("Downcast from tirx.Sub to ir.IntImm failed": dq without a window, dk/dv without causal),
    as commit f3302e0 found for the count."""
    return T.min(W, 0)


def _q_blocks(spec: AttnBwdKernelSpec, n0, BN, BM, sq, sk, W):
    """(first q block, count) that can see any of the kv rows ``n0 .. n0 + BN - 1`` (those past ``sk``
    see nothing): causal hides queries ``i < j - off`` from key j, a window those with
    ``i >= j - off + W``; whole blocks outside are never visited."""
    off = sk - sq
    lo = _clamp(n0 - off, sq) if spec.causal else _zero(W)
    hi = _clamp(T.min(n0 + BN, sk) - 1 - off + W, sq) if spec.window else sq
    first = T.truncdiv(lo, BM)
    return first, T.max(T.truncdiv(hi + BM - 1, BM) - first, 0)


def _kv_blocks(spec: AttnBwdKernelSpec, m0, BM, BN, sq, sk, W):
    """(first kv block, count) that rows ``m0 .. m0 + BM - 1`` of the queries can see: causal, keys
    up to ``i + off`` of the last row; a window, keys past ``i + off - W`` of the first."""
    off = sk - sq
    hi = _clamp(T.min(m0 + BM, sq) + off, sk) if spec.causal else sk
    lo = _clamp(m0 + off - W + 1, sk) if spec.window else _zero(W)
    first = T.truncdiv(lo, BN)
    return first, T.max(T.truncdiv(hi + BN - 1, BN) - first, 0)


def _capped(spec: AttnBwdKernelSpec, s, softcap):
    """(score after the softcap, ``1 - t^2``, its derivative) of a scaled score ``s``."""
    if not spec.softcap:
        return s, None
    t = T.tanh(s / softcap)
    return softcap * t, T.float32(1) - t * t


def _sig(spec: AttnBwdKernelSpec, names: tuple[str, ...]) -> dict[str, Any]:
    st = storage_dtype(spec.dtype, spec.backend)
    ext = _flat(*names)
    return {n: T.Tensor((e,), "float32" if n in ("LSE", "LSE2", "DELTA") else "int32" if n in ("CUQ", "CUK") else st)
            for n, e in zip(names, ext)}


# ------------------------------------------------------------------------------------ delta
def _prep(spec: AttnBwdKernelSpec):
    D, BP, dt = spec.head_dim, _PREP_ROWS, spec.dtype
    # the CUDA row sum's fragment is a power of two wide, its columns past D zero: TileLang 0.1.15 found
    # no layout for T.reduce_sum over [32, 80] or [32, 96] on 128 threads ("no available layout found")
    DP = 1 << (D - 1).bit_length()
    st = storage_dtype(dt, spec.backend)
    U = spec.stride_unit
    sig = _sig(spec, ("O", "DO", "DELTA", "CUQ"))

    if spec.backend == "c":
        @T.macro
        def body(O, DO, DELTA, CUQ, B, Hq, Sq, osb, oss, osh, dosb, doss, dosh, lsb, lsh):
            with T.Kernel(T.ceildiv(Sq, BP), Hq, B, threads=1) as (mb, h, b):
                q = _Seq(spec, CUQ, b, Sq)
                acc = T.alloc_local((1,), "float32")
                for r in T.serial(BP):
                    i = mb * BP + r
                    if i < q.len:
                        oo, go = q.row(i, h, osb, oss, osh, U), q.row(i, h, dosb, doss, dosh, U)
                        acc[0] = T.float32(0)
                        for d in T.serial(D):
                            acc[0] = acc[0] + load_f32(O, oo + d, st, dt) * load_f32(DO, go + d, st, dt)
                        DELTA[q.lse(i, h, lsb, lsh)] = acc[0]
    else:
        def out_at(q, i, h, lsb, lsh, dlb, dlh):
            # (a function, not a name rebound in the macro: binding lsb to another name renames the variable)
            return q.lse(i, h, dlb, dlh) if spec.tma else q.lse(i, h, lsb, lsh)

        @T.macro
        def body(O, DO, DELTA, CUQ, B, Hq, Sq, osb, oss, osh, dosb, doss, dosh, lsb, lsh, LSE=None, LSE2=None, dlb=None,
                 dlh=None):
            # (TMA programs, spec.tma: delta and lse * log2(e) into the padded rows dlb, dlh; lse read by lsb, lsh)
            with T.Kernel(T.ceildiv(Sq, BP), Hq, B, threads=spec.threads) as (mb, h, b):
                q = _Seq(spec, CUQ, b, Sq)
                prod = T.alloc_fragment((BP, DP), "float32")
                dl = T.alloc_fragment((BP,), "float32")
                if mb * BP < q.len:
                    for r, d in T.Parallel(BP, DP):
                        i = mb * BP + r
                        # every load in bounds, then a 0/1 weight: TileLang hoists a vectorised load
                        # out of a select (and simplifies its index under the select's condition), so
                        # rows past the sequence and columns past D were read, past the tensor in its
                        # last program (memcheck on the H200). Rows clamp to the last (_last), columns
                        # past D to the last 8-column vector; the weight zeroes both (finite values)
                        c = T.min(d // 8, D // 8 - 1) * 8 + d % 8 if DP > D else d
                        keep = T.And(i < q.len, d < D) if DP > D else i < q.len
                        prod[r, d] = (T.cast(O[q.row(_last(i, q.len), h, osb, oss, osh, U) + c], "float32")
                                      * T.cast(DO[q.row(_last(i, q.len), h, dosb, doss, dosh, U) + c], "float32")
                                      * T.Cast("float32", keep))
                    T.reduce_sum(prod, dl, dim=1)  # a fixed tree: deterministic
                    for r in T.Parallel(BP):
                        if mb * BP + r < q.len:
                            DELTA[out_at(q, mb * BP + r, h, lsb, lsh, dlb, dlh)] = dl[r]
                    if spec.tma:
                        for r in T.Parallel(BP):
                            if mb * BP + r < q.len:
                                LSE2[q.lse(mb * BP + r, h, dlb, dlh)] = (LSE[q.lse(mb * BP + r, h, lsb, lsh)]
                                                                         * T.float32(_LOG2E))

    if spec.tma:
        # the TMA programs' prep (dense): delta, and lse * log2(e) from the forward's lse (its own strides),
        # into rows padded to dlh (padded_rows: a multiple of 4): the gradient programs load both by TMA, whose
        # strides are multiples of 16 bytes (lse's rows are Sq long), and take p as exp2(qk unit - lse2)
        tsig = _sig(spec, ("O", "DO", "LSE", "LSE2", "DELTA", "CUQ"))

        @T.prim_func
        def attn_bwd_prep_tma(O: tsig["O"], DO: tsig["DO"], LSE: tsig["LSE"], LSE2: tsig["LSE2"],
                              DELTA: tsig["DELTA"], CUQ: tsig["CUQ"], B: T.int32, Hq: T.int32, Sq: T.int32,
                              osb: T.int64, oss: T.int64, osh: T.int64, dosb: T.int64, doss: T.int64, dosh: T.int64,
                              lsb: T.int64, lsh: T.int64, dlh: T.int64):
            body(O, DO, DELTA, CUQ, B, Hq, Sq, osb, oss, osh, dosb, doss, dosh, lsb, lsh, LSE, LSE2, _i64(Hq) * dlh,
                 dlh)

        return attn_bwd_prep_tma

    @T.prim_func
    def attn_bwd_prep(O: sig["O"], DO: sig["DO"], DELTA: sig["DELTA"], CUQ: sig["CUQ"], B: T.int32, Hq: T.int32,
                      Sq: T.int32, osb: T.int64, oss: T.int64, osh: T.int64, dosb: T.int64, doss: T.int64,
                      dosh: T.int64, lsb: T.int64, lsh: T.int64):
        body(O, DO, DELTA, CUQ, B, Hq, Sq, osb, oss, osh, dosb, doss, dosh, lsb, lsh)

    return attn_bwd_prep


# ----------------------------------------------------------------------------- the gradients
def _score(spec: AttnBwdKernelSpec, qk, scale, softcap):
    """(s, softcap derivative or None) of a raw product ``q . k``."""
    return _capped(spec, qk * scale, softcap)


def _dkdv_c(spec: AttnBwdKernelSpec):
    D, BN, BM, dt = spec.head_dim, spec.block_kv, spec.block_q, spec.dtype
    st = storage_dtype(dt, spec.backend)

    @T.macro
    def body(Q, K, V, DO, LSE, DELTA, DK, DV, CUQ, CUK, B, Hkv, G, Sq, Sk, W, scale, softcap, qsb, qss, qsh, ksb, kss,
             ksh, vsb, vss, vsh, dosb, doss, dosh, lsb, lsh, dksb, dkss, dksh, dvsb, dvss, dvsh):
        with T.Kernel(T.ceildiv(Sk, BN), Hkv, B, threads=1) as (nb, hk, b):
            q, k = _Seq(spec, CUQ, b, Sq), _Seq(spec, CUK, b, Sk)
            kf = T.alloc_local((BN * D,), "float32")
            vf = T.alloc_local((BN * D,), "float32")
            dk = T.alloc_local((BN * D,), "float32")
            dv = T.alloc_local((BN * D,), "float32")
            qf = T.alloc_local((D,), "float32")
            gf = T.alloc_local((D,), "float32")
            sc = T.alloc_local((6,), "float32")  # q.k, dO.v, lse, delta, p, ds
            n0 = nb * BN
            if n0 < k.len:
                for jj in T.serial(BN):
                    for d in T.serial(D):
                        dk[jj * D + d] = T.float32(0)
                        dv[jj * D + d] = T.float32(0)
                        kf[jj * D + d] = T.float32(0)
                        vf[jj * D + d] = T.float32(0)
                    if n0 + jj < k.len:
                        for d in T.serial(D):
                            kf[jj * D + d] = load_f32(K, k.row(n0 + jj, hk, ksb, kss, ksh, 1) + d, st, dt)
                            vf[jj * D + d] = load_f32(V, k.row(n0 + jj, hk, vsb, vss, vsh, 1) + d, st, dt)
                first, nq = _q_blocks(spec, n0, BN, BM, q.len, k.len, W)
                for n in T.serial(G * nq):
                    h = hk * G + T.truncdiv(n, nq)
                    m0 = (first + T.truncmod(n, nq)) * BM
                    for r in T.serial(BM):
                        i = m0 + r
                        if i < q.len:
                            for d in T.serial(D):
                                qf[d] = load_f32(Q, q.row(i, h, qsb, qss, qsh, 1) + d, st, dt)
                                gf[d] = load_f32(DO, q.row(i, h, dosb, doss, dosh, 1) + d, st, dt)
                            sc[2] = LSE[q.lse(i, h, lsb, lsh)]
                            sc[3] = DELTA[q.lse(i, h, lsb, lsh)]
                            for jj in T.serial(BN):
                                if _visible(spec, i, n0 + jj, q.len, k.len, W):
                                    sc[0] = T.float32(0)
                                    sc[1] = T.float32(0)
                                    for d in T.serial(D):
                                        sc[0] = sc[0] + qf[d] * kf[jj * D + d]
                                        sc[1] = sc[1] + gf[d] * vf[jj * D + d]
                                    s, dcap = _score(spec, sc[0], scale, softcap)
                                    sc[4] = T.exp(s - sc[2])
                                    sc[5] = sc[4] * (sc[1] - sc[3])
                                    if spec.softcap:
                                        sc[5] = sc[5] * dcap
                                    sc[5] = sc[5] * scale
                                    for d in T.serial(D):
                                        dv[jj * D + d] = dv[jj * D + d] + sc[4] * gf[d]
                                        dk[jj * D + d] = dk[jj * D + d] + sc[5] * qf[d]
                for jj in T.serial(BN):
                    if n0 + jj < k.len:
                        for d in T.serial(D):
                            DK[k.row(n0 + jj, hk, dksb, dkss, dksh, 1) + d] = to_storage(dk[jj * D + d], st, dt)
                            DV[k.row(n0 + jj, hk, dvsb, dvss, dvsh, 1) + d] = to_storage(dv[jj * D + d], st, dt)

    return body


def _dq_c(spec: AttnBwdKernelSpec):
    D, BN, BM, dt = spec.head_dim, spec.block_kv, spec.block_q, spec.dtype
    st = storage_dtype(dt, spec.backend)

    @T.macro
    def body(Q, K, V, DO, LSE, DELTA, DQ, CUQ, CUK, B, Hkv, G, Sq, Sk, W, scale, softcap, qsb, qss, qsh, ksb, kss, ksh,
             vsb, vss, vsh, dosb, doss, dosh, lsb, lsh, dqsb, dqss, dqsh):
        with T.Kernel(T.ceildiv(Sq, BM), Hkv * G, B, threads=1) as (mb, h, b):
            q, k = _Seq(spec, CUQ, b, Sq), _Seq(spec, CUK, b, Sk)
            hk = T.truncdiv(h, G)
            qf = T.alloc_local((D,), "float32")
            gf = T.alloc_local((D,), "float32")
            acc = T.alloc_local((D,), "float32")
            sc = T.alloc_local((5,), "float32")  # q.k, dO.v, lse, delta, ds
            m0 = mb * BM
            if m0 < q.len:
                first, nk = _kv_blocks(spec, m0, BM, BN, q.len, k.len, W)
                for r in T.serial(BM):
                    i = m0 + r
                    if i < q.len:
                        for d in T.serial(D):
                            qf[d] = load_f32(Q, q.row(i, h, qsb, qss, qsh, 1) + d, st, dt)
                            gf[d] = load_f32(DO, q.row(i, h, dosb, doss, dosh, 1) + d, st, dt)
                            acc[d] = T.float32(0)
                        sc[2] = LSE[q.lse(i, h, lsb, lsh)]
                        sc[3] = DELTA[q.lse(i, h, lsb, lsh)]
                        for n in T.serial(nk):
                            for jj in T.serial(BN):
                                j = (first + n) * BN + jj
                                if _visible(spec, i, j, q.len, k.len, W):
                                    ko, vo = k.row(j, hk, ksb, kss, ksh, 1), k.row(j, hk, vsb, vss, vsh, 1)
                                    sc[0] = T.float32(0)
                                    sc[1] = T.float32(0)
                                    for d in T.serial(D):
                                        sc[0] = sc[0] + qf[d] * load_f32(K, ko + d, st, dt)
                                        sc[1] = sc[1] + gf[d] * load_f32(V, vo + d, st, dt)
                                    s, dcap = _score(spec, sc[0], scale, softcap)
                                    sc[4] = T.exp(s - sc[2]) * (sc[1] - sc[3])
                                    if spec.softcap:
                                        sc[4] = sc[4] * dcap
                                    sc[4] = sc[4] * scale
                                    for d in T.serial(D):
                                        acc[d] = acc[d] + sc[4] * load_f32(K, ko + d, st, dt)
                        for d in T.serial(D):
                            DQ[q.row(i, h, dqsb, dqss, dqsh, 1) + d] = to_storage(acc[d], st, dt)

    return body


def _last(i, n):
    """Row ``i`` clamped to a sequence's last row (``n >= 1`` wherever a tile is loaded): a tile's rows
    past the sequence read a real row, finite, whose p and ds the mask sets to 0; a predicated load
    (zeros past the end) kept TileLang from issuing the copy as ``cp.async``, which pipelining needs."""
    return T.min(i, n - 1)


def _lse2(lse, base2: bool):
    """``lse`` in base 2 (``lse * log2(e)``); ``base2``: it is already (the TMA programs' lse2)."""
    return lse if base2 else lse * T.float32(_LOG2E)


def _cut(spec: AttnBwdKernelSpec, m0, BM, n0, BN, sq, sk, W):
    """Whether some query of rows ``m0 .. m0 + BM - 1`` does not see some key of ``n0 .. n0 + BN - 1`` (or
    either lies past its sequence): only such a tile is masked element by element (:func:`_probs`)."""
    off = sk - sq
    cut = T.Or(m0 + BM > sq, n0 + BN > sk)
    if spec.causal:
        cut = T.Or(cut, n0 + BN - 1 > m0 + off)
    if spec.window:
        cut = T.Or(cut, n0 <= m0 + BM - 1 + off - W)
    return cut


def _probs(spec: AttnBwdKernelSpec, rows: int, cols: int, transposed: bool, with_p: bool, base2: bool = False):
    """The CUDA schedule's p and ds of a tile, as a macro: the products ``qk`` (then p, fp32, in place)
    and ``dp`` over ``rows x cols`` fragments (``transposed``: keys by queries, dk/dv's), into ``p_t``
    (``with_p``: dk/dv's; dq's takes ds alone) and ``ds_t`` in the dtype: :func:`_exp_p`, then :func:`_ds`.
    ``base2``: ``lse_s`` holds ``lse * log2(e)`` already (the TMA programs' lse2)."""
    exp_p = _exp_p(spec, rows, cols, transposed, base2)
    ds = _ds(spec, rows, cols, transposed, with_p, True)

    @T.macro
    def probs(qk, dp, p_t, ds_t, lse_s, dl_s, m0, n0, Sq, Sk, W, scale, softcap):
        # (Sq, Sk, W, scale, softcap: the kernel's own names; a dense call hands it its extents, and a
        # macro's parameter renames the variable it is given: the launcher then missed 'Sq', tests/test_attn_fwd.py)
        exp_p(qk, dp, lse_s, dl_s, m0, n0, Sq, Sk, W, scale, softcap)
        ds(qk, dp, p_t, ds_t, dl_s, scale)

    return probs


def _exp_p(spec: AttnBwdKernelSpec, rows: int, cols: int, transposed: bool, base2: bool):
    """p of a tile into its products ``qk``, in place (a macro): ``p = exp2(qk scale log2(e) - lse log2(e))``,
    one FFMA and ``ex2.approx.ftz`` an element, computed once and read by both p and ds (an expression each of
    them evaluated was two exp2 an element). With a softcap, ``t = tanh(qk scale / c)`` goes into ``qk`` first
    and ``dp`` becomes ``(dp - delta) scale (1 - t^2)`` in place, so that tanh too is taken once an element;
    then ``p = exp2(t c log2(e) - lse log2(e))``: only then does it read ``dp``.
    Hidden pairs get p = 0 in a branch of their own, taken by the tiles a mask or an end cuts
    (:func:`_cut`): a select an element compiled to a branch an element (the forward's, a third of its
    warp samples on the H100). 1.8-2.0x the backward on the H200's causal rows (benchmarks/NOTES.md)."""

    @T.macro
    def exp_p(qk, dp, lse_s, dl_s, m0, n0, Sq, Sk, W, scale, softcap):
        unit = (softcap if spec.softcap else scale) * T.float32(_LOG2E)
        if spec.softcap:
            for a, c in T.Parallel(rows, cols):
                qk[a, c] = T.tanh(qk[a, c] * scale / softcap)
            for a, c in T.Parallel(rows, cols):
                r = c if transposed else a
                dp[a, c] = (dp[a, c] - dl_s[r]) * scale * (T.float32(1) - qk[a, c] * qk[a, c])
        if _cut(spec, m0, cols if transposed else rows, n0, rows if transposed else cols, Sq, Sk, W):
            for a, c in T.Parallel(rows, cols):
                i, j = (m0 + c, n0 + a) if transposed else (m0 + a, n0 + c)
                r = c if transposed else a
                qk[a, c] = T.if_then_else(_visible(spec, i, j, Sq, Sk, W), T.call_extern(
                    "float32", "tileops_ex2", qk[a, c] * unit - _lse2(lse_s[r], base2)), T.float32(0))
        else:
            for a, c in T.Parallel(rows, cols):
                r = c if transposed else a
                qk[a, c] = T.call_extern("float32", "tileops_ex2", qk[a, c] * unit - _lse2(lse_s[r], base2))

    return exp_p


def _ds(spec: AttnBwdKernelSpec, rows: int, cols: int, transposed: bool, with_p: bool, with_ds: bool):
    """p (``with_p``) and ds (``with_ds``) of a tile in the dtype, the A operands of the next products (a macro):
    from p in ``qk`` (:func:`_exp_p`) and the products ``dp``, ``ds = p (dp - delta) scale`` (with a softcap
    ``dp`` holds ``(dp - delta) scale (1 - t^2)`` already). One loop writes both where both are asked (one
    pass over the fragments); ``overlap`` 3 writes p first and ds once dp has landed."""
    dt = spec.dtype

    @T.macro
    def ds(qk, dp, p_t, ds_t, dl_s, scale):
        for a, c in T.Parallel(rows, cols):
            r = c if transposed else a
            if with_p:
                p_t[a, c] = T.cast(qk[a, c], dt)
            if with_ds:
                if spec.softcap:
                    ds_t[a, c] = T.cast(qk[a, c] * dp[a, c], dt)
                else:
                    ds_t[a, c] = T.cast(qk[a, c] * (dp[a, c] - dl_s[r]) * scale, dt)

    return ds


def _q_tile(spec: AttnBwdKernelSpec):
    """The CUDA schedule's load of a q tile (both programs): a macro that copies rows ``m0 .. m0 + BM``
    of q head ``h`` of batch ``b`` from Q and dO into ``Q_s``, ``G_s`` and their lse and delta into
    ``lse_s``, ``dl_s`` (rows past the sequence: its last row, :func:`_last`). One copy a parallel
    loop: TileLang 0.1.15 vectorizes a loop of two stores by the narrowest of their index casts (4-byte
    copies); alone, each is a 16-byte ``cp.async``. (Its parameters carry the kernel's own names.)"""
    D, BM, U = spec.head_dim, spec.block_q, _VEC

    @T.macro
    def load_q(Q, DO, LSE, DELTA, Q_s, G_s, lse_s, dl_s, CUQ, b, Sq, m0, h, qsb, qss, qsh, dosb, doss, dosh, lsb, lsh):
        q = _Seq(spec, CUQ, b, Sq)
        for r, d in T.Parallel(BM, D):
            Q_s[r, d] = Q[q.row(_last(m0 + r, q.len), h, qsb, qss, qsh, U) + d]
        for r, d in T.Parallel(BM, D):
            G_s[r, d] = DO[q.row(_last(m0 + r, q.len), h, dosb, doss, dosh, U) + d]
        for r in T.Parallel(BM):
            lse_s[r] = LSE[q.lse(_last(m0 + r, q.len), h, lsb, lsh)]
            dl_s[r] = DELTA[q.lse(_last(m0 + r, q.len), h, lsb, lsh)]

    return load_q


def _dkdv_step(spec: AttnBwdKernelSpec, base2: bool):
    """One q tile of the CUDA dk/dv program (both loads): ``sT = K Q^T``, ``dpT = V dO^T``, their p and ds,
    then ``dV += pT dO`` and ``dK += dsT Q``, as a macro (its parameters carry the kernel's own names).

    ``overlap`` (the knob; :data:`_DEFAULT_OVERLAP`) says which products run while the step computes:
    1 none (``T.gemm`` waits on its wgmma where it is issued); 2 sT's and dpT's products issued together
    (``T.wgmma_gemm``, no wait) and p's exp2 run once sT's has landed, under dpT's; 3 also ``dV += pT dO``
    issued as soon as p is, and ds computed under it once dpT's has landed. The arithmetic is the same
    expressions in the same order at every level: only the waits move, so the values are level 1's, a zero's
    sign aside (:func:`_scores_together`; tests/test_attention_bwd_kernels.py). FlashAttention-3's backward
    overlaps the same way.

    A streamed stage (Q, dO) goes back to the producer after the last statement that reads it, which an
    unwaited wgmma is not: ``touch`` reads it again after the wait that retires its last product, as the
    forward's pipeline 4 does with its K and V (checked in the emitted CUDA by the tests)."""
    BN, BM = spec.block_kv, spec.block_q
    FULL = T.GemmWarpPolicy.FullRow
    level = spec.tile("overlap")
    via_shared = spec.tile("ds_shared") == 2
    if level == 1:
        probs = _probs(spec, BN, BM, transposed=True, with_p=True, base2=base2)

        @T.macro
        def step(K_s, V_s, Q_s, G_s, lse_s, dl_s, sT, dpT, pT, dsT, pT_s, dsT_s, dk, dv, touch, m0, n0, Sq, Sk, W,
                 scale, softcap):
            T.clear(sT)
            T.gemm(K_s, Q_s, sT, transpose_B=True, policy=FULL)
            T.clear(dpT)
            T.gemm(V_s, G_s, dpT, transpose_B=True, policy=FULL)
            probs(sT, dpT, pT, dsT, lse_s, dl_s, m0, n0, Sq, Sk, W, scale, softcap)
            if via_shared:
                T.copy(pT, pT_s)
                T.copy(dsT, dsT_s)
                T.gemm(pT_s, G_s, dv, policy=FULL)
                T.gemm(dsT_s, Q_s, dk, policy=FULL)
            else:
                T.gemm(pT, G_s, dv, policy=FULL)
                T.gemm(dsT, Q_s, dk, policy=FULL)

        return step

    scores = _scores_together(spec, BN, BM, transposed=True, base2=base2)
    words = BN * BM // spec.threads  # fp32 registers of one score fragment a thread
    if level == 2:
        ds = _ds(spec, BN, BM, True, with_p=True, with_ds=True)

        @T.macro
        def step(K_s, V_s, Q_s, G_s, lse_s, dl_s, sT, dpT, pT, dsT, pT_s, dsT_s, dk, dv, touch, m0, n0, Sq, Sk, W,
                 scale, softcap):
            scores(K_s, Q_s, V_s, G_s, sT, dpT, lse_s, dl_s, m0, n0, Sq, Sk, W, scale, softcap)
            T.wait_wgmma(0)
            T.warpgroup_fence_operand(dpT, 0, words)
            ds(sT, dpT, pT, dsT, dl_s, scale)
            # (dO's and Q's last readers: these two T.gemm wait on their wgmma, so no touch is needed)
            T.gemm(pT, G_s, dv, policy=FULL)
            T.gemm(dsT, Q_s, dk, policy=FULL)

        return step

    p_only = _ds(spec, BN, BM, True, with_p=True, with_ds=False)
    ds_only = _ds(spec, BN, BM, True, with_p=False, with_ds=True)

    @T.macro
    def step(K_s, V_s, Q_s, G_s, lse_s, dl_s, sT, dpT, pT, dsT, pT_s, dsT_s, dk, dv, touch, m0, n0, Sq, Sk, W, scale,
             softcap):
        scores(K_s, Q_s, V_s, G_s, sT, dpT, lse_s, dl_s, m0, n0, Sq, Sk, W, scale, softcap)
        p_only(sT, dpT, pT, dsT, dl_s, scale)
        T.wgmma_gemm(pT, G_s, dv, policy=FULL)
        T.wait_wgmma(1)  # dpT's product (issued before dV's) has landed
        T.warpgroup_fence_operand(dpT, 0, words)
        ds_only(sT, dpT, pT, dsT, dl_s, scale)
        T.wgmma_gemm(dsT, Q_s, dk, policy=FULL)
        T.wait_wgmma(0)
        touch[0] = Q_s[0, 0]
        touch[1] = G_s[0, 0]

    return step


def _scores_together(spec: AttnBwdKernelSpec, rows: int, cols: int, transposed: bool, base2: bool):
    """``overlap`` 2 and 3's start of a step (a macro): the two score products issued together (``qk = A B^T``,
    ``dp = C D^T``), then, once ``qk``'s has landed (``wait_wgmma(1)``: the later one may still run), p's exp2
    in place (:func:`_exp_p`, which reads no ``dp`` without a softcap). ``dp``'s product is left running: the
    caller waits on it. The products start from ``clear_accum``, not from fragments cleared first as level 1's
    do: nvcc moved the clearing of ``dp`` below the issue of ``qk``'s product, and ptxas 13.0 then injected a
    wait on it (C7517, dq at head_dim 128, seen here), which is the overlap undone."""
    FULL = T.GemmWarpPolicy.FullRow
    exp_p = _exp_p(spec, rows, cols, transposed, base2)
    words = rows * cols // spec.threads

    @T.macro
    def scores(A, B, C, D, qk, dp, lse_s, dl_s, m0, n0, Sq, Sk, W, scale, softcap):
        T.wgmma_gemm(A, B, qk, transpose_B=True, clear_accum=True, policy=FULL)
        T.wgmma_gemm(C, D, dp, transpose_B=True, clear_accum=True, policy=FULL)
        T.wait_wgmma(1)
        # (the registers a wgmma wrote, read only after its wait: nvcc may not hoist the reads)
        T.warpgroup_fence_operand(qk, 0, words)
        exp_p(qk, dp, lse_s, dl_s, m0, n0, Sq, Sk, W, scale, softcap)

    return scores


def _dq_step(spec: AttnBwdKernelSpec, base2: bool):
    """One K/V tile of the CUDA dq program (both loads): ``s = Q K^T``, ``dp = dO V^T``, ds, then
    ``dQ += ds K``, as a macro (its parameters carry the kernel's own names). ``overlap`` 2 issues the two
    score products together and runs p's exp2 under dp's (:func:`_dkdv_step`); V's stage is then read
    last by dp's unwaited product, and ``touch`` reads it after the wait."""
    BN, BM = spec.block_kv, spec.block_q
    FULL = T.GemmWarpPolicy.FullRow
    via_shared = spec.tile("ds_shared") == 2
    if spec.tile("overlap") == 2:
        scores = _scores_together(spec, BM, BN, transposed=False, base2=base2)
        ds = _ds(spec, BM, BN, False, with_p=False, with_ds=True)
        words = BM * BN // spec.threads

        @T.macro
        def step(Q_s, G_s, K_s, V_s, lse_s, dl_s, s_f, dp, ds_f, ds_s, dq, touch, m0, n0, Sq, Sk, W, scale,
                 softcap):
            scores(Q_s, K_s, G_s, V_s, s_f, dp, lse_s, dl_s, m0, n0, Sq, Sk, W, scale, softcap)
            T.wait_wgmma(0)
            T.warpgroup_fence_operand(dp, 0, words)
            touch[0] = V_s[0, 0]
            ds(s_f, dp, None, ds_f, dl_s, scale)
            T.gemm(ds_f, K_s, dq, policy=FULL)

        return step

    probs = _probs(spec, BM, BN, transposed=False, with_p=False, base2=base2)

    @T.macro
    def step(Q_s, G_s, K_s, V_s, lse_s, dl_s, s_f, dp, ds_f, ds_s, dq, touch, m0, n0, Sq, Sk, W, scale, softcap):
        T.clear(s_f)
        T.gemm(Q_s, K_s, s_f, transpose_B=True, policy=FULL)
        T.clear(dp)
        T.gemm(G_s, V_s, dp, transpose_B=True, policy=FULL)
        probs(s_f, dp, None, ds_f, lse_s, dl_s, m0, n0, Sq, Sk, W, scale, softcap)
        if via_shared:
            T.copy(ds_f, ds_s)
            T.gemm(ds_s, K_s, dq, policy=FULL)
        else:
            T.gemm(ds_f, K_s, dq, policy=FULL)

    return step


def _dkdv_tiles(spec: AttnBwdKernelSpec) -> tuple:
    """The CUDA dk/dv program's tiles (both loads), allocated where it is called: K, V, Q, dO and lse,
    delta in shared memory, the score, p and ds fragments and the dk, dv accumulators, p and ds in
    shared memory too with ``ds_shared`` 2 (else None)."""
    D, BN, BM, dt = spec.head_dim, spec.block_kv, spec.block_q, spec.dtype
    via_shared = spec.tile("ds_shared") == 2
    return (T.alloc_shared((BN, D), dt), T.alloc_shared((BN, D), dt), T.alloc_shared((BM, D), dt),
            T.alloc_shared((BM, D), dt), T.alloc_shared((BM,), "float32"), T.alloc_shared((BM,), "float32"),
            T.alloc_fragment((BN, BM), "float32"), T.alloc_fragment((BN, BM), "float32"),
            T.alloc_fragment((BN, BM), dt), T.alloc_fragment((BN, BM), dt), T.alloc_fragment((BN, D), "float32"),
            T.alloc_fragment((BN, D), "float32"), T.alloc_shared((BN, BM), dt) if via_shared else None,
            T.alloc_shared((BN, BM), dt) if via_shared else None)


def _dkdv_cuda(spec: AttnBwdKernelSpec):
    D, BN, BM, dt, U = spec.head_dim, spec.block_kv, spec.block_q, spec.dtype, _VEC
    NS = spec.tile("stages")
    load_q = _q_tile(spec)
    step = _dkdv_step(spec, base2=False)

    @T.macro
    def body(Q, K, V, DO, LSE, DELTA, DK, DV, CUQ, CUK, B, Hkv, G, Sq, Sk, W, scale, softcap, qsb, qss, qsh, ksb, kss,
             ksh, vsb, vss, vsh, dosb, doss, dosh, lsb, lsh, dksb, dkss, dksh, dvsb, dvss, dvsh):
        with T.Kernel(T.ceildiv(Sk, BN), Hkv, B, threads=spec.threads) as (nb, hk, b):
            T.import_source(EX2_SOURCE)
            q, k = _Seq(spec, CUQ, b, Sq), _Seq(spec, CUK, b, Sk)
            K_s, V_s, Q_s, G_s, lse_s, dl_s, sT, dpT, pT, dsT, dk, dv, pT_s, dsT_s = _dkdv_tiles(spec)
            n0 = nb * BN
            if n0 < k.len:
                for jj, d in T.Parallel(BN, D):
                    K_s[jj, d] = K[k.row(_last(n0 + jj, k.len), hk, ksb, kss, ksh, U) + d]
                for jj, d in T.Parallel(BN, D):
                    V_s[jj, d] = V[k.row(_last(n0 + jj, k.len), hk, vsb, vss, vsh, U) + d]
                T.clear(dk)
                T.clear(dv)
                first, nq = _q_blocks(spec, n0, BN, BM, q.len, k.len, W)
                # (first, first + ...): TileLang 0.1.15 lowered a pipelined loop from 0 to a dynamic count at
                # 2+ stages with a wait count depending on the loop variable (`ptx_wait_group(2 - n * 2)`),
                # which its codegen refuses; from a dynamic start it schedules the waits as constants
                for n in T.Pipelined(first * G, (first + nq) * G, num_stages=NS):
                    h = hk * G + T.truncdiv(n - first * G, nq)
                    m0 = (first + T.truncmod(n - first * G, nq)) * BM
                    load_q(Q, DO, LSE, DELTA, Q_s, G_s, lse_s, dl_s, CUQ, b, Sq, m0, h, qsb, qss, qsh, dosb, doss, dosh,
                           lsb, lsh)
                    step(K_s, V_s, Q_s, G_s, lse_s, dl_s, sT, dpT, pT, dsT, pT_s, dsT_s, dk, dv, None, m0, n0, q.len,
                         k.len, W, scale, softcap)
                for jj, d in T.Parallel(BN, D):
                    if n0 + jj < k.len:
                        DK[k.row(n0 + jj, hk, dksb, dkss, dksh, U) + d] = T.cast(dk[jj, d], dt)
                        DV[k.row(n0 + jj, hk, dvsb, dvss, dvsh, U) + d] = T.cast(dv[jj, d], dt)

    return body


def _dq_cuda(spec: AttnBwdKernelSpec):
    D, BN, BM, dt, U = spec.head_dim, spec.block_kv, spec.block_q, spec.dtype, _VEC
    NS = spec.tile("stages")
    load_q = _q_tile(spec)
    step = _dq_step(spec, base2=False)
    via_shared = spec.tile("ds_shared") == 2

    @T.macro
    def body(Q, K, V, DO, LSE, DELTA, DQ, CUQ, CUK, B, Hkv, G, Sq, Sk, W, scale, softcap, qsb, qss, qsh, ksb, kss, ksh,
             vsb, vss, vsh, dosb, doss, dosh, lsb, lsh, dqsb, dqss, dqsh):
        with T.Kernel(T.ceildiv(Sq, BM), Hkv * G, B, threads=spec.threads) as (mb, h, b):
            T.import_source(EX2_SOURCE)
            q, k = _Seq(spec, CUQ, b, Sq), _Seq(spec, CUK, b, Sk)
            hk = T.truncdiv(h, G)
            Q_s = T.alloc_shared((BM, D), dt)
            G_s = T.alloc_shared((BM, D), dt)  # dO
            K_s = T.alloc_shared((BN, D), dt)
            V_s = T.alloc_shared((BN, D), dt)
            lse_s = T.alloc_shared((BM,), "float32")
            dl_s = T.alloc_shared((BM,), "float32")
            s_f = T.alloc_fragment((BM, BN), "float32")
            dp = T.alloc_fragment((BM, BN), "float32")
            ds_f = T.alloc_fragment((BM, BN), dt)
            dq = T.alloc_fragment((BM, D), "float32")
            ds_s = T.alloc_shared((BM, BN), dt) if via_shared else None
            m0 = mb * BM
            if m0 < q.len:
                load_q(Q, DO, LSE, DELTA, Q_s, G_s, lse_s, dl_s, CUQ, b, Sq, m0, h, qsb, qss, qsh, dosb, doss, dosh,
                       lsb, lsh)
                T.clear(dq)
                first, nk = _kv_blocks(spec, m0, BM, BN, q.len, k.len, W)
                for n in T.Pipelined(first, first + nk, num_stages=NS):
                    n0 = n * BN
                    for jj, d in T.Parallel(BN, D):
                        K_s[jj, d] = K[k.row(_last(n0 + jj, k.len), hk, ksb, kss, ksh, U) + d]
                    for jj, d in T.Parallel(BN, D):
                        V_s[jj, d] = V[k.row(_last(n0 + jj, k.len), hk, vsb, vss, vsh, U) + d]
                    step(Q_s, G_s, K_s, V_s, lse_s, dl_s, s_f, dp, ds_f, ds_s, dq, None, m0, n0, q.len, k.len, W,
                         scale, softcap)
                for r, d in T.Parallel(BM, D):
                    if m0 + r < q.len:
                        DQ[q.row(m0 + r, h, dqsb, dqss, dqsh, U) + d] = T.cast(dq[r, d], dt)

    return body


# ------------------------------------------------------------------- TMA programs (loads 2, dense)
def _tma_sig(spec: AttnBwdKernelSpec, names: tuple[str, ...]) -> dict[str, Any]:
    """4-D strided tensors ``[B, S, H, D]`` (head_dim contiguous) with dynamic extents and strides named
    as :data:`TMA_EXTENTS`, and lse2/delta ``[B, Hq, Sq]`` over rows padded to ``dlh``: TileLang builds
    their TMA descriptors on the host from these (strides in elements, multiples of 16 bytes: the
    host's fit checks q, k, v, dO and the gradients; :func:`padded_rows` lse2's and delta's, ``dlb =
    Hq * dlh``, ``dlh = padded_rows(Sq)``)."""
    D, dt = spec.head_dim, spec.dtype
    B, Sq, Sk, Hq, Hkv = T.dynamic("B, Sq, Sk, Hq, Hkv", "int32")
    dlb, dlh = T.dynamic("dlb, dlh", "int64")
    rows = {"Q": (Sq, Hq), "DO": (Sq, Hq), "DQ": (Sq, Hq), "K": (Sk, Hkv), "V": (Sk, Hkv), "DK": (Sk, Hkv),
            "DV": (Sk, Hkv)}
    out = {}
    for n in names:
        if n in ("LSE2", "DELTA"):
            out[n] = T.StridedTensor((B, Hq, Sq), (dlb, dlh, 1), "float32")
        else:
            sb, ss, sh = T.dynamic(", ".join(_strides(n)), "int64")
            out[n] = T.StridedTensor((B, *rows[n], D), (sb, ss, sh, 1), dt)
    return out


def _dkdv_tma(spec: AttnBwdKernelSpec):
    """The dk/dv program of a dense call with its tiles by TMA: :func:`_dkdv_cuda`'s math, the Q, dO, lse2
    and delta tiles of each step streamed by the producer warpgroup TileLang adds (``stages`` buffers,
    mbarriers), K and V loaded once. Rows past the sequences come as zeros (TMA's bounds), which the
    masks then hide; dk and dv are stored a tile at once (TMA drops the rows past ``Sk``)."""
    D, BN, BM, dt = spec.head_dim, spec.block_kv, spec.block_q, spec.dtype
    NS = spec.tile("stages")
    step = _dkdv_step(spec, base2=True)
    sig = _tma_sig(spec, ("Q", "K", "V", "DO", "LSE2", "DELTA", "DK", "DV"))

    @T.prim_func
    def attn_bwd_dkdv_tma(Q: sig["Q"], K: sig["K"], V: sig["V"], DO: sig["DO"], LSE2: sig["LSE2"],
                          DELTA: sig["DELTA"], DK: sig["DK"], DV: sig["DV"], G: T.int32, W: T.int32,
                          scale: T.float32, softcap: T.float32):
        B, Sk, Hkv = K.shape[0], K.shape[1], K.shape[2]
        Sq = Q.shape[1]
        with T.Kernel(T.ceildiv(Sk, BN), Hkv, B, threads=spec.threads) as (nb, hk, b):
            T.import_source(EX2_SOURCE)
            K_s, V_s, Q_s, G_s, lse_s, dl_s, sT, dpT, pT, dsT, dk, dv, pT_s, dsT_s = _dkdv_tiles(spec)
            dK_s = T.alloc_shared((BN, D), dt)
            dV_s = T.alloc_shared((BN, D), dt)
            touch = T.alloc_local((2,), dt) if spec.tile("overlap") == 3 else None  # (_dkdv_step)
            n0 = nb * BN
            T.copy(K[b, n0:n0 + BN, hk, :], K_s)
            T.copy(V[b, n0:n0 + BN, hk, :], V_s)
            T.clear(dk)
            T.clear(dv)
            first, nq = _q_blocks(spec, n0, BN, BM, Sq, Sk, W)
            # At least one step, as the forward's blocks walk one tile: a program whose keys no query sees
            # (a window past them) would otherwise never wait on its K/V loads, and TileLang may stage dK/dV
            # in their shared memory (the forward's race, benchmarks/NOTES.md). That step's tile is past the
            # queries or hidden whole, so cut (_cut) and masked to zeros. Its (head, q block) from
            # max(nq, 1): the loop's bounds and every TMA coordinate are expressions of the arguments and
            # the loop variable, never a register (the producer warpgroup gets none written before the loop)
            nq1 = T.max(nq, 1)
            for n in T.Pipelined(first * G, first * G + T.max(nq * G, 1), num_stages=NS):
                h = hk * G + T.truncdiv(n - first * G, nq1)
                m0 = (first + T.truncmod(n - first * G, nq1)) * BM
                T.copy(Q[b, m0:m0 + BM, h, :], Q_s)
                T.copy(DO[b, m0:m0 + BM, h, :], G_s)
                T.copy(LSE2[b, h, m0:m0 + BM], lse_s)
                T.copy(DELTA[b, h, m0:m0 + BM], dl_s)
                step(K_s, V_s, Q_s, G_s, lse_s, dl_s, sT, dpT, pT, dsT, pT_s, dsT_s, dk, dv, touch, m0, n0, Sq, Sk, W,
                     scale, softcap)
            T.copy(dk, dK_s)
            T.copy(dv, dV_s)
            T.copy(dK_s, DK[b, n0:n0 + BN, hk, :])
            T.copy(dV_s, DV[b, n0:n0 + BN, hk, :])

    return attn_bwd_dkdv_tma


def _dq_tma(spec: AttnBwdKernelSpec):
    """The dq program of a dense call with its tiles by TMA: :func:`_dq_cuda`'s math, Q, dO, lse2 and
    delta loaded once, the K and V tiles streamed by the producer warpgroup (``stages`` buffers)."""
    D, BN, BM, dt = spec.head_dim, spec.block_kv, spec.block_q, spec.dtype
    NS = spec.tile("stages")
    step = _dq_step(spec, base2=True)
    via_shared = spec.tile("ds_shared") == 2
    sig = _tma_sig(spec, ("Q", "K", "V", "DO", "LSE2", "DELTA", "DQ"))

    @T.prim_func
    def attn_bwd_dq_tma(Q: sig["Q"], K: sig["K"], V: sig["V"], DO: sig["DO"], LSE2: sig["LSE2"],
                        DELTA: sig["DELTA"], DQ: sig["DQ"], G: T.int32, W: T.int32, scale: T.float32,
                        softcap: T.float32):
        B, Sq, Hq = Q.shape[0], Q.shape[1], Q.shape[2]
        Sk = K.shape[1]
        with T.Kernel(T.ceildiv(Sq, BM), Hq, B, threads=spec.threads) as (mb, h, b):
            T.import_source(EX2_SOURCE)
            hk = h // G
            Q_s = T.alloc_shared((BM, D), dt)
            G_s = T.alloc_shared((BM, D), dt)  # dO
            K_s = T.alloc_shared((BN, D), dt)
            V_s = T.alloc_shared((BN, D), dt)
            lse_s = T.alloc_shared((BM,), "float32")
            dl_s = T.alloc_shared((BM,), "float32")
            s_f = T.alloc_fragment((BM, BN), "float32")
            dp = T.alloc_fragment((BM, BN), "float32")
            ds_f = T.alloc_fragment((BM, BN), dt)
            dq = T.alloc_fragment((BM, D), "float32")
            ds_s = T.alloc_shared((BM, BN), dt) if via_shared else None
            dQ_s = T.alloc_shared((BM, D), dt)
            touch = T.alloc_local((1,), dt) if spec.tile("overlap") == 2 else None  # (_dq_step)
            m0 = mb * BM
            T.copy(Q[b, m0:m0 + BM, h, :], Q_s)
            T.copy(DO[b, m0:m0 + BM, h, :], G_s)
            T.copy(LSE2[b, h, m0:m0 + BM], lse_s)
            T.copy(DELTA[b, h, m0:m0 + BM], dl_s)
            T.clear(dq)
            first, nk = _kv_blocks(spec, m0, BM, BN, Sq, Sk, W)
            # at least one tile (see _dkdv_tma): rows that see no key walk one, cut and masked whole
            for n in T.Pipelined(first, first + T.max(nk, 1), num_stages=NS):
                n0 = n * BN
                T.copy(K[b, n0:n0 + BN, hk, :], K_s)
                T.copy(V[b, n0:n0 + BN, hk, :], V_s)
                step(Q_s, G_s, K_s, V_s, lse_s, dl_s, s_f, dp, ds_f, ds_s, dq, touch, m0, n0, Sq, Sk, W, scale,
                     softcap)
            T.copy(dq, dQ_s)
            T.copy(dQ_s, DQ[b, m0:m0 + BM, h, :])

    return attn_bwd_dq_tma


def _dkdv(spec: AttnBwdKernelSpec):
    if spec.tma:
        return _dkdv_tma(spec)
    sig = _sig(spec, ("Q", "K", "V", "DO", "LSE", "DELTA", "DK", "DV", "CUQ", "CUK"))
    body = _dkdv_cuda(spec) if spec.backend == "cuda" else _dkdv_c(spec)

    @T.prim_func
    def attn_bwd_dkdv(Q: sig["Q"], K: sig["K"], V: sig["V"], DO: sig["DO"], LSE: sig["LSE"], DELTA: sig["DELTA"],
                      DK: sig["DK"], DV: sig["DV"], CUQ: sig["CUQ"], CUK: sig["CUK"], B: T.int32, Hkv: T.int32,
                      G: T.int32, Sq: T.int32, Sk: T.int32, W: T.int32, scale: T.float32, softcap: T.float32,
                      qsb: T.int64, qss: T.int64, qsh: T.int64, ksb: T.int64, kss: T.int64, ksh: T.int64,
                      vsb: T.int64, vss: T.int64, vsh: T.int64, dosb: T.int64, doss: T.int64, dosh: T.int64,
                      lsb: T.int64, lsh: T.int64, dksb: T.int64, dkss: T.int64, dksh: T.int64, dvsb: T.int64,
                      dvss: T.int64, dvsh: T.int64):
        body(Q, K, V, DO, LSE, DELTA, DK, DV, CUQ, CUK, B, Hkv, G, Sq, Sk, W, scale, softcap, qsb, qss, qsh, ksb, kss,
             ksh, vsb, vss, vsh, dosb, doss, dosh, lsb, lsh, dksb, dkss, dksh, dvsb, dvss, dvsh)

    return attn_bwd_dkdv


def _dq(spec: AttnBwdKernelSpec):
    if spec.tma:
        return _dq_tma(spec)
    sig = _sig(spec, ("Q", "K", "V", "DO", "LSE", "DELTA", "DQ", "CUQ", "CUK"))
    body = _dq_cuda(spec) if spec.backend == "cuda" else _dq_c(spec)

    @T.prim_func
    def attn_bwd_dq(Q: sig["Q"], K: sig["K"], V: sig["V"], DO: sig["DO"], LSE: sig["LSE"], DELTA: sig["DELTA"],
                    DQ: sig["DQ"], CUQ: sig["CUQ"], CUK: sig["CUK"], B: T.int32, Hkv: T.int32, G: T.int32,
                    Sq: T.int32, Sk: T.int32, W: T.int32, scale: T.float32, softcap: T.float32, qsb: T.int64,
                    qss: T.int64, qsh: T.int64, ksb: T.int64, kss: T.int64, ksh: T.int64, vsb: T.int64,
                    vss: T.int64, vsh: T.int64, dosb: T.int64, doss: T.int64, dosh: T.int64, lsb: T.int64,
                    lsh: T.int64, dqsb: T.int64, dqss: T.int64, dqsh: T.int64):
        body(Q, K, V, DO, LSE, DELTA, DQ, CUQ, CUK, B, Hkv, G, Sq, Sk, W, scale, softcap, qsb, qss, qsh, ksb, kss, ksh,
             vsb, vss, vsh, dosb, doss, dosh, lsb, lsh, dqsb, dqss, dqsh)

    return attn_bwd_dq


#: the names :mod:`tileops.kernels` looks up in a builder module
build = build_attention_bwd
Spec = AttnBwdKernelSpec
