"""Op manifests: YAML declarations parsed once into frozen dataclasses."""

from __future__ import annotations

import functools

from .call import DTYPE_NAMES, DTYPES, CallSpec
from .cases import call_specs, case_dims, case_params, index_dtype, tensor_shape
from .expr import Expr, ExprError, parse_expr
from .loader import ManifestError, load_file, load_files, manifest_files, packaged_files
from .schema import LEAD, SCHEMA, Case, KernelSpec, OpManifest, ParamSpec, Rule, TensorSpec

__all__ = [
    "CallSpec", "DTYPES", "DTYPE_NAMES", "call_specs", "case_dims", "case_params", "index_dtype", "tensor_shape",
    "Expr", "ExprError",
    "parse_expr", "ManifestError", "load_file", "load_files", "packaged_files", "manifest_files",
    "LEAD", "SCHEMA", "Case", "KernelSpec", "OpManifest", "ParamSpec", "Rule", "TensorSpec", "registry", "get",
]


@functools.lru_cache(maxsize=1)
def registry() -> dict[str, OpManifest]:
    """Every family's manifests (:func:`manifest_files`: packaged, then ``TILEOPS_FAMILY_PATH``'s),
    parsed once per process, keyed by op (class) name."""
    return load_files(manifest_files())


def get(name: str) -> OpManifest:
    """The manifest of op ``name``."""
    reg = registry()
    if name not in reg:
        raise KeyError(f"no manifest for op {name!r}; known: {', '.join(sorted(reg))}")
    return reg[name]
