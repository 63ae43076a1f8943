"""Hugging Face RMSNorm modules routed through tileops.norm.RMSNormFwdOp by
``tileops.integrations.transformers.patch(model, rope=..., norm=...)``, on tiny random models and
single modules (no downloads).

HF's own modules are the reference: a patched model against the same model unpatched (fp32 logits,
greedy generations, gradients of the projections and the norm weights), and each served class's
``forward`` against the patched module on 16-bit inputs, element by element (bit-exact on >= 99.9%
of elements on the CPU's C kernels, none more than 2 units in the last place of x's dtype off).
"""

from __future__ import annotations

import importlib
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tileops.integrations import transformers as tt  # noqa: E402
from tileops.integrations import transformers_norm as tn  # noqa: E402

try:
    from test_hf import _compare, _model
except ImportError:  # run from the repo root
    from tests.test_hf import _compare, _model

#: each served class's modeling module (``transformers.models.<m>.modeling_<m>``)
CLASS_MODULES = {"LlamaRMSNorm": "llama", "MistralRMSNorm": "mistral", "Qwen2RMSNorm": "qwen2",
                 "Qwen3RMSNorm": "qwen3", "Phi3RMSNorm": "phi3", "Qwen2VLRMSNorm": "qwen2_vl",
                 "Qwen2_5_VLRMSNorm": "qwen2_5_vl", "Qwen3VLTextRMSNorm": "qwen3_vl", "GemmaRMSNorm": "gemma",
                 "Gemma2RMSNorm": "gemma2", "Gemma3RMSNorm": "gemma3", "Olmo2RMSNorm": "olmo2"}
assert set(CLASS_MODULES) == set(tt.RMSNORM_CLASSES)


def _hf_class(name: str) -> type:
    pkg = CLASS_MODULES[name]
    try:
        mod = importlib.import_module(f"transformers.models.{pkg}.modeling_{pkg}")
    except ImportError:
        pytest.skip(f"transformers {transformers.__version__} has no {pkg}")
    return getattr(mod, name)


class _Holder(torch.nn.Module):
    """A module with a config (what patch asks of a model) holding the modules under test."""

    def __init__(self, **modules: torch.nn.Module) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(model_type="holder")
        for name, m in modules.items():
            setattr(self, name, m)


def _norm(name: str, hidden: int, gen: torch.Generator, weight_dtype=torch.float32) -> torch.nn.Module:
    """An instance of HF class ``name`` with a random weight around its init (ones, Gemma zeros)
    and eps 1e-5 or 1e-6."""
    eps = (1e-5, 1e-6)[int(torch.randint(0, 2, (1,), generator=gen))]
    m = _hf_class(name)(hidden, eps)
    with torch.no_grad():
        m.weight.add_(torch.randn(hidden, generator=gen) * 0.5)
    return m.to(weight_dtype)


def _ulps(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """|got - want| in units of the last place of ``dtype`` at |want| (bf16's 2^-7 at 1.0)."""
    d = (got.double() - want.double()).abs()
    mag = want.double().abs().clamp_min(torch.finfo(dtype).tiny)
    return d / (torch.exp2(torch.floor(torch.log2(mag))) * torch.finfo(dtype).eps)


def _agree(got: torch.Tensor, want: torch.Tensor, x_dtype: torch.dtype, what: str) -> float:
    """The same dtype and strides as HF's output, and its values: fp32 within 2e-6 relative, 16-bit
    bit-exact on >= 99.9% of elements and within 2 ulps of x's dtype everywhere. Returns the fraction
    bit-exact."""
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape)
    assert got.stride() == want.stride(), (what, got.stride(), want.stride())
    assert torch.isfinite(got).all(), what
    if x_dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6 * float(want.abs().max()), msg=what)
        return float((got == want).double().mean())
    same = float((got == want).double().mean())
    worst = float(_ulps(got, want, x_dtype).max())
    assert same >= 0.999 and worst <= 2, (what, same, worst)
    return same


# (x dtype, weight dtype): a 16-bit model, mixed precision (fp32 weights, 16-bit activations), fp32
DTYPE_PAIRS = [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float16, torch.float16),
               (torch.float32, torch.float32)]


@pytest.mark.parametrize("name", sorted(tt.RMSNORM_CLASSES))
def test_each_class_matches_its_own_forward(name, gen):
    """Every served class against its own forward, for each dtype pairing (with Llama's form an fp32
    weight and a bf16 x give fp32, as torch's promotion does in HF's module), and the weight's
    and x's gradients in fp32."""
    mods = {f"n{i}": _norm(name, 184, gen, wd) for i, (_, wd) in enumerate(DTYPE_PAIRS)}
    xs = [(torch.randn(3, 100, 184, generator=gen) * 3).to(xd) for xd, _ in DTYPE_PAIRS]
    with torch.no_grad():
        want = [mods[f"n{i}"](x) for i, x in enumerate(xs)]
    holder = _Holder(**mods)
    tt.patch(holder, rope=False)
    try:
        assert tt.report(holder)["norm"] == {name: len(mods)}
        with torch.no_grad():
            got = [mods[f"n{i}"](x.clone()) for i, x in enumerate(xs)]
        for i, (xd, wd) in enumerate(DTYPE_PAIRS):
            _agree(got[i], want[i], xd, f"{name} x {xd} weight {wd}")
        # fp32 gradients: the weight's summed over rows on the device, x's
        m, x = mods["n3"], xs[3]
        g = torch.randn(x.shape, generator=gen)
        x1 = x.clone().requires_grad_()
        (m(x1) * g).sum().backward()
        patched = (x1.grad, m.weight.grad.clone())
    finally:
        tt.unpatch(holder)
    m.weight.grad = None
    x2 = x.clone().requires_grad_()
    (m(x2) * g).sum().backward()
    torch.testing.assert_close(patched[0], x2.grad, rtol=1e-5, atol=1e-5 * float(x2.grad.abs().max()))
    torch.testing.assert_close(patched[1], m.weight.grad, rtol=1e-5, atol=1e-5 * float(m.weight.grad.abs().max()))


def _recording(ops: list) -> list:
    """Make each op record the x it is given: (data_ptr, shape, stride)."""
    seen: list = []
    for op in ops:
        real = op.forward
        op.forward = lambda x, *a, _real=real, **k: (seen.append((x.data_ptr(), tuple(x.shape), x.stride())),
                                                     _real(x, *a, **k))[1]
    return seen


@pytest.mark.parametrize("name, transposed", [("Qwen3RMSNorm", False), ("Gemma3RMSNorm", True)])
def test_per_head_norms_take_their_views_without_copies(name, transposed, gen):
    """Qwen3 norms q and k per head as ``[batch, seq, heads, head_dim]`` views of the projections;
    Gemma 3 as their ``[batch, heads, seq, head_dim]`` transposes. Either reaches the op as a view of
    the projection's memory (Gemma 3's with its leading dims put back in memory order, so that its
    rows lie at two strides), and the output has HF's values, dtype and strides."""
    m = _norm(name, 64, gen, torch.bfloat16)
    proj = (torch.randn(2, 40, 6 * 64, generator=gen) * 2).to(torch.bfloat16)
    x = proj.view(2, 40, 6, 64)
    if transposed:
        x = x.transpose(1, 2)
    with torch.no_grad():
        want = m(x)
    holder = _Holder(norm=m)
    tt.patch(holder, rope=False)
    try:
        seen = _recording(tt.report(holder)["norm_ops"])
        with torch.no_grad():
            got = m(x)
    finally:
        tt.unpatch(holder)
    assert len(seen) == 1 and seen[0][0] == proj.data_ptr(), seen
    assert seen[0][1:] == ((2, 40, 6, 64), (40 * 384, 384, 64, 1)), seen
    _agree(got, want, torch.bfloat16, name)


def test_calls_the_op_does_not_take_run_transformers_forward(gen):
    """A bf16 weight with an fp32 x (HF promotes: fp32 out), or a float64 x: the op takes neither,
    and the module computes what it computed before, through its own forward."""
    m = _norm("LlamaRMSNorm", 64, gen, torch.bfloat16)
    g = _norm("GemmaRMSNorm", 64, gen, torch.float32)
    xs = [torch.randn(5, 64, generator=gen), torch.randn(5, 64, generator=gen, dtype=torch.float64)]
    with torch.no_grad():
        want = [m(xs[0]), g(xs[1])]
    holder = _Holder(m=m, g=g)
    tt.patch(holder, rope=False)
    try:
        seen = _recording(tt.report(holder)["norm_ops"])
        with torch.no_grad():
            got = [m(xs[0]), g(xs[1])]
            m(xs[0].to(torch.bfloat16))  # and a call it does take goes to the op
    finally:
        tt.unpatch(holder)
    assert len(seen) == 1
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)


# Mistral computes Llama's form, Gemma 1/2 Gemma 3's: measured 5-9 s each on 2 cores, slow
@pytest.mark.parametrize("kind, rope", [("qwen3", True), ("gemma3", False), ("olmo2", False), ("llama-default", False),
                                        *(pytest.param(k, r, marks=pytest.mark.slow)
                                          for k, r in (("mistral", True), ("gemma", False), ("gemma2", False)))])
def test_norm_patched_model_matches_transformers(kind, rope):
    """fp32 on the CPU: logits within 1e-5 relative, greedy generations (16 tokens, also left padded)
    identical, gradients of the projections and every norm weight within 1e-4; RoPE too where it
    is served. (The RoPE model types of test_hf run with both parts, the default.)"""
    _compare(kind, torch.float32, "cpu", 1e-5, 1e-4, rope=rope, norm=True)


def test_rope_only_patch_leaves_the_norms_alone():
    """``norm=False`` is the RoPE patch as it was: no norm module is touched."""
    model = _model("qwen3")
    tt.patch(model, norm=False)
    try:
        rep = tt.report(model)
        assert rep["rope"] is not None and rep["norm"] == {} and rep["norm_ops"] == []
        assert not any("forward" in m.__dict__ for m in model.modules() if tn.norm_form(m) is not None)
    finally:
        tt.unpatch(model)


@pytest.mark.slow  # 5 s on 2 cores
def test_rope_only_patch_matches_transformers():
    _compare("llama-default", torch.float32, "cpu", 1e-5, 1e-4, rope=True, norm=False)


@pytest.mark.cuda
@pytest.mark.parametrize("kind, rope", [("llama-default", True), ("mistral", True), ("qwen3", True), ("phi3-long", True),
                                        ("gemma", False), ("gemma2", False), ("gemma3", False), ("olmo2", False)])
def test_norm_patched_model_matches_transformers_bf16_cuda(kind, rope):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _compare(kind, torch.bfloat16, "cuda", 3e-2, 5e-2, rope=rope, norm=True)


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(tt.RMSNORM_CLASSES))
def test_each_class_matches_its_own_forward_bf16_cuda(name):
    """On the GPU the op's row sums are added in another order than torch's, and rsqrt is the
    hardware's approximation: >= 99% bit-exact, no element more than 2 ulps off."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    gen = torch.Generator().manual_seed(11)
    for xd, wd in DTYPE_PAIRS[:3]:
        m = _norm(name, 4096, gen, wd).cuda()
        x = (torch.randn(4, 512, 4096, generator=gen) * 3).to(xd).cuda()
        with torch.no_grad():
            want = m(x)
            holder = _Holder(norm=m)
            tt.patch(holder, rope=False)
            try:
                got = m(x)
            finally:
                tt.unpatch(holder)
        assert got.dtype == want.dtype and got.stride() == want.stride()
        same = float((got == want).double().mean())
        worst = float(_ulps(got, want, xd).max())
        assert same >= 0.99 and worst <= 2, (name, xd, wd, same, worst)


# ----------------------------------------------------------------------------------- patch / unpatch
def test_unpatch_restores_the_same_forward_objects():
    """Every module's instance ``forward`` is what it was: absent (the class's), or the object a
    module had before (someone else's wrapper, which a routed call no longer reaches while patched)."""
    model = _model("qwen3")
    theirs = model.model.norm.forward  # a bound method, set as an instance attribute by someone else
    model.model.norm.forward = theirs
    before = {id(m): m.__dict__.get("forward") for m in model.modules()}
    classes = {type(m): type(m).forward for m in model.modules()}
    for rope, norm in ((True, True), (False, True), (True, False)):
        tt.patch(model, rope=rope, norm=norm)
        assert ("forward" in model.model.layers[0].self_attn.q_norm.__dict__) == norm
        assert model.model.norm.forward is not theirs or not norm
        tt.unpatch(model)
        assert {id(m): m.__dict__.get("forward") for m in model.modules()} == before
        assert model.model.norm.__dict__["forward"] is theirs
        assert all(cls.forward is f for cls, f in classes.items())


def test_patch_twice_and_through_another_module_is_refused():
    model = _model("gemma2")
    tt.patch(model, rope=False)
    try:
        for kw in ({}, {"rope": False}, {"norm": False}):
            with pytest.raises(ValueError, match="already patched"):
                tt.patch(model, **kw)
        with pytest.raises(ValueError, match=r"Gemma2RMSNorm is already patched \(through another module\)"):
            tt.patch(model.model, rope=False)
    finally:
        tt.unpatch(model)
    with pytest.raises(ValueError, match="expected a model patched by tileops"):
        tt.unpatch(model)
    with pytest.raises(ValueError, match="expected a model patched by tileops"):
        tt.report(model)


def test_bad_choices_and_unserved_models_are_refused_before_anything_changes():
    model = _model("gemma3")
    with pytest.raises(NotImplementedError, match=r"'gemma3_text'.*not served for RoPE.*patch\(model, rope=False\)"):
        tt.patch(model)  # rope=True by default: Gemma 3's per-layer-type rope is not served
    with pytest.raises(ValueError, match="rope, norm, attention: expected at least one of them True"):
        tt.patch(model, rope=False, norm=False)
    with pytest.raises(TypeError, match="norm: expected a bool, got int 1"):
        tt.patch(model, rope=False, norm=1)
    model.model.norm.eps = "1e-6"
    with pytest.raises(NotImplementedError, match=r"Gemma3RMSNorm.eps: expected a number.*got str"):
        tt.patch(model, rope=False)
    assert not tt.is_patched(model) and not any("forward" in m.__dict__ for m in model.modules())
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64))
    with pytest.raises(NotImplementedError, match=r"norm: 'gpt2' .* no RMSNorm module of a served class "
                                                  r"\(found LayerNorm\)"):
        tt.patch(gpt2, rope=False)


def test_report_and_classes_left_alone(gen):
    """A subclass of a served class, or a class of the same name outside transformers, may compute
    something else: left alone, and reported as such with the model's other norms."""

    class LlamaRMSNorm(_hf_class("LlamaRMSNorm")):  # same name, this module's
        pass

    mine = LlamaRMSNorm(64)
    holder = _Holder(a=_norm("LlamaRMSNorm", 64, gen), b=_norm("Qwen3RMSNorm", 64, gen), mine=mine,
                     ln=torch.nn.LayerNorm(64))
    tt.patch(holder, rope=False)
    try:
        rep = tt.report(holder)
        assert rep["rope"] is None and rep["norm"] == {"LlamaRMSNorm": 1, "Qwen3RMSNorm": 1}
        assert rep["left_alone"] == {"LlamaRMSNorm": 1, "LayerNorm": 1}
        # eps 1e-5 and 1e-6 may be drawn: one op per (eps, offset, rounding, out_dtype)
        keys = {(op.params["eps"], op.params["rounding"], op.params["out_dtype"]) for op in rep["norm_ops"]}
        assert len(keys) == len(rep["norm_ops"]) and {k[2] for k in keys} == {None, "float32"}
        assert "forward" not in mine.__dict__ and "forward" not in holder.ln.__dict__
    finally:
        tt.unpatch(holder)
    model = _model("qwen2_vl")  # the vision tower's LayerNorms stay transformers'
    tt.patch(model)
    try:
        rep = tt.report(model)
        assert rep["norm"] == {"Qwen2VLRMSNorm": 2 * 2 + 1} and rep["left_alone"] == {"LayerNorm": 2 + 1}, rep
    finally:
        tt.unpatch(model)
