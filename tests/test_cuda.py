"""CUDA-only checks of the BUILTIN kernels (skipped without a GPU; run on the H200)."""

from __future__ import annotations

import pytest
import torch

from tests.references import reference, reference_grad
import tileops
from tileops import BUILTIN
from tileops.testing import tolerance
from tileops.rope import LongRoPEFwdOp, RoPEFwdOp, RoPELlama31FwdOp, RoPENeoxPositionIdsFwdOp, YaRNFwdOp

pytestmark = pytest.mark.cuda


def test_accuracy_at_long_positions_cuda():
    seq = 1 << 20
    x = torch.randn(seq, 16, device="cuda")
    out = RoPEFwdOp(input_layout="1d")(x).double().cpu()
    ref = reference("RoPEFwdOp", {"input_layout": "1d"}, {"x": x.cpu()})
    mag = torch.sqrt(x[:, :8].double().cpu() ** 2 + x[:, 8:].double().cpu() ** 2).repeat(1, 2)
    ulps = (out - ref).abs() / (mag.clamp_min(2.0**-126) * 2.0**-23)  # an exact (0, 0) pair: 0/0 otherwise
    assert ulps.max().item() < 8, f"{ulps.max().item():.1f} ulps"


@pytest.mark.parametrize("bad", [-1, 8192, 2**40])
def test_out_of_range_position_raises_with_index_on_gpu(bad):
    op = RoPENeoxPositionIdsFwdOp(8192, target=BUILTIN)
    x = torch.randn(37, 4, 64, device="cuda", dtype=torch.float16)
    pos = torch.randint(0, 8192, (37,), device="cuda")
    pos[21] = bad
    op(x, pos)  # no host sync: reported by check() (or the next call)
    with pytest.raises(ValueError, match=r"position_ids\[21\]"):
        op.check()
    with tileops.strict(), pytest.raises(ValueError, match=r"position_ids\[21\]"):
        op(x, pos)  # strict mode: at the call
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


#: the rope schedules :func:`test_every_element_written_cuda` runs: (pairing, head_dim, dtype, spec fields)
EVERY_ELEMENT_CASES = (("neox", 80, "float16", {}), ("interleaved", 96, "bfloat16", {}), ("neox", 92, "float32", {}),
                       ("interleaved", 64, "float16", {"tokens_per_thread": 4}))


def _every_element_spec(pairing: str, d: int, dtype: str, extra: dict, backend: str):
    from tileops.kernels.rope import RoPEKernelSpec

    return RoPEKernelSpec(dtype=dtype, head_dim=d, rot=d, pairing=pairing, backend=backend, head_lanes=8, **extra)


def every_element_jobs(arch: str) -> list[tuple]:
    """The kernel jobs of :func:`test_every_element_written_cuda` (``benchmarks.device_cache`` builds them)."""
    return [("rope", _every_element_spec(*case, "cuda"), "cuda", arch) for case in EVERY_ELEMENT_CASES]


def test_every_element_written_cuda():
    """Each schedule, run straight into NaN-filled outputs for x and a key (GQA head counts). The kernels
    come through the index as an op's do (the lean build where it serves them, ~1 s each), not TileLang's
    nvcc build, which took this test 275 s on the H200 beside the suite's other workers."""
    from tileops.compile.build import device_backend, load_kernel
    from tileops.rope.tables import RoPETables

    dev = torch.device("cuda")
    backend, arch = device_backend(dev)
    for pairing, d, dtype, extra in EVERY_ELEMENT_CASES:
        spec = _every_element_spec(pairing, d, dtype, extra, backend)
        k = load_kernel("rope", spec, backend, arch, dev, spec.args)
        x = torch.randn(3, 37, 5, d, device=dev).to(getattr(torch, dtype))
        key = torch.randn(3, 37, 2, d, device=dev).to(getattr(torch, dtype))
        out, kout = torch.full_like(x, float("nan")), torch.full_like(key, float("nan"))
        inv = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        td = RoPETables(inv, 1.0).on(dev)
        u = spec.stride_unit
        st = [[v // u for v in t.stride()[:3]] for t in (x, out, key, kout)]
        k(*k.bind(**dict.fromkeys(k.arg_names, 0) | dict(  # no positions: P to tag unread, 0
            X=x.data_ptr(), Y=out.data_ptr(), K=key.data_ptr(), KY=kout.data_ptr(), TD=td.data_ptr(),
            B=3, S=37, H=5, HK=2, xsb=st[0][0], xss=st[0][1], xsh=st[0][2], ysb=st[1][0], yss=st[1][1],
            ysh=st[1][2], ksb=st[2][0], kss=st[2][1], ksh=st[2][2], kysb=st[3][0], kyss=st[3][1],
            kysh=st[3][2], NX=0, NY=0, NK=0, NKY=0)))
        assert not out.isnan().any() and not kout.isnan().any(), (pairing, d, dtype)
        for got, src in ((out, x), (kout, key)):
            ref = reference("RoPEFwdOp", {"rope_layout": pairing, "input_layout": "2d"}, {"x": src.cpu()})
            assert (got.double().cpu() - ref).abs().max().item() < 3e-2


def test_positions_up_to_2_24_fp32_cuda():
    n = 1 << 16
    x = torch.randn(n, 16, device="cuda")
    pos = torch.randint(0, 2**24, (n,), device="cuda")
    pos[:3] = torch.tensor([0, 2**24 - 1, 2**16], device="cuda")
    out = RoPEFwdOp(input_layout="1d")(x, position_ids=pos).double().cpu()
    ref = reference("RoPEFwdOp", {"input_layout": "1d"}, {"x": x.cpu(), "position_ids": pos.cpu()})
    mag = torch.sqrt(x[:, :8].double().cpu() ** 2 + x[:, 8:].double().cpu() ** 2).repeat(1, 2)
    ulps = (out - ref).abs() / (mag.clamp_min(2.0**-126) * 2.0**-23)  # an exact (0, 0) pair: 0/0 otherwise
    assert ulps.max().item() < 8, f"{ulps.max().item():.1f} ulps"


@pytest.mark.parametrize("cls, params", [(RoPELlama31FwdOp, {}), (YaRNFwdOp, {"scale": 4.0}),
                                         (LongRoPEFwdOp, {"max_position_embeddings": 131072}),
                                         (RoPEFwdOp, {"rope_layout": "interleaved"})])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_positions_and_gradients_cuda(cls, params, dtype):
    params = {"input_layout": "2d", **params}
    op = cls(**params)
    q = torch.randn(2, 6, 33, 128, device="cuda", dtype=dtype, requires_grad=True)  # HF [B, H, S, D]
    pos = torch.randint(0, 2**24, (2, 33), device="cuda")
    out = op(q.transpose(1, 2), position_ids=pos)
    assert out.grad_fn is not None
    x = q.detach().transpose(1, 2).cpu()
    ref = reference(cls.__name__, params, {"x": x, "position_ids": pos.cpu()})
    tol = 2e-5 if dtype == torch.float32 else 1.6e-2
    assert ((out.detach().double().cpu() - ref).abs() <= tol + tol * ref.abs()).all()
    g = torch.randn(out.shape, device="cuda", dtype=dtype)
    out.backward(g)
    want = reference_grad(cls.__name__, params, {"x": x, "position_ids": pos.cpu()}, g.cpu())
    got = q.grad.transpose(1, 2).double().cpu()
    assert ((got - want).abs() <= tol + tol * want.abs()).all(), (got - want).abs().max().item()


@pytest.mark.parametrize("bad", [-1, 2**24])
def test_sequence_op_position_out_of_range_cuda(bad):
    op = RoPEFwdOp(input_layout="2d")
    x = torch.randn(2, 9, 3, 64, device="cuda", dtype=torch.float16)
    pos = torch.randint(0, 100, (2, 9), device="cuda")
    pos[1, 7] = bad
    op(x, position_ids=pos)
    with pytest.raises(ValueError, match=rf"position_ids\[1, 7\] = {bad}"):
        op.check()


@pytest.mark.parametrize("case", ["ids", "2d", "int64-beyond"])
def test_a_temporary_position_tensor_is_named_from_the_kernels_record(case):
    """``op(x, position_ids=pos.to("cuda"))``: the positions are freed before the deferred report, so
    it names the first bad element from the kernel's record (kernels/report.py), at its index in the
    caller's tensor, as a report of a tensor the caller keeps does; a later bad element is not the
    one named, and a value past int32 is named as saturated."""
    if case == "ids":
        op, x = RoPENeoxPositionIdsFwdOp(8192), torch.randn(100, 4, 64, device="cuda", dtype=torch.float16)
        pos = torch.arange(100)
        pos[64], pos[80], want = 16777216, -1, r"position_ids\[64\] = 16777216 "
    else:
        op, x = RoPEFwdOp(input_layout="2d"), torch.randn(2, 100, 2, 64, device="cuda", dtype=torch.float16)
        pos = torch.arange(200).view(2, 100) % 100
        if case == "2d":
            pos[1, 64], pos[1, 90], want = 2**24, -3, r"position_ids\[1, 64\] = 16777216 "
        else:
            pos[0, 5], pos[1, 0], want = 2**40, -1, r"position_ids\[0, 5\] = 2147483647 or more "
    op(x, position_ids=pos.to("cuda"))  # the device copy is gone when the call returns
    with pytest.raises(ValueError, match=want + r"\(reported for an earlier call"):
        op.check()
    op(x, position_ids=torch.zeros_like(pos).to("cuda"))
    op.check()  # the entry's record was cleared: nothing left to report


def test_decode_many_calls_no_recompile():
    from tileops.compile import build

    op = RoPENeoxPositionIdsFwdOp(4096, rotary_dim=64)
    op(torch.randn(1, 8, 128, device="cuda", dtype=torch.float16), torch.zeros(1, dtype=torch.int32, device="cuda"))
    before = build.stats.kernels
    for t in range(1, 40):
        x = torch.randn(t, 8, 128, device="cuda", dtype=torch.float16)
        pos = torch.randint(0, 4096, (t,), device="cuda", dtype=torch.int32)
        out = op(x, pos)
        ref = reference("RoPENeoxPositionIdsFwdOp", {"max_position": 4096, "rotary_dim": 64},
                        {"x": x.cpu(), "position_ids": pos.cpu()})
        assert (out.double().cpu() - ref).abs().max().item() < 4e-3
    assert build.stats.kernels == before


def test_wide_heads_and_large_batches_run(gen):
    """Shapes that once exceeded a CUDA launch's limits: a vector width of 1 on a wide head (more
    than 1024 threads a block at 8 head lanes) and a 2d batch above the grid's 65535 rows. Each runs
    and matches the float64 reference, into NaN-filled outputs so an unwritten element shows."""
    cases = [
        (RoPEFwdOp(input_layout="2d"), {"input_layout": "2d"}, torch.randn(2, 3, 9, 258, generator=gen).half(), None),
        (RoPENeoxPositionIdsFwdOp(64, rotary_dim=98), {"max_position": 64, "rotary_dim": 98},
         torch.randn(5, 11, 256, generator=gen).half(), torch.randint(0, 64, (5,), generator=gen)),
        (RoPEFwdOp(input_layout="2d"), {"input_layout": "2d"}, torch.randn(1, 3, 10, 1022, generator=gen), None),
        (RoPEFwdOp(input_layout="2d"), {"input_layout": "2d"}, torch.randn(70000, 2, 3, 16, generator=gen), None),
    ]
    for op, params, x, pos in cases:
        xc = x.cuda()
        before = xc.clone()
        out = torch.full_like(xc, float("nan"))
        kw = {} if pos is None else {"position_ids": pos.cuda()}
        op(xc, out=out, **kw)
        op.check()
        assert torch.equal(xc, before)
        ref = reference(op.name, params, {"x": x, **({} if pos is None else {"position_ids": pos})})
        atol, rtol = tolerance(x.dtype)
        err = (out.double().cpu() - ref).abs()
        assert torch.isfinite(out).all(), (op.name, list(x.shape))
        assert not (err > atol + rtol * ref.abs()).any(), (op.name, list(x.shape), err.max().item())
