"""The benchmark runner's own logic, on the CPU (its timings need a GPU; what it times does not)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tileops.manifest import registry
from tileops.workloads import op_class

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ sits beside tests/, not installed
from benchmarks import plots, runner  # noqa: E402
from benchmarks.baselines import make_baseline  # noqa: E402


def _backward_grads(monkeypatch, name: str, params: dict, inputs: dict) -> list[list[torch.Tensor]]:
    """The gradients each contender's backward timer computes (ours, eager, torch.compile), with the
    GPU timer replaced by one call and torch.compile by the function itself (the host and graph
    timers of a decode-size row make their one call too)."""
    got: list[list[torch.Tensor]] = []

    def one_call(fn, n):
        got.append(list(fn(0)))
        return (1.0, 1.0, 1.0)

    def once(fn, *args, **kwargs):  # the host and graph timers of a decode-size row: one call each
        fn()
        return 1.0

    monkeypatch.setattr(runner, "gpu_time", one_call)
    monkeypatch.setattr(runner, "host_time_us", once)
    monkeypatch.setattr(runner, "graph_us_per_call", once)
    monkeypatch.setattr(runner, "fresh_compile", lambda f: f)
    m = registry()[name]
    op = op_class(name)(**params)
    fn, args = make_baseline(op, inputs)
    runner._backward_row(m, m.cases[0], "float32", op, [inputs], fn, [runner._bind(args, inputs)], 1.0, 1)
    return got


def test_a_qk_backward_row_differentiates_x_and_key_for_every_contender(monkeypatch, gen):
    # the timer once took x's gradient through q's output alone: torch.compile then rotated q's
    # gradient only while ours also rotated the key's, and the row compared unequal work
    x, key = torch.randn(1, 24, 4, 32, generator=gen), torch.randn(1, 24, 2, 32, generator=gen)
    pos = torch.randint(0, 40, (3, 1, 24), generator=gen)
    got = _backward_grads(monkeypatch, "MRoPEFwdOp", {"mrope_section": (4, 6, 6)},
                          {"x": x, "position_ids": pos, "key": key})
    assert len(got) == 3  # ours, eager, torch.compile
    for grads in got:
        assert [tuple(t.shape) for t in grads] == [tuple(x.shape), tuple(key.shape)]
        assert all(bool(torch.isfinite(t).all()) and bool(t.abs().sum() > 0) for t in grads)


def test_a_backward_row_without_a_key_differentiates_x_alone(monkeypatch):
    x = torch.randn(2, 16, 3, 32)
    got = _backward_grads(monkeypatch, "RoPEFwdOp", {"input_layout": "2d"}, {"x": x})
    assert len(got) == 3 and all([tuple(t.shape) for t in grads] == [tuple(x.shape)] for grads in got)


# ------------------------------------------------------------------ the figures and the summary
RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
PAGE_PX = (700, 1200)  # the docs page's content column is about 800 px; wider is shrunk, narrower wastes it


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def _committed() -> dict:
    return json.loads((RESULTS / "latest.json").read_text(encoding="utf-8"))


def test_one_figure_per_family_and_direction_of_the_committed_results_sized_for_the_page(tmp_path):
    pytest.importorskip("matplotlib")
    result = _committed()
    written = plots.write(result, tmp_path)
    figures = [p for p in written if p.suffix == ".png"]
    # the committed run has RoPE's forward and backward rows (the first runs had no family or
    # direction field) and the norm family's, spliced in later
    assert sorted(p.name for p in figures) == sorted(f"latest-{f}-{d}.png" for f in ("rope", "norm")
                                                     for d in ("forward", "backward"))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in written)
    per_figure: dict[str, int] = {}
    for r in result["rows"]:
        key = f"{r.get('family', 'rope')}-{'backward' if r['case'].endswith(' (backward)') else 'forward'}"
        per_figure[key] = per_figure.get(key, 0) + 1
    for p in figures:
        width, height = _png_size(p)
        assert PAGE_PX[0] <= width <= PAGE_PX[1], (p.name, width)
        rows = per_figure[p.stem.split("-", 1)[1]]
        assert height >= 50 * rows, (p.name, height, rows)  # a bar group of four per row, labels legible


def test_figures_follow_the_families_and_directions_a_result_holds(tmp_path):
    pytest.importorskip("matplotlib")
    row = {"dtype": "float16", "bytes": 8 << 20, "copy_us": 5.0, "ours_us": [4.0, 3.9, 4.1],
           "eager_us": [40.0] * 3, "compile_us": [float("nan")] * 3, "liger_us": None}
    rows = [dict(row, op="ScaleFwdOp", family="scale", direction="forward", case="s-1k"),
            dict(row, op="RoPEFwdOp", family="rope", direction="forward", case="r-1k"),
            dict(row, op="RoPEFwdOp", family="rope", direction="backward", case="r-1k (backward)"),
            dict(row, op="ScaleFwdOp", family="scale", direction="forward", case="s-2k")]
    written = plots.write({"meta": {"gpu": "test GPU"}, "rows": rows}, tmp_path)
    assert [p.name for p in written] == ["latest-scale-forward.png", "latest-rope-forward.png",
                                         "latest-rope-backward.png", "summary.md"]
    summary = (tmp_path / "summary.md").read_text(encoding="utf-8")
    # torch.compile failed (NaN) and Liger has no such op: no ratio for either, not a NaN
    assert "| `ScaleFwdOp` | 2 | - | - | - | - | 125 | - |" in summary, summary
    assert "nan" not in summary.lower()


def test_the_summary_table_names_its_columns_and_spans_each_ops_cases():
    result = _committed()
    text = plots.summary_markdown(result, ["latest-rope-forward.png"])
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("| op |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert columns == ["op", "cases", "x torch.compile, forward", "x torch.compile, backward", "x Liger, forward",
                       "x Liger, backward", "% same-bytes copy, forward", "% same-bytes copy, backward"]
    assert "![latest-rope-forward](latest-rope-forward.png)" in lines
    # RoPEFwdOp's forward cells, recomputed from the JSON's medians
    fwd = [r for r in result["rows"] if r["op"] == "RoPEFwdOp" and not r["case"].endswith("(backward)")]
    compile_x = [r["compile_us"][0] / r["ours_us"][0] for r in fwd]
    liger_x = [r["liger_us"][0] / r["ours_us"][0] for r in fwd if r["liger_us"]]
    pct = [100 * r["copy_us"] / r["ours_us"][0] for r in fwd]
    ours = next(line for line in lines if line.startswith("| `RoPEFwdOp` |"))
    cells = [c.strip() for c in ours.strip("|").split("|")]
    assert cells[1] == str(len(fwd))
    assert cells[2] == f"{min(compile_x):.2f}-{max(compile_x):.2f}"
    assert cells[4] == f"{min(liger_x):.2f}-{max(liger_x):.2f}"
    assert cells[6] == f"{min(pct):.0f}-{max(pct):.0f}"


def test_the_committed_summary_and_figures_are_those_of_the_committed_json(tmp_path):
    # a run that updated latest.json but not what the docs page shows would go unnoticed
    result = _committed()
    names = [plots.figure_name(f, d) for f, d in plots.groups(result)]
    assert (RESULTS / "summary.md").read_text(encoding="utf-8") == plots.summary_markdown(result, names)
    for name in names:
        assert (RESULTS / name).is_file(), name


def test_splice_replaces_one_ops_rows_in_place_and_says_so():
    base = json.loads((Path(runner.HERE) / "results" / "latest.json").read_text())
    op = base["rows"][len(base["rows"]) // 2]["op"]
    first = next(i for i, r in enumerate(base["rows"]) if r["op"] == op)
    new_rows = [dict(r, ours_us=[1.0, 1.0, 1.0]) for r in base["rows"] if r["op"] == op][:1]
    new = {"meta": dict(base["meta"], commit="abc1234", date="2030-01-02T00:00:00+00:00"), "rows": new_rows}
    got = runner.splice(base, new)
    assert [r for r in got["rows"] if r["op"] == op] == new_rows
    assert got["rows"][first] == new_rows[0]  # where the op's first row stood
    assert [r for r in got["rows"] if r["op"] != op] == [r for r in base["rows"] if r["op"] != op]
    assert got["meta"]["commit"] == base["meta"]["commit"] and got["meta"]["updated"][-1]["commit"] == "abc1234"
    assert f"Rows of {op} re-measured later: commit abc1234" in runner.markdown(got)
    assert f"{op}: re-measured at commit abc1234" in plots.summary_markdown(got, [])
    again = runner.splice(got, new)  # a second splice of the same op replaces the record, not adds one
    assert [u["commit"] for u in again["meta"]["updated"]].count("abc1234") == 1


@pytest.mark.parametrize("model", ["llama", "qwen3"])
def test_the_hf_benchmark_builds_its_variants_and_reports_each(model):
    """benchmarks.hf_generate's models (the --quick size; the timings need a GPU): the same weights,
    unpatched, RoPE alone, RoPE with the norms (2 x layers + 1; Qwen3's q_norm/k_norm: 2 x layers
    more) and, for Qwen3, the fused prologue; every row's table line names the variants' times and
    ratios."""
    pytest.importorskip("transformers")
    from benchmarks import hf_generate
    from tileops.integrations import transformers as tt

    size = hf_generate.sizes(model, quick=True)
    spec = hf_generate.MODELS[model]
    models = hf_generate.build_models(model, size, torch.device("cpu"), torch.float32)
    assert list(models) == list(spec.variants) == ["unpatched", "rope", "rope+norm"] + ["prologue"] * (model == "qwen3")
    norm = {"llama": {"LlamaRMSNorm": 2 * size["layers"] + 1}, "qwen3": {"Qwen3RMSNorm": 4 * size["layers"] + 1}}
    try:
        assert not tt.is_patched(models["unpatched"])
        reports = {k: tt.report(models[k]) for k in spec.variants[1:]}
        assert reports["rope"]["rope"] is not None and reports["rope"]["norm"] == {}
        assert reports["rope+norm"]["norm"] == norm[model] and reports["rope+norm"]["prologue"] == []
        if model == "qwen3":  # one op serves every layer (the same q/k norm eps)
            assert reports["prologue"]["norm"] == norm[model] and len(reports["prologue"]["prologue"]) == 1
        w = [m.model.layers[0].self_attn.q_proj.weight for m in models.values()]
        assert all(torch.equal(w[0], x) for x in w[1:])
    finally:
        for m in models.values():
            if tt.is_patched(m):
                tt.unpatch(m)
    times = {k: {"ms": ms, "min_ms": ms, "max_ms": ms, "cpu_ms": 2 * ms, "graphs_compiled": 2,
                 "runs_ms": [4.0, 1.0] if k == "unpatched" else [ms, ms]}
             for k, ms in zip(spec.variants, (4.0, 2.0, 1.0, 0.5))}
    info = {"model": model, "size": size, "dtype": "fp32", "device": "CPU", "torch": "t", "transformers": "t",
            "reps": 1, "warmup": 0}
    md = hf_generate.markdown([{"setup": "s", **hf_generate.ratio_row(times, spec.ratios)}], info)
    want = {"llama": "| s | 4.0 | 2.0 | 1.0 | 0.50 | 0.25 | 0.50 | 2 / 2 / 2 |",
            "qwen3": "| s | 4.0 | 2.0 | 1.0 | 0.5 | 0.25 | 0.12 | 0.50 | 2 / 2 / 2 / 2 |"}
    assert want[model] in md, md
    cpu = {"llama": "| s | 8.0 | 4.0 | 2.0 | 0.50 | 0.25 | 0.50 |",  # the CPU times' table, its own ratios
           "qwen3": "| s | 8.0 | 4.0 | 2.0 | 1.0 | 0.25 | 0.12 | 0.50 |"}
    assert cpu[model] in md, md
    # per-run ratios: the median of each repetition's ratio (unpatched ran 4 then 1 ms), not of the medians
    paired = {"llama": "| s | 1.25 | 0.62 | 0.50 |", "qwen3": "| s | 0.62 | 0.31 | 0.50 |"}
    assert paired[model] in md, md


def test_the_hf_benchmark_refuses_an_unknown_row(capsys):
    from benchmarks import hf_generate

    with pytest.raises(SystemExit) as e:
        hf_generate.main(["--quick", "--rows", "compiled,graphs"])
    assert e.value.code == 2
    assert "--rows: expected a comma-separated subset of compiled, eager, train, hf-compile, got " \
           "'compiled,graphs'" in capsys.readouterr().err


def test_the_hf_benchmark_agreement_finds_the_first_differing_step(gen):
    from benchmarks import hf_generate

    want, logits = torch.randint(0, 100, (3, 10), generator=gen), torch.randn(3, 50, generator=gen)
    late = want.clone()
    late[2, 7:] += 1  # row 2 from step 8 on (1-based)
    early = want.clone()
    early[0, 4] += 1  # row 0 at step 5 alone
    early[1, 6:] += 1
    nudged = logits.clone()
    nudged[1, 3] += 0.25
    got = hf_generate.agreement({"unpatched": (want, logits), "same": (want.clone(), logits.clone()),
                                 "late": (late, nudged), "early": (early, logits)})
    assert list(got) == ["same", "late", "early"]
    scale = float(logits.abs().max())
    assert got["same"] == {"tokens_equal": 1.0, "rows_equal": 3, "rows": 3, "first_divergence": None,
                           "step1_logits_max_abs_diff": 0.0, "step1_logits_max_abs": scale}
    assert got["late"]["first_divergence"] == 8 and got["late"]["rows_equal"] == 2
    assert got["late"]["tokens_equal"] == pytest.approx(27 / 30)
    assert got["late"]["step1_logits_max_abs_diff"] == pytest.approx(0.25)
    assert got["early"]["first_divergence"] == 5 and got["early"]["rows_equal"] == 1
    assert got["early"]["tokens_equal"] == pytest.approx(25 / 30)


@pytest.mark.slow  # measured 33 s on 2 cores (four models compiled with aot_eager); CI runs -m slow
def test_the_hf_benchmark_quick_qwen3_prologue_gives_the_unpatched_tokens(tmp_path):
    """``python -m benchmarks.hf_generate --quick --model qwen3`` (one run per variant): in fp32 on
    the CPU, compiled (aot_eager) and eager static-cache generation of every variant, the fused
    prologue's included, gives the unpatched model's tokens and compiles as many graphs, and the
    row counts the op each variant's graphs call (the prologue's: once per layer and graph)."""
    pytest.importorskip("transformers")
    from benchmarks import hf_generate

    assert hf_generate.main(["--quick", "--model", "qwen3", "--reps", "1", "--warmup", "0",
                             "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "hf_generate_qwen3.json").read_text())
    compiled, eager, training = result["rows"]
    assert compiled["setup"].startswith("compiled generate (aot_eager, static cache)")
    assert eager["setup"].startswith("eager generate (static cache)") and "agreement" not in training
    for row in (compiled, eager):
        assert list(row["agreement"]) == ["rope", "rope+norm", "prologue"]
        for name, a in row["agreement"].items():
            assert a["tokens_equal"] == 1.0 and a["first_divergence"] is None and a["rows_equal"] == a["rows"] == 2
            assert a["step1_logits_max_abs_diff"] <= 1e-5 * a["step1_logits_max_abs"], (row["setup"], name, a)
    graphs = {k: t["graphs_compiled"] for k, t in compiled["times"].items()}
    assert graphs == dict.fromkeys(graphs, graphs["unpatched"]) and graphs["unpatched"] >= 1, graphs
    calls = graphs["unpatched"] * hf_generate.QUICK_MODEL["layers"]
    assert compiled["ops"] == {"unpatched": {}, "rope": {"RoPEFwdOp": calls}, "rope+norm": {"RoPEFwdOp": calls},
                               "prologue": {"AttnPrologueFwdOp": calls}}, compiled["ops"]
    assert "| prologue | 1.000 | 2 / 2 | none |" in (tmp_path / "hf_generate_qwen3.md").read_text()


@pytest.mark.slow  # five models compiled with aot_eager on the CPU, and the attention ops' C kernels
def test_the_hf_benchmark_compiles_every_variant_with_attention(tmp_path):
    """``--attention`` adds a fifth variant, whose graphs went past Dynamo's cache of eight a code
    object (the variants share ``forward``'s): the compiled row then timed it eager and said it had
    compiled 0 graphs. Every variant compiles now; Qwen3's attention variant (prologue and attention
    patched) calls the prologue, ``AttnFwdOp`` (the prefill) and ``PagedAttnDecodeFwdOp`` (the
    steps), and gives the unpatched tokens in fp32."""
    pytest.importorskip("transformers")
    from benchmarks import hf_generate

    assert hf_generate.main(["--quick", "--model", "qwen3", "--attention", "--rows", "compiled", "--reps", "1",
                             "--warmup", "0", "--out", str(tmp_path)]) == 0
    (compiled,) = json.loads((tmp_path / "hf_generate_qwen3_attention.json").read_text())["rows"]
    assert "error" not in compiled, compiled
    graphs = {k: t["graphs_compiled"] for k, t in compiled["times"].items()}
    assert list(graphs) == ["unpatched", "rope", "rope+norm", "prologue", "prologue+attention"]
    assert min(graphs.values()) >= 1, graphs
    assert set(compiled["ops"]["prologue+attention"]) == {"AttnPrologueFwdOp", "AttnFwdOp", "PagedAttnDecodeFwdOp"}
    assert compiled["agreement"]["prologue+attention"]["tokens_equal"] == 1.0, compiled["agreement"]
    assert "prologue+attention / prologue" in compiled["ratios"]


def test_a_compiled_row_with_a_variant_run_eager_is_not_reported():
    """A variant whose calls compiled no graph (Dynamo ran them eager) turns its compiled row into an
    error row, which the table prints as failed, never as a time."""
    from benchmarks import hf_generate

    times = {n: {"graphs_compiled": g} for n, g in (("unpatched", 2), ("attention", 0))}
    rows = [{"setup": "compiled generate", "times": times}]
    hf_generate._refuse_eager(rows)
    assert rows == [{"setup": "compiled generate", "error": "compiled no graph for attention: their calls ran eager, "
                                                             "so the row is not reported"}]


def test_backward_bytes_count_what_each_backward_must_move():
    """RoPE's backward: the output's gradient in, x's out. A norm's also reads x (h with a residual,
    whose gradient is x's own tensor: written once), and the weight and its gradient."""
    x, w, r = torch.randn(64, 256), torch.randn(256), torch.randn(64, 256)
    row, vec = x.numel() * 4, w.numel() * 4
    rms, rope = registry()["RMSNormFwdOp"], registry()["RoPEFwdOp"]
    assert runner._backward_bytes(rms, op_class("RMSNormFwdOp")(), {"x": x, "weight": w}, (0, 1)) == 3 * row + 2 * vec
    with_res = {"x": x, "weight": w, "residual": r}
    assert runner._backward_bytes(rms, op_class("RMSNormFwdOp")(), with_res, (0, 1, 2)) == 4 * row + 2 * vec
    assert runner._backward_bytes(rope, op_class("RoPEFwdOp")(), {"x": x}, (0,)) == 2 * row


def test_prologue_benchmark_columns_compute_the_same_thing():
    """benchmarks/prologue.py times the fused op against the PyTorch chain and against the chain
    with tileops' RoPE in the middle: on the CPU, each of its smoke rows (neox, YaRN, MRoPE) gives
    the same q and caches in every column, so the H200 table compares like with like."""
    from benchmarks import prologue

    assert prologue.smoke() == []


@pytest.mark.slow  # three Inductor compiles on the CPU
def test_the_hf_profile_reports_each_variant(capsys, tmp_path):
    """``python -m benchmarks.hf_profile --quick``: a summary line per variant (host CPU time, launches,
    matmuls) and its full table in ``--out``; an unknown variant is refused before anything is built."""
    pytest.importorskip("transformers")
    from benchmarks import hf_profile

    with pytest.raises(SystemExit):
        hf_profile.main(["--quick", "--variants", "unpatched,nope"])
    assert "--variants: nope not among" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        hf_profile.main(["--quick", "--reps", "0"])
    assert "--reps: expected an integer >= 1, got 0" in capsys.readouterr().err
    assert hf_profile.main(["--quick", "--reps", "1", "--new", "2", "--variants", "unpatched,prologue",
                            "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for name in ("unpatched", "prologue"):
        assert re.search(rf"^{name}: wall median [0-9.]+ ms", out, re.M), out
        assert re.search(rf"^{name}: host CPU self [0-9.]+ ms, GPU [0-9.]+ ms, launches \d+, aten::mm [1-9]", out,
                         re.M), out
        assert (tmp_path / f"hf_profile_{name}.txt").read_text().count("aten::mm") >= 1


def test_the_decode_sweep_parses_its_schedules_and_refuses_others():
    """``python -m benchmarks.decode --sweep``: CUDA-core and tensor-core schedules, the latter with the
    prefetch, the float8 widening and the programs an SM asked of nvcc; a malformed one is refused by name
    before any GPU work."""
    from benchmarks.decode import parse_sweep

    assert parse_sweep("128x2,128x2x1x0,128m64,128m128p1,128m64w1,128m64p0w0,128m128p1w1b3") == [
        {"threads": 128, "unroll": 2}, {"threads": 128, "unroll": 2, "prefetch": 1, "stages": 0},
        {"threads": 128, "mma": 1, "tile": 64, "prefetch": 0},
        {"threads": 128, "mma": 1, "tile": 128, "prefetch": 1},
        {"threads": 128, "mma": 1, "tile": 64, "prefetch": 0, "widen": 1},
        {"threads": 128, "mma": 1, "tile": 64, "prefetch": 0, "widen": 0},
        {"threads": 128, "mma": 1, "tile": 128, "prefetch": 1, "widen": 1, "min_blocks": 3}]
    for bad in ("128m64w2", "128m64x", "128", "128m64b9", "128m64b3w1"):
        with pytest.raises(SystemExit, match=f"--sweep: expected .*got '{bad}'"):
            parse_sweep(bad)


def test_a_decode_sweep_column_says_what_ran():
    """A sweep's column is titled with the partial program's knobs as built: where ``kernel_specs``' rules
    override the sweep (a widened float8 cache takes tiles of 64; a bf16 cache has no widening), the title
    names the knob as built and what was asked. (2026-12-06: a float8 sweep's "tile 128" columns had run at
    tiles of 64, and read as a tie.)"""
    import torch

    from benchmarks.decode import parse_sweep, sweep_label

    (asked,) = parse_sweep("128m128p1w1b3")
    assert sweep_label(asked, torch.float8_e4m3fn) == (
        "threads 128, mma 1, tile 64 (asked 128), prefetch 1, widen 1, min_blocks 4 (asked 3)")
    assert sweep_label(asked, torch.bfloat16) == (
        "threads 128, mma 1, tile 128, prefetch 1, widen 0 (asked 1), min_blocks 3")
    (same,) = parse_sweep("128m64p1w1")
    assert "asked" not in sweep_label(same, torch.float8_e4m3fn)


def test_the_attention_sweep_names_its_kernels_without_a_gpu():
    """``benchmarks.attention``'s rows and configs give the kernels a run launches, with no GPU (what
    ``benchmarks.device_cache --attention-configs`` compiles ahead): the forward's spec carries each
    config's schedule, ping-pong (pipeline 3) among them; a bad row or config is refused by name."""
    from benchmarks import attention

    work = attention.work_list(rows="16k,16k-causal", dtypes="bf16")
    assert work == [("16k", "bf16"), ("16k-causal", "bf16")]
    configs = [attention.parse_config(c) for c in ("128x128x2x256x2", "128x176x2x256x3")]
    jobs = attention.kernel_jobs(work, configs, "sm_90")
    specs = [s for b, s, _, arch in jobs if b == "attention" and arch == "sm_90"]
    assert len(jobs) == len(specs) == 4
    assert {(s.causal, s.block_N, s.pipeline, s.pingpong) for s in specs} == {
        (c, bn, p, p == 3) for c in (False, True) for bn, p in ((128, 2), (176, 3))}
    with pytest.raises(SystemExit, match=r"--rows: unknown \['bf16'\]"):
        attention.work_list(rows="bf16")
    with pytest.raises(SystemExit, match=r"--dtypes: unknown \['fp8'\]; dtypes: bf16, fp16"):
        attention.work_list(dtypes="bf16,fp8")
    with pytest.raises(SystemExit, match=r"--configs: expected .*got '128x128'"):
        attention.parse_config("128x128")


def test_the_attention_table_puts_the_builtin_and_derived_schedules_side_by_side():
    """``--configs builtin,derived``: the op built with ``target=BUILTIN`` and with ``target=None``; once
    an op has run, its label says which schedule served it and where that came from. Their kernels are
    the built-in ones (a derived choice's are built by its first call, or were by the tune before it)."""
    from benchmarks import attention
    from tileops.schedules import Schedule

    assert [attention.parse_config(c) for c in ("builtin", " Derived")] == ["builtin", "derived"]
    row = attention.ROWS["16x1k-causal"]
    built, derived = attention.make_op(row, "builtin"), attention.make_op(row, "derived")
    assert built._fixed_target is not None and built._fixed_target.name == "builtin"
    assert derived._fixed_target is None and derived.params["causal"] is True
    jobs = attention.kernel_jobs([("16x1k-causal", "bf16")], ["builtin", "derived"], "sm_90")
    assert jobs == attention.kernel_jobs([("16x1k-causal", "bf16")], [None], "sm_90")
    assert attention.config_label("derived") == "derived"
    derived._schedule = Schedule(knobs=(("attention", "block_M", 64), ("attention", "block_N", 176)),
                                source="tuned on this machine at 2026-12-06 21:00 UTC")
    assert attention.config_label("derived", derived) == ("derived: 64x176 (tuned on this machine at "
                                                          "2026-12-06 21:00 UTC)")
    with pytest.raises(SystemExit, match=r"or one of builtin, derived; got 'tuned'"):
        attention.parse_config("tuned")


def test_device_cache_prune_keeps_the_entries_its_kernels_are_found_under(tmp_path):
    """``benchmarks.device_cache --prune`` removes an index entry no kernel of the run names (both of
    its files), keeps each kernel's entry under either build's key, and leaves other files alone."""
    from benchmarks.device_cache import prune
    from tileops.compile.build import index_key
    from tileops.kernels import get_spec

    job = ("attention", get_spec("attention")(dtype="bfloat16", head_dim=64, hq=4, hkv=2, backend="cuda"),
           "cuda", "sm_90")
    kept = [index_key(*job), index_key(*job, lean=True)]
    names = [f"{k}.{s}" for k in (*kept, "a" * 32) for s in ("json", "so")] + ["compile.lock"]
    for n in names:
        (tmp_path / n).write_text("x")
    assert prune(tmp_path, [job]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n for n in names if not n.startswith("a" * 32))


def test_device_cache_merge_adds_a_device_packs_entries_and_prune_keeps_them(tmp_path):
    """``benchmarks.device_cache --merge PACK`` adds the entries of a device run's pack
    (``benchmarks/device/suite.sh``'s ``new-kernels-KofN.tar.xz``) to the index and ``--prune`` keeps
    them; a pack with any other member is refused whole, before anything is written."""
    import tarfile

    from benchmarks.device_cache import merge, prune

    src, index = tmp_path / "src", tmp_path / "index"
    (src / "kernels").mkdir(parents=True)
    index.mkdir()
    key = "b" * 32
    for suffix in ("json", "so"):
        (src / "kernels" / f"{key}.{suffix}").write_text(suffix)
    good = tmp_path / "new-kernels-1of2.tar.xz"
    with tarfile.open(good, "w:xz") as tar:
        tar.add(src / "kernels", arcname="kernels")
    (index / f"{'c' * 32}.json").write_text("stale")
    assert merge(index, [str(good)]) == {key}
    assert (index / f"{key}.so").read_text() == "so" and (index / f"{key}.json").read_text() == "json"
    assert prune(index, [], merge(index, [str(good)])) == 1  # the stale entry only
    assert sorted(p.name for p in index.iterdir()) == [f"{key}.json", f"{key}.so"]
    (src / "evil.sh").write_text("x")
    bad = tmp_path / "bad.tar.xz"
    with tarfile.open(bad, "w:xz") as tar:
        tar.add(src / "kernels" / f"{key}.so", arcname=f"kernels/{'d' * 32}.so")
        tar.add(src / "evil.sh", arcname="../evil.sh")
    with pytest.raises(SystemExit, match=r"--merge .*bad.tar.xz: expected only kernels/<32 hex>.*'../evil.sh'"):
        merge(index, [str(bad)])
    assert not (index / f"{'d' * 32}.so").exists() and not (tmp_path / "evil.sh").exists()
    with pytest.raises(SystemExit, match=r"--merge: expected a pack file .*'nowhere.tar.xz': no such file"):
        merge(index, ["nowhere.tar.xz"])


def test_attention_cost_fits_a_line_and_plans_its_calls(capsys):
    """``benchmarks.attention_cost``: the least-squares line through exact points is that line; each
    call gives every SM ``--waves`` blocks of one q tile walking ``n`` K/V tiles; ``--dry`` prints the
    plan with no GPU and a count list that makes no line is refused by name."""
    from benchmarks import attention_cost

    f, t = attention_cost.fit([(1, 19.5), (2, 21.75), (8, 35.25), (32, 89.25)])  # 17.25 + 2.25 n
    assert (f, t) == (17.25, 2.25)
    rows = attention_cost.calls([1, 4], waves=8, sms=132)
    assert [r[1] for r in rows] == [128, 512] and all(r[0] * attention_cost.HQ >= 8 * 132 for r in rows)
    assert all(r[5] is False for r in rows)  # not causal: every block walks all its tiles
    assert attention_cost.main(["--dry", "--tiles", "1,2"]) == 0
    out = capsys.readouterr().out
    assert "1056 blocks), seq_q 128, seq_k 256" in out and "kind='fwd'" in out and "bwd" not in out
    with pytest.raises(SystemExit, match=r"--tiles: a line needs two or more counts"):
        attention_cost.main(["--dry", "--tiles", "4"])
    with pytest.raises(SystemExit, match=r"--tiles: expected counts like 1,2,4,8, got '1,x'"):
        attention_cost.main(["--dry", "--tiles", "1,x"])
    with pytest.raises(SystemExit, match=r"--waves: expected a count of at least 1, got 0"):
        attention_cost.main(["--dry", "--waves", "0"])


def test_sanitize_prefill_finds_the_allocators_free_blocks_and_only_initcheck_asks_for_it(monkeypatch, tmp_path,
                                                                                         capsys):
    from benchmarks import sanitize

    snap = [{"address": 1000, "blocks": [{"size": 64, "state": "active_allocated", "address": 1000},
                                         {"size": 32, "state": "inactive", "address": 1064}]},
            # a snapshot without block addresses: each block starts where the one before ended
            {"address": 5000, "blocks": [{"size": 16, "state": "inactive"}, {"size": 8, "state": "active_allocated"},
                                         {"size": 40, "state": "inactive"}]}]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: snap)
    assert list(sanitize._free_blocks()) == [(1064, 32), (5000, 16), (5024, 40)]
    assert sanitize._Raw(5024, 40).__cuda_array_interface__["data"] == (5024, False)

    # initcheck's processes, and only they, get the variable; --logdir is made where it is missing
    seen = {}

    class Proc:
        returncode = 0

        def __init__(self, cmd, env, stdout, **_):
            if "--tool" in cmd:
                seen[cmd[cmd.index("--tool") + 1]] = env.get(sanitize.PREFILL_ENV)
            self.cmd, self.sink = cmd, stdout

        def wait(self):
            self.sink.write("ERROR SUMMARY: 0 errors\nsanitize calls: 0 passed, 0 failed, 0 refused\n")

    monkeypatch.setattr(sanitize.subprocess, "Popen", Proc)
    monkeypatch.setattr(sanitize, "calls", lambda: [])
    logdir = tmp_path / "new" / "logs"
    assert sanitize.outer(["memcheck", "initcheck", "synccheck"], 1, str(logdir)) == 0
    assert seen == {"memcheck": None, "initcheck": "1", "synccheck": None}
    assert (logdir / "sanitize-initcheck.log").exists()
    assert sanitize.outer(["initcheck"], 0, str(logdir)) == 0  # --jobs 0: no plain run, and said so
    out = capsys.readouterr().out
    assert "plain run: skipped (--jobs 0)" in out and "passed: initcheck (no plain run) over 0 calls" in out
    assert sanitize.outer([], 1, str(logdir)) == 0  # no tool: the plain run alone, named so
    assert "passed: the plain run over 0 calls" in capsys.readouterr().out


def test_sanitize_cut_by_sigterm_says_how_far_each_part_got(monkeypatch, tmp_path, capsys):
    """A run cut short (``timeout``'s SIGTERM, a device call's limit) prints, for each part that had not
    ended, the calls it got through from its log, and exits 124, a second SIGTERM during the report
    included; the logs stay in ``--logdir``."""
    import signal

    from benchmarks import sanitize

    class Proc:
        returncode = 0
        started = []

        def __init__(self, cmd, env, stdout, **_):
            self.part, self.sink, self.killed = int(cmd[cmd.index("--part") + 1]), stdout, False
            Proc.started.append(self)

        def poll(self):
            return None

        def kill(self):
            # timeout signals its process group too: a second SIGTERM comes while the runner reports
            # (seen on an H100, 2026-12-06: it raised out of the report, which printed nothing)
            self.killed = True
            os.kill(os.getpid(), signal.SIGTERM)

        def wait(self):
            if self.part == 0:  # part 0 ends whole; part 1 has run two calls of four when the signal comes
                self.sink.write("ok a (0.1 s)\nok c (0.1 s)\nsanitize calls: 2 passed, 0 failed, 0 refused\n")
                return
            self.sink.write("ok b (0.1 s)\nFAILED d: ValueError: off\n")
            self.sink.flush()
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(sanitize.subprocess, "Popen", Proc)
    monkeypatch.setattr(sanitize, "calls", lambda: [(n, None) for n in "abcdefgh"])
    before = signal.getsignal(signal.SIGTERM)
    assert sanitize.outer(["memcheck"], 2, str(tmp_path)) == 124
    out = capsys.readouterr().out
    assert "plain part 0: rc=0; sanitize calls: 2 passed" in out
    assert ("plain part 1: cut after 2 of 4 calls (1 ok, 1 failed); last ended: FAILED d: ValueError: off"
            in out)
    assert "CUT by SIGTERM" in out and "memcheck" not in out  # no tool started after the cut
    assert [p.killed for p in Proc.started] == [False, True]
    assert (tmp_path / "sanitize-plain-1.log").read_text().startswith("ok b")
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is the runner's only while it runs


@pytest.mark.parametrize("argv, says", [
    (["--jobs", "-1"], "--jobs: expected a count of processes >= 0"),
    (["--tool-parts", "0"], "--tool-parts: expected a count of processes >= 1"),
    (["--tools", "memcheck,leakcheck"], "--tools: expected names from memcheck, racecheck, initcheck, synccheck, "
                                        "got leakcheck")])
def test_sanitize_refuses_bad_counts_and_tools_before_any_process_starts(argv, says, capsys, monkeypatch):
    from benchmarks import sanitize

    monkeypatch.setattr(sanitize.subprocess, "Popen", None)  # nothing may start
    with pytest.raises(SystemExit):
        sanitize.main(argv)
    assert says in capsys.readouterr().err


def test_decode_kernel_rows_give_each_kernels_time_and_the_gap_before_it():
    """``python -m benchmarks.decode --kernels``: from the device's kernel events of replays of a call of
    two launches, each kernel's median time and the median gap before it: the partial's gap is between
    replays, the merge's the one inside the call."""
    from benchmarks.decode import kernel_rows

    events = []
    t = 0.0
    for replay in range(5):
        events.append(("partial", t, t + 9.0 + replay % 2))  # 9 or 10 us
        events.append(("merge", t + 10.5, t + 10.5 + 5.0))  # 0.5 or 1.5 us after the partial ends
        t += 20.0  # the next replay: 4.5 us after this merge ends
    rows = kernel_rows(events[::-1])  # (any order: sorted by start)
    assert rows == [("partial", 5, 9.0, 4.5), ("merge", 5, 5.0, 1.5)]


@pytest.mark.parametrize("argv,says", [(["--kernels", "--sweep", "128m64"], "--kernels and --sweep"),
                                       (["--sweep", "128m64", "--splits", "264:256"], "--sweep and --splits")])
def test_decode_refuses_two_runs_at_once(argv, says, monkeypatch, capsys):
    """``python -m benchmarks.decode``: --kernels, --sweep and --splits are each a run of their own; asked
    together, one of them silently did not run. Refused before anything touches a GPU."""
    from benchmarks import decode

    monkeypatch.setattr(sys, "argv", ["decode", *argv])
    with pytest.raises(SystemExit) as e:
        decode.main()
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def test_device_cache_test_jobs_leaves_the_families_the_real_device_backend():
    """``benchmarks.device_cache`` lists the attention tests' kernels under a stand-in CUDA device, then runs
    HF's tiny models on the CPU (``hf_jobs``) in the same process. The families' kernel modules bind
    ``device_backend`` by name when first imported; imported under the stand-in they kept it, and those CPU
    models built CUDA specs ("dtype: the CUDA schedule runs on tensor cores ..., got float32"). Run in a
    process of its own: the modules must be imported there for the first time."""
    code = (
        "import sys; sys.path.insert(0, '.')\n"
        "import benchmarks.device_cache as dc\n"
        "assert dc.test_jobs()\n"
        "import tileops.compile.build as b\n"
        "import tileops.attention.attn_builtin, tileops.attention.decode_builtin, tileops.attention.builtin\n"
        "import tileops.norm.builtin, tileops.rope.builtin\n"
        "mods = [tileops.attention.attn_builtin, tileops.attention.decode_builtin, tileops.attention.builtin,\n"
        "        tileops.norm.builtin, tileops.rope.builtin]\n"
        "bad = [m.__name__ for m in mods if m.device_backend is not b.device_backend]\n"
        "assert not bad, bad\n"
        "print('ok')\n")
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600,
                         check=False)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-1000:] + run.stderr[-3000:]
