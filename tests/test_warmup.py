"""Ahead-of-time compilation: ``op.compile(...)`` fills the disk caches without data, in parallel
processes, so that a new process's first call loads its kernel without compiling or importing
TileLang (issue 13, start-up)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.test_generator import cache_env
from tileops.rope import RoPENeoxPositionIdsFwdOp


def python_in(tmp_path, code: str, timeout: int = 600) -> str:
    """``code`` run by a new Python process with both disk caches in ``tmp_path``; its stdout (its
    stderr's tail in the failure when it exits non-zero)."""
    done = subprocess.run([sys.executable, "-c", code], env=cache_env(tmp_path), capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.slow  # measured 5-38 s on 2 cores (pytest --durations); CI runs -m slow
def test_compile_ahead_then_a_new_process_loads_without_tilelang(tmp_path):
    aot = ("from tileops.rope import RoPENeoxPositionIdsFwdOp\n"
           "op = RoPENeoxPositionIdsFwdOp(4096, rotary_dim=32)\n"
           "print(op.compile(head_dim=48, dtypes=['float32'], with_inputs=[], device='cpu', jobs=2))\n")
    assert python_in(tmp_path, aot).split()[-1] == "4"  # forward and backward, positions int32 and int64
    first = ("import sys, torch\n"
             "from tileops.compile import build\n"
             "from tileops.rope import RoPENeoxPositionIdsFwdOp\n"
             "op = RoPENeoxPositionIdsFwdOp(4096, rotary_dim=32)\n"
             "x = torch.randn(5, 3, 48)\n"
             "out = op(x, torch.tensor([0, 1, 7, 4095, 2], dtype=torch.int32))\n"
             "print(bool(torch.isfinite(out).all()), build.stats.compiles, build.stats.loads, 'tilelang' in sys.modules)\n")
    warm = python_in(tmp_path, first, timeout=300)
    assert warm.split() == ["True", "0", "1", "False"], warm


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
    and bhsd ops only (a packed or 1d op never takes it), and never for the CPU."""
    from tileops.compile.warmup import op_kernel_jobs

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
    bhsd = op_kernel_jobs("RoPEFwdOp", {"input_layout": "bhsd"}, {"head_dim": 128}, ["bfloat16"], "sm_90",
                          with_inputs=[])  # HF's own layout: the same kernels, through strides
    assert [j[1] for j in bhsd] == specs
    assert {s.transposed for _, s, _, _ in op_kernel_jobs("RoPENeoxPositionIdsFwdOp", {"max_position": 64},
                                                          {"head_dim": 128}, ["float16"], "sm_90")} == {False}
    assert {s.transposed for _, s, _, _ in op_kernel_jobs("RoPEFwdOp", {"input_layout": "2d"}, {"head_dim": 128},
                                                          ["float16"], "c")} == {False}


def test_warmup_learns_the_kernels_without_constructing_an_op(monkeypatch):
    """``tileops warmup``'s list comes from each family's ``kernel_specs`` (manifest, params, call):
    no op is made, and the kernels a constructed op loads for a call are among those listed for it."""
    import torch

    from tileops.compile.warmup import kernel_jobs
    from tileops.manifest import call_specs, case_dims, case_params, registry
    from tileops.op import Op
    from tileops.rope import builtin
    from tileops.workloads import op_class

    with monkeypatch.context() as m:
        m.setattr(Op, "_setup", lambda *a, **k: (_ for _ in ()).throw(AssertionError("warmup constructed an op")))
        jobs = {arch: set(kernel_jobs(None, arch)) for arch in ("sm_90", "c")}
    assert len(jobs["sm_90"]) > 100 and len(jobs["c"]) > 50
    for name, man in registry().items():
        if man.family != "rope":  # the norm family's: tests/test_norm_ops.py runs calls and compares what they load
            continue
        case = man.cases[-1]
        op = op_class(name)(**case_params(man, case))
        for arch, backend, device in (("sm_90", "cuda", "cuda"), ("c", "c", "cpu")):
            for call in call_specs(man, case_dims(man, case), case.dtypes, torch.device(device), case.with_inputs):
                for inverse in (False, True):  # what RoPEKernels loads for this call, from the op itself
                    spec = builtin._spec_for(op, call, backend, inverse=inverse)
                    assert (man.kernel.builder, spec, backend, arch) in jobs[arch], (name, case.label, spec)


@pytest.mark.slow  # measured 5-38 s on 2 cores (pytest --durations); CI runs -m slow
def test_compile_from_a_script_without_a_main_guard(tmp_path):
    """``op.compile(..., jobs=2)`` pasted into a plain script: the workers are ``python -m
    tileops.compile.warmup``, so they never re-run the script (a spawned pool did, and died with
    BrokenProcessPool). With ``TILEOPS_PROGRESS=1`` and stderr a pipe, one plain line per kernel."""
    script = tmp_path / "no_guard.py"
    script.write_text("from tileops.rope import RoPENeoxPositionIdsFwdOp\n"
                      "print('script ran')\n"
                      "op = RoPENeoxPositionIdsFwdOp(4096, rotary_dim=32)\n"
                      "print(op.compile(head_dim=48, dtypes=['float32'], with_inputs=[], device='cpu', jobs=2,\n"
                      "                 backward=False))\n")
    env = {**os.environ, "TILEOPS_CACHE_DIR": str(tmp_path / "tileops"), "TILEOPS_PROGRESS": "1", "TILEOPS_NATIVE": "0"}
    env.pop("TILELANG_DISABLE_CACHE", None)  # TileLang's own disk cache may serve: the point is the workers
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["script", "ran", "2"], done.stdout  # ran once; two kernels (int32, int64 positions)
    steps = [line.split("] ", 1) for line in done.stderr.splitlines() if line.startswith("[")]
    assert sorted(n for n, _ in steps) == ["[1/2", "[2/2"], done.stderr
    assert sorted(rest.rsplit("  ", 1)[0] for _, rest in steps) == [
        "rope neox float32 head_dim=48 positions int32 fwd c", "rope neox float32 head_dim=48 positions int64 fwd c"]


@pytest.mark.slow  # measured 5-38 s on 2 cores (pytest --durations); CI runs -m slow
def test_map_jobs_runs_a_worker_per_job_and_names_a_failing_one():
    from tileops.compile.warmup import map_jobs

    assert map_jobs(os.path.basename, ["/a/x", "/b/y", "/c/z"], jobs=2, progress=False) == ["x", "y", "z"]
    with pytest.raises(RuntimeError, match=r"TypeError"):
        map_jobs(os.path.basename, ["/a/x", 3], jobs=2, progress=False)


def test_progress_lines_when_not_a_terminal(monkeypatch):
    import io

    from tileops.progress import Progress, task, wanted

    out = io.StringIO()  # not a TTY: plain lines, never a bar
    with Progress(3, "compiling kernels", stream=out) as bar:
        for label in ("a", "b", "c"):
            bar.step(label, 0.25)
    assert out.getvalue().splitlines() == ["[1/3] a  0.2 s", "[2/3] b  0.2 s", "[3/3] c  0.2 s"]
    quiet = io.StringIO()
    with Progress(2, "x", show=False, stream=quiet) as bar:
        bar.step("a")
    assert quiet.getvalue() == ""
    out = io.StringIO()
    with task("building", stream=out):
        pass
    assert out.getvalue().startswith("tileops: building ...\ntileops: building: done in ")
    monkeypatch.delenv("TILEOPS_PROGRESS", raising=False)
    assert wanted(None, io.StringIO()) is False  # not a terminal: a library call stays quiet
    assert wanted(True, io.StringIO()) is True and wanted(False) is False
    monkeypatch.setenv("TILEOPS_PROGRESS", "1")
    assert wanted(None, io.StringIO()) is True
    monkeypatch.setenv("TILEOPS_PROGRESS", "0")
    assert wanted(None) is False
    with pytest.raises(TypeError, match=r"progress: expected True, False or None, got str 'no'"):
        wanted("no")  # a truthy string must not mean "show"


@pytest.mark.slow  # measured 5-38 s on 2 cores (pytest --durations); CI runs -m slow
def test_a_first_call_that_compiles_says_so_once_and_a_load_says_nothing(tmp_path):
    code = ("import torch\n"
            "from tileops.rope import RoPEFwdOp\n"
            "op = RoPEFwdOp(rope_layout='neox', input_layout='2d')\n"
            "op(torch.randn(1, 4, 2, 64))\n"
            "op(torch.randn(1, 9, 2, 64))\n")
    env = {**os.environ, "TILEOPS_CACHE_DIR": str(tmp_path / "tileops"), "TILEOPS_NATIVE": "0"}
    env.pop("TILELANG_DISABLE_CACHE", None)
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    lines = [line for line in first.stderr.splitlines() if "compiled" in line]
    assert len(lines) == 1, first.stderr
    assert lines[0].startswith("tileops: compiled RoPEFwdOp (rope neox float32 head_dim=64 fwd) for c in ")
    assert f"(cached in {tmp_path / 'tileops' / 'kernels'})" in lines[0]
    assert "in memory cache" not in first.stderr  # TileLang's hint about its own API is filtered
    again = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "compiled" not in again.stderr, again.stderr
    quiet = ("import logging\nlogging.getLogger('tileops.compile').setLevel(logging.WARNING)\n"
             + code.replace("64", "32"))
    silenced = subprocess.run([sys.executable, "-c", quiet], env=env, capture_output=True, text=True, timeout=600)
    assert silenced.returncode == 0 and "compiled" not in silenced.stderr, silenced.stderr


def test_tilelang_memory_cache_hint_alone_is_filtered():
    import logging

    import tileops.compile.build  # noqa: F401 - installs the filter

    log = logging.getLogger("tilelang.cache.kernel_cache")
    hint = logging.LogRecord(log.name, logging.WARNING, __file__, 1, "Found kernel '%s' in memory cache. For better "
                             "performance, consider using `@tilelang.jit` instead of direct kernel caching.",
                             ("rope_c",), None)
    other = logging.LogRecord(log.name, logging.WARNING, __file__, 1, "Cache directory %s is not writable",
                              ("/x",), None)
    assert not log.filter(hint) and log.filter(other)


def _rope_job():
    from tileops.compile.warmup import op_kernel_jobs

    jobs = op_kernel_jobs("RoPENeoxPositionIdsFwdOp", {"max_position": 4096, "rotary_dim": 32}, {"head_dim": 48},
                          ["float32"], "c", with_inputs=[], backward=False)
    return jobs[:1]


def test_compile_jobs_skips_indexed_kernels_without_a_process(tmp_path, monkeypatch):
    """A batch whose kernels the index has starts no process and compiles nothing: a test module's
    warm-up run by every pytest-xdist worker costs the first worker only."""
    from tileops.compile import build, warmup

    for k, v in cache_env(tmp_path).items():
        monkeypatch.setenv(k, v)
    job = _rope_job()
    assert not build.indexed(*job[0])
    n, _, failures = warmup.compile_jobs(job, jobs=1, progress=False)
    assert (n, failures) == (1, []) and build.indexed(*job[0])
    monkeypatch.setattr(warmup, "map_jobs", lambda *a, **k: pytest.fail("an indexed kernel was compiled again"))
    assert warmup.compile_jobs(job + job, jobs=4, progress=False)[::2] == (1, [])


def test_compile_jobs_wait_for_another_batch(tmp_path, monkeypatch, capfd):
    """While another process holds the cache's compile lock, a batch waits (saying so) before it
    looks at the index; it goes on when the lock is released."""
    import fcntl
    import threading

    from tileops.compile import warmup

    for k, v in cache_env(tmp_path).items():
        monkeypatch.setenv(k, v)
    looked = threading.Event()

    def indexed(*job):
        looked.set()
        return True

    monkeypatch.setattr("tileops.compile.build.indexed", indexed)
    lock_dir = tmp_path / "tileops" / "kernels"
    lock_dir.mkdir(parents=True)
    with open(lock_dir / "compile.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        done = []
        t = threading.Thread(target=lambda: done.append(warmup.compile_jobs(_rope_job(), progress=True)))
        t.start()
        assert not looked.wait(1.0)  # a lock that did not hold would let it look at once
    t.join(60)
    assert looked.is_set() and done and done[0][0] == 1
    assert "waiting for another process's kernel compiles" in capfd.readouterr().err


def _nvcc_missing() -> str | None:
    from tileops.compile import cuda_build

    try:
        cuda_build.cuda_home()
    except Exception as e:  # noqa: BLE001 - any reason the toolkit is not usable
        return str(e)
    return None


@pytest.mark.slow  # one TileLang CUDA build: ~15 s on 2 cores
@pytest.mark.skipif(_nvcc_missing() is not None, reason="needs the CUDA toolkit (nvcc)")
def test_a_machine_without_a_cuda_driver_builds_tilelang_kernels_for_one_with(tmp_path):
    """``tileops warmup --arch sm_90`` on a build machine (toolkit, no driver): a kernel TileLang builds
    itself (the attention forward: dynamic shared memory, which the lean build refuses) links against
    a stand-in ``libcuda.so`` and skips the library's ``init()``, and lands in the index that a GPU
    machine loads from. Where a driver is present the ordinary build runs (and the kernel is indexed
    as well)."""
    job = ("from tileops.compile import build, tilelang_api\n"
           "from tileops.compile.warmup import compile_jobs\n"
           "from tileops.kernels import get_spec\n"
           "spec = get_spec('attention')(dtype='bfloat16', head_dim=64, hq=4, hkv=2, backend='cuda', kind='fwd')\n"
           "n, _, failures = compile_jobs([('attention', spec, 'cuda', 'sm_90')], jobs=1, progress=False)\n"
           "print(n, failures, build.indexed('attention', spec, 'cuda', 'sm_90'), tilelang_api.driver_missing())\n")
    out = python_in(tmp_path, job)
    n, failures, indexed, _ = out.split()[-4:]
    assert (n, failures, indexed) == ("1", "[]", "True"), out


def test_driverless_puts_back_what_it_changed(tmp_path, monkeypatch):
    """The stand-in and the init() answer last as long as the build: TileLang's loader and
    LIBRARY_PATH are as before afterwards."""
    from tileops.compile import tilelang_api

    tilelang_api.load()
    from tilelang.jit.adapter.libgen import LibraryGenerator

    monkeypatch.setenv("LIBRARY_PATH", "/somewhere")
    before = LibraryGenerator.load_lib
    if _nvcc_missing() is not None or not __import__("shutil").which(os.environ.get("CC", "cc")):
        pytest.skip("needs a C compiler for the stand-in libcuda.so")
    with tilelang_api.driverless(str(tmp_path / "stub")):
        assert LibraryGenerator.load_lib is not before
        assert os.environ["LIBRARY_PATH"].split(os.pathsep) == [str(tmp_path / "stub"), "/somewhere"]
        assert os.path.exists(tmp_path / "stub" / "libcuda.so")
    assert LibraryGenerator.load_lib is before and os.environ["LIBRARY_PATH"] == "/somewhere"
