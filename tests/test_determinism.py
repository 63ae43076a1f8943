"""The tests' random inputs are the same every run (``tests/seeds.py``, ``tests/conftest.py``): a
test's seed is a constant of its node id, the same in another process with another
``PYTHONHASHSEED`` (a seed from ``hash()`` would differ: shown), so the same in any xdist worker;
``TILEOPS_EXPLORE=1`` draws fresh ones and ``TILEOPS_SEED`` pins one; hypothesis is derandomized
by default. The slow test runs the conftest itself in pytest subprocesses under xdist: the same
draws from ``gen`` and the global RNGs in two runs of other hash seeds, other draws when exploring,
and a failure's report naming the seed that replays it."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import settings

try:  # pytest puts tests/ on sys.path when it is not a package, the repo root when it is
    import seeds
except ImportError:  # pragma: no cover
    from tests import seeds

TESTS = Path(__file__).resolve().parent
#: the environment of a run in the default mode: no seed pinned, no exploring
PLAIN = {k: v for k, v in os.environ.items() if k not in ("TILEOPS_EXPLORE", "TILEOPS_SEED", "PYTHONHASHSEED")}
DEFAULT_MODE = not seeds.explore() and seeds.pinned() is None


def _in_process(code: str, **env: str) -> str:
    """``code``'s stdout, run in a new interpreter that imports ``seeds``, with ``env`` added to
    :data:`PLAIN`."""
    run = subprocess.run([sys.executable, "-c", f"import seeds\n{code}"], env={**PLAIN, **env}, cwd=TESTS,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


@pytest.mark.skipif(not DEFAULT_MODE, reason="TILEOPS_EXPLORE or TILEOPS_SEED is set")
def test_a_tests_seed_is_the_crc32_of_its_node_id(request, tileops_seed, gen):
    assert tileops_seed == gen.initial_seed() == zlib.crc32(request.node.nodeid.encode())
    # the global RNGs are seeded from seed + 1: not gen's numbers again
    other = (tileops_seed + 1) % seeds.LIMIT
    assert torch.initial_seed() == other and random.random() == random.Random(other).random()
    assert not torch.equal(torch.randn(8), torch.randn(8, generator=gen))


def test_the_seed_is_the_same_in_processes_of_other_hash_seeds():
    key = "tests/test_x.py::test_y[float16-2d]"
    code = f"print(seeds.seed_for({key!r}), hash({key!r}))"
    (a, hash_a), (b, hash_b) = (_in_process(code, PYTHONHASHSEED=h).split() for h in ("1", "2"))
    assert hash_a != hash_b, "the processes hash alike: they show nothing"
    assert a == b == str(zlib.crc32(key.encode()))


def test_explore_draws_fresh_seeds_and_tileops_seed_pins_them():
    code = "print(seeds.seed_for('k'), seeds.seed_for('k'))"
    fresh = _in_process(code, TILEOPS_EXPLORE="1").split() + _in_process(code, TILEOPS_EXPLORE="1").split()
    assert len(set(fresh)) > 1, fresh  # four equal 32-bit draws: one chance in 2^96
    assert _in_process(code, TILEOPS_EXPLORE="1", TILEOPS_SEED="77").split() == ["77", "77"]
    assert _in_process(code, TILEOPS_SEED="0").split() == ["0", "0"]
    for bad in ("-1", "4294967296", "0x10", "seven"):
        run = subprocess.run([sys.executable, "-c", "import seeds\nseeds.seed_for('k')"], cwd=TESTS,
                             env={**PLAIN, "TILEOPS_SEED": bad}, capture_output=True, text=True, timeout=60)
        assert run.returncode != 0 and "TILEOPS_SEED: expected an integer from 0 to 4294967295" in run.stderr, bad


def test_hypothesis_profiles():
    plain, explore = settings.get_profile("tileops"), settings.get_profile("tileops-explore")
    assert plain.derandomize and plain.database is None and plain.deadline is None and plain.print_blob
    assert not explore.derandomize and explore.database is None and explore.print_blob
    assert settings.default.derandomize is not seeds.explore()


# ------------------------------------------------------------------- the conftest in pytest runs

_PROBE = '''
import json, os, random
import numpy, torch

def _draws(gen, name):
    out = {"gen": torch.randn(4, generator=gen).tolist(), "torch": torch.randn(4).tolist(),
           "random": random.random(), "numpy": float(numpy.random.rand())}
    with open(os.path.join(os.environ["DRAWS"], name + ".json"), "w") as f:
        json.dump(out, f)

def test_a(gen):
    _draws(gen, "a")

def test_b(gen):
    _draws(gen, "b")

def test_fails(gen):
    _draws(gen, "fails")
    assert False
'''


def _pytest(tmp: Path, name: str, **env: str) -> tuple[dict, str]:
    """A run of the probe in a copy of the conftest (``-n 2``: its tests in two xdist workers):
    each test's draws, and the output."""
    draws = tmp / name
    draws.mkdir()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", "test_probe.py"], cwd=tmp, capture_output=True, text=True, timeout=300,
                         env={**PLAIN, "TILEOPS_NATIVE": "0", "DRAWS": str(draws), **env})
    assert run.returncode == 1 and "2 passed" in run.stdout and "1 failed" in run.stdout, run.stdout[-3000:]
    return {p.stem: json.loads(p.read_text()) for p in draws.iterdir()}, run.stdout


@pytest.mark.slow  # four pytest runs of two workers each: about 30 s on 2 cores
def test_the_conftest_draws_the_same_in_any_worker_and_names_a_failures_seed(tmp_path):
    for f in ("conftest.py", "seeds.py"):
        shutil.copy(TESTS / f, tmp_path / f)
    (tmp_path / "test_probe.py").write_text(_PROBE)
    first, out = _pytest(tmp_path, "first", PYTHONHASHSEED="1")
    again, _ = _pytest(tmp_path, "again", PYTHONHASHSEED="2")
    assert set(first) == {"a", "b", "fails"} and first == again
    assert first["a"] != first["b"]
    want = torch.Generator().manual_seed(zlib.crc32(b"test_probe.py::test_a"))
    assert first["a"]["gen"] == torch.randn(4, generator=want).tolist()
    seed = zlib.crc32(b"test_probe.py::test_fails")
    assert "tileops seed" in out and f"TILEOPS_SEED={seed} python -m pytest 'test_probe.py::test_fails'" in out, out
    fresh, out = _pytest(tmp_path, "fresh", TILEOPS_EXPLORE="1")
    assert all(fresh["a"][k] != first["a"][k] for k in first["a"]), (fresh, first)
    # the seed the failure printed under TILEOPS_EXPLORE, pinned: the failing test's draws again
    shown = out.split(" python -m pytest 'test_probe.py::test_fails'")[0].rsplit("TILEOPS_SEED=", 1)[1]
    pinned, _ = _pytest(tmp_path, "pinned", TILEOPS_SEED=shown)
    assert pinned["fails"] == fresh["fails"] != first["fails"]


# ------------------------------------------------------------------- --shard K/N

_SHARD_PROBE = "import pytest\n\n@pytest.mark.parametrize('i', range(12))\ndef test_p(i):\n    pass\n"


def _collected(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-p", "no:cacheprovider",
                           *args, "test_probe.py"], cwd=tmp, capture_output=True, text=True, timeout=120,
                          env={**PLAIN, "TILEOPS_NATIVE": "0"})


def test_shards_split_the_tests_by_the_crc32_of_their_node_ids_each_once(tmp_path):
    """``--shard K/N`` (the H200's CUDA suite runs in parts): the parts are disjoint, together every
    test, each test's part its node id's CRC-32 modulo N (the same on every machine); a bad K/N is a
    usage error naming it."""
    for f in ("conftest.py", "seeds.py"):
        shutil.copy(TESTS / f, tmp_path / f)
    (tmp_path / "test_probe.py").write_text(_SHARD_PROBE)
    ids = [f"test_probe.py::test_p[{i}]" for i in range(12)]
    parts = []
    for k in (1, 2):
        run = _collected(tmp_path, "--shard", f"{k}/2")
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        parts.append({line for line in run.stdout.splitlines() if line.startswith("test_probe.py::")})
    assert parts[0] | parts[1] == set(ids) and not parts[0] & parts[1]
    assert parts[0] == {i for i in ids if zlib.crc32(i.encode()) % 2 == 0} and parts[0] and parts[1]
    bad = _collected(tmp_path, "--shard", "3/2")
    assert bad.returncode == 4 and "--shard: expected K/N with 1 <= K <= N (integers), got '3/2'" in bad.stderr, (
        bad.stdout[-1000:] + bad.stderr[-1000:])


# ------------------------------------------------------------------- torch's threads in xdist workers


def test_xdist_workers_share_the_cores_among_them(request):
    """Each worker's torch threads are the cores shared among the workers (``_share_threads``): 2
    processes of 2 threads each on 2 cores took 10.7 s for the float64 attention reference that 1
    thread does in 1.0 s (OpenMP threads spin while they wait; this machine, 2026-12-05)."""
    import conftest

    cores, before = os.cpu_count() or 1, torch.get_num_threads()
    if hasattr(request.config, "workerinput"):  # this very run: the count its worker was given
        assert before == max(1, cores // int(request.config.workerinput["workercount"]))
    try:
        for workers, want in ((1, cores), (cores, 1), (4 * cores, 1)):
            conftest._share_threads(type("Config", (), {"workerinput": {"workercount": workers}})())
            assert torch.get_num_threads() == want, (workers, torch.get_num_threads())
        torch.set_num_threads(3)
        conftest._share_threads(type("Config", (), {})())  # not a worker (-n 0): torch's own count stays
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
