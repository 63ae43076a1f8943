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


def test_compile_for_another_target_compiles_nothing():
    assert RoPENeoxPositionIdsFwdOp(4096, target="torch").compile(head_dim=64, device="cpu") == 0
