"""The seeds of the tests' random inputs. By default a test's seed is a constant, the CRC-32 of its
pytest node id, so every run draws the same inputs whatever the process, the xdist worker or the
order (CI once failed by chance on inputs no later run drew). ``TILEOPS_EXPLORE=1`` draws a fresh
seed for every test instead, to look for new failures; ``TILEOPS_SEED=<n>`` pins every test's seed
to ``n``, to replay the seed a failure's report printed (``tests/conftest.py``, which seeds the
RNGs). No torch here: a process that only needs the seed starts fast (``tests/test_determinism.py``)."""

from __future__ import annotations

import os
import zlib

#: seeds are 32-bit: numpy's global RNG takes no more
LIMIT = 2**32


def explore() -> bool:
    """Whether ``TILEOPS_EXPLORE`` asks for fresh seeds."""
    return os.environ.get("TILEOPS_EXPLORE", "").strip().lower() not in ("", "0", "false", "no", "off")


def pinned() -> int | None:
    """``TILEOPS_SEED`` as a seed, or None where it is unset."""
    text = os.environ.get("TILEOPS_SEED", "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) >= LIMIT:
        raise ValueError(f"TILEOPS_SEED: expected an integer from 0 to {LIMIT - 1}, got {text!r}")
    return int(text)


def seed_for(key: str) -> int:
    """The seed of ``key``'s inputs (a test's node id): ``TILEOPS_SEED`` where it is set; a fresh one
    from the OS under ``TILEOPS_EXPLORE``; else the CRC-32 of ``key`` (never ``hash()``, which
    ``PYTHONHASHSEED`` randomises per process, and so per xdist worker)."""
    if (n := pinned()) is not None:
        return n
    if explore():
        return int.from_bytes(os.urandom(4), "little")
    return zlib.crc32(key.encode())
