"""Benchmarks of tileops' ops against the alternatives; run ``python -m benchmarks``."""
