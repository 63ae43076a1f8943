"""The benchmark runner's own logic, on the CPU (its timings need a GPU; what it times does not)."""

from __future__ import annotations

import json
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
    GPU timer replaced by one call and torch.compile by the function itself."""
    got: list[list[torch.Tensor]] = []

    def one_call(fn, n):
        got.append(list(fn(0)))
        return (1.0, 1.0, 1.0)

    monkeypatch.setattr(runner, "gpu_time", one_call)
    monkeypatch.setattr(runner, "fresh_compile", lambda f: f)
    m = registry()[name]
    op = op_class(name)(**params)
    fn, args = make_baseline(op, inputs)
    runner._backward_row(m, m.cases[0], "float32", op, [inputs], fn, [runner._bind(args, inputs)], 1.0, 1)
    return got


def test_a_qk_backward_row_differentiates_x_and_key_for_every_contender(monkeypatch):
    # the timer once took x's gradient through q's output alone: torch.compile then rotated q's
    # gradient only while ours also rotated the key's, and the row compared unequal work
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    x, key = torch.randn(1, 24, 4, 32, generator=g), torch.randn(1, 24, 2, 32, generator=g)
    pos = torch.randint(0, 40, (3, 1, 24), generator=g)
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


def test_the_hf_benchmark_builds_its_three_variants_and_reports_each():
    """benchmarks.hf_generate's models (the --quick size; the timings need a GPU): the same weights,
    unpatched, RoPE alone and RoPE with the 2 x layers + 1 norms; every row's table line names the
    three variants' times and ratios."""
    pytest.importorskip("transformers")
    from benchmarks import hf_generate
    from tileops.integrations import transformers as tt

    models = hf_generate._models(hf_generate.QUICK, torch.device("cpu"), torch.float32)
    assert list(models) == ["unpatched", "rope", "rope+norm"]
    try:
        assert not tt.is_patched(models["unpatched"])
        reports = {k: tt.report(models[k]) for k in ("rope", "rope+norm")}
        assert reports["rope"]["rope"] is not None and reports["rope"]["norm"] == {}
        assert reports["rope+norm"]["norm"] == {"LlamaRMSNorm": 2 * hf_generate.QUICK["layers"] + 1}
        w = [m.model.layers[0].self_attn.q_proj.weight for m in models.values()]
        assert torch.equal(w[0], w[1]) and torch.equal(w[0], w[2])
    finally:
        for m in models.values():
            if tt.is_patched(m):
                tt.unpatch(m)
    times = {k: {"ms": ms, "min_ms": ms, "max_ms": ms, "graphs_compiled": 2} for k, ms in
             zip(hf_generate.VARIANTS, (4.0, 2.0, 1.0))}
    info = {"size": hf_generate.QUICK, "dtype": "fp32", "device": "CPU", "torch": "t", "transformers": "t",
            "reps": 1, "warmup": 0}
    md = hf_generate.markdown([{"setup": "s", **hf_generate._row(times)}], info)
    assert "| s | 4.0 | 2.0 | 1.0 | 0.50 | 0.25 | 0.50 | 2 / 2 / 2 |" in md, md


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
