"""CUDA-only checks of the BUILTIN kernels (skipped without a GPU; run on the H200)."""

from __future__ import annotations

import pytest
import torch

from tests.references import reference
from tileops import BUILTIN
from tileops.rope import RoPEFwdOp, RoPENeoxPositionIdsFwdOp, YaRNFwdOp

pytestmark = pytest.mark.cuda


def test_accuracy_at_long_positions_cuda():
    seq = 1 << 20
    x = torch.randn(seq, 16, device="cuda")
    out = RoPEFwdOp(input_layout="1d")(x).double().cpu()
    ref = reference("RoPEFwdOp", {"input_layout": "1d"}, {"x": x.cpu()})
    mag = torch.sqrt(x[:, :8].double().cpu() ** 2 + x[:, 8:].double().cpu() ** 2).repeat(1, 2)
    ulps = (out - ref).abs() / (mag * 2.0**-23)
    assert ulps.max().item() < 8, f"{ulps.max().item():.1f} ulps"


@pytest.mark.parametrize("bad", [-1, 8192, 2**40])
def test_out_of_range_position_raises_with_index_on_gpu(bad):
    op = RoPENeoxPositionIdsFwdOp(8192, target=BUILTIN)
    x = torch.randn(37, 4, 64, device="cuda", dtype=torch.float16)
    pos = torch.randint(0, 8192, (37,), device="cuda")
    pos[21] = bad
    with pytest.raises(ValueError, match=r"position_ids\[21\]"):
        op(x, pos)
    pos[21] = 5  # the op recovers: the flag was reset
    ref = reference("RoPENeoxPositionIdsFwdOp", {"max_position": 8192}, {"x": x.cpu(), "position_ids": pos.cpu()})
    assert (op(x, pos).double().cpu() - ref).abs().max().item() < 4e-3


def test_partner_on_other_device_is_named():
    op = RoPENeoxPositionIdsFwdOp(100)
    with pytest.raises(ValueError, match="position_ids"):
        op(torch.randn(3, 2, 8, device="cuda"), torch.zeros(3, dtype=torch.int64))


def test_strided_and_offset_views_cuda():
    base = torch.randn(2, 6, 300, 128, device="cuda", dtype=torch.bfloat16)
    x = base.transpose(1, 2)  # [B, S, H, D] view of [B, H, S, D]
    op = YaRNFwdOp(input_layout="2d", scale=4.0, original_max_position=64)
    out = op(x)
    ref = reference("YaRNFwdOp", {"input_layout": "2d", "scale": 4.0, "original_max_position": 64}, {"x": x.cpu()})
    assert (out.double().cpu() - ref).abs().max().item() < 3e-2
    assert torch.equal(x, base.transpose(1, 2))


def test_every_element_written_cuda():
    from tileops.generate import compile_kernel, device_backend
    from tileops.kernels.rope import LO, RopeKernelSpec
    from tileops.launch import raw_kernel
    from tileops.rope.tables import RopeTables

    dev = torch.device("cuda")
    backend, arch = device_backend(dev)
    cases = (("neox", 80, "float16", {}), ("interleaved", 96, "bfloat16", {}), ("neox", 92, "float32", {}),
             ("neox", 128, "bfloat16", {"blocks_per_sm": 1}), ("interleaved", 64, "float16", {"tokens_per_thread": 4}))
    for pairing, d, dtype, extra in cases:
        spec = RopeKernelSpec(dtype=dtype, head_dim=d, rot=d, pairing=pairing, backend=backend, head_lanes=8,
                              **extra)
        k = raw_kernel(compile_kernel("rope", spec, backend, arch), dev)
        g = (2,) if spec.blocks_per_sm else ()  # two blocks loop over all 37 tokens
        x = torch.randn(3, 37, 5, d, device=dev).to(getattr(torch, dtype))
        out = torch.full_like(x, float("nan"))
        inv = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        t = RopeTables(inv, 1.0, LO)
        th = t.high(dev, 37)
        k(x.data_ptr(), out.data_ptr(), th.data_ptr(), t.low(dev).data_ptr(), *g, 3, 37, 5, th.shape[0])
        assert not out.isnan().any(), (pairing, d, dtype)
        ref = reference("RoPEFwdOp", {"rope_layout": pairing, "input_layout": "2d"}, {"x": x.cpu()})
        assert (out.double().cpu() - ref).abs().max().item() < 3e-2


def test_decode_many_calls_no_recompile():
    from tileops import generate

    op = RoPENeoxPositionIdsFwdOp(4096, rotary_dim=64)
    op(torch.randn(1, 8, 128, device="cuda", dtype=torch.float16), torch.zeros(1, dtype=torch.int32, device="cuda"))
    before = generate.stats.compiles
    for t in range(1, 40):
        x = torch.randn(t, 8, 128, device="cuda", dtype=torch.float16)
        pos = torch.randint(0, 4096, (t,), device="cuda", dtype=torch.int32)
        out = op(x, pos)
        ref = reference("RoPENeoxPositionIdsFwdOp", {"max_position": 4096, "rotary_dim": 64},
                        {"x": x.cpu(), "position_ids": pos.cpu()})
        assert (out.double().cpu() - ref).abs().max().item() < 4e-3
    assert generate.stats.compiles == before
