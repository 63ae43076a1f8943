"""Cold and warm first-call times, each in a new process: ``python -m benchmarks.compile_time``.

cold: an empty TileLang cache folder, so the first call lowers, runs nvcc and links the host stub.
warm: a new process with that cache filled, so the first call only loads the library.
Both include importing tileops (and TileLang, on the first call).
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
import time
t0 = time.perf_counter()
import torch
from tileops.rope import RoPEFwdOp, RoPENeoxPositionIdsFwdOp
op = {op}
args = ({args},)
torch.cuda.synchronize()
t1 = time.perf_counter()
op(*args)
torch.cuda.synchronize()
t2 = time.perf_counter()
print(f"{{t2 - t1:.3f}} {{t2 - t0:.3f}}")
"""


def main() -> int:
    print("| op | cold first call s | warm first call s (new process) | warm process total s |")
    print("|---|---|---|---|")
    for op, args in CASES:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TILELANG_CACHE_DIR": cache}
            code = CODE.format(op=op, args=args)
            cold = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
            warm = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
            c_first, _ = cold.stdout.split()
            w_first, w_total = warm.stdout.split()
            print(f"| `{op}` | {c_first} | {w_first} | {w_total} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
