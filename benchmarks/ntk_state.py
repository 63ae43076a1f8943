"""Dynamic NTK's state kernel, side by side with what bounds it (H200).

    python -m benchmarks.ntk_state

Rows, all ``[1, 8192, 32, 128]`` bf16 (the runner's ``ntk-2d-8k`` shape), medians of
:func:`benchmarks.timing.gpu_time` measured in one process:

* the same-bytes copy (the ceiling the runner quotes);
* plain 2d RoPE (``RoPEFwdOp``): one launch, the RoPE kernel alone;
* dynamic NTK, the length unchanged call after call (the state kernel reads the length and returns):
  the runner's case; its excess over plain RoPE is what the state kernel costs;
* the same with ``position_ids`` (every block of the state kernel reduces them), and with positions
  that grow by one each call (decoding past ``max_position_embeddings``: the length moves every call,
  so the tables are rewritten every call): the rebuild's cost in a call;
* the state kernel alone, unchanged and rebuilding (lengths 8192 and 1000 in turn: back to 2048 and
  out again), launched through the op's ``device_tables`` without the RoPE kernel.
"""

from __future__ import annotations

import itertools

import torch

from tileops.rope import RoPEDynamicNTKFwdOp, RoPEFwdOp

from .timing import gpu_time, rotation, same_bytes_copy_us


def main() -> None:
    shape = (1, 8192, 32, 128)
    nbytes = 2 * shape[1] * shape[2] * shape[3] * 2
    n = rotation(nbytes)
    sets = n + n % 2  # even: calls alternate between two lengths across the wrap too
    xs = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
    full = torch.arange(8192, device="cuda")[None]
    # growing positions, one tensor per call (the decode past max_position_embeddings case: the
    # length moves on every call, so the tables are rewritten every call); 400 > every call gpu_time makes
    growing = [full + 8192 + k for k in range(400)]
    count = itertools.count()
    ntk = RoPEDynamicNTKFwdOp(input_layout="2d", factor=4.0, max_position_embeddings=2048)
    plain = RoPEFwdOp(input_layout="2d")
    dev = torch.device("cuda", torch.cuda.current_device())
    rows = {
        "same-bytes copy": None,
        "plain RoPE": lambda i: plain(xs[i % n]),
        "NTK, length unchanged": lambda i: ntk(xs[i % n]),
        "NTK positions, unchanged": lambda i: ntk(xs[i % n], position_ids=full),
        "NTK positions, length grows each call": lambda i: ntk(xs[i % n], position_ids=growing[next(count) % 400]),
        "state kernel alone, unchanged": lambda i: ntk.device_tables(None, 8192, 128, dev),
        # 8192, then 1000 (below max_position_embeddings: back to 2048), and again
        "state kernel alone, rebuilding": lambda i: ntk.device_tables(None, 8192 if i % 2 else 1000, 128, dev),
    }
    print(f"{'row':36s} {'median us':>10s} {'p20-p80':>15s} {'% same-bytes copy':>18s}")
    copy = same_bytes_copy_us(nbytes)
    for name, fn in rows.items():
        if fn is None:
            med, lo, hi = copy, float("nan"), float("nan")
        else:
            med, lo, hi = gpu_time(fn, sets)
        print(f"{name:36s} {med:10.2f} {lo:7.2f}-{hi:<7.2f} {100 * copy / med:17.0f}%")


if __name__ == "__main__":
    main()
