"""The attention-prologue part of :mod:`tileops.integrations.transformers`: ``patch(model,
prologue=True)`` runs q/k norm, RoPE and the write into transformers' ``StaticCache`` as one call of
:class:`tileops.attention.AttnPrologueFwdOp` in every attention layer of Llama, Mistral, Qwen2 and
Qwen3.

What a patched attention layer does, per call (read from those classes' ``forward`` in transformers
5.17 and 5.24, which agree on everything used here):

1. q, k and v are projected as one ``[tokens, (Hq + 2 Hkv) * head_dim]`` buffer: one matmul with the
   three weights (and biases) concatenated at the call, where the projections are plain
   ``torch.nn.Linear`` modules with no hooks (a decode step is bound by the host's launches: one
   concatenation of the weights and one matmul instead of three matmuls and a concatenation of
   their outputs; the weights stay HF's three, so nothing is held twice and an update to them is
   seen at the next call); else each module is called, as HF calls it, and the outputs concatenated;
2. the op normalises q and k per head (Qwen3's ``q_norm``/``k_norm``, Llama's rounding, the modules'
   own weights read at each call), rotates them at the ``position_ids`` the model's rotary embedding
   received (the RoPE patch tags its ``cos`` with them), writes k and v into the layer's static
   cache and returns q;
3. the attention runs as HF's would (the model's ``_attn_implementation``) on q and the whole cache;
   except a decode step (one token a sequence) of a model also patched with ``attention=True``,
   which :class:`tileops.attention.PagedAttnDecodeFwdOp` serves from the cache the op just wrote
   (``_decode``): block table ``[[0], [1], ...]`` (a sequence's block is its row of the static
   layer), lengths the layer's ``cumulative_length``, read on the device: nothing of the step is read
   back, so a compiled step is one graph (where transformers' ``generate`` drops an all-ones mask, as
   5.25 does; 5.17 hands it to every step, and reading it is the check for padding). Where a token of
   the batch is padding (the 2-D mask the attention patch passes holds a False: the op takes no
   per-sequence start; reading it is a host read), the head size is not one the op takes, or the
   op's CUDA kernels are refused (``decode_builtin.cuda_enabled``), the step runs the attention as
   above.

The static cache as the op sees it. A ``StaticLayer`` holds ``keys``/``values`` of shape
``[batch, Hkv, max_cache_len, head_dim]``: the op's ``"HND"`` layout with one block per sequence
(``block_size = max_cache_len``). Row ``b``'s token ``t`` goes to slot ``b * max_cache_len +
cumulative_length + t`` (``cumulative_length``: the layer's own device counter, which HF's
``update`` advances and so does the patched layer; no host read, so CUDA graphs and
``torch.compile`` see no sync). A token past ``max_cache_len`` gets a slot past the cache, which the
op reports as a bad ``slot_mapping`` (deferred, as RoPE's bad positions are) and never writes: HF's
own ``index_copy_`` raises there, and writing it would land in the next sequence's block.

Calls the op does not serve run HF's forward unchanged (with the RoPE and norm patches, if on):
no cache or a cache layer that is not a plain ``StaticLayer`` (``DynamicCache``, a sliding-window
layer, an offloading cache), training, a sliding window, or inputs of another dtype than the op was
built for. The first such call of each kind warns once, naming why.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from typing import Any

import torch

from ..torch_private import forward_hooked
from .transformers_norm import LLAMA, norm_form

__all__ = ["PROLOGUE_MODEL_TYPES", "PrologueLayer", "prologue_plan", "prologue_forward"]

#: model types whose attention ``forward`` was read: projections ``q_proj``/``k_proj``/``v_proj``,
#: Qwen3's per-head ``q_norm``/``k_norm`` (Llama's rounding) before RoPE, ``apply_rotary_pos_emb``
#: on the whole head, the cache's ``update(k, v, layer_idx)``, then ``ALL_ATTENTION_FUNCTIONS``
#: with ``scaling`` (and ``sliding_window`` for Mistral, Qwen2 and Qwen3)
PROLOGUE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_SLIDING = {"mistral", "qwen2", "qwen3"}  # those whose forward passes sliding_window


class PrologueLayer:
    """One attention module's plan: its op, and the names its ``forward`` takes its arguments by."""

    def __init__(self, module: torch.nn.Module, op: Any, params: list[str], cache_name: str, sliding: bool,
                 qk_norm: bool) -> None:
        self.module, self.op, self.params, self.cache_name = module, op, params, cache_name
        self.sliding, self.qk_norm = sliding, qk_norm
        self.decode: Any = None  # the decode step's PagedAttnDecodeFwdOp, made at the first step it serves
        self.tables: dict[tuple, torch.Tensor] = {}  # [[0], [1], ...] by (batch, device)


def prologue_plan(model: torch.nn.Module, model_type: Any, rope_op: Any, attentions: list[torch.nn.Module],
                  head_dim: int) -> list[PrologueLayer]:
    """The op of every attention module (one per distinct (qk norm, eps), sharing ``rope_op`` and the
    ``head_dim`` the RoPE patch found); raises where the model is not served, before anything is touched."""
    from ..attention import AttnPrologueFwdOp

    name = "tileops.integrations.transformers.patch"
    if model_type not in PROLOGUE_MODEL_TYPES:
        raise NotImplementedError(f"{name}: prologue: model type {model_type!r} is not served; served: "
                                  f"{', '.join(PROLOGUE_MODEL_TYPES)} (prologue=False keeps RoPE and norms routed)")
    config = getattr(model.config, "text_config", None) or model.config
    hq = config.num_attention_heads
    hkv = getattr(config, "num_key_value_heads", None) or hq
    ops: dict[tuple, Any] = {}
    plan = []
    for a in attentions:
        for proj in ("q_proj", "k_proj", "v_proj"):
            if not isinstance(getattr(a, proj, None), torch.nn.Linear):
                raise NotImplementedError(f"{name}: prologue: {type(a).__name__}.{proj}: expected a torch.nn.Linear, "
                                          f"got {type(getattr(a, proj, None)).__name__}")
        if getattr(a, "head_dim", head_dim) != head_dim or not isinstance(getattr(a, "layer_idx", None), int):
            raise NotImplementedError(f"{name}: prologue: {type(a).__name__}: expected head_dim {head_dim} and an "
                                      f"int layer_idx, got {getattr(a, 'head_dim', None)!r}, "
                                      f"{getattr(a, 'layer_idx', None)!r}")
        norms = [getattr(a, n, None) for n in ("q_norm", "k_norm")]
        qk_norm = norms[0] is not None
        eps = 1e-6
        if qk_norm:
            if any(norm_form(n) is not LLAMA for n in norms):
                raise NotImplementedError(f"{name}: prologue: {type(a).__name__}: q_norm/k_norm of classes "
                                          f"{[type(n).__name__ for n in norms]}: expected RMSNorm modules of "
                                          f"Llama's form (Qwen3RMSNorm)")
            eps = float(norms[0].variance_epsilon)
            if float(norms[1].variance_epsilon) != eps:
                raise NotImplementedError(f"{name}: prologue: {type(a).__name__}: q_norm eps {eps} and k_norm eps "
                                          f"{norms[1].variance_epsilon}: expected one eps (one op normalises both)")
        key = (qk_norm, eps)
        if key not in ops:
            ops[key] = AttnPrologueFwdOp(hq, hkv, head_dim, rope_op, qk_norm=qk_norm, eps=eps, cache_layout="HND")
        params = list(inspect.signature(type(a).forward).parameters)[1:]  # past self
        cache_name = next((p for p in ("cache", "past_key_values") if p in params), None)
        if cache_name is None:
            raise NotImplementedError(f"{name}: prologue: {type(a).__name__}.forward takes no cache "
                                      f"(expected a 'cache' or 'past_key_values' parameter)")
        plan.append(PrologueLayer(a, ops[key], params, cache_name, model_type in _SLIDING, qk_norm))
    return plan


def _warn_once(seen: set[str], why: str) -> None:
    if why not in seen and not torch.compiler.is_compiling():
        seen.add(why)
        warnings.warn(f"tileops.integrations.transformers: prologue: {why}; that call runs transformers' "
                      f"attention (unfused)", RuntimeWarning, stacklevel=4)


def _static_layer(cache: Any, layer_idx: int, static_type: type) -> Any:
    """The cache's layer ``layer_idx`` if it is a plain ``static_type`` (transformers' ``StaticLayer``)
    of a cache that does not offload, else None."""
    layers = getattr(cache, "layers", None)
    if layers is None or getattr(cache, "offloading", False) or layer_idx >= len(layers):
        return None
    layer = layers[layer_idx]
    return layer if type(layer) is static_type else None


def project_qkv(module: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``cat([q_proj(hidden), k_proj(hidden), v_proj(hidden)], -1)``, as one matmul where that is the
    same computation: every projection exactly a ``torch.nn.Linear`` (a subclass, a quantized linear,
    may compute otherwise from its ``weight``), with a bias on all or none, and no forward hook on
    them or on every module (a hook would not be called)."""
    projs = (module.q_proj, module.k_proj, module.v_proj)
    plain = (all(type(p) is torch.nn.Linear for p in projs) and not forward_hooked(projs)
             and len({p.bias is None for p in projs}) == 1)
    if not plain:
        return torch.cat([p(hidden) for p in projs], -1)
    bias = None if projs[0].bias is None else torch.cat([p.bias for p in projs])
    return torch.nn.functional.linear(hidden, torch.cat([p.weight for p in projs]), bias)


def prologue_forward(layer: PrologueLayer, original: Any, tag_of: Any, seen: set[str]) -> Any:
    """The attention module's forward through ``layer.op`` (:func:`prologue_plan`); ``original`` is
    the forward it replaces (HF's, with the RoPE patch's position check), ``tag_of(pe)`` the
    ``(rope op, position_ids)`` the RoPE patch tagged ``position_embeddings``' cos with (it raises
    for cos/sin from elsewhere)."""
    from transformers.cache_utils import StaticLayer
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    module, op = layer.module, layer.op
    hq, hkv, d = op.params["num_q_heads"], op.params["num_kv_heads"], op.params["head_dim"]
    eager = sys.modules[type(module).__module__].eager_attention_forward  # what HF's forward calls for "eager"

    def forward(*args, **kwargs):
        if args:  # HF's decoder layers pass everything by keyword; a caller may not
            kwargs = {**dict(zip(layer.params, args)), **kwargs}
        hidden, cache = kwargs["hidden_states"], kwargs.get(layer.cache_name)
        why = None
        if cache is None:
            why = "no cache was passed"
        elif module.training:
            why = "the module is in training mode"
        elif (static := _static_layer(cache, module.layer_idx, StaticLayer)) is None:
            layers = getattr(cache, "layers", None)
            kind = type(layers[module.layer_idx]).__name__ if layers and module.layer_idx < len(layers) else "no layer"
            why = (f"{type(cache).__name__} with a {kind} (served: a StaticCache's full-attention StaticLayer, "
                   f"not offloaded)")
        elif layer.sliding and getattr(module, "sliding_window", getattr(module.config, "sliding_window", None)):
            why = "the layer has a sliding window"
        elif hidden.dtype != module.q_proj.weight.dtype or hidden.dim() != 3:
            why = f"hidden_states of dtype {hidden.dtype} and shape {list(hidden.shape)}"
        if why is not None:
            _warn_once(seen, why)
            return original(**kwargs)
        return fused(static, tag_of(kwargs.get("position_embeddings")), kwargs)

    def fused(static: Any, tag: tuple[Any, torch.Tensor], kwargs: dict[str, Any]) -> Any:
        hidden = kwargs["hidden_states"]
        batch, seq = hidden.shape[:2]
        qkv = project_qkv(module, hidden).view(batch * seq, (hq + 2 * hkv) * d)
        if not static.is_initialized:  # HF allocates the layer at its first update, from k's shape and dtype
            empty = qkv.new_empty(batch, hkv, 0, d)
            static.lazy_initialization(empty, empty)
        _, pos = tag
        if pos.dim() == 1:
            pos = pos[None]
        # dense: [1, seq] expanded to the batch is a stride-0 view, which the op would copy on its
        # general path at every call instead of serving the call from its binding
        positions = pos.to(qkv.device).expand(batch, seq).reshape(batch * seq).contiguous()
        cap = static.max_cache_len
        at = static.cumulative_length + torch.arange(seq, device=qkv.device)
        rows = torch.arange(batch, device=qkv.device)[:, None] * cap
        # a token past the cache's length gets a slot past the whole cache: reported, never written
        slots = torch.where(at < cap, rows + at, batch * cap).reshape(batch * seq)
        norms = {}
        if layer.qk_norm:
            norms = {"q_norm_weight": module.q_norm.weight, "k_norm_weight": module.k_norm.weight}
        q = op(qkv, positions, static.keys, static.values, slots, **norms)
        static.cumulative_length.add_(seq)
        q = q.view(batch, seq, hq, d).transpose(1, 2)
        # as HF's forward picks it, per call (the model's attention implementation may be switched)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation, eager)
        mask = kwargs.get("attention_mask")
        rest = {k: v for k, v in kwargs.items() if k not in ("hidden_states", "position_embeddings", "attention_mask",
                                                             layer.cache_name)}
        if layer.sliding:
            rest["sliding_window"] = None
        if seq == 1 and _decodes(layer, q, static, mask, module.config._attn_implementation):
            return module.o_proj(_decode(layer, q, static).reshape(batch, 1, hq * d)), None
        out, weights = attend(module, q, static.keys, static.values, mask, dropout=0.0, scaling=module.scaling, **rest)
        out = out.reshape(batch, seq, -1).contiguous()
        return module.o_proj(out), weights

    return forward


#: head sizes ``PagedAttnDecodeFwdOp`` takes (its manifest)
DECODE_HEAD_DIMS = (64, 128, 256)


def _decodes(layer: PrologueLayer, q: torch.Tensor, static: Any, mask: Any, implementation: str) -> bool:
    """Whether this decode step's attention is :class:`tileops.attention.PagedAttnDecodeFwdOp`'s to serve
    (the module docstring, item 3): the model patched with ``attention=True``, a head size and device
    the op takes, the cache in q's dtype, and no padded key (the mask the attention patch's mask
    function returns: None or its ``FilledSlots``, nothing padded; or a 2-D boolean mask, read; a
    4-D mask from elsewhere is not read)."""
    from ..attention.decode_builtin import cuda_enabled
    from .transformers_attention import NAME, FilledSlots

    if implementation != NAME or q.shape[-1] not in DECODE_HEAD_DIMS or static.keys.dtype != q.dtype:
        return False
    if q.device.type == "cuda" and not cuda_enabled():
        return False
    if mask is None or isinstance(mask, FilledSlots):  # (no padding: the keys are the filled slots)
        return True
    return isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.dtype == torch.bool and bool(mask.all())


def decode_op(layer: PrologueLayer, head_dim: int) -> Any:
    """The layer's :class:`tileops.attention.PagedAttnDecodeFwdOp`, built at its first use. ``patch``
    builds it with the model (``attention=True``): built at the first decode step inside a compiled
    forward, its construction (which reads the op's manifest) broke the graph, and each layer's frame
    then compiled apart, recompiled once a layer index (Dynamo specialises on ``layer_idx``)."""
    from ..attention import PagedAttnDecodeFwdOp

    if layer.decode is None:
        op = layer.op.params
        layer.decode = PagedAttnDecodeFwdOp(op["num_q_heads"], op["num_kv_heads"], head_dim,
                                            softmax_scale=float(layer.module.scaling), cache_layout="HND")
    return layer.decode


def build_decode_ops(layers: list[PrologueLayer]) -> None:
    """Each layer's decode op (:func:`decode_op`) where its head size is one the op takes, built with
    the model (``patch(prologue=True, attention=True)``)."""
    for layer in layers:
        d = layer.op.params["head_dim"]
        if d in DECODE_HEAD_DIMS:
            decode_op(layer, d)


def _decode(layer: PrologueLayer, q: torch.Tensor, static: Any) -> torch.Tensor:
    """``[batch, Hq, D]``: one token a sequence (q, ``[batch, Hq, 1, D]``) against the static layer's
    cache, as one paged cache of ``batch`` blocks of ``max_cache_len`` rows (HND) and lengths the
    layer's ``cumulative_length`` (the current token included: the prologue wrote it)."""
    batch, hq, _, d = q.shape
    decode_op(layer, d)
    key = (batch, q.device)
    if key not in layer.tables:
        layer.tables[key] = torch.arange(batch, dtype=torch.int32, device=q.device)[:, None]
    lens = static.cumulative_length.to(torch.int32).expand(batch).contiguous()
    return layer.decode(q.view(batch, hq, d), static.keys, static.values, layer.tables[key], lens)
