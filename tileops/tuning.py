"""The tuner: candidates of an op's schedule space, checked, timed, and the fastest kept.

``op.tune(*inputs)`` and ``tileops tune`` come here. For one shape class (:mod:`tileops.schedules`)
and the calls that stand for it:

1. the built-in schedule is run and timed first: the baseline every candidate must beat;
2. each candidate of the manifest's space for the device's backend (``kernel.tune``, its rules
   applied; their kernels compiled a batch at a time, in parallel: :func:`_builder`) is built as an
   op of its own, run on every call and **checked against the family's
   float64 reference** (``tileops.<family>.reference``: the output, and the gradients where the knobs
   reach a backward's kernels and the reference has them: :func:`_backward_checked`; an input the op
   writes, a KV cache, against the built-in schedule's writes) before it is timed; on CUDA a call is
   timed with events over copies of its inputs that pass the L2 cache (:func:`_gpu_seconds`). A
   candidate that fails to build, or whose result misses the dtype's tolerance
   (:mod:`tileops.tolerances`), is dropped and reported, never chosen;
3. the fastest, if it beat the built-in schedule by more than :data:`MARGIN` in the search, is timed
   again against it, the two alternated over :data:`CONFIRM_ROUNDS` rounds; it is kept in this
   machine's table for the class only if it wins that by the margin too. Otherwise the built-in
   schedule is kept, as measured.

A space of up to :data:`EXHAUSTIVE` points is searched whole; a larger one one knob at a time from its
first point (each knob's values with the others held at the best so far, twice over the knobs).
``budget`` seconds bound the search: the best found by then is kept. A class whose budget ends before
any candidate is tried keeps nothing: an entry then would say "tuned" of a search that never ran.
"""

from __future__ import annotations

import importlib
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from . import schedules
from .progress import Progress, wanted
from .targets import BUILTIN
from .tolerances import tolerance

__all__ = ["tune", "tune_calls", "Trial", "Result", "MARGIN", "EXHAUSTIVE"]

#: a candidate is chosen over the built-in schedule only when its time is below (1 - MARGIN) of the
#: built-in's: the spread of medians of one call timed twice in a row on a shared machine (the H200's
#: host table moved 5-30% between rounds; this 2-core CPU's medians ~2%), so that noise never picks
MARGIN = 0.03
#: the largest space searched point by point; a larger one is searched a knob at a time
EXHAUSTIVE = 64
#: CUDA: a timed pass over a call's input sets moves this many times the L2 cache (:meth:`_Call.rotation`)
L2_PASSES = 3
#: CUDA: the most input sets a call rotates through (a small call's copies stay small: 16 of decode's
#: 32 rows of 4,096 are 4 MB)
MAX_SETS = 16
#: CUDA: the fewest calls a timed pass makes (the rotation's sets, cycled)
MIN_PASS_CALLS = 16
#: CUDA: the side of the bf16 matrix products that hold the GPU while a pass queues (~0.2 ms each on an H200)
HOLD_N = 4096
#: rounds of the confirmation that a search's best beats the built-in schedule (:func:`_confirm`)
CONFIRM_ROUNDS = 5


@dataclass
class Trial:
    """One candidate's outcome: its knobs, its time (seconds, summed over the calls: the medians), or
    why it was dropped."""

    knobs: tuple[tuple[str, str, Any], ...]
    seconds: float | None = None
    dropped: str | None = None

    def label(self) -> str:
        return ", ".join(f"{k}={v}" for _, k, v in self.knobs) or "built-in"


@dataclass
class Result:
    """What a tuning found for one shape class: the schedule kept, and every trial."""

    op: str
    shape_class: str
    chosen: schedules.Schedule
    baseline: Trial
    trials: list[Trial] = field(default_factory=list)
    seconds: float = 0.0  # the tuning's own wall time
    #: the search's best timed again against the built-in schedule, alternated (:func:`_confirm`):
    #: ``(its knobs, its seconds, the built-in's seconds)``; None where the search found no contender
    confirmed: tuple[tuple, float, float] | None = None

    @property
    def best(self) -> Trial:
        timed = [t for t in self.trials if t.seconds is not None]
        return min(timed, key=lambda t: t.seconds) if timed else self.baseline

    @property
    def dropped(self) -> list[Trial]:
        return [t for t in self.trials if t.dropped is not None]


def _reference(family: str) -> Any:
    return importlib.import_module(f"tileops.{family}.reference")


def _backward_knobs(manifest: Any, space: list) -> bool:
    """Whether the space sets a knob of a builder other than the forward's: the backward's kernels
    (``attention_bwd``), whose time then counts."""
    own = manifest.kernel.builder
    return manifest.backward is not None and any(b != own for point in space for b, _, _ in point)


def _backward_checked(manifest: Any, space: list) -> bool:
    """Whether a candidate's gradients are checked: where its knobs reach a backward's kernels, those of
    another builder (``attention_bwd``) or the backward the forward's own builder makes with the same
    knobs (RoPE's), and the family's reference has float64 gradients (``grads``). A family without them
    declares only forward knobs (the norm's space: the forward's vectors and row groups)."""
    if manifest.backward is None:
        return False
    return _backward_knobs(manifest, space) or hasattr(_reference(manifest.family), "grads")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Call:
    """One call a trial runs: its inputs, the float64 reference, and the output gradient (backward)."""

    def __init__(self, op: Any, inputs: Mapping[str, torch.Tensor], backward: bool, seed: int,
                 timed_backward: bool | None = None):
        m = op.manifest
        self.inputs = dict(inputs)
        self.device = next(t.device for t in self.inputs.values() if isinstance(t, torch.Tensor))
        self.wrt = [n for n in (m.backward.wrt if backward else ()) if self.inputs.get(n) is not None]
        #: whether a timed run takes the gradients too (checked runs always do where ``wrt`` names any)
        self.timed_backward = bool(self.wrt) if timed_backward is None else timed_backward and bool(self.wrt)
        fam = _reference(m.family)
        self.ref = fam.reference(op, self.inputs)
        self.scale = fam.scale(op, self.inputs) if hasattr(fam, "scale") else self.ref.abs()
        #: (atol, rtol) of the call's first floating input's dtype
        self.tolerance = tolerance(next(t.dtype for t in self.inputs.values()
                                        if t is not None and t.is_floating_point()))
        self.grad_out = None
        self.grad_refs: dict[str, torch.Tensor] = {}
        # inputs the op writes (a KV cache): each checked run starts from their contents as given, and
        # what it writes is held to the built-in schedule's writes (:meth:`keep_writes`)
        self.written = [t.name for t in m.inputs if t.written and self.inputs.get(t.name) is not None]
        self._given = {n: self.inputs[n].clone() for n in self.written}
        self.writes: dict[str, torch.Tensor] = {}
        self._rotation: list[Mapping[str, Any]] | None = None
        if self.wrt:
            if not hasattr(fam, "grads"):
                raise ValueError(f"{m.name}: the space sets backward knobs, and tileops.{m.family}.reference "
                                 f"has no float64 gradients to check them against")
            gen = torch.Generator().manual_seed(seed)
            first = self.inputs[m.outputs[0].like]
            self.grad_out = torch.randn(first.shape, generator=gen, dtype=torch.float32).to(first.dtype).to(
                first.device)
            self.grad_refs = fam.grads(op, self.inputs, self.grad_out)

    def run(self, op: Any, inputs: Mapping[str, Any] | None = None,
            timed: bool = False) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The op's output and the gradients of ``wrt`` (none without a backward; ``timed``: only where
        the backward's time counts), on ``inputs`` (default: the call's own; :meth:`rotation` gives
        copies)."""
        inputs = self.inputs if inputs is None else inputs
        if not self.wrt or (timed and not self.timed_backward):
            with torch.no_grad():
                out = op(**inputs)
            return (out[0] if isinstance(out, tuple) else out), ()
        leaves = {n: inputs[n].detach().clone().requires_grad_(True) for n in self.wrt}
        out = op(**{**inputs, **leaves})
        first = out[0] if isinstance(out, tuple) else out
        got = torch.autograd.grad(first, list(leaves.values()), self.grad_out, allow_unused=True)
        # an input the first output does not read (RoPE's key) has no gradient from it: zeros
        return first.detach(), tuple(torch.zeros_like(leaf) if g is None else g
                                     for g, leaf in zip(got, leaves.values()))

    def checked_run(self, op: Any) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
        """:meth:`run` on the call's inputs with the written ones as given (fresh copies): the output,
        the gradients, and what the op wrote into each written input."""
        inputs = {**self.inputs, **{n: t.clone() for n, t in self._given.items()}}
        out, grads = self.run(op, inputs)
        return out, grads, {n: inputs[n] for n in self.written}

    def keep_writes(self, op: Any) -> None:
        """Run the built-in schedule ``op`` once and keep what it writes: the reference a candidate's
        writes are checked against (the family's float64 reference gives the outputs alone; the
        built-in schedule's writes are what the generated tests check against float64)."""
        self.writes = self.checked_run(op)[2]

    def rotation(self) -> list[Mapping[str, Any]]:
        """The call's inputs and copies of them (CUDA): enough sets that one pass over them moves
        :data:`L2_PASSES` times the GPU's L2 cache, so that a timed call reads its inputs from memory as a
        model's call does, not from the L2 the previous call left them in (at most :data:`MAX_SETS`)."""
        if self._rotation is None:
            nbytes = sum(t.numel() * t.element_size() for t in self.inputs.values() if isinstance(t, torch.Tensor))
            l2 = getattr(torch.cuda.get_device_properties(self.device), "L2_cache_size", 50 << 20)
            n = max(1, min(MAX_SETS, math.ceil(L2_PASSES * l2 / max(nbytes, 1))))
            copies = [{k: (t.clone() if isinstance(t, torch.Tensor) else t) for k, t in self.inputs.items()}
                      for _ in range(n - 1)]
            self._rotation = [self.inputs, *copies]
        return self._rotation

    def check_writes(self, writes: Mapping[str, torch.Tensor]) -> str | None:
        """Why a candidate's writes miss the built-in schedule's, or None. Each is within ``atol + rtol *
        |t|`` of the true value ``t``, so the two differ by at most ``2 * atol + 2 * rtol * |t|``, and
        ``|t| <= (|built-in| + atol) / (1 - rtol)``: the bound, in the written tensor's own dtype
        (a float8 cache: its stored units, the scales being the same)."""
        for name, want in self.writes.items():
            atol, rtol = tolerance(want.dtype)
            got, ref = writes[name].detach().cpu().double(), want.detach().cpu().double()
            if not bool(torch.equal(torch.isnan(got), torch.isnan(ref))):
                return f"{name}: NaN where the built-in schedule wrote none, or none where it did"
            bound = 2 * atol + 2 * rtol * (ref.abs() + atol) / (1 - rtol)
            bad = ~((got - ref).abs() <= bound) & ~torch.isnan(ref)
            if bool(bad.any()):
                i = tuple(int(j) for j in bad.nonzero()[0])
                return (f"{name} written off at {list(i)}: {got[i].item():.6g}, the built-in schedule wrote "
                        f"{ref[i].item():.6g}")
        return None

    def check(self, out: torch.Tensor, grads: tuple[torch.Tensor, ...]) -> str | None:
        """Why a trial's result misses the reference, or None: each output element within ``atol + rtol
        * scale`` of the float64 value (the generated tests' bound); each gradient, whose float64
        terms cancel, within ``atol + rtol * max |reference|`` (a wrong tile is off by the values' size)."""
        atol, rtol = self.tolerance
        got = out.detach().cpu().double()
        if not bool(torch.isfinite(got).all()):
            return "a non-finite output"
        err = (got - self.ref).abs()
        bad = err > atol + rtol * self.scale
        if bool(bad.any()):
            i = tuple(int(j) for j in bad.nonzero()[0])
            return f"output off at {list(i)}: {got[i].item():.6g}, want {self.ref[i].item():.6g}"
        for name, g in zip(self.wrt, grads):
            ref = self.grad_refs[name]
            g = g.detach().cpu().double()
            worst = float((g - ref).abs().max()) if g.numel() else 0.0
            if not math.isfinite(worst) or worst > atol + rtol * float(ref.abs().max() if ref.numel() else 0.0):
                return f"gradient of {name} off by {worst:.3g}"
        return None


def _candidate(op: Any, knobs: tuple) -> Any:
    """A new op like ``op``, served by BUILTIN with the schedule ``knobs`` (empty: the built-in one)."""
    cand = type(op)(**op.params, target=BUILTIN)
    cand._forced_schedule = knobs
    return cand


class _Hold:
    """Public work that keeps a GPU busy while the host queues a timed pass behind it: matrix products
    of :data:`HOLD_N` squared bf16, each timed once. Without it a pass of calls shorter than their host
    time times the host's launches, not the kernels: the first tuning on the H200 measured the prologue
    at 2,048 tokens at 19.4-22.0 us a call (bf16, fp16) where the runner's GPU time is 16.7 us, and
    ranked its candidates by that noise (its best 14% ahead in the search, no win confirmed)."""

    def __init__(self, device: torch.device):
        gen = torch.Generator(device=device).manual_seed(0)
        self.a = torch.randn(HOLD_N, HOLD_N, device=device, dtype=torch.bfloat16, generator=gen)
        self.out = torch.empty_like(self.a)
        for _ in range(3):
            torch.matmul(self.a, self.a, out=self.out)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            torch.matmul(self.a, self.a, out=self.out)
        end.record()
        end.synchronize()
        self.seconds = max(start.elapsed_time(end) * 1e-3 / 10, 1e-6)

    def hold(self, seconds: float) -> None:
        """Queue about ``seconds`` of GPU work (at most one second's)."""
        for _ in range(min(int(seconds / self.seconds) + 1, int(1.0 / self.seconds) + 1)):
            torch.matmul(self.a, self.a, out=self.out)


_holds: dict[str, _Hold] = {}


def _gpu_seconds(op: Any, c: _Call, reps: int) -> float:
    """One call's GPU time: the median over ``reps`` passes of a pass's CUDA-event time over the call's
    :meth:`_Call.rotation` (at least :data:`MIN_PASS_CALLS` calls), divided by its calls. Each pass is
    queued behind work that holds the GPU for twice the host time of a pass (:class:`_Hold`), so that
    its calls run back to back: what is timed is the kernels', not the host's launches."""
    sets = c.rotation()
    calls = [sets[i % len(sets)] for i in range(max(len(sets), MIN_PASS_CALLS))]
    stream = torch.cuda.current_stream(c.device)
    hold = _holds.get(str(c.device))
    if hold is None:
        hold = _holds[str(c.device)] = _Hold(c.device)
    torch.cuda.synchronize(c.device)
    t0 = time.perf_counter()
    for inputs in calls:  # the host time of a pass, the GPU free
        c.run(op, inputs, timed=True)
    host = time.perf_counter() - t0
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(c.device)
        hold.hold(2 * host)
        start.record(stream)
        for inputs in calls:
            c.run(op, inputs, timed=True)
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / len(calls))
    return statistics.median(times)


def _seconds(op: Any, calls: list[_Call], reps: int) -> float:
    """``op``'s time on ``calls``: the sum of each call's median of ``reps`` runs (CUDA: of passes over its
    rotation, :func:`_gpu_seconds`)."""
    total = 0.0
    for c in calls:
        if c.device.type == "cuda":
            total += _gpu_seconds(op, c, reps)
            continue
        times = []
        for _ in range(reps):
            _sync(c.device)
            t0 = time.perf_counter()
            c.run(op, timed=True)
            _sync(c.device)
            times.append(time.perf_counter() - t0)
        total += statistics.median(times)
    return total


def _trial(op: Any, knobs: tuple, calls: list[_Call], reps: int) -> Trial:
    """Build an op with ``knobs`` forced, check it on every call, then time it (seconds: the sum of
    each call's median)."""
    trial = Trial(knobs)
    try:
        cand = _candidate(op, knobs)
        results = [c.checked_run(cand) for c in calls]  # builds its kernels
    except Exception as e:  # a candidate its builder or compiler refuses is dropped, never fatal
        trial.dropped = f"does not build or run: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return trial
    for c, (out, grads, writes) in zip(calls, results):
        why = c.check(out, grads) or c.check_writes(writes)
        if why is not None:
            trial.dropped = f"wrong: {why}"
            return trial
    trial.seconds = _seconds(cand, calls, reps)
    return trial


def _confirm(op: Any, knobs: tuple, calls: list[_Call], reps: int, rounds: int = CONFIRM_ROUNDS) -> tuple[float, float]:
    """(the candidate's, the built-in schedule's) seconds: each the median of ``rounds`` medians, the
    two timed in turn in every round, so that a drift of the machine reaches both alike."""
    ops = [_candidate(op, knobs), _candidate(op, ())]
    got: list[list[float]] = [[], []]
    for _ in range(rounds):
        for i, o in enumerate(ops):
            got[i].append(_seconds(o, calls, reps))
    return statistics.median(got[0]), statistics.median(got[1])


def _builder(op: Any, calls: list[Any], device: torch.device, backward: bool,
             progress: bool | None) -> Callable[[list[tuple]], None]:
    """What :func:`_search` hands each batch of points: their kernels for ``calls`` (the
    :class:`~tileops.manifest.CallSpec` of each; the backward's kernels too where a candidate's gradients
    are checked), compiled at once, one process a CPU, into the disk cache the trials then load from. One
    after another in the trials, the H200's first ``tileops tune AttnFwdOp`` spent 15-22 s a candidate
    compiling (381 s for 21 of 24), its 16 CPUs one at a time. A kernel that fails to build here is built
    again by its trial, which drops the candidate with the error."""
    from .compile.build import device_backend
    from .compile.warmup import compile_jobs, schedule_jobs

    arch = device_backend(device)[1]

    def build(points: list[tuple]) -> None:
        jobs = [j for call in dict.fromkeys(calls) for j in schedule_jobs(op.manifest, op.params, call, points, arch,
                                                                           backward)]
        compile_jobs(jobs, progress=progress)

    return build


def _search(space: list[tuple], run: Callable[[tuple], Trial], deadline: float,
            build: Callable[[list[tuple]], None] = lambda points: None) -> list[Trial]:
    """Trials over ``space``: every point when it is small, else one knob at a time from the best.
    ``build`` is handed each batch of points before they are visited (all of a small space; a knob's
    values, the others held), to compile their kernels at once (:func:`_builder`)."""
    trials: list[Trial] = []
    seen: set[tuple] = set()

    def visit(batch: list[tuple]) -> None:
        batch = [p for p in dict.fromkeys(batch) if p not in seen]
        if not batch or time.monotonic() > deadline:
            return
        build(batch)
        for point in batch:
            if time.monotonic() > deadline:
                return
            seen.add(point)
            trials.append(run(point))

    if len(space) <= EXHAUSTIVE:
        visit(space)
        return trials
    allowed = set(space)
    names = [(b, k) for b, k, _ in space[0]]
    values = {bk: sorted({v for p in space for (b, k, v) in p if (b, k) == bk}) for bk in names}
    best_point = space[0]
    for _ in range(2):
        for bk in names:
            visit([p for v in values[bk]
                   if (p := tuple((b, k, (v if (b, k) == bk else pv)) for (b, k, pv) in best_point)) in allowed])
            timed = [t for t in trials if t.seconds is not None]
            if timed:
                best_point = min(timed, key=lambda t: t.seconds).knobs
    return trials


def tune_calls(op: Any, calls: list[Mapping[str, torch.Tensor]], *, budget: float | None = None,
               progress: bool | None = None, reps: int | None = None, record: bool = True,
               label: str = "") -> Result:
    """Tune ``op``'s schedule for one shape class, which every call of ``calls`` (input name -> tensor)
    must have; keep the choice (``record``) in this machine's table. See the module's doc."""
    m = op.manifest
    if budget is not None and not (isinstance(budget, (int, float)) and budget > 0):
        raise ValueError(f"{m.name}.tune: budget: expected seconds > 0 (or None for the whole space), got {budget!r}")
    if op._fixed_target is not None and op._fixed_target.name != BUILTIN:
        raise ValueError(f"{m.name}.tune: served by target {op._fixed_target.name!r}, whose kernels tileops does "
                         f"not schedule; tune an op built with target=None or BUILTIN")
    first = next(t for t in calls[0].values() if isinstance(t, torch.Tensor))
    device = first.device
    backend = "cuda" if device.type == "cuda" else "c"
    space = schedules.candidates(m, backend)
    if not space:
        raise ValueError(f"{m.name}.tune: the manifest declares no schedule space for the {backend} backend "
                         f"(kernel.tune.{backend}); nothing to tune on {device.type}")
    t0 = time.monotonic()
    deadline = t0 + budget if budget is not None else math.inf
    base_op = type(op)(**op.params, target=BUILTIN)
    classes, call_specs = set(), []
    for c in calls:
        call_specs.append(base_op._check_call(c))
        classes.add(base_op.schedule.shape_class)
    if len(classes) != 1:
        raise ValueError(f"{m.name}.tune: the calls are of several shape classes ({', '.join(sorted(classes))}); "
                         f"tune each on its own")
    cls = classes.pop()
    checked, timed = _backward_checked(m, space), _backward_knobs(m, space)
    prepared = [_Call(base_op, c, checked, seed=1000 + i, timed_backward=timed) for i, c in enumerate(calls)]
    for c in prepared:
        c.keep_writes(base_op)
    reps = reps or (20 if device.type == "cuda" else 5)
    show = wanted(progress)
    # the search's visits: every point, or about each knob's values once (a knob at a time)
    visits = len(space) if len(space) <= EXHAUSTIVE else sum(len(v) for _, _, v in m.kernel.tune.spaces[backend].knobs)
    with Progress(visits + 1, f"tuning {m.name} {label or cls}", show=show) as bar:
        baseline = _trial(op, (), prepared, reps)
        if baseline.dropped is not None:
            raise ValueError(f"{m.name}.tune: the built-in schedule itself fails its check ({baseline.dropped}); "
                             f"not tuning against it")
        bar.step(f"built-in: {baseline.seconds * 1e6:.1f} us")

        def run(point: tuple) -> Trial:
            trial = _trial(op, point, prepared, reps)
            bar.step(f"{trial.label()}: " + (f"{trial.seconds * 1e6:.1f} us" if trial.seconds is not None
                                             else f"DROPPED ({trial.dropped})"))
            return trial

        trials = _search(space, run, deadline, _builder(base_op, call_specs, device, checked, show))
    result = Result(m.name, cls, schedules.Schedule(shape_class=cls), baseline, trials)
    best = result.best
    chosen: tuple = ()
    builtin_s = chosen_s = baseline.seconds
    if best.seconds is not None and best.seconds < baseline.seconds * (1 - MARGIN):
        # a search's best is the luckiest draw among many: timed again against the built-in schedule,
        # alternated, before it is kept (on the 2-core CPU, picks 4% ahead in the search were 0.4% in
        # such a rerun)
        ours, theirs = _confirm(op, best.knobs, prepared, reps)
        result.confirmed = (best.knobs, ours, theirs)
        builtin_s = chosen_s = theirs
        if ours < theirs * (1 - MARGIN):
            chosen, chosen_s = best.knobs, ours
    for t in result.dropped:
        print(f"tileops tune: {m.name} {cls}: dropped {t.label()}: {t.dropped}", file=sys.stderr)
    result.seconds = time.monotonic() - t0
    if not trials:
        result.chosen = schedules.Schedule(source="not kept: the budget ended before any candidate was tried",
                                           shape_class=cls)
    elif record:
        schedules.record(m, device, cls, chosen, {
            "us": round(chosen_s * 1e6, 2), "builtin_us": round(builtin_s * 1e6, 2),
            "candidates": len(space), "tried": len(trials), "dropped": len(result.dropped),
            "tuning_s": round(result.seconds, 1), "calls": len(calls)})
        fresh = type(op)(**op.params)  # target=None: what such an op now takes for the class
        fresh._check_call(calls[0])
        result.chosen = fresh.schedule
    else:
        result.chosen = schedules.Schedule(knobs=chosen, source="not kept", shape_class=cls)
    return result


def tune(op: Any, inputs: Mapping[str, torch.Tensor], *, budget: float | None = None,
         progress: bool | None = None) -> schedules.Schedule:
    """``op.tune``: tune for the shape class of one call, keep the choice, return the schedule that now
    serves the class."""
    return tune_calls(op, [inputs], budget=budget, progress=progress).chosen
