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
from ..runtime.plan import ErrorWord, Plan, Ptr, Step, Tag, Value
from . import attn_builtin, decode_builtin
from .hooks import kernel_spec

__all__ = ["implement", "kernel_specs", "PrologueKernels"]


class PrologueKernels:
    """The kernel of one op specialization, and how a call's tensors are handed to it."""

    def __init__(self, op: Any, spec: Any):
        self.op = op
        self.device = spec.device
        self.backend, self.arch = device_backend(self.device)
        p = op.params
        self.kspec = _spec(op.manifest, p, spec.dtype("qkv"), spec.dtype("positions"), spec.dtype("slot_mapping"),
                           self.backend, op.name)
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
        #: the call's plan (:data:`FORWARD` for this op's tensors)
        self.plan = Plan.of(op.manifest, FORWARD, checks={"positions": 0, "slot_mapping": 1})

    def prepare(self, tensors: dict) -> torch.Tensor:
        return self.tables.on(self.device)

    def backward(self, state: Any, grads: tuple, tensors: dict) -> tuple:  # pragma: no cover - no backward declared
        raise NotImplementedError(f"{self.op.name} has no backward")

    def forward(self, tables: torch.Tensor, tensors: dict, outs: dict) -> torch.Tensor:
        """q ``[tokens, Hq, D]``; k and v written into the caches."""
        qkv = tensors["qkv"]
        if qkv.shape[0] and qkv.stride(1) != 1:
            qkv = qkv.contiguous()
        q_out = outs.get("q_out")
        q = q_out if q_out is not None and self._fits(q_out, q_out.stride(0), q_out.stride(1)) else self._new_q(qkv)
        cache = self._cache(tensors["key_cache"])
        if qkv.shape[0]:
            self._check_aligned(tensors, qkv, *cache[2:])
            # the kernel reads positions and slots as dense runs (P[t], MRoPE's P[s * tokens + t],
            # SL[t]): a strided or expanded view is copied first (tokens elements). HF's position_ids
            # [1, seq] expanded to the batch has stride 0, which read densely took the bytes past the
            # tensor as positions
            launch = {**tensors, "qkv": qkv, **{n: tensors[n].contiguous() for n in ("positions", "slot_mapping")}}
            b = self._bind(tables, launch, {"q_out": q}, q, cache)
            self.op._runtime.execute(b, launch, {"q_out": q})
        if q_out is not None and q is not q_out:
            q_out.copy_(q)
            return q_out
        return q

    def binding(self, tensors: dict, outs: dict) -> Any:
        """The binding of every later call shaped like this one, or None where the general path must
        copy (qkv's last dim, positions or slots not contiguous; ``q_out`` off the kernel's vectors), has
        nothing to launch (no tokens) or raises (a cache or qkv stride off the kernel's vectors). The
        pointers' alignment is checked per call by the runtime (a call it refuses takes the general path,
        which names the input)."""
        qkv, q_out = tensors["qkv"], outs.get("q_out")
        cache = self._cache(tensors["key_cache"])
        u = self.unit
        if (qkv.shape[0] == 0 or qkv.stride(1) != 1 or qkv.stride(0) % u or any(st % u for st in cache[2:])
                or not all(tensors[n].is_contiguous() for n in ("positions", "slot_mapping"))):
            return None
        if q_out is not None and (q_out.stride(-1) != 1 or q_out.stride(0) % u or q_out.stride(1) % u):
            return None
        q = q_out if q_out is not None else self._new_q(qkv)  # a new q: the layout every call's gets
        return self._bind(self.tables.on(self.device), tensors, {"q_out": q_out}, q, cache)

    def _new_q(self, qkv: torch.Tensor) -> torch.Tensor:
        p = self.op.params
        return torch.empty((qkv.shape[0], p["num_q_heads"], p["head_dim"]), dtype=qkv.dtype, device=qkv.device)

    def _cache(self, kc: torch.Tensor) -> tuple[int, int, int, int, int]:
        """``(blocks, block_size, block stride, row stride, head stride)`` of a cache in the op's
        layout; the slot count is noted for a bad slot's error."""
        if self.op.params["cache_layout"] == "NHD":  # [blocks, bs, Hkv, D]
            got = kc.shape[0], kc.shape[1], kc.stride(0), kc.stride(1), kc.stride(2)
        else:  # HND [blocks, Hkv, bs, D]
            got = kc.shape[0], kc.shape[2], kc.stride(0), kc.stride(2), kc.stride(1)
        self.op.note_slot_limit(got[0] * got[1])
        return got

    def _bind(self, tables: torch.Tensor, launch: dict, outs: dict, q: torch.Tensor, cache: tuple) -> Any:
        """The launch of ``launch``'s tensors writing q into ``q`` (``outs``: the call's ``q_out``, given
        or None for a new one laid out as ``q``)."""
        u, qkv, kc = self.unit, launch["qkv"], launch["key_cache"]
        blocks, bs, csb, csr, csh = cache
        positions = launch["positions"]
        env = {"S": qkv.shape[0], "xst": qkv.stride(0) // u, "qst": q.stride(0) // u, "qsh": q.stride(1) // u,
               "csb": csb // u, "csr": csr // u, "csh": csh // u, "bs": bs, "nslots": blocks * bs,
               "limit": self.limit, "eps_bits": self.eps_bits, "TD": tables.data_ptr(),
               # MRoPE's three position streams [3, tokens] lie psc elements apart
               "psc": positions.stride(0) if positions.dim() == 2 else 0}
        return self.plan.bind({"prologue": self.kernel}, launch, outs, env=env, keep=(tables,), views={"q_out": q},
                              align={**dict.fromkeys(("qkv", "q_out", "q_norm_weight", "k_norm_weight"),
                                                     u * qkv.element_size()),
                                     **dict.fromkeys(("key_cache", "value_cache"), u * kc.element_size())})

    def _fits(self, t: torch.Tensor, *strides: int) -> bool:
        """Whether the kernel moves ``t`` where it lies: a contiguous last dim and, on CUDA, the pointer and
        ``strides`` on ``stride_unit`` elements (16-byte vectors)."""
        u = self.unit
        return (t.stride(-1) == 1 and all(st % u == 0 for st in strides)
                and t.data_ptr() % (u * t.element_size()) == 0)

    def _check_aligned(self, tensors: dict, qkv: torch.Tensor, csb: int, csr: int, csh: int) -> None:
        """CUDA: a ValueError naming the input whose pointer or strides are off the kernel's 16-byte
        vectors (the caches are written in place and the others are read where they lie: no copy hides it)."""
        if self.unit == 1:
            return
        u = self.unit
        need = f"a multiple of {u} elements ({u * qkv.element_size()} bytes: the CUDA kernel's vectors)"
        checks = [("qkv", qkv, (qkv.stride(0),), "its data pointer and row stride"),
                  ("key_cache", tensors["key_cache"], (csb, csr, csh), "its data pointer and strides"),
                  ("value_cache", tensors["value_cache"], (csb, csr, csh), "its data pointer and strides")]
        for name in ("q_norm_weight", "k_norm_weight"):
            if tensors.get(name) is not None:
                checks.append((name, tensors[name], (), "its data pointer"))
        for name, t, strides, what in checks:
            if not self._fits(t, *strides):
                raise ValueError(f"{self.op.name}: {name}: expected {what} on {need}, got data pointer offset "
                                 f"{t.data_ptr() % 256} bytes mod 256, strides {list(t.stride())} (a view that "
                                 f"starts or steps inside a vector; .clone() gives an aligned copy)")


def _spec(manifest: Any, params: Any, qkv: str, positions: str, slots: str, backend: str, op_name: str) -> Any:
    """The kernel spec of a call: the fields from the op (:func:`tileops.attention.hooks.kernel_spec`),
    on CUDA with the schedule's choices the manifest's ``kernel.static`` sets."""
    spec = kernel_spec(manifest, params, qkv, positions, slots, backend)
    static = dict(manifest.kernel.static or {})
    return dataclasses.replace(spec, **static) if backend == "cuda" and static else spec


def kernel_specs(manifest: Any, params: Any, call: Any, backend: str, backward: bool = True) -> list[tuple[str, Any]]:
    """The ``(builder, spec)`` a call of one specialization launches, for ``tileops warmup`` and
    ``op.compile`` (no backward: the manifest declares none); ``AttnFwdOp``'s are
    :func:`tileops.attention.attn_builtin.kernel_specs`, ``PagedAttnDecodeFwdOp``'s
    :func:`tileops.attention.decode_builtin.kernel_specs`."""
    if manifest.name == "AttnFwdOp":
        return attn_builtin.kernel_specs(manifest, params, call, backend, backward)
    if manifest.name == "PagedAttnDecodeFwdOp":
        return decode_builtin.kernel_specs(manifest, params, call, backend, backward)
    spec = _spec(manifest, params, call.dtype("qkv"), call.dtype("positions"), call.dtype("slot_mapping"), backend,
                 manifest.name)
    return [(manifest.kernel.builder, spec)]


#: The fused prologue: q and k of qkv normalised and rotated at positions, q into q_out, k and v
#: written into the caches at slot_mapping (the caches' layout is their strides). A bad position reads
#: as 0 and a bad slot writes nothing; each marks its word (positions 0, slots 1).
FORWARD = (Step("prologue", {"QKV": Ptr("qkv"), "P": Ptr("positions"), "SL": Ptr("slot_mapping"),
                             "QW": Ptr("q_norm_weight"), "KW": Ptr("k_norm_weight"), "Q": Ptr("q_out"),
                             "KC": Ptr("key_cache"), "VC": Ptr("value_cache"), "KS": Ptr("k_scale"),
                             "VS": Ptr("v_scale"), "ERR": ErrorWord(), "tag": Tag(),
                             **{a: Value(a) for a in ("S", "xst", "qst", "qsh", "csb", "csr", "csh", "bs", "nslots",
                                                      "limit", "eps_bits", "TD", "psc")}}),)


def implement(op: Any, spec: Any) -> Any:
    if op.name == "AttnFwdOp":
        return attn_builtin.implement(op, spec)
    if op.name == "PagedAttnDecodeFwdOp":
        return decode_builtin.implement(op, spec)
    return PrologueKernels(op, spec)
