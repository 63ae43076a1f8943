"""The attention prologue kernel (``kernels/prologue.py``, issue 24), C backend, driven directly on the CPU.

The reference is float64 math written here from the issue's definition (RMSNorm per head, neox RoPE
at the given positions with cos/sin evaluated in float64, the paged cache write): it shares no code
with the kernel. The kernel's only input from the package is the rope family's digit tables
(``tileops.rope.tables.digit_tables``), the tables every rope op hands its kernel.

Every output (q, both caches) is NaN-filled before the launch, so an element the kernel fails to
write cannot pass, and a cache row no slot names must still be NaN after it. Inputs are fresh random
draws (``gen``). Bad positions and slots are checked to be reported in the error words and never to
reach memory outside the cache: each cache is a view of a larger NaN-filled buffer whose tail must
stay untouched. Not covered here: the CUDA schedule (not written yet), fp8 caches, other pairings.
"""

from __future__ import annotations

import struct

import pytest
import torch

from tileops.compile.build import load_kernel
from tileops.kernels import get_spec
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


def inv_freq(rot: int) -> torch.Tensor:
    return 1.0 / BASE ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)


def reference(qkv, positions, slots, hq, hkv, d, rot, amplitude, qw, kw, nslots):
    """float64 (q, k rows, v rows, pair magnitude of q and k) from the math: q ``[S, hq, d]``; k and v
    ``{slot: [hkv, d]}`` for each token with a slot in ``[0, nslots)``. A position outside
    ``[0, LIMIT)`` rotates as position 0 (what the kernel reads in its place)."""
    x = qkv.double().reshape(qkv.shape[0], hq + 2 * hkv, d)
    q, k, v = x[:, :hq], x[:, hq:hq + hkv], x[:, hq + hkv:]
    if qw is not None:
        q = q / torch.sqrt((q * q).mean(-1, keepdim=True) + EPS) * qw.double()
        k = k / torch.sqrt((k * k).mean(-1, keepdim=True) + EPS) * kw.double()
    p = positions.double()
    p = torch.where((p < 0) | (p >= LIMIT), torch.zeros_like(p), p)
    ang = p[:, None] * inv_freq(rot)[None, :]  # [S, rot/2]
    cos, sin = (ang.cos() * amplitude)[:, None, :], (ang.sin() * amplitude)[:, None, :]

    def rotate(t):
        h = rot // 2
        a, c = t[..., :h], t[..., h:rot]
        out = t.clone()
        out[..., :h] = a * cos - c * sin
        out[..., h:rot] = c * cos + a * sin
        mag = t.abs().clone()
        mag[..., :h] = a.abs() + c.abs()
        mag[..., h:rot] = a.abs() + c.abs()
        return out, mag

    q_out, q_mag = rotate(q)
    k_out, k_mag = rotate(k)
    ks, vs, kmag = {}, {}, {}
    for t, s in enumerate(slots.tolist()):
        if 0 <= s < nslots:
            ks[s], vs[s], kmag[s] = k_out[t], v[t], k_mag[t]
    return q_out, q_mag, ks, vs, kmag


def assert_within(got, ref, mag, unit, what):
    """``|got - ref| <= 8 * unit * mag + 1e-30``: the kernel rounds the norm's output twice to the
    dtype (``n`` and ``n * w``) and the rotation once; each rounding moves a pair's element by at
    most ``unit`` of the pair's magnitude, and fp32 arithmetic adds a few 2^-24."""
    got = got.double()
    assert torch.isfinite(got).all(), f"{what}: {int((~torch.isfinite(got)).sum())} elements not written"
    err = (got - ref).abs()
    bound = 8 * max(unit, 2.0**-22) * mag + 1e-30
    bad = err > bound
    assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.numel()} elements off; max error {err.max():.3e}"


def run(spec, qkv, positions, slots, tables, qw, kw, q, kc, vc, err, hq, hkv, bs, nslots, layout, tag):
    """Launch ``spec`` (C backend) with the cache strides of ``layout``."""
    d = spec.head_dim
    if layout == "NHD":
        csb, csr, csh = bs * hkv * d, hkv * d, d
    else:  # HND
        csb, csr, csh = hkv * bs * d, d, bs * d
    args = dict(QKV=qkv.data_ptr(), P=positions.data_ptr(), SL=slots.data_ptr(), TD=tables.data_ptr(),
                QW=0 if qw is None else qw.data_ptr(), KW=0 if kw is None else kw.data_ptr(),
                Q=q.data_ptr(), KC=kc.data_ptr(), VC=vc.data_ptr(), ERR=err.data_ptr(),
                S=qkv.shape[0], HQ=hq, HKV=hkv, xst=qkv.stride(0), qst=q.stride(0), qsh=q.stride(1),
                csb=csb, csr=csr, csh=csh, bs=bs, nslots=nslots, limit=LIMIT, tag=tag,
                eps_bits=struct.unpack("<i", struct.pack("<f", EPS))[0])
    k = load_kernel("prologue", spec, "c", "c", CPU, spec.args)
    k(*k.bind(**args, **dict.fromkeys(k.extent_names, 0)))


def cache_rows(cache, layout, slot, bs):
    """``[hkv, d]`` of ``slot`` in a ``[blocks, ...]`` cache of ``layout``."""
    blk, row = divmod(slot, bs)
    return cache[blk, row] if layout == "NHD" else cache[blk, :, row]


def case(gen, dtype, *, s, hq, hkv, d, rot, qk_norm, layout, bs=16, blocks=5, pos_dtype=torch.int64,
         slot_dtype=torch.int64, bad_positions=(), bad_slots=(), amplitude=1.0):
    """Build inputs, run, check every output against :func:`reference`; returns the error words."""
    spec = get_spec("prologue")(dtype=_name(dtype), head_dim=d, rot=rot, positions=_name(pos_dtype),
                                slots=_name(slot_dtype), qk_norm=qk_norm)
    width = (hq + 2 * hkv) * d
    # a row-strided slice of a wider buffer, as a column slice of a projection's output is
    qkv = torch.randn(s, width + 24, generator=gen).to(dtype)[:, 8:8 + width]
    positions = torch.randint(0, LIMIT, (s,), generator=gen, dtype=pos_dtype)
    nslots = blocks * bs
    slots = torch.randperm(nslots, generator=gen)[:s].to(slot_dtype)
    slots[torch.randperm(s, generator=gen)[: max(1, s // 5)]] = -1  # padding tokens: skipped
    for t, value in bad_positions:
        positions[t] = value
    for t, value in bad_slots:
        slots[t] = value
    qw = kw = None
    if qk_norm:
        qw = (1 + 0.3 * torch.randn(d, generator=gen)).to(dtype)
        kw = (1 + 0.3 * torch.randn(d, generator=gen)).to(dtype)
    tables = digit_tables(inv_freq(rot), amplitude)
    q = torch.full((s, hq, d), NAN, dtype=dtype)
    shape = (blocks + 2, bs, hkv, d) if layout == "NHD" else (blocks + 2, hkv, bs, d)
    kfull, vfull = torch.full(shape, NAN, dtype=dtype), torch.full(shape, NAN, dtype=dtype)
    kfull[blocks:], vfull[blocks:] = 7.0, 7.0  # a guard past the cache: must stay 7
    err = torch.zeros(2, dtype=torch.int32)
    tag = int(torch.randint(1, 2**31 - 1, (1,), generator=gen))
    before = qkv.clone()
    run(spec, qkv, positions, slots, tables, qw, kw, q, kfull, vfull, err, hq, hkv, bs, nslots, layout, tag)

    assert torch.equal(qkv, before), "qkv was modified"
    assert (kfull[blocks:] == 7.0).all() and (vfull[blocks:] == 7.0).all(), "wrote past the cache"
    q_ref, q_mag, ks, vs, kmag = reference(qkv, positions, slots, hq, hkv, d, rot, amplitude, qw, kw, nslots)
    unit = UNIT[dtype]
    assert_within(q, q_ref, q_mag, unit, "q")
    if rot < d and not qk_norm:
        assert torch.equal(q[..., rot:], qkv.reshape(s, -1, d)[:, :hq, rot:]), "columns past rot: not copied exactly"
    for slot in range(nslots):
        kr, vr = cache_rows(kfull, layout, slot, bs), cache_rows(vfull, layout, slot, bs)
        if slot in ks:
            assert_within(kr, ks[slot], kmag[slot], unit, f"k cache slot {slot}")
            assert torch.equal(vr.double(), vs[slot]), f"v cache slot {slot}: not copied exactly"
        else:
            assert torch.isnan(kr.float()).all() and torch.isnan(vr.float()).all(), f"slot {slot} written"
    return err, tag


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


def test_each_error_word_alone(gen):
    """A bad position alone sets word 0 only; a bad slot alone sets word 1 only."""
    err, tag = case(gen, torch.float32, s=5, hq=1, hkv=1, d=8, rot=8, qk_norm=False, layout="NHD", bs=4,
                    blocks=2, bad_positions=((4, LIMIT + 3),))
    assert err.tolist() == [tag, 0]
    err, tag = case(gen, torch.float32, s=5, hq=1, hkv=1, d=8, rot=8, qk_norm=False, layout="NHD", bs=4,
                    blocks=2, bad_slots=((4, 8),))
    assert err.tolist() == [0, tag]


def test_spec_refuses_what_is_not_built():
    spec = get_spec("prologue")
    with pytest.raises(ValueError, match="backend"):
        spec(dtype="bfloat16", head_dim=64, rot=64, backend="cuda")
    with pytest.raises(ValueError, match="pairing"):
        spec(dtype="bfloat16", head_dim=64, rot=64, pairing="interleaved")
    with pytest.raises(ValueError, match="rot"):
        spec(dtype="bfloat16", head_dim=64, rot=65)
