"""Per-call position errors on the CPU: reported at the call itself, never to another thread."""

from __future__ import annotations

import threading
from typing import Any, Callable

import pytest
import torch

import tileops
from tests.paths import both
from tileops.rope import RoPENeoxPositionIdsFwdOp


@pytest.mark.slow  # measured 5-38 s on 2 cores (pytest --durations); CI runs -m slow
def test_threads_sharing_an_op_see_only_their_own_errors():
    """Four threads, two with a bad position in every call, on both runtimes (tests/paths.py)."""
    x = torch.randn(23, 4, 32)
    good = torch.randint(0, 1000, (23,))

    def scenario(on: Callable[[Any], Any]) -> tuple[dict, list]:
        op = on(RoPENeoxPositionIdsFwdOp(1000))
        want = op(x, good)
        op(x, good)
        counts = {"good_raised": 0, "good_wrong": 0, "bad_raised": 0, "bad_silent": 0}
        lock = threading.Lock()

        def worker(kind: str) -> None:
            for i in range(120):
                pos = good.clone()
                if kind == "bad":
                    pos[9] = 1000 + i
                try:
                    out = op(x, pos, out=torch.empty_like(x)) if i % 2 else op(x, pos)
                    key = "bad_silent" if kind == "bad" else ("good_wrong" if not torch.equal(out, want) else None)
                except ValueError as e:
                    assert f"position_ids[9] = {1000 + i}" in str(e)
                    key = f"{kind}_raised"
                if key:
                    with lock:
                        counts[key] += 1

        threads = [threading.Thread(target=worker, args=(w,)) for w in ("good", "bad", "good", "bad")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        op.check()
        return counts, [op]

    py, nat = both(scenario)
    assert py == nat == {"good_raised": 0, "good_wrong": 0, "bad_raised": 240, "bad_silent": 0}


def test_strict_mode_and_check_on_the_cpu():
    op = RoPENeoxPositionIdsFwdOp(10)
    x = torch.randn(3, 2, 8)
    with tileops.strict():
        assert tileops.runtime.errors.is_strict()
        with pytest.raises(ValueError, match=r"position_ids\[2\] = 10"):
            op(x, torch.tensor([0, 1, 10]))
    assert not tileops.runtime.errors.is_strict()
    op.check()  # nothing pending


def test_a_report_whose_tensor_was_freed_or_changed_says_so_and_names_the_rest():
    """The tracker holds a checked tensor weakly (tileops.runtime.errors): a deferred report may find
    it freed (the runtime passes None) or rewritten since the kernel read it. The error still names
    the op, the argument, the range and which call; it says why the index is missing instead of
    naming a wrong one."""
    from tileops.attention import AttnPrologueFwdOp
    from tileops.runtime import errors

    rope = RoPENeoxPositionIdsFwdOp(1000)
    with pytest.raises(ValueError) as freed:
        rope._raise_bad_value("position_ids", None, errors.WHEN_EARLIER)
    assert str(freed.value).startswith("RoPENeoxPositionIdsFwdOp: position_ids: expected every value in "
                                       "[0, max_position=1000); the kernel read one outside")
    assert errors.WHEN_EARLIER in str(freed.value) and "freed before this report" in str(freed.value)
    with pytest.raises(ValueError, match=r"has changed since, so its index is unknown"):
        rope._raise_bad_value("position_ids", torch.tensor([0, 999]), errors.WHEN_GRAPH)
    with pytest.raises(ValueError, match=r"got position_ids\[1\] = 1000 \(in a CUDA graph replay, whose kernel read "
                                         r"it as position 0\)$"):
        rope._raise_bad_value("position_ids", torch.tensor([0, 1000]), errors.WHEN_GRAPH)

    op = AttnPrologueFwdOp(4, 2, 64, rope)
    with pytest.raises(ValueError, match=r"^AttnPrologueFwdOp: positions: expected .* of RoPENeoxPositionIdsFwdOp; "
                                         r"the kernel read one outside; the tensor was freed"):
        op._raise_bad_value("positions", None)
    op.note_slot_limit(32)
    with pytest.raises(ValueError, match=r"^AttnPrologueFwdOp: slot_mapping: expected every slot below num_blocks \* "
                                         r"block_size = 32 \(or negative: skipped\); the kernel read one past the cache "
                                         r"\(in a CUDA graph replay, whose kernel skipped that token's cache write\); "
                                         r"the tensor was freed"):
        op._raise_bad_value("slot_mapping", None, errors.WHEN_GRAPH)
    with pytest.raises(ValueError, match=r"got slot_mapping\[2\] = 32$"):
        op._raise_bad_value("slot_mapping", torch.tensor([-1, 31, 32]))


def test_a_family_without_its_own_value_error_gets_the_base_class_words():
    """The op base class knows no family: its default error names the op, the input and the call,
    none of RoPE's words (RoPE's position error lives in tileops/rope/hooks.py)."""
    from tileops.norm import RMSNormFwdOp
    from tileops.runtime import errors

    op = RMSNormFwdOp()
    with pytest.raises(ValueError, match=r"^RMSNormFwdOp: x: a value is out of range \(this call\)$"):
        op._raise_bad_value("x", None)
    with pytest.raises(ValueError) as e:
        op._raise_bad_value("x", torch.tensor([1]), errors.WHEN_GRAPH)
    assert str(e.value) == f"RMSNormFwdOp: x: a value is out of range ({errors.WHEN_GRAPH})"
    assert "position" not in str(e.value)
