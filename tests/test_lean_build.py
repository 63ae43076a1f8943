"""The lean CUDA build (tileops/cuda_build.py): TileLang lowers, tileops compiles the device code to a cubin
(NVRTC or ``nvcc -cubin``) and the launcher with the system C++ compiler.

The CPU tests build real libraries (no GPU needed: nothing touches CUDA until a launch) and check
what can be checked without one; the CUDA test compares a lean build's output with TileLang's own
build of the same kernel, bit for bit, on random inputs.
"""

from __future__ import annotations

import ctypes
import os

import pytest
import torch

from tileops.compile import cuda_build, build
from tileops.kernels import report
from tileops.kernels.rope import RoPEKernelSpec


def _toolchain() -> str | None:
    """Why the lean build cannot run here, or None."""
    try:
        cuda_build.check_toolchain()
    except cuda_build.Unsupported as e:
        return str(e)
    return None


needs_toolchain = pytest.mark.skipif(_toolchain() is not None, reason=f"lean build: {_toolchain()}")

TL_SOURCE = """
template <typename T> __device__ __forceinline__ void tileops_st16(T* dst, const T* src) {}
#if defined(_MSC_VER) && !defined(__clang__) && _MSC_VER < 1940
#define _tl_orig_alignas alignas
#include <cuda.h>
#endif
#include <tl_templates/cuda/reduce.h>
#include <tl_templates/cuda/debug.h>
#ifdef ENABLE_BF16
#include <tl_templates/cuda/cuda_bf16_fallbacks.cuh>
#endif
extern "C" __global__ void k(half_t* __restrict__ X, int n) { X[0] = (half_t)((float)X[1] * 2.0f); }
"""


def test_device_source_replaces_tilelangs_includes():
    src = cuda_build.device_source(TL_SOURCE)
    assert "tl_templates" not in src and "cuda.h" not in src and "_MSC_VER" not in src
    assert src.startswith(cuda_build.DEVICE_PRELUDE)
    assert "struct __align__(2) half_t" in src and "extern \"C\" __global__ void k(" in src


@pytest.mark.parametrize("extra, what", [("#include <cute/tensor.hpp>\n", "cute/tensor.hpp"),
                                         ("__device__ void f() { tl::fence(); }\n", "tl::"),
                                         ("__device__ fp8_e4_t g;\n", "fp8_e4_t")])
def test_device_source_refuses_what_the_prelude_lacks(extra, what):
    with pytest.raises(cuda_build.Unsupported, match=what):
        cuda_build.device_source(TL_SOURCE + extra)


def test_kernel_params_types():
    decl = ('extern "C" __global__ void __launch_bounds__(128, 1) k(const half_t* __restrict__ X, '
            'float* __restrict__ Y, int B, int64_t xs, unsigned int u, float f)')
    assert cuda_build._kernel_params(decl) == ["void*", "void*", "int", "int64_t", "unsigned int", "float"]
    with pytest.raises(cuda_build.Unsupported, match="CUtensorMap"):
        cuda_build._kernel_params('__global__ void k(const __grid_constant__ CUtensorMap desc)')


SPECS = [
    RoPEKernelSpec(dtype="float16", head_dim=128, rot=128, head_lanes=8),
    RoPEKernelSpec(dtype="bfloat16", head_dim=96, rot=64, pairing="interleaved", positions="int64", inverse=True),
    RoPEKernelSpec(dtype="float32", head_dim=128, rot=128, positions="int32", mrope_section=(16, 24, 24)),
    RoPEKernelSpec(dtype="bfloat16", head_dim=128, rot=128, transposed=True),
]


@needs_toolchain
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.dtype}-{s.head_dim}-{s.positions}-{s.transposed}")
def test_lean_library_builds_and_its_record_matches_the_call(spec, tmp_path):
    lean = cuda_build.build(build.prim_func("rope", spec), "sm_90", build.PASS_CONFIGS, out_dir=str(tmp_path))
    # the parameters in the builder's order (spec.args), then the dynamic extents
    assert len(lean.record["args"]) == len(spec.args) + len(lean.record["extents"])
    tensors = [n for n in spec.args if n in ("X", "Y", "K", "KY", "TD", "P", "ERR")]
    assert all(t == "void*" for t in lean.record["args"][:len(tensors)]) and spec.args[:len(tensors)] == tuple(tensors)
    assert "void*" not in lean.record["args"][len(tensors):]
    assert set(lean.record["extents"]) >= {"NX", "NY", "NK", "NKY"}
    lib = ctypes.CDLL(lean.libpath)
    for name in ("init", "call", "load", "get_last_error"):
        assert hasattr(lib, name), name
    assert lib.init() == 0  # opening the library does no CUDA work
    host = open(os.path.join(tmp_path, "host.cpp")).read()
    assert "cudaLaunchKernelExC" in host and "tileops_cubin[]" in host
    assert "cutlass" not in host and "tl_templates" not in lean.device_source


@needs_toolchain
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without a GPU gets")
def test_lean_library_without_a_gpu_fails_to_load_with_a_message(tmp_path):
    spec = SPECS[0]
    lean = cuda_build.build(build.prim_func("rope", spec), "sm_90", build.PASS_CONFIGS, out_dir=str(tmp_path))
    lib = ctypes.CDLL(lean.libpath)
    lib.get_last_error.restype = ctypes.c_char_p
    assert lib.load() == -1
    assert b"loading the kernel's cubin failed" in lib.get_last_error()
    from tileops.compile.entry import raw_kernel_from

    with pytest.raises(RuntimeError, match="cubin failed"):
        raw_kernel_from(lib, lean.record, torch.device("cuda", 0), spec.args)


@needs_toolchain
def test_a_lean_build_is_indexed_under_its_own_key(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEOPS_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TILELANG_DISABLE_CACHE", raising=False)
    spec = SPECS[1]
    monkeypatch.setattr(build, "compile_kernel", lambda *a: pytest.fail("TileLang's build was used"))
    build.clear_memory_cache()
    lib, record = build._obtain("rope", spec, "cuda", "sm_90")[0]
    lean_key = build.index_key("rope", spec, "cuda", "sm_90", lean=True)
    assert lean_key != build.index_key("rope", spec, "cuda", "sm_90")
    assert sorted(os.listdir(tmp_path / "kernels")) == [lean_key + ".json", lean_key + ".so"]
    before = build.stats.loads
    again, record2 = build._obtain("rope", spec, "cuda", "sm_90")[0]  # a later process: from the index
    assert build.stats.loads == before + 1 and record2["args"] == record["args"]


@pytest.mark.parametrize("failure", [cuda_build.Unsupported("a template"), RuntimeError("nvrtc: boom")])
def test_a_kernel_the_lean_build_cannot_make_is_built_by_tilelang(failure, tmp_path, monkeypatch):
    monkeypatch.setenv("TILEOPS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "_lean_warned", False)

    def refuse(*a, **k):
        raise failure

    class Adapter:
        lib, libpath = "the TileLang library", None

    class Kernel:
        adapter = Adapter()

    monkeypatch.setattr(cuda_build, "build", refuse)  # lowering now,
    monkeypatch.setattr(cuda_build, "compile_sources", refuse)  # and the sources shipped lowered
    monkeypatch.setattr(build, "prim_func", lambda *a: None)
    monkeypatch.setattr(build, "compile_kernel", lambda *a: Kernel())
    import tileops.compile.entry

    monkeypatch.setattr(tileops.compile.entry, "kernel_record", lambda k: {"args": [], "extents": []})
    if isinstance(failure, RuntimeError):
        with pytest.warns(RuntimeWarning, match="lean CUDA build failed.*nvrtc: boom"):
            lib, _ = build._obtain("rope", SPECS[0], "cuda", "sm_90")[0]
    else:
        lib, _ = build._obtain("rope", SPECS[0], "cuda", "sm_90")[0]
    assert lib == "the TileLang library"


def test_lean_build_off_by_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEOPS_LEAN_BUILD", "0")
    monkeypatch.setenv("TILEOPS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cuda_build, "build", lambda *a, **k: pytest.fail("the lean build was tried"))
    monkeypatch.setattr(cuda_build, "compile_sources", lambda *a, **k: pytest.fail("the lean build was tried"))

    class Adapter:
        lib, libpath = "tl", None

    class Kernel:
        adapter = Adapter()

    import tileops.compile.entry

    monkeypatch.setattr(build, "compile_kernel", lambda *a: Kernel())
    monkeypatch.setattr(tileops.compile.entry, "kernel_record", lambda k: {"args": [], "extents": []})
    assert build._obtain("rope", SPECS[0], "cuda", "sm_90")[0][0] == "tl"


# ------------------------------------------------------------------------------------- on a GPU
def _bind_and_run(k, spec, x, out, key, kout, td, pos=None, err=None):
    u = spec.stride_unit
    st = [[v // u for v in t.stride()[:3]] for t in (x, out, key, kout)]
    extra = {}
    if spec.positions:
        extra = dict(P=pos.data_ptr(), ERR=err.data_ptr(), psb=pos.stride(0), pss=pos.stride(1), limit=1 << 20,
                     tag=7, NP=0)
    args = dict(X=x.data_ptr(), Y=out.data_ptr(), K=key.data_ptr(), KY=kout.data_ptr(), TD=td.data_ptr(),
                B=x.shape[0], S=x.shape[1], H=x.shape[2], HK=key.shape[2], xsb=st[0][0], xss=st[0][1],
                xsh=st[0][2], ysb=st[1][0], yss=st[1][1], ysh=st[1][2], ksb=st[2][0], kss=st[2][1],
                ksh=st[2][2], kysb=st[3][0], kyss=st[3][1], kysh=st[3][2], NX=0, NY=0, NK=0, NKY=0, **extra)
    k(*k.bind(**dict.fromkeys(k.arg_names, 0) | {n: v for n, v in args.items() if n in k.arg_names}))


@pytest.mark.cuda
@pytest.mark.parametrize("spec", [
    RoPEKernelSpec(dtype="float16", head_dim=128, rot=128, head_lanes=8),
    RoPEKernelSpec(dtype="bfloat16", head_dim=80, rot=80, pairing="interleaved", head_lanes=8, inverse=True),
    RoPEKernelSpec(dtype="float32", head_dim=96, rot=48, head_lanes=8),
    RoPEKernelSpec(dtype="bfloat16", head_dim=128, rot=64, head_lanes=8, positions="int64"),
    RoPEKernelSpec(dtype="float16", head_dim=64, rot=64, head_lanes=1, tokens_per_thread=2, positions="int32"),
], ids=lambda s: f"{s.dtype}-{s.head_dim}-{s.rot}-{s.pairing}-{s.positions}")
def test_lean_and_tilelang_builds_agree_bit_for_bit_cuda(spec):
    from tileops.compile.entry import kernel_record, raw_kernel, raw_kernel_from
    from tileops.rope.tables import RoPETables

    dev = torch.device("cuda")
    tl_kernel = build.compile_kernel("rope", spec, "cuda", build.device_backend(dev)[1])
    lean = cuda_build.build(build.prim_func("rope", spec), build.device_backend(dev)[1], build.PASS_CONFIGS)
    assert lean.record == kernel_record(tl_kernel)  # the same arguments in the same order
    ours = raw_kernel_from(build._init_library(lean.libpath), lean.record, dev, spec.args)
    theirs = raw_kernel(tl_kernel, dev, spec.args)
    dt = getattr(torch, spec.dtype)
    x = torch.randn(2, 77, 6, spec.head_dim, device=dev).to(dt)
    key = torch.randn(2, 77, 2, spec.head_dim, device=dev).to(dt)
    inv = 10000.0 ** (-torch.arange(0, spec.rot, 2, dtype=torch.float64) / spec.rot)
    td = RoPETables(inv, 1.0).on(dev)
    pos = torch.randint(0, 1 << 20, (2, 77), device=dev, dtype=getattr(torch, spec.positions or "int64"))
    results = []
    for k in (ours, theirs):
        out, kout = torch.full_like(x, float("nan")), torch.full_like(key, float("nan"))
        err = torch.zeros(report.ENTRY, dtype=torch.int32, device=dev)  # a call's error entry
        _bind_and_run(k, spec, x, out, key, kout, td, pos, err)
        torch.cuda.synchronize()
        assert not out.isnan().any() and not kout.isnan().any()
        results.append((out, kout, err))
    for a, b in zip(results[0], results[1]):
        assert torch.equal(a.view(torch.uint8) if a.is_floating_point() else a,
                           b.view(torch.uint8) if b.is_floating_point() else b)
