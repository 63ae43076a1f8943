"""Run a Hugging Face transformers model's RoPE and RMSNorm through tileops: ``patch(model)``,
``unpatch(model)``.

``patch(model, rope=True, norm=True)`` (both by default) chooses the parts. The RMSNorm modules
(:mod:`tileops.integrations.transformers_norm` says which classes and how each rounds) get an
instance-level ``forward`` that calls ``tileops.norm.RMSNormFwdOp``, one op per distinct
(eps, offset, rounding, output dtype).

How RoPE plugs in (the least a model's code is touched, in the manner of Liger's
``apply_liger_kernel_to_llama``):

* the model's rotary embedding modules (``model.model.rotary_emb``) get an instance-level
  ``forward`` that calls theirs and tags the ``cos`` it returns with ``(op, position_ids)`` (HF
  computes cos/sin once per forward from the positions and hands them to every layer unchanged);
* the attention modules get an instance-level ``forward`` that refuses a ``position_embeddings``
  whose ``cos`` is not tagged (one that did not come from the model's patched rotary embedding),
  then calls theirs;
* the modeling module's global ``apply_rotary_pos_emb`` (what the attention's forward looks up at
  call time) is replaced by one that, for tagged ``cos``, runs the op on q and k as
  ``[batch, seq, heads, head_dim]`` views with ``position_ids=``. Untagged ``cos`` (another,
  unpatched model of the same architecture) goes to the original function, so patching is per
  model although the function is per module; a patched attention never gets that far with one.

Nothing is shared between calls: the tag travels with the tensor, and there is no context variable
or other per-thread state, so concurrent eager calls cannot see each other's positions, and
``torch.compile`` traces all of it (Dynamo follows a Python attribute set on a tensor it made, and
:mod:`tileops.runtime.library` gives it the op as a custom op): a patched model compiles into the graphs an
unpatched one does, with no graph break and no recompile of its own.

``unpatch`` deletes the instance attributes (or puts back the instance ``forward`` a module had
before) and, when the last patched model of a modeling module is unpatched, puts back the original
function object.
"""

from __future__ import annotations

import inspect
import math
import sys
import threading
import warnings
import weakref
from typing import Any

import torch

from ..rope.hf import from_hf_config
from .transformers_norm import RMSNORM_CLASSES, NormOps, left_alone, norm_form, routed_forward
from .transformers_attention import NAME as _ATTN_NAME, STATE_ATTR as _ATTN_ATTR, AttentionState, attention_plan
from .transformers_attention import register as _register_attention
from .transformers_prologue import build_decode_ops, prologue_forward, prologue_plan

__all__ = ["patch", "unpatch", "is_patched", "report", "SERVED_MODEL_TYPES", "RMSNORM_CLASSES"]

#: model types whose modeling code was checked: attention applies the module-global
#: ``apply_rotary_pos_emb(q, k, cos, sin)`` to q, k ``[batch, heads, seq, head_dim]`` with cos/sin
#: from a ``*RotaryEmbedding`` module called as ``rotary_emb(x, position_ids)`` (Phi-3 rotates the
#: first ``cos.shape[-1]`` columns: partial rotary). The vision-language models (Qwen2-VL,
#: Qwen2.5-VL, Qwen3-VL, whole or their text model) pass ``position_ids`` ``[3, batch, seq]`` and
#: fold MRoPE's sections into cos/sin in the rotary embedding (``recomposition_frequencies``); their
#: vision towers have rotary embeddings and attention of their own (``*Vision*``, with
#: ``apply_rotary_pos_emb_vision``), which stay HF's.
SERVED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "qwen2_vl", "qwen2_vl_text", "qwen2_5_vl",
                      "qwen2_5_vl_text", "qwen3_vl", "qwen3_vl_text")

_STATE = "_tileops_patch"
#: the attribute of a tagged ``cos``: ``(op, position_ids)``, a tuple (the cheapest object to make
#: once per forward, and one Dynamo builds in the graph's Python side without a break)
_TAG = "_tileops"
_LOCK = threading.Lock()
_MODULES: dict[str, "_ModuleSwap"] = {}


class _ModuleSwap:
    """The replaced ``apply_rotary_pos_emb`` of one modeling module, shared by its patched models."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.original = module.apply_rotary_pos_emb
        self.users: weakref.WeakSet = weakref.WeakSet()
        original = self.original

        def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
            tag = getattr(cos, _TAG, None)
            if tag is None:  # a model that is not patched (a patched attention refuses untagged cos): HF's own
                return original(q, k, cos, sin, unsqueeze_dim)
            if unsqueeze_dim != 1:
                raise NotImplementedError(f"tileops.integrations.transformers: apply_rotary_pos_emb: expected "
                                          f"unsqueeze_dim=1 (q, k [batch, heads, seq, head_dim]), got {unsqueeze_dim}")
            return _rotate(tag, q, k)

        apply_rotary_pos_emb.__wrapped__ = original
        apply_rotary_pos_emb.__doc__ = "tileops: " + (original.__doc__ or "apply_rotary_pos_emb")
        self.replacement = apply_rotary_pos_emb


class _PatchState:
    """What ``patch`` changed on one model, for ``unpatch`` and :func:`report`."""

    def __init__(self, op: Any, model_type: str, swap: _ModuleSwap | None) -> None:
        #: the RoPE op and the swapped modeling module (both None with ``rope=False``)
        self.op, self.model_type, self.swap = op, model_type, swap
        self.wrapped: list[tuple[torch.nn.Module, Any]] = []  # (module, its previous instance forward or _NONE)
        self.norm_ops: NormOps | None = None
        self.norms: dict[str, int] = {}  # routed norm modules by class name
        self.left_alone: dict[str, int] = {}
        self.prologue_ops: list[Any] = []  # the attention prologue ops (patch(prologue=True))
        self.prologue_layers: list[Any] = []  # their layers' plans (each holds its decode op once made)
        self.prologue_fallbacks: set[str] = set()  # why calls ran transformers' attention (warned once each)
        self.attention: AttentionState | None = None  # patch(attention=True)
        self.attention_modules: list[torch.nn.Module] = []


_NONE = object()


def _rotate(tag: tuple[Any, torch.Tensor], q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k ``[batch, heads, seq, head_dim]`` -> rotated, same layout, in one launch where they lie
    (the op's ``input_layout="bhsd"``: no copies and no transposes; the four transposed views a layer
    made before were 45% of this call's host time, ``benchmarks/NOTES.md``)."""
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 4:
            raise ValueError(f"tileops.integrations.transformers: {name}: expected [batch, heads, seq, head_dim], "
                             f"got shape {list(t.shape)}")
    op, pos = tag
    batch, seq = q.shape[0], q.shape[2]
    if op.name == "MRoPEFwdOp":
        pos = _mrope_positions(pos, q)
    else:
        if pos.dim() == 2 and pos.shape[0] == 1 and batch != 1:
            pos = pos[0]  # [1, seq] shared by the batch
        if pos.shape[-1] != seq or (pos.dim() == 2 and pos.shape[0] != batch):
            raise ValueError(f"tileops.integrations.transformers: position_ids: expected [{seq}] or [{batch}, {seq}] "
                             f"(or [1, {seq}]) for q of shape {list(q.shape)}, got {list(pos.shape)}")
    if pos.device != q.device:
        pos = pos.to(q.device)
    # forward, not op(...): Op.__call__ only re-packs the arguments (0.6 us of host time per call)
    return op.forward(q, position_ids=pos, key=k)


def _mrope_positions(pos: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """MRoPE's positions ``[3, batch, seq]`` for q ``[batch, heads, seq, head_dim]``: ``[3, 1, seq]``
    and a text-only ``[batch, seq]`` are expanded to it (no copy)."""
    batch, seq = q.shape[0], q.shape[2]
    if pos.dim() == 2:  # one position per token: every stream the same (HF expands it so)
        pos = pos.expand(3, *pos.shape)
    if pos.dim() == 3 and pos.shape[0] == 3 and pos.shape[1] == 1 and batch != 1:
        pos = pos.expand(3, batch, pos.shape[2])
    if pos.dim() != 3 or tuple(pos.shape) != (3, batch, seq):
        raise ValueError(f"tileops.integrations.transformers: position_ids: expected [3, {batch}, {seq}] (or "
                         f"[3, 1, {seq}], [{batch}, {seq}]) for q of shape {list(q.shape)}, got {list(pos.shape)}")
    return pos


def is_patched(model: torch.nn.Module) -> bool:
    """Whether ``patch(model)`` is in effect."""
    return getattr(model, _STATE, None) is not None


def _check_tables(op: Any, rotary: torch.nn.Module, config: Any, head_dim: int, model_type: str) -> None:
    """The op's frequencies and amplitude must be the model's own (HF computes them in fp32)."""
    rope_type = getattr(rotary, "rope_type", "default")
    inv = getattr(rotary, "original_inv_freq", None)
    if inv is None:
        inv = rotary.inv_freq
    # model.to(torch.bfloat16) also rounds the inv_freq buffer (from_pretrained(dtype=...) keeps it
    # fp32): compare within that rounding, and say that tileops keeps the exact frequencies
    rtol = max(1e-5, torch.finfo(inv.dtype).eps) if inv.is_floating_point() else 1e-5
    if rtol > 1e-5:
        warnings.warn(f"tileops.integrations.transformers: the {model_type} model's {type(rotary).__name__}."
                      f"inv_freq is {inv.dtype} (model.to(dtype) rounds it; from_pretrained(dtype=...) keeps "
                      f"it float32); tileops uses the frequencies of the config, exact, so its RoPE differs "
                      f"from this model's own by that rounding", stacklevel=3)
    hf = [(inv.detach().double().cpu(), float(getattr(rotary, "attention_scaling", 1.0)))]
    rot = 2 * hf[0][0].numel()
    if rope_type == "longrope":  # the long set, as HF's dynamic update computes it
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        omp = op.params["original_max_position_embeddings"]
        long_inv, long_amp = ROPE_INIT_FUNCTIONS["longrope"](config, torch.device("cpu"), seq_len=omp + 1)
        hf.append((long_inv.double(), float(long_amp)))
    mine = op.table_choices(rot) if hasattr(op, "table_choices") else [op.frequencies(rot)]
    problem = None
    if op.rotated_width(head_dim) != rot:
        problem = f"it rotates {rot} of {head_dim} columns, the op {op.rotated_width(head_dim)}"
    elif len(mine) < len(hf):
        problem = f"it switches between {len(hf)} frequency sets, the op has {len(mine)}"
    else:
        for (a, amp_a), (b, amp_b) in zip(hf, mine):
            if a.shape != b.shape or not torch.allclose(a, b.double(), rtol=rtol, atol=0) or not math.isclose(
                    amp_a, amp_b, rel_tol=1e-6):
                problem = (f"its inv_freq/attention_scaling differ from the op's "
                           f"(largest relative difference {float(((a - b) / b).abs().max()):.3g}, "
                           f"amplitudes {amp_a} vs {amp_b})")
                break
    if problem is None and op.name == "MRoPEFwdOp":
        problem = _mrope_problem(op, rotary, rot)
    if problem:
        raise NotImplementedError(f"tileops.integrations.transformers: {model_type} with rope type {rope_type!r}: "
                                  f"the model's {type(rotary).__name__} does not match {op.name} built from its "
                                  f"config: {problem}")


def _carry_seen_length(op: Any, rotaries: list, model_type: str) -> None:
    """Dynamic NTK: the op starts from the longest length the model's rotary embedding has seen
    (``max_seq_len_cached``, which HF's ``dynamic_rope_update`` keeps across calls and which patched
    calls keep updating, the rotary embedding still running). From the trained length instead, a model
    that had run 64 tokens (trained on 32) rotated a 40-token call with other frequencies than HF's:
    logits 0.023 relative off."""
    if not hasattr(op, "set_seen_length"):
        return
    seen = {int(getattr(r, "max_seq_len_cached", op.params["max_position_embeddings"])) for r in rotaries}
    if len(seen) > 1:
        raise NotImplementedError(f"tileops.integrations.transformers.patch: {model_type} with rope type 'dynamic': "
                                  f"its rotary embeddings have seen different lengths ({sorted(seen)}); one op "
                                  f"serves them all")
    # on the device the rotary embedding is on now (a model moved after patch() starts the op's state of
    # its new device at the trained length, as a fresh op's)
    op.set_seen_length(max(seen.pop(), int(op.params["max_position_embeddings"])), rotaries[0].inv_freq.device)


def _mrope_problem(op: Any, rotary: torch.nn.Module, rot: int) -> str | None:
    """Whether the model's rotary embedding assigns each pair the stream the op does: its own
    ``recomposition_frequencies`` applied to a marker (stream c holding the value c) reads the map
    back, so the check follows the installed transformers, not a copy of its rule."""
    recompose = getattr(rotary, "recomposition_frequencies", None)
    if recompose is None:  # transformers that applies MRoPE elsewhere (apply_multimodal_rotary_pos_emb)
        return (f"it has no recomposition_frequencies (this transformers {_version()} applies MRoPE "
                f"where tileops does not hook it)")
    marker = torch.arange(3, dtype=torch.float32).view(3, 1, 1, 1).expand(3, 1, 1, rot // 2).clone()
    got = recompose(marker)
    if tuple(got.shape[-1:]) != (rot,) or not torch.equal(got[..., : rot // 2], got[..., rot // 2:]):
        return f"its recomposed cos/sin have shape {list(got.shape)}, not [..., {rot}] with equal halves"
    mine = op.streams().to(torch.float32)
    theirs = got.reshape(-1, rot)[0, : rot // 2]
    if not torch.equal(theirs, mine):
        return (f"its mrope_section gives the pairs the streams {theirs.long().tolist()}, the op "
                f"{mine.long().tolist()}")
    return None


def _version() -> str:
    import transformers

    return transformers.__version__


def patch(model: torch.nn.Module, *, rope: bool = True, norm: bool = True, prologue: bool = False,
          attention: bool = False) -> torch.nn.Module:
    """Make a transformers model run its RoPE and its RMSNorm modules through tileops; returns ``model``.

    RoPE (``rope=True``): the op is :func:`tileops.rope.from_hf_config` of ``model.config``; it gets
    q and k as ``[batch, seq, heads, head_dim]`` views of HF's ``[batch, heads, seq, head_dim]`` and
    the ``position_ids`` the model's rotary embedding received (``[1, seq]`` is shared by the batch),
    so prefill, decode with a KV cache, left padding, ``generate()`` and training (gradients reach
    ``q_proj``/``k_proj``) all see HF's positions.

    RMSNorm (``norm=True``): every module of a class in :data:`RMSNORM_CLASSES` (Llama, Mistral,
    Qwen2, Qwen3 with its ``q_norm``/``k_norm``, Phi-3, the Qwen-VL text models, Gemma 1/2/3 with
    ``1 + weight``, Olmo2) runs ``tileops.norm.RMSNormFwdOp`` with the module's eps and the rounding
    of its class, one op per distinct configuration; its output has the dtype HF's has (fp32 for
    Llama's form with an fp32 weight and a 16-bit input), and gradients reach the module's weight.
    Modules of other classes are left alone (:func:`report` lists both).

    Attention prologue (``prologue=True``, with ``rope=True``; Llama, Mistral, Qwen2, Qwen3): each
    attention layer runs its q/k norm (Qwen3's ``q_norm``/``k_norm``), RoPE and the write of k and v
    into transformers' ``StaticCache`` as one call of :class:`tileops.attention.AttnPrologueFwdOp`
    (``generate(..., cache_implementation="static")``); a call the op does not serve (another
    cache, training, a sliding window) runs transformers' attention and warns once naming why
    (:mod:`tileops.integrations.transformers_prologue` says which calls and how the static cache
    maps onto the op's paged layout).

    Attention (``attention=True``; Llama, Mistral, Qwen2, Qwen3, Gemma 2 and 3): every attention
    layer's softmax(q k^T) v runs :class:`tileops.attention.AttnFwdOp`, registered as the attention
    implementation ``"tileops"`` through transformers' ``AttentionInterface`` (prefill, decode and
    training, with the layers' windows and softcaps; a padded batch as one varlen call). A call it
    does not serve (a 4-D mask, dropout in training) runs transformers' ``sdpa`` and warns once,
    naming why (:mod:`tileops.integrations.transformers_attention`). Gemma's RoPE is not served:
    patch it with ``rope=False``.

    Other models, patched or not, are unaffected.

    Args:
        model (torch.nn.Module): A transformers model (e.g. ``LlamaForCausalLM``); with ``rope=True``
            its ``config.model_type`` must be one of :data:`SERVED_MODEL_TYPES`.
        rope (bool): Route the rotary embedding. Default True.
        norm (bool): Route the RMSNorm modules. Default True; ``norm=False`` is the RoPE-only patch,
            ``rope=False`` routes the norms alone (Gemma, Olmo2: model types whose RoPE is not served).
        prologue (bool): Fuse each attention layer's q/k norm, RoPE and static-cache write into one
            call. Default False; needs ``rope=True``.
        attention (bool): Run attention itself through tileops. Default False.

    Returns:
        torch.nn.Module: ``model``, patched.

    Raises:
        NotImplementedError: With ``rope``: the model type, its rope type or its rotary settings are
            not served (the message names them), or the model's own frequency tables differ from the
            op's. With ``norm``: the model has no module of a class in :data:`RMSNORM_CLASSES`.
        ValueError: ``model`` (or a module in it) is already patched (call :func:`unpatch` first),
            ``rope``, ``norm`` and ``attention`` are all False, or ``prologue`` is True without ``rope``.
        TypeError: ``model`` is not a torch module with a ``config``, or ``rope``/``norm``/``prologue``/
            ``attention`` is not a bool.
    """
    name = "tileops.integrations.transformers.patch"
    if not isinstance(model, torch.nn.Module) or getattr(model, "config", None) is None:
        raise TypeError(f"{name}: model: expected a transformers model "
                        f"(a torch.nn.Module with a config), got {type(model).__name__}")
    for key, value in (("rope", rope), ("norm", norm), ("prologue", prologue), ("attention", attention)):
        if not isinstance(value, bool):
            raise TypeError(f"{name}: {key}: expected a bool, got {type(value).__name__} {value!r}")
    if not (rope or norm or attention):
        raise ValueError(f"{name}: rope, norm, attention: expected at least one of them True, got all False "
                         f"(nothing to patch)")
    if prologue and not rope:
        raise ValueError(f"{name}: prologue: expected rope=True with it (the fused layers take the positions "
                         f"the patched rotary embedding tags cos with), got rope=False")
    if is_patched(model):
        raise ValueError(f"{name}: model: expected a model not patched yet, got one already patched (unpatch it first)")
    for m in model.modules():
        if getattr(m.__dict__.get("forward"), "_tileops_wrapper", False):
            raise ValueError(f"{name}: model: expected a model not patched yet, got one whose "
                             f"{type(m).__name__} is already patched (through another module)")
    model_type = getattr(model.config, "model_type", None)
    # everything is checked, and every op built, before the model is touched
    norm_ops, norms = _norm_plan(model, model_type) if norm else (None, [])
    plan = _rope_plan(model, model_type) if rope else None
    fused = (prologue_plan(model, model_type, plan["op"], [a for a, _ in plan["attentions"]], plan["head_dim"])
             if prologue else [])
    attentions = attention_plan(model, model_type) if attention else []

    swap = None
    if plan is not None:
        mod = plan["module"]
        with _LOCK:
            swap = _MODULES.get(mod.__name__)
            if swap is None or mod.apply_rotary_pos_emb is not swap.replacement:
                if swap is not None and len(swap.users):
                    raise RuntimeError(f"{name}: {mod.__name__}.apply_rotary_pos_emb "
                                       f"was replaced by someone else while tileops had it patched")
                swap = _MODULES[mod.__name__] = _ModuleSwap(mod)
                mod.apply_rotary_pos_emb = swap.replacement
    state = _PatchState(plan["op"] if plan else None, model_type, swap)
    if swap is not None:
        with _LOCK:
            swap.users.add(state)
        for r in plan["rotaries"]:
            _wrap(state, r, _rotary_forward(r.forward, plan["op"]))
        layers = {id(layer.module): layer for layer in fused}
        for a, slot in plan["attentions"]:
            checked = _attention_forward(a.forward, slot, model_type)
            if id(a) in layers:
                checked = prologue_forward(layers[id(a)], checked, lambda pe: _tag_of(pe, model_type),
                                           state.prologue_fallbacks)
            _wrap(state, a, checked)
        state.prologue_ops = list({id(layer.op): layer.op for layer in fused}.values())
        state.prologue_layers = list(fused)
    state.norm_ops = norm_ops
    for m, ops in norms:
        _wrap(state, m, routed_forward(m, ops, m.forward))
        state.norms[type(m).__name__] = state.norms.get(type(m).__name__, 0) + 1
    state.left_alone = left_alone(model)
    if attention:
        _register_attention()
        state.attention = AttentionState(model.config._attn_implementation)
        state.attention_modules = attentions
        state.attention.prepare(attentions)
        build_decode_ops(fused)
        for a in attentions:
            object.__setattr__(a, _ATTN_ATTR, state.attention)
        model.set_attn_implementation(_ATTN_NAME)
    object.__setattr__(model, _STATE, state)
    return model


def _norm_plan(model: torch.nn.Module, model_type: Any) -> tuple[NormOps, list[tuple[torch.nn.Module, Any]]]:
    """The model's ops, and (module, its two ops) for every routed RMSNorm module."""
    ops = NormOps()
    plan = [(m, ops.for_module(m, form)) for m in model.modules() if (form := norm_form(m)) is not None]
    if not plan:
        others = left_alone(model)
        raise NotImplementedError(
            f"tileops.integrations.transformers.patch: norm: {model_type!r} model {type(model).__name__} has no "
            f"RMSNorm module of a served class (found {', '.join(sorted(others)) or 'no norm modules'}); served: "
            f"{', '.join(RMSNORM_CLASSES)} (norm=False patches the RoPE alone)")
    return ops, plan


def _rope_plan(model: torch.nn.Module, model_type: Any) -> dict[str, Any]:
    """The RoPE op and the modules to wrap, every check done; raises where the model is not served."""
    name = "tileops.integrations.transformers.patch"
    config = model.config
    if model_type not in SERVED_MODEL_TYPES:
        has_norms = any(norm_form(m) is not None for m in model.modules())
        hint = " (patch(model, rope=False) routes its RMSNorm modules alone)" if has_norms else ""
        raise NotImplementedError(f"{name}: model type {model_type!r} ({type(model).__name__}) is not served for "
                                  f"RoPE; served: {', '.join(SERVED_MODEL_TYPES)}{hint}")
    # a vision tower's rotary embedding (Qwen2-VL's) is not the language model's: it stays HF's
    rotaries = [m for m in model.modules()
                if type(m).__name__.endswith("RotaryEmbedding") and "Vision" not in type(m).__name__]
    if not rotaries:
        raise NotImplementedError(f"{name}: {model_type} model {type(model).__name__} has no *RotaryEmbedding module")
    modules = {type(m).__module__ for m in rotaries}
    mod = sys.modules.get(modules.pop()) if len(modules) == 1 else None
    if mod is None or not callable(getattr(mod, "apply_rotary_pos_emb", None)):
        raise NotImplementedError(f"{name}: {model_type}: its rotary embedding "
                                  f"is not defined next to a module-level apply_rotary_pos_emb")
    # the vision tower's attention (apply_rotary_pos_emb_vision, its own cos/sin) stays HF's too
    attentions = [m for m in model.modules() if type(m).__module__ == mod.__name__
                  and type(m).__name__.endswith("Attention") and "Vision" not in type(m).__name__]
    if not attentions:
        raise NotImplementedError(f"{name}: {model_type}: no attention module of {mod.__name__} found")
    # where each attention's forward takes position_embeddings when they are passed by position (the
    # class's signature: an instance-level forward may be someone's (*args, **kwargs) wrapper)
    slots = []
    for a in attentions:
        names = list(inspect.signature(type(a).forward).parameters)[1:]  # past self
        if "position_embeddings" not in names:
            raise NotImplementedError(f"{name}: {model_type}: "
                                      f"{type(a).__name__}.forward takes no position_embeddings (cos, sin)")
        slots.append((a, names.index("position_embeddings")))
    try:
        op = from_hf_config(config, input_layout="bhsd")  # q and k as the attention hands them over
    except NotImplementedError as e:
        raise NotImplementedError(f"{name}: {model_type}: {e}") from None
    text = getattr(config, "text_config", None) or config  # a vision-language model: its text model's
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    for r in rotaries:
        _check_tables(op, r, config, head_dim, model_type)
    _carry_seen_length(op, rotaries, model_type)
    return {"op": op, "module": mod, "rotaries": rotaries, "attentions": slots, "head_dim": head_dim}


def _wrap(state: _PatchState, module: torch.nn.Module, forward: Any) -> None:
    forward._tileops_wrapper = True
    state.wrapped.append((module, module.__dict__.get("forward", _NONE)))
    module.forward = forward


def _rotary_forward(forward: Any, op: Any) -> Any:
    def tagged_forward(x, position_ids, *args, **kwargs):
        cos, sin = forward(x, position_ids, *args, **kwargs)
        setattr(cos, _TAG, (op, position_ids))
        return cos, sin

    return tagged_forward


def _tag_of(pe: Any, model_type: str) -> tuple[Any, torch.Tensor]:
    """The ``(op, position_ids)`` the patched rotary embedding tagged ``position_embeddings``' cos
    with; refuses cos/sin that did not come from it (the replaced ``apply_rotary_pos_emb`` would
    hand untagged cos to HF's function)."""
    tag = None if pe is None else getattr(pe[0], _TAG, None)
    if tag is None:
        raise RuntimeError(
            f"tileops.integrations.transformers: {model_type} model patched by tileops: the cos in "
            f"position_embeddings carries no position_ids (it did not come from the model's patched "
            f"rotary embedding); refusing to rotate without positions")
    return tag


def _attention_forward(forward: Any, slot: int, model_type: str) -> Any:
    """The attention's forward, refusing cos/sin that did not come from the patched rotary embedding."""

    def checked_forward(*args, **kwargs):
        _tag_of(args[slot] if len(args) > slot else kwargs.get("position_embeddings"), model_type)
        return forward(*args, **kwargs)

    return checked_forward


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`patch`: every wrapped module's ``forward`` is what it was (the class's, or the
    instance-level object it had before) and, once no patched model of its architecture remains, the
    modeling module's ``apply_rotary_pos_emb`` is the original object again.

    Raises:
        ValueError: ``model`` is not patched.
    """
    state = _state(model, "unpatch")
    for module, previous in reversed(state.wrapped):
        if previous is _NONE:
            del module.forward
        else:
            module.forward = previous
    state.wrapped.clear()
    if state.attention is not None:
        model.set_attn_implementation(state.attention.previous)
        for a in state.attention_modules:
            object.__delattr__(a, _ATTN_ATTR)
    swap = state.swap
    if swap is not None:
        with _LOCK:
            swap.users.discard(state)
            if not len(swap.users) and swap.module.apply_rotary_pos_emb is swap.replacement:
                swap.module.apply_rotary_pos_emb = swap.original
                _MODULES.pop(swap.module.__name__, None)
    object.__delattr__(model, _STATE)
    return model


def _state(model: torch.nn.Module, caller: str) -> _PatchState:
    state = getattr(model, _STATE, None)
    if state is None:
        raise ValueError(f"tileops.integrations.transformers.{caller}: model: expected a model patched by "
                         f"tileops, got one that is not ({type(model).__name__})")
    return state


def report(model: torch.nn.Module) -> dict[str, Any]:
    """What :func:`patch` routed through tileops in ``model``.

    Returns:
        dict: ``rope``: the RoPE op, or None (``rope=False``); ``norm``: the routed RMSNorm modules
        by class name (how many of each; empty with ``norm=False``); ``norm_ops``: the norm ops built,
        one per distinct (eps, offset, rounding, out_dtype); ``left_alone``: the model's other norm
        modules (a class name holding ``Norm``) by class name, which stay transformers';
        ``prologue``: the attention prologue ops (empty without ``prologue=True``);
        ``prologue_fallbacks``: why attention calls ran unfused so far (each kind once);
        ``attention``: the attention ops (``attention=True``: those built with the model, and any
        other a call asked for); ``attention_fallbacks``: why attention calls ran transformers'
        attention so far (each kind once); ``decode``: the decode ops (``prologue=True,
        attention=True``: a static cache's decode steps; built with the model).

    Raises:
        ValueError: ``model`` is not patched.
    """
    state = _state(model, "report")
    return {"rope": state.op, "norm": dict(state.norms),
            "norm_ops": list(state.norm_ops.ops.values()) if state.norm_ops else [],
            "left_alone": dict(state.left_alone), "prologue": list(state.prologue_ops),
            "prologue_fallbacks": sorted(state.prologue_fallbacks),
            "attention": list(state.attention.ops.values()) if state.attention else [],
            "attention_fallbacks": sorted(state.attention.fallbacks) if state.attention else [],
            "decode": [layer.decode for layer in state.prologue_layers if layer.decode is not None]}
