"""How a kernel reports a bad value it checked: the layout of a call's error entry, and the macro
that writes it.

A kernel that checks an input's values (RoPE's positions, the prologue's slots) gets ``ERR``, its
call's entry of :data:`ENTRY` int32 words in pinned host memory (:mod:`tileops.runtime.errors`), and
the call's ``tag``. Checked input ``k`` (``k < CHECKS``) owns

* ``ERR[k]``: the tag, written by every thread that finds a bad value (the runtime judges a call by
  it: a word holding the call's own tag says the call was bad);
* ``ERR[CHECKS + 2k]``, ``ERR[CHECKS + 2k + 1]``: one 64-bit record of the *first* bad element, as
  ``RECORD_MAX - (offset << 32 | uint32(value))``, low word first. ``offset`` is the element's
  offset from the input's pointer, in elements, which the runtime turns into an index with the
  strides it launched with; ``value`` the value read, saturated to int32. The largest record is the
  smallest offset, so the CUDA kernel keeps it with one ``atomicMax`` whatever order its threads
  find bad values in, and a fresh entry (all zeros) holds none. The report names the index and the
  value even when the tensor was freed before it (a temporary passed to a deferred call: the common
  ``op(x, position_ids=pos.to("cuda"))``), where it could once only say that the index was unknown.

``offset`` saturates at :data:`OFFSET_MAX` (an index past 2^31 - 2 elements is reported as unknown)
and ``value`` at int32's range (the report says "or beyond" for a saturated value). The C backend
runs one thread, so it compares and stores the two words in plain code; the CUDA one calls
:data:`CUDA_SOURCE`'s ``tileops_report`` (a kernel that reports imports it).
"""

from __future__ import annotations

from typing import Any

__all__ = ["CHECKS", "ENTRY", "OFFSET_MAX", "RECORD_MAX", "CUDA_SOURCE", "report"]

#: checked inputs a call may have, and so tag words an entry starts with
CHECKS = 4
#: int32 words of one call's entry: the tags, then a two-word record per checked input
ENTRY = CHECKS + 2 * CHECKS
#: the largest offset a record holds exactly (one more is "at or past")
OFFSET_MAX = 0x7FFFFFFE
#: records are stored subtracted from this, so that the smallest offset is the largest record
RECORD_MAX = 0x7FFFFFFFFFFFFFFF

#: ``tileops_report(err, k, tag, offset, value)``: the tag, and the record kept by ``atomicMax`` (a
#: 64-bit atomic on the two words: ``err + CHECKS`` is 16 bytes into an entry whose size, 48 bytes,
#: keeps every entry of a chunk 16-byte aligned)
CUDA_SOURCE = f"""
__device__ __forceinline__ void tileops_report(int* err, int k, int tag, long long offset, long long value) {{
  err[k] = tag;
  unsigned long long off = offset < 0 ? 0ULL : offset > {OFFSET_MAX}LL ? {OFFSET_MAX}ULL : (unsigned long long)offset;
  long long v = value < -2147483648LL ? -2147483648LL : value > 2147483647LL ? 2147483647LL : value;
  unsigned long long packed = (off << 32) | (unsigned long long)(unsigned int)(int)v;
  atomicMax(reinterpret_cast<unsigned long long*>(err + {CHECKS}) + k, {RECORD_MAX}ULL - packed);
}}
"""


def report(backend: str) -> Any:
    """A macro ``report(ERR, k, tag, offset, value)`` for ``backend`` (``cuda`` or ``c``): the bad
    element at ``offset`` of checked input ``k`` held ``value`` (both int64 expressions)."""
    import tilelang.language as T

    if backend == "cuda":
        @T.macro
        def report_cuda(ERR, k, tag, offset, value):
            T.call_extern("handle", "tileops_report", T.address_of(ERR[0]), k, tag,
                          T.cast(offset, "int64"), T.cast(value, "int64"))

        return report_cuda

    @T.macro
    def report_c(ERR, k, tag, offset, value):
        ERR[k] = tag
        off = T.max(T.min(T.cast(offset, "int64"), T.int64(OFFSET_MAX)), T.int64(0))
        v = T.max(T.min(T.cast(value, "int64"), T.int64(2**31 - 1)), T.int64(-(2**31)))
        # in a variable: an expression, TVM's simplifier rewrote ``record > held`` as
        # ``held + packed < RECORD_MAX``, which overflows int64
        record = T.alloc_var("int64")
        record = T.int64(RECORD_MAX) - ((off << T.int64(32)) | (v & T.int64(0xFFFFFFFF)))
        lo = CHECKS + 2 * k
        held = (T.cast(ERR[lo + 1], "int64") << T.int64(32)) | (T.cast(ERR[lo], "int64") & T.int64(0xFFFFFFFF))
        if record > held:
            ERR[lo] = T.cast(record & T.int64(0xFFFFFFFF), "int32")
            ERR[lo + 1] = T.cast(record >> T.int64(32), "int32")

    return report_c
