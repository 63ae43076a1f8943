"""``tileops emit``: CUDA source for sm_90/sm_80 that nvcc compiles, with 16-byte loads and stores."""

from __future__ import annotations

import io
import re
import shutil
import subprocess
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from tileops.cli import main

NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)


def emit(*args: str) -> str:
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main(["emit", *args]) == 0
    return buf.getvalue()


def _includes() -> list[str]:
    import tilelang

    root = Path(tilelang.__file__).parent
    return [f"-I{root / 'src'}", f"-I{root / '3rdparty' / 'cutlass' / 'include'}"]


def _ptx(src: str, arch: str, tmp_path: Path) -> str:
    cu = tmp_path / "k.cu"
    cu.write_text(src)
    ptx = tmp_path / "k.ptx"
    subprocess.run([NVCC, "-ptx", f"-arch={arch}", "-std=c++17", *_includes(), "-o", str(ptx), str(cu)],
                   check=True, capture_output=True)
    return ptx.read_text()


def test_emit_c_source():
    src = emit("RoPEFwdOp", "--arch", "c")
    assert "rope_c" in src and "__global__" not in src


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
@pytest.mark.parametrize("op,case", [("RoPEFwdOp", "neox-2d-2k"), ("RoPEFwdOp", "interleaved-2d-2k"),
                                     ("RoPENeoxPositionIdsFwdOp", "ids-partial-4k"),
                                     ("MRoPEFwdOp", "qwen2vl-2d-4k"), ("MRoPEFwdOp", "qwen3vl-2d-4k"),
                                     ("MRoPEFwdOp", "qwen2vl-packed-4k"), ("MRoPEFwdOp", "mrope-packed-odd")])
@pytest.mark.slow  # measured 5-38 s on 2 cores (pytest --durations); CI runs -m slow
def test_cuda_source_compiles_with_16_byte_accesses(op, case, arch, tmp_path):
    src = emit(op, "--case", case, "--arch", arch)
    assert "__global__" in src
    cu = tmp_path / "k.cu"
    cu.write_text(src)
    subprocess.run([NVCC, "-cubin", f"-arch={arch}", "-std=c++17", *_includes(), "-o", str(tmp_path / "k.cubin"),
                    str(cu)], check=True, capture_output=True)
    ptx = _ptx(src, arch, tmp_path)
    loads = re.findall(r"ld\.global(?:\.nc)?\.v4\.(?:u32|f32|b32)", ptx)
    stores = re.findall(r"st\.global(?:\.cg)?\.v4\.(?:u32|f32|b32)", ptx)
    assert loads, "no 16-byte global loads"
    assert stores, "no 16-byte global stores"
    narrow_loads = re.findall(r"ld\.global(?:\.nc)?\.(?:u8|u16|s16|b16|v2\.u16)\b", ptx)
    assert not narrow_loads, f"narrow global loads of x: {narrow_loads[:4]}"


@pytest.mark.slow  # measured 5-38 s on 2 cores (pytest --durations); CI runs -m slow
@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_mrope_sections_on_vector_boundaries_keep_wide_table_loads(tmp_path):
    """Qwen2-VL's [16, 24, 24] in bf16: each thread's 8 pairs share one stream, so its cos/sin table
    loads stay 16 bytes wide as in plain RoPE; Qwen3-VL's interleaved map gathers a row per pair."""
    wide = _ptx(emit("MRoPEFwdOp", "--case", "qwen2vl-2d-4k", "--arch", "sm_90"), "sm_90", tmp_path)
    gather = _ptx(emit("MRoPEFwdOp", "--case", "qwen3vl-2d-4k", "--arch", "sm_90"), "sm_90", tmp_path)
    plain = _ptx(emit("RoPEFwdOp", "--case", "neox-2d-2k", "--arch", "sm_90"), "sm_90", tmp_path)
    f32x4 = r"ld\.global(?:\.nc)?\.v4\.f32"
    assert len(re.findall(f32x4, wide)) == len(re.findall(f32x4, plain)) > 0
    assert len(re.findall(r"ld\.global(?:\.nc)?\.f32", gather)) >= 48  # 6 tables x 8 pairs
