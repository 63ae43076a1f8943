"""The families' host side as on an H200, run here: every binding a fixed set of calls makes, against
the recording committed in ``tests/golden/cuda_bindings.json``.

``python -m benchmarks.bindings`` runs rope, the norms, the prologue, the paged decode and attention
with the CUDA backend's specs and stand-in kernels (nothing launches, no GPU is needed) and records,
for each of its calls, the binding the runtime is asked to run (every argument a CUDA kernel takes by
name, pointer alignments, output modes and strides) or the refusal the call raised. A change to how
calls meet the CUDA kernels (a family's plan, the runtime's views and fit policy, a schedule that
moves an argument) shows here as the calls whose bindings moved, before any GPU runs them. When the
change is meant, record again (``python -m benchmarks.bindings tests/golden/cuda_bindings.json``) and
say in the commit what moved and why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden" / "cuda_bindings.json"


def test_the_cuda_host_side_binds_as_recorded(tmp_path):
    out = tmp_path / "bindings.json"
    env = {**os.environ, "TILEOPS_NATIVE": "0"}  # the recording replaces the runtime: no extension needed
    run = subprocess.run([sys.executable, "-m", "benchmarks.bindings", str(out)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    want, got = json.loads(GOLDEN.read_text()), json.loads(out.read_text())
    assert [c for c, _, _ in got] == [c for c, _, _ in want], "the recorded calls changed: record again"
    moved = [f"{case}: {kind} -> {kind2}\n  was {json.dumps(was)[:600]}\n  now {json.dumps(now)[:600]}"
             for (case, kind, was), (_, kind2, now) in zip(want, got) if (kind, was) != (kind2, now)]
    assert not moved, (f"{len(moved)} of {len(want)} calls bind otherwise than {GOLDEN.relative_to(ROOT)} records "
                       f"(`python -m benchmarks.bindings --diff` shows them by argument):\n" + "\n".join(moved))
    assert sum(kind == "raised" for _, kind, _ in want) == 6  # the refusals are recorded too
