"""q and k in one launch (``key=``), ``out=``/``key_out=``, in place, and strided views used where
they lie, on the CPU's BUILTIN kernels and the torch target, against the float64 references."""

from __future__ import annotations

import pytest
import torch

from tests.references import reference, reference_grad
from tileops import BUILTIN
from tileops.rope import RoPEFwdOp, RoPENeoxPositionIdsFwdOp, YaRNFwdOp
from tileops.testing import tolerance

TARGETS = [BUILTIN, "torch"]


def assert_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    atol, rtol = tolerance(got.dtype)
    err = (got.detach().double() - ref).abs()
    assert bool((err <= atol + rtol * ref.abs()).all()), f"max error {err.max().item():.3e}"


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_query_and_key_in_one_call_hf_layout(dtype, target, gen):
    """HF's q [B, Hq, S, D] and k [B, Hkv, S, D] passed as transposed views, GQA head counts."""
    params = {"input_layout": "2d", "scale": 4.0}
    op = YaRNFwdOp(**params, target=target)
    q = torch.randn(2, 8, 11, 64, generator=gen).to(dtype)
    k = torch.randn(2, 2, 11, 64, generator=gen).to(dtype)
    q0, k0 = q.clone(), k.clone()
    pos = torch.randint(0, 2**24, (2, 11), generator=gen)
    qo, ko = op(q.transpose(1, 2), position_ids=pos, key=k.transpose(1, 2))
    assert qo.shape == (2, 11, 8, 64) and ko.shape == (2, 11, 2, 64)
    assert torch.equal(q, q0) and torch.equal(k, k0), "inputs were modified"
    assert_close(qo, reference("YaRNFwdOp", params, {"x": q.transpose(1, 2), "position_ids": pos}))
    assert_close(ko, reference("YaRNFwdOp", params, {"x": k.transpose(1, 2), "position_ids": pos}))


@pytest.mark.parametrize("target", TARGETS)
def test_in_place_on_a_fused_qkv_buffer(target, gen):
    """vLLM's layout: q and k are column blocks of one [tokens, (Hq + 2 Hkv) * D] buffer. out=q,
    key_out=k rotates them where they lie: the base buffer changes, v does not, no copy is made."""
    T, Hq, Hkv, D = 37, 6, 2, 64
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=gen)
    before = qkv.clone()
    q = qkv[:, : Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D : (Hq + Hkv) * D].view(T, Hkv, D)
    pos = torch.randint(0, 8192, (T,), generator=gen)
    op = RoPENeoxPositionIdsFwdOp(8192, rotary_dim=32, target=target)
    qo, ko = op(q, pos, key=k, out=q, key_out=k)
    assert qo is q and ko is k
    params = {"max_position": 8192, "rotary_dim": 32}
    assert_close(qkv[:, : Hq * D].view(T, Hq, D),
                 reference("RoPENeoxPositionIdsFwdOp", params, {"x": before[:, : Hq * D].view(T, Hq, D), "position_ids": pos}))
    assert_close(qkv[:, Hq * D : (Hq + Hkv) * D].view(T, Hkv, D),
                 reference("RoPENeoxPositionIdsFwdOp", params,
                           {"x": before[:, Hq * D : (Hq + Hkv) * D].view(T, Hkv, D), "position_ids": pos}))
    assert torch.equal(qkv[:, (Hq + Hkv) * D :], before[:, (Hq + Hkv) * D :]), "v was touched"


@pytest.mark.parametrize("target", TARGETS)
def test_out_and_in_place_1d_and_2d(target, gen):
    for layout, shape in (("1d", (29, 96)), ("2d", (2, 29, 3, 96))):
        op = RoPEFwdOp(rope_layout="interleaved", input_layout=layout, target=target)
        params = {"rope_layout": "interleaved", "input_layout": layout}
        x = torch.randn(shape, generator=gen)
        ref = reference("RoPEFwdOp", params, {"x": x})
        out = torch.full_like(x, float("nan"))
        assert op(x, out=out) is out
        assert_close(out, ref)
        y = x.clone()
        assert op(y, out=y) is y  # in place
        assert_close(y, ref)


def test_out_through_a_strided_view_and_a_misaligned_one(gen):
    """out= a transposed view is written where it lies; out= one element off a 16-byte boundary
    takes the documented fallback (a dense buffer, copied in) and is still right."""
    op = RoPEFwdOp(input_layout="2d")
    x = torch.randn(2, 9, 4, 32, generator=gen)
    ref = reference("RoPEFwdOp", {"input_layout": "2d"}, {"x": x})
    hf = torch.full((2, 4, 9, 32), float("nan"))
    assert op(x, out=hf.transpose(1, 2)) is not None
    assert_close(hf.transpose(1, 2), ref)
    flat = torch.full((1 + x.numel(),), float("nan"))
    odd = flat[1:].view(x.shape)
    op(x, out=odd)
    assert_close(odd, ref)
    assert flat[0].isnan(), "the fallback wrote outside out"


def test_bad_out_and_key_are_named(gen):
    op = RoPEFwdOp(input_layout="2d")
    x = torch.randn(2, 5, 4, 32, generator=gen)
    k = torch.randn(2, 5, 1, 32, generator=gen)
    bad = [
        (dict(out=torch.empty(2, 5, 4, 16)), ValueError, "out: expected shape"),
        (dict(out=torch.empty(2, 5, 4, 32, dtype=torch.float64)), TypeError, "out: expected dtype"),
        (dict(out=[1.0]), TypeError, "out: expected a torch.Tensor"),
        (dict(key_out=torch.empty_like(k)), ValueError, "key_out: given without key"),
        (dict(key=k.double()), TypeError, "key: expected dtype"),
        (dict(key=k.half()), TypeError, r"key: expected dtype float32 \(that of x\)"),
        (dict(key=torch.randn(2, 6, 1, 32)), ValueError, "key: expected seq_len=5"),
        (dict(key=torch.randn(2, 5, 1, 16)), ValueError, "key: expected head_dim=32"),
        (dict(key=k, out=k.expand(2, 5, 4, 32)), ValueError, "out: expected a tensor whose elements each have "
                                                              r"their own memory.*strides \[160, 32, 0, 1\]"),
        (dict(out=x[:, :, [1, 0, 2, 3]].transpose(0, 0)), None, None),  # a copy: fine
    ]
    for kwargs, kind, match in bad:
        if kind is None:
            op(x, **kwargs)
            continue
        with pytest.raises(kind, match=match):
            op(x, **kwargs)
    z = torch.randn(2, 5, 5, 32, generator=gen)
    with pytest.raises(ValueError, match="out: overlaps x"):
        op(z[:, :, :4], out=z[:, :, 1:])  # shifted by one head: would read rows already written


def test_key_gradients_in_one_backward(gen):
    op = RoPEFwdOp(input_layout="2d")
    x = torch.randn(2, 7, 4, 32, generator=gen, requires_grad=True)
    k = torch.randn(2, 7, 1, 32, generator=gen, requires_grad=True)
    pos = torch.randint(0, 5000, (7,), generator=gen)
    qo, ko = op(x, position_ids=pos, key=k)
    gq, gk = torch.randn_like(qo), torch.randn_like(ko)
    torch.autograd.backward((qo, ko), (gq, gk))
    params = {"input_layout": "2d"}
    assert_close(x.grad, reference_grad("RoPEFwdOp", params, {"x": x.detach(), "position_ids": pos}, gq))
    assert_close(k.grad, reference_grad("RoPEFwdOp", params, {"x": k.detach(), "position_ids": pos}, gk))
    with pytest.raises(RuntimeError, match="out= cannot be used"):
        op(x, out=torch.empty(2, 7, 4, 32))


@pytest.mark.parametrize("layout", ["1d", "2d", "ids"])
def test_key_in_place_on_repeated_calls_every_layout(layout, gen):
    """The second call of a signature takes the launch plan: the key's heads as the kernel sees them
    (one in 1d, where the key is [seq, D]). The fuzzer found the plan taking seq_len for them, which
    rotated a 1d key in place seq_len times."""
    shapes = {"1d": ((13, 32), (13, 32)), "2d": ((2, 13, 4, 32), (2, 13, 2, 32)), "ids": ((13, 4, 32), (13, 2, 32))}
    xs, ks = shapes[layout]
    if layout == "ids":
        op, params = RoPENeoxPositionIdsFwdOp(4096, target=BUILTIN), {"max_position": 4096}
    else:
        op, params = RoPEFwdOp(input_layout=layout, target=BUILTIN), {"input_layout": layout}
    for _ in range(3):
        x, k = torch.randn(xs, generator=gen), torch.randn(ks, generator=gen)
        pos = torch.randint(0, 4096, (13,), generator=gen)
        want_x = reference(op.name, params, {"x": x, "position_ids": pos})
        want_k = reference(op.name, params, {"x": k, "position_ids": pos})
        op(x, position_ids=pos, key=k, out=x, key_out=k)
        assert_close(x, want_x)
        assert_close(k, want_k)
