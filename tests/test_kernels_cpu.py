"""BUILTIN kernels (TileLang C on the CPU) against the float64 references, on odd shapes.

Every output is compared element by element with ``tests/references.py`` (float64, no shared code
with the kernels). Inputs are random draws, seeded per test; outputs are new tensors, so an unwritten element
would hold whatever ``torch.empty`` left there: we also check the kernel writes every element by
running it into memory pre-filled with NaN (see ``test_every_element_written``).
"""

from __future__ import annotations

import pytest
import torch

from tests.references import reference
from tileops import BUILTIN
from tileops.rope import RoPEFwdOp, RoPENeoxPositionIdsFwdOp
from tileops.testing import tolerance

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    atol, rtol = tolerance(out.dtype)
    got = out.double()
    assert torch.isfinite(got).all(), "non-finite output"
    err = (got - ref).abs()
    bad = err > atol + rtol * ref.abs()
    assert not bad.any(), f"{int(bad.sum())} elements off; max error {err.max().item():.3e}"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("rope_layout", ["neox", "interleaved"])
@pytest.mark.parametrize("seq_len", [1, 37, 300])
@pytest.mark.parametrize("head_dim", [80, 96])
def test_rope_1d_2d(dtype, rope_layout, seq_len, head_dim, gen):
    for layout, shape in (("1d", (seq_len, head_dim)), ("2d", (2, seq_len, 5, head_dim))):
        op = RoPEFwdOp(rope_layout=rope_layout, input_layout=layout, target=BUILTIN)
        x = torch.randn(shape, generator=gen).to(dtype)
        before = x.clone()
        out = op(x)
        assert out.shape == x.shape and out.dtype == dtype and out.data_ptr() != x.data_ptr()
        assert torch.equal(x, before), "the input was modified"
        assert_close(out, reference("RoPEFwdOp", {"rope_layout": rope_layout, "input_layout": layout}, {"x": x}))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_position_ids_partial(dtype, pos_dtype, gen):
    op = RoPENeoxPositionIdsFwdOp(50_000, rotary_dim=96, target=BUILTIN)
    x = torch.randn(23, 7, 256, generator=gen).to(dtype)
    pos = torch.randint(0, 50_000, (23,), generator=gen, dtype=pos_dtype)
    out = op(x, pos)
    ref = reference("RoPENeoxPositionIdsFwdOp", {"max_position": 50_000, "rotary_dim": 96},
                    {"x": x, "position_ids": pos})
    assert_close(out, ref)
    assert torch.equal(out[..., 96:], x[..., 96:]), "columns past rotary_dim must be copied exactly"


def test_every_element_written(gen):
    """Run the compiled kernel directly into NaN-filled outputs (x and a key): no element may stay NaN."""
    from tileops.compile.build import compile_kernel
    from tileops.kernels.rope import RoPEKernelSpec
    from tileops.compile.entry import raw_kernel
    from tileops.rope.tables import RoPETables

    spec = RoPEKernelSpec(dtype="float32", head_dim=96, rot=96, pairing="interleaved", backend="c")
    kernel = raw_kernel(compile_kernel("rope", spec, "c", "c"), torch.device("cpu"), spec.args)
    x = torch.randn(3, 37, 5, 96, generator=gen)
    k = torch.randn(3, 37, 2, 96, generator=gen)
    out, kout = torch.full_like(x, float("nan")), torch.full_like(k, float("nan"))
    inv = 10000.0 ** (-torch.arange(0, 96, 2, dtype=torch.float64) / 96)
    td = RoPETables(inv, 1.0).on(torch.device("cpu"))
    st = lambda t: dict(zip("bsh", t.stride()[:3]))  # noqa: E731
    a, b, c, d = st(x), st(out), st(k), st(kout)
    # the position arguments (P to tag) are parameters of every RoPE kernel; one without positions
    # never reads them, and takes 0 as the launcher's slots give
    kernel(*kernel.bind(**dict.fromkeys(kernel.arg_names, 0) | dict(
        X=x.data_ptr(), Y=out.data_ptr(), K=k.data_ptr(), KY=kout.data_ptr(), TD=td.data_ptr(),
        B=3, S=37, H=5, HK=2, xsb=a["b"], xss=a["s"], xsh=a["h"], ysb=b["b"], yss=b["s"],
        ysh=b["h"], ksb=c["b"], kss=c["s"], ksh=c["h"], kysb=d["b"], kyss=d["s"], kysh=d["h"],
        NX=x.numel(), NY=out.numel(), NK=k.numel(), NKY=kout.numel())))
    assert not out.isnan().any() and not kout.isnan().any()
    params = {"rope_layout": "interleaved", "input_layout": "2d"}
    assert_close(out, reference("RoPEFwdOp", params, {"x": x}))
    assert_close(kout, reference("RoPEFwdOp", params, {"x": k}))


def test_accuracy_does_not_degrade_with_position(gen):
    """fp32 output within a few fp32 ulps of float64 at every position up to 2^20."""
    seq = 1 << 20
    op = RoPEFwdOp(input_layout="1d", target=BUILTIN)
    x = torch.randn(seq, 8, generator=gen)
    out = op(x).double()
    ref = reference("RoPEFwdOp", {"input_layout": "1d"}, {"x": x})
    # pair magnitude bounds |out|; an fp32 ulp of it is 2^-23 * magnitude
    mag = torch.sqrt(x[:, :4].double() ** 2 + x[:, 4:].double() ** 2).repeat(1, 2)
    ulps = (out - ref).abs() / (mag * 2.0**-23)
    tail = ulps[-4096:].max().item()
    assert ulps.max().item() < 8, f"max error {ulps.max().item():.1f} ulps"
    assert tail < 8, f"error at positions near 2^20: {tail:.1f} ulps"


def test_non_contiguous_and_unaligned_inputs(gen):
    op = RoPEFwdOp(input_layout="2d", target=BUILTIN)
    base = torch.randn(2, 5, 37, 64, generator=gen)
    x = base.transpose(1, 2)  # [B, S, H, D] view of a [B, H, S, D] tensor
    assert not x.is_contiguous()
    assert_close(op(x), reference("RoPEFwdOp", {"input_layout": "2d"}, {"x": x}))
    flat = torch.randn(1 + 2 * 37 * 5 * 64, generator=gen)
    y = flat[1:].view(2, 37, 5, 64)  # contiguous but 4 bytes past a 16-byte boundary
    assert y.data_ptr() % 16
    assert_close(op(y), reference("RoPEFwdOp", {"input_layout": "2d"}, {"x": y}))


def test_block_threads_fit_every_allowed_head():
    """Every head_dim the manifests allow (even, at most 1024), every rotated width and dtype: the
    CUDA block stays within 1024 threads, however narrow the vector gets."""
    from tileops.kernels.rope import MAX_BLOCK_THREADS, RoPEKernelSpec

    worst = 0
    for dtype in ("float16", "bfloat16", "float32"):
        for head_dim in range(2, 1025, 2):
            for rot in {head_dim, 2, max(2, head_dim // 2 // 2 * 2), 98 if head_dim >= 98 else head_dim}:
                for head_lanes in (1, 8, 64):
                    k = RoPEKernelSpec(dtype=dtype, head_dim=head_dim, rot=rot, head_lanes=head_lanes)
                    assert 1 <= k.block_threads <= MAX_BLOCK_THREADS, (dtype, head_dim, rot, head_lanes)
                    worst = max(worst, k._lanes * head_lanes)
    assert worst > MAX_BLOCK_THREADS  # the clamp was needed: fp32 head_dim 1022 at 8 lanes is 4088


def test_empty_sequence():
    op = RoPEFwdOp(input_layout="2d", target=BUILTIN)
    out = op(torch.randn(2, 0, 4, 64))
    assert out.shape == (2, 0, 4, 64)


def test_one_prim_func_per_backend_whose_parameters_are_every_argument():
    """kernels/rope.py and kernels/ntk.py write one ``T.prim_func`` per backend: its parameters are
    the builder's whole ``ARGS`` whatever the spec, and a kernel that does not use some (the position
    arguments without positions, ``psc`` without MRoPE, ``seq`` with positions) does not read them:
    the generated kernel takes only what it reads, as the three functions per backend it replaces did."""
    import re

    from tileops.compile.build import emit_source, prim_func
    from tileops.kernels import ntk, rope

    def params(builder, spec):
        return [p.name.removesuffix("_handle") for p in prim_func(builder, spec).params]

    for backend in ("c", "cuda"):
        arch = "c" if backend == "c" else "sm_90"
        plain = rope.RoPEKernelSpec("float32", 64, 64, backend=backend)
        ids = rope.RoPEKernelSpec("float32", 64, 64, positions="int32", backend=backend)
        mrope = rope.RoPEKernelSpec("float32", 64, 64, positions="int64", mrope_section=(8, 12, 12), backend=backend)
        for spec in (plain, ids, mrope):
            assert params("rope", spec) == list(rope.ARGS) == list(spec.args), spec
            assert prim_func("rope", spec).attrs["global_symbol"] == f"rope_{backend}"
        for spec in (ntk.NTKKernelSpec(64, backend=backend), ntk.NTKKernelSpec(64, positions="int64", backend=backend)):
            assert params("ntk", spec) == list(ntk.ARGS) == list(spec.args), spec
        read = {}
        for name, builder, spec in (("plain", "rope", plain), ("ids", "rope", ids),
                                    ("ntk-ids", "ntk", ntk.NTKKernelSpec(64, positions="int64", backend=backend))):
            src = emit_source(builder, spec, backend, arch)
            decl = re.search(rf"{builder}_{backend}_kernel\(([^)]*)\)", src).group(1)
            read[name] = {p.split()[-1].lstrip("*") for p in decl.split(",")}
        assert not read["plain"] & {"P", "ERR", "psb", "pss", "psc", "limit", "tag"}, read["plain"]
        assert {"P", "ERR", "psb", "pss", "limit", "tag"} <= read["ids"] and "psc" not in read["ids"], read["ids"]
        assert "seq" not in read["ntk-ids"] and "P" in read["ntk-ids"], read["ntk-ids"]


def test_digit_tables_take_no_torch_trigonometry_and_round_float64_once(monkeypatch):
    """The digit tables are the same bits in every process: torch's float64 cos, split over its CPU
    threads, gave half of a first call's values up to 6.8e-9 off in some processes (rope/tables.py),
    so the tables never call it. Each entry is float64's (cos, sin) rounded once to fp32: within
    half an fp32 ulp (2^-24 relative) of torch's float64 values taken on one thread, plus 2^-50 for
    the two libraries' last float64 bits."""
    from tileops.rope import freqs
    from tileops.rope.tables import DIGITS, LO, digit_tables

    inv, amp = freqs.base_inv_freq(500000.0, 96), 0.75

    def refused(*args, **kwargs):
        raise AssertionError("digit_tables called torch's trigonometry")

    with monkeypatch.context() as m:
        for fn in ("cos", "sin"):
            m.setattr(torch, fn, refused)
            m.setattr(torch.Tensor, fn, refused)
        got = digit_tables(inv, amp)
    assert got.dtype == torch.float32 and got.shape == (DIGITS, LO, 2, 48)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        d = torch.arange(LO, dtype=torch.float64)
        want = []
        for k in range(DIGITS):
            angle = (d * float(LO**k))[:, None] * inv
            a = amp if k == 0 else 1.0
            want.append(torch.stack([angle.cos() * a, angle.sin() * a], dim=1))
        want = torch.stack(want)
    finally:
        torch.set_num_threads(threads)
    assert bool(((got.double() - want).abs() <= want.abs() * 2.0**-24 + 2.0**-50).all())
    assert got[0, 0, 0].eq(amp).all() and got[1:, 0, 0].eq(1.0).all() and got[:, 0, 1].eq(0.0).all()
