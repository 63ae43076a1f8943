"""The five documented ops keep their documented constructor signatures, character for character:
the positional parameters in order with their defaults, and everything added since keyword-only
(after ``*``), so a call written against the documented signature keeps its meaning.

The annotations are left out of the comparison: they are the generator's (``tileops generate``),
and the documented text names parameters, order, kinds and defaults, not types.
"""

from __future__ import annotations

import inspect

import pytest

from tileops import rope

DOCUMENTED = [
    "RoPEFwdOp(rope_layout='neox', input_layout='1d', base=10000.0, *, target=None)",
    "RoPENeoxPositionIdsFwdOp(max_position, base=10000.0, rotary_dim=None, *, target=None)",
    "RoPELlama31FwdOp(input_layout='1d', base=10000.0, scale_factor=8.0, low_freq_factor=1.0, "
    "high_freq_factor=4.0, original_max_position=8192, *, target=None)",
    # rope_layout came after the documented signature: keyword-only, after the `*`
    "YaRNFwdOp(input_layout='1d', base=10000.0, scale=16.0, original_max_position=4096, beta_fast=32.0, "
    "beta_slow=1.0, attn_factor=1.0, *, rope_layout='neox', target=None)",
    "LongRoPEFwdOp(input_layout='1d', base=10000.0, rescale_factors=None, max_position_embeddings=4096, "
    "original_max_position_embeddings=4096, *, target=None)",
]


def _unannotated(cls: type) -> str:
    sig = inspect.signature(cls)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return f"{cls.__name__}{sig.replace(parameters=params, return_annotation=inspect.Signature.empty)}"


@pytest.mark.parametrize("text", DOCUMENTED, ids=[t.split("(")[0] for t in DOCUMENTED])
def test_documented_constructor_signature(text):
    assert _unannotated(getattr(rope, text.split("(")[0])) == text


def test_a_later_param_cannot_be_passed_positionally():
    # the eighth positional argument of YaRNFwdOp would be rope_layout if it were positional
    with pytest.raises(TypeError, match="positional"):
        rope.YaRNFwdOp("1d", 10000.0, 16.0, 4096, 32.0, 1.0, 1.0, "interleaved")
    assert rope.YaRNFwdOp(rope_layout="interleaved").params["rope_layout"] == "interleaved"
