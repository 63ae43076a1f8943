"""Compile, on this machine (the CUDA toolkit, no GPU), the sm_90 kernels the H200's CUDA suite
would otherwise compile there, and pack them for the device machine.

    python -m benchmarks.device_cache [--jobs 2] [--out .devsite/kcache.tar.xz] [--tune OP,...] [--merge PACK ...]

What it compiles: every manifest case's kernels (``tileops warmup``'s list), the attention tests'
warm-up lists (``tests/test_attn_fwd_cuda.py``, ``tests/test_attn_bwd_cuda.py``,
``tests/test_attention_bwd_kernels.py``: their module fixtures, called with the arch set to sm_90),
the paged decode's tensor-core test cases (``tests/test_paged_decode_cuda.py``) and the ops the
Hugging Face GPU tests make (:func:`hf_jobs`). TileLang's own build
needs a driver only to link and to call a library's ``init()``:
:func:`tileops.compile.tilelang_api.driverless` stands in for both here. The index
(``$TILEOPS_CACHE_DIR/kernels``, default ``.kcache``) is packed with ``xz``: the libraries share
CUDA's static runtime, so 401 of them (411 MB) pack into 7.6 MB, within what the device call
carries. There:

    mkdir -p .kcache-gpu && tar -xJf .devsite/kcache.tar.xz -C .kcache-gpu
    TILEOPS_CACHE_DIR=$PWD/.kcache-gpu python3 -m pytest -m cuda ...

The index's keys hold the builder sources, TileLang's version, the arch and the machine, not
Python's version, so this machine's 3.11 serves the device's 3.12. Measured 2026-12-04: ~1,530 s on 2
cores; the H200 then built none of them (``benchmarks/NOTES.md``). This saves the device's minutes, the
scarce ones: its backward tests had spent a whole call compiling.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import time
import types
from pathlib import Path

ARCH = "sm_90"
ROOT = Path(__file__).resolve().parent.parent


def _fixture(fix):
    """A pytest fixture's own function."""
    for attr in ("__wrapped__", "_fixture_function"):
        if hasattr(fix, attr):
            return getattr(fix, attr)
    return fix.__pytest_wrapped__.obj


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_jobs() -> list[tuple]:
    """The kernel jobs of the attention tests' warm-up fixtures, as on an H200 (sm_90)."""
    import torch

    import tileops.attention.builtin  # noqa: F401
    import tileops.compile.build as build
    import tileops.compile.warmup as warmup
    import tileops.norm.builtin  # noqa: F401
    import tileops.rope.builtin  # noqa: F401

    # (the families' kernel modules bind ``device_backend`` by name when first imported: imported under the
    # stand-in below, they kept it, and hf_jobs' CPU models then built CUDA kernels and failed)
    jobs: list[tuple] = []
    saved = warmup.compile_jobs, build.device_backend, torch.cuda.is_available
    warmup.compile_jobs = lambda todo, *a, **k: jobs.extend(todo) or (0, 0.0, [])
    build.device_backend = lambda device: ("cuda", ARCH)
    torch.cuda.is_available = lambda: True
    sys.path.insert(0, str(ROOT))
    try:
        _fixture(_module("test_attn_fwd_cuda").warm)()
        bwd = _module("test_attn_bwd_cuda")
        items = [types.SimpleNamespace(name=f"test_cuda_gradients[{i}]",
                                       callspec=types.SimpleNamespace(params={"name": i})) for i in bwd.IDS]
        _fixture(bwd.warm)(types.SimpleNamespace(session=types.SimpleNamespace(items=items)))
        kernels = _module("test_attention_bwd_kernels")
        _fixture(kernels.warm_masks)()
        items = [types.SimpleNamespace(name=f"test_cuda_head_dims[{d}]", callspec=types.SimpleNamespace(
            params={"d": d, "dtype": dt})) for d in kernels.HEAD_DIMS for dt in kernels.DTYPES]
        _fixture(kernels.warm_head_dims)(types.SimpleNamespace(session=types.SimpleNamespace(items=items)))
    finally:
        warmup.compile_jobs, build.device_backend, torch.cuda.is_available = saved
    # the paged decode's tensor-core cases and the ops its other tests make (TileLang's own build: they
    # take dynamic shared memory), and the rows of benchmarks.decode
    decode = _module("test_paged_decode_cuda")
    jobs += decode.mma_kernel_jobs(ARCH) + decode.decode_kernel_jobs(ARCH)
    from benchmarks.decode import schedule_specs

    jobs += schedule_specs({})
    # the rope schedules test_cuda.py runs straight into NaN-filled outputs (TileLang's nvcc build took that
    # test 275 s on the H200 when it compiled them there)
    jobs += _module("test_cuda").every_element_jobs(ARCH)
    return jobs


def hf_jobs() -> list[tuple]:
    """The kernel jobs of the Hugging Face GPU tests (``tests/test_hf_attention.py``'s bf16 models,
    ``tests/test_hf_prologue.py``'s decode route): the attention and paged decode ops their patched
    tiny models make, recorded from the same models run on the CPU (fp32 forwards; the decode route's
    own CPU dry run), then compiled for sm_90 in bf16. Without them the H200 built them in the tests,
    ~20 s a program, one test after another in its worker (the fourth call of the eighth session was
    cut with three of these tests still building)."""
    import torch

    from tileops.attention import AttnFwdOp, PagedAttnDecodeFwdOp
    from tileops.compile.warmup import op_kernel_jobs

    sys.path.insert(0, str(ROOT))
    made: dict[tuple, tuple[str, dict]] = {}
    inits = {cls: cls.__init__ for cls in (AttnFwdOp, PagedAttnDecodeFwdOp)}

    def recording(cls):
        def init(self, *a, **k):
            inits[cls](self, *a, **k)
            made[(cls.__name__, *sorted(self.params.items()))] = (cls.__name__, dict(self.params))
        return init

    for cls in inits:
        cls.__init__ = recording(cls)
    try:
        hf = importlib.import_module("tests.test_hf_attention")
        gen = torch.Generator().manual_seed(0)
        for kind in hf.KINDS:
            model = hf._model(kind, gen)
            hf._patch(model)
            with torch.no_grad():
                model(torch.randint(3, 128, (1, 12), generator=gen))
        pro = importlib.import_module("tests.test_hf_prologue")
        for kind, config in pro.D64_CONFIGS.items():
            pro.check_bf16_generate(kind, False, gen, "cpu", config=config(), attention=True)
    finally:
        for cls, init in inits.items():
            cls.__init__ = init
    jobs: list[tuple] = []
    for name, p in made.values():
        if name == "AttnFwdOp":
            dims = {"q_dim": p["head_dim"], "q_heads": p["num_q_heads"], "kv_heads": p["num_kv_heads"]}
        else:
            dims = {"q_dim": p["head_dim"], "q_heads": p["num_q_heads"], "cache_heads": p["num_kv_heads"]}
        jobs += op_kernel_jobs(name, p, dims, ["bfloat16"], ARCH, with_inputs=())
    return list(dict.fromkeys(jobs))


def tune_jobs(ops: list[str], cases: "list[str] | None") -> list[tuple]:
    """The kernels of every candidate of the CUDA schedule space of ``ops``, for each of their cases (or
    those labelled ``cases``) in each of its dtypes: what ``tileops tune OP --cases ...`` builds."""
    from tileops import schedules
    from tileops.compile.warmup import kernel_jobs
    from tileops.manifest import registry

    known = {c.label for n in ops if n in registry() for c in registry()[n].cases}
    unknown = sorted(set(cases or ()) - known)
    if unknown:  # a label of no case builds nothing: say so instead of packing a cache without it
        raise SystemExit(f"--tune-cases: {unknown[0]!r} is no case of {', '.join(ops)}; cases: "
                         f"{', '.join(sorted(known))}")
    return [j for j in kernel_jobs(ops, ARCH, schedules.space_for("cuda"), cases) if j[2] == "cuda"]


#: an index entry's two files (the lock file is neither)
_ENTRY = re.compile(r"([0-9a-f]{32})\.(json|so)")


def merge(kernels: Path, packs: list[str]) -> set[str]:
    """Add to the index folder ``kernels`` the entries of ``packs``: the ``new-kernels-KofN.tar.xz``
    files ``benchmarks/device/suite.sh`` brings back, the kernels a device run of the suite still built
    there (185 of them on the H100, 2026-12-05: norm, rope and prologue variants the tests make beyond
    the manifests' cases, which :func:`test_jobs` does not list). Only ``kernels/<key>.json`` and
    ``kernels/<key>.so`` members are taken; a pack holding anything else is refused whole. Returns the
    keys added, which ``--prune`` keeps: no kernel of this run names them."""
    import tarfile

    keys: set[str] = set()
    for pack in packs:
        if not os.path.isfile(pack):
            raise SystemExit(f"--merge: expected a pack file (new-kernels-KofN.tar.xz), got {pack!r}: no such file")
        with tarfile.open(pack, "r:*") as tar:
            members = [m for m in tar.getmembers() if not (m.isdir() and m.name.rstrip("/") == "kernels")]
            odd = [m.name for m in members if not (m.isfile() and m.name.startswith("kernels/")
                                                   and _ENTRY.fullmatch(m.name[len("kernels/"):]))]
            if odd:
                raise SystemExit(f"--merge {pack}: expected only kernels/<32 hex>.json and .so entries, got "
                                 f"{odd[0]!r}")
            for m in members:
                name = m.name[len("kernels/"):]
                with tar.extractfile(m) as src, open(kernels / name, "wb") as dst:
                    dst.write(src.read())
                keys.add(name.split(".")[0])
    return keys


def prune(kernels: Path, jobs: list[tuple], keep: "set[str]" = frozenset()) -> int:
    """Remove the entries of the index folder ``kernels`` that none of ``jobs`` is found under (either
    build's key, :func:`tileops.compile.build.index_key`) and ``keep`` does not name; the number of
    entries removed."""
    from tileops.compile.build import index_key

    keep = set(keep) | {index_key(*j, lean=lean) for j in jobs for lean in (True, False)}
    stale = {m[1] for f in kernels.iterdir() if (m := _ENTRY.fullmatch(f.name)) and m[1] not in keep}
    for key in stale:
        for suffix in (".json", ".so"):
            (kernels / f"{key}{suffix}").unlink(missing_ok=True)
    return len(stale)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=None, help="compiles at once (default: one per CPU core)")
    ap.add_argument("--out", default=str(ROOT / ".devsite" / "kcache.tar.xz"))
    ap.add_argument("--decode-sweep", default="", help="also the kernels of `python -m benchmarks.decode --sweep "
                                                       "THIS` (THREADSxUNROLL[xPREFETCH[xSTAGES]],...)")
    ap.add_argument("--attention-configs", default="", help="also the kernels of `python -m benchmarks.attention "
                                                            "--configs THIS` (BMxBNxSTAGESxTHREADS[xPIPELINE],...)")
    ap.add_argument("--attention-rows", default=None, help="with --attention-configs: its --rows (default: the "
                                                           "table's); --attention-dtypes: its --dtypes")
    ap.add_argument("--attention-dtypes", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tune", default="", help="also every candidate of these ops' CUDA schedule spaces, for "
                                               "each of their cases (OP,...: what `tileops tune OP` builds)")
    ap.add_argument("--tune-cases", default="", help="with --tune: only these cases (LABEL,...: `tileops tune "
                                                     "--cases`)")
    ap.add_argument("--merge", nargs="*", default=[], metavar="PACK",
                    help="also the index entries of these packs: a device run's new-kernels-KofN.tar.xz "
                         "(benchmarks/device/suite.sh), the kernels the suite built there; --prune keeps them")
    ap.add_argument("--prune", action="store_true", help="before packing, remove the index's entries that no kernel "
                                                        "of this run names (an earlier source's: every builder "
                                                        "edit moves its kernels' keys, and stale entries only "
                                                        "swell the pack)")
    a = ap.parse_args()
    os.environ.setdefault("TILEOPS_CACHE_DIR", str(ROOT / ".kcache"))
    from tileops import schedules
    from tileops.compile.warmup import compile_jobs, kernel_jobs
    from tileops.manifest import registry

    t0 = time.perf_counter()
    # the shipped tables' choices too (what `tileops warmup` builds)
    jobs = [j for j in kernel_jobs(list(registry()), ARCH, schedules.shipped_for(ARCH)) if j[2] == "cuda"]
    jobs += test_jobs() + hf_jobs()
    if a.tune:
        jobs += tune_jobs(a.tune.split(","), a.tune_cases.split(",") if a.tune_cases else None)
        jobs = list(dict.fromkeys(jobs))
    if a.decode_sweep:
        from benchmarks.decode import parse_sweep, schedule_specs

        jobs += [j for c in parse_sweep(a.decode_sweep) for j in schedule_specs(c)]
    if a.attention_configs:
        from benchmarks import attention

        work = attention.work_list(**({"rows": a.attention_rows} if a.attention_rows else {}),
                                   dtypes=a.attention_dtypes)
        jobs += attention.kernel_jobs(work, [attention.parse_config(c) for c in a.attention_configs.split(",")], ARCH)
        jobs = list(dict.fromkeys(jobs))
    index = os.environ["TILEOPS_CACHE_DIR"]
    (Path(index) / "kernels").mkdir(parents=True, exist_ok=True)
    merged = merge(Path(index) / "kernels", a.merge)  # first: a job among them is not compiled again
    if a.merge:
        print(f"merged {len(merged)} entries from {len(a.merge)} packs into {index}/kernels", flush=True)
    n, seconds, failures = compile_jobs(jobs, a.jobs, progress=True)
    print(f"{n} kernels for {ARCH} in the index ({seconds:.0f} s); {len(failures)} failed", flush=True)
    for spec, err in failures:
        print(f"  {spec}: {err}", file=sys.stderr)
    if a.prune:
        print(f"pruned {prune(Path(index) / 'kernels', jobs, merged)} stale entries from {index}/kernels",
              flush=True)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    print(f"packing {index}/kernels into {a.out} (xz -9e: ~2-3 min on 2 cores) ...", flush=True)
    with open(a.out, "wb") as out:
        tar = subprocess.Popen(["tar", "-C", index, "-cf", "-", "kernels"], stdout=subprocess.PIPE)
        subprocess.run(["xz", "-9e", "-T2", "--lzma2=dict=192MiB"], stdin=tar.stdout, stdout=out, check=True)
        tar.wait()
    print(f"{a.out}: {os.path.getsize(a.out) / 1e6:.1f} MB ({time.perf_counter() - t0:.0f} s in all)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
