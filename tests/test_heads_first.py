"""``input_layout="bhsd"``: transformers' ``[batch, heads, seq, head_dim]`` rotated where it lies.

The layout is the ``"2d"`` kernel reading other strides, so on every RoPE op that offers it a call
must give the bits of the ``"2d"`` op called on the transposed view, forward and backward, for HF's
own tensors (transposes of ``[batch, seq, heads, D]`` projections) and for dense ``[B, H, S, D]``
ones; the outputs are laid out like the inputs; a shape that does not fit names the dim. The HF
patch calls the op on q and k as they come, with no transposes.
"""

from __future__ import annotations

import pytest
import torch

from tileops.manifest import registry
from tileops.workloads import op_class, workload

REGISTRY = registry()
#: each op offering the layout, with the first of its manifest's "2d" cases (its params fit the op)
LAYOUT = {name: p for name, m in REGISTRY.items() for p in m.params if p.name == "input_layout"}
OPS = [(name, next(c for c in m.cases if c.params.get("input_layout", LAYOUT[name].default) == "2d"))
       for name, m in sorted(REGISTRY.items()) if "bhsd" in (getattr(LAYOUT.get(name), "choices", None) or ())]


def test_every_batched_rope_op_offers_the_layout():
    names = {n for n, _ in OPS}
    assert names == {n for n, m in REGISTRY.items() if m.family == "rope" and n != "RoPENeoxPositionIdsFwdOp"}


def _pair(name: str, case, gen: torch.Generator):
    """The op in "2d" and in "bhsd", and the case's shrunk CPU inputs ([B, S, H, D] tensors)."""
    m = REGISTRY[name]
    w = workload(m, case, "float32", "cpu", shrink=True, generator=gen)
    two = op_class(name)(**w.params)
    hf = op_class(name)(**{**w.params, "input_layout": "bhsd"})
    return two, hf, w.inputs


def _views(inputs: dict, dense: bool) -> dict:
    """The inputs as "bhsd" takes them: x and key transposed (HF's views), or made dense so."""
    out = dict(inputs)
    for k in ("x", "key"):
        if out.get(k) is not None:
            t = out[k].transpose(1, 2)
            out[k] = t.contiguous() if dense else t
    return out


@pytest.mark.parametrize("dense", [False, True], ids=["hf-views", "dense"])
@pytest.mark.parametrize("name,case", OPS, ids=[n for n, _ in OPS])
def test_bhsd_gives_the_bits_of_2d_on_the_transpose(name, case, dense, gen):
    two, hf, inputs = _pair(name, case, gen)
    b, s, h, d = inputs["x"].shape
    key = torch.randn(b, s, 1, d, generator=gen)  # a GQA key: its own head count
    given = {"x": inputs["x"], "key": key}
    if name == "MRoPEFwdOp":
        poss = [None, torch.randint(0, 4096, (3, b, s), generator=gen)]
    else:
        poss = [None, torch.randint(0, 4096, (b, s), generator=gen), torch.randint(0, 4096, (s,), generator=gen)]
    for pos in poss:
        call = {**given, "position_ids": pos}
        want = two(**call)
        hf_call = _views(call, dense)
        before = {k: v.clone() for k, v in hf_call.items() if v is not None}
        got = hf(**hf_call)
        for w_, g_, src in zip(want, got, (hf_call["x"], hf_call["key"])):
            assert torch.equal(g_.transpose(1, 2), w_)
            assert g_.shape == src.shape and g_.stride() == torch.empty_like(src).stride()
        for k, v in before.items():
            assert torch.equal(hf_call[k], v), f"{k} was modified"


GRAD_OPS = [o for o in OPS if o[0] in ("RoPEFwdOp", "MRoPEFwdOp", "YaRNFwdOp")]


@pytest.mark.parametrize("name,case", GRAD_OPS, ids=[n for n, _ in GRAD_OPS])
def test_bhsd_gradients_and_in_place_are_those_of_2d(name, case, gen):
    two, hf, inputs = _pair(name, case, gen)
    x = inputs["x"]
    g = torch.randn(x.shape, generator=gen)
    a = x.clone().requires_grad_()
    two(a).backward(g)
    bh = x.transpose(1, 2).clone().requires_grad_()  # dense [B, H, S, D]
    hf(bh).backward(g.transpose(1, 2))
    assert torch.equal(bh.grad.transpose(1, 2), a.grad)
    inplace = x.transpose(1, 2).clone()
    assert hf(inplace, out=inplace) is inplace
    assert torch.equal(inplace.transpose(1, 2), two(x))


def test_bhsd_names_the_dim_a_position_tensor_misses(gen):
    from tileops.rope import RoPEFwdOp

    op = RoPEFwdOp(input_layout="bhsd")
    x = torch.randn(2, 4, 7, 16, generator=gen)  # [batch 2, heads 4, seq 7, D 16]
    with pytest.raises(ValueError, match=r"position_ids: expected seq_len=7 \(as in x\), got seq_len=4"):
        op(x, position_ids=torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="key: expected"):
        op(x, key=torch.randn(2, 1, 5, 16, generator=gen))


def test_from_hf_config_makes_the_layout_asked_and_refuses_another():
    from tileops.rope import from_hf_config

    cfg = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "rope_theta": 10000.0,
           "max_position_embeddings": 128}
    assert from_hf_config(cfg).params["input_layout"] == "2d"
    assert from_hf_config(cfg, input_layout="bhsd").params["input_layout"] == "bhsd"
    with pytest.raises(ValueError, match=r"from_hf_config: input_layout: expected one of '2d', 'bhsd', got '1d'"):
        from_hf_config(cfg, input_layout="1d")


def test_the_hf_patch_rotates_q_and_k_as_they_come(gen):
    """``apply_rotary_pos_emb`` of a patched model hands the op HF's q and k themselves: no view made."""
    pytest.importorskip("transformers")
    from tileops.integrations import transformers as tt

    seen = []

    class Spy:
        name = "RoPEFwdOp"

        def forward(self, x, position_ids=None, key=None):
            seen.append((x, key))
            return x, key

    q = torch.randn(2, 5, 4, 16, generator=gen).transpose(1, 2)  # HF's: a transposed projection
    k = torch.randn(2, 5, 2, 16, generator=gen).transpose(1, 2)
    out = tt._rotate((Spy(), torch.arange(5)[None]), q, k)
    assert seen[0][0] is q and seen[0][1] is k and out[0] is q and out[1] is k


@pytest.mark.cuda
@pytest.mark.parametrize("dense", [False, True], ids=["hf-views", "dense"])
def test_bhsd_on_cuda_gives_the_bits_of_2d_short_and_head_major(dense, gen):
    """On CUDA too, and past ``TRANSPOSED_MIN_TOKENS`` where a dense ``[B, H, S, D]`` (head-major in
    memory) takes the kernel made for head-major views, as HF's views do under "2d"."""
    from tileops.rope import RoPEFwdOp
    from tileops.rope.builtin import TRANSPOSED_MIN_TOKENS

    two, hf = RoPEFwdOp(input_layout="2d"), RoPEFwdOp(input_layout="bhsd")
    for s in (7, TRANSPOSED_MIN_TOKENS + 3):
        q = torch.randn(1, s, 4, 128, generator=gen).to("cuda", torch.bfloat16)  # [B, S, H, D]
        k = torch.randn(1, s, 2, 128, generator=gen).to("cuda", torch.bfloat16)
        pos = torch.randint(0, 1 << 20, (1, s), generator=gen).to("cuda")
        call = _views({"x": q, "key": k, "position_ids": pos}, dense)
        want = two(q, position_ids=pos, key=k)
        got = hf(**call)
        hf.check()
        assert torch.equal(got[0].transpose(1, 2), want[0]) and torch.equal(got[1].transpose(1, 2), want[1])
    head_major = (False, True) in next(iter(hf._impls.values()))._kernels
    assert head_major == dense  # HF's views of [B, S, H, D] projections are token-major: the usual kernel
