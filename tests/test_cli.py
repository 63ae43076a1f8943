"""The command line: list, show, check, demo."""

from __future__ import annotations

import io
import subprocess
import sys
from contextlib import redirect_stdout

from tileops.cli import main


def run(*args: str) -> tuple[int, str]:
    buf = io.StringIO()
    with redirect_stdout(buf):
        code = main(list(args))
    return code, buf.getvalue()


def test_list_shows_every_manifest_op():
    from tileops.manifest import registry

    code, out = run("list")
    assert code == 0
    names = sorted(registry())
    assert len(names) >= 8  # the RoPE family at least
    listed = sorted(line.split()[0] for line in out.strip().splitlines())
    assert listed == names


def test_show_prints_params_and_cases():
    code, out = run("show", "RoPENeoxPositionIdsFwdOp")
    assert code == 0
    assert "max_position: int (required)" in out and "rotary_dim" in out and "ids-2k" in out


def test_show_unknown_op():
    code, _ = run("show", "NoSuchOp")
    assert code == 2


def test_check_packaged():
    code, out = run("check")
    from tileops.manifest import registry

    assert code == 0 and f"ok: {len(registry())} ops" in out


def test_check_reports_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("MyOp:\n  family: rope\n  sumary: typo\n")
    code, out = run("check", str(bad))
    assert code == 1
    assert f"{bad}:3:" in out and "sumary" in out


def test_module_entry_point():
    done = subprocess.run([sys.executable, "-m", "tileops", "list"], capture_output=True, text=True, check=True)
    assert "RoPEFwdOp" in done.stdout


def test_demo_passes_on_cpu():
    code, out = run("demo", "--device", "cpu")
    assert code == 0, out
    from tileops.manifest import registry

    assert f"{len(registry())} ok, 0 mismatched" in out


def test_demo_device_is_checked(capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["demo", "--device", "bogus"])
    err = capsys.readouterr().err
    assert "--device" in err and "expected cpu, cuda or cuda:N" in err and "'bogus'" in err


def test_lowered_refuses_an_arch_the_lean_build_lacks_and_bad_jobs(capsys, monkeypatch):
    from tileops import lowered

    monkeypatch.setattr(lowered, "write", lambda *a, **k: (_ for _ in ()).throw(AssertionError("wrote")))
    for argv, what in ((["lowered", "--arch", "sm_75"], "--arch: expected sm_XX with XX >= 80"),
                       (["lowered", "--arch", "c"], "--arch: expected sm_XX"),
                       (["lowered", "--jobs", "0"], "--jobs: expected a positive number, got 0")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert what in err, err
