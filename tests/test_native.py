"""The native runtime (tileops/runtime/native.py, tileops/runtime/_native.cpp) against the Python
runtime beside it (tileops/runtime/executor.py), on the CPU's BUILTIN kernels: the same results bit
for bit, the same errors at the same calls, the same refusals; what it hands back to the general
path; the custom ops' C++ kernels; the deferred tracker on a fake driver; and how the extension is
built, cached, rebuilt, loaded once at import and switched off. Every scenario runs both ways and
checks that the native run was in fact served natively (the runtime counts its calls)."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
import threading
import weakref
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import tileops
from tests.paths import both, native_module, on_python
from tests.references import reference
from tileops.compile.entry import build_c_library
from tileops.kernels import report
from tileops.runtime import errors, library, native
from tileops.runtime.served import Layout, Output, Served
from tileops.rope import Phi3LongRoPEFwdOp, RoPEFwdOp, RoPENeoxPositionIdsFwdOp, YaRNFwdOp
from tileops.testing import tolerance

ROOT = Path(__file__).resolve().parent.parent


def assert_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    atol, rtol = tolerance(got.dtype)
    err = (got.detach().double() - ref).abs()
    assert bool((err <= atol + rtol * ref.abs()).all()), f"max error {err.max().item():.3e}"


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def test_the_extension_was_built_and_loaded_at_import_with_warnings_on_and_clean():
    """conftest.py builds it before the tests: this process loaded it when tileops was imported; its
    build log (``-Wall -Wextra``) has no warning; build() finds it intact and does nothing."""
    mod = native_module()
    assert native.status() == "loaded" and tileops.runtime.library.native.module is mod
    path = native.build()
    assert native._intact(path) and "-Wall" in native.FLAGS and "-Wextra" in native.FLAGS
    log = (Path(path).parent / "build.log").read_text()
    assert "_native.cpp" in log and "warning:" not in log, [ln for ln in log.splitlines() if "warning" in ln][:5]


def test_the_four_serving_calls_and_every_layout_match_the_python_path_bit_for_bit(gen):
    """The serving calls of benchmarks.serving --host (ids q+k in place, ids q alone, 2d q+k on HF
    views, 2d q alone), out=, in place, transposed and sliced views, three calls each (the first
    makes the plans, the next two are served by them), both ways, each against float64."""
    T, Hq, Hk, D = 5, 4, 2, 64
    inputs = {
        "q": torch.randn(T, Hq, D, generator=gen), "k": torch.randn(T, Hk, D, generator=gen),
        "pos": torch.randint(0, 1 << 20, (T,), generator=gen),
        "qh": torch.randn(2, Hq, T, D, generator=gen), "kh": torch.randn(2, Hk, T, D, generator=gen),
        "pos2": torch.randint(0, 1 << 20, (2, T), generator=gen),
        "qkv": torch.randn(T, (Hq + 2 * Hk) * D, generator=gen),
    }

    def scenario(on: Callable[[Any], Any]) -> tuple[list, list]:
        ids = on(RoPENeoxPositionIdsFwdOp(1 << 20))
        hf = on(RoPEFwdOp(input_layout="2d"))
        yarn = on(YaRNFwdOp(input_layout="1d", scale=4.0, rope_layout="interleaved"))
        got = []
        for _ in range(3):
            v = {n: t.clone() for n, t in inputs.items()}
            q, k = v["q"], v["k"]
            got.append(ids(q, v["pos"], key=k, out=q, key_out=k))  # in place
            got.append(ids(v["q"], v["pos"]))
            got.append(hf(v["qh"].transpose(1, 2), position_ids=v["pos2"], key=v["kh"].transpose(1, 2)))
            got.append(hf(v["qh"].transpose(1, 2)))
            o = torch.full((2, T, Hq, D), float("nan"))
            got.append(hf(v["qh"].transpose(1, 2), position_ids=v["pos2"][0], out=o))
            qkv = v["qkv"]  # q and k column blocks of one fused buffer, in place
            qq, kk = qkv[:, : Hq * D].view(T, Hq, D), qkv[:, Hq * D : (Hq + Hk) * D].view(T, Hk, D)
            ids(qq, v["pos"], key=kk, out=qq, key_out=kk)
            got.append(qkv)
            got.append(yarn(v["qh"][0, 0], position_ids=v["pos"]))
        return got, [ids, hf, yarn]

    py, nat = both(scenario)
    assert same(py, nat)
    ids_p, hf_p = {"max_position": 1 << 20}, {"input_layout": "2d"}
    x, pos = inputs["q"], inputs["pos"]
    assert_close(nat[0][0], reference("RoPENeoxPositionIdsFwdOp", ids_p, {"x": x, "position_ids": pos}))
    assert_close(nat[0][1], reference("RoPENeoxPositionIdsFwdOp", ids_p, {"x": inputs["k"], "position_ids": pos}))
    assert_close(nat[2][1], reference("RoPEFwdOp", hf_p, {"x": inputs["kh"].transpose(1, 2),
                                                           "position_ids": inputs["pos2"]}))
    assert_close(nat[3], reference("RoPEFwdOp", hf_p, {"x": inputs["qh"].transpose(1, 2)}))
    assert_close(nat[4], reference("RoPEFwdOp", hf_p, {"x": inputs["qh"].transpose(1, 2),
                                                        "position_ids": inputs["pos2"][0]}))
    assert torch.equal(nat[5][:, (Hq + Hk) * D :], inputs["qkv"][:, (Hq + Hk) * D :]), "v was written"


def test_q_and_k_on_hf_views_with_new_outputs_stay_on_the_native_path(gen):
    """The host table's HF-view row (benchmarks/host.py): q and k ``[B, H, S, D]`` passed as the
    transposed views HF's attention makes in each call, positions, new outputs. Once the first call
    has bound the signature, every later call is served by the extension: none goes back to Python
    (on the CPU that costs ~10 us a call, against ~2.5 us served). The outputs are what the Python
    runtime makes, bit for bit and stride for stride: each a tensor of its own with its input's
    strides (a transposed view of a dense ``[B, H, S, D]`` block, which HF transposes back), sharing
    memory with no input and not with each other."""
    B, Hq, Hk, S, D = 2, 4, 2, 5, 32
    qh, kh = torch.randn(B, Hq, S, D, generator=gen), torch.randn(B, Hk, S, D, generator=gen)
    pos = torch.randint(0, 1 << 20, (B, S), generator=gen)

    def scenario(on: Callable[[Any], Any]) -> tuple[list, list]:
        op = on(RoPEFwdOp(input_layout="2d"))
        return [op(qh.transpose(1, 2), position_ids=pos, key=kh.transpose(1, 2)) for _ in range(4)], [op]

    py, nat = both(scenario)
    assert same(py, nat)
    native_module()
    op = RoPEFwdOp(input_layout="2d")
    op(qh.transpose(1, 2), position_ids=pos, key=kh.transpose(1, 2))  # binds the signature
    before = op._runtime.stats()
    got = [op(qh.transpose(1, 2), position_ids=pos, key=kh.transpose(1, 2)) for _ in range(5)]
    after = op._runtime.stats()
    assert (after["hits"] - before["hits"], after["misses"] - before["misses"]) == (5, 0), (before, after)
    for qo, ko in got:
        assert qo.stride() == qh.transpose(1, 2).stride() and ko.stride() == kh.transpose(1, 2).stride()
        assert qo.transpose(1, 2).is_contiguous() and ko.transpose(1, 2).is_contiguous()
        storages = {t.untyped_storage().data_ptr() for t in (qo, ko, qh, kh, pos)}
        assert len(storages) == 5 and qo.storage_offset() == ko.storage_offset() == 0
        assert torch.equal(qo, nat[0][0]) and torch.equal(ko, nat[0][1])
    assert_close(got[0][1], reference("RoPEFwdOp", {"input_layout": "2d"},
                                      {"x": kh.transpose(1, 2), "position_ids": pos}))


def test_a_served_calls_outputs_are_seen_by_dispatch_modes_and_the_profiler(gen):
    """The extension makes a new output past the dispatcher's first step only while nothing watches:
    under a TorchDispatchMode the served q+k call's two allocations reach the mode, and the profiler
    records them, as before (the call still served natively)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    native_module()
    op = RoPEFwdOp(input_layout="2d")
    qt = torch.randn(1, 2, 4, 16, generator=gen).transpose(1, 2)
    kt = torch.randn(1, 1, 4, 16, generator=gen).transpose(1, 2)
    pos = torch.arange(4)[None]
    op(qt, position_ids=pos, key=kt)
    seen = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    hits = op._runtime.stats()["hits"]
    with Log():
        op(qt, position_ids=pos, key=kt)
    with torch.profiler.profile() as prof:
        op(qt, position_ids=pos, key=kt)
    assert seen == ["aten.empty_strided.default"] * 2
    assert sum(e.name == "aten::empty_strided" for e in prof.events()) == 2
    assert op._runtime.stats()["hits"] == hits + 2


def test_bad_positions_are_reported_once_at_the_same_calls(gen):
    """A run of good and bad calls (new and given outputs, with a key): the same calls raise the
    same messages both ways, and the good calls' results are the same."""
    T = 7
    x = torch.randn(T, 3, 32, generator=gen)
    k = torch.randn(T, 1, 32, generator=gen)
    bad_at = {2: (3, 100), 3: (0, -1), 6: (6, 1 << 30), 7: (1, 100)}
    plan = [torch.randint(0, 100, (T,), generator=gen) for _ in range(9)]
    for i, (j, v) in bad_at.items():
        plan[i][j] = v

    def scenario(on: Callable[[Any], Any]) -> tuple[list, list]:
        op = on(RoPENeoxPositionIdsFwdOp(100))
        seen = []
        for i, pos in enumerate(plan):
            out = torch.full_like(x, float("nan")) if i % 2 else None
            try:
                seen.append(("ok", op(x, pos.clone(), key=k, out=out)))
            except ValueError as e:
                seen.append(("error", str(e)))
        op.check()  # nothing pending on the CPU
        return seen, [op]

    py, nat = both(scenario)
    assert same(py, nat)
    assert [i for i, (kind, _) in enumerate(nat) if kind == "error"] == sorted(bad_at)
    assert "position_ids[3] = 100" in nat[2][1] and "position_ids[6] = 1073741824" in nat[6][1]


def test_overlapping_out_is_refused_and_interleaved_views_pass_both_ways(gen):
    """On a repeated signature: an out= that now overlaps x or the positions raises the Python
    path's error and writes nothing; q and k blocks of one buffer (ranges that meet, memory that
    does not) are served."""
    buf0 = torch.randn(64, 16, generator=gen)

    def scenario(on: Callable[[Any], Any]) -> tuple[list, list]:
        op = on(RoPEFwdOp(input_layout="1d"))
        buf = buf0.clone()
        seen = [op(buf[:20], out=buf[30:50]), op(buf[:20], out=buf[40:60])]  # the plan, then served by it
        before = buf.clone()
        for x, out in ((buf[:20], buf[5:25]), (buf[10:30], buf[:20])):
            with pytest.raises(ValueError, match="out: overlaps x") as e:
                op(x, out=out)
            seen.append(str(e.value))
        assert torch.equal(buf, before), "a refused call wrote memory"
        mem = torch.arange(320, dtype=torch.int32)
        op(torch.randn(20, 16), position_ids=torch.arange(20, dtype=torch.int32), out=torch.empty(20, 16))
        op(torch.randn(20, 16), position_ids=torch.arange(20, dtype=torch.int32), out=torch.empty(20, 16))
        with pytest.raises(ValueError, match="out: overlaps position_ids") as e:
            op(torch.randn(20, 16), position_ids=mem[:20], out=mem.view(torch.float32).view(20, 16))
        seen.append(str(e.value))
        assert torch.equal(mem, torch.arange(320, dtype=torch.int32))
        ids = on(RoPENeoxPositionIdsFwdOp(4096))  # interleaved: the exact test, by offset
        for _ in range(3):
            qkv = torch.randn(6, 8 * 32, generator=gen)
            q, k = qkv[:, : 4 * 32].view(6, 4, 32), qkv[:, 4 * 32 : 6 * 32].view(6, 2, 32)
            want = reference("RoPENeoxPositionIdsFwdOp", {"max_position": 4096},
                             {"x": q.clone(), "position_ids": torch.arange(6)})
            ids(q, torch.arange(6), key=k, out=q, key_out=k)
            assert_close(q, want)
        return seen, [op, ids]

    py, nat = both(scenario)
    assert same(py, nat)


def test_a_misaligned_pointer_takes_the_copy_fallback_both_ways(gen):
    """A float32 tensor one byte off its element alignment (memory from a buffer at an odd
    offset), in a signature whose plan exists: the plan refuses the pointer, the general path
    copies, and the answer is right; the input is not modified."""
    x = torch.randn(9, 3, 32, generator=gen)
    pos = torch.randint(0, 4096, (9,), generator=gen)
    ref = reference("RoPENeoxPositionIdsFwdOp", {"max_position": 4096}, {"x": x, "position_ids": pos})

    def scenario(on: Callable[[Any], Any]) -> tuple[list, list]:
        op = on(RoPENeoxPositionIdsFwdOp(4096))
        got = [op(x, pos), op(x, pos)]
        raw = bytearray(4 * x.numel() + 1)
        odd = torch.frombuffer(raw, dtype=torch.float32, offset=1, count=x.numel()).view(x.shape)
        odd.copy_(x)
        assert odd.data_ptr() % 4 == 1
        got.append(op(odd, pos))
        assert torch.equal(odd, x), "the input was modified"
        out_raw = bytearray(4 * x.numel() + 1)
        out = torch.frombuffer(out_raw, dtype=torch.float32, offset=1, count=x.numel()).view(x.shape)
        got.append(op(x, pos, out=out))
        got.append(op(x, pos, out=out))
        assert got[-1] is out
        return got, [op]

    py, nat = both(scenario)
    assert same(py, nat)
    for g in nat:
        assert_close(g, ref)


def test_strict_mode_in_place_and_key_both_ways(gen):
    x0 = torch.randn(4, 2, 16, generator=gen)
    k0 = torch.randn(4, 1, 16, generator=gen)

    def scenario(on: Callable[[Any], Any]) -> tuple[list, list]:
        op = on(RoPENeoxPositionIdsFwdOp(10))
        seen = []
        x, k = x0.clone(), k0.clone()
        with tileops.strict():
            seen.append(op(x, torch.tensor([0, 1, 2, 3]), key=k, out=x, key_out=k))
            seen.append(op(x, torch.tensor([3, 2, 1, 0]), key=k, out=x, key_out=k))
            with pytest.raises(ValueError, match=r"position_ids\[2\] = 10$") as e:
                op(x, torch.tensor([0, 1, 10, 3]), key=k, out=x, key_out=k)
            seen.append(str(e.value))
        assert not errors.is_strict()
        seen.append(op(x, torch.tensor([1, 1, 1, 1]), key=k, out=x, key_out=k))
        return [[t.clone() if isinstance(t, torch.Tensor) else t for t in s] if isinstance(s, tuple) else s
                for s in seen], [op]

    py, nat = both(scenario)
    assert same(py, nat)


def test_what_the_native_runtime_leaves_to_the_general_path(gen):
    """Inputs that require grad (the output gets a grad_fn), a tensor subclass, a dtype the
    manifest refuses: each served (or refused) by the general path as before."""
    mod = native_module()
    op = RoPEFwdOp(input_layout="2d")
    x = torch.randn(2, 5, 3, 32, generator=gen)
    want = reference("RoPEFwdOp", {"input_layout": "2d"}, {"x": x})
    op(x)
    op(x)
    hits = op._runtime.stats()["hits"]
    xg = x.clone().requires_grad_(True)
    y = op(xg)
    assert y.grad_fn is not None
    y.sum().backward()
    assert xg.grad is not None
    with torch.no_grad():
        assert op(xg).grad_fn is None
    assert op._runtime.stats()["hits"] == hits + 1, "a no_grad call of the same signature is served natively"

    class Sub(torch.Tensor):
        pass

    s = x.clone().as_subclass(Sub)
    assert not mod.is_plain(s)
    assert_close(op(s), want)
    assert_close(op(s), want)
    with pytest.raises(TypeError, match="x: expected dtype"):
        op(x.double())
    assert op._runtime.stats()["hits"] == hits + 1


def test_the_custom_ops_serve_a_bound_signature_in_cpp(gen):
    """tileops::apply and apply_out, called as a compiled graph calls them: a signature the op
    bound before is served by the extension's kernels (its runtime counts it), one it has not goes
    to the general path (which binds it), and both give the eager call's result."""
    native_module()
    op = RoPEFwdOp(input_layout="2d")
    x = torch.randn(1, 7, 2, 32, generator=gen)
    k = torch.randn(1, 7, 1, 32, generator=gen)
    pos = torch.randint(0, 5000, (7,), generator=gen)
    want_q, want_k = op(x, position_ids=pos, key=k)
    stats = op._runtime.stats
    before = stats()
    got = torch.ops.tileops.apply.default(op._handle, [x, pos, k], "x,position_ids,key")
    assert torch.equal(got[0], want_q) and torch.equal(got[1], want_k)
    assert stats()["hits"] == before["hits"] + 1, "a bound signature went to Python"
    new = torch.ops.tileops.apply.default(op._handle, [x], "x")[0]  # not bound yet: the general path
    assert stats()["misses"] == before["misses"] + 1 and torch.equal(new, op(x))
    assert torch.equal(torch.ops.tileops.apply.default(op._handle, [x], "x")[0], new)
    assert stats()["hits"] == before["hits"] + 3  # the eager op(x) and the apply after it
    o = torch.full_like(x, float("nan"))
    torch.ops.tileops.apply_out.default(op._handle, [x], "x", [o])
    torch.ops.tileops.apply_out.default(op._handle, [x], "x", [o])
    assert torch.equal(o, new)
    y = x.clone()
    v = y._version
    torch.ops.tileops.apply_out.default(op._handle, [y], "x", [y])  # in place
    assert torch.equal(y, new) and y._version > v
    with pytest.raises(RuntimeError, match="names no live op"):
        torch.ops.tileops.apply.default(10**9, [x], "x")


def test_the_custom_op_is_differentiable_once_and_refuses_a_second_derivative(gen):
    """tileops::apply with an input that requires grad (its C++ autograd kernel hands the call to
    library._Apply): the gradient is the eager call's, also with create_graph=True, and
    differentiating that gradient raises (the backward kernel is not itself differentiable)."""
    native_module()
    op = RoPEFwdOp(input_layout="2d")
    x = torch.randn(1, 5, 2, 32, generator=gen, requires_grad=True)
    (y,) = torch.ops.tileops.apply.default(op._handle, [x], "x")
    (want,) = torch.autograd.grad(op(x).square().sum(), x)
    (g,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    assert torch.equal(g, want)
    with pytest.raises(RuntimeError, match="double backward"):
        g.sum().backward()


def test_custom_op_calls_from_threads_without_the_gil_count_every_call(gen):
    """torch releases the GIL around an op call: four threads calling tileops::apply at once run
    the executor concurrently; every call is served right and counted once."""
    native_module()
    op = RoPEFwdOp(input_layout="2d")
    x = torch.randn(1, 3, 2, 16, generator=gen)
    want = op(x)
    op(x)
    before = op._runtime.stats()
    wrong = []

    def worker() -> None:
        for _ in range(300):
            if not torch.equal(torch.ops.tileops.apply.default(op._handle, [x], "x")[0], want):
                wrong.append(1)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = op._runtime.stats()
    assert not wrong and after["hits"] - before["hits"] == 1200 and after["misses"] == before["misses"]


def test_a_phi3_op_picks_its_table_per_call_both_ways(gen):
    """Phi3's short/long table is chosen per call on the device: the native plan calls back for it."""
    x = torch.randn(1, 9, 2, 32, generator=gen)
    pos_short = torch.randint(0, 60, (9,), generator=gen)
    pos_long = pos_short + 100

    def scenario(on: Callable[[Any], Any]) -> tuple[list, list]:
        op = on(Phi3LongRoPEFwdOp(input_layout="2d", short_factor=torch.linspace(1, 2, 16),
                               long_factor=torch.linspace(2, 8, 16), original_max_position_embeddings=64,
                               max_position_embeddings=256))
        return [op(x, position_ids=p) for p in (pos_short, pos_long, pos_short, pos_long)], [op]

    py, nat = both(scenario)
    assert same(py, nat)
    assert not torch.equal(nat[0], nat[1])


# ---------------------------------------------------------------------------------- the build
def _env(env: dict[str, str]) -> dict[str, str]:
    return {**os.environ, "TILEOPS_NATIVE": "1", **env}  # on unless a test turns it off


def _run(args: list[str], env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-W", "error", *args], capture_output=True, text=True, cwd=ROOT,
                          env=_env(env), timeout=timeout)


_PROBE = """
import logging, sys, torch
logging.basicConfig(level=logging.DEBUG, stream=sys.stdout, format="%(name)s %(message)s")
logging.getLogger("tilelang").setLevel(logging.ERROR)
from tileops.runtime import native
print("AT IMPORT", native.status())
from tileops.rope import RoPEFwdOp
op = RoPEFwdOp(input_layout="2d")
x = torch.randn(1, 3, 2, 16)
y = op(x); y = op(x)
print("STATUS", native.status(), native.module is not None, op._native_run is not None, native.library_path())
"""
_BUILD = ["-c", "from tileops.runtime import native\nnative.build(progress=True)"]


@pytest.mark.slow  # measured 5-38 s on 2 cores (pytest --durations); CI runs -m slow
def test_off_switch_no_cached_build_and_no_compiler_mean_the_python_runtime_silently(tmp_path):
    """TILEOPS_NATIVE=0; a cache without a build (an import on a machine without a GPU never builds
    one: nothing is compiled, nothing left behind); a compiler that fails; a cache that cannot be
    created: the Python runtime serves, with no warning."""
    r = _run(["-c", _PROBE], {"TILEOPS_NATIVE": "0", "TILEOPS_CACHE_DIR": str(tmp_path / "a")})
    assert r.returncode == 0, r.stderr
    assert "AT IMPORT off" in r.stdout and "STATUS off False False" in r.stdout
    if torch.cuda.is_available():
        pytest.skip("an import on a machine with a GPU builds the extension")
    r = _run(["-c", _PROBE], {"CXX": "false", "TILEOPS_CACHE_DIR": str(tmp_path / "b")})
    assert r.returncode == 0 and r.stderr.strip() == "", r.stderr  # -W error: no warning either
    assert "AT IMPORT not built" in r.stdout and "STATUS not built False False" in r.stdout
    assert not (tmp_path / "b" / "native").exists(), "an import started a build"
    r = _run(_BUILD, {"CXX": "false", "TILEOPS_CACHE_DIR": str(tmp_path / "b")})
    assert r.returncode != 0 and "building the native runtime failed" in r.stderr, r.stderr[-2000:]
    (tmp_path / "a-file").write_text("")
    r = _run(["-c", _PROBE], {"TILEOPS_CACHE_DIR": str(tmp_path / "a-file" / "cache")})  # cannot be created
    assert r.returncode == 0, r.stderr
    assert "STATUS not built False False" in r.stdout


_FAKE_GPU = """
import torch
torch.version.cuda = torch.version.cuda or "12.8"
torch.cuda.device_count = lambda: 1  # what an import sees on a machine with a GPU
from tileops.runtime import native
print("STATUS", native.status())
"""


@pytest.mark.slow  # measured 5-38 s on 2 cores (pytest --durations); CI runs -m slow
def test_an_import_on_a_gpu_machine_builds_says_so_and_after_a_failure_does_not_retry(tmp_path):
    """The first import on a machine with a GPU (faked here) builds the extension, with a line on
    stderr before and after; with a compiler that fails, it says so, runs without the extension,
    and the next import does not try again (``python -m tileops.runtime.native`` does)."""
    env = {"TILEOPS_CACHE_DIR": str(tmp_path / "cache"), "CXX": "false"}
    first = subprocess.run([sys.executable, "-c", _FAKE_GPU], capture_output=True, text=True, cwd=ROOT,
                           env=_env(env), timeout=900)
    assert first.returncode == 0, first.stderr
    lines = [ln for ln in first.stderr.splitlines() if "compiling the native runtime" in ln]
    assert len(lines) == 2 and lines[0].endswith("...") and ": failed in " in lines[1], first.stderr
    assert "STATUS failed: building the native runtime failed" in first.stdout, first.stdout
    assert list((tmp_path / "cache" / "native").glob("*/build.failed"))
    again = subprocess.run([sys.executable, "-c", _FAKE_GPU], capture_output=True, text=True, cwd=ROOT,
                           env=_env(env), timeout=900)
    assert "compiling" not in again.stderr and "STATUS failed: an earlier build did" in again.stdout, \
        again.stdout + again.stderr


@pytest.mark.slow  # measured 5-38 s on 2 cores (pytest --durations); CI runs -m slow
def test_a_cached_build_loads_at_import_and_a_damaged_one_is_rebuilt_once(tmp_path):
    """A new process loads the cached build when it imports tileops, before any op exists (with no
    compiler at all); a library overwritten with garbage is not loaded, and two builders starting
    at once rebuild it once (a lock file), after which an import loads it."""
    native_module()
    built = Path(native.library_path())
    cache = tmp_path / "cache"
    env = {"TILEOPS_CACHE_DIR": str(cache)}
    target = Path(_run(["-c", "from tileops.runtime import native; print(native.library_path())"], env).stdout.strip())
    assert target.name == built.name and target.parent.name == built.parent.name  # the key ignores the cache's place
    shutil.copytree(built.parent, target.parent)
    r = _run(["-c", _PROBE], {**env, "CXX": "false"})
    assert r.returncode == 0 and "AT IMPORT loaded" in r.stdout and "STATUS loaded True True" in r.stdout, \
        r.stdout + r.stderr
    target.write_bytes(b"\x7fELF garbage" * 100)
    r = _run(["-c", _PROBE], env)
    assert r.returncode == 0 and ("STATUS not built False False" in r.stdout or torch.cuda.is_available()), r.stdout
    procs = [subprocess.Popen([sys.executable, *_BUILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=ROOT, env=_env(env)) for _ in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert sum(err.count(": done in") for _, err in outs) == 1, "both processes compiled"
    assert native._intact(str(target)) and target.read_bytes() != b"\x7fELF garbage" * 100
    r = _run(["-c", _PROBE], env)
    assert "STATUS loaded True True" in r.stdout, r.stdout + r.stderr


def test_an_op_is_garbage_collected_with_its_runtime(gen):
    import gc
    import weakref

    native_module()
    op = Phi3LongRoPEFwdOp(input_layout="1d", original_max_position_embeddings=64, max_position_embeddings=256)
    x = torch.randn(4, 16, generator=gen)
    for _ in range(3):
        op(x, position_ids=torch.arange(4), key=x.clone())  # a binding whose late slot holds op's tables
    assert op._runtime.stats()["hits"] >= 1 and any(
        isinstance(e, tuple) and e[1] is not None and e[1].late for e in op._bindings.values())
    handle, ref = op._handle, weakref.ref(op)
    del op
    gc.collect()
    assert ref() is None, "the op (or a cycle through its runtime) was kept alive"
    with pytest.raises(RuntimeError, match="names no live op"):
        library.lookup(handle)


# ---------------------------------------------------------------------------------- the tracker
class _FakeDriver:
    """The five driver calls the tracker makes on a GPU, as C function pointers, over events that
    finish when the test says so (``finished``): the deferred tracker runs on the CPU."""

    def __init__(self) -> None:
        self.finished: set[int] = set()
        self.capturing = False
        self.next_event = 100
        vp, ip = ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)

        def capture(stream: int, status: Any) -> int:
            status[0] = int(self.capturing)
            return 0

        self.recorded: list[tuple[int, int]] = []  # (event, stream) of each cuEventRecord the tracker made itself
        self._fns = [ctypes.CFUNCTYPE(ctypes.c_int, vp, vp)(lambda ev, st: self.recorded.append((ev, st)) or 0),
                     ctypes.CFUNCTYPE(ctypes.c_int, vp, ip)(capture),
                     ctypes.CFUNCTYPE(ctypes.c_int, vp)(lambda ev: 0 if ev in self.finished else 600),
                     ctypes.CFUNCTYPE(ctypes.c_int, vp)(lambda ev: self.finished.add(ev) or 0),
                     ctypes.CFUNCTYPE(ctypes.c_int, ip)(lambda mode: 0)]
        self.addresses = tuple(ctypes.cast(f, ctypes.c_void_p).value for f in self._fns)

    def make_event(self, index: int) -> int:
        self.next_event += 1
        return self.next_event


class _Judged:
    """Stands in for an op: the tracker's errors name the call (its positions' first value), and
    for a freed tensor the kernel's record of its bad element."""

    def raise_bad_value(self, name: str, values: "torch.Tensor | None", when: str, found: Any) -> None:
        raise ValueError(f"{f'freed{found}' if values is None else int(values[0])}: {when}")

    def unused(self, *args: Any) -> None:
        raise AssertionError("the tracker calls only raise_bad_value")

    def register(self) -> int:
        return library.register(Served(self.unused, self.unused, self.raise_bad_value),
                                Layout("Judged", ("x", "position_ids"), (Output("out", "x"),)))


def _write_record(entry: int, k: int, offset: int, value: int) -> None:
    """What kernels/report.py's ``tileops_report`` stores for a bad element, written from Python:
    the record of checked input ``k`` at the entry whose address is ``entry`` (kept if a smaller
    offset is there already, as the kernel's atomicMax keeps it)."""
    record = report.RECORD_MAX - ((offset << 32) | (value & 0xFFFFFFFF))
    lo = ctypes.c_int32.from_address(entry + 4 * (report.CHECKS + 2 * k))
    hi = ctypes.c_int32.from_address(entry + 4 * (report.CHECKS + 2 * k + 1))
    if record > ((hi.value & 0xFFFFFFFF) << 32 | (lo.value & 0xFFFFFFFF)):
        lo.value, hi.value = ctypes.c_int32(record & 0xFFFFFFFF).value, ctypes.c_int32(record >> 32).value


def _fake_cuda(mod: Any, drv: Any, make_event: Callable[[int], int]) -> tuple:
    """The driver faked (words in ordinary memory); returns what to restore."""
    return mod.set_driver(*drv.addresses, make_event, False)


#: device indices no GPU has: each test's fake calls get a pool of words (and events) of their own
FAKE_DEVICE, SPIN_DEVICE = 97, 98


def test_pending_calls_are_judged_in_order_once_each_on_a_fake_driver():
    """The deferred tracker's GPU logic on a fake driver: calls pending per stream, judged in order
    without waiting at the next call (but for a stream where a word holds its call's tag: that call
    ran and found a bad value), each bad call raising once (up to the first bad one per judgement),
    check() waiting for the rest, strict mode, a graph-captured call judged (and
    cleared) by check(); the checked tensors held weakly: a pending or captured call's tensor the
    caller let go is freed at once (torch's CUDA-graph trees require it) and its report names the
    element the kernel recorded, placed by the strides it was launched with; an entry's record is
    cleared with it, so the next call given that entry names its own."""
    mod = native_module()
    drv = _FakeDriver()
    old = _fake_cuda(mod, drv, drv.make_event)
    try:
        owner = _Judged()
        d = mod.Dispatch(owner.register(), ("x", "position_ids"), ("out",), (0,))
        log: list = []
        event_of: dict[int, int] = {}
        kept: list = []  # the callers' tensors, alive until the test ends (but those let go)

        def launch(n: int, bad: bool, stream: int, keep: bool = True, at: int = 0) -> None:
            def kernel(args: list, st: int, record: int, event: int, capturing: int) -> bool:
                event_of[n] = event
                if bad:
                    ctypes.c_int32.from_address(args[0]).value = args[1]
                    _write_record(args[0], 0, 2 * at, n)  # the values below lie at stride 2
                return drv.capturing

            values = torch.full((6, 2), n)[:, 0]
            gone = weakref.ref(values)
            if keep:
                kept.append(values)
            try:
                d._track(kernel, values, stream, FAKE_DEVICE)
                log.append((n, "queued"))
            except ValueError as e:
                log.append((n, str(e)))
            del values
            if not keep:
                log.append((n, "freed" if gone() is None else "kept alive"))

        def judge(what: str, fn: Callable[[], None]) -> None:
            try:
                fn()
                log.append((what, "nothing"))
            except ValueError as e:
                log.append((what, str(e)))

        launch(1, False, 7)
        launch(2, True, 7)
        launch(3, True, 7)
        launch(4, True, 8)
        drv.finished.update((event_of[1], event_of[2]))
        judge("reap a", d.reap)
        judge("reap b", d.reap)  # call 3's event has not completed, but its word holds its tag: waited for
        log.append(("pending", d.has_pending()))
        judge("check a", d.check)  # waits: 4 (stream 8)
        judge("check b", d.check)
        judge("check c", d.check)
        log.append(("pending", d.has_pending()))
        with tileops.strict():
            launch(5, True, 7)
            launch(6, False, 7)
        drv.capturing = True
        launch(7, True, 9)
        drv.capturing = False
        log.append(("pending", d.has_pending(), d.stats()["graph_words"]))
        judge("graph a", d.check)
        judge("graph b", d.check)  # cleared by the first
        launch(8, True, 7, keep=False)
        drv.finished.add(event_of[8])
        judge("reap freed", d.reap)
        drv.capturing = True
        launch(9, True, 9, keep=False, at=4)
        drv.capturing = False
        judge("graph freed", d.check)
        launch(10, True, 7, keep=False, at=5)  # the entry call 8 used: its record was cleared
        drv.finished.add(event_of[10])
        judge("reap freed again", d.reap)
    finally:
        mod.set_driver(*old)
    assert log == [(1, "queued"), (2, "queued"), (3, "queued"), (4, "queued"),
                   ("reap a", f"2: {errors.WHEN_EARLIER}"), ("reap b", f"3: {errors.WHEN_EARLIER}"),
                   ("pending", True), ("check a", f"4: {errors.WHEN_EARLIER}"), ("check b", "nothing"),
                   ("check c", "nothing"), ("pending", False), (5, "5: "), (6, "queued"), (7, "queued"),
                   ("pending", False, 1), ("graph a", f"7: {errors.WHEN_GRAPH}"), ("graph b", "nothing"),
                   (8, "queued"), (8, "freed"), ("reap freed", f"freed[0] = 8: {errors.WHEN_EARLIER}"),
                   (9, "queued"), (9, "freed"), ("graph freed", f"freed[4] = 9: {errors.WHEN_GRAPH}"),
                   (10, "queued"), (10, "freed"), ("reap freed again", f"freed[5] = 10: {errors.WHEN_EARLIER}")], log


def test_a_stream_records_an_event_every_few_calls_and_judges_the_calls_between_by_it():
    """Most tracked calls record no CUDA event (an event is a record after the kernel and a query at a
    later call: 2.35 us of a 9 us call on an H100): every kEventEvery-th call of a stream's queue does,
    the call after it queries it, and the calls it covers are judged once it has completed; check()
    records one after the last call. A word holding its call's tag is judged at the next
    call, its stream waited for; a stream being captured takes no event from a judgement, so its
    calls wait for the capture's end."""
    mod = native_module()
    src = Path(native.__file__).with_name("_native.cpp").read_text(encoding="utf-8")
    every = int(re.search(r"constexpr int kEventEvery = (\d+);", src)[1])
    assert every > 2
    drv = _FakeDriver()
    old = _fake_cuda(mod, drv, drv.make_event)
    try:
        owner = _Judged()  # (the op: its handle names it while it lives)
        d = mod.Dispatch(owner.register(), ("x", "position_ids"), ("out",), (0,))
        event_of: dict[int, int] = {}
        kept: list = []

        def launch(n: int, bad: bool = False, stream: int = 7) -> None:
            def kernel(args: list, st: int, record: int, event: int, capturing: int) -> bool:
                assert capturing, "every tracked call asks whether its stream is being captured"
                event_of[n] = event
                if bad:
                    ctypes.c_int32.from_address(args[0]).value = args[1]
                    _write_record(args[0], 0, 0, n)
                return drv.capturing

            kept.append(torch.full((3,), n))
            d._track(kernel, kept[-1], stream, FAKE_DEVICE)

        def pending() -> int:
            return d.stats()["pending"]

        for n in range(1, 2 * every + 1):
            launch(n)
        assert [n for n in sorted(event_of) if event_of[n]] == [every, 2 * every]
        d.reap()  # the call after an event queries it: not completed, no word holds a tag
        assert pending() == 2 * every and drv.recorded == []
        drv.finished.add(event_of[every])
        d.reap()  # calls 1 .. every
        assert pending() == every
        launch(2 * every + 1)  # no event
        assert not event_of[2 * every + 1]
        drv.finished.add(event_of[2 * every])
        d.reap()  # not the call after an event: no query (once every `every` calls), nothing judged
        assert pending() == every + 1
        d.check()  # judges through call 2 * every, then records an event after the last and waits for it
        assert pending() == 0 and [st for _, st in drv.recorded] == [7]

        launch(100)
        launch(101, bad=True)  # its word holds its tag
        launch(102)
        with pytest.raises(ValueError, match=f"101: {errors.WHEN_EARLIER}"):
            d.reap()  # (the next call's judgement) records an event after 102 and waits for it
        assert pending() == 1
        d.reap()  # 102, covered by that event
        assert pending() == 0 and [st for _, st in drv.recorded] == [7, 7]

        launch(200, stream=9)
        launch(201, bad=True, stream=9)
        drv.capturing = True  # stream 9 is being captured now: no event may be recorded on it
        d.reap()
        assert pending() == 2 and len(drv.recorded) == 2
        drv.capturing = False
        with pytest.raises(ValueError, match=f"201: {errors.WHEN_EARLIER}"):
            d.reap()
        assert pending() == 0 and [st for _, st in drv.recorded] == [7, 7, 9]
    finally:
        mod.set_driver(*old)


_SPIN = """
#include <time.h>
/* a fake cuEventSynchronize that returns once another thread has set the event's flag, or 999
   after 5 s: that thread is a Python thread, which runs only if the caller released the GIL */
int spin_sync(void* ev) {
  volatile int* flag = (volatile int*)ev;
  struct timespec t0, t;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  while (!*flag) {
    clock_gettime(CLOCK_MONOTONIC, &t);
    if (t.tv_sec - t0.tv_sec > 5) return 999;
  }
  return 0;
}
int flag_query(void* ev) { return *(volatile int*)ev ? 0 : 600; }
"""


def test_every_wait_on_the_gpu_releases_the_gil():
    """Strict mode's wait and op.check()'s, on a fake driver whose synchronize spins until a Python
    thread sets the event's flag: that thread runs only while the waiting call has released the GIL
    (a wait that kept it would time out with CUDA error 999)."""
    mod = native_module()
    lib = build_c_library(_SPIN)
    drv = _FakeDriver()
    flags: list = []

    def make_event(index: int) -> int:
        flags.append(ctypes.c_int(0))
        return ctypes.addressof(flags[-1])

    addresses = list(drv.addresses)
    addresses[2] = ctypes.cast(lib.flag_query, ctypes.c_void_p).value
    addresses[3] = ctypes.cast(lib.spin_sync, ctypes.c_void_p).value
    old = mod.set_driver(*addresses, make_event, False)
    try:
        d = mod.Dispatch(_Judged().register(), ("x", "position_ids"), ("out",), (0,))

        def release_later() -> threading.Thread:
            def set_flags() -> None:
                threading.Event().wait(0.2)
                for f in flags:
                    f.value = 1

            t = threading.Thread(target=set_flags)
            t.start()
            return t

        for f in flags:
            f.value = 0
        t = release_later()
        with tileops.strict():
            d._track(lambda *a: False, torch.tensor([0]), 7, SPIN_DEVICE)  # waits in the call
        t.join()
        for f in flags:
            f.value = 0
        d._track(lambda *a: False, torch.tensor([0]), 7, SPIN_DEVICE)
        assert d.has_pending()
        t = release_later()
        d.check()  # waits for the pending call
        t.join()
        assert not d.has_pending()
    finally:
        mod.set_driver(*old)


def test_the_error_entry_layout_is_one_in_the_kernels_and_both_trackers():
    """kernels/report.py lays out a call's error entry; the Python tracker reads it with the same
    constants and the extension's source declares the same sizes (a mismatch would read a record
    from the next call's tag words)."""
    src = Path(native.__file__).with_name("_native.cpp").read_text(encoding="utf-8")
    assert f"constexpr int kWords = {report.CHECKS};" in src
    assert "constexpr int kEntry = kWords + 2 * kWords;" in src and report.ENTRY == 3 * report.CHECKS
    assert (errors.WORDS, errors.ENTRY) == (report.CHECKS, report.ENTRY)
    assert 4 * report.ENTRY % 16 == 0, "tileops_report's 64-bit atomic needs every entry 16-byte aligned"
