"""``tileops.attention.AttnPrologueFwdOp`` on the GPU: the CUDA schedule of ``kernels/prologue.py``
(skipped without a GPU, like every ``cuda``-marked test; written to run on the H200).

What the GPU adds to the CPU tests (``tests/test_attention_prologue.py`` runs the C schedule through
the op, ``tests/test_prologue_kernels.py`` the CUDA source on the CPU harness): the lean nvcc build
launched for real, the GPU's ``rsqrtf`` and shuffles, 16-byte accesses and the host's alignment
checks, a CUDA graph captured after one warm-up and replayed on new data, positions and slots, and
the deferred error words (no host sync at the call).

The reference is the float64 unfused chain of ``tests/test_attention_prologue.py`` (its own math and
``tests/references.py``, no code shared with the kernels); caches are NaN-filled inside larger
buffers whose guard block must stay 7; inputs are random draws, seeded per
test (``tests/conftest.py``).
"""

from __future__ import annotations

import pytest
import torch

import tileops
from tests.test_attention_prologue import (EPS, NAN, UNIT, VARIANTS, assert_cache_rows, assert_within, reference,
                                           run_case)
from tileops.attention import AttnPrologueFwdOp
from tileops.rope import RoPENeoxPositionIdsFwdOp

pytestmark = pytest.mark.cuda

DEV = "cuda"


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_rope_variant(gen, name):
    """Every rope constructor of the family through the CUDA schedule: 8 q heads on 1 kv head,
    head_dim 64, bf16, both layouts, with and without the norm."""
    run_case(gen, VARIANTS[name], hq=8, hkv=1, d=64, tokens=37, layout="NHD" if len(name) % 2 else "HND",
             qk_norm=len(name) % 3 == 0, device=DEV)


@pytest.mark.parametrize("d,hq,hkv,layout,bs,dtype,slots", [
    (128, 32, 8, "NHD", 16, torch.bfloat16, torch.int64),
    (128, 32, 8, "HND", 64, torch.float16, torch.int32),
    (64, 64, 8, "HND", 64, torch.float16, torch.int32),
    (80, 16, 16, "NHD", 1, torch.bfloat16, torch.int32),
    (256, 8, 1, "HND", 16, torch.float16, torch.int64),
], ids=["128-32-8-NHD", "128-32-8-HND", "64-64-8", "80-16-16", "256-8-1"])
@pytest.mark.parametrize("tokens", [1, 300])
def test_heads_dims_layouts_blocks_with_qk_norm(gen, d, hq, hkv, layout, bs, dtype, slots, tokens):
    rope = RoPENeoxPositionIdsFwdOp(max_position=8192, base=1e6)
    run_case(gen, rope, hq=hq, hkv=hkv, d=d, tokens=tokens, dtype=dtype, qk_norm=True, layout=layout, bs=bs,
             blocks=max(2, -(-2 * tokens // bs)), slot_dtype=slots, pos_dtype=slots, device=DEV)


def test_partial_rotary_and_strided_indices(gen):
    """Partial rotary (the copy lanes), positions and slots as strided views (copied dense first)."""
    run_case(gen, VARIANTS["RoPELinearFwdOp-partial"], hq=4, hkv=2, d=64, tokens=29, qk_norm=True,
             strided_indices=True, device=DEV)


def _inputs(gen, tokens, hq, hkv, d, nslots, dtype=torch.bfloat16):
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    positions = torch.randint(0, 8192, (tokens,), generator=gen)
    slots = torch.randperm(nslots, generator=gen)[:tokens]
    slots[torch.randperm(tokens, generator=gen)[:2]] = -1
    return qkv, positions, slots


def test_graph_replays_on_new_data_positions_and_slots(gen):
    """A CUDA graph captured after one warm-up call replays on new qkv, positions and slots copied
    into the captured buffers; every replay matches the float64 chain (and the caches' rows that the
    replay's slots name)."""
    hq, hkv, d, tokens, bs, blocks = 16, 4, 128, 48, 16, 8
    nslots = bs * blocks
    rope = RoPENeoxPositionIdsFwdOp(max_position=8192, base=1e6)
    op = AttnPrologueFwdOp(hq, hkv, d, rope, qk_norm=True, eps=EPS)
    qw = (1 + 0.3 * torch.randn(d, generator=gen)).to(torch.bfloat16)
    kw = (1 + 0.3 * torch.randn(d, generator=gen)).to(torch.bfloat16)
    qkv, positions, slots = (t.to(DEV) for t in _inputs(gen, tokens, hq, hkv, d, nslots))
    kc = torch.full((blocks, bs, hkv, d), NAN, dtype=torch.bfloat16, device=DEV)
    vc = torch.full_like(kc, NAN)
    q = torch.empty(tokens, hq, d, dtype=torch.bfloat16, device=DEV)
    qw_d, kw_d = qw.to(DEV), kw.to(DEV)
    op(qkv, positions, kc, vc, slots, q_norm_weight=qw_d, k_norm_weight=kw_d, q_out=q)  # warm-up: compiles, binds
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op(qkv, positions, kc, vc, slots, q_norm_weight=qw_d, k_norm_weight=kw_d, q_out=q)
    for _ in range(3):
        new_qkv, new_pos, new_slots = _inputs(gen, tokens, hq, hkv, d, nslots)
        qkv.copy_(new_qkv)
        positions.copy_(new_pos)
        slots.copy_(new_slots)
        kc.fill_(NAN)
        vc.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        q_ref, q_mag, cache = reference(new_qkv, new_pos, new_slots, hq, hkv, d, rope, qw, kw, nslots)
        assert_within(q.cpu(), q_ref, q_mag, UNIT[torch.bfloat16], "q (replay)")
        kcpu, vcpu = kc.cpu(), vc.cpu()
        assert_cache_rows(kcpu, vcpu, "NHD", bs, nslots, cache, UNIT[torch.bfloat16], "replay")
    op.check()


def test_bad_positions_and_slots_deferred_and_never_out_of_bounds(gen):
    """A bad position or slot is reported at a later sync point (``op.check()``), not at the call, and
    nothing past the cache is written; ``tileops.strict()`` raises at the call. The report names the
    bad index while the caller holds the tensor, and from the kernel's record when the tensor was
    freed before the report (the tracker holds it weakly)."""
    rope = VARIANTS["RoPENeoxPositionIdsFwdOp"]  # max_position 8192
    op = AttnPrologueFwdOp(8, 1, 64, rope)
    qkv = torch.randn(4, 10 * 64, generator=gen).to(torch.bfloat16).to(DEV)
    kfull = torch.full((2, 16, 1, 64), 7.0, dtype=torch.bfloat16, device=DEV)
    vfull = torch.full_like(kfull, 7.0)
    kc, vc = kfull[:1], vfull[:1]
    good = torch.tensor([0, 1, 2, 3], device=DEV)
    op(qkv, good, kc, vc, good)
    op.check()
    bad_pos = torch.tensor([0, 1, 8192, 3], device=DEV)
    op(qkv, bad_pos, kc, vc, good)  # no raise here: deferred
    with pytest.raises(ValueError, match=r"positions: expected every value in \[0, max_position=8192\) of "
                                         r"RoPENeoxPositionIdsFwdOp, got positions\[2\] = 8192 "
                                         r"\(reported for an earlier"):
        op.check()
    bad_slots = torch.tensor([0, 16, 2**40, 3], device=DEV)
    op(qkv, good, kc, vc, bad_slots)
    with pytest.raises(ValueError, match=r"slot_mapping: expected every slot below num_blocks \* block_size = 16 "
                                         r"\(or negative: skipped\), got slot_mapping\[1\] = 16 \(reported"):
        op.check()
    # temporaries, freed before the report: the kernel's record names the first bad element
    op(qkv, good, kc, vc, torch.tensor([0, 1, 16, 17], device=DEV))
    with pytest.raises(ValueError, match=r"slot_mapping: expected every slot below num_blocks \* block_size = 16 "
                                         r"\(or negative: skipped\), got slot_mapping\[2\] = 16 \(reported"):
        op.check()
    op(qkv, torch.tensor([0, 9000, 1, -5], device=DEV), kc, vc, good)
    with pytest.raises(ValueError, match=r"got positions\[1\] = 9000 \(reported for an earlier"):
        op.check()
    with tileops.strict(), pytest.raises(ValueError, match="positions"):
        op(qkv, torch.tensor([-1, 1, 2, 3], device=DEV), kc, vc, good)
    torch.cuda.synchronize()
    assert (kfull[1:] == 7).all() and (vfull[1:] == 7).all(), "a bad slot wrote past the cache"
    op(qkv, good, kc, vc, torch.tensor([0, -1, 5, 15], device=DEV))
    op.check()  # nothing pending


def test_views_off_the_vectors(gen):
    """A qkv or cache that starts inside a 16-byte vector is a ValueError naming it (no copy can stand
    in for a cache written in place); a ``q_out`` off the vectors is written through a copy."""
    op = AttnPrologueFwdOp(2, 1, 64, VARIANTS["RoPENeoxPositionIdsFwdOp"])
    wide = torch.randn(3, 4 * 64 + 8, generator=gen).to(torch.bfloat16).to(DEV)
    kc = torch.zeros(2, 16, 1, 64, dtype=torch.bfloat16, device=DEV)
    vc = torch.zeros_like(kc)
    pos, slots = torch.arange(3, device=DEV), torch.tensor([0, 5, 9], device=DEV)
    with pytest.raises(ValueError, match="qkv: expected its data pointer and strides on a multiple of 8"):
        op(wide[:, 1:1 + 4 * 64], pos, kc, vc, slots)
    flat = torch.zeros(2 * 16 * 64 + 1, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="key_cache: expected its data pointer and strides"):
        op(wide[:, :4 * 64], pos, flat[1:].view(2, 16, 1, 64), vc, slots)
    want = op(wide[:, :4 * 64], pos, kc, vc, slots)
    out = torch.full((3 * 2 * 64 + 1,), NAN, dtype=torch.bfloat16, device=DEV)[1:].view(3, 2, 64)
    got = op(wide[:, :4 * 64], pos, kc, vc, slots, q_out=out)
    op.check()
    assert got is out and torch.equal(out, want)
