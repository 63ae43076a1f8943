"""Issue 12 on a GPU: many threads on many streams sharing one op, inputs past 2^31 elements.
(Skipped without CUDA; docs/reliability.md lists what each test shows.)"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from tests.references import reference, reference_grad
from tileops.rope import RoPENeoxPositionIdsFwdOp, RoPEFwdOp
from tileops.testing import tolerance

pytestmark = pytest.mark.cuda


def test_eight_threads_on_eight_streams_mix_good_and_bad_positions(gen):
    """8 threads, each on its own stream, share one op (q and k in one launch) and mix good and bad
    calls at random. Thread i's bad calls put the value 4096 + i at index i, so an error names the
    thread it belongs to: every good call that ran is right, every bad call that ran is reported
    exactly once and to its own thread, and nothing else raises."""
    limit, n_threads, calls = 4096, 8, 60
    op = RoPENeoxPositionIdsFwdOp(limit, rotary_dim=48)
    x = torch.randn(41, 8, 64, generator=gen).half().cuda()
    k = torch.randn(41, 2, 64, generator=gen).half().cuda()
    good = torch.randint(0, limit, (41,), generator=gen).cuda()
    want_q, want_k = op(x, position_ids=good, key=k)
    op.check()
    ref_q = reference(op.name, {"max_position": limit, "rotary_dim": 48}, {"x": x.cpu(), "position_ids": good.cpu()})
    atol, rtol = tolerance(torch.float16)
    assert not ((want_q.double().cpu() - ref_q).abs() > atol + rtol * ref_q.abs()).any()
    results = {}
    failures: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(n_threads)

    def worker(i: int) -> None:
        rng = random.Random(i * 7919 + int(torch.randint(0, 2**30, (1,), generator=gen)))
        stream = torch.cuda.Stream()
        launched_bad = reported = wrong = 0
        bad = good.clone()
        bad[i] = limit + i
        mine = f"position_ids[{i}] = {limit + i}"
        kept = []
        start.wait()
        with torch.cuda.stream(stream):
            def judge(e: ValueError) -> None:
                nonlocal reported
                reported += 1
                if mine not in str(e):
                    with lock:
                        failures.append(f"thread {i} got another's error: {e}")

            for _ in range(calls):
                is_bad = rng.random() < 0.4
                pos = bad if is_bad else good
                qo, ko = torch.full_like(x, float("nan")), torch.full_like(k, float("nan"))
                try:
                    op(x, position_ids=pos, key=k, out=qo, key_out=ko)
                except ValueError as e:  # an earlier bad call of this thread; this one did not run
                    judge(e)
                    continue
                if is_bad:
                    launched_bad += 1
                else:
                    kept.append((qo, ko))
            while True:  # check() reports one bad call at a time
                try:
                    op.check()
                    break
                except ValueError as e:
                    judge(e)
            stream.synchronize()
            for qo, ko in kept:
                wrong += not (torch.equal(qo, want_q) and torch.equal(ko, want_k))
        with lock:
            results[i] = (launched_bad, reported, wrong, len(kept))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[:3]
    assert len(results) == n_threads
    for i, (launched_bad, reported, wrong, n_good) in results.items():
        assert wrong == 0, f"thread {i}: {wrong} of {n_good} good calls wrong"
        assert reported == launched_bad, f"thread {i}: {launched_bad} bad calls ran, {reported} reported"
    assert sum(r[0] for r in results.values()) > 0 and sum(r[3] for r in results.values()) > 0


def _rows_match(out: torch.Tensor, x: torch.Tensor, rows, params: dict, grad_of=None) -> None:
    """``out`` at each (batch, sequence) row of ``rows`` against the float64 reference of that row
    alone, evaluated at the row's position (its sequence index) passed explicitly; with
    ``grad_of``, the reference gradient of that row for the output gradient ``grad_of``."""
    atol, rtol = tolerance(out.dtype)
    for b, s in rows:
        head = x[b : b + 1, s : s + 1].cpu()
        # the reference of row s: positions given explicitly (the op's own position would be s)
        ins = {"x": head, "position_ids": torch.tensor([s])}
        ref = reference("RoPEFwdOp", params, ins) if grad_of is None else reference_grad(
            "RoPEFwdOp", params, ins, grad_of[b : b + 1, s : s + 1].cpu().double())
        got = out[b : b + 1, s : s + 1].double().cpu()
        bad = (got - ref).abs() > atol + rtol * ref.abs()
        assert torch.isfinite(got).all() and not bad.any(), (b, s, (got - ref).abs().max().item())


def test_more_than_2_31_elements_forward_and_backward(gen):
    """x of 3 * 2^30 elements (bf16, 6 GiB): rows at the start, the middle and the end of every batch
    entry match float64, forward and backward (int64 addressing throughout)."""
    B, S, H, D = 3, 1 << 20, 8, 128
    assert B * S * H * D > 2**31
    free, _ = torch.cuda.mem_get_info()
    if free < 30 * 2**30:
        pytest.skip(f"needs ~30 GiB of free GPU memory, {free / 2**30:.0f} GiB free")
    g = torch.Generator(device="cuda").manual_seed(gen.initial_seed())
    x = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
    op = RoPEFwdOp(input_layout="2d")
    out = op(x)
    rows = [(b, s) for b in range(B) for s in (0, 1, S // 2 - 1, S // 2, S - 2, S - 1)]
    _rows_match(out.detach(), x.detach(), rows, {"input_layout": "2d"})
    grad = torch.randn(out.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    del out
    (dx,) = torch.autograd.grad(op(x), x, grad)
    _rows_match(dx, x.detach(), rows, {"input_layout": "2d"}, grad_of=grad)
