"""Shared test fixtures: the ``cuda`` marker skips without a GPU; every test's random inputs seeded
with a constant of its own (``tests/seeds.py``: ``gen``, the global RNGs, hypothesis derandomized;
``TILEOPS_EXPLORE=1`` for fresh ones), its seed printed when it fails; the native runtime built
before any test process imports tileops."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import zlib

import pytest
import seeds
import torch
from hypothesis import settings

try:  # numpy is torch's optional dependency: a test using its global RNG is seeded too
    import numpy
except ImportError:  # pragma: no cover
    numpy = None

HAS_CUDA = torch.cuda.is_available()
SEED = pytest.StashKey[int]()

# Hypothesis: the default profile draws the same examples every run (from each test's code), so the
# README's command and `-m slow` are reproducible; a failure prints the @reproduce_failure line that
# replays it. Under TILEOPS_EXPLORE each run draws new examples. No example database: a failure
# replayed from a local one would make a run depend on the runs before it.
settings.register_profile("tileops", derandomize=True, database=None, deadline=None, print_blob=True)
settings.register_profile("tileops-explore", derandomize=False, database=None, deadline=None, print_blob=True)
# loaded here, before any test module builds its settings on the current profile (tests/test_fuzz.py)
settings.load_profile("tileops-explore" if seeds.explore() else "tileops")


def pytest_configure(config: pytest.Config) -> None:
    """Build the native runtime into the cache first (once, in the process that starts the workers;
    about 40 s on 2 cores the first time, a cache check after): tileops loads it when it is
    imported, and on a machine without a GPU an import never builds it, so the tests would
    otherwise run the Python runtime alone. ``TILEOPS_NATIVE=0`` skips the build (and the extension).
    A bad ``TILEOPS_SEED`` is refused here, once, not in every test's setup."""
    try:
        seeds.pinned()
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None
    _log_compiles(config)
    _share_threads(config)
    if hasattr(config, "workerinput") or os.environ.get("TILEOPS_NATIVE", "1").strip() in ("0", "false", "no", "off"):
        return
    code = ("from tileops.runtime import native\n"
            "try:\n    native.build(progress=True)\n"
            "except OSError as e:  # no compiler or headers: the tests run the Python runtime alone\n"
            "    print(f'tileops: no native runtime for these tests ({e})')\n")
    subprocess.run([sys.executable, "-c", code], check=False)


def _share_threads(config: pytest.Config) -> None:
    """In a pytest-xdist worker, torch's CPU threads are the machine's cores shared among the workers
    (at least one). Each process would otherwise start one thread per core: on the GPU machine's 16
    cores, 15 workers of a thread per core each ran the float64 references, and OpenMP's threads
    spin while they wait; the suite's longest test there (``test_AttnFwdOp[gqa-4x512-causal-bf16-cuda]``, 17
    GFLOP of float64 reference and no kernel to compile) took 292 s of its part's 415 s (H100,
    2026-12-05). The count can move a float64 reduction's last bits (torch splits a long sum among
    its threads), far inside every tolerance; a worker keeps one count for all its tests."""
    workers = getattr(config, "workerinput", {}).get("workercount")
    if workers:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


#: the test running in this process, for the compile log's lines (``TILEOPS_COMPILE_LOG``)
_RUNNING = [""]


def _log_compiles(config: pytest.Config) -> None:
    """``TILEOPS_COMPILE_LOG=DIR``: each test process appends tileops' "compiled ..." records (one a
    kernel compiled, not loaded from the index) to ``DIR/<worker>.log``, each after the test that
    compiled it. What a device run of the suite still compiles is then named: on the H100 (2026-12-05)
    about 180 kernels were built there beside the carried index, and pytest's capture hid which."""
    where = os.environ.get("TILEOPS_COMPILE_LOG", "").strip()
    if not where:
        return
    import logging

    os.makedirs(where, exist_ok=True)
    worker = getattr(config, "workerinput", {}).get("workerid", "main")
    handler = logging.FileHandler(os.path.join(where, f"{worker}.log"))
    handler.setFormatter(logging.Formatter("%(test)s\t%(message)s"))

    def add_test(record: logging.LogRecord) -> bool:
        record.test = _RUNNING[0]
        return True

    handler.addFilter(add_test)
    log = logging.getLogger("tileops.compile")
    log.addHandler(handler)
    log.setLevel(logging.INFO)


def pytest_runtest_setup(item: pytest.Item) -> None:
    _RUNNING[0] = item.nodeid


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--shard", default=None, metavar="K/N",
                     help="run only the K-th of N parts of the collected tests (1 <= K <= N), each test's part "
                          "the CRC-32 of its node id modulo N: the same parts on every machine and run, together "
                          "every test once (the H200's CUDA suite does not fit one 600 s call)")


def shard_of(nodeid: str, n: int) -> int:
    """The part (1 .. n) a test runs in under ``--shard K/n``."""
    return zlib.crc32(nodeid.encode()) % n + 1


def _shard(text: str) -> tuple[int, int]:
    k, _, n = text.partition("/")
    if not (k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise pytest.UsageError(f"--shard: expected K/N with 1 <= K <= N (integers), got {text!r}")
    return int(k), int(n)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("shard"):
        k, n = _shard(config.getoption("shard"))
        keep, other = [], []
        for i in items:
            (keep if shard_of(i.nodeid, n) == k else other).append(i)
        config.hook.pytest_deselected(items=other)
        items[:] = keep
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (none here)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def tileops_seed(request: pytest.FixtureRequest) -> int:
    """This test's seed (``seeds.seed_for`` of its node id), with torch's global RNGs (the CPU's and
    every GPU's), ``random``'s and numpy's seeded from it: a test drawing from them draws the same
    inputs whichever worker ran what before it."""
    seed = seeds.seed_for(request.node.nodeid)
    request.node.stash[SEED] = seed
    # seed + 1: gen is seeded with seed, and a test drawing from both must not get the same
    # numbers twice (torch's CPU generator would repeat them)
    other = (seed + 1) % seeds.LIMIT
    torch.manual_seed(other)
    random.seed(other)
    if numpy is not None:
        numpy.random.seed(other)
    return seed


@pytest.fixture
def gen(tileops_seed: int) -> torch.Generator:
    """A generator seeded with the test's seed."""
    return torch.Generator().manual_seed(tileops_seed)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failing test's report says which seed drew its inputs and how to draw them again (a section
    of the report, so it reaches the xdist controller with it)."""
    report = yield
    seed = item.stash.get(SEED, None)
    if report.failed and seed is not None:
        how = ("TILEOPS_SEED pinned it" if seeds.pinned() is not None else
               "a fresh one (TILEOPS_EXPLORE)" if seeds.explore() else "the CRC-32 of the test's node id")
        report.sections.append(("tileops seed", (
            f"seed {seed}: {how}; `TILEOPS_SEED={seed} python -m pytest '{item.nodeid}'` draws the same inputs"
            # a hypothesis run draws its examples apart from the seed (not every @given is the test's own)
            + ("; hypothesis's examples are its own: its @reproduce_failure line above replays them"
               if "@reproduce_failure" in report.longreprtext else ""))))
    return report
