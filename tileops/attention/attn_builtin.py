"""BUILTIN implementation of ``AttnFwdOp``: the attention kernels of ``kernels/attention.py``.

One object per (op, call specialization) holds the compiled forward kernel (compiled at
construction) and hands a call's views to it through a plan (:data:`FORWARD`): q, k, v and out by
their pointers, every stride (in the kernel's units) and size by value. Views are read where they lie
(HF's ``[B, H, S, D]`` transposed, a slice along the sequence): only a last dim that is not
contiguous, a stride off the CUDA kernel's 16-byte vectors, or (CUDA) a pointer off them is copied
first (an output written through a buffer and copied back: the plan's fit policy, declared with the
dims of its tensors, :data:`DIMS`, which the runtime applies).

A call that wants the lse (``return_lse``, or a gradient to come) runs :data:`FORWARD_LSE`, whose
second output is the lse: a new fp32 tensor a call, so its binding is cached per signature as the
plain forward's is (it was bound for each such call once, with the lse's address as a value: every
training step's forward paid a whole binding on the host). Varlen calls check
``cu_seqlens_q``/``cu_seqlens_k`` on the device: error words 0 and 1 of the plan
(:mod:`tileops.kernels.report`).

Gradients (the manifest's ``backward``): a call whose q, k or v requires grad gets a per-call state
from :meth:`AttnKernels.prepare` (a dict), into which the forward writes the lse it computes for that
call alone (a no-grad call computes none unless ``return_lse``). :data:`BACKWARD` then runs the three
programs of ``kernels/attention_bwd.py`` as one plan: ``prep`` (delta = rowsum(dO * O), fp32, laid
out like lse: the plan's per-call workspace), ``dkdv`` (each kv head's dk/dv summed over its group of
q heads, written once) and ``dq``; dq, dk, dv are new tensors laid out like q, k, v. No atomics: the
same inputs give the same bits. Varlen calls pass the token counts (``total_q``, ``total_k``) as the
kernels' bound on a sequence's length (``Sq``/``Sk``): the max sequence length would need the offsets
on the host (a synchronisation every backward), and the bound costs only programs that find no rows
and return (``batch * ceil(total / block)`` of them in place of about ``ceil(total / block) + batch``).
A dense CUDA call (``kernels/attention_bwd.py``'s ``loads`` 2, its default there) runs :data:`BACKWARD_TMA`
instead: the same three programs with their tiles by TMA, lse2 and delta in rows padded for TMA.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..autograd import grad_needed
from ..compile.build import device_backend, load_kernel
from ..compile.entry import encode_arg
from ..runtime.binding import Binding
from ..runtime.plan import (Dims, ErrorWord, Output, Plan, Ptr, Size, Step, Stride, Tag, Value, Workspace,
                            strides)
from ..runtime.views import Misfit
from ..schedules import static_for

__all__ = ["AttnKernels", "BACKWARD", "BACKWARD_TMA", "FORWARD", "backward_plan", "CUDA_ENV", "backward_specs",
           "cuda_enabled", "implement", "kernel_specs"]

#: The environment variable that, set to 0, refuses CUDA calls of the attention backward's and the paged
#: decode's tile programs (a way back to ``target="torch"``'s answers on a GPU where they misbehave).
CUDA_ENV = "TILEOPS_ATTENTION_CUDA"


def cuda_enabled(backward: bool = False) -> bool:
    """Whether CUDA calls may launch the attention kernels: the forward's, always; the backward's (a
    call whose gradient will be taken) and the paged decode's, unless :data:`CUDA_ENV` is 0.

    Both were refused by default until their CUDA tests ran to the end on the H200, which they did on
    2026-12-04 (``benchmarks/NOTES.md``): ``tests/test_attn_bwd_cuda.py`` (every head dim in fp16 and
    bf16, every mask, softcap, MHA, varlen with empty sequences, HF's views, a view off the vectors,
    determinism) and ``tests/test_attention_bwd_kernels.py``'s CUDA tests, every one passed; the
    forward's had passed on 2026-12-03."""
    if not backward:
        return True
    import os

    return os.environ.get(CUDA_ENV, "").strip().lower() not in ("0", "false", "no", "off")


#: the kernel's integer arguments bound from :meth:`AttnKernels._env` (the CUDA kernel takes the sizes
#: and strides as its tensors' dynamic extents, the C one as parameters: by name alike)
_VALUES = ("batch", "tiles", "lsb", "lsh", "has_lse", "scale_bits", "cap_bits", "window")
#: How the kernels see q, k, v, out and their gradients: ``[B, S, H, D]`` dense, ``[T, H, D]`` varlen (a
#: batch of one); a dim of extent 1 strides over what lies inside it and a stride of 0 does not fit (the
#: CUDA kernels' TMA descriptors take positive strides alone); the offsets read as dense runs
_ROWS = Dims({4: "bshd", 3: "shd"}, span=True)
DIMS = {**dict.fromkeys(("q", "k", "v", "out", "dout", "dq", "dk", "dv"), _ROWS),
        **dict.fromkeys(("cu_seqlens_q", "cu_seqlens_k"), Dims("b", vector=False, dense=True)),
        # the forward's lse, [B, Hq, Sq] or varlen [Hq, T], read (and delta written alike) one at a time
        "lse": Dims({3: "bhs", 2: "hs"}, vector=False)}


def _bsh(tensor: str, prefix: str, elements: bool = False) -> dict:
    """A tensor's (batch, row, head) stride arguments ``<prefix>s{b,s,h}``: in elements (the forward's
    TMA extents) or in the kernels' units (the backward's)."""
    return strides(tensor, f"{prefix}s", "bsh", elements)
#: the window is compared as ``j <= i + off - w`` in int32: a wider window than this hides nothing
#: that 2^30 does not (sequences hold fewer than 2^31 tokens)
_MAX_WINDOW = 2**30

_INPUTS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")
_FWD_ARGS = {"Q": Ptr("q"), "K": Ptr("k"), "V": Ptr("v"), "O": Ptr("out"), "CUQ": Ptr("cu_seqlens_q"),
             "CUK": Ptr("cu_seqlens_k"), "ERR": ErrorWord(), "tag": Tag(), "nb": Size("q", "b"), "sq": Size("q", "s"),
             "sk": Size("k", "s"), **_bsh("q", "q", True), **_bsh("k", "k", True), **_bsh("v", "v", True),
             **_bsh("out", "o", True), **{a: Value(a) for a in _VALUES}}
#: The forward: out from q, k, v (``has_lse`` 0: the kernel writes no lse); varlen calls check their
#: offsets (error word 0 for cu_seqlens_q, 1 for cu_seqlens_k)
FORWARD = Plan("attention forward", inputs=_INPUTS, outputs=(Output("out", like="q"),),
               steps=(Step("fwd", _FWD_ARGS),), checks={"cu_seqlens_q": 0, "cu_seqlens_k": 1}, dims=DIMS)
#: The forward with the lse (``has_lse`` 1), per q's rank: a new fp32 ``[B, Hq, Sq]`` (varlen ``[Hq, T]``),
#: C-contiguous, the ``lsb``/``lsh`` strides :meth:`AttnKernels._env` passes
FORWARD_LSE = {rank: Plan(f"attention forward with the lse ({rank}-D q)", inputs=_INPUTS,
                          outputs=(Output("out", like="q"), Output("lse", like="q", shape=shape, dtype="float32")),
                          steps=(Step("fwd", {**_FWD_ARGS, "LSE": Ptr("lse")}),),
                          checks={"cu_seqlens_q": 0, "cu_seqlens_k": 1}, dims=DIMS)
               for rank, shape in ((4, ("q_b", "q_h", "q_s")), (3, ("q_h", "q_s")))}


#: the values every gradient program takes: the sizes (``Sq``/``Sk`` the dense lengths, varlen the
#: token counts: the module's doc; ``G`` the q heads a kv head serves), the window and the fp32 scale and
#: softcap, lse's (and delta's) strides
_GRAD_SCALARS = {"G": Value("q_h // k_h"), "W": Value("W"), "scale": Value("scale"), "softcap": Value("softcap")}
_GRAD_VALUES = {"B": Value("B"), "Hkv": Size("k", "h"), "Sq": Size("q", "s"), "Sk": Size("k", "s"), **_GRAD_SCALARS,
                "lsb": Stride("lse", "b"), "lsh": Stride("lse", "h"), **_bsh("q", "q"), **_bsh("k", "k"),
                **_bsh("v", "v"), **_bsh("dout", "do")}
_GRAD_PTRS = {"Q": Ptr("q"), "K": Ptr("k"), "V": Ptr("v"), "DO": Ptr("dout"), "LSE": Ptr("lse"),
              "DELTA": Ptr("delta"), "CUQ": Ptr("cu_seqlens_q"), "CUK": Ptr("cu_seqlens_k")}

#: the prep's arguments (delta laid out by lse's strides; the TMA plan's prep adds its padded rows)
_PREP = {"O": Ptr("out"), "DO": Ptr("dout"), "DELTA": Ptr("delta"), "CUQ": Ptr("cu_seqlens_q"), "B": Value("B"),
         "Hq": Size("q", "h"), "Sq": Size("q", "s"), "lsb": Stride("lse", "b"), "lsh": Stride("lse", "h"),
         **_bsh("out", "o"), **_bsh("dout", "do")}

#: The backward: delta = rowsum(dO * O) into the per-call workspace (fp32, one element per query row
#: and q head, laid out like lse: ``batch * seq_q * Hq``, varlen ``total_q * Hq``), then dk/dv
#: (a program per kv block and kv head, over its group's q heads), then dq (a program per q block).
#: ``out`` and ``lse`` are the forward's; ``dout`` out's gradient.
BACKWARD = Plan(
    "attention backward", inputs=("q", "k", "v", "out", "dout", "lse", "cu_seqlens_q", "cu_seqlens_k"),
    outputs=(Output("dq", like="q"), Output("dk", like="k"), Output("dv", like="v")),
    workspaces=(Workspace("delta", "float32", "q_b * q_s * q_h"),),
    steps=(Step("prep", _PREP),
           Step("dkdv", {**_GRAD_PTRS, "DK": Ptr("dk"), "DV": Ptr("dv"), **_GRAD_VALUES, **_bsh("dk", "dk"),
                         **_bsh("dv", "dv")}),
           Step("dq", {**_GRAD_PTRS, "DQ": Ptr("dq"), **_GRAD_VALUES, **_bsh("dq", "dq")})),
    dims=DIMS)

#: The backward of a dense CUDA call with its tiles by TMA (``kernels/attention_bwd.py``'s ``loads`` 2, the
#: default of a dense call): ``prep`` also writes ``lse * log2(e)``, and both it and delta go into rows padded to
#: ``dlh`` (a multiple of 16 bytes, as TMA's strides must be; :func:`padded_rows`), two per-call workspaces
#: ``[B, Hq, dlh]``; the gradient programs take q, k, v, dO and the gradients as 4-D tensors, their sizes
#: and strides (in elements) the kernels' dynamic extents.
_TMA_VALUES = {**_GRAD_SCALARS, "B": Size("q", "b"), "Sq": Size("q", "s"), "Sk": Size("k", "s"), "Hq": Size("q", "h"),
               "Hkv": Size("k", "h"), "dlb": Value("q_h * dlh"), "dlh": Value("dlh"), **_bsh("q", "q", True),
               **_bsh("k", "k", True), **_bsh("v", "v", True), **_bsh("dout", "do", True)}
_TMA_PTRS = {"Q": Ptr("q"), "K": Ptr("k"), "V": Ptr("v"), "DO": Ptr("dout"), "LSE2": Ptr("lse2"),
             "DELTA": Ptr("delta")}
BACKWARD_TMA = Plan(
    "attention backward (TMA)", inputs=BACKWARD.inputs, outputs=BACKWARD.outputs,
    workspaces=(Workspace("lse2", "float32", "q_b * q_h * dlh"), Workspace("delta", "float32", "q_b * q_h * dlh")),
    steps=(Step("prep", {**_PREP, "LSE": Ptr("lse"), "LSE2": Ptr("lse2"), "dlh": Value("dlh")}),
           Step("dkdv", {**_TMA_PTRS, "DK": Ptr("dk"), "DV": Ptr("dv"), **_TMA_VALUES, **_bsh("dk", "dk", True),
                         **_bsh("dv", "dv", True)}),
           Step("dq", {**_TMA_PTRS, "DQ": Ptr("dq"), **_TMA_VALUES, **_bsh("dq", "dq", True)})),
    dims=DIMS)


def backward_plan(tma: bool) -> Plan:
    """The backward's plan for its programs: :data:`BACKWARD_TMA` for TMA programs (``spec.tma``), else
    :data:`BACKWARD`."""
    return BACKWARD_TMA if tma else BACKWARD


def kernel_specs(manifest: Any, params: Any, call: Any, backend: str, backward: bool = True) -> list[tuple[str, Any]]:
    """The ``(builder, spec)`` a call of one specialization launches, for ``tileops warmup``,
    ``op.compile`` and ``tileops emit``: the forward, then, with ``backward`` and a manifest that
    declares one, the backward's ``prep``, ``dkdv`` and ``dq`` (``kernels/attention_bwd.py``, at its
    default tiles for the head dim)."""
    from tileops.kernels import get_spec

    from .hooks import AttnFwdHooks

    fields = AttnFwdHooks.kernel_fields_of(params, call)
    # the manifest's static knobs are the CUDA schedule's (the C forward has none); a chosen schedule's
    # apply on its backend (tileops.schedules), the backward's by its builder's name
    own = manifest.kernel.builder
    static = static_for(manifest, call, built_in=backend == "cuda")
    out = [(own, get_spec(own)(backend=backend, **fields, **static))]
    if backward and manifest.backward is not None:
        bwd = static_for(manifest, call, BWD_BUILDER)
        out += [(BWD_BUILDER, spec) for spec in backward_specs(fields, backend, bwd)]
    return out


#: the builder of the backward's three programs
BWD_BUILDER = "attention_bwd"


def backward_specs(fields: dict, backend: str, static: "dict | None" = None) -> list[Any]:
    """The ``prep``, ``dkdv`` and ``dq`` specs of the backward of a forward of ``fields``
    (:meth:`AttnFwdHooks.kernel_fields_of`), ``static`` the knobs of ``kernels/attention_bwd.py`` a
    chosen schedule sets (:func:`tileops.schedules.static_for`; none: its defaults). ``prep`` reads o
    and dO alone: no mask field, and of the knobs ``loads`` alone."""
    from tileops.kernels import get_spec

    make = get_spec(BWD_BUILDER)
    common = dict(head_dim=fields["head_dim"], dtype=fields["dtype"], varlen=fields["varlen"], backend=backend)
    masks = dict(causal=fields["causal"], window=fields["window"], softcap=fields["softcap"])
    static = static or {}
    # each program keyed by the knobs it reads (a dq knob on the dk/dv spec would only make a second key)
    own = {kind: {k: v for k, v in static.items() if not k.startswith(other)}
           for kind, other in (("dkdv", "dq_"), ("dq", "dkdv_"))}
    # the prep takes ``loads`` alone: with TMA programs (2) it writes their padded lse2 and delta
    prep = {k: v for k, v in static.items() if k == "loads"}
    return [make(kind="prep", **common, **prep), make(kind="dkdv", **common, **masks, **own["dkdv"]),
            make(kind="dq", **common, **masks, **own["dq"])]


class AttnKernels:
    """The forward kernel of one op specialization, and how a call's tensors are handed to it."""

    def __init__(self, op: Any, call: Any):
        self.op = op
        self.device = call.device
        # (an sm_90 device's kernels are built as sm_90a: tileops.compile.build._tvm_target)
        self.backend, self.arch = device_backend(self.device)
        self.spec = kernel_specs(op.manifest, op.params, call, self.backend)[0][1]
        self.varlen = self.spec.varlen
        self.unit = self.spec.stride_unit
        self.kernel = load_kernel(op.manifest.kernel.builder, self.spec, self.backend, self.arch, self.device,
                                  self.spec.args, op_name=op.name)
        p = op.params
        self.scale = p["softmax_scale"] if p["softmax_scale"] is not None else 1.0 / math.sqrt(p["head_dim"])
        self.scale_bits = encode_arg("float", self.scale)  # the kernel reinterprets the float32's bits
        self.cap_bits = encode_arg("float", p["softcap"] if p["softcap"] is not None else 1.0)
        self.window = min(p["sliding_window"] or 0, _MAX_WINDOW)
        from .hooks import AttnFwdHooks

        self._fields = AttnFwdHooks.kernel_fields_of(p, call)
        self.call = call
        self._bwd_kernels: dict[str, Any] | None = None  # compiled at the first backward
        self._bwd_spec_list: list[Any] | None = None

    def _env(self, t: dict, lse: bool) -> dict[str, int]:
        """The forward's values besides its tensors' sizes and strides (``lse``: whether it writes one)."""
        q, hq = t["q"], self.spec.hq
        if self.varlen:
            batch, sq = t["cu_seqlens_q"].shape[0] - 1, q.shape[0]
            tiles = sq if self.backend == "c" else -(-sq // self.spec.rows_per_tile) + batch
            lsb, lsh = 0, sq
        else:
            batch, sq = q.shape[0], q.shape[1]
            tiles = -(-sq // self.spec.rows_per_tile)
            lsb, lsh = hq * sq, sq
        return {"batch": batch, "tiles": tiles, "lsb": lsb, "lsh": lsh, "has_lse": int(lse),
                "scale_bits": self.scale_bits, "cap_bits": self.cap_bits, "window": self.window}

    def _empty(self, t: dict) -> bool:
        """Whether the call launches nothing: no query rows, or (the CUDA kernel's TMA descriptors
        need a row) no keys at all. With no keys every output row is zeros and every lse -inf; the
        offsets of such a varlen call are not checked (there is no kernel to check them)."""
        q, k = t["q"], t["k"]
        rows = q.shape[0] * q.shape[1] if q.dim() == 4 else q.shape[0]
        keys = k.shape[0] * k.shape[1] if k.dim() == 4 else k.shape[0]
        return rows == 0 or keys == 0 or q.shape[-2] == 0

    # ------------------------------------------------------------------------------ calls
    def prepare(self, tensors: dict) -> dict | None:
        """The call's state: a dict (into which :meth:`forward` writes this call's lse, which the
        backward reads) when a gradient will be taken, else None (no lse is computed)."""
        return {} if grad_needed(self.op, tensors, {}) else None

    def forward(self, state: dict | None, tensors: dict, outs: dict, lse: bool = False) -> Any:
        """out (new unless given), or ``(out, lse)`` with ``lse``; with a ``state`` dict (a gradient
        will be taken: :meth:`prepare`) the lse is computed too and kept as ``state["lse"]``."""
        if state is not None:
            self._refuse_backward()
        q = tensors["q"]
        out = outs.get("out")
        out = self.op._new_output("out", tensors) if out is None else out
        want = lse or state is not None
        if self._empty(tensors):
            out.zero_()
            lse_t = None
            if want:
                shape = (q.shape[0], self.spec.hq, q.shape[1]) if q.dim() == 4 else (self.spec.hq, q.shape[0])
                lse_t = torch.full(shape, -math.inf, dtype=torch.float32, device=q.device)
        else:
            plan = FORWARD_LSE[q.dim()] if want else FORWARD
            writes = {"out": out}
            # bound once a signature, the lse's too (a new tensor a call, which the plan makes). The
            # views are tried where they lie first, as the backward's are: placing them in Python at
            # every call cost a training forward about half its host time (on a 2-core CPU, HF's views
            # of a tiny shape: 170-229 -> 96-120 us a call; tests/test_attn_fwd.py,
            # test_a_view_placed_first_on_the_lse_path_every_call)
            got = self._run(plan, plan.name, tensors, writes,
                            lambda t, w: self._bind_where_they_lie(plan, t, w))
            lse_t = got[1] if want else None  # (out, lse): out as written, the lse new
        if state is not None:
            state["lse"] = lse_t
        return (out, lse_t) if lse else out

    def _run(self, plan: Plan, name: str, tensors: dict, writes: dict, bind: Any) -> Any:
        """Run ``plan`` (its bindings cached by ``name`` and signature) on the call's tensors as they lie,
        or, where ``bind(tensors, writes)`` refuses them (None: a view no kernel addresses, or a pointer
        off the alignment), on the copies its fit policy makes (:meth:`Plan.place`), whose writes are
        copied back. The forward and the backward both run so."""
        got = self.op.run_plan(self, (name, *plan.key(tensors, writes)), lambda: bind(tensors, writes), tensors,
                               writes)
        if got is not NotImplemented:
            return got
        placed = plan.place(tensors, writes, self.unit)
        launch, fitted = placed.inputs, placed.writes
        got = self.op.run_plan(self, (name, *plan.key(launch, fitted)), lambda: bind(launch, fitted), launch, fitted)
        if got is NotImplemented:  # (place fitted the call's views and pointers: nothing is left to fit)
            raise RuntimeError(f"{self.op.name}: the {name} plan's binding refused a call its plan had placed")
        placed.copy_back()
        return got

    def _bind_where_they_lie(self, plan: Plan, tensors: dict, outs: dict) -> Binding | None:
        """``plan`` bound for the call's tensors as they lie, or None where a view is not one the kernel
        addresses (the call is then placed: :meth:`Plan.place`)."""
        if isinstance(plan.layout({**tensors, **outs}, self.unit), Misfit):
            return None
        return self._bind(plan, tensors, outs, {})

    def _bind(self, plan: Plan, tensors: dict, outs: dict, views: dict) -> Binding:
        return plan.bind({"fwd": self.kernel}, tensors, outs, env=self._env(tensors, plan is not FORWARD),
                         views=views, unit=self.unit)

    def binding(self, tensors: dict, outs: dict) -> Binding | None:
        """The binding of every later call shaped like this one (without lse), or None where the call
        must copy a view first, launches nothing, or needs its offsets made contiguous."""
        out = outs.get("out")
        view = out if out is not None else self.op._new_output("out", tensors)
        if self._empty(tensors) or isinstance(FORWARD.layout({**tensors, "out": view}, self.unit), Misfit):
            return None
        return self._bind(FORWARD, tensors, {"out": out}, {"out": view})

    # ------------------------------------------------------------------------------ backward
    def backward(self, state: dict | None, grads: tuple, tensors: dict) -> tuple:
        """``(dq, dk, dv)`` from out's gradient: :data:`BACKWARD` on the forward's q, k, v, out and lse.
        A state without the lse (the backward of a ``torch.compile`` graph, whose forward ran as a
        custom op and kept none) computes it again with a forward."""
        self._refuse_backward()
        q, k, v = tensors["q"], tensors["k"], tensors["v"]
        dout = grads[0]
        if dout is None:  # (autograd materialises a zero gradient; a direct caller may pass None)
            dout = torch.zeros_like(tensors["out"])
        if self._empty(tensors):  # no query rows or no keys: every gradient is zero
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        lse = (state or {}).get("lse")
        if lse is None:
            lse = self.forward(None, {n: t for n, t in tensors.items() if n != "out"}, {}, lse=True)[1]
        launch = {"q": q, "k": k, "v": v, "out": tensors["out"], "dout": dout, "lse": lse,
                  "cu_seqlens_q": None, "cu_seqlens_k": None}
        if self.varlen:
            launch.update(cu_seqlens_q=_monotone(tensors["cu_seqlens_q"], q.shape[0]),
                          cu_seqlens_k=_monotone(tensors["cu_seqlens_k"], k.shape[0]))
        plan = self._bwd_plan()
        # a view the kernels cannot address where it lies (a stride off 8 elements on CUDA, a last dim
        # not contiguous: an expanded dO of out.sum()) runs on dense copies; the new gradients are dense then
        return self._run(plan, "backward", launch, {}, lambda t, w: self._backward_binding(t))

    def _refuse_backward(self) -> None:
        """A CUDA call whose gradient will be taken, before any kernel runs, unless :func:`cuda_enabled`."""
        if self.backend == "cuda" and not cuda_enabled(backward=True):
            raise NotImplementedError(
                f"{self.op.name}: CUDA gradients: the attention backward's tile programs are refused by "
                f"{CUDA_ENV}=0, so a CUDA call whose inputs require grad is refused; call it under "
                f"torch.no_grad() or with inputs that do not require grad, or use target='torch' to train "
                f"through PyTorch's attention")

    def _bwd_specs(self) -> list[Any]:
        if self._bwd_spec_list is None:  # (once: the plan is chosen by them at every backward call)
            self._bwd_spec_list = backward_specs(self._fields, self.backend,
                                                 static_for(self.op.manifest, self.call, BWD_BUILDER))
        return self._bwd_spec_list

    def _bwd_plan(self) -> Plan:
        """:data:`BACKWARD_TMA` where the backward's programs take their tiles by TMA (``loads``
        2: dense CUDA calls, unless a schedule sets 1), else :data:`BACKWARD`."""
        return backward_plan(self._bwd_specs()[1].tma)

    def _bwd(self) -> dict[str, Any]:
        if self._bwd_kernels is None:
            self._bwd_kernels = {
                s.kind: load_kernel(BWD_BUILDER, s, self.backend, self.arch, self.device, s.args, op_name=self.op.name)
                for s in self._bwd_specs()}
        return self._bwd_kernels

    def _backward_binding(self, launch: dict) -> Binding | None:
        """:data:`BACKWARD` bound for tensors shaped as ``launch``; None when a view's strides are not
        ones the kernels address (the pointers each call brings, the binding checks)."""
        # the new gradients are laid out as empty_like lays out q, k, v (the binding's strides for them)
        metas = {n: torch.empty_like(launch[like], device="meta") for n, like in (("dq", "q"), ("dk", "k"),
                                                                                   ("dv", "v"))}
        plan = self._bwd_plan()
        if isinstance(plan.layout({**launch, **metas}, self.unit), Misfit):
            return None
        return plan.bind(self._bwd(), launch, {}, env=self._backward_env(launch), unit=self.unit)

    def _backward_env(self, launch: dict) -> dict[str, Any]:
        """The backward's values besides its tensors' sizes and strides: the batch (varlen: the offsets'
        count), the window, the scale and the softcap."""
        from tileops.kernels.attention_bwd import padded_rows

        batch = launch["cu_seqlens_q"].shape[0] - 1 if self.varlen else launch["q"].shape[0]
        rows = launch["q"].shape[0] if self.varlen else launch["q"].shape[1]
        return {"B": batch, "W": self.window, "scale": float(self.scale),
                "softcap": float(self.op.params["softcap"] or 0.0), "dlh": padded_rows(rows)}


def _monotone(cu: torch.Tensor, total: int) -> torch.Tensor:
    """Offsets the backward programs may follow whatever the call passed: clamped into ``[0, total]``
    and made non-decreasing on the device (no synchronisation). The programs trust their offsets;
    a bad one (which the forward reported, or will at a later call) then addresses nothing outside the
    tensors. Good offsets come back equal, as a new tensor."""
    return torch.cummax(cu.clamp(0, total), 0).values.to(torch.int32).contiguous()


def implement(op: Any, spec: Any) -> AttnKernels:
    return AttnKernels(op, spec)
