"""Schedules (``tileops.schedules``) and the tuner (``tileops.tuning``), on the CPU.

What a table chooses reaches the kernel specs; ``target=BUILTIN`` never takes a table; a table of
another device, a stale digest or a corrupt file is ignored with one warning; the tuner drops a
candidate whose result is wrong, and keeps the built-in schedule unless a candidate is faster.
"""

from __future__ import annotations

import itertools
import json
import math
import warnings
from pathlib import Path

import pytest
import torch

from tileops import schedules, tuning
from tileops.attention import AttnFwdOp, attn_builtin
from tileops.cli import main
from tileops.manifest import registry
from tileops.targets import BUILTIN

ATTN = registry()["AttnFwdOp"]


@pytest.fixture(autouse=True)
def own_tables(tmp_path, monkeypatch):
    """Every test reads and writes tables under its own folder: none of this machine's, none shipped."""
    monkeypatch.setattr(schedules, "tuned_path", lambda identity: tmp_path / "tuned" / "table.json")
    monkeypatch.setattr(schedules, "shipped_dir", lambda: tmp_path / "shipped")
    schedules.forget_tables()
    yield
    schedules.forget_tables()


def _qkv(gen, batch=1, seq=16, hq=4, hkv=2, d=64):
    return (torch.randn(batch, seq, hq, d, generator=gen), torch.randn(batch, seq, hkv, d, generator=gen),
            torch.randn(batch, seq, hkv, d, generator=gen))


def _class_of(op, q, k, v):
    op._check_call({"q": q, "k": k, "v": v, "cu_seqlens_q": None, "cu_seqlens_k": None})
    return op.schedule.shape_class


def _write(path, device, ops):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"format": schedules.FORMAT, "device": device, "ops": ops}))


def _entry(knobs, manifest=ATTN):
    flat = tuple((b, k, v) for b, kv in sorted(knobs.items()) for k, v in sorted(kv.items()))
    return {"knobs": knobs, "digest": schedules.digest_of(manifest, flat), "tuned": "2026-12-05 01:00 UTC"}


def test_candidates_are_the_product_the_rules_allow():
    space = ATTN.kernel.tune.spaces["cuda"]
    want = []
    for bm, bn, st, th, pl in itertools.product(*(v for _, _, v in space.knobs)):
        # a warpgroup (128 threads) takes 64 rows of block_M; pipeline 4's ping-pong needs two of them;
        # 192 rows take three (their score tile fits no fewer threads' registers)
        if bm % (th // 2) == 0 and (pl == 2 or (bm, th) == (128, 256)) and (bm != 192 or th == 384):
            want.append((("attention", "block_M", bm), ("attention", "block_N", bn), ("attention", "stages", st),
                         ("attention", "threads", th), ("attention", "pipeline", pl)))
    assert schedules.candidates(ATTN, "cuda") == want and len(want) == 40
    assert len(schedules.candidates(ATTN, "c")) == 3 ** 4
    assert schedules.candidates(registry()["RoPEFwdOp"], "c") == []


@pytest.mark.parametrize("seq,bucket", [(512, "tokens<=512"), (513, "tokens<=4096"), (40000, "tokens>32768")])
def test_shape_class_buckets_the_token_count(seq, bucket):
    q = torch.empty(1, seq, 4, 64)
    kv = torch.empty(1, 8, 2, 64)
    op = AttnFwdOp(4, 2, 64, causal=True)
    cls = _class_of(op, q, kv, kv)
    assert cls.endswith(f",{bucket},seq_k<=2048") and cls.startswith("causal=True,q=float32")


@pytest.mark.parametrize("batch,seq", [(16, 1024), (1, 16384)])
def test_one_token_bucket_is_split_by_the_keys_a_sequence_has(batch, seq):
    # both calls are 16,384 tokens; a sequence's keys (dim_buckets: {seq_k: [2048]}) tell them apart
    q = torch.empty(batch, seq, 4, 64)
    got = _class_of(AttnFwdOp(4, 2, 64, causal=True), q, q[:, :, :2], q[:, :, :2])
    assert got.endswith(",tokens<=32768," + ("seq_k<=2048" if seq <= 2048 else "seq_k>2048"))


def test_an_op_keeps_its_choice_per_class_not_per_token_bucket():
    """One op called on 4 x 1,024 then 1 x 4,096 (one token bucket, one CallSpec) takes each class's
    own choice: the op's cache of choices is keyed by the dim buckets too."""
    op = AttnFwdOp(4, 2, 64, causal=True)
    short, long = torch.empty(4, 1024, 4, 64), torch.empty(1, 4096, 4, 64)
    cls = _class_of(AttnFwdOp(4, 2, 64, causal=True), long, long[:, :, :2], long[:, :, :2])
    device = schedules.device_identity(torch.device("cpu"))
    _write(schedules.tuned_path(device), device,
           {"AttnFwdOp": {cls: _entry({"attention_bwd": {"dq_block_q": 32}})}})
    schedules.forget_tables()
    got = [(_class_of(op, x, x[:, :, :2], x[:, :, :2]), op.schedule.knobs) for x in (short, long, short)]
    assert [c.rsplit(",", 1)[1] for c, _ in got] == ["seq_k<=2048", "seq_k>2048", "seq_k<=2048"]
    assert [k for _, k in got] == [(), (("attention_bwd", "dq_block_q", 32),), ()]


def test_a_varlen_call_buckets_its_total_tokens():
    op = AttnFwdOp(4, 2, 64)
    q, kv = torch.empty(600, 4, 64), torch.empty(30, 2, 64)
    cu = torch.tensor([0, 600], dtype=torch.int32)
    op._check_call({"q": q, "k": kv, "v": kv, "cu_seqlens_q": cu, "cu_seqlens_k": torch.tensor([0, 30],
                                                                                             dtype=torch.int32)})
    # (no seq_k: a varlen call's sequences are on the device, and the class is made before any sync)
    assert op.schedule.shape_class.endswith(",tokens<=4096")


def test_a_tuned_choice_reaches_the_kernel_specs_and_builtin_ignores_it(gen, tmp_path):
    q, k, v = _qkv(gen)
    cls = _class_of(AttnFwdOp(4, 2, 64), q, k, v)
    device = schedules.device_identity(torch.device("cpu"))
    _write(tmp_path / "tuned" / "table.json", device,
           {"AttnFwdOp": {cls: _entry({"attention_bwd": {"dq_block_q": 32, "dkdv_block_kv": 64}})}})
    op = AttnFwdOp(4, 2, 64)
    call = op._check_call({"q": q, "k": k, "v": v, "cu_seqlens_q": None, "cu_seqlens_k": None})
    assert op.schedule.source == "tuned on this machine at 2026-12-05 01:00 UTC"
    assert call.schedule == (("attention_bwd", "dkdv_block_kv", 64), ("attention_bwd", "dq_block_q", 32))
    specs = {s.kind: s for b, s in attn_builtin.kernel_specs(ATTN, op.params, call, "c") if b == "attention_bwd"}
    assert (specs["dkdv"].dkdv_block_kv, specs["dq"].dq_block_q) == (64, 32)
    assert specs["dq"].dkdv_block_kv == 0 and specs["dkdv"].dq_block_q == 0  # each program its own knobs
    fixed = AttnFwdOp(4, 2, 64, target=BUILTIN)
    call = fixed._check_call({"q": q, "k": k, "v": v, "cu_seqlens_q": None, "cu_seqlens_k": None})
    assert call.schedule == () and fixed.schedule.source == "built-in"


def test_a_shipped_table_serves_when_none_is_tuned(gen, tmp_path):
    q, k, v = _qkv(gen)
    cls = _class_of(AttnFwdOp(4, 2, 64), q, k, v)
    device = schedules.device_identity(torch.device("cpu"))
    _write(tmp_path / "shipped" / f"{schedules.device_slug(device)}.json", {**device, "driver": "other"},
           {"AttnFwdOp": {cls: _entry({"attention_bwd": {"dq_block_kv": 32}})}})
    op = AttnFwdOp(4, 2, 64)
    op(q, k, v)
    assert op.schedule.source == f"shipped for {device['name']}"
    assert op.schedule.knobs == (("attention_bwd", "dq_block_kv", 32),)


@pytest.mark.parametrize("spoil", ["another device", "stale", "corrupt", "bad knob"])
def test_a_table_that_cannot_be_trusted_is_ignored_with_one_warning(gen, tmp_path, spoil):
    q, k, v = _qkv(gen)
    cls = _class_of(AttnFwdOp(4, 2, 64), q, k, v)
    device = schedules.device_identity(torch.device("cpu"))
    entry = _entry({"attention_bwd": {"dq_block_q": 32}})
    path = tmp_path / "tuned" / "table.json"
    if spoil == "another device":
        _write(path, {**device, "name": "some other CPU"}, {"AttnFwdOp": {cls: entry}})
    elif spoil == "stale":
        _write(path, device, {"AttnFwdOp": {cls: {**entry, "digest": "0" * 16}}})
    elif spoil == "bad knob":
        _write(path, device, {"AttnFwdOp": {cls: {**entry, "knobs": {"attention_bwd": {"dq_block_q": 4096}}}}})
    else:
        path.parent.mkdir(parents=True)
        path.write_text('{"format": 1, "device": ')
    want = {"another device": "another device", "stale": "stale", "corrupt": "corrupt",
            "bad knob": "corrupt"}[spoil]
    with pytest.warns(RuntimeWarning, match=f"ignoring schedule table .*: {want}"):
        first = AttnFwdOp(4, 2, 64)
        _class_of(first, q, k, v)
    assert first.schedule.source == "built-in" and first.schedule.knobs == ()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second lookup warns no more
        second = AttnFwdOp(4, 2, 64)
        _class_of(second, q, k, v)
    assert second.schedule.knobs == ()


def test_record_keeps_one_entry_per_class_and_replaces_another_devices_table(tmp_path):
    path = tmp_path / "t.json"
    _write(path, {"kind": "cpu", "name": "elsewhere", "arch": "x", "cores": 1}, {"AttnFwdOp": {"a": {}}})
    cpu = torch.device("cpu")
    schedules.record(ATTN, cpu, "c1", (("attention_bwd", "dq_block_q", 32),), {"us": 1.0}, path=path)
    schedules.record(ATTN, cpu, "c2", (), {"us": 2.0}, path=path)
    table = json.loads(path.read_text())
    assert table["device"] == schedules.device_identity(cpu)
    assert sorted(table["ops"]["AttnFwdOp"]) == ["c1", "c2"]
    assert table["ops"]["AttnFwdOp"]["c1"]["knobs"] == {"attention_bwd": {"dq_block_q": 32}}
    assert table["ops"]["AttnFwdOp"]["c2"]["knobs"] == {}


def test_the_tuner_drops_a_wrong_candidate_and_keeps_the_builtin_unless_beaten(gen, monkeypatch):
    """Two candidates: one whose output is spoiled (as a schedule that computes wrong would be) and one
    that is right. The wrong one is dropped before it is timed; the right one is kept only if it beats
    the built-in schedule by the margin, which the timings are made to decide here."""
    q, k, v = _qkv(gen, seq=8)
    wrong = (("attention_bwd", "dq_block_kv", 16),)
    right = (("attention_bwd", "dkdv_block_q", 16),)
    monkeypatch.setattr(schedules, "candidates", lambda m, backend: [wrong, right])
    real_run = tuning._Call.run

    def run(self, op, inputs=None, timed=False):
        out, grads = real_run(self, op, inputs, timed)
        if op._forced_schedule == wrong:
            out = out + 1.0
        return out, grads

    monkeypatch.setattr(tuning._Call, "run", run)
    times = {(): 1.0, right: 0.5}
    monkeypatch.setattr(tuning, "_trial", _timed(tuning._trial, times))
    confirmed = []
    monkeypatch.setattr(tuning, "_confirm", lambda op, knobs, calls, reps: confirmed.append(knobs) or (
        times[knobs], times[()]))
    op = AttnFwdOp(4, 2, 64)
    result = tuning.tune_calls(op, [{"q": q, "k": k, "v": v}], progress=False)
    assert [t.knobs for t in result.dropped] == [wrong]
    assert result.dropped[0].dropped.startswith("wrong: output off at")
    assert result.chosen.knobs == right and result.chosen.source.startswith("tuned on this machine")
    assert confirmed == [right]  # timed again against the built-in schedule before it was kept
    # the rerun's figures are kept beside the search's, which stay as measured (the best is still the best)
    assert result.confirmed == (right, 0.5, 1.0) and result.best.knobs == right
    times[right] = 0.99  # within the margin of the built-in: the built-in schedule is kept
    result = tuning.tune_calls(op, [{"q": q, "k": k, "v": v}], progress=False)
    assert result.chosen.knobs == () and result.chosen.source.startswith("tuned on this machine")


def _timed(real, times):
    """``tuning._trial`` with its measured time replaced by ``times[knobs]`` (a check still runs)."""
    def trial(op, knobs, calls, reps):
        t = real(op, knobs, calls, 1)
        if t.seconds is not None:
            t.seconds = times[knobs]
        return t
    return trial


@pytest.mark.parametrize("size", [6, tuning.EXHAUSTIVE + 1])
def test_the_search_builds_each_batch_of_points_before_it_times_them(size):
    """A small space is built whole before its first trial; a larger one knob by knob, each knob's
    values (the others held at the best so far) built before they are timed. Every point timed was
    built first, and no point is timed twice."""
    space = [(("k", "a", a), ("k", "b", b)) for a in range(size) for b in range(2)]
    events = []
    ran = tuning._search(space, lambda point: events.append(("run", point)) or tuning.Trial(point, 1.0),
                         math.inf, lambda batch: events.append(("build", tuple(batch))))
    built = set()
    for what, x in events:
        if what == "build":
            assert not built & set(x), "a point built twice"
            built |= set(x)
        else:
            assert x in built, f"{x} timed before it was built"
    timed = [x for what, x in events if what == "run"]
    assert len(timed) == len(set(timed)) == len(ran)
    if size <= tuning.EXHAUSTIVE:
        assert events[0] == ("build", tuple(space)) and set(timed) == set(space)
    else:
        assert sum(what == "build" for what, _ in events) > 1 and len(timed) < len(space)


def test_a_budget_spent_before_any_candidate_keeps_nothing(gen):
    """The built-in schedule is timed first; a budget that ends there tries no candidate, so the class
    keeps no entry (one would read "tuned on this machine" of a search that never ran: the H200's
    ``tileops tune AttnFwdOp --budget 360`` wrote three such entries, 0 of 24 candidates tried).
    A nanosecond of budget is spent by the time the built-in schedule has run."""
    q, k, v = _qkv(gen, seq=8)
    result = tuning.tune_calls(AttnFwdOp(4, 2, 64), [{"q": q, "k": k, "v": v}], budget=1e-9, progress=False)
    assert result.trials == [] and result.chosen.knobs == ()
    assert result.chosen.source == "not kept: the budget ended before any candidate was tried"
    assert not schedules.tuned_path({}).exists()


def test_the_tune_command_skips_the_classes_a_spent_budget_leaves(capsys, monkeypatch):
    """Past its ``--budget`` the command tunes no further class, and says which it left (the budget,
    a nanosecond, is spent making the cases' inputs)."""
    def tune_calls(op, calls, **kw):
        raise AssertionError(f"a spent budget tuned {kw['label']}")

    monkeypatch.setattr(tuning, "tune_calls", tune_calls)
    assert main(["tune", "AttnFwdOp", "--device", "cpu", "--budget", "1e-9", "--cases", "gqa-2k"]) == 0
    out, err = capsys.readouterr()
    for label in ("gqa-2k-bf16", "gqa-2k-fp16"):
        assert f"tileops tune: AttnFwdOp {label}: not tuned, the budget (1e-09 s) is spent" in err
    assert "AttnFwdOp: 0 of 2 shape classes tuned in" in out


def test_tune_refuses_an_op_with_no_space_for_the_backend():
    from tileops.rope import RoPEFwdOp

    with pytest.raises(ValueError, match="RoPEFwdOp.tune: the manifest declares no schedule space for the c backend"):
        RoPEFwdOp().tune(torch.zeros(4, 8))


def test_show_prints_the_spaces_and_each_cases_schedule(capsys):
    assert main(["show", "AttnFwdOp", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "schedule spaces (kernel.tune):" in out
    assert "c: attention_bwd.dkdv_block_kv in [16, 32, 64]" in out and "(81 candidates)" in out
    assert "cuda: attention.block_M in [64, 128, 192]" in out and "(40 candidates)" in out
    assert "gqa-2k-bfloat16" in out and "(built-in; class causal=False,q=bfloat16" in out


def test_tune_refuses_a_budget_that_is_not_positive(gen):
    q, k, v = _qkv(gen, seq=8)
    with pytest.raises(ValueError, match=r"AttnFwdOp.tune: budget: expected seconds > 0 \(or None for the whole "
                                         r"space\), got 0"):
        AttnFwdOp(4, 2, 64).tune(q, k, v, budget=0)


@pytest.mark.parametrize("argv,message", [
    (["--budget", "-1"], "--budget: expected seconds > 0, got -1.0"),
    (["--cases", "gqa-2k", "no-such-case"], "--cases: 'no-such-case' is no case of AttnFwdOp; cases: gemma-window"),
])
def test_tune_command_refuses_bad_flags_before_tuning(capsys, argv, message):
    assert main(["tune", "AttnFwdOp", "--device", "cpu", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_norm_class_is_bucketed_by_its_rows():
    """``rows`` in ``kernel.tune.tokens``: the product of x's leading dims, however they are shaped."""
    from tileops.norm import RMSNormFwdOp

    edge = registry()["RMSNormFwdOp"].kernel.tune.buckets[0]
    op = RMSNormFwdOp()

    def cls(*lead):
        op._check_call({"x": torch.zeros(*lead, 64), "weight": torch.zeros(64), "residual": None})
        return op.schedule.shape_class

    assert cls(edge).endswith(f"tokens<={edge}")
    assert cls(1, edge).endswith(f"tokens<={edge}")  # [1, edge, hidden]: edge rows still
    nxt = registry()["RMSNormFwdOp"].kernel.tune.buckets[1]
    assert cls(edge + 1).endswith(f"tokens<={nxt}")
    assert cls(edge // 2, 2, 2).endswith(f"tokens<={nxt}")  # 2 * edge rows over three leading dims


def test_warmup_builds_the_shipped_choices_for_their_kernels_only(tmp_path):
    """``tileops warmup`` and the lowered kernels take :func:`schedules.shipped_for`: a shipped entry's
    kernels are built for the cases whose kernels its class keys (params, dtypes, specialized dims), in
    any token bucket, and for no other case."""
    from tileops.compile.warmup import kernel_jobs
    from tileops.manifest import call_specs, case_dims, case_params

    m = registry()["RMSNormFwdOp"]
    case = next(c for c in m.cases if c.label == "llama-8k")
    params = {**m.defaults(), **case_params(m, case)}
    call = call_specs(m, case_dims(m, case), ["bfloat16"], torch.device("cuda"), case.with_inputs, False, params)[0]
    dims = {**case_dims(m, case), "rows": 4096}
    cls = schedules.shape_class(m, call, dims, params)
    chosen = {"norm": {"vectors_per_thread": 8}}
    _write(tmp_path / "shipped" / "h200.json", {"kind": "cuda", "name": "NVIDIA H200", "arch": "sm_90", "sms": 132,
                                                "driver": "1"}, {"RMSNormFwdOp": {cls: _entry(chosen, m)}})
    schedules.forget_tables()
    plain = kernel_jobs(["RMSNormFwdOp"], "sm_90")
    warm = kernel_jobs(["RMSNormFwdOp"], "sm_90", schedules.shipped_for("sm_90"))
    added = [j for j in warm if j not in plain]
    # the forward, backward and weight-sum kernels of that class (the wsum's own dtype is fp32)
    assert sorted(j[1].kind for j in added) == ["bwd", "fwd", "wsum"]
    assert all(j[1].vectors_per_thread == 8 and j[1].hidden == 8192 for j in added)
    assert next(j for j in added if j[1].kind == "fwd")[1].dtype == "bfloat16"
    assert not [j for j in plain if j[1].vectors_per_thread == 8]
    # another arch's warm-up takes nothing of an sm_90 table
    assert kernel_jobs(["RMSNormFwdOp"], "sm_80", schedules.shipped_for("sm_80")) == kernel_jobs(["RMSNormFwdOp"],
                                                                                                 "sm_80")


def test_warmup_builds_a_shipped_choice_whose_bucket_no_case_reaches(tmp_path):
    """An entry for attention's 16 x 1,024 causal class (16,384 tokens: no manifest case has so many) is
    still built for the cases of its kernels (causal, bf16, head_dim 128, GQA 32/8), so that a fresh
    process that takes it has it lowered rather than compiled at its first call; a non-causal case's
    kernels are not."""
    from tileops.compile.warmup import kernel_jobs

    op = AttnFwdOp(32, 8, 128, causal=True)
    q = torch.empty(16, 1024, 32, 128, dtype=torch.bfloat16)
    cls = _class_of(op, q, q[:, :, :8], q[:, :, :8])
    assert cls.endswith(",tokens<=32768,seq_k<=2048")
    chosen = {"attention": {"block_M": 64, "block_N": 176, "stages": 1, "threads": 128, "pipeline": 2}}
    _write(tmp_path / "shipped" / "h200.json", {"kind": "cuda", "name": "NVIDIA H200", "arch": "sm_90", "sms": 132,
                                                "driver": "1"}, {"AttnFwdOp": {cls: _entry(chosen, ATTN)}})
    schedules.forget_tables()
    plain = kernel_jobs(["AttnFwdOp"], "sm_90")
    added = [j for j in kernel_jobs(["AttnFwdOp"], "sm_90", schedules.shipped_for("sm_90")) if j not in plain]
    fwd = [j[1] for j in added if j[0] == "attention"]
    assert fwd and all((s.block_M, s.block_N, s.threads, s.causal, s.dtype, s.head_dim) == (64, 176, 128, True,
                                                                                            "bfloat16", 128)
                       for s in fwd)


def test_rope_reference_gradients_are_the_rotation_by_the_negated_angle(gen):
    """What the tuner checks a RoPE candidate's backward against: float64 autograd of the rotation,
    here against the op's own backward (fp32, on the CPU) and against the rotation's inverse."""
    from tileops.rope import RoPEFwdOp
    from tileops.rope import reference as ref

    op = RoPEFwdOp(input_layout="2d")
    x, key = torch.randn(2, 9, 3, 64, generator=gen), torch.randn(2, 9, 1, 64, generator=gen)
    g = torch.randn(2, 9, 3, 64, generator=gen)
    got = ref.grads(op, {"x": x, "key": key}, g)
    leaf = x.clone().requires_grad_(True)
    (want,) = torch.autograd.grad(op(leaf), leaf, g)
    torch.testing.assert_close(got["x"].float(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got["key"], torch.zeros(key.shape, dtype=torch.float64))
    # R(theta)^T R(theta) x = x: the gradient of a rotated x with respect to x, fed the rotation, is x
    back = ref.grads(op, {"x": x}, ref.reference(op, {"x": x}))["x"]
    torch.testing.assert_close(back, x.double(), atol=1e-12, rtol=1e-12)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_call_is_timed_over_copies_that_pass_the_l2():
    """On CUDA a candidate is timed with events over copies of its inputs that move at least three
    times the L2 cache (or the most copies allowed), the call's own inputs first."""
    from tileops.rope import RoPEFwdOp

    op = RoPEFwdOp(input_layout="2d", target=BUILTIN)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, 256, 8, 128, generator=gen).to(torch.bfloat16).cuda()
    call = tuning._Call(op, {"x": x}, backward=False, seed=1)
    sets = call.rotation()
    assert sets[0]["x"] is x and all(s["x"].data_ptr() != x.data_ptr() and torch.equal(s["x"], x) for s in sets[1:])
    l2 = torch.cuda.get_device_properties(x.device).L2_cache_size
    assert len(sets) == tuning.MAX_SETS or len(sets) * x.numel() * x.element_size() >= tuning.L2_PASSES * l2
    assert tuning._gpu_seconds(op, call, reps=3) > 0


def test_a_candidate_that_writes_a_cache_wrong_or_not_at_all_is_caught():
    """The prologue's output is q; its k and v go into the caches, which the float64 reference does not
    give: a candidate's writes are held to the built-in schedule's, each checked run starting from the
    caches as given."""
    from tileops.workloads import op_class, workload

    m = registry()["AttnPrologueFwdOp"]
    case = next(c for c in m.cases if c.label == "llama-decode-hnd")
    w = workload(m, case, "float32", "cpu", shrink=True, generator=torch.Generator().manual_seed(11))
    op = op_class(m.name)(**w.params, target=BUILTIN)
    call = tuning._Call(op, w.inputs, backward=False, seed=1)
    assert call.written == ["key_cache", "value_cache"]
    call.keep_writes(op)
    out, _, writes = call.checked_run(op)
    assert call.check_writes(writes) is None and call.check(out, ()) is None
    assert "key_cache written off" in call.check_writes({**writes, "key_cache": call._given["key_cache"]})
    spoiled = writes["value_cache"].clone()
    spoiled.view(-1)[spoiled.numel() // 2] += 1.0
    assert "value_cache written off" in call.check_writes({**writes, "value_cache": spoiled})


def test_the_schedules_runner_refuses_an_unknown_dtype_before_any_gpu_work(capsys):
    """``python -m benchmarks --schedules --dtypes``: a dtype that is none of the manifests' spellings,
    or ``--dtypes`` without ``--schedules``, is refused by name (exit 2), on a machine without a GPU too."""
    from benchmarks import runner

    for argv, said in ((["--schedules", "--dtypes", "fp8"], "got 'fp8'"),
                       (["--dtypes", "all"], "expected with --schedules")):
        with pytest.raises(SystemExit) as e:
            runner.main(argv)
        assert e.value.code == 2
        assert said in capsys.readouterr().err


def test_every_shipped_entry_is_current():
    """Each entry of each table shipped in the package was tuned for (or, with a ``restamped`` reason, stands
    for) its builders' sources as they are: an edit to a builder makes its entries stale, and a stale entry
    is ignored at construction (one warning), so the device falls back to the built-in schedule without a
    failing test. Tune again on that device, or, for an edit that cannot move the timing, restamp the entry
    and say why."""
    import tileops.kernels
    from tileops import manifest

    # (the package's folder itself: this module's fixture points shipped_dir() at a temporary one)
    tables = sorted(Path(tileops.kernels.__path__[0], "schedules").glob("*.json"))
    assert tables
    for path in tables:
        table = json.loads(path.read_text())
        for op, classes in table["ops"].items():
            m = manifest.get(op)
            for cls, entry in classes.items():
                knobs = schedules._valid_knobs(entry["knobs"])
                assert knobs is not None, (path.name, op, cls)
                assert entry["digest"] == schedules.digest_of(m, knobs), (
                    f"{path.name}: {op} {cls} is stale: tune it again, or restamp it with the reason")
