"""Shared test fixtures: the ``cuda`` marker skips without a GPU; a fresh generator per test; the
native runtime built before any test process imports tileops."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


def pytest_configure(config: pytest.Config) -> None:
    """Build the native runtime into the cache first (once, in the process that starts the workers;
    about 40 s on 2 cores the first time, a cache check after): tileops loads it when it is
    imported, and on a machine without a GPU an import never builds it, so the tests would
    otherwise run the Python runtime alone. ``TILEOPS_NATIVE=0`` skips the build (and the extension)."""
    if hasattr(config, "workerinput") or os.environ.get("TILEOPS_NATIVE", "1").strip() in ("0", "false", "no", "off"):
        return
    code = ("from tileops.runtime import native\n"
            "try:\n    native.build(progress=True)\n"
            "except OSError as e:  # no compiler or headers: the tests run the Python runtime alone\n"
            "    print(f'tileops: no native runtime for these tests ({e})')\n")
    subprocess.run([sys.executable, "-c", code], check=False)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (none here)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def gen() -> torch.Generator:
    """A generator seeded afresh from the OS, so every run draws new inputs."""
    g = torch.Generator()
    g.seed()
    return g
