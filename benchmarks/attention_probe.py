"""Does each attention variant return, and is it right? One call per variant, each in its own process
with a timeout, so that a deadlocked kernel (the forward's first call on the H200 never returned:
``benchmarks/NOTES.md``, "the forward's deadlock") is reported as TIMEOUT and the probe goes on.

    python -m benchmarks.attention_probe                  # forward: pipeline 1 and 2, causal or not,
                                                          # seq 128 and 2048, head_dim 64 and 128
    python -m benchmarks.attention_probe --backward       # the backward plan (forward pipeline 1)
    python -m benchmarks.attention_probe --pipelines 2 --seqs 128 --dims 128 --timeout 30

A variant is ``AttnFwdOp(4, 2, D, causal=...)`` (GQA 4 q / 2 kv heads), bf16, q ``[1, S, 4, D]``,
k/v ``[1, S, 2, D]`` contiguous: the shape of the call that hung, and a long one. ``pipeline`` is
``kernels/attention.py``'s knob (1: every thread loads, no TMA, no warp specialisation; 2: TileLang's
TMA producer warpgroup), set through the manifest's ``kernel.static`` as ``benchmarks.attention``
sets tile shapes. Every kernel is compiled first, in parallel, into the disk cache
(:func:`tileops.compile.warmup.compile_jobs`), so a child's timeout measures the call, not nvcc.

A line per variant: ``ok`` with the largest ``|ours - ref|`` over the largest ``|ref|`` (ref: SDPA in
float32 on the same bf16 inputs; dq, dk, dv with ``--backward``), or ``TIMEOUT``, or the error. The
children get ``TILEOPS_ATTENTION_CUDA=1``, whatever the caller set: 0 would refuse the CUDA calls that take
gradients (``--backward``; ``tileops/attention/attn_builtin.py``: ``cuda_enabled``).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

HQ, HKV = 4, 2


def make_op(d: int, causal: bool, pipeline: int) -> Any:
    """``AttnFwdOp(4, 2, d)`` with the manifest's ``pipeline`` set (an op reads its own manifest object)."""
    from tileops.attention import AttnFwdOp

    op = AttnFwdOp(HQ, HKV, d, causal=causal)
    kernel = dataclasses.replace(op.manifest.kernel, static={**(op.manifest.kernel.static or {}), "pipeline": pipeline})
    op.manifest = dataclasses.replace(op.manifest, kernel=kernel)
    return op


def _ref(q, k, v, causal: bool):
    """SDPA in float32 on ``[B, S, H, D]`` tensors (its layout is ``[B, H, S, D]``: transposed views)."""
    import torch

    f = torch.nn.functional.scaled_dot_product_attention
    return f(q.float().transpose(1, 2), k.float().transpose(1, 2), v.float().transpose(1, 2), is_causal=causal,
             enable_gqa=True).transpose(1, 2)


def _rel(got, ref) -> float:
    return float((got.float() - ref.float()).abs().max()) / max(float(ref.float().abs().max()), 1e-30)


def one(v: dict) -> dict:
    """Run variant ``v`` once in this process (the child's side): its result as a dict."""
    import torch

    s, d, causal = v["seq"], v["dim"], v["causal"]
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, s, HQ, d, generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, s, HKV, d, generator=g, device="cuda", dtype=torch.bfloat16)
    val = torch.randn(1, s, HKV, d, generator=g, device="cuda", dtype=torch.bfloat16)
    op = make_op(d, causal, v["pipeline"])
    t0 = time.perf_counter()
    if not v["backward"]:
        out = op(q, k, val)
        torch.cuda.synchronize()
        return {"err": _rel(out, _ref(q, k, val, causal)), "s": time.perf_counter() - t0}
    leaves = [x.detach().requires_grad_(True) for x in (q, k, val)]
    dout = torch.randn(1, s, HQ, d, generator=g, device="cuda", dtype=torch.bfloat16)
    grads = torch.autograd.grad(op(*leaves), leaves, dout)
    torch.cuda.synchronize()
    ref_leaves = [x.detach().float().requires_grad_(True) for x in (q, k, val)]
    refs = torch.autograd.grad(_ref(*ref_leaves, causal), ref_leaves, dout.float())
    return {"err": max(_rel(a, b) for a, b in zip(grads, refs)), "s": time.perf_counter() - t0}


def variants(a: argparse.Namespace) -> list[dict]:
    pipelines = [int(p) for p in (a.pipelines or ("1" if a.backward else "1,2")).split(",")]
    return [{"pipeline": p, "causal": c, "seq": s, "dim": d, "backward": a.backward}
            for p, c, s, d in itertools.product(pipelines, (False, True), [int(x) for x in a.seqs.split(",")],
                                                [int(x) for x in a.dims.split(",")])]


def label(v: dict) -> str:
    return (f"{'bwd' if v['backward'] else 'fwd'} pipeline={v['pipeline']} {'causal' if v['causal'] else 'full  '}"
            f" seq={v['seq']:<5} D={v['dim']:<4}")


def precompile(vs: list[dict], jobs: int | None) -> None:
    """Every variant's kernels into the disk cache, in parallel (the children then only load them)."""
    import torch

    from tileops.compile.build import device_backend
    from tileops.compile.warmup import compile_jobs, op_kernel_jobs

    arch = device_backend(torch.device("cuda"))[1]
    todo = []
    for v in vs:
        op = make_op(v["dim"], v["causal"], v["pipeline"])
        dims = {"q_dim": v["dim"], "q_heads": HQ, "kv_heads": HKV}
        todo += [(b, dataclasses.replace(s, pipeline=v["pipeline"]) if b == "attention" else s, be, ar)
                 for b, s, be, ar in op_kernel_jobs("AttnFwdOp", op.params, dims, ["bfloat16"], arch, with_inputs=(),
                                                    backward=v["backward"])]
    t0 = time.perf_counter()
    count, _, failures = compile_jobs(todo, jobs, progress=True)
    print(f"compiled {count} kernels in {time.perf_counter() - t0:.0f} s"
          + (f"; {len(failures)} failed, first: {failures[0][1][:300]}" if failures else ""), flush=True)


def run_child(v: dict, timeout: float) -> str:
    """Variant ``v`` in a child process (its own session, so a hung one is killed with its group)."""
    env = {**os.environ, "TILEOPS_ATTENTION_CUDA": "1"}
    cmd = [sys.executable, "-m", "benchmarks.attention_probe", "--one", json.dumps(v)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # the group of the child this probe started, nothing else
        p.communicate()
        return f"TIMEOUT (> {timeout:.0f} s)"
    for line in out.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[7:])
            return f"ok  max|err|/max|ref| {r['err']:.2e}  ({r['s']:.1f} s)"
    tail = (err.strip().splitlines() or ["(no output)"])[-1]
    return f"error (rc {p.returncode}): {tail[:200]}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backward", action="store_true", help="the backward plan (dq, dk, dv) instead of the forward")
    ap.add_argument("--pipelines", default=None,
                    help="kernels/attention.py pipeline values (default 1,2; --backward: 1)")
    ap.add_argument("--seqs", default="128,2048", help="sequence lengths (default 128,2048)")
    ap.add_argument("--dims", default="64,128", help="head dims (default 64,128)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds a variant's call may take (default 60)")
    ap.add_argument("--no-precompile", action="store_true", help="compile in each child (then raise --timeout)")
    ap.add_argument("--jobs", type=int, default=None, help="compile processes (default one per CPU)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child's side: one variant's JSON
    a = ap.parse_args(argv)
    if a.one is not None:
        print("RESULT " + json.dumps(one(json.loads(a.one))), flush=True)
        return 0
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.attention_probe runs the kernels: no GPU here")
    vs = variants(a)
    if not a.no_precompile:
        precompile(vs, a.jobs)
    bad = 0
    for v in vs:
        res = run_child(v, a.timeout)
        bad += not res.startswith("ok")
        print(f"{label(v)}  {res}", flush=True)
    print(f"{len(vs) - bad}/{len(vs)} variants returned", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
