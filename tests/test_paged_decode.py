"""``PagedAttnDecodeFwdOp`` on the CPU: the op's plan (split-KV partials, then the merge) against the
float64 reference of ``tests/references_attention.py``, the decode of a cache the prologue wrote, the
reports of bad block tables and lengths, the checks before any kernel runs, the torch target, and
the CUDA schedule's refusal of a head_dim it cannot read (its runs: ``tests/test_paged_decode_cuda.py``).

Bounds: the kernel tests' (``tests/test_paged_decode_kernels.py``: from the arithmetic, :func:`bound`),
with the magnitudes the reference returns.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import tileops
from tests.test_paged_decode_kernels import bound
from tileops.attention import AttnPrologueFwdOp, PagedAttnDecodeFwdOp
from tileops.rope import RoPENeoxPositionIdsFwdOp
from tileops.runtime.views import Misfit

_spec = importlib.util.spec_from_file_location("_decode_refs", Path(__file__).with_name("references_attention.py"))
refs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(refs)


def _inputs(seed, lens, *, bs=16, hq=8, hkv=2, d=64, dtype=torch.float32, layout="NHD", spare=2):
    """q, caches of shuffled blocks, block tables (unused entries -1) and lengths."""
    g = torch.Generator().manual_seed(seed)
    per = [max(1, -(-n // bs)) for n in lens]
    blocks = sum(per) + spare
    shape = (blocks, bs, hkv, d) if layout == "NHD" else (blocks, hkv, bs, d)
    kc, vc = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
    order = torch.randperm(blocks, generator=g).to(torch.int32)
    bt = torch.full((len(lens), max(per)), -1, dtype=torch.int32)
    at = 0
    for b, n in enumerate(per):
        bt[b, :n] = order[at:at + n]
        at += n
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    return {"q": q, "key_cache": kc, "value_cache": vc, "block_tables": bt,
            "seq_lens": torch.tensor(lens, dtype=torch.int32)}


def _check(op, t, **call):
    got = op(**t, **call)
    want, mag = refs.paged_decode(dict(op.params), t)
    _, terms = _terms(op, t)
    tol = bound(terms, op.params["head_dim"], 64, op.params["softcap"], want, t["q"].dtype)
    err = (got.double() - want).abs()
    assert bool(torch.isfinite(got).all())
    assert not bool((err > tol).any()), f"off by {err.max().item():.3g} (bound {tol.max().item():.3g})"
    return got


def _terms(op, t):
    """The magnitudes :func:`bound` takes: A (the largest scale * sum |q_d k_d|), max |v|, keys seen."""
    p = op.params
    d = p["head_dim"]
    sc = p["softmax_scale"] or d ** -0.5
    kc, vc = t["key_cache"].float().double(), t["value_cache"].float().double()
    if p["cache_dtype"] == "float8_e4m3fn":
        kc, vc = kc * float(t["k_scale"]), vc * float(t["v_scale"])
    a = float(t["q"].double().abs().amax()) * float(kc.abs().amax()) * d * sc  # a bound on every key's
    n = int(t["seq_lens"].clamp(min=0).max())
    return None, {"a": a, "v": float(vc.abs().amax()), "n": n}


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_layouts_match_the_reference(layout):
    op = PagedAttnDecodeFwdOp(8, 2, 64, cache_layout=layout)
    _check(op, _inputs(61, [37, 0, 1, 16, 300], layout=layout))


def test_many_splits_and_a_window_and_softcap():
    """Two sequences of kv heads 2: the plan splits each into up to 66 (264 programs) of at least 256
    tokens, so a 2,000-token context takes 8 splits; a window of 300 leaves most of them empty. The
    programs at most one wave on an H200: 8 sequences of kv heads 8 take 4 splits with the tiles of 128
    (2 programs an SM), 8 with tiles of 64 (4)."""
    from tileops.attention.decode_builtin import splits

    assert splits(2, 2, 2048) == 8 and splits(64, 8, 4096) == 1 and splits(1, 8, 100) == 1
    assert splits(8, 8, 32768) == 4 and splits(1, 8, 4096) == 16 and splits(33, 8, 4096) == 1
    assert splits(8, 8, 32768, 528) == 8 and splits(17, 8, 4096, 528) == 3
    op = PagedAttnDecodeFwdOp(8, 2, 64, sliding_window=300, softcap=30.0, softmax_scale=0.2)
    _check(op, _inputs(62, [2000, 700]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes(dtype):
    _check(PagedAttnDecodeFwdOp(8, 2, 64), _inputs(63, [40, 3], dtype=dtype))


def test_float8_cache():
    op = PagedAttnDecodeFwdOp(8, 2, 64, cache_dtype=torch.float8_e4m3fn)
    t = _inputs(64, [40, 3, 77], dtype=torch.bfloat16)
    t["key_cache"] = (t["key_cache"].float() * 30).clamp(-448, 448).to(torch.float8_e4m3fn)
    t["value_cache"] = (t["value_cache"].float() * 30).clamp(-448, 448).to(torch.float8_e4m3fn)
    _check(op, {**t, "k_scale": torch.tensor([0.02]), "v_scale": torch.tensor([0.5])})


def test_views_out_and_the_fast_path():
    """q as a view with a non-contiguous last dim (copied first), ``out=`` given, and the same call again
    (the runtime's binding): bit for bit the plain call's."""
    op = PagedAttnDecodeFwdOp(4, 2, 64)
    t = _inputs(65, [50, 20], hq=4)
    plain = op(**t)
    wide = torch.randn(2, 4, 64, 2, generator=torch.Generator().manual_seed(5))
    wide[..., 0] = t["q"]
    out = torch.full_like(t["q"], float("nan"))
    got = op(**{**t, "q": wide[..., 0]}, out=out)
    assert got is out and torch.equal(out, plain)
    assert all(torch.equal(op(**t), plain) for _ in range(3))


def test_reads_the_cache_the_prologue_wrote():
    """16 decode steps: each appends one token a sequence with the prologue (its slots from the block
    tables), then decodes it with the q the prologue returned. Every step's output agrees with the
    reference on the caches as written: the two ops agree on the layout, the slots and the lengths
    (the current token included)."""
    hq, hkv, d, bs = 4, 2, 64, 4
    rope = RoPENeoxPositionIdsFwdOp(max_position=4096)
    g = torch.Generator().manual_seed(66)
    for layout in ("NHD", "HND"):
        pro = AttnPrologueFwdOp(hq, hkv, d, rope, cache_layout=layout)
        dec = PagedAttnDecodeFwdOp(hq, hkv, d, cache_layout=layout)
        blocks = 12
        shape = (blocks, bs, hkv, d) if layout == "NHD" else (blocks, hkv, bs, d)
        kc, vc = torch.zeros(shape), torch.zeros(shape)
        bt = torch.tensor([[7, 2, 9, 0, 11], [4, 1, 10, 3, 5]], dtype=torch.int32)
        lens = torch.tensor([0, 3], dtype=torch.int32)
        for _ in range(16):
            qkv = torch.randn(2, (hq + 2 * hkv) * d, generator=g)
            pos = lens.clone()
            slots = (bt[torch.arange(2), (pos // bs).long()] * bs + pos % bs).to(torch.int32)
            q = pro(qkv, pos, kc, vc, slots)
            lens = lens + 1
            t = {"q": q, "key_cache": kc, "value_cache": vc, "block_tables": bt, "seq_lens": lens}
            _check(dec, t)
        k_last = kc[bt[1, (18 // bs)], 18 % bs] if layout == "NHD" else kc[bt[1, 18 // bs], :, 18 % bs]
        assert bool((k_last != 0).any()), "the second sequence's last token was written where the table says"


def test_bad_tables_and_lengths_are_reported_with_their_index():
    op = PagedAttnDecodeFwdOp(8, 2, 64)
    t = _inputs(67, [40, 30])
    blocks = t["key_cache"].shape[0]
    bad = t["block_tables"].clone()
    bad[1, 1] = blocks + 3
    with pytest.raises(ValueError, match=rf"block_tables: expected block numbers in \[0, num_blocks = {blocks}\).*"
                                         rf"got block_tables\[1, 1\] = {blocks + 3}"):
        op(**{**t, "block_tables": bad})
    with pytest.raises(ValueError, match=r"seq_lens: expected lengths in \[0, max_blocks \* block_size = 48\].*"
                                         r"got seq_lens\[0\] = 49"):
        op(**{**t, "seq_lens": torch.tensor([49, 30], dtype=torch.int32)})
    # sequence 1 holds 2 blocks: a length of 49 reads its table's padding (-1) too; the length is named
    with pytest.raises(ValueError, match=r"seq_lens: expected lengths in \[0, max_blocks \* block_size = 48\].*"
                                         r"got seq_lens\[1\] = 49"):
        op(**{**t, "seq_lens": torch.tensor([40, 49], dtype=torch.int32)})
    with tileops.strict(), pytest.raises(ValueError, match=r"got seq_lens\[1\] = -2"):
        op(**{**t, "seq_lens": torch.tensor([40, -2], dtype=torch.int32)})
    assert torch.equal(op(**t), op(**t)), "a good call after the bad ones runs as before"


def test_an_entry_past_the_length_is_never_read():
    """Entries past a sequence's length (the table's padding, any value) are not checked or read."""
    op = PagedAttnDecodeFwdOp(8, 2, 64)
    t = _inputs(68, [10, 30])
    t["block_tables"][0, 1] = 10**6  # sequence 0 has 10 tokens: one block
    _check(op, t)


def _fp8(t):
    return {n: t[n].to(torch.float8_e4m3fn) for n in ("key_cache", "value_cache")}


FP8 = dict(cache_dtype=torch.float8_e4m3fn)
# id -> (op kwargs, the call's changes, what the error says)
BAD = {
    "table-rows": ({}, lambda t: {"block_tables": t["block_tables"][:1]},
                   r"block_tables: expected batch=2 \(as in q\), got batch=1"),
    "table-no-blocks": ({}, lambda t: {"block_tables": t["block_tables"][:, :0]},
                        r"block_tables: expected at least one block a sequence"),
    "lens-count": ({}, lambda t: {"seq_lens": t["seq_lens"][:1]},
                   r"seq_lens: expected batch=2 \(as in q\), got batch=1"),
    "cache-dtype": ({}, lambda t: {n: t[n].to(torch.float16) for n in ("key_cache", "value_cache")},
                    r"key_cache: expected the cache in cache_dtype"),
    "cache-no-blocks": ({}, lambda t: {n: t[n][:0] for n in ("key_cache", "value_cache")},
                        r"key_cache: expected at least one block of at least one row"),
    "q-heads": ({}, lambda t: {"q": t["q"][:, :4]}, r"q: expected num_q_heads heads"),
    "value-strides": ({}, lambda t: {"value_cache": t["value_cache"].transpose(0, 1).contiguous().transpose(0, 1)},
                      r"value_cache: expected the strides of key_cache"),
    "scale-without-fp8": ({}, lambda t: {"k_scale": torch.tensor(1.0), "v_scale": torch.tensor(1.0)},
                          r"k_scale: expected no k_scale"),
    "q-not-cache-dtype": (dict(cache_dtype=torch.float16),
                          lambda t: {n: t[n].half() for n in ("key_cache", "value_cache")},
                          r"q: expected q in cache_dtype"),
    "fp8-without-scales": (FP8, _fp8, r"k_scale: expected k_scale and v_scale with an fp8 cache"),
    "fp8-two-scales": (FP8, lambda t: {**_fp8(t), "k_scale": torch.ones(2), "v_scale": torch.ones(2)},
                       r"k_scale: expected one scale per tensor"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_inputs_are_refused_before_any_kernel(name, monkeypatch):
    from tileops.attention import decode_builtin

    monkeypatch.setattr(decode_builtin, "load_kernel", lambda *a, **k: pytest.fail("a kernel was built"))
    kw, change, match = BAD[name]
    t = _inputs(69, [10, 30])
    with pytest.raises((ValueError, TypeError), match=match):
        PagedAttnDecodeFwdOp(8, 2, 64, **kw)(**{**t, **change(t)})


def test_torch_target_agrees():
    t = _inputs(70, [37, 0, 5], layout="HND")
    ours = PagedAttnDecodeFwdOp(8, 2, 64, cache_layout="HND")(**t)
    plain = PagedAttnDecodeFwdOp(8, 2, 64, cache_layout="HND", target="torch")(**t)
    want, _ = refs.paged_decode({**PagedAttnDecodeFwdOp(8, 2, 64, cache_layout="HND").params}, t)
    _, terms = _terms(PagedAttnDecodeFwdOp(8, 2, 64, cache_layout="HND"), t)
    tol = bound(terms, 64, 64, None, want, torch.float32)
    assert bool(((plain.double() - want).abs() <= tol).all())  # the same sums in another order: the same bound
    assert bool(((ours.double() - want).abs() <= tol).all())


def _as_cuda(monkeypatch, enabled: bool, kernel=None):
    """The op's host side as on a GPU (no kernel runs: ``kernel`` stands in for every one, else a
    kernel built fails the test), the CUDA kernels let run or not."""
    from tileops.attention import decode_builtin
    from tileops.attention.attn_builtin import CUDA_ENV

    monkeypatch.setattr(decode_builtin, "device_backend", lambda device: ("cuda", "sm_90"))
    monkeypatch.setattr(decode_builtin, "load_kernel",
                        (lambda *a, **k: kernel) if kernel is not None else
                        (lambda *a, **k: pytest.fail("a kernel was built")))
    monkeypatch.setenv(CUDA_ENV, "1" if enabled else "0")


def test_cuda_calls_are_refused_when_the_variable_says_0(monkeypatch):
    _as_cuda(monkeypatch, enabled=False)
    with pytest.raises(NotImplementedError, match=r"CUDA: the paged decode's CUDA kernels are refused by "
                                                   r"TILEOPS_ATTENTION_CUDA=0: target='torch'"):
        PagedAttnDecodeFwdOp(8, 2, 64)(**_inputs(71, [10]))


def test_cuda_refuses_a_head_dim_its_schedule_cannot_read(monkeypatch):
    """On CUDA a row is read in vectors, one a lane of a warp: fp32 (4-element vectors) reaches 128, so
    head_dim 256 is refused at the first call, naming the torch target, before a kernel is built."""
    _as_cuda(monkeypatch, enabled=True)
    t = _inputs(71, [10], d=256)
    with pytest.raises(NotImplementedError, match=r"head_dim: the CUDA paged decode reads a row as vectors of 4 "
                                                   r"elements, one a lane of a warp: expected a multiple of 4 up to "
                                                   r"128, got 256; target='torch'"):
        PagedAttnDecodeFwdOp(8, 2, 256)(**t)


def test_cuda_host_side_strides_in_vectors_and_caches_on_them(monkeypatch):
    """The host side of a CUDA call, run here with a stand-in kernel: an aligned call binds its strides
    in vectors (8 elements of bf16) and reaches the kernels; the plan's fit policy refuses a cache off
    the 16-byte vectors with a ValueError naming it (a binding is made from strides alone, and the
    executor's per-call pointer check sends such a call to that policy: the CUDA test
    ``test_cuda_binding_refuses_a_cache_or_q_off_the_vectors_it_was_bound_on_aligned``), and copies a q
    off them. (The H200's first call found a bug on this path that no CPU test had reached.)"""
    class Reached(Exception):
        pass

    class Kernel:  # what the plan's binding asks of a kernel: it stops there
        def __getattr__(self, name):
            raise Reached(name)

    _as_cuda(monkeypatch, enabled=True, kernel=Kernel())
    op = PagedAttnDecodeFwdOp(8, 2, 128, cache_layout="HND")
    t = _inputs(72, [40, 3], d=128, dtype=torch.bfloat16, layout="HND")
    off = torch.zeros(t["key_cache"].numel() + 1, dtype=torch.bfloat16)[1:].view(t["key_cache"].shape)
    with pytest.raises(Reached):
        op(**t)
    impl = next(iter(op._impls.values()))
    assert (impl.unit, impl.out_unit) == (8, 8)
    assert not isinstance(impl.plan.layout({**t, "out": None}, impl.units, pointers=True), Misfit)
    q = torch.zeros(t["q"].numel() + 1, dtype=torch.bfloat16)[1:].view(t["q"].shape)  # a vector's element in
    assert impl.plan.layout({**t, "q": q}, impl.units, pointers=True) == Misfit("q", "alignment")
    placed = impl.plan.place({**t, "q": q}, {"out": None}, impl.units)
    assert placed.inputs["q"] is not q and placed.inputs["q"].data_ptr() % 16 == 0, "a q off the vectors is copied"
    with pytest.raises(ValueError, match=r"value_cache: expected its data pointer and strides on a multiple of 8 "
                                         r"elements \(16 bytes: the CUDA kernel's vectors\), got data pointer offset"):
        impl.plan.place({**t, "value_cache": off.as_strided(t["value_cache"].shape, t["value_cache"].stride())},
                        {"out": None}, impl.units)


def test_cuda_binding_refuses_a_cache_or_q_off_the_vectors_it_was_bound_on_aligned(monkeypatch):
    """A binding is kept by signature (shapes, strides, dtypes), which says nothing of where a tensor
    starts: a cache one element off its vectors, shaped like the aligned one a binding was made for,
    must leave the binding (the executor's pointer check) for the general path, which names it. On
    the H200 such a call went through the binding and faulted ("misaligned address")."""
    from tileops.runtime.executor import PythonRuntime

    class Kernel:  # enough of a compiled kernel to be bound; a launch fails the test
        device_index = None

        def __init__(self, spec):
            self.slot = {n: i for i, n in enumerate(spec.args)}

        def template(self, values):
            return [0] * len(self.slot)

        def launch(self, *a):
            pytest.fail("a kernel was launched")

    from tileops.attention import decode_builtin

    _as_cuda(monkeypatch, enabled=True)
    monkeypatch.setattr(decode_builtin, "load_kernel", lambda builder, spec, *a, **k: Kernel(spec))
    op = PagedAttnDecodeFwdOp(8, 2, 128, cache_layout="HND")
    t = _inputs(74, [40, 3], d=128, dtype=torch.bfloat16, layout="HND")
    b = op._impl_for(op._check_call(t)).binding(t, {"out": None})
    names = b.names
    needs = {names[i]: a for launch in b.launches for i, _, a in launch.pointers if i < len(names)}
    assert {n: needs.get(n) for n in ("q", "key_cache", "value_cache", "out")} == {
        "q": 16, "key_cache": 16, "value_cache": 16, "out": 16}
    for name in ("key_cache", "value_cache", "q"):
        off = torch.zeros(t[name].numel() + 1, dtype=torch.bfloat16)[1:].view(t[name].shape)
        assert PythonRuntime(0).execute(b, {**t, name: off}, {"out": None}) is NotImplemented, name


def test_a_report_names_every_limit_the_op_was_called_with():
    """Calls with tables of two sizes: a bad length's error names both limits, not the last call's alone."""
    op = PagedAttnDecodeFwdOp(8, 2, 64)
    op(**_inputs(72, [40, 30]))  # 3 blocks of 16 a sequence: 48 tokens
    with pytest.raises(ValueError, match=r"max_blocks \* block_size \(this op's calls had 32, 48\)\].*"
                                         r"got seq_lens\[0\] = 49"):
        op(**{**_inputs(73, [20, 30]), "seq_lens": torch.tensor([49, 30], dtype=torch.int32)})
