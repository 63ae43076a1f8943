"""``patch(model, prologue=True)``: q/k norm, RoPE and the static-cache write as one call of
``AttnPrologueFwdOp`` in tiny Llama, Mistral, Qwen2 and Qwen3 models (no downloads), against the
same models unpatched (transformers' own attention is the reference).

fp32 on the CPU: greedy generation gives the same tokens, and the static caches hold the same keys
and values (within fp32 rounding: the op's norm sums and rotates in another order than torch);
eagerly and with ``model.forward`` compiled (``aot_eager``, ``fullgraph=True``). bf16 on a GPU
(``-m cuda``): Llama, Qwen2 and Qwen3 eagerly, Qwen3 compiled by Inductor, within bf16's tolerance.
"""

from __future__ import annotations

import contextlib
import operator
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.cache_utils import StaticLayer  # noqa: E402

from tests.test_hf import _rel  # noqa: E402
from tileops.integrations import transformers as tt  # noqa: E402

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
HEAD_DIM = 16
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**TINY, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                     "original_max_position_embeddings": 64,
                                                                     "rope_theta": 5000.0}),
    "mistral": lambda: transformers.MistralConfig(**TINY, sliding_window=None),  # a window: HF's attention
    "qwen2": lambda: transformers.Qwen2Config(**TINY, rope_theta=20000.0),
    "qwen3": lambda: transformers.Qwen3Config(**TINY, head_dim=HEAD_DIM),
}
MODELS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
          "qwen3": "Qwen3ForCausalLM"}


def _model(kind: str, gen: torch.Generator, config=None) -> torch.nn.Module:
    """A tiny ``kind`` model of ``config`` (default ``CONFIGS[kind]()``), its weights from ``gen``."""
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    m = getattr(transformers, MODELS[kind])(config or CONFIGS[kind]()).eval()
    with torch.no_grad():  # norms' weights away from 1, so that a weight the op ignored would show
        for mod in m.modules():
            if type(mod).__name__.endswith("RMSNorm"):
                mod.weight.add_(torch.randn(mod.weight.shape, generator=gen) * 0.3)
    return m


def _generate_output(model: torch.nn.Module, ids: torch.Tensor, new: int = 8, **extra):
    """Greedy static-cache generation of ``new`` tokens: transformers' whole output."""
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                          cache_implementation="static", return_dict_in_generate=True, **extra)


def _generate(model: torch.nn.Module, ids: torch.Tensor, new: int = 8, **extra):
    out = _generate_output(model, ids, new, **extra)
    return out.sequences, out.past_key_values


def _assert_same_caches(got_cache, want_cache, length: int) -> None:
    for a, b in zip(got_cache.layers, want_cache.layers, strict=True):
        assert int(a.cumulative_length) == int(b.cumulative_length) == length
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
        # v is copied, never computed (tests/test_attention_prologue.py checks the bits), but of
        # hidden states that differ from HF's in fp32's last bits: the routed input RMSNorm sums in
        # another order, and a later layer's input went through the attention above it
        torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)
        assert not a.keys[:, :, length:].any() and not a.values[:, :, length:].any()  # nothing past the tokens


class _Updates:
    """Counts HF's StaticLayer.update calls (the unfused cache write)."""

    def __init__(self, monkeypatch) -> None:
        self.n = 0
        original = StaticLayer.update

        def update(layer, *a, **k):
            self.n += 1
            return original(layer, *a, **k)

        monkeypatch.setattr(StaticLayer, "update", update)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_static_generate_gives_the_unpatched_tokens_and_caches(kind, gen, monkeypatch):
    model = _model(kind, gen)
    ids = torch.randint(3, 128, (2, 11), generator=gen)
    want, want_cache = _generate(model, ids)
    tt.patch(model, prologue=True)
    try:
        updates = _Updates(monkeypatch)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no call may fall back to transformers' attention
            got, got_cache = _generate(model, ids)
        rep = tt.report(model)
    finally:
        tt.unpatch(model)
    assert updates.n == 0, f"{updates.n} cache writes went through transformers' StaticLayer.update"
    assert rep["prologue_fallbacks"] == [] and len(rep["prologue"]) == 1
    assert rep["prologue"][0].params["qk_norm"] == (kind == "qwen3")
    _assert_served_from_bindings(rep["prologue"][0])
    assert torch.equal(got, want), (got, want)
    _assert_same_caches(got_cache, want_cache, ids.shape[1] + 8 - 1)  # the last token generated is never fed back


def _assert_served_from_bindings(op) -> None:
    """With the native runtime, most of the op's calls (every layer's, every decode step's, all of
    one call signature or two) were served from its bindings, without Python: the general path ran
    once per signature (a stride-0 positions view, say, would send every call there)."""
    from tileops.runtime import native

    if native.module is not None:
        stats = op._runtime.stats()
        assert stats["misses"] <= 4 < stats["hits"], stats


class _AotEager:
    """A compile backend: ``aot_eager`` (AOTAutograd over the ops' fake registrations, then eager
    kernels) on each graph Dynamo captures, which it keeps."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs) -> object:
        self.graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


@contextlib.contextmanager
def _forward_compiled(model: torch.nn.Module, backend: object = "inductor"):
    """``model.forward`` compiled whole (``fullgraph=True``) by ``backend`` inside the block, the
    model's own forward and a fresh Dynamo after it."""
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend=backend, fullgraph=True)
    try:
        yield
    finally:
        del model.forward
        torch._dynamo.reset()


def _compiled_generate(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, object, list]:
    """``_generate`` with ``model.forward`` compiled whole (no HF compile of its own): the tokens,
    the static cache and the graphs compiled."""
    backend = _AotEager()
    with _forward_compiled(model, backend), torch.no_grad():
        tokens, cache = _generate(model, ids, disable_compile=True)
    return tokens, cache, backend.graphs


def _in_place(graph: torch.fx.GraphModule) -> list[str]:
    """The in-place tensor methods and item assignments a Dynamo graph calls (HF's cache write is
    ``index_copy_``; each static layer's length counter moves by ``add_``)."""
    return [str(n.target) for n in graph.graph.nodes
            if (n.op == "call_method" and str(n.target).endswith("_")) or n.target is operator.setitem]


def test_compiled_static_generate_gives_the_unpatched_tokens_through_the_fused_op(gen):
    """The issue's check under torch.compile: a Qwen3 with q_norm/k_norm, ``model.forward`` compiled
    whole, greedy static-cache generation in fp32 gives exactly the unpatched model's tokens, and the
    caches the same keys and values. The fused op ran: each graph (prefill, decode) calls it once per
    layer and writes the cache by no other means (the unpatched graphs' writes are transformers'),
    so the keys and values compared were written by it."""
    model = _model("qwen3", gen)
    layers = model.config.num_hidden_layers
    ids = torch.randint(3, 128, (2, 11), generator=gen)
    want, want_cache, plain = _compiled_generate(model, ids)
    tt.patch(model, prologue=True)
    try:
        got, got_cache, graphs = _compiled_generate(model, ids)
        op = tt.report(model)["prologue"][0]
    finally:
        tt.unpatch(model)
    assert torch.equal(got, want), (got, want)
    _assert_served_from_bindings(op)  # tileops::apply_out, from the graphs
    assert len(graphs) == len(plain) == 2  # prefill and decode, recompiled by neither at later steps
    for g in graphs:
        calls = [n for n in g.graph.nodes if n.op == "call_function" and "tileops" in str(n.target)]
        assert [n.args[0] for n in calls] == [op._handle] * layers, [(n.target, n.args[0]) for n in calls]
        assert _in_place(g) == ["add_"] * layers, _in_place(g)
    for g in plain:  # what the check above would see of transformers' own write
        writes = [t for t in _in_place(g) if t != "add_"]
        assert len(writes) >= 2 * layers, _in_place(g)
    _assert_same_caches(got_cache, want_cache, ids.shape[1] + 8 - 1)


def test_a_dynamic_cache_runs_transformers_attention_and_says_so_once(gen):
    model = _model("qwen3", gen)
    ids = torch.randint(3, 128, (1, 7), generator=gen)
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    tt.patch(model, prologue=True)
    try:
        with pytest.warns(RuntimeWarning, match=r"prologue: DynamicCache with a .*runs transformers' attention") as rec:
            got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
        assert len([w for w in rec if "prologue" in str(w.message)]) == 1
        assert any("DynamicCache" in why for why in tt.report(model)["prologue_fallbacks"])
    finally:
        tt.unpatch(model)
    assert torch.equal(got, want)


def test_tokens_past_the_static_cache_are_reported_not_written_into_the_next_sequence(gen):
    """HF's own write raises past max_cache_len; the fused layer gives those tokens a slot past the
    whole cache, which the op reports as a bad slot_mapping and never writes (row b's overflow
    would otherwise land in row b + 1's block)."""
    model = _model("llama", gen)
    tt.patch(model, prologue=True)
    try:
        cache = transformers.StaticCache(config=model.config, max_cache_len=8)
        ids = torch.randint(3, 128, (2, 6), generator=gen)
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
            before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
            op = tt.report(model)["prologue"][0]
            with pytest.raises(Exception, match="slot_mapping"):
                model(ids, past_key_values=cache, use_cache=True)  # tokens 6..11 of a cache of 8
                op.check()
        for (k0, v0), layer in zip(before, cache.layers):
            # rows 6 and 7 of each sequence are written, nothing of the next sequence's block moved
            assert torch.equal(layer.keys[:, :, :6], k0[:, :, :6]) and torch.equal(layer.values[:, :, :6], v0[:, :, :6])
    finally:
        tt.unpatch(model)


def test_projections_are_one_matmul_unless_a_hook_or_a_subclass_must_run(gen):
    """q/k/v are projected by one matmul of the concatenated weights (and biases: Qwen2's), giving the
    three projections' values; a forward hook on a projection is still called (that layer calls the
    modules), and a Linear subclass's own forward runs, not its weight through F.linear."""
    from tileops.integrations.transformers_prologue import project_qkv

    for kind in ("qwen2", "qwen3"):
        attn = _model(kind, gen).model.layers[0].self_attn
        hidden = torch.randn(2, 3, TINY["hidden_size"], generator=gen)
        want = torch.cat([attn.q_proj(hidden), attn.k_proj(hidden), attn.v_proj(hidden)], -1)
        torch.testing.assert_close(project_qkv(attn, hidden), want, rtol=1e-6, atol=1e-6)
    seen = []
    handle = attn.k_proj.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    try:
        torch.testing.assert_close(project_qkv(attn, hidden), want, rtol=1e-6, atol=1e-6)
    finally:
        handle.remove()
    assert seen == [torch.Size([2, 3, attn.k_proj.out_features])], seen  # called once, on its own output

    class Doubled(torch.nn.Linear):  # computes otherwise from its weight, as a quantized linear does
        def forward(self, x):
            return 2 * super().forward(x)

    doubled = Doubled(attn.v_proj.in_features, attn.v_proj.out_features, bias=attn.v_proj.bias is not None)
    doubled.load_state_dict(attn.v_proj.state_dict())
    attn.v_proj = doubled
    v = want.shape[-1] - doubled.out_features
    got = project_qkv(attn, hidden)
    torch.testing.assert_close(got[..., :v], want[..., :v], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[..., v:], 2 * want[..., v:], rtol=1e-6, atol=1e-6)


def test_a_sliding_window_layer_runs_transformers_attention(gen):
    """Mistral's default config has a window (4096): its static cache holds sliding-window layers,
    which the fused layer does not write (their slots wrap), so those calls are HF's."""
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = transformers.MistralForCausalLM(transformers.MistralConfig(**TINY)).eval()
    ids = torch.randint(3, 128, (1, 5), generator=gen)
    want, _ = _generate(model, ids, 3)
    tt.patch(model, prologue=True)
    try:
        with pytest.warns(RuntimeWarning, match=r"StaticCache with a StaticSlidingWindowLayer"):
            got, _ = _generate(model, ids, 3)
    finally:
        tt.unpatch(model)
    assert torch.equal(got, want)


def test_prologue_needs_rope_and_a_served_model_type(gen):
    model = _model("llama", gen)
    with pytest.raises(ValueError, match=r"prologue: expected rope=True with it"):
        tt.patch(model, rope=False, prologue=True)
    with pytest.raises(TypeError, match=r"prologue: expected a bool"):
        tt.patch(model, prologue="yes")
    assert not tt.is_patched(model)
    phi3 = transformers.Phi3ForCausalLM(transformers.Phi3Config(**TINY)).eval()
    with pytest.raises(NotImplementedError, match=r"prologue: model type 'phi3' is not served"):
        tt.patch(phi3, prologue=True)
    assert not tt.is_patched(phi3)


# ---------------------------------------------------------------------------------- bf16 on the GPU
def _bf16_generate(model: torch.nn.Module, ids: torch.Tensor, new: int, compiled: bool):
    """Greedy static-cache generation: the new tokens, each step's logits and the cache; ``compiled``:
    ``model.forward`` compiled whole by Inductor (HF's own compile off), as a serving loop would."""
    with _forward_compiled(model) if compiled else contextlib.nullcontext(), torch.no_grad():
        out = _generate_output(model, ids, new, output_logits=True, disable_compile=True)
    return out.sequences[:, ids.shape[1]:], [lg.float() for lg in out.logits], out.past_key_values


def check_bf16_generate(kind: str, compiled: bool, gen: torch.Generator, device: str, *, config=None,
                        attention: bool = False) -> None:
    """The patched model in bf16 against the same model unpatched: the logits after the prefill, and
    at every later step of a row whose tokens so far are the unpatched ones, and the prompt's keys and
    values in the static cache within bf16's tolerance (2-3 roundings of 2^-8 per layer: 3e-2 of the
    largest value, as tests/test_hf.py's bf16 comparison), and the same greedy tokens up to a near tie:
    where a row's token first differs, the patched model's token scores within that tolerance of the
    best under the unpatched model's logits (after it, the two rows continue from different tokens and
    are not compared). ``attention``: patched with ``attention=True`` too, so that the decode steps read
    the static cache through ``PagedAttnDecodeFwdOp``. Called by the CUDA tests; on the CPU for a dry
    run of the check itself."""
    model = _model(kind, gen, config).to(device, torch.bfloat16)
    ids = torch.randint(3, 128, (4, 11), generator=gen).to(device)
    new = 12
    want, want_logits, want_cache = _bf16_generate(model, ids, new, compiled)
    tt.patch(model, prologue=True, attention=attention)
    try:
        got, got_logits, got_cache = _bf16_generate(model, ids, new, compiled)
        rep = tt.report(model)
    finally:
        tt.unpatch(model)
    assert rep["prologue_fallbacks"] == [] and len(rep["prologue"]) == 1, rep["prologue_fallbacks"]
    assert rep["prologue"][0].params["qk_norm"] == (kind == "qwen3")
    if attention:
        assert len(rep["decode"]) == len(got_cache.layers), rep["decode"]  # an op a layer
        assert all(op.params["cache_layout"] == "HND" for op in rep["decode"]), rep["decode"]
    assert not any(torch.isnan(lg).any() for lg in got_logits), "NaN in the patched model's logits"
    for step in range(new):
        same = (got[:, :step] == want[:, :step]).all(1)  # rows fed the same tokens so far
        if bool(same.any()):
            rel = _rel(got_logits[step][same], want_logits[step][same])
            assert rel < 3e-2, f"step {step}: the logits differ by {rel:.3g}"
    prompt = ids.shape[1]
    for i, (a, b) in enumerate(zip(got_cache.layers, want_cache.layers, strict=True)):
        for what in ("keys", "values"):
            rel = _rel(getattr(a, what)[:, :, :prompt], getattr(b, what)[:, :, :prompt])
            assert rel < 3e-2, f"layer {i}: the prompt's {what} in the static cache differ by {rel:.3g}"
    for row in range(ids.shape[0]):
        differ = (got[row] != want[row]).nonzero()
        if len(differ):
            step = int(differ[0])
            scores = want_logits[step][row]
            gap = float(scores.max() - scores[got[row, step]])
            assert gap <= 3e-2 * float(scores.abs().max()), (
                f"row {row}, step {step}: token {int(got[row, step])} scores {gap:.4f} below the unpatched "
                f"model's best {int(want[row, step])} (largest logit {float(scores.abs().max()):.3f}): not a near tie")


@pytest.mark.cuda
@pytest.mark.parametrize("kind, compiled", [("llama", False), ("qwen2", False), ("qwen3", False), ("qwen3", True)],
                         ids=["llama", "qwen2", "qwen3", "qwen3-compiled"])
def test_static_generate_bf16_cuda_matches_within_bf16(kind, compiled, gen):
    """The issue's check on the GPU: ``generate(cache_implementation="static")`` in bf16, patched with
    ``prologue=True``, matches the unpatched model within bf16's tolerance, eagerly and compiled."""
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU (none here)")
    check_bf16_generate(kind, compiled, gen, "cuda")


#: head_dim 64, a size ``PagedAttnDecodeFwdOp`` takes (TINY's 16 is not)
D64 = dict(TINY, hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
D64_CONFIGS = {"llama": lambda: transformers.LlamaConfig(**D64),
               "qwen3": lambda: transformers.Qwen3Config(**D64, head_dim=64)}


@pytest.mark.cuda
@pytest.mark.parametrize("kind", list(D64_CONFIGS))
def test_decode_steps_on_the_gpu_run_the_paged_decode_op_within_bf16(kind, gen, monkeypatch):
    """``patch(prologue=True, attention=True)`` on the GPU in bf16: every decode step of a static-cache
    ``generate`` (2 layers x 11 steps) reads the cache through the CUDA paged decode, and the model
    matches the unpatched one as :func:`check_bf16_generate` measures."""
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU (none here)")
    from tileops.integrations import transformers_prologue

    calls = []
    real = transformers_prologue._decode
    monkeypatch.setattr(transformers_prologue, "_decode", lambda *a: calls.append(1) or real(*a))
    check_bf16_generate(kind, False, gen, "cuda", config=D64_CONFIGS[kind](), attention=True)
    assert len(calls) == 2 * 11, len(calls)  # the first new token comes from the prefill


@pytest.mark.parametrize("kind", list(D64_CONFIGS))
def test_decode_steps_run_the_paged_decode_op_when_attention_is_patched_too(kind, gen, monkeypatch):
    """``patch(prologue=True, attention=True)``: every decode step of a static-cache ``generate`` reads
    the cache the prologue wrote through ``PagedAttnDecodeFwdOp`` (2 layers x 7 steps), and the tokens
    are the unpatched model's (fp32, CPU). With a padded sequence in the batch the steps run the
    attention patch's varlen call instead (the decode op takes no per-sequence start), with the
    unpatched tokens again."""
    from tileops.integrations import transformers_prologue

    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = getattr(transformers, MODELS[kind])(D64_CONFIGS[kind]()).eval()
    ids = torch.randint(3, 128, (2, 11), generator=gen)
    padded = torch.ones_like(ids)
    padded[1, :3] = 0  # sequence 1: three pad tokens on the left

    def run(mask):
        return model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                              cache_implementation="static").cpu()

    want, want_padded = run(torch.ones_like(ids)), run(padded)
    calls = []
    real = transformers_prologue._decode
    monkeypatch.setattr(transformers_prologue, "_decode", lambda *a: calls.append(1) or real(*a))
    tt.patch(model, prologue=True, attention=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no call may fall back to transformers' attention
            got = run(torch.ones_like(ids))
        served = len(calls)
        got_padded = run(padded)
        rep = tt.report(model)
    finally:
        tt.unpatch(model)
    assert served == 2 * 7, served  # the first new token comes from the prefill
    assert len(calls) == served, "a padded batch's steps are not the decode op's"
    assert len(rep["decode"]) == 2 and all(op.params["cache_layout"] == "HND" for op in rep["decode"])
    assert torch.equal(got, want), (got, want)
    assert torch.equal(got_padded, want_padded), (got_padded, want_padded)


class _CountingAotEager(_AotEager):
    """``_AotEager`` that also counts the compiled graphs' runs (``runs``)."""

    def __init__(self) -> None:
        super().__init__()
        self.runs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs) -> object:
        compiled = super().__call__(gm, example_inputs)

        def run(*args):
            self.runs += 1
            return compiled(*args)
        return run


def test_a_compiled_decode_step_with_attention_patched_too_is_one_graph(gen):
    """``patch(prologue=True, attention=True)`` with ``model.forward`` compiled: each decode step runs
    one graph, which calls the prologue and the paged decode op. The mask function read a static
    layer's length counter on the host and the decode ops were built at the first step, inside the
    trace: both broke the graph, and a step of this 2-layer Qwen3 ran 15 graphs. (The prefill's
    attention still reads the counter: its graphs are not counted here.) The tokens are the unpatched
    model's, fp32 on the CPU."""
    import inspect

    from transformers.generation.utils import GenerationMixin

    from tileops.runtime.library import layout

    if "_mask_length" not in inspect.getsource(GenerationMixin.generate):
        # (transformers 5.17: the all-ones mask reaches every step, and whether a sequence is padded is
        # then a read of it: a graph break a layer, 13 graph runs a step here against 15 before)
        pytest.skip(f"transformers {transformers.__version__}'s generate passes an all-ones attention mask to "
                    f"every step (later releases drop it once, before the loop)")
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = transformers.Qwen3ForCausalLM(D64_CONFIGS["qwen3"]()).eval()
    ids = torch.randint(3, 128, (2, 11), generator=gen)
    with torch.no_grad():
        want = _generate(model, ids, 9)[0]
    tt.patch(model, prologue=True, attention=True)
    backend = _CountingAotEager()
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend=backend)
    try:
        runs = {}
        with torch.no_grad():
            for new in (8, 9):  # one decode step more: the difference is one step's graphs
                backend.runs = 0
                got = _generate(model, ids, new, disable_compile=True)[0]
                runs[new] = backend.runs
        called = [{layout(n.args[0]).name for n in g.graph.nodes
                   if n.op == "call_function" and str(n.target).startswith("tileops.")} for g in backend.graphs]
        rep = tt.report(model)
    finally:
        del model.forward
        torch._dynamo.reset()
        tt.unpatch(model)
    assert runs[9] - runs[8] == 1, runs
    assert torch.equal(got, want), (got, want)
    assert len(rep["decode"]) == 2, rep["decode"]
    assert {"AttnPrologueFwdOp", "PagedAttnDecodeFwdOp"} in called, called  # a decode step's graph
