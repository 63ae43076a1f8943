"""The attention prologue as one TileLang tile program (issue 24): per-head RMSNorm of q and k, RoPE
at explicit positions, q written once, k and v written into a paged KV cache, one launch.

First configuration only (``docs/dev/prologue-plan.md`` says what follows): the C schedule (a CUDA
schedule is not written yet: ``build`` refuses ``backend="cuda"``), neox pairing, a cache of qkv's
own dtype. The stages are those of the norm and rope families, written here in the same math until
``kernels/norm.py`` and ``kernels/rope.py`` export them as macros (the plan's "Refactor" section):
their helpers are private names, and editing those files re-keys every shipped kernel.

Inputs (all flat buffers addressed by element strides, as the rope and norm builders take them):

* ``QKV``: row ``t`` holds ``HQ`` q heads, then ``HKV`` k heads, then ``HKV`` v heads of ``D``
  elements each, contiguous within the row; ``xst`` is the row stride (a row-strided slice of a
  wider projection output is fine).
* ``P``: ``[S]`` positions (int32/int64). One outside ``[0, limit)`` reads as position 0 (no table
  row past the end is touched) and writes ``tag`` into ``ERR[0]``.
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
chain (norm op, then rope op) stores it between the two; the norm itself is the ``llama`` form
(``n = round(x * rsqrt(mean(x^2) + eps))``, ``y = round(n * w)``), its row sum in float64 as
``kernels/norm.py``'s C schedule adds it. The rotation is in fp32, rounded once.
"""

from dataclasses import dataclass
from typing import Any

from .rope import DIGITS, LO
from .storage import load_f32, storage_dtype, to_storage

#: ``tilelang.language``, imported when a kernel is first built (:func:`build_prologue`)
T: Any = None

__all__ = ["PrologueKernelSpec", "build_prologue", "build", "Spec", "STATIC", "ARGS"]

#: no schedule choices yet: the C schedule has none (the CUDA one will: lanes per row, rows per block)
STATIC = {}

_DTYPES = ("float16", "bfloat16", "float32")

#: the generated function's parameters, in order; the launcher binds by these names and passes 0 for
#: the norm weights of a kernel without ``qk_norm`` (never read)
ARGS = ("QKV", "P", "SL", "TD", "QW", "KW", "Q", "KC", "VC", "ERR",
        "S", "HQ", "HKV", "xst", "qst", "qsh", "csb", "csr", "csh", "bs", "nslots", "limit", "tag", "eps_bits")


@dataclass(frozen=True)
class PrologueKernelSpec:
    """Everything a prologue kernel is compiled for; two equal specs share one compiled kernel."""

    dtype: str  # qkv, q out and the caches: float16 | bfloat16 | float32
    head_dim: int  # D
    rot: int  # rotated width R, even, <= D; columns R..D are copied
    positions: str = "int64"  # int32 | int64
    slots: str = "int64"  # int32 | int64
    qk_norm: bool = False  # per-head RMSNorm of q and k (llama rounding), weights of ``dtype``
    pairing: str = "neox"  # neox only so far
    backend: str = "c"  # c only so far

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
        if self.pairing != "neox":
            raise ValueError(f"pairing: only 'neox' is built so far, got {self.pairing!r}")
        if self.backend != "c":
            raise ValueError(f"backend: only 'c' is built so far (the CUDA schedule is planned in "
                             f"docs/dev/prologue-plan.md), got {self.backend!r}")

    @property
    def stride_unit(self) -> int:
        """The unit of every stride the kernel takes: one element on the C backend."""
        return 1

    #: the generated function's parameter names, in order (not a field: the same for every spec)
    args = ARGS


def _rounded(value, dtype: str, storage: str):
    """fp32 ``value`` rounded to ``dtype`` and widened back to fp32 (what storing it and reading it
    back gives): through :func:`to_storage`, so the C backend's hand-rounded bf16 is the one stored."""
    if dtype == "float32":
        return value
    bits = to_storage(value, storage, dtype)
    if storage == "int16":  # bf16 bits on the C backend: the top half of an fp32
        return T.reinterpret(T.shift_left(T.cast(T.cast(bits, "uint16"), "uint32"), T.uint32(16)), "float32")
    return T.cast(bits, "float32")


def build_prologue(spec: PrologueKernelSpec):
    """The ``T.prim_func`` for ``spec``; its parameters are :data:`ARGS` (see the module's docstring)."""
    global T
    import tilelang.language as T  # here, not at the top: loading a cached kernel never imports TileLang
    D, R, half = spec.head_dim, spec.rot, spec.rot // 2
    dt = spec.dtype
    st = storage_dtype(dt, spec.backend)
    NX, NQ, NK, NV, NP, NS = T.dynamic("NX, NQ, NK, NV, NP, NS")

    @T.macro
    def position(P, ERR, t, limit, tag):
        """``P[t]`` checked against ``[0, limit)``; one outside reads as 0 and marks ``ERR[0]``."""
        p = T.alloc_var("int64")
        raw = T.cast(P[t], "int64")
        if raw < 0 or raw >= limit:
            ERR[0] = tag
            p = 0
        else:
            p = raw
        return p

    @T.macro
    def cos_sin(TD, cst, p):
        """``cst[0, j], cst[1, j]`` = cos, sin of ``p * f_j`` (times the amplitude), composed from
        the three 8-bit digits of ``p`` by angle addition, as the rope kernel composes them."""
        d0 = p % LO
        d1 = (p // LO) % LO
        d2 = p // (LO * LO)
        for j in T.serial(half):
            c12 = TD[2, d2, 0, j] * TD[1, d1, 0, j] - TD[2, d2, 1, j] * TD[1, d1, 1, j]
            s12 = TD[2, d2, 1, j] * TD[1, d1, 0, j] + TD[2, d2, 0, j] * TD[1, d1, 1, j]
            cst[0, j] = c12 * TD[0, d0, 0, j] - s12 * TD[0, d0, 1, j]
            cst[1, j] = s12 * TD[0, d0, 0, j] + c12 * TD[0, d0, 1, j]

    @T.macro
    def rms_row(f, W, acc, eps):
        """The per-head RMSNorm stage on the fp32 row ``f[0:D]``, in place, ``llama`` rounding, and
        the result rounded to qkv's dtype (the unfused chain stores it there)."""
        acc[0] = T.float64(0)
        for c in T.serial(D):
            acc[0] = acc[0] + T.cast(f[c] * f[c], "float64")
        rstd = T.float32(1) / T.sqrt(T.cast(acc[0] / T.float64(D), "float32") + eps)
        for c in T.serial(D):
            f[c] = _rounded(_rounded(f[c] * rstd, dt, st) * load_f32(W, c, st, dt), dt, st)

    @T.macro
    def rotate_store(f, cst, Y, yo):
        """The rope stage: ``f[0:D]`` rotated (neox pairs ``(j, j + R/2)``), columns past ``R``
        copied, stored at ``Y[yo:yo + D]``."""
        for j in T.serial(half):
            a = f[j]
            c = f[j + half]
            Y[yo + j] = to_storage(a * cst[0, j] - c * cst[1, j], st, dt)
            Y[yo + j + half] = to_storage(c * cst[0, j] + a * cst[1, j], st, dt)
        for i in T.serial(D - R):
            Y[yo + R + i] = to_storage(f[R + i], st, dt)

    @T.macro
    def load_row(QKV, f, xo):
        for c in T.serial(D):
            f[c] = load_f32(QKV, xo + c, st, dt)

    @T.prim_func
    def prologue_c(QKV: T.Tensor((NX,), st), P: T.Tensor((NP,), spec.positions),
                   SL: T.Tensor((NS,), spec.slots), TD: T.Tensor((DIGITS, LO, 2, half), "float32"),
                   QW: T.Tensor((D,), st), KW: T.Tensor((D,), st), Q: T.Tensor((NQ,), st),
                   KC: T.Tensor((NK,), st), VC: T.Tensor((NV,), st), ERR: T.Tensor((2,), "int32"),
                   S: T.int32, HQ: T.int32, HKV: T.int32, xst: T.int64, qst: T.int64, qsh: T.int64,
                   csb: T.int64, csr: T.int64, csh: T.int64, bs: T.int64, nslots: T.int64, limit: T.int64,
                   tag: T.int32, eps_bits: T.int32):
        with T.Kernel(S, threads=1) as t:
            f = T.alloc_local((D,), "float32")
            cst = T.alloc_local((2, half), "float32")
            acc = T.alloc_local((1,), "float64")
            eps = T.reinterpret(eps_bits, "float32")
            p = position(P, ERR, t, limit, tag)
            cos_sin(TD, cst, p)
            xo = T.cast(t, "int64") * xst
            for h in T.serial(HQ):
                load_row(QKV, f, xo + T.cast(h, "int64") * D)
                if spec.qk_norm:
                    rms_row(f, QW, acc, eps)
                rotate_store(f, cst, Q, T.cast(t, "int64") * qst + T.cast(h, "int64") * qsh)
            slot = T.cast(SL[t], "int64")
            if slot >= nslots:
                ERR[1] = tag
            if slot >= 0 and slot < nslots:
                co = (slot // bs) * csb + (slot % bs) * csr
                for h in T.serial(HKV):
                    load_row(QKV, f, xo + T.cast(HQ + h, "int64") * D)
                    if spec.qk_norm:
                        rms_row(f, KW, acc, eps)
                    rotate_store(f, cst, KC, co + T.cast(h, "int64") * csh)
                    vo = xo + T.cast(HQ + HKV + h, "int64") * D
                    for c in T.serial(D):
                        VC[co + T.cast(h, "int64") * csh + c] = QKV[vo + c]

    return prologue_c


#: the names :mod:`tileops.kernels` looks up in a builder module
build = build_prologue
Spec = PrologueKernelSpec
