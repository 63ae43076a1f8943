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


def _record(offset: int, value: int) -> tuple[int, int]:
    """The two words kernels/report.py stores for a bad element at ``offset`` holding ``value``."""
    from tileops.kernels import report

    stored = report.RECORD_MAX - ((offset << 32) | (value & 0xFFFFFFFF))
    signed = (lambda w: w - (1 << 32) if w & 0x80000000 else w)
    return signed(stored & 0xFFFFFFFF), signed(stored >> 32)


def test_a_record_is_placed_at_the_index_its_strides_give():
    """errors.found turns a record's offset back into an index with the strides the tensor was
    launched with: a contiguous row, a transposed view, a broadcast (stride 0: index 0); an offset
    the sizes cannot hold, an empty entry and unknown strides name nothing; a value saturated at
    int32's range says so."""
    from tileops.runtime.errors import BadValue, found

    assert found(*_record(64, 16777216), (100,), (1,)) == BadValue((64,), 16777216)
    assert str(found(*_record(64, 16777216), (100,), (1,))) == "[64] = 16777216"
    assert found(*_record(2 * 100 + 7, -3), (3, 100), (100, 1)) == BadValue((2, 7), -3)
    assert found(*_record(7 * 3 + 2, 5), (3, 100), (1, 3)) == BadValue((2, 7), 5)  # a transposed view
    assert found(*_record(9, 5), (4, 100), (0, 1)) == BadValue((0, 9), 5)  # expanded along dim 0
    assert found(*_record(2, 5), (3, 100), (1, 3)) == BadValue((2, 0), 5)
    assert found(*_record(300, 5), (3, 100), (100, 1)) is None  # past the tensor
    assert found(*_record(301, 5), (3, 100), (200, 2)) is None  # between its elements
    assert found(0, 0, (3,), (1,)) is None and found(*_record(1, 5), None, None) is None
    beyond = found(*_record(1, 2**31 - 1), (3,), (1,))
    assert beyond.beyond and str(beyond) == "[1] = 2147483647 or more"
    assert str(found(*_record(1, -(2**31)), (3,), (1,))) == "[1] = -2147483648 or less"


def test_the_c_kernels_record_the_first_bad_element(monkeypatch):
    """The record a kernel writes (kernels/report.py) holds the bad element at the smallest offset
    and its value, whichever order the kernel meets them in: RoPE's positions (1-d, 2-d, a strided
    view, a broadcast, a value past int32) and the prologue's slots; and the report of a live tensor
    names the same element as the record."""
    from tileops.attention import AttnPrologueFwdOp
    from tileops.rope import RoPEFwdOp

    seen: list = []

    def spy(cls: Any) -> Any:  # on the class: an op hands its methods to the runtime when constructed
        real = cls._raise_bad_value

        def record(self: Any, name: str, values: Any, when: str = "", found: Any = None) -> None:
            seen.append(str(found))
            real(self, name, values, when, found)

        monkeypatch.setattr(cls, "_raise_bad_value", record)
        return cls

    rope = spy(RoPEFwdOp)(input_layout="2d")
    x = torch.zeros(2, 100, 2, 16)
    ids = torch.arange(100)
    ids[64], ids[70] = 16777216, -3
    rows = torch.arange(200).view(2, 100) % 100
    rows[1, 90], rows[1, 5] = -7, 99999999
    wide = torch.arange(300).view(100, 3)
    wide[80, 1], wide[64, 1] = -5, 16777216
    line = torch.arange(100)
    line[77] = 1 << 40
    cases = [(ids, "[64] = 16777216"), (rows, "[1, 5] = 99999999"), (wide[:, 1], "[64] = 16777216"),
             (line.expand(2, 100), "[0, 77] = 2147483647 or more")]
    for pos, want in cases:
        with pytest.raises(ValueError) as e:
            rope(x, position_ids=pos)
        assert seen[-1] == want, (want, seen[-1])
        if "or more" not in want:
            assert f"position_ids{want}" in str(e.value)

    pro = spy(AttnPrologueFwdOp)(2, 1, 16, RoPENeoxPositionIdsFwdOp(64))
    qkv = torch.zeros(5, 4 * 16)
    kc, vc = torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16)
    with pytest.raises(ValueError, match=r"got slot_mapping\[2\] = 8$"):
        pro(qkv, torch.arange(5), kc, vc, torch.tensor([0, -1, 8, 3, 9]))
    assert seen[-1] == "[2] = 8"
    with pytest.raises(ValueError, match=r"got positions\[1\] = 64$"):
        pro(qkv, torch.tensor([0, 64, 1, -2, 3]), kc, vc, torch.arange(5))
    assert seen[-1] == "[1] = 64"


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
    with pytest.raises(ValueError, match=r"^RMSNormFwdOp: x: a value is out of range \(x\[3\] = 9\) \(this call\)$"):
        op._raise_bad_value("x", None, found=errors.BadValue((3,), 9))
