"""The command line: list, show, check, demo."""

from __future__ import annotations

import io
import re
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


def test_check_reports_file_and_line_on_stderr(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("MyOp:\n  family: rope\n  sumary: typo\n")
    assert main(["check", str(bad)]) == 1
    got = capsys.readouterr()
    assert f"{bad}:3:" in got.err and "sumary" in got.err and got.out == ""


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
    from tileops.compile import warmup

    monkeypatch.setattr(warmup, "write_lowered", lambda *a, **k: (_ for _ in ()).throw(AssertionError("wrote")))
    for argv, what in ((["lowered", "--arch", "sm_75"], "--arch: expected sm_XX with XX >= 80"),
                       (["lowered", "--arch", "c"], "--arch: expected sm_XX"),
                       (["lowered", "--jobs", "0"], "--jobs: expected a positive number, got 0")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert what in err, err


def test_arch_is_refused_at_once_naming_the_flag_by_every_subcommand(capsys, monkeypatch):
    """sm_75 ran 12 minutes of ``cannot find -lcuda`` in ``warmup`` on a machine without a GPU; now
    every ``--arch`` goes through one check before anything is compiled or lowered."""
    from tileops.compile import warmup

    boom = lambda *a, **k: (_ for _ in ()).throw(AssertionError("ran"))  # noqa: E731
    monkeypatch.setattr(warmup, "warmup", boom)
    monkeypatch.setattr(warmup, "write_lowered", boom)
    monkeypatch.setattr("tileops.compile.build.emit_source", boom)
    for cmd in (["warmup"], ["emit", "RoPEFwdOp"], ["lowered"]):
        for arch, what in (("sm_75", "expected sm_XX with XX >= 80"), ("sm90", "expected sm_XX"),
                           ("gfx90a", "expected sm_XX")):
            assert main([*cmd, "--arch", arch]) == 2
            err = capsys.readouterr().err
            assert err.startswith(f"tileops {cmd[0]}: --arch: {what}") and repr(arch) in err, err


def test_warmup_refuses_a_cuda_arch_without_the_toolkit(capsys, monkeypatch):
    from tileops.compile import cuda_build, warmup

    monkeypatch.setattr(warmup, "warmup", lambda *a, **k: (_ for _ in ()).throw(AssertionError("ran")))

    def no_toolkit(*a):
        raise cuda_build.Unsupported("no CUDA toolkit found (CUDA_HOME, nvcc on PATH, /usr/local/cuda)")

    monkeypatch.setattr(cuda_build, "cuda_home", no_toolkit)
    monkeypatch.setattr(cuda_build, "_toolkit_dirs", no_toolkit)
    assert main(["warmup", "--arch", "sm_90"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tileops warmup: --arch: building for sm_90 needs the CUDA toolkit") and "--arch c" in err


def test_emit_and_warmup_default_to_this_machine(monkeypatch):
    import torch

    from tileops.compile.warmup import default_arch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_arch() == "c"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert default_arch() == "sm_90"
    from tileops.cli import parser

    for cmd in (["warmup"], ["emit", "RoPEFwdOp"]):
        assert parser().parse_args(cmd).arch is None  # resolved by default_arch() when the command runs


def test_version_bare_command_and_subcommand_help(capsys):
    import importlib.metadata

    import pytest

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"tileops {importlib.metadata.version('tileops')}\n"
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: tileops") and "warmup" in out and "demo" in out
    from tileops.cli import parser

    sub = next(a for a in parser()._actions if a.dest == "cmd")
    for name, p in sub.choices.items():  # every subcommand's --help opens with a description
        assert p.description and len(p.description) > 30, name
        assert any(c.dest == name for c in sub._choices_actions), name  # and has a line in `tileops --help`


def test_warmup_prints_a_line_per_kernel_when_not_a_terminal(capsys, monkeypatch):
    from tileops.runtime import native
    from tileops.compile import warmup

    monkeypatch.setattr(warmup, "_compile", lambda job: None)  # the steps, not the compiles
    monkeypatch.setattr("tileops.compile.build.indexed", lambda *job: False)  # none cached by an earlier run
    monkeypatch.setattr(native, "build", lambda progress=None: None)
    jobs = warmup.kernel_jobs(["RoPEFwdOp"], "c")
    assert main(["warmup", "RoPEFwdOp", "--arch", "c", "--jobs", "1"]) == 0
    got = capsys.readouterr()
    steps = [line for line in got.err.splitlines() if line.startswith("[")]
    n = len(jobs)
    assert len(steps) == n and steps[0].startswith(f"[{1:>{len(str(n))}}/{n}] rope ") and steps[-1].startswith(f"[{n}/{n}]")
    assert f"{n} of {n} kernels for c in the cache" in got.out


def test_demo_reports_each_first_call_on_stderr(capsys):
    from tileops.manifest import registry

    rc = main(["demo", "--device", "cpu"])
    got = capsys.readouterr()
    assert rc == 0, got.out  # the table says which op mismatched
    err = got.err
    n = len(registry())
    # the progress lines, "[ 3/12] ...": not TVM's own log lines, "[05:14:31] ... Warning: ...", which a
    # cold kernel compile prints on stderr too (seen failing this test on a cold cache under load)
    steps = [line for line in err.splitlines() if re.match(r"\[\s*\d+/\d+\] ", line)]
    assert len(steps) == n and "RoPEFwdOp" in err and "first call" in steps[0]
