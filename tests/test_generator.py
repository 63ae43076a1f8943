"""The generator: one compile per specialization, shared by threads and by lengths."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import threading

import pytest
import torch

from tests.references import reference
from tileops import BUILTIN
from tileops.compile import build
from tileops.rope import RoPEFwdOp


def test_fifty_lengths_one_compile(gen):
    op = RoPEFwdOp(rope_layout="interleaved", input_layout="2d", base=500.0, target=BUILTIN)
    op(torch.randn(1, 3, 2, 36, generator=gen))  # compile (or load) this specialization once
    before = build.stats.kernels
    for length in range(1, 51):
        x = torch.randn(2, length, 3, 36, generator=gen)
        out = op(x)
        ref = reference("RoPEFwdOp", {"rope_layout": "interleaved", "input_layout": "2d", "base": 500.0}, {"x": x})
        assert (out.double() - ref).abs().max().item() < 1e-5
    assert build.stats.kernels == before, "a new length compiled a new kernel"
    assert len(op._impls) == 1, "a new length built a new implementation"


def test_new_dtype_and_head_dim_compile_once_each(gen):
    build.clear_memory_cache()
    op = RoPEFwdOp(input_layout="1d", target=BUILTIN)
    before = build.stats.kernels
    for _ in range(3):
        for dtype in (torch.float16, torch.float32):
            for d in (34, 38):
                op(torch.randn(5, d, generator=gen).to(dtype))
    assert build.stats.kernels - before == 4


def test_threads_first_call_compile_once(gen):
    build.clear_memory_cache()
    op = RoPEFwdOp(input_layout="2d", target=BUILTIN)
    xs = [torch.randn(1, 9 + i, 3, 42, generator=gen) for i in range(8)]
    outs: list = [None] * 8
    errors: list = []
    before = build.stats.kernels
    start = threading.Barrier(8)

    def work(i: int) -> None:
        try:
            start.wait()
            outs[i] = op(xs[i])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert build.stats.kernels - before == 1
    for x, out in zip(xs, outs):
        ref = reference("RoPEFwdOp", {"input_layout": "2d"}, {"x": x})
        assert (out.double() - ref).abs().max().item() < 1e-5


def cache_env(tmp_path) -> dict:
    """Both disk caches in ``tmp_path``: TileLang's, and tileops' index of loadable kernels."""
    env = {**os.environ, "TILELANG_CACHE_DIR": str(tmp_path / "tilelang"), "TILEOPS_CACHE_DIR": str(tmp_path / "tileops"),
           "TILEOPS_NATIVE": "0"}  # on a machine with a GPU, an import with a fresh cache builds the native runtime
    env.pop("TILELANG_DISABLE_CACHE", None)
    return env


@pytest.mark.slow  # measured 5-38 s on 2 cores (pytest --durations); CI runs -m slow
def test_disk_cache_serves_a_new_process(tmp_path):
    """A second process with the same cache folders loads the kernel instead of building it: in that
    process TileLang's build step is made to fail, so only a disk hit can answer (with the cache
    disabled, the second process fails). A warm process never imports TileLang at all."""
    first_code = (
        "import torch\n"
        "from tileops.rope import RoPEFwdOp\n"
        "print(RoPEFwdOp(input_layout='1d')(torch.ones(4, 46)).sum().item())\n"
    )
    no_build = (
        "import importlib, tilelang\n"
        "k = importlib.import_module('tilelang.jit.kernel')\n"
        "def refuse(*a, **kw):\n"
        "    raise RuntimeError('built again: the disk cache did not serve the kernel')\n"
        "k.JITKernel._compile_and_create_adapter = refuse\n"
    )
    env = cache_env(tmp_path)
    first = subprocess.run([sys.executable, "-c", first_code], env=env, capture_output=True, text=True, check=True)
    assert any(p.is_file() for p in tmp_path.rglob("*")), "nothing was written to the disk cache"
    warm = subprocess.run([sys.executable, "-c", first_code + "import sys; print('tilelang' in sys.modules)\n"],
                          env=env, capture_output=True, text=True, check=True)
    assert warm.stdout == first.stdout + "False\n", "a warm process imported TileLang"
    second = subprocess.run([sys.executable, "-c", no_build + first_code], env=env, capture_output=True, text=True)
    assert second.returncode == 0, second.stderr[-2000:]
    assert second.stdout == first.stdout
    # the same second process with the cache off must build, and so fail: the check above can fail
    off = subprocess.run([sys.executable, "-c", no_build + first_code], env={**env, "TILELANG_DISABLE_CACHE": "1"},
                         capture_output=True, text=True)
    assert off.returncode != 0 and "built again" in off.stderr


@pytest.mark.slow  # measured 5-38 s on 2 cores (pytest --durations); CI runs -m slow
def test_importing_tileops_leaves_tilelang_settings_alone():
    """No TILELANG_* variable set, no TileLang logger level changed, by importing or calling."""
    code = (
        "import logging, os, torch\n"
        "import tilelang\n"
        "level = logging.getLogger('tilelang').level\n"
        "import tileops\n"
        "from tileops.rope import RoPEFwdOp\n"
        "RoPEFwdOp()(torch.randn(3, 8))\n"
        "print(sorted(k for k in os.environ if k.startswith('TILELANG')), logging.getLogger('tilelang').level == level)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TILELANG")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] True"


_PROBE = (
    "import torch\n"
    "from tileops.rope import RoPEFwdOp\n"
    "print(RoPEFwdOp(input_layout='1d')(torch.ones(4, 46)).sum().item())\n"
)


@pytest.mark.parametrize("damage", ["truncated library", "garbage library", "corrupt params", "corrupt manifest",
                                    "truncated index library", "garbage index library", "corrupt index record"])
@pytest.mark.slow  # measured 5-38 s on 2 cores (pytest --durations); CI runs -m slow
def test_a_damaged_disk_cache_entry_is_rebuilt_with_a_warning(tmp_path, damage):
    """A cache entry cut short or overwritten (a crash mid-write, a bad disk), in TileLang's cache or
    in tileops' index, is detected, warned about and rebuilt: the same answer, never a crash or a
    wrong result."""
    env = cache_env(tmp_path)
    good = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True)
    (lib,) = (tmp_path / "tilelang").rglob("kernel_lib.so")
    (index_lib,) = (tmp_path / "tileops" / "kernels").glob("*.so")
    entry = lib.parent
    if "index" in damage:
        target = index_lib.with_suffix(".json") if "record" in damage else index_lib
    else:
        shutil.rmtree(tmp_path / "tileops" / "kernels")  # so that TileLang's entry is read
        target = {"corrupt params": entry / "params.json", "corrupt manifest": entry / "manifest.json"}.get(damage, lib)
    if damage.startswith("truncated"):
        target.write_bytes(target.read_bytes()[:1000])
    elif damage.startswith("garbage"):
        target.write_bytes(random.randbytes(target.stat().st_size))  # random: seeded per test (conftest)
    else:
        target.write_text("{not json")
    again = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-2000:]
    told = again.stdout + again.stderr  # TileLang's log handler writes to stdout
    assert again.stdout.splitlines()[-1] == good.stdout.strip()
    if "index" in damage:
        assert "rebuilding it" in told and str(target) in told, told[-2000:]
    else:
        assert "failed integrity verification" in told and "recompiling" in told, told[-2000:]
    third = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True)
    assert third.stdout == good.stdout and "integrity" not in third.stderr and "rebuilding" not in third.stderr, \
        "the rebuilt entry was not kept"


@pytest.mark.slow  # measured 5-38 s on 2 cores (pytest --durations); CI runs -m slow
def test_an_unwritable_cache_directory_means_memory_only_with_a_warning(tmp_path):
    (tmp_path / "a-file").write_text("")
    where = tmp_path / "a-file" / "cache"  # cannot be created, even by root
    env = {**cache_env(tmp_path), "TILELANG_CACHE_DIR": str(where)}
    two_calls = _PROBE + "print(RoPEFwdOp(input_layout='1d')(torch.ones(5, 46)).sum().item())\n"
    proc = subprocess.run([sys.executable, "-c", two_calls], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"kernel cache directory {where} is not writable" in proc.stderr
    assert "kept in memory only" in proc.stderr
    assert len(proc.stdout.split()) == 2
    good = subprocess.run([sys.executable, "-c", two_calls], env={**env, "TILELANG_CACHE_DIR": str(tmp_path / "ok")},
                          capture_output=True, text=True, check=True)
    assert proc.stdout == good.stdout


@pytest.mark.slow  # measured 5-38 s on 2 cores (pytest --durations); CI runs -m slow
def test_two_processes_filling_one_cold_cache_at_once(tmp_path):
    """Both compile (or one waits on the other's entry) and both get correct kernels; a third
    process then loads the entry without building."""
    env = cache_env(tmp_path)
    procs = [subprocess.Popen([sys.executable, "-c", _PROBE], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-1000:] for o in outs]
    want = subprocess.run([sys.executable, "-c", _PROBE], env=cache_env(tmp_path / "alone"),
                          capture_output=True, text=True, check=True).stdout
    assert [o[0].splitlines()[-1] for o in outs] == [want.strip()] * 2
    no_build = ("import importlib, tilelang\n"
                "k = importlib.import_module('tilelang.jit.kernel')\n"
                "k.JITKernel._compile_and_create_adapter = lambda *a, **kw: (_ for _ in ()).throw(RuntimeError('built'))\n")
    third = subprocess.run([sys.executable, "-c", no_build + _PROBE], env=env, capture_output=True, text=True)
    assert third.returncode == 0 and third.stdout == want, third.stderr[-1000:]
