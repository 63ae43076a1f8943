"""Cold and warm first-call times, each in a new process: ``python -m benchmarks.compile_time``.

cold: empty cache folders (TileLang's and tileops' index), so the first call imports TileLang,
lowers and builds the kernel: by tileops' lean build (NVRTC and the C++ compiler, the default) and,
in a second new process beside it, by TileLang's own (``TILEOPS_LEAN_BUILD=0``: nvcc on TileLang's
templates), so the two are measured side by side. "build s" is the time inside the builds,
TileLang's import and lowering included; "shipped" counts the kernels built from the sources tileops
ships lowered (:mod:`tileops.compile.lowered`), which need neither.
warm: a new process with those caches filled, so the first call loads the library from tileops'
index (without importing TileLang: the table says whether it was imported).
Columns: constructing the op (which reads its manifest), its first call, and the whole process
from before ``import torch``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

CASES = [
    ("RoPEFwdOp(rope_layout='neox', input_layout='2d')", "torch.randn(2, 64, 32, 128, device='cuda', dtype=torch.float16)"),
    ("RoPEFwdOp(rope_layout='interleaved', input_layout='1d')", "torch.randn(512, 128, device='cuda', dtype=torch.bfloat16)"),
    ("RoPENeoxPositionIdsFwdOp(8192, rotary_dim=64)",
     "torch.randn(64, 32, 128, device='cuda', dtype=torch.float16), torch.randint(0, 8192, (64,), device='cuda')"),
]

CODE = """
import sys, time
t0 = time.perf_counter()
import torch
from tileops.rope import RoPEFwdOp, RoPENeoxPositionIdsFwdOp
args = ({args},)
torch.cuda.synchronize()
t1 = time.perf_counter()
op = {op}
t2 = time.perf_counter()
op(*args)
torch.cuda.synchronize()
t3 = time.perf_counter()
from tileops.compile.build import stats
print(f"{{t2 - t1:.3f}} {{t3 - t2:.3f}} {{t3 - t0:.3f}} {{'tilelang' in sys.modules}} {{stats.seconds:.3f}} "
      f"{{stats.shipped}}/{{stats.lean}}/{{stats.compiles}}")
"""


def _run(code: str, cache: str, **env_extra: str) -> list[str]:
    # TILEOPS_NATIVE=0: with an empty cache, an import on a GPU machine would build the native runtime first
    env = {**os.environ, "TILELANG_CACHE_DIR": os.path.join(cache, "tilelang"),
           "TILEOPS_CACHE_DIR": os.path.join(cache, "tileops"), "TILEOPS_NATIVE": "0", **env_extra}
    env.pop("TILELANG_DISABLE_CACHE", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.split()[-6:]


def main() -> int:
    print("| op | cold: construct s | cold: first call s | cold: build s (shipped/lean/all) | cold, TileLang's build: "
          "first call s | warm: construct s | warm: first call s | warm: whole process s | warm: TileLang imported |")
    print("|---|---|---|---|---|---|---|---|---|")
    for op, args in CASES:
        code = CODE.format(op=op, args=args)
        with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as other:
            c_make, c_first, _, _, c_build, c_lean = _run(code, cache)
            _, t_first, _, _, _, _ = _run(code, other, TILEOPS_LEAN_BUILD="0")
            w_make, w_first, w_total, w_tl, _, _ = _run(code, cache)
            print(f"| `{op}` | {c_make} | {c_first} | {c_build} ({c_lean}) | {t_first} | {w_make} | {w_first} | "
                  f"{w_total} | {w_tl} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
