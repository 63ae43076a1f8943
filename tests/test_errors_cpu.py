"""Per-call position errors on the CPU: reported at the call itself, never to another thread."""

from __future__ import annotations

import threading

import pytest
import torch

import tileops
from tileops.rope import RoPENeoxPositionIdsFwdOp


def test_threads_sharing_an_op_see_only_their_own_errors():
    op = RoPENeoxPositionIdsFwdOp(1000)
    x = torch.randn(23, 4, 32)
    good = torch.randint(0, 1000, (23,))
    want = op(x, good)
    counts = {"good_raised": 0, "good_wrong": 0, "bad_raised": 0, "bad_silent": 0}
    lock = threading.Lock()

    def worker(kind: str) -> None:
        for _ in range(150):
            pos = good.clone()
            if kind == "bad":
                pos[9] = 1000
            try:
                out = op(x, pos)
                key = "good_wrong" if kind == "good" and not torch.equal(out, want) else None
                key = key or ("bad_silent" if kind == "bad" else None)
            except ValueError as e:
                assert "position_ids[9] = 1000" in str(e)
                key = f"{kind}_raised"
            if key:
                with lock:
                    counts[key] += 1

    threads = [threading.Thread(target=worker, args=(k,)) for k in ("good", "bad", "good", "bad")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counts == {"good_raised": 0, "good_wrong": 0, "bad_raised": 300, "bad_silent": 0}


def test_strict_mode_and_check_on_the_cpu():
    op = RoPENeoxPositionIdsFwdOp(10)
    x = torch.randn(3, 2, 8)
    with tileops.strict():
        assert tileops.errors.is_strict()
        with pytest.raises(ValueError, match=r"position_ids\[2\] = 10"):
            op(x, torch.tensor([0, 1, 10]))
    assert not tileops.errors.is_strict()
    op.check()  # nothing pending
