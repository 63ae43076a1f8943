"""The RoPE family's hooks: everything an op of the family does besides its signature.

Each op class in :mod:`tileops.rope.ops` is generated from its manifest (``tileops generate``): its
constructor and ``forward`` signatures, its docstrings and the values it hands to the base class.
It inherits from the hook class its manifest names (``hooks:``), defined here: how the frequencies
are computed, which columns rotate, which positions are valid, and checks the rule language does
not express. Nothing here declares a parameter.
"""

from __future__ import annotations

from typing import Any

import torch

from ..op import Op
from ..runtime.errors import BadValue, unnamed
from ..runtime.memory import persistent
from . import freqs
from .tables import DIGITS, LO, DynamicNTKTables, RoPETables

#: positions the digit tables cover: [0, 2^24)
MAX_POSITION = LO**DIGITS

#: the dim of x holding a row's sequence index (``seq_len``, or the tokens of ``"ids"``), by layout
SEQ_AXIS = {"1d": 0, "2d": 1, "bhsd": 2, "ids": 0}
#: the layouts with a batch and a heads dim: ``[batch, seq_len, heads, D]`` and transformers'
#: ``[batch, heads, seq_len, D]``; one kernel serves both, through strides
BATCHED = ("2d", "bhsd")

__all__ = ["RoPEHooks", "Base", "NeoxPositionIds", "Llama31", "YaRN", "LongRoPE", "Linear", "Phi3LongRoPE",
           "DynamicNTK", "MRoPE", "MAX_POSITION", "SEQ_AXIS", "BATCHED"]


class RoPEHooks(Op):
    """What every RoPE op shares: frequencies -> tables -> one kernel builder.

    What decides the op's kernels (its layout, pairing, rotated width and extra kernel fields) is a
    function of the params alone, defined per class (``layout_of``, ``pairing_of``,
    ``rotated_width_of``, ``kernel_fields_of``), so that :func:`tileops.rope.builtin.kernel_specs`
    names an op's kernels from its manifest and params without constructing it (``tileops warmup``);
    the op reads the same through :attr:`layout`, :attr:`pairing`, :meth:`rotated_width` and
    :meth:`kernel_fields`."""

    @classmethod
    def layout_of(cls, params: Any) -> str:
        """The layout ops of this class with ``params`` see x in: ``"1d"``, ``"2d"``, ``"bhsd"`` or ``"ids"``."""
        return params["input_layout"]

    @classmethod
    def pairing_of(cls, params: Any) -> str:
        """``"neox"`` (pairs ``(i, i + R/2)``) or ``"interleaved"`` (pairs ``(2i, 2i + 1)``)."""
        return "neox"

    @classmethod
    def rotated_width_of(cls, params: Any, head_dim: int) -> int:
        """How many leading columns of a head of ``head_dim`` rotate (the rest are copied)."""
        return head_dim

    @classmethod
    def kernel_fields_of(cls, params: Any, positions: str | None) -> dict[str, Any]:
        """Fields of the kernel spec beyond the family's common ones, for a call whose
        ``position_ids`` have dtype ``positions`` (None when not given); most ops have none."""
        return {}

    @property
    def layout(self) -> str:
        """``"1d"``, ``"2d"``, ``"bhsd"`` or ``"ids"`` (position ids)."""
        return self.layout_of(self.params)

    @property
    def pairing(self) -> str:
        """``"neox"`` or ``"interleaved"``."""
        return self.pairing_of(self.params)

    def rotated_width(self, head_dim: int) -> int:
        """How many leading columns of a head of ``head_dim`` rotate."""
        return self.rotated_width_of(self.params, head_dim)

    def kernel_fields(self, positions: str | None) -> dict[str, Any]:
        """:meth:`kernel_fields_of` this op's params."""
        return self.kernel_fields_of(self.params, positions)

    def frequencies(self, rot: int) -> tuple[torch.Tensor, float]:
        """float64 inverse frequencies ``(rot // 2,)`` and the amplitude applied to cos and sin."""
        return freqs.base_inv_freq(self.params["base"], rot), 1.0

    def table_choices(self, rot: int) -> list[tuple[torch.Tensor, float]]:
        """The frequency sets a call may pick from (:meth:`choose_table`); most ops have one."""
        return [self.frequencies(rot)]

    def choose_table(self, position_ids: torch.Tensor | None, seq_len: int) -> "int | torch.Tensor":
        """Which of :meth:`table_choices` a call uses: an int, or a 0-dim int64 tensor on the
        device when the choice depends on position values (never read on the host)."""
        return 0

    def _check_more(self, tensors: Any, dims: Any) -> None:
        key, x = tensors.get("key"), tensors["x"]
        if key is not None and key.dtype != x.dtype:
            raise TypeError(f"{self.name}: key: expected dtype {str(x.dtype).replace('torch.', '')} (that of x), "
                            f"got {str(key.dtype).replace('torch.', '')}")

    def position_limit(self) -> int:
        """Positions must lie in ``[0, position_limit())``: 2^24, what the digit tables cover."""
        return MAX_POSITION

    def angles(self, positions: torch.Tensor, inv_freq: torch.Tensor, given: bool) -> torch.Tensor:
        """float64 angles ``[..., R/2]`` at ``positions`` (the call's ``position_ids`` when
        ``given``, else ``0 .. seq_len - 1``), for the ``torch`` target and the demo's reference."""
        return positions.to(torch.float64)[..., None] * inv_freq.to(positions.device)

    def deployment_tables(self, rot: int) -> RoPETables:
        """The one set of tables a cache-writing op (the attention prologue) rotates with at every
        position: keys written into a cache must keep their angles as the sequence grows, so the
        frequencies cannot change with a call's length. For most ops, their only set (the very
        :class:`RoPETables` object this op's kernels use: one copy per device); an op whose HF form
        picks per call overrides this with the fixed choice vLLM makes for a deployment."""
        return self._tables(rot)[0]

    def _tables(self, rot: int) -> list[RoPETables]:
        # kept on the op (not in a class-level cache), so tables go when the op goes
        cache = self.__dict__.setdefault("_table_cache", {})
        t = cache.get(rot)
        if t is None:
            t = cache[rot] = [RoPETables(inv, amp) for inv, amp in self.table_choices(rot)]
        return t

    def _raise_bad_value(self, name: str, values: "torch.Tensor | None", when: str = "",
                         found: "BadValue | None" = None) -> None:
        """The runtime's report of a bad checked value (:meth:`tileops.op.Op._raise_bad_value`): a RoPE
        kernel checks one input, ``position_ids``, so this is the position error."""
        self._raise_bad_position(values, when, found)

    def _raise_bad_position(self, position_ids: "torch.Tensor | None", when: str = "",
                            found: "BadValue | None" = None) -> None:
        """Raise the ValueError naming the first position outside ``[0, position_limit())``;
        ``when`` says which call it was, if not this one."""
        self.raise_bad_position(self.name, "position_ids", position_ids, when, found)

    def raise_bad_position(self, op_name: str, arg: str, positions: "torch.Tensor | None", when: str = "",
                           found: "BadValue | None" = None) -> None:
        """The ValueError of :meth:`_raise_bad_position` for a call of op ``op_name`` (this op, or one
        composing it: the attention prologue) whose input ``arg`` held ``positions`` (None: freed
        before the report, see :func:`tileops.runtime.errors.unnamed`); ``found``, the kernel's record
        of the first bad element, names it when the tensor no longer does."""
        limit = self.position_limit()
        bound = "max_position" if "max_position" in self.params else "2^24"
        of = "" if op_name == self.name else f" of {self.name}"
        # a call reported after it ran has its output: made with the bad position read as 0
        when = f" ({when}, whose kernel read it as position 0)" if when else ""
        bad = ((positions < 0) | (positions >= limit)).nonzero() if positions is not None else None
        if (bad is None or bad.shape[0] == 0) and found is not None:
            raise ValueError(f"{op_name}: {arg}: expected every value in [0, {bound}={limit}){of}, "
                             f"got {arg}{found}{when}")
        if bad is None or bad.shape[0] == 0:
            raise ValueError(f"{op_name}: {arg}: expected every value in [0, {bound}={limit}){of}; the kernel "
                             f"read one outside{when}; {unnamed(positions)}")
        idx = tuple(int(i) for i in bad[0])
        raise ValueError(f"{op_name}: {arg}: expected every value in [0, {bound}={limit}){of}, "
                         f"got {arg}[{', '.join(map(str, idx))}] = {int(positions[idx])}{when}")


class RoPEFwdHooks(RoPEHooks):
    """``RoPEFwdOp``: base frequencies; ``rope_layout`` picks the pairing."""

    @classmethod
    def pairing_of(cls, params: Any) -> str:
        return params["rope_layout"]


class _PartialRotary(RoPEHooks):
    """Neox pairing on the first ``rotary_dim`` columns; the rest are copied unchanged."""

    @classmethod
    def rotated_width_of(cls, params: Any, head_dim: int) -> int:
        rd = params["rotary_dim"]
        return head_dim if rd is None else rd


class RoPENeoxPositionIdsFwdHooks(_PartialRotary):
    """``RoPENeoxPositionIdsFwdOp``: packed tokens, positions in ``[0, max_position)``."""

    @classmethod
    def layout_of(cls, params: Any) -> str:
        return "ids"

    def position_limit(self) -> int:
        return self.params["max_position"]


class RoPELlama31FwdHooks(RoPEHooks):
    """``RoPELlama31FwdOp``: Llama 3.1's banded frequency scaling."""

    def frequencies(self, rot: int) -> tuple[torch.Tensor, float]:
        p = self.params
        return freqs.llama31_inv_freq(p["base"], rot, p["scale_factor"], p["low_freq_factor"],
                                      p["high_freq_factor"], p["original_max_position"]), 1.0


class YaRNFwdHooks(RoPEHooks):
    """``YaRNFwdOp``: YaRN's ramp between kept and interpolated frequencies, and its amplitude."""

    @classmethod
    def pairing_of(cls, params: Any) -> str:
        return params["rope_layout"]

    def frequencies(self, rot: int) -> tuple[torch.Tensor, float]:
        p = self.params
        inv = freqs.yarn_inv_freq(p["base"], rot, p["scale"], p["original_max_position"], p["beta_fast"],
                                  p["beta_slow"])
        return inv, freqs.yarn_amplitude(p["scale"], p["attn_factor"])


class LongRoPEFwdHooks(RoPEHooks):
    """``LongRoPEFwdOp``: one set of per-frequency divisors and LongRoPE's amplitude."""

    def _check_params(self, params: dict[str, Any]) -> dict[str, Any]:
        params = super()._check_params(params)
        params["rescale_factors"] = freqs.factor_table(self.name, "rescale_factors", params["rescale_factors"],
                                                       "head_dim // 2")
        return params

    def _check_more(self, tensors: Any, dims: Any) -> None:
        super()._check_more(tensors, dims)
        rf = self.params["rescale_factors"]
        if rf is not None and rf.shape[0] != dims["head_dim"] // 2:
            raise ValueError(f"{self.name}: rescale_factors: expected length head_dim // 2 = "
                             f"{dims['head_dim'] // 2} (head_dim {dims['head_dim']} of x), got length {rf.shape[0]}")

    def frequencies(self, rot: int) -> tuple[torch.Tensor, float]:
        p = self.params
        return (freqs.longrope_inv_freq(p["base"], rot, p["rescale_factors"]),
                freqs.longrope_amplitude(p["max_position_embeddings"], p["original_max_position_embeddings"]))


class RoPELinearFwdHooks(_PartialRotary):
    """``RoPELinearFwdOp``: positions divided by ``factor`` (HF ``linear``), partial rotary."""

    def frequencies(self, rot: int) -> tuple[torch.Tensor, float]:
        p = self.params
        return freqs.base_inv_freq(p["base"], rot) / p["factor"], 1.0


class Phi3LongRoPEFwdHooks(_PartialRotary):
    """``Phi3LongRoPEFwdOp``: HF's longrope, short or long factors picked per call on the device."""

    def _check_params(self, params: dict[str, Any]) -> dict[str, Any]:
        params = super()._check_params(params)
        for arg in ("short_factor", "long_factor"):
            params[arg] = freqs.factor_table(self.name, arg, params[arg], "rotary_dim // 2")
        return params

    def _check_more(self, tensors: Any, dims: Any) -> None:
        super()._check_more(tensors, dims)
        rot = self.rotated_width(dims["head_dim"])
        for arg in ("short_factor", "long_factor"):
            f = self.params[arg]
            if f is not None and f.shape[0] != rot // 2:
                raise ValueError(f"{self.name}: {arg}: expected length rotary_dim // 2 = {rot // 2} "
                                 f"(rotated width {rot} of head_dim {dims['head_dim']}), got length {f.shape[0]}")

    def amplitude(self) -> float:
        """``attention_factor``, or HF's default from the two lengths."""
        p = self.params
        if p["attention_factor"] is not None:
            return p["attention_factor"]
        return freqs.longrope_amplitude(p["max_position_embeddings"], p["original_max_position_embeddings"])

    def frequencies(self, rot: int) -> tuple[torch.Tensor, float]:
        """The short table: what a call at positions below the switch uses."""
        return freqs.longrope_inv_freq(self.params["base"], rot, self.params["short_factor"]), self.amplitude()

    def table_choices(self, rot: int) -> list[tuple[torch.Tensor, float]]:
        """``[short, long]``: :meth:`choose_table` picks one per call."""
        long = freqs.longrope_inv_freq(self.params["base"], rot, self.params["long_factor"])
        return [self.frequencies(rot), (long, self.amplitude())]

    def deployment_tables(self, rot: int) -> RoPETables:
        """The long factors when the deployment's ``max_position_embeddings`` exceeds
        ``original_max_position_embeddings``, else the short ones, at every position (vLLM's
        ``Phi3LongRoPEScaledRotaryEmbedding`` fixes the choice so; HF's per-call switch would change
        the angles of keys already in a cache once a call passes the original length)."""
        p = self.params
        return self._tables(rot)[int(p["max_position_embeddings"] > p["original_max_position_embeddings"])]

    def choose_table(self, position_ids: torch.Tensor | None, seq_len: int) -> int | torch.Tensor:
        """1 (long) when ``max(position_ids) + 1 > original_max_position_embeddings``, else 0; a
        0-dim int64 tensor on the positions' device, so nothing is read on the host."""
        omp = self.params["original_max_position_embeddings"]
        if position_ids is None:
            return int(seq_len > omp)
        return (position_ids.max() + 1 > omp).long()


class RoPEDynamicNTKFwdHooks(_PartialRotary):
    """``RoPEDynamicNTKFwdOp``: HF's dynamic NTK scaling, its length state kept on the device.

    Once per call, the state is updated on the device, with no host read: by :meth:`device_tables`
    (BUILTIN: one small kernel, ``kernels/ntk.py``, that also rewrites the digit tables when the
    length changed) or by :meth:`dynamic_inv_freq` (the ``torch`` target: torch ops). Both keep the
    one state tensor of the device, so the targets can be mixed on one op.
    """

    def frequencies(self, rot: int) -> tuple[torch.Tensor, float]:
        """The unscaled table: what a call no longer than ``max_position_embeddings`` uses."""
        return ntk_inv_freq(self.params["base"], rot, self.params["factor"], self.params["max_position_embeddings"],
                            self.params["max_position_embeddings"]), 1.0

    def deployment_tables(self, rot: int) -> RoPETables:
        """The NTK base at the deployment's maximum length, ``factor * max_position_embeddings``, at
        every position (vLLM's ``DynamicNTKScalingRotaryEmbedding``): fixed tables, where HF grows the
        base with each call's length and would change the angles of keys already in a cache."""
        cache = self.__dict__.setdefault("_deployment_tables", {})
        t = cache.get(rot)
        if t is None:
            p = self.params
            mpe = p["max_position_embeddings"]
            t = cache[rot] = RoPETables(ntk_inv_freq(p["base"], rot, p["factor"], p["factor"] * mpe, mpe), 1.0)
        return t

    def _state(self, device: torch.device) -> torch.Tensor:
        states = self.__dict__.setdefault("_ntk_state", {})
        st = states.get(device)
        if st is None:
            mpe = float(self.params["max_position_embeddings"])
            st = states.setdefault(device, persistent(
                lambda: torch.full((), mpe, dtype=torch.float64, device=device), device))
        return st

    def set_seen_length(self, length: int, device: "torch.device | str") -> None:
        """Set the longest length seen on ``device`` to ``length``, as a model that already ran has it
        (HF's ``max_seq_len_cached``): the next call grows it or goes back to ``max_position_embeddings``
        from there, as HF's would. The tables follow at that call (they are stamped with the length
        they were built for). Raises ValueError for a length below ``max_position_embeddings``, which
        the state never holds."""
        mpe = int(self.params["max_position_embeddings"])
        if isinstance(length, bool) or not isinstance(length, int) or length < mpe:
            raise ValueError(f"{self.name}: length: expected an int >= max_position_embeddings ({mpe}), got "
                             f"{length!r}")
        self._state(torch.device(device)).fill_(float(length))

    def dynamic_inv_freq(self, position_ids: torch.Tensor | None, seq_len: int, rot: int,
                         device: torch.device) -> torch.Tensor:
        """This call's ``inv_freq`` ``[rot // 2]`` float64 on ``device``, after updating the cached
        length as HF's ``dynamic_rope_update`` does (grow past it; back to the trained length when a
        call is shorter than that). A call with a position out of range (which raises) leaves the
        length alone, and rotates with the state as it was."""
        p = self.params
        mpe = float(p["max_position_embeddings"])
        st = self._state(device)
        if position_ids is None:
            seq = torch.full((), float(seq_len), dtype=torch.float64, device=device)
        else:
            seq = (position_ids.max() + 1).to(device=device, dtype=torch.float64)
        new = torch.where(seq > st, seq, torch.where(seq < mpe, torch.full_like(st, mpe), st))
        if position_ids is not None:  # a call with a position out of range raises: it leaves the state alone
            ok = ((position_ids >= 0) & (position_ids < self.position_limit())).all().to(device)
            new = torch.where(ok, new, st)
        st.copy_(new)
        return ntk_inv_freq(p["base"], rot, p["factor"], new, p["max_position_embeddings"])

    def device_tables(self, position_ids: torch.Tensor | None, seq_len: int, rot: int,
                      device: torch.device) -> torch.Tensor:
        """The digit tables for this call (``[DIGITS, LO, 2, rot // 2]`` fp32 on ``device``), after
        updating the cached length as :meth:`dynamic_inv_freq` does, in one launch
        (:class:`tileops.rope.tables.DynamicNTKTables`). The tables are the op's, rewritten in place
        by a later call that changes the length: a caller keeping them past that copies them."""
        holders = self.__dict__.setdefault("_ntk_tables", {})
        t = holders.get((device, rot))
        if t is None:
            p = self.params
            t = holders.setdefault((device, rot), DynamicNTKTables(
                self._state(device), rot, device, p["base"], p["factor"], p["max_position_embeddings"],
                self.position_limit()))
        return t.update(position_ids, seq_len, self.run_plan)


class MRoPEFwdHooks(RoPEHooks):
    """``MRoPEFwdOp``: three position streams, each pair taking the angle of the stream its section
    gives it (consecutive for Qwen2-VL / Qwen2.5-VL, interleaved for Qwen3-VL); base frequencies."""

    @classmethod
    def layout_of(cls, params: Any) -> str:
        return "ids" if params["input_layout"] == "packed" else params["input_layout"]

    def _check_params(self, params: dict[str, Any]) -> dict[str, Any]:
        params = super()._check_params(params)
        sec = params["mrope_section"]
        if len(sec) != 3 or min(sec) < 1:
            raise ValueError(f"{self.name}: mrope_section: expected 3 positive ints (pairs taking the temporal, "
                             f"height and width positions), got {list(sec)}")
        return params

    def _check_more(self, tensors: Any, dims: Any) -> None:
        super()._check_more(tensors, dims)
        sec, half = self.params["mrope_section"], dims["head_dim"] // 2
        if sum(sec) != half:
            raise ValueError(f"{self.name}: mrope_section: expected 3 counts summing to head_dim // 2 = {half} "
                             f"(head_dim {dims['head_dim']} of x; every pair takes one stream), got {list(sec)} "
                             f"(sum {sum(sec)})")
        if tensors.get("position_ids") is None and self.layout == "ids":
            raise ValueError(f"{self.name}: position_ids: expected [3, tokens] positions with "
                             f"input_layout='packed' (packed sequences have positions of their own), got None")

    @classmethod
    def kernel_fields_of(cls, params: Any, positions: str | None) -> dict[str, Any]:
        # without position_ids every stream is the sequence index: plain RoPE, the plain kernel
        if positions is None:
            return {}
        return {"mrope_section": tuple(params["mrope_section"]), "mrope_interleaved": params["mrope_interleaved"]}

    def streams(self) -> torch.Tensor:
        """The stream of each pair (:func:`tileops.rope.freqs.mrope_streams`), int64 on the CPU."""
        return freqs.mrope_streams(self.params["mrope_section"], self.params["mrope_interleaved"])

    def angles(self, positions: torch.Tensor, inv_freq: torch.Tensor, given: bool) -> torch.Tensor:
        """``[..., R/2]``: pair ``j`` at the position of its stream, ``positions[stream[j], ...]``."""
        if not given:
            return super().angles(positions, inv_freq, given)
        pick = torch.nn.functional.one_hot(self.streams(), 3).T.to(torch.float64).to(positions.device)  # [3, R/2]
        pos = positions.to(torch.float64).movedim(0, -1)  # [..., 3]
        return (pos @ pick) * inv_freq.to(positions.device)  # one non-zero term per pair: exact


def ntk_inv_freq(base: float, rot: int, factor: float, cached: "float | torch.Tensor",
                 max_position_embeddings: int) -> torch.Tensor:
    """float64 ``inv_freq`` for a cached length (HF ``_compute_dynamic_ntk_parameters``), on the
    device of ``cached`` when it is a tensor (a call's length, never read on the host)."""
    device = cached.device if isinstance(cached, torch.Tensor) else None
    b = base * (factor * cached / max_position_embeddings - (factor - 1)) ** (rot / (rot - 2))
    return b ** (-torch.arange(0, rot, 2, dtype=torch.float64, device=device) / rot)
