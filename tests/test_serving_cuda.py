"""Serving-grade calls on a GPU: no host sync for positions, per-call errors across threads and
streams, CUDA graphs, torch.compile, opcheck and several GPUs (skipped without CUDA). Tests taking
``on`` run on the native runtime and on the Python one (``TILEOPS_NATIVE=0``), which judges a call
that reads positions at the call itself instead of deferring it (tileops/runtime/errors.py)."""

from __future__ import annotations

import threading

import pytest
import torch

import tileops
from tests.paths import both, native_module, on_python
from tests.references import reference, reference_grad
from tileops.rope import RoPEFwdOp, RoPENeoxPositionIdsFwdOp, YaRNFwdOp

pytestmark = pytest.mark.cuda


@pytest.fixture(params=["native", "python"])
def on(request):
    """Each test so marked runs on the native runtime (tileops.runtime.native) and on the Python
    one: every op it makes passes through ``on``."""
    if request.param == "python":
        return on_python
    native_module()
    return lambda op: op


def _close(got, ref, tol=4e-3):
    return bool(((got.double().cpu() - ref).abs() <= tol + tol * ref.abs()).all())


def test_python_runtime_judges_a_bad_position_at_the_call():
    op = on_python(RoPENeoxPositionIdsFwdOp(4096))
    x = torch.randn(64, 8, 128, device="cuda", dtype=torch.float16)
    good = torch.randint(0, 4096, (64,), device="cuda")
    bad = good.clone()
    bad[17] = 4096
    with pytest.raises(ValueError, match=r"position_ids\[17\] = 4096$"):
        op(x, bad)  # it waited for its own kernel
    ref = reference("RoPENeoxPositionIdsFwdOp", {"max_position": 4096}, {"x": x.cpu(), "position_ids": good.cpu()})
    assert _close(op(x, good), ref)
    op.check()


def test_bad_position_reported_at_the_next_call_or_check_without_sync():
    native_module()
    op = RoPENeoxPositionIdsFwdOp(4096)
    x = torch.randn(64, 8, 128, device="cuda", dtype=torch.float16)
    bad = torch.randint(0, 4096, (64,), device="cuda")
    bad[17] = 4096
    good = torch.randint(0, 4096, (64,), device="cuda")
    op(x, bad)  # no exception here: nothing waited for the kernel
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=r"position_ids\[17\] = 4096 \(reported for an earlier call"):
        op(x, good)
    out = op(x, good)  # the error was reported once; the op goes on
    op.check()
    ref = reference("RoPENeoxPositionIdsFwdOp", {"max_position": 4096}, {"x": x.cpu(), "position_ids": good.cpu()})
    assert _close(out, ref)
    op(x, bad)
    with pytest.raises(ValueError, match=r"position_ids\[17\]"):
        op.check()
    with tileops.strict(), pytest.raises(ValueError, match=r"position_ids\[17\] = 4096$"):
        op(x, bad)


def test_a_call_without_positions_reports_an_earlier_bad_one():
    """As Op._eager_call judges the op's pending calls before any call, the native runtime does too,
    whatever the new call's signature (here: no positions, another shape)."""
    native_module()
    op = RoPEFwdOp(input_layout="2d")
    x = torch.randn(1, 16, 4, 64, device="cuda")
    pos = torch.randint(0, 4096, (16,), device="cuda")
    op(x, position_ids=pos)
    op(x)
    op(x)  # both signatures have plans now
    pos[3] = -7
    op(x, position_ids=pos)
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=r"position_ids\[3\] = -7 \(reported for an earlier call"):
        op(x)
    op(x)
    op.check()
    assert op._runtime.stats()["hits"] >= 3


def test_threads_and_streams_see_only_their_own_errors(on):
    op = on(YaRNFwdOp(input_layout="2d", scale=4.0))
    x = torch.randn(2, 33, 4, 64, device="cuda")
    ref_pos = torch.randint(0, 2**20, (2, 33), device="cuda")
    want = op(x, position_ids=ref_pos)
    torch.cuda.synchronize()
    errors = {"good": 0, "bad": 0, "wrong": 0, "launched_bad": 0}
    lock = threading.Lock()

    def worker(kind: str) -> None:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for i in range(60):
                pos = ref_pos.clone()
                if kind == "bad":
                    pos[1, 5] = -3
                try:
                    out = op(x, position_ids=pos)
                    if kind == "bad":  # it ran (an earlier call's error would have stopped it first)
                        with lock:
                            errors["launched_bad"] += 1
                    if kind == "good":
                        stream.synchronize()
                        if not torch.equal(out, want):
                            with lock:
                                errors["wrong"] += 1
                except ValueError as e:
                    with lock:
                        errors[kind] += 1
                    assert "position_ids[1, 5] = -3" in str(e)
            try:
                op.check()
            except ValueError:
                with lock:
                    errors[kind] += 1

    threads = [threading.Thread(target=worker, args=(k,)) for k in ("good", "bad", "good", "bad")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors["good"] == 0 and errors["wrong"] == 0, errors
    if on is on_python:  # each bad call raises at the call itself
        assert errors["bad"] == 120 and errors["launched_bad"] == 0, errors
        return
    # every bad call that ran is reported exactly once: at a later call of its thread, or at check()
    assert errors["bad"] == errors["launched_bad"] > 0, errors


def test_cuda_graph_replays_new_data_and_positions_with_key_and_out(on):
    op = on(RoPEFwdOp(input_layout="2d"))
    q = torch.randn(1, 32, 32, 128, device="cuda", dtype=torch.bfloat16)  # decode: 32 tokens
    k = torch.randn(1, 32, 8, 128, device="cuda", dtype=torch.bfloat16)
    pos = torch.randint(0, 8192, (32,), device="cuda")
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    op(q, position_ids=pos, key=k, out=qo, key_out=ko)  # warm-up: compiles, builds the tables
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    op(q, position_ids=pos, key=k, out=qo, key_out=ko)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before, "a warm call allocated"
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g):
        op(q, position_ids=pos, key=k, out=qo, key_out=ko)
    for _ in range(3):
        q.copy_(torch.randn_like(q))
        k.copy_(torch.randn_like(k))
        pos.copy_(torch.randint(0, 8192, (32,), device="cuda"))
        g.replay()
        torch.cuda.synchronize()
        params = {"input_layout": "2d"}
        assert _close(qo, reference("RoPEFwdOp", params, {"x": q.cpu(), "position_ids": pos.cpu()}), 1.6e-2)
        assert _close(ko, reference("RoPEFwdOp", params, {"x": k.cpu(), "position_ids": pos.cpu()}), 1.6e-2)
        op.check()
    pos[3] = 1 << 24
    g.replay()
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=r"position_ids\[3\] = 16777216 \(in a CUDA graph replay, whose kernel "
                                         r"read it as position 0\)"):
        op.check()
    pos[3] = 7
    g.replay()
    torch.cuda.synchronize()
    op.check()  # cleared: the next replay is judged alone


def test_every_op_captures_in_a_graph(on):
    for name, cls in tileops.ops().items():
        m = tileops.manifest.get(name)
        if m.family == "attention":  # its own params (a rope op) and caches: captured below
            continue
        params = {p.name: p.default for p in m.params if p.has_default}
        if "max_position" in [p.name for p in m.params]:
            params["max_position"] = 4096
        if "input_layout" in params:
            params["input_layout"] = "2d"
        if name == "MRoPEFwdOp":
            params["mrope_section"] = (8, 12, 12)  # the 32 pairs of head_dim 64
        op = on(cls(**params))
        if m.family == "norm":
            x, w = torch.randn(16, 4, 64, device="cuda"), torch.randn(64, device="cuda")
            call = lambda: op(x, weight=w, out=out)  # noqa: E731
        elif name == "RoPENeoxPositionIdsFwdOp":
            x, pos = torch.randn(16, 4, 64, device="cuda"), torch.randint(0, 4096, (16,), device="cuda")
            call = lambda: op(x, pos, out=out)  # noqa: E731
        else:
            x = torch.randn(1, 16, 4, 64, device="cuda")
            pos = torch.randint(0, 4096, (3, 1, 16) if name == "MRoPEFwdOp" else (16,), device="cuda")
            call = lambda: op(x, position_ids=pos, out=out)  # noqa: E731
        out = torch.empty_like(x)
        call()
        want = out.clone()
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.cuda.graph(g):
            call()
        out.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want), name


def test_the_prologue_captures_in_a_graph(on):
    """The fused prologue in a CUDA graph: the replay writes q and both caches again, bit for bit."""
    from tileops.attention import AttnPrologueFwdOp
    from tileops.rope import RoPENeoxPositionIdsFwdOp

    op = on(AttnPrologueFwdOp(4, 2, 64, RoPENeoxPositionIdsFwdOp(4096, 1e4), qk_norm=True))
    qkv = torch.randn(16, 8 * 64, device="cuda")
    pos = torch.randint(0, 4096, (16,), device="cuda")
    slots = torch.randperm(4 * 16, device="cuda")[:16]
    caches = [torch.zeros(4, 16, 2, 64, device="cuda") for _ in range(2)]
    qw, kw = torch.randn(64, device="cuda"), torch.randn(64, device="cuda")
    out = torch.empty(16, 4, 64, device="cuda")
    call = lambda: op(qkv, pos, *caches, slots, q_norm_weight=qw, k_norm_weight=kw, q_out=out)  # noqa: E731
    call()
    want = [out.clone()] + [c.clone() for c in caches]
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g):
        call()
    for t in [out, *caches]:
        t.zero_()
    g.replay()
    torch.cuda.synchronize()
    for got, w in zip([out, *caches], want):
        assert torch.equal(got, w)


def test_opcheck_and_compile_on_cuda():
    op = RoPEFwdOp(input_layout="2d")
    x = torch.randn(2, 9, 4, 64, device="cuda")
    k = torch.randn(2, 9, 1, 64, device="cuda")
    pos = torch.randint(0, 5000, (2, 9), device="cuda")
    torch.library.opcheck(torch.ops.tileops.apply.default, (op._handle, [x, pos, k], "x,position_ids,key"))
    torch.library.opcheck(torch.ops.tileops.apply.default, (op._handle, [x.requires_grad_(True), pos], "x,position_ids"))
    x = x.detach()

    def f(q, k, pos):
        qo, ko = op(q, position_ids=pos, key=k)
        return qo.float() * 2, ko

    for mode in (None, "reduce-overhead"):
        cf = torch.compile(f, fullgraph=True, dynamic=mode is None, mode=mode)
        for seq in (9, 17, 33):
            q = torch.randn(2, seq, 4, 64, device="cuda")
            kk = torch.randn(2, seq, 1, 64, device="cuda")
            p = torch.randint(0, 5000, (2, seq), device="cuda")
            for a, b in zip(cf(q, kk, p), f(q, kk, p)):
                assert torch.equal(a, b), mode


@pytest.mark.parametrize("name", ["RoPEFwdOp", "Phi3LongRoPEFwdOp-partial", "RoPEDynamicNTKFwdOp-partial",
                                  "AttnPrologueFwdOp"])
def test_first_call_inside_reduce_overhead(name):
    """An op first called inside ``torch.compile``'s CUDA graphs (mode ``"reduce-overhead"``, whose
    warm-up routes the thread's allocations into the graphs' pool) builds the tensors it keeps (cos/sin
    tables, Phi-3's stacked sets, dynamic NTK's state and tables) outside that pool: the next run
    refused ("tensor(s) in the cudagraph pool not tracked as outputs", found with a patched Qwen3 on
    the H200). Every replay equals an eager op's call on the same inputs."""
    from tests.test_attention_prologue import rope_variants
    from tileops.attention import AttnPrologueFwdOp

    ropes = [rope_variants(), rope_variants()]  # fresh ops: the compiled one's first call is in the graph
    prologue = name == "AttnPrologueFwdOp"
    ops = ([AttnPrologueFwdOp(4, 2, 64, r["RoPENeoxPositionIdsFwdOp"], qk_norm=True) for r in ropes] if prologue
           else [r[name] for r in ropes])
    caches = [[torch.full((4, 16, 2, 64), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(2)]
              for _ in ops]
    for kc, vc in caches:  # as transformers' StaticCache marks its tensors: graphs may write them in place
        torch._dynamo.mark_static_address(kc)
        torch._dynamo.mark_static_address(vc)
    w = torch.rand(2, 64, device="cuda", dtype=torch.bfloat16) + 0.5

    def call(i: int, x: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        if prologue:
            return ops[i](x, pos, *caches[i], slots, q_norm_weight=w[0], k_norm_weight=w[1]) * 1
        return ops[i](x, position_ids=pos) * 1

    compiled = torch.compile(lambda *a: call(0, *a), mode="reduce-overhead", fullgraph=True)
    limit = min(ops[0].params["rope"].position_limit() if prologue else ops[0].position_limit(), 1 << 16)
    for step in range(4):
        tokens = 24 if prologue else 96  # the standalone ops' layout is 1d: [tokens, head_dim]
        x = torch.randn(tokens, 8 * 64 if prologue else 64, device="cuda", dtype=torch.bfloat16)
        pos = torch.randint(0, limit, (tokens,), device="cuda")
        slots = torch.randperm(64, device="cuda")[:24]
        torch.compiler.cudagraph_mark_step_begin()
        got = compiled(x, pos, slots).clone()
        want = call(1, x, pos, slots)
        assert torch.equal(got, want), step
        if prologue:
            for a, b in zip(*caches):
                assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), step
    for op in ops:
        op.check()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_one_op_on_two_gpus_from_two_threads(on):
    op = on(RoPEFwdOp(input_layout="2d"))
    results = {}

    def run(dev: int) -> None:
        torch.cuda.set_device(dev)
        ok = True
        for i in range(20):
            x = torch.randn(2, 65, 8, 128, device=f"cuda:{dev}", dtype=torch.bfloat16)
            pos = torch.randint(0, 2**20, (2, 65), device=f"cuda:{dev}")
            out = op(x, position_ids=pos)
            assert out.device == x.device
            ref = reference("RoPEFwdOp", {"input_layout": "2d"}, {"x": x.cpu(), "position_ids": pos.cpu()})
            ok &= _close(out, ref, 1.6e-2)
        results[dev] = ok

    threads = [threading.Thread(target=run, args=(d,)) for d in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {0: True, 1: True}


def test_native_and_python_runtimes_agree_on_cuda_bit_for_bit():
    """The serving calls, out=, in place, a fused qkv buffer and a view 4 bytes off a 16-byte
    boundary (the plan refuses it, the Python path copies), three times each, both ways."""
    T, Hq, Hk, D = 32, 32, 8, 128
    g = torch.Generator(device="cuda").manual_seed(7)
    inputs = {"q": torch.randn(T, Hq, D, device="cuda", dtype=torch.bfloat16, generator=g),
              "k": torch.randn(T, Hk, D, device="cuda", dtype=torch.bfloat16, generator=g),
              "pos": torch.randint(0, 1 << 20, (T,), device="cuda", generator=g),
              "qh": torch.randn(1, Hq, T, D, device="cuda", generator=g),
              "kh": torch.randn(1, Hk, T, D, device="cuda", generator=g),
              "qkv": torch.randn(T, (Hq + 2 * Hk) * D, device="cuda", dtype=torch.float16, generator=g)}

    def scenario(on):
        ids = on(RoPENeoxPositionIdsFwdOp(1 << 20))
        hf = on(RoPEFwdOp(input_layout="2d"))
        got = []
        for _ in range(3):
            v = {n: t.clone() for n, t in inputs.items()}
            q, k = v["q"], v["k"]
            ids(q, v["pos"], key=k, out=q, key_out=k)
            got += [q, k, ids(v["q"], v["pos"])]
            got += list(hf(v["qh"].transpose(1, 2), position_ids=v["pos"][None], key=v["kh"].transpose(1, 2)))
            got.append(hf(v["qh"].transpose(1, 2)))
            flat = torch.full((1 + v["qh"].numel(),), float("nan"), device="cuda")
            odd = flat[1:].view(1, T, Hq, D)  # 4 bytes past a 16-byte boundary
            hf(v["qh"].transpose(1, 2), position_ids=v["pos"], out=odd)
            got.append(flat.clone())
            qkv = v["qkv"]
            qq, kk = qkv[:, : Hq * D].view(T, Hq, D), qkv[:, Hq * D : (Hq + Hk) * D].view(T, Hk, D)
            ids(qq, v["pos"], key=kk, out=qq, key_out=kk)
            got.append(qkv)
        ids.check()
        torch.cuda.synchronize()
        return [t.cpu() for t in got], [ids, hf]

    py, nat = both(scenario)
    same = [torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)) for a, b in zip(py, nat)]
    assert all(same) and len(py) == len(nat), same  # bytes: the NaN the odd view leaves in flat[0] is equal too
    ref = reference("RoPENeoxPositionIdsFwdOp", {"max_position": 1 << 20},
                    {"x": inputs["q"].cpu(), "position_ids": inputs["pos"].cpu()})
    assert _close(nat[0], ref, 1.6e-2)
    assert torch.isnan(nat[6][0]), "the fallback wrote outside out"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_launches_on_the_tensors_gpu_not_the_current_one(on):
    """Tensors on cuda:1 while cuda:0 is current: the launch switches device (and back), on the
    stream current on cuda:1; errors come back from there too."""
    torch.cuda.set_device(0)
    op = on(RoPEFwdOp(input_layout="2d"))
    for _ in range(3):
        x = torch.randn(2, 33, 4, 64, device="cuda:1")
        pos = torch.randint(0, 5000, (2, 33), device="cuda:1")
        out = op(x, position_ids=pos)
        assert out.device == x.device and torch.cuda.current_device() == 0
        ref = reference("RoPEFwdOp", {"input_layout": "2d"}, {"x": x.cpu(), "position_ids": pos.cpu()})
        assert _close(out, ref)
    pos[1, 2] = -1
    with pytest.raises(ValueError, match=r"position_ids\[1, 2\] = -1"):
        op(x, position_ids=pos)  # the Python runtime: at the call; the native one: at check()
        op.check()
    if on is not on_python:
        assert op._runtime.stats()["hits"] >= 2


@pytest.mark.parametrize("dtype, D", [(torch.bfloat16, 128), (torch.float32, 64)])
def test_long_head_major_views_take_their_kernel(on, dtype, D):
    """q and k of HF's [B, H, S, D] through transposes, long enough for the kernel made for
    head-major views (kernels/rope.py, ``transposed``): new outputs, NaN-filled given outputs and in
    place, with and without positions, each call repeated so the plan (Python or native) runs too;
    every result against the float64 reference, and the gradient through transposed views."""
    from tileops.rope.builtin import TRANSPOSED_MIN_TOKENS

    S = TRANSPOSED_MIN_TOKENS + 3
    op = on(RoPEFwdOp(input_layout="2d"))
    q = torch.randn(1, 4, S, D, device="cuda", dtype=dtype)
    k = torch.randn(1, 2, S, D, device="cuda", dtype=dtype)
    pos = torch.randint(0, 2**20, (1, S), device="cuda")
    tol = 2e-5 if dtype == torch.float32 else 1.6e-2
    for p in (None, pos):
        inputs = {} if p is None else {"position_ids": p.cpu()}
        want_q = reference("RoPEFwdOp", {"input_layout": "2d"}, {"x": q.transpose(1, 2).cpu(), **inputs})
        want_k = reference("RoPEFwdOp", {"input_layout": "2d"}, {"x": k.transpose(1, 2).cpu(), **inputs})
        for mode in ("new", "out", "in place"):
            for _ in range(3):
                qv, kv = q.clone().transpose(1, 2), k.clone().transpose(1, 2)
                kw = {} if p is None else {"position_ids": p}
                if mode == "out":
                    kw["out"] = torch.full_like(q, float("nan")).transpose(1, 2)
                    kw["key_out"] = torch.full_like(k, float("nan")).transpose(1, 2)
                elif mode == "in place":
                    kw["out"], kw["key_out"] = qv, kv
                got_q, got_k = op(qv, key=kv, **kw)
                if mode == "in place":
                    assert got_q is qv and got_k is kv
                assert _close(got_q, want_q, tol) and _close(got_k, want_k, tol), (mode, p is None)
    impl = next(iter(op._impls.values()))
    assert (False, True) in impl._kernels, "the head-major kernel did not serve these views"
    short = RoPEFwdOp(input_layout="2d")
    short(q[:, :, :32].transpose(1, 2), key=k[:, :, :32].transpose(1, 2))
    assert (False, True) not in next(iter(short._impls.values()))._kernels
    qg = q.clone().requires_grad_(True)
    out = op(qg.transpose(1, 2), position_ids=pos)
    g = torch.randn(1, 4, S, D, device="cuda", dtype=dtype)
    out.backward(g.transpose(1, 2))
    want = reference_grad("RoPEFwdOp", {"input_layout": "2d"},
                          {"x": q.transpose(1, 2).cpu(), "position_ids": pos.cpu()}, g.transpose(1, 2).cpu())
    assert _close(qg.grad.transpose(1, 2), want, tol)
