"""Every op, forward and backward, under NVIDIA's compute-sanitizer (issue 12): ``python -m benchmarks.sanitize``.

The calls (``calls()``) cover every manifest case of every op (inputs scaled down by the manifest's
``cpu_shrink``), forward and backward, and on top of that, for the base op in 2d and the
position-ids op: head_dim 2, 64, 80, 96, 128, 256 and 512; 1 and 80 heads and a GQA key; lengths 1,
7 and 129 (partial tiles) and 8195 (the head-major kernel); ``key=``, ``out=`` into NaN-filled tensors, in place, HF's transposed
views, a fused qkv buffer, a misaligned view (the copy fallback); positions 0 and 2^24 - 1 (the
largest supported) and out-of-range positions, which must be reported while memcheck stays clean.
Every result is checked against the float64 references of ``tests/references.py``.

The runner first makes the calls without the tool, split over ``--jobs`` processes, which compiles
every kernel into the disk cache (and checks every result); then it runs them all in one process
under each tool (``memcheck``, ``racecheck``, ``initcheck``, ``synccheck``), prints each tool's
summary line and exits non-zero unless every tool reports no error and every call passed.
``--inner`` runs the calls in this process (what each tool runs); ``--tools`` picks tools;
``--concurrent`` runs the tools at once and ``--tool-parts N`` splits each tool's calls over N
processes (on the H200's 16 cores, ``--concurrent --tool-parts 3``: twelve processes on one GPU).
``--shard K/N`` takes every N-th call from the K-th, for the plain run and the tools alike: the four
tools over all the calls have never fitted one device call's 600 s (the first tensor-core call alone took
261 s under each tool beside eleven other processes), so the whole run is N calls, each shard's summary
line naming its shard.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import typing
import zlib
from typing import Callable, Iterator

import torch

TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
HEAD_DIMS = (2, 64, 80, 96, 128, 256, 512)
MAX_POS = (1 << 24) - 1
#: where the calls run: CUDA under the tool; ``TILEOPS_SANITIZE_DEVICE=cpu`` tries the calls on the CPU
DEV = os.environ.get("TILEOPS_SANITIZE_DEVICE", "cuda")


#: set in initcheck's processes (``outer``): each call first fills the memory the caching allocator holds free
PREFILL_ENV = "TILEOPS_SANITIZE_PREFILL"


class _Raw:
    """``length`` bytes of device memory at ``ptr`` as torch sees an array it does not own."""

    def __init__(self, ptr: int, length: int) -> None:
        self.__cuda_array_interface__ = {"shape": (length,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 3}


def _free_blocks() -> Iterator[tuple[int, int]]:
    """``(address, size)`` of every block this process's caching allocator holds free."""
    for seg in torch.cuda.memory_snapshot():
        addr = seg["address"]
        for blk in seg["blocks"]:
            if blk["state"] == "inactive":
                yield blk.get("address", addr), blk["size"]
            addr += blk["size"]


def _prefill() -> None:
    """Fill with 0xFF bytes (NaN in every float dtype, -1 in every int) the memory the caching allocator
    holds free, after growing both of its pools, so that what a call allocates next is written memory.

    initcheck does not see the TMA engine's stores (``cp.async.bulk.tensor``): on 2026-12-06 (an H100)
    it reported every element of out, dq, dk and dv of the attention calls as read uninitialised
    (196,608 reads for gqa-2k shrunk: out and dq 16 x 32 x 128, dk and dv 32 x 8 x 128; 262,144 for
    mha-1k-d64: four tensors of 2 x 32 x 16 x 64), exactly what those kernels store from shared memory
    by TMA, while every value matched its float64 reference. With the fill, an output lands on written
    memory, and an element a kernel failed to store stays NaN, which ``_close`` rejects; initcheck still
    reports any read of memory nothing wrote (a new segment, a workspace of a later allocation)."""
    # the small pool serves allocations up to 1 MiB from 2 MiB segments, the large pool the rest
    held = [torch.empty(1 << 20, dtype=torch.uint8, device="cuda") for _ in range(32)]
    held += [torch.empty(n << 20, dtype=torch.uint8, device="cuda") for n in (8, 8, 64, 256)]
    del held
    torch.cuda.synchronize()
    for addr, size in _free_blocks():
        torch.as_tensor(_Raw(addr, size), device="cuda").fill_(0xFF)
    torch.cuda.synchronize()


def _refs():
    from tests.references import reference, reference_grad
    from tileops.testing import tolerance

    return reference, reference_grad, tolerance


def _close(got: torch.Tensor, ref: torch.Tensor, what: str, scale: "torch.Tensor | None" = None) -> None:
    """``|got - ref| <= atol + rtol * scale`` elementwise, ``scale`` the magnitude the op's roundings
    act on where the family's reference gives one (``tests/family_references.scales``: a rotation
    that cancels is measured against its pair, as the generated tests measure it), else the
    reference's own value."""
    _, _, tolerance = _refs()
    atol, rtol = tolerance(got.dtype)
    g = got.detach().double().cpu()
    bad = ~torch.isfinite(g) | ((g - ref).abs() > atol + rtol * (ref.abs() if scale is None else scale))
    if bool(bad.any()):
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} elements off, max err "
                             f"{(g - ref).abs().max().item():.3g}")


Call = tuple[str, Callable[[], None]]


def _case_calls() -> Iterator[Call]:
    """Every case of every op of every family, forward and backward, on its first dtype (shrunk
    inputs), against the family's float64 reference (``tests/family_references.py``)."""
    from tests import family_references as fam
    from tileops.manifest import registry
    from tileops.workloads import op_class, workload

    for name, m in sorted(registry().items()):
        for case in m.cases:
            def run(name=name, m=m, case=case) -> None:
                # a constant per case: hash() of a str is randomised per process (PYTHONHASHSEED)
                g = torch.Generator().manual_seed(zlib.crc32(f"{name} {case.label}".encode()))
                w = workload(m, case, case.dtypes[0], DEV, shrink=True, generator=g)
                op = op_class(name)(**w.params)
                cpu = {k: v.cpu() for k, v in w.inputs.items() if v is not None}
                res = op(**w.inputs)
                wants = fam.outputs(m, w.params, cpu)
                scales = fam.scales(m, w.params, cpu)
                outs = dict(zip(wants, res if isinstance(res, tuple) else (res,)))
                for o, want in wants.items():
                    _close(outs[o], want, f"{name} {case.label} {o}", scales.get(o))
                if m.backward:
                    wrt = [n for n in m.backward.wrt if w.inputs.get(n) is not None]
                    leaves = {n: w.inputs[n].detach().clone().requires_grad_(True) for n in wrt}
                    res = op(**{**w.inputs, **leaves})
                    res = res if isinstance(res, tuple) else (res,)
                    gs = [torch.randn(o.shape, generator=g).to(o.dtype).to(DEV) for o in res]
                    got = torch.autograd.grad(res, [leaves[n] for n in wrt], gs)
                    grad_outs = dict(zip(outs, (x.cpu() for x in gs)))
                    want = fam.grads(m, w.params, cpu, wrt, grad_outs)
                    gscales = fam.grad_scales(m, w.params, cpu, wrt, grad_outs)
                    for n, gr in zip(wrt, got):
                        _close(gr, want[n], f"{name} {case.label} d{n}", gscales.get(n))
                op.check()
            yield f"{name} {case.label}", run


def _base_calls() -> Iterator[Call]:
    """RoPEFwdOp in 2d over head dims, heads, lengths, views, outputs and positions; and in bhsd on
    HF's own [B, H, S, D] (the head-major kernel at 8195 tokens)."""
    from tileops.rope import RoPEFwdOp

    reference, reference_grad, _ = _refs()
    params = {"input_layout": "2d"}
    for D in HEAD_DIMS:
        # 2 x 8195 tokens: long enough for the kernel made for head-major views (kernels/rope.py)
        for H, HK, S in ((1, 1, 1), (80, 8, 7), (4, 4, 129)) + (((2, 1, 8195),) if D in (64, 128) else ()):
            dt = torch.float32 if D in (80, 2) else torch.bfloat16

            def run(D=D, H=H, HK=HK, S=S, dt=dt) -> None:
                g = torch.Generator().manual_seed(D * 1000 + H)
                op = RoPEFwdOp(input_layout="2d")
                # HF's [B, H, S, D], seen as [B, S, H, D]: strided, no copy
                q = torch.randn(2, H, S, D, generator=g).to(dt).to(DEV).transpose(1, 2)
                k = torch.randn(2, HK, S, D, generator=g).to(dt).to(DEV).transpose(1, 2)
                pos = torch.randint(0, MAX_POS + 1, (2, S), generator=g)
                pos[0, 0], pos[-1, -1] = 0, MAX_POS
                qo, ko = torch.full(q.shape, float("nan"), dtype=dt).to(DEV), torch.full(k.shape, float("nan"), dtype=dt).to(DEV)
                op(q, position_ids=pos.to(DEV), key=k, out=qo, key_out=ko)
                cq, ck = q.cpu(), k.cpu()
                # float64 on the host, once for every call below that rotates q or k at pos
                want_q = reference("RoPEFwdOp", params, {"x": cq, "position_ids": pos})
                want_k = reference("RoPEFwdOp", params, {"x": ck, "position_ids": pos})
                _close(qo, want_q, f"D{D} H{H} S{S} out=")
                _close(ko, want_k, f"D{D} H{H} S{S} key_out=")
                q2, k2 = q.clone(), k.clone()
                op(q2, position_ids=pos.to(DEV), key=k2, out=q2, key_out=k2)  # in place
                _close(q2, want_q, f"D{D} in place")
                _close(op(q), reference("RoPEFwdOp", params, {"x": cq}), f"D{D} no positions")
                leaf = q.detach().clone().requires_grad_(True)
                go = torch.randn(2, H, S, D, generator=g).to(dt).to(DEV).transpose(1, 2)  # as HF's would be
                (dq,) = torch.autograd.grad(op(leaf, position_ids=pos.to(DEV)), leaf, go)
                _close(dq, reference_grad("RoPEFwdOp", params, {"x": cq, "position_ids": pos}, go.cpu()), f"D{D} dq")
                op.check()
                hf = RoPEFwdOp(input_layout="bhsd")  # the same q and k as HF holds them: [B, H, S, D]
                qb, kb = hf(q.transpose(1, 2), position_ids=pos.to(DEV), key=k.transpose(1, 2))
                _close(qb.transpose(1, 2), want_q, f"D{D} bhsd q")
                _close(kb.transpose(1, 2), want_k, f"D{D} bhsd k")
                hf.check()
            yield f"RoPEFwdOp 2d D={D} H={H}/{HK} S={S}", run


def _ids_calls() -> Iterator[Call]:
    """The position-ids op on a fused qkv buffer, partial rotary, a misaligned view, bad positions."""
    from tileops.rope import RoPENeoxPositionIdsFwdOp

    reference, _, _ = _refs()
    for D, rot in ((64, 64), (128, 64), (256, 98), (512, 512)):
        def run(D=D, rot=rot) -> None:
            g = torch.Generator().manual_seed(D)
            T_, HQ, HKV, limit = 129, 8, 2, 1 << 24
            p = {"max_position": limit, "rotary_dim": rot}
            op = RoPENeoxPositionIdsFwdOp(limit, rotary_dim=rot)
            qkv = torch.randn(T_, (HQ + 2 * HKV) * D, generator=g).half().to(DEV)
            q = qkv[:, : HQ * D].view(T_, HQ, D)
            k = qkv[:, HQ * D : (HQ + HKV) * D].view(T_, HKV, D)
            pos = torch.randint(0, limit, (T_,), generator=g)
            pos[0], pos[-1] = 0, limit - 1
            cq, ck = q.cpu().clone(), k.cpu().clone()  # before the in-place call (.cpu() of a CPU tensor is itself)
            v_before = qkv[:, (HQ + HKV) * D :].clone()
            op(q, position_ids=pos.to(DEV), key=k, out=q, key_out=k)  # in place in the fused buffer
            _close(q, reference(op.name, p, {"x": cq, "position_ids": pos}), f"ids D{D} fused q")
            _close(k, reference(op.name, p, {"x": ck, "position_ids": pos}), f"ids D{D} fused k")
            assert torch.equal(qkv[:, (HQ + HKV) * D :], v_before), "v was written"
            buf = torch.randn(T_ * HQ * D + 1, generator=g).half().to(DEV)
            odd = buf[1:].view(T_, HQ, D)  # 2 bytes past a 16-byte boundary: the copy fallback
            _close(op(odd, position_ids=pos.to(DEV)), reference(op.name, p, {"x": odd.cpu(), "position_ids": pos}),
                   f"ids D{D} misaligned")
            bad = pos.clone()
            bad[T_ // 2] = limit  # out of range: read as 0, reported, never read out of bounds
            try:
                op(odd, position_ids=bad.to(DEV))  # on a GPU reported by check(), on the CPU at the call
                op.check()
            except ValueError as e:
                assert f"position_ids[{T_ // 2}] = {limit}" in str(e), e
            else:
                raise AssertionError("an out-of-range position was not reported")
        yield f"ids D={D} rot={rot}", run


def _shard(text: str) -> tuple[int, int]:
    """``"K/N"`` (1-based, as pytest's ``--shard``) -> ``(K - 1, N)``; anything else is refused by name."""
    m = re.fullmatch(r"(\d+)/(\d+)", text)
    if not m or not 1 <= int(m[1]) <= int(m[2]):
        raise SystemExit(f"--shard: expected K/N with 1 <= K <= N (e.g. 2/3), got {text!r}")
    return int(m[1]) - 1, int(m[2])


def calls() -> list[Call]:
    """Every call, or those whose name holds ``TILEOPS_SANITIZE_MATCH`` (``--match``), in a fixed order;
    of those, every N-th from the K-th under ``TILEOPS_SANITIZE_SHARD=K/N`` (``--shard``)."""
    match = os.environ.get("TILEOPS_SANITIZE_MATCH", "")
    chosen = [c for c in (*_case_calls(), *_base_calls(), *_ids_calls()) if match in c[0]]
    k, n = _shard(os.environ.get("TILEOPS_SANITIZE_SHARD", "1/1"))
    return chosen[k::n]


def inner(part: int, parts: int) -> int:
    from tileops.attention.attn_builtin import CUDA_ENV

    todo = calls()[part::parts]
    failed = refused = 0
    prefill = DEV == "cuda" and os.environ.get(PREFILL_ENV) == "1"
    for name, run in todo:
        t0 = time.time()
        try:
            if prefill:
                _prefill()
            run()
            print(f"ok {name} ({time.time() - t0:.1f} s)", flush=True)  # (how far a run cut short got)
        except NotImplementedError as e:
            # TILEOPS_ATTENTION_CUDA=0 refuses the attention backward's and the paged decode's CUDA
            # kernels before they launch: what the op is meant to do, but not a pass either: named and counted
            if CUDA_ENV in str(e):
                refused += 1
                print(f"REFUSED {name}: not run ({CUDA_ENV}=0 refuses it)", flush=True)
            else:
                failed += 1
                print(f"FAILED {name}: {type(e).__name__}: {e}", flush=True)
        except Exception as e:  # report every failure, then fail the run
            failed += 1
            print(f"FAILED {name}: {type(e).__name__}: {e}", flush=True)
    if DEV == "cuda":
        torch.cuda.synchronize()
    print(f"sanitize calls: {len(todo) - failed - refused} passed, {failed} failed, {refused} refused", flush=True)
    return 1 if failed else 0


def _summary(tool: str, log: str) -> str:
    lines = [ln for ln in log.splitlines() if "ERROR SUMMARY" in ln or "RACECHECK SUMMARY" in ln]
    return lines[-1].strip() if lines else "(no summary line)"


class _Cut(Exception):
    """SIGTERM reached the runner (``timeout``'s, a device call's limit): what ran is reported, then it exits."""


def _cut(signum: int, frame: object) -> None:
    # once: timeout signals the runner and then its process group, the runner again, and a second
    # SIGTERM while the runner reported raised out of the report, which printed nothing (an H100,
    # 2026-12-06); :func:`outer` puts the previous handler back when it returns
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise _Cut()


def _progress(log: str, total: int) -> str:
    """How far a part cut short got, from its log: the calls that passed, and the last one that ended."""
    done = [ln for ln in log.splitlines() if ln.startswith(("ok ", "FAILED ", "REFUSED "))]
    passed = sum(ln.startswith("ok ") for ln in done)
    failed = sum(ln.startswith("FAILED ") for ln in done)
    last = f"; last ended: {done[-1]}" if done else ""
    return f"cut after {len(done)} of {total} calls ({passed} ok, {failed} failed){last}"


def _run_name() -> str:
    """``sanitize``, with the shard it runs (``--shard``), for the summary line."""
    shard = os.environ.get("TILEOPS_SANITIZE_SHARD", "")
    return f"sanitize shard {shard}" if shard else "sanitize"


def outer(tools: list[str], jobs: int, logdir: str, concurrent: bool = False, tool_parts: int = 1) -> int:
    """The plain run over ``jobs`` processes, then each tool's run (one after another, or with
    ``concurrent`` all at once: independent processes on one GPU; a tool's time is then from the start
    of them all), each split over ``tool_parts`` processes (every ``tool_parts``-th call, as the plain
    run splits them). ``jobs`` 0 skips the plain run (a device call whose earlier command ran it on the
    same tree: its kernels are in the cache, its results checked), and the summary line says so.

    Every process writes straight into its log (``--logdir``'s file, else a temporary one), so a run
    cut short keeps what it did: on SIGTERM (``timeout``, which signals the children too) the runner
    prints, for each part not yet reported, how many calls it got through, and exits 124. (On
    2026-12-06 a plain run cut at 105 s on a fresh machine printed nothing: it reported its parts
    only once all of them had ended.)"""
    previous = signal.signal(signal.SIGTERM, _cut)
    running: dict[str, tuple[subprocess.Popen, typing.IO[str], int]] = {}
    t_all = time.time()
    try:
        return _outer(tools, jobs, logdir, concurrent, tool_parts, running)
    except _Cut:
        for label, (proc, sink, total) in running.items():
            if proc.poll() is None:
                proc.kill()
            sink.seek(0)
            print(f"  {label}: {_progress(sink.read(), total)}", flush=True)
        print(f"{_run_name()}: CUT by SIGTERM after {time.time() - t_all:.0f} s "
              f"(the {len(running)} parts that had not ended are above)", flush=True)
        return 124
    finally:
        signal.signal(signal.SIGTERM, previous)
        for _, sink, _ in running.values():
            sink.close()


def _outer(tools: list[str], jobs: int, logdir: str, concurrent: bool, tool_parts: int,
           running: "dict[str, tuple[subprocess.Popen, typing.IO[str], int]]") -> int:
    """:func:`outer`'s runs; ``running`` holds every process started and not yet reported, by label."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if logdir:
        os.makedirs(logdir, exist_ok=True)
    me = [sys.executable, "-m", "benchmarks.sanitize", "--inner"]
    n_calls = len(calls())

    def sink_for(name: str) -> typing.IO[str]:
        return open(os.path.join(logdir, name), "w+") if logdir else tempfile.TemporaryFile("w+")

    def report(label: str) -> tuple[subprocess.Popen, str]:
        """Wait for ``label``'s process; its return code and log, once it is no longer running."""
        proc, sink, _ = running[label]
        proc.wait()
        sink.seek(0)
        log = sink.read()
        del running[label]
        sink.close()
        return proc, log

    t0 = time.time()
    for i in range(jobs):
        sink = sink_for(f"sanitize-plain-{i}.log")
        proc = subprocess.Popen([*me, "--part", str(i), "--parts", str(jobs)], env=env, stdout=sink,
                                stderr=subprocess.STDOUT, text=True)
        running[f"plain part {i}"] = (proc, sink, len(range(i, n_calls, jobs)))
    ok = True
    for i in range(jobs):
        p, out = report(f"plain part {i}")
        ok &= p.returncode == 0
        lines = out.splitlines()
        shown = [ln for ln in lines if ln.startswith(("FAILED", "REFUSED", "sanitize calls"))]
        print(f"  plain part {i}: rc={p.returncode}; {'; '.join(shown) or '(no summary)'}", flush=True)
        if p.returncode != 0:
            print("\n".join("    " + ln for ln in lines[-15:]), flush=True)
    if jobs:
        print(f"plain run ({n_calls} calls, {jobs} processes, kernels compiled): {'ok' if ok else 'FAILED'} "
              f"in {time.time() - t0:.0f} s", flush=True)
    else:
        print("plain run: skipped (--jobs 0)", flush=True)
    exe = os.environ.get("COMPUTE_SANITIZER", "compute-sanitizer")

    def start(tool: str, part: int) -> str:
        """Start part ``part`` of the tool's run, its output going straight to its log; its label in ``running``."""
        cmd = [exe, "--tool", tool, "--error-exitcode", "99", "--print-limit", "20"]
        if tool == "racecheck":
            cmd += ["--racecheck-report", "all"]
        name = f"sanitize-{tool}.log" if tool_parts == 1 else f"sanitize-{tool}-{part}.log"
        sink = sink_for(name)
        inner = [*me, "--part", str(part), "--parts", str(tool_parts)]
        tool_env = {**env, PREFILL_ENV: "1"} if tool == "initcheck" else env  # (``_prefill`` says why)
        proc = subprocess.Popen([*cmd, *inner], env=tool_env, stdout=sink, stderr=subprocess.STDOUT, text=True)
        label = f"{tool} part {part}"
        running[label] = (proc, sink, len(range(part, n_calls, tool_parts)))
        return label

    t_all = time.time()
    started = {(tool, i): start(tool, i) for tool in tools for i in range(tool_parts)} if concurrent else {}
    for tool in tools:
        t0 = t_all if concurrent else time.time()
        runs = [started.get((tool, i)) or start(tool, i) for i in range(tool_parts)]
        for i, label in enumerate(runs):
            proc, log = report(label)
            calls_line = next((ln for ln in log.splitlines() if ln.startswith("sanitize calls")),
                              "(calls did not finish)")
            good = proc.returncode == 0
            ok &= good
            part = f" part {i}" if tool_parts > 1 else ""
            print(f"{tool:10s}{part} rc={proc.returncode} {_summary(tool, log)}; {calls_line} "
                  f"({time.time() - t0:.0f} s)", flush=True)
            if not good:
                print("\n".join(ln for ln in log.splitlines() if re.search(r"FAILED|Error|error", ln))[-3000:])
    ran = (["the plain run"] if jobs else []) + list(tools)
    print(f"{_run_name()}: {'passed' if ok else 'FAILED'}: "
          f"{', '.join(ran) or 'nothing'}{'' if jobs else ' (no plain run)'} over {n_calls} calls "
          f"({time.time() - t_all:.0f} s under the tools)", flush=True)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.sanitize", description=__doc__.split("\n")[0])
    ap.add_argument("--inner", action="store_true", help="run the calls in this process")
    ap.add_argument("--part", type=int, default=0)
    ap.add_argument("--parts", type=int, default=1)
    ap.add_argument("--tools", default=",".join(TOOLS), help=f"comma-separated, from {', '.join(TOOLS)}")
    ap.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1),
                    help="processes for the plain run; 0: no plain run")
    ap.add_argument("--logdir", default="", help="write each tool's full log here")
    ap.add_argument("--concurrent", action="store_true", help="run the tools at once, not one after another")
    ap.add_argument("--tool-parts", type=int, default=1,
                    help="split each tool's run over this many processes (with --concurrent: tools x parts at once)")
    ap.add_argument("--match", default=None, help="only the calls whose name holds this (e.g. 'AttnFwdOp')")
    ap.add_argument("--shard", default=None,
                    help="K/N: every N-th call from the K-th, plain run and tools alike, so that the whole run "
                         "spreads over N device calls (each under the per-call limit)")
    a = ap.parse_args(argv)
    tools = [t for t in a.tools.split(",") if t]
    if a.jobs < 0:
        ap.error(f"--jobs: expected a count of processes >= 0 (0: no plain run), got {a.jobs}")
    if a.tool_parts < 1:
        ap.error(f"--tool-parts: expected a count of processes >= 1, got {a.tool_parts}")
    if unknown := [t for t in tools if t not in TOOLS]:
        ap.error(f"--tools: expected names from {', '.join(TOOLS)}, got {', '.join(unknown)}")
    if a.match is not None:  # (the tools' processes inherit it)
        os.environ["TILEOPS_SANITIZE_MATCH"] = a.match
    if a.shard is not None:
        _shard(a.shard)  # refused here, before any process starts
        os.environ["TILEOPS_SANITIZE_SHARD"] = a.shard
    if a.inner:
        return inner(a.part, a.parts)
    return outer(tools, a.jobs, a.logdir, a.concurrent, a.tool_parts)


if __name__ == "__main__":
    sys.exit(main())
