"""The attention prologue kernel (``kernels/prologue.py``, issue 24), driven directly on the CPU: the C
backend, and the CUDA schedule's generated source through ``tests/cuda_on_cpu.py`` (the ``test_cuda_*``
tests, the same checks, plus a lean nvcc build for sm_90 and sm_80 and two mutations of the source
that the checks must catch).

The reference is float64 math written here from the issue's definition (RMSNorm per head, RoPE of
either pairing at the given positions, MRoPE's three streams, cos/sin evaluated in float64, the
paged cache write): it shares no code with the kernel. The kernel's only input from the package is the rope family's digit tables
(``tileops.rope.tables.digit_tables``), the tables every rope op hands its kernel.

Every output (q, both caches) is NaN-filled before the launch, so an element the kernel fails to
write cannot pass, and a cache row no slot names must still be NaN after it. Inputs are seeded random
draws (``gen``). Bad positions and slots are checked to be reported in the error words and never to
reach memory outside the cache: each cache is a view of a larger NaN-filled buffer whose tail must
stay untouched. The norm's two roundings are also checked bit for bit on the columns past a partial
rotary width (the norm's output, copied), against an fp32 emulation of the norm's definition. A
float8 cache is checked against the reference divided by the scale: v bit for bit against torch's
saturating cast of ``v / scale``, k within half an e4m3 step of the float64 k (plus the dtype's
rounding). Not covered here: the CUDA schedule on a GPU (``tests/test_attention_cuda.py``).
"""

from __future__ import annotations

import functools
import re
import struct

import pytest
import torch

from tests import cuda_on_cpu
from tests.test_lean_build import needs_toolchain
from tileops.compile.build import emit_source, load_kernel
from tileops.kernels import get_spec, report
from tileops.runtime import errors
from tileops.rope.tables import digit_tables

CPU = torch.device("cpu")
NAN = float("nan")
BASE = 10_000.0
EPS = 1e-6
#: positions at or past this are the op's to report (any limit below 2^24 the tables cover)
LIMIT = 40_000
#: per-element error unit of each dtype's rounding (half an ulp at 1.0)
UNIT = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def prologue_spec(dtype: str, head_dim: int, rot: int, *, pairing: str = "neox", positions: str = "int64",
                  mrope_section: tuple[int, int, int] | None = None, mrope_interleaved: bool = False,
                  qk_norm: bool = False, rounding: str = "llama", offset: float = 0.0, backend: str = "c",
                  **fields):
    """A kernel spec as :mod:`tileops.compose` makes one: the rope stage's spec and (``qk_norm``) the norm
    stage's, as the rope and norm ops' forward kernels have them, then the builder's own ``fields``."""
    rope = get_spec("rope")(dtype=dtype, head_dim=head_dim, rot=rot, pairing=pairing, positions=positions,
                            backend=backend, mrope_section=mrope_section, mrope_interleaved=mrope_interleaved)
    norm = get_spec("norm")(kind="fwd", hidden=head_dim, dtype=dtype, weight=dtype, rounding=rounding, offset=offset,
                            backend=backend) if qk_norm else None
    return get_spec("prologue")(rope=rope, norm=norm, **fields)


def inv_freq(rot: int) -> torch.Tensor:
    return 1.0 / BASE ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)


def mrope_stream(j: int, section: tuple[int, int, int], interleaved: bool) -> int:
    """The position stream (0 temporal, 1 height, 2 width) of rotary pair ``j``: Qwen2-VL's
    consecutive sections, or Qwen3-VL's interleaved map (height on ``j % 3 == 1`` for the first
    ``3 * section[1]`` pairs, width on ``j % 3 == 2`` for the first ``3 * section[2]``)."""
    if interleaved:
        if j % 3 == 1 and j < 3 * section[1]:
            return 1
        if j % 3 == 2 and j < 3 * section[2]:
            return 2
        return 0
    return 0 if j < section[0] else 1 if j < section[0] + section[1] else 2


def reference(qkv, positions, slots, hq, hkv, d, rot, amplitude, qw, kw, nslots, pairing="neox", section=None,
              interleaved=False, offset=0.0):
    """float64 (q, k rows, v rows, pair magnitude of q and k) from the math: q ``[S, hq, d]``; k and v
    ``{slot: [hkv, d]}`` for each token with a slot in ``[0, nslots)``. A position outside
    ``[0, LIMIT)`` rotates as position 0 (what the kernel reads in its place); with MRoPE
    (``positions`` ``[3, S]``) each stream's bad position reads 0 on its own."""
    x = qkv.double().reshape(qkv.shape[0], hq + 2 * hkv, d)
    q, k, v = x[:, :hq], x[:, hq:hq + hkv], x[:, hq + hkv:]
    if qw is not None:
        q = q / torch.sqrt((q * q).mean(-1, keepdim=True) + EPS) * (offset + qw.double())
        k = k / torch.sqrt((k * k).mean(-1, keepdim=True) + EPS) * (offset + kw.double())
    p = positions.double()
    p = torch.where((p < 0) | (p >= LIMIT), torch.zeros_like(p), p)
    half = rot // 2
    if section is None:
        pj = p[:, None].expand(-1, half)  # [S, rot/2]: every pair at the token's position
    else:
        streams = torch.tensor([mrope_stream(j, section, interleaved) for j in range(half)])
        pj = p[streams, :].T  # [S, rot/2]: pair j at its stream's position
    ang = pj * inv_freq(rot)[None, :]
    cos, sin = (ang.cos() * amplitude)[:, None, :], (ang.sin() * amplitude)[:, None, :]
    if pairing == "neox":
        first, second = torch.arange(half), torch.arange(half) + half
    else:  # interleaved: (2j, 2j + 1)
        first, second = torch.arange(0, rot, 2), torch.arange(1, rot, 2)

    def rotate(t):
        a, c = t[..., first], t[..., second]
        out = t.clone()
        out[..., first] = a * cos - c * sin
        out[..., second] = c * cos + a * sin
        mag = t.abs().clone()
        mag[..., first] = a.abs() + c.abs()
        mag[..., second] = a.abs() + c.abs()
        return out, mag

    q_out, q_mag = rotate(q)
    k_out, k_mag = rotate(k)
    ks, vs, kmag = {}, {}, {}
    for t, s in enumerate(slots.tolist()):
        if 0 <= s < nslots:
            ks[s], vs[s], kmag[s] = k_out[t], v[t], k_mag[t]
    return q_out, q_mag, ks, vs, kmag


def assert_within(got, ref, mag, unit, what):
    """``|got - ref| <= 8 * unit * mag + 2 subnormal steps``: the kernel rounds the norm's output twice to the
    dtype (``n`` and ``n * w``) and the rotation once; each rounding moves a pair's element by at
    most ``unit`` of the pair's magnitude, and fp32 arithmetic adds a few 2^-24."""
    # below the dtype's smallest normal the spacing is absolute: fp16's 2^-24 (a normalised value
    # near 5e-6 rounds to it; seen in 1 of 6 runs), bf16's 2^-133
    fi = torch.finfo(got.dtype)
    got = got.double()
    assert torch.isfinite(got).all(), f"{what}: {int((~torch.isfinite(got)).sum())} elements not written"
    err = (got - ref).abs()
    bound = 8 * max(unit, 2.0**-22) * mag + 2 * fi.smallest_normal * fi.eps
    bad = err > bound
    assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.numel()} elements off; max error {err.max():.3e}"


def assert_e4m3(got, ref, mag, unit, what):
    """A float8 e4m3fn cache row against the float64 ``ref`` (already divided by the scale): saturated
    at 448, and otherwise within half an e4m3 step of it (2^-4 of the value; 2^-10 absolute among the
    subnormals) plus the dtype's roundings before the conversion (:func:`assert_within`'s bound)."""
    got = got.double()
    assert not torch.isnan(got).any(), f"{what}: {int(torch.isnan(got).sum())} elements not written"
    want = ref.clamp(-448.0, 448.0)
    slack = 8 * max(unit, 2.0**-22) * mag
    err = (got - want).abs()
    bad = err > 2.0**-4 * (want.abs() + slack) + 2.0**-10 + slack
    assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.numel()} elements off; max error {err.max():.3e}"


def e4m3(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What a float8 cache holds for ``x`` (its bits): ``x / scale`` in fp32, saturated, as torch casts it."""
    return (x.float() / torch.tensor(scale, dtype=torch.float32)).clamp(-448, 448).to(torch.float8_e4m3fn).view(
        torch.uint8)


@functools.lru_cache(maxsize=None)
def _emulated(spec, mutate=None):
    """The CUDA schedule's source for ``spec`` run on the CPU (``mutate``: a function applied to the
    source first, for the mutation checks)."""
    src = emit_source("prologue", spec, "cuda", "sm_90")
    return cuda_on_cpu.CudaOnCpu(mutate(src) if mutate else src)


def run(spec, qkv, positions, slots, tables, qw, kw, q, kc, vc, err, hq, hkv, bs, nslots, layout, tag, mutate=None,
        scales=None):
    """Launch ``spec`` with the cache strides of ``layout``: the C backend through its entry point, or
    the CUDA schedule's source on the CPU (``tests/cuda_on_cpu.py``), strides in its unit."""
    d = spec.head_dim
    if layout == "NHD":
        csb, csr, csh = bs * hkv * d, hkv * d, d
    else:  # HND
        csb, csr, csh = hkv * bs * d, d, bs * d
    strides = dict(xst=qkv.stride(0), qst=q.stride(0), qsh=q.stride(1), csb=csb, csr=csr, csh=csh)
    unit = spec.stride_unit
    for name, value in strides.items():
        assert value % unit == 0, (name, value, unit)
        strides[name] = value // unit
    args = dict(QKV=qkv.data_ptr(), P=positions.data_ptr(), SL=slots.data_ptr(), TD=tables.data_ptr(),
                QW=0 if qw is None else qw.data_ptr(), KW=0 if kw is None else kw.data_ptr(),
                Q=q.data_ptr(), KC=kc.data_ptr(), VC=vc.data_ptr(), ERR=err.data_ptr(),
                KS=0 if scales is None else scales[0].data_ptr(), VS=0 if scales is None else scales[1].data_ptr(),
                S=qkv.shape[0], **strides, bs=bs, nslots=nslots, limit=LIMIT, tag=tag,
                eps_bits=struct.unpack("<i", struct.pack("<f", EPS))[0],
                psc=positions.stride(0) if positions.dim() == 2 else 0)
    if spec.backend == "cuda":
        for t in (qkv, q, kc, vc) + ((qw, kw) if qw is not None else ()):
            assert t.data_ptr() % (unit * t.element_size()) == 0, "a pointer off the kernel's vectors"
        _emulated(spec, mutate).launch(-(-qkv.shape[0] // spec.tokens_per_block), spec.block_threads, **args)
        return
    k = load_kernel("prologue", spec, "c", "c", CPU, spec.args)
    k(*k.bind(**args, **dict.fromkeys(k.extent_names, 0)))


def cache_rows(cache, layout, slot, bs):
    """``[hkv, d]`` of ``slot`` in a ``[blocks, ...]`` cache of ``layout``."""
    blk, row = divmod(slot, bs)
    return cache[blk, row] if layout == "NHD" else cache[blk, :, row]


def case(gen, dtype, *, s, hq, hkv, d, rot, qk_norm, layout, bs=16, blocks=5, pos_dtype=torch.int64,
         slot_dtype=torch.int64, bad_positions=(), bad_slots=(), amplitude=1.0, pairing="neox", section=None,
         interleaved=False, rounding="llama", offset=0.0, norm_check=None, backend="c", head_lanes=16, mutate=None,
         fp8=False, fp8_scales=(0.01, 0.5), v_inf=0, schedule=None, outputs=None):
    """Build inputs, run, check every output against :func:`reference`; returns the error words.
    ``section``: MRoPE (positions ``[3, s]``, a bad position ``(t, value)`` set in every stream, or
    ``(t, value, stream)`` in one). ``norm_check(x, w, q_cols)``, when given, gets each q head's input
    columns past ``rot`` (of the dtype), its weight and the kernel's q there (with ``qk_norm``).
    ``backend="cuda"``: the CUDA schedule (``head_lanes`` lane groups a token) on the CPU harness.
    ``fp8``: float8 e4m3fn caches, k stored over a scale small enough that some keys saturate (0.01:
    past 4.48) and v over one that makes some e4m3 subnormals (0.5: below 2^-7), or ``fp8_scales``;
    ``v_inf``: that many v elements set to +-inf (stored as +-448). ``schedule``: more
    spec fields (the CUDA schedule's variants); ``outputs``: a list that gets ``(q, key cache, value
    cache, error words)`` appended, for a bitwise comparison of two schedules on the same inputs."""
    spec = prologue_spec(_name(dtype), d, rot, hq=hq, hkv=hkv, cache="float8_e4m3fn" if fp8 else "",
                         positions=_name(pos_dtype), slots=_name(slot_dtype), qk_norm=qk_norm, pairing=pairing,
                         mrope_section=section, mrope_interleaved=interleaved, rounding=rounding, offset=offset,
                         backend=backend, head_lanes=head_lanes, **(schedule or {}))
    width = (hq + 2 * hkv) * d
    # a row-strided slice of a wider buffer, as a column slice of a projection's output is
    qkv = torch.randn(s, width + 24, generator=gen).to(dtype)[:, 8:8 + width]
    if v_inf:  # v's columns: no norm or rotation, so only the cache store sees them
        at = torch.randperm(s * hkv * d, generator=gen)[:v_inf]
        signs = torch.where(torch.rand(v_inf, generator=gen) < 0.5, -1.0, 1.0)
        qkv[at // (hkv * d), (hq + hkv) * d + at % (hkv * d)] = (signs * float("inf")).to(dtype)
    pshape = (s,) if section is None else (3, s)
    positions = torch.randint(0, LIMIT, pshape, generator=gen, dtype=pos_dtype)
    nslots = blocks * bs
    slots = torch.randperm(nslots, generator=gen)[:s].to(slot_dtype)
    slots[torch.randperm(s, generator=gen)[: max(1, s // 5)]] = -1  # padding tokens: skipped
    for t, value, *stream in bad_positions:
        if section is None:
            positions[t] = value
        else:
            positions[stream[0] if stream else slice(None), t] = value
    for t, value in bad_slots:
        slots[t] = value
    qw = kw = None
    if qk_norm:
        qw = (1 + 0.3 * torch.randn(d, generator=gen)).to(dtype)
        kw = (1 + 0.3 * torch.randn(d, generator=gen)).to(dtype)
    tables = digit_tables(inv_freq(rot), amplitude)
    q = torch.full((s, hq, d), NAN, dtype=dtype)
    shape = (blocks + 2, bs, hkv, d) if layout == "NHD" else (blocks + 2, hkv, bs, d)
    cdt = torch.float8_e4m3fn if fp8 else dtype
    kfull, vfull = torch.full(shape, NAN, dtype=cdt), torch.full(shape, NAN, dtype=cdt)
    kfull[blocks:], vfull[blocks:] = 7.0, 7.0  # a guard past the cache: must stay 7
    scales = (torch.tensor([fp8_scales[0]]), torch.tensor([fp8_scales[1]])) if fp8 else None
    err = torch.zeros(report.ENTRY, dtype=torch.int32)  # the call's error entry: tags, then records
    tag = int(torch.randint(1, 2**31 - 1, (1,), generator=gen))
    before = qkv.clone()
    run(spec, qkv, positions, slots, tables, qw, kw, q, kfull, vfull, err, hq, hkv, bs, nslots, layout, tag, mutate,
        scales)
    if outputs is not None:
        outputs.append((q, kfull, vfull, err))

    assert torch.equal(qkv, before), "qkv was modified"
    assert (kfull[blocks:] == 7.0).all() and (vfull[blocks:] == 7.0).all(), "wrote past the cache"
    q_ref, q_mag, ks, vs, kmag = reference(qkv, positions, slots, hq, hkv, d, rot, amplitude, qw, kw, nslots,
                                           pairing, section, interleaved, offset)
    unit = UNIT[dtype]
    assert_within(q, q_ref, q_mag, unit, "q")
    if rot < d and not qk_norm:
        assert torch.equal(q[..., rot:], qkv.reshape(s, -1, d)[:, :hq, rot:]), "columns past rot: not copied exactly"
    if norm_check is not None:
        norm_check(qkv.reshape(s, -1, d)[:, :hq], qw, q)
    for slot in range(nslots):
        kr, vr = cache_rows(kfull, layout, slot, bs), cache_rows(vfull, layout, slot, bs)
        if slot in ks and fp8:
            assert_e4m3(kr, ks[slot] / scales[0].item(), kmag[slot] / scales[0].item(), unit, f"k cache slot {slot}")
            assert torch.equal(vr.view(torch.uint8), e4m3(vs[slot], scales[1].item())), \
                f"v cache slot {slot}: not e4m3(v / scale)"
        elif slot in ks:
            assert_within(kr, ks[slot], kmag[slot], unit, f"k cache slot {slot}")
            assert torch.equal(vr.double(), vs[slot]), f"v cache slot {slot}: not copied exactly"
        else:
            assert torch.isnan(kr.float()).all() and torch.isnan(vr.float()).all(), f"slot {slot} written"
    check_records(err, positions, slots, nslots)
    return err[:2], tag


def check_records(err: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, nslots: int) -> None:
    """The kernel's record of each checked input (kernels/report.py; 0 positions, 1 slots) names its
    first bad element, its index and value, or is empty when there is none."""
    words = err.tolist()
    for k, (t, bad) in enumerate(((positions, (positions < 0) | (positions >= LIMIT)), (slots, slots >= nslots))):
        lo, hi = words[report.CHECKS + 2 * k], words[report.CHECKS + 2 * k + 1]
        if not bool(bad.any()):
            assert (lo, hi) == (0, 0), f"a record for input {k}, which held no bad value"
            continue
        first = tuple(int(i) for i in bad.nonzero()[0])  # row-major: the smallest offset of a dense tensor
        value = max(-(2**31), min(2**31 - 1, int(t[first])))
        got = errors.found(lo, hi, tuple(t.shape), t.stride())
        assert got is not None and (got.index, got.value) == (first, value), (k, got, first, value)


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk_norm"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_matches_math(gen, dtype, qk_norm, layout):
    err, _ = case(gen, dtype, s=23, hq=4, hkv=2, d=32, rot=32, qk_norm=qk_norm, layout=layout, amplitude=0.75)
    assert err.tolist() == [0, 0], "an error word was set for good positions and slots"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=_name)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_partial_rotary_gqa(gen, dtype, index_dtype):
    """Partial rotary (columns past ``rot`` pass through), 7 q heads on 1 kv head, int32 indices."""
    for qk_norm in (False, True):
        err, _ = case(gen, dtype, s=11, hq=7, hkv=1, d=40, rot=24, qk_norm=qk_norm, layout="NHD", bs=4,
                      blocks=4, pos_dtype=index_dtype, slot_dtype=index_dtype)
        assert err.tolist() == [0, 0]


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_bad_positions_and_slots_reported_never_out_of_bounds(gen, layout):
    """Positions below 0 and at or past the limit, slots at and past the end of the cache: each sets
    its error word to the call's tag; the token's q is computed at position 0 (the reference's), its
    k and v go nowhere, and the guard past the cache stays intact (checked in :func:`case`)."""
    huge = 2**40  # an int64 value whose digits would index far past the tables
    bs, blocks = 8, 3
    err, tag = case(gen, torch.bfloat16, s=9, hq=2, hkv=2, d=16, rot=16, qk_norm=True, layout=layout, bs=bs,
                    blocks=blocks, bad_positions=((0, -1), (3, LIMIT), (5, huge)),
                    bad_slots=((1, bs * blocks), (2, huge), (7, bs * blocks + bs - 1)))
    assert err.tolist() == [tag, tag]


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_float8_caches(gen, dtype, layout):
    """float8 e4m3fn caches: k (normalised, rotated, rounded to the dtype) and v over their scales,
    saturated; partial rotary, GQA and a bad slot too (nothing past the cache)."""
    err, tag = case(gen, dtype, s=13, hq=4, hkv=2, d=40, rot=24, qk_norm=True, layout=layout, bs=4, blocks=4,
                    bad_slots=((5, 16),), fp8=True)
    assert err.tolist() == [0, tag]


def test_each_error_word_alone(gen):
    """A bad position alone sets word 0 only; a bad slot alone sets word 1 only."""
    err, tag = case(gen, torch.float32, s=5, hq=1, hkv=1, d=8, rot=8, qk_norm=False, layout="NHD", bs=4,
                    blocks=2, bad_positions=((4, LIMIT + 3),))
    assert err.tolist() == [tag, 0]
    err, tag = case(gen, torch.float32, s=5, hq=1, hkv=1, d=8, rot=8, qk_norm=False, layout="NHD", bs=4,
                    blocks=2, bad_slots=((4, 8),))
    assert err.tolist() == [0, tag]


def test_spec_refuses_what_is_not_built():
    """The stages' own choices are refused by the stages' specs (the rope's pairing, MRoPE's sections, the
    norm's rounding); the fused spec refuses stages that do not fit one another, and its own fields."""
    with pytest.raises(ValueError, match="backend"):
        prologue_spec("bfloat16", 64, 64, backend="rocm")
    with pytest.raises(ValueError, match="pairing"):
        prologue_spec("bfloat16", 64, 64, pairing="gptj")
    with pytest.raises(ValueError, match="mrope_section"):
        prologue_spec("bfloat16", 64, 64, mrope_section=(8, 8, 8))  # sums to 24, not 32
    with pytest.raises(ValueError, match="rounding"):
        prologue_spec("bfloat16", 64, 64, qk_norm=True, rounding="gemma")
    with pytest.raises(ValueError, match="rot"):
        prologue_spec("bfloat16", 64, 65)
    rope = get_spec("rope")(dtype="bfloat16", head_dim=64, rot=64, positions="int64", backend="c")
    for hidden, dtype, weight in ((32, "bfloat16", "bfloat16"), (64, "float16", "float16"), (64, "bfloat16", None)):
        norm = get_spec("norm")(kind="fwd", hidden=hidden, dtype=dtype, weight=weight, backend="c")
        with pytest.raises(ValueError, match="norm: expected a row of head_dim 64 in bfloat16 with a bfloat16 weight"):
            get_spec("prologue")(rope=rope, norm=norm)
    with pytest.raises(ValueError, match="rope: expected a RoPEKernelSpec"):
        get_spec("prologue")(rope=None)
    with pytest.raises(ValueError, match="slots"):
        get_spec("prologue")(rope=rope, slots="int16")
    with pytest.raises(ValueError, match="cache"):
        get_spec("prologue")(rope=rope, cache="float8_e5m2")


def test_it_composes_the_rope_and_norm_stages():
    """The builder declares the builders whose stages it imports, so an edit to either re-keys it."""
    import tileops.kernels as kernels

    assert kernels.USES["prologue"] == ("norm", "rope")
    assert [p.rsplit("/", 1)[-1] for p in kernels.used_files("prologue")] == ["norm.py", "rope.py"]


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_interleaved_pairing(gen, dtype, layout):
    """Interleaved pairs ``(2j, 2j + 1)`` (GPT-J, DeepSeek's YaRN), full and partial rotary, with and
    without the norm."""
    for qk_norm, rot in ((False, 32), (True, 20)):
        err, _ = case(gen, dtype, s=13, hq=3, hkv=1, d=32, rot=rot, qk_norm=qk_norm, layout=layout,
                      pairing="interleaved", amplitude=1.25)
        assert err.tolist() == [0, 0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=_name)
@pytest.mark.parametrize("interleaved", [False, True], ids=["sections", "interleaved_map"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_mrope(gen, dtype, interleaved, index_dtype):
    """MRoPE: positions ``[3, S]``, each pair at its stream's position (Qwen2-VL's consecutive
    sections; Qwen3-VL's interleaved map), partial rotary, the norm; a bad position in one stream
    reads 0 there alone and is reported."""
    err, _ = case(gen, dtype, s=17, hq=4, hkv=2, d=48, rot=40, qk_norm=True, layout="HND", pos_dtype=index_dtype,
                  section=(6, 7, 7), interleaved=interleaved)
    assert err.tolist() == [0, 0]
    err, tag = case(gen, dtype, s=9, hq=2, hkv=1, d=32, rot=32, qk_norm=False, layout="NHD", pos_dtype=index_dtype,
                    section=(4, 6, 6), interleaved=interleaved, bad_positions=((2, -5, 1), (6, LIMIT, 2)))
    assert err.tolist() == [tag, 0]


def _emulated_norm(x, w, rounding, offset, dtype, n_step=0):
    """The norm's definition in fp32 operations, for the bit-exact check: the mean of the fp32 squares
    (summed in float64, rounded to fp32 once), ``rstd = 1 / sqrt(mean + eps)``; ``llama``: ``n =
    dtype(x * rstd)``, ``y = dtype(n * w)``; ``fp32``: ``y = dtype(x * rstd * (offset + w))``.
    ``n_step`` (``llama``): take n's neighbour that many representable values away (its bits + step)."""
    xf = x.float()
    var = ((xf * xf).double().sum(-1, keepdim=True) / x.shape[-1]).float()
    rstd = 1.0 / torch.sqrt(var + torch.tensor(EPS, dtype=torch.float32))
    if rounding == "llama":
        n = (xf * rstd).to(dtype)
        if n_step:
            n = (n.view(torch.int16) + n_step).view(dtype)
        return (n.float() * w.float()).to(dtype)
    return (xf * rstd * (offset + w.float())).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=_name)
@pytest.mark.parametrize("rounding, offset", [("llama", 0.0), ("fp32", 0.0), ("fp32", 1.0)],
                         ids=["llama", "fp32", "fp32_offset1"])
def test_norm_roundings(gen, dtype, rounding, offset):
    """The norm stage's ``rounding`` and ``offset`` (Gemma's ``1 + w``): q and k within the bound of
    the float64 math, and the columns past ``rot`` (the norm's output, copied) equal bit for bit to
    the norm's definition in fp32 operations with this rounding; the other rounding differs there
    somewhere (so the check can tell them apart)."""
    rot, d = 16, 96
    other = {"llama": "fp32", "fp32": "llama"}[rounding]
    told = []

    def check(x, w, q):
        want = _emulated_norm(x, w, rounding, offset, dtype)[..., rot:]
        got = q[..., rot:]
        # The same bits but where the row's fp32 statistic lands an fp32 ulp apart from the
        # emulation's and an element sits on a rounding boundary: 1-2 elements of 9,920 in about 1
        # run of 10 (fp16, 60 seeds). Then llama's n is the dtype's neighbouring value, and y =
        # dtype(n' * w) may be 2 ulps of y away (|w| up to ~2): it must be one of those two products;
        # fp32's single rounding moves y by at most one ulp.
        differ = got != want
        if rounding == "llama":
            near = torch.zeros_like(differ)
            for step in (-1, 1):
                near |= got == _emulated_norm(x, w, rounding, offset, dtype, n_step=step)[..., rot:]
        else:
            ulp = torch.finfo(dtype).eps * want.float().abs().clamp_min(torch.finfo(dtype).smallest_normal)
            near = (got.float() - want.float()).abs() <= ulp
        assert int(differ.sum()) <= max(1, want.numel() // 1000) and bool((near | ~differ).all()), (
            f"columns past rot: {int(differ.sum())} of {want.numel()} differ from {rounding}, "
            f"{int((differ & ~near).sum())} by more than the neighbouring statistic explains")
        told.append(not torch.equal(_emulated_norm(x, w, other, offset, dtype)[..., rot:], want))

    err, _ = case(gen, dtype, s=31, hq=4, hkv=2, d=d, rot=rot, qk_norm=True, layout="NHD", rounding=rounding,
                  offset=offset, norm_check=check)
    assert err.tolist() == [0, 0]
    assert told == [True], "the two roundings agree on these inputs: the bit-exact check proves nothing"


# ------------------------------------------------------------------------------ the CUDA schedule
# The generated CUDA source run on the CPU (tests/cuda_on_cpu.py: one OS thread per CUDA thread, real
# warp shuffles): the lane mapping, the norm's butterfly, the row loop, the slot and position checks.
# Not its speed, and not the GPU's approximate rsqrtf (the harness's is 1 / sqrtf). Sizes stay small.
needs_gxx = pytest.mark.skipif(not cuda_on_cpu.available(), reason="no g++")
CUDA = dict(backend="cuda")
#: the emulated matrices take ~9 min on 2 cores in all: bf16 runs by default, the rest with -m slow
SLOW = pytest.mark.slow
CUDA_DTYPES = [pytest.param(torch.float32, id="float32", marks=SLOW), pytest.param(torch.float16, id="float16",
                                                                                     marks=SLOW), torch.bfloat16]


@needs_gxx
@pytest.mark.parametrize("dtype", CUDA_DTYPES, ids=_name)
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk_norm"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_cuda_matches_math(gen, dtype, qk_norm, layout):
    """The float64 math, both layouts; ``head_lanes=2`` (HND) makes each lane group walk 4 rows of a
    token (q, k and v in one loop), 16 (NHD) one row each with 8 of 16 groups idle."""
    err, _ = case(gen, dtype, s=23, hq=4, hkv=2, d=32, rot=32, qk_norm=qk_norm, layout=layout, amplitude=0.75,
                  head_lanes=2 if layout == "HND" else 16, **CUDA)
    assert err.tolist() == [0, 0], "an error word was set for good positions and slots"


@needs_gxx
@SLOW
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=_name)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_cuda_partial_rotary_gqa(gen, dtype, index_dtype):
    """Partial rotary (rot/2 = 12: 4-element vectors of bf16, copy lanes past rot), 7 q heads on 1 kv
    head (rows 7, 8 of 9 are k and v), int32 and int64 indices."""
    for qk_norm in (False, True):
        err, _ = case(gen, dtype, s=11, hq=7, hkv=1, d=40, rot=24, qk_norm=qk_norm, layout="NHD", bs=4,
                      blocks=4, pos_dtype=index_dtype, slot_dtype=index_dtype, head_lanes=4, **CUDA)
        assert err.tolist() == [0, 0]


@needs_gxx
@SLOW
@pytest.mark.parametrize("dtype, d, rot", [(torch.bfloat16, 64, 64), (torch.bfloat16, 80, 80),
                                           (torch.float16, 80, 32), (torch.bfloat16, 128, 128),
                                           (torch.bfloat16, 256, 256), (torch.float32, 256, 256),
                                           (torch.float16, 128, 64)],
                         ids=lambda v: _name(v) if isinstance(v, torch.dtype) else str(v))
def test_cuda_head_dims(gen, dtype, d, rot):
    """head_dim 64/80/128/256 at 16-byte vectors: lane groups of 4, 8 (5 of them live: 80 bf16), 16
    and 32 lanes (fp32 256: a whole warp a row), partial rotary with copy lanes; with the norm."""
    spec = prologue_spec(_name(dtype), d, rot, backend="cuda")
    assert spec.vec * torch.tensor([], dtype=dtype).element_size() == 16, "not 16-byte vectors"
    err, _ = case(gen, dtype, s=5, hq=2, hkv=1, d=d, rot=rot, qk_norm=True, layout="HND", bs=4, blocks=3,
                  head_lanes=2, **CUDA)
    assert err.tolist() == [0, 0]


@needs_gxx
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_cuda_bad_positions_and_slots_reported_never_out_of_bounds(gen, layout):
    """As the C test: each bad value reported in its word, the token's q at position 0, its k and v
    nowhere, the guard past the cache intact."""
    huge = 2**40
    bs, blocks = 8, 3
    err, tag = case(gen, torch.bfloat16, s=9, hq=2, hkv=2, d=16, rot=16, qk_norm=True, layout=layout, bs=bs,
                    blocks=blocks, bad_positions=((0, -1), (3, LIMIT), (5, huge)),
                    bad_slots=((1, bs * blocks), (2, huge), (7, bs * blocks + bs - 1)), head_lanes=2, **CUDA)
    assert err.tolist() == [tag, tag]


@needs_gxx
def test_cuda_each_error_word_alone(gen):
    err, tag = case(gen, torch.float32, s=5, hq=1, hkv=1, d=8, rot=8, qk_norm=False, layout="NHD", bs=4,
                    blocks=2, bad_positions=((4, LIMIT + 3),), **CUDA)
    assert err.tolist() == [tag, 0]
    err, tag = case(gen, torch.float32, s=5, hq=1, hkv=1, d=8, rot=8, qk_norm=False, layout="NHD", bs=4,
                    blocks=2, bad_slots=((4, 8),), **CUDA)
    assert err.tolist() == [0, tag]


@needs_gxx
@pytest.mark.parametrize("dtype", CUDA_DTYPES, ids=_name)
def test_cuda_interleaved_pairing(gen, dtype):
    """Interleaved pairs inside a lane's two vectors, full and partial rotary, with and without the norm."""
    for qk_norm, rot, layout in ((False, 32, "NHD"), (True, 16, "HND")):
        err, _ = case(gen, dtype, s=13, hq=3, hkv=1, d=32, rot=rot, qk_norm=qk_norm, layout=layout,
                      pairing="interleaved", amplitude=1.25, head_lanes=2, **CUDA)
        assert err.tolist() == [0, 0]


@needs_gxx
@SLOW
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=_name)
@pytest.mark.parametrize("interleaved", [False, True], ids=["sections", "interleaved_map"])
def test_cuda_mrope(gen, dtype, interleaved):
    """MRoPE's three streams: sections that are (16, 24, 24) multiples of the vector keep the table
    loads vectors; (6, 7, 7) and Qwen3-VL's map gather per pair; a bad position in one stream alone."""
    for section, d in (((4, 6, 6), 32), ((6, 7, 7), 48)):
        err, _ = case(gen, dtype, s=9, hq=2, hkv=1, d=d, rot=2 * sum(section), qk_norm=True, layout="HND",
                      pos_dtype=torch.int32, section=section, interleaved=interleaved, head_lanes=2, **CUDA)
        assert err.tolist() == [0, 0]
    err, tag = case(gen, dtype, s=9, hq=2, hkv=1, d=32, rot=32, qk_norm=False, layout="NHD", section=(4, 6, 6),
                    interleaved=interleaved, bad_positions=((2, -5, 1), (6, LIMIT, 2)), **CUDA)
    assert err.tolist() == [tag, 0]


@needs_gxx
@pytest.mark.parametrize("rounding, offset", [("llama", 0.0), ("fp32", 1.0)], ids=["llama", "fp32_offset1"])
def test_cuda_norm_roundings(gen, rounding, offset):
    """The norm's roundings on the CUDA schedule: q within the float64 bound, and the columns past
    rot (the norm's output, copied) equal to the norm's definition in fp32 operations on all but a
    few elements (the row sum is fp32 in lanes then a butterfly here, float64 in the emulation: a sum
    one ulp apart can move an element to its neighbouring bf16 value), while the other rounding
    differs there on many more."""
    dtype, rot, d = torch.bfloat16, 16, 96
    other = {"llama": "fp32", "fp32": "llama"}[rounding]
    seen = []

    def check(x, w, q):
        want = _emulated_norm(x, w, rounding, offset, dtype)[..., rot:]
        off = int((q[..., rot:] != want).sum())
        off_other = int((q[..., rot:] != _emulated_norm(x, w, other, offset, dtype)[..., rot:]).sum())
        seen.append((off, off_other, want.numel()))

    case(gen, dtype, s=31, hq=4, hkv=2, d=d, rot=rot, qk_norm=True, layout="NHD", rounding=rounding, offset=offset,
         norm_check=check, head_lanes=4, **CUDA)
    (off, off_other, n), = seen
    assert off <= n // 1000, f"{off} of {n} columns past rot differ from the {rounding} rounding"
    assert off_other > 10 * max(off, 1), "the two roundings agree on these inputs: the check proves nothing"


@needs_gxx
@pytest.mark.parametrize("dtype", CUDA_DTYPES, ids=_name)
def test_cuda_float8_caches(gen, dtype):
    """float8 caches on the CUDA schedule (the harness's stand-in for the cvt instruction is the same
    round-to-nearest-even, saturating conversion): as the C test, both layouts, a bad slot."""
    for layout in ("NHD", "HND"):
        err, tag = case(gen, dtype, s=13, hq=4, hkv=2, d=32, rot=16, qk_norm=True, layout=layout, bs=4, blocks=4,
                        bad_slots=((5, 16),), head_lanes=2, fp8=True, **CUDA)
        assert err.tolist() == [0, tag]


#: the CUDA schedule's variants (``PrologueKernelSpec``'s schedule fields, off in the spec's defaults;
#: "manifest" is what the manifest's ``kernel.static`` sets): each must store the plain schedule's bits
VARIANTS = {"share": dict(share_angles=True), "pairs": dict(share_angles=True, pair_angles=True),
            "rcp": dict(reciprocal_scale=True),
            "manifest": dict(share_angles=True, reciprocal_scale=True, min_blocks=7),
            "all": dict(share_angles=True, pair_angles=True, reciprocal_scale=True)}
#: the cases they run: every dtype, both pairings, partial rotary, the norm on and off, float8 caches,
#: MRoPE's per-pair streams (Qwen3-VL's map, consecutive sections that are not multiples of the
#: vector) and its uniform sections, several tokens a block (``tokens_per_block`` 2 and 16: the shared
#: buffer's token slots) and threads composing several pairs each (pair_angles with fewer threads a
#: token than pairs), bad positions (one stream's alone) and slots
VARIANT_CASES = {
    "bf16-fp8-hnd": dict(dtype=torch.bfloat16, s=13, hq=4, hkv=2, d=32, rot=32, qk_norm=True, layout="HND", bs=4,
                         blocks=4, fp8=True, head_lanes=2, bad_positions=((3, LIMIT),), bad_slots=((5, 16),)),
    # reciprocal_scale's fallbacks: infinite v values (the division for that store) and a k scale
    # outside RCP_SCALES (the division for every k store), the v scale negative
    "bf16-fp8-inf-scales": dict(dtype=torch.bfloat16, s=11, hq=2, hkv=2, d=32, rot=32, qk_norm=False, layout="NHD",
                                bs=4, blocks=4, fp8=True, fp8_scales=(2.0**-70, -0.75), v_inf=9, head_lanes=2),
    "fp16-interleaved-partial-2tok": dict(dtype=torch.float16, s=9, hq=3, hkv=1, d=32, rot=16, qk_norm=False,
                                          layout="NHD", pairing="interleaved", amplitude=1.25),
    "fp32-mrope-map-partial": dict(dtype=torch.float32, s=9, hq=2, hkv=1, d=48, rot=40, qk_norm=True, layout="HND",
                                   section=(6, 7, 7), interleaved=True, head_lanes=2, pos_dtype=torch.int32,
                                   bad_positions=((2, -5, 1), (6, LIMIT, 2))),
    "bf16-mrope-sections-16tok": dict(dtype=torch.bfloat16, s=21, hq=2, hkv=1, d=64, rot=64, qk_norm=True,
                                      layout="NHD", section=(12, 10, 10), head_lanes=2, slot_dtype=torch.int32),
    "bf16-mrope-uniform": dict(dtype=torch.bfloat16, s=7, hq=2, hkv=1, d=64, rot=64, qk_norm=False, layout="NHD",
                               section=(8, 8, 16), head_lanes=2),
}


@needs_gxx
@pytest.mark.parametrize("variant", [v if v in ("manifest",) else pytest.param(v, marks=SLOW) for v in VARIANTS])
@pytest.mark.parametrize("name", VARIANT_CASES)
def test_cuda_schedule_variants_store_the_default_bits(variant, name):
    """Each schedule variant stores q, both caches and the error words bit for bit as the default
    schedule does on the same inputs (and both are within the float64 math's bound)."""
    fields = dict(VARIANT_CASES[name])
    dtype = fields.pop("dtype")
    got = []
    for schedule in (None, VARIANTS[variant]):
        case(torch.Generator().manual_seed(5), dtype, **fields, schedule=schedule, outputs=got, **CUDA)
    (q0, k0, v0, e0), (q1, k1, v1, e1) = got
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
    for what, a, b in (("q", q0, q1), ("key cache", k0, k1), ("value cache", v0, v1), ("error words", e0, e1)):
        a, b = a.view(bits[a.element_size()]), b.view(bits[b.element_size()])  # NaN == NaN, -0 != 0
        assert torch.equal(a, b), f"{what}: {int((a != b).sum())} of {a.numel()} elements differ from the default's bits"


@pytest.mark.parametrize("variant", ["share", "pairs"])
def test_cuda_shared_angles_barrier_is_reached_by_every_thread(variant):
    """With share_angles the cos/sin go through one ``__shared__`` buffer and one ``__syncthreads``,
    at the kernel body's top level (in no branch: every thread reaches it). The harness cannot show a
    missing barrier here (its threads run in order, and the writers have the lowest ids)."""
    spec = prologue_spec("bfloat16", 128, 128, hq=32, hkv=8, qk_norm=True, backend="cuda", mrope_section=(24, 20, 20),
                         mrope_interleaved=True, **VARIANTS[variant])
    src = emit_source("prologue", spec, "cuda", "sm_90")
    assert src.count("__syncthreads()") == 1 and re.search(r"^  __syncthreads\(\);$", src, re.M), src
    assert src.count("__shared__") == 1


def _break_pairing(src: str) -> str:
    """A mutation: the neox rotation reads the first element of a pair as its partner too."""
    out = re.sub(r"float c = \(\(float\)xb\[", "float c = ((float)xa[", src)
    assert out != src
    return out


def _break_slot_bound(src: str) -> str:
    """A mutation: the slot bound one block too far (a slot up to nslots + bs - 1 would be written)."""
    # (the slot's variable is named by the macro it is last passed to: kernels/report.py's ``value``)
    out = re.sub(r"\((\w+) < nslots\)", r"(\1 < (nslots + bs))", src)
    assert out != src
    return out


@needs_gxx
def test_cuda_mutations_are_caught(gen):
    """The checks above catch a broken pairing and a slot bound that lets the last block's row past
    the cache be written (the source is edited, compiled and run; the test must fail)."""
    with pytest.raises(AssertionError, match="q: .* off"):
        case(gen, torch.bfloat16, s=7, hq=2, hkv=1, d=32, rot=32, qk_norm=False, layout="NHD", mutate=_break_pairing,
             **CUDA)
    with pytest.raises(AssertionError, match="wrote past the cache"):
        case(gen, torch.bfloat16, s=7, hq=2, hkv=1, d=32, rot=32, qk_norm=False, layout="NHD", bs=4, blocks=2,
             bad_slots=((3, 8 + 3),), mutate=_break_slot_bound, **CUDA)


@needs_toolchain
@pytest.mark.parametrize("arch", ["sm_90", pytest.param("sm_80", marks=SLOW)])
@pytest.mark.parametrize("fields", [dict(dtype="bfloat16", head_dim=128, rot=128, qk_norm=True),
                                    dict(dtype="float16", head_dim=80, rot=32, positions="int32", slots="int32"),
                                    dict(dtype="bfloat16", head_dim=128, rot=128, mrope_section=(24, 20, 20),
                                         mrope_interleaved=True, qk_norm=True, rounding="fp32", offset=1.0),
                                    dict(dtype="float32", head_dim=64, rot=64, pairing="interleaved"),
                                    dict(dtype="bfloat16", head_dim=128, rot=128, qk_norm=True, hq=32, hkv=8,
                                         cache="float8_e4m3fn")],
                         ids=["qwen3", "partial-i32", "mrope-gemma", "fp32-interleaved", "qwen3-fp8"])
def test_cuda_source_compiles_lean(fields, arch, tmp_path):
    """The CUDA schedule lowers and the lean build (nvcc, no TileLang templates) compiles it for the
    H200 (sm_90) and the A100 (sm_80); x is moved 16 bytes at a time, the q and cache stores through
    tileops_st16, the row sum by shuffles (no shared memory, no barrier)."""
    if fields.get("cache") and arch == "sm_80":
        pytest.skip("float8 caches need sm_89's cvt (the op refuses older GPUs)")
    from tileops.compile import build, cuda_build

    spec = prologue_spec(backend="cuda", **fields)
    lean = cuda_build.build(build.prim_func("prologue", spec), arch, build.PASS_CONFIGS, out_dir=str(tmp_path))
    src = lean.device_source
    assert "*(uint4*)(ra + " in src or "*(float4*)(ra + " in src  # every row loaded up front, 16 bytes at a time
    assert "tileops_st16((&(Q[" in src
    if spec.fp8:  # V bytes a vector in one store, converted by the hardware's cvt
        assert "tileops_st_e4m3((&(KC[" in src and "tileops_st_e4m3((&(VC[" in src
        assert "cvt.rn.satfinite.e4m3x2.f32" in src
    else:
        assert "tileops_st16((&(KC[" in src and "tileops_st16((&(VC[" in src
    assert ("tileops_xor_lane(acc" in src) == spec.qk_norm
    assert "__syncthreads" not in src and "__shared__" not in src
    assert len(lean.record["args"]) == len(spec.args) + len(lean.record["extents"])


def test_cuda_spec_layout():
    """The lane mapping's numbers for the planned shapes, and what the schedule refuses."""
    spec = prologue_spec
    q3 = spec(dtype="bfloat16", head_dim=128, rot=128, backend="cuda")
    assert (q3.vec, q3.row_lanes, q3.lanes, q3.block_threads, q3.tokens_per_block, q3.stride_unit) == (
        8, 8, 8, 128, 1, 8)
    odd = spec(dtype="bfloat16", head_dim=80, rot=80, backend="cuda")
    assert (odd.vec, odd.row_lanes, odd.lanes) == (8, 5, 8)
    narrow = spec(dtype="bfloat16", head_dim=40, rot=24, backend="cuda")  # rot/2 = 12: 4-element vectors
    assert (narrow.vec, narrow.row_lanes, narrow.lanes) == (4, 7, 8)
    assert spec(dtype="bfloat16", head_dim=128, rot=128).stride_unit == 1
    with pytest.raises(ValueError, match="32 lanes"):
        spec(dtype="bfloat16", head_dim=1024, rot=1024, backend="cuda")
    with pytest.raises(ValueError, match="head_lanes"):
        spec(dtype="bfloat16", head_dim=128, rot=128, backend="cuda", head_lanes=3)
    with pytest.raises(ValueError, match="threads"):
        spec(dtype="bfloat16", head_dim=128, rot=128, backend="cuda", threads=16)
