"""The norm family's ops (``tileops.norm``) on the CPU: Hugging Face's roundings, views used where they
lie, in place, the fused residual, mixed dtypes, gradients, and what the runtime and warmup see.

The kernels themselves are tested in ``tests/test_norm_kernels.py``; the generated tests, the fuzzer
and the bad-input tests run the ops from their manifests. Here: what the op layer adds. References
are float64 math and the HF modules as they compute (``tests/norm_references.py``, no code shared
with the kernels); outputs are NaN-filled where a test gives them; inputs are random draws from the
test's seed (``gen``). The CUDA variants are in ``tests/test_norm_cuda.py``.

Kernels are compiled on first use (about 2.5 s each on the C backend): the tests share specs with
the generated tests where they can (bf16 hidden 4096, bf16 128 per head, fp32 64).
"""

from __future__ import annotations

import array

import pytest
import torch

from tests import norm_references as ref
from tests.test_norm_kernels import assert_close, assert_hf_bits
from tileops.norm import LayerNormFwdOp, RMSNormFwdOp
from tileops.norm.builtin import BACKWARD
from tileops.testing import tolerance

NAN = float("nan")


def _native(op) -> bool:
    return op._native_run is not None


def _served(op, call) -> int:
    """How many of three repeated calls the runtime served from a binding (no check, no copy), after
    one that makes the binding."""
    if not _native(op):
        pytest.skip("no native runtime here")
    call()
    before = op._runtime.stats()["hits"]
    for _ in range(3):
        call()
    return op._runtime.stats()["hits"] - before


# ----------------------------------------------------------------------- Hugging Face's roundings
@pytest.mark.parametrize("style,dtype,hidden,params", [
    ("llama", torch.bfloat16, 4096, {}),  # LlamaRMSNorm, Qwen2/3, Mistral, Phi-3
    ("gemma", torch.float16, 184, {"offset": 1.0}),  # Gemma 1/2/3: 1 + weight, fp32, rounded once
    ("olmo2", torch.bfloat16, 184, {"rounding": "fp32"}),  # Olmo2: (weight * n).to(dtype)
])
def test_rms_norm_rounds_as_the_hf_modules(style, dtype, hidden, params, gen):
    """The op's output has the bits HF's module computes on >= 99.9% of elements (elsewhere within
    one ulp, two for Llama's double rounding: ``assert_hf_bits``), written out in torch and, where
    transformers is installed, the module itself; ``rounding`` None picks llama without an offset
    and fp32 with one. (The dtypes and sizes are the generated cases': their kernels are compiled.)"""
    op = RMSNormFwdOp(eps=1e-6, **params)
    w = (torch.randn(hidden, generator=gen) * 0.5 + (0.0 if style == "gemma" else 1.0)).to(dtype)
    module = ref.hf_module(style, hidden, 1e-6)
    if module is not None:
        with torch.no_grad():
            module.weight.copy_(w.float())
        module = module.to(dtype)
    rounds = 2 if style == "llama" else 1
    for rows in ((1,), (37,), (3, 41)):
        x = (torch.randn(*rows, hidden, generator=gen) * 2).to(dtype)
        got = op(x, w)
        assert_hf_bits(got, ref.hf_rms_norm(x, w, 1e-6, style), f"{style} {rows}", rounds=rounds)
        if module is not None:
            with torch.no_grad():
                assert_hf_bits(got, module(x), f"{style} {rows} module", rounds=rounds)


@pytest.mark.parametrize("out_dtype", [None, "float32"])
def test_an_fp32_weight_with_a_bf16_x(out_dtype, gen):
    """Mixed precision: HF's LlamaRMSNorm with an fp32 weight and a bf16 x returns fp32 (torch promotes
    the product); ``out_dtype="float32"`` returns that, None rounds it to bf16 once more. A given
    ``out`` must be of that dtype."""
    op = RMSNormFwdOp(out_dtype=out_dtype)
    w = torch.randn(4096, generator=gen) * 0.3 + 1
    x = torch.randn(3, 5, 4096, generator=gen).to(torch.bfloat16)
    want = ref.hf_rms_norm(x, w, 1e-6, "llama")
    assert want.dtype == torch.float32
    y = op(x, w)
    if out_dtype is None:
        assert_hf_bits(y, want.to(torch.bfloat16), rounds=2)
    else:
        assert y.dtype == torch.float32 and (y == want).double().mean().item() >= 0.999
        # elsewhere the normalised value rounded to the neighbouring bf16: 2^-7 relative at most
        assert_close(y, want.double(), rtol=2.0**-7, atol=0)
    out = torch.full_like(x, NAN, dtype=y.dtype)
    assert op(x, w, out=out) is out and torch.equal(out, y)
    wrong = torch.bfloat16 if out_dtype else torch.float32
    with pytest.raises(TypeError, match=r"RMSNormFwdOp: out: expected dtype torch\.\w+ \(that of "):
        op(x, w, out=torch.empty_like(x, dtype=wrong))
    with pytest.raises(ValueError, match=r"RMSNormFwdOp: weight: expected weight in x's dtype or float32"):
        op(x, w.half())


def test_layer_norm_matches_torch(gen):
    """LayerNorm in fp16 (weight and bias, neither, one of them) against
    ``torch.nn.functional.layer_norm`` on the same values in float64: fp32 arithmetic rounded once,
    so within one fp16 ulp, or, where the result is far below the terms it came from, within the
    fp32 error of those terms plus half an ulp. The terms: ``x - mean`` (both about |x|: an element
    near the mean keeps the absolute error of the fp32 mean, 2^-24 |mean|), then ``n * weight`` and
    the bias, which may cancel it; a few 2^-24 of ``|x| / std * |weight| + |bias|``."""
    op = LayerNormFwdOp(eps=1e-5)
    x = (torch.randn(423, 184, generator=gen) * 3 + 5).half()  # a mean far from 0
    w, b = torch.randn(184, generator=gen).half(), torch.randn(184, generator=gen).half()
    xd = x.double()
    std = (xd.var(-1, unbiased=False, keepdim=True) + 1e-5).sqrt()
    for weight, bias in ((w, b), (None, None), (w, None), (None, b)):
        f64 = [None if t is None else t.double() for t in (weight, bias)]
        want = torch.nn.functional.layer_norm(xd, (184,), *f64, 1e-5)
        terms = xd.abs() / std * (1 if weight is None else f64[0].abs()) + (0 if bias is None else f64[1].abs())
        got = op(x, weight, bias)
        assert got.dtype == torch.float16
        near = (got.double() - want).abs() <= terms * 2.0**-22 + want.abs() * 2.0**-11
        far = (ref.ulps_apart(got, want.half()) > 1) & ~near
        assert not far.any(), f"{int(far.sum())} elements off (weight {weight is not None}, bias {bias is not None})"


def test_offset_must_survive_the_kernels_constant():
    """``offset`` is compiled in: a value not exact in fp32 and in 7 digits is refused at
    construction, naming it; exact ones are taken."""
    for good in (0.0, 1.0, 0.5, -2.0):
        assert RMSNormFwdOp(offset=good).params["offset"] == good
    for bad in (0.1, 1 / 3, 1.0000001):
        with pytest.raises(ValueError, match=r"RMSNormFwdOp: offset: expected a value exact in fp32"):
            RMSNormFwdOp(offset=bad)


# ------------------------------------------------------------------------------ views and in place
def test_per_head_norm_of_fused_qkv_slices_in_place_without_copies(gen):
    """Qwen3's q_norm and k_norm on the q and k slices of a fused qkv buffer, ``[tokens, heads,
    head_dim]`` views whose token stride is the whole row: normalised in place (``out=q``), v and the
    other slice untouched. The runtime serves repeated calls from a binding, which it makes only for
    views the kernel addresses where they lie (no copy)."""
    T, HQ, HK, D = 37, 6, 2, 128
    op = RMSNormFwdOp()
    w = (torch.randn(D, generator=gen) * 0.2 + 1).to(torch.bfloat16)
    qkv = (torch.randn(T, (HQ + 2 * HK) * D, generator=gen) * 2).to(torch.bfloat16)
    before = qkv.clone()
    q = qkv[:, :HQ * D].view(T, HQ, D)
    k = qkv[:, HQ * D:(HQ + HK) * D].view(T, HK, D)
    assert q.stride() == ((HQ + 2 * HK) * D, D, 1)
    want_q, want_k = ref.hf_rms_norm(q.clone(), w, 1e-6, "llama"), ref.hf_rms_norm(k.clone(), w, 1e-6, "llama")
    assert op(q, w, out=q) is q and op(k, w, out=k) is k
    assert_hf_bits(q, want_q, "q in place", rounds=2)
    assert_hf_bits(k, want_k, "k in place", rounds=2)
    assert torch.equal(qkv[:, (HQ + HK) * D:], before[:, (HQ + HK) * D:]), "v was written"
    assert op._impl_for(op._check_call({"x": q, "weight": w, "residual": None})).binding(
        {"x": q, "weight": w, "residual": None}, {"out": q}) is not None, "the view would be copied"
    assert _served(op, lambda: op(q, w, out=q)) == 3
    # every other head of k, a head stride of 2 * head_dim: read where it lies into a new tensor
    kk = before[:, HQ * D:].view(T, 2 * HK, D)[:, ::2]
    assert_hf_bits(op(kk, w), ref.hf_rms_norm(kk.contiguous(), w, 1e-6, "llama"), "strided heads", rounds=2)
    assert _served(op, lambda: op(kk, w)) == 3


def test_two_stride_views_are_served_and_deeper_ones_copied(gen):
    """``[batch, seq, hidden]`` sliced along seq (rows at two strides: served where they lie) and a
    view needing three strides (copied first, never computed wrongly: no binding is made for it);
    ``out=`` NaN-filled is written everywhere; the inputs are never changed."""
    op = RMSNormFwdOp(eps=1e-5)
    w = torch.randn(64, generator=gen)
    big = torch.randn(4, 30, 64, generator=gen)
    deep = torch.randn(3, 5, 7, 64, generator=gen)[:, 1:3, ::2]  # strides 2240, 448, 128: no two merge
    for x, copied in ((big[:, 3:20], False), (big[::2, 5:9], False), (deep, True), (big.transpose(0, 1), False)):
        before = x.clone()
        want = ref.rms_norm(x, w, 1e-5)
        out = torch.full(x.shape, NAN)
        assert op(x, w, out=out) is out
        assert_close(out, want, *tolerance(torch.float32)[::-1], what=str(list(x.stride())))
        assert_close(op(x, w), want, *tolerance(torch.float32)[::-1], what=str(list(x.stride())))
        assert torch.equal(x, before)
        tensors = {"x": x, "weight": w, "residual": None}
        b = op._impl_for(op._check_call(tensors)).binding(tensors, {"out": None})
        assert (b is None) == copied, x.stride()
    # a weight that is not contiguous is read through a copy
    wide = torch.randn(64, 2, generator=gen)
    assert_close(op(big, wide[:, 0]), ref.rms_norm(big, wide[:, 0], 1e-5), *tolerance(torch.float32)[::-1])


def test_fused_residual_add_in_place_as_vllm(gen):
    """vLLM's fused_add_rms_norm: ``h = x + residual`` in bf16 written over the residual, norm(h) over
    x, in one call; and the same into new tensors, returned as ``(out, residual_out)``."""
    op = RMSNormFwdOp()
    w = (torch.randn(4096, generator=gen) * 0.2 + 1).to(torch.bfloat16)
    for rows in ((1,), (7,), (2, 9)):
        x = (torch.randn(*rows, 4096, generator=gen) * 2).to(torch.bfloat16)
        r = (torch.randn(*rows, 4096, generator=gen) * 4).to(torch.bfloat16)
        h_want = x + r  # HF's decoder layer: residual + hidden_states in bf16
        y_want = ref.hf_rms_norm(h_want, w, 1e-6, "llama")
        y, h = op(x, w, residual=r)
        assert torch.equal(h, h_want) and h.data_ptr() not in (x.data_ptr(), r.data_ptr())
        assert_hf_bits(y, y_want, f"rows {rows}", rounds=2)
        got = op(x, w, residual=r, out=x, residual_out=r)
        assert got[0] is x and got[1] is r
        assert torch.equal(r, h_want) and torch.equal(x, y)
    x, r = torch.randn(5, 4096, generator=gen).to(torch.bfloat16), torch.randn(5, 4096, generator=gen).to(torch.bfloat16)
    assert _served(op, lambda: op(x, w, residual=r, out=x, residual_out=r)) == 3


def test_residual_must_be_shaped_and_typed_like_x(gen):
    op = RMSNormFwdOp()
    x, w = torch.randn(4, 6, 64, generator=gen), torch.randn(64, generator=gen)
    with pytest.raises(ValueError, match=r"RMSNormFwdOp: residual: expected shape \[4, 6, 64\] \(that of x\), got \[24, 64\]"):
        op(x, w, residual=x.reshape(24, 64).clone())
    with pytest.raises(TypeError, match=r"RMSNormFwdOp: residual: expected dtype float32 \(that of x\), got float16"):
        op(x, w, residual=x.half())
    with pytest.raises(ValueError, match=r"residual_out: given without residual"):
        op(x, w, residual_out=x.clone())
    with pytest.raises(ValueError, match=r"residual_out: overlaps x in memory"):
        op(x, w, residual=x.clone(), residual_out=x)


def test_empty_rows_an_empty_last_dim_and_too_many_rows(gen):
    op = RMSNormFwdOp()
    w = torch.randn(64, generator=gen)
    assert op(torch.empty(0, 64), w).shape == (0, 64)
    y, h = op(torch.empty(3, 0, 64), w, residual=torch.empty(3, 0, 64))
    assert y.shape == h.shape == (3, 0, 64)
    assert op(torch.empty(5, 0), torch.empty(0)).shape == (5, 0)  # nothing to compute, no kernel
    huge = torch.zeros(1, 1, 64).expand(2**16, 2**15 + 1, 64)  # 2^31 + 2^16 rows, no memory
    with pytest.raises(ValueError, match=r"RMSNormFwdOp: x: expected at most 2\^31 - 1 rows"):
        op(huge, w)


def test_the_torch_target_computes_what_builtin_does(gen):
    """The plain-PyTorch target (HF's computation, torch's summation order) and the kernels agree on
    the bits of nearly every element, fused residual included."""
    w = (torch.randn(4096, generator=gen) * 0.2 + 1).to(torch.bfloat16)
    x = torch.randn(9, 4096, generator=gen).to(torch.bfloat16)
    r = torch.randn(9, 4096, generator=gen).to(torch.bfloat16)
    (yb, hb), (yt, ht) = (RMSNormFwdOp(target=t)(x, w, residual=r) for t in ("builtin", "torch"))
    assert torch.equal(hb, ht)
    assert_hf_bits(yb, yt, "builtin against torch", rounds=2)


# ------------------------------------------------------------------------------------- gradients
def _grads64(fn, inputs: dict, grads: tuple) -> dict:
    """float64 autograd of ``fn(**inputs)`` (one output or a tuple) against ``grads``, by input name."""
    leaves = {n: t.detach().double().requires_grad_(True) for n, t in inputs.items()}
    outs = fn(**leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    got = torch.autograd.grad(outs, list(leaves.values()), [g.double() for g in grads])
    return dict(zip(leaves, got))


def _rms_reference(x, weight, residual=None, eps=1e-6):
    h = x if residual is None else x + residual
    y = ref.rms_norm(h, weight, eps)
    return y if residual is None else (y, h)


def _layer_reference(x, weight, bias, residual=None, eps=1e-5):
    h = x if residual is None else x + residual
    y = ref.layer_norm(h, weight, bias, eps)
    return y if residual is None else (y, h)


def _fp32_gradients_match(op, reference, inputs: dict, gen) -> tuple[dict, tuple]:
    """The gradients of every input of ``op(**inputs)`` against random output gradients, each within
    the fp32 tolerances of float64 autograd of ``reference``; returns them and the output gradients."""
    leaves = {n: t.clone().requires_grad_(True) for n, t in inputs.items()}
    outs = op(**leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    assert all(o.grad_fn is not None for o in outs)
    gs = tuple(torch.randn(o.shape, generator=gen) for o in outs)
    got = dict(zip(leaves, torch.autograd.grad(outs, list(leaves.values()), gs)))
    want = _grads64(reference, inputs, gs)
    atol, rtol = tolerance(torch.float32)
    for name in inputs:
        assert_close(got[name], want[name], rtol, atol, f"grad of {name}")
    return got, gs


@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_fp32_gradients_against_float64(residual, gen):
    """x's, the weight's (summed over every row on the device) and the residual's gradient, fp32,
    within the forward's tolerances of float64 autograd; the residual's is x's (the gradient reaching
    ``residual_out`` added to the one through the norm)."""
    op = RMSNormFwdOp()
    inputs = {"x": torch.randn(7, 9, 64, generator=gen) * 2, "weight": torch.randn(64, generator=gen) * 0.3 + 1}
    if residual:
        inputs["residual"] = torch.randn(7, 9, 64, generator=gen)
    got, gs = _fp32_gradients_match(op, _rms_reference, inputs, gen)
    if residual:
        assert torch.equal(got["x"], got["residual"])
    leaves = {n: t.clone().requires_grad_(True) for n, t in inputs.items()}
    again = torch.autograd.grad(op(**leaves), list(leaves.values()), gs)
    assert all(torch.equal(a, b) for a, b in zip(again, got.values())), "the same rows gave other bits"


def test_layer_norm_fp32_gradients_against_float64(gen):
    op = LayerNormFwdOp()
    inputs = {"x": torch.randn(5, 11, 64, generator=gen) * 3 + 2, "weight": torch.randn(64, generator=gen),
              "bias": torch.randn(64, generator=gen), "residual": torch.randn(5, 11, 64, generator=gen)}
    got, gs = _fp32_gradients_match(op, _layer_reference, inputs, gen)
    # a frozen weight and bias: x's gradient alone, the same bits
    x = inputs["x"].clone().requires_grad_(True)
    (gx,) = torch.autograd.grad(op(x, inputs["weight"], inputs["bias"], residual=inputs["residual"]), [x], gs)
    assert torch.equal(gx, got["x"])


def test_backward_reads_what_autograd_kept_and_refuses_a_later_change(gen):
    """The backward reads the tensors ``backward.saves`` names (``residual_out`` with a residual, else
    x; the weight) through ``save_for_backward``: changing one in place before the backward is an
    error, not a wrong gradient. A second derivative raises."""
    op = RMSNormFwdOp()
    x, w, r = (torch.randn(4, 64, generator=gen).requires_grad_(True), torch.randn(64, generator=gen),
               torch.randn(4, 64, generator=gen))
    y, h = op(x, w, residual=r)
    with torch.no_grad():
        h.add_(1.0)  # e.g. the next layer's residual add written over it
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    leaf = x.detach().clone().requires_grad_(True)
    y = op(leaf, w)
    with torch.no_grad():
        leaf.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    leaf = x.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(op(leaf, w).square().sum(), leaf, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        g.sum().backward()


def test_gradients_of_odd_shapes(gen):
    """No rows (the weight's gradient is zeros), one row, and a gradient that is not contiguous (a
    view the backward copies)."""
    op = RMSNormFwdOp()
    w = torch.randn(64, generator=gen).requires_grad_(True)
    x = torch.empty(0, 64).requires_grad_(True)
    gx, gw = torch.autograd.grad(op(x, w).sum(), [x, w])
    assert gx.shape == (0, 64) and torch.equal(gw, torch.zeros(64))
    x = torch.randn(2, 64, 3, generator=gen)[..., 1].requires_grad_(True)  # [2, 64], last dim strided
    y = op(x, w)
    g = torch.randn(64, 2, generator=gen).t()  # a transposed gradient
    gx, gw = torch.autograd.grad(y, [x, w], g)
    want = _grads64(_rms_reference, {"x": x.detach(), "weight": w.detach()}, (g,))
    atol, rtol = tolerance(torch.float32)
    assert_close(gx, want["x"], rtol, atol, "x")
    assert_close(gw, want["weight"], rtol, atol, "weight")


@pytest.fixture
def nan_empty():
    """``torch.empty`` and ``empty_like`` NaN-filled for one test (PyTorch's deterministic mode fills
    new memory): an element no kernel writes shows as NaN."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)


def test_weight_and_bias_gradients_are_written_whole_and_planned_once(nan_empty, gen):
    """The weight's and bias's gradients are new tensors (NaN-filled here) that ``wsum`` writes
    whole: within fp32 tolerances of float64 autograd; with no rows they are zeros. A later call
    shaped alike launches from the plan the first one made, with the same bits; a gradient whose
    last dim is strided is copied first (its signature has no plan; the copies' has one, made once)
    and still right."""
    assert torch.empty(4).isnan().all()
    op = LayerNormFwdOp()
    inputs = {"x": torch.randn(5, 11, 64, generator=gen) * 3 + 2, "weight": torch.randn(64, generator=gen),
              "bias": torch.randn(64, generator=gen), "residual": torch.randn(5, 11, 64, generator=gen)}
    got, gs = _fp32_gradients_match(op, _layer_reference, inputs, gen)
    kernels = op._impl_for(op._check_call(inputs))
    def backward_bindings():  # (the forward's general path binds into the same cache; None: copied first)
        return [b for b in kernels.op._bindings.of(kernels) if b is None or b.names == BACKWARD.names]

    (plan,) = backward_bindings()
    assert plan is not None and [launch.kernel for launch in plan.launches] == [
        kernels._kernel(kernels.bwd_spec), kernels._kernel(kernels.wsum_spec)]
    leaves = {n: t.clone().requires_grad_(True) for n, t in inputs.items()}
    again = torch.autograd.grad(op(**leaves), list(leaves.values()), gs)
    assert all(torch.equal(a, b) for a, b in zip(again, got.values())), "the plan's launch gave other bits"
    assert backward_bindings() == [plan]
    strided = tuple(torch.randn(*g.shape, 2, generator=gen)[..., 1] for g in gs)  # last dims at stride 2
    leaves = {n: t.clone().requires_grad_(True) for n, t in inputs.items()}
    copied = dict(zip(leaves, torch.autograd.grad(op(**leaves), list(leaves.values()), strided)))
    assert len(backward_bindings()) == 3 and backward_bindings()[:2] == [plan, None]
    leaves = {n: t.clone().requires_grad_(True) for n, t in inputs.items()}
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(op(**leaves), list(leaves.values()), strided),
                                                  copied.values())), "the copies' plan gave other bits"
    assert len(backward_bindings()) == 3, "a second call of the copied signature binds nothing new"
    want = _grads64(_layer_reference, inputs, strided)
    atol, rtol = tolerance(torch.float32)
    for name in inputs:
        assert_close(copied[name], want[name], rtol, atol, f"grad of {name} (copied)")
    leaves = {n: (torch.empty(0, 64) if t.dim() > 1 else t.clone()).requires_grad_(True) for n, t in inputs.items()}
    none = dict(zip(leaves, torch.autograd.grad([o.sum() for o in op(**leaves)], list(leaves.values()))))
    assert none["x"].shape == none["residual"].shape == (0, 64)
    assert torch.equal(none["weight"], torch.zeros(64)) and torch.equal(none["bias"], torch.zeros(64))


@pytest.mark.slow  # 65,536 rows through the C kernels: about 10 s on 2 cores with the compiles
def test_bf16_weight_gradient_over_65536_rows(gen):
    """The weight's gradient of 65,536 bf16 rows, summed on the device in fp32 partials, within 1e-2
    relative of the float64 sum of what autograd through HF's module sums (dy times the normalised
    value rounded to bf16). x has column means and dy a mean, so each column's sum is large (not a
    cancellation, whose relative error would say nothing)."""
    rows, hidden = 65536, 256
    op = RMSNormFwdOp()
    w = (torch.randn(hidden, generator=gen) * 0.2 + 1).to(torch.bfloat16).requires_grad_(True)
    mu = (torch.rand(hidden, generator=gen) + 1) * (torch.randint(0, 2, (hidden,), generator=gen) * 2 - 1)
    x = (torch.randn(rows, hidden, generator=gen) + mu).to(torch.bfloat16)
    dy = (torch.randn(rows, hidden, generator=gen) * 0.5 + 1).to(torch.bfloat16)
    (gw,) = torch.autograd.grad(op(x, w), [w], dy)
    xd = x.double()
    n = (xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16).double()
    want = (dy.double() * n).sum(0)
    assert want.abs().min().item() > 1000  # the construction above did what it says
    assert gw.dtype == torch.bfloat16
    assert_close(gw, want, rtol=1e-2, atol=0, what="dw")


# ------------------------------------------------------------------ torch.library and torch.compile
def test_opcheck_with_an_output_dtype_of_its_own(gen):
    """``torch.library.opcheck`` of the custom ops for an op whose output's dtype is a param's
    (``out_dtype``): the fake promises fp32 for a bf16 x, as the kernel writes (every op is opchecked
    in ``tests/test_library.py``)."""
    from tileops.runtime.library import pack

    op = RMSNormFwdOp(out_dtype="float32")
    x = torch.randn(3, 5, 4096, generator=gen).to(torch.bfloat16)
    w = torch.randn(4096, generator=gen) * 0.3 + 1
    torch.library.opcheck(torch.ops.tileops.apply.default, (op._handle, *pack(op._layout, {"x": x, "weight": w})))
    out = torch.empty_like(x, dtype=torch.float32)
    torch.library.opcheck(torch.ops.tileops.apply_out.default, (op._handle, *pack(op._layout, {"x": x, "weight": w}), [out]))
    y = torch.compile(lambda x, w: op(x, w), fullgraph=True)(x, w)
    assert y.dtype == torch.float32 and torch.equal(y, op(x, w))


def test_compiled_fullgraph_dynamic_no_recompile_over_20_lengths(gen):
    """A decoder layer's norm with the fused residual, compiled once (``dynamic=True``) for 20
    lengths: one frame, and the eager op's bits at every length."""
    from torch._dynamo.testing import CompileCounterWithBackend

    rms, ln = RMSNormFwdOp(), LayerNormFwdOp()
    w = torch.randn(64, generator=gen)

    def block(x, r):
        y, h = rms(x, w, residual=r)
        return ln(y * 2, w, w, residual=h)

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(block, fullgraph=True, dynamic=True, backend=counter)
    for seq in range(5, 25):  # from 5: Dynamo specializes sizes 0 and 1, and duck-sizes the first call
        x, r = torch.randn(2, seq, 64, generator=gen), torch.randn(2, seq, 64, generator=gen)
        for got, want in zip(compiled(x, r), block(x, r)):
            assert torch.equal(got, want)
    assert counter.frame_count == 1, f"{counter.frame_count} compiles for 20 lengths"


def test_compiled_gradients_and_in_place_residual(gen):
    """Gradients through a compiled function (``tileops::apply_backward`` with the saved
    ``residual_out``; x's and the residual's gradients, one tensor in the kernel, two outputs of the
    custom op) equal the eager ones; the vLLM form (``out=x, residual_out=r``) compiles to the
    in-place custom op."""
    op = RMSNormFwdOp()
    w = (torch.randn(64, generator=gen) * 0.3 + 1).requires_grad_(True)

    def loss(x, r):
        y, h = op(x, w, residual=r)
        return (y * h).sum()

    x, r = (torch.randn(6, 64, generator=gen).requires_grad_(True) for _ in range(2))
    got = torch.autograd.grad(torch.compile(loss, fullgraph=True)(x, r), [x, r, w])
    want = torch.autograd.grad(loss(x, r), [x, r, w])
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)

    wd = w.detach()

    def fused(x, r):
        op(x, wd, residual=r, out=x, residual_out=r)
        return x, r

    xs, rs = torch.randn(6, 64, generator=gen), torch.randn(6, 64, generator=gen)
    y, h = op(xs, wd, residual=rs)
    got = torch.compile(fused, fullgraph=True)(xs.clone(), rs.clone())
    assert torch.equal(got[0], y) and torch.equal(got[1], h)


# --------------------------------------------------------------------- warmup and the command line
def test_warmup_names_the_kernels_norm_calls_load(monkeypatch, gen):
    """``tileops warmup`` (``kernel_jobs``) names each norm case's forward, backward and weight-sum
    kernels from the family's ``kernel_specs``, without constructing an op; the kernels that real
    calls of a case load (forward and backward, on the CPU) are among those it names."""
    from tileops.compile.warmup import kernel_jobs
    from tileops.manifest import registry
    from tileops.norm import builtin
    from tileops.workloads import op_class, workload

    for name in ("RMSNormFwdOp", "LayerNormFwdOp"):
        m = registry()[name]
        cuda = kernel_jobs([name], "sm_90")
        assert {s.kind for _, s, _, _ in cuda} == {"fwd", "bwd", "wsum"}, name
        assert all(b == "norm" and backend == "cuda" and arch == "sm_90" for b, _, backend, arch in cuda)
        listed = set(kernel_jobs([name], "c"))
        loaded = []
        real = builtin.load_kernel
        monkeypatch.setattr(builtin, "load_kernel", lambda b, s, be, a, *rest, **kw: (
            loaded.append((b, s, be, a)), real(b, s, be, a, *rest, **kw))[1])
        for case in (m.cases[0], m.cases[-1]):
            w = workload(m, case, case.dtypes[0], "cpu", shrink=True, generator=gen)
            op = op_class(name)(**w.params)
            leaves = {n: t.clone().requires_grad_(True) for n, t in w.inputs.items()}
            out = op(**leaves)
            torch.autograd.grad(out, list(leaves.values()), [torch.ones_like(o) for o in
                                                             (out if isinstance(out, tuple) else (out,))])
        monkeypatch.undo()
        assert {s.kind for _, s, _, _ in loaded} >= {"fwd", "bwd"}, loaded
        assert set(loaded) <= listed, sorted(set(map(repr, loaded)) - set(map(repr, listed)))[:2]


def test_list_show_and_emit_rows(capsys):
    """``tileops list`` and ``show`` describe the norm ops (leading dims, the input like x, the output
    dtype param, the backward); ``emit`` prints a case's forward kernel for the CPU and for sm_90."""
    from tileops.cli import main

    assert main(["list"]) == 0
    rows = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()}
    assert rows["RMSNormFwdOp"] == rows["LayerNormFwdOp"] == "norm"
    assert main(["show", "RMSNormFwdOp"]) == 0
    out = capsys.readouterr().out
    for text in ("x: float16, bfloat16, float32  shape: [..., hidden]", "residual: like x  (optional)",
                 "out: like x, dtype from out_dtype", "backward: wrt x, weight, residual; summed over rows: weight",
                 "qk-norm-128            hidden=128, lead=[16384, 32]"):
        assert text in out, text
    assert main(["show", "LayerNormFwdOp"]) == 0
    assert "weight: float16, bfloat16, float32  shape: [hidden]  (optional, positional)" in capsys.readouterr().out
    assert main(["emit", "RMSNormFwdOp", "--case", "one-row", "--arch", "c"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("// RMSNormFwdOp case one-row, c: NormKernelSpec(kind='fwd', hidden=64") and "norm_fwd" in out
    assert main(["emit", "LayerNormFwdOp", "--case", "ln-4k", "--arch", "sm_90"]) == 0
    out = capsys.readouterr().out
    assert "norm_fwd_kernel" in out and "__global__" in out and "bias='bfloat16'" in out


# ------------------------------------------------------------- the CUDA host path, emulated on the CPU
class _EmulatedKernel:
    """A norm kernel's CUDA schedule as the runtime launches it, run on the CPU by
    ``tests/cuda_on_cpu.py``: the host side of the CUDA path (stride units, alignment and the copies
    they force, the backward's blocks and partial rows) runs unchanged on CPU tensors."""

    _EXTENTS = {"fwd": ("NX", "NR", "NY", "NRO"), "bwd": ("NX", "NDY", "NDRO", "NDX", "NP"), "wsum": ("NP",)}

    def __init__(self, spec):
        from tests.test_norm_kernels import _emulated

        self.spec, self.emu = spec, _emulated(spec)
        self.param_names, self.extent_names = spec.args, self._EXTENTS[spec.kind]
        self.arg_names = self.param_names + self.extent_names
        self.arg_types = ("int64_t",) * len(self.arg_names)
        self.slot = {n: i for i, n in enumerate(self.arg_names)}
        self.device_index = None
        self.launched: list[str] = []

    def bind(self, **values):
        return [values[n] for n in self.arg_names]

    def template(self, values):
        """What :meth:`tileops.compile.entry.RawKernel.template` gives: every argument by slot, 0 unless given."""
        args = array.array("q", bytes(8 * len(self.arg_names)))
        for name, value in values.items():
            args[self.slot[name]] = int(value)
        return args

    def stream(self) -> int:
        return 0

    def __call__(self, *args) -> None:
        self.launch(list(args), 0)

    def launch(self, args, stream) -> bool:
        named = dict(zip(self.arg_names, (int(a) for a in args)))
        s = self.spec
        # the grids the kernels declare: row groups, G persistent blocks, 32 columns a block
        grid = (-(-named["M"] // s.rows_per_block) if s.kind == "fwd" else named["G"] if s.kind == "bwd"
                else -(-s.hidden // 32))
        self.launched.append(s.kind)
        self.emu.launch(grid, s.block_threads, **named)
        return False


@pytest.fixture
def emulated_cuda():
    """A context in which norm ops serve CPU tensors through the CUDA path: ``device_backend`` says
    sm_90, kernels are :class:`_EmulatedKernel`, the device has 132 SMs (an H200's); an op made by
    ``emulated_cuda.op(cls, ...)`` runs on the Python runtime (the native executor would call a
    compiled entry point). Ops made and called outside the context run the C backend as ever."""
    import contextlib

    from tests import cuda_on_cpu
    from tileops.norm import builtin
    from tileops.runtime import executor

    if not cuda_on_cpu.available():
        pytest.skip("no C++ compiler")

    @contextlib.contextmanager
    def context():
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(builtin, "device_backend", lambda device: ("cuda", "sm_90"))
            mp.setattr(builtin, "load_kernel", lambda b, spec, *a, **k: _EmulatedKernel(spec))
            mp.setattr(torch.cuda, "get_device_properties", lambda device: type("P", (), {"multi_processor_count": 132}))
            yield

    def op(cls, *args, **kwargs):
        made = cls(*args, **kwargs)
        made._use_runtime(executor.PythonRuntime(made._handle))
        return made

    context.op = op
    return context


@pytest.mark.slow  # compiles each kernel's CUDA source with g++ (about 10 s each on 2 cores) and runs it emulated
def test_the_cuda_host_path_emulated(emulated_cuda, gen):
    """Per-head bf16 norm of the q slice of a fused qkv buffer in place with the residual fused in
    place (vLLM), rows at strides that are whole 16-byte vectors; views off the vector (a pointer one
    element past it, a row stride of 68 elements) copied first and still right; gradients through
    bwd on G blocks and wsum over their partial rows (the row-per-warp schedule: one partial row
    per warp). Against the same op on the C backend."""
    T, HQ, HK, D = 11, 4, 2, 128
    op, c_op = emulated_cuda.op(RMSNormFwdOp), RMSNormFwdOp()
    w = (torch.randn(D, generator=gen) * 0.2 + 1).to(torch.bfloat16)
    qkv = (torch.randn(T, (HQ + 2 * HK) * D, generator=gen) * 2).to(torch.bfloat16)
    res = torch.randn(T, HQ, D, generator=gen).to(torch.bfloat16)
    q = qkv[:, :HQ * D].view(T, HQ, D)
    want_y, want_h = c_op(q.clone(), w, residual=res)
    rest = qkv[:, HQ * D:].clone()
    buf = torch.randn(T * 136 + 1, generator=gen).to(torch.bfloat16)
    views = (buf[1:1 + T * D].view(T, D), buf[:T * 68].view(T, 68)[:, :64])  # off the 16-byte vector
    want_views = [c_op(x, w[:x.shape[-1]].contiguous()) for x in views]
    x, r = torch.randn(37, D, generator=gen).to(torch.bfloat16), torch.randn(37, D, generator=gen).to(torch.bfloat16)
    dy, dh = torch.randn(37, D, generator=gen).to(torch.bfloat16), torch.randn(37, D, generator=gen).to(torch.bfloat16)

    def grads(o):
        leaves = [t.clone().requires_grad_(True) for t in (x, w, r)]
        return torch.autograd.grad(o(leaves[0], leaves[1], residual=leaves[2]), leaves, (dy, dh))

    cx, cw, cr = grads(c_op)
    with emulated_cuda():
        got = op(q, w, residual=res, out=q, residual_out=res)
        assert got[0] is q and got[1] is res and torch.equal(res, want_h)
        # the two schedules sum a row in other orders: the same bits but where Llama's rounding is a tie
        assert_hf_bits(q, want_y, "q in place", rounds=2)
        assert torch.equal(qkv[:, HQ * D:], rest)
        kernels = op._impl_for(op._check_call({"x": q, "weight": w, "residual": res}))
        assert kernels.unit == 8 and kernels.spec.backend == "cuda"
        for v, want in zip(views, want_views):  # a pointer one bf16 past the vector, a row stride of 68: copied
            wv = w[:v.shape[-1]].contiguous()
            assert_hf_bits(op(v, wv), want, str(v.stride()), rounds=2)
        narrow = {"x": views[1], "weight": w[:64].contiguous(), "residual": None}
        assert op._impl_for(op._check_call(narrow)).binding(narrow, {"out": None}) is None  # not bound: copied
        # gradients: bf16 rows of 128 (per warp), x and residual from one launch, the weight's summed
        gx, gw, gr = grads(op)
        b = op._impl_for(op._check_call({"x": x, "weight": w, "residual": r}))
        assert b.bwd_spec.per_warp and b.bwd_spec.partials_per_block == b.bwd_spec.block_threads // 32
        assert b._blocks(37) == -(-37 // b.bwd_spec.rows_per_block)  # fewer groups than resident blocks
        assert b._blocks(10**6) == 132 * (1024 // b.bwd_spec.block_threads)
        # dy one bf16 past the vector: strides as dy's, so the same plan, whose launch the pointer refuses;
        # then dy is copied, and the copies' signature (dx written into a buffer of its own) is bound once
        off = torch.empty(dy.numel() + 1, dtype=dy.dtype)[1:].view(dy.shape).copy_(dy)
        plans = b.op._bindings.of(b)
        for _ in range(2):
            leaves = [t.clone().requires_grad_(True) for t in (x, w, r)]
            got = torch.autograd.grad(op(leaves[0], leaves[1], residual=leaves[2]), leaves, (off, dh))
            assert all(torch.equal(u, v) for u, v in zip(got, (gx, gw, gr)))
            assert b.op._bindings.of(b)[:len(plans)] == plans and len(b.op._bindings.of(b)) == len(plans) + 1
    assert torch.equal(gx, gr) and torch.equal(cx, cr)
    # the two schedules sum in other orders: dx within a bf16 rounding, dw within its fp32 sums' error
    assert_close(gx, cx.double(), rtol=2.0**-7, atol=2.0**-7 * cx.abs().mean().item(), what="dx")
    assert_close(gw, cw.double(), rtol=2.0**-7, atol=0, what="dw")
