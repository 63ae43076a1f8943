"""torch.compile of models patched by tileops.integrations.transformers, on tiny random models (CPU).

A patched model must compile like the unpatched one: Dynamo traces the patch's plumbing (no more
graph breaks than the unpatched model has, the op appearing in the graph as ``tileops::apply``),
``generate`` with a static cache and a compiled forward compiles no more graphs, and the compiled
model computes what the eager patched model computes. Cheap backends (``eager``, ``aot_eager``)
stand in for Inductor: what is checked is what Dynamo and AOTAutograd see.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tileops.integrations import transformers as tt  # noqa: E402

try:
    from test_hf import _MODELS, NORM_ONLY, TINY, VL, _config, _rel, _vl_config
except ImportError:  # run from the repo root
    from tests.test_hf import _MODELS, NORM_ONLY, TINY, VL, _config, _rel, _vl_config

#: one tiny model per served model type: the ``*_text`` types are the vision-language models'
#: text models (``*TextModel``, no LM head)
TEXT = {f"{k}_text": v[1].replace("ForConditionalGeneration", "TextModel") for k, v in VL.items()}
assert set(_MODELS) | set(TEXT) == set(tt.SERVED_MODEL_TYPES)


def _model(kind: str, seed: int = 0) -> torch.nn.Module:
    if kind in TEXT:
        cfg = _vl_config(kind[: -len("_text")]).text_config
    else:
        cfg = _config("llama-default" if kind == "llama" else kind)
    torch.manual_seed(seed)
    cls = TEXT.get(kind) or _MODELS.get(kind) or NORM_ONLY[kind][1]
    return getattr(transformers, cls)._from_config(cfg).eval()


def _op_nodes(graphs, ops=None) -> int:
    """How many calls of tileops' custom ops the FX graphs hold (of ``ops`` alone, when given: a
    call's first argument is its op's handle)."""
    handles = None if ops is None else {op._handle for op in ops}
    return sum(1 for g in graphs for n in g.graph.nodes if n.op == "call_function" and "tileops" in str(n.target)
               and (handles is None or n.args[0] in handles))


def _norm_calls(model, ids) -> int:
    """How many times a forward of ``model`` on ``ids`` calls a routed norm module (eagerly)."""
    calls = []
    hooks = [m.register_forward_hook(lambda *_: calls.append(1)) for m in model.modules()
             if type(m).__name__ in tt.RMSNORM_CLASSES]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return len(calls)


def _explain(model, ids):
    torch._dynamo.reset()
    with torch.no_grad():
        return torch._dynamo.explain(model)(ids)


@pytest.mark.parametrize("kind, rope", [*((k, True) for k in tt.SERVED_MODEL_TYPES), ("gemma3", False),
                                        # Gemma 1/2 compute Gemma 3's form; Olmo2 differs in rounding alone
                                        *(pytest.param(k, False, marks=pytest.mark.slow) for k in NORM_ONLY
                                          if k != "gemma3")])
def test_patched_model_has_no_more_graph_breaks(kind, rope, gen):
    """RoPE and RMSNorm (``rope=False``: the model types served for RMSNorm alone)."""
    model = _model(kind)
    ids = torch.randint(3, 128, (2, 11), generator=gen)
    plain = _explain(model, ids)
    norm_calls = _norm_calls(model, ids)
    tt.patch(model, rope=rope)
    try:
        patched = _explain(model, ids)
        rep = tt.report(model)
    finally:
        tt.unpatch(model)
        torch._dynamo.reset()
    reasons = [str(r.reason).splitlines()[0] for r in patched.break_reasons]
    assert patched.graph_break_count <= plain.graph_break_count, (kind, reasons)
    assert patched.graph_count <= plain.graph_count, kind
    # RoPE's op was traced, not HF's code in its place, once per layer (q and k together); the
    # routed norms trace HF's own code (Inductor fuses it with its neighbours), so no norm op
    layers = model.config.get_text_config().num_hidden_layers
    assert _op_nodes(patched.graphs, [rep["rope"]] if rope else []) == (layers if rope else 0), kind
    assert norm_calls >= 2 * layers + 1 and rep["norm_ops"] and _op_nodes(patched.graphs, rep["norm_ops"]) == 0, kind
    assert _op_nodes(plain.graphs) == 0


class _Counting:
    """A compile backend that runs the graph as Dynamo captured it and counts the graphs it gets."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs) -> object:
        self.graphs.append(gm)
        return gm.forward


def _compiled_generate(model, ids, new_tokens: int) -> tuple[list[int], torch.Tensor, _Counting]:
    """A greedy static-cache generation with ``model.forward`` compiled: the number of graphs
    compiled by each step (a logits processor reads it), the tokens, and the backend."""
    backend = _Counting()
    counts: list[int] = []

    def record(input_ids, scores):
        counts.append(len(backend.graphs))
        return scores

    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend=backend)
    try:
        with torch.no_grad():
            tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                    do_sample=False, cache_implementation="static", pad_token_id=0,
                                    logits_processor=transformers.LogitsProcessorList([record]))
    finally:
        del model.forward
        torch._dynamo.reset()
    return counts, tokens, backend


@pytest.mark.slow  # measured 5-38 s on 2 cores (pytest --durations); CI runs -m slow
@pytest.mark.parametrize("kind, rope", [("llama", True), ("phi3", True), ("qwen2_vl", True), ("qwen3_vl", True),
                                        ("gemma3", False)])
def test_static_cache_generate_compiles_no_more_graphs(kind, rope, gen):
    """Step by step, the patched model has compiled as many graphs as the unpatched one: prefill and
    the first decode step compile, later steps reuse them (Phi-3 also recompiles where the generation
    crosses its original length, unpatched too: HF's rotary embedding swaps its inv_freq there; the
    op switches tables on the device). Before the patch was traceable, its graph breaks made Dynamo
    recompile the resumed frames at every step until the recompile limit."""
    model = _model(kind)
    ids = torch.randint(3, 128, (2, 20), generator=gen)  # + 10 new tokens: past Phi-3's original 24
    plain, want, _ = _compiled_generate(model, ids, 10)
    tt.patch(model, rope=rope)
    try:
        patched, got, backend = _compiled_generate(model, ids, 10)
    finally:
        tt.unpatch(model)
    assert patched == plain, (kind, patched, plain)
    if kind != "phi3":
        assert patched[-1] == patched[2], f"{kind}: later decode steps compiled more graphs: {patched}"
    # the compiled graphs run RoPE's op where it is routed; routed norms trace HF's own code
    assert (_op_nodes(backend.graphs) > 0) == rope, kind
    assert torch.equal(got, want), kind


@pytest.mark.slow  # measured 5-38 s on 2 cores (pytest --durations); CI runs -m slow
@pytest.mark.parametrize("kind, rope", [("llama", True), ("phi3", True), ("qwen3", True), ("qwen2_vl_text", True),
                                        ("gemma3", False)])
def test_compiled_patched_model_matches_eager(kind, rope, gen):
    """aot_eager (AOTAutograd: the ops' fake and autograd registrations) against the eager patched
    model: fp32 logits and the gradients of a loss for the q/k projections and the norm weights."""
    model = _model(kind)
    model.train()  # dropout is 0 in these configs: train mode only makes autograd record
    ids = torch.randint(3, 128, (2, 30), generator=gen)  # Phi-3: past its original length of 24
    tt.patch(model, rope=rope)
    try:
        runs = []
        for forward in (model.forward, torch.compile(model.forward, backend="aot_eager")):
            model.zero_grad(set_to_none=True)
            out = forward(ids)
            logits = out.logits if hasattr(out, "logits") else out.last_hidden_state
            (logits.float() ** 2).mean().backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()
                     if "q_proj" in n or "k_proj" in n or n.endswith("norm.weight")}
            runs.append((logits.detach(), grads))
    finally:
        tt.unpatch(model)
        torch._dynamo.reset()
    (eager, eager_grads), (compiled, compiled_grads) = runs
    assert _rel(compiled, eager) < 1e-6, (kind, _rel(compiled, eager))
    # compiled, the norms are HF's code and eager the op's (both fp32, summed in their own orders):
    # the gradients agree to the 1e-4 against HF (1.03e-5 seen on a Qwen2-VL k_proj bias)
    for name in eager_grads:
        assert _rel(compiled_grads[name], eager_grads[name]) < 1e-4, (kind, name)


def test_compiled_patched_attention_refuses_untagged_cos():
    """The guarantee of the eager patch holds in a compiled graph: cos/sin that did not come from the
    patched rotary embedding are refused, not rotated another way."""
    model = _model("llama")
    tt.patch(model)
    try:
        attn = model.model.layers[0].self_attn
        head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]
        h, cos, sin = torch.randn(1, 5, TINY["hidden_size"]), torch.ones(1, 5, head_dim), torch.zeros(1, 5, head_dim)
        compiled = torch.compile(attn, backend="eager")
        with pytest.raises(RuntimeError, match="no position_ids"):
            compiled(h, position_embeddings=(cos, sin), attention_mask=None)
    finally:
        tt.unpatch(model)
        torch._dynamo.reset()


def test_patched_and_unpatched_models_compile_side_by_side(gen):
    """Per model under compile too: an unpatched model of the same architecture, compiled next to a
    patched one, traces HF's function (no op in its graph) and computes what it computed before."""
    a, b = _model("qwen2", seed=0), _model("qwen2", seed=1)
    ids = torch.randint(3, 128, (2, 11), generator=gen)
    with torch.no_grad():
        want_b = b(ids).logits
        tt.patch(a)
        try:
            backends = _Counting(), _Counting()
            got_a = torch.compile(a, backend=backends[0])(ids).logits
            got_b = torch.compile(b, backend=backends[1])(ids).logits
            eager_a = a(ids).logits
        finally:
            tt.unpatch(a)
            torch._dynamo.reset()
    assert _op_nodes(backends[0].graphs) > 0 and _op_nodes(backends[1].graphs) == 0
    assert torch.equal(got_b, want_b)
    assert _rel(got_a, eager_a) < 1e-6
