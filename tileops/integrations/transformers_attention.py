"""The attention part of :mod:`tileops.integrations.transformers`: ``patch(model, attention=True)``
runs every attention layer's softmax(q k^T) v through :class:`tileops.attention.AttnFwdOp`.

How it plugs in: through transformers' own extension points, nothing of the model's code replaced.
An attention function and a mask function are registered under the name :data:`NAME` in
``AttentionInterface`` and ``AttentionMaskInterface``, and the patched model's
``set_attn_implementation(NAME)`` makes its layers call them (``unpatch`` sets back the one it had).

What a layer's call becomes (read from the ``forward`` of Llama, Mistral, Qwen2, Qwen3, Gemma 2 and
Gemma 3 in transformers 5.17 and 5.24, which pass ``scaling``, ``sliding_window`` and Gemma 2's
``softcap`` to the attention function):

* the mask function returns what FlashAttention's does (``flash_attention_mask``): ``None`` when no
  token is padding and the keys are exactly the cache's tokens, else the 2-D boolean padding mask
  of the keys. No ``[batch, 1, q, k]`` mask is ever built on the served path. That path is taken only
  for transformers' plain patterns, causal or sliding-window causal, each with its padding: the mask
  creators say so by letting sdpa skip the mask (``allow_is_causal_skip``), which they refuse for
  anything composed on top (packed sequences found from ``position_ids``, Gemma 3's bidirectional
  image blocks and windows, a model's or/and mask functions); a decode step of one query on a static
  cache, whose skip they refuse for ``torch.compile``'s sake, is plain too unless a mask function was
  composed (``use_vmap``). Every other call gets transformers' own 4-D mask (its ``sdpa`` mask
  function) and runs as the next item but one says;
* ``None``: one dense call on the layer's ``[batch, heads, seq, head_dim]`` q, k and v as
  ``[batch, seq, heads, head_dim]`` views (no copies), GQA without repeating k and v, the causal mask
  aligned bottom-right (a decode step's query sees the whole cache) and the layer's window and
  softcap;
* a padding mask: the padded tokens are dropped and the batch runs as one varlen call
  (``cu_seqlens``), the output scattered back with zeros at padded queries. Finding the tokens
  reads the mask on the host, as transformers' FlashAttention path does; the unpadded case never
  reads anything back. A sliding window counts positions, which dropping tokens from the middle of a
  row would shift: a windowed layer's mask with a hole (a zero between ones) is not served;
* anything else the op cannot compute exactly (a 4-D mask, dropout in training, a bidirectional
  window, a dtype or head size the op does not take, a module tileops did not patch) runs
  transformers' ``sdpa`` (``eager`` where Gemma 2's softcap needs it) with the mask spelled out in
  full, and warns once per patched model and reason, naming it.

One op serves every layer with the same (heads, kv heads, head_dim, causal, scale, window,
softcap): Gemma 2/3's sliding and full layers take two.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from ..attention.attn_builtin import cuda_enabled

__all__ = ["NAME", "ATTENTION_MODEL_TYPES", "AttentionState", "attention_plan", "register", "attention_forward",
           "attention_mask"]

#: the name the attention and mask functions are registered under in transformers' interfaces
NAME = "tileops"
#: model types whose attention ``forward`` was read (see the module's docstring)
ATTENTION_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gemma3_text")
#: head sizes the op has kernels for (``AttnFwdOp``'s manifest)
HEAD_DIMS = (64, 80, 96, 128, 256)
#: the attribute of a patched attention module pointing at its model's :class:`AttentionState`
STATE_ATTR = "_tileops_attention"


class AttentionState:
    """What ``patch(attention=True)`` set on one model: the ops by configuration, the
    implementation it replaced, and the reasons calls ran transformers' attention (warned once each)."""

    def __init__(self, previous: Any) -> None:
        self.previous = previous
        self.ops: dict[tuple, Any] = {}
        self.fallbacks: set[str] = set()

    def prepare(self, modules: list[torch.nn.Module]) -> None:
        """Build, with the model, the op each module's calls will ask for, from what the module holds
        (its config's heads, its head size, scale, window and softcap, as the forwards of
        :data:`ATTENTION_MODEL_TYPES` pass them). Built at the first call inside a compiled forward,
        an op's construction (it reads its manifest) broke the graph there. A call that asks for
        another op (arguments a module does not hold) still gets it built then; an op built here that
        no call asks for stays unused."""
        for m in modules:
            config = getattr(m.config, "text_config", None) or m.config
            hq = config.num_attention_heads
            hkv = getattr(config, "num_key_value_heads", None) or hq
            d = getattr(m, "head_dim", None)
            if d not in HEAD_DIMS or hq % hkv:
                continue  # such calls are refused or fall back; nothing to build ahead
            # (Mistral passes its config's window; Qwen2/3 and Gemma their module's, None on full layers)
            window = getattr(m, "sliding_window", getattr(config, "sliding_window", None))
            self.op(*op_key(m, hq, hkv, d, getattr(m, "scaling", None), window,
                            getattr(m, "attn_logit_softcapping", None)))

    def op(self, hq: int, hkv: int, d: int, causal: bool, scale: float, window: int | None,
           softcap: float | None) -> Any:
        key = (hq, hkv, d, causal, scale, window, softcap)
        op = self.ops.get(key)
        if op is None:
            from ..attention import AttnFwdOp

            op = self.ops[key] = AttnFwdOp(hq, hkv, d, causal=causal, softmax_scale=scale, sliding_window=window,
                                           softcap=softcap)
        return op


def op_key(module: torch.nn.Module, hq: int, hkv: int, d: int, scaling: float | None, sliding_window: int | None,
           softcap: float | None) -> tuple:
    """The arguments of :meth:`AttentionState.op` for a call of ``module`` with these arguments."""
    causal = bool(getattr(module, "is_causal", True))
    scale = float(scaling) if scaling is not None else 1.0 / math.sqrt(d)
    return (hq, hkv, d, causal, scale, int(sliding_window) if sliding_window else None,
            float(softcap) if softcap else None)


def _config(model: torch.nn.Module) -> Any:
    return getattr(model.config, "text_config", None) or model.config


def attention_plan(model: torch.nn.Module, model_type: Any) -> list[torch.nn.Module]:
    """The attention modules ``patch(attention=True)`` serves; raises where the model is not served,
    before anything is touched."""
    name = "tileops.integrations.transformers.patch"
    if model_type not in ATTENTION_MODEL_TYPES:
        raise NotImplementedError(f"{name}: attention: model type {model_type!r} is not served; served: "
                                  f"{', '.join(ATTENTION_MODEL_TYPES)}")
    if not hasattr(model, "set_attn_implementation"):
        raise NotImplementedError(f"{name}: attention: expected a transformers model with set_attn_implementation "
                                  f"(transformers >= 4.56), got {type(model).__name__}")
    modules = [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "scaling")
               and hasattr(m, "q_proj")]
    if not modules:
        raise NotImplementedError(f"{name}: attention: model has no attention module with q_proj and scaling")
    return modules


def register() -> None:
    """Register the attention and mask functions under :data:`NAME` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, attention_mask)


def _plain(q_length: int, kwargs: dict) -> bool:
    """Whether the mask a creator asks for is causal or sliding-window causal with padding and nothing
    composed on top, told by the flags it passes (the module's docstring): never by calling the mask
    function, which is O(batch q k), nor by its closures, which differ between transformers releases.
    A creator that passes no flag is not known to be plain."""
    if kwargs.get("allow_is_causal_skip") is True:
        return True
    # one query on a static cache: the skip is refused for torch.compile, not for a pattern
    return (q_length == 1 and kwargs.get("use_vmap") is False and "allow_is_causal_skip" in kwargs
            and "allow_is_bidirectional_skip" not in kwargs)


def _full_mask(**arguments: Any) -> torch.Tensor:
    """transformers' own ``[batch, 1, q, k]`` boolean mask for the arguments a mask creator passed
    (its ``sdpa`` mask function, never skipped)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    return ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](**{**arguments, "allow_is_causal_skip": False,
                                                   "allow_is_bidirectional_skip": False})


def attention_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                   mask_function: Any = None, attention_mask: torch.Tensor | None = None,
                   **kwargs: Any) -> torch.Tensor | None:
    """The mask a layer gets: None (nothing padded, the keys are the cache's tokens), or the 2-D
    boolean padding mask of the keys ``[batch, <= kv_length]`` (a static cache's mask is shorter than
    its ``kv_length``: the slots past it are not filled yet). The pattern itself (causal, window)
    comes from the layer's own arguments. A pattern that is not plain (:func:`_plain`: packed
    sequences, bidirectional blocks or windows, a composed mask function) gets transformers' own 4-D
    mask instead, which the attention function hands to transformers' attention: without it, the
    packed documents of one row attended to each other (a tiny Llama's second document's logits off
    by 1.04 relative) and Gemma 3's image tokens lost their bidirectional block, with no warning.

    Without a padding mask (transformers drops an all-ones one) a static cache's keys are still not
    all tokens: a full-attention layer's ``kv_length`` is the cache's length, of which ``q_offset +
    q_length`` slots are filled. Returning None there let the queries see the unfilled slots (zeros:
    a score of 0 each, in every softmax's sum; the patched model's logits moved by 0.2 on a tiny
    Llama). The filled slots are then marked as the keys: at a decode step ``q_offset`` is the layer's
    device counter, which :class:`FilledSlots` holds unread until a path needs the mask spelled out
    (the attention function does; the prologue's paged decode does not)."""
    if isinstance(attention_mask, FilledSlots):
        attention_mask = None  # its own answer handed back (the docstring of FilledSlots): nothing padded
    if not _plain(q_length, kwargs):
        return _full_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                          kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask, **kwargs)
    if attention_mask is None:
        filled = q_offset + q_length - kv_offset
        if torch.is_tensor(filled):  # a static layer's counter: read where a path needs it, not here
            return FilledSlots(filled, batch_size, kv_length)
        if filled >= kv_length:
            return None  # the keys are exactly the tokens (a dynamic cache): nothing read
        return torch.ones(batch_size, filled, dtype=torch.bool)
    mask = attention_mask[:, -kv_length:].to(torch.bool)
    if mask.shape[1] == kv_length and bool(mask.all()):
        return None
    return mask


class FilledSlots:
    """What the mask function returns for a static cache with nothing padded: each row's keys are its
    first ``count`` cache slots, ``count`` a device counter (the layer's). Read on the host there, it
    synchronised every step, and under ``torch.compile`` broke the graph at every decode step (with
    the ops then built inside the trace too, a tiny two-layer Qwen3 patched with ``prologue=True,
    attention=True`` ran 15 graphs a step, the unpatched model 1), though the prologue's paged decode
    reads the counter on the device and needs no mask. So the read waits for a path that needs the
    mask spelled out (:meth:`mask`)."""

    #: transformers hands the mask back to the mask function as a 2-D padding mask (``generate`` builds
    #: it ahead for a compileable cache, the model's forward from it again), after ``.to(device, bool)``
    ndim = 2

    def __init__(self, count: torch.Tensor, batch: int, kv_length: int) -> None:
        self.count, self.batch, self.kv_length = count, batch, kv_length

    def to(self, *args: Any, **kwargs: Any) -> "FilledSlots":
        return self

    def mask(self) -> torch.Tensor | None:
        """The 2-D boolean mask of the filled slots, ``[batch, count]``, or None when every slot is
        filled (a host read of the counter)."""
        n = int(self.count)
        return None if n >= self.kv_length else torch.ones(self.batch, n, dtype=torch.bool)


#: the reasons warned of for modules no patch owns (a config shared with a patched model)
_UNOWNED: set[str] = set()


def _warn_once(state: AttentionState | None, why: str, runs: str) -> None:
    seen = state.fallbacks if state is not None else _UNOWNED
    if why not in seen:
        seen.add(why)
        warnings.warn(f"tileops.integrations.transformers: attention: {why}; such calls run transformers' {runs}",
                      stacklevel=3)


def _visible(sq: int, sk: int, causal: bool, window: int | None, keys: torch.Tensor | None,
             device: torch.device) -> torch.Tensor:
    """``[batch or 1, 1, sq, sk]`` bool, True where query i sees key j: the op's rule (causal aligned
    bottom-right, the window behind it) and, with ``keys`` (``[batch, <= sk]``), the padding. The
    queries are the last ``sq`` of the filled key slots, as :func:`_varlen` takes them: a static
    cache's keys run past its filled slots (``keys`` ends at them), and aligned at the end of all
    ``sk`` slots a prefill's queries saw each other's keys both ways."""
    if window is not None and not causal:
        # transformers' bidirectional windows differ (Gemma 3's sees |i - j| < w, its generic overlay
        # <= w): only its own 4-D mask, which the mask function returns for every such pattern, says which
        # (this spelled out j > i - w once, every later key visible: 0.97 relative off)
        raise NotImplementedError("tileops.integrations.transformers: attention: a sliding window without the "
                                  "causal mask needs transformers' own 4-D mask; got "
                                  f"{'no mask' if keys is None else 'a 2-D padding mask'}")
    end = sk if keys is None else keys.shape[1]
    i = torch.arange(sq, device=device)[:, None] + (end - sq)
    j = torch.arange(sk, device=device)[None, :]
    see = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if causal:
        see &= j <= i
    if window is not None:
        see &= j > i - window
    see = see[None, None]
    if keys is not None:
        pad = torch.zeros(keys.shape[0], sk, dtype=torch.bool, device=device)
        pad[:, :keys.shape[1]] = keys
        see = see & pad[:, None, None, :]
    return see


def _fallback(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              mask: torch.Tensor | None, causal: bool, window: int | None, softcap: float | None,
              dropout: float, scaling: float, kwargs: dict) -> tuple[torch.Tensor, None]:
    """transformers' own attention on an explicit mask (sdpa; eager for a softcap, which sdpa refuses)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    # the mask below is explicit: a caller's own is_causal (SigLIP's vision attention passes one) would
    # be given twice
    kwargs = {k: v for k, v in kwargs.items() if k != "is_causal"}
    if mask is None or mask.dim() == 2:
        mask = _visible(query.shape[2], key.shape[2], causal, window, mask, query.device)
    if softcap is not None:
        from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill_(
                ~mask, torch.finfo(query.dtype).min)
        return eager_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling,
                                       softcap=softcap, **kwargs)
    return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling,
                                  is_causal=False, **kwargs)


def _unserved(module: torch.nn.Module, query: torch.Tensor, mask: Any, dropout: float, causal: bool,
              window: int | None, tensors: tuple = ()) -> str | None:
    """Why the op cannot compute this call exactly, or None (``tensors``: q, k and v, for whether a
    gradient will be taken)."""
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.dtype == torch.bool):
        return ("a mask that is not causal or sliding-window with padding (packed sequences, a bidirectional "
                "block or window, a 4-D or custom mask)")
    if dropout:
        return f"attention dropout {dropout} in training"
    if window is not None and not causal:
        return "a sliding window without the causal mask (bidirectional windows are not served)"
    if query.shape[-1] not in HEAD_DIMS:
        return f"head_dim {query.shape[-1]} (served: {', '.join(map(str, HEAD_DIMS))})"
    if query.is_cuda and torch.is_grad_enabled() and not cuda_enabled(backward=True) and any(
            t.requires_grad for t in tensors):
        return "CUDA gradients (the attention backward's kernels are refused by TILEOPS_ATTENTION_CUDA=0)"
    if query.is_cuda and query.dtype not in (torch.float16, torch.bfloat16):
        return f"{query.dtype} on CUDA (served: float16, bfloat16)"
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {query.dtype}"
    return None


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function protocol: q ``[batch, Hq, seq_q, D]``, k and v ``[batch, Hkv,
    seq_k, D]`` -> ``([batch, seq_q, Hq, D], None)``."""
    if isinstance(attention_mask, FilledSlots):
        attention_mask = attention_mask.mask()
    state = getattr(module, STATE_ATTR, None)
    b, hq, sq, d = query.shape
    wanted = op_key(module, hq, key.shape[1], d, scaling, sliding_window, softcap)
    causal, scale, window, cap = wanted[3:]
    # a module not patched by tileops gets here when its config is shared with a patched model's
    # (the implementation is a config attribute): it runs transformers' attention, as before
    why = ("a module tileops did not patch (a vision tower, or a model sharing a patched model's config)"
           if state is None else _unserved(module, query, attention_mask, dropout, causal, window, (query, key, value)))
    if why is None and (key.dtype != query.dtype or value.dtype != query.dtype):
        why = f"q, k, v of dtypes {query.dtype}, {key.dtype}, {value.dtype}"
    if why is None and window is not None and attention_mask is not None and _holes(attention_mask):
        why = "a sliding window over a padding mask with a hole (a masked token between two real ones)"
    if why is not None:
        _warn_once(state, why, "eager attention" if cap is not None else "sdpa")
        return _fallback(module, query, key, value, attention_mask, causal, window, cap, dropout, scale, kwargs)
    op = state.op(*wanted)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # [B, S, H, D] views
    if attention_mask is None:
        return op(q, k, v), None
    return _varlen(op, q, k, v, attention_mask), None


def _holes(keys: torch.Tensor) -> bool:
    """Whether a row of the 2-D key mask has a masked slot between two real ones (a host read, as
    :func:`_varlen`'s): dropping it would move the later keys closer to the queries, and a window
    counts positions (a tiny Mistral of window 4 was 0.92 relative off at the real tokens)."""
    real = keys.to(torch.int32)
    starts = (real[:, 1:] > real[:, :-1]).sum(1) + real[:, 0]  # runs of real slots a row
    return bool((starts > 1).any())


def _varlen(op: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """A padded batch as one varlen call: ``keys`` ``[batch, <= seq_k]`` marks the real keys (slots
    past its length are unfilled cache slots); the queries are the last ``seq_q`` key slots. Padded
    queries get zeros, as transformers' FlashAttention path gives them."""
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    kmask = torch.zeros(b, sk, dtype=torch.bool, device=k.device)
    kmask[:, :keys.shape[1]] = keys.to(k.device)
    # the queries' own slots: the last sq of the filled ones (a static cache's mask ends at them)
    end = keys.shape[1]
    qmask = kmask[:, end - sq:end]
    kidx, qidx = kmask.flatten().nonzero().flatten(), qmask.flatten().nonzero().flatten()  # host reads
    cu_k = torch.zeros(b + 1, dtype=torch.int32, device=k.device)
    cu_q = torch.zeros(b + 1, dtype=torch.int32, device=k.device)
    cu_k[1:] = kmask.sum(1).cumsum(0)
    cu_q[1:] = qmask.sum(1).cumsum(0)
    hkv = k.shape[2]
    out = op(q.reshape(b * sq, hq, d).index_select(0, qidx), k.reshape(b * sk, hkv, d).index_select(0, kidx),
             v.reshape(b * sk, hkv, d).index_select(0, kidx), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    full = out.new_zeros(b * sq, hq, d)
    full.index_copy_(0, qidx, out)
    return full.view(b, sq, hq, d)
