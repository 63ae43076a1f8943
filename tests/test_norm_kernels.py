"""The norm family's TileLang kernels (``kernels/norm.py``), driven directly on the CPU.

Two ways to run a kernel, and most tests take both (``backend``):

* ``c``: the C backend, built with :func:`tileops.compile.build.load_kernel` and called through
  its C entry point with arguments bound by name, as the runtime will;
* ``cuda``: the CUDA schedule's generated source, run on the CPU by ``tests/cuda_on_cpu.py`` (one
  OS thread per CUDA thread, real barriers and warp shuffles): its indexing, predicates,
  reductions and the backward's prefetch are checked without a GPU. Not its speed, and not the
  GPU's approximate ``rsqrtf``.

Outputs (and the weight-gradient partial buffers) are NaN-filled before every launch, so an element
a kernel fails to write cannot pass. References: float64 math (tight tolerances for fp32), and
Hugging Face's RMSNorm modules as they compute (bf16/fp16: the same bits on at least 99.9% of
elements), both from ``tests/norm_references.py``, which shares no code with the kernels.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from tests import cuda_on_cpu
from tests import norm_references as ref
from tileops.compile.build import emit_source, load_kernel
from tileops.kernels import get_spec

CPU = torch.device("cpu")
NAN = float("nan")
#: "cuda" runs the CUDA source on the CPU; its id is not "cuda", the keyword conftest.py skips without a GPU
BACKENDS = ["c", pytest.param("cuda", id="cuda_on_cpu",
                              marks=pytest.mark.skipif(not cuda_on_cpu.available(), reason="no g++"))]


def spec(backend="c", **fields):
    return get_spec("norm")(backend=backend, **fields)


@functools.lru_cache(maxsize=None)
def _emulated(s):
    return cuda_on_cpu.CudaOnCpu(emit_source("norm", s, "cuda", "sm_90"))


def launch(s, grid: int, **args) -> None:
    """Run kernel ``s`` on ``grid`` blocks (CUDA) with ``args`` by name; pointers as ints, strides
    in elements (divided here into the kernel's unit, which must divide them)."""
    unit = s.stride_unit
    for name in [n for n in args if n.endswith(("st", "sh")) and n not in ("NH",)]:
        assert args[name] % unit == 0, (name, args[name], unit)
        args[name] //= unit
    if s.backend == "cuda":
        _emulated(s).launch(grid, s.block_threads, **args)
        return
    k = load_kernel("norm", s, "c", "c", CPU, s.args)
    k(*k.bind(**args, **dict.fromkeys(k.extent_names, 0)))


def eps_bits(eps: float) -> int:
    from tileops.kernels.norm import eps_bits as bits

    return bits(eps)


def ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def rows(t: torch.Tensor | None) -> tuple[int, int, int, int]:
    """(M, NH, row stride, head stride) of ``t`` seen as rows of its last dim: ``[M, H]`` or
    ``[T, NH, H]`` (M = T * NH), in elements; zeros for None."""
    if t is None:
        return 0, 0, 0, 0
    assert t.stride(-1) == 1
    if t.dim() == 2:
        return t.shape[0], 1, t.stride(0), 0
    assert t.dim() == 3
    return t.shape[0] * t.shape[1], t.shape[1], t.stride(0), t.stride(1)


def nan_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.full(t.shape, NAN, dtype=dtype or t.dtype)


def fwd(s, x, w=None, b=None, r=None, *, y=None, ro=None, eps=1e-6):
    """Run the forward kernel ``s``; returns (y, h). ``y``/``ro`` given: written in place (they may
    be ``x``/``r`` themselves); else new NaN-filled tensors."""
    y = nan_like(x, getattr(torch, s.y_dtype)) if y is None else y
    if s.residual and ro is None:
        ro = nan_like(x)
    M, NH, xst, xsh = rows(x)
    _, _, yst, ysh = rows(y)
    _, _, rst, rsh = rows(r)
    _, _, rost, rosh = rows(ro)
    launch(s, -(-M // s.rows_per_block), X=ptr(x), R=ptr(r), W=ptr(w), B=ptr(b), Y=ptr(y), RO=ptr(ro), M=M,
           NH=NH, xst=xst, xsh=xsh, rst=rst, rsh=rsh, yst=yst, ysh=ysh, rost=rost, rosh=rosh,
           eps_bits=eps_bits(eps))
    return y, ro


def bwd(s, x, dy, w=None, dro=None, *, blocks=5, eps=1e-6):
    """Run the backward kernel ``s`` on ``blocks`` blocks, then the wsum kernel; returns (dx, dw, db)."""
    dx = nan_like(x)
    P = blocks * s.partials_per_block
    dwp = torch.full((P, s.hidden), NAN) if s.weight else None
    dbp = torch.full((P, s.hidden), NAN) if s.bias else None
    M, NH, xst, xsh = rows(x)
    _, _, dyst, dysh = rows(dy)
    _, _, dxst, dxsh = rows(dx)
    _, _, drost, drosh = rows(dro)
    launch(s, blocks, X=ptr(x), DY=ptr(dy), DRO=ptr(dro), W=ptr(w), DX=ptr(dx), DWP=ptr(dwp), DBP=ptr(dbp), M=M,
           NH=NH, G=blocks, xst=xst, xsh=xsh, dyst=dyst, dysh=dysh, drost=drost, drosh=drosh, dxst=dxst,
           dxsh=dxsh, eps_bits=eps_bits(eps))
    dw = db = None
    if s.weight or s.bias:
        ws = spec(s.backend, kind="wsum", hidden=s.hidden, weight=s.weight, bias=s.bias, norm=s.norm,
                  rounding=s.rounding)
        dw = torch.full((s.hidden,), NAN, dtype=getattr(torch, s.weight)) if s.weight else None
        db = torch.full((s.hidden,), NAN, dtype=getattr(torch, s.bias)) if s.bias else None
        launch(ws, -(-s.hidden // 32), DWP=ptr(dwp), DBP=ptr(dbp), DW=ptr(dw), DB=ptr(db), P=P)
    return dx, dw, db


def assert_close(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float, what: str = "") -> None:
    assert not got.isnan().any(), f"{what}: NaN left (an element was not written)"
    err = (got.double() - want).abs()
    bad = err > atol + rtol * want.abs()
    assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.numel()} off; max error {err.max().item():.3e}"


def assert_hf_bits(got: torch.Tensor, want: torch.Tensor, what: str = "", rounds: int = 1) -> None:
    """The same bits as HF on >= 99.9% of elements (plus one row's cluster, below), and elsewhere at
    most ``rounds`` ulps of the dtype.

    An element differs where the kernel's fp32 variance (its own summation order) and torch's differ
    in their last bits and the normalised value lies on a rounding boundary: y is then the
    neighbouring value. With ``llama`` rounding there are two roundings in a row (the normalised
    value to the input dtype, then its product with the weight): one ulp of the first can be two
    of the second (the first near the bottom of its binade, the product near the top of its), so
    those tests pass ``rounds=2``.

    Such differences come in clusters, not one by one: x has a 16-bit float's 128 mantissas per
    binade and a row scales them all by the same 1/rms, so when that factor moves by an ulp, every
    element of the row sharing the mantissa that lands on a boundary flips at once. One row of
    4096 (CPU, 5,000 seeded rows) had 1/rms one ulp off torch's in about one row in a thousand, and
    then 25 to 30 elements differed: 0.7% of a single row, which a share alone would call a bug.
    So two mantissas' worth of the last dimension (2 * ceil(hidden / 128) elements) may differ on
    top of the 0.1%; a real rounding bug moves far more (one rounding for Llama's two: 25-42% of such a row)."""
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert not got.isnan().any(), f"{what}: NaN left (an element was not written)"
    d = ref.ulps_apart(got, want)
    differ = int((d != 0).sum())
    allowed = 0.001 * d.numel() + 2 * -(-got.shape[-1] // 128)
    assert differ <= allowed, (f"{what}: {differ} of {d.numel()} elements differ from HF's bits "
                               f"(at most {allowed:.0f} may)")
    assert d.max().item() <= rounds, f"{what}: {int((d > rounds).sum())} elements more than {rounds} ulps from HF"


# ------------------------------------------------------------------------- the spec, no compiling
def test_spec_rejects_bad_fields_by_name():
    S = get_spec("norm")
    for fields, word in [(dict(kind="fwd", hidden=64, dtype="float64"), "dtype"),
                         (dict(kind="sideways", hidden=64), "kind"),
                         (dict(kind="fwd", hidden=0), "hidden"),
                         (dict(kind="fwd", hidden=64, norm="layer"), "rounding"),
                         (dict(kind="fwd", hidden=64, bias="float32"), "bias"),
                         (dict(kind="fwd", hidden=64, offset=1.0), "offset"),
                         (dict(kind="fwd", hidden=64, weight="float32", offset=0.1), "offset"),
                         (dict(kind="wsum", hidden=64), "weight, bias"),
                         (dict(kind="fwd", hidden=64, threads=96), "threads"),
                         (dict(kind="fwd", hidden=1 << 20, dtype="float32"), "hidden")]:
        with pytest.raises(ValueError, match=rf"^{word}: "):
            S(**fields)


def test_cuda_layout_fits_every_hidden_size():
    """Every hidden size up to 65536 and dtype: a block of at most 1024 threads, lanes a power of two
    dividing the block, every vector of the row owned by exactly one lane, and a row-per-warp row
    inside one warp."""
    S = get_spec("norm")
    for dtype in ("float16", "bfloat16", "float32"):
        for hidden in list(range(1, 1100)) + [2048, 2050, 4096, 5120, 8192, 12288, 16384, 65536]:
            for kind in ("fwd", "bwd"):
                s = S(kind=kind, hidden=hidden, dtype=dtype)
                assert s.hidden % s.vec == 0 and s.vec * {"float32": 4}.get(dtype, 2) <= 16
                assert 1 <= s.block_threads <= 1024 and s.block_threads % s.lanes == 0, (dtype, hidden)
                assert s.lanes & (s.lanes - 1) == 0
                assert s.lanes * s.vectors >= s.nvec > s.lanes * (s.vectors - 1), (dtype, hidden)
                assert s.vectors * s.vec * {"float32": 4}.get(dtype, 2) <= 256, (dtype, hidden)
                if s.per_warp:
                    assert s.lanes <= 32 and s.partials_per_block == s.block_threads // 32


# ----------------------------------------------------------------------------------- forward
# 64: 16 lanes, two rows a warp; 184: 46 vectors over 32 lanes (a lane's second vector is past the
# row for some); 1030: a block of 256 threads, 515 two-element vectors; 4096: a block, every lane full
@pytest.mark.parametrize("hidden", [64, 184, 1030, 4096])
@pytest.mark.parametrize("backend", BACKENDS)
def test_rms_fp32_against_float64(hidden, backend, gen):
    s = spec(backend, kind="fwd", hidden=hidden, dtype="float32", weight="float32")
    w = torch.randn(hidden, generator=gen)
    for m in (1, 7, 423):
        x = torch.randn(m, hidden, generator=gen) * 3
        y, _ = fwd(s, x, w, eps=1e-5)
        assert_close(y, ref.rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-6, what=f"rows {m}")


@pytest.mark.parametrize("style,dtype,hidden", [("llama", torch.bfloat16, 4096), ("llama", torch.float16, 64),
                                                ("gemma", torch.bfloat16, 184), ("olmo2", torch.bfloat16, 64)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_rms_matches_hf_module_bits(style, dtype, hidden, backend, gen):
    rounding = "llama" if style == "llama" else "fp32"
    offset = 1.0 if style == "gemma" else 0.0
    s = spec(backend, kind="fwd", hidden=hidden, dtype=str(dtype).split(".")[1], weight=str(dtype).split(".")[1],
             rounding=rounding, offset=offset)
    w = (torch.randn(hidden, generator=gen) * 0.5 + (0.0 if style == "gemma" else 1.0)).to(dtype)
    for m in (1, 7, 423):
        x = (torch.randn(m, hidden, generator=gen) * 2).to(dtype)
        y, _ = fwd(s, x, w, eps=1e-6)
        assert_hf_bits(y, ref.hf_rms_norm(x, w, 1e-6, style), f"{style} rows {m}", rounds=2 if style == "llama" else 1)


@pytest.mark.parametrize("style", ref.HF_STYLES)
def test_hf_references_are_the_modules(style, gen):
    """``hf_rms_norm`` computes what the installed transformers module computes, bit for bit."""
    module = ref.hf_module(style, 96, 1e-6)
    if module is None:
        pytest.skip("transformers is not installed")
    with torch.no_grad():
        module.weight.copy_(torch.randn(96, generator=gen))
        module = module.to(torch.bfloat16)
        x = torch.randn(5, 3, 96, generator=gen).to(torch.bfloat16)
        want = module(x)
    got = ref.hf_rms_norm(x, module.weight.detach(), 1e-6, style)
    assert got.dtype == want.dtype and torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("out", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_weight_with_bf16_x(out, backend, gen):
    """Mixed precision: an fp32 weight. HF's LlamaRMSNorm then returns fp32 (torch promotes
    ``fp32 * bf16``): ``out_dtype="float32"`` is that tensor; ``bfloat16`` rounds it once more."""
    s = spec(backend, kind="fwd", hidden=184, dtype="bfloat16", weight="float32", out_dtype=out)
    w = torch.randn(184, generator=gen) * 0.3 + 1
    x = torch.randn(423, 184, generator=gen).to(torch.bfloat16)
    y, _ = fwd(s, x, w)
    want = ref.hf_rms_norm(x, w, 1e-6, "llama")
    assert want.dtype == torch.float32 and y.dtype == getattr(torch, out)
    if out == "bfloat16":
        assert_hf_bits(y, want.to(torch.bfloat16), rounds=2)
        return
    same = (y == want).double().mean().item()
    assert same >= 0.999, same
    # elsewhere the normalised value rounded to the neighbouring bf16: 2^-7 relative at most
    assert_close(y, want.double(), rtol=2.0**-7, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_head_slice_of_fused_qkv_in_place(backend, gen):
    """Qwen3's q_norm on the q slice of a fused qkv buffer: rows = tokens x heads, a token stride of
    (q + 2 kv heads) x head_dim, written in place; k and v untouched."""
    T, HQ, HK, D = 37, 6, 2, 128
    s = spec(backend, kind="fwd", hidden=D, dtype="bfloat16", weight="bfloat16")
    qkv = (torch.randn(T, (HQ + 2 * HK) * D, generator=gen) * 2).to(torch.bfloat16)
    before = qkv.clone()
    q = qkv[:, :HQ * D].view(T, HQ, D)
    assert q.stride() == ((HQ + 2 * HK) * D, D, 1)
    w = (torch.randn(D, generator=gen) * 0.2 + 1).to(torch.bfloat16)
    want = ref.hf_rms_norm(q.clone(), w, 1e-6, "llama")
    y, _ = fwd(s, q, w, y=q)
    assert y is q
    assert_hf_bits(q, want, "q in place", rounds=2)
    assert torch.equal(qkv[:, HQ * D:], before[:, HQ * D:]), "k or v was written"
    # a key slice with a head stride other than head_dim: heads of k taken every other one
    k = before[:, HQ * D:].view(T, 2 * HK, D)[:, ::2]
    y, _ = fwd(s, k, w)
    assert_hf_bits(y, ref.hf_rms_norm(k.contiguous(), w, 1e-6, "llama"), "strided heads", rounds=2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_residual_add_in_place(backend, gen):
    """vLLM's fused_add_rms_norm: h = x + residual in bf16 written over the residual, norm(h) over x."""
    s = spec(backend, kind="fwd", hidden=64, dtype="bfloat16", weight="bfloat16", residual=True)
    w = (torch.randn(64, generator=gen) * 0.2 + 1).to(torch.bfloat16)
    for m in (1, 7, 423):
        x = (torch.randn(m, 64, generator=gen) * 2).to(torch.bfloat16)
        r = (torch.randn(m, 64, generator=gen) * 4).to(torch.bfloat16)
        h_want = x + r  # HF's decoder layer: residual + hidden_states in bf16
        y_want = ref.hf_rms_norm(h_want, w, 1e-6, "llama")
        y, h = fwd(s, x, w, r=r, y=x, ro=r)
        assert y is x and h is r
        assert torch.equal(r.view(torch.int16), h_want.view(torch.int16)), "h differs from x + residual in bf16"
        assert_hf_bits(x, y_want, f"rows {m}", rounds=2)
    # strided rows: every other row of a buffer, outputs to new tensors
    x = (torch.randn(50, 64, generator=gen)).to(torch.bfloat16)[::2]
    r = (torch.randn(50, 64, generator=gen)).to(torch.bfloat16)[1::2]
    y, h = fwd(s, x, w, r=r)
    assert torch.equal(h, x + r)
    assert_hf_bits(y, ref.hf_rms_norm(x + r, w, 1e-6, "llama"), "strided", rounds=2)


def test_rows_a_lane_group_holds():
    """``rows_per_group`` serves the forward's row-per-warp RMSNorm, keeping at most 4 loads of x in
    flight a lane; a row-per-block row, the backward and LayerNorm hold one row a group."""
    S = get_spec("norm")
    assert S(kind="fwd", hidden=128, rows_per_group=2).group_rows == 2  # 1 vector a lane
    assert S(kind="fwd", hidden=128, rows_per_group=8).group_rows == 4
    assert S(kind="fwd", hidden=1024, rows_per_group=2).group_rows == 1  # 4 vectors a lane
    assert S(kind="fwd", hidden=512, rows_per_group=2).group_rows == 2  # 2 vectors a lane
    assert S(kind="fwd", hidden=4096, rows_per_group=2).group_rows == 1  # a block a row
    assert S(kind="bwd", hidden=128, rows_per_group=2).group_rows == 1
    assert S(kind="fwd", hidden=128, norm="layer", rounding="fp32", rows_per_group=2).group_rows == 1
    a = S(kind="fwd", hidden=128, rows_per_group=2)
    assert a.rows_per_block == 2 * S(kind="fwd", hidden=128).rows_per_block
    with pytest.raises(ValueError, match="rows_per_group: expected an int in"):
        S(kind="fwd", hidden=128, rows_per_group=0)


@pytest.mark.skipif(not cuda_on_cpu.available(), reason="no g++")
@pytest.mark.parametrize("hidden", [64, 128, 184])
def test_rows_per_group_gives_the_one_row_bits(hidden, gen):
    """The CUDA forward holding two rows a lane group (run on the CPU harness) writes the bits of the
    one-row schedule: a last block with rows of only some groups, a partial one, a residual, and a
    per-head view of a wider buffer."""
    one = spec("cuda", kind="fwd", hidden=hidden, dtype="bfloat16", weight="bfloat16")
    two = dataclasses.replace(one, rows_per_group=2)
    assert two.group_rows == 2
    w = (torch.randn(hidden, generator=gen) * 0.2 + 1).to(torch.bfloat16)
    for m in (1, 5, two.rows_per_block + 3):
        x = torch.randn(m, hidden, generator=gen).to(torch.bfloat16)
        assert torch.equal(fwd(two, x, w)[0].view(torch.int16), fwd(one, x, w)[0].view(torch.int16)), m
    wide = torch.randn(9, 3 * hidden + 16, generator=gen).to(torch.bfloat16)
    heads = wide[:, 16:16 + 2 * hidden].view(9, 2, hidden)  # two heads of each token, a row stride apart
    assert torch.equal(fwd(two, heads, w)[0].view(torch.int16), fwd(one, heads, w)[0].view(torch.int16))
    r = torch.randn(7, hidden, generator=gen).to(torch.bfloat16)
    x = torch.randn(7, hidden, generator=gen).to(torch.bfloat16)
    with_r = (dataclasses.replace(one, residual=True), dataclasses.replace(two, residual=True))
    (y1, h1), (y2, h2) = (fwd(s, x, w, r=r) for s in with_r)
    assert torch.equal(y1.view(torch.int16), y2.view(torch.int16)) and torch.equal(h1, h2)


@pytest.mark.skipif(not cuda_on_cpu.available(), reason="no g++")
@pytest.mark.parametrize("hidden", [128, 4096])
def test_nh1_path_gives_the_dividing_bits(hidden, gen):
    """The forward's ``nh1_path`` (row offsets without the division where NH is 1; run on the CPU
    harness) writes the bits of the dividing schedule: dense rows (NH = 1, its own path), a
    per-head view of a wider buffer (NH = 2, the dividing path) and a residual."""
    one = spec("cuda", kind="fwd", hidden=hidden, dtype="bfloat16", weight="bfloat16", rows_per_group=2)
    fast = dataclasses.replace(one, nh1_path=1)
    w = (torch.randn(hidden, generator=gen) * 0.2 + 1).to(torch.bfloat16)
    x = torch.randn(fast.rows_per_block + 3, hidden, generator=gen).to(torch.bfloat16)
    assert torch.equal(fwd(fast, x, w)[0].view(torch.int16), fwd(one, x, w)[0].view(torch.int16))
    wide = torch.randn(5, 3 * hidden + 16, generator=gen).to(torch.bfloat16)
    heads = wide[:, 16:16 + 2 * hidden].view(5, 2, hidden)
    assert torch.equal(fwd(fast, heads, w)[0].view(torch.int16), fwd(one, heads, w)[0].view(torch.int16))
    r = torch.randn(7, hidden, generator=gen).to(torch.bfloat16)
    (y1, h1), (y2, h2) = (fwd(dataclasses.replace(s, residual=True), x[:7], w, r=r) for s in (one, fast))
    assert torch.equal(y1.view(torch.int16), y2.view(torch.int16)) and torch.equal(h1, h2)


#: the backward's schedule knobs, and specs where each acts: per head (row per lane group), wide rows
#: of 2 vectors a thread (a block a row, 256 and 128 threads), LayerNorm's two sums, a residual. Three
#: sets: the L2 prefetch with the register prefetch of the next row, and the rows copied to shared
#: memory by cp.async one and two rows ahead (with the L2 prefetch, the weight in registers, two
#: barriers a row in the last)
_BWD_KNOBS = {"bwd_prefetch": 2, "bwd_one_sync": 1, "bwd_w_shared": 1, "nh1_path": 1, "bwd_async": 2}
_BWD_KNOB_SETS = {
    "pf2+ws+1sync+nh1": {"bwd_prefetch": 2, "bwd_one_sync": 1, "bwd_w_shared": 1, "nh1_path": 1},
    "async1+ws+1sync+nh1": {"bwd_async": 1, "bwd_one_sync": 1, "bwd_w_shared": 1, "nh1_path": 1},
    "async2+pf1": {"bwd_async": 2, "bwd_prefetch": 1},
}
_BWD_KNOB_SPECS = [
    dict(hidden=128, dtype="bfloat16", weight="bfloat16"),
    dict(hidden=4096, dtype="bfloat16", weight="bfloat16", bwd_vectors_per_thread=2),
    dict(hidden=2048, dtype="bfloat16", weight="bfloat16", bwd_vectors_per_thread=2, residual=True),
    dict(hidden=1024, dtype="float16", weight="float16", bias="float16", norm="layer", rounding="fp32"),
]


@pytest.mark.skipif(not cuda_on_cpu.available(), reason="no g++")
@pytest.mark.parametrize("knob_set", list(_BWD_KNOB_SETS))
@pytest.mark.parametrize("fields", _BWD_KNOB_SPECS, ids=lambda f: f"{f.get('norm', 'rms')}-{f['hidden']}"
                         f"{'-residual' if f.get('residual') else ''}")
def test_backward_knobs_give_the_default_bits(fields, knob_set, gen):
    """The backward with the schedule knobs on (L2 prefetch of rows ahead, one barrier a row, the
    weight in shared memory, offsets without division where NH is 1, the next rows copied to shared
    memory by cp.async; on the CPU harness, where the prefetch does nothing and a copy is done when
    issued) writes the default schedule's bits: dx and the weight (bias) gradient, whose summation
    order the knobs keep. Blocks that see more and fewer rows than the prefetch and copy distances,
    dense rows (NH = 1) and per-head views (NH = 3)."""
    base = spec("cuda", kind="bwd", **fields)
    knobs = dataclasses.replace(base, **_BWD_KNOB_SETS[knob_set])
    H = base.hidden
    w = (torch.randn(H, generator=gen) * 0.2 + 1).to(torch.bfloat16 if base.dtype == "bfloat16" else torch.float16)
    dt = w.dtype
    for shape, blocks in (((9 * base.rows_per_block + 5, H), 3), ((3, H), 4), ((4 * base.rows_per_block + 1, 3, H), 2)):
        x = (torch.randn(*shape, generator=gen) * 2 + 0.5).to(dt)
        dy = torch.randn(*shape, generator=gen).to(dt)
        dro = torch.randn(*shape, generator=gen).to(dt) if base.residual else None
        b = w if base.bias else None
        got = bwd(knobs, x, dy, w if base.weight else None, dro, blocks=blocks)
        want = bwd(base, x, dy, w if base.weight else None, dro, blocks=blocks)
        for name, g_, w_ in zip(("dx", "dw", "db"), got, want):
            assert (g_ is None) == (w_ is None), name
            if g_ is not None:
                assert torch.equal(g_.view(torch.int16), w_.view(torch.int16)), (name, shape)
        del b


def test_async_rows_leave_the_blocks_resident():
    """``bwd_async`` copies as many rows ahead as keep 1024 threads' blocks an SM in its 228 KB of shared
    memory: two rows of 16384 bf16 (x and dy, 64 KB a row) beside the next one in a 1024-thread block,
    one with a residual (three rows of 96 KB would not fit); none beside the weight at 4096 wide with a
    residual (4 blocks of 2 x 24 KB + 8 KB + 1 KB each are past 228 KB); none in a row-per-warp schedule;
    and the source then copies with cp.async, 16 bytes at a time."""
    S = get_spec("norm")
    wide = {"kind": "bwd", "dtype": "bfloat16", "weight": "bfloat16", "bwd_vectors_per_thread": 2}
    assert S(hidden=16384, bwd_async=2, **wide).async_rows == 2
    assert S(hidden=16384, bwd_async=2, residual=True, **wide).async_rows == 1
    assert S(hidden=4096, bwd_async=1, residual=True, **wide).async_rows == 1
    assert S(hidden=4096, bwd_async=1, residual=True, bwd_w_shared=1, **wide).async_rows == 0
    assert S(hidden=128, bwd_async=2, **wide).async_rows == 0
    assert S(hidden=16384, **wide).async_rows == 0
    src = emit_source("norm", S(hidden=8192, bwd_async=1, backend="cuda", **wide), "cuda", "sm_90")
    assert "tileops_cp_async<16>" in src and "extern __shared__" in src


def test_backward_knobs_are_checked():
    S = get_spec("norm")
    for name in _BWD_KNOBS:
        with pytest.raises(ValueError, match=f"{name}: expected an int in"):
            S(kind="bwd", hidden=128, **{name: 9})


@pytest.mark.parametrize("affine", ["weight+bias", "none"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_norm_fp32_against_float64(affine, backend, gen):
    hidden = 184 if affine == "weight+bias" else 64
    wb = affine == "weight+bias"
    s = spec(backend, kind="fwd", hidden=hidden, dtype="float32", norm="layer", rounding="fp32",
             weight="float32" if wb else None, bias="float32" if wb else None)
    w = torch.randn(hidden, generator=gen) if wb else None
    b = torch.randn(hidden, generator=gen) if wb else None
    for m in (1, 7, 423):
        x = torch.randn(m, hidden, generator=gen) * 3 + 5  # a mean far from 0: the two-pass variance
        y, _ = fwd(s, x, w, b, eps=1e-5)
        assert_close(y, ref.layer_norm(x, w, b, 1e-5), rtol=1e-5, atol=2e-6, what=f"rows {m}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_norm_bf16_residual_within_one_ulp(backend, gen):
    """bf16 LayerNorm of x + residual: fp32 arithmetic rounded once, so within one bf16 ulp of the
    float64 result of the same h; h itself is torch's bf16 sum."""
    s = spec(backend, kind="fwd", hidden=64, dtype="bfloat16", norm="layer", rounding="fp32", weight="bfloat16",
             bias="bfloat16", residual=True)
    w = torch.randn(64, generator=gen).to(torch.bfloat16)
    b = torch.randn(64, generator=gen).to(torch.bfloat16)
    x = torch.randn(3, 141, 64, generator=gen).to(torch.bfloat16)  # [batch, seq, hidden]: NH = seq
    r = torch.randn(3, 141, 64, generator=gen).to(torch.bfloat16)
    y, h = fwd(s, x, w, b, r=r, eps=1e-5)
    assert torch.equal(h, x + r)
    exact = ref.layer_norm(h, w, b, 1e-5)
    apart = ref.ulps_apart(y, exact.to(torch.bfloat16))
    # n * w + b in fp32 is within about 2^-23 (|n * w| + |b|) of the float64 value; where the bias
    # cancels the product to far below that (about 1 element in 10^4 per run), the one rounding can
    # land several bf16 ulps of the tiny result away, still within that absolute error.
    scale = (ref.layer_norm(h, w, None, 1e-5).abs() + b.double().abs()) * 2.0**-22
    near = (y.double() - exact).abs() <= scale + exact.abs() * 2.0**-8
    assert bool(((apart <= 1) | near).all()), f"{int(((apart > 1) & ~near).sum())} elements off"


# ---------------------------------------------------------------------------------- backward
def _rms64(offset):
    return lambda x, w: ref.rms_norm(x, w, 1e-6, offset)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rms_backward_residual_fp32(backend, gen):
    """dx (which is also the residual's gradient: the upstream gradient of h is added) and dweight
    against float64 autograd; the weight gradient is the same bits for the same block count."""
    s = spec(backend, kind="bwd", hidden=184, dtype="float32", weight="float32", residual=True)
    w = torch.randn(184, generator=gen) * 0.3 + 1
    for m in (1, 7, 423):
        h = torch.randn(m, 184, generator=gen) * 2
        dy = torch.randn(m, 184, generator=gen)
        dro = torch.randn(m, 184, generator=gen)
        dx, dw, _ = bwd(s, h, dy, w, dro, blocks=3)
        gx, gw = ref.grads(_rms64(0.0), h, dy, w)
        assert_close(dx, gx + dro.double(), rtol=1e-4, atol=1e-5, what=f"dx rows {m}")
        assert_close(dw, gw, rtol=1e-4, atol=1e-5, what=f"dw rows {m}")
    again = bwd(s, h, dy, w, dro, blocks=3)
    assert torch.equal(again[0], dx) and torch.equal(again[1], dw), "not deterministic"
    one_block = bwd(s, h, dy, w, dro, blocks=1)[1]  # a different summation order, the same gradient
    assert_close(one_block, gw, rtol=1e-4, atol=1e-5, what="dw, one block")


@pytest.mark.parametrize("backend", BACKENDS)
def test_gemma_backward_offset_fp32(backend, gen):
    s = spec(backend, kind="bwd", hidden=64, dtype="float32", weight="float32", rounding="fp32", offset=1.0)
    w = torch.randn(64, generator=gen) * 0.3
    x = torch.randn(7, 9, 64, generator=gen) * 2  # [T, heads, D] per-head rows
    dy = torch.randn(7, 9, 64, generator=gen)
    dx, dw, _ = bwd(s, x, dy, w, blocks=4)
    gx, gw = ref.grads(_rms64(1.0), x, dy, w)
    assert_close(dx, gx, rtol=1e-4, atol=1e-5, what="dx")
    assert_close(dw, gw, rtol=1e-4, atol=1e-5, what="dw")


@pytest.mark.parametrize("affine", ["weight+bias", "none"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_norm_backward_fp32(affine, backend, gen):
    wb = affine == "weight+bias"
    hidden = 184 if wb else 64
    s = spec(backend, kind="bwd", hidden=hidden, dtype="float32", norm="layer", rounding="fp32",
             weight="float32" if wb else None, bias="float32" if wb else None)
    w = torch.randn(hidden, generator=gen) if wb else None
    b = torch.randn(hidden, generator=gen) if wb else None
    for m in (1, 7, 423):
        x = torch.randn(m, hidden, generator=gen) * 3 + 5
        dy = torch.randn(m, hidden, generator=gen)
        dx, dw, db = bwd(s, x, dy, w, blocks=6, eps=1e-5)
        gx, gw, gb = ref.grads(lambda x, w, b: ref.layer_norm(x, w, b, 1e-5), x, dy, w, b)
        assert_close(dx, gx, rtol=1e-4, atol=1e-5, what=f"dx rows {m}")
        if wb:
            assert_close(dw, gw, rtol=1e-4, atol=1e-5, what=f"dw rows {m}")
            assert_close(db, gb, rtol=1e-5, atol=1e-5, what=f"db rows {m}")
        else:
            assert dw is None and db is None


@pytest.mark.parametrize("backend", ["c", pytest.param("cuda", id="cuda_on_cpu", marks=[
    pytest.mark.slow, pytest.mark.skipif(not cuda_on_cpu.available(), reason="no g++")])])  # emulated: 45 s
def test_bf16_weight_gradient_over_65536_rows(backend, gen):
    """The weight gradient of 65,536 bf16 rows, summed on the device in fp32 partials, within 1e-2
    relative of the float64 sum. x has column means and dy a mean, so each column's sum is large
    (not a cancellation whose relative error would say nothing)."""
    M, H = 65536, 256
    s = spec(backend, kind="bwd", hidden=H, dtype="bfloat16", weight="bfloat16")
    w = (torch.randn(H, generator=gen) * 0.2 + 1).to(torch.bfloat16)
    mu = (torch.rand(H, generator=gen) + 1) * (torch.randint(0, 2, (H,), generator=gen) * 2 - 1)  # |mu| in [1, 2)
    x = (torch.randn(M, H, generator=gen) + mu).to(torch.bfloat16)
    dy = (torch.randn(M, H, generator=gen) * 0.5 + 1).to(torch.bfloat16)
    dx, dw, _ = bwd(s, x, dy, w, blocks=64)
    assert dw.dtype == torch.bfloat16
    gx, gw = ref.grads(_rms64(0.0), x, dy, w)
    assert gw.abs().min().item() > 1000  # the construction above did what it says (about 65536 x 0.5)
    assert_close(dw, gw, rtol=1e-2, atol=0, what="dw")
    # dx = rstd * (dn - n * mean(dn * n)) cancels: its error scales with the terms, not with dx
    assert_close(dx, gx, rtol=1e-2, atol=1e-2 * gx.abs().mean().item(), what="dx")


# ----------------------------------------------------------------------------- CUDA, lowered only
_CUDA_SPECS = [
    dict(kind="fwd", hidden=128, dtype="bfloat16", weight="bfloat16", residual=True),  # per head: 16 lanes
    dict(kind="fwd", hidden=4096, dtype="bfloat16", weight="float32", out_dtype="float32"),  # a block a row
    dict(kind="fwd", hidden=2048, dtype="float16", norm="layer", rounding="fp32", weight="float16",
         bias="float16"),
    dict(kind="bwd", hidden=128, dtype="bfloat16", weight="bfloat16", residual=True),
    dict(kind="bwd", hidden=8192, dtype="bfloat16", norm="layer", rounding="fp32", weight="bfloat16",
         bias="bfloat16"),
    dict(kind="wsum", hidden=4096, weight="bfloat16"),
]


@pytest.mark.parametrize("fields", _CUDA_SPECS, ids=lambda f: f"{f['kind']}-{f.get('norm', 'rms')}-{f['hidden']}")
def test_cuda_source_is_emitted(fields):
    """The CUDA schedule of every kernel kind lowers for sm_90, and the lean build (no TileLang
    templates) accepts the source; x's loads and stores are 16-byte vectors."""
    from tileops.compile import cuda_build
    from tileops.compile.build import emit_source

    s = get_spec("norm")(backend="cuda", **fields)
    src = emit_source("norm", s, "cuda", "sm_90")
    assert f"norm_{s.kind}_kernel" in src
    cuda_build.device_source(src)  # raises Unsupported where it needs TileLang's templates
    if s.kind != "wsum":
        assert "*(uint4*)(X + " in src, "x is not read 16 bytes at a time"
        assert ("__syncthreads" in src) == (not s.per_warp)
    c_twin = dataclasses.replace(s, backend="c")
    assert c_twin.stride_unit == 1 and s.stride_unit == s.vec
