"""The native fast path (tileops/native.py, tileops/_native.cpp) against the Python path it
replaces, on the CPU's BUILTIN kernels: the same results bit for bit, the same errors at the same
calls, the same refusals; what it hands back to the Python path; and how it is built, cached,
rebuilt and switched off. Every scenario runs both ways and checks that the native run was in
fact served natively (the dispatch counts its calls)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import tileops
from tests.paths import both, can_build, native_module, python_path
from tests.references import reference
from tileops.runtime import errors, native
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


def test_the_extension_builds_where_a_compiler_and_headers_are():
    if not can_build():
        pytest.skip("no C++ compiler or no torch C++ headers here (or TILEOPS_NATIVE=0)")
    assert native.build() is not None, native.status()
    assert native.status() == "loaded"


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

    def scenario(path: str) -> tuple[list, list]:
        ids = RoPENeoxPositionIdsFwdOp(1 << 20)
        hf = RoPEFwdOp(input_layout="2d")
        yarn = YaRNFwdOp(input_layout="1d", scale=4.0, rope_layout="interleaved")
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

    def scenario(path: str) -> tuple[list, list]:
        op = RoPENeoxPositionIdsFwdOp(100)
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

    def scenario(path: str) -> tuple[list, list]:
        op = RoPEFwdOp(input_layout="1d")
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
        ids = RoPENeoxPositionIdsFwdOp(4096)  # interleaved: the exact test, by offset
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

    def scenario(path: str) -> tuple[list, list]:
        op = RoPENeoxPositionIdsFwdOp(4096)
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

    def scenario(path: str) -> tuple[list, list]:
        op = RoPENeoxPositionIdsFwdOp(10)
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


def test_what_the_native_path_leaves_to_the_python_path(gen):
    """Inputs that require grad (the output gets a grad_fn), a tensor subclass, a dtype the
    manifest refuses: each served (or refused) by the Python path as before."""
    mod = native_module()
    op = RoPEFwdOp(input_layout="2d")
    x = torch.randn(2, 5, 3, 32, generator=gen)
    want = reference("RoPEFwdOp", {"input_layout": "2d"}, {"x": x})
    op(x)
    op(x)
    hits = op._dispatch.stats()["hits"]
    xg = x.clone().requires_grad_(True)
    y = op(xg)
    assert y.grad_fn is not None
    y.sum().backward()
    assert xg.grad is not None
    with torch.no_grad():
        assert op(xg).grad_fn is None
    assert op._dispatch.stats()["hits"] == hits + 1, "a no_grad call of the same signature is served natively"

    class Sub(torch.Tensor):
        pass

    s = x.clone().as_subclass(Sub)
    assert not mod.is_plain(s)
    assert_close(op(s), want)
    assert_close(op(s), want)
    with pytest.raises(TypeError, match="x: expected dtype"):
        op(x.double())
    assert op._dispatch.stats()["hits"] == hits + 1


def test_an_op_made_before_the_extension_was_loaded_switches_to_it(gen):
    """Calls of an op made while the Python path served (its Python tracker, Python plans), then
    the extension arrives (as a background build finishes): the next calls are native, the Python
    tracker is judged first, errors and results stay right."""
    native_module()
    x = torch.randn(6, 2, 32, generator=gen)
    pos = torch.randint(0, 500, (6,), generator=gen)
    want = reference("RoPENeoxPositionIdsFwdOp", {"max_position": 500}, {"x": x, "position_ids": pos})
    with python_path():
        op = RoPENeoxPositionIdsFwdOp(500)
        assert_close(op(x, pos), want)
        assert_close(op(x, pos), want)
        assert isinstance(op._calls(), errors.Tracker) and op._dispatch is None
    assert_close(op(x, pos), want)  # the switch: through the Python path once more
    tracker = op._calls()
    assert not isinstance(tracker, errors.Tracker) and isinstance(tracker.legacy, errors.Tracker)
    assert_close(op(x, pos), want)
    assert op._dispatch.stats()["hits"] >= 1
    bad = pos.clone()
    bad[4] = 500
    with pytest.raises(ValueError, match=r"position_ids\[4\] = 500$"):
        op(x, bad)
    op.check()


def test_a_phi3_op_picks_its_table_per_call_both_ways(gen):
    """Phi3's short/long table is chosen per call on the device: the native plan calls back for it."""
    x = torch.randn(1, 9, 2, 32, generator=gen)
    pos_short = torch.randint(0, 60, (9,), generator=gen)
    pos_long = pos_short + 100

    def scenario(path: str) -> tuple[list, list]:
        op = Phi3LongRoPEFwdOp(input_layout="2d", short_factor=torch.linspace(1, 2, 16),
                               long_factor=torch.linspace(2, 8, 16), original_max_position_embeddings=64,
                               max_position_embeddings=256)
        return [op(x, position_ids=p) for p in (pos_short, pos_long, pos_short, pos_long)], [op]

    py, nat = both(scenario)
    assert same(py, nat)
    assert not torch.equal(nat[0], nat[1])


# ---------------------------------------------------------------------------------- the build
def _env(env: dict[str, str]) -> dict[str, str]:
    return {**os.environ, "TILEOPS_NATIVE": "1", **env}  # on unless a test turns it off


def _run(code: str, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env=_env(env), timeout=timeout)


_PROBE = """
import logging, sys, torch
logging.basicConfig(level=logging.DEBUG, stream=sys.stdout, format="%(name)s %(message)s")
logging.getLogger("tilelang").setLevel(logging.ERROR)
from tileops.runtime import native
from tileops.rope import RoPEFwdOp
op = RoPEFwdOp(input_layout="2d")
native.wait()
x = torch.randn(1, 3, 2, 16)
y = op(x); y = op(x)
print("STATUS", native.status(), native.module is not None, op._native_run is not None, native.library_path())
"""


@pytest.mark.slow  # measured 5-38 s on 2 cores (pytest --durations); CI runs -m slow
def test_off_switch_and_no_compiler_mean_the_python_path_silently(tmp_path):
    """TILEOPS_NATIVE=0, a compiler that fails, a cache that cannot be created: the Python path, no warning."""
    r = _run(_PROBE, {"TILEOPS_NATIVE": "0", "TILEOPS_CACHE_DIR": str(tmp_path / "a")})
    assert r.returncode == 0, r.stderr
    assert "STATUS off False False" in r.stdout
    r = _run(_PROBE, {"CXX": "false", "TILEOPS_CACHE_DIR": str(tmp_path / "b")})
    assert r.returncode == 0, r.stderr  # -W error: no warning either
    assert "STATUS failed:" in r.stdout and "False False" in r.stdout
    assert "native fast path unavailable" in r.stdout  # a debug line says why
    assert r.stderr.strip() == "", r.stderr
    (tmp_path / "a-file").write_text("")
    r = _run(_PROBE, {"TILEOPS_CACHE_DIR": str(tmp_path / "a-file" / "cache")})  # cannot be created
    assert r.returncode == 0, r.stderr
    assert "STATUS failed:" in r.stdout and "False False" in r.stdout


@pytest.mark.slow  # measured 5-38 s on 2 cores (pytest --durations); CI runs -m slow
def test_a_cached_build_loads_without_building_and_a_damaged_one_is_rebuilt(tmp_path):
    """A second process finds the build in the cache (it loads with no compiler at all); a cached
    library overwritten with garbage is rebuilt, once, by two processes starting at once, and both
    load it."""
    if not can_build():
        pytest.skip("no C++ compiler or no torch C++ headers here (or TILEOPS_NATIVE=0)")
    native_module()
    built = native.library_path()
    cache = tmp_path / "cache"
    env = {"TILEOPS_CACHE_DIR": str(cache)}
    target = Path(_run("from tileops.runtime import native; print(native.library_path())", env).stdout.strip())
    assert target.name == Path(built).name  # the key does not depend on the cache's place
    target.parent.mkdir(parents=True)
    shutil.copy(built, target)
    shutil.copy(built + ".sha256", str(target) + ".sha256")
    r = _run(_PROBE, {**env, "CXX": "false"})
    assert r.returncode == 0 and "STATUS loaded True True" in r.stdout, r.stdout + r.stderr
    target.write_bytes(b"\x7fELF garbage" * 100)
    procs = [subprocess.Popen([sys.executable, "-W", "error", "-c", _PROBE], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT, env=_env(env))
             for _ in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    for (out, err), p in zip(outs, procs):
        assert p.returncode == 0 and "STATUS loaded True True" in out, out + err
    assert sum(o.count("tileops: built ") for o, _ in outs) == 1, "both processes compiled"
    assert native._intact(str(target)) and target.read_bytes() != b"\x7fELF garbage" * 100
    assert not list(cache.glob("native/*.tmp")), "a temporary file was left"


class _FakeKernel:
    """Stands in for a RawKernel: its launch writes the tag into the error word when told to."""

    def __init__(self, bad: bool):
        self.bad = bad
        self.launches = 0

    def launch(self, args: list, stream: int, *event: int) -> bool:
        import ctypes

        self.launches += 1
        if self.bad:
            ctypes.c_int32.from_address(args[0]).value = args[1]
        return False


def test_both_trackers_work_with_both_pools():
    """A backward (or any launch outside Op._eager_call) may meet an op whose tracker is of one
    implementation and a pool of the other while the extension is being loaded: each tracker
    works with each pool (a native tracker hands a Python pool's calls to a Python tracker)."""
    mod = native_module()
    device = torch.device("cpu")
    pools = {"python": errors.ErrorWords(device), "native": errors._native_pool(mod, device)}
    for tname in ("python", "native"):
        for pname, pool in pools.items():
            raised = []
            tracker = (errors.Tracker if tname == "python" else
                       lambda rb: mod.Tracker(rb, errors._TrackerLocal()))(lambda pos, when: raised.append((pos, when)))
            free = len(pool._free) if pname == "python" else pool.free
            pos = torch.arange(3)
            for bad in (False, True, False, True):
                tracker.launch(_FakeKernel(bad), [0, 0], 0, 1, pos, pool, 0)
            assert [w for _, w in raised] == [errors.WHEN_NOW] * 2, (tname, pname)
            assert all(p is pos for p, _ in raised)
            assert (len(pool._free) if pname == "python" else pool.free) == free, "a word was not given back"
            assert not tracker.has_pending()
            tracker.check()


def test_an_op_is_garbage_collected_with_its_native_plans_and_tracker(gen):
    import gc
    import weakref

    native_module()
    op = RoPENeoxPositionIdsFwdOp(100)
    x = torch.randn(4, 2, 16, generator=gen)
    for _ in range(3):
        op(x, torch.arange(4), key=x.clone())
    assert op._dispatch.stats()["hits"] >= 1 and op._dispatch.tracker is op._calls()
    handle, ref = op._handle, weakref.ref(op)
    del op
    gc.collect()
    assert ref() is None, "the op (or a cycle through its native objects) was kept alive"
    with pytest.raises(RuntimeError, match="names no live op"):
        tileops.runtime.library.lookup(handle)


class _FakeDriver:
    """The five driver calls the trackers make on a GPU, in Python (for errors.Tracker) and as C
    function pointers (for the native one), over events that finish when the test says so: the
    pending-call logic of both trackers runs on the CPU."""

    def __init__(self) -> None:
        import ctypes

        self.finished: set[int] = set()
        self.capturing = False
        self.next_event = 100
        vp, ip = ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)

        def capture(stream: int, status: Any) -> int:
            status[0] = int(self.capturing)
            return 0

        self._fns = [ctypes.CFUNCTYPE(ctypes.c_int, vp, vp)(lambda ev, st: 0),
                     ctypes.CFUNCTYPE(ctypes.c_int, vp, ip)(capture),
                     ctypes.CFUNCTYPE(ctypes.c_int, vp)(lambda ev: 0 if ev in self.finished else 600),
                     ctypes.CFUNCTYPE(ctypes.c_int, vp)(lambda ev: self.finished.add(ev) or 0),
                     ctypes.CFUNCTYPE(ctypes.c_int, ip)(lambda mode: 0)]
        self.addresses = tuple(ctypes.cast(f, ctypes.c_void_p).value for f in self._fns)
        self.record_address, self.capturing_address = self.addresses[0], self.addresses[1]

    def create_event(self, index: int) -> tuple[Any, int]:
        self.next_event += 1
        return None, self.next_event

    def done(self, event: int) -> bool:
        return event in self.finished

    def wait(self, event: int) -> None:
        self.finished.add(event)


class _QueuedKernel:
    """A kernel that 'runs' on a stream: it writes the tag into the word when its call is bad, and
    reports capture when the fake driver is capturing."""

    def __init__(self, drv: _FakeDriver):
        self.drv = drv
        self.bad = False

    def launch(self, args: list, stream: int, record: int = 0, event: int = 0, capturing: int = 0) -> bool:
        import ctypes

        if self.bad:
            ctypes.c_int32.from_address(args[0]).value = args[1]
        return self.drv.capturing


def test_pending_calls_are_judged_alike_by_both_trackers(monkeypatch):
    """The GPU logic of errors.Tracker and of the native tracker, side by side on a fake driver:
    calls pending per stream, judged in order without waiting, each bad call raising once (up to
    the first bad one per judgement), check() waiting for the rest, strict mode, a graph-captured
    call judged (and cleared) by check(), every word given back once judged."""
    mod = native_module()
    drv = _FakeDriver()
    monkeypatch.setattr(errors, "_driver", drv)
    old = mod.set_driver(*drv.addresses)
    try:
        logs = {}
        for kind in ("python", "native"):
            pool = mod.Pool(torch.device("cuda", 0), True, 0, 64, lambda: (lambda b: (b, b.data_ptr()))(
                torch.zeros(64, dtype=torch.int32)), lambda: drv.create_event(0))
            log: list = []
            rb = lambda pos, when: (_ for _ in ()).throw(ValueError(f"{int(pos[0])}: {when}"))  # noqa: E731
            tracker = errors.Tracker(rb) if kind == "python" else mod.Tracker(rb, errors._TrackerLocal())
            kernel = _QueuedKernel(drv)
            events: list = []

            def launch(n: int, bad: bool, stream: int) -> None:
                kernel.bad = bad
                before = drv.next_event
                try:
                    tracker.launch(kernel, [0, 0], 0, 1, torch.tensor([n]), pool, stream)
                    log.append((n, "queued"))
                except ValueError as e:
                    log.append((n, str(e)))
                events.extend(range(before + 1, drv.next_event + 1))

            def judge(what: str, fn: Callable[[], None]) -> None:
                try:
                    fn()
                    log.append((what, "nothing"))
                except ValueError as e:
                    log.append((what, str(e)))

            free = pool.free
            launch(1, False, 7)
            launch(2, True, 7)
            launch(3, True, 7)
            launch(4, True, 8)
            drv.finished.update(pool.event(i) for i in range(2))  # the first two words' calls
            judge("reap a", tracker.reap)
            judge("reap b", tracker.reap)  # call 3 has not finished: nothing more
            log.append(("pending", tracker.has_pending()))
            judge("check a", tracker.check)  # waits: 3 (stream 7), then 4 (stream 8) next time
            judge("check b", tracker.check)
            judge("check c", tracker.check)
            log.append(("pending", tracker.has_pending(), pool.free == free))
            with tileops.strict():
                launch(5, True, 7)
                launch(6, False, 7)
            drv.capturing = True
            launch(7, True, 9)
            drv.capturing = False
            log.append(("pending", tracker.has_pending()))
            judge("graph a", tracker.check)
            judge("graph b", tracker.check)  # cleared by the first
            logs[kind] = log
        assert logs["python"] == logs["native"], logs
        log = logs["native"]
        assert ("reap a", f"2: {errors.WHEN_EARLIER}") in log and ("reap b", "nothing") in log
        assert ("check a", f"3: {errors.WHEN_EARLIER}") in log and ("check b", f"4: {errors.WHEN_EARLIER}") in log
        assert ("check c", "nothing") in log and ("pending", False, True) in log
        assert (5, "5: ") in log and (6, "queued") in log
        assert ("graph a", f"7: {errors.WHEN_GRAPH}") in log and ("graph b", "nothing") in log
    finally:
        mod.set_driver(*old)


@pytest.mark.slow  # measured 5-38 s on 2 cores (pytest --durations); CI runs -m slow
def test_a_short_lived_process_never_starts_the_compiler(tmp_path):
    """Without a cached build, the build starts only at the process's BUILD_AFTER-th eager call: a
    script of a few calls neither waits for nor leaves behind a compiler run."""
    code = ("import torch\n"
            "from tileops.runtime import native\n"
            "from tileops.rope import RoPEFwdOp\n"
            "op = RoPEFwdOp()\n"
            "x = torch.randn(3, 16)\n"
            "for _ in range(native.BUILD_AFTER - 1):\n"
            "    op(x)\n"
            "print('STATUS', native.status())\n"
            "op(x)\n"
            "print('STATUS', native.status())\n")
    r = _run(code, {"TILEOPS_CACHE_DIR": str(tmp_path / "cache"), "CXX": "false"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[-3:-1] == ["STATUS not built", "STATUS building"] or \
        r.stdout.split("\n")[-3:-1][1].startswith("STATUS failed"), r.stdout
