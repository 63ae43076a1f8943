"""The target registry: BUILTIN, names, None, and errors for unknown names."""

from __future__ import annotations

import pytest
import torch

import tileops
from tests.references import reference
from tileops import BUILTIN
from tileops.rope import RoPEFwdOp, RoPENeoxPositionIdsFwdOp
from tileops.targets import Target, get_target, register_target, target_names


def test_known_targets():
    names = target_names()
    assert BUILTIN in names and "torch" in names


def test_unknown_target_lists_known_names():
    with pytest.raises(ValueError) as e:
        RoPEFwdOp(target="nope")
    msg = str(e.value)
    assert "target" in msg and "'nope'" in msg and BUILTIN in msg and "torch" in msg


def test_target_of_wrong_type():
    with pytest.raises(TypeError, match="target"):
        RoPEFwdOp(target=3)


def test_none_decides_from_device(gen):
    op = RoPEFwdOp()
    assert op.serving_target is None
    op(torch.randn(4, 8, generator=gen))
    assert op.serving_target == BUILTIN


@pytest.mark.parametrize("target", [BUILTIN, "torch"])
def test_named_targets_agree_with_reference(target, gen):
    op = RoPENeoxPositionIdsFwdOp(1000, rotary_dim=16, target=target)
    assert op.serving_target == target
    x = torch.randn(11, 3, 24, generator=gen)
    pos = torch.randint(0, 1000, (11,), generator=gen)
    ref = reference("RoPENeoxPositionIdsFwdOp", {"max_position": 1000, "rotary_dim": 16}, {"x": x, "position_ids": pos})
    assert (op(x, pos).double() - ref).abs().max().item() < 1e-5


def test_registered_target_that_claims_the_device_serves_none(gen):
    calls = []

    class Claiming(Target):
        name = "test-claims-cpu"

        def claims(self, device):
            return device.type == "cpu"

        def implement(self, op, spec):
            inner = get_target("torch").implement(op, spec)

            def run(**tensors):
                calls.append(spec)
                return inner(**tensors)

            return run

    t = register_target(Claiming())
    try:
        op = RoPEFwdOp()
        op(torch.randn(3, 8, generator=gen))
        assert op.serving_target == "test-claims-cpu" and calls
        assert RoPEFwdOp(target=BUILTIN).serving_target == BUILTIN  # named targets are not overridden
    finally:
        from tileops import targets

        targets._registry.pop(t.name)


def test_register_twice_needs_replace():
    class A(Target):
        name = "test-dup"

    register_target(A())
    try:
        with pytest.raises(ValueError, match="already registered"):
            register_target(A())
        register_target(A(), replace=True)
    finally:
        from tileops import targets

        targets._registry.pop("test-dup")


def test_public_api():
    assert tileops.BUILTIN == "builtin"
    from tileops.manifest import registry

    assert set(tileops.ops()) == set(registry())  # every manifest's class, no other
    assert {"RoPEFwdOp", "RoPENeoxPositionIdsFwdOp", "YaRNFwdOp", "RoPEDynamicNTKFwdOp"} <= set(tileops.ops())
