"""Kernels shipped lowered: the lean build's sources for every kernel of the manifests' cases.

A cold first call spends most of its time in TileLang before any compiler runs: importing it (1-3 s)
and lowering the kernel (0.5-1.7 s on the H200's host, ``benchmarks/NOTES.md``). What lowering gives
the lean build (:class:`tileops.compile.cuda_build.Sources`: the device source, the launcher's
source, the launch record) depends only on what the lean build's index key digests: the kernel's
spec, the builder's source, TileLang's version, the pass configs and :mod:`tileops.compile.cuda_build`
itself. So those sources are generated ahead, for every kernel ``tileops warmup`` would build, and
shipped in ``kernels/lowered/<arch>.json.xz``; a cold first call of one of those kernels compiles
them (NVRTC and the C++ compiler, about half a second) without importing TileLang. A kernel not in
the file, or a file left behind by a change to the kernels (its keys no longer match), is lowered by
TileLang as before: the file can make a first call faster, never different.

``tileops lowered`` regenerates the file (:func:`tileops.compile.warmup.write_lowered` lowers the
kernels, :func:`write` writes them; ``tests/test_lowered.py`` fails when the file is stale). Each
entry keeps the digest of its kernel's TIR (``tir``), so that an edit moving keys without changing
the generated code carries entries over rather than lowering them again.
"""

from __future__ import annotations

import json
import lzma
import os
import threading
from pathlib import Path
from typing import Any

__all__ = ["path", "lookup", "shipped", "write"]

_FORMAT = 1
_lock = threading.Lock()
_packs: dict[str, dict[str, Any]] = {}


def path(arch: str) -> Path:
    """Where the shipped sources for ``arch`` are (``tileops.kernels``' ``lowered/`` folder)."""
    import tileops.kernels

    return Path(tileops.kernels.__file__).parent / "lowered" / f"{arch}.json.xz"


def _pack(arch: str) -> dict[str, Any]:
    with _lock:
        got = _packs.get(arch)
        if got is None:
            got = {}
            try:
                with lzma.open(path(arch), "rt", encoding="utf-8") as f:
                    data = json.load(f)
                if data.get("format") == _FORMAT and data.get("arch") == arch:
                    got = data["kernels"]
            except (OSError, ValueError, lzma.LZMAError, KeyError, TypeError):
                got = {}  # absent or unreadable: every kernel is lowered by TileLang
            _packs[arch] = got
        return got


def lookup(key: str, arch: str) -> Any:
    """The shipped :class:`tileops.compile.cuda_build.Sources` of the kernel whose lean index key is ``key``, or None
    (not shipped, or shipped as ``unserved``: a kernel the lean build refuses, which TileLang's build serves)."""
    from .cuda_build import Sources

    entry = _pack(arch).get(key)
    if not isinstance(entry, dict):
        return None
    try:
        return Sources(device=entry["device"], host=entry["host"], record=entry["record"], name=entry["name"])
    except KeyError:
        return None


def shipped(arch: str) -> dict[str, Any]:
    """Every shipped entry for ``arch``, by lean index key (empty without a readable file)."""
    return dict(_pack(arch))


def write(arch: str, kernels: dict[str, dict[str, Any]]) -> Path:
    """Write the file for ``arch`` holding ``kernels`` (lean index key -> the sources :func:`lookup`
    reads), atomically, and forget the copy read before; returns its path."""
    out = path(arch)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    with lzma.open(tmp, "wt", encoding="utf-8", preset=9) as f:
        json.dump({"format": _FORMAT, "arch": arch, "kernels": kernels}, f, sort_keys=True, separators=(",", ":"))
    os.replace(tmp, out)
    with _lock:
        _packs.pop(arch, None)
    return out
