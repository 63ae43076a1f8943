"""MRoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): ``MRoPEFwdOp`` against transformers' own rotary
embedding and apply function, against the independent float64 reference, and its positions: three
streams, read through any strides, each bounds-checked. (The generated tests run the manifest's
cases; the patched models are in test_hf.py.)"""

from __future__ import annotations

import pytest
import torch

from tileops import BUILTIN
from tileops.rope import MRoPEFwdOp, RoPEFwdOp, RoPENeoxPositionIdsFwdOp

try:  # pytest puts tests/ on sys.path when it is not a package, the repo root when it is
    from references import mrope_pair_streams, reference
except ImportError:  # pragma: no cover
    from tests.references import mrope_pair_streams, reference

TARGETS = [BUILTIN, "torch"]
LAYOUTS = {"1d": lambda b, s, h, d, g: torch.randn(s, d, generator=g),
           "2d": lambda b, s, h, d, g: torch.randn(b, s, h, d, generator=g),
           "packed": lambda b, s, h, d, g: torch.randn(s, h, d, generator=g)}


def _rows(layout: str, x: torch.Tensor) -> tuple[int, ...]:
    return tuple(x.shape[:2]) if layout == "2d" else tuple(x.shape[:1])


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = 2e-5) -> None:
    torch.testing.assert_close(got.double(), want.double(), atol=tol, rtol=tol)


# ------------------------------------------------------------------------------ against transformers
def _hf(model: str):
    """transformers' modeling module and text config class of ``model``; skips where the installed
    version lays MRoPE out differently (no ``recomposition_frequencies``)."""
    transformers = pytest.importorskip("transformers")
    mod = pytest.importorskip(f"transformers.models.{model}.modeling_{model}")
    rotary = {"qwen2_vl": "Qwen2VLRotaryEmbedding", "qwen2_5_vl": "Qwen2_5_VLRotaryEmbedding",
              "qwen3_vl": "Qwen3VLTextRotaryEmbedding"}[model]
    cls = getattr(mod, rotary, None)
    if cls is None or not hasattr(cls, "recomposition_frequencies"):
        pytest.skip(f"transformers {transformers.__version__}: {model} has no {rotary}.recomposition_frequencies")
    config = {"qwen2_vl": "Qwen2VLTextConfig", "qwen2_5_vl": "Qwen2_5_VLTextConfig",
              "qwen3_vl": "Qwen3VLTextConfig"}[model]
    return mod, cls, getattr(transformers, config)


def _hf_rotary(model: str, section, head_dim: int, theta: float):
    mod, cls, config_cls = _hf(model)
    cfg = config_cls(vocab_size=64, hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=head_dim, num_hidden_layers=1, intermediate_size=32,
                     rope_parameters={"rope_type": "default", "mrope_section": list(section), "rope_theta": theta})
    return mod, cls(cfg)


SECTIONS = [("qwen2_vl", (16, 24, 24)), ("qwen2_vl", (2, 3, 3)), ("qwen2_5_vl", (16, 24, 24)),
            ("qwen2_5_vl", (5, 1, 2)), ("qwen3_vl", (24, 20, 20)), ("qwen3_vl", (3, 3, 2)),
            ("qwen3_vl", (1, 1, 30)), ("qwen3_vl", (30, 1, 1)), ("qwen3_vl", (10, 13, 13))]


@pytest.mark.parametrize("model, section", SECTIONS)
def test_reference_stream_map_is_transformers(model, section):
    """The references' per-pair stream (written from the semantics) is the one transformers' own
    recomposition gives: its recomposition_frequencies run on a marker, stream c holding c."""
    _, rot = _hf_rotary(model, section, 2 * sum(section), 1e4)
    half = sum(section)
    marker = torch.arange(3, dtype=torch.float64).view(3, 1, 1, 1).expand(3, 1, 1, half).clone()
    got = rot.recomposition_frequencies(marker)
    assert got.shape[-1] == 2 * half and torch.equal(got[..., :half], got[..., half:])
    want = mrope_pair_streams(section, model == "qwen3_vl", half)
    assert got.reshape(-1, 2 * half)[0, :half].long().tolist() == want
    op = MRoPEFwdOp(list(section), mrope_interleaved=model == "qwen3_vl")
    assert op.streams().tolist() == want


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("model, section", [("qwen2_vl", (16, 24, 24)), ("qwen2_5_vl", (2, 3, 3)),
                                            ("qwen3_vl", (24, 20, 20)), ("qwen3_vl", (3, 3, 2))])
def test_matches_transformers_rotary_and_apply(model, section, target, gen):
    """q and k (GQA) at random, different positions in the three streams: the op against
    transformers' rotary embedding and apply_rotary_pos_emb (its fp32 angles: positions below 200
    keep their error under the tolerance), and against transformers' recomposition and apply run in
    float64 on float64 angles, at positions up to 2^20."""
    D = 2 * sum(section)
    mod, rot = _hf_rotary(model, section, D, 1e6 if model != "qwen3_vl" else 5e6)
    interleaved = model == "qwen3_vl"
    op = MRoPEFwdOp(list(section), "2d", float(rot.config.rope_parameters["rope_theta"]), interleaved,
                    target=target)
    B, H, S = 2, 4, 11
    q = torch.randn(B, H, S, D, generator=gen)
    k = torch.randn(B, 2, S, D, generator=gen)
    pos = torch.randint(0, 200, (3, B, S), generator=gen)
    cos, sin = rot(q, pos)
    hq, hk = mod.apply_rotary_pos_emb(q, k, cos, sin)
    oq, ok = op(q.transpose(1, 2), position_ids=pos, key=k.transpose(1, 2))
    _close(oq.transpose(1, 2), hq, 5e-5)
    _close(ok.transpose(1, 2), hk, 5e-5)
    assert not torch.allclose(oq.transpose(1, 2), op_as_rope(q, pos[0], rot), atol=1e-3), "streams ignored"

    pos = torch.randint(0, 2**20, (3, B, S), generator=gen)
    inv = 1.0 / rot.config.rope_parameters["rope_theta"] ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    freqs = pos[..., None].double() * inv  # [3, B, S, D/2], as the rotary embedding forms them
    hq, hk = mod.apply_rotary_pos_emb(q.double(), k.double(), rot.recomposition_frequencies(freqs.cos()),
                                      rot.recomposition_frequencies(freqs.sin()))
    oq, ok = op(q.transpose(1, 2), position_ids=pos, key=k.transpose(1, 2))
    _close(oq.transpose(1, 2), hq)
    _close(ok.transpose(1, 2), hk)
    ref = reference("MRoPEFwdOp", op.params, {"x": q.transpose(1, 2), "position_ids": pos})
    # the reference is HF's maths (1e-9: the two spell base^(-2i/D) differently, angles reach 1e6 rad)
    torch.testing.assert_close(ref.transpose(1, 2), hq, atol=1e-9, rtol=1e-9)


def op_as_rope(q: torch.Tensor, pos: torch.Tensor, rot) -> torch.Tensor:
    """q rotated by plain RoPE at the temporal stream alone (what ignoring the other two would give)."""
    base = float(rot.config.rope_parameters["rope_theta"])
    return RoPEFwdOp(input_layout="2d", base=base)(q.transpose(1, 2), position_ids=pos).transpose(1, 2)


# ------------------------------------------------------------------------------ positions
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_equal_streams_and_no_positions_are_plain_rope(layout, target, gen):
    """A text token has three equal positions: that is plain RoPE, bit for bit (the same digits
    pick the same table rows); so is a call without position_ids (1d, 2d)."""
    x = LAYOUTS[layout](2, 9, 3, 64, gen)
    rows = _rows(layout, x)
    p = torch.randint(0, 2**24, rows, generator=gen)
    op = MRoPEFwdOp([10, 11, 11], layout, 5e5, True, target=target)
    got = op(x, position_ids=p.expand(3, *rows))  # a stride-0 stream dim: no copy
    if layout == "packed":
        plain = RoPENeoxPositionIdsFwdOp(2**24, 5e5, target=target)(x, p)
    else:
        plain = RoPEFwdOp("neox", layout, 5e5, target=target)(x, position_ids=p)
        assert torch.equal(op(x), RoPEFwdOp("neox", layout, 5e5, target=target)(x))
    assert torch.equal(got, plain)
    assert not torch.equal(op(x, position_ids=torch.stack([p, p, (p + 1) % 2**24])), plain)


@pytest.mark.parametrize("target", TARGETS)
def test_positions_through_any_strides(target, gen):
    """The [3, batch, seq] positions are read where they lie: the last three rows of HF's [4, B, S]
    (text row first), a batch-shared [3, 1, S] expanded, a transposed [B, S, 3], every other
    column, int32; x and key as HF's transposed views."""
    B, S, D = 3, 13, 128
    op = MRoPEFwdOp([16, 24, 24], "2d", 1e6, target=target)
    q = torch.randn(B, 4, S, D, generator=gen).transpose(1, 2)
    k = torch.randn(B, 2, S, D, generator=gen).transpose(1, 2)
    four = torch.randint(0, 2**24, (4, B, S), generator=gen)
    shared = torch.randint(0, 5000, (3, 1, S), generator=gen)
    wide = torch.randint(0, 2**24, (3, B, 2 * S), generator=gen)
    views = {"hf-4-rows": four[1:], "shared": shared.expand(3, B, S),
             "transposed": torch.randint(0, 2**24, (B, S, 3), generator=gen).permute(2, 0, 1),
             "every-other": wide[..., ::2], "int32": four[1:].to(torch.int32)}
    for name, pos in views.items():
        before = pos.clone()
        oq, ok = op(q, position_ids=pos, key=k)
        dense = pos.contiguous()
        _close(oq, reference("MRoPEFwdOp", op.params, {"x": q, "position_ids": dense}))
        _close(ok, reference("MRoPEFwdOp", op.params, {"x": k, "position_ids": dense}))
        assert torch.equal(pos, before), name


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("stream", [0, 1, 2])
def test_a_bad_position_in_any_stream_names_its_index(stream, target, gen):
    op = MRoPEFwdOp([8, 12, 12], "2d", target=target)
    x = torch.randn(2, 6, 3, 64, generator=gen)
    for bad in (-1, 2**24):
        pos = torch.randint(0, 100, (3, 2, 6), generator=gen)
        pos[stream, 1, 4] = bad
        with pytest.raises(ValueError, match=rf"position_ids\[{stream}, 1, 4\] = {bad}\b"):
            op(x, position_ids=pos)
    pos = torch.randint(0, 2**24, (3, 2, 6), generator=gen)  # after the error the op works
    _close(op(x, position_ids=pos), reference("MRoPEFwdOp", op.params, {"x": x, "position_ids": pos}))


@pytest.mark.parametrize("target", TARGETS)
def test_in_place_out_and_gradients(target, gen):
    op = MRoPEFwdOp([10, 15, 15], "packed", 1e4, True, target=target)
    x = torch.randn(17, 5, 80, generator=gen)
    k = torch.randn(17, 1, 80, generator=gen)
    pos = torch.randint(0, 2**24, (3, 17), generator=gen)
    want_x = reference("MRoPEFwdOp", op.params, {"x": x, "position_ids": pos})
    want_k = reference("MRoPEFwdOp", op.params, {"x": k, "position_ids": pos})
    xi, ki = x.clone(), k.clone()
    got = op(xi, position_ids=pos, key=ki, out=xi, key_out=ki)
    assert got[0] is xi and got[1] is ki
    _close(xi, want_x)
    _close(ki, want_k)
    xg, kg = x.clone().requires_grad_(), k.clone().requires_grad_()
    oq, ok = op(xg, position_ids=pos, key=kg)
    gq, gk = torch.randn(oq.shape, generator=gen), torch.randn(ok.shape, generator=gen)
    (oq * gq).sum().add((ok * gk).sum()).backward()
    x64, k64 = x.double().requires_grad_(), k.double().requires_grad_()
    rq = reference("MRoPEFwdOp", op.params, {"x": x64, "position_ids": pos})
    rk = reference("MRoPEFwdOp", op.params, {"x": k64, "position_ids": pos})
    ((rq * gq.double()).sum() + (rk * gk.double()).sum()).backward()
    _close(xg.grad, x64.grad)
    _close(kg.grad, k64.grad)


# ------------------------------------------------------------------------------ refused
@pytest.mark.parametrize("section, exc", [([16, 24], ValueError), ([16, 24, 24, 0], ValueError),
                                          ([0, 32, 32], ValueError), ([-8, 36, 36], ValueError),
                                          ([16.0, 24, 24], TypeError), ("16,24,24", TypeError),
                                          (None, TypeError), ([True, 31, 32], TypeError)])
def test_bad_sections_are_refused_at_construction(section, exc):
    with pytest.raises(exc, match=r"mrope_section"):
        MRoPEFwdOp(section)


def test_sections_must_cover_the_head(gen):
    op = MRoPEFwdOp([16, 24, 24], "2d")
    pos = torch.zeros(3, 1, 5, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"mrope_section: expected 3 counts summing to head_dim // 2 = 32.*"
                                         r"got \[16, 24, 24\] \(sum 64\)"):
        op(torch.randn(1, 5, 2, 64, generator=gen), position_ids=pos)


def test_position_shapes_are_checked(gen):
    op = MRoPEFwdOp([16, 24, 24], "2d")
    x = torch.randn(3, 5, 2, 128, generator=gen)
    # [batch, seq] positions (RoPEFwdOp's form) are not read as three streams, even with batch 3
    with pytest.raises(ValueError, match=r"position_ids: expected 3 dims \[streams, batch, seq_len\]"):
        op(x, position_ids=torch.zeros(3, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"position_ids: expected 3 position streams"):
        op(x, position_ids=torch.zeros(4, 3, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"position_ids: expected batch=3"):
        op(x, position_ids=torch.zeros(3, 1, 5, dtype=torch.int64))
    packed = MRoPEFwdOp([16, 24, 24], "packed")
    with pytest.raises(ValueError, match=r"position_ids: expected \[3, tokens\] positions"):
        packed(torch.randn(5, 2, 128, generator=gen))


# ------------------------------------------------------------------------------ CUDA (the H200)
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("section, interleaved, D", [((16, 24, 24), False, 128), ((24, 20, 20), True, 128),
                                                     ((10, 15, 15), False, 80), ((4, 2, 2), False, 16),
                                                     ((10, 13, 13), True, 72)])
def test_cuda_matches_the_reference(section, interleaved, D, dtype):
    """Both CUDA paths: sections that are multiples of the 16-byte vector (one stream per thread,
    wide table loads) and the rest (interleaved, or [10, 15, 15]: a table row per pair); strided
    positions and HF's transposed q/k; bad positions in each stream reported by check()."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    import tileops
    from tileops.testing import TOLERANCES

    gen = torch.Generator().manual_seed(11)
    op = MRoPEFwdOp(list(section), "2d", 1e6, interleaved, target=BUILTIN)
    B, S = 3, 301
    q = torch.randn(B, 7, S, D, generator=gen).to(dtype).cuda().transpose(1, 2)
    k = torch.randn(B, 2, S, D, generator=gen).to(dtype).cuda().transpose(1, 2)
    pos = torch.randint(0, 2**24, (4, B, S), generator=gen).cuda()[1:]
    oq, ok = op(q, position_ids=pos, key=k)
    atol, rtol = TOLERANCES[str(dtype).replace("torch.", "")]
    for got, t in ((oq, q), (ok, k)):
        want = reference("MRoPEFwdOp", op.params, {"x": t.cpu(), "position_ids": pos.cpu()})
        torch.testing.assert_close(got.double().cpu(), want, atol=atol, rtol=rtol)
    for stream in range(3):
        bad = pos.clone()
        bad[stream, 2, 100] = 2**24
        op(q, position_ids=bad, key=k)
        with pytest.raises(ValueError, match=rf"position_ids\[{stream}, 2, 100\] = 16777216"):
            op.check()
    with tileops.strict(), pytest.raises(ValueError, match=r"position_ids\[1, 2, 100\]"):
        bad = pos.clone()
        bad[1, 2, 100] = -1
        op(q, position_ids=bad, key=k)


@pytest.mark.cuda
def test_cuda_packed_and_text_only():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(1000, 28, 128, generator=gen).to(torch.bfloat16).cuda()
    p = torch.randint(0, 2**24, (1000,), generator=gen).cuda()
    op = MRoPEFwdOp([16, 24, 24], "packed", 1e6, target=BUILTIN)
    assert torch.equal(op(x, position_ids=p.expand(3, 1000)), RoPENeoxPositionIdsFwdOp(2**24, 1e6)(x, p))
    pos = torch.randint(0, 2**24, (3, 1000), generator=gen).cuda()
    want = reference("MRoPEFwdOp", op.params, {"x": x.cpu(), "position_ids": pos.cpu()})
    torch.testing.assert_close(op(x, position_ids=pos).double().cpu(), want, atol=1.6e-2, rtol=1.6e-2)
