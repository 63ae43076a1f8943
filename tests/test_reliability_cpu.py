"""Faults in the data rather than in the call: NaN and Inf in x stay in their own pairs, on the
BUILTIN kernels of the CPU and (marked cuda) of the GPU. See docs/reliability.md."""

from __future__ import annotations

import pytest
import torch

from tileops.rope import RoPEFwdOp, RoPENeoxPositionIdsFwdOp, YaRNFwdOp


def _partner(i: int, rot: int, pairing: str) -> int | None:
    if i >= rot:
        return None  # a copied column pairs with nothing
    if pairing == "interleaved":
        return i ^ 1
    return i + rot // 2 if i < rot // 2 else i - rot // 2


CASES = [
    ("neox 2d", lambda: RoPEFwdOp(input_layout="2d"), (2, 7, 3, 32), 32, "neox", {}),
    ("interleaved 2d", lambda: RoPEFwdOp(rope_layout="interleaved", input_layout="2d"), (2, 7, 3, 32), 32,
     "interleaved", {}),
    ("yarn interleaved 1d", lambda: YaRNFwdOp(rope_layout="interleaved", scale=4.0), (9, 64), 64, "interleaved", {}),
    ("ids partial", lambda: RoPENeoxPositionIdsFwdOp(100, rotary_dim=16), (9, 3, 40), 16, "neox",
     {"position_ids": torch.arange(9) * 7}),
]


@pytest.mark.parametrize("name,make,shape,rot,pairing,kw", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_nan_and_inf_stay_in_their_own_pair(name, make, shape, rot, pairing, kw, bad, device, gen):
    op = make()
    x = torch.randn(*shape, generator=gen)
    flat = x.view(-1)
    hits = torch.randperm(flat.numel(), generator=gen)[:3]
    flat[hits] = bad
    out = op(x.to(device), **{k: v.to(device) for k, v in kw.items()}).cpu()
    want = torch.zeros(shape, dtype=torch.bool).view(-1, shape[-1])
    rows = hits // shape[-1]
    cols = hits % shape[-1]
    for r, c in zip(rows.tolist(), cols.tolist()):
        want[r, c] = True
        p = _partner(c, rot, pairing)
        if p is not None:
            want[r, p] = True
    got = ~torch.isfinite(out).view(-1, shape[-1])
    assert torch.equal(got, want), f"non-finite outputs outside the pairs of the bad inputs ({name})"
    assert torch.isfinite(out.view(-1, shape[-1])[~want]).all()
