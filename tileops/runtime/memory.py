"""Where tensors lie in memory: whether two may share bytes, the spans a launch checks per call, and
where a tensor an op keeps across calls is allocated.

The ops refuse an output that overlaps another argument (except its own input exactly: in place),
at the first call of a signature (:meth:`tileops.op.Op._check_outs`) and, from the pointers alone,
at every later call (:mod:`tileops.runtime.binding`: each pair's byte spans, then :func:`disjoint`
only when the spans meet).
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

__all__ = ["disjoint", "persistent", "same_view", "span"]


def same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same elements in the same order (an output that is its input)."""
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype)


def span(t: torch.Tensor, skip: int = 0) -> int:
    """Bytes from ``t``'s first element to just past its last (over the dims from ``skip`` on)."""
    return (1 + sum((n - 1) * st for n, st in list(zip(t.shape, t.stride()))[skip:])) * t.element_size()


def disjoint(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether no element of ``a`` shares memory with ``b`` (conservative: False when unsure).

    Besides tensors whose byte ranges do not meet, this accepts views that interleave with the same
    strides, such as the q, k and v column blocks of one fused ``[tokens, (Hq + 2 Hkv) * D]`` buffer:
    within one period of the outermost stride each occupies its own band of columns.
    """
    if a.numel() == 0 or b.numel() == 0:
        return True
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return True
    a0, b0 = a.data_ptr(), b.data_ptr()
    if a0 + span(a) <= b0 or b0 + span(b) <= a0:
        return True
    if a.dim() < 2 or a.stride() != b.stride() or a.element_size() != b.element_size() or a.shape[0] != b.shape[0]:
        return False
    period = a.stride(0) * a.element_size()  # bytes between rows of the outermost dim
    sa, sb = span(a, 1), span(b, 1)
    r = (b0 - a0) % period if period else 0
    return period > 0 and sa <= period and r >= sa and r + sb <= period


def persistent(make: Callable[[], torch.Tensor], device: torch.device) -> torch.Tensor:
    """``make()``: a tensor an op keeps across calls (its cos/sin tables, dynamic NTK's state),
    allocated outside any CUDA-graph memory pool.

    ``torch.compile``'s CUDA graphs (mode ``"reduce-overhead"``) run a graph's warm-up with the
    calling thread's allocations routed into the graph's private pool, and refuse the next run while
    a tensor from that pool outlives it untracked: "Detected 1 tensor(s) in the cudagraph pool not
    tracked as outputs" (torch 2.11 on the H200, the RoPE tables of an op whose first call ran
    there). On CUDA ``make`` therefore runs on a short thread of its own, which the pool does not
    route, and that thread's stream is synchronised before the tensor is handed over; once per op
    and device, at the first call. Inside a CUDA graph capture nothing is allocated: it raises,
    asking for one call of the op before the capture. (Not yet shown enough:
    ``tests/test_serving_cuda.py::test_first_call_inside_reduce_overhead`` failed on the H200 with
    the pool error before this and still failed after it, on 2026-12-02, for a reason not read.)
    """
    if device.type != "cuda":
        return make()
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"tileops: the first call of this op on {device} is inside a CUDA graph capture, where "
                           f"its tables cannot be built: call it once on {device} before capturing")
    got: dict[str, object] = {}

    def build() -> None:
        try:
            with torch.cuda.device(device):
                t = make()
                torch.cuda.current_stream(device).synchronize()
            got["tensor"] = t
        except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread
            got["error"] = e

    worker = threading.Thread(target=build, name="tileops-persistent", daemon=True)
    worker.start()
    worker.join()
    if "error" in got:
        raise got["error"]  # type: ignore[misc]
    return got["tensor"]  # type: ignore[return-value]
