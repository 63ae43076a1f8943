"""Ahead-of-time compilation: ``op.compile(...)`` fills the disk caches without data, in parallel
processes, so that a new process's first call loads its kernel without compiling or importing
TileLang (issue 13, start-up)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tileops.rope import RoPENeoxPositionIdsFwdOp


def _env(tmp_path) -> dict:
    env = {**os.environ, "TILELANG_CACHE_DIR": str(tmp_path / "tilelang"), "TILEOPS_CACHE_DIR": str(tmp_path / "tileops")}
    env.pop("TILELANG_DISABLE_CACHE", None)
    return env


def test_compile_ahead_then_a_new_process_loads_without_tilelang(tmp_path):
    aot = ("from tileops.rope import RoPENeoxPositionIdsFwdOp\n"
           "op = RoPENeoxPositionIdsFwdOp(4096, rotary_dim=32)\n"
           "print(op.compile(head_dim=48, dtypes=['float32'], with_inputs=[], device='cpu', jobs=2))\n")
    done = subprocess.run([sys.executable, "-c", aot], env=_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "4"  # forward and backward, positions int32 and int64
    first = ("import sys, torch\n"
             "from tileops import generate\n"
             "from tileops.rope import RoPENeoxPositionIdsFwdOp\n"
             "op = RoPENeoxPositionIdsFwdOp(4096, rotary_dim=32)\n"
             "x = torch.randn(5, 3, 48)\n"
             "out = op(x, torch.tensor([0, 1, 7, 4095, 2], dtype=torch.int32))\n"
             "print(bool(torch.isfinite(out).all()), generate.stats.compiles, generate.stats.loads, 'tilelang' in sys.modules)\n")
    warm = subprocess.run([sys.executable, "-c", first], env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert warm.returncode == 0, warm.stderr[-2000:]
    assert warm.stdout.split() == ["True", "0", "1", "False"], warm.stdout


def test_compile_refuses_bad_arguments_naming_them():
    op = RoPENeoxPositionIdsFwdOp(4096)
    with pytest.raises(TypeError, match=r"RoPENeoxPositionIdsFwdOp.compile: expected the dims head_dim; missing head_dim"):
        op.compile(device="cpu")
    with pytest.raises(TypeError, match=r"unknown seq_len"):
        op.compile(head_dim=64, seq_len=9, device="cpu")
    with pytest.raises(ValueError, match=r"dtypes: expected some of float16, bfloat16, float32, got 'float64'"):
        op.compile(head_dim=64, dtypes=["float64"], device="cpu")
    with pytest.raises(ValueError, match=r"with_inputs: expected some of key, got 'positions'"):
        op.compile(head_dim=64, with_inputs=["positions"], device="cpu")
    # the dims: an int, at least 1, and one a call would be served with (the manifest's rules)
    with pytest.raises(TypeError, match=r"compile: head_dim: expected an int, got str '64'"):
        op.compile(head_dim="64", device="cpu")
    with pytest.raises(TypeError, match=r"compile: head_dim: expected an int, got bool True"):
        op.compile(head_dim=True, device="cpu")
    with pytest.raises(ValueError, match=r"compile: head_dim: expected a positive size, got 0"):
        op.compile(head_dim=0, device="cpu")
    with pytest.raises(ValueError, match=r"x: expected an even head_dim \(the last dim\); got head_dim=63"):
        op.compile(head_dim=63, device="cpu")
    with pytest.raises(ValueError, match=r"x: expected head_dim <= 1024; got head_dim=2048"):
        op.compile(head_dim=2048, device="cpu")


def test_compile_for_another_target_compiles_nothing():
    assert RoPENeoxPositionIdsFwdOp(4096, target="torch").compile(head_dim=64, device="cpu") == 0


def test_warmup_builds_the_head_major_kernel_for_2d_ops_only():
    """A long head-major 2d view (HF's [B, H, S, D] through a transpose) is served on CUDA by a kernel
    of its own schedule: ``tileops warmup`` and ``op.compile`` build it beside the usual one, for 2d
    ops only (a packed or 1d op never takes it), and never for the CPU."""
    from tileops.warmup import op_kernel_jobs

    jobs = op_kernel_jobs("RoPEFwdOp", {"input_layout": "2d"}, {"head_dim": 128}, ["bfloat16"], "sm_90",
                          with_inputs=[])
    specs = [j[1] for j in jobs]
    assert sorted((s.inverse, s.transposed) for s in specs) == [(False, False), (False, True), (True, False),
                                                                 (True, True)]
    for s in specs:  # the head-major kernel walks fewer head lanes, so a block covers more tokens
        assert s._head_lanes == (s.transposed_head_lanes if s.transposed else s.head_lanes)
        assert s.group == s._slots and s.block_threads <= 1024
    lanes = {s.transposed: s._head_lanes for s in specs}
    assert lanes[True] < lanes[False]
    assert max(s.group for s in specs if s.transposed) > max(s.group for s in specs if not s.transposed)
    assert {s.transposed for _, s, _, _ in op_kernel_jobs("RoPENeoxPositionIdsFwdOp", {"max_position": 64},
                                                          {"head_dim": 128}, ["float16"], "sm_90")} == {False}
    assert {s.transposed for _, s, _, _ in op_kernel_jobs("RoPEFwdOp", {"input_layout": "2d"}, {"head_dim": 128},
                                                          ["float16"], "c")} == {False}
