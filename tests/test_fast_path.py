"""The per-signature binding (the eager fast path, tileops/runtime/binding.py) and the
packed-argument launcher, on the CPU's BUILTIN kernels: a repeated call skips the signature checks but never what its pointers
decide (overlap, alignment), and every path gives the float64 reference's answer."""

from __future__ import annotations

import ctypes
import dataclasses

import pytest
import torch

from tests.references import reference
from tileops.compile import entry
from tileops.rope import RoPEFwdOp, RoPENeoxPositionIdsFwdOp


def assert_close(got: torch.Tensor, ref: torch.Tensor, tol: float = 2e-5) -> None:
    err = (got.double() - ref).abs()
    assert bool((err <= tol + tol * ref.abs()).all()), f"max error {err.max().item():.3e}"


def test_a_repeated_signature_skips_the_checks_and_stays_right(gen, monkeypatch):
    op = RoPENeoxPositionIdsFwdOp(4096)
    checks = []
    full = op._check_call
    monkeypatch.setattr(op, "_check_call", lambda t: checks.append(1) or full(t))
    for _ in range(3):
        x = torch.randn(9, 4, 32, generator=gen)
        k = torch.randn(9, 2, 32, generator=gen)
        pos = torch.randint(0, 4096, (9,), generator=gen)
        out = torch.full_like(x, float("nan"))
        got, kgot = op(x, pos, key=k, out=out)
        assert got is out
        assert_close(got, reference("RoPENeoxPositionIdsFwdOp", {"max_position": 4096}, {"x": x, "position_ids": pos}))
        assert_close(kgot, reference("RoPENeoxPositionIdsFwdOp", {"max_position": 4096}, {"x": k, "position_ids": pos}))
    assert len(checks) == 1, "the signature was checked again for a call shaped like the first"
    # new strides make a new signature: checked once more, and still right
    xt = torch.randn(4, 9, 32, generator=gen).transpose(0, 1)
    pos = torch.randint(0, 4096, (9,), generator=gen)
    assert_close(op(xt, pos), reference("RoPENeoxPositionIdsFwdOp", {"max_position": 4096},
                                        {"x": xt, "position_ids": pos}))
    assert len(checks) == 2


def test_same_signature_but_overlapping_out_is_refused(gen):
    """The plan checks overlap by pointers on every call: a second call shaped like the first,
    whose out now overlaps x, must raise (and leave x as it was)."""
    op = RoPEFwdOp(input_layout="1d")
    buf = torch.randn(64, 16, generator=gen)
    op(buf[:20], out=buf[30:50])  # disjoint: fine, and makes the plan
    x, out = buf[:20], buf[5:25]
    before = buf.clone()
    with pytest.raises(ValueError, match="out: overlaps x"):
        op(x, out=out)
    assert torch.equal(buf, before), "a refused call wrote memory"
    x = torch.randn(20, 16, generator=gen)
    op(x, position_ids=torch.arange(20, dtype=torch.int32), out=torch.empty(20, 16))  # the plan
    mem = torch.arange(320, dtype=torch.int32)
    with pytest.raises(ValueError, match="out: overlaps position_ids"):
        op(x, position_ids=mem[:20], out=mem.view(torch.float32).view(20, 16))
    assert torch.equal(mem, torch.arange(320, dtype=torch.int32))
    with pytest.raises(ValueError, match="out: .*share memory"):
        op(x, out=torch.empty(20, 1).expand(20, 16))


def test_fused_qkv_views_in_place_at_new_buffers(gen):
    """q and k column blocks of fused [tokens, (Hq + 2 Hkv) * D] buffers, rotated in place call after
    call: the plan's exact interleave test is cached by offset, and each call is right."""
    op = RoPENeoxPositionIdsFwdOp(1 << 20)
    T, Hq, Hk, D = 7, 4, 2, 32
    for _ in range(3):
        qkv = torch.randn(T, (Hq + 2 * Hk) * D, generator=gen)
        before = qkv.clone()
        q = qkv[:, : Hq * D].view(T, Hq, D)
        k = qkv[:, Hq * D : (Hq + Hk) * D].view(T, Hk, D)
        pos = torch.randint(0, 1 << 20, (T,), generator=gen)
        op(q, pos, key=k, out=q, key_out=k)
        p = {"max_position": 1 << 20}
        assert_close(q, reference("RoPENeoxPositionIdsFwdOp", p, {"x": before[:, : Hq * D].view(T, Hq, D), "position_ids": pos}))
        assert_close(k, reference("RoPENeoxPositionIdsFwdOp", p,
                                  {"x": before[:, Hq * D : (Hq + Hk) * D].view(T, Hk, D), "position_ids": pos}))
        assert torch.equal(qkv[:, (Hq + Hk) * D :], before[:, (Hq + Hk) * D :]), "v was written"


def test_bad_position_through_the_plan_is_reported_every_time(gen):
    op = RoPENeoxPositionIdsFwdOp(100)
    x = torch.randn(5, 2, 16, generator=gen)
    op(x, torch.arange(5))
    for i in range(3):
        pos = torch.arange(5)
        pos[i] = 100 + i
        with pytest.raises(ValueError, match=rf"position_ids\[{i}\] = {100 + i}$"):
            op(x, pos)


def test_packed_launcher_matches_plain_ctypes(gen):
    op = RoPEFwdOp(input_layout="2d")
    x = torch.randn(2, 5, 3, 64, generator=gen)
    op(x)
    impl = next(iter(op._impls.values()))
    kernel = impl._kernels[False, False]
    assert kernel.packed is not None, "no packed launcher although a C compiler is here"
    want = op(x)
    impl._kernels[False, False] = dataclasses.replace(kernel, packed=None)
    op._forget_bindings()  # bindings (the op's and its runtime's) hold the kernel they were made with
    got = op(x)
    assert torch.equal(got, want)
    assert_close(got, reference("RoPEFwdOp", {"input_layout": "2d"}, {"x": x}))


def test_launcher_without_a_compiler_or_a_writable_cache(tmp_path, monkeypatch):
    """No C compiler: the trampoline is not built, and plain ctypes serves (None, no error)."""
    monkeypatch.setenv("TILEOPS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", "false")
    monkeypatch.setattr(entry, "_trampolines", {})
    monkeypatch.setattr(entry.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    assert entry._trampoline(["void*", "int32_t"]) is None
    # a cache directory that cannot be created (under a file): built in the temp directory instead
    monkeypatch.delenv("CC")
    monkeypatch.setattr(entry, "_trampolines", {})
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("TILEOPS_CACHE_DIR", str(tmp_path / "a-file" / "cache"))
    assert entry._trampoline(["void*", "int32_t"]) is not None
    assert list((tmp_path / "tmp").glob("tileops-launch-*/trampoline-*.so"))


def test_the_trampoline_asks_about_capture_for_a_tracked_call_and_records_only_with_an_event():
    """(entry, args, stream, record, event, capturing): an untracked call (no ``capturing``) asks the
    driver nothing; a tracked one asks whether its stream is being captured (CAPTURING if so, the
    kernel launched either way), and records ``event`` after the kernel only when given one: most
    tracked calls have none (the native tracker's kEventEvery)."""
    tramp = entry._trampoline(["int32_t"])
    if tramp is None:
        pytest.skip("no C compiler")
    log: list = []
    capturing = [False]
    vp, ip = ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)
    fns = [ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_int32, vp)(lambda a, st: log.append(("kernel", a)) or 0),
           ctypes.CFUNCTYPE(ctypes.c_int, vp, vp)(lambda ev, st: log.append(("record", ev)) or 0),
           ctypes.CFUNCTYPE(ctypes.c_int, vp, ip)(lambda st, status: log.append("asked")
                                                  or status.__setitem__(0, int(capturing[0])) or 0)]
    kernel, record, capture = (ctypes.cast(f, ctypes.c_void_p).value for f in fns)
    args = (ctypes.c_int64 * 1)(5)

    def call(event: int, asks: bool) -> int:
        log.clear()
        return tramp(kernel, ctypes.addressof(args), 7, record, event, capture if asks else 0)

    assert call(0, False) == 0 and log == [("kernel", 5)]
    assert call(0, True) == 0 and log == ["asked", ("kernel", 5)]
    assert call(99, True) == 0 and log == ["asked", ("kernel", 5), ("record", 99)]
    capturing[0] = True
    assert call(99, True) == entry.CAPTURING and log == ["asked", ("kernel", 5)]
    assert call(0, True) == entry.CAPTURING and log == ["asked", ("kernel", 5)]
