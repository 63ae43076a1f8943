"""The attention prologue as one TileLang tile program (issue 24): per-head RMSNorm of q and k, RoPE
at explicit positions, q written once, k and v written into a paged KV cache, one launch.

Composed from the stages the norm and rope builders export (``USES`` below: their sources are part
of this builder's cache key), not a copy of their math: :func:`tileops.kernels.rope.angles` (the
position read, bounds-checked, and the cos/sin composition from the digit tables, MRoPE's per-pair
stream pick included), :func:`tileops.kernels.rope.rotate` (the pairing, the partial-rotary copy,
the store in the dtype) and :func:`tileops.kernels.norm.norm_row` (the per-row RMSNorm with the
spec's ``rounding``/``offset``, its row sum in float64 as the norm's C schedule adds it). A rope
variant or pairing added to those stages reaches this kernel with no edit here. So far the C
schedule only (``build`` refuses ``backend="cuda"``; ``docs/dev/prologue-plan.md`` plans the CUDA
one) and a cache of qkv's own dtype.

Inputs (all flat buffers addressed by element strides, as the rope and norm builders take them):

* ``QKV``: row ``t`` holds ``HQ`` q heads, then ``HKV`` k heads, then ``HKV`` v heads of ``D``
  elements each, contiguous within the row; ``xst`` is the row stride (a row-strided slice of a
  wider projection output is fine).
* ``P``: ``[S]`` positions (int32/int64), contiguous; with ``mrope_section``, ``[3, S]``: three
  streams (temporal, height, width), stream ``i`` at ``P[i * psc :]``. One outside ``[0, limit)``
  reads as position 0 (no table row past the end is touched) and writes ``tag`` into ``ERR[0]``.
* ``SL``: ``[S]`` cache slots (int32/int64). A negative slot skips the token's k and v (vLLM's
  padding slot -1); a slot at or past ``nslots`` writes ``tag`` into ``ERR[1]`` and skips them, so
  no cache row past the end is written. q is written whatever the slot.
* ``TD``: the rope family's digit tables ``[3, 256, 2, R/2]`` (``tileops.rope.tables``): any rope
  variant's frequencies and amplitude reach this kernel as they reach the rope kernel.
* ``QW``, ``KW``: the per-head RMSNorm weights ``[D]`` (read only with ``qk_norm``).
* ``KC``, ``VC``: the caches; element ``(slot, h, d)`` at ``(slot // bs) * csb + (slot % bs) * csr
  + h * csh + d``. The layout is the strides: NHD ``[blocks, bs, HKV, D]`` is ``csr = HKV * D``,
  ``csh = D``; HND ``[blocks, HKV, bs, D]`` is ``csr = D``, ``csh = bs * D``.

Rounding: the norm's output is rounded to qkv's dtype before the rotation reads it, as the unfused
chain (norm op, then rope op) stores it between the two; the norm itself follows ``rounding``
(``llama``: ``n = round(x * rsqrt(mean(x^2) + eps))``, ``y = round(n * w)``; ``fp32``: ``y =
round(x * rsqrt(...) * (offset + w))``, Gemma's form with ``offset=1``). The rotation is in fp32,
rounded once.
"""

from dataclasses import dataclass
from typing import Any

from .norm import NormKernelSpec, norm_row
from .rope import DIGITS, LO, RoPEKernelSpec, angles, rotate
from .storage import load_f32, storage_dtype

#: ``tilelang.language``, imported when a kernel is first built (:func:`build_prologue`)
T: Any = None

__all__ = ["PrologueKernelSpec", "build_prologue", "build", "Spec", "STATIC", "USES", "ARGS"]

#: no schedule choices yet: the C schedule has none (the CUDA one will: lanes per row, rows per block)
STATIC = {}

#: the builders whose stages this one composes: their sources join its cache key
#: (:func:`tileops.kernels.used_files`)
USES = ("norm", "rope")

_DTYPES = ("float16", "bfloat16", "float32")

#: the generated function's parameters, in order; the launcher binds by these names and passes 0 for
#: the norm weights of a kernel without ``qk_norm`` (never read) and for ``psc`` (the stride between
#: MRoPE's three position streams) of a kernel without ``mrope_section`` (never read)
ARGS = ("QKV", "P", "SL", "TD", "QW", "KW", "Q", "KC", "VC", "ERR",
        "S", "HQ", "HKV", "xst", "qst", "qsh", "csb", "csr", "csh", "bs", "nslots", "limit", "tag", "eps_bits",
        "psc")


@dataclass(frozen=True)
class PrologueKernelSpec:
    """Everything a prologue kernel is compiled for; two equal specs share one compiled kernel."""

    dtype: str  # qkv, q out and the caches: float16 | bfloat16 | float32
    head_dim: int  # D
    rot: int  # rotated width R, even, <= D; columns R..D are copied
    positions: str = "int64"  # int32 | int64
    slots: str = "int64"  # int32 | int64
    qk_norm: bool = False  # per-head RMSNorm of q and k, weights of ``dtype``
    pairing: str = "neox"  # neox | interleaved (the rope family's pairings)
    backend: str = "c"  # c only so far
    #: MRoPE: pairs per position stream (temporal, height, width), summing to rot // 2 (as
    #: :class:`tileops.kernels.rope.RoPEKernelSpec` has it); ``P`` is then ``[3, S]``
    mrope_section: "tuple[int, int, int] | None" = None
    mrope_interleaved: bool = False  # Qwen3-VL's stream map instead of consecutive sections
    rounding: str = "llama"  # the norm's: llama | fp32 (:mod:`tileops.kernels.norm`); with qk_norm
    offset: float = 0.0  # the norm scales by ``offset + w`` (Gemma: 1.0); with qk_norm

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype: expected one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if type(self.head_dim) is not int or self.head_dim < 2:
            raise ValueError(f"head_dim: expected an int >= 2, got {self.head_dim!r}")
        if type(self.rot) is not int or self.rot < 2 or self.rot % 2 or self.rot > self.head_dim:
            raise ValueError(f"rot: expected an even width in [2, {self.head_dim}], got {self.rot!r}")
        for name in ("positions", "slots"):
            if getattr(self, name) not in ("int32", "int64"):
                raise ValueError(f"{name}: expected 'int32' or 'int64', got {getattr(self, name)!r}")
        if self.backend != "c":
            raise ValueError(f"backend: only 'c' is built so far (the CUDA schedule is planned in "
                             f"docs/dev/prologue-plan.md), got {self.backend!r}")
        if not self.qk_norm and (self.rounding != "llama" or self.offset != 0.0):
            raise ValueError(f"rounding, offset: the norm's choices, expected the defaults ('llama', 0.0) "
                             f"without qk_norm, got {self.rounding!r}, {self.offset!r}")
        self.rope_spec  # noqa: B018 - the rope stage's own checks (pairing, mrope_section), by field name
        self.norm_spec  # noqa: B018 - and the norm's (rounding, offset)

    @property
    def rope_spec(self) -> RoPEKernelSpec:
        """The spec of the rope stages this kernel composes."""
        return RoPEKernelSpec(dtype=self.dtype, head_dim=self.head_dim, rot=self.rot, pairing=self.pairing,
                              positions=self.positions, backend=self.backend, mrope_section=self.mrope_section,
                              mrope_interleaved=self.mrope_interleaved)

    @property
    def norm_spec(self) -> "NormKernelSpec | None":
        """The spec of the norm stage (a per-head RMSNorm forward with a weight of ``dtype``), or None
        without ``qk_norm``."""
        if not self.qk_norm:
            return None
        return NormKernelSpec(kind="fwd", hidden=self.head_dim, dtype=self.dtype, weight=self.dtype,
                              rounding=self.rounding, offset=self.offset, backend=self.backend)

    @property
    def stride_unit(self) -> int:
        """The unit of every stride the kernel takes: one element on the C backend."""
        return 1

    #: the generated function's parameter names, in order (not a field: the same for every spec)
    args = ARGS


def build_prologue(spec: PrologueKernelSpec):
    """The ``T.prim_func`` for ``spec``; its parameters are :data:`ARGS` (see the module's docstring)."""
    global T
    import tilelang.language as T  # here, not at the top: loading a cached kernel never imports TileLang
    D, half = spec.head_dim, spec.rot // 2
    dt = spec.dtype
    st = storage_dtype(dt, spec.backend)
    NX, NQ, NK, NV, NP, NS = T.dynamic("NX, NQ, NK, NV, NP, NS")
    angles_of = angles(spec.rope_spec)
    rotate_row = rotate(spec.rope_spec, row=True)
    normed = norm_row(spec.norm_spec) if spec.qk_norm else None

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

    @T.prim_func
    def prologue_c(QKV: T.Tensor((NX,), st), P: T.Tensor((NP,), spec.positions),
                   SL: T.Tensor((NS,), spec.slots), TD: T.Tensor((DIGITS, LO, 2, half), "float32"),
                   QW: T.Tensor((D,), st), KW: T.Tensor((D,), st), Q: T.Tensor((NQ,), st),
                   KC: T.Tensor((NK,), st), VC: T.Tensor((NV,), st), ERR: T.Tensor((2,), "int32"),
                   S: T.int32, HQ: T.int32, HKV: T.int32, xst: T.int64, qst: T.int64, qsh: T.int64,
                   csb: T.int64, csr: T.int64, csh: T.int64, bs: T.int64, nslots: T.int64, limit: T.int64,
                   tag: T.int32, eps_bits: T.int32, psc: T.int64):
        with T.Kernel(S, threads=1) as t:
            f = T.alloc_local((D,), "float32")
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
                ERR[1] = tag
            if slot >= 0 and slot < nslots:
                co = (slot // bs) * csb + (slot % bs) * csr
                for h in T.serial(HKV):
                    head(QKV, f, xo + T.cast(HQ + h, "int64") * D, KW, acc, eps, cst, KC,
                         co + T.cast(h, "int64") * csh)
                    vo = xo + T.cast(HQ + HKV + h, "int64") * D
                    for c in T.serial(D):
                        VC[co + T.cast(h, "int64") * csh + c] = QKV[vo + c]

    return prologue_c


#: the names :mod:`tileops.kernels` looks up in a builder module
build = build_prologue
Spec = PrologueKernelSpec
