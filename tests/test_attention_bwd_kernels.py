"""The attention backward's tile programs (``kernels/attention_bwd.py``), driven directly on the CPU.

The C schedule's delta, dk/dv and dq kernels, built with :func:`tileops.compile.build.load_kernel`
and called through their C entry points with arguments bound by name, as ``AttnFwdOp``'s backward plan
(``tileops/attention/attn_builtin.py``: ``BACKWARD``; its tests ``tests/test_attn_bwd.py``) binds them,
against float64 autograd of a reference attention written here from the definition (it shares no
code with the kernels). The kernels take the reference's own o and lse (o rounded to the inputs'
dtype, lse to fp32, as the forward saves them), so what is checked is the backward alone.

Every gradient buffer (and the delta workspace) is NaN-filled before the kernels run: an element
they fail to write cannot pass. Inputs come from the test's seeded generator (``tests/conftest.py``).

Tolerances (:func:`error_scale`) are bounds from the arithmetic, per element, not fitted numbers:

* fp32 sums: a sum of n fp32 products is within ``n * u * sum |terms|`` of the exact sum
  (``u = 2^-24``; the worst case, Higham's gamma_n). Each gradient is built from such sums: s and
  dp over D terms, delta over D, dk/dv over the G * Sq rows of a kv head's group, dq over Sk; n is
  taken as ``D + G * Sq + Sk`` plus 8 for exp/tanh and the scalings (a few ulps each), and each
  term's magnitude from the float64 reference's absolute values (:func:`error_scale`);
* an error in s moves p by ``p * |ds|`` (``d exp(x) = exp(x) dx``), carried through to every gradient;
* inputs in bf16/fp16: the kernels and the reference read the same rounded q, k, v, dO, o; the
  gradients are then rounded once to the dtype: its unit roundoff ``2^-8`` (bf16, 8 significant
  bits) or ``2^-11`` (fp16, 11) relative, plus the fp32 bound above; o, rounded once to the dtype,
  moves delta by at most that roundoff times ``sum |dO o|``;
* the CUDA schedule rounds p and ds to the dtype before the tensor-core products: one roundoff of
  each, carried through ``dv = p^T dO``, ``dk = ds^T q``, ``dq = ds k`` (``Case.allowed``).
"""

import functools
import math

import pytest
import torch

from tileops.attention.attn_builtin import CUDA_ENV, cuda_enabled

#: the attention backward's kernels on CUDA run unless refused (tileops.attention.attn_builtin.cuda_enabled)
ATTN_CUDA = pytest.mark.skipif(not cuda_enabled(backward=True), reason=f"{CUDA_ENV}=0 refuses the attention "
                               "backward's CUDA kernels")

from tileops.compile.build import device_backend, load_kernel
from tileops.kernels import get_spec

CPU = torch.device("cpu")
NAN = float("nan")
U32 = 2.0 ** -24
#: the unit roundoff of each dtype, 2^-p for p bits of significand (24, 8, 11): a value rounded once
#: to nearest moves at most this much, relative
HALF_ULP = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


# ------------------------------------------------------------------------------ the reference
def visible(sq: int, sk: int, causal: bool, window: int | None) -> torch.Tensor:
    """[sq, sk] bool: query i sees key j (bottom-right aligned causal; a window hides j <= i + sk - sq - w)."""
    i = torch.arange(sq).unsqueeze(1)
    j = torch.arange(sk).unsqueeze(0)
    ok = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        ok &= j <= i + sk - sq
    if window is not None:
        ok &= j > i + sk - sq - window
    return ok


def attention64(q, k, v, scale, causal, window, softcap):
    """One sequence in float64: q [Sq, Hq, D], k/v [Sk, Hkv, D] -> (o [Sq, Hq, D], lse [Hq, Sq], p [Hq, Sq, Sk],
    s_raw [Hq, Sq, Sk]). A query that sees no key gets o = 0 and lse = -inf."""
    hq, hkv = q.shape[1], k.shape[1]
    kk = k.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)  # [Hq, Sk, D]
    vv = v.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
    s_raw = scale * q.transpose(0, 1) @ kk.transpose(1, 2)  # [Hq, Sq, Sk]
    s = softcap * torch.tanh(s_raw / softcap) if softcap else s_raw
    ok = visible(q.shape[0], k.shape[0], causal, window)
    s = s.masked_fill(~ok, -math.inf)
    m = s.amax(-1, keepdim=True) if s.shape[-1] else s.new_zeros(*s.shape[:-1], 1)  # (no keys: amax refuses)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m).detach()
    e = torch.exp(s - m)
    tot = e.sum(-1, keepdim=True)
    p = e / torch.where(tot == 0, torch.ones_like(tot), tot)
    o = (p @ vv).transpose(0, 1)
    lse = (torch.log(tot) + m).squeeze(-1)  # log 0 = -inf for a row that sees nothing
    return o, lse, p, s_raw


class Case:
    """Inputs, the reference's o/lse/gradients, and the kernels' layout for one test."""

    def __init__(self, gen, *, lens_q, lens_k, hq, hkv, d=64, dtype=torch.float32, causal=False, window=None,
                 softcap=None, varlen=False, scale=None):
        self.varlen, self.dtype, self.d, self.hq, self.hkv = varlen, dtype, d, hq, hkv
        self.causal, self.window, self.softcap = causal, window, softcap
        self.scale = scale if scale is not None else d ** -0.5
        self.lens_q, self.lens_k = lens_q, lens_k
        tq, tk = sum(lens_q), sum(lens_k)

        def draw(rows, heads):  # drawn in fp32 from the seeded generator, then rounded to the dtype
            return torch.randn(rows, heads, d, generator=gen).to(dtype)

        if varlen:
            self.q, self.k, self.v, self.do = draw(tq, hq), draw(tk, hkv), draw(tk, hkv), draw(tq, hq)
        else:  # dense [B, S, H, D]; k/v a head-major view (HF's layout) to exercise the strides
            b = len(lens_q)
            self.q = draw(b * lens_q[0], hq).reshape(b, lens_q[0], hq, d)
            self.do = draw(b * lens_q[0], hq).reshape(b, lens_q[0], hq, d)
            self.k = draw(b * lens_k[0], hkv).reshape(b, hkv, lens_k[0], d).transpose(1, 2)
            self.v = draw(b * lens_k[0], hkv).reshape(b, lens_k[0], hkv, d)
        self._reference()

    def seqs(self):
        """(b, q rows, k rows) of each sequence as slices of the flat [total, H, D] (varlen) or batch index."""
        cq, ck = 0, 0
        for b, (nq, nk) in enumerate(zip(self.lens_q, self.lens_k)):
            yield b, slice(cq, cq + nq), slice(ck, ck + nk)
            cq, ck = cq + nq, ck + nk

    def _part(self, t, b, rows):
        return t[rows] if self.varlen else t[b]

    def _reference(self):
        dt = torch.float64
        q, k, v, do = (t.to(dt).requires_grad_(True) for t in (self.q, self.k, self.v, self.do))
        os_, lses = [], []
        total = 0.0
        err = {n: torch.zeros_like(t, dtype=dt) for n, t in (("dq", q), ("dk", k), ("dv", v))}
        once = {n: torch.zeros_like(t) for n, t in err.items()}
        tiles = {n: torch.zeros_like(t) for n, t in err.items()}
        for b, rq, rk in self.seqs():
            o, lse, p, s_raw = attention64(self._part(q, b, rq), self._part(k, b, rk), self._part(v, b, rk),
                                           self.scale, self.causal, self.window, self.softcap)
            os_.append(o)
            lses.append(lse)
            total = total + (o * self._part(do, b, rq)).sum()
            self._error_scale(err, once, tiles, b, rq, rk, o.detach(), lse.detach(), p.detach(), s_raw.detach())
        total.backward()
        self.dq, self.dk, self.dv = q.grad, k.grad, v.grad
        self.err, self.once, self.tiles = err, once, tiles
        # what the forward saves: o in the inputs' dtype, lse fp32 ([B, Hq, Sq]; varlen [Hq, total_q])
        if self.varlen:
            self.o = torch.cat([o.detach() for o in os_]).to(self.dtype)
            self.lse = torch.cat([x.detach() for x in lses], dim=1).float().contiguous()
        else:
            self.o = torch.stack([o.detach() for o in os_]).to(self.dtype)
            self.lse = torch.stack([x.detach() for x in lses]).float().contiguous()

    def _error_scale(self, err, once, tiles, b, rq, rk, o, lse, p, s_raw):
        """Adds to ``err`` the magnitudes the fp32 bound multiplies (the module's doc): for each gradient,
        the sum of |terms| of its sums, and the reach of the errors of s, dp and delta through them; to
        ``once`` what o's one rounding to the dtype moves (in units of the dtype's roundoff)."""
        g = self.hq // self.hkv
        q, k, v, do = (self._part(t, b, r).double() for t, r in ((self.q, rq), (self.k, rk), (self.v, rk),
                                                                   (self.do, rq)))
        kk = k.repeat_interleave(g, dim=1).transpose(0, 1)
        vv = v.repeat_interleave(g, dim=1).transpose(0, 1)
        qh, doh = q.transpose(0, 1), do.transpose(0, 1)
        sc = self.scale
        # |ds| bound of s (before exp): the D-term sum scale * q.k, and lse's rounding to fp32
        s_err = sc * qh.abs() @ kk.abs().transpose(1, 2) + torch.where(torch.isinf(lse), 0, lse.abs()).unsqueeze(-1)
        dp = doh @ vv.transpose(1, 2)
        delta = (doh * o.transpose(0, 1)).sum(-1, keepdim=True)
        delta_mag = (doh.abs() * o.transpose(0, 1).abs()).sum(-1, keepdim=True)
        ds = p * (dp - delta)
        # magnitude of the error of ds: p's (through s) times |dp - delta|, plus p times the D-term sums
        # dp and delta
        ds_err = p * s_err * (dp - delta).abs() + p * (doh.abs() @ vv.abs().transpose(1, 2) + delta_mag)
        dv_mag = (p.transpose(1, 2) @ doh.abs() + (p * s_err).transpose(1, 2) @ doh.abs())  # [Hq, Sk, D]
        dk_mag = sc * ((ds.abs() + ds_err).transpose(1, 2) @ qh.abs())
        dq_mag = sc * ((ds.abs() + ds_err) @ kk.abs())
        # o rounded once to the dtype moves delta by at most its unit roundoff times sum |dO o| (not n times)
        ds_once = p * delta_mag

        def per_kv(t):  # [Hq, Sk, D] -> [Sk, Hkv, D], summed over each kv head's group
            return t.reshape(self.hkv, g, *t.shape[1:]).sum(1).transpose(0, 1)

        self._part(err["dk"], b, rk).add_(per_kv(dk_mag))
        self._part(err["dv"], b, rk).add_(per_kv(dv_mag))
        self._part(err["dq"], b, rq).add_(dq_mag.transpose(0, 1))
        self._part(once["dk"], b, rk).add_(per_kv(sc * ds_once.transpose(1, 2) @ qh.abs()))
        self._part(once["dq"], b, rq).add_((sc * ds_once @ kk.abs()).transpose(0, 1))
        # the CUDA schedule rounds p and ds to the dtype for the tensor cores: once each, relative
        self._part(tiles["dv"], b, rk).add_(per_kv(p.transpose(1, 2) @ doh.abs()))
        self._part(tiles["dk"], b, rk).add_(per_kv(sc * ds.abs().transpose(1, 2) @ qh.abs()))
        self._part(tiles["dq"], b, rq).add_((sc * ds.abs() @ kk.abs()).transpose(0, 1))

    def allowed(self, name: str, tensor_cores: bool = False) -> torch.Tensor:
        """The per-element bound of gradient ``name`` (the module's doc); ``tensor_cores``: with p and ds
        rounded to the dtype before their products, as the CUDA schedule computes."""
        n = self.d + (self.hq // self.hkv) * max(self.lens_q) + max(self.lens_k) + 8
        want = getattr(self, name)
        once = self.once[name] + self.tiles[name] if tensor_cores else self.once[name]
        return n * U32 * self.err[name] + HALF_ULP[self.dtype] * (once + want.abs())


# ------------------------------------------------------------------------------- the kernels
def spec(kind: str, case: Case, backend: str = "c", **fields):
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[case.dtype]
    masks = {} if kind == "prep" else dict(causal=case.causal, window=case.window is not None,
                                           softcap=case.softcap is not None)
    if kind == "prep":  # (it has no tile products: the op's prep takes no overlap)
        fields = {k: v for k, v in fields.items() if k != "overlap"}
    if kind == "dq" and fields.get("overlap") == 3:  # (dq has no dV product: its highest level is 2)
        fields = {**fields, "overlap": 2}
    return get_spec("attention_bwd")(kind=kind, head_dim=case.d, dtype=name, varlen=case.varlen, backend=backend,
                                     **masks, **fields)


@functools.cache
def _kernel(s, device):
    backend, arch = device_backend(device)
    return load_kernel("attention_bwd", s, backend, arch, device, s.args)


def launch(s, device, **args) -> None:
    k = _kernel(s, device)
    k(*k.bind(**{**dict.fromkeys(k.extent_names, 0), **args}))


def strides(prefix: str, t: torch.Tensor, varlen: bool, unit: int) -> dict[str, int]:
    """``{prefix}sb``, ``ss``, ``sh`` in ``unit`` elements: a dense [B, S, H, D] tensor's strides, or
    varlen [T, H, D]'s (sb 0)."""
    assert t.stride(-1) == 1
    got = (0, t.stride(0), t.stride(1)) if varlen else (t.stride(0), t.stride(1), t.stride(2))
    assert all(x % unit == 0 for x in got), (prefix, got, unit)
    return {f"{prefix}s{n}": x // unit for n, x in zip("bsh", got)}


def run_backward(case: Case, device: torch.device = CPU, **fields) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """delta, then dk/dv, then dq through the schedule of ``device`` (C on the CPU); returns (dq, dk, dv)
    on the CPU, NaN-filled before the kernels ran."""
    vl, backend = case.varlen, device_backend(device)[0]
    q, k, v, do, o, lse = (t.to(device) for t in (case.q, case.k, case.v, case.do, case.o, case.lse))
    dq = torch.full(q.shape, NAN, dtype=case.dtype, device=device)
    dk = torch.full(k.shape, NAN, dtype=case.dtype, device=device)
    dv = torch.full(v.shape, NAN, dtype=case.dtype, device=device)
    delta = torch.full(lse.shape, NAN, dtype=torch.float32, device=device)
    cuq = torch.tensor([0, *torch.tensor(case.lens_q).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cuk = torch.tensor([0, *torch.tensor(case.lens_k).cumsum(0).tolist()], dtype=torch.int32, device=device)
    b = len(case.lens_q)
    sq, sk = max(case.lens_q), max(case.lens_k)
    kinds = {kind: spec(kind, case, backend, **fields) for kind in ("prep", "dkdv", "dq")}
    if kinds["dkdv"].tma:
        return _run_tma(kinds, q, k, v, do, o, lse, dq, dk, dv, case)
    unit = kinds["dq"].stride_unit
    lse_st = dict(lsb=0 if vl else lse.stride(0), lsh=lse.stride(-2))
    cu = dict(CUQ=cuq.data_ptr() if vl else 0, CUK=cuk.data_ptr() if vl else 0)
    launch(kinds["prep"], device, O=o.data_ptr(), DO=do.data_ptr(), DELTA=delta.data_ptr(), CUQ=cu["CUQ"], B=b,
           Hq=case.hq, Sq=sq, **strides("o", o, vl, unit), **strides("do", do, vl, unit), **lse_st)
    common = dict(Q=q.data_ptr(), K=k.data_ptr(), V=v.data_ptr(), DO=do.data_ptr(), LSE=lse.data_ptr(),
                  DELTA=delta.data_ptr(), **cu, B=b, Hkv=case.hkv, G=case.hq // case.hkv, Sq=sq, Sk=sk,
                  W=case.window or 0, scale=case.scale, softcap=case.softcap or 0.0, **strides("q", q, vl, unit),
                  **strides("k", k, vl, unit), **strides("v", v, vl, unit), **strides("do", do, vl, unit), **lse_st)
    launch(kinds["dkdv"], device, **common, DK=dk.data_ptr(), DV=dv.data_ptr(), **strides("dk", dk, vl, unit),
           **strides("dv", dv, vl, unit))
    launch(kinds["dq"], device, **common, DQ=dq.data_ptr(), **strides("dq", dq, vl, unit))
    return dq.cpu(), dk.cpu(), dv.cpu()


def _run_tma(kinds, q, k, v, do, o, lse, dq, dk, dv, case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`run_backward`'s launches for TMA programs (dense CUDA, ``loads`` 2): prep writes lse * log2(e)
    and delta into rows padded to ``dlh``; the gradient programs take sizes and element strides as their
    tensors' extents, by name."""
    from tileops.kernels.attention_bwd import padded_rows

    device, (b, sq, hq, _), sk = q.device, q.shape, k.shape[1]
    dlh = padded_rows(sq)
    lse2 = torch.full((b, hq, dlh), NAN, dtype=torch.float32, device=device)
    delta = torch.full((b, hq, dlh), NAN, dtype=torch.float32, device=device)
    launch(kinds["prep"], device, O=o.data_ptr(), DO=do.data_ptr(), LSE=lse.data_ptr(), LSE2=lse2.data_ptr(),
           DELTA=delta.data_ptr(), CUQ=0, B=b, Hq=hq, Sq=sq, **strides("o", o, False, 8),
           **strides("do", do, False, 8), lsb=lse.stride(0), lsh=lse.stride(1), dlh=dlh)
    common = dict(Q=q.data_ptr(), K=k.data_ptr(), V=v.data_ptr(), DO=do.data_ptr(), LSE2=lse2.data_ptr(),
                  DELTA=delta.data_ptr(), G=case.hq // case.hkv, W=case.window or 0, scale=case.scale,
                  softcap=case.softcap or 0.0, B=b, Sq=sq, Sk=sk, Hq=hq, Hkv=case.hkv, dlb=hq * dlh, dlh=dlh,
                  **strides("q", q, False, 1), **strides("k", k, False, 1), **strides("v", v, False, 1),
                  **strides("do", do, False, 1))
    launch(kinds["dkdv"], device, **common, DK=dk.data_ptr(), DV=dv.data_ptr(), **strides("dk", dk, False, 1),
           **strides("dv", dv, False, 1))
    launch(kinds["dq"], device, **common, DQ=dq.data_ptr(), **strides("dq", dq, False, 1))
    return dq.cpu(), dk.cpu(), dv.cpu()


def check(case: Case, device: torch.device = CPU, **fields) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    got = run_backward(case, device, **fields)
    for name, g in zip(("dq", "dk", "dv"), got):
        assert not g.isnan().any(), f"{name}: NaN left (an element was not written, or a masked row leaked)"
        want, allowed = getattr(case, name), case.allowed(name, tensor_cores=device.type == "cuda")
        err = (g.double() - want).abs()
        bad = err > allowed
        assert not bad.any(), (f"{name}: {int(bad.sum())} of {bad.numel()} off; worst error {err.max().item():.3e}, "
                               f"{(err / allowed.clamp_min(1e-300)).max().item():.2f} x its bound")
    return got


# ------------------------------------------------------------------------------------ tests
def test_spec_rejects_bad_fields_by_name():
    S = get_spec("attention_bwd")
    for fields, word in [(dict(kind="fwd", head_dim=64), "kind"), (dict(kind="dq", head_dim=72), "head_dim"),
                         (dict(kind="dq", head_dim=64, dtype="float32"), "dtype"),
                         (dict(kind="dq", head_dim=64, causal=1), "causal"),
                         (dict(kind="dq", head_dim=64, dq_block_q=48), "dq_block_q"),
                         # a multiple of 16 that is no power of two: 112 rows stopped the H100 (misaligned)
                         (dict(kind="dkdv", head_dim=64, dkdv_block_q=112), "dkdv_block_q"),
                         (dict(kind="dq", head_dim=64, dq_threads=96), "dq_threads"),
                         (dict(kind="dq", head_dim=64, stages=5), "stages"),
                         # TileLang 0.1.15's cp.async pipeline at 2+ stages skips its last wait (TMA's does not)
                         (dict(kind="dq", head_dim=64, stages=2, backend="cuda", loads=1), "stages"),
                         (dict(kind="dq", head_dim=64, stages=2, backend="cuda", varlen=True), "stages"),
                         (dict(kind="dq", head_dim=64, loads=3), "loads"),
                         # TMA would read the next sequence's rows past a varlen sequence's end
                         (dict(kind="dkdv", head_dim=64, loads=2, backend="cuda", varlen=True), "loads"),
                         (dict(kind="dq", head_dim=64, overlap=4), "overlap"),
                         (dict(kind="prep", head_dim=64, overlap=2), "overlap"),
                         (dict(kind="dq", head_dim=128, overlap=3), "overlap"),
                         # a product left running needs TMA loads, p and ds in registers and no softcap
                         (dict(kind="dkdv", head_dim=128, overlap=2, loads=1), "overlap"),
                         (dict(kind="dkdv", head_dim=128, overlap=3, softcap=True), "overlap"),
                         (dict(kind="dq", head_dim=256, overlap=2), "overlap"),
                         (dict(kind="dkdv", head_dim=64, overlap=2, backend="c", dtype="float32"), "overlap")]:
        with pytest.raises(ValueError, match=rf"^{word}: "):
            S(**fields)


def test_the_best_overlap_is_the_highest_level_whose_registers_fit():
    """dk/dv can leave dV's product running under ds (3) where its live registers fit (head_dim 80-128: 224 fp32
    words a consumer thread at 128), 2 at head_dim 64 (256 words: ptxas 13.0 serialised that build's wgmma);
    dq 2; 1 wherever no product can be left running: a softcap, head_dim 256 (p and ds through shared
    memory), every thread loading (varlen), the C schedule. The default stays 1 until levels 2 and 3 have run
    on a GPU (kernels/attention_bwd.py, ``_DEFAULT_OVERLAP``)."""
    S = get_spec("attention_bwd")
    got = {(k, d): S(kind=k, head_dim=d).overlap_best for d in HEAD_DIMS for k in ("dkdv", "dq")}
    assert got == {("dkdv", 64): 2, ("dq", 64): 2, ("dkdv", 80): 3, ("dq", 80): 2, ("dkdv", 96): 3, ("dq", 96): 2,
                   ("dkdv", 128): 3, ("dq", 128): 2, ("dkdv", 256): 1, ("dq", 256): 1}
    assert S(kind="dkdv", head_dim=128).overlap_words == 224 and S(kind="dkdv", head_dim=64).overlap_words == 256
    for fields in (dict(softcap=True), dict(varlen=True), dict(loads=1), dict(backend="c", dtype="float32")):
        assert S(kind="dkdv", head_dim=128, **fields).overlap_best == 1, fields
    assert S(kind="prep", head_dim=128).overlap_best == 1
    assert {S(kind=k, head_dim=d).tile("overlap") for d in HEAD_DIMS for k in ("dkdv", "dq")} == {1}
    assert S(kind="dkdv", head_dim=64, overlap=3).tile("overlap") == 3  # asked for: taken


def _releases_and_pending(src: str, streamed: set) -> list[tuple[str, set]]:
    """For each consumer release of a ``streamed`` stage in ``src`` (the CUDA of a TMA gradient program), the
    shared buffer released and the buffers still read by wgmma groups issued and not yet retired there.
    A stage's empty barrier is the one the producer waits on before its TMA load into that buffer (the
    loop variable, ``n`` there and ``n_1`` in the consumers' loop, read as one); a group is the
    descriptors' buffers between two ``warpgroup_commit_batch``; ``warpgroup_wait<n>`` (``T.gemm``'s) and
    ``wait_wgmma<n>`` retire the oldest groups until n are left."""
    import re

    def index(expr):
        return re.sub(r"\bn_\d+\b", "n", expr)

    empty = {}  # barrier index expression -> buffer
    for m in re.finditer(r"tl::tma_load\(\w+_desc, mbarrier\[[^\n]*?\(\(bfloat16_t\*\)(\w+)\)", src):
        if m.group(1) in streamed:
            wait = list(re.finditer(r"mbarrier\[(.*)\]\.wait\(", src[:m.start()]))[-1]
            empty[index(wait.group(1))] = m.group(1)
    assert set(empty.values()) == streamed, empty
    events = sorted([(m.start(), "buf", m.group(1)) for m in re.finditer(
        r"initialize_wgmma_descriptor<[^>]*>\(\w+, \(&\(\(\(bfloat16_t\*\)(\w+)\)", src)]
        + [(m.start(), "commit", None) for m in re.finditer(r"warpgroup_commit_batch\(\)", src)]
        + [(m.start(), "wait", int(m.group(1))) for m in re.finditer(r"(?:warpgroup_wait|wait_wgmma)<(\d+)>", src)]
        + [(m.start(), "arrive", index(m.group(1))) for m in re.finditer(r"mbarrier\[(.*)\]\.arrive\(\);", src)])
    out, group, pending = [], set(), []
    for _, what, x in events:
        if what == "buf":
            group.add(x)
        elif what == "commit":
            pending.append(group)
            group = set()
        elif what == "wait":
            del pending[:max(len(pending) - x, 0)]
        elif x in empty:
            out.append((empty[x], set().union(*pending)))
    return out


@pytest.mark.parametrize("kind,level", [("dkdv", 3), ("dkdv", 2), ("dq", 2), ("dkdv", 1)])
def test_overlapped_steps_release_each_stage_after_the_wgmma_that_reads_it(kind, level):
    """The producer may refill a stage (Q and dO in dk/dv, K and V in dq) only once no wgmma reads it. TileLang's
    warp specialisation releases a stage after the last statement that reads it, and an unwaited
    ``T.wgmma_gemm`` is such a statement: the steps' ``touch`` reads after the waits move the releases there.
    Read in the CUDA emitted for sm_90 (head_dim 128 causal; a few seconds a kernel here): with those reads
    removed, dk/dv 3 released Q and dO under dK's and dV's products, and dq 2 released V under dp's."""
    from tileops.compile.build import emit_source

    spec = get_spec("attention_bwd")(kind=kind, head_dim=128, dtype="bfloat16", causal=True, overlap=level)
    src = emit_source("attention_bwd", spec, "cuda", "sm_90")
    assert src.count("tl::wait_wgmma<") == {1: 0, 2: 2, 3: 3}[level]  # the levels' own waits
    streamed = {"dkdv": {"Q_s", "G_s"}, "dq": {"K_s", "V_s"}}[kind]
    got = _releases_and_pending(src, streamed)
    assert sorted(b for b, _ in got) == sorted(streamed), got  # each released once a step
    for buf, reading in got:
        assert buf not in reading, f"{buf} goes back to the producer while a wgmma still reads it"


# Sequences of 37 and 21 rows cross the C schedule's 16-row tiles with a partial last tile.
@pytest.mark.parametrize("sq,sk", [(37, 37), (21, 37), (37, 21)], ids=["Sq=Sk", "Sq<Sk", "Sq>Sk"])
def test_causal(gen, sq, sk):
    """Bottom-right causal; with Sq > Sk the first Sq - Sk queries see no key (lse -inf, zero gradients)."""
    case = Case(gen, lens_q=[sq, sq], lens_k=[sk, sk], hq=8, hkv=2, causal=True)
    dq, _, _ = check(case)
    if sq > sk:
        assert torch.isinf(case.lse[:, :, : sq - sk]).all()
        assert (dq[:, : sq - sk] == 0).all()


@pytest.mark.parametrize("hq,hkv", [(8, 2), (3, 3)], ids=["gqa4", "mha"])
def test_no_mask(gen, hq, hkv):
    check(Case(gen, lens_q=[29, 29], lens_k=[45, 45], hq=hq, hkv=hkv))


@pytest.mark.parametrize("causal", [False, True], ids=["window", "causal+window"])
def test_sliding_window(gen, causal):
    """Window 7 over 40 keys: whole 16-row tiles fall outside the band and are skipped."""
    check(Case(gen, lens_q=[33], lens_k=[40], hq=4, hkv=1, causal=causal, window=7))


def test_softcap(gen):
    """Gemma 2's 50 with an amplified scale, so that tanh saturates for part of the scores (its
    derivative 1 - t^2 then ranges over (0, 1])."""
    check(Case(gen, lens_q=[24], lens_k=[30], hq=4, hkv=2, softcap=50.0, causal=True, scale=6.0))


def test_varlen_with_an_empty_sequence(gen):
    """Three sequences, the middle one empty on both sides, one where the queries outnumber the keys."""
    check(Case(gen, lens_q=[19, 0, 23], lens_k=[26, 0, 17], hq=8, hkv=2, causal=True, varlen=True))


def test_a_fully_masked_query_row(gen):
    """Window 1 with Sq > Sk: query rows before Sk - Sq see no key at all; their dq is exactly 0."""
    case = Case(gen, lens_q=[20], lens_k=[12], hq=2, hkv=1, causal=True, window=1)
    dq, _, _ = check(case)
    assert (dq[:, :8] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_inputs(gen, dtype):
    check(Case(gen, lens_q=[18, 18], lens_k=[35, 35], hq=4, hkv=2, dtype=dtype, causal=True, window=20))


def test_tile_shapes_agree(gen):
    """Other tile shapes (the knobs a manifest may set) give gradients within the same bounds."""
    case = Case(gen, lens_q=[30], lens_k=[30], hq=2, hkv=1, causal=True, window=9)
    check(case, dkdv_block_kv=8, dkdv_block_q=32, dq_block_q=4, dq_block_kv=32)


def test_deterministic(gen):
    """Two runs on the same inputs: the same bits."""
    case = Case(gen, lens_q=[25, 25], lens_k=[25, 25], hq=4, hkv=1, causal=True)
    first = run_backward(case)
    second = run_backward(case)
    for a, b in zip(first, second):
        assert torch.equal(a.view(torch.int32) if a.dtype == torch.float32 else a.view(torch.int16),
                           b.view(torch.int32) if b.dtype == torch.float32 else b.view(torch.int16))


def test_cuda_schedule_lowers_to_tensor_cores_and_async_copies():
    """The CUDA schedule lowers for sm_90 without a GPU (head_dim 128, every mask, varlen): the tile
    products on wgmma (the dk/dv and dq products of p and ds from registers), the streamed tiles
    through 16-byte ``cp.async`` (a predicated load, or two copies in one parallel loop, had left
    4-byte copies or none). Its build is TileLang's nvcc, not the lean build: the source uses TileLang's
    templates (``tileops.compile.cuda_build.Unsupported``)."""
    from tileops.compile import cuda_build
    from tileops.compile.build import emit_source

    S = get_spec("attention_bwd")
    for kind in ("dkdv", "dq"):
        src = emit_source("attention_bwd", S(kind=kind, head_dim=128, dtype="bfloat16", causal=True, window=True,
                                             softcap=True, varlen=True), "cuda", "sm_90")
        for word in ("tl::wgmma_ss", "tl::wgmma_rs", "cp_async_gs<16>"):
            assert word in src, (kind, word)
        with pytest.raises(cuda_build.Unsupported):
            cuda_build.device_source(src)


def test_cuda_loops_from_the_first_tile_lower():
    """dq without a window and dk/dv without causal loop from the first tile: TileLang 0.1.15's codegen
    refused those pipelined loops when they started at a literal 0 (every row of the op's backward but
    windowed ones failed to build); they start at ``_zero(W)`` now. Head_dim 64, dense, every thread
    loading (``loads`` 1; ~15 s here)."""
    from tileops.compile.build import emit_source

    S = get_spec("attention_bwd")
    for kind in ("dq", "dkdv"):
        src = emit_source("attention_bwd", S(kind=kind, head_dim=64, dtype="bfloat16", loads=1), "cuda", "sm_90")
        assert "tl::wgmma" in src and "cp_async_gs<16>" in src, kind


@pytest.mark.parametrize("fields", [dict(), dict(causal=True, window=True, softcap=True, head_dim=256)],
                         ids=["full-d128", "masked-softcap-d256"])
def test_cuda_dense_programs_take_their_tiles_by_tma(fields):
    """A dense call's gradient programs with ``loads`` 2: every tile by TMA (K/V once and Q/dO
    streamed in dk/dv, the reverse in dq, lse2 and delta by 1-D boxes), under the producer warpgroup
    TileLang adds (``setmaxnreg``: 384 threads, two stages of mbarriers), no ``cp.async``, the products on
    wgmma, and the gradients stored a tile at once (``tma_store``). The prep writes lse2 beside delta."""
    from tileops.compile.build import emit_source

    S = get_spec("attention_bwd")
    fields = {"head_dim": 128, **fields}
    for kind in ("dkdv", "dq"):
        spec = S(kind=kind, dtype="bfloat16", backend="cuda", loads=2, **fields)
        assert spec.tma and spec.tile("stages") == 2
        src = emit_source("attention_bwd", spec, "cuda", "sm_90")
        # Q, dO, lse2, delta, K and V: one load each in the source (a tile's boxes in a loop)
        assert src.count("tl::tma_load(") == 6, (kind, src.count("tl::tma_load("))
        assert "cp_async" not in src and "tl::wgmma" in src and "tl::tma_store(" in src, kind
        assert "__launch_bounds__(384, 1)" in src and "warpgroup_reg_alloc" in src, kind
    prep = emit_source("attention_bwd", S(kind="prep", dtype="bfloat16", backend="cuda", loads=2,
                                          head_dim=fields["head_dim"]), "cuda", "sm_90")
    assert "LSE2[" in prep and "1.442695" in prep
    # fp32, as the gradient programs read it: first written in the inputs' dtype (bf16 bits read as fp32
    # made p garbage; dq off by up to 1e11 on the H100)
    for name in ("LSE2", "DELTA", "LSE"):
        assert f"float* __restrict__ {name}" in prep, name


def test_cuda_tiles_split_by_columns_take_p_and_ds_through_shared_memory():
    """dq at 64 q rows over 256 threads: the two warpgroups split the score tile by columns, and
    TileLang 0.1.15 cannot lay p and ds out in registers then (the H200's build of :data:`TILES` failed:
    "Layout infer conflict between s_f and ds_f"). ``ds_shared`` defaults to 2 there, which lowers; 1
    is refused by name before any build. The head dims' defaults keep their choice (~8 s here)."""
    from tileops.compile.build import emit_source

    S = get_spec("attention_bwd")
    s = S(kind="dq", head_dim=128, dtype="bfloat16", causal=True, **TILES)
    assert s.split_by_columns and s.tile("ds_shared") == 2
    assert "tl::wgmma" in emit_source("attention_bwd", s, "cuda", "sm_90")
    with pytest.raises(ValueError, match=r"^ds_shared: 1 \(p and ds in registers\) needs the dq program's 64-row "
                                         r"tile in slices of 64 rows a warpgroup; 256 threads split it by columns"):
        S(kind="dq", head_dim=128, dtype="bfloat16", **TILES, ds_shared=1)
    assert [S(kind=k, head_dim=d).tile("ds_shared") for d in HEAD_DIMS for k in ("dkdv", "dq")] == [
        1] * 8 + [2, 2], "the head dims' defaults"


def test_cuda_prep_lowers_at_head_dims_80_and_96():
    """delta's row sum over a fragment padded to a power of two wide (TileLang 0.1.15 found no layout for
    ``T.reduce_sum`` over [32, 80] or [32, 96] on 128 threads)."""
    from tileops.compile.build import emit_source

    S = get_spec("attention_bwd")
    for d in (80, 96):
        assert "attn_bwd_prep" in emit_source("attention_bwd", S(kind="prep", head_dim=d, dtype="float16"), "cuda",
                                              "sm_90")


# ------------------------------------------------------------------------- the CUDA schedule
# Written to run on the H200 (skipped without a GPU): the tensor-core programs at every head dim, with
# sequences that cross their 128-row tiles and end inside one.
CUDA = torch.device("cuda")
HEAD_DIMS = [64, 80, 96, 128, 256]
DTYPES = [torch.bfloat16, torch.float16]
MASKS = {
    "sq<sk": dict(lens_q=[200], lens_k=[333], causal=True),
    "sq>sk": dict(lens_q=[333], lens_k=[200], causal=True),  # the first 133 queries see no key
    "causal+window": dict(lens_q=[300], lens_k=[300], causal=True, window=77),
    "window": dict(lens_q=[300], lens_k=[300], window=130),
    "softcap": dict(lens_q=[257], lens_k=[257], causal=True, softcap=50.0, scale=4.0),
    "varlen": dict(lens_q=[190, 0, 129, 1], lens_k=[250, 0, 64, 300], causal=True, varlen=True),
}
#: the masks test_cuda_overlapped_steps_give_the_waited_steps_values runs: rows that see no key, and a band
OVERLAP_MASKS = ("sq>sk", "causal+window")
#: the tile knobs of test_cuda_mha_and_tile_shapes' every-thread run (the knobs its sweep tries)
TILES = dict(dkdv_block_q=64, dq_block_kv=128, dq_block_q=64, stages=1, loads=1)
#: and of its TMA run: the dk/dv program's q step at 32 (the TMA default is 64 at head_dim 128)
TMA_TILES = dict(dkdv_block_q=32)


def _specs(d=128, dtype=torch.bfloat16, causal=False, window=None, softcap=None, varlen=False, **fields):
    """The CUDA specs of a case's three kernels (as :func:`run_backward` makes them)."""
    class Like:  # what spec() reads of a Case
        pass

    like = Like()
    like.dtype, like.d, like.causal, like.window, like.softcap, like.varlen = dtype, d, causal, window, softcap, varlen
    return [spec(kind, like, "cuda", **fields) for kind in ("prep", "dkdv", "dq")]


def _warm(specs) -> None:
    """Compile ``specs`` into the kernel cache at once, one process a CPU: TileLang's nvcc build of one
    of these programs takes ~30 s cold (sm_90a, head_dim 128, measured on 2 busy cores), so 30 of them
    one after another would hold a test run for a quarter of an hour."""
    from tileops.compile.warmup import compile_jobs

    arch = device_backend(CUDA)[1]
    # a kernel that fails to build here fails its own test, where load_kernel builds it again and raises
    compile_jobs([("attention_bwd", x, "cuda", arch) for x in dict.fromkeys(specs)], progress=False)


@pytest.fixture(scope="module")
def warm_head_dims(request):
    """The kernels of the selected ``test_cuda_head_dims`` cases (``-k`` may pick some)."""
    picked = [i.callspec.params for i in request.session.items
              if i.name.startswith("test_cuda_head_dims[") and hasattr(i, "callspec")]
    _warm([x for c in picked for x in _specs(c["d"], c["dtype"])])


@pytest.fixture(scope="module")
def warm_masks():
    fields = [{k: v for k, v in kw.items() if k not in ("lens_q", "lens_k", "scale")} for kw in MASKS.values()]
    rest = [_specs(**f) for f in fields]
    every = [_specs(loads=1, **f) for f in fields if not f.get("varlen")]
    mha = [_specs(causal=True, **f) for f in ({}, TMA_TILES, dict(loads=1), TILES)]
    levels = [_specs(overlap=level, **fields[list(MASKS).index(name)]) for name in OVERLAP_MASKS for level in (2, 3)]
    _warm([x for group in (*rest, *every, *mha, *levels) for x in group])


@pytest.mark.cuda
@ATTN_CUDA
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_head_dims(gen, warm_head_dims, d, dtype):
    check(Case(gen, lens_q=[300, 300], lens_k=[300, 300], hq=8, hkv=2, d=d, dtype=dtype), CUDA)


@pytest.mark.cuda
@ATTN_CUDA
@pytest.mark.parametrize("name", list(MASKS))
def test_cuda_masks(gen, warm_masks, name):
    check(Case(gen, hq=8, hkv=2, d=128, dtype=torch.bfloat16, **MASKS[name]), CUDA)


@pytest.mark.cuda
@ATTN_CUDA
@pytest.mark.parametrize("name", [n for n, kw in MASKS.items() if not kw.get("varlen")])
def test_cuda_masks_every_thread(gen, warm_masks, name):
    """Every dense mask with the programs' tiles loaded by every thread (``loads`` 1, one stage: varlen's
    programs, which a schedule may also choose for a dense call; the default, TMA, is test_cuda_masks')."""
    check(Case(gen, hq=8, hkv=2, d=128, dtype=torch.bfloat16, **MASKS[name]), CUDA, loads=1)


@pytest.mark.cuda
@ATTN_CUDA
def test_cuda_mha_and_tile_shapes(gen, warm_masks):
    """MHA, and other tiles: by TMA (the default) and with the dk/dv program's q step at 32; by every
    thread's loads (``loads`` 1), and with the dk/dv program's q step at 64, the dq program's 64-row tiles
    over 128-key steps (knobs the benchmark's sweep tries)."""
    case = Case(gen, lens_q=[300], lens_k=[300], hq=4, hkv=4, d=128, dtype=torch.bfloat16, causal=True)
    check(case, CUDA)
    check(case, CUDA, **TMA_TILES)
    check(case, CUDA, loads=1)
    check(case, CUDA, **TILES)


@pytest.mark.cuda
@ATTN_CUDA
def test_cuda_deterministic(gen, warm_masks):
    case = Case(gen, lens_q=[400], lens_k=[400], hq=8, hkv=1, d=128, dtype=torch.bfloat16, causal=True)
    first, second = run_backward(case, CUDA), run_backward(case, CUDA)
    for a, b in zip(first, second):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.cuda
@ATTN_CUDA
@pytest.mark.parametrize("name", OVERLAP_MASKS)
def test_cuda_overlapped_steps_give_the_waited_steps_values(gen, warm_masks, name):
    """``overlap`` moves only the waits on the tile products (the arithmetic is the same expressions in the
    same order; levels 2 and 3 start the score products from ``clear_accum`` where level 1 adds them to
    zeros, which can differ only in a zero's sign): levels 2 and 3 (dk/dv; dq takes 2) give level 1's, the
    default's, values exactly, and each passes the float64 bounds."""
    case = Case(gen, hq=8, hkv=2, d=128, dtype=torch.bfloat16, **MASKS[name])
    waited = check(case, CUDA)
    for level in (2, 3):
        for n, a, b in zip(("dq", "dk", "dv"), waited, check(case, CUDA, overlap=level)):
            assert torch.equal(a, b), (level, n)
