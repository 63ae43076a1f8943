"""RMSNorm's CUDA schedule knobs against the manifest's schedule, side by side in one run (bf16, H200).

    python -m benchmarks.norm_schedules            # on a GPU: a markdown table, one line per row and config
    python -m benchmarks.norm_schedules --dry      # anywhere: the rows and each config's kernel specs
    python -m benchmarks.norm_schedules --dry --lower   # and lower every config's kernels for sm_90
    # the cp.async backward against the manifest's, the six backward rows (about 2-3 minutes on an H200):
    python -m benchmarks.norm_schedules --direction backward --configs manifest,m+a1,m+a2,1sync+a1,1sync+a2 --rounds 5

Rows: the backward (dx, dw; and the residual's gradient) of the runner's norm cases of 4 MB and
more, and the per-head forward. Configs are :class:`kernels.norm.NormKernelSpec` knobs set over the
manifest's ``kernel.static`` (the script patches ``tileops.norm.builtin.kernel_specs`` while each
config's op makes its kernels): ``nh1_path`` (no division in row offsets where NH is 1),
``bwd_prefetch`` (rows ahead asked of L2), ``bwd_one_sync`` (one barrier a row), ``bwd_w_shared``
(the weight in shared memory), ``bwd_async`` (the next rows copied to shared memory by cp.async, no
register holding them in flight; its kernels use dynamic shared memory, so TileLang's own nvcc build
compiles them, a few seconds each). Every config's kernels are compiled first, in parallel
(:func:`tileops.compile.warmup.compile_jobs`); each row's configs are timed interleaved over
``ROUNDS`` rounds on the same input sets (:func:`benchmarks.timing.gpu_time`, L2 rotated, the median
of the rounds' medians), beside a same-bytes copy; the forward row also times torch.compile of HF's
math (a fresh static compile) and Liger where it imports. ``diff``: the largest absolute difference
of each output (dx, dw; y) from the "knobs off" config's on the same inputs (want 0: the knobs keep
every summation order).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch

import tileops.norm.builtin as B

#: (label, leading dims, hidden, residual, direction)
ROWS = [
    ("4096 x 8192", (4096,), 8192, False, "backward"),
    ("2048 x 16384", (2048,), 16384, False, "backward"),
    ("16384 x 4096", (16384,), 4096, False, "backward"),
    ("16384 x 4096 + residual", (16384,), 4096, True, "backward"),
    ("65536 x 2048", (65536,), 2048, False, "backward"),
    ("per head 16384 x 32 x 128", (16384, 32), 128, False, "backward"),
    ("per head 16384 x 32 x 128", (16384, 32), 128, False, "forward"),
]
#: every knob off: the schedule before the knobs
OFF = {"bwd_prefetch": 0, "bwd_one_sync": 0, "bwd_w_shared": 0, "nh1_path": 0, "bwd_async": 0}
#: config -> its knobs, each config setting all five (whatever the manifest sets), but "manifest", which
#: sets none: the manifest's own, and the "m+" configs, which set theirs over the manifest's (``bwd_w_shared``
#: and ``bwd_one_sync`` at 8192 wide and more or with a residual: ``tileops.norm.builtin.kernel_specs``). The
#: first is the reference the others' outputs are compared with.
CONFIGS = {
    "knobs off": OFF,
    "manifest": {},
    **{name: {**OFF, **fields} for name, fields in {
        "nh1": dict(nh1_path=1),
        "pf1": dict(bwd_prefetch=1),
        "pf2": dict(bwd_prefetch=2),
        "ws+1sync": dict(bwd_w_shared=1, bwd_one_sync=1),
        "ws+1sync+pf1": dict(bwd_w_shared=1, bwd_one_sync=1, bwd_prefetch=1),
        "ws+1sync+pf2": dict(bwd_w_shared=1, bwd_one_sync=1, bwd_prefetch=2),
        "all pf2": dict(bwd_w_shared=1, bwd_one_sync=1, bwd_prefetch=2, nh1_path=1),
        "pf2+nh1": dict(bwd_prefetch=2, nh1_path=1),
        "ws+1sync+nh1": dict(bwd_w_shared=1, bwd_one_sync=1, nh1_path=1),
        # cp.async one and two rows ahead with the weight in registers (its shared memory would cost the
        # residual row at 4096 wide a block an SM: 4 x 57 KB is past an SM's 228 KB) and one barrier a row
        "1sync+a1": {"nh1_path": 1, "bwd_one_sync": 1, "bwd_async": 1},
        "1sync+a2": {"nh1_path": 1, "bwd_one_sync": 1, "bwd_async": 2},
    }.items()},
    # cp.async over the manifest's schedule
    "m+a1": {"bwd_async": 1},
    "m+a2": {"bwd_async": 2},
}
#: the configs a forward row times (the other knobs are the backward's)
FORWARD_CONFIGS = ("knobs off", "manifest", "nh1")
ROUNDS = 3
OP = "RMSNormFwdOp"
ORIG = B.kernel_specs


def with_fields(spec, fields: dict):
    """``spec`` with the knobs of ``fields`` that act on its kind (``bwd_*`` the backward's alone; the
    weight sum none), so that configs differing only there share one forward kernel."""
    mine = {k: v for k, v in fields.items() if spec.kind == "bwd" or (spec.kind == "fwd" and not k.startswith("bwd_"))}
    return dataclasses.replace(spec, **mine) if mine else spec


def patch(fields: dict) -> None:
    """Make ``tileops.norm.builtin`` build its forward and backward kernels with ``fields`` set."""
    def specs(*a, **k):
        return [(b, with_fields(s, fields)) for b, s in ORIG(*a, **k)]

    B.kernel_specs = specs if fields else ORIG


#: the configs a run measures (``--configs``; default: all)
CHOSEN: set[str] | None = None


def configs_of(direction: str) -> dict:
    return {n: c for n, c in CONFIGS.items() if (direction == "backward" or n in FORWARD_CONFIGS)
            and (CHOSEN is None or n in CHOSEN or n == "knobs off")}


def jobs(arch: str) -> list:
    """Every (builder, spec, backend, arch) compile job of every row and config."""
    from tileops.compile.warmup import op_kernel_jobs

    out = []
    for _, lead, hidden, residual, direction in ROWS:
        base = op_kernel_jobs(OP, {}, {"hidden": hidden}, ["bfloat16"], arch,
                              with_inputs=["residual"] if residual else [], backward=direction == "backward")
        for fields in configs_of(direction).values():
            out += [(b, with_fields(s, fields), be, ar) for b, s, be, ar in base]
    return list(dict.fromkeys(out))


def inputs(lead, hidden, residual, gen) -> dict:
    x = torch.randn(*lead, hidden, generator=gen).to(torch.bfloat16)
    w = (torch.randn(hidden, generator=gen) * 0.2 + 1).to(torch.bfloat16)
    got = {"x": x, "weight": w}
    if residual:
        got["residual"] = torch.randn(*lead, hidden, generator=gen).to(torch.bfloat16)
    return {k: v.cuda() for k, v in got.items()}


def row_bytes(x: torch.Tensor, residual: bool, direction: str) -> int:
    """Bytes the row must move (as benchmarks.runner counts them): forward x (and the residual) read, y
    (and h) written; backward dy, x (h) read, dx written, and with a residual h's gradient read; the
    weight once each way."""
    n = x.numel() * x.element_size()
    w = x.shape[-1] * x.element_size()
    if direction == "forward":
        return n * (4 if residual else 2) + w
    return n * (4 if residual else 3) + 2 * w


def make_op(fields: dict, first: dict, direction: str):
    """An op whose kernels are built with ``fields``: its first call (and backward) run while patched."""
    from tileops.norm import RMSNormFwdOp

    patch(fields)
    try:
        op = RMSNormFwdOp(eps=1e-6)
        out = call(op, first, direction)
    finally:
        patch({})
    impl = next(iter(op._impls.values()))
    spec = impl.bwd_spec if direction == "backward" else impl.spec
    for k, v in fields.items():
        assert getattr(spec, k) == v, (k, spec)
    return op, out


def call(op, s: dict, direction: str):
    """The row's outputs on input set ``s``: y (forward); dx, dw (and dresidual) (backward)."""
    if direction == "forward":
        return (op(**s),)
    graph = grad_graph(op, s)
    return torch.autograd.grad(*graph, retain_graph=True)


def grad_graph(op, s: dict):
    """(outputs, leaves, output gradients) of one call with x, weight (and residual) requiring grad."""
    leaves = {k: v.detach().requires_grad_(True) for k, v in s.items()}
    out = op(**leaves)
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator(device="cuda").manual_seed(7)
    return outs, list(leaves.values()), [torch.randn(o.shape, generator=g, device="cuda").to(o.dtype) for o in outs]


def timer(op, sets: list, direction: str):
    """``fn(i)``: one timed call on input set ``i`` (backward: autograd.grad of a graph built once per set)."""
    if direction == "forward":
        return lambda i: op(**sets[i])
    graphs = [grad_graph(op, s) for s in sets]
    return lambda i: torch.autograd.grad(*graphs[i], retain_graph=True)


def baselines(lead, hidden, sets: list) -> dict:
    """torch.compile of HF's math (fresh static compile) and Liger, for the forward, where they run."""
    from benchmarks.baselines import liger_baseline, make_baseline
    from benchmarks.runner import fresh_compile
    from benchmarks.timing import gpu_time
    from tileops.norm import RMSNormFwdOp

    op = RMSNormFwdOp(eps=1e-6)
    out = {}
    try:
        fn, _ = make_baseline(op, sets[0])
        cfn = fresh_compile(fn)
        bargs = [make_baseline(op, s)[1] for s in sets]
        out["torch.compile"] = gpu_time(lambda i: cfn(*bargs[i]), len(sets))[0]
    except Exception as e:  # noqa: BLE001 - a baseline that fails is reported, not fatal
        print(f"torch.compile failed: {type(e).__name__}: {e}", file=sys.stderr)
    lg = liger_baseline(op, sets[0])
    if lg is not None:
        largs = [liger_baseline(op, s)[1] for s in sets]
        out["Liger"] = gpu_time(lambda i: lg[0](*largs[i]), len(sets))[0]
    return out


def max_diff(a, b) -> float:
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry", action="store_true", help="no GPU: print the rows' kernel specs per config")
    ap.add_argument("--lower", action="store_true", help="with --dry: lower every kernel for sm_90")
    ap.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--configs", help="comma-separated configs to measure beside 'knobs off' (default: all)")
    ap.add_argument("--rounds", type=int, default=ROUNDS, help=f"interleaved rounds per row (default {ROUNDS})")
    ap.add_argument("--direction", choices=("forward", "backward"), help="only the rows of this direction")
    a = ap.parse_args()
    global CHOSEN, ROWS
    if a.direction:
        ROWS = [r for r in ROWS if r[4] == a.direction]
    if a.configs:
        CHOSEN = set(a.configs.split(","))
        unknown = CHOSEN - set(CONFIGS)
        if unknown:
            ap.error(f"--configs: unknown {sorted(unknown)}; known: {', '.join(CONFIGS)}")
    if a.dry or not torch.cuda.is_available():
        todo = jobs("sm_90")
        for _, s, _, _ in todo:
            print(s)
        if a.lower:
            from tileops.compile import build, cuda_build

            for b, s, _, arch in todo:
                t0 = time.perf_counter()
                try:
                    src = cuda_build.lower_sources(build.prim_func(b, s), arch, build.PASS_CONFIGS)
                except cuda_build.Unsupported as e:  # (bwd_async's dynamic shared memory: TileLang's own build)
                    print(f"lowered in {time.perf_counter() - t0:.1f} s, built by TileLang ({e}): {s.kind} {s.hidden}")
                    continue
                print(f"lowered in {time.perf_counter() - t0:.1f} s ({len(src.device)} chars): {s.kind} {s.hidden}")
        return 0

    from benchmarks.timing import gpu_time, rotation, same_bytes_copy_us
    from tileops.compile.build import device_backend
    from tileops.compile.warmup import compile_jobs

    t0 = time.perf_counter()
    n, secs, failures = compile_jobs(jobs(device_backend(torch.device("cuda"))[1]), jobs=a.jobs, progress=False)
    print(f"compiled {n} kernels in {secs:.0f} s; failures: {[f'{s}: {e[:200]}' for s, e in failures]}", flush=True)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, {a.rounds} rounds\n")
    print("| row | direction | config | us | % same-bytes copy | copy us | max abs diff vs knobs off |")
    print("|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for label, lead, hidden, residual, direction in ROWS:
        first = inputs(lead, hidden, residual, gen)
        nbytes = row_bytes(first["x"], residual, direction)
        sets = [first] + [inputs(lead, hidden, residual, gen) for _ in range(rotation(nbytes) - 1)]
        copy_us = same_bytes_copy_us(nbytes)
        ops, fns, diffs, ref = {}, {}, {}, None
        for name, fields in configs_of(direction).items():
            try:
                ops[name], out = make_op(fields, first, direction)
            except Exception as e:  # noqa: BLE001 - a config that fails is reported, not fatal
                print(f"| {label} | {direction} | {name} | failed: {type(e).__name__}: {str(e)[:160]} | | | |")
                continue
            ref = out if ref is None else ref
            diffs[name] = max_diff(out, ref)
            fns[name] = timer(ops[name], sets, direction)
        times = {name: [] for name in fns}
        for _ in range(a.rounds):  # interleaved, so that a drift of the clocks hits every config alike
            for name, fn in fns.items():
                times[name].append(gpu_time(fn, len(sets))[0])
        for name in fns:
            us = statistics.median(times[name])
            print(f"| {label} | {direction} | {name} | {us:.1f} | {100 * copy_us / us:.0f} | {copy_us:.1f} | "
                  f"{diffs[name]:.3g} |", flush=True)
        if direction == "forward":
            for name, us in baselines(lead, hidden, sets).items():
                print(f"| {label} | {direction} | {name} | {us:.1f} | {100 * copy_us / us:.0f} | {copy_us:.1f} | |",
                      flush=True)
        del ops, fns, sets, first
        torch.cuda.empty_cache()
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
