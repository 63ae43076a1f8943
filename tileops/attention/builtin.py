"""BUILTIN implementation of the attention family: the fused prologue kernel of ``kernels/prologue.py``.

One object per (op, call specialization) holds the compiled kernel and launches it on the call's
views: qkv is read where it lies (any row stride; a last dim that is not contiguous is copied first),
q is written into ``q_out`` or a new ``[tokens, num_q_heads, head_dim]`` tensor, and the caches are
addressed by their own strides (the layout is the strides: ``kernels/prologue.py``). The rope stage's
tables are the rope op's own :class:`tileops.rope.tables.RoPETables` (its ``deployment_tables``),
one copy per device shared with the rope op.

Every launch goes through a :class:`tileops.runtime.binding.Binding` and the op's runtime, which
tracks the kernel's two error words: ``ERR[0]`` for ``positions``, ``ERR[1]`` for ``slot_mapping``
(:mod:`tileops.runtime.errors`). There is no per-signature fast path yet: the runtime allocates new
outputs shaped like their ``like`` input, and q is not shaped like qkv, so every call takes this path.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

import torch

from ..compile.build import device_backend, load_kernel
from ..kernels.float8 import CVT_MIN_SM
from ..runtime.binding import bind
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
        self.eps_bits = struct.unpack("<i", struct.pack("<f", p["eps"]))[0]

    def prepare(self, tensors: dict) -> torch.Tensor:
        return self.tables.on(self.device)

    def backward(self, state: Any, grads: tuple, tensors: dict) -> tuple:  # pragma: no cover - no backward declared
        raise NotImplementedError(f"{self.op.name} has no backward")

    def forward(self, tables: torch.Tensor, tensors: dict, outs: dict) -> torch.Tensor:
        """q ``[tokens, Hq, D]``; k and v written into the caches."""
        p = self.op.params
        hq, d = p["num_q_heads"], p["head_dim"]
        qkv = tensors["qkv"]
        if qkv.shape[0] and qkv.stride(1) != 1:
            qkv = qkv.contiguous()
        q_out = outs.get("q_out")
        q = q_out if q_out is not None and self._fits(q_out, q_out.stride(0), q_out.stride(1)) else torch.empty(
            (qkv.shape[0], hq, d), dtype=qkv.dtype, device=qkv.device)
        kc = tensors["key_cache"]
        if p["cache_layout"] == "NHD":  # [blocks, bs, Hkv, D]
            blocks, bs = kc.shape[0], kc.shape[1]
            csb, csr, csh = kc.stride(0), kc.stride(1), kc.stride(2)
        else:  # HND [blocks, Hkv, bs, D]
            blocks, bs = kc.shape[0], kc.shape[2]
            csb, csr, csh = kc.stride(0), kc.stride(2), kc.stride(1)
        nslots = blocks * bs
        self.op.slot_limit = nslots  # named by a bad slot's error
        u = self.unit
        if qkv.shape[0]:
            self._check_aligned(tensors, qkv, csb, csr, csh)
            # the kernel reads positions and slots as dense runs (P[t], MRoPE's P[s * tokens + t],
            # SL[t]): a strided or expanded view is copied first (tokens elements). HF's position_ids
            # [1, seq] expanded to the batch has stride 0, which read densely took the bytes past the
            # tensor as positions
            index = {n: tensors[n].contiguous() for n in ("positions", "slot_mapping")}
            launch = {**tensors, "qkv": qkv, **index}
            args = {"S": qkv.shape[0], "xst": qkv.stride(0) // u, "qst": q.stride(0) // u,
                    "qsh": q.stride(1) // u, "csb": csb // u, "csr": csr // u, "csh": csh // u, "bs": bs,
                    "nslots": nslots,
                    "limit": self.limit, "eps_bits": self.eps_bits, "TD": tables.data_ptr(),
                    # MRoPE's three position streams [3, tokens] lie psc elements apart
                    "psc": index["positions"].stride(0) if index["positions"].dim() == 2 else 0}
            b = bind(self.kernel, self.op.manifest, launch, {"q_out": q}, args=args, keep=(tables,),
                     pointers={"QKV": "qkv", "P": "positions", "SL": "slot_mapping", "QW": "q_norm_weight",
                               "KW": "k_norm_weight", "Q": "q_out", "KC": "key_cache", "VC": "value_cache",
                               "KS": "k_scale", "VS": "v_scale"},
                     # a bad position reads as 0 and a bad slot writes nothing; each marks its word
                     align={**dict.fromkeys(("qkv", "q_out", "q_norm_weight", "k_norm_weight"), u * qkv.element_size()),
                            **dict.fromkeys(("key_cache", "value_cache"), u * kc.element_size())},
                     checks={"positions": 0, "slot_mapping": 1})
            self.op._runtime.execute(b, launch, {"q_out": q})
        if q_out is not None and q is not q_out:
            q_out.copy_(q)
            return q_out
        return q

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
    spec = kernel_spec(params, qkv, positions, slots, backend, op_name)
    static = dict(manifest.kernel.static or {})
    return dataclasses.replace(spec, **static) if backend == "cuda" and static else spec


def kernel_specs(manifest: Any, params: Any, call: Any, backend: str, backward: bool = True) -> list[tuple[str, Any]]:
    """The ``(builder, spec)`` a call of one specialization launches, for ``tileops warmup`` and
    ``op.compile`` (no backward: the manifest declares none)."""
    spec = _spec(manifest, params, call.dtype("qkv"), call.dtype("positions"), call.dtype("slot_mapping"), backend,
                 manifest.name)
    return [(manifest.kernel.builder, spec)]


def implement(op: Any, spec: Any) -> PrologueKernels:
    return PrologueKernels(op, spec)
