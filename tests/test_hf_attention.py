"""``patch(model, attention=True)``: attention through ``AttnFwdOp`` in tiny Llama, Mistral, Qwen2,
Qwen3, Gemma 2 and Gemma 3 models built from configs (no downloads), against the same models
unpatched with transformers' eager attention (plain fp32 matmuls and softmax) as the reference.

fp32 on the CPU: logits within 1e-5 relative (the op accumulates q.k and p.v in fp32 over at most
40 keys in another order than the reference's matmuls: a few ulps of fp32, 2^-24 each, per layer),
greedy tokens identical (a dynamic cache: prefill, then decode steps whose one query sees the whole
cache; a left-padded batch: the varlen path), and gradients of every weight within 1e-4 relative
(the backward sums over the same keys, twice over). The windows of Mistral, Gemma 2 and 3 are
shorter than the sequences, and Gemma 2 caps its scores, so both reach the op. bf16 on a GPU
(``-m cuda``): within bf16's tolerance.
"""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.test_hf import _rel  # noqa: E402
from tileops.attention.attn_builtin import cuda_enabled  # noqa: E402
from tileops.integrations import transformers as tt  # noqa: E402

#: head_dim 64, a size the op has kernels for; 4 q heads over 2 kv heads: GQA
TINY = dict(vocab_size=128, hidden_size=128, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
WINDOW = 8  # shorter than the 24-token prompts: the window hides keys


def _configs() -> dict:
    T = transformers
    return {
        "llama": lambda: T.LlamaConfig(**TINY),
        "mistral": lambda: T.MistralConfig(**TINY, sliding_window=WINDOW),
        "qwen2": lambda: T.Qwen2Config(**TINY),
        "qwen3": lambda: T.Qwen3Config(**TINY),
        "gemma2": lambda: T.Gemma2Config(**TINY, query_pre_attn_scalar=48, attn_logit_softcapping=5.0,
                                         final_logit_softcapping=None, sliding_window=WINDOW,
                                         layer_types=["sliding_attention", "full_attention"]),
        "gemma3": lambda: T.Gemma3TextConfig(**TINY, query_pre_attn_scalar=64, sliding_window=WINDOW,
                                             layer_types=["sliding_attention", "full_attention"]),
    }


MODELS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
          "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
KINDS = tuple(MODELS)


def _model(kind: str, gen: torch.Generator, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    cfg = _configs()[kind]()
    cfg._attn_implementation = "eager"
    m = getattr(transformers, MODELS[kind])(cfg).eval()
    with torch.no_grad():  # larger scores than the init's, so that the softmax is not near uniform
        for name, p in m.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
    return m.to(device, dtype)


def _patch(model: torch.nn.Module) -> None:
    tt.patch(model, rope=False, norm=False, attention=True)


@pytest.mark.parametrize("kind", KINDS)
def test_logits_and_gradients_match_eager_attention(kind, gen):
    """Prefill logits within 1e-5 and every weight's gradient within 1e-4 of the unpatched model
    (transformers' eager attention), with no call falling back."""
    model = _model(kind, gen).train()
    ids = torch.randint(3, 128, (2, 24), generator=gen)
    want = model(ids).logits
    want.square().mean().backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    _patch(model)
    try:
        got = model(ids).logits
        got.square().mean().backward()
        rep = tt.report(model)
    finally:
        tt.unpatch(model)
    assert rep["attention_fallbacks"] == [] and rep["attention"], rep["attention_fallbacks"]
    rel = _rel(got, want)
    assert rel < 1e-5, f"{kind}: logits differ by {rel:.3g}"
    for n, p in model.named_parameters():
        if n in want_grads:
            rel = _rel(p.grad, want_grads[n])
            assert rel < 1e-4, f"{kind}: {n}.grad differs by {rel:.3g}"


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_greedy_generation_gives_the_unpatched_tokens_left_padded_too(kind, gen):
    """Dynamic-cache greedy generation (prefill, then one query over the cache a step), a full batch
    and a left-padded one (the varlen path): the same tokens as the unpatched model."""
    model = _model(kind, gen)
    ids = torch.randint(3, 128, (3, 20), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding: rows of 20, 15 and 17 tokens
    mask[2, :3] = 0
    ids = ids.masked_fill(mask == 0, 0)
    for m in (torch.ones_like(ids), mask):
        with torch.no_grad():
            want = model.generate(ids, attention_mask=m, max_new_tokens=6, do_sample=False)
        _patch(model)
        try:
            with torch.no_grad():
                got = model.generate(ids, attention_mask=m, max_new_tokens=6, do_sample=False)
            rep = tt.report(model)
        finally:
            tt.unpatch(model)
        assert rep["attention_fallbacks"] == [], rep["attention_fallbacks"]
        assert torch.equal(got, want), f"{kind}: tokens differ:\n{got}\n{want}"


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral", "gemma2", "gemma3"])
def test_static_cache_generation_matches_the_unpatched_logits(kind, gen):
    """A static cache holds more slots than tokens, and transformers drops an all-ones mask: the keys
    past the filled slots must stay hidden. (They were not: the mask function said "no mask" and the
    queries saw the cache's empty slots; the logits moved by ~0.2.) Full batch and left-padded, every
    step's logits within 1e-5 of the unpatched model's. Mistral's and Gemma's sliding layers keep a
    static cache of ``WINDOW`` (8) slots, which the 20-token prompt and 5 steps fill and roll over:
    their mask sizes carry a ``kv_offset``."""
    for want, got, fallbacks in _static_generations(_model(kind, gen), gen, steps=5):
        assert fallbacks == [], fallbacks
        assert torch.equal(got.sequences, want.sequences), f"{kind}: tokens differ"
        for i, (a, b) in enumerate(zip(got.logits, want.logits)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"{kind}: step {i}'s logits")


def _static_generations(model: torch.nn.Module, gen: torch.Generator, steps: int) -> list:
    """Static-cache greedy generations of 2 x 20 tokens, full and with the second row left-padded by 4,
    unpatched then patched: ``(want, got, the patch's fallbacks)`` for each (warnings silenced)."""
    ids = torch.randint(3, 128, (2, 20), generator=gen)
    padded = torch.ones_like(ids)
    padded[1, :4] = 0
    runs = []
    for m in (torch.ones_like(ids), padded):
        def run():
            with torch.no_grad():
                return model.generate(ids, attention_mask=m, max_new_tokens=steps, do_sample=False,
                                      output_logits=True, return_dict_in_generate=True,
                                      cache_implementation="static")
        want = run()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _patch(model)
            try:
                got = run()
                fallbacks = tt.report(model)["attention_fallbacks"]
            finally:
                tt.unpatch(model)
        runs.append((want, got, fallbacks))
    return runs


def test_padded_prefill_logits_match_at_the_real_tokens(gen):
    """A right-padded training batch runs as one varlen call: the real tokens' logits equal the
    unpatched model's (a padded query's output is zero, as transformers' FlashAttention path gives it)."""
    model = _model("qwen3", gen)
    ids = torch.randint(3, 128, (2, 16), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, 11:] = 0
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        _patch(model)
        try:
            got = model(ids, attention_mask=mask).logits
        finally:
            tt.unpatch(model)
    real = mask.bool()
    rel = _rel(got[real], want[real])
    assert rel < 1e-5, f"logits at the real tokens differ by {rel:.3g}"


def test_what_the_op_does_not_serve_runs_transformers_attention_and_says_why_once(gen):
    """Dropout in training and a caller's 4-D mask are not the op's: such calls run transformers'
    sdpa on the mask spelled out, warn once each (naming why), and give sdpa's result."""
    model = _model("llama", gen)
    model.config.attention_dropout = 0.0
    ids = torch.randint(3, 128, (2, 12), generator=gen)
    causal = torch.ones(12, 12, dtype=torch.bool).tril()[None, None].expand(2, 1, 12, 12)
    four_d = torch.zeros(2, 1, 12, 12).masked_fill(~causal, torch.finfo(torch.float32).min)
    with torch.no_grad():
        want = model(ids).logits
    _patch(model)
    try:
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            got = model(ids, attention_mask=four_d).logits
            model(ids, attention_mask=four_d)
        rep = tt.report(model)
    finally:
        tt.unpatch(model)
    ours = [w for w in caught if "tileops" in str(w.message)]
    assert len(ours) == 1 and "a mask that is not causal or sliding-window with padding" in str(ours[0].message), [
        str(w.message) for w in ours]
    assert rep["attention_fallbacks"] == ["a mask that is not causal or sliding-window with padding (packed "
                                          "sequences, a bidirectional block or window, a 4-D or custom mask)"]
    assert _rel(got, want) < 1e-5


def test_unpatch_restores_the_implementation_and_patch_checks_its_arguments(gen):
    model = _model("llama", gen)
    before = model.config._attn_implementation
    _patch(model)
    assert model.config._attn_implementation == "tileops"
    tt.unpatch(model)
    assert model.config._attn_implementation == before
    assert not any(hasattr(m, "_tileops_attention") for m in model.modules())
    with pytest.raises(TypeError, match=r"attention: expected a bool"):
        tt.patch(model, attention=1)
    with pytest.raises(ValueError, match=r"expected at least one of them True"):
        tt.patch(model, rope=False, norm=False, attention=False)
    phi3 = transformers.Phi3ForCausalLM(transformers.Phi3Config(**TINY)).eval()
    with pytest.raises(NotImplementedError, match=r"attention: model type 'phi3' is not served"):
        tt.patch(phi3, rope=False, norm=False, attention=True)
    assert not tt.is_patched(phi3)


def test_patch_builds_every_op_the_layers_ask_for(gen):
    """The ops are built with the model, from what each attention module holds (heads, head size,
    scale, window, softcap): built at a first call inside a compiled forward, an op's construction
    broke the graph there. A forward of each served model asks for no op the patch had not built."""
    for kind in KINDS:
        model = _model(kind, gen)
        _patch(model)
        try:
            built = list(tt.report(model)["attention"])
            with torch.no_grad():
                model(torch.randint(3, 128, (1, 12), generator=gen))
            assert tt.report(model)["attention"] == built and built, (kind, built)
        finally:
            tt.unpatch(model)


def test_compiled_forward_has_no_graph_break(gen):
    """``model.forward`` compiled whole (``fullgraph=True``: a graph break is an error) through the
    op, equal to the eager patched model."""
    model = _model("qwen3", gen)
    ids = torch.randint(3, 128, (1, 16), generator=gen)
    _patch(model)
    try:
        with torch.no_grad():
            eager = model(ids).logits
            torch._dynamo.reset()
            compiled = torch.compile(model.forward, backend="aot_eager", fullgraph=True)
            got = compiled(ids).logits
    finally:
        torch._dynamo.reset()
        tt.unpatch(model)
    assert _rel(got, eager) < 1e-6


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_enabled(backward=True),
                    reason="TILEOPS_ATTENTION_CUDA=0 refuses the attention backward's CUDA kernels")
@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen3", "gemma2", "gemma3"])
def test_bf16_on_the_gpu_matches_within_bf16(kind, gen):
    """bf16 on the GPU: prefill logits within 3e-2 of the unpatched model's (2-3 roundings of 2^-8 a
    layer, as tests/test_hf.py's bf16 comparison) and the gradients of the attention weights within
    5e-2 (the backward's products are rounded to bf16 once more)."""
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU (none here)")
    model = _model(kind, gen, torch.bfloat16, "cuda").train()
    ids = torch.randint(3, 128, (2, 40), generator=gen).cuda()
    want = model(ids).logits.float()
    want.square().mean().backward()
    want_grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None and "proj" in n}
    model.zero_grad()
    _patch(model)
    try:
        got = model(ids).logits.float()
        got.square().mean().backward()
        rep = tt.report(model)
    finally:
        tt.unpatch(model)
    assert rep["attention_fallbacks"] == [], rep["attention_fallbacks"]
    assert _rel(got, want) < 3e-2
    for n, p in model.named_parameters():
        if n in want_grads:
            assert _rel(p.grad.float(), want_grads[n]) < 5e-2, n


def test_a_model_sharing_the_patched_models_config_keeps_its_results(gen):
    """The implementation is a config attribute, and models built from one config object share it:
    the unpatched one then reaches the registered function, which runs transformers' sdpa on the
    spelled-out mask (window included) and says so once; its logits are what they were."""
    model = _model("mistral", gen)
    other = transformers.MistralForCausalLM(model.config).eval()
    other.load_state_dict(model.state_dict())
    ids = torch.randint(3, 128, (1, 20), generator=gen)
    with torch.no_grad():
        want = other(ids).logits
    _patch(model)
    try:
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            got = other(ids).logits
    finally:
        tt.unpatch(model)
    assert _rel(got, want) < 1e-5
    ours = [str(w.message) for w in caught if "tileops" in str(w.message)]
    assert len(ours) <= 1 and all("sharing a patched model's config" in m for m in ours), ours


def test_cuda_training_falls_back_when_the_variable_refuses_the_backward(monkeypatch):
    """On CUDA the op serves prefill, generation and training; with ``TILEOPS_ATTENTION_CUDA=0`` a call
    whose gradient will be taken goes to transformers' attention, saying why
    (``tileops.attention.attn_builtin.cuda_enabled``). Decided from the tensors alone: a stand-in for a
    CUDA tensor (this machine has no GPU)."""
    from types import SimpleNamespace

    from tileops.integrations import transformers_attention as ta

    monkeypatch.setenv("TILEOPS_ATTENTION_CUDA", "0")

    def q(grad):
        return SimpleNamespace(is_cuda=True, shape=(1, 4, 8, 64), dtype=torch.bfloat16, requires_grad=grad)

    frozen, trained = q(False), q(True)
    assert ta._unserved(None, frozen, None, 0.0, True, None, (frozen, frozen, frozen)) is None
    why = ta._unserved(None, trained, None, 0.0, True, None, (trained, frozen, frozen))
    assert why is not None and why.startswith("CUDA gradients")
    with torch.no_grad():
        assert ta._unserved(None, trained, None, 0.0, True, None, (trained, trained, trained)) is None
    monkeypatch.setenv("TILEOPS_ATTENTION_CUDA", "1")
    assert ta._unserved(None, trained, None, 0.0, True, None, (trained, frozen, frozen)) is None


#: the reason a call whose mask transformers composed beyond causal, window and padding is given
COMPOSED = ("a mask that is not causal or sliding-window with padding (packed sequences, a bidirectional block or "
            "window, a 4-D or custom mask)")
HOLE = "a sliding window over a padding mask with a hole (a masked token between two real ones)"


def _patched_logits(model: torch.nn.Module, **inputs) -> tuple[torch.Tensor, list]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _patch(model)
        try:
            with torch.no_grad():
                got = model(**inputs).logits
            return got, tt.report(model)["attention_fallbacks"]
        finally:
            tt.unpatch(model)


def test_packed_documents_stay_apart(gen):
    """One row of two documents, positions restarting at the second and no mask (a flattening
    collator's batch): transformers keeps them apart (``find_packed_sequence_indices``), a pattern
    the op's arguments do not express, so the call gets transformers' mask and attention. (It did
    not: the second document attended to the first, its logits 1.04 relative off, no warning.)"""
    model = _model("llama", gen)
    ids = torch.randint(3, 128, (1, 24), generator=gen)
    pos = torch.cat([torch.arange(10), torch.arange(14)])[None]
    with torch.no_grad():
        want = model(ids, position_ids=pos, use_cache=False).logits
        apart = torch.cat([model(ids[:, :10], use_cache=False).logits, model(ids[:, 10:], use_cache=False).logits], 1)
    assert _rel(want, apart) < 1e-5  # what transformers does: each document on its own
    got, fallbacks = _patched_logits(model, input_ids=ids, position_ids=pos, use_cache=False)
    assert fallbacks == [COMPOSED]
    assert _rel(got, want) < 1e-5


def test_a_bidirectional_window_gets_transformers_mask(gen):
    """Gemma 3 with ``use_bidirectional_attention``: its sliding layers see ``|i - j|`` within the
    window both ways (an or-mask on the causal one). The fallback once spelled out ``j > i - w``
    instead, every later key visible: logits 0.97 relative off under a warning that promised
    transformers' attention."""
    cfg = transformers.Gemma3TextConfig(**TINY, query_pre_attn_scalar=64, sliding_window=4,
                                        layer_types=["sliding_attention", "full_attention"],
                                        use_bidirectional_attention=True)
    cfg._attn_implementation = "eager"
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    ids = torch.randint(3, 128, (2, 16), generator=gen)
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
    got, fallbacks = _patched_logits(model, input_ids=ids, use_cache=False)
    assert fallbacks == [COMPOSED]
    assert _rel(got, want) < 1e-5


@pytest.mark.parametrize("kind", ["mistral", "gemma3", "llama"])
def test_a_window_over_a_mask_with_a_hole(kind, gen):
    """A mask with zeros between ones (a left-padded turn appended to a batch's first turn): the
    varlen path drops the masked tokens, which moves the later keys closer to the queries, and a
    window counts positions. A windowed layer's such call runs transformers' attention (it once ran
    the op, 0.92 relative off at the real tokens); a layer without a window keeps the op, whose
    causal order the dropped tokens do not change."""
    model = _model(kind, gen)
    ids = torch.randint(3, 128, (2, 20), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, 3:6] = 0
    with torch.no_grad():
        want = model(ids, attention_mask=mask, use_cache=False).logits
    got, fallbacks = _patched_logits(model, input_ids=ids, attention_mask=mask, use_cache=False)
    assert fallbacks == ([] if kind == "llama" else [HOLE])
    real = mask.bool()
    assert _rel(got[real], want[real]) < 1e-5


def test_a_fallback_on_a_static_cache_keeps_the_causal_order(gen):
    """head_dim 16 is not the op's: every call runs transformers' attention on the mask spelled out.
    On a static cache the keys run past the filled slots; the queries are the last of the filled
    ones. Aligned at the end of all the slots instead, a prefill's queries saw each other's keys
    both ways: logits up to 0.67 off, tokens changed. Every step within 1e-5, full and left-padded."""
    cfg = transformers.LlamaConfig(**{**TINY, "hidden_size": 64, "head_dim": 16})
    cfg._attn_implementation = "eager"
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = transformers.LlamaForCausalLM(cfg).eval()
    for want, got, fallbacks in _static_generations(model, gen, steps=4):
        assert fallbacks == ["head_dim 16 (served: 64, 80, 96, 128, 256)"]
        assert torch.equal(got.sequences, want.sequences)
        for i, (a, b) in enumerate(zip(got.logits, want.logits)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"step {i}'s logits")


def test_gemma3_image_tokens_keep_their_bidirectional_block(gen):
    """Gemma 3's image tokens see each other both ways (an or-mask from ``token_type_ids``), which the
    op's arguments do not express: transformers' mask and attention serve such a call. Its vision
    tower, a module the patch does not own, reaches the same function with an ``is_causal`` of its
    own (which crashed: given twice). Logits within 1e-5 of the unpatched model, image included."""
    T = transformers
    text = dict(TINY, query_pre_attn_scalar=64, sliding_window=WINDOW, layer_types=["sliding_attention",
                                                                                     "full_attention"])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=7)
    cfg = T.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=100,
                         boi_token_index=101, eoi_token_index=102)
    cfg._attn_implementation = "eager"
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = T.Gemma3ForConditionalGeneration(cfg).eval()
    ids = torch.randint(3, 99, (1, 14), generator=gen)
    ids[0, 4], ids[0, 9] = 101, 102
    ids[0, 5:9] = 100  # <boi>, four image tokens, <eoi>
    pixels = torch.randn(1, 3, 28, 28, generator=gen)
    inputs = dict(input_ids=ids, pixel_values=pixels, token_type_ids=(ids == 100).long())
    with torch.no_grad():
        want = model(**inputs).logits
        causal = model(input_ids=ids, pixel_values=pixels).logits
    assert _rel(causal[:, 5:9], want[:, 5:9]) > 1e-3  # the block matters at the image's tokens
    got, fallbacks = _patched_logits(model, **inputs)
    assert COMPOSED in fallbacks
    assert _rel(got, want) < 1e-5


def test_the_fallback_refuses_to_spell_out_a_bidirectional_window():
    """transformers' bidirectional windows differ by model (Gemma 3: ``|i - j| < w``; its generic overlay:
    ``<= w``), so the fallback never builds one itself (it once built ``j > i - w``, every later key
    visible): without transformers' own 4-D mask such a call is refused, naming why."""
    from tileops.integrations.transformers_attention import attention_forward

    module = torch.nn.Module()
    module.is_causal = False
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 4, 6, 64, generator=g), torch.randn(1, 2, 6, 64, generator=g)
    for mask in (None, torch.ones(1, 6, dtype=torch.bool)):
        with pytest.raises(NotImplementedError, match=r"a sliding window without the causal mask needs "
                                                      r"transformers' own 4-D mask; got (no mask|a 2-D padding mask)"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                attention_forward(module, q, k, k, mask, sliding_window=3)
