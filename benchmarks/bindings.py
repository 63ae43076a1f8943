"""Every binding the families make for a fixed set of calls, as on an H200, on this machine:
``python -m benchmarks.bindings OUT.json`` (then ``--diff A.json B.json``).

The families' host side runs as on sm_90 (``device_backend`` answers cuda, every kernel is a stand-in
with the real argument names and the CUDA kernels' dynamic extents taken as they come), on CPU tensors:
each call's :class:`tileops.runtime.binding.Binding` (argument values by name, pointer slots and
their alignments, output modes and strides) is recorded when the runtime would run it, and nothing is
launched; a call that is refused records its error. ``tests/test_cuda_bindings.py`` compares a fresh
recording with ``tests/golden/cuda_bindings.json``; ``--diff`` compares two recordings by argument (run
it on two trees with ``PYTHONPATH=<other tree>``): a refactor of how calls meet kernels should move no
argument a CUDA kernel takes. Rope (2d, 1d, ids, MRoPE; keys, HF views, long head-major views, views off
the vectors, out given and in place), the norms, the prologue (NHD, HND; qkv, caches and q_out off the
vectors), the paged decode and attention (dense, HF views, varlen) are covered; the backward passes are
not (they need a forward's lse and autograd).
"""

import argparse
import array
import json
import os
import re
import types

import torch

import tileops.compile.build as build


class Stop(Exception):
    """Where a recorded call stops: at the runtime, before anything would launch."""


class _Slots(dict):
    """A stand-in kernel's argument slots: its parameters, then any other name asked for (the CUDA
    kernels take their dynamic extents as arguments too, which ``spec.args`` does not list)."""

    def __init__(self, kernel: "_Kernel"):
        super().__init__({n: i for i, n in enumerate(kernel.arg_names)})
        self.kernel = kernel

    def __contains__(self, name: object) -> bool:
        return True

    def __missing__(self, name: str) -> int:
        self[name] = len(self)
        self.kernel.arg_names += (name,)
        return self[name]


class _Kernel:
    """What a binding asks of a kernel, with the real kernel's argument names (floats kept in micro-units)."""

    def __init__(self, names):
        self.arg_names = tuple(names)
        self.slot = _Slots(self)
        self.device_index = None

    def template(self, values):
        args = array.array("q", bytes(8 * (len(self.slot) + len(values))))
        for n, v in values.items():
            args[self.slot[n]] = v if isinstance(v, int) else int(round(v * 1e6))
        return args


def _stand_in(builder, spec, backend, arch, device, args, op_name=None, **kw):
    return _Kernel(args)


def _as_h200() -> None:
    """The families' kernel sets answer as on an H200: the cuda backend at sm_90, stand-in kernels, 132 SMs."""
    import tileops.attention.attn_builtin as atb
    import tileops.attention.builtin as ab
    import tileops.attention.decode_builtin as db
    import tileops.norm.builtin as nb
    import tileops.rope.builtin as rb

    for m in (rb, nb, ab, db, atb, build):
        if hasattr(m, "device_backend"):
            m.device_backend = lambda device: ("cuda", "sm_90")
        if hasattr(m, "load_kernel"):
            m.load_kernel = _stand_in
    torch.cuda.get_device_properties = lambda d: types.SimpleNamespace(multi_processor_count=132)
    os.environ["TILEOPS_ATTENTION_CUDA"] = "1"


def _record(b) -> dict | None:
    """A binding as data: what a CUDA kernel would take, by argument name (addresses bound per call as
    values, the tables' and an lse's, left out: they differ from run to run)."""
    if b is None:
        return None
    out = {
        f: repr(getattr(b, f, None))
        for f in (
            "names",
            "inputs",
            "outputs",
            "likes",
            "strides",
            "sizes",
            "dtypes",
            "checks",
            "checked",
            "word_slot",
            "tag_slot",
            "work",
            "work_bytes",
            "scalars",
        )
    }
    out["late"] = repr(tuple(s for s, _ in b.late))
    out["launches"] = [
        {
            "values": {
                n: run.template[i]
                for i, n in enumerate(run.kernel.arg_names)
                if run.template[i] and n not in ("TD", "LSE")
            },
            "pointers": {run.kernel.arg_names[s]: a for _, s, a in run.pointers},
        }
        for run in b.launches
    ]
    return out


def _armed(op, got: list) -> None:
    """``op``'s runtime records each binding it is asked to run, and stops the call there."""
    rt = op._runtime

    class Recorder:
        def __getattr__(self, n):
            return getattr(rt, n)

        def execute(self, b, *a, **k):
            got.append(_record(b))
            raise Stop()

    op._runtime = Recorder()
    op._native_run = None


def _cases() -> list:
    """(name, op, calls): each call a new signature of the op, many of them views the kernels take only
    through the fit policy (copies, buffers)."""
    g = torch.Generator().manual_seed(5)

    def rn(*s, dt=torch.bfloat16):
        return torch.randn(*s, generator=g).to(dt)

    from tileops.attention import AttnFwdOp, AttnPrologueFwdOp, PagedAttnDecodeFwdOp
    from tileops.norm import LayerNormFwdOp, RMSNormFwdOp
    from tileops.rope import MRoPEFwdOp, RoPEFwdOp, RoPENeoxPositionIdsFwdOp

    def off(shape, dt=torch.bfloat16, by=1):  # a tensor starting `by` elements into a 16-byte vector
        n = 1
        for s in shape:
            n *= s
        return torch.zeros(n + by, dtype=dt)[by:].view(shape)

    cases = []
    op = RoPEFwdOp("neox", "2d")
    cases.append(
        (
            "rope2d",
            op,
            [
                lambda: op(rn(2, 16, 4, 64)),
                lambda: op(rn(2, 16, 4, 64), key=rn(2, 16, 2, 64)),
                lambda: op(rn(2, 4, 16, 64).transpose(1, 2), key=rn(2, 2, 16, 64).transpose(1, 2)),
                lambda: op(rn(1, 4, 8192, 64).transpose(1, 2)),
                lambda: op(rn(2, 16, 4, 64), position_ids=torch.arange(16).repeat(2, 1)),
                lambda: op(rn(2, 16, 4, 72)[..., :64]),
                lambda: op(off((2, 16, 4, 64))),
                lambda: op(rn(2, 16, 4, 64), out=off((2, 16, 4, 64))),
                lambda: (lambda y: op(y, out=y))(off((2, 16, 4, 64))),
                lambda: op(rn(2, 16, 4, 64, dt=torch.float32)),
            ],
        )
    )
    op1 = RoPEFwdOp("interleaved", "1d")
    cases.append(("rope1d", op1, [lambda: op1(rn(16, 64)), lambda: op1(rn(16, 72)[:, :64]), lambda: op1(rn(1, 64))]))
    opm = MRoPEFwdOp([8, 12, 12], "2d")
    cases.append(("mrope", opm, [lambda: opm(rn(2, 16, 4, 64), position_ids=torch.arange(16).repeat(3, 2, 1))]))
    opi = RoPENeoxPositionIdsFwdOp(4096)
    cases.append(
        (
            "ids",
            opi,
            [lambda: opi(rn(16, 4, 64), torch.arange(16)), lambda: opi(rn(16, 4, 72)[..., :64], torch.arange(16))],
        )
    )
    rms = RMSNormFwdOp()
    w = rn(64)
    cases.append(
        (
            "rms",
            rms,
            [
                lambda: rms(rn(8, 12, 64), w),
                lambda: rms(rn(8, 12, 64)[:, 4:8], w),
                lambda: rms(rn(8, 12, 64)[:, ::2], w),
                lambda: rms(rn(8, 12, 72)[..., :64], w),
                lambda: rms(off((8, 64)), w),
                lambda: rms(rn(8, 64), off((64,))),
                lambda: rms(rn(8, 64), w, residual=rn(8, 64)),
                lambda: rms(rn(4096, 64), rn(64)),
            ],
        )
    )
    ln = LayerNormFwdOp()
    cases.append(("ln", ln, [lambda: ln(rn(6, 64), rn(64), rn(64)), lambda: ln(rn(6, 128)[:, ::2], rn(64), rn(64))]))
    for layout in ("NHD", "HND"):
        pro = AttnPrologueFwdOp(4, 2, 64, RoPEFwdOp("neox", "1d"), qk_norm=True, eps=1e-6, cache_layout=layout)

        def mk(tokens=5, wide=0, pro=pro, layout=layout, q_out=None, pad=0):  # pad: a cache row's padding
            qkv = rn(tokens, 8 * 64 + wide)[:, : 8 * 64]
            kc = torch.zeros((4, 16, 2, 64 + pad) if layout == "NHD" else (4, 2, 16, 64 + pad), dtype=torch.bfloat16)
            kc, vc = kc[..., :64], torch.zeros_like(kc)[..., :64]
            return pro(
                qkv,
                torch.arange(tokens),
                kc,
                vc,
                torch.arange(tokens) * 3,
                q_norm_weight=rn(64),
                k_norm_weight=rn(64),
                q_out=q_out,
            )

        cases.append(
            (
                f"pro{layout}",
                pro,
                [
                    mk,
                    lambda mk=mk: mk(7, 16),
                    lambda mk=mk: mk(1),
                    lambda mk=mk: mk(5, q_out=rn(5, 4, 72)[..., :64]),
                    lambda mk=mk: mk(5, 4),  # qkv's row stride off the vectors: refused
                    lambda mk=mk: mk(5, pad=4),  # the caches' strides off them: refused
                    lambda mk=mk: mk(5, pad=8),  # padded rows on them: bound
                ],
            )
        )
    for layout in ("NHD", "HND"):
        dec = PagedAttnDecodeFwdOp(8, 2, 64, cache_layout=layout)

        def dk(batch=2, offq=False, dec=dec, layout=layout, out=None, pad=0):
            kc = rn(*((16, 16, 2, 64 + pad) if layout == "NHD" else (16, 2, 16, 64 + pad)))
            kc, vc = kc[..., :64], rn(*kc.shape)[..., :64]
            q = off((batch, 8, 64)) if offq else rn(batch, 8, 64)
            bt = torch.arange(batch * 4).view(batch, 4) % 16
            return dec(q, kc, vc, bt.to(torch.int32), torch.tensor([50, 7, 33][:batch], dtype=torch.int32), out=out)

        cases.append(
            (
                f"dec{layout}",
                dec,
                [
                    dk,
                    lambda dk=dk: dk(3),
                    lambda dk=dk: dk(2, True),
                    lambda dk=dk: dk(1),
                    lambda dk=dk: dk(2, out=off((2, 8, 64))),
                    lambda dk=dk: dk(2, pad=4),  # the caches' strides off the vectors: refused
                ],
            )
        )
    att = AttnFwdOp(4, 2, 64, causal=True)
    cases.append(
        (
            "attn",
            att,
            [
                lambda: att(rn(2, 16, 4, 64), rn(2, 16, 2, 64), rn(2, 16, 2, 64)),
                lambda: att(
                    rn(2, 4, 16, 64).transpose(1, 2), rn(2, 2, 16, 64).transpose(1, 2), rn(2, 2, 16, 64).transpose(1, 2)
                ),
                lambda: att(rn(1, 16, 4, 64), rn(1, 16, 2, 64), rn(1, 16, 2, 64)),
                lambda: att(off((2, 8, 4, 64)), rn(2, 8, 2, 64), rn(2, 8, 2, 64)),
                lambda: att(rn(2, 8, 4, 72)[..., :64], rn(2, 8, 2, 64), rn(2, 8, 2, 64)),
                # with the lse (return_lse, or a training call's forward): its plan's second output
                lambda: att(rn(2, 16, 4, 64), rn(2, 16, 2, 64), rn(2, 16, 2, 64), return_lse=True),
                lambda: att(
                    rn(2, 4, 16, 64).transpose(1, 2),
                    rn(2, 2, 16, 64).transpose(1, 2),
                    rn(2, 2, 16, 64).transpose(1, 2),
                    return_lse=True,
                ),
            ],
        )
    )
    attv = AttnFwdOp(4, 2, 64)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    cases.append(
        ("attnv", attv, [lambda: attv(rn(12, 4, 64), rn(12, 2, 64), rn(12, 2, 64), cu_seqlens_q=cu, cu_seqlens_k=cu),
                         lambda: attv(rn(12, 4, 64), rn(12, 2, 64), rn(12, 2, 64), cu_seqlens_q=cu, cu_seqlens_k=cu,
                                      return_lse=True)])
    )

    return cases


def record(path: str) -> None:
    _as_h200()
    rec = []
    for name, op, calls in _cases():
        for i, call in enumerate(calls):
            got: list = []
            _armed(op, got)
            try:
                call()
                rec.append([f"{name}#{i}", "ran", None])
            except Stop:
                rec.append([f"{name}#{i}", "bound", got[-1]])
            except Exception as e:  # a refusal is behaviour too (where the allocator put a tensor is not)
                said = re.sub(r"offset \d+ bytes mod 256", "offset N bytes mod 256", f"{type(e).__name__}: {e}")
                rec.append([f"{name}#{i}", "raised", said])
    with open(path, "w") as f:
        json.dump(rec, f, indent=0, default=str)
    print(f"{len(rec)} calls recorded into {path}")


def diff(a_path: str, b_path: str) -> int:
    a, b = (json.load(open(p)) for p in (a_path, b_path))
    n = 0
    for (case, ka, va), (_, kb, vb) in zip(a, b):
        if (ka, va) == (kb, vb):
            continue
        n += 1
        if ka != kb or not isinstance(va, dict) or not isinstance(vb, dict):
            print(f"{case}: {ka} {str(va)[:200]} | {kb} {str(vb)[:200]}")
            continue
        d = {k: (va[k], vb.get(k)) for k in va if k != "launches" and va[k] != vb.get(k)}
        for i, (x, y) in enumerate(zip(va["launches"], vb["launches"])):
            for part in ("values", "pointers"):
                moved = {
                    k: (x[part].get(k), y[part].get(k))
                    for k in {*x[part], *y[part]}
                    if x[part].get(k) != y[part].get(k)
                }
                if moved:
                    d[f"launch {i} {part}"] = moved
        print(f"{case}: {d}")
    print(f"{n} of {len(a)} calls differ")
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", help="where to write this tree's bindings (JSON)")
    ap.add_argument("--diff", nargs=2, metavar=("A", "B"), help="compare two recordings")
    args = ap.parse_args()
    if args.diff:
        diff(*args.diff)
    elif args.out:
        record(args.out)
    else:
        ap.error("give OUT or --diff A B")


if __name__ == "__main__":
    main()
