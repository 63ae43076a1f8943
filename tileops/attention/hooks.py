"""The attention family's hooks: everything the prologue op does besides its signature.

:class:`AttnPrologueFwdHooks` says which call each stage its manifest's ``compose`` section names
sees inside the fused kernel (:func:`stage_calls`); :mod:`tileops.compose` asks the stages' families
for their specs, as their own ops get them, and makes the kernel spec of them. The rope stage's
tables are the one set a cache-writing op may use (:meth:`tileops.rope.hooks.RoPEHooks.deployment_tables`).
Nothing about a rope variant or a norm option is written here, so one added to its family later
reaches the fused op with no edit to this file. Checks the rule language does not express (the
rope's width against ``head_dim``, MRoPE's ``[3, tokens]`` positions, the caches' strides) are here too.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .. import compose
from ..manifest import CallSpec
from ..op import Op
from ..runtime.errors import BadValue, unnamed

__all__ = ["AttnPrologueFwdHooks", "AttnFwdHooks", "PagedAttnDecodeFwdHooks", "kernel_spec", "stage_calls"]

#: the kernel counts tokens and heads in int32
MAX_TOKENS = 2**31 - 1


def stage_calls(params: Any, qkv_dtype: str, positions: str, backend: str) -> dict[str, CallSpec]:
    """The call each composed stage sees: the rope op rotates head rows (``x``, ``head_dim`` wide, in
    qkv's dtype) at positions of the call's dtype; the norm op normalises those rows (``hidden``)
    with a weight in qkv's dtype."""
    device = torch.device("cuda" if backend == "cuda" else "cpu")
    d = params["head_dim"]
    return {"rope": CallSpec(device, (("x", qkv_dtype), ("position_ids", positions)), (("head_dim", d),)),
            "norm": CallSpec(device, (("x", qkv_dtype), ("weight", qkv_dtype)), (("hidden", d),))}


def kernel_spec(manifest: Any, params: Any, qkv_dtype: str, positions: str, slots: str, backend: str) -> Any:
    """The kernel spec of a call: the rope and norm stages' specs (:func:`tileops.compose.kernel_spec`)
    and the cache write's fields. A stage the fused builder does not build (a field of its spec the
    builder fixes, at another value) is a ValueError naming ``rope`` or ``qk_norm``."""
    fp8 = params["cache_dtype"] == "float8_e4m3fn"
    return compose.kernel_spec(manifest, params, stage_calls(params, qkv_dtype, positions, backend), backend,
                               hq=params["num_q_heads"], hkv=params["num_kv_heads"],
                               cache="float8_e4m3fn" if fp8 else "", slots=slots)


#: a paged cache's dims as the kernels name them, by ``cache_layout``: blocks, a block's rows, heads, head dim
CACHE_DIMS = {"NHD": "brhd", "HND": "bhrd"}


def block_size(cache: torch.Tensor, cache_layout: str) -> int:
    """The rows a block of ``cache`` (laid out as ``cache_layout``) holds."""
    return cache.shape[CACHE_DIMS[cache_layout].index("r")]


def _check_caches(op_name: str, kc: torch.Tensor, vc: torch.Tensor) -> None:
    """A paged cache pair as the kernels address it: a contiguous head row, and one set of strides for
    both (the kernel takes them once)."""
    for name, c in (("key_cache", kc), ("value_cache", vc)):
        if c.stride(-1) != 1:
            raise ValueError(f"{op_name}: {name}: expected a contiguous last dim (head_dim), got strides "
                             f"{list(c.stride())}")
    if kc.stride() != vc.stride():
        raise ValueError(f"{op_name}: value_cache: expected the strides of key_cache {list(kc.stride())} (one "
                         f"kernel addresses both), got {list(vc.stride())}")


class AttnPrologueFwdHooks(Op):
    """``AttnPrologueFwdOp``: the rope stage from the ``rope`` op."""

    def _check_params(self, params: dict[str, Any]) -> dict[str, Any]:
        params = super()._check_params(params)
        rope, d = params["rope"], params["head_dim"]
        if "position_ids" not in {t.name for t in rope.manifest.inputs}:
            raise TypeError(f"{self.name}: rope: expected a rope op that takes position_ids, got {rope.name}")
        rot = rope.rotated_width(d)
        if rot % 2 or not 2 <= rot <= d:
            raise ValueError(f"{self.name}: rope: expected a rotated width in [2, head_dim={d}], even; {rope.name} "
                             f"rotates {rot} columns")
        try:  # the rope's tables for this width: factor lists of another length fail here, not at a call
            rope.deployment_tables(rot)
        except (ValueError, RuntimeError, IndexError) as e:
            raise ValueError(f"{self.name}: rope: {rope.name} has no tables for head_dim {d} (rotated width "
                             f"{rot}): {e}") from None
        # what the kernel builder refuses (a stage it does not build) is refused now, not at the first call
        kernel_spec(self.manifest, params, "bfloat16", "int64", "int64", "c")
        return params

    @functools.cached_property
    def mrope(self) -> bool:
        """Whether the rope stage takes three position streams (``positions`` ``[3, tokens]``)."""
        return kernel_spec(self.manifest, self.params, "bfloat16", "int64", "int64", "c").mrope

    def _check_more(self, tensors: Any, dims: Any) -> None:
        positions, qkv = tensors["positions"], tensors["qkv"]
        if self.mrope and (positions.dim() != 2 or positions.shape[0] != 3):
            raise ValueError(f"{self.name}: positions: expected [3, tokens] for {self.params['rope'].name} (three "
                             f"streams), got shape {list(positions.shape)}")
        if not self.mrope and positions.dim() != 1:
            raise ValueError(f"{self.name}: positions: expected [tokens] for {self.params['rope'].name}, got shape "
                             f"{list(positions.shape)}")
        if qkv.shape[0] > MAX_TOKENS:
            raise ValueError(f"{self.name}: qkv: expected at most 2^31 - 1 tokens, got {qkv.shape[0]}")
        _check_caches(self.name, tensors["key_cache"], tensors["value_cache"])
        for name in ("q_norm_weight", "k_norm_weight"):
            w = tensors.get(name)
            if w is not None and w.stride(0) != 1 and w.shape[0] > 1:
                raise ValueError(f"{self.name}: {name}: expected a contiguous weight, got stride {w.stride(0)}")

    def position_limit(self) -> int:
        """Positions must lie in ``[0, position_limit())``: the rope op's limit."""
        return self.params["rope"].position_limit()

    def note_slot_limit(self, slots: int) -> None:
        """Note a cache's slot count (``num_blocks * block_size``) that a call was launched for, for a
        bad slot's error (the kernel reports that a slot was bad, not the cache it was bad for)."""
        self.__dict__.setdefault("_slot_limits", set()).add(int(slots))

    def _raise_bad_value(self, name: str, values: "torch.Tensor | None", when: str = "",
                         found: "BadValue | None" = None) -> None:
        """The ValueError naming ``positions`` (as the rope op words it) or ``slot_mapping``
        (``values`` None: freed before the report; ``found``: the kernel's record of the first bad
        element, which names it then)."""
        if name == "slot_mapping":
            # the slot counts of the caches this op was launched for (:meth:`note_slot_limit`); with one,
            # the bad call's. A server keeps one cache; with several (caches of several sizes), a slot is
            # named only where it is past every one of them, so a slot valid for its own cache never is
            limits = self.__dict__.get("_slot_limits") or set()
            limit = max(limits, default=None)
            below = "num_blocks * block_size"
            if len(limits) == 1:
                below += f" = {limit}"
            elif limits:
                below += f" (this op's caches hold {', '.join(map(str, sorted(limits)))})"
            # a call reported after it ran has written the cache, but for the bad slot's token
            when = f" ({when}, whose kernel skipped that token's cache write)" if when else ""
            bad = (values >= limit).nonzero() if limit is not None and values is not None else None
            if (bad is None or bad.shape[0] == 0) and found is not None:
                raise ValueError(f"{self.name}: slot_mapping: expected every slot below {below} "
                                 f"(or negative: skipped), got slot_mapping{found}{when}")
            if bad is None or bad.shape[0] == 0:
                why = "its cache's size is unknown" if limit is None and values is not None else unnamed(values)
                raise ValueError(f"{self.name}: slot_mapping: expected every slot below {below} (or negative: "
                                 f"skipped); the kernel read one past the cache{when}; {why}")
            i = int(bad[0, 0])
            raise ValueError(f"{self.name}: slot_mapping: expected every slot below {below} "
                             f"(or negative: skipped), got slot_mapping[{i}] = {int(values[i])}{when}")
        self.params["rope"].raise_bad_position(self.name, "positions", values, when, found)


class AttnFwdHooks(Op):
    """``AttnFwdOp``: which kernel a call needs, the dense/varlen checks the rules cannot express,
    ``return_lse`` (a flag of the manifest; refused while an input requires grad: the backward takes
    no gradient of lse) and the deferred report of bad ``cu_seqlens``."""

    @classmethod
    def kernel_fields_of(cls, params: Any, call: Any) -> dict[str, Any]:
        """The fields of :class:`kernels.attention.AttnKernelSpec` (less ``backend`` and the schedule)
        for a call of specialization ``call`` (varlen when it passes ``cu_seqlens_q``)."""
        given = dict(call.dtypes)
        return {"dtype": given["q"], "head_dim": call.dim("q_dim"), "hq": call.dim("q_heads"),
                "hkv": call.dim("kv_heads"), "causal": bool(params["causal"]),
                "window": params["sliding_window"] is not None, "softcap": params["softcap"] is not None,
                "varlen": "cu_seqlens_q" in given}

    def _check_more(self, tensors: Any, dims: Any) -> None:
        q, k = tensors["q"], tensors["k"]
        cq, ck = tensors.get("cu_seqlens_q"), tensors.get("cu_seqlens_k")
        if k.dim() != q.dim():
            raise ValueError(f"{self.name}: k: expected {q.dim()} dims as q ({'dense [batch, seq_k, Hkv, D]' if q.dim() == 4 else 'varlen [total_k, Hkv, D]'}), "
                             f"got {k.dim()} dims {list(k.shape)}")
        if q.dim() == 4:
            for name, t in (("cu_seqlens_q", cq), ("cu_seqlens_k", ck)):
                if t is not None:
                    raise ValueError(f"{self.name}: {name}: expected None with a 4-D (dense) q; varlen calls pass "
                                     f"q [total_q, Hq, D]")
        else:
            for name, t in (("cu_seqlens_q", cq), ("cu_seqlens_k", ck)):
                if t is None:
                    raise ValueError(f"{self.name}: {name}: expected int32 offsets [batch + 1] with a 3-D (varlen) "
                                     f"q, got None")
            if cq.shape[0] < 1:
                raise ValueError(f"{self.name}: cu_seqlens_q: expected batch + 1 >= 1 offsets, got shape "
                                 f"{list(cq.shape)}")
        if q.shape[:-3] and q.shape[0] > MAX_TOKENS or max(q.shape[-3], k.shape[-3]) > MAX_TOKENS:
            raise ValueError(f"{self.name}: q: expected fewer than 2^31 rows (the kernels count them in int32)")
        if q.device.type == "cuda" and q.dtype == torch.float32:
            raise TypeError(f"{self.name}: q: expected float16 or bfloat16 on CUDA (the kernel runs on tensor "
                            f"cores), got float32")

    def _flagged_call(self, tensors: Any, outs: Any, flags: Any) -> Any:
        """``return_lse=True``: ``(out, lse)``, always on the general path (its lse is a new tensor)."""
        from ..autograd import grad_needed, is_kernel_set

        if torch.compiler.is_compiling():
            raise NotImplementedError(f"{self.name}: return_lse=True is not traced by torch.compile yet; call it "
                                      f"eagerly (or without return_lse)")
        spec = self._check_call(tensors)
        given = {n: t for n, t in outs.items() if t is not None}
        if given:
            self._check_outs(tensors, given)
        needing = grad_needed(self, tensors, given)
        if needing:
            # the backward takes out's gradient alone: an lse used in a loss would reach q and k through
            # nothing (a silently wrong gradient), so a differentiable call returns no lse
            raise RuntimeError(f"{self.name}: return_lse=True while {needing[0]} requires grad: the backward does "
                               f"not take lse's gradient; call without return_lse for a differentiable out, or "
                               f"under torch.no_grad() (or with detached inputs) for the lse")
        impl = self._impl_for(spec)
        if is_kernel_set(impl):
            return impl.forward(impl.prepare(tensors), tensors, given, lse=True)
        out, lse = impl(**tensors, return_lse=True)
        if given:
            given["out"].copy_(out)
            out = given["out"]
        return out, lse

    def _raise_bad_value(self, name: str, values: "torch.Tensor | None", when: str = "",
                         found: "BadValue | None" = None) -> None:
        """The ValueError of a bad ``cu_seqlens_q``/``cu_seqlens_k`` offset the kernel found (``found``:
        its index and value; ``values``: the offsets, when still alive)."""
        what = "q's rows (total_q)" if name == "cu_seqlens_q" else "k's rows (total_k)"
        at = f"{when}: " if when else ""
        rule = f"expected offsets starting at 0, non-decreasing, and ending at the token count of {what}"
        if found is not None:
            raise ValueError(f"{self.name}: {name}: {rule}; {at}got {name}{found}")
        if values is not None:  # the offsets (on the host): the first bad one, as the kernel judges them
            cu = values.tolist()
            total = self.__dict__.get("_totals", {}).get(name)
            for i, c in enumerate(cu):
                if (i == 0 and c != 0) or (i and c < cu[i - 1]) or (i == len(cu) - 1 and total is not None
                                                                     and c != total):
                    raise ValueError(f"{self.name}: {name}: {rule}; {at}got {name}[{i}] = {c}")
        raise ValueError(f"{self.name}: {name}: {rule}; {at}the kernel found a bad offset"
                         f" ({unnamed(values)})")


class PagedAttnDecodeFwdHooks(Op):
    """``PagedAttnDecodeFwdOp``: the caches' strides (one layout for both), the counts the kernels take in
    int32, and the deferred report of a bad block-table entry or length."""

    def _check_more(self, tensors: Any, dims: Any) -> None:
        q = tensors["q"]
        _check_caches(self.name, tensors["key_cache"], tensors["value_cache"])
        bt = tensors["block_tables"]
        if bt.shape[1] * dims["block_size"] > MAX_TOKENS or dims["num_blocks"] > MAX_TOKENS:
            raise ValueError(f"{self.name}: block_tables: expected at most 2^31 - 1 tokens a sequence "
                             f"(max_blocks * block_size) and blocks (the kernels count them in int32), got "
                             f"{bt.shape[1]} x {dims['block_size']} over {dims['num_blocks']} blocks")
        if q.shape[0] > 65535:
            raise ValueError(f"{self.name}: q: expected at most 65535 sequences (a grid dimension), got {q.shape[0]}")

    def _raise_bad_value(self, name: str, values: "torch.Tensor | None", when: str = "",
                         found: "BadValue | None" = None) -> None:
        """The ValueError naming the first bad ``block_tables`` entry or ``seq_lens`` length the kernel
        found (``found``: its record), else the first the host finds in ``values``, as the kernel judges
        them (an entry is bad only where its sequence's length reaches it)."""
        at = f" ({when})" if when else ""
        limits = self.__dict__.get("_decode_limits", {"blocks": set(), "tokens": set()})

        def said(kind: str) -> str:  # one limit: the bad call's; several (caches of several sizes): all
            seen = sorted(limits[kind])
            if not seen:
                return ""
            if len(seen) == 1:
                return f" = {seen[0]}"
            return f" (this op's calls had {', '.join(map(str, seen))})"

        if name == "block_tables":
            rule = (f"expected block numbers in [0, num_blocks{said('blocks')}) where a sequence's length reaches; "
                    f"the kernel skipped that block's keys")
            if found is not None:
                raise ValueError(f"{self.name}: block_tables: {rule}; got block_tables{found}{at}")
            raise ValueError(f"{self.name}: block_tables: {rule}{at}; {unnamed(values)}")
        rule = (f"expected lengths in [0, max_blocks * block_size{said('tokens')}]; the kernel read the sequence "
                f"clamped into its table")
        if found is not None:
            raise ValueError(f"{self.name}: seq_lens: {rule}; got seq_lens{found}{at}")
        if values is not None and limits["tokens"]:  # past every table: bad for whichever call it was
            bad = ((values < 0) | (values > max(limits["tokens"]))).nonzero()
            if bad.shape[0]:
                i = int(bad[0, 0])
                raise ValueError(f"{self.name}: seq_lens: {rule}; got seq_lens[{i}] = {int(values[i])}{at}")
        raise ValueError(f"{self.name}: seq_lens: {rule}{at}; {unnamed(values)}")

    def note_decode_limits(self, blocks: int, tokens: int) -> None:
        """Note the cache's block count and a sequence's token limit a call was launched with, for a bad
        value's error (the kernel reports the value, not the limit it broke); every pair seen is kept, as
        the prologue keeps its caches' slot counts, so a report never names another call's limit alone."""
        limits = self.__dict__.setdefault("_decode_limits", {"blocks": set(), "tokens": set()})
        limits["blocks"].add(int(blocks))
        limits["tokens"].add(int(tokens))
