"""The attention prologue as one TileLang tile program (issue 24): per-head RMSNorm of q and k, RoPE
at explicit positions, q written once, k and v written into a paged KV cache, one launch.

Composed from the stages the norm and rope builders export (``USES`` below: their sources are part
of this builder's cache key), not a copy of their math, each given the spec of its stage: the
spec holds the rope op's and the norm op's own kernel specs (``rope``, ``norm``; made by
:mod:`tileops.compose` from the manifests the op's ``compose:`` section names) and copies none of
their fields. :func:`tileops.kernels.rope.angles` (the position read, bounds-checked, and the
cos/sin composition from the digit tables, MRoPE's per-pair stream pick included),
:func:`tileops.kernels.rope.rotate` (the pairing, the partial-rotary copy, the store in the dtype)
and :func:`tileops.kernels.norm.norm_row` (the per-row RMSNorm with the norm stage's rounding and
offset, its row sum in float64 as the norm's C schedule adds it). A rope variant or pairing, or a
norm option, added to those stages reaches this kernel with no edit here (:data:`STAGES` lists the
little this builder fixes in them). Two schedules: the C
one (a token per loop iteration) and the CUDA one (a lane group per head row, a token's groups
walking its q, k and v rows with cos/sin composed once: ``_build_cuda`` says why, with the numbers),
which takes the rope stage's CUDA pieces (:func:`tileops.kernels.rope.lane_angles`, ``rotate_vals``,
``pair_offsets``, ``store_one``) and the norm's (:func:`tileops.kernels.norm.lane_allsum`,
``lane_rstd``, ``lane_value``). A cache of qkv's dtype or of float8 e4m3fn. On CUDA the qkv, q and cache
strides are in units of ``vec`` elements (``stride_unit``) and every pointer must lie on a 16-byte
vector (the host checks both).

Inputs (all flat buffers addressed by element strides, as the rope and norm builders take them):

* ``QKV``: row ``t`` holds ``HQ`` q heads, then ``HKV`` k heads, then ``HKV`` v heads of ``D``
  elements each, contiguous within the row; ``xst`` is the row stride (a row-strided slice of a
  wider projection output is fine).
* ``P``: ``[S]`` positions (int32/int64), contiguous; with ``mrope_section``, ``[3, S]``: three
  streams (temporal, height, width), stream ``i`` at ``P[i * psc :]``. One outside ``[0, limit)``
  reads as position 0 (no table row past the end is touched) and is reported as the entry ``ERR``'s
  checked input 0 (:mod:`tileops.kernels.report`: the call's tag, the element's offset and value).
* ``SL``: ``[S]`` cache slots (int32/int64). A negative slot skips the token's k and v (vLLM's
  padding slot -1); a slot at or past ``nslots`` is reported as checked input 1 and skips them, so
  no cache row past the end is written. q is written whatever the slot.
* ``TD``: the rope family's digit tables ``[3, 256, 2, R/2]`` (``tileops.rope.tables``): any rope
  variant's frequencies and amplitude reach this kernel as they reach the rope kernel.
* ``QW``, ``KW``: the per-head RMSNorm weights ``[D]`` (read only with ``qk_norm``).
* ``KC``, ``VC``: the caches; element ``(slot, h, d)`` at ``(slot // bs) * csb + (slot % bs) * csr
  + h * csh + d``. The layout is the strides: NHD ``[blocks, bs, HKV, D]`` is ``csr = HKV * D``,
  ``csh = D``; HND ``[blocks, HKV, bs, D]`` is ``csr = D``, ``csh = bs * D``. A float8 cache is
  its bytes (``uint8``), each element ``e4m3(x / scale)``, saturated.
* ``KS``, ``VS``: the float8 caches' per-tensor fp32 scales ``[1]``, read on the device (only then).

Rounding: the norm's output is rounded to qkv's dtype before the rotation reads it, as the unfused
chain (norm op, then rope op) stores it between the two; the norm itself follows ``rounding``
(``llama``: ``n = round(x * rsqrt(mean(x^2) + eps))``, ``y = round(n * w)``; ``fp32``: ``y =
round(x * rsqrt(...) * (offset + w))``, Gemma's form with ``offset=1``). The rotation is in fp32,
rounded once.
"""

from dataclasses import dataclass
from typing import Any

from .norm import CUDA_HELPERS, NormKernelSpec, lane_allsum, lane_rstd, lane_value, norm_row
from .rope import (DIGITS, LO, RoPEKernelSpec, angles, lane_angles, pair_angle, pair_offsets, position, rotate,
                   rotate_vals, store_one)
from .float8 import STORE_SOURCE, e4m3_bits, reciprocal_scale, store_e4m3
from .report import CUDA_SOURCE as REPORT_SOURCE
from .report import ENTRY, report
from .storage import load_f32, storage_dtype

#: ``tilelang.language``, imported when a kernel is first built (:func:`build_prologue`)
T: Any = None

__all__ = ["PrologueKernelSpec", "build_prologue", "build", "Spec", "STATIC", "STAGES", "USES", "ARGS"]

#: The schedule choices a manifest's ``kernel.static`` may set (:mod:`tileops.kernels` reads this literal
#: without importing the module); the C schedule has none.
STATIC = {
    "threads": (32, 1024, "target threads per block, a power of two (CUDA)"),
    "head_lanes": (1, 64, "lane groups that split one token's head rows, a power of two (CUDA)"),
    "min_blocks": (1, 32, "blocks an SM must hold at once, asked of nvcc (__launch_bounds__): it caps the "
                          "registers a thread at 65536 / (min_blocks * block threads) (CUDA)"),
    # switches: a (False, True) range is a bool in a manifest (tileops.manifest.loader._static)
    "share_angles": (False, True, "a token's cos/sin composed once into shared memory, read by every lane "
                                  "group after one barrier (CUDA)"),
    "pair_angles": (False, True, "with share_angles: each of a token's threads composes single pairs (CUDA)"),
    "reciprocal_scale": (False, True, "a float8 cache's x / scale by the scale's reciprocal and one correction, "
                                      "the division's bits (CUDA)"),
}

_ELEM_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}

#: the builders whose stages this one composes: their sources join its cache key
#: (:func:`tileops.kernels.used_files`)
USES = ("norm", "rope")

#: the generated function's parameters, in order; the launcher binds by these names and passes 0 for
#: the norm weights of a kernel without ``qk_norm``, the scales of a cache that is not float8 and
#: ``psc`` (the stride between MRoPE's three position streams) of a kernel without ``mrope_section``:
#: none of them is read then
ARGS = ("QKV", "P", "SL", "TD", "QW", "KW", "Q", "KC", "VC", "KS", "VS", "ERR",
        "S", "xst", "qst", "qsh", "csb", "csr", "csh", "bs", "nslots", "limit", "tag", "eps_bits",
        "psc")


#: What this builder's own schedule fixes in each stage it composes (the spec fields named as the
#: manifest's ``compose`` stages): ``{stage: {field: the values it builds}}``. The schedule rotates
#: forward at positions read from ``P``, and normalises a head row with a weight of its dtype into
#: the row itself; every other field of a stage's spec (the rope's pairing, rotated width and MRoPE's
#: sections, the norm's rounding and offset, one its family adds later) is applied by the stage's
#: own functions (``angles``, ``rotate``, ``lane_angles``, ``norm_row``, ``lane_value`` ...), so it
#: reaches this kernel with no edit here. :mod:`tileops.compose` refuses a stage spec with another
#: value, naming the op's argument that brings it.
STAGES = {
    "rope": {"inverse": (False,), "transposed": (False,), "positions": ("int32", "int64")},
    "norm": {"kind": ("fwd",), "norm": ("rms",), "residual": (False,), "bias": (None,), "out_dtype": (None,)},
}


@dataclass(frozen=True)
class PrologueKernelSpec:
    """Everything a prologue kernel is compiled for; two equal specs share one compiled kernel.

    Made of the specs of the stages the op's manifest composes (:mod:`tileops.compose`), each the one
    the stage's own op compiles its kernel for, less that kernel's schedule: ``rope`` (qkv's dtype,
    head_dim, the rotated width, the pairing, the positions' dtype, MRoPE's sections, the backend)
    and ``norm`` (with ``qk_norm``: the rounding, the offset); then the fields of this builder's own
    stage, the cache write, and its schedule."""

    #: the rope stage: :class:`tileops.kernels.rope.RoPEKernelSpec` of the rope op's forward kernel
    rope: RoPEKernelSpec
    #: the norm stage (a per-head RMSNorm with a weight of qkv's dtype): the norm op's forward
    #: :class:`tileops.kernels.norm.NormKernelSpec`, or None without ``qk_norm``
    norm: "NormKernelSpec | None" = None
    #: the heads, compiled in: the op fixes them, and the CUDA schedule unrolls its walk over a
    #: token's rows by them (``_build_cuda`` says why)
    hq: int = 1
    hkv: int = 1
    #: the caches' storage: "" for ``dtype``, or "float8_e4m3fn": ``saturate(x / scale)`` with the
    #: per-tensor fp32 scales ``KS``/``VS`` (:mod:`tileops.kernels.float8`), x rounded to ``dtype``
    #: first, as the unfused chain (rope, then the cache write) rounds it
    cache: str = ""
    slots: str = "int64"  # int32 | int64
    threads: int = 128  # cuda: target threads per block (a power of two)
    head_lanes: int = 16  # cuda: lane groups that split a token's q, k and v head rows (a power of two)
    #: cuda: blocks an SM must hold at once (``__launch_bounds__``' second number), which caps the
    #: registers a thread: unbounded, nvcc gave Qwen3's kernel 126-128 (4 blocks of 128 threads an SM)
    min_blocks: int = 1
    #: cuda, schedule variants (off: the schedule ``_build_cuda`` describes; each gives the same bits):
    #: ``share_angles``: a token's cos/sin composed once, by its lane group 0, into shared memory,
    #: read by every group after a block barrier (instead of each of the ``head_lanes`` groups
    #: composing the same values from the tables)
    share_angles: bool = False
    #: ``pair_angles`` (with ``share_angles``): each of a token's threads composes single pairs
    #: (6 scalar table loads each; with MRoPE, only its pair's stream's position read) instead
    pair_angles: bool = False
    #: ``reciprocal_scale``: a float8 cache's ``x / scale`` as ``x`` times the scale's reciprocal with
    #: Markstein's correction, the division's bits in fewer instructions
    #: (:data:`tileops.kernels.float8.DIV_SOURCE`); nothing changes for other caches
    reciprocal_scale: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.rope, RoPEKernelSpec):
            raise ValueError(f"rope: expected a RoPEKernelSpec, got {self.rope!r}")
        if self.slots not in ("int32", "int64"):
            raise ValueError(f"slots: expected 'int32' or 'int64', got {self.slots!r}")
        for name in ("hq", "hkv"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {getattr(self, name)!r}")
        if self.cache not in ("", "float8_e4m3fn"):
            raise ValueError(f"cache: expected '' (the dtype) or 'float8_e4m3fn', got {self.cache!r}")
        n = self.norm
        if n is not None and not isinstance(n, NormKernelSpec):
            raise ValueError(f"norm: expected a NormKernelSpec or None, got {n!r}")
        # the norm normalises the rope's head rows in place: one row, dtype and backend for both
        if n is not None and (n.hidden, n.dtype, n.weight, n.backend) != (self.head_dim, self.dtype, self.dtype,
                                                                           self.backend):
            raise ValueError(f"norm: expected a row of head_dim {self.head_dim} in {self.dtype} with a {self.dtype} "
                             f"weight on the {self.backend} backend (the rope stage's), got hidden {n.hidden}, "
                             f"{n.dtype} with a {n.weight} weight on {n.backend}")
        for name, low, high in (("threads", 32, 1024), ("head_lanes", 1, 64)):
            n = getattr(self, name)
            if type(n) is not int or not low <= n <= high or n & (n - 1):
                raise ValueError(f"{name}: expected a power of two in [{low}, {high}], got {n!r}")
        if type(self.min_blocks) is not int or not 1 <= self.min_blocks <= 32:
            raise ValueError(f"min_blocks: expected an int in [1, 32], got {self.min_blocks!r}")
        for name in ("share_angles", "pair_angles", "reciprocal_scale"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        if self.pair_angles and not self.share_angles:
            raise ValueError("pair_angles: composes the shared cos/sin of share_angles, expected share_angles=True "
                             "with it")
        if self.backend == "cuda" and self.lanes > 32:
            raise ValueError(f"head_dim, rot: the CUDA schedule holds a head row in at most 32 lanes of one warp; a "
                             f"{self.dtype} row of head_dim {self.head_dim}, rot {self.rot} at {self.vec}-element "
                             f"vectors needs {self.row_lanes} (head_dim and rot / 2 multiples of 16 bytes of the "
                             f"dtype keep it at head_dim * bytes / 32 or fewer)")

    #: what :mod:`tileops.compose` checks each stage against (not a field)
    stages = STAGES

    # ---------------------------------------------------------------- read from the stages' specs
    @property
    def dtype(self) -> str:
        """qkv and q out (and the caches, but for a float8 cache): the rope stage's dtype."""
        return self.rope.dtype

    @property
    def head_dim(self) -> int:
        """D."""
        return self.rope.head_dim

    @property
    def rot(self) -> int:
        """The rotated width R, even, <= D; columns R..D are copied."""
        return self.rope.rot

    @property
    def positions(self) -> str:
        """The positions' dtype, int32 | int64 (``P`` is ``[3, S]`` where the rope stage has MRoPE's sections)."""
        return self.rope.positions

    @property
    def backend(self) -> str:
        """c | cuda: the stages'."""
        return self.rope.backend

    @property
    def qk_norm(self) -> bool:
        """Per-head RMSNorm of q and k (the norm stage), weights of ``dtype``."""
        return self.norm is not None

    @property
    def mrope(self) -> bool:
        """Whether the rope stage takes three position streams (MRoPE)."""
        return self.rope.mrope_section is not None

    @property
    def vec(self) -> int:
        """CUDA: elements per access of x (16 bytes, shrunk until it divides head_dim and rot / 2: the
        rope stage's vector, :attr:`tileops.kernels.rope.RoPEKernelSpec.vec`)."""
        return self.rope.vec

    @property
    def stride_unit(self) -> int:
        """The unit of the qkv, q and cache strides the kernel takes (``xst qst qsh csb csr csh``):
        ``vec`` elements on CUDA, so that the compiler can prove every row starts on a vector boundary
        and keep 16-byte accesses (the host checks that each stride and pointer divides), one element
        on the C backend. ``psc`` is always in elements."""
        return self.vec if self.backend == "cuda" else 1

    @property
    def rows(self) -> int:
        """A token's head rows: ``hq`` q, then ``hkv`` k, then ``hkv`` v."""
        return self.hq + 2 * self.hkv

    @property
    def steps(self) -> int:
        """CUDA: the rows each lane group of a token walks, ``ceil(rows / head_lanes)``."""
        return -(-self.rows // self.head_lanes)

    @property
    def fp8(self) -> bool:
        return self.cache == "float8_e4m3fn"

    @property
    def row_lanes(self) -> int:
        """CUDA: the lanes that hold one head row: ``rot / 2 / vec`` that rotate (each holds ``vec``
        pairs, both elements of each: the rope stage's lane), then ``(head_dim - rot) / vec`` that copy."""
        return (self.rot // 2) // self.vec + (self.head_dim - self.rot) // self.vec

    @property
    def lanes(self) -> int:
        """CUDA: the lane group of one head row, a power of two (the butterfly's width)."""
        return 1 << max(0, (self.row_lanes - 1).bit_length())

    @property
    def block_threads(self) -> int:
        """CUDA: threads of one block: ``lanes * head_lanes`` a token, ``threads`` at least."""
        return max(self.threads, self.lanes * self.head_lanes)

    @property
    def tokens_per_block(self) -> int:
        """CUDA: tokens one block handles."""
        return self.block_threads // (self.lanes * self.head_lanes)

    #: the generated function's parameter names, in order (not a field: the same for every spec)
    args = ARGS


def _signature(spec: PrologueKernelSpec, storage: str) -> dict:
    """The buffer parameters both schedules declare (flat extents dynamic; the launcher passes them).
    A float8 cache is its bytes, ``uint8`` (the host passes its pointer): TileLang's C backend has no
    fp8 type, and its CUDA one needs a header the lean build leaves out (:mod:`tileops.kernels.float8`)."""
    D, half = spec.head_dim, spec.rot // 2
    NX, NQ, NK, NV, NP, NS = T.dynamic("NX, NQ, NK, NV, NP, NS")
    cache = "uint8" if spec.fp8 else storage
    return dict(QKV=T.Tensor((NX,), storage), P=T.Tensor((NP,), spec.positions), SL=T.Tensor((NS,), spec.slots),
                TD=T.Tensor((DIGITS, LO, 2, half), "float32"), QW=T.Tensor((D,), storage),
                KW=T.Tensor((D,), storage), Q=T.Tensor((NQ,), storage), KC=T.Tensor((NK,), cache),
                VC=T.Tensor((NV,), cache), KS=T.Tensor((1,), "float32"), VS=T.Tensor((1,), "float32"),
                ERR=T.Tensor((ENTRY,), "int32"))  # the call's error entry (kernels/report.py)


def build_prologue(spec: PrologueKernelSpec):
    """The ``T.prim_func`` for ``spec``; its parameters are :data:`ARGS` (see the module's docstring)."""
    global T
    import tilelang.language as T  # here, not at the top: loading a cached kernel never imports TileLang
    if spec.backend == "cuda":
        return _build_cuda(spec)
    D, half = spec.head_dim, spec.rot // 2
    dt = spec.dtype
    st = storage_dtype(dt, spec.backend)
    angles_of = angles(spec.rope)
    bad_slot = report("c")
    rotate_row = rotate(spec.rope, row=True)
    normed = norm_row(spec.norm) if spec.qk_norm else None

    @T.macro
    def load_row(QKV, f, xo):
        for c in T.serial(D):
            f[c] = load_f32(QKV, xo + c, st, dt)

    @T.macro
    def head(QKV, f, xo, W, acc, eps, cst, Y, yo):
        """One q or k head: loaded, normalised (with ``qk_norm``), rotated, stored at ``Y[yo:]``."""
        load_row(QKV, f, xo)
        if spec.qk_norm:
            normed(f, acc, W, W, eps)
        rotate_row(f, Y, 0, yo, cst)

    sig = _signature(spec, st)
    HQ, HKV, fp8 = spec.hq, spec.hkv, spec.fp8

    @T.macro
    def put_kv(QKV, f, xo, KW, acc, eps, cst, KC, VC, KS, VS, kr, co, csh, h):
        """kv head ``h`` of the token at ``QKV[xo:]`` into the caches at row offset ``co``: k
        normalised and rotated, v as read; a float8 cache gets ``e4m3(x / scale)`` of each, k from its
        value rounded to the dtype (``kr``), as the unfused chain stores it before the cache write."""
        ko = co + T.cast(h, "int64") * csh
        vo = xo + T.cast(HQ + HKV + h, "int64") * D
        if fp8:
            head(QKV, f, xo + T.cast(HQ + h, "int64") * D, KW, acc, eps, cst, kr, 0)
            for c in T.serial(D):
                KC[ko + c] = e4m3_bits(load_f32(kr, c, st, dt) / KS[0])
            for c in T.serial(D):
                VC[ko + c] = e4m3_bits(load_f32(QKV, vo + c, st, dt) / VS[0])
        else:
            head(QKV, f, xo + T.cast(HQ + h, "int64") * D, KW, acc, eps, cst, KC, ko)
            for c in T.serial(D):
                VC[ko + c] = QKV[vo + c]

    @T.prim_func
    def prologue_c(QKV: sig["QKV"], P: sig["P"], SL: sig["SL"], TD: sig["TD"], QW: sig["QW"], KW: sig["KW"],
                   Q: sig["Q"], KC: sig["KC"], VC: sig["VC"], KS: sig["KS"], VS: sig["VS"], ERR: sig["ERR"],
                   S: T.int32, xst: T.int64, qst: T.int64, qsh: T.int64,
                   csb: T.int64, csr: T.int64, csh: T.int64, bs: T.int64, nslots: T.int64, limit: T.int64,
                   tag: T.int32, eps_bits: T.int32, psc: T.int64):
        with T.Kernel(S, threads=1) as t:
            f = T.alloc_local((D,), "float32")
            kr = T.alloc_local((D,), st)  # a float8 cache's k, rounded to the dtype
            cst = T.alloc_local((2, half), "float32")
            acc = T.alloc_local((2,), "float64")
            eps = T.reinterpret(eps_bits, "float32")
            xo = T.cast(t, "int64") * xst
            qo = T.cast(t, "int64") * qst
            slot = T.cast(SL[t], "int64")
            # token t's position(s): P[t] (stream i: P[i * psc + t]), a bad one reported in ERR[0]
            angles_of(TD, cst, P, ERR, 0, 1, psc, limit, tag, 0, t, 0)
            for h in T.serial(HQ):
                head(QKV, f, xo + T.cast(h, "int64") * D, QW, acc, eps, cst, Q, qo + T.cast(h, "int64") * qsh)
            if slot >= nslots:
                bad_slot(ERR, 1, tag, t, slot)
            if slot >= 0 and slot < nslots:
                co = (slot // bs) * csb + (slot % bs) * csr
                for h in T.serial(HKV):
                    put_kv(QKV, f, xo, KW, acc, eps, cst, KC, VC, KS, VS, kr, co, csh, h)

    return prologue_c


def _build_cuda(spec: PrologueKernelSpec):
    """The CUDA schedule: one lane group per (token, head row), a block per ``tokens_per_block`` tokens.

    Why not the plan's 1-D grid over every (token, head) row with cos/sin composed per row: for
    Qwen3's 32/8/8 heads that composes a token's angles 40 times (every q and k row), 6 table loads of
    ``vec`` fp32 each per lane per row: 192 bytes of table reads (L1/L2) against the 32 bytes of x a
    lane moves in each direction, 6x the x traffic. The rope kernel's walk (cos/sin composed once per
    token and lane, reused across the heads it walks) measured 91-102% of a same-bytes copy on the
    H200. So a token's ``lanes * head_lanes`` threads compose its angles once and walk its head rows:
    row ``r = hl + k * head_lanes`` of the ``hq + 2 hkv`` (q, then k, then v), the row's kind a
    branch, uniform within a lane group. With ``head_lanes = 16`` Qwen3's 48 rows are 3 rows a group
    (16 q, 16 q, 8 k + 8 v), no group idle.

    Loads first, all of them. The first version walked the rows one at a time (load, the norm's
    butterfly, rotate, store, next row) behind the position and slot reads and the table loads: 62-70%
    of a same-bytes copy on the H200 at 64-16,384 tokens (``benchmarks/prologue.py``, 2048 tokens 21.8
    us against 14.9). Each lane had 32 bytes in flight at a time, and the whole prelude's latency
    (position, then its table rows; the slot) before its first load. The heads are compiled in
    (``hq``, ``hkv``: the op fixes them), so a lane now issues the loads of every row it will walk
    (``steps`` x 2 vectors: 96 bytes for Qwen3 bf16), none of them waiting on the position or the
    slot (a row of a live token lies inside qkv whatever its slot), then reads its position and slot
    and composes cos/sin while they are in flight, then works through the rows from registers.

    A lane holds the rope stage's unit, ``vec`` pairs and both elements of each (neox: the vectors at
    ``j0`` and ``R/2 + j0``; interleaved: ``2 vec`` contiguous elements): the pairing needs no shuffle
    or shared memory for any head_dim or rot. Lanes past ``rot / 2 / vec`` hold one vector of the
    columns past ``rot`` (copied, normalised with qk_norm). The norm's row sum is the norm's lane
    butterfly (:func:`tileops.kernels.norm.lane_allsum`) over the group's ``lanes`` lanes; every lane
    of a warp runs every step (rows past the end and dead tokens add 0), so the full-mask shuffles
    always meet. Tokens past ``S`` read token ``S - 1``'s position and slot (inside every buffer) and
    write nothing. A float8 cache stores each k and v element as ``cvt.rn.satfinite`` of ``x /
    scale`` (:func:`tileops.kernels.float8.store_e4m3`: the hardware's ``cvt.rn.satfinite``; the
    integer form is about 30 instructions an element, next to a store of one byte), ``vec`` bytes in
    one store: sm_89 and later (the host refuses older GPUs). With ``reciprocal_scale`` the quotient
    is the scale's reciprocal times ``x`` with one correction (:data:`tileops.kernels.float8.DIV_SOURCE`:
    the division's bits), not a division an element: a float8 row's k and v rows are 32 divisions a
    thread at head_dim 128, and the fp8 2,048-token row was the slowest for its bytes (83% of a copy).

    Variants of the cos/sin step (spec fields; the manifest turns ``share_angles`` on). Each
    composes the same fp32 operations on the same table values, so every variant stores the same bits
    (``benchmarks/prologue_schedules.py`` compares them bit for bit on the GPU):

    * ``share_angles``: without it every lane group composes the same cos/sin (``head_lanes`` times
      the table reads and FMAs a token). With it lane group 0 reads the position(s) and composes,
      writes its lanes' ``[2, R/2]`` into shared memory (a slot per token of the block), and after
      one block barrier (after the row loads, the slot and the weights are issued; every thread
      reaches it) every lane reads its ``V`` pairs back;
    * ``pair_angles`` (with ``share_angles``): the token's threads compose single pairs instead,
      pair ``j`` by thread ``j`` (``tileops.kernels.rope.pair_angle``: 6 scalar loads, coalesced
      across a warp, one pair's arithmetic; with MRoPE only the pair's stream's position is read), so
      the chain before the barrier is one position, one round of table loads and one pair.

    H200, one run side by side, % of a same-bytes copy (``results/prologue_schedules.md``), share
    / share and pairs / neither (``min_blocks`` 7, 7, 6): Qwen3 2,048 tokens 91.7 / 92.9 / 88.0,
    16,384 90.5 / 91.4 / 90.9, MRoPE 2,048 88.9 / 89.3 / 80.5, fp8 2,048 87.1 / 84.1 / 79.9 (with
    ``reciprocal_scale`` but in the last; without it, share and pairs 82.2). Loading
    MRoPE's three streams' rows as vectors and picking per pair was slower (57-71%) and is gone.
    """
    D, R, half = spec.head_dim, spec.rot, spec.rot // 2
    dt = spec.dtype
    V = spec.vec
    C = half // V  # lanes that rotate
    CL = spec.row_lanes  # lanes that hold a row: C rotate, CL - C copy
    L, HL = spec.lanes, spec.head_lanes
    TOK, TPB = spec.tokens_per_block, spec.block_threads
    HQ, HKV, NR, K = spec.hq, spec.hkv, spec.rows, spec.steps
    fp8 = spec.fp8
    rcp = fp8 and spec.reciprocal_scale
    mrope = spec.mrope
    rs, ns = spec.rope, spec.norm
    pos, rotated, store = position(rs), rotate_vals(rs), store_one(rs)
    bad_slot = report("cuda")
    angles_of = lane_angles(rs)
    norm = spec.qk_norm
    share, pairs = spec.share_angles, spec.pair_angles
    NT = L * HL  # a token's threads
    if pairs:
        pair_of = pair_angle(rs)
    if norm:
        allsum, value, rstd_of = lane_allsum(L), lane_value(ns), lane_rstd(ns)

    @T.macro
    def load(QKV, xr, o, buf, at):
        for v in T.vectorized(V):
            buf[at + v] = QKV[xr + o + v]

    @T.macro
    def put_cache(CC, yc, o, buf, scale, rscale):
        """``buf`` into a cache at ``CC[yc + o]``: as it is, or a float8 cache's ``e4m3(x / scale)``
        (``rscale``: the scale's reciprocal with ``reciprocal_scale``)."""
        if fp8:
            T.evaluate(store_e4m3(CC, yc + o, buf, scale, V, rscale if rcp else None))
        else:
            store(CC, yc + o, buf)

    @T.macro
    def put(Q, KC, VC, isq, isk, yq, yc, o, buf, ks, vs, kr, vr):
        """``buf`` to the row's destination: q (``Q[yq + o]``), k or v (``KC``/``VC[yc + o]``)."""
        if isq:
            store(Q, yq + o, buf)
        elif isk:
            put_cache(KC, yc, o, buf, ks, kr)
        else:
            put_cache(VC, yc, o, buf, vs, vr)

    @T.macro
    def normed(buf, wq, wk, isq, rstd):
        """``buf`` normalised in place with q's or k's weights, rounded to the dtype (the norm's output
        as the unfused chain stores it before the rotation reads it)."""
        if isq:
            for v in T.serial(V):
                buf[v] = T.cast(value(buf, wq, wq, 0, v, 0, rstd), dt)
        else:
            for v in T.serial(V):
                buf[v] = T.cast(value(buf, wk, wk, 0, v, 0, rstd), dt)

    sig = _signature(spec, dt)
    # the norm's helpers (tileops_xor_lane, and the same tileops_st16 as the rope stage's stores), and
    # for a float8 cache the conversion: TileLang keeps one import_source per kernel
    helpers = CUDA_HELPERS + (STORE_SOURCE if fp8 else "") + REPORT_SOURCE

    @T.prim_func
    def prologue_cuda(QKV: sig["QKV"], P: sig["P"], SL: sig["SL"], TD: sig["TD"], QW: sig["QW"], KW: sig["KW"],
                      Q: sig["Q"], KC: sig["KC"], VC: sig["VC"], KS: sig["KS"], VS: sig["VS"], ERR: sig["ERR"],
                      S: T.int32, xst: T.int64, qst: T.int64, qsh: T.int64,
                      csb: T.int64, csr: T.int64, csh: T.int64, bs: T.int64, nslots: T.int64, limit: T.int64,
                      tag: T.int32, eps_bits: T.int32, psc: T.int64):
        with T.Kernel(T.ceildiv(S, TOK), threads=TPB) as bx:
            T.import_source(helpers)
            T.annotate_min_blocks_per_sm(spec.min_blocks)
            tx = T.get_thread_binding()
            lane = tx % L
            hl = (tx // L) % HL
            t = bx * TOK + tx // (L * HL)
            live = t < S
            ts = T.min(t, S - 1)  # a dead token reads the last one's position and slot, writes nothing
            cs = T.alloc_local((V,), "float32")
            sn = T.alloc_local((V,), "float32")
            c2 = T.alloc_local((V,), "float32")
            s2 = T.alloc_local((V,), "float32")
            c1 = T.alloc_local((V,), "float32")
            s1 = T.alloc_local((V,), "float32")
            c0 = T.alloc_local((V,), "float32")
            s0 = T.alloc_local((V,), "float32")
            ra = T.alloc_local((K * V,), dt)  # every row's vectors, loaded up front
            rb = T.alloc_local((K * V,), dt)
            xa = T.alloc_local((V,), dt)
            xb = T.alloc_local((V,), dt)
            ya = T.alloc_local((V,), dt)
            yb = T.alloc_local((V,), dt)
            wqa = T.alloc_local((V,), dt)
            wqb = T.alloc_local((V,), dt)
            wka = T.alloc_local((V,), dt)
            wkb = T.alloc_local((V,), dt)
            acc = T.alloc_local((1,), "float32")
            eps = T.reinterpret(eps_bits, "float32")
            xo = T.cast(ts, "int64") * xst * V
            qo = T.cast(ts, "int64") * qst * V
            j0 = lane * V
            o1, o2 = pair_offsets(rs, j0)
            oc = R + (lane - C) * V  # a copy lane's vector
            # 1. every row's loads, waiting on nothing
            for k in T.unroll(K):
                if live and hl + k * HL < NR:
                    if lane < C:
                        load(QKV, xo + T.cast(hl + k * HL, "int64") * D, o1, ra, k * V)
                        load(QKV, xo + T.cast(hl + k * HL, "int64") * D, o2, rb, k * V)
                    elif lane < CL:
                        load(QKV, xo + T.cast(hl + k * HL, "int64") * D, oc, ra, k * V)
            # 2. while they fly: token ts's position(s) (a bad one reported in ERR[0], read as 0), its
            # cos/sin, its slot, the norm weights, the scales
            if share:  # the token's cos/sin [2, R/2] in shared memory, read after the barrier below
                CSS = T.alloc_shared((TOK, 2, half), "float32", scope="shared")
            if pairs:  # each thread of the token its pairs j, j + NT, ...
                for k in T.unroll(-(-half // NT)):
                    if tx % NT + k * NT < half:
                        pair_of(TD, CSS, P, ERR, 0, 1, psc, limit, tag, 0, ts, tx % NT + k * NT, tx // NT, 0)
            elif not share or hl == 0:  # shared: lane group 0 reads the position(s), composes and stores
                if mrope:
                    pt = pos(P, ERR, 0, 1, limit, tag, 0, ts, 0, psc, 0)
                    ph = pos(P, ERR, 0, 1, limit, tag, 0, ts, 1, psc, 0)
                    pw = pos(P, ERR, 0, 1, limit, tag, 0, ts, 2, psc, 0)
                else:
                    p = pos(P, ERR, 0, 1, limit, tag, 0, ts, None, None, 0)
                if share and lane < C:  # (else composed below, beside the norm weights' loads)
                    if mrope:
                        angles_of(TD, j0, None, pt, ph, pw, c2, s2, c1, s1, c0, s0, cs, sn)
                    else:
                        angles_of(TD, j0, p, None, None, None, c2, s2, c1, s1, c0, s0, cs, sn)
                    for v in T.vectorized(V):
                        CSS[tx // NT, 0, j0 + v] = cs[v]
                    for v in T.vectorized(V):
                        CSS[tx // NT, 1, j0 + v] = sn[v]
            slot = T.cast(SL[ts], "int64")
            if live and slot >= nslots and tx % (L * HL) == 0:
                bad_slot(ERR, 1, tag, ts, slot)
            kept = slot >= 0 and slot < nslots  # k and v written; a bad slot is never an address
            co = T.alloc_var("int64")  # the slot's cache row; variables: computed once, not per store
            co = T.int64(0)
            if kept:  # slot >= 0 and bs > 0: truncating division is the floor, without sign fixes
                co = (T.truncdiv(slot, bs) * csb + T.truncmod(slot, bs) * csr) * V
            ks = T.alloc_var("float32")
            vs = T.alloc_var("float32")
            ks = T.float32(1)
            vs = T.float32(1)
            kr = T.alloc_var("float32")  # their reciprocals, with reciprocal_scale (once a thread)
            vr = T.alloc_var("float32")
            kr = T.float32(0)
            vr = T.float32(0)
            if fp8:
                ks = KS[0]
                vs = VS[0]
                if rcp:
                    kr = reciprocal_scale(ks)
                    vr = reciprocal_scale(vs)
            if lane < C:
                if not share:  # (shared: read after the barrier below)
                    if mrope:
                        angles_of(TD, j0, None, pt, ph, pw, c2, s2, c1, s1, c0, s0, cs, sn)
                    else:
                        angles_of(TD, j0, p, None, None, None, c2, s2, c1, s1, c0, s0, cs, sn)
                if norm:
                    load(QW, 0, o1, wqa, 0)
                    load(QW, 0, o2, wqb, 0)
                    load(KW, 0, o1, wka, 0)
                    load(KW, 0, o2, wkb, 0)
            elif lane < CL:
                if norm:
                    load(QW, 0, oc, wqa, 0)
                    load(KW, 0, oc, wka, 0)
            if share:  # every thread of the block, none in a branch
                T.sync_threads()
                if lane < C:
                    for v in T.vectorized(V):
                        cs[v] = CSS[tx // NT, 0, j0 + v]
                    for v in T.vectorized(V):
                        sn[v] = CSS[tx // NT, 1, j0 + v]
            # 3. the rows, from registers
            for k in T.unroll(K):
                r = hl + k * HL
                isq = r < HQ
                isk = r >= HQ and r < HQ + HKV
                ok = live and r < NR and (isq or kept)
                yq = qo + T.cast(r, "int64") * qsh * V
                yc = co + T.cast(T.if_then_else(isk, r - HQ, r - HQ - HKV), "int64") * csh * V
                for v in T.serial(V):
                    xa[v] = ra[k * V + v]
                    xb[v] = rb[k * V + v]
                if norm:
                    # the row's sum of squares: every lane of the warp shuffles, a lane with nothing adds 0
                    acc[0] = T.float32(0)
                    if ok and (isq or isk):
                        if lane < CL:
                            for v in T.serial(V):
                                acc[0] = acc[0] + T.cast(xa[v], "float32") * T.cast(xa[v], "float32")
                        if lane < C:
                            for v in T.serial(V):
                                acc[0] = acc[0] + T.cast(xb[v], "float32") * T.cast(xb[v], "float32")
                    allsum(acc, 1)
                    rstd = T.alloc_var("float32")
                    rstd = rstd_of(acc, eps)
                    if ok and (isq or isk):
                        if lane < CL:
                            normed(xa, wqa, wka, isq, rstd)
                        if lane < C:
                            normed(xb, wqb, wkb, isq, rstd)
                if ok:
                    if lane < C:
                        if isq or isk:
                            rotated(xa, xb, cs, sn, ya, yb)
                            put(Q, KC, VC, isq, isk, yq, yc, o1, ya, ks, vs, kr, vr)
                            put(Q, KC, VC, isq, isk, yq, yc, o2, yb, ks, vs, kr, vr)
                        else:
                            put(Q, KC, VC, isq, isk, yq, yc, o1, xa, ks, vs, kr, vr)
                            put(Q, KC, VC, isq, isk, yq, yc, o2, xb, ks, vs, kr, vr)
                    elif lane < CL:
                        put(Q, KC, VC, isq, isk, yq, yc, oc, xa, ks, vs, kr, vr)

    return prologue_cuda


#: the names :mod:`tileops.kernels` looks up in a builder module
build = build_prologue
Spec = PrologueKernelSpec
