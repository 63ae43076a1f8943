"""What serves a CPU call, and that every way it may be served is right.

``target=None`` on a CPU tensor is BUILTIN's C kernel; an fp16 call of at least
``CPU_WIDEN_FP16_MIN`` elements (x and key together) runs the fp32 kernel on fp32 copies and rounds
back (``RoPEKernels.widens``). Both ways are compared with the float64 references
(``tests/references.py``) and with each other bit for bit, forward and backward, with positions, a
key, ``out=`` and in place. No timing is asserted here: the numbers are ``benchmarks/cpu.py``'s.
"""

from __future__ import annotations

import pytest
import torch

import tileops.rope.builtin as builtin
from tests.references import inv_freq_and_amplitude, reference, rotate
from tileops import BUILTIN
from tileops.compile.build import C_FLAGS, c_flags
from tileops.rope import RoPEFwdOp
from tileops.testing import tolerance

PARAMS = {"rope_layout": "neox", "input_layout": "2d"}


def _impl(op, **tensors):
    return op._impl_for(op._check_call(tensors))


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    atol, rtol = tolerance(out.dtype)
    got = out.double()
    assert torch.isfinite(got).all(), "non-finite output"
    err = (got - ref).abs()
    assert (err <= atol + rtol * ref.abs()).all(), f"max error {err.max().item():.3e}"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("dtype, shape, key_heads, widened", [
    (torch.float16, (1, 1, 32, 128), 0, False),  # decode: 4096 elements, the fp16 kernel itself
    (torch.float16, (2, 32, 32, 128), 0, True),  # 262144 elements
    (torch.float16, (1, 8, 8, 128), 8, True),  # 8192 + 8192 with the key: the threshold exactly
    (torch.float16, (1, 8, 8, 128), 0, False),  # 8192 alone: below it
    (torch.bfloat16, (2, 32, 32, 128), 0, False),  # bf16 converts by bit shifts in the kernel
    (torch.float32, (2, 32, 32, 128), 0, False),
])
def test_rule_picks(dtype, shape, key_heads, widened):
    op = RoPEFwdOp(**PARAMS)
    x = torch.zeros(shape, dtype=dtype)
    key = torch.zeros(*shape[:2], key_heads, shape[3], dtype=dtype) if key_heads else None
    impl = _impl(op, x=x, **({"key": key} if key is not None else {}))
    assert isinstance(impl, builtin.RoPEKernels)
    assert impl.widens(x, key) is widened
    assert op.serving_target == BUILTIN  # what target=None resolved to, whichever way the kernel runs


def test_compile_flags():
    """The C kernels are optimized, and contract nothing into FMA (the bits of the -O0 build)."""
    assert "-O3" in C_FLAGS and "-ffp-contract=off" in C_FLAGS
    assert set(C_FLAGS) <= set(c_flags())
    assert not any(f.startswith(("-march", "-ffast-math", "-mfma")) for f in c_flags())


@pytest.fixture(params=["direct", "widened"])
def way(request, monkeypatch):
    """Serve fp16 calls of every size by the fp16 kernel (``direct``) or through fp32 (``widened``)."""
    monkeypatch.setattr(builtin, "CPU_WIDEN_FP16_MIN", 1 << 62 if request.param == "direct" else 0)
    return request.param


def test_fp16_both_ways_match_reference(way, gen):
    op = RoPEFwdOp(**PARAMS)
    x = torch.randn(2, 37, 5, 96, generator=gen).half()
    key = torch.randn(2, 37, 2, 96, generator=gen).half()
    pos = torch.randint(0, 300_000, (2, 37), generator=gen)
    before = x.clone(), key.clone()
    assert _impl(op, x=x, position_ids=pos, key=key).widens(x, key) is (way == "widened")
    out, kout = op(x, position_ids=pos, key=key)
    assert same_bits(x, before[0]) and same_bits(key, before[1]), "an input was modified"
    assert_close(out, reference("RoPEFwdOp", PARAMS, {"x": x, "position_ids": pos}))
    assert_close(kout, reference("RoPEFwdOp", PARAMS, {"x": key, "position_ids": pos}))

    given = torch.full_like(x, float("nan"))
    assert op(x, position_ids=pos, out=given) is given
    assert same_bits(given, out)
    inplace = x.clone()
    op(inplace, position_ids=pos, out=inplace)
    assert same_bits(inplace, out)
    strided = torch.randn(2, 5, 37, 96, generator=gen).half().transpose(1, 2)  # HF's [B, H, S, D] seen as [B, S, H, D]
    assert_close(op(strided), reference("RoPEFwdOp", PARAMS, {"x": strided}))


def test_fp16_backward_both_ways(way, gen):
    op = RoPEFwdOp(**PARAMS)
    x = torch.randn(3, 64, 4, 128, generator=gen).half().requires_grad_(True)
    g = torch.randn(3, 64, 4, 128, generator=gen).half()
    (dx,) = torch.autograd.grad(op(x), x, g)
    # the gradient of x -> R(theta) x is R(-theta) g: g rotated by the negated positions, in float64
    inv, amp = inv_freq_and_amplitude("RoPEFwdOp", PARAMS, 128)
    assert_close(dx, rotate(g.double(), -torch.arange(64.0).view(1, -1, 1), inv, amp, "neox"))


def test_widened_is_bit_identical(monkeypatch, gen):
    """The fp32 detour rounds exactly where the fp16 kernel rounds: the same bits, both directions."""
    x = torch.randn(2, 64, 8, 128, generator=gen).half()
    key = torch.randn(2, 64, 2, 128, generator=gen).half()
    pos = torch.randint(0, 2**24, (2, 64), generator=gen)
    g = torch.randn_like(x)
    results = []
    for threshold in (1 << 62, 0):
        monkeypatch.setattr(builtin, "CPU_WIDEN_FP16_MIN", threshold)
        op = RoPEFwdOp(**PARAMS, target=BUILTIN)
        xr = x.clone().requires_grad_(True)
        out, kout = op(xr, position_ids=pos, key=key)
        (dx,) = torch.autograd.grad(out, xr, g)
        results.append((out, kout, dx))
    for direct, widened in zip(*results):
        assert same_bits(direct, widened)
