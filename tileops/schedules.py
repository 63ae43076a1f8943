"""Schedules: which values of its kernels' schedule knobs serve a call, and where they came from.

A manifest's ``kernel.static`` is the built-in schedule. Its ``kernel.tune`` section declares, per
backend, the space ``tileops tune`` searches (candidate values of knobs of the op's builders, and
rules between them) and the *shape classes* a tuned choice is kept for: the call's dtypes, its
specialized dims (``kernel.specialize``: the head dim), a bucket of its token count and buckets of the
dims ``kernel.tune.dim_buckets`` names (attention's keys a sequence).

Tables of choices are JSON files, one per device:

* **tuned** on this machine (``tileops tune``, ``op.tune``): ``<cache>/schedules/<device>.json``
  under ``TILEOPS_CACHE_DIR`` (default ``~/.cache/tileops``); the device identity recorded in it
  is the name, arch, SM count and driver (a CPU: its model, arch and core count);
* **shipped** in the package next to the lowered kernels (``tileops/kernels/schedules/``), for the
  devices they were tuned on; a shipped table matches a device by name, arch and SM count (a user's
  driver differs from the tuning machine's).

An op built with ``target=None`` takes, for a call of a shape class, the tuned choice of this device,
else the shipped one, else the built-in schedule; ``target=BUILTIN`` always takes the built-in one.
Every entry carries the digest of the builders whose knobs it sets (:func:`tileops.compile.build.builder_digest`):
a table from another device, an entry whose builders changed since it was tuned, or a file that does
not parse is ignored, with one warning per file and process, and never used.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from .compile.build import builder_digest
from .compile.entry import cache_root
from .manifest import OpManifest
from .manifest.call import CallSpec
from .manifest.expr import ExprError

__all__ = ["Schedule", "BUILT_IN", "FORMAT", "shape_class", "token_count", "device_identity", "device_slug",
           "candidates", "choose", "static_for", "record", "tuned_path", "shipped_dir", "digest_of", "forget_tables",
           "cpu_model", "bucket", "dim_buckets", "buckets", "generation", "shipped_for", "space_for"]

#: the tables' layout version: a file of another is ignored (with its warning)
FORMAT = 1
#: where a schedule came from when no table chose one
BUILT_IN = "built-in"


@dataclass(frozen=True)
class Schedule:
    """The schedule that serves a call: ``knobs`` ``((builder, knob, value), ...)`` over the manifest's
    ``kernel.static`` (empty: the built-in schedule), where it came from (``source``: ``"built-in"``,
    ``"shipped for NVIDIA H200"``, ``"tuned on this machine at 2026-12-05 01:40 UTC"``) and the shape
    class it was chosen for."""

    knobs: tuple[tuple[str, str, Any], ...] = ()
    source: str = BUILT_IN
    shape_class: str = ""

    def for_builder(self, builder: str) -> dict[str, Any]:
        """The knobs this schedule sets on ``builder``'s kernels, by name."""
        return {k: v for b, k, v in self.knobs if b == builder}

    def __str__(self) -> str:
        shown = ", ".join(f"{b}.{k}={v}" for b, k, v in self.knobs) or "the manifest's kernel.static"
        return f"{shown} ({self.source}; class {self.shape_class or '-'})"


# ------------------------------------------------------------------------------ shape classes
def token_count(manifest: OpManifest, dims: Mapping[str, int]) -> int | None:
    """The call's token count by the manifest's ``kernel.tune.tokens``: the first expression whose every
    name the call's dims give (None: the manifest buckets no count, or no expression applies)."""
    tune = manifest.kernel.tune
    for expr in (tune.tokens if tune is not None else ()):
        if expr.names <= dims.keys():
            try:
                return int(expr.evaluate(dims))
            except (ExprError, TypeError, ValueError):
                return None
    return None


def bucket(manifest: OpManifest, dims: Mapping[str, int]) -> str | None:
    """A call's token bucket (``tokens<=2048``; above the last edge ``tokens>16384``), or None where the
    manifest buckets no count: the one part of a shape class the call's :class:`CallSpec` does not fix."""
    tune = manifest.kernel.tune
    if tune is None or not tune.buckets:
        return None
    n = token_count(manifest, dims)
    return None if n is None else _edge("tokens", n, tune.buckets)


def _edge(name: str, n: int, edges: tuple[int, ...]) -> str:
    edge = next((b for b in edges if n <= b), None)
    return f"{name}<={edge}" if edge is not None else f"{name}>{edges[-1]}"


def dim_buckets(manifest: OpManifest, dims: Mapping[str, int]) -> list[str]:
    """A call's buckets of the dims ``kernel.tune.dim_buckets`` names (``seq_k<=2048``), in the manifest's
    order; a dim the call lacks (a varlen call's ``seq_k``) gives none."""
    tune = manifest.kernel.tune
    return [_edge(d, int(dims[d]), edges) for d, edges in (tune.dim_buckets if tune is not None else ())
            if d in dims]


def buckets(manifest: OpManifest, dims: Mapping[str, int]) -> tuple[str, ...]:
    """Every bucket part of a call's shape class: its token :func:`bucket`, then its :func:`dim_buckets`
    (with the call's specialization, what tells its class from another's)."""
    tokens = bucket(manifest, dims)
    return ((tokens,) if tokens is not None else ()) + tuple(dim_buckets(manifest, dims))


def shape_class(manifest: OpManifest, call: CallSpec, dims: Mapping[str, int],
                params: Mapping[str, Any]) -> str:
    """The shape class a call's schedule is chosen for: the params ``kernel.tune.by`` names, its dtypes,
    its specialized dims and its :func:`buckets`, as one readable key."""
    tune = manifest.kernel.tune
    parts = [f"{p}={params.get(p)}" for p in (tune.by if tune is not None else ())]
    parts += [f"{n}={d}" for n, d in call.dtypes] + [f"{n}={v}" for n, v in call.dims]
    return ",".join([*parts, *buckets(manifest, dims)])


# ------------------------------------------------------------------------------ devices
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; else what ``platform`` knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _nvidia_driver() -> str:
    """The NVIDIA kernel driver's version (Linux: ``/proc/driver/nvidia/version``), or ``"unknown"``."""
    try:
        with open("/proc/driver/nvidia/version") as f:
            found = re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9][0-9.]*)", f.readline())
        return found.group(1) if found else "unknown"
    except OSError:
        return "unknown"


def device_identity(device: torch.device) -> dict[str, Any]:
    """What a table is kept per: a GPU's name, arch, SM count and driver; a CPU's model, arch and cores."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"kind": "cuda", "name": props.name, "arch": f"sm_{props.major}{props.minor}",
                "sms": props.multi_processor_count, "driver": _nvidia_driver()}
    return {"kind": "cpu", "name": cpu_model(), "arch": platform.machine(), "cores": os.cpu_count() or 1}


def device_slug(identity: Mapping[str, Any]) -> str:
    """A table's file name (without ``.json``) for a device: its name, arch and SMs or cores, no driver."""
    size = f"{identity['sms']}sm" if identity["kind"] == "cuda" else f"{identity['cores']}c"
    words = re.sub(r"[^a-z0-9]+", "-", f"{identity['kind']} {identity['name']} {identity['arch']} {size}".lower())
    return words.strip("-")


def _same_device(a: Mapping[str, Any], b: Mapping[str, Any], driver: bool) -> bool:
    keys = [k for k in ("kind", "name", "arch", "sms", "cores", "driver") if driver or k != "driver"]
    return all(a.get(k) == b.get(k) for k in keys)


# ------------------------------------------------------------------------------ spaces
def candidates(manifest: OpManifest, backend: str) -> list[tuple[tuple[str, str, Any], ...]]:
    """Every point of the manifest's schedule space for ``backend`` that its rules allow, in the
    declared order (the product of the knobs' lists, the last knob fastest); empty without a space."""
    import itertools

    tune = manifest.kernel.tune
    space = tune.spaces.get(backend) if tune is not None else None
    if space is None or not space.knobs:
        return []
    out = []
    for values in itertools.product(*(vals for _, _, vals in space.knobs)):
        point = tuple((b, k, v) for (b, k, _), v in zip(space.knobs, values))
        env = {k: v for _, k, v in point}
        if all(rule.evaluate(env) for rule in space.rules):
            out.append(point)
    return out


def digest_of(manifest: OpManifest, knobs: tuple[tuple[str, str, Any], ...]) -> str:
    """The digest an entry is kept with: of the op's builder and those its knobs set, each builder's
    source with what it uses."""
    import hashlib

    builders = {b for b, _, _ in knobs} | {manifest.kernel.builder}
    h = hashlib.sha256()
    for b in sorted(builders):
        h.update(f"{b}:{builder_digest(b)};".encode())
    return h.hexdigest()[:16]


# ------------------------------------------------------------------------------ tables
def tuned_path(identity: Mapping[str, Any]) -> Path:
    """Where this machine's tuned table for a device is kept."""
    return Path(cache_root()) / "schedules" / f"{device_slug(identity)}.json"


def shipped_dir() -> Path:
    """The folder of the tables shipped with the package (``tileops.kernels``' ``schedules/``)."""
    import tileops.kernels

    return Path(tileops.kernels.__path__[0]) / "schedules"


_lock = threading.Lock()
#: path -> (mtime, size, parsed table or None); a table is read again when its file changes
_tables: dict[str, tuple[float, int, dict | None]] = {}
_warned: set[tuple[str, str]] = set()
#: bumped by :func:`forget_tables`: an op keeps the schedule it chose for a class while this holds
_generation = 0


def generation() -> int:
    """How many times the tables were forgotten (a tuning kept a choice, or :func:`forget_tables`): part of
    the key under which an op keeps a class's schedule, so that what a tuning keeps serves at once."""
    return _generation


def forget_tables() -> None:
    """Drop every table read so far (and the record of warnings given): the next lookup reads the files."""
    global _generation
    with _lock:
        _tables.clear()
        _warned.clear()
        _generation += 1


def _warn_once(path: Path, why: str) -> None:
    key = (str(path), why.split(":", 1)[0])
    if key not in _warned:
        _warned.add(key)
        import warnings

        warnings.warn(f"tileops: ignoring schedule table {path}: {why}", RuntimeWarning, stacklevel=4)


def _parse(path: Path) -> dict:
    """The table in the file at ``path``; OSError or ValueError (what is wrong with it) when there is none."""
    table = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(table, dict) or table.get("format") != FORMAT:
        raise ValueError(f"expected a table of format {FORMAT}")
    if not isinstance(table.get("device"), dict) or not isinstance(table.get("ops"), dict):
        raise ValueError("expected the keys 'device' and 'ops'")
    return table


def _read(path: Path) -> dict | None:
    """The table at ``path`` (None: no file, or one that does not parse, warned about once)."""
    try:
        st = path.stat()
    except OSError:
        return None
    with _lock:
        got = _tables.get(str(path))
        if got is not None and got[:2] == (st.st_mtime, st.st_size):
            return got[2]
    try:
        table = _parse(path)
    except (OSError, ValueError) as e:
        _warn_once(path, f"corrupt: {e}")
        table = None
    with _lock:
        _tables[str(path)] = (st.st_mtime, st.st_size, table)
    return table


def _valid_knobs(raw: Any) -> tuple[tuple[str, str, Any], ...] | None:
    """An entry's ``{builder: {knob: value}}`` as knobs, or None where a builder, knob or value is not
    one the builders declare (``tileops.kernels.STATIC``)."""
    from tileops.kernels import STATIC

    if not isinstance(raw, dict):
        return None
    out = []
    for builder, knobs in sorted(raw.items()):
        if builder not in STATIC or not isinstance(knobs, dict):
            return None
        for knob, value in sorted(knobs.items()):
            if knob not in STATIC[builder]:
                return None
            low, high, _ = STATIC[builder][knob]
            ok = isinstance(value, bool) if (low is False and high is True) else (
                type(value) is int and low <= value <= high)
            if not ok:
                return None
            out.append((builder, knob, value))
    return tuple(out)


def _entry(path: Path, table: dict, manifest: OpManifest, cls: str) -> tuple[tuple, dict] | None:
    ops = table["ops"].get(manifest.name)
    entry = ops.get(cls) if isinstance(ops, dict) else None
    if not isinstance(entry, dict):
        return None
    knobs = _valid_knobs(entry.get("knobs"))
    if knobs is None:
        _warn_once(path, f"corrupt: {manifest.name} {cls}: knobs {entry.get('knobs')!r} are not the builders'")
        return None
    now = digest_of(manifest, knobs)
    if entry.get("digest") != now:
        _warn_once(path, f"stale: {manifest.name} {cls} was tuned for other kernel sources (digest "
                         f"{entry.get('digest')!r}, now {now!r}); tune again")
        return None
    return knobs, entry


def _tables_for(identity: Mapping[str, Any]) -> Iterator[tuple[str, Path, dict]]:
    """``(kind, path, table)`` of the tables that may serve a device, in the order they are asked: this
    machine's tuned one (the same device, driver included), then the shipped one (the driver aside: a
    user's differs from the tuning machine's)."""
    for kind, path in (("tuned", tuned_path(identity)), ("shipped", shipped_dir() / f"{device_slug(identity)}.json")):
        table = _read(path)
        if table is None:
            continue
        if not _same_device(table["device"], identity, driver=kind == "tuned"):
            _warn_once(path, f"another device: made on {table['device']}, this is {identity}")
            continue
        yield kind, path, table


def _source(kind: str, table: dict, entry: dict) -> str:
    if kind == "shipped":
        return f"shipped for {table['device'].get('name', 'this device')}"
    return f"tuned on this machine at {entry.get('tuned', 'an unknown date')}"


_identities: dict[str, dict[str, Any]] = {}


def _identity(device: torch.device) -> dict[str, Any]:
    key = str(device)
    got = _identities.get(key)
    if got is None:
        got = _identities[key] = device_identity(device)
    return got


def choose(manifest: OpManifest, call: CallSpec, dims: Mapping[str, int], params: Mapping[str, Any]) -> Schedule:
    """The schedule for a call of ``manifest`` (``call``, with all its ``dims``) on the device it runs on,
    for an op built with ``target=None`` and served by BUILTIN: this machine's tuned choice for the
    call's shape class, else the shipped one for this device, else the built-in schedule."""
    cls = shape_class(manifest, call, dims, params)
    if manifest.kernel.tune is None:
        return Schedule(shape_class=cls)
    for kind, path, table in _tables_for(_identity(call.device)):
        got = _entry(path, table, manifest, cls)
        if got is not None:
            return Schedule(knobs=got[0], source=_source(kind, table, got[1]), shape_class=cls)
    return Schedule(shape_class=cls)


#: a shape class's bucket part (``tokens<=2048``, ``seq_k>2048``), as :func:`_edge` writes it
_BUCKET = re.compile(r"[A-Za-z_][A-Za-z_0-9]*(<=|>)[0-9]+")


def _unbucketed(cls: str) -> str:
    """A shape class without its bucket parts: what its kernels are keyed by."""
    return ",".join(p for p in cls.split(",") if not _BUCKET.fullmatch(p))


def shipped_for(arch: str) -> "Callable[[OpManifest, CallSpec, Mapping[str, Any], Mapping[str, Any]], list[tuple]]":
    """For a warm-up or the lowered kernels of ``arch`` (``sm_90``; ``c``: the CPU): a function naming
    the schedules the shipped tables of devices of that arch choose for a manifest case's call, other
    than the built-in one, so that what a fresh process there takes is built too
    (:func:`tileops.compile.warmup.kernel_jobs`)."""
    tables = []
    for path in sorted(shipped_dir().glob("*.json")):
        table = _read(path)
        if table is not None and (table["device"].get("arch") == arch if arch != "c"
                                  else table["device"].get("kind") == "cpu"):
            tables.append((path, table))

    def choices(manifest: OpManifest, call: CallSpec, dims: Mapping[str, Any],
                params: Mapping[str, Any]) -> list[tuple]:
        # every bucket's: a case has one token count, but its kernels (keyed by params, dtypes and the
        # specialized dims alone) serve calls of every count, and a table's choice for another bucket
        # (attention's seq_k>2048 classes, which no case reaches) would otherwise compile at a user's
        # first such call
        if manifest.kernel.tune is None:
            return []
        kernel_key = shape_class(manifest, call, {}, params)
        got = []
        for path, table in tables:
            entries = table["ops"].get(manifest.name)  # (a corrupt op entry: _entry warns of none)
            got += [_entry(path, table, manifest, cls) for cls in sorted(entries if isinstance(entries, dict) else ())
                    if _unbucketed(cls) == kernel_key]
        return list(dict.fromkeys(e[0] for e in got if e is not None and e[0]))

    return choices


def space_for(backend: str) -> "Callable[[OpManifest, CallSpec, Mapping[str, Any], Mapping[str, Any]], list[tuple]]":
    """Like :func:`shipped_for`, naming every candidate of a manifest's ``backend`` space instead: the
    kernels ``tileops tune`` builds, compiled ahead (``python -m benchmarks.device_cache --tune``)."""
    return lambda manifest, call, dims, params: candidates(manifest, backend)


def static_for(manifest: OpManifest, call: CallSpec, builder: str | None = None,
               built_in: bool = True) -> dict[str, Any]:
    """The schedule knobs a call's kernels of ``builder`` (default: the manifest's own) are built with:
    the manifest's ``kernel.static`` (its own builder's; not with ``built_in=False``: a backend whose
    schedule the manifest's knobs are not) with the call's chosen schedule over it
    (:attr:`CallSpec.schedule`)."""
    own = manifest.kernel.builder
    builder = builder or own
    out = dict(manifest.kernel.static or {}) if builder == own and built_in else {}
    out.update({k: v for b, k, v in call.schedule if b == builder})
    return out


def record(manifest: OpManifest, device: torch.device, cls: str, knobs: tuple[tuple[str, str, Any], ...],
           stats: Mapping[str, Any], path: "Path | None" = None) -> Path:
    """Keep ``knobs`` as the tuned choice for ``manifest``'s class ``cls`` on ``device`` (``stats``: what
    the tuning measured) in this machine's table (or ``path``), and return the file. A table of
    another device at that path is replaced."""
    identity = device_identity(device)
    path = path or tuned_path(identity)
    try:
        table = _parse(path)
    except (OSError, ValueError):  # none yet, or one that does not parse: replaced
        table = None
    if table is None or not _same_device(table["device"], identity, driver=True):
        table = {"format": FORMAT, "device": identity, "ops": {}}
    nested: dict[str, dict[str, Any]] = {}
    for b, k, v in knobs:
        nested.setdefault(b, {})[k] = v
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    table["ops"].setdefault(manifest.name, {})[cls] = {"knobs": nested, "digest": digest_of(manifest, knobs),
                                                      "tuned": when, **dict(stats)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)  # a reader sees the old table or the new one, never half of one
    forget_tables()
    return path
