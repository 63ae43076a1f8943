"""The benchmark runner's own logic, on the CPU (its timings need a GPU; what it times does not)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from tileops.manifest import registry
from tileops.workloads import op_class

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ sits beside tests/, not installed
from benchmarks import runner  # noqa: E402
from benchmarks.baselines import make_baseline  # noqa: E402


def _backward_grads(monkeypatch, name: str, params: dict, inputs: dict) -> list[list[torch.Tensor]]:
    """The gradients each contender's backward timer computes (ours, eager, torch.compile), with the
    GPU timer replaced by one call and torch.compile by the function itself."""
    got: list[list[torch.Tensor]] = []

    def one_call(fn, n):
        got.append(list(fn(0)))
        return (1.0, 1.0, 1.0)

    monkeypatch.setattr(runner, "gpu_time", one_call)
    monkeypatch.setattr(runner, "fresh_compile", lambda f: f)
    m = registry()[name]
    op = op_class(name)(**params)
    fn, args = make_baseline(op, inputs)
    runner._backward_row(m, m.cases[0], "float32", op, [inputs], fn, [runner._bind(args, inputs)], 1, 1.0, 1)
    return got


def test_a_qk_backward_row_differentiates_x_and_key_for_every_contender(monkeypatch):
    # the timer once took x's gradient through q's output alone: torch.compile then rotated q's
    # gradient only while ours also rotated the key's, and the row compared unequal work
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    x, key = torch.randn(1, 24, 4, 32, generator=g), torch.randn(1, 24, 2, 32, generator=g)
    pos = torch.randint(0, 40, (3, 1, 24), generator=g)
    got = _backward_grads(monkeypatch, "MRoPEFwdOp", {"mrope_section": (4, 6, 6)},
                          {"x": x, "position_ids": pos, "key": key})
    assert len(got) == 3  # ours, eager, torch.compile
    for grads in got:
        assert [tuple(t.shape) for t in grads] == [tuple(x.shape), tuple(key.shape)]
        assert all(bool(torch.isfinite(t).all()) and bool(t.abs().sum() > 0) for t in grads)


def test_a_backward_row_without_a_key_differentiates_x_alone(monkeypatch):
    x = torch.randn(2, 16, 3, 32)
    got = _backward_grads(monkeypatch, "RoPEFwdOp", {"input_layout": "2d"}, {"x": x})
    assert len(got) == 3 and all([tuple(t.shape) for t in grads] == [tuple(x.shape)] for grads in got)
