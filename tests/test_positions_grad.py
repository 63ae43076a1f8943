"""Positions for every op and gradients (issue 9), on the CPU's BUILTIN kernels and the torch target.

References are the float64 formulas of ``tests/references.py`` (and float64 autograd of them); inputs
are random draws, seeded per test (``tests/conftest.py``).
"""

from __future__ import annotations

import pytest
import torch

from tests.references import reference, reference_grad
from tileops import BUILTIN
from tileops.rope import LongRoPEFwdOp, RoPEFwdOp, RoPELlama31FwdOp, RoPENeoxPositionIdsFwdOp, YaRNFwdOp
from tileops.testing import tolerance

SEQUENCE_OPS = [
    (RoPEFwdOp, {"rope_layout": "interleaved"}),
    (RoPEFwdOp, {}),
    (RoPELlama31FwdOp, {}),
    (YaRNFwdOp, {"scale": 4.0, "original_max_position": 2048}),
    (LongRoPEFwdOp, {"max_position_embeddings": 131072}),
]
IDS = [f"{cls.__name__}{'-' + next(iter(p.values())) if 'rope_layout' in p else ''}" for cls, p in SEQUENCE_OPS]


def assert_close(got: torch.Tensor, ref: torch.Tensor, what: str = "") -> None:
    atol, rtol = tolerance(got.dtype)
    err = (got.detach().double() - ref).abs()
    bad = err > atol + rtol * ref.abs()
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off; max error {err.max().item():.3e}"


@pytest.mark.parametrize("target", [BUILTIN, "torch"])
@pytest.mark.parametrize("cls, extra", SEQUENCE_OPS, ids=IDS)
def test_positions_shared_and_per_batch(cls, extra, target, gen):
    params = {"input_layout": "2d", **extra}
    op = cls(**params, target=target)
    x = torch.randn(3, 19, 4, 64, generator=gen)
    shared = torch.randint(0, 2**24, (19,), generator=gen)
    per_batch = torch.randint(0, 2**24, (3, 19), generator=gen, dtype=torch.int32)
    for pos in (shared, per_batch, per_batch.flip(1), per_batch.t().contiguous().t(), per_batch.repeat(1, 2)[:, ::2]):
        out = op(x, position_ids=pos)
        assert_close(out, reference(cls.__name__, params, {"x": x, "position_ids": pos}), f"positions {pos.shape}")
    # None is 0 .. seq_len - 1, the same as passing them
    assert torch.equal(op(x), op(x, position_ids=torch.arange(19)))


@pytest.mark.parametrize("cls, extra", SEQUENCE_OPS, ids=IDS)
def test_positions_1d(cls, extra, gen):
    op = cls(input_layout="1d", **extra)
    x = torch.randn(37, 96, generator=gen)
    pos = torch.randint(0, 2**24, (37,), generator=gen)
    assert_close(op(x, position_ids=pos), reference(cls.__name__, extra, {"x": x, "position_ids": pos}))


def test_decode_step_uses_its_position_not_zero(gen):
    """A KV-cache decode step: one new token at position 57 must not be rotated as position 0."""
    op = RoPELlama31FwdOp(input_layout="2d")
    x = torch.randn(2, 1, 4, 128, generator=gen)
    at57 = op(x, position_ids=torch.tensor([[57], [90]]))
    assert_close(at57, reference("RoPELlama31FwdOp", {"input_layout": "2d"},
                                 {"x": x, "position_ids": torch.tensor([[57], [90]])}))
    assert not torch.allclose(at57, op(x))


def test_fp32_accuracy_does_not_depend_on_position(gen):
    """fp32 within a few ulps of float64 at positions spread over [0, 2^24), the top one included."""
    op = RoPEFwdOp(input_layout="1d")
    n = 1 << 14
    x = torch.randn(n, 16, generator=gen)
    pos = torch.randint(0, 2**24, (n,), generator=gen)
    pos[:4] = torch.tensor([0, 2**24 - 1, 2**16, 2**16 - 1])
    out = op(x, position_ids=pos).double()
    ref = reference("RoPEFwdOp", {}, {"x": x, "position_ids": pos})
    mag = torch.sqrt(x[:, :8].double() ** 2 + x[:, 8:].double() ** 2).repeat(1, 2)
    # torch's CPU randn gives an exact (0, 0) pair (x[:, j], x[:, j + 8]) about once in 128 draws of this
    # size (a zero uniform in Box-Muller); there out = ref = 0, and 0/0 would read as NaN ulps
    ulps = (out - ref).abs() / (mag.clamp_min(2.0**-126) * 2.0**-23)
    assert ulps.max().item() < 8, f"{ulps.max().item():.1f} ulps"


@pytest.mark.parametrize("target", [BUILTIN, "torch"])
@pytest.mark.parametrize("bad", [-1, 2**24, 2**40])
def test_position_out_of_range_names_index_and_value(bad, target, gen):
    op = YaRNFwdOp(input_layout="2d", target=target)
    x = torch.randn(2, 7, 3, 32, generator=gen)
    pos = torch.randint(0, 1000, (2, 7), generator=gen)
    pos[1, 4] = bad
    with pytest.raises(ValueError, match=rf"position_ids\[1, 4\] = {bad}"):
        op(x, position_ids=pos)
    pos[1, 4] = 3  # the op recovers
    assert_close(op(x, position_ids=pos), reference("YaRNFwdOp", {"input_layout": "2d"}, {"x": x, "position_ids": pos}))


def test_bad_position_arguments_are_named(gen):
    op = RoPEFwdOp(input_layout="2d")
    x = torch.randn(2, 7, 3, 32, generator=gen)
    cases = [
        (torch.zeros(7), TypeError, "dtype"),  # float positions
        (torch.arange(6), ValueError, "seq_len"),  # wrong length
        (torch.arange(14).view(2, 7)[:1].expand(3, 7), ValueError, "batch"),  # wrong batch
        (torch.arange(7).view(1, 1, 7), ValueError, "dims"),  # rank 3
        ([0, 1, 2, 3, 4, 5, 6], TypeError, "torch.Tensor"),
    ]
    for pos, kind, word in cases:
        with pytest.raises(kind, match="position_ids") as info:
            op(x, position_ids=pos)
        assert word in str(info.value)
    with pytest.raises(TypeError):
        op(x, torch.arange(7))  # keyword-only
    assert torch.equal(x, x.clone())


# ------------------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("target", [BUILTIN, "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cls, extra", SEQUENCE_OPS, ids=IDS)
def test_gradient_matches_float64_autograd(cls, extra, dtype, target, gen):
    params = {"input_layout": "2d", **extra}
    op = cls(**params, target=target)
    x = torch.randn(2, 13, 3, 64, generator=gen).to(dtype).requires_grad_(True)
    pos = torch.randint(0, 2**24, (2, 13), generator=gen)
    out = op(x, position_ids=pos)
    assert out.grad_fn is not None
    g = torch.randn(out.shape, generator=gen).to(dtype)
    out.backward(g)
    assert x.grad is not None and x.grad.dtype == dtype
    want = reference_grad(cls.__name__, params, {"x": x.detach(), "position_ids": pos}, g)
    assert_close(x.grad, want, "grad")


def test_gradient_of_position_ids_op_and_partial_rotary(gen):
    op = RoPENeoxPositionIdsFwdOp(5000, rotary_dim=32)
    x = torch.randn(23, 5, 80, generator=gen, requires_grad=True)
    pos = torch.randint(0, 5000, (23,), generator=gen)
    g = torch.randn(23, 5, 80, generator=gen)
    op(x, pos).backward(g)
    params = {"max_position": 5000, "rotary_dim": 32}
    assert_close(x.grad, reference_grad("RoPENeoxPositionIdsFwdOp", params, {"x": x.detach(), "position_ids": pos}, g))
    assert torch.equal(x.grad[..., 32:], g[..., 32:]), "the copied columns pass their gradient through"


def test_gradient_through_a_strided_view_and_noncontiguous_grad(gen):
    """q.transpose(1, 2) in, a gradient made by expand/transpose back: still exact."""
    op = RoPEFwdOp(input_layout="2d")
    q = torch.randn(2, 4, 9, 32, generator=gen, requires_grad=True)  # HF [B, H, S, D]
    out = op(q.transpose(1, 2))
    w = torch.randn(32, generator=gen)
    (out * w).sum().backward()  # grad is w broadcast: stride 0 on every dim but the last
    want = reference_grad("RoPEFwdOp", {"input_layout": "2d"}, {"x": q.detach().transpose(1, 2)},
                          w.expand(2, 9, 4, 32))
    assert_close(q.grad.transpose(1, 2), want)


def test_no_grad_and_detached_inputs_give_plain_tensors(gen):
    op = RoPEFwdOp(input_layout="2d")
    x = torch.randn(1, 5, 2, 16, generator=gen, requires_grad=True)
    with torch.no_grad():
        assert op(x).grad_fn is None
    assert op(x.detach()).grad_fn is None
    assert op(x).requires_grad


def test_double_backward_raises_clearly(gen):
    op = RoPEFwdOp(input_layout="2d")
    x = torch.randn(1, 5, 2, 16, generator=gen, requires_grad=True)
    (gx,) = torch.autograd.grad(op(x).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        gx.sum().backward()


def test_training_step_reaches_the_weights(gen):
    """q = x W; rope(q); loss; the gradient reaches W (it stayed None before issue 9)."""
    w = torch.nn.Linear(16, 2 * 16, bias=False)
    op = RoPEFwdOp(input_layout="2d")
    x = torch.randn(1, 7, 16, generator=gen)
    q = w(x).view(1, 7, 2, 16)
    op(q, position_ids=torch.arange(3, 10)).pow(2).mean().backward()
    assert w.weight.grad is not None and w.weight.grad.abs().sum() > 0
