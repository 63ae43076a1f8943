"""Schedules (``tileops.schedules``) and the tuner (``tileops.tuning``), on the CPU.

What a table chooses reaches the kernel specs; ``target=BUILTIN`` never takes a table; a table of
another device, a stale digest or a corrupt file is ignored with one warning; the tuner drops a
candidate whose result is wrong, and keeps the built-in schedule unless a candidate is faster.
"""

from __future__ import annotations

import itertools
import json
import warnings

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
    for bm, bn, st, th in itertools.product(*(v for _, _, v in space.knobs)):
        if bm % (th // 2) == 0:  # a warpgroup (128 threads) takes 64 rows of block_M
            want.append((("attention", "block_M", bm), ("attention", "block_N", bn), ("attention", "stages", st),
                         ("attention", "threads", th)))
    assert schedules.candidates(ATTN, "cuda") == want
    assert len(schedules.candidates(ATTN, "c")) == 3 ** 4
    assert schedules.candidates(registry()["RoPEFwdOp"], "c") == []


@pytest.mark.parametrize("seq,bucket", [(512, "tokens<=512"), (513, "tokens<=4096"), (40000, "tokens>32768")])
def test_shape_class_buckets_the_token_count(seq, bucket):
    q = torch.empty(1, seq, 4, 64)
    kv = torch.empty(1, 8, 2, 64)
    op = AttnFwdOp(4, 2, 64, causal=True)
    cls = _class_of(op, q, kv, kv)
    assert cls.endswith("," + bucket) and cls.startswith("causal=True,q=float32")


def test_a_varlen_call_buckets_its_total_tokens():
    op = AttnFwdOp(4, 2, 64)
    q, kv = torch.empty(600, 4, 64), torch.empty(30, 2, 64)
    cu = torch.tensor([0, 600], dtype=torch.int32)
    op._check_call({"q": q, "k": kv, "v": kv, "cu_seqlens_q": cu, "cu_seqlens_k": torch.tensor([0, 30],
                                                                                             dtype=torch.int32)})
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

    def run(self, op):
        out, grads = real_run(self, op)
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


def test_tune_refuses_an_op_with_no_space_for_the_backend():
    from tileops.rope import RoPEFwdOp

    with pytest.raises(ValueError, match="RoPEFwdOp.tune: the manifest declares no schedule space for the c backend"):
        RoPEFwdOp().tune(torch.zeros(4, 8))


def test_show_prints_the_spaces_and_each_cases_schedule(capsys):
    assert main(["show", "AttnFwdOp", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "schedule spaces (kernel.tune):" in out
    assert "c: attention_bwd.dkdv_block_kv in [16, 32, 64]" in out and "(81 candidates)" in out
    assert "cuda: attention.block_M in [64, 128]" in out and "(18 candidates)" in out
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
