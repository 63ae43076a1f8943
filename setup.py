"""The package list, computed so that a new family needs no edit here: every package under
``tileops/`` (``tileops/<family>/`` included), plus ``kernels/`` and ``manifests/``, which ship as
``tileops.kernels`` and ``tileops.manifests`` (``package-dir`` in pyproject.toml). Everything else
is in pyproject.toml."""

from setuptools import find_packages, setup

setup(packages=["tileops", *(f"tileops.{p}" for p in find_packages("tileops")), "tileops.kernels", "tileops.manifests"])
