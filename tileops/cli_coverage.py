"""``tileops coverage``: how many generated tests cover each op x dtype x target cell.

The counts come from :func:`tileops.testing.generated_cases`, the list ``tests/test_generated.py``
parametrizes over, so the table is what the test suite runs (a 0 is a dtype an op allows that no
case exercises). ``--markdown`` prints the same table for the docs.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Mapping
from typing import Any

__all__ = ["cmd_coverage", "coverage_rows", "register"]


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("coverage", help="generated tests per op, dtype and target",
                              description="Count the generated tests (tests/test_generated.py) that cover each op, "
                                          "dtype and target: a 0 is a dtype an op allows that no case exercises.")
    p.add_argument("files", nargs="*", help="manifest files (default: the packaged manifests)")
    p.add_argument("--markdown", action="store_true", help="print a Markdown table (for the docs)")
    p.set_defaults(fn=cmd_coverage)


def coverage_rows(registry: Mapping[str, Any]) -> tuple[list[str], list[tuple[str, str, list[int]]]]:
    """(columns, rows): one row ``(op, dtype, counts per column)`` per op and dtype it allows."""
    from .testing import COLUMNS, generated_cases

    columns = list(COLUMNS)
    counts = Counter((c.op, c.dtype, c.column) for c in generated_cases(registry, columns))
    rows = []
    for name, m in registry.items():
        # The dtypes the op allows (its first input's, as cases use) plus any a case lists.
        dtypes = list(m.inputs[0].dtypes) if m.inputs else []
        dtypes += [d for case in m.cases for d in case.dtypes if d not in dtypes]
        for d in dtypes:
            rows.append((name, d, [counts[(name, d, col)] for col in columns]))
    return columns, rows


def cmd_coverage(args: argparse.Namespace) -> int:
    import torch

    from .manifest import ManifestError, load_files, registry
    from .workloads import SHORT

    try:
        reg = load_files(args.files) if args.files else registry()
    except ManifestError as e:
        print(str(e), file=sys.stderr)
        return 1
    columns, rows = coverage_rows(reg)
    head = ["op", "dtype", *columns, "total"]
    body = [[op, SHORT.get(d, d), *map(str, n), str(sum(n))] for op, d, n in rows]
    totals = [sum(n[i] for _, _, n in rows) for i in range(len(columns))]
    foot = ["total", "", *map(str, totals), str(sum(totals))]
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "|".join(["---", "---"] + ["--:"] * (len(head) - 2)) + "|")
        for r in body + [[f"**{foot[0]}**", *foot[1:]]]:
            print("| " + " | ".join(r) + " |")
    else:
        widths = [max(len(r[i]) for r in [head, *body, foot]) for i in range(len(head))]
        for r in [head, *body, foot]:
            print("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip())
    pairs = totals[0] if totals else 0  # every column holds each case x dtype pair once
    # The docs embed the Markdown table, so it must not depend on the machine that printed it.
    gpu = "" if args.markdown else (" (a GPU is present)" if torch.cuda.is_available() else
                                    " (none here: those skip)")
    print(f"\n{sum(totals)} generated tests ({pairs} case x dtype pairs x {len(columns)} targets); "
          f"builtin-cuda tests run only with an NVIDIA GPU{gpu}.")
    return 0
