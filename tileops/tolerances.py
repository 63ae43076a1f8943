"""How close a result in a dtype must come to a float64 reference: what the generated tests, ``tileops
demo`` and ``tileops tune`` (which drops a schedule that misses it) all hold a kernel to."""

from __future__ import annotations

__all__ = ["TOLERANCES", "tolerance"]

#: dtype name -> (atol, rtol) against a float64 reference: a few roundings of the dtype at unit
#: magnitude (fp32 arithmetic inside, one rounding at the store).
TOLERANCES: dict[str, tuple[float, float]] = {"float32": (2e-5, 2e-5), "float16": (2e-3, 2e-3),
                                              "bfloat16": (1.6e-2, 1.6e-2),
                                              # a cache of it: half an e4m3 step (2^-4 of the value; 2^-10
                                              # among subnormals) after the value's own bf16 roundings
                                              "float8_e4m3fn": (2.0**-10 + 1e-6, 2.0**-4 + 1.6e-2)}


def tolerance(dtype: object) -> tuple[float, float]:
    """(atol, rtol) for a dtype given by name or as a torch dtype."""
    return TOLERANCES[str(dtype).replace("torch.", "")]
