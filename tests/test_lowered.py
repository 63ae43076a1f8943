"""The sources shipped lowered (tileops/lowered.py, kernels/lowered/sm_90.json.xz)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.test_lean_build import needs_toolchain
from tileops.compile import cuda_build, build, lowered
from tileops.compile.warmup import kernel_jobs
from tileops.manifest import registry

FAMILIES = sorted({m.family for m in registry().values()})
#: families whose kernels the shipped file does not hold yet (a new family, until `tileops lowered`
#: is run again: it lowers the kernels not shipped only): their cold first calls lower them with
#: TileLang, as any kernel not shipped is. The mark is strict: once they are shipped the test fails
#: as XPASS, and the entry goes.
NOT_SHIPPED: dict[str, str] = {}


def _jobs(families=None):
    names = [n for n, m in registry().items() if families is None or m.family in families]
    return [j for j in kernel_jobs(names, "sm_90") if j[2] == "cuda"]


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.xfail(strict=True, reason=NOT_SHIPPED[f]))
                                    if f in NOT_SHIPPED else f for f in FAMILIES])
def test_the_shipped_file_has_every_warmup_kernel_under_its_current_key(family):
    """Fails after a change to a kernel builder, its helpers, tileops/cuda_build.py, the pass configs or
    TileLang's version until ``tileops lowered`` is run again (the old keys no longer match)."""
    shipped = lowered.shipped("sm_90")  # (a kernel the lean build refuses is there as "unserved")
    stale = [repr(j[1]) for j in _jobs([family]) if build.index_key(*j, lean=True) not in shipped]
    assert not stale, f"{len(stale)} kernels missing from {lowered.path('sm_90')} (run `tileops lowered`): {stale[:2]}"


@pytest.mark.parametrize("i", [0, 57, 131, -1])
def test_shipped_sources_are_what_lowering_gives_now(i):
    shipped = lowered.shipped("sm_90")
    job = [j for j in _jobs([f for f in FAMILIES if f not in NOT_SHIPPED])
           if "device" in shipped.get(build.index_key(*j, lean=True), {})][i]
    shipped = lowered.lookup(build.index_key(*job, lean=True), "sm_90")
    fresh = cuda_build.lower_sources(build.prim_func(job[0], job[1]), "sm_90", build.pass_configs(job[1]))
    assert shipped == fresh


def test_an_unreadable_or_foreign_file_means_lowering(tmp_path, monkeypatch):
    bad = tmp_path / "sm_90.json.xz"
    bad.write_bytes(b"not xz at all")
    monkeypatch.setattr(lowered, "path", lambda arch: bad)
    monkeypatch.setattr(lowered, "_packs", {})
    assert lowered.lookup("anything", "sm_90") is None
    import lzma

    with lzma.open(bad, "wt") as f:
        json.dump({"format": 1, "arch": "sm_80", "kernels": {"k": {}}}, f)  # another arch's file
    monkeypatch.setattr(lowered, "_packs", {})
    assert lowered.lookup("k", "sm_90") is None


COLD = """
import json, sys
from tileops.compile import build
from tileops.compile.warmup import kernel_jobs
job = [j for j in kernel_jobs(["RoPEFwdOp"], "sm_90") if j[2] == "cuda"][0]
lib, record = build._obtain(*job)[0]
print(json.dumps({"tilelang": "tilelang" in sys.modules, "lean": build.stats.lean,
                  "shipped": build.stats.shipped, "args": len(record["args"])}))
"""


@needs_toolchain
def test_a_cold_build_of_a_shipped_kernel_never_imports_tilelang(tmp_path):
    # TILEOPS_NATIVE=0: on a machine with a GPU, an import with a fresh cache would build the native runtime
    env = {**os.environ, "TILEOPS_CACHE_DIR": str(tmp_path / "tileops"), "TILELANG_CACHE_DIR": str(tmp_path / "tl"),
           "TILEOPS_NATIVE": "0"}
    env.pop("TILELANG_DISABLE_CACHE", None)
    out = subprocess.run([sys.executable, "-c", COLD], env=env, capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"tilelang": False, "lean": 1, "shipped": 1, "args": got["args"]} and got["args"] > 20
    assert len(os.listdir(tmp_path / "tileops" / "kernels")) == 2  # indexed: a later process loads it


def test_an_entry_whose_tir_is_unchanged_moves_to_its_new_key_without_lowering(tmp_path, monkeypatch):
    """A builder edit that leaves the generated code alone (a refactor) moves every key of its
    kernels; ``tileops lowered`` then carries each entry over by its TIR's digest instead of
    lowering it again (8 s a kernel on 2 cores). An entry whose TIR differs is lowered."""
    from tileops.compile import warmup

    jobs = [j for j in kernel_jobs(["RoPEFwdOp"], "sm_90") if j[2] == "cuda"][:3]
    keys = [build.index_key(*j, lean=True) for j in jobs]
    tirs = [build.lowering_digest(build.prim_func(j[0], j[1]), "sm_90", build.pass_configs(j[1])) for j in jobs]
    old = {f"old{i}": {"spec": "?", "device": f"d{i}", "host": f"h{i}", "record": {}, "name": f"n{i}", "tir": t}
           for i, t in enumerate(tirs[:2])}
    old["old1"]["tir"] = "another kernel's TIR"  # the second kernel's code changed: it must be lowered
    out = tmp_path / "sm_90.json.xz"
    monkeypatch.setattr(lowered, "path", lambda arch: out)
    monkeypatch.setattr(lowered, "_packs", {"sm_90": old})
    monkeypatch.setattr(warmup, "kernel_jobs", lambda names, arch, schedules=None: jobs)
    lowered_now = []
    monkeypatch.setattr(warmup, "_lower", lambda job: (lowered_now.append(job), (build.index_key(*job, lean=True), {
        "spec": repr(job[1]), "device": "fresh", "host": "", "record": {}, "name": "", "tir": "t"}))[1])
    path, n = warmup.write_lowered("sm_90", jobs=1, progress=False)
    assert n == {"kept": 0, "carried": 1, "lowered": 2, "unserved": 0}
    assert lowered_now == jobs[1:]
    assert lowered.shipped("sm_90")[keys[0]]["device"] == "d0"  # moved, not lowered
    assert lowered.shipped("sm_90")[keys[0]]["spec"] == repr(jobs[0][1])
    assert {lowered.shipped("sm_90")[k]["device"] for k in keys[1:]} == {"fresh"}
    assert "old0" not in lowered.shipped("sm_90")  # an entry no kernel has any longer goes
