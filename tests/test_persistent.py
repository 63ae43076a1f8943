"""``tileops.runtime.memory.persistent``: where an op's kept tensors (cos/sin tables, dynamic NTK's
state) are made. On CUDA ``make`` runs on a thread of its own, so that torch's CUDA-graph trees,
which route the allocations of the thread running a graph's warm-up into their pool, do not catch
it. The GPU side is ``tests/test_serving_cuda.py::test_first_call_inside_reduce_overhead``; here the
thread, the hand-over and the refusals run on the CPU with torch.cuda's calls stood in for."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from tileops.runtime import memory

CUDA = torch.device("cuda", 0)


class _Stream:
    def __init__(self, log: list) -> None:
        self.log = log

    def synchronize(self) -> None:
        self.log.append(("synchronize", threading.get_ident()))


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's device, stream and capture queries, recording which thread called them."""
    log: list = []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: _Stream(log))
    return log


def test_cuda_tensors_are_made_on_another_thread_and_synchronised_there(fake_cuda):
    made_on = []
    want = torch.randn(5)

    def make():
        made_on.append(threading.get_ident())
        return want

    got = memory.persistent(make, CUDA)
    assert got is want
    assert made_on and made_on[0] != threading.get_ident()
    assert fake_cuda == [("synchronize", made_on[0])]  # the maker's stream, by the maker's thread


def test_an_error_while_making_is_raised_to_the_caller(fake_cuda):
    boom = ValueError("no memory for the tables")

    def make():
        raise boom

    with pytest.raises(ValueError) as e:
        memory.persistent(make, CUDA)
    assert e.value is boom
    assert fake_cuda == []  # nothing to synchronise after a failed make


def test_inside_a_capture_nothing_is_made(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    called = []
    with pytest.raises(RuntimeError, match=r"first call of this op on cuda:0 is inside a CUDA graph capture.*"
                                           r"call it once on cuda:0 before capturing"):
        memory.persistent(lambda: called.append(1), CUDA)
    assert called == []


def test_the_cpu_makes_in_place():
    made_on = []
    got = memory.persistent(lambda: made_on.append(threading.get_ident()) or torch.ones(2), torch.device("cpu"))
    assert made_on == [threading.get_ident()] and torch.equal(got, torch.ones(2))
