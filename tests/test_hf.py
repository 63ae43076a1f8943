"""Hugging Face transformers: from_hf_config against transformers' own tables, and patch/unpatch on
tiny randomly initialised models (no downloads).

The model tests compare a patched model against the same model unpatched (HF's own RoPE is the
reference there); the op tests compare against the float64 references in tests/references.py.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from tileops.integrations import transformers as tt  # noqa: E402
from tileops.rope import (  # noqa: E402
    Phi3LongRoPEFwdOp,
    RoPEFwdOp,
    RoPELinearFwdOp,
    RoPELlama31FwdOp,
    YaRNFwdOp,
    from_hf_config,
)

try:
    from references import inv_freq_and_amplitude, reference
except ImportError:  # run from the repo root
    from tests.references import inv_freq_and_amplitude, reference

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
HEAD_DIM = 16
SHORT = [1.0 + 0.15 * i for i in range(HEAD_DIM // 4)]  # Phi-3 below: partial_rotary_factor 0.5 -> 4 factors
LONG = [1.5 + 0.9 * i for i in range(HEAD_DIM // 4)]
ROPE = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.5},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
}


def _config(kind: str):
    """A tiny transformers config of each kind the model tests use."""
    if kind.startswith("llama-"):
        rs = ROPE[kind.split("-", 1)[1]]
        extra = {"rope_theta": 5000.0} if rs is None else {"rope_scaling": {**rs, "rope_theta": 5000.0}}
        # dynamic NTK: a trained length of 16, which prompts (23 tokens) and generation grow past
        tiny = {**TINY, "max_position_embeddings": 16} if kind == "llama-dynamic" else TINY
        return transformers.LlamaConfig(**tiny, **extra)
    if kind == "qwen2":
        return transformers.Qwen2Config(**TINY, rope_theta=20000.0)
    if kind == "mistral":
        return transformers.MistralConfig(**TINY)
    if kind == "qwen3":
        return transformers.Qwen3Config(**TINY, head_dim=HEAD_DIM)
    if kind == "phi3":  # longrope, partial rotary, original length 24: prompts cross it while generating
        return transformers.Phi3Config(**TINY, partial_rotary_factor=0.5, original_max_position_embeddings=24,
                                       rope_scaling={"rope_type": "longrope", "short_factor": SHORT,
                                                     "long_factor": LONG})
    if kind in VL:
        return _vl_config(kind)
    if kind in NORM_ONLY:  # model types whose RMSNorm is served and RoPE is not (patch(model, rope=False))
        return getattr(transformers, NORM_ONLY[kind][0])(**TINY, **NORM_ONLY[kind][2])
    raise KeyError(kind)


#: model types served for RMSNorm alone: (config class, model class, config extras). Gemma 3 with
#: one sliding and one full attention layer (its per-layer-type rope parameters are what from_hf_config
#: refuses), Gemma 2 with a window shorter than the prompts
NORM_ONLY = {"gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=16)),
             "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=16, sliding_window=8)),
             "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                        dict(head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
             "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {})}


#: the vision-language models (MRoPE): the whole model, a one-block vision tower, its image tokens
#: outside the ids the tests draw (3..127) so that text prompts hold none
VL = {"qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration", [2, 3, 3]),
      "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", [4, 2, 2]),
      "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration", [3, 3, 2])}
IMAGE_TOKEN, VISION_START, VISION_END = 150, 152, 153


def _vl_config(kind: str):
    name, _, section = VL[kind]
    if not hasattr(transformers, name):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    text = {**TINY, "vocab_size": 160, "head_dim": HEAD_DIM,
            "rope_parameters": {"rope_type": "default", "mrope_section": section, "rope_theta": 5000.0}}
    vision = {"qwen2_vl": dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2),
              "qwen2_5_vl": dict(depth=1, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=2,
                                 fullatt_block_indexes=[0]),
              "qwen3_vl": dict(depth=1, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=2,
                               num_position_embeddings=64, deepstack_visual_indexes=[0])}[kind]
    return getattr(transformers, name)(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN,
                                       video_token_id=151, vision_start_token_id=VISION_START,
                                       vision_end_token_id=VISION_END)


_MODELS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
           "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", **{k: v[1] for k, v in VL.items()}}


def _model(kind: str, dtype=torch.float32, device="cpu", seed=0):
    cfg = _config(kind)
    torch.manual_seed(seed)
    # built in ``dtype`` as from_pretrained(dtype=...) builds it: the rotary inv_freq stays fp32
    # (model.to(dtype) would round it too, and HF's own RoPE with it)
    kind = kind.split("-")[0]
    cls = _MODELS[kind] if kind in _MODELS else NORM_ONLY[kind][1]
    model = getattr(transformers, cls)._from_config(cfg, dtype=dtype)
    # norm weights are initialised to ones (Gemma: zeros, for 1 + weight): spread them, so that a
    # norm that dropped or misplaced its weight shows
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_((torch.randn(p.shape, generator=gen) * 0.3).to(p.dtype))
    return model.to(device=device).eval()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


# ----------------------------------------------------------------------------------- from_hf_config
def _hf_tables(cfg) -> tuple[torch.Tensor, float]:
    rt = cfg.rope_parameters["rope_type"]
    if rt == "default":
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        dim = int(head_dim * cfg.rope_parameters.get("partial_rotary_factor", 1.0))
        return 1.0 / cfg.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim), 1.0
    inv, amp = ROPE_INIT_FUNCTIONS[rt](cfg, torch.device("cpu"))
    return inv.double(), float(amp)


def _op_tables(op, head_dim):
    rot = op.rotated_width(head_dim)
    return op.frequencies(rot)


HF_CASES = {
    "default": ("LlamaConfig", {}, RoPEFwdOp),
    "default-partial": ("Phi3Config", {"partial_rotary_factor": 0.75}, RoPELinearFwdOp),
    "linear": ("LlamaConfig", {"rope_parameters": {"rope_type": "linear", "factor": 3.0, "rope_theta": 1e5}},
               RoPELinearFwdOp),
    "linear-partial": ("LlamaConfig", {"rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                           "partial_rotary_factor": 0.5}}, RoPELinearFwdOp),
    "llama3": ("LlamaConfig", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "rope_theta": 5e5,
                                                   "original_max_position_embeddings": 128}}, RoPELlama31FwdOp),
    "yarn": ("LlamaConfig", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                                 "original_max_position_embeddings": 64}}, YaRNFwdOp),
    "yarn-attention-factor": ("LlamaConfig", {"rope_parameters": {
        "rope_type": "yarn", "factor": 8.0, "attention_factor": 0.7, "beta_fast": 24.0, "beta_slow": 2.0,
        "original_max_position_embeddings": 32}}, YaRNFwdOp),
    "yarn-mscale": ("LlamaConfig", {"rope_parameters": {
        "rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 64}}, YaRNFwdOp),
    "yarn-no-factor": ("LlamaConfig", {"max_position_embeddings": 512, "rope_parameters": {
        "rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64}}, YaRNFwdOp),
    "longrope": ("Phi3Config", {"original_max_position_embeddings": 32, "rope_parameters": {
        "rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
        "long_factor": [2.0 + 0.5 * i for i in range(8)]}}, Phi3LongRoPEFwdOp),
    "longrope-partial-factor": ("Phi3Config", {"partial_rotary_factor": 0.5, "original_max_position_embeddings": 32,
                                               "rope_parameters": {"rope_type": "longrope", "factor": 16.0,
                                                                   "short_factor": SHORT, "long_factor": LONG}},
                                Phi3LongRoPEFwdOp),
}


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_from_hf_config_matches_transformers(case):
    cls_name, kwargs, op_cls = HF_CASES[case]
    base = {k: v for k, v in TINY.items() if k not in kwargs}
    cfg = getattr(transformers, cls_name)(**base, **kwargs)
    op = from_hf_config(cfg, target="torch")
    assert type(op) is op_cls and op.params["input_layout"] == "2d"
    inv_hf, amp_hf = _hf_tables(cfg)
    inv, amp = _op_tables(op, HEAD_DIM)
    assert inv.dtype == torch.float64 and inv.shape == inv_hf.shape
    # HF computes its tables in fp32: agreement to fp32 precision, not closer
    assert _rel(inv, inv_hf) < 2e-6 and float(((inv - inv_hf) / inv_hf).abs().max()) < 2e-6, case
    assert math.isclose(amp, amp_hf, rel_tol=1e-12), (case, amp, amp_hf)
    # and to float64 precision against the independent references
    ref_inv, ref_amp = inv_freq_and_amplitude(type(op).__name__, {**op.params, "max_position_id": 0}, HEAD_DIM)
    torch.testing.assert_close(inv, ref_inv, rtol=1e-13, atol=0)
    assert math.isclose(amp, ref_amp, rel_tol=1e-13)
    if op_cls is Phi3LongRoPEFwdOp:  # the long set against HF's dynamic update's
        omp = cfg.rope_parameters["original_max_position_embeddings"]
        long_hf, long_amp = ROPE_INIT_FUNCTIONS["longrope"](cfg, torch.device("cpu"), seq_len=omp + 1)
        (s_inv, _), (l_inv, l_amp) = op.table_choices(op.rotated_width(HEAD_DIM))
        torch.testing.assert_close(s_inv, inv)
        assert float(((l_inv - long_hf.double()) / l_inv).abs().max()) < 2e-6
        assert math.isclose(l_amp, long_amp, rel_tol=1e-12)
        assert not torch.allclose(l_inv, s_inv)


def test_yarn_attention_factor_replaces_the_amplitude():
    cfg = transformers.LlamaConfig(**TINY, rope_parameters={"rope_type": "yarn", "factor": 8.0, "attention_factor": 0.7,
                                                            "original_max_position_embeddings": 32})
    op = from_hf_config(cfg)
    assert op.frequencies(HEAD_DIM)[1] == pytest.approx(0.7, rel=1e-15)
    assert op.params["attn_factor"] == pytest.approx(0.7 / (0.1 * math.log(8.0) + 1), rel=1e-15)
    # no attention_factor: HF's default amplitude, attn_factor exactly 1
    cfg = transformers.LlamaConfig(**TINY, rope_parameters={"rope_type": "yarn", "factor": 8.0,
                                                            "original_max_position_embeddings": 32})
    assert from_hf_config(cfg).params["attn_factor"] == 1.0


def test_both_spellings_give_the_same_op():
    v4 = {**TINY, "head_dim": 32, "rope_theta": 5e5, "partial_rotary_factor": 0.5,
          "rope_scaling": {"type": "linear", "factor": 4.0}}
    v5 = {**TINY, "head_dim": 32, "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5,
                                                      "partial_rotary_factor": 0.5}}
    ops = [from_hf_config(v4), from_hf_config(v5), from_hf_config(types.SimpleNamespace(**v4)),
           from_hf_config(transformers.LlamaConfig(**v4))]
    for op in ops:
        assert type(op) is RoPELinearFwdOp
        assert op.params == {"input_layout": "2d", "base": 5e5, "factor": 4.0, "rotary_dim": 16}
    # llama3 in v4 spelling: original_max_position_embeddings inside rope_scaling
    v4 = {**TINY, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 96}}
    op = from_hf_config(v4)
    assert type(op) is RoPELlama31FwdOp and op.params["original_max_position"] == 96 and op.params["base"] == 5e5


def test_phi3_original_length_comes_from_the_config_attribute():
    # transformers gives config.original_max_position_embeddings priority over the rope block's
    cfg = {**TINY, "original_max_position_embeddings": 48,
           "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                            "original_max_position_embeddings": 4096}}
    op = from_hf_config(cfg)
    assert op.params["original_max_position_embeddings"] == 48
    assert op.params["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(256 / 48) / math.log(48)))


def test_phi3_chooses_its_table_on_the_device():
    op = from_hf_config(_config("phi3"))
    omp = 24
    for pos, want in ((torch.arange(omp), 0), (torch.arange(omp + 1), 1), (torch.tensor([[3, 9], [0, omp]]), 1),
                      (torch.tensor([[3, 9], [0, omp - 1]]), 0)):
        got = op.choose_table(pos, pos.shape[-1])
        assert isinstance(got, torch.Tensor) and got.dim() == 0 and got.dtype == torch.int64
        assert int(got) == want, pos
    assert op.choose_table(None, omp) == 0 and op.choose_table(None, omp + 1) == 1


@pytest.mark.parametrize("rope, match", [
    ({"rope_type": "proportional", "factor": 1.0}, "'proportional'"),
    ({"rope_type": "mrope", "mrope_section": [2, 3, 3]}, "'mrope'"),
    ({"rope_type": "yarn", "factor": 4.0, "truncate": False}, "truncate"),
])
def test_refused_rope_types(rope, match):
    with pytest.raises(NotImplementedError, match=match):
        from_hf_config({**TINY, "rope_parameters": {**rope, "rope_theta": 1e4}})


@pytest.mark.parametrize("rope", ["llama3", "yarn"])
def test_partial_rotary_refused_where_no_op_has_it(rope):
    with pytest.raises(NotImplementedError, match=f"partial_rotary_factor.*{rope}"):
        from_hf_config({**TINY, "partial_rotary_factor": 0.5, "rope_scaling": ROPE[rope]})


@pytest.mark.parametrize("config, exc, match", [
    ({**TINY, "rope_parameters": {"rope_type": "linear"}}, ValueError, r"rope_parameters\['factor'\]"),
    ({**TINY, "rope_scaling": {"rope_type": "linear", "factor": "2"}}, TypeError, r"rope_scaling\['factor'\]"),
    ({**TINY, "rope_scaling": {"rope_type": "linear", "factor": -2.0}}, ValueError, r"rope_scaling\['factor'\]"),
    ({**TINY, "rope_theta": 0.0}, ValueError, "rope_theta"),
    ({**TINY, "partial_rotary_factor": 1.5}, ValueError, "partial_rotary_factor"),
    ({**TINY, "partial_rotary_factor": 0.2}, NotImplementedError, "partial_rotary_factor"),  # int(16 * 0.2) = 3
    ({"vocab_size": 8, "rope_theta": 1e4}, ValueError, "head_dim"),
    ({**TINY, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
                               "high_freq_factor": 2.0}}, ValueError, "high_freq_factor"),
    ({**TINY, "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 7, "long_factor": [1.0] * 8}},
     ValueError, r"short_factor.*expected 8 numbers"),
    ({**TINY, "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8}}, ValueError, "long_factor"),
    ({**TINY, "rope_scaling": {"rope_type": 3}}, TypeError, "rope_type"),
    ({**TINY, "rope_scaling": [1, 2]}, TypeError, "rope_scaling"),
    ({**TINY, "layer_types": ["full_attention"], "rope_parameters": {"full_attention": {"rope_type": "default"}}},
     NotImplementedError, "per-layer"),
    (42, TypeError, "config"),
])
def test_bad_configs_name_the_field(config, exc, match):
    with pytest.raises(exc, match=match):
        from_hf_config(config)


@pytest.mark.parametrize("make, exc, match", [
    (lambda: transformers.GPT2Config(), ValueError, r"'gpt2' config with no rotary settings"),
    (lambda: transformers.BertConfig(), ValueError, r"'bert' config with no rotary settings"),
    (lambda: transformers.T5Config(), ValueError, r"'t5' config with no rotary settings"),
    (lambda: transformers.OPTConfig(), ValueError, r"'opt' config with no rotary settings"),
    (lambda: transformers.BloomConfig(), ValueError, r"'bloom' config with no rotary settings"),
    (lambda: transformers.GPT2Config().to_dict(), ValueError, r"'gpt2' config with no rotary settings"),
    (lambda: transformers.FalconConfig(alibi=True), ValueError, r"'falcon' config with config.alibi set"),
    (lambda: transformers.LlavaConfig(), ValueError, r"'llava' config .*pass config.text_config"),
    (lambda: transformers.GPTJConfig(), NotImplementedError, r"config.rotary_dim: a 'gptj' config"),
    (lambda: {"model_type": "gpt_neox", **TINY, "rotary_pct": 0.25, "rotary_emb_base": 1e4}, NotImplementedError,
     r"config.rotary_pct: .*load it with transformers 5"),
    (lambda: {**TINY, "rope_theta": 1e4, "rotary_dim": 8}, NotImplementedError,
     r"config.rotary_dim: 8 rotated columns are not read"),
])
def test_configs_without_rope_are_refused(make, exc, match):
    """A model without rotary embeddings (absolute positions, relative biases, ALiBi) gets no RoPE with
    default settings, and rotary settings spelt in a way not read are named."""
    with pytest.raises(exc, match=match):
        from_hf_config(make())


@pytest.mark.slow  # measured 5-38 s on 2 cores (pytest --durations); CI runs -m slow
def test_rotary_configs_are_still_accepted():
    """Every transformers config class whose default instance carries rope parameters, and the
    spellings that had no rope key before (a flat MRoPE config.json, Falcon without alibi, GPT-NeoX as
    transformers 5 reads it), gets an op or a NotImplementedError about its rope settings, never the
    no-RoPE refusal."""
    from transformers import CONFIG_MAPPING

    configs = [transformers.FalconConfig(alibi=False), transformers.GPTNeoXConfig(),
               {"model_type": "qwen2_vl", **TINY, "rope_scaling": None}]
    for model_type in CONFIG_MAPPING:
        try:
            cfg = CONFIG_MAPPING[model_type]()
        except Exception:  # noqa: BLE001 - a config class that needs arguments: not a default instance
            continue
        if getattr(cfg, "rope_parameters", None):
            configs.append(cfg)
    assert len(configs) > 100
    for cfg in configs:
        try:
            from_hf_config(cfg)
        except NotImplementedError:
            pass
        except ValueError as e:
            assert "no rotary settings" not in str(e) and "ALiBi" not in str(e), (getattr(cfg, "model_type", cfg), e)
    assert type(from_hf_config(transformers.GPTNeoXConfig(**TINY))) is RoPELinearFwdOp  # rotary_pct 0.25


# ----------------------------------------------------------------------------------- the new ops
def test_phi3_op_switches_tables_by_position_against_the_reference():
    gen = torch.Generator().manual_seed(7)
    short, long = torch.rand(12, generator=gen) + 1, torch.rand(12, generator=gen) * 4 + 1
    params = dict(input_layout="2d", base=500.0, short_factor=short, long_factor=long,
                  original_max_position_embeddings=40, max_position_embeddings=160, rotary_dim=24)
    op = Phi3LongRoPEFwdOp(**params)
    x = torch.randn(2, 7, 3, 40, generator=gen)
    for top in (39, 40, 1000):  # max + 1 == 40 stays short; 41 and beyond go long
        pos = torch.randint(0, top, (2, 7), generator=gen)
        pos[1, 3] = top - 1
        out = op(x, position_ids=pos)
        ref = reference("Phi3LongRoPEFwdOp", {**params, "max_position_id": top - 1}, {"x": x, "position_ids": pos})
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(out[..., 24:], x[..., 24:])  # beyond rotary_dim: copied


def test_linear_op_with_positions_and_gradient():
    gen = torch.Generator().manual_seed(8)
    params = dict(input_layout="2d", factor=2.5, rotary_dim=24)
    op = RoPELinearFwdOp(**params)
    x = torch.randn(3, 5, 2, 40, generator=gen, requires_grad=True)
    pos = torch.randint(0, 5000, (5,), generator=gen)
    out = op(x, position_ids=pos)
    ref = reference("RoPELinearFwdOp", params, {"x": x.detach(), "position_ids": pos})
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    w = torch.randn(out.shape, generator=gen)
    (out * w).sum().backward()
    x64 = x.detach().double().requires_grad_()
    (reference("RoPELinearFwdOp", params, {"x": x64, "position_ids": pos}) * w.double()).sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------- patch / unpatch
KINDS = ["llama-default", "llama-linear", "llama-llama3", "llama-yarn", "llama-dynamic", "qwen2", "phi3-short",
         "phi3-long", *VL]


def _ids(kind: str, batch: int, gen: torch.Generator, device="cpu") -> torch.Tensor:
    length = {"phi3-short": 12, "phi3-long": 40}.get(kind, 23)  # phi3: original length 24
    return torch.randint(3, 128, (batch, length), generator=gen).to(device)


def _proj_grads(model) -> dict[str, torch.Tensor]:
    """The gradients of the q/k projections (RoPE's inputs) and of the language model's norm
    weights (the vision tower's get none from a text prompt)."""
    out = {}
    for name, p in model.named_parameters():
        if any(k in name for k in ("q_proj.weight", "k_proj.weight", "qkv_proj.weight")) or (
                name.endswith("norm.weight") and "visual" not in name):
            assert p.grad is not None, name
            out[name] = p.grad.detach().clone()
    assert any("proj" in n for n in out) and any("norm" in n for n in out)
    return out


def _run(model, ids, mask):
    """logits, projection gradients of a loss on them, and greedy generations (plain and left padded)."""
    model.zero_grad(set_to_none=True)
    out = model(ids, attention_mask=torch.ones_like(ids), labels=ids)
    out.loss.backward()
    grads = _proj_grads(model)
    with torch.no_grad():
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                             pad_token_id=0)
        padded = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    return out.logits.detach(), grads, gen, padded


def _check_generation(model, got: torch.Tensor, want: torch.Tensor, exact: bool) -> None:
    if exact or torch.equal(got, want):
        assert torch.equal(got, want)
        return
    # low precision: a differing greedy token must be a near-tie of the reference's logits
    row, col = (got != want).nonzero()[0].tolist()
    with torch.no_grad():
        logits = model(want[row:row + 1, :col]).logits[0, -1].float()
    top = logits.topk(2).values
    assert float(top[0] - top[1]) < 0.05 * float(logits.abs().max()), (row, col)


def _start_afresh(model: torch.nn.Module, kind: str) -> None:
    """HF's dynamic rope keeps the longest length seen (the generations grew it): back to the trained one."""
    if kind == "llama-dynamic":
        rot = model.model.rotary_emb
        rot.inv_freq.copy_(rot.original_inv_freq)
        rot.max_seq_len_cached = rot.original_max_seq_len


def _compare(kind: str, dtype, device, tol_logits, tol_grads, rope=True, norm=True):
    """``patch(model, rope=rope, norm=norm)`` against the model unpatched: logits, gradients (q/k
    projections and norm weights), greedy generations; then unpatched, the model's own again."""
    model = _model(kind.split("-")[0] if kind.startswith("phi3") else kind, dtype, device)
    gen = torch.Generator().manual_seed(1)
    ids = _ids(kind, 2, gen, device)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding in the second row
    ids[1, :5] = 0
    before = _run(model, ids, mask)
    _start_afresh(model, kind)  # patch() carries the length seen: both runs start from the trained one
    mod = __import__(type(model).__module__, fromlist=["apply_rotary_pos_emb"])
    original_fn = mod.apply_rotary_pos_emb
    assert tt.patch(model, rope=rope, norm=norm) is model and tt.is_patched(model)
    assert (mod.apply_rotary_pos_emb is not original_fn) == rope
    rep = tt.report(model)
    assert (rep["rope"] is not None) == rope and bool(rep["norm"]) == norm, rep
    after = _run(model, ids, mask)
    d_logits = _rel(after[0], before[0])
    assert d_logits < tol_logits, (kind, d_logits)
    d_grads = max(_rel(after[1][n], before[1][n]) for n in before[1])
    assert d_grads < tol_grads, (kind, d_grads)
    exact = dtype == torch.float32
    _check_generation(model, after[2], before[2], exact)
    _check_generation(model, after[3], before[3], exact)
    # the default target: TileLang kernels on the CPU and on CUDA (a norm op built for a dtype
    # pairing no module had is never called: None)
    targets = {op.serving_target for op in rep["norm_ops"]} - {None}
    assert targets == ({"builtin"} if norm else set()), targets
    served = model._tileops_patch.op.serving_target if rope else "builtin"
    assert served == "builtin", served
    assert tt.unpatch(model) is model and not tt.is_patched(model)
    assert mod.apply_rotary_pos_emb is original_fn
    assert all("forward" not in m.__dict__ for m in model.modules())
    _start_afresh(model, kind)
    again = _run(model, ids, mask)
    assert torch.equal(again[0], before[0]) and torch.equal(again[2], before[2]) and torch.equal(again[3], before[3])
    print(f"\n{kind} {dtype} {device} ({served}): logits rel diff {d_logits:.2e}, grad rel diff {d_grads:.2e}")
    return d_logits, d_grads


@pytest.mark.parametrize("kind", KINDS)
def test_patched_model_matches_transformers(kind):
    _compare(kind, torch.float32, "cpu", 1e-5, 1e-4)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", KINDS)
def test_patched_model_matches_transformers_bf16_cuda(kind):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _compare(kind, torch.bfloat16, "cuda", 3e-2, 5e-2)


@pytest.mark.parametrize("kind", ["mistral", "qwen3"])
def test_more_architectures_forward(kind):
    model = _model(kind)
    ids = _ids(kind, 3, torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(ids).logits
        tt.patch(model)
        got = model(ids).logits
        tt.unpatch(model)
    assert _rel(got, want) < 1e-5


def test_the_patch_is_per_model():
    a, b = _model("llama-linear", seed=0), _model("llama-linear", seed=1)
    mod = __import__(type(b).__module__, fromlist=["apply_rotary_pos_emb"])
    original_fn = mod.apply_rotary_pos_emb
    ids = _ids("llama-linear", 2, torch.Generator().manual_seed(3))
    with torch.no_grad():
        want_b = b(ids).logits
        tt.patch(a)
        calls = []
        op = a._tileops_patch.op
        real = op.forward
        op.forward = lambda *args, **kw: (calls.append(1), real(*args, **kw))[1]
        try:
            got_b = b(ids).logits  # unpatched: HF's function, the op is not called
            assert not calls and torch.equal(got_b, want_b)
            a(ids)
            assert len(calls) == 2  # one call (q and k together) in each of the two layers
            tt.patch(b)
            tt.unpatch(a)  # b still patched: the module keeps the replacement
            assert mod.apply_rotary_pos_emb is not original_fn
            assert _rel(b(ids).logits, want_b) < 1e-5
        finally:
            del op.forward
            for m in (a, b):
                if tt.is_patched(m):
                    tt.unpatch(m)
    assert mod.apply_rotary_pos_emb is original_fn


def test_concurrent_eager_calls_keep_their_positions():
    """Nothing of a call is kept where another thread could read it: two threads running a patched
    model and an unpatched one of the same architecture, with prompts of other lengths, get what each
    gets alone."""
    import threading

    a, b = _model("qwen2", seed=0), _model("qwen2", seed=1)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 128, (2, n), generator=gen) for n in (7, 19)]
    tt.patch(a)
    try:
        with torch.no_grad():
            want = {(m, i): m(p).logits for m in (a, b) for i, p in enumerate(prompts)}
        wrong = []

        def work(model, i):
            with torch.no_grad():
                for _ in range(6):
                    if not torch.equal(model(prompts[i]).logits, want[(model, i)]):
                        wrong.append((model is a, i))

        threads = [threading.Thread(target=work, args=(m, i)) for m in (a, b) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        tt.unpatch(a)
    assert not wrong, wrong


def test_patch_twice_unpatch_unpatched_and_missing_positions():
    model = _model("llama-default")
    with pytest.raises(ValueError, match="expected a model patched by tileops"):
        tt.unpatch(model)
    tt.patch(model)
    try:
        with pytest.raises(ValueError, match="already patched"):
            tt.patch(model)
        with pytest.raises(ValueError, match="already patched"):
            tt.patch(model.model)  # the same modules through another object
        # an attention called with cos/sin that did not come from the patched rotary embedding
        attn = model.model.layers[0].self_attn
        h = torch.randn(1, 5, 64)
        cos, sin = torch.ones(1, 5, HEAD_DIM), torch.zeros(1, 5, HEAD_DIM)
        with pytest.raises(RuntimeError, match="no position_ids"):
            attn(h, position_embeddings=(cos, sin), attention_mask=None)
    finally:
        tt.unpatch(model)


def test_unserved_models_and_rope_types_are_refused():
    with pytest.raises(NotImplementedError, match="truncate"):
        tt.patch(transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **TINY, rope_scaling={"rope_type": "yarn", "factor": 2.0, "truncate": False})))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64))
    with pytest.raises(NotImplementedError, match="'gpt2'"):
        tt.patch(gpt2)
    with pytest.raises(TypeError, match="model"):
        tt.patch(torch.nn.Linear(2, 2))
    # Llama ignores partial_rotary_factor in its default rope: the op would rotate less, so patch refuses
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, partial_rotary_factor=0.5))
    with pytest.raises(NotImplementedError, match="does not match"):
        tt.patch(model)
    assert not tt.is_patched(model)


@pytest.mark.slow  # measured 5-38 s on 2 cores (pytest --durations); CI runs -m slow
def test_docs_example_runs():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, str(root / "docs" / "examples" / "hf_patch.py")], capture_output=True,
                         text=True, timeout=600, cwd=root)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "same tokens as transformers: True" in run.stdout and "q_proj grad: True" in run.stdout, run.stdout
    assert "{'LlamaRMSNorm': 5}" in run.stdout and "norm weight grad: True" in run.stdout, run.stdout


def test_model_cast_with_to_warns_and_uses_exact_frequencies():
    """model.to(bf16) rounds HF's inv_freq buffer to bf16: patch() accepts it within that rounding,
    warns, and rotates with the config's exact frequencies (the model's own RoPE is the worse one)."""
    model = _model("llama-default").to(torch.bfloat16)
    assert model.model.rotary_emb.inv_freq.dtype == torch.bfloat16
    with pytest.warns(UserWarning, match="inv_freq is torch.bfloat16"):
        tt.patch(model)
    try:
        ids = torch.randint(3, 128, (1, 9))
        with torch.no_grad():
            out = model(ids).logits
        assert torch.isfinite(out.float()).all()
    finally:
        tt.unpatch(model)


def _deepseek_config(**extra):
    return transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=2560, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1,
        rope_scaling={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 0.8, "mscale_all_dim": 0.7}, **extra)


@pytest.mark.parametrize("interleave", [True, False])
def test_deepseek_v3_yarn_matches_transformers(interleave, gen):
    """DeepSeek-V3's rope part: yarn with mscale / mscale_all_dim and (by default) interleaved pairs.
    transformers' apply_rotary_pos_emb_interleave returns the rotated pairs de-interleaved; the op
    rotates them where they lie, so its result de-interleaved must match (and q.k is the same)."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    cfg = _deepseek_config(rope_interleave=interleave)
    op = from_hf_config(cfg)
    assert isinstance(op, YaRNFwdOp) and op.params["rope_layout"] == ("interleaved" if interleave else "neox")
    B, H, S, D = 2, 4, 9, cfg.qk_rope_head_dim
    q = torch.randn(B, H, S, D, generator=gen, dtype=torch.float64).float()
    k = torch.randn(B, 1, S, D, generator=gen, dtype=torch.float64).float()
    # transformers forms angles in fp32 (error ~ position * 2^-24 rad); positions below 200 keep
    # that under the tolerance, the op's float64 angles being exact
    pos = torch.randint(0, 200, (B, S), generator=gen)
    cos, sin = hf.DeepseekV3RotaryEmbedding(cfg).float()(q, pos)
    apply = hf.apply_rotary_pos_emb_interleave if interleave else hf.apply_rotary_pos_emb
    hq, hk = apply(q, k, cos, sin)
    oq, ok = op(q.transpose(1, 2), position_ids=pos, key=k.transpose(1, 2))
    oq, ok = oq.transpose(1, 2), ok.transpose(1, 2)
    if interleave:
        torch.testing.assert_close((oq @ ok.transpose(-1, -2)), (hq @ hk.transpose(-1, -2)), atol=1e-4, rtol=1e-4)
        oq = torch.cat((oq[..., 0::2], oq[..., 1::2]), -1)
        ok = torch.cat((ok[..., 0::2], ok[..., 1::2]), -1)
    torch.testing.assert_close(oq, hq, atol=5e-5, rtol=5e-5)
    torch.testing.assert_close(ok, hk, atol=5e-5, rtol=5e-5)
    assert not torch.allclose(oq, q, atol=1e-2), "nothing was rotated"


def test_rope_interleave_where_no_op_has_it():
    cfg = _deepseek_config()
    cfg.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(NotImplementedError, match="config.rope_interleave: interleaved pairs with rope type 'linear'"):
        from_hf_config(cfg)
    as_json = {**_deepseek_config().to_dict(), "rope_interleave": "yes"}  # a config.json dict
    with pytest.raises(TypeError, match="config.rope_interleave: expected a bool, got str"):
        from_hf_config(as_json)


def test_dynamic_ntk_follows_transformers_call_after_call(gen):
    """HF's dynamic NTK is stateful: its base grows with the longest length seen and goes back when a
    call is shorter than max_position_embeddings. The op keeps that state on the device; a sequence
    of calls (grow, shorter but still long, short, long again) matches transformers' own module."""
    from transformers.models.llama import modeling_llama as hf

    cfg = transformers.LlamaConfig(**{**TINY, "max_position_embeddings": 64},
                                   rope_scaling={"rope_type": "dynamic", "factor": 3.0, "rope_theta": 5000.0})
    op = from_hf_config(cfg)
    assert type(op).__name__ == "RoPEDynamicNTKFwdOp" and op.params["max_position_embeddings"] == 64
    rot = hf.LlamaRotaryEmbedding(cfg)
    B, H, S, D = 2, 3, 7, HEAD_DIM
    for top in (40, 150, 90, 20, 200, 64, 65):
        q = torch.randn(B, H, S, D, generator=gen)
        k = torch.randn(B, 1, S, D, generator=gen)
        pos = torch.randint(0, top, (B, S), generator=gen)
        pos[0, 0] = top - 1  # this call's length is top
        cos, sin = rot(q, pos)
        hq, hk = hf.apply_rotary_pos_emb(q, k, cos, sin)
        oq, ok = op(q.transpose(1, 2), position_ids=pos, key=k.transpose(1, 2))
        # transformers forms angles in fp32: positions below 200 keep its error under the tolerance
        torch.testing.assert_close(oq.transpose(1, 2), hq, atol=5e-5, rtol=5e-5, msg=f"length {top}")
        torch.testing.assert_close(ok.transpose(1, 2), hk, atol=5e-5, rtol=5e-5, msg=f"length {top}")
        assert float(op._ntk_state[torch.device("cpu")]) == float(rot.max_seq_len_cached), top


def test_dynamic_ntk_bad_call_leaves_the_length_alone(gen):
    """A call with a position out of range raises, and does not move the op's cached length."""
    from tileops.rope import RoPEDynamicNTKFwdOp

    op = RoPEDynamicNTKFwdOp(input_layout="2d", factor=2.0, max_position_embeddings=16)
    x = torch.randn(1, 5, 2, 16, generator=gen)
    op(x, position_ids=torch.tensor([[0, 1, 2, 3, 40]]))
    state = op._ntk_state[torch.device("cpu")]
    assert float(state) == 41.0
    with pytest.raises(ValueError, match=r"position_ids\[0, 4\] = 16777216"):
        op(x, position_ids=torch.tensor([[0, 1, 2, 3, 2**24]]))
    assert float(state) == 41.0
    op(x, position_ids=torch.tensor([[0, 1, 2, 3, 4]]))  # shorter than 16: back to the trained length
    assert float(state) == 16.0


def test_patch_carries_the_dynamic_length_the_model_has_seen(gen):
    """HF's dynamic rope keeps the longest length seen across calls. A model that ran 64 tokens
    (trained on 32) and is patched then must rotate a 40-token call with the frequencies of 64, as
    it would unpatched: the op starts from the rotary embedding's ``max_seq_len_cached`` (it started
    from the trained length: logits 0.023 relative off, no error). Again after unpatch and patch."""
    from tileops.rope import RoPEDynamicNTKFwdOp

    cfg = transformers.LlamaConfig(**{**TINY, "max_position_embeddings": 32},
                                   rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = transformers.LlamaForCausalLM(cfg).eval()
    long_ids, ids = torch.randint(3, 128, (1, 64), generator=gen), torch.randint(3, 128, (1, 40), generator=gen)
    with torch.no_grad():
        model(long_ids)
        want = model(ids).logits  # 40: no growth past 64, no reset (not below 32)
    assert model.model.rotary_emb.max_seq_len_cached == 64
    for _ in range(2):
        tt.patch(model, norm=False)
        try:
            with torch.no_grad():
                got = model(ids).logits
        finally:
            tt.unpatch(model)
        assert _rel(got, want) < 1e-5
    op = RoPEDynamicNTKFwdOp(input_layout="2d", factor=2.0, max_position_embeddings=32)
    with pytest.raises(ValueError, match=r"length: expected an int >= max_position_embeddings \(32\), got 31"):
        op.set_seen_length(31, "cpu")
    op.set_seen_length(64, "cpu")
    assert float(op._ntk_state[torch.device("cpu")]) == 64.0


# ----------------------------------------------------------------------------------- MRoPE
MROPE_CASES = {
    "qwen2_vl_text": (lambda: transformers.Qwen2VLTextConfig(**TINY, rope_parameters={
        "rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4}), [2, 3, 3], False, 1e4),
    "qwen2_vl-v4-dict": (lambda: {"model_type": "qwen2_vl", **TINY, "rope_theta": 1e6,
                                  "rope_scaling": {"type": "mrope", "mrope_section": [4, 2, 2]}}, [4, 2, 2], False, 1e6),
    "qwen2_vl-composite": (lambda: _vl_config("qwen2_vl"), [2, 3, 3], False, 5000.0),
    "qwen2_vl-composite-dict": (lambda: _vl_config("qwen2_vl").to_dict(), [2, 3, 3], False, 5000.0),
    "qwen2_5_vl-default-section": (lambda: transformers.Qwen2_5_VLConfig(), [16, 24, 24], False, 1e6),
    "qwen3_vl-composite": (lambda: _vl_config("qwen3_vl"), [3, 3, 2], True, 5000.0),
    "qwen3_vl-default-section": (lambda: transformers.Qwen3VLConfig(), [24, 20, 20], True, 5e5),
    # Qwen3-VL interleaves whatever mrope_interleaved says, as transformers does
    "qwen3_vl_text-flag-false": (lambda: transformers.Qwen3VLTextConfig(**TINY, head_dim=16, rope_parameters={
        "rope_type": "default", "mrope_section": [3, 3, 2], "mrope_interleaved": False}), [3, 3, 2], True, 5e5),
}


@pytest.mark.parametrize("case", sorted(MROPE_CASES))
def test_from_hf_config_mrope(case):
    make, section, interleaved, theta = MROPE_CASES[case]
    op = from_hf_config(make(), target="torch")
    assert type(op).__name__ == "MRoPEFwdOp"
    assert op.params == {"mrope_section": tuple(section), "input_layout": "2d", "base": theta,
                         "mrope_interleaved": interleaved}


@pytest.mark.parametrize("config, exc, match", [
    (lambda: {"model_type": "qwen2_vl", **TINY, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 4]}},
     ValueError, r"rope_scaling\['mrope_section'\]: expected counts summing to head_dim / 2 = 8"),
    (lambda: {"model_type": "qwen2_vl", **TINY, "rope_scaling": {"type": "mrope", "mrope_section": [8]}},
     ValueError, r"mrope_section'\]: expected 3 counts"),
    (lambda: {"model_type": "qwen2_vl", **TINY, "rope_scaling": {"type": "mrope", "mrope_section": [2.5, 3, 3]}},
     ValueError, r"mrope_section'\]\[0\]: expected a whole number"),
    (lambda: {"model_type": "qwen2_vl", **TINY},  # HF's default [16, 24, 24] needs head_dim 128
     ValueError, r"mrope_section'\] \(the default of qwen2_vl\)"),
    (lambda: {"model_type": "qwen3_vl_text", **TINY, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}},
     NotImplementedError, r"rope type 'yarn' with MRoPE \(qwen3_vl_text\)"),
    (lambda: {"model_type": "llama", **TINY, "rope_scaling": {"rope_type": "mrope", "mrope_section": [2, 3, 3]}},
     NotImplementedError, r"rope type 'mrope' is served for the model types qwen2_vl.*got config.model_type 'llama'"),
])
def test_bad_mrope_configs_name_the_field(config, exc, match):
    with pytest.raises(exc, match=match):
        from_hf_config(config())


def _image_prompt(kind: str, model, gen: torch.Generator):
    """ids with one image (random pixels; grid 1 x 4 x 6, 6 tokens after merging) between text, and
    the kwargs the model takes with them."""
    vc = model.config.vision_config
    grid = torch.tensor([[1, 4, 6]])
    tokens = int(grid.prod()) // vc.spatial_merge_size ** 2
    pixels = torch.randn(int(grid.prod()), vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2,
                         generator=gen)
    ids = torch.randint(3, 128, (1, 9 + tokens), generator=gen)
    ids[0, 3], ids[0, 4:4 + tokens], ids[0, 4 + tokens] = VISION_START, IMAGE_TOKEN, VISION_END
    return ids, dict(pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(ids == IMAGE_TOKEN).long())


def _image_run(model, ids, kw):
    model.model.rope_deltas = None  # the positions of a new prompt
    with torch.no_grad():
        logits = model(ids, **kw).logits
        model.model.rope_deltas = None
        tokens = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0, **kw)
    return logits, tokens


@pytest.mark.parametrize("kind", sorted(VL))
def test_vl_model_with_an_image_matches_transformers(kind, gen):
    """A prompt holding an image: the three position streams differ (the image's tokens share a
    temporal position and spread over height and width), so the section map decides the result.
    Patched logits and greedy generation match the unpatched model's; the op is called with those
    streams; and an op with the other section layout is refused at patch() (its map differs from
    the model's own recomposition)."""
    model = _model(kind)
    ids, kw = _image_prompt(kind, model, gen)
    pos, _ = model.model.get_rope_index(ids, image_grid_thw=kw["image_grid_thw"],
                                        mm_token_type_ids=kw["mm_token_type_ids"])
    assert not torch.equal(pos[1], pos[2]) and not torch.equal(pos[0], pos[1]), "the streams do not differ"
    want = _image_run(model, ids, kw)
    tt.patch(model)
    try:
        op = model._tileops_patch.op
        seen = []
        real = op.forward
        op.forward = lambda *a, **k: (seen.append(k["position_ids"]), real(*a, **k))[1]
        got = _image_run(model, ids, kw)
        del op.forward
    finally:
        tt.unpatch(model)
    assert _rel(got[0], want[0]) < 1e-5, _rel(got[0], want[0])
    assert torch.equal(got[1], want[1])
    assert seen and seen[0].shape[0] == 3 and torch.equal(seen[0].cpu(), pos), "the op saw other positions"

    wrong = type(op)(list(op.params["mrope_section"]), "2d", op.params["base"], not op.params["mrope_interleaved"])
    original = tt.from_hf_config
    tt.from_hf_config = lambda config, **kwargs: wrong
    try:
        with pytest.raises(NotImplementedError, match="gives the pairs the streams"):
            tt.patch(model)
    finally:
        tt.from_hf_config = original
    assert not tt.is_patched(model)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", sorted(VL))
def test_vl_model_with_an_image_bf16_cuda(kind):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    gen = torch.Generator().manual_seed(5)
    model = _model(kind, torch.bfloat16, "cuda")
    ids, kw = _image_prompt(kind, model, gen)
    ids = ids.cuda()
    kw = {k: v.cuda() for k, v in kw.items()}
    kw["pixel_values"] = kw["pixel_values"].to(torch.bfloat16)
    want = _image_run(model, ids, kw)
    tt.patch(model)
    try:
        got = _image_run(model, ids, kw)
    finally:
        tt.unpatch(model)
    assert _rel(got[0], want[0]) < 3e-2
    if not torch.equal(got[1], want[1]):  # bf16: a differing greedy token must be a near-tie
        col = int((got[1] != want[1]).nonzero()[0, 1])
        mm = torch.zeros(1, col, dtype=torch.long, device="cuda")
        mm[:, : ids.shape[1]] = kw["mm_token_type_ids"]
        model.model.rope_deltas = None
        with torch.no_grad():
            logits = model(want[1][:, :col], **{**kw, "mm_token_type_ids": mm}).logits[0, -1].float()
        top = logits.topk(2).values
        assert float(top[0] - top[1]) < 0.05 * float(logits.abs().max()), col


@pytest.mark.parametrize("kind", sorted(VL))
def test_vl_text_model_with_explicit_three_stream_positions(kind, gen):
    """The text model alone (model type ``*_text``), given position_ids as the whole model hands
    them: [3, batch, seq] with different streams, and [4, batch, seq] (text positions first, then
    the three streams: a strided view reaches the op)."""
    cfg = _vl_config(kind).text_config
    cls = getattr(transformers, VL[kind][1].replace("ForConditionalGeneration", "TextModel"))
    torch.manual_seed(0)
    model = cls._from_config(cfg).eval()
    ids = torch.randint(3, 128, (2, 15), generator=gen)
    three = torch.randint(0, 40, (3, 2, 15), generator=gen)
    four = torch.cat([torch.arange(15).expand(1, 2, 15), three])
    with torch.no_grad():
        want = [model(ids, position_ids=p).last_hidden_state for p in (three, four)]
        tt.patch(model)
        try:
            got = [model(ids, position_ids=p).last_hidden_state for p in (three, four)]
        finally:
            tt.unpatch(model)
    for g, w in zip(got, want):
        assert _rel(g, w) < 1e-5, _rel(g, w)
