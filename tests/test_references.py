"""Tests of the float64 references themselves (tests/references.py).

The kernels are judged against these references, so the references must be checked against
something other than themselves: the worked numbers in rope-semantics.md, hand-written element
formulas, invariants of a rotation, an independent complex-multiply formulation, and (when
installed) Hugging Face transformers' own frequency tables.
"""

import math

import pytest
import torch

try:  # pytest puts tests/ on sys.path when it is not a package, the repo root when it is
    from references import DEFAULTS, REFERENCES, inv_freq_and_amplitude, reference, yarn_correction_range
except ImportError:  # pragma: no cover
    from tests.references import DEFAULTS, REFERENCES, inv_freq_and_amplitude, reference, yarn_correction_range

F64 = torch.float64
SEQ_OPS = ["RoPEFwdOp", "RoPELlama31FwdOp", "YaRNFwdOp", "LongRoPEFwdOp"]  # ops with input_layout


def randn(*shape, seed=0):
    # Random non-zero data: zeros would hide a wrong sign or a swapped pair.
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


# --------------------------------------------------------------------------- worked checks from the doc


def test_yarn_correction_range_worked_check():
    # rope-semantics.md: D=128, base=1e4, original_max_position=2048 -> (16, 41).
    assert yarn_correction_range(128, 10000.0, 2048, 32.0, 1.0) == (16, 41)


def test_yarn_inv_freq_and_mscale_worked_check():
    params = {"scale": 4.0, "original_max_position": 2048}
    inv, mscale = inv_freq_and_amplitude("YaRNFwdOp", params, 128)
    assert mscale == pytest.approx(1.1386, abs=5e-5)
    base_inv, _ = inv_freq_and_amplitude("RoPEFwdOp", {}, 128)
    # Up to the ramp start (16) nothing is interpolated; from its end (41) all is divided by scale;
    # in between the table moves monotonically from one to the other.
    assert torch.equal(inv[:17], base_inv[:17])
    torch.testing.assert_close(inv[41:], base_inv[41:] / 4.0, rtol=1e-15, atol=0)
    ratio = inv[17:41] / base_inv[17:41]
    assert bool(((ratio < 1) & (ratio > 0.25)).all()) and bool((ratio[1:] < ratio[:-1]).all())
    # attn_factor multiplies the YaRN mscale; no scaling (scale 1) leaves just attn_factor.
    assert inv_freq_and_amplitude("YaRNFwdOp", {**params, "attn_factor": 2.0}, 128)[1] == pytest.approx(2 * mscale)
    assert inv_freq_and_amplitude("YaRNFwdOp", {"scale": 1.0, "attn_factor": 0.5}, 128)[1] == 0.5


def test_longrope_phi3_amplitude_and_factors():
    # Phi-3 128k/4k: sqrt(1 + ln 32 / ln 4096) = 1.1902.
    params = {"max_position_embeddings": 131072, "original_max_position_embeddings": 4096}
    inv, amp = inv_freq_and_amplitude("LongRoPEFwdOp", params, 96)
    assert amp == pytest.approx(1.1902, abs=5e-5)
    assert inv_freq_and_amplitude("LongRoPEFwdOp", {}, 96)[1] == 1.0  # no extension, no amplitude
    # The rescale factors multiply the divisor: inv_freq divides by them.
    factors = 1.0 + torch.rand(48, generator=torch.Generator().manual_seed(1), dtype=F64) * 20
    scaled, _ = inv_freq_and_amplitude("LongRoPEFwdOp", {**params, "rescale_factors": factors}, 96)
    torch.testing.assert_close(scaled, inv / factors, rtol=1e-14, atol=0)
    for bad in (0.0, float("nan")):
        f = factors.clone()
        f[3] = bad
        with pytest.raises(ValueError):
            inv_freq_and_amplitude("LongRoPEFwdOp", {"rescale_factors": f}, 96)


def test_base_inv_freq_values():
    inv, amp = inv_freq_and_amplitude("RoPEFwdOp", {"base": 500000.0}, 8)
    assert amp == 1.0 and inv.dtype == F64
    expected = torch.tensor([500000.0 ** (-2 * i / 8) for i in range(4)], dtype=F64)
    torch.testing.assert_close(inv, expected, rtol=1e-15, atol=0)


# --------------------------------------------------------------------------- pairings by hand


@pytest.mark.parametrize("base", [10000.0, 100.0])
def test_neox_vs_interleaved_by_hand(base):
    x = randn(3, 4, seed=2)  # three positions, head_dim 4
    neox = reference("RoPEFwdOp", {"rope_layout": "neox", "base": base}, {"x": x})
    inter = reference("RoPEFwdOp", {"rope_layout": "interleaved", "base": base}, {"x": x})
    for p in range(3):
        a, b, c, d = (float(v) for v in x[p])
        t0, t1 = p * 1.0, p * base ** (-2 / 4)  # inv_freq = [1, base^(-1/2)]
        c0, s0, c1, s1 = math.cos(t0), math.sin(t0), math.cos(t1), math.sin(t1)
        # neox pairs (0, 2) and (1, 3)
        want_neox = [a * c0 - c * s0, b * c1 - d * s1, c * c0 + a * s0, d * c1 + b * s1]
        # interleaved pairs (0, 1) and (2, 3)
        want_inter = [a * c0 - b * s0, b * c0 + a * s0, c * c1 - d * s1, d * c1 + c * s1]
        torch.testing.assert_close(neox[p], torch.tensor(want_neox, dtype=F64), rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(inter[p], torch.tensor(want_inter, dtype=F64), rtol=1e-14, atol=1e-14)
    assert not torch.allclose(neox[1:], inter[1:])  # the pairings really differ


def test_interleaved_matches_complex_multiply():
    # Meta's Llama formulation: view pairs (2i, 2i+1) as complex numbers, multiply by e^{i p theta}.
    x = randn(37, 64, seed=3)
    out = reference("RoPEFwdOp", {"rope_layout": "interleaved"}, {"x": x})
    inv = 10000.0 ** (-torch.arange(0, 64, 2, dtype=F64) / 64)
    angle = torch.arange(37, dtype=F64)[:, None] * inv
    z = torch.view_as_complex(x.double().reshape(37, 32, 2)) * torch.polar(torch.ones_like(angle), angle)
    torch.testing.assert_close(out, torch.view_as_real(z).reshape(37, 64), rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("op", SEQ_OPS)
def test_2d_layout_is_1d_per_batch_and_head(op):
    # The 2d layout [batch, seq, heads, dim] uses the seq index, independent of batch and head.
    x = randn(2, 19, 3, 32, seed=4)
    out = reference(op, {"input_layout": "2d"}, {"x": x})
    assert out.shape == x.shape and out.dtype == F64
    for b in range(2):
        for h in range(3):
            want = reference(op, {"input_layout": "1d"}, {"x": x[:, :, h, :][b]})
            assert torch.equal(out[b, :, h, :], want)


# --------------------------------------------------------------------------- rotation invariants


@pytest.mark.parametrize("op", SEQ_OPS)
@pytest.mark.parametrize("rope_layout", ["neox", "interleaved"])
def test_pair_norm_scaled_by_amplitude(op, rope_layout):
    x = randn(300, 64, seed=5)
    params = {"rope_layout": rope_layout, "scale": 8.0, "max_position_embeddings": 16384}
    out = reference(op, params, {"x": x})
    _, amp = inv_freq_and_amplitude(op, params, 64)
    if "rope_layout" not in DEFAULTS[op]:
        rope_layout = "neox"  # only RoPEFwdOp and YaRNFwdOp have an interleaved option
    xd = x.double()
    if rope_layout == "neox":
        pairs_in, pairs_out = (xd[:, :32], xd[:, 32:]), (out[:, :32], out[:, 32:])
    else:
        pairs_in, pairs_out = (xd[:, 0::2], xd[:, 1::2]), (out[:, 0::2], out[:, 1::2])
    n_in = torch.hypot(*pairs_in)
    n_out = torch.hypot(*pairs_out)
    torch.testing.assert_close(n_out, amp * n_in, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("op", SEQ_OPS)
def test_position_zero_is_identity(op):
    # cos 0 = 1 and sin 0 = 0 exactly, so with amplitude 1 row 0 comes back bit-identical
    # (YaRN's default scale 16 has an mscale, so take scale 1 there).
    x = randn(5, 128, seed=6)
    params = {"rope_layout": "interleaved", "scale": 1.0}
    out = reference(op, params, {"x": x})
    assert inv_freq_and_amplitude(op, params, 128)[1] == 1.0
    assert torch.equal(out[0], x[0].double())
    assert not torch.allclose(out[1], x[1].double())  # ...and row 1 is not
    # With an amplitude, position 0 is a pure scaling by it (still exact: x*amp - y*0).
    params = {"scale": 4.0, "max_position_embeddings": 8 * 4096}
    out = reference(op, params, {"x": x})
    assert torch.equal(out[0], x[0].double() * inv_freq_and_amplitude(op, params, 128)[1])


def test_position_ids_zero_is_identity_and_bounds():
    x = randn(6, 4, 64, seed=7)
    params = {"max_position": 8192}
    zeros = torch.zeros(6, dtype=torch.int64)
    assert torch.equal(reference("RoPENeoxPositionIdsFwdOp", params, {"x": x, "position_ids": zeros}), x.double())
    for bad in (-1, 8192):
        pos = torch.full((6,), bad, dtype=torch.int32)
        with pytest.raises(ValueError):
            reference("RoPENeoxPositionIdsFwdOp", params, {"x": x, "position_ids": pos})


@pytest.mark.parametrize("rotary_dim", [16, 32, 48, 64])
def test_partial_rotary_tail_and_agreement(rotary_dim):
    x = randn(23, 5, 64, seed=8)
    pos = torch.randint(0, 8192, (23,), generator=torch.Generator().manual_seed(9), dtype=torch.int32)
    params = {"max_position": 8192, "rotary_dim": rotary_dim}
    out = REFERENCES["RoPENeoxPositionIdsFwdOp"](params, {"x": x, "position_ids": pos})
    # Columns from rotary_dim on are copied, bit for bit.
    assert torch.equal(out[..., rotary_dim:], x.double()[..., rotary_dim:])
    # The rotated head is neox RoPE with D = rotary_dim: check against RoPEFwdOp at each token's
    # position (RoPEFwdOp's row s sits at position s, so evaluate a sequence up to max(pos)).
    head = x[..., :rotary_dim]
    for t in range(0, 23, 7):
        seq = head[t, 0].expand(int(pos[t]) + 1, rotary_dim)  # the last row sits at position pos[t]
        want = reference("RoPEFwdOp", {}, {"x": seq})[-1]
        torch.testing.assert_close(out[t, 0, :rotary_dim], want, rtol=1e-13, atol=1e-13)


def test_position_ids_arange_matches_sequence_op():
    x = randn(40, 3, 32, seed=10)
    pos = torch.arange(40, dtype=torch.int64)
    a = reference("RoPENeoxPositionIdsFwdOp", {"max_position": 40}, {"x": x, "position_ids": pos})
    b = reference("RoPEFwdOp", {"input_layout": "2d"}, {"x": x[None]})[0]
    assert torch.equal(a, b)


# --------------------------------------------------------------------------- Llama 3.1 bands


def test_llama31_bands():
    params = {"base": 500000.0}
    inv, amp = inv_freq_and_amplitude("RoPELlama31FwdOp", params, 128)
    base_inv, _ = inv_freq_and_amplitude("RoPEFwdOp", params, 128)
    wavelen = 2 * math.pi / base_inv
    high = wavelen < 8192 / 4.0  # short wavelengths: unchanged
    low = wavelen > 8192 / 1.0  # long wavelengths: divided by scale_factor 8
    mid = ~high & ~low
    assert amp == 1.0 and high.any() and low.any() and mid.any()
    assert torch.equal(inv[high], base_inv[high])
    assert inv[0] == base_inv[0]  # the highest frequency, explicitly
    torch.testing.assert_close(inv[low], base_inv[low] / 8.0, rtol=1e-15, atol=0)
    assert inv[-1] == base_inv[-1] / 8.0  # the lowest frequency, explicitly
    ratio = inv[mid] / base_inv[mid]  # medium band: strictly between the two
    assert bool(((ratio > 1 / 8.0) & (ratio < 1.0)).all())
    with pytest.raises(ValueError):
        inv_freq_and_amplitude("RoPELlama31FwdOp", {"low_freq_factor": 2.0, "high_freq_factor": 2.0}, 128)


def test_unknown_op_and_layout_rejected():
    with pytest.raises(KeyError):
        reference("NoSuchOp", {}, {"x": randn(2, 4)})
    with pytest.raises(ValueError):
        reference("RoPEFwdOp", {"input_layout": "3d"}, {"x": randn(2, 4)})


# --------------------------------------------------------------------------- Hugging Face cross-check


def _hf_config(head_dim, rope_parameters, max_position_embeddings):
    # LlamaConfig is a real PreTrainedConfig, so standardize_rope_params() and the attributes the
    # init functions read (head_dim, rope_parameters, max_position_embeddings) behave as in a model.
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rope_parameters=rope_parameters,
    )


def _hf_cases():
    f = [1.0 + 0.37 * i for i in range(32)]  # LongRoPE factors for head_dim 64 (32 pairs)
    return [
        # (hf rope_type, hf rope_parameters, hf max_position_embeddings, our op, our params, head_dim)
        ("default", {"rope_type": "default", "rope_theta": 10000.0}, 4096, "RoPEFwdOp", {}, 128),
        ("default", {"rope_type": "default", "rope_theta": 500000.0}, 4096, "RoPEFwdOp", {"base": 500000.0}, 64),
        ("llama3", {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
         131072, "RoPELlama31FwdOp", {"base": 500000.0}, 128),
        ("llama3", {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 2.0,
                    "high_freq_factor": 8.0, "original_max_position_embeddings": 2048},
         8192, "RoPELlama31FwdOp",
         {"scale_factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0, "original_max_position": 2048}, 64),
        ("yarn", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 2048},
         8192, "YaRNFwdOp", {"scale": 4.0, "original_max_position": 2048}, 128),
        ("yarn", {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0, "beta_fast": 16.0,
                  "beta_slow": 2.0, "original_max_position_embeddings": 4096},
         65536, "YaRNFwdOp", {"base": 1e6, "beta_fast": 16.0, "beta_slow": 2.0}, 64),
        ("longrope", {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": f, "long_factor": f,
                      "original_max_position_embeddings": 4096},
         131072, "LongRoPEFwdOp", {"rescale_factors": torch.tensor(f), "max_position_embeddings": 131072}, 64),
    ]


def _hf_tables(case):
    """HF's (inv_freq, attention scaling) for one of ``_hf_cases()``."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type, hf_params, hf_max_pos, _, _, head_dim = case
    config = _hf_config(head_dim, dict(hf_params), hf_max_pos)
    if rope_type == "default":
        # transformers 5 no longer lists "default" in ROPE_INIT_FUNCTIONS; models carry it.
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        init = ROPE_INIT_FUNCTIONS.get("default") or LlamaRotaryEmbedding.compute_default_rope_parameters
    else:
        init = ROPE_INIT_FUNCTIONS[rope_type]
    return init(config)


@pytest.mark.parametrize("case", _hf_cases(), ids=lambda c: c[0])
def test_inv_freq_and_amplitude_match_transformers(case):
    pytest.importorskip("transformers")
    _, _, _, op, params, head_dim = case
    hf_inv, hf_amp = _hf_tables(case)
    inv, amp = inv_freq_and_amplitude(op, params, head_dim)
    # HF builds its table in float32: agreement to a few float32 ulps is all that can be asked.
    torch.testing.assert_close(inv, hf_inv.double(), rtol=4e-7, atol=0)
    assert amp == pytest.approx(float(hf_amp), rel=1e-12)


def test_yarn_attn_factor_vs_transformers():
    # Deliberate difference: HF's `attention_factor` *replaces* the 0.1 ln(scale) + 1 mscale, while our
    # `attn_factor` (vLLM's convention, and rope-semantics.md) *multiplies* it. HF's `truncate` option
    # (default True: floor/ceil the ramp ends) matches ours; truncate=False is not modelled.
    pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    mscale = 0.1 * math.log(4.0) + 1.0
    hf = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "attention_factor": 0.7 * mscale,
          "original_max_position_embeddings": 2048}
    hf_inv, hf_amp = ROPE_INIT_FUNCTIONS["yarn"](_hf_config(128, hf, 8192))
    inv, amp = inv_freq_and_amplitude(
        "YaRNFwdOp", {"scale": 4.0, "original_max_position": 2048, "attn_factor": 0.7}, 128)
    torch.testing.assert_close(inv, hf_inv.double(), rtol=4e-7, atol=0)
    assert amp == pytest.approx(hf_amp, rel=1e-12)


def test_neox_output_matches_transformers_rotate_half():
    # The pairing itself, against HF's apply_rotary_pos_emb (rotate_half), fed float64 cos/sin.
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    x = randn(2, 33, 3, 64, seed=11)
    params = {"input_layout": "2d", "scale": 4.0, "original_max_position": 2048}
    inv, amp = inv_freq_and_amplitude("YaRNFwdOp", params, 64)
    freqs = torch.arange(33, dtype=F64)[:, None] * inv
    emb = torch.cat((freqs, freqs), dim=-1)[None].expand(2, -1, -1)  # [batch, seq, dim]
    q, _ = apply_rotary_pos_emb(x.double(), x.double(), emb.cos() * amp, emb.sin() * amp, unsqueeze_dim=2)
    torch.testing.assert_close(reference("YaRNFwdOp", params, {"x": x}), q, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("case", _hf_cases(), ids=lambda c: c[0])
def test_op_frequencies_match_transformers(case):
    """The ops' own float64 tables (what the kernels' cos/sin come from) against HF's init functions."""
    pytest.importorskip("transformers")
    from tileops.workloads import op_class

    _, _, _, op_name, params, head_dim = case
    hf_inv, hf_amp = _hf_tables(case)
    inv, amp = op_class(op_name)(**params).frequencies(head_dim)
    torch.testing.assert_close(inv, hf_inv.double(), rtol=4e-7, atol=0)
    assert amp == pytest.approx(float(hf_amp), rel=1e-12)
