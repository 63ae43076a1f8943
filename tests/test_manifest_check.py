"""``tileops check`` on broken manifests, and unit tests of the rule language (manifest/expr.py).

Each file in ``tests/bad_manifests/`` breaks one thing. Its first line reads ``# expect: TEXT`` (a
fragment of the error) and the line the error must point at carries a trailing ``# ERROR``, so the
expected ``FILE:LINE`` is read from the file itself and stays right when a file is edited.
``dup_op_second.yaml`` is checked together with ``dup_op_first.yaml`` (each is fine alone).
"""

from __future__ import annotations

import importlib
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tileops.cli import main
from tileops.manifest import ExprError, manifest_files, packaged_files, parse_expr, registry

BAD = Path(__file__).parent / "bad_manifests"
FILES = sorted(p for p in BAD.glob("*.yaml") if p.name != "dup_op_first.yaml")


def expectation(path: Path) -> tuple[str, int]:
    lines = path.read_text().splitlines()
    assert lines[0].startswith("# expect: "), f"{path.name}: the first line must say what error to expect"
    marked = [i + 1 for i, line in enumerate(lines) if line.rstrip().endswith("# ERROR")]
    assert len(marked) == 1, f"{path.name}: mark exactly one line with '# ERROR'"
    return lines[0][len("# expect: "):], marked[0]


def check_args(path: Path) -> list[str]:
    return [str(BAD / "dup_op_first.yaml"), str(path)] if path.name == "dup_op_second.yaml" else [str(path)]


# Each of these once showed a bug, fixed in the working tree alongside these tests: errors about a
# whole op (duplicate op, missing key) pointed at its first key's line instead of the op's name, and
# rules raising OverflowError, ValueError (log2 of 0) or TypeError (min with one argument) while a
# case was checked crashed `tileops check` with a traceback instead of printing FILE:LINE.


@pytest.mark.parametrize("path", [pytest.param(p, id=p.stem) for p in FILES])
def test_check_reports_file_and_line(path, capsys):
    fragment, line = expectation(path)
    assert main(["check", *check_args(path)]) == 1
    out = capsys.readouterr().err.strip().splitlines()  # errors go to stderr
    assert len(out) == 1, out  # one error, nothing else (no "ok" line)
    assert out[0].startswith(f"{path}:{line}: "), out[0]
    assert fragment in out[0]


def test_check_as_a_subprocess():
    # All files in one run: every file gets its own FILE:LINE line, and the exit status is 1.
    files = FILES
    proc = subprocess.run([sys.executable, "-m", "tileops", "check", str(BAD / "dup_op_first.yaml"),
                           *map(str, files)], capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == len(files) and proc.stdout == ""
    for path in files:
        fragment, line = expectation(path)
        got = [x for x in lines if x.startswith(f"{path}:")]
        assert len(got) == 1 and fragment in got[0], (path.name, got)
        assert got[0].startswith(f"{path}:{line}: "), got[0]


@pytest.mark.parametrize("rule", [
    pytest.param("9 ** 9 ** 9 > base", id="9**9**9"),
    pytest.param("(((((2 ** 64) ** 64) ** 64) ** 64) ** 64) > base", id="nested-pow-64"),
    pytest.param("'a' * 10 ** 10 != ''", id="string-repeat")])
def test_check_of_a_huge_power_ends(tmp_path, rule):
    # `tileops check` evaluates every rule on every case: an unbounded power must not hang it.
    text = (BAD / "expr_overflow.yaml").read_text().replace("2.0 ** 10000 > base", rule)
    path = tmp_path / "huge_power.yaml"
    path.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "tileops", "check", str(path)], capture_output=True,
                          text=True, timeout=60, check=False)  # a hang, not a slow start
    assert proc.returncode == 1 and f"{path}:" in proc.stderr, proc.stdout + proc.stderr


def test_check_packaged_manifests_is_ok(capsys):
    assert main(["check"]) == 0
    assert capsys.readouterr().out.strip() == f"ok: {len(registry())} ops in {len(manifest_files())} files"


def test_check_packaged_files_given_explicitly(capsys):
    assert main(["check", *map(str, packaged_files())]) == 0
    assert capsys.readouterr().out.startswith("ok: ")


# --------------------------------------------------------------------------- the rule language


def ev(text: str, **env):
    return parse_expr(text).evaluate(env)


@pytest.mark.parametrize("text, want", [
    ("1 + 2 * 3", 7), ("(1 + 2) * 3", 9), ("10 - 4 - 3", 3), ("2 ** 3 ** 2", 512), ("-2 ** 2", -4),
    ("2 * -3", -6), ("7 // 2", 3), ("7 % 3", 1), ("7 / 2", 3.5), ("1 + 6 % 4 * 2", 5), ("--3", 3),
    ("not 1 == 2", True), ("not not 0", False), ("true or false and false", True),
    ("(true or false) and false", False), ("1 + 2 == 3 and 4 > 3", True), ("1e3", 1000.0), (".5 * 4", 2.0),
])
def test_precedence_and_arithmetic(text, want):
    got = ev(text)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize("text, want", [
    ("1 < 2 < 3", True), ("1 < 3 < 2", False), ("3 > 2 == 2", True), ("1 <= 1 < 2 != 3", True),
    ("2 < 1 < undefined_name", False),  # a false link stops the chain, as in Python: no lookup
    ("a < b <= c", True),
])
def test_chained_comparisons(text, want):
    assert ev(text, a=1, b=2, c=2) is want


def test_none_true_false_and_strings():
    assert ev("rotary_dim == none", rotary_dim=None) is True
    assert ev("rotary_dim == None or rotary_dim > 0", rotary_dim=None) is True
    assert ev("rotary_dim == none or rotary_dim > 0", rotary_dim=4) is True
    assert ev("none != 0") is True and ev("True") is True and ev("False") is False
    assert ev("layout == '2d'", layout="2d") is True
    assert ev("name == \"it's\"", name="it's") is True  # double quotes may hold a single quote
    assert ev("name == 'say \"hi\"'", name='say "hi"') is True
    assert ev("'a' == 1") is False  # == across types is just false
    with pytest.raises(ExprError, match="cannot compare"):
        ev("none < 1")
    with pytest.raises(ExprError, match="cannot compare"):
        ev("'a' < 1")


def test_functions():
    assert ev("isfinite(x, 2)", x=1.5) is True
    assert ev("isfinite(x)", x=math.nan) is False and ev("isfinite(x)", x=math.inf) is False
    assert ev("isfinite(x)", x=True) is False and ev("isfinite(x)", x=None) is False
    assert ev("abs(-3) == 3 and min(4, 2, 9) == 2 and max(1, 5) == 5 and log2(8) == 3")
    assert ev("is_pow2(64)") and not ev("is_pow2(0)") and not ev("is_pow2(6)") and not ev("is_pow2(2.0)")
    assert ev("max(min(a, 3), 1)", a=7) == 3


def test_names_and_text():
    e = parse_expr("  a + b * max(c, 2) > 0 ")
    assert e.names == frozenset({"a", "b", "c"}) and str(e) == "a + b * max(c, 2) > 0"
    assert parse_expr("rotary_dim == none").names == frozenset({"rotary_dim"})


@pytest.mark.parametrize("text, fragment", [
    ("x.__class__", "unexpected character '.'"),
    ("x.real > 0", "unexpected character '.'"),
    ("x[0] > 1", "unexpected character '['"),
    ("__import__('os')", "unknown function '__import__'"),
    ("eval('1')", "unknown function 'eval'"),
    ("open('/etc/passwd')", "unknown function 'open'"),
    ("foo(1)", "unknown function 'foo'"),
    ("lambda: 1", "unexpected character ':'"),
    ("(lambda x: x)(1)", "unexpected character ':'"),
    ("[1, 2]", "unexpected character '['"),
    ("{1: 2}", "unexpected character '{'"),
    ("a if b else c", "after a complete expression"),
    ("a = 1", "unexpected character '='"),
    ("1 2", "unexpected '2' after a complete expression"),
    ("(1 + 2", "expected ')'"),
    ("1 +", "unexpected 'end of rule'"),
    ("and > 1", "unexpected keyword 'and'"),
    ("'abc", "unexpected character"),
    ("'a\\'b' == 1", "unexpected character"),  # no escapes in strings
    ("max()", "unexpected ')'"),
    ("", "non-empty"),
    ("   ", "non-empty"),
    ("x @ y", "unexpected character '@'"),
    ("x ; y", "unexpected character ';'"),
])
def test_parse_errors(text, fragment):
    with pytest.raises(ExprError) as info:
        parse_expr(text)
    assert fragment in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("text, env, fragment", [
    ("a > 0", {}, "unknown name 'a'"),
    ("1 / a", {"a": 0}, "division by zero"),
    ("1 // a", {"a": 0}, "division by zero"),
    ("1 % a", {"a": 0}, "modulo by zero"),
    ("a + 1 > 0", {"a": None}, "arithmetic needs numbers"),
    ("a * 2 == 'xx'", {"a": "x"}, "arithmetic needs numbers"),  # no string arithmetic: 'a' * 10**10 is 10 GB
    ("2 ** a > 0", {"a": 65}, "exponent 65 is too large"),
    ("((2 ** 64) ** 64) ** 64 > 0", {}, "integer too large"),
])
def test_evaluation_errors(text, env, fragment):
    if fragment is None:
        assert parse_expr(text).evaluate(env) is True
        return
    with pytest.raises(ExprError, match=fragment):
        parse_expr(text).evaluate(env)


def test_parse_expr_rejects_non_strings():
    for bad in (None, 3, ["a > 0"]):
        with pytest.raises(ExprError):
            parse_expr(bad)


def test_static_choices_match_each_builders_spec():
    """``tileops.kernels.STATIC`` (what ``tileops check`` accepts in ``kernel.static``, read from each
    builder module's source) names spec fields with integer defaults in range; for ``rope`` exactly
    the fields a manifest sets (every other field the op derives from the call)."""
    import dataclasses

    from tileops.kernels import BUILDERS, SPECS, STATIC, get_builder, get_spec

    derived = {"rope": {"dtype", "head_dim", "rot", "pairing", "positions", "inverse", "backend", "transposed",
                        "mrope_section", "mrope_interleaved"}}
    assert set(STATIC) == set(SPECS) == set(BUILDERS) >= {"rope"}
    for name in BUILDERS:
        spec, build = get_spec(name), get_builder(name)
        assert dataclasses.is_dataclass(spec) and callable(build), name
        assert getattr(importlib.import_module(f"tileops.kernels.{name}"), "STATIC") == STATIC[name], name
        fields = {f.name for f in dataclasses.fields(spec)}
        assert set(STATIC[name]) <= fields, name
        if name in derived:
            assert set(STATIC[name]) == fields - derived[name], name
        for key, (low, high, _) in STATIC[name].items():
            assert isinstance(getattr(spec, key), int) and low <= getattr(spec, key) <= high, key


def test_a_schedule_switch_in_kernel_static_is_a_bool(tmp_path):
    """A ``STATIC`` range of ``(False, True)`` is a switch: the manifest gives ``true``/``false`` and the
    spec gets a bool; an integer there, or a bool for an integer choice, is a FILE:LINE error."""
    from tileops.kernels import STATIC
    from tileops.manifest import ManifestError
    from tileops.manifest.loader import load_file

    assert STATIC["prologue"]["share_angles"][:2] == (False, True)
    src = (Path(__file__).parent.parent / "manifests" / "attention" / "AttnPrologueFwdOp.yaml").read_text()
    line = "static: {min_blocks: 7, share_angles: true, reciprocal_scale: true}"
    assert line in src
    path = tmp_path / "AttnPrologueFwdOp.yaml"
    path.write_text(src.replace(line, "static: {min_blocks: 7, share_angles: true, pair_angles: false}"))
    static = load_file(path)[0].kernel.static
    assert static == {"min_blocks": 7, "share_angles": True, "pair_angles": False}  # the rest: the spec's
    assert type(static["share_angles"]) is bool and type(static["min_blocks"]) is int
    for bad, want in (("share_angles: 1", r"kernel.static.share_angles: expected a bool \(true or false\), found"),
                      ("min_blocks: true", r"kernel.static.min_blocks: expected an integer, found")):
        key = bad.split(":")[0]
        text = src.replace(line, line.replace(f"{key}: " + ("true" if key == "share_angles" else "7"), bad))
        assert text != src
        path.write_text(text)
        with pytest.raises(ManifestError, match=want) as e:
            load_file(path)
        assert e.value.line == _line_of(text, bad), str(e.value)


def test_builders_are_found_by_their_file(tmp_path):
    """A module of kernels/ with a module-level ``build`` is a builder (its STATIC read without
    importing it); a helper module without one is not; a STATIC that is not a literal is an error."""
    from tileops import kernels

    (tmp_path / "demo.py").write_text("import no_such_module\nSTATIC = {'threads': (1, 8, 'x')}\n"
                                      "def build(spec):\n    pass\n")
    (tmp_path / "helper.py").write_text("def load(x):\n    return x\n")
    assert kernels._declared(tmp_path / "demo.py") == (True, {"threads": (1, 8, "x")}, ())
    assert kernels._declared(tmp_path / "helper.py") == (False, {}, ())
    (tmp_path / "fused.py").write_text("import no_such_module\nSTATIC = {}\nUSES = ('norm',\n        'rope')\n"
                                       "def build(spec):\n    pass\n")
    assert kernels._declared(tmp_path / "fused.py") == (True, {}, ("norm", "rope"))  # read, not imported
    (tmp_path / "fused.py").write_text("STATIC = {}\nUSES = 'norm'\nbuild = None\n")
    with pytest.raises(ValueError, match=r"fused.py: USES must be a tuple of builder names"):
        kernels._declared(tmp_path / "fused.py")
    assert "storage" not in kernels.BUILDERS  # kernels/storage.py: helpers for every builder
    assert any(p.endswith("storage.py") for p in kernels.HELPERS)  # part of every kernel's cache key
    (tmp_path / "bad.py").write_text("LIMIT = 8\nSTATIC = {'threads': (1, LIMIT, 'x')}\nbuild = None\n")
    with pytest.raises(ValueError, match=r"bad.py:2: STATIC must be a literal"):
        kernels._declared(tmp_path / "bad.py")


# ------------------------------------------------------------------ untrusted manifests (data, never code)
_BASE = (BAD / "unknown_builder.yaml").read_text().replace("builder: ropee  # ERROR", "builder: rope")


def _attack(tmp_path, name: str, text: str) -> tuple[int, str]:
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "tileops", "check", str(path)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()
    assert len(line) == 1 and line[0].startswith(f"{path}:"), proc.stderr
    return int(line[0].split(":")[1]), line[0]


def _line_of(text: str, fragment: str) -> int:
    return text[: text.index(fragment)].count("\n") + 1


@pytest.mark.slow  # measured 5-38 s on 2 cores (pytest --durations); CI runs -m slow
def test_a_tag_that_would_build_an_object_is_refused_and_nothing_runs(tmp_path):
    witness = tmp_path / "ran"
    for tag in (f'!!python/object/apply:os.system ["touch {witness}"]', "!!python/name:os.system",
                "!!python/object:builtins.object {}", "!custom 3"):
        text = _BASE.replace("      default: 10000.0", f"      default: {tag}")
        line, msg = _attack(tmp_path, "tag", text)
        assert line == _line_of(text, tag) and "is not allowed: a manifest holds plain data" in msg, msg
    assert not witness.exists(), "a tag in a manifest ran code"


@pytest.mark.parametrize("rule,fragment", [
    ("x.__class__ == 1", "unexpected character '.'"),
    ("__import__('os') == 0", "unknown"),
    ("getattr(base, 'real') > 0", "unknown"),
    ("base > " + " + ".join(["1"] * 700), "rule too long"),
    ("base > " + "9" * 150, "number literal too long (150 characters; at most 100)"),
    ("base > " + "(" * 40 + "1" + ")" * 40, "parentheses nested 40 deep"),
])
def test_rule_expressions_that_reach_outside_the_language_are_refused(tmp_path, rule, fragment):
    text = _BASE.replace('{check: "base > 0"', '{check: "' + rule + '"')
    line, msg = _attack(tmp_path, "rule", text)
    assert line == _line_of(text, rule[:10]) and fragment in msg, msg


def test_a_ten_megabyte_string_is_refused_at_its_line(tmp_path):
    text = _BASE.replace("  summary: A minimal op", "  summary: " + "A" * (10 << 20) + " A minimal op")
    line, msg = _attack(tmp_path, "big", text)
    assert line == _line_of(text, "  summary:") and "a manifest line may have at most" in msg


def test_a_large_file_of_short_lines_is_refused(tmp_path):
    text = _BASE + "".join(f"# filler {i} {'x' * 60}\n" for i in range(20000))
    line, msg = _attack(tmp_path, "long", text)
    assert line == 1 and "file larger than" in msg


def test_deep_nesting_is_refused_without_recursion(tmp_path):
    text = _BASE.replace("  cases:", "  description: " + "[" * 5000 + "]" * 5000 + "\n  cases:")
    line, msg = _attack(tmp_path, "deep", text)
    assert line == _line_of(text, "  description:") and "nests at most 16 deep" in msg


@pytest.mark.slow  # measured 5-38 s on 2 cores (pytest --durations); CI runs -m slow
def test_anchors_and_aliases_are_refused(tmp_path):
    laughs = "lols: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
        f"lols{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 10))
    line, msg = _attack(tmp_path, "laughs", laughs + _BASE)
    assert line == 1 and "YAML anchor &a0 is not allowed" in msg
    text = _BASE.replace("    base:\n", "    base: *nothing\n    basis:\n")
    line, msg = _attack(tmp_path, "alias", text)
    assert line == _line_of(text, "*nothing") and "YAML alias *nothing is not allowed" in msg
