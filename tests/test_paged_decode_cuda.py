"""``PagedAttnDecodeFwdOp``'s CUDA schedule on the GPU (skipped without one): the op against the float64
reference (``tests/references_attention.py``) in bf16, fp16 and float8 caches, NHD and HND, block sizes
1 and 16, head_dim 64, 128 and 256, GQA groups of 1, 4 and 16, fp32, windows and softcap, contexts that split;
bad block tables and lengths reported with their index (deferred, then ``op.check()``); views off the
16-byte vectors; and 64 decode steps of a layer, ``AttnPrologueFwdOp`` then this op captured in one CUDA
graph and replayed on new tokens, positions, slots, block tables and lengths.

Bounds: the kernel tests' (``tests/test_paged_decode_kernels.py``, :func:`bound`, from the arithmetic),
with the magnitudes of the inputs (:func:`tests.test_paged_decode._terms`), and for the tensor-core
schedule (the manifest's for 16-bit q: ``mma``) what its products add (:func:`tolerance`). The GPU's
``exp2f``, ``log2f`` and ``tanhf`` are within 2 ulp of the correctly rounded values, inside the bound's
few ``u`` for each.
"""

from __future__ import annotations

import pytest
import torch

import tileops
from tests.test_paged_decode import _inputs, _terms, refs
from tests.test_paged_decode_kernels import UNIT, bound
from tileops.attention import AttnPrologueFwdOp, PagedAttnDecodeFwdOp
from tileops.attention.attn_builtin import CUDA_ENV
from tileops.attention.decode_builtin import cuda_enabled
from tileops.rope import RoPENeoxPositionIdsFwdOp

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not cuda_enabled(), reason=f"{CUDA_ENV}=0 refuses the paged "
                                                   "decode's CUDA kernels")]

DEV = "cuda"


def _on(t: dict) -> dict:
    return {n: v.to(DEV) for n, v in t.items()}


def _check(op, t, **call):
    """The op on the GPU (out NaN-filled first) against the reference on ``t``'s CPU tensors."""
    out = torch.full(t["q"].shape, float("nan"), dtype=t["q"].dtype, device=DEV)
    got = op(**_on(t), out=out, **call)
    assert got is out
    op.check()
    want, _ = refs.paged_decode(dict(op.params), t)
    tol = tolerance(op, t, want)
    err = (got.cpu().double() - want).abs()
    assert bool(torch.isfinite(got).all()), "a NaN or inf in out (an element never written?)"
    assert not bool((err > tol).any()), (f"off by {err.max().item():.3g} ({(err / tol).max().item():.2f} x the "
                                         f"bound) at {(err > tol).nonzero()[0].tolist()}")
    return got


def tolerance(op, t: dict, want: torch.Tensor) -> torch.Tensor:
    """The elementwise bound on ``|out - want|`` for ``t`` (CPU tensors): :func:`bound`, and where the
    call takes the tensor-core schedule (``mma`` in the op's manifest, 16-bit q) what it adds, from the
    arithmetic:

    * the products' fp32 accumulation: the attention tests' 2^-22 a step (``tests/test_attn_bwd.py``
      ``u_exp``) in place of 2^-24 in the logits' error, 4x its ``(D + 8) u A`` term;
    * p rounded to the dtype before ``P V`` (the sum l is taken before, in fp32): the output, a sum of
      weights times values over l, moves at most ``unit * max|v|``.

    A float8 cache's elements enter the products exactly (e4m3 values are fp16 and bf16 values) and
    its scales multiply the fp32 scores and output: one rounding each, inside the bound's few ``u``."""
    _, terms = _terms(op, t)
    dtype, p = t["q"].dtype, op.params
    if not (op.manifest.kernel.static.get("mma") and dtype != torch.float32):
        return bound(terms, p["head_dim"], 264, p["softcap"], want, dtype)
    return (bound({**terms, "a": 4 * terms["a"]}, p["head_dim"], 264, p["softcap"], want, dtype)
            + UNIT[dtype] * terms["v"])


LENS = [37, 0, 1, 16, 300, 2000]  # empty, one token, a block exactly, a part block, a context that splits


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("bs", [16, 1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_layouts_block_sizes_dtypes(layout, bs, dtype):
    op = PagedAttnDecodeFwdOp(8, 2, 128, cache_layout=layout)
    got = _check(op, _inputs(81, LENS, bs=bs, d=128, dtype=dtype, layout=layout))
    assert bool((got[1] == 0).all()), "a sequence of no token outputs zeros"


@pytest.mark.parametrize("d,hq,hkv,dtype", [(64, 32, 8, torch.bfloat16), (256, 8, 2, torch.bfloat16),
                                             (128, 8, 8, torch.float16), (128, 16, 1, torch.bfloat16),
                                             (128, 8, 2, torch.float32)],
                         ids=["d64-gqa4", "d256", "mha", "group16", "fp32"])
def test_head_dims_groups_and_fp32(d, hq, hkv, dtype):
    _check(PagedAttnDecodeFwdOp(hq, hkv, d), _inputs(82, [700, 5, 64], d=d, hq=hq, hkv=hkv, dtype=dtype))


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_float8_cache(layout):
    op = PagedAttnDecodeFwdOp(8, 2, 128, cache_dtype=torch.float8_e4m3fn, cache_layout=layout)
    t = _inputs(83, LENS, d=128, dtype=torch.bfloat16, layout=layout)
    t["key_cache"] = (t["key_cache"].float() * 30).clamp(-448, 448).to(torch.float8_e4m3fn)
    t["value_cache"] = (t["value_cache"].float() * 30).clamp(-448, 448).to(torch.float8_e4m3fn)
    _check(op, {**t, "k_scale": torch.tensor([0.02]), "v_scale": torch.tensor([0.5])})


def test_window_and_softcap():
    op = PagedAttnDecodeFwdOp(8, 2, 128, sliding_window=300, softcap=30.0, softmax_scale=0.2)
    _check(op, _inputs(84, [2000, 700, 3], d=128, dtype=torch.bfloat16))


def test_agrees_with_the_torch_target():
    t = _on(_inputs(85, LENS, d=128, dtype=torch.float16, layout="HND"))
    ours = PagedAttnDecodeFwdOp(8, 2, 128, cache_layout="HND")(**t)
    plain = PagedAttnDecodeFwdOp(8, 2, 128, cache_layout="HND", target="torch")(**t)
    # both within the bound of the same reference: within twice it of each other
    op = PagedAttnDecodeFwdOp(8, 2, 128, cache_layout="HND")
    want, _ = refs.paged_decode(dict(op.params), t)
    tol = tolerance(op, {n: v.cpu() for n, v in t.items()}, want)
    assert bool(((ours.cpu().double() - plain.cpu().double()).abs() <= 2 * tol).all())


def test_bad_tables_and_lengths_are_reported_with_their_index():
    """Deferred: the call returns, ``op.check()`` raises naming the first bad element, also for a
    table made for the call and freed before the report (the kernel's record); strict raises at the
    call; nothing is read outside the cache; a good call after them is as before."""
    op = PagedAttnDecodeFwdOp(8, 2, 128)
    t = _on(_inputs(86, [40, 30], d=128, dtype=torch.bfloat16))
    blocks = t["key_cache"].shape[0]
    good = op(**t).clone()
    bad = t["block_tables"].clone()
    bad[1, 1] = blocks + 3
    op(**{**t, "block_tables": bad})
    with pytest.raises(ValueError, match=rf"got block_tables\[1, 1\] = {blocks + 3}"):
        op.check()
    tables = t["block_tables"].cpu().clone()
    tables[0, 2] = -7
    op(**{**t, "block_tables": tables.to(DEV)})  # a temporary, freed before the report
    with pytest.raises(ValueError, match=r"got block_tables\[0, 2\] = -7"):
        op.check()
    op(**{**t, "seq_lens": torch.tensor([40, 49], dtype=torch.int32, device=DEV)})
    with pytest.raises(ValueError, match=r"seq_lens: expected lengths in \[0, max_blocks \* block_size = 48\].*"
                                         r"got seq_lens\[1\] = 49"):
        op.check()
    with tileops.strict(), pytest.raises(ValueError, match=r"got seq_lens\[0\] = -1"):
        op(**{**t, "seq_lens": torch.tensor([-1, 30], dtype=torch.int32, device=DEV)})
    assert torch.equal(op(**t), good)
    op.check()


def test_views_off_the_vectors():
    """q and out off the 16-byte vectors go through dense copies (bit for bit the plain call's); a cache
    off them is a ValueError naming it, before any kernel runs."""
    op = PagedAttnDecodeFwdOp(4, 2, 64)
    t = _on(_inputs(87, [50, 20], hq=4, dtype=torch.bfloat16))
    plain = op(**t)
    wide = torch.zeros(2, 4 * 64 + 1, dtype=torch.bfloat16, device=DEV)
    q = wide[:, 1:].view(2, 4, 64)  # starts one element into a vector
    q.copy_(t["q"])
    owide = torch.full((2, 4 * 64 + 1), float("nan"), dtype=torch.bfloat16, device=DEV)
    out = owide[:, 1:].view(2, 4, 64)
    assert op(**{**t, "q": q}, out=out) is out and torch.equal(out, plain)
    kc = torch.zeros(t["key_cache"].numel() + 1, dtype=torch.bfloat16, device=DEV)[1:].view(t["key_cache"].shape)
    with pytest.raises(ValueError, match=r"key_cache: expected its data pointer and strides on a multiple of 8"):
        op(**{**t, "key_cache": kc, "value_cache": kc})


def test_a_layer_step_in_a_cuda_graph_64_steps():
    """The decode step of a layer: the prologue appends each sequence's token to the cache and returns
    its q, the decode reads the cache. Captured once in a CUDA graph and replayed 64 times on new
    tokens, positions, slots and lengths; at step 32 the tables move the sequences' later blocks
    elsewhere. Each step's output against the float64 reference on the cache as the prologue wrote it."""
    hq, hkv, d, bs, batch, nblk = 8, 2, 128, 16, 4, 8
    gen = torch.Generator().manual_seed(88)
    rope = RoPENeoxPositionIdsFwdOp(max_position=4096)
    pro = AttnPrologueFwdOp(hq, hkv, d, rope, cache_layout="HND")
    dec = PagedAttnDecodeFwdOp(hq, hkv, d, cache_layout="HND")
    blocks = 2 * batch * nblk
    kc = torch.zeros(blocks, hkv, bs, d, dtype=torch.bfloat16, device=DEV)
    vc = torch.zeros_like(kc)
    order = torch.randperm(blocks, generator=gen).to(torch.int32)
    tables = order[:batch * nblk].view(batch, nblk).clone()
    spare = order[batch * nblk:].view(batch, nblk)
    lens = torch.tensor([0, 5, 17, 40], dtype=torch.int32)
    bt = tables.to(DEV)
    qkv = torch.empty(batch, (hq + 2 * hkv) * d, dtype=torch.bfloat16, device=DEV)
    pos = torch.empty(batch, dtype=torch.int64, device=DEV)
    slots = torch.empty(batch, dtype=torch.int64, device=DEV)
    sl = torch.empty(batch, dtype=torch.int32, device=DEV)
    q = torch.empty(batch, hq, d, dtype=torch.bfloat16, device=DEV)
    out = torch.empty(batch, hq, d, dtype=torch.bfloat16, device=DEV)

    def feed(lens):
        qkv.copy_(torch.randn(batch, (hq + 2 * hkv) * d, generator=gen).to(torch.bfloat16))
        pos.copy_(lens.long())
        slots.copy_((tables[torch.arange(batch), (lens // bs).long()] * bs + lens % bs).long())
        sl.copy_(lens + 1)

    def step():
        pro(qkv, pos, kc, vc, slots, q_out=q)
        dec(q, kc, vc, bt, sl, out=out)

    feed(lens)
    step()  # compiles and binds both ops outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for i in range(64):
        if i == 32:  # blocks not reached yet move to spare ones
            later = torch.arange(nblk)[None, :] > ((lens + 1) // bs)[:, None]
            tables = torch.where(later, spare, tables)
            bt.copy_(tables)
        feed(lens)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        lens = lens + 1
        t = {"q": q.cpu(), "key_cache": kc.cpu(), "value_cache": vc.cpu(), "block_tables": tables.clone(),
             "seq_lens": lens.clone()}
        want, _ = refs.paged_decode(dict(dec.params), t)
        tol = tolerance(dec, t, want)
        err = (out.cpu().double() - want).abs()
        assert not bool((err > tol).any()), f"step {i}: off by {err.max().item():.3g}"
    pro.check()
    dec.check()


# ------------------------------------------------------------------------------ the tensor-core schedule
# ``mma=1`` (``kernels/paged_decode.py`` ``_partial_mma``, the manifest's schedule for 16-bit q): the
# group's q heads as the rows of mma.sync products over tiles of tokens gathered from the pages into
# shared memory, at other tiles, thread counts, groups and head dims than the manifest's.
MMA_CASES = {
    # id: (head_dim, hq, hkv, dtype, cache dtype, layout, block size, lens, fields, op kwargs)
    "gqa4-bf16-nhd-bs16": (128, 8, 2, torch.bfloat16, None, "NHD", 16, LENS, {}, {}),
    "gqa4-fp16-hnd-bs1": (128, 8, 2, torch.float16, None, "HND", 1, [37, 0, 1, 300], {}, {}),
    "d64-gqa4-tile32": (64, 32, 8, torch.bfloat16, None, "NHD", 16, [700, 5, 64], {"tile": 32}, {}),
    "d256-256threads": (256, 8, 2, torch.bfloat16, None, "HND", 16, [700, 5, 64], {"threads": 256}, {}),
    "tile128": (128, 8, 2, torch.bfloat16, None, "NHD", 16, [700, 5, 64], {"tile": 128}, {}),
    "mha": (128, 8, 8, torch.float16, None, "NHD", 16, [700, 5, 64], {}, {}),
    "group16": (128, 16, 1, torch.bfloat16, None, "NHD", 16, [700, 5, 64], {}, {}),
    "group32-two-chunks": (64, 32, 1, torch.bfloat16, None, "NHD", 8, [200, 3], {"tile": 16, "threads": 64}, {}),
    # a float8 cache read one element at a time (widen=0; the manifest widens): tiles of 64, no prefetch
    "float8": (128, 8, 2, torch.bfloat16, torch.float8_e4m3fn, "HND", 16, LENS, {"widen": 0}, {}),
    "window-softcap": (128, 8, 2, torch.bfloat16, None, "NHD", 16, [2000, 700, 3], {},
                       dict(sliding_window=300, softcap=30.0, softmax_scale=0.2)),
    # the next tile's pages and rows loaded during this tile's products (two slots of token flags)
    "prefetch": (128, 8, 2, torch.bfloat16, None, "NHD", 16, LENS, {"prefetch": 1}, {}),
    # (a float8 cache read one element at a time takes tiles of 64 without the prefetch whatever the
    # schedule asks: decode_builtin's _MMA_NARROW; this case once asked for the prefetch, and ran without it)
    "float8-window": (128, 8, 2, torch.bfloat16, torch.float8_e4m3fn, "HND", 16, [2000, 700, 3], {"widen": 0},
                      dict(sliding_window=300)),
    # a float8 cache widened eight elements at once (widen=1, the manifest's), its caches holding every finite
    # e4m3fn code: at tiles of 64 with the prefetch (decode_builtin._MMA_FLOAT8_WIDENED), and without it
    "float8-widen": (128, 8, 2, torch.bfloat16, torch.float8_e4m3fn, "HND", 16, LENS, {"widen": 1}, {}),
    "float8-widen-fp16-nhd-window-tile64": (128, 32, 8, torch.float16, torch.float8_e4m3fn, "NHD", 1,
                                            [2000, 700, 3], {"widen": 1, "tile": 64, "prefetch": 0},
                                            dict(sliding_window=300)),
    # widened, the products are fp16 and a bf16 q's rows are rescaled into fp16 by a power of two: q times
    # 2^17 (past fp16's 65504) and 2^-30 (under its smallest subnormal, 2^-24), the scale undoing it, so
    # that a q cast to fp16 as it comes gives inf or zeros
    "float8-widen-q-large": (128, 8, 2, torch.bfloat16, torch.float8_e4m3fn, "NHD", 16, LENS, {"widen": 1},
                             dict(softmax_scale=2.0**-17 / 128**0.5)),
    "float8-widen-q-small-softcap": (128, 8, 2, torch.bfloat16, torch.float8_e4m3fn, "HND", 16, LENS, {"widen": 1},
                                     dict(softmax_scale=2.0**30 / 128**0.5, softcap=20.0)),
}
#: the factor a case's q is multiplied by (a power of two: exact in bf16)
Q_FACTOR = {"float8-widen-q-large": 2.0**17, "float8-widen-q-small-softcap": 2.0**-30}


def _mma_op(name: str) -> PagedAttnDecodeFwdOp:
    """The case's op with its manifest's CUDA schedule set to the tensor-core one."""
    from benchmarks.decode import with_schedule

    d, hq, hkv, dtype, cache, layout, bs, lens, fields, kw = MMA_CASES[name]
    return with_schedule(PagedAttnDecodeFwdOp(hq, hkv, d, cache_layout=layout, cache_dtype=cache, **kw),
                         {"mma": 1, **fields})


def mma_kernel_jobs(arch: str) -> list[tuple]:
    """The kernel jobs of the tensor-core cases (``benchmarks.device_cache`` compiles them off the GPU:
    TileLang's own nvcc build, ~20 s a program, since they take dynamic shared memory)."""
    from tileops.attention.decode_builtin import kernel_specs
    from tileops.manifest import call_specs

    jobs = []
    for name, (d, hq, hkv, dtype, cache, *_) in MMA_CASES.items():
        op = _mma_op(name)
        dims = {"q_dim": d, "q_heads": hq, "cache_heads": hkv}
        with_inputs = ("k_scale", "v_scale") if cache is not None else ()
        for call in call_specs(op.manifest, dims, [str(dtype).removeprefix("torch.")], torch.device("cuda"),
                               with_inputs, params=op.params):
            jobs += [(b, s, "cuda", arch) for b, s in kernel_specs(op.manifest, op.params, call, "cuda")]
    return list(dict.fromkeys(jobs))


def _case_inputs(name: str) -> dict:
    d, hq, hkv, dtype, cache, layout, bs, lens, fields, kw = MMA_CASES[name]
    t = _inputs(89, lens, bs=bs, d=d, hq=hq, hkv=hkv, dtype=dtype, layout=layout)
    t["q"] = t["q"] * Q_FACTOR.get(name, 1.0)
    if cache is not None and fields.get("widen"):  # every finite code (all but 0x7F and 0xFF), key and value apart
        finite = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.int32).to(torch.uint8)
        for i, name in enumerate(("key_cache", "value_cache")):
            n = t[name].numel()
            t[name] = finite[(torch.arange(n) * (7 + 4 * i) + 3 * i) % len(finite)].view(cache).view(t[name].shape)
        t.update(k_scale=torch.tensor([0.02]), v_scale=torch.tensor([0.5]))
    elif cache is not None:
        t["key_cache"] = (t["key_cache"].float() * 30).clamp(-448, 448).to(cache)
        t["value_cache"] = (t["value_cache"].float() * 30).clamp(-448, 448).to(cache)
        t.update(k_scale=torch.tensor([0.02]), v_scale=torch.tensor([0.5]))
    return t


@pytest.mark.parametrize("name", list(MMA_CASES))
def test_tensor_core_schedule(name):
    got = _check(_mma_op(name), _case_inputs(name))
    empty = [i for i, n in enumerate(MMA_CASES[name][7]) if n == 0]
    assert all(bool((got[i] == 0).all()) for i in empty), "a sequence of no token outputs zeros"


#: the ops the tests above make with the manifest's schedule, as ``(num_q_heads, num_kv_heads, head_dim,
#: q dtype, op kwargs)`` (:func:`decode_kernel_jobs`): layout and block size are not part of a kernel
DEFAULT_SCHEDULE_OPS = [
    (8, 2, 128, torch.bfloat16, {}), (8, 2, 128, torch.float16, {}),
    (32, 8, 64, torch.bfloat16, {}), (8, 2, 256, torch.bfloat16, {}), (8, 8, 128, torch.float16, {}),
    (16, 1, 128, torch.bfloat16, {}), (8, 2, 128, torch.float32, {}),
    (8, 2, 128, torch.bfloat16, {"cache_dtype": torch.float8_e4m3fn}),
    (8, 2, 128, torch.bfloat16, {"sliding_window": 300, "softcap": 30.0, "softmax_scale": 0.2}),
    (4, 2, 64, torch.bfloat16, {}),
]


def decode_kernel_jobs(arch: str) -> list[tuple]:
    """The kernel jobs of :data:`DEFAULT_SCHEDULE_OPS` (``benchmarks.device_cache`` compiles them off the
    GPU, beside :func:`mma_kernel_jobs`'s)."""
    from tileops.attention.decode_builtin import kernel_specs
    from tileops.manifest import call_specs

    jobs = []
    for hq, hkv, d, dtype, kw in DEFAULT_SCHEDULE_OPS:
        op = PagedAttnDecodeFwdOp(hq, hkv, d, **kw)
        given = ("k_scale", "v_scale") if "cache_dtype" in kw else ()
        for call in call_specs(op.manifest, {"q_dim": d, "q_heads": hq, "cache_heads": hkv},
                               [str(dtype).removeprefix("torch.")], torch.device("cuda"), given, params=op.params):
            jobs += [(b, s, "cuda", arch) for b, s in kernel_specs(op.manifest, op.params, call, "cuda")]
    return list(dict.fromkeys(jobs))


def test_a_nan_in_q_or_the_caches_gives_nan_where_the_definition_puts_it():
    """NaN in, NaN out (``tests/test_paged_decode_kernels.py`` says why this is tested), on the tensor-core
    schedule, one split (the partial writes out) and several (the merge): a NaN key element or a NaN in q
    makes the heads that read it NaN, a NaN value element their column; an unreached block is never read."""
    op = PagedAttnDecodeFwdOp(8, 2, 128)
    for lens in ([37, 0, 1, 16, 300], [2000, 700, 3]):  # one split, then several (the longest sequence splits)
        t = _inputs(90, lens, d=128, dtype=torch.bfloat16)
        clean = {n: v.clone() for n, v in t.items()}  # (the bound's magnitudes, from the inputs without NaN)
        bt = t["block_tables"]
        nan = float("nan")
        t["key_cache"][bt[0, 0], 5, 0, 7] = nan  # sequence 0, token 5, kv head 0: q heads 0-3
        t["value_cache"][bt[-1, 0], 1, 1, 3] = nan  # the last sequence, token 1, kv head 1: column 3 of heads 4-7
        t["q"][1, 2, 11] = nan  # sequence 1, q head 2 (a sequence of no token outputs zeros all the same)
        unread = sorted(set(range(t["key_cache"].shape[0])) - set(bt.flatten().tolist()))
        t["key_cache"][unread[0]] = nan
        got = op(**_on(t), out=torch.full(t["q"].shape, nan, dtype=t["q"].dtype, device=DEV)).cpu()
        op.check()
        want, _ = refs.paged_decode(dict(op.params), t)
        assert torch.equal(got.isnan(), want.isnan()), lens
        fine = ~want.isnan()
        tol = tolerance(op, clean, refs.paged_decode(dict(op.params), clean)[0])
        assert bool(((got.double() - want).abs()[fine] <= tol[fine]).all()), lens
