"""The generator: one compile per specialization, shared by threads and by lengths."""

from __future__ import annotations

import subprocess
import sys
import threading

import torch

from tests.references import reference
from tileops import BUILTIN, generate
from tileops.rope import RoPEFwdOp


def test_fifty_lengths_one_compile(gen):
    op = RoPEFwdOp(rope_layout="interleaved", input_layout="2d", base=500.0, target=BUILTIN)
    op(torch.randn(1, 3, 2, 36, generator=gen))  # compile (or load) this specialization once
    before = generate.stats.compiles
    for length in range(1, 51):
        x = torch.randn(2, length, 3, 36, generator=gen)
        out = op(x)
        ref = reference("RoPEFwdOp", {"rope_layout": "interleaved", "input_layout": "2d", "base": 500.0}, {"x": x})
        assert (out.double() - ref).abs().max().item() < 1e-5
    assert generate.stats.compiles == before, "a new length compiled a new kernel"
    assert len(op._impls) == 1, "a new length built a new implementation"


def test_new_dtype_and_head_dim_compile_once_each(gen):
    generate.clear_memory_cache()
    op = RoPEFwdOp(input_layout="1d", target=BUILTIN)
    before = generate.stats.compiles
    for _ in range(3):
        for dtype in (torch.float16, torch.float32):
            for d in (34, 38):
                op(torch.randn(5, d, generator=gen).to(dtype))
    assert generate.stats.compiles - before == 4


def test_threads_first_call_compile_once(gen):
    generate.clear_memory_cache()
    op = RoPEFwdOp(input_layout="2d", target=BUILTIN)
    xs = [torch.randn(1, 9 + i, 3, 42, generator=gen) for i in range(8)]
    outs: list = [None] * 8
    errors: list = []
    before = generate.stats.compiles
    start = threading.Barrier(8)

    def work(i: int) -> None:
        try:
            start.wait()
            outs[i] = op(xs[i])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert generate.stats.compiles - before == 1
    for x, out in zip(xs, outs):
        ref = reference("RoPEFwdOp", {"input_layout": "2d"}, {"x": x})
        assert (out.double() - ref).abs().max().item() < 1e-5


def test_disk_cache_serves_a_new_process(tmp_path):
    """A second process with the same cache folder loads the kernel instead of building it."""
    code = (
        "import time, torch, tileops.generate as g\n"
        "from tileops.rope import RoPEFwdOp\n"
        "op = RoPEFwdOp(input_layout='1d')\n"
        "op(torch.randn(4, 46))\n"
        "print(g.stats.compiles)\n"
    )
    env = {**__import__("os").environ, "TILELANG_CACHE_DIR": str(tmp_path)}
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    files_after_first = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
    second = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    files_after_second = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
    assert files_after_first, "nothing was written to the disk cache"
    assert files_after_first == files_after_second, "the second process compiled again"
    assert first.stdout.strip() == second.stdout.strip() == "1"
