"""Shared test fixtures: the ``cuda`` marker skips without a GPU; a fresh generator per test."""

from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


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
