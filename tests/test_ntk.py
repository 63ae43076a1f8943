"""Dynamic NTK's state kernel (``kernels/ntk.py``): the cached length and the tables it rewrites, call
after call, against a float64 reference of HF's semantics written here (no code shared with the op).

The CPU runs the kernels' C backend; the ``cuda`` tests the same on the GPU, plus graph capture with
the length changing between replays and a count of the kernels a call launches."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tileops.rope import RoPEDynamicNTKFwdOp, RoPEFwdOp
from tileops.testing import TOLERANCES

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BASE, FACTOR, MPE = 5000.0, 3.0, 64


def hf_length(cached: float, seq: int) -> float:
    """HF's ``dynamic_rope_update``: grow past the cached length; back to the trained one when shorter."""
    if seq > cached:
        return float(seq)
    return float(MPE) if seq < MPE else cached


def reference(x: torch.Tensor, pos: torch.Tensor, cached: float, rot: int) -> torch.Tensor:
    """x ``[B, S, H, D]`` rotated (neox, first ``rot`` columns) at ``pos`` ``[B, S]``, float64."""
    b = BASE * (FACTOR * cached / MPE - (FACTOR - 1)) ** (rot / (rot - 2))
    inv = torch.tensor([b ** (-2 * j / rot) for j in range(rot // 2)], dtype=torch.float64)
    angle = pos.double().cpu()[..., None, None] * inv  # [B, S, 1, R/2]
    x = x.double().cpu()
    a, c = x[..., :rot // 2], x[..., rot // 2:rot]
    return torch.cat([a * angle.cos() - c * angle.sin(), c * angle.cos() + a * angle.sin(), x[..., rot:]], -1)


def check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    atol, rtol = TOLERANCES[str(dtype).replace("torch.", "")]
    torch.testing.assert_close(got.double().cpu(), want, atol=atol, rtol=rtol, msg=what)


def where(device: str) -> torch.device:
    """The device as a call's tensors name it (``cuda:0``, not ``cuda``): the key of the op's state."""
    return torch.empty(0, device=device).device


def state(op: RoPEDynamicNTKFwdOp, device: str) -> float:
    return float(op._state(where(device)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rotary_dim", [None, 24])
@pytest.mark.parametrize("pos_kind", ["int64-BS", "int32-S"])
def test_length_follows_hf_with_positions(device, dtype, rotary_dim, pos_kind, gen):
    """Grow, stay, shrink back, grow again; a call with a position out of range raises and leaves
    the length (and the next call's frequencies) alone; a call of exactly mpe keeps a longer length."""
    op = RoPEDynamicNTKFwdOp(input_layout="2d", base=BASE, factor=FACTOR, max_position_embeddings=MPE,
                             rotary_dim=rotary_dim)
    B, S, H, D = 2, 6, 3, 40
    rot = rotary_dim or D
    cached = float(MPE)
    for top in (40, 150, 90, 20, 5000, None, 64, 65, 9, 300):
        x = torch.randn(B, S, H, D, generator=gen).to(dtype).to(device)
        pos = torch.randint(0, top or 100, (B, S), generator=gen)
        if top is None:  # out of range: raises, the state stays
            pos[1, 2] = 2**24
        else:
            pos[1, -1] = top - 1  # this call's length is top
        if pos_kind == "int32-S":
            pos = pos[0].to(torch.int32) if top is not None else pos[1].to(torch.int32)
        given = pos.to(device)
        if top is None:
            with pytest.raises(ValueError, match="position_ids"):
                op(x, position_ids=given)
                op.check()
            assert state(op, device) == cached, "a call out of range moved the length"
            continue
        out = op(x, position_ids=given)
        cached = hf_length(cached, int(pos.max()) + 1)
        assert state(op, device) == cached, top
        check(out, reference(x, pos.expand(B, S) if pos.dim() == 1 else pos, cached, rot), dtype, f"length {top}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["1d", "2d"])
def test_length_follows_hf_without_positions(device, dtype, layout, gen):
    """Without positions the length is seq_len: the same state machine, and the same state kernel."""
    op = RoPEDynamicNTKFwdOp(input_layout=layout, base=BASE, factor=FACTOR, max_position_embeddings=MPE,
                             rotary_dim=16)
    cached = float(MPE)
    for S in (5, 70, 30, 80, 3, 64, 66):
        shape = (S, 20) if layout == "1d" else (2, S, 3, 20)
        x = torch.randn(shape, generator=gen).to(dtype).to(device)
        x4 = x[None, :, None] if layout == "1d" else x
        out = op(x)
        cached = hf_length(cached, S)
        assert state(op, device) == cached, S
        want = reference(x4, torch.arange(S).expand(x4.shape[0], S), cached, 16)
        check(out, want[0, :, 0] if layout == "1d" else want, dtype, f"seq_len {S}")


@pytest.mark.parametrize("device", DEVICES)
def test_tables_are_rewritten_only_when_the_length_changes(device, gen):
    """The state kernel skips the tables when the length stays (the common case) and rewrites them
    when it moves: a sentinel written into the tables survives the first, not the second."""
    op = RoPEDynamicNTKFwdOp(input_layout="2d", factor=FACTOR, max_position_embeddings=MPE)
    x = torch.randn(1, 100, 2, 32, generator=gen).to(device)
    op(x)
    tables = op._ntk_tables[(where(device), 32)].tables
    tables[2, 255, 0, 3] = 42.0
    op(x)  # length 100 again
    assert float(tables[2, 255, 0, 3]) == 42.0, "the tables were rewritten although the length did not change"
    op(x[:, :99])  # 99 < 100, > MPE: stays 100
    assert float(tables[2, 255, 0, 3]) == 42.0
    op(x[:, :10])  # back to MPE: rewritten
    assert float(tables[2, 255, 0, 3]) != 42.0 and state(op, device) == MPE


@pytest.mark.parametrize("device", DEVICES)
def test_backward_uses_the_forward_frequencies(device, gen):
    """A later call that changes the length rewrites the op's tables; the backward of an earlier call
    still rotates by that call's frequencies (the gradient of ``A R(t) x`` is ``A R(-t) g``)."""
    op = RoPEDynamicNTKFwdOp(input_layout="2d", base=BASE, factor=FACTOR, max_position_embeddings=MPE, rotary_dim=24)
    B, S, H, D = 2, 5, 3, 40
    x = torch.randn(B, S, H, D, generator=gen, dtype=torch.float64).float().to(device).requires_grad_(True)
    pos = torch.randint(0, 150, (B, S), generator=gen)
    pos[0, 0] = 149
    out = op(x, position_ids=pos.to(device))
    op(torch.randn(B, S, H, D, generator=gen).to(device), position_ids=(pos + 1000).to(device))  # length 1150
    assert state(op, device) == 1150.0
    g = torch.randn(B, S, H, D, generator=gen).to(device)
    (dx,) = torch.autograd.grad(out, x, g)
    check(dx, reference(g, -pos, 150.0, 24), torch.float32, "gradient")  # R(-t) g: the angle negated


def _dispatched(fn) -> int:
    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def test_a_call_dispatches_no_more_torch_ops_than_plain_rope(gen):
    """The length and the tables are updated by one kernel of tileops' own, not by a chain of torch
    ops: a call dispatches what a plain RoPE call of the same shape does (its output's allocation).
    (The torch-op version this replaced dispatched two dozen per call.)"""
    x = torch.randn(2, 80, 3, 32, generator=gen)
    pos = torch.randint(0, 200, (2, 80), generator=gen)
    ntk = RoPEDynamicNTKFwdOp(input_layout="2d", factor=FACTOR, max_position_embeddings=MPE)
    plain = RoPEFwdOp(input_layout="2d")
    for _ in range(2):  # compiled, planned
        ntk(x, position_ids=pos), plain(x, position_ids=pos), ntk(x), plain(x)
    assert _dispatched(lambda: ntk(x, position_ids=pos)) <= _dispatched(lambda: plain(x, position_ids=pos))
    assert _dispatched(lambda: ntk(x)) <= _dispatched(lambda: plain(x))


@pytest.mark.cuda
@pytest.mark.parametrize("with_pos", [False, True])
def test_cuda_call_launches_one_kernel_more_than_plain_rope(with_pos):
    """On the GPU a call is the state kernel and the RoPE kernel: one launch more than plain RoPE,
    whatever the length does (the tables are rewritten inside that launch, never by more kernels)."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(1, 4096, 8, 128, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(4096, device="cuda")[None]
    kw = {"position_ids": pos} if with_pos else {}
    ntk = RoPEDynamicNTKFwdOp(input_layout="2d", factor=4.0, max_position_embeddings=2048)
    plain = RoPEFwdOp(input_layout="2d")
    for _ in range(3):
        ntk(x, **kw), plain(x, **kw)
    torch.cuda.synchronize()

    def kernels(fn) -> int:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)

    assert kernels(lambda: ntk(x, **kw)) == kernels(lambda: plain(x, **kw)) + 1
    assert kernels(lambda: ntk(x[:, :100], **({"position_ids": pos[:, :100]} if with_pos else {}))) == \
        kernels(lambda: plain(x[:, :100], **({"position_ids": pos[:, :100]} if with_pos else {}))) + 1


@pytest.mark.cuda
def test_cuda_graph_replays_follow_the_length(gen):
    """One captured call replayed with new positions: the length grows, stays, shrinks back, and an
    out-of-range replay leaves it, all inside the graph (no host read), as eager calls would."""
    op = RoPEDynamicNTKFwdOp(input_layout="2d", base=BASE, factor=FACTOR, max_position_embeddings=MPE, rotary_dim=24)
    B, S, H, D = 2, 16, 4, 64
    x = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
    pos = torch.zeros(B, S, dtype=torch.int64, device="cuda")
    out = torch.full_like(x, float("nan"))
    op(x, position_ids=pos, out=out)  # warm-up: compiles, plans
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g):
        op(x, position_ids=pos, out=out)
    cached = float(MPE)
    for top in (40, 150, 90, 20, 5000, None, 64, 300, 9):
        p = torch.randint(0, top or 100, (B, S), generator=gen)
        if top is None:
            p[0, 3] = 2**24
        else:
            p[1, 0] = top - 1
        x.copy_(torch.randn(B, S, H, D, generator=gen).to(torch.bfloat16))
        pos.copy_(p)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        if top is None:
            with pytest.raises(ValueError, match="position_ids"):
                op.check()
            assert state(op, "cuda") == cached
            continue
        op.check()
        cached = hf_length(cached, int(p.max()) + 1)
        assert state(op, "cuda") == cached, top
        check(out, reference(x, p, cached, 24), torch.bfloat16, f"replay at length {top}")


def test_warmup_builds_the_state_kernel_for_dynamic_ntk_only():
    """``tileops warmup`` and ``op.compile`` build the state kernel a call launches, for each position
    dtype and for calls without positions, on CUDA and the C backend; other ops launch none."""
    from tileops.compile.warmup import op_kernel_jobs

    for arch in ("sm_90", "c"):
        jobs = op_kernel_jobs("RoPEDynamicNTKFwdOp", {"input_layout": "2d", "rotary_dim": 24}, {"head_dim": 64},
                              ["bfloat16"], arch, every_index_dtype=True)
        state_kernels = [s for b, s, _, _ in jobs if b == "ntk"]
        assert sorted(str(s.positions) for s in state_kernels) == ["None", "int32", "int64"], arch
        assert {(s.rot, s.backend) for s in state_kernels} == {(24, "c" if arch == "c" else "cuda")}
    assert not [j for j in op_kernel_jobs("RoPEFwdOp", {"input_layout": "2d"}, {"head_dim": 64}, ["bfloat16"], "sm_90")
                if j[0] != "rope"]


@pytest.mark.parametrize("positions", [None, "int64"])
def test_the_state_kernel_takes_integers_only(positions, tmp_path):
    """Every argument is a pointer or an integer (doubles as their bits), so the launcher's integer
    trampoline serves it as it serves the RoPE kernel (a double would fall back to ctypes, ~4 us a call)."""
    from tileops.compile import cuda_build, build
    from tileops.kernels.ntk import NTKKernelSpec

    from tests.test_lean_build import _toolchain

    if _toolchain() is not None:
        pytest.skip(f"lean build: {_toolchain()}")
    spec = NTKKernelSpec(128, positions=positions)
    lean = cuda_build.build(build.prim_func("ntk", spec), "sm_90", build.PASS_CONFIGS, out_dir=str(tmp_path))
    assert len(lean.record["args"]) == len(spec.args) + len(lean.record["extents"])
    assert set(lean.record["args"]) <= {"void*", "int32_t", "int64_t"}, lean.record["args"]
    assert "__syncthreads" in lean.device_source and "cos(" in lean.device_source
