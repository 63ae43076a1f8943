"""The builder digest (part of every kernel's cache key) follows ``USES``: a builder that composes
other builders' stages is re-keyed when any of them is edited, and only then.

Throwaway builders live in a temp family root named by ``TILEOPS_FAMILY_PATH``, read by
subprocesses, so this process's registries and the repository's files stay as they are."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_BUILDER = textwrap.dedent('''\
    """A throwaway builder for tests/test_builder_digest.py ({note})."""
    {uses}
    STATIC = {{}}


    def build(spec):
        raise NotImplementedError("never built: only its digest is read")


    Spec = dict
    ''')

_DIGESTS = ("import json, sys\n"
            "from tileops.compile.build import builder_digest\n"
            "out = {}\n"
            "for name in sys.argv[1:]:\n"
            "    try:\n"
            "        out[name] = builder_digest(name)\n"
            "    except KeyError as e:\n"
            "        out[name] = 'KeyError: ' + str(e)\n"
            "print(json.dumps(out))\n")


def _write(root: Path, name: str, uses: tuple[str, ...] | None, note: str = "v1") -> None:
    line = "" if uses is None else f"USES = {uses!r}\n"
    (root / "kernels" / f"{name}.py").write_text(_BUILDER.format(note=note, uses=line))


def _digests(root: Path, *names: str) -> dict[str, str]:
    env = {**os.environ, "TILEOPS_FAMILY_PATH": str(root)}
    proc = subprocess.run([sys.executable, "-c", _DIGESTS, *names], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "kernels").mkdir()
    _write(tmp_path, "zz_user", ("zz_used", "norm"))
    _write(tmp_path, "zz_used", ("zz_deep",))
    _write(tmp_path, "zz_deep", ("zz_user",))  # a cycle back to the user: followed once, no loop
    _write(tmp_path, "zz_plain", None)
    _write(tmp_path, "zz_bad", ("zz_used", "nrom"))
    return tmp_path


def test_editing_a_used_builder_rekeys_its_users_only(root: Path):
    names = ("zz_user", "zz_used", "zz_deep", "zz_plain", "rope", "norm")
    before = _digests(root, *names)
    assert len(set(before.values())) == len(names), before  # every builder its own key
    _write(root, "zz_deep", ("zz_user",), note="v2")  # used by zz_used, so by zz_user through it
    after = _digests(root, *names)
    changed = {n for n in names if after[n] != before[n]}
    assert changed == {"zz_user", "zz_used", "zz_deep"}, (before, after)
    _write(root, "zz_plain", None, note="v2")
    assert {n for n, d in _digests(root, *names).items() if d != after[n]} == {"zz_plain"}


def test_a_builder_without_uses_hashes_its_file_and_the_helpers_alone(root: Path):
    """The digest of a builder that declares no ``USES`` is what it was before ``USES`` existed:
    the sha256 of its own file's sha256 and each helper module's, in order."""
    import tileops.kernels as kernels

    for name in ("rope", "norm", "ntk"):
        assert kernels.USES[name] == ()
        digest = hashlib.sha256()
        for path in (kernels.FILES[name], *kernels.HELPERS):
            digest.update(hashlib.sha256(Path(path).read_bytes()).digest())
        assert _digests(root, name)[name] == digest.hexdigest()


def test_an_unknown_name_in_uses_is_an_error_naming_it(root: Path):
    got = _digests(root, "zz_bad")["zz_bad"]
    assert got.startswith("KeyError: ") and "zz_bad.py: USES names 'nrom', which is not a kernel builder" in got, got
