"""The ops as torch.library custom ops: opcheck for every op, torch.compile with no graph break and
no recompile across lengths, gradients through a compiled function (CPU here; the CUDA variants
are in test_cuda.py)."""

from __future__ import annotations

import pytest
import torch

import tileops
from tileops.runtime.library import pack
from tileops.manifest import registry
from tileops.workloads import make_inputs, op_class

REGISTRY = registry()
OPS = sorted(REGISTRY)


def _small(name: str, gen: torch.Generator, every: bool = True) -> tuple:
    m = REGISTRY[name]
    case = next(c for c in m.cases if c.label.endswith("odd") or "odd" in c.label or c.bench is False)
    params = {p.name: p.default for p in m.params if p.has_default} | dict(case.params)
    dims = {d: 3 for d in m.dims} | {"head_dim": 32, "hidden": 64}  # RoPE's head size, a norm's row
    # attention's head counts and sizes are the op's params (a rule ties them): the case's own
    dims |= {d: v for d, v in case.dims.items() if d in ("q_heads", "kv_heads", "q_dim", "k_dim", "cache_heads",
                                                        "cache_dim")}
    if "max_position" in params:
        params["max_position"] = 1000
    if params.get("rotary_dim"):
        params["rotary_dim"] = 16
    if "mrope_section" in params:  # head_dim 32: three sections summing to 16
        params["mrope_section"] = (4, 6, 6)
    for arg in ("rescale_factors", "short_factor", "long_factor"):
        if arg in params and params[arg] is not None:
            params[arg] = None
    inputs = make_inputs(m, params, dims, "float32", generator=gen, every=every)
    for n in DENSE_REFUSES.get(name, ()):
        inputs.pop(n, None)
    return m, op_class(name)(**params), inputs


#: optional inputs the case's call refuses: attention's offsets need a varlen (3-D) q, the case's is dense;
#: the paged decode's scales need an fp8 cache, the case's is not
DENSE_REFUSES = {"AttnFwdOp": ("cu_seqlens_q", "cu_seqlens_k"), "PagedAttnDecodeFwdOp": ("k_scale", "v_scale")}


#: ops that write an input in place (the prologue's KV caches) go through apply_out alone, with the
#: written inputs among its mutated tensors: tests/test_attention_prologue.py opchecks that form
WRITES = {n for n in OPS if any(t.written for t in REGISTRY[n].inputs)}


@pytest.mark.parametrize("name", [n for n in OPS if n not in WRITES])
def test_opcheck_every_op(name, gen):
    # The custom ops take the given inputs as one list in the manifest's order with their names,
    # and apply_out one tensor per output the call produces.
    m, op, inputs = _small(name, gen)
    h = op._handle
    required = {t.name: inputs[t.name] for t in m.inputs if not t.optional}
    for given in (inputs, required):
        torch.library.opcheck(torch.ops.tileops.apply.default, (h, *pack(op._layout, given)))
    wrt = set(m.backward.wrt) if m.backward else set()
    grad = {n: t.clone().requires_grad_(True) if n in wrt else t for n, t in inputs.items()}
    torch.library.opcheck(torch.ops.tileops.apply.default, (h, *pack(op._layout, grad)))
    outs = [torch.empty_like(inputs[o.like]) for o in m.outputs if o.like in inputs]
    torch.library.opcheck(torch.ops.tileops.apply_out.default, (h, *pack(op._layout, inputs), outs))


def test_compiled_fullgraph_dynamic_no_recompile_and_eager_result(gen):
    from torch._dynamo.testing import CompileCounterWithBackend

    op = tileops.rope.RoPELlama31FwdOp(input_layout="2d")

    def attention_inputs(q, k, pos):
        qo, ko = op(q, position_ids=pos, key=k)
        return qo * 0.5, ko

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(attention_inputs, fullgraph=True, dynamic=True, backend=counter)
    # from 5: Dynamo specializes sizes 0 and 1, and equates dims equal at the first call (duck sizing)
    for seq in range(5, 25):
        q = torch.randn(2, seq, 4, 32, generator=gen)
        k = torch.randn(2, seq, 2, 32, generator=gen)
        pos = torch.randint(0, 2**20, (2, seq), generator=gen)
        got, want = compiled(q, k, pos), attention_inputs(q, k, pos)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
    assert counter.frame_count == 1, f"{counter.frame_count} compiles for 20 lengths"


def test_compiled_gradients_and_out(gen):
    op = tileops.rope.RoPEFwdOp(input_layout="2d")

    def loss(x, pos):
        return op(x, position_ids=pos).square().sum()

    compiled = torch.compile(loss, fullgraph=True)
    x = torch.randn(2, 9, 3, 32, generator=gen, requires_grad=True)
    pos = torch.randint(0, 5000, (9,), generator=gen)
    (g_compiled,) = torch.autograd.grad(compiled(x, pos), x)
    (g_eager,) = torch.autograd.grad(loss(x, pos), x)
    assert torch.allclose(g_compiled, g_eager, atol=1e-5, rtol=1e-5)

    def in_place(x, pos):
        op(x, position_ids=pos, out=x)
        return x

    y = torch.randn(2, 9, 3, 32, generator=gen)
    want = op(y, position_ids=pos)
    got = torch.compile(in_place, fullgraph=True)(y.clone(), pos)
    assert torch.equal(got, want)


def test_reduce_overhead_mode_runs(gen):
    op = tileops.rope.RoPEFwdOp(input_layout="2d")
    f = torch.compile(lambda x: op(x) + 1, mode="reduce-overhead", fullgraph=True)
    x = torch.randn(1, 5, 2, 16, generator=gen)
    assert torch.equal(f(x), op(x) + 1)


def test_compiled_with_some_outputs_given_returns_what_eager_returns(gen):
    # out= given with a key but no key_out: the eager call returns (out, a new key_out); the traced
    # call once passed key_out=None to the kernel and returned (out, None)
    op = tileops.rope.RoPEFwdOp(input_layout="2d")
    x, k = torch.randn(2, 7, 3, 32, generator=gen), torch.randn(2, 7, 1, 32, generator=gen)
    pos = torch.randint(0, 5000, (7,), generator=gen)
    want = op(x, position_ids=pos, key=k)

    def only_out(x, k, pos, o):
        return op(x, position_ids=pos, key=k, out=o)

    o = torch.full_like(x, float("nan"))
    got = torch.compile(only_out, fullgraph=True)(x, k, pos, o)
    assert isinstance(got, tuple) and len(got) == 2 and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(o, want[0])

    def only_key_out(x, k, pos, ko):
        return op(x, position_ids=pos, key=k, key_out=ko)

    ko = torch.full_like(k, float("nan"))
    got = torch.compile(only_key_out, fullgraph=True)(x, k, pos, ko)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(ko, want[1])
    with pytest.raises(Exception, match="key_out: given without key"):
        torch.compile(lambda x, ko: op(x, key_out=ko), fullgraph=True)(x, ko)
    with pytest.raises(Exception, match="out= cannot be used while x requires grad"):
        torch.compile(lambda x, o: op(x, out=o), fullgraph=True)(x.clone().requires_grad_(True), o)
