"""BUILTIN implementation of ``PagedAttnDecodeFwdOp``: the two programs of ``kernels/paged_decode.py``
as one plan (:data:`FORWARD`).

``partial`` reads each split of each sequence's tokens through the block table into two workspaces
of the plan (per-split outputs and base-2 log-sum-exps, fp32, allocated per call), ``merge`` weighs
the splits into ``out``. The split count comes from the shapes alone (:func:`splits`), so a call never
waits for the device; the same rule on every backend, so the CPU's tests run the plan a GPU runs.
q and out are read and written where they lie (strides as values; a last dim that is not contiguous
is copied first), the caches by their strides (the layout is the strides, as the prologue writes
them). The kernel checks the lengths and the block tables (error words ``LENS_WORD`` and
``TABLES_WORD`` of ``kernels/paged_decode.py``: a bad length is named before the table entries it
reaches), reported by the op's runtime with the index (:mod:`tileops.runtime.errors`).

The CUDA schedule is checked on the CPU in CI (its generated source run there against the float64
reference) and its GPU tests passed on the H200 (:func:`cuda_enabled`); ``TILEOPS_ATTENTION_CUDA=0``
refuses its CUDA calls.

CUDA: the programs read and write 16-byte vectors (8 elements; 4 of fp32), and take every stride in
those units: q or out off them (a view that starts or steps inside a vector) goes through a dense
copy, and a cache off them is refused with a ValueError naming it (a cache is the server's memory:
no copy of it is made behind its back). A head_dim the CUDA schedule cannot read (not a multiple of
the vector, or more than a warp's 32 vectors) is refused when the op is first called on CUDA.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..compile.build import device_backend, load_kernel
from ..compile.entry import encode_arg
from ..kernels.paged_decode import LENS_WORD, TABLES_WORD, cuda_problem
from .attn_builtin import CUDA_ENV, cuda_enabled as _attn_cuda_enabled
from .hooks import CACHE_DIMS, block_size
from ..runtime.binding import Binding
from ..runtime.plan import Dims, ErrorWord, Plan, Ptr, Size, Step, Stride, Tag, Value, Workspace, strides
from ..runtime.views import Misfit
from ..schedules import static_for

__all__ = ["DecodeKernels", "FORWARD", "WORKSPACES", "cuda_enabled", "kernel_specs", "implement", "splits",
           "target_programs"]

#: the builder of both programs
BUILDER = "paged_decode"

#: the streaming multiprocessors the split rule fills: an H200's (the same rule on every backend, so
#: that the CPU's tests run the split a GPU runs, and cover the merge)
SMS = 132
#: the partial programs an H200 SM holds at once, by schedule (ptxas, sm_90a, 128 threads; registers at
#: head_dim 128 unless said): the tensor cores' tiles of 128 tokens with the next tile loaded ahead (233
#: registers, D 64: 150) 2; tiles of 64 up to head_dim 128 (bf16 111, float8 85) 4; tiles of 64 at head_dim
#: 256 (bf16 194, float8 139) 2; the CUDA cores' program (fp32) 2, the rule it was measured with
PROGRAMS_AN_SM = {"tile128": 2, "tile64": 4, "tile64-d256": 2, "cuda-cores": 2}
#: programs the partial step aims for when the schedule is not known (the C backend's fp32 call): two an SM
TARGET_PROGRAMS = PROGRAMS_AN_SM["cuda-cores"] * SMS
#: the fewest tokens a split reads: below this the merge's reads (a row of D fp32 a split and q head)
#: stop being small next to the split's own (256 keys of D elements, for its G q heads)
MIN_SPLIT_TOKENS = 256

#: the CUDA-cores partial's token-loop knobs, which the tensor-core one (``mma``) does not read
_CUDA_CORE_LOOP = ("unroll", "stages")
#: the manifest's knobs of the tensor-core partial, which an fp32 call (the CUDA cores') drops
_MMA_KNOBS = ("mma", "tile", "prefetch", "widen", "min_blocks")
#: the tensor-core partial's tile where the manifest's (128 tokens, the next tile loaded during this
#: one's products) loses. head_dim 256: tiles of 128 spill (ptxas, sm_90a, bf16: 255 registers and
#: 1,260 bytes of spill stores; tiles of 64: 194 registers, none). A float8 cache read one element at a
#: time: its per-element conversion makes the program ALU-bound, and the prefetch's registers cost it
#: programs an SM (H200, bf16 q, GQA 32/8, D 128, one split: 216 and 856 us at 64 x 1024 and 64 x 4096,
#: against 165 and 636 for tiles of 64 without it).
_MMA_NARROW = {"tile": 64, "prefetch": 0}
#: A float8 cache widened eight elements at once (``widen``, the manifest's; fp16 products) keeps the
#: prefetch at tiles of 64 (whatever tile the schedule asks): 126 registers (bf16 q, its rows rescaled;
#: fp16 q 120), 4 programs an SM, against 177 and 2 at tiles of 128. H100, bf16 q, GQA 32/8, D 128, block
#: size 16, eager us (``benchmarks.decode --sweep ... --sweep-cache fp8``): with the fp16 products
#: (2026-12-06, b87affa) 64 x 1024 60.1, 64 x 4096 221.2, 8 x 32768 224.6, 1 x 4096 16.0, and 73.5 / 269.0 /
#: 273.3 / 19.1 without the prefetch (tiles of 128 not measured: this rule made the sweep's "tile 128"
#: run at 64); before them (bf16 widened by bit moves, ALU-bound) tiles of 64 won over 128 by 10-15%:
#: 84.7 / 103.0, 321.7 / 367.6, 333.9 / 385.6, 20.3 / 20.0, and 3 programs of 128 an SM (``min_blocks``)
#: gained 2% or lost 25%.
#: ``min_blocks`` 4 holds it there: the row sums kept per element (a reduction a tile fewer) take 136
#: registers unasked, 127 asked, no spill (ptxas, sm_90a; with a window and softcap 134 / 127). With them
#: and the row maxima in one exchange (2026-12-06, H100, against the tree before, alternated twice in one
#: call): 60.8 -> 56.3, 216.6 -> 204.4, 221.7 -> 209.9, 16.0 -> 15.3 us.
_MMA_FLOAT8_WIDENED = {"tile": 64, "min_blocks": 4}
_PARTIAL_VALUES = ("splits", "chunk", "scale_bits", "softcap_bits", "window")

#: what the partial program reads, whichever way it writes
_PARTIAL = {"Q": Ptr("q"), "KC": Ptr("key_cache"), "VC": Ptr("value_cache"), "BT": Ptr("block_tables"),
            "SL": Ptr("seq_lens"), "KS": Ptr("k_scale"), "VS": Ptr("v_scale"), "ERR": ErrorWord(), "tag": Tag(),
            "batch": Size("q", "b"), "nblocks": Size("key_cache", "b"), "bs": Size("key_cache", "r"),
            "max_blocks": Size("block_tables", "n"), "btb": Stride("block_tables", "b"),
            **strides("q", "qs", "bh"), **strides("key_cache", "cs", "brh"), **{a: Value(a) for a in _PARTIAL_VALUES}}
#: The call: partial outputs and log-sum-exps per (sequence, q head, split) into the workspaces, then
#: their merge into out. Error words: 0 block_tables, 1 seq_lens.
FORWARD = (Step("partial", {**_PARTIAL, "OP": Ptr("partial_out"), "LP": Ptr("partial_lse")}),
           Step("merge", {"OP": Ptr("partial_out"), "LP": Ptr("partial_lse"), "O": Ptr("out"), "batch": Size("q", "b"),
                          "splits": Value("splits"), **strides("out", "os", "bh")}))
#: the workspaces the two steps share, per call
WORKSPACES = (Workspace("partial_out", "float32", "q_b * q_h * splits * q_d"),
              Workspace("partial_lse", "float32", "q_b * q_h * splits"))
#: A call of one split (:func:`splits`: every sequence's tokens in one program, as at batch 64): the
#: partial program normalises its output and writes out itself, the merge's answer to the bit (the merge
#: of one split multiplies by 2^0 and divides by 1), with no merge launch and no workspace. H200, bf16
#: GQA 32/8, D 128: the merge was a second launch at 64 x 1024 and 64 x 4096 (one split each).
DIRECT = (Step("partial", {**_PARTIAL, "O": Ptr("out"), **strides("out", "os", "bh"), "direct": Value("1")}),)


def cuda_enabled() -> bool:
    """Whether CUDA calls may launch the paged decode's programs: unless :data:`CUDA_ENV` is 0, as the
    attention backward's.

    Refused by default until its GPU tests ran to the end on the H200, which they did on 2026-12-04
    (``benchmarks/NOTES.md``): ``tests/test_paged_decode_cuda.py`` (bf16, fp16 and float8 caches, NHD and
    HND, block sizes 1 and 16, head_dim 64 to 256, groups of 1 to 16, fp32, windows, softcap, splits, bad
    tables and lengths reported with their index, views off the vectors, 64 prologue + decode steps
    replayed from a CUDA graph) and the manifest's 6 generated CUDA cases: 26 passed."""
    return _attn_cuda_enabled(backward=True)


def target_programs(partial: Any) -> int:
    """The programs the split rule aims for with the CUDA ``partial`` spec (None: not served on CUDA):
    one wave, :data:`PROGRAMS_AN_SM` on each of :data:`SMS`. At most one wave, not at least: at 8 x 32768
    (kv heads 8), tiles of 128 at 5 splits made 320 programs, a second wave of 56, 397 us (65% of a
    copy), and at 4 splits 256 programs, 277 us (93%); a float8 cache at tiles of 64, 4, 5 and 8 splits:
    1060, 916 and 640 us (H200, bf16 q, GQA 32/8, D 128)."""
    if partial is None or not partial.mma:
        return TARGET_PROGRAMS
    if partial.tile == 128:
        per_sm = PROGRAMS_AN_SM["tile128"]
    else:
        per_sm = PROGRAMS_AN_SM["tile64-d256" if partial.head_dim > 128 else "tile64"]
    # (a schedule's min_blocks asks nvcc for that many programs an SM: the rule aims at them)
    return max(per_sm, partial.min_blocks) * SMS


def splits(batch: int, hkv: int, tokens: int, programs: int = TARGET_PROGRAMS) -> int:
    """The splits of a sequence of at most ``tokens`` (``max_blocks * block_size``) for ``batch``
    sequences of ``hkv`` kv heads: as many as ``programs`` programs allow (:func:`target_programs`), none
    shorter than :data:`MIN_SPLIT_TOKENS`, at least one."""
    want = programs // max(batch * hkv, 1)
    return max(1, min(want, math.ceil(tokens / MIN_SPLIT_TOKENS)))


def _fields(params: Any, call: Any) -> dict[str, Any]:
    """The fields of :class:`kernels.paged_decode.PagedDecodeSpec` (less ``backend`` and ``kind``)."""
    given = dict(call.dtypes)
    cache = given["key_cache"]
    return {"dtype": given["q"], "cache_dtype": cache, "head_dim": call.dim("q_dim"), "hq": call.dim("q_heads"),
            "hkv": call.dim("cache_heads"), "window": params["sliding_window"] is not None,
            "softcap": params["softcap"] is not None}


def kernel_specs(manifest: Any, params: Any, call: Any, backend: str, backward: bool = True) -> list[tuple[str, Any]]:
    """The ``(builder, spec)`` a call of one specialization launches (``tileops warmup``, ``op.compile``):
    ``partial`` and ``merge``; on CUDA none for a head_dim its schedule cannot read (the call is refused)."""
    from tileops.kernels import get_spec

    spec = get_spec(BUILDER)
    fields = _fields(params, call)
    if backend == "cuda" and cuda_problem(fields["dtype"], fields["cache_dtype"], fields["head_dim"]):
        return []
    # the manifest's knobs are the CUDA schedule's; a chosen schedule's apply on its backend (tileops.schedules)
    static = static_for(manifest, call, built_in=backend == "cuda")
    if static.get("mma") and fields["dtype"] == "float32":
        # the tensor-core products take 16-bit operands: fp32 q takes the CUDA cores' loop, whose copies
        # ahead are ``stages`` (the manifest's ``tile`` and ``prefetch`` are the tensor-core program's)
        static = {k: v for k, v in static.items() if k not in _MMA_KNOBS}
    elif static.get("mma") and (fields["head_dim"] > 128
                                or (fields["cache_dtype"].startswith("float8") and not static.get("widen"))):
        static.update(_MMA_NARROW)
    elif static.get("mma") and fields["cache_dtype"].startswith("float8"):
        static.update(_MMA_FLOAT8_WIDENED)
    # each program keyed by the knobs it reads: the merge by its threads, the tensor-core partial not by
    # the CUDA cores' token loop (so that a schedule sweep compiles one merge, not one a schedule)
    merge = {k: v for k, v in static.items() if k == "threads"}
    partial = {k: v for k, v in static.items() if not (static.get("mma") and k in _CUDA_CORE_LOOP)}
    if not (partial.get("mma") and fields["cache_dtype"].startswith("float8")):
        partial.pop("widen", None)  # (the tensor-core partial's float8 widening: nothing else reads it)
    return [(BUILDER, spec(backend=backend, kind="partial", **fields, **partial)),
            (BUILDER, spec(backend=backend, kind="merge", **fields, **merge))]


class DecodeKernels:
    """The two programs of one op specialization, and how a call's tensors are handed to them."""

    def __init__(self, op: Any, call: Any):
        self.op = op
        self.device = call.device
        self.backend, self.arch = device_backend(self.device)
        if self.backend == "cuda":
            if not cuda_enabled():
                raise NotImplementedError(
                    f"{op.name}: CUDA: the paged decode's CUDA kernels are refused by {CUDA_ENV}=0: "
                    f"target='torch' computes it with PyTorch")
            f = _fields(op.params, call)
            problem = cuda_problem(f["dtype"], f["cache_dtype"], f["head_dim"])
            if problem:
                raise NotImplementedError(f"{op.name}: {problem}; target='torch' computes it with PyTorch")
        specs = {s.kind: s for _, s in kernel_specs(op.manifest, op.params, call, self.backend)}
        # the split rule follows the CUDA schedule on every backend (the CPU runs the split a GPU runs)
        cuda = specs if self.backend == "cuda" else {
            s.kind: s for _, s in kernel_specs(op.manifest, op.params, call, "cuda")}
        self.programs = target_programs(cuda.get("partial"))
        self.kernels = {kind: load_kernel(BUILDER, s, self.backend, self.arch, self.device, s.args, op_name=op.name)
                        for kind, s in specs.items()}
        # the strides' units (CUDA: q and the caches in the partial program's vectors, out in the merge's)
        self.unit, self.out_unit = specs["partial"].stride_unit, specs["merge"].stride_unit
        self.units = {"q": self.unit, "key_cache": self.unit, "value_cache": self.unit, "out": self.out_unit}
        p = op.params
        self.scale = p["softmax_scale"] if p["softmax_scale"] is not None else 1.0 / math.sqrt(p["head_dim"])
        checks = {"seq_lens": LENS_WORD, "block_tables": TABLES_WORD}
        self.plan = Plan.of(op.manifest, FORWARD, workspaces=WORKSPACES, dims=_dims(p["cache_layout"]), checks=checks)
        #: a call of one split: the partial writes out (its tensors seen and placed as :attr:`plan` has them)
        self.direct = Plan.of(op.manifest, DIRECT, dims=_dims(p["cache_layout"]), checks=checks)

    def prepare(self, tensors: dict) -> None:
        return None

    def backward(self, state: Any, grads: tuple, tensors: dict) -> tuple:  # pragma: no cover - no backward declared
        raise NotImplementedError(f"{self.op.name} has no backward")

    def forward(self, state: Any, tensors: dict, outs: dict) -> torch.Tensor:
        """out ``[batch, Hq, D]`` (new unless given), the call placed by the plan's fit policy."""
        q, out = tensors["q"], outs.get("out")
        if q.shape[0] == 0:
            return torch.empty_like(q) if out is None else out
        placed = self.plan.place(tensors, {"out": out}, self.units)
        launch, writes = placed.inputs, placed.writes
        self.op.run_plan(self, self.plan.key(launch, writes), lambda: self._bind(launch, writes, {}), launch, writes)
        placed.copy_back()
        return placed.outs["out"]

    def binding(self, tensors: dict, outs: dict) -> Binding | None:
        """The binding of every later call shaped like this one, or None where the general path must copy
        (a last dim not contiguous, tables or lengths not contiguous), refuses (a cache off the vectors)
        or has nothing to launch."""
        q, out = tensors["q"], outs.get("out")
        view = out if out is not None else torch.empty_like(q, device="meta")
        if q.shape[0] == 0 or isinstance(self.plan.layout({**tensors, "out": view}, self.units), Misfit):
            return None
        return self._bind(tensors, {"out": out}, {"out": view})

    def _bind(self, tensors: dict, outs: dict, views: dict) -> Binding:
        kc, bt = tensors["key_cache"], tensors["block_tables"]
        p = self.op.params
        bs = block_size(kc, p["cache_layout"])
        tokens = bt.shape[1] * bs
        n = splits(tensors["q"].shape[0], p["num_kv_heads"], tokens, self.programs)
        self.op.note_decode_limits(kc.shape[0], tokens)
        env = {"splits": n, "chunk": math.ceil(tokens / n), "scale_bits": encode_arg("float", self.scale),
               "softcap_bits": encode_arg("float", p["softcap"] or 1.0),
               "window": min(p["sliding_window"] or 0, 2**31 - 1)}
        plan = self.direct if n == 1 else self.plan  # (n follows from the shapes: one binding per signature)
        return plan.bind(self.kernels, tensors, outs, env=env, views=views, unit=self.units)


def _dims(cache_layout: str) -> dict:
    """How the programs see the call's tensors: q and out ``[batch, Hq, D]`` by their strides (copied
    when off the vectors); the caches in their layout, read where they lie (a cache off the vectors is
    refused: a copy of a server's cache each call would cost more than the call); the block tables and
    lengths as dense runs."""
    cache = Dims(CACHE_DIMS[cache_layout], refuse="any")
    return {"q": Dims("bhd"), "out": Dims("bhd"), "key_cache": cache, "value_cache": cache,
            "block_tables": Dims("bn", vector=False, dense=True), "seq_lens": Dims("b", vector=False, dense=True)}


def implement(op: Any, call: Any) -> DecodeKernels:
    return DecodeKernels(op, call)
