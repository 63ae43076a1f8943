"""BUILTIN implementation of the attention family: the fused prologue kernel of ``kernels/prologue.py``.

One object per (op, call specialization) holds the compiled kernel and launches it on the call's
views: qkv is read where it lies (any row stride; a last dim that is not contiguous is copied first),
q is written into ``q_out`` or a new ``[tokens, num_q_heads, head_dim]`` tensor, and the caches are
addressed by their own strides (the layout is the strides: ``kernels/prologue.py``). The rope stage's
tables are the rope op's own :class:`tileops.rope.tables.RoPETables` (its ``deployment_tables``),
one copy per device shared with the rope op.

Every launch goes through a :class:`tileops.runtime.binding.Binding` and the op's runtime, which
tracks the kernel's two error words: ``ERR[0]`` for ``positions``, ``ERR[1]`` for ``slot_mapping``
(:mod:`tileops.runtime.errors`). A call the kernel takes as it lies (qkv's last dim, positions and
slots contiguous; strides on the kernel's vectors) has a binding per call signature
(:meth:`PrologueKernels.binding`): the op's runtime serves the next such call, eager or from a
compiled graph (``tileops::apply_out`` with the caches as its written inputs), without this module.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..compile.build import device_backend, load_kernel
from ..compile.entry import encode_arg
from ..kernels.float8 import CVT_MIN_SM
from ..runtime.plan import Dims, ErrorWord, Plan, Ptr, Size, Step, Stride, Tag, Value, strides
from ..runtime.views import Misfit
from ..schedules import static_for
from . import attn_builtin, decode_builtin
from .hooks import CACHE_DIMS, block_size, kernel_spec

__all__ = ["implement", "kernel_specs", "PrologueKernels"]


class PrologueKernels:
    """The kernel of one op specialization, and how a call's tensors are handed to it."""

    def __init__(self, op: Any, spec: Any):
        self.op = op
        self.device = spec.device
        self.backend, self.arch = device_backend(self.device)
        p = op.params
        self.kspec = _spec(op.manifest, p, spec, self.backend)
        # CUDA: the qkv, q and cache strides in units of stride_unit elements (16-byte vectors), and every
        # pointer the kernel moves vectors through on such a vector (checked per call)
        self.unit = self.kspec.stride_unit
        if self.kspec.fp8 and self.backend == "cuda" and int(self.arch[3:]) < CVT_MIN_SM:
            raise NotImplementedError(f"{op.name}: cache_dtype: float8_e4m3fn caches are stored with the hardware "
                                      f"conversion of sm_{CVT_MIN_SM} and later; {self.device} is {self.arch}")
        self.kernel = load_kernel(op.manifest.kernel.builder, self.kspec, self.backend, self.arch, self.device,
                                  self.kspec.args, op_name=op.name)
        self.tables = p["rope"].deployment_tables(self.kspec.rot)
        self.limit = op.position_limit()
        self.eps_bits = encode_arg("float", p["eps"])  # the kernel reinterprets the float32's bits
        #: the call's plan (:data:`FORWARD` for this op's tensors, seen as :func:`plan_of` declares), and the
        #: general path's bindings by signature
        self.plan = plan_of(op)

    def prepare(self, tensors: dict) -> torch.Tensor:
        return self.tables.on(self.device)

    def backward(self, state: Any, grads: tuple, tensors: dict) -> tuple:  # pragma: no cover - no backward declared
        raise NotImplementedError(f"{self.op.name} has no backward")

    def forward(self, tables: torch.Tensor, tensors: dict, outs: dict) -> torch.Tensor:
        """q ``[tokens, Hq, D]``; k and v written into the caches. The plan's fit policy places the
        call: qkv with a last dim that is not contiguous, positions and slots that are not one dense run
        (HF's ``[1, seq]`` positions expanded to the batch have stride 0) and a ``q_out`` off the kernel's
        vectors are copied; a pointer or stride off them on anything read or written where it lies is a
        ValueError naming it."""
        qkv, q_out = tensors["qkv"], outs.get("q_out")
        self._note_slots(tensors["key_cache"])
        if not qkv.shape[0]:
            return q_out if q_out is not None else self._new_q(qkv)
        placed = self.plan.place(tensors, {"q_out": q_out if q_out is not None else self._new_q(qkv)}, self.unit)
        launch, writes = placed.inputs, placed.writes
        # bound once a signature of what is launched (the tables are one tensor a device: their address holds)
        self.op.run_plan(self, (tables.data_ptr(), *self.plan.key(launch, writes)),
                         lambda: self._bind(tables, launch, writes, {}), launch, writes)
        placed.copy_back()
        return placed.outs["q_out"]

    def binding(self, tensors: dict, outs: dict) -> Any:
        """The binding of every later call shaped like this one, or None where the general path must
        copy (qkv's last dim, positions or slots not contiguous; ``q_out`` off the kernel's vectors), has
        nothing to launch (no tokens) or raises (a cache or qkv stride off the kernel's vectors). The
        pointers' alignment is checked per call by the runtime (a call it refuses takes the general path,
        which names the input)."""
        qkv, q_out = tensors["qkv"], outs.get("q_out")
        self._note_slots(tensors["key_cache"])
        q = q_out if q_out is not None else self._new_q(qkv)  # a new q: the layout every call's gets
        if qkv.shape[0] == 0 or isinstance(self.plan.layout({**tensors, "q_out": q}, self.unit), Misfit):
            return None
        return self._bind(self.tables.on(self.device), tensors, {"q_out": q_out}, {"q_out": q})

    def _new_q(self, qkv: torch.Tensor) -> torch.Tensor:
        p = self.op.params
        return torch.empty((qkv.shape[0], p["num_q_heads"], p["head_dim"]), dtype=qkv.dtype, device=qkv.device)

    def _note_slots(self, kc: torch.Tensor) -> None:
        """The cache's slot count, noted for a bad slot's error."""
        self.op.note_slot_limit(kc.shape[0] * block_size(kc, self.op.params["cache_layout"]))

    def _bind(self, tables: torch.Tensor, launch: dict, outs: dict, views: dict) -> Any:
        """The launch of ``launch``'s tensors writing q into ``outs``' (given, or None for a new one laid
        out as ``views`` has it)."""
        env = {"limit": self.limit, "eps_bits": self.eps_bits, "TD": tables.data_ptr()}
        return self.plan.bind({"prologue": self.kernel}, launch, outs, env=env, keep=(tables,), views=views,
                              unit=self.unit)


def plan_of(op: Any) -> Plan:
    """The prologue's plan for ``op``: :data:`FORWARD`, its tensors seen as the kernel sees them. qkv
    ``[tokens, width]`` by its row stride (a pointer or stride off the vectors refused: serving code
    should know its projection's split is misaligned, not pay a copy a call); q ``[tokens, Hq, D]``; the
    caches in the op's layout, written in place (anything off refused); positions (MRoPE's ``[3,
    tokens]``) and slots read as dense runs."""
    cache = Dims(CACHE_DIMS[op.params["cache_layout"]], refuse="any")
    dims = {"qkv": Dims("tc", refuse="alignment"), "q_out": Dims("thd"), "key_cache": cache, "value_cache": cache,
            "q_norm_weight": Dims("d", refuse="any"), "k_norm_weight": Dims("d", refuse="any"),
            "positions": Dims({1: "t", 2: "ct"}, vector=False, dense=True),
            "slot_mapping": Dims("t", vector=False, dense=True)}
    return Plan.of(op.manifest, FORWARD, checks={"positions": 0, "slot_mapping": 1}, dims=dims)


def _spec(manifest: Any, params: Any, call: Any, backend: str) -> Any:
    """The kernel spec of a call: the fields from the op (:func:`tileops.attention.hooks.kernel_spec`),
    with the schedule's choices: on CUDA the manifest's ``kernel.static`` and over it the chosen
    schedule's (:mod:`tileops.schedules`), on the C backend the chosen schedule's alone."""
    spec = kernel_spec(manifest, params, call.dtype("qkv"), call.dtype("positions"), call.dtype("slot_mapping"),
                       backend)
    static = static_for(manifest, call, built_in=backend == "cuda")
    return dataclasses.replace(spec, **static) if static else spec


def kernel_specs(manifest: Any, params: Any, call: Any, backend: str, backward: bool = True) -> list[tuple[str, Any]]:
    """The ``(builder, spec)`` a call of one specialization launches, for ``tileops warmup`` and
    ``op.compile`` (no backward: the manifest declares none); ``AttnFwdOp``'s are
    :func:`tileops.attention.attn_builtin.kernel_specs`, ``PagedAttnDecodeFwdOp``'s
    :func:`tileops.attention.decode_builtin.kernel_specs`."""
    if manifest.name == "AttnFwdOp":
        return attn_builtin.kernel_specs(manifest, params, call, backend, backward)
    if manifest.name == "PagedAttnDecodeFwdOp":
        return decode_builtin.kernel_specs(manifest, params, call, backend, backward)
    spec = _spec(manifest, params, call, backend)
    return [(manifest.kernel.builder, spec)]


#: The fused prologue: q and k of qkv normalised and rotated at positions, q into q_out, k and v
#: written into the caches at slot_mapping (the caches' layout is their strides). A bad position reads
#: as 0 and a bad slot writes nothing; each marks its word (positions 0, slots 1).
FORWARD = (Step("prologue", {"QKV": Ptr("qkv"), "P": Ptr("positions"), "SL": Ptr("slot_mapping"),
                             "QW": Ptr("q_norm_weight"), "KW": Ptr("k_norm_weight"), "Q": Ptr("q_out"),
                             "KC": Ptr("key_cache"), "VC": Ptr("value_cache"), "KS": Ptr("k_scale"),
                             "VS": Ptr("v_scale"), "ERR": ErrorWord(), "tag": Tag(), "S": Size("qkv", "t"),
                             "xst": Stride("qkv", "t"), "qst": Stride("q_out", "t"), "qsh": Stride("q_out", "h"),
                             **strides("key_cache", "cs", "brh"), "bs": Size("key_cache", "r"),
                             "nslots": Size("key_cache", "br"), "psc": Stride("positions", "c"),
                             **{a: Value(a) for a in ("limit", "eps_bits", "TD")}}),)


def implement(op: Any, spec: Any) -> Any:
    if op.name == "AttnFwdOp":
        return attn_builtin.implement(op, spec)
    if op.name == "PagedAttnDecodeFwdOp":
        return decode_builtin.implement(op, spec)
    return PrologueKernels(op, spec)
