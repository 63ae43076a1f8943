"""The docs' example target (``docs/examples/tileops_target_example``, included in "Writing a target")
serves every RoPE op the way the ``torch`` target does: the same bits on every manifest case of the
family, with and without positions, with a key, in every layout (``bhsd`` included), for MRoPE's three
position streams, Phi-3's two tables and dynamic NTK's length-dependent frequencies past
``max_position_embeddings``.

A target is code users copy: until 2026-12-06 the example read the sequence from axis 1 of a
``bhsd`` input (an error, or a wrong answer when heads equal the length), took MRoPE's ``[3, ...]``
positions as one stream (an error) and rotated dynamic NTK calls past the trained length with the
unscaled table (max error 3.9 against the ``torch`` target, and no error raised).
``tests/test_docs.py::test_example_target_through_its_entry_point`` installs it as a package (slow);
this imports it from its source, on the CPU, in CI's default run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tileops import targets
from tileops.manifest import registry
from tileops.workloads import op_class

EXAMPLE = Path(__file__).resolve().parent.parent / "docs" / "examples" / "tileops_target_example"
NAME = "example-under-test"
CASES = [(name, case) for name, m in sorted(registry().items()) if m.family == "rope" for case in m.cases]


@pytest.fixture(autouse=True)
def one_thread():
    """Both targets evaluate cos and sin with torch's float64 ops, and torch splits a call of 4,096
    elements or more over its threads; the first such call of a process can come out up to 6.8e-9 off
    (``tileops/rope/tables.py``'s ``digit_tables`` says more), an fp32 ulp of a table entry, so the
    target that happens to call first differs in the last bit (LongRoPE 2d-8k, 64 x 64 angles, 1 run
    in 5 at ``-n 0`` on 2 threads). On one thread torch takes the serial path and both give the same
    bits; CI's xdist workers run one thread each already (``tests/conftest.py``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target():
    sys.path.insert(0, str(EXAMPLE))
    try:
        from tileops_target_example import ExampleTarget
    finally:
        sys.path.remove(str(EXAMPLE))

    class UnderTest(ExampleTarget):
        name = NAME

    t = targets.register_target(UnderTest())
    yield t
    targets._registry.pop(NAME)


def _inputs(op, dims: dict, gen: torch.Generator, positions: bool) -> dict:
    """Small inputs in the op's layout (lengths capped at 64; a GQA key of 2 heads), positions when
    asked or required: MRoPE's ``[3, ...]`` streams, others in ``[0, 64)``."""
    d, lay = dims["head_dim"], op.layout
    s = min(dims.get("seq_len", dims.get("tokens", 9)), 64)
    shape = {"1d": (s, d), "2d": (2, s, 3, d), "bhsd": (2, 3, s, d), "ids": (s, 3, d)}[lay]
    key_shape = {"1d": (s, d), "2d": (2, s, 2, d), "bhsd": (2, 2, s, d), "ids": (s, 2, d)}[lay]
    out = {"x": torch.randn(*shape, generator=gen), "key": torch.randn(*key_shape, generator=gen)}
    if positions or lay == "ids":
        lead = {"1d": (s,), "2d": (2, s), "bhsd": (2, s), "ids": (s,)}[lay]
        streams = (3,) if op.name == "MRoPEFwdOp" else ()
        out["position_ids"] = torch.randint(0, 64, streams + lead, generator=gen)
    return out


@pytest.mark.parametrize("name, case", CASES, ids=[f"{n}-{c.label}" for n, c in CASES])
@pytest.mark.parametrize("positions", [False, True], ids=["arange", "positions"])
def test_the_example_target_gives_the_torch_targets_bits(target, name, case, positions):
    cls = op_class(name)
    ours, ref = cls(**case.params, target=NAME), cls(**case.params, target="torch")
    t = _inputs(ours, case.dims, torch.Generator().manual_seed(7), positions)
    got, want = ours(**t), ref(**t)
    assert ours.serving_target == NAME
    for g, w in zip(got, want):
        assert torch.equal(g, w), f"{name} {case.label}: max error {(g - w).abs().max().item():.3g}"


def test_dynamic_ntk_past_the_trained_length_takes_the_grown_frequencies(target):
    """A call longer than ``max_position_embeddings`` rotates with the frequencies of its length: the
    example's first version used the unscaled table there."""
    from tileops.rope import RoPEDynamicNTKFwdOp

    ours = RoPEDynamicNTKFwdOp(factor=2.0, max_position_embeddings=16, input_layout="1d", target=NAME)
    ref = RoPEDynamicNTKFwdOp(factor=2.0, max_position_embeddings=16, input_layout="1d", target="torch")
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(3))
    assert torch.equal(ours(x), ref(x))
    unscaled = RoPEDynamicNTKFwdOp(factor=2.0, max_position_embeddings=64, input_layout="1d", target="torch")
    assert not torch.equal(ours(x), unscaled(x))  # (the comparison can tell: 37 tokens grow the base)


def test_the_example_target_reports_a_bad_position_as_the_op_does(target):
    from tileops.rope import RoPENeoxPositionIdsFwdOp

    op = RoPENeoxPositionIdsFwdOp(32, target=NAME)
    with pytest.raises(ValueError, match=r"position_ids\[2\] = 40"):
        op(torch.randn(4, 2, 64, generator=torch.Generator().manual_seed(5)), torch.tensor([0, 1, 40, 3]))
