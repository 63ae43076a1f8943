"""``AttnFwdOp``'s gradients on CUDA (skipped without a GPU; run on the H200): the forward's tile
program, then the backward plan's ``prep``, ``dkdv`` and ``dq`` tile programs (tensor cores) in bf16
and fp16 at every head_dim, and at head_dim 128 every mask, softcap, MHA, varlen with an empty
sequence, HF's transposed views, a view off the 16-byte vectors (copied), and determinism.

The checks and bounds are the CPU tests' (``tests/test_attn_bwd.py``: float64 autograd through the
definition, bounds from the arithmetic) with ``tensor_cores``: the GPU's exp2 and p and ds rounded to
the dtype before their tile products. Sequences of 200 to 333 rows cross the 64- and 128-row tiles
and end inside one. The kernels are compiled first, all at once (:func:`warm`): TileLang's nvcc
build of one backward program takes ~30 s cold, so one after another they would hold a run for
many minutes.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tileops.attention import AttnFwdOp

from tileops.attention.attn_builtin import CUDA_ENV, cuda_enabled  # noqa: E402

#: the attention backward's kernels on CUDA run unless refused (tileops.attention.attn_builtin.cuda_enabled)
ATTN_CUDA = pytest.mark.skipif(not cuda_enabled(backward=True), reason=f"{CUDA_ENV}=0 refuses the attention "
                               "backward's CUDA kernels")
pytestmark = [pytest.mark.cuda, ATTN_CUDA]

_spec = importlib.util.spec_from_file_location("_attn_bwd_cpu_checks", Path(__file__).with_name("test_attn_bwd.py"))
cpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cpu)

DEV = torch.device("cuda")
HEAD_DIMS = [64, 80, 96, 128, 256]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# id -> (op kwargs, Hq, Hkv, lens_q, lens_k, varlen); head_dim 128, bf16 unless the id says
MASKS = {
    "none": (dict(), 8, 2, 200, 333, False),
    "causal-sq<sk": (dict(causal=True), 8, 2, 200, 333, False),
    "causal-sq>sk": (dict(causal=True), 8, 2, 333, 200, False),  # the first 133 queries see no key
    "causal+window": (dict(causal=True, sliding_window=77), 8, 2, 300, 300, False),
    "window": (dict(sliding_window=130), 8, 2, 300, 300, False),
    "softcap": (dict(causal=True, softcap=50.0, softmax_scale=0.35), 8, 2, 257, 257, False),
    "mha": (dict(causal=True), 4, 4, 300, 300, False),
    "varlen": (dict(causal=True), 8, 2, [190, 0, 129, 1], [250, 0, 64, 300], True),
    # sanitize's shrunk manifest cases: sequences shorter than every tile (4 and 16 queries, GQA 4)
    "tiny-4x8": (dict(causal=True), 32, 8, 4, 8, False),
    "tiny-16x32": (dict(causal=True), 32, 8, 16, 32, False),
}


def case(name: str) -> tuple:
    """(op kwargs, Hq, Hkv, head_dim, dtype, lens_q, lens_k, varlen) of a test id."""
    if name.startswith("d"):  # d<head_dim>-<dtype>: causal, Sq < Sk, two sequences
        d, dt = name[1:].split("-")
        return dict(causal=True), 8, 2, int(d), DTYPES[dt], 200, 333, False
    kw, hq, hkv, lq, lk, varlen = MASKS[name]
    return kw, hq, hkv, 128, torch.bfloat16, lq, lk, varlen


IDS = [f"d{d}-{dt}" for d in HEAD_DIMS for dt in DTYPES] + list(MASKS)


def make(name: str, seed: int) -> tuple:
    kw, hq, hkv, d, dtype, lq, lk, varlen = case(name)
    op = AttnFwdOp(hq, hkv, d, **kw)
    if varlen:
        t = cpu.draw(seed, {"q": (sum(lq), hq, d), "k": (sum(lk), hkv, d), "v": (sum(lk), hkv, d),
                            "dout": (sum(lq), hq, d)}, dtype)
        t["cu_seqlens_q"] = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32)
        t["cu_seqlens_k"] = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], dtype=torch.int32)
    else:
        t = cpu.dense(seed, 2, lq, lk, hq, hkv, d, dtype)
    return op, {n: x.to(DEV) for n, x in t.items()}


@pytest.fixture(scope="module")
def warm(request):
    """Every kernel the selected tests' ops launch (forward and backward), compiled at once, one
    process a CPU (``-k`` may select some)."""
    from tileops.compile.build import device_backend
    from tileops.compile.warmup import compile_jobs, op_kernel_jobs

    arch = device_backend(DEV)[1]
    names = {i.callspec.params["name"] for i in request.session.items
             if i.name.startswith("test_cuda_gradients[") and hasattr(i, "callspec")}
    names |= {"causal-sq<sk", "d128-bf16"}  # the views, copy and determinism tests' ops
    jobs = []
    for name in sorted(names):
        kw, hq, hkv, d, dtype, _, _, varlen = case(name)
        op = AttnFwdOp(hq, hkv, d, **kw)
        jobs += op_kernel_jobs(op.name, dict(op.params), {"q_dim": d, "q_heads": hq, "kv_heads": hkv},
                               [str(dtype).removeprefix("torch.")], arch,
                               with_inputs=("cu_seqlens_q", "cu_seqlens_k") if varlen else ())
    compile_jobs(jobs, progress=False)  # a kernel that fails to build fails its own test, where it is built again


@pytest.mark.parametrize("name", IDS)
def test_cuda_gradients(warm, name):
    op, t = make(name, 51)
    dq, _, _ = cpu.check(op, t, tensor_cores=True)
    if name == "causal-sq>sk":
        assert bool((dq[:, :133] == 0).all())


def test_cuda_hf_views_and_a_view_off_the_vectors(warm):
    """q, k, v and dO as HF's transposed views: gradients laid out like the inputs, bit for bit those
    of dense inputs; then a dO whose pointer is off the kernels' 16-byte vectors (one element into a
    buffer), which the plan's binding refuses and the fallback copies to a dense tensor first."""
    op, t = make("causal-sq<sk", 52)
    views = {n: x.transpose(1, 2).contiguous().transpose(1, 2) for n, x in t.items()}
    got = cpu.check(op, views, tensor_cores=True)
    for g, n in zip(got, "qkv"):
        assert g.stride() == views[n].stride()
    flat = cpu.run(op, t)
    assert all(torch.equal(a, b) for a, b in zip(got, flat))
    off = torch.empty(t["dout"].numel() + 1, dtype=t["dout"].dtype, device=DEV)[1:].view(t["dout"].shape)
    off.copy_(t["dout"])
    assert off.data_ptr() % 16
    shifted = cpu.run(op, {**t, "dout": off})
    assert all(torch.equal(a, b) for a, b in zip(shifted, flat))


def test_cuda_deterministic(warm):
    op, t = make("d128-bf16", 53)
    first, second = cpu.run(op, t), cpu.run(op, t)
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(first, second))
