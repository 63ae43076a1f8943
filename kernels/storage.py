"""How a tile program stores and converts each element type, for every builder.

TileLang's C backend has no bfloat16 type: a bf16 buffer is declared as int16 there and converted
to and from fp32 by hand (the bits of a bf16 are the top half of an fp32's). On CUDA every dtype is
its own type. Arithmetic is fp32 whatever the stored type.

TileLang is imported by the first conversion, while a kernel is built: importing this module (as a
builder module does at its top) imports no TileLang, so a process that loads cached kernels never does.
"""

from __future__ import annotations

__all__ = ["storage_dtype", "load_f32", "to_storage", "round_to"]


def storage_dtype(dtype: str, backend: str) -> str:
    """The buffer element type a kernel declares for ``dtype`` on ``backend`` ("cuda" or "c")."""
    return "int16" if dtype == "bfloat16" and backend == "c" else dtype


def load_f32(buf, idx, storage: str, dtype: str):
    """An element of ``buf`` as fp32. bf16 on the C backend is stored as int16 bits."""
    import tilelang.language as T

    if dtype == "bfloat16" and storage == "int16":
        bits = T.shift_left(T.cast(T.cast(buf[idx], "uint16"), "uint32"), T.uint32(16))
        return T.reinterpret(bits, "float32")
    return T.cast(buf[idx], "float32")


def to_storage(value, storage: str, dtype: str):
    """fp32 -> the stored type, rounding to nearest even (bf16 bits by hand on the C backend)."""
    import tilelang.language as T

    if dtype == "bfloat16" and storage == "int16":
        u = T.reinterpret(value, "uint32")
        rounded = T.shift_right(u + T.uint32(0x7FFF) + T.bitwise_and(T.shift_right(u, T.uint32(16)), T.uint32(1)),
                                T.uint32(16))
        return T.cast(T.cast(rounded, "uint16"), "int16")
    return T.cast(value, dtype)


def round_to(value, dtype: str, storage: str):
    """An fp32 value rounded to ``dtype`` (to nearest even) and widened back to fp32: what storing it
    in a ``dtype`` tensor and reading it back gives (the norms' ``llama`` rounding, ``x + residual``
    in the input dtype, the fused prologue's norm output). bf16 on the C backend (``storage``
    int16, no bf16 type there) by hand: keep the top 16 bits, rounded as :func:`to_storage` rounds."""
    import tilelang.language as T

    if dtype == "float32":
        return value
    if dtype == "bfloat16" and storage == "int16":
        u = T.reinterpret(value, "uint32")
        r = u + T.uint32(0x7FFF) + T.bitwise_and(T.shift_right(u, T.uint32(16)), T.uint32(1))
        return T.reinterpret(T.bitwise_and(r, T.uint32(0xFFFF0000)), "float32")
    return T.cast(T.cast(value, dtype), "float32")
