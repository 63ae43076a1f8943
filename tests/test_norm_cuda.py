"""CUDA-only checks of the norm family (skipped without a GPU; run on the H200).

What the GPU does differently from the CPU: the CUDA schedules (a row per lane group of a warp up to
1024 bf16 elements, per block above; the backward's persistent blocks and partial rows per warp),
16-byte vectors (views off them are copied), the fast path served by the native runtime, CUDA graph
capture and replay, torch.compile on CUDA, and the GPU's own reductions in HF's modules (torch's
CUDA sums, against which the roundings are compared). The generated tests' ``builtin-cuda`` column
runs every manifest case at its full size, forward and backward, besides these.

References: float64 math and the HF modules as they compute, from ``tests/norm_references.py``
(no code shared with the kernels); outputs NaN-filled where a test gives them; random inputs, seeded
per test (``tests/conftest.py``).
"""

from __future__ import annotations

import pytest
import torch

from tests import norm_references as ref
from tests.test_norm_kernels import assert_close, assert_hf_bits
from tileops.norm import LayerNormFwdOp, RMSNormFwdOp
from tileops.testing import tolerance

pytestmark = pytest.mark.cuda

DEV = "cuda"
NAN = float("nan")
#: hidden sizes over the schedules: a warp's lane group (64, 128), lanes past the row (184), a
#: block of 256 two-element vectors (1030), blocks of 128, 256, 512 and 1024 threads (2048 .. 16384)
HIDDEN = [64, 128, 184, 1030, 2048, 4096, 8192, 16384]


def _randn(*shape, gen, dtype=torch.float32, scale=1.0, shift=0.0):
    return (torch.randn(*shape, generator=gen) * scale + shift).to(dtype).to(DEV)


def _served(op, call) -> int:
    """Of three repeated calls after one that binds, how many the native runtime served."""
    if op._native_run is None:
        pytest.skip("no native runtime here")
    call()
    before = op._runtime.stats()["hits"]
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    return op._runtime.stats()["hits"] - before


# ----------------------------------------------------------------------------------- forward
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_element_written_cuda(hidden, dtype, gen):
    """Every schedule, into NaN-filled outputs: RMSNorm with the fused residual, LayerNorm with weight
    and bias; rows that do not fill the last block (1031), one row; against float64."""
    rms, ln = RMSNormFwdOp(eps=1e-5), LayerNormFwdOp(eps=1e-5)
    w, b = _randn(hidden, gen=gen, dtype=dtype, scale=0.3, shift=1.0), _randn(hidden, gen=gen, dtype=dtype)
    atol, rtol = tolerance(dtype)
    for rows in (1, 1031):
        x, r = _randn(rows, hidden, gen=gen, dtype=dtype), _randn(rows, hidden, gen=gen, dtype=dtype)
        y, h = torch.full_like(x, NAN), torch.full_like(x, NAN)
        rms(x, w, residual=r, out=y, residual_out=h)
        assert torch.equal(h, x + r), (hidden, dtype, rows)
        assert_close(y.cpu(), ref.rms_norm(h.cpu(), w.cpu(), 1e-5), rtol, atol, f"rms {hidden} {dtype} {rows}")
        y = torch.full_like(x, NAN)
        ln(x, w, b, out=y)
        assert_close(y.cpu(), ref.layer_norm(x.cpu(), w.cpu(), b.cpu(), 1e-5), rtol, atol, f"ln {hidden} {dtype} {rows}")


@pytest.mark.parametrize("style,dtype,hidden,params", [
    ("llama", torch.bfloat16, 4096, {}), ("llama", torch.bfloat16, 128, {}), ("llama", torch.float16, 8192, {}),
    ("gemma", torch.bfloat16, 2048, {"offset": 1.0}), ("gemma", torch.bfloat16, 256, {"offset": 1.0}),
    ("olmo2", torch.bfloat16, 4096, {"rounding": "fp32"}),
])
def test_hf_roundings_on_the_gpu(style, dtype, hidden, params, gen):
    """HF's module computed on the GPU (torch's CUDA reductions) and the op: the same bits on >= 99.9%
    of elements, elsewhere one ulp (two for Llama's double rounding); and the installed transformers
    class itself, where transformers is installed."""
    op = RMSNormFwdOp(eps=1e-6, **params)
    w = _randn(hidden, gen=gen, dtype=dtype, scale=0.5, shift=0.0 if style == "gemma" else 1.0)
    x = _randn(4099, hidden, gen=gen, dtype=dtype, scale=2.0)
    rounds = 2 if style == "llama" else 1
    assert_hf_bits(op(x, w), ref.hf_rms_norm(x, w, 1e-6, style), f"{style} {hidden}", rounds=rounds)
    module = ref.hf_module(style, hidden, 1e-6)
    if module is not None:
        with torch.no_grad():
            module.weight.copy_(w.float().cpu())
            module = module.to(device=DEV, dtype=dtype)
            assert_hf_bits(op(x, w), module(x), f"{style} {hidden} module", rounds=rounds)


def test_fp32_weight_with_bf16_x_on_the_gpu(gen):
    """HF's LlamaRMSNorm with an fp32 weight and a bf16 x returns fp32: ``out_dtype="float32"``; a new
    fp32 output is not made by the runtime (it makes new outputs in x's dtype), a given one is served."""
    op = RMSNormFwdOp(out_dtype="float32")
    w = _randn(4096, gen=gen, scale=0.3, shift=1.0)
    x = _randn(4099, 4096, gen=gen, dtype=torch.bfloat16)
    want = ref.hf_rms_norm(x, w, 1e-6, "llama")
    y = op(x, w)
    assert y.dtype == torch.float32 and (y == want).double().mean().item() >= 0.999
    assert_close(y.cpu(), want.double().cpu(), rtol=2.0**-7, atol=0)
    assert _served(op, lambda: op(x, w)) == 0
    out = torch.full_like(x, NAN, dtype=torch.float32)
    assert _served(op, lambda: op(x, w, out=out)) == 3 and torch.equal(out, y)


def test_layer_norm_on_the_gpu(gen):
    """bf16 LayerNorm with fp32 weight and bias against ``torch.nn.functional.layer_norm`` in float64:
    one rounding, or where the result is far below its terms, their fp32 error."""
    op = LayerNormFwdOp()
    x = _randn(4099, 2048, gen=gen, dtype=torch.bfloat16, scale=3.0, shift=5.0)
    w, b = _randn(2048, gen=gen), _randn(2048, gen=gen)
    got = op(x, w, b).cpu()
    xd = x.double().cpu()
    want = torch.nn.functional.layer_norm(xd, (2048,), w.double().cpu(), b.double().cpu(), 1e-5)
    std = (xd.var(-1, unbiased=False, keepdim=True) + 1e-5).sqrt()
    terms = xd.abs() / std * w.double().cpu().abs() + b.double().cpu().abs()
    near = (got.double() - want).abs() <= terms * 2.0**-21 + want.abs() * 2.0**-8
    assert bool(((ref.ulps_apart(got, want.to(torch.bfloat16)) <= 1) | near).all())


# ---------------------------------------------------------------------- views, in place, the fast path
def test_qkv_slices_in_place_and_the_fast_path_cuda(gen):
    """Qwen3's q_norm and k_norm in place on the slices of a fused qkv buffer (a token stride of the
    whole row, 16-byte multiples): v untouched, HF's bits, and repeated calls served by the native
    runtime with no copy; every other head of k read where it lies; vLLM's in-place residual form."""
    T, HQ, HK, D = 4099, 32, 8, 128
    op = RMSNormFwdOp()
    w = _randn(D, gen=gen, dtype=torch.bfloat16, scale=0.2, shift=1.0)
    qkv = _randn(T, (HQ + 2 * HK) * D, gen=gen, dtype=torch.bfloat16, scale=2.0)
    before = qkv.clone()
    q, k = qkv[:, :HQ * D].view(T, HQ, D), qkv[:, HQ * D:(HQ + HK) * D].view(T, HK, D)
    want_q, want_k = ref.hf_rms_norm(q.clone(), w, 1e-6, "llama"), ref.hf_rms_norm(k.clone(), w, 1e-6, "llama")
    assert op(q, w, out=q) is q and op(k, w, out=k) is k
    assert_hf_bits(q, want_q, "q", rounds=2)
    assert_hf_bits(k, want_k, "k", rounds=2)
    assert torch.equal(qkv[:, (HQ + HK) * D:], before[:, (HQ + HK) * D:])
    assert _served(op, lambda: op(q, w, out=q)) == 3
    kk = before[:, HQ * D:].view(T, 2 * HK, D)[:, ::2]
    assert_hf_bits(op(kk, w), ref.hf_rms_norm(kk.contiguous(), w, 1e-6, "llama"), "every other head", rounds=2)
    assert _served(op, lambda: op(kk, w)) == 3
    x, r = _randn(T, 4096, gen=gen, dtype=torch.bfloat16), _randn(T, 4096, gen=gen, dtype=torch.bfloat16)
    w4 = _randn(4096, gen=gen, dtype=torch.bfloat16, scale=0.2, shift=1.0)
    h_want = x + r
    y_want = ref.hf_rms_norm(h_want, w4, 1e-6, "llama")
    op(x, w4, residual=r, out=x, residual_out=r)
    assert torch.equal(r, h_want)
    assert_hf_bits(x, y_want, "vLLM in place", rounds=2)
    assert _served(op, lambda: op(x, w4, residual=r, out=x, residual_out=r)) == 3


def test_views_off_the_vector_are_copied_and_right_cuda(gen):
    """A pointer one element past a 16-byte boundary, a row stride that is not a multiple of 8 bf16,
    a view needing three strides, a weight not contiguous: each copied first (no binding serves
    them), the results those of dense copies."""
    op = RMSNormFwdOp()
    buf = _randn(300 * 1032 + 8, gen=gen, dtype=torch.bfloat16)
    w = _randn(1024, gen=gen, dtype=torch.bfloat16, scale=0.2, shift=1.0)
    deep = _randn(6, 5, 7, 1024, gen=gen, dtype=torch.bfloat16)[:, 1:3, ::2]
    wide_w = _randn(1024, 2, gen=gen, dtype=torch.bfloat16)[:, 0]
    for x, weight in ((buf[1:1 + 300 * 1024].view(300, 1024), w), (buf[:300 * 1028].view(300, 1028)[:, :1024], w),
                      (deep, w), (buf[:300 * 1024].view(300, 1024), wide_w)):
        want = op(x.contiguous(), weight.contiguous())
        out = torch.full(x.shape, NAN, dtype=x.dtype, device=DEV)
        assert op(x, weight, out=out) is out and torch.equal(out, want)
        tensors = {"x": x, "weight": weight, "residual": None}
        assert op._impl_for(op._check_call(tensors)).binding(tensors, {"out": None}) is None or \
            x.data_ptr() % 16 or weight.data_ptr() % 16


def test_empty_rows_and_decode_sizes_cuda(gen):
    """No rows launches nothing (a grid of 0 blocks is an error on CUDA) and their weight gradient is
    zeros; decode-sized calls (1 .. 64 rows) reuse one compiled kernel."""
    from tileops.compile import build

    op = RMSNormFwdOp()
    w = _randn(4096, gen=gen, dtype=torch.bfloat16).requires_grad_(True)
    x = torch.empty(0, 4096, dtype=torch.bfloat16, device=DEV).requires_grad_(True)
    gx, gw = torch.autograd.grad(op(x, w).float().sum(), [x, w])
    assert gx.shape == (0, 4096) and torch.equal(gw, torch.zeros_like(gw))
    op(_randn(1, 4096, gen=gen, dtype=torch.bfloat16), w.detach())
    before = build.stats.kernels
    for rows in range(1, 65):
        x = _randn(rows, 4096, gen=gen, dtype=torch.bfloat16)
        assert_hf_bits(op(x, w.detach()), ref.hf_rms_norm(x, w.detach(), 1e-6, "llama"), str(rows), rounds=2)
    assert build.stats.kernels == before


# ------------------------------------------------------------------------------------- gradients
def test_fp32_gradients_cuda(gen):
    """x's, the weight's, the bias's and the residual's gradients in fp32 on the GPU within the
    forward's tolerances of float64 autograd (the GPU's rsqrtf is within 2 ulp)."""
    atol, rtol = tolerance(torch.float32)
    for op, fn, names in ((RMSNormFwdOp(), lambda x, weight, residual: ref.rms_norm(x + residual, weight, 1e-6),
                           ("x", "weight", "residual")),
                          (LayerNormFwdOp(), lambda x, weight, bias, residual: ref.layer_norm(x + residual, weight,
                                                                                               bias, 1e-5),
                           ("x", "weight", "bias", "residual"))):
        for hidden in (128, 4096):
            inputs = {n: _randn(*((hidden,) if n in ("weight", "bias") else (37, 11, hidden)), gen=gen) for n in names}
            leaves = {n: t.clone().requires_grad_(True) for n, t in inputs.items()}
            y, _ = op(**leaves)
            g = torch.randn(y.shape, generator=gen).to(DEV)
            got = torch.autograd.grad(y, list(leaves.values()), g)
            f64 = {n: t.detach().double().cpu().requires_grad_(True) for n, t in inputs.items()}
            want = torch.autograd.grad(fn(**f64), list(f64.values()), g.double().cpu())
            for n, a, b in zip(names, got, want):
                assert_close(a.cpu(), b, rtol, atol, f"{op.name} {hidden} grad of {n}")


@pytest.mark.parametrize("hidden", [128, 2048])
def test_bf16_weight_gradient_over_65536_rows_cuda(hidden, gen):
    """The weight's gradient of 65,536 bf16 rows (a warp's lane groups at 128, blocks at 2048), summed
    on the device in fp32 partial rows then in a fixed order, within 1e-2 relative of the float64 sum
    of what autograd through HF's module sums; the same bits again for the same rows."""
    rows = 65536
    op = RMSNormFwdOp()
    w = _randn(hidden, gen=gen, dtype=torch.bfloat16, scale=0.2, shift=1.0).requires_grad_(True)
    mu = ((torch.rand(hidden, generator=gen) + 1) * (torch.randint(0, 2, (hidden,), generator=gen) * 2 - 1)).to(DEV)
    x = (torch.randn(rows, hidden, generator=gen).to(DEV) + mu).to(torch.bfloat16)
    dy = _randn(rows, hidden, gen=gen, dtype=torch.bfloat16, scale=0.5, shift=1.0)
    (gw,) = torch.autograd.grad(op(x, w), [w], dy)
    (again,) = torch.autograd.grad(op(x, w), [w], dy)
    assert torch.equal(gw, again), "the same rows gave other bits"
    xd = x.double()
    n = (xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16).double()
    want = (dy.double() * n).sum(0).cpu()
    assert want.abs().min().item() > 1000
    assert gw.dtype == torch.bfloat16
    assert_close(gw.cpu(), want, rtol=1e-2, atol=0, what="dw")


# --------------------------------------------------------------------------- graphs and compile
def test_cuda_graph_capture_and_replay(gen):
    """A decoder step's norms captured in a CUDA graph (the fused residual in place, then LayerNorm
    into a new tensor) and a training step's backward (bwd and wsum, their partial rows from the
    graph's pool); replayed on new data, the eager results."""
    rms, ln = RMSNormFwdOp(), LayerNormFwdOp()
    w = _randn(4096, gen=gen, dtype=torch.bfloat16, scale=0.2, shift=1.0)
    sx, sr = _randn(64, 4096, gen=gen, dtype=torch.bfloat16), _randn(64, 4096, gen=gen, dtype=torch.bfloat16)
    leaf = _randn(64, 4096, gen=gen, dtype=torch.bfloat16).requires_grad_(True)
    wl = w.clone().requires_grad_(True)
    sg = _randn(64, 4096, gen=gen, dtype=torch.bfloat16)

    def step():
        rms(sx, w, residual=sr, out=sx, residual_out=sr)
        y = ln(sx, w)
        return (y, *torch.autograd.grad(rms(leaf, wl), [leaf, wl], sg))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # compile and bind outside the capture
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(3):
        x, r, lx, g = (_randn(64, 4096, gen=gen, dtype=torch.bfloat16) for _ in range(4))
        sx.copy_(x)
        sr.copy_(r)
        with torch.no_grad():
            leaf.copy_(lx)
        sg.copy_(g)
        graph.replay()
        torch.cuda.synchronize()
        h = x + r
        y0 = rms(h, w)
        assert torch.equal(sr, h) and torch.equal(sx, y0)
        assert torch.equal(outs[0], ln(y0, w))
        lx = lx.clone().requires_grad_(True)
        wl2 = w.clone().requires_grad_(True)
        want = torch.autograd.grad(rms(lx, wl2), [lx, wl2], g)
        assert torch.equal(outs[1], want[0]) and torch.equal(outs[2], want[1])


def test_compiled_on_cuda_dynamic_and_reduce_overhead(gen):
    """torch.compile on CUDA: one frame for 20 lengths (``dynamic=True``) with the eager bits, and
    ``mode="reduce-overhead"`` (Inductor's CUDA graphs) running the fused residual norm."""
    from torch._dynamo.testing import CompileCounterWithBackend

    op = RMSNormFwdOp()
    w = _randn(4096, gen=gen, dtype=torch.bfloat16, scale=0.2, shift=1.0)

    def block(x, r):
        y, h = op(x, w, residual=r)
        return y * 2, h

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(block, fullgraph=True, dynamic=True, backend=counter)
    for seq in range(5, 25):
        x, r = _randn(2, seq, 4096, gen=gen, dtype=torch.bfloat16), _randn(2, seq, 4096, gen=gen, dtype=torch.bfloat16)
        for got, want in zip(compiled(x, r), block(x, r)):
            assert torch.equal(got, want)
    assert counter.frame_count == 1, f"{counter.frame_count} compiles for 20 lengths"
    graphed = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    x, r = _randn(8, 4096, gen=gen, dtype=torch.bfloat16), _randn(8, 4096, gen=gen, dtype=torch.bfloat16)
    for _ in range(3):
        for got, want in zip(graphed(x, r), block(x, r)):
            assert torch.equal(got, want)
