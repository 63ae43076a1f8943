"""The benchmark runner's figures and summary, drawn from its saved JSON (no GPU needed).

    python -m benchmarks.plots [--json benchmarks/results/latest.json] [--out benchmarks/results]

One figure per family and direction (``latest-<family>-<direction>.png``: ``latest-rope-forward.png``,
``latest-rope-backward.png``), in the order they first appear in the results: a group of horizontal
bars per row, tileops, torch.compile, Liger and torch eager, each as its speed relative to a copy of
the row's own bytes timed in the same run (the copy's time over the contender's: 1.0 is the copy, a
vertical line; above it is faster than the copy). ``summary.md`` holds the table the benchmarks page
leads with (per op and direction: x torch.compile, x Liger, % of the same-bytes copy, as ranges over
the op's cases) followed by the figures, linked by file name, beside it. The runner calls
:func:`write` after every run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BACKWARD_SUFFIX = " (backward)"  # how the runner labels a backward row's case

# name in the legend -> the runner row's key, top to bottom within a row's group
CONTENDERS = {"tileops": "ours_us", "torch.compile": "compile_us", "Liger": "liger_us", "torch eager": "eager_us"}
COLOURS = {"tileops": "#1f77b4", "torch.compile": "#ff7f0e", "Liger": "#2ca02c", "torch eager": "#8c8c8c"}
DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}

# Sized for the docs page's content column (about 800 px): 8 in at 120 dpi is 960 px, shown at 0.83x,
# so 10 pt text reads as about 14 px. Each row takes ROW_IN inches: four bars and a two-line label.
WIDTH_IN, DPI, ROW_IN, FRAME_IN = 8.0, 120, 0.5, 1.9
# the summary's columns, each once per direction: (title, the row's key it compares with ours)
SUMMARY_COLUMNS = (("x torch.compile", "compile_us"), ("x Liger", "liger_us"), ("% same-bytes copy", "copy_us"))


def direction(row: dict[str, Any]) -> str:
    """``forward`` or ``backward``: the row's own field, else the runner's case label suffix."""
    return row.get("direction") or ("backward" if row["case"].endswith(BACKWARD_SUFFIX) else "forward")


def family(row: dict[str, Any]) -> str:
    """The row's op family: its own field, else the op's manifest, else the op's name (an op this
    tileops does not know, from a results file of another tree)."""
    if row.get("family"):
        return row["family"]
    from tileops.manifest import registry

    m = registry().get(row["op"])
    return m.family if m is not None else row["op"]


def _family_title(name: str) -> str:
    from tileops import docgen

    try:
        return docgen.family_title(name)
    except OSError:  # a family this tileops does not have (results of another tree): its name will do
        return name


def groups(result: dict[str, Any]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """The rows by (family, direction), in the order each pair first appears."""
    out: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in result["rows"]:
        out.setdefault((family(r), direction(r)), []).append(r)
    return out


def _time(t: Any) -> float | None:
    """A time that was measured: None for none (no Liger for the case) or NaN (torch.compile failed)."""
    return float(t) if isinstance(t, (int, float)) and math.isfinite(t) and t > 0 else None


def _median(r: dict[str, Any], key: str) -> float | None:
    v = r.get(key)
    return _time(v[0]) if v else None


def relative(copy_us: Any, t: Any) -> float | None:
    """Speed relative to a copy of the same bytes: the copy's time over this time."""
    copy_us, t = _time(copy_us), _time(t)
    return copy_us / t if copy_us is not None and t is not None else None


def of_copy(r: dict[str, Any], key: str) -> float | None:
    """The contender's speed relative to a copy of the runner row's bytes."""
    return relative(r.get("copy_us"), _median(r, key))


def figure_name(fam: str, dirn: str) -> str:
    return f"latest-{fam}-{dirn}.png"


def _label(r: dict[str, Any]) -> str:
    case = r["case"].removesuffix(BACKWARD_SUFFIX)
    mb = r["bytes"] / 1e6
    return f"{case}  {DTYPES.get(r['dtype'], r['dtype'])}  {mb:.{1 if mb < 10 else 0}f} MB\n{r['op']}"


def family_figure(rows: list[dict[str, Any]], title: str, path: Path) -> None:
    """The figure of one family and direction: a bar group per row, a rule between ops."""
    rules = [j for j in range(1, len(rows)) if rows[j]["op"] != rows[j - 1]["op"]]
    draw([_label(r) for r in rows], {name: [of_copy(r, key) for r in rows] for name, key in CONTENDERS.items()},
         title, path, rules)


def draw(labels: list[str], bars: dict[str, list[float | None]], title: str, path: Path,
         rules: list[int] = ()) -> None:
    """Horizontal bars, a group per label: for each contender (``bars``' keys, top to bottom; the
    first is tileops, its value written at the bar's end) its speed relative to a copy of the same
    bytes, None where it did not run; a vertical line at 1.0, a thin rule above each index in
    ``rules``. Sized for the docs page: WIDTH_IN wide, ROW_IN per label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    n, k = len(labels), len(bars)
    bar = 0.8 / k
    fig, ax = plt.subplots(figsize=(WIDTH_IN, FRAME_IN + ROW_IN * n), dpi=DPI)
    top = 1.0
    for i, (name, values) in enumerate(bars.items()):
        ys = [j - 0.4 + bar * (i + 0.5) for j, v in enumerate(values) if v is not None]
        xs = [v for v in values if v is not None]
        top = max([top, *xs])
        colour = COLOURS.get(name)
        ax.barh(ys, xs, height=bar * 0.9, color=colour, label=name)
        if i == 0:  # ours is the number a reader looks for
            for y, x in zip(ys, xs):
                ax.text(x + 0.01, y, f"{x:.2f}", va="center", ha="left", fontsize=8, color=colour,
                        fontweight="bold", bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.6})
    ax.axvline(1.0, color="k", linewidth=1.2, zorder=3)
    for j in rules:
        ax.axhline(j - 0.5, color="#cccccc", linewidth=0.8)
    ax.set_yticks(range(n), labels, fontsize=9)
    ax.set_ylim(n - 0.5, -0.5)  # first label at the top
    ax.set_xlim(0, top * 1.1)
    ax.grid(axis="x", color="#e6e6e6", linewidth=0.8)
    ax.set_axisbelow(True)
    ax.tick_params(axis="x", labelsize=9)
    ax.set_xlabel("speed relative to a copy of the same bytes (copy time / op time; higher is faster)",
                  fontsize=9.5)
    ax.set_title(title, fontsize=11.5, loc="left", pad=44)  # the legend sits between title and bars
    handles, names = ax.get_legend_handles_labels()
    handles.append(Line2D([], [], color="k", linewidth=1.2))
    names.append("copy of the same bytes (1.0)")
    ax.legend(handles, names, fontsize=9, ncol=3, loc="lower left", bbox_to_anchor=(0.0, 1.005),
              frameon=False, borderaxespad=0.0, handlelength=1.5, columnspacing=1.2)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def _span(values: list[float], fmt: str) -> str:
    if not values:
        return "-"
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo}-{hi}"


def _cell(rows: list[dict[str, Any]], key: str) -> str:
    """A summary cell: the range over ``rows`` of the contender's median time over ours (above 1:
    tileops is faster), or for ``copy_us`` of ours as a % of the same-bytes copy; - where none was timed."""
    if key == "copy_us":
        return _span([100 * v for r in rows if (v := of_copy(r, "ours_us")) is not None], "{:.0f}")
    pairs = [(_median(r, key), _median(r, "ours_us")) for r in rows]
    return _span([theirs / ours for theirs, ours in pairs if theirs is not None and ours is not None], "{:.2f}")


def summary_markdown(result: dict[str, Any], figures: list[str]) -> str:
    """A row per op: for each direction, x torch.compile, x Liger and % of the same-bytes copy as
    ranges over the op's cases; then the figures (by file name, beside this file)."""
    meta = result["meta"]
    versions = meta.get("versions", {})
    dirns = list(dict.fromkeys(direction(r) for r in result["rows"]))
    cells: dict[str, dict[str, list[dict[str, Any]]]] = {}  # op -> direction -> rows, in the results' order
    for (_, dirn), rows in groups(result).items():
        for r in rows:
            cells.setdefault(r["op"], {}).setdefault(dirn, []).append(r)
    header = ["op", "cases"] + [f"{title}, {d}" for title, _ in SUMMARY_COLUMNS for d in dirns]
    lines = [(f"{meta['gpu']}, torch {versions.get('torch', '?')}, commit {meta.get('commit') or '?'}, "
              f"{meta.get('date', '?')[:10]}. Per op, the range over its cases (full table: `latest.md`)."
              + "".join(f" {', '.join(u['ops'])}: re-measured at commit {u['commit']}, {u['date'][:10]}."
                        for u in meta.get("updated", []))), "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for op, by_dirn in cells.items():
        row = [f"`{op}`", str(max(len(v) for v in by_dirn.values()))]
        row += [_cell(by_dirn.get(d, []), key) for _, key in SUMMARY_COLUMNS for d in dirns]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", ("x torch.compile, x Liger: their median time over ours, timed in the same run (above 1: "
                   "tileops is faster; - where Liger does not run the case). % same-bytes copy: the time of a "
                   "device copy of the row's bytes over ours (above 100 on rows of 8 MB or less, where launch "
                   "and ramp-up weigh more than bandwidth)."), ""]
    lines += [f"![{name.removesuffix('.png')}]({name})" for name in figures]
    return "\n".join(lines) + "\n"


def write(result: dict[str, Any], out: Path) -> list[Path]:
    """Draw every family's and direction's figure and ``summary.md`` into ``out``; the files written."""
    out.mkdir(parents=True, exist_ok=True)
    names = []
    for (fam, dirn), rows in groups(result).items():
        names.append(figure_name(fam, dirn))
        title = f"{_family_title(fam)}, {dirn}: {result['meta']['gpu']}"
        family_figure(rows, title, out / names[-1])
    (out / "summary.md").write_text(summary_markdown(result, names), encoding="utf-8")
    return [out / n for n in names] + [out / "summary.md"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.plots", description=__doc__.split("\n")[0])
    p.add_argument("--json", default=str(HERE / "results" / "latest.json"), help="the runner's saved results")
    p.add_argument("--out", default=None, help="folder for the figures and summary.md (default: the JSON's)")
    args = p.parse_args(argv)
    src = Path(args.json)
    result = json.loads(src.read_text(encoding="utf-8"))  # the runner writes NaN, which json reads back
    for path in write(result, Path(args.out) if args.out else src.parent):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
