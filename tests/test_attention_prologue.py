"""``tileops.attention.AttnPrologueFwdOp`` on the CPU (the C backend): the op against a float64
reference of the unfused chain written here.

The reference: per-head RMSNorm in float64, then the rotation with the rope op's frequencies from
``tests/references.py`` (the RoPE family's own float64 definitions, which import nothing of tileops),
then the paged cache write in token order. Caches are NaN-filled and live inside larger buffers whose
guard blocks must stay untouched, so a slot written that should not be, or one past the cache, shows.
qkv is a column slice of a wider buffer (row-strided). Inputs are random draws, seeded per
test (``tests/conftest.py``).

Kernel compiles (~2.5 s each here) are shared: the specs differ only in dtype, head_dim, rotated
width, index dtypes and qk_norm, and the cases below reuse a few. Not covered here: the CUDA schedule
on a GPU (``tests/test_attention_cuda.py``, marked ``cuda``). A float8 cache is checked against the
reference over its scale (k within half an e4m3 step plus the dtype's roundings, v bit for bit against
torch's saturating cast of ``v / scale``), and bit for bit against the unfused chain (the op with a
cache of qkv's dtype, then that cast).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tileops
from tileops.attention import AttnPrologueFwdOp
from tileops.kernels.norm import NormKernelSpec
from tileops.rope import (LongRoPEFwdOp, MRoPEFwdOp, Phi3LongRoPEFwdOp, RoPEDynamicNTKFwdOp, RoPEFwdOp,
                          RoPELinearFwdOp, RoPELlama31FwdOp, RoPENeoxPositionIdsFwdOp, YaRNFwdOp, from_hf_config)

try:  # pytest puts tests/ on sys.path when it is not a package
    import references
except ImportError:  # pragma: no cover
    from tests import references
from tests.test_prologue_kernels import assert_e4m3, e4m3  # the float8 cache's bound and bits, one copy

NAN = float("nan")
EPS = 1e-6
UNIT = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def ref_params(rope) -> dict:
    """The rope op's params as the float64 reference reads them, with the deployment's fixed choice
    where HF picks per call: Phi-3's long factors when max_position_embeddings > original, dynamic
    NTK's base at factor * max_position_embeddings (``max_position_id`` stands for the call length)."""
    p = dict(rope.params)
    if rope.name == "Phi3LongRoPEFwdOp":
        p["max_position_id"] = p["max_position_embeddings"] - 1 if (
            p["max_position_embeddings"] > p["original_max_position_embeddings"]) else 0
    if rope.name == "RoPEDynamicNTKFwdOp":
        p["max_position_id"] = p["factor"] * p["max_position_embeddings"] - 1
    return p


def reference(qkv, positions, slots, hq, hkv, d, rope, qw, kw, nslots):
    """float64 q ``[T, hq, d]`` with its pair magnitudes, and ``{slot: (k [hkv, d], k magnitude, v)}``
    of the last token naming each slot in ``[0, nslots)``."""
    x = qkv.double().reshape(qkv.shape[0], hq + 2 * hkv, d)
    q, k, v = x[:, :hq], x[:, hq:hq + hkv], x[:, hq + hkv:]
    if qw is not None:
        q = q / torch.sqrt((q * q).mean(-1, keepdim=True) + EPS) * qw.double()
        k = k / torch.sqrt((k * k).mean(-1, keepdim=True) + EPS) * kw.double()
    p = ref_params(rope)
    rot = d if p.get("rotary_dim") is None else p["rotary_dim"]
    inv, amp = references.inv_freq_and_amplitude(rope.name, p, rot)
    pairing = rope.pairing
    h = rot // 2
    first, second = (slice(0, h), slice(h, rot)) if pairing == "neox" else (slice(0, rot, 2), slice(1, rot, 2))

    def mag(t):  # each element's bound: |a| + |c| of its pair, times the amplitude
        m = t.abs().clone()
        s = t[..., first].abs() + t[..., second].abs()
        m[..., first], m[..., second] = s, s
        return m * max(1.0, abs(amp))

    def rotate(t):
        if positions.dim() == 1:
            return references.rotate(t, positions.view(-1, 1), inv, amp, pairing)
        # MRoPE: pair j turns by the position of its stream
        streams = references.mrope_pair_streams(p["mrope_section"], p["mrope_interleaved"], h)
        ang = (positions.double().T[:, streams] * inv)[:, None, :]  # [T, 1, R/2]
        out, a, c = t.clone(), t[..., first], t[..., second]
        out[..., first] = (a * ang.cos() - c * ang.sin()) * amp
        out[..., second] = (c * ang.cos() + a * ang.sin()) * amp
        return out

    q_ref, k_ref = rotate(q), rotate(k)
    cache = {}
    for t, s in enumerate(slots.tolist()):
        if 0 <= s < nslots:
            cache[s] = (k_ref[t], mag(k[t]), v[t])
    return q_ref, mag(q), cache


def assert_within(got, ref, mag, unit, what):
    """``|got - ref| <= 8 unit |pair| + tiny``: the norm rounds twice to the dtype, the rotation once."""
    got = got.double()
    assert torch.isfinite(got).all(), f"{what}: {int((~torch.isfinite(got)).sum())} elements not written"
    err = (got - ref).abs()
    bad = err > 8 * unit * mag + 1e-6
    assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.numel()} off; max error {err.max():.3e}"


def rows(cache, layout, slot, bs):
    blk, row = divmod(slot, bs)
    return cache[blk, row] if layout == "NHD" else cache[blk, :, row]


def run_case(gen, rope, *, hq, hkv, d, tokens=5, dtype=torch.bfloat16, qk_norm=False, layout="NHD", bs=16,
             blocks=3, slot_dtype=torch.int64, pos_dtype=torch.int64, positions=None, max_pos=4000,
             strided_indices=False, device="cpu", fp8=False):
    """Build the inputs, run the op on ``device``, check q and every cache row against :func:`reference`.
    ``fp8``: float8 caches, k over a scale at which some keys saturate (0.01), v over one that makes
    e4m3 subnormals (0.5)."""
    op = AttnPrologueFwdOp(hq, hkv, d, rope, qk_norm=qk_norm, eps=EPS, cache_layout=layout,
                           cache_dtype=torch.float8_e4m3fn if fp8 else None)
    width = (hq + 2 * hkv) * d
    # row-strided: a column slice of a wider buffer (at 16 bytes, as a projection's q/k/v split lies)
    qkv = torch.randn(tokens, width + 16, generator=gen).to(dtype).to(device)[:, 8:8 + width]
    if positions is None:
        streams = (3,) if rope.name == "MRoPEFwdOp" else ()
        positions = torch.randint(0, max_pos, (*streams, tokens), generator=gen)
    positions = positions.to(pos_dtype)
    nslots = blocks * bs
    slots = torch.randperm(nslots, generator=gen)[:tokens].to(slot_dtype)
    slots[torch.randperm(tokens, generator=gen)[: max(1, tokens // 4)]] = -1  # padding: skipped
    if strided_indices:  # every other element of a buffer whose others are out of range for both
        positions, slots = (torch.full((*t.shape[:-1], 2 * tokens), 2**40, dtype=t.dtype).index_copy_(
            -1, torch.arange(0, 2 * tokens, 2), t)[..., ::2] for t in (positions, slots))
    qw = kw = None
    if qk_norm:
        qw = (1 + 0.3 * torch.randn(d, generator=gen)).to(dtype)
        kw = (1 + 0.3 * torch.randn(d, generator=gen)).to(dtype)
    shape = (blocks + 1, bs, hkv, d) if layout == "NHD" else (blocks + 1, hkv, bs, d)
    cdt = torch.float8_e4m3fn if fp8 else dtype
    kfull, vfull = torch.full(shape, NAN, dtype=cdt), torch.full(shape, NAN, dtype=cdt)
    kfull[blocks:], vfull[blocks:] = 7.0, 7.0  # a guard block past the cache
    scales = dict(k_scale=torch.tensor([0.01]), v_scale=torch.tensor([0.5])) if fp8 else {}
    if device != "cpu":
        kfull, vfull, positions, slots = (t.to(device) for t in (kfull, vfull, positions, slots))
        qw, kw = (None if w is None else w.to(device) for w in (qw, kw))
        scales = {k: t.to(device) for k, t in scales.items()}
    before = qkv.clone()
    q = op(qkv, positions, kfull[:blocks], vfull[:blocks], slots, q_norm_weight=qw, k_norm_weight=kw, **scales)
    op.check()
    assert q.shape == (tokens, hq, d) and q.dtype == dtype and q.device == qkv.device
    if device != "cpu":
        q, qkv, before, positions, slots, kfull, vfull = (t.cpu() for t in (q, qkv, before, positions, slots, kfull,
                                                                            vfull))
        qw, kw = (None if w is None else w.cpu() for w in (qw, kw))
    assert torch.equal(qkv, before), "qkv was modified"
    assert (kfull[blocks:] == 7.0).all() and (vfull[blocks:] == 7.0).all(), "wrote past the cache"
    q_ref, q_mag, cache = reference(qkv, positions, slots, hq, hkv, d, rope, qw, kw, nslots)
    assert_within(q, q_ref, q_mag, UNIT[dtype], f"q ({rope.name})")
    assert_cache_rows(kfull, vfull, layout, bs, nslots, cache, UNIT[dtype], rope.name, (0.01, 0.5) if fp8 else None)
    return op, q


def assert_cache_rows(kc, vc, layout, bs, nslots, cache, unit, what, fp8_scales=None):
    """Every slot of the caches against :func:`reference`'s ``cache``: k within the bound, v exact (a
    float8 cache: k over its scale within half an e4m3 step, v bit for bit e4m3(v / scale)); a slot no
    token names still NaN."""
    for s in range(nslots):
        kr, vr = rows(kc, layout, s, bs), rows(vc, layout, s, bs)
        if s in cache and fp8_scales is not None:
            ks, vs = fp8_scales
            assert_e4m3(kr, cache[s][0] / ks, cache[s][1] / ks, unit, f"k slot {s} ({what})")
            assert torch.equal(vr.view(torch.uint8), e4m3(cache[s][2], vs)), f"v slot {s}: not e4m3(v / scale)"
        elif s in cache:
            assert_within(kr, cache[s][0], cache[s][1], unit, f"k slot {s} ({what})")
            assert torch.equal(vr.double(), cache[s][2]), f"v slot {s} ({what}): not copied exactly"
        else:
            assert torch.isnan(kr.float()).all() and torch.isnan(vr.float()).all(), f"slot {s} written ({what})"


class _Config:
    """A transformers-style config (only the attributes from_hf_config reads)."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def rope_variants():
    """Every rope constructor of the family that takes positions, head_dim 64; partial rotary ones
    rotate 32 columns; MRoPE's take [3, tokens] positions."""
    n = torch.linspace(1.0, 3.0, 16, dtype=torch.float64)
    return {
        "RoPEFwdOp": RoPEFwdOp(base=5e5),
        "RoPEFwdOp-interleaved": RoPEFwdOp(rope_layout="interleaved", base=1e4),
        "YaRNFwdOp-interleaved (DeepSeek)": YaRNFwdOp(scale=40.0, original_max_position=4096, rope_layout="interleaved"),
        "MRoPEFwdOp (Qwen2-VL)": MRoPEFwdOp(mrope_section=[8, 12, 12], input_layout="packed", base=1e6),
        "MRoPEFwdOp-interleaved (Qwen3-VL)": MRoPEFwdOp(mrope_section=[12, 10, 10], input_layout="packed", base=5e6,
                                                        mrope_interleaved=True),
        "RoPENeoxPositionIdsFwdOp": RoPENeoxPositionIdsFwdOp(max_position=8192, base=1e6),
        "RoPELlama31FwdOp": RoPELlama31FwdOp(base=5e5, scale_factor=8.0, original_max_position=1024),
        "YaRNFwdOp": YaRNFwdOp(scale=4.0, original_max_position=1024),
        "LongRoPEFwdOp": LongRoPEFwdOp(rescale_factors=torch.linspace(1.0, 4.0, 32), max_position_embeddings=16384,
                                       original_max_position_embeddings=4096),
        "RoPELinearFwdOp-partial": RoPELinearFwdOp(factor=2.0, rotary_dim=32),
        "Phi3LongRoPEFwdOp-partial": Phi3LongRoPEFwdOp(short_factor=n, long_factor=2 * n, rotary_dim=32,
                                                       max_position_embeddings=16384,
                                                       original_max_position_embeddings=4096),
        "RoPEDynamicNTKFwdOp-partial": RoPEDynamicNTKFwdOp(factor=2.0, max_position_embeddings=2048, rotary_dim=32),
        "from_hf_config-llama3": from_hf_config(_Config(
            rope_theta=5e5, head_dim=64, hidden_size=512, num_attention_heads=8, max_position_embeddings=8192,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 1024})),
    }


VARIANTS = rope_variants()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_rope_variant(gen, name):
    """8 q heads on 1 kv head, head_dim 64, bf16, both layouts over the variants."""
    run_case(gen, VARIANTS[name], hq=8, hkv=1, d=64, tokens=6, layout="NHD" if len(name) % 2 else "HND")


@pytest.mark.parametrize("d,hq,hkv,layout,bs,dtype,slots", [
    (128, 32, 8, "NHD", 16, torch.bfloat16, torch.int64),
    (64, 64, 8, "HND", 64, torch.float16, torch.int32),
    (80, 16, 16, "NHD", 1, torch.bfloat16, torch.int32),
    (256, 8, 1, "HND", 16, torch.float16, torch.int64),
], ids=["128-32-8", "64-64-8", "80-16-16", "256-8-1"])
def test_heads_dims_layouts_blocks_with_qk_norm(gen, d, hq, hkv, layout, bs, dtype, slots):
    rope = RoPENeoxPositionIdsFwdOp(max_position=8192, base=1e6)
    run_case(gen, rope, hq=hq, hkv=hkv, d=d, tokens=4, dtype=dtype, qk_norm=True, layout=layout, bs=bs,
             blocks=max(2, 8 // bs), slot_dtype=slots, pos_dtype=slots)


def test_strided_and_expanded_positions_and_slots_are_read_as_their_values(gen):
    """positions and slot_mapping are read through their own strides, not as dense runs: HF's
    ``position_ids [1, seq]`` expanded to a batch has stride 0, and a dense read of it took the
    bytes past the tensor as positions (found by the HF prologue patch at decode)."""
    run_case(gen, VARIANTS["RoPENeoxPositionIdsFwdOp"], hq=4, hkv=2, d=64, tokens=6, strided_indices=True)
    op = AttnPrologueFwdOp(4, 2, 64, VARIANTS["RoPENeoxPositionIdsFwdOp"])
    qkv = torch.randn(3, 8 * 64, generator=gen).to(torch.bfloat16)
    kc, vc = torch.zeros(2, 16, 2, 64, dtype=torch.bfloat16), torch.zeros(2, 16, 2, 64, dtype=torch.bfloat16)
    slots = torch.tensor([3, 17, 30])
    want = op(qkv, torch.tensor([5, 5, 5]), kc.clone(), vc.clone(), slots)
    got = op(qkv, torch.tensor([5]).expand(3), kc, vc, slots)  # stride 0
    op.check()
    assert torch.equal(got, want)


def test_tables_are_the_rope_ops_own(gen):
    """One copy of the digit tables per device, shared by the rope op and the fused op."""
    rope = VARIANTS["RoPENeoxPositionIdsFwdOp"]
    op, _ = run_case(gen, rope, hq=8, hkv=1, d=64, tokens=3)
    impl = next(iter(op._impls.values()))
    assert impl.tables is rope._tables(64)[0]


@pytest.mark.parametrize("name", ["Phi3LongRoPEFwdOp-partial", "RoPEDynamicNTKFwdOp-partial"])
def test_keys_before_and_after_4096_decode_consistently(gen, name):
    """Keys written in a call at positions below 4096 and in a later call past it use one set of
    frequencies (the deployment's): each is the reference's rotation at its own position with those
    frequencies, so attention between them sees their true distance. The standalone rope op keeps
    HF's per-call choice: at the short call it rotates with other frequencies."""
    rope = VARIANTS[name]
    short = torch.arange(10, 13)
    long = torch.arange(5000, 5003)
    run_case(gen, rope, hq=8, hkv=1, d=64, tokens=3, positions=short)
    run_case(gen, rope, hq=8, hkv=1, d=64, tokens=3, positions=long)
    x = torch.randn(3, 64, generator=gen)  # the rope op's 1d layout: [seq, head_dim]
    alone = rope(x, position_ids=short)
    inv, amp = references.inv_freq_and_amplitude(rope.name, ref_params(rope), 32)
    fused_rule = references.rotate(x.double(), short, inv, amp, "neox")
    assert not torch.allclose(alone.double(), fused_rule, atol=1e-3), \
        "the standalone op should keep HF's per-call choice at short positions"


def test_bad_positions_and_slots_reported_never_out_of_bounds(gen):
    rope = VARIANTS["RoPENeoxPositionIdsFwdOp"]  # max_position 8192
    op = AttnPrologueFwdOp(8, 1, 64, rope)
    qkv = torch.randn(4, 10 * 64, generator=gen).to(torch.bfloat16)
    kfull, vfull = torch.full((2, 16, 1, 64), 7.0, dtype=torch.bfloat16), torch.full((2, 16, 1, 64), 7.0,
                                                                                       dtype=torch.bfloat16)
    kc, vc = kfull[:1], vfull[:1]
    good = torch.tensor([0, 1, 2, 3])
    with pytest.raises(ValueError, match=r"positions: expected every value in \[0, max_position=8192\).*"
                                         r"got positions\[2\] = 8192"):
        op(qkv, torch.tensor([0, 1, 8192, 3]), kc, vc, good)
    with pytest.raises(ValueError, match=r"slot_mapping: .*= 16 .*got slot_mapping\[1\] = 16"):
        op(qkv, good, kc, vc, torch.tensor([0, 16, 2, 3]))
    with pytest.raises(ValueError, match=r"slot_mapping\[0\] = 1099511627776"):
        op(qkv, good, kc, vc, torch.tensor([2**40, 1, 2, 3]))
    with tileops.strict(), pytest.raises(ValueError, match="positions"):
        op(qkv, torch.tensor([-1, 1, 2, 3]), kc, vc, good)
    assert (kfull[1:] == 7).all() and (vfull[1:] == 7).all(), "a bad slot wrote past the cache"
    op(qkv, good, kc, vc, torch.tensor([0, -1, 5, 15]))
    op.check()  # nothing pending


@pytest.mark.parametrize("name", ["RoPENeoxPositionIdsFwdOp", "YaRNFwdOp-interleaved (DeepSeek)", "RoPELinearFwdOp-partial"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_float8_caches(gen, name, layout):
    """float8 e4m3fn caches with per-tensor scales: k and v over their scales, saturated, against the
    float64 chain; a pairing, partial rotary, both layouts."""
    run_case(gen, VARIANTS[name], hq=4, hkv=2, d=64, tokens=9, qk_norm=True, layout=layout, bs=4, fp8=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_float8_caches_hold_the_unfused_chains_bits(gen, dtype):
    """Bit for bit what the unfused chain stores: the op with caches of qkv's dtype, then torch's
    saturating cast of ``x / scale`` (k rounded to the dtype first, as the chain stores it); q the same."""
    rope = VARIANTS["RoPENeoxPositionIdsFwdOp"]
    t, hq, hkv, d = 11, 4, 2, 64
    qkv = (3 * torch.randn(t, (hq + 2 * hkv) * d, generator=gen)).to(dtype)
    pos, slots = torch.randint(0, 4000, (t,), generator=gen), torch.randperm(32, generator=gen)[:t]
    w = [(1 + 0.3 * torch.randn(d, generator=gen)).to(dtype) for _ in range(2)]
    ks, vs = 0.005, 0.3  # normalised keys reach ~4 x their weight: some pass 448 x 0.005
    fused = AttnPrologueFwdOp(hq, hkv, d, rope, qk_norm=True, cache_dtype=torch.float8_e4m3fn)
    k8, v8 = (torch.full((8, 4, hkv, d), NAN, dtype=torch.float8_e4m3fn) for _ in range(2))
    q8 = fused(qkv, pos, k8, v8, slots, q_norm_weight=w[0], k_norm_weight=w[1], k_scale=torch.tensor(ks),
               v_scale=torch.tensor(vs))
    plain = AttnPrologueFwdOp(hq, hkv, d, rope, qk_norm=True)
    kc, vc = (torch.zeros(8, 4, hkv, d, dtype=dtype) for _ in range(2))
    q = plain(qkv, pos, kc, vc, slots, q_norm_weight=w[0], k_norm_weight=w[1])
    assert torch.equal(q8, q)
    written = torch.zeros(32, dtype=torch.bool)
    written[slots] = True
    written = written.view(8, 4)
    assert torch.equal(k8[written].view(torch.uint8), e4m3(kc[written], ks))
    assert torch.equal(v8[written].view(torch.uint8), e4m3(vc[written], vs))
    assert (k8[written].float().abs() == 448).any(), "no key saturated: the scale tests nothing past 448"
    assert torch.isnan(k8[~written].float()).all() and torch.isnan(v8[~written].float()).all()


def test_float8_scales_named(gen):
    rope, args = _good(gen)
    args["key_cache"], args["value_cache"] = (c.to(torch.float8_e4m3fn) for c in (args["key_cache"], args["value_cache"]))
    op = AttnPrologueFwdOp(8, 1, 64, rope, cache_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="k_scale: expected k_scale and v_scale with an fp8 cache"):
        op(**args)
    with pytest.raises(ValueError, match="k_scale: expected one scale per tensor"):
        op(**args, k_scale=torch.ones(2), v_scale=torch.ones(2))
    with pytest.raises(TypeError, match="k_scale: expected dtype float32"):
        op(**args, k_scale=torch.ones(1, dtype=torch.float16), v_scale=torch.ones(1))
    with pytest.raises(ValueError, match="key_cache: expected the cache in cache_dtype"):
        op(**{**args, "key_cache": args["key_cache"].to(torch.bfloat16),
              "value_cache": args["value_cache"].to(torch.bfloat16)}, k_scale=torch.ones(1), v_scale=torch.ones(1))


def test_a_cache_dtype_other_than_qkvs_or_float8_is_refused(gen):
    rope, args = _good(gen)
    op = AttnPrologueFwdOp(8, 1, 64, rope, cache_dtype=torch.float16)
    with pytest.raises(ValueError, match="qkv: expected qkv in cache_dtype, or cache_dtype None or float8_e4m3fn"):
        op(**{**args, "key_cache": args["key_cache"].half(), "value_cache": args["value_cache"].half()})


def test_cuda_kernel_specs():
    """``tileops warmup`` and ``tileops lowered`` get the CUDA schedule's spec (16-byte strides' unit),
    the C one for the CPU; a head row wider than a warp's lanes is a ValueError naming head_dim."""
    from tileops.attention import builtin
    from tileops.manifest import CallSpec

    op = AttnPrologueFwdOp(8, 1, 64, VARIANTS["RoPENeoxPositionIdsFwdOp"], qk_norm=True)
    dtypes = (("qkv", "bfloat16"), ("positions", "int64"), ("slot_mapping", "int32"))
    for device, backend in (("cuda", "cuda"), ("cpu", "c")):
        call = CallSpec(torch.device(device), dtypes, (("width", 640),))
        [(builder, spec)] = builtin.kernel_specs(op.manifest, op.params, call, backend)
        assert builder == "prologue" and spec.backend == backend and spec.qk_norm and spec.slots == "int32"
        assert spec.stride_unit == (8 if backend == "cuda" else 1)
    wide = AttnPrologueFwdOp(1, 1, 1024, RoPENeoxPositionIdsFwdOp(max_position=64))
    call = CallSpec(torch.device("cuda"), dtypes, (("width", 3072),))
    with pytest.raises(ValueError, match="AttnPrologueFwdOp: head_dim, rot: the CUDA schedule"):
        builtin.kernel_specs(wide.manifest, wide.params, call, "cuda")


def _good(gen):
    rope = VARIANTS["RoPENeoxPositionIdsFwdOp"]
    args = dict(qkv=torch.randn(3, 10 * 64, generator=gen).to(torch.bfloat16), positions=torch.arange(3),
                key_cache=torch.zeros(2, 16, 1, 64, dtype=torch.bfloat16),
                value_cache=torch.zeros(2, 16, 1, 64, dtype=torch.bfloat16), slot_mapping=torch.arange(3))
    return rope, args


BAD_CALLS = {  # argument -> (change to the good call, error type, what the message must say)
    "qkv-width": (lambda a: a.update(qkv=a["qkv"][:, :-64]), ValueError, "qkv: expected a last dim"),
    "qkv-dtype": (lambda a: a.update(qkv=a["qkv"].double()), TypeError, "qkv: expected dtype float16, bfloat16, float32"),
    "positions-dtype": (lambda a: a.update(positions=a["positions"].float()), TypeError, "positions: expected dtype"),
    "positions-length": (lambda a: a.update(positions=torch.arange(4)), ValueError, "positions: expected tokens=3"),
    "cache-layout": (lambda a: a.update(key_cache=torch.zeros(2, 1, 16, 64, dtype=torch.bfloat16),
                                        value_cache=torch.zeros(2, 1, 16, 64, dtype=torch.bfloat16)),
                     ValueError, "key_cache: expected num_kv_heads heads"),
    "cache-dtype": (lambda a: a.update(key_cache=a["key_cache"].half(), value_cache=a["value_cache"].half()),
                    ValueError, "key_cache: expected the cache in cache_dtype"),
    "cache-shapes-differ": (lambda a: a.update(value_cache=torch.zeros(3, 16, 1, 64, dtype=torch.bfloat16)),
                            ValueError, "value_cache: expected shape"),
    "cache-strides-differ": (lambda a: a.update(value_cache=torch.zeros(16, 2, 1, 64, dtype=torch.bfloat16)
                                                .transpose(0, 1)), ValueError, "value_cache: expected the strides"),
    "caches-overlap": (lambda a: a.update(value_cache=a["key_cache"]), ValueError, "key_cache: overlaps value_cache"),
    "slot-dtype": (lambda a: a.update(slot_mapping=a["slot_mapping"].to(torch.int16)), TypeError,
                   "slot_mapping: expected dtype int32, int64"),
    "weight-without-qk-norm": (lambda a: a.update(q_norm_weight=torch.ones(64, dtype=torch.bfloat16)), ValueError,
                               "q_norm_weight: expected no norm weights without qk_norm"),
    "scale-without-fp8": (lambda a: a.update(k_scale=torch.ones(1), v_scale=torch.ones(1)), ValueError,
                          "k_scale: expected no k_scale or v_scale without an fp8 cache"),
    "cache-no-blocks": (lambda a: a.update(key_cache=a["key_cache"][:0], value_cache=a["value_cache"][:0]),
                        ValueError, "key_cache: expected at least one block"),
    "q_out-shape": (lambda a: a.update(q_out=torch.empty(3, 8, 32, dtype=torch.bfloat16)), ValueError,
                    r"q_out: expected shape \[3, 8, 64\]"),
}


@pytest.mark.parametrize("what", list(BAD_CALLS))
def test_bad_call_names_the_argument(gen, what):
    rope, args = _good(gen)
    op = AttnPrologueFwdOp(8, 1, 64, rope)
    change, error, message = BAD_CALLS[what]
    change(args)
    with pytest.raises(error, match=message):
        op(**args)


def test_missing_norm_weights_named(gen):
    rope, args = _good(gen)
    op = AttnPrologueFwdOp(8, 1, 64, rope, qk_norm=True)
    with pytest.raises(ValueError, match="q_norm_weight: expected q_norm_weight and k_norm_weight with qk_norm"):
        op(**args)
    with pytest.raises(ValueError, match="k_norm_weight: expected k_norm_weight"):
        op(**args, q_norm_weight=torch.ones(64, dtype=torch.bfloat16))


def test_a_k_norm_weight_without_qk_norm_is_refused(gen):
    """As q_norm_weight without qk_norm is (``expected no norm weights without qk_norm=True``): the
    fuzzer found it accepted and ignored."""
    rope, args = _good(gen)
    op = AttnPrologueFwdOp(8, 1, 64, rope)
    with pytest.raises(ValueError, match="k_norm_weight"):
        op(**args, k_norm_weight=torch.ones(64, dtype=torch.bfloat16))


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(num_q_heads=8, num_kv_heads=3), ValueError, "num_q_heads: expected a multiple of num_kv_heads"),
    (dict(head_dim=63), ValueError, "head_dim: expected an even head_dim"),
    (dict(rope="RoPEFwdOp"), TypeError, "rope: expected an op of"),
    (dict(cache_layout="NDH"), ValueError, "cache_layout: expected one of 'NHD', 'HND'"),
    (dict(cache_dtype=torch.float64), ValueError, "cache_dtype: expected one of"),
    (dict(head_dim=16), ValueError, "rope: expected a rotated width in \\[2, head_dim=16\\]"),
])
def test_bad_construction_names_the_argument(kwargs, error, message):
    base = dict(num_q_heads=8, num_kv_heads=1, head_dim=64, rope=VARIANTS["RoPELinearFwdOp-partial"])
    with pytest.raises(error, match=message):
        AttnPrologueFwdOp(**{**base, **kwargs})


def test_rope_of_another_family_refused():
    from tileops.norm import RMSNormFwdOp

    with pytest.raises(TypeError, match="rope: expected an op of the 'rope' family .* got RMSNormFwdOp"):
        AttnPrologueFwdOp(8, 1, 64, RMSNormFwdOp())


# --------------------------------------------------------------------------- the manifest's compose section


def _composed(tmp_path, name: str, edit):
    from tileops.manifest import packaged_files

    src = next(p for p in packaged_files() if p.name == "AttnPrologueFwdOp.yaml").read_text()
    path = tmp_path / f"{name}.yaml"
    path.write_text(edit(name + src[len("AttnPrologueFwdOp"):]))
    return path


def test_compose_resolves_to_loaded_manifests():
    from tileops.manifest import registry

    stages = {s.name: s for s in registry()["AttnPrologueFwdOp"].compose}
    assert stages["norm"].ops == ("RMSNormFwdOp",)
    assert "RoPELlama31FwdOp" in stages["rope"].ops and "YaRNFwdOp" in stages["rope"].ops
    assert stages["rope"].param == "rope" and stages["norm"].when == "qk_norm"


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.replace("from: norm/RMSNormFwdOp", "from: norm/NoSuchNormOp"),
     "compose.norm.from: no op 'NoSuchNormOp' in family 'norm'"),
    (lambda t: t.replace("from: rope\n", "from: ropes\n"), "compose.rope.from: unknown family 'ropes'"),
    (lambda t: t.replace("from: norm/RMSNormFwdOp", "from: attention/CyclicOp"), "compose.norm.from: a cycle: "
                                                                                 "CyclicOp -> CyclicOp"),
    (lambda t: t.replace("rope: {op: RoPELlama31FwdOp}", "rope: {op: RMSNormFwdOp}"),
     r"cases\[llama-decode-hnd\].params.rope: 'RMSNormFwdOp' is not among compose.rope's ops"),
    (lambda t: t.replace("      written: true\n    value_cache:", "      written: true\n      optional: true\n"
                                                                     "    value_cache:"),
     "inputs.key_cache: 'written' is for required inputs"),
], ids=["unknown-op", "unknown-family", "cycle", "case-op-of-another-family", "written-optional"])
def test_compose_errors_name_the_key(tmp_path, edit, message):
    from tileops.manifest import ManifestError, load_files, packaged_files

    path = _composed(tmp_path, "CyclicOp", edit)
    others = [p for p in packaged_files() if p.name != "AttnPrologueFwdOp.yaml"]
    with pytest.raises(ManifestError, match=message):
        load_files([*others, path])


def test_opcheck_and_compiled_calls_write_the_caches(gen):
    """Traced by torch.compile, the op is ``tileops::apply_out`` with the caches among its mutated
    tensors (after q): opcheck passes on that form, and a compiled function (fullgraph) gives the
    eager call's q and caches."""
    from tileops.runtime.library import pack

    rope, args = _good(gen)
    op = AttnPrologueFwdOp(8, 1, 64, rope)
    rest = {k: v for k, v in args.items() if k not in ("key_cache", "value_cache")}
    q = torch.empty(args["qkv"].shape[0], 8, 64, dtype=args["qkv"].dtype)
    torch.library.opcheck(torch.ops.tileops.apply_out.default,
                          (op._handle, *pack(op._layout, rest), [q, args["key_cache"].clone(), args["value_cache"].clone()]))

    def step(qkv, positions, key_cache, value_cache, slot_mapping):
        return op(qkv, positions, key_cache, value_cache, slot_mapping) * 2

    eager = {k: v.clone() for k, v in args.items()}
    compiled = {k: v.clone() for k, v in args.items()}
    want = step(**eager)
    got = torch.compile(step, fullgraph=True)(**compiled)
    op.check()
    assert torch.equal(got, want)
    for name in ("key_cache", "value_cache"):
        assert torch.equal(compiled[name], eager[name]), name
        assert not torch.equal(compiled[name], args[name]), f"{name}: nothing written"


def _runtimes():
    from tileops.runtime import native

    return ["python"] + (["native"] if native.module is not None else [])


@pytest.mark.parametrize("runtime", _runtimes())
def test_repeated_calls_are_served_from_the_binding(gen, runtime):
    """A call shaped like an earlier one takes the runtime's binding: q (its own shape, not qkv's) is a
    new tensor per call, the caches are written, eager and as the compiled graph's ``apply_out`` (the
    caches after q among its mutated tensors); every call against the float64 reference. The native
    runtime serves them without Python (its hits count them)."""
    from tileops.runtime import native
    from tileops.runtime.executor import PythonRuntime
    from tileops.runtime.library import pack

    # the custom ops are the extension's where it is loaded: they serve the ops of its runtime
    traced = runtime == "native" or native.module is None
    rope = VARIANTS["RoPENeoxPositionIdsFwdOp"]
    hq, hkv, d, bs, blocks, tokens = 4, 2, 64, 4, 3, 6
    op = AttnPrologueFwdOp(hq, hkv, d, rope, qk_norm=True, eps=EPS, cache_layout="HND")
    if runtime == "python":
        op._use_runtime(PythonRuntime(op._handle))
    checks = []
    full = op._check_call
    op._check_call = lambda t: checks.append(1) or full(t)
    qw, kw = ((1 + 0.3 * torch.randn(d, generator=gen)).to(torch.bfloat16) for _ in range(2))
    qs = []
    for i in range(6):
        qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen).to(torch.bfloat16)
        positions = torch.randint(0, 8192, (tokens,), generator=gen)
        slots = torch.randperm(blocks * bs, generator=gen)[:tokens]
        slots[0] = -1
        kc, vc = (torch.full((blocks, hkv, bs, d), NAN, dtype=torch.bfloat16) for _ in range(2))
        if i % 2 == 0 or not traced:
            q = op(qkv, positions, kc, vc, slots, q_norm_weight=qw, k_norm_weight=kw)
        else:  # what a compiled graph calls (tileops.op.Op._traced_call)
            q = torch.full((tokens, hq, d), NAN, dtype=torch.bfloat16)
            rest = dict(qkv=qkv, positions=positions, slot_mapping=slots, q_norm_weight=qw, k_norm_weight=kw)
            torch.ops.tileops.apply_out.default(op._handle, *pack(op._layout, rest), [q, kc, vc])
        op.check()
        assert q.shape == (tokens, hq, d) and all(q is not p for p in qs)
        qs.append(q)
        q_ref, q_mag, cache = reference(qkv, positions, slots, hq, hkv, d, rope, qw, kw, blocks * bs)
        assert_within(q, q_ref, q_mag, UNIT[torch.bfloat16], f"q of call {i}")
        assert_cache_rows(kc, vc, "HND", bs, blocks * bs, cache, UNIT[torch.bfloat16], f"call {i}")
    assert len(checks) == (2 if traced else 1), "a call shaped like an earlier one was checked again"
    if runtime == "native":
        assert op._runtime.stats()["hits"] >= 4, op._runtime.stats()


@pytest.mark.parametrize("runtime", _runtimes())
def test_a_bound_call_whose_caches_overlap_is_refused(gen, runtime):
    """The caches are written in place: a call shaped like a served one whose value_cache is now the key
    cache's memory, or whose key_cache overlaps qkv, is refused by name before anything is written (the
    binding checks the caches' memory by pointers at every call); a bad slot through the binding is
    reported as at the first call."""
    from tileops.runtime.executor import PythonRuntime

    rope = VARIANTS["RoPENeoxPositionIdsFwdOp"]
    op = AttnPrologueFwdOp(8, 1, 64, rope)
    if runtime == "python":
        op._use_runtime(PythonRuntime(op._handle))
    qkv = torch.randn(3, 10 * 64, generator=gen).to(torch.bfloat16)
    pos, slots = torch.arange(3), torch.tensor([0, 5, 9])
    buf = torch.zeros(4, 16, 1, 64, dtype=torch.bfloat16)
    op(qkv, pos, buf[:2], buf[2:], slots)
    op(qkv, pos, buf[:2], buf[2:], slots)  # bound
    before = buf.clone()
    with pytest.raises(ValueError, match="value_cache: overlaps key_cache|key_cache: overlaps value_cache"):
        op(qkv, pos, buf[:2], buf[1:3], slots)
    mem = torch.zeros(2 * 16 * 64 + 3 * 10 * 64, dtype=torch.bfloat16)
    cache_view = mem[:2 * 16 * 64].view(2, 16, 1, 64)
    with pytest.raises(ValueError, match="key_cache: overlaps qkv"):
        op(mem[16 * 64:16 * 64 + 3 * 640].view(3, 640), pos, cache_view, buf[2:], slots)
    assert torch.equal(buf, before), "a refused call wrote a cache"
    with pytest.raises(ValueError, match=r"slot_mapping: .*= 32 .*got slot_mapping\[2\] = 32"):
        op(qkv, pos, buf[:2], buf[2:], torch.tensor([0, 5, 32]))
        op.check()


def test_cuda_alignment_checks_name_the_argument(gen):
    """The CUDA path's fit policy (run here on CPU tensors with the CUDA kernel's unit, nothing
    launched): a qkv, cache or norm weight whose pointer or strides are off the 16-byte vectors is a
    ValueError naming it, since each is used where it lies; a q_out off them is written through a buffer."""
    from tileops.attention.builtin import plan_of

    op = AttnPrologueFwdOp(2, 1, 64, VARIANTS["RoPENeoxPositionIdsFwdOp"], qk_norm=True)
    plan = plan_of(op)
    wide = torch.randn(3, 4 * 64 + 8, generator=gen).to(torch.bfloat16)
    kc = torch.zeros(2, 16, 1, 64, dtype=torch.bfloat16)
    w = torch.ones(65, dtype=torch.bfloat16)
    good = dict(qkv=wide[:, :256], positions=torch.arange(3), slot_mapping=torch.arange(3), key_cache=kc,
                value_cache=kc.clone(), q_norm_weight=w[:64], k_norm_weight=w[:64])
    q = torch.empty(3, 2, 64, dtype=torch.bfloat16)

    def place(unit=8, q_out=q, **bad):
        return plan.place({**good, **bad}, {"q_out": q_out}, unit)

    placed = place()
    assert all(placed.inputs[n] is t for n, t in good.items()) and placed.writes["q_out"] is q
    with pytest.raises(ValueError, match=r"qkv: expected its data pointer and strides on a multiple of 8 "
                                         r"elements \(16 bytes"):
        place(qkv=wide[:, 1:257])
    with pytest.raises(ValueError, match="qkv: expected its data pointer and strides"):
        place(qkv=torch.zeros(3, 260, dtype=torch.bfloat16)[:, :256])  # row stride 260
    flat = torch.zeros(2 * 16 * 64 + 1, dtype=torch.bfloat16)[1:].view(2, 16, 1, 64)
    with pytest.raises(ValueError, match="value_cache: expected its data pointer and strides"):
        place(value_cache=flat)
    with pytest.raises(ValueError, match="k_norm_weight: expected its data pointer"):
        place(k_norm_weight=w[1:])
    # copied, not refused: a qkv whose last dim is not contiguous, positions that are not one dense run
    cols = torch.randn(256, 3, generator=gen).to(torch.bfloat16).t()
    placed = place(qkv=cols, positions=torch.arange(6)[::2])
    assert placed.inputs["qkv"].is_contiguous() and torch.equal(placed.inputs["qkv"], cols)
    assert placed.inputs["positions"].is_contiguous()
    odd = torch.empty(3, 2, 65, dtype=torch.bfloat16)[..., :64]  # head stride 65: through a buffer
    placed = place(q_out=odd)
    assert placed.writes["q_out"] is not odd and placed.outs["q_out"] is odd
    place(unit=1, value_cache=flat, qkv=wide[:, 1:257])  # the C backend: element strides, nothing to refuse


class _HalvedRoPE(RoPENeoxPositionIdsFwdOp):
    """A throwaway variant of the rope family, written here only: every frequency halved and an
    amplitude of 1.25 (what a new variant is to the family: its frequencies and amplitude), on the
    manifest of the op it extends."""

    op_name = "RoPENeoxPositionIdsFwdOp"

    def frequencies(self, rot):
        inv, _ = super().frequencies(rot)
        return inv / 2, 1.25


def test_a_new_rope_variant_is_fused_with_no_edit_to_the_fused_op(gen):
    """The fused op composes whatever rope object it gets, reading its frequencies through the
    rope family's tables: a variant the repository has never seen runs fused, equal to the float64
    math of its own frequencies and to the variant's standalone op between torch ops."""
    rope = _HalvedRoPE(max_position=8192, base=1e4)
    op = AttnPrologueFwdOp(4, 2, 64, rope)
    qkv = torch.randn(5, 8 * 64, generator=gen).to(torch.bfloat16)
    positions = torch.randint(0, 8192, (5,), generator=gen)
    kc = torch.full((2, 16, 2, 64), NAN, dtype=torch.bfloat16)
    vc = torch.full((2, 16, 2, 64), NAN, dtype=torch.bfloat16)
    slots = torch.tensor([3, 17, -1, 30, 0])
    q = op(qkv, positions, kc, vc, slots)
    op.check()
    x = qkv.double().view(5, 8, 64)
    inv = 1.0 / (1e4 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)) / 2
    want_q = references.rotate(x[:, :4], positions.view(-1, 1), inv, 1.25, "neox")
    want_k = references.rotate(x[:, 4:6], positions.view(-1, 1), inv, 1.25, "neox")
    assert_within(q, want_q, x[:, :4].abs().max() * 2.5 * torch.ones_like(want_q), UNIT[torch.bfloat16], "q")
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            got_k = kc.view(-1, 2, 64)[s]
            assert_within(got_k, want_k[t], x[t, 4:6].abs().max() * 2.5 * torch.ones_like(want_k[t]),
                          UNIT[torch.bfloat16], f"k slot {s}")
            assert torch.equal(vc.view(-1, 2, 64)[s], qkv.view(5, 8, 64)[t, 6:]), f"v slot {s}"
    standalone_q, standalone_k = rope(qkv.view(5, 8, 64)[:, :4], positions, key=qkv.view(5, 8, 64)[:, 4:6])
    assert torch.equal(q, standalone_q), "fused q differs from the variant's own op"
    assert torch.equal(kc.view(-1, 2, 64)[3], standalone_k[0])


# --------------------------------------------------------------------------- the fused spec is made of the stages'


def test_the_fused_spec_holds_the_stage_ops_own_specs():
    """The rope stage is the spec the rope family gives the rope op's forward kernel, the norm stage
    the one the norm family gives RMSNormFwdOp's (the op ``compose.norm.from`` names), each less its
    own kernel's schedule (the manifest's ``kernel.static``: the fused kernel has its own)."""
    from tileops import compose
    from tileops.attention.hooks import kernel_spec, stage_calls
    from tileops.kernels import STATIC
    from tileops.manifest import CallSpec
    from tileops.norm import RMSNormFwdOp
    from tileops.norm.builtin import kernel_specs as norm_specs
    from tileops.rope.builtin import kernel_specs as rope_specs

    rope = YaRNFwdOp(scale=4.0, original_max_position=4096, rope_layout="interleaved")
    op = AttnPrologueFwdOp(4, 2, 64, rope, qk_norm=True)
    spec = kernel_spec(op.manifest, op.params, "float16", "int32", "int64", "cuda")
    calls = stage_calls(op.params, "float16", "int32", "cuda")

    def unscheduled(s, builder):
        return dataclasses.replace(s, **{f.name: f.default for f in dataclasses.fields(s) if f.name in STATIC[builder]})

    [(_, own_rope), *_] = rope_specs(rope.manifest, rope.params, calls["rope"], "cuda", backward=False)
    norm = RMSNormFwdOp()
    [(_, own_norm)] = norm_specs(norm.manifest, norm.params, calls["norm"], "cuda", backward=False)
    assert spec.rope == unscheduled(own_rope, "rope") and spec.rope.pairing == "interleaved"
    assert spec.norm == unscheduled(own_norm, "norm") and spec.norm.rounding == "llama"
    assert (spec.dtype, spec.head_dim, spec.rot, spec.positions, spec.backend) == ("float16", 64, 64, "int32", "cuda")
    assert kernel_spec(op.manifest, {**op.params, "qk_norm": False}, "float16", "int32", "int64", "cuda").norm is None
    # a case's {op: Name, params: {...}} (tileops warmup names kernels so) composes as the op object does
    case = {**op.params, "rope": {"op": "YaRNFwdOp", "params": {"scale": 4.0, "original_max_position": 4096,
                                                                 "rope_layout": "interleaved"}}}
    assert compose.stage_specs(op.manifest, case, calls, "cuda") == {"rope": spec.rope, "norm": spec.norm}
    assert isinstance(calls["rope"], CallSpec)


def test_a_stage_the_fused_builder_does_not_build_is_refused_naming_its_argument(monkeypatch):
    """What the fused builder fixes in a stage (``Spec.stages``) is checked by :mod:`tileops.compose`, a
    ValueError naming the op's argument that brings the stage (``rope``; the norm's switch ``qk_norm``),
    what the builder builds and what came, at construction. Here a builder that would build neox pairs
    and fp32 rounding only (its declaration patched, the builder untouched)."""
    from tileops.kernels import get_spec

    spec_cls = get_spec("prologue")
    stages = spec_cls.stages
    monkeypatch.setattr(spec_cls, "stages", {"rope": {**stages["rope"], "pairing": ("neox",)},
                                             "norm": {**stages["norm"], "rounding": ("fp32",)}})
    with pytest.raises(ValueError, match=r"AttnPrologueFwdOp: rope: the fused kernel cannot compose RoPEFwdOp yet: "
                                         r"its rope stage has pairing='interleaved', prologue builds 'neox'"):
        AttnPrologueFwdOp(4, 2, 64, RoPEFwdOp(rope_layout="interleaved"))
    AttnPrologueFwdOp(4, 2, 64, RoPEFwdOp())
    with pytest.raises(ValueError, match=r"AttnPrologueFwdOp: qk_norm: the fused kernel cannot compose RMSNormFwdOp "
                                         r"yet: its norm stage has rounding='llama', prologue builds 'fp32'"):
        AttnPrologueFwdOp(4, 2, 64, RoPEFwdOp(), qk_norm=True)


@dataclasses.dataclass(frozen=True)
class _ScaledNormSpec(NormKernelSpec):
    """A throwaway option of the norm stage, written here only: the normalised row times ``out_scale``
    (on the C schedule: :func:`_scaled_row_value`)."""

    out_scale: float = 1.0


def _scaled_row_value(row_value):
    """``kernels/norm.py``'s C per-element stage with ``out_scale`` applied after it."""
    import tileops.kernels.norm as norm_kernels

    def scaled_row_value(spec):
        value = row_value(spec)
        scale = getattr(spec, "out_scale", 1.0)
        if scale == 1.0:
            return value
        T = norm_kernels.T  # TileLang's language module, imported by the stage before this runs

        @T.macro
        def scaled(f, c, rstd, W, B):
            return value(f, c, rstd, W, B) * T.float32(scale)

        return scaled

    return scaled_row_value


def test_a_new_norm_option_reaches_the_fused_op_with_no_edit_to_it(gen, monkeypatch, tmp_path):
    """A norm option the norm family adds (a spec field, the hooks that set it, the stage code that
    applies it; all patched into the norm family here) reaches the fused kernel through
    ``compose.norm``, with no edit to ``kernels/prologue.py`` or ``tileops/attention/``: the fused
    spec's norm stage carries it, and q and the cached k come out twice the plain op's, bit for bit
    (doubling commutes with every rounding), and within the float64 reference's bound."""
    import tileops.kernels.norm as norm_kernels
    from tileops.attention.hooks import kernel_spec
    from tileops.norm.hooks import RMSNormFwdHooks

    rope = RoPENeoxPositionIdsFwdOp(max_position=4096, base=1e4)
    hq, hkv, d, tokens = 4, 2, 64, 7
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen).to(torch.bfloat16)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    slots = torch.tensor([3, 17, -1, 30, 0, 8, 9])
    qw = (1 + 0.3 * torch.randn(d, generator=gen)).to(torch.bfloat16)
    kw = (1 + 0.3 * torch.randn(d, generator=gen)).to(torch.bfloat16)

    def run():
        op = AttnPrologueFwdOp(hq, hkv, d, rope, qk_norm=True, eps=EPS)
        kc, vc = (torch.full((2, 16, 2, d), NAN, dtype=torch.bfloat16) for _ in range(2))
        q = op(qkv, positions, kc, vc, slots, q_norm_weight=qw, k_norm_weight=kw)
        return op, q, kc

    _, plain_q, plain_k = run()
    # kernels built from patched code go to a cache of their own, never to the one later runs read
    monkeypatch.setenv("TILEOPS_CACHE_DIR", str(tmp_path))
    fields = RMSNormFwdHooks.kernel_fields_of.__func__
    monkeypatch.setattr(norm_kernels, "Spec", _ScaledNormSpec)  # what get_spec("norm") returns
    monkeypatch.setattr(RMSNormFwdHooks, "kernel_fields_of",
                        classmethod(lambda cls, params, call: {**fields(cls, params, call), "out_scale": 2.0}))
    monkeypatch.setattr(norm_kernels, "row_value", _scaled_row_value(norm_kernels.row_value))
    op, q, kc = run()
    spec = kernel_spec(op.manifest, op.params, "bfloat16", "int64", "int64", "c")
    assert type(spec.norm) is _ScaledNormSpec and spec.norm.out_scale == 2.0
    assert torch.equal(q, 2 * plain_q), "the fused q is not twice the plain op's: the option did not reach it"
    written = slots[slots >= 0]
    assert torch.equal(kc.view(-1, hkv, d)[written], 2 * plain_k.view(-1, hkv, d)[written])
    x = qkv.double().view(tokens, -1, d)[:, :hq + hkv]  # the q and k heads
    w = torch.cat([qw.double().expand(hq, d), kw.double().expand(hkv, d)])
    normed = 2 * x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS) * w
    inv = 1.0 / (1e4 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    want = references.rotate(normed, positions.view(-1, 1), inv, 1.0, "neox")
    assert_within(q, want[:, :hq], 2 * normed.abs().max() * torch.ones_like(want[:, :hq]), UNIT[torch.bfloat16], "q")
