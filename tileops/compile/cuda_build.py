"""The lean CUDA build: TileLang lowers a kernel, tileops compiles it.

TileLang's own build (its Cython execution backend) runs ``nvcc --shared`` on one ``.cu`` file with
the device kernel and a host launcher, which includes TileLang's CUDA templates, CUTLASS and its
host adapter (about 133k lines after preprocessing): a cold build spends 4-5 s in nvcc on headers a
RoPE kernel never uses (``benchmarks/NOTES.md``, "Start-up"). This module builds the same library
in two cheap steps:

* **device code**: TileLang's kernel source with its template includes replaced by a short prelude
  (:data:`DEVICE_PRELUDE`: the only names tileops' kernels take from them, ``half_t`` and
  ``bfloat16_t``), compiled to a cubin in process by NVRTC (``nvcc -cubin`` where it is not found);
* **host code**: TileLang's own launcher generator (a private class looked up in
  :mod:`tileops.compile.tilelang_api`, so the grid, block and argument order are exactly TileLang's),
  told to launch the embedded cubin through the runtime's library API (``cudaLibraryLoadData``,
  ``cudaLaunchKernelExC``) instead of a kernel symbol nvcc registers, compiled by the system C++
  compiler against CUDA's C headers and static runtime.

The library exports what TileLang's does (``init``, ``call``, ``get_last_error``), so
:mod:`tileops.compile.entry` and :mod:`tileops.compile.build` treat both alike. A kernel this build
cannot serve (a template it does not provide, dynamic shared memory, clusters, cooperative launch,
TMA descriptors, an L2 persistence window) raises :class:`Unsupported`, and
:mod:`tileops.compile.build` builds it TileLang's way. ``TILEOPS_LEAN_BUILD=0`` turns this build off;
``TILEOPS_NVRTC`` names the NVRTC library to use.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from . import entry, tilelang_api

__all__ = ["Unsupported", "LeanLibrary", "Sources", "enabled", "build", "lower_sources", "compile_sources",
           "device_source", "nvrtc_path", "cuda_home", "check_toolchain", "MIN_SM"]

_log = logging.getLogger("tileops.compile.cuda_build")


class Unsupported(Exception):
    """The lean build cannot serve this kernel (the reason is the message); build it TileLang's way."""


#: the lowest CUDA arch tileops builds for: the device prelude converts bfloat16 with sm_80
#: instructions (:data:`DEVICE_PRELUDE`), and TileLang's own nvcc build, the fallback, links against
#: ``libcuda``, which a machine without the driver lacks (``tileops warmup --arch sm_75`` there
#: printed 99 ``cannot find -lcuda`` in 12 minutes)
MIN_SM = 80


def enabled() -> bool:
    """Whether the lean build may be used: ``TILEOPS_LEAN_BUILD`` is not ``0``."""
    return os.environ.get("TILEOPS_LEAN_BUILD", "1").strip().lower() not in ("0", "false", "no", "off")


#: what replaces TileLang's template includes in the device source. tileops' kernels take two
#: names from those templates, TileLang's 16-bit float types (CUTLASS's ``half_t`` and
#: ``bfloat16_t``), and use them as storage converted to and from float. Defined here with the PTX
#: conversions those types compile to on sm_80 and later (round to nearest even; a widening
#: conversion is exact), so the kernel's machine code is TileLang's build's: ``benchmarks/lean_sass.py``
#: compares the SASS of the two builds kernel by kernel.
DEVICE_PRELUDE = """\
/* tileops lean build: in place of TileLang's CUDA templates */
struct __align__(2) half_t {
  unsigned short storage;
  half_t() = default;
  __device__ __forceinline__ explicit half_t(float x) { asm("{  cvt.rn.f16.f32 %0, %1;}\\n" : "=h"(storage) : "f"(x)); }
  __device__ __forceinline__ operator float() const {
    float f;
    asm("{  cvt.f32.f16 %0, %1;}\\n" : "=f"(f) : "h"(storage));
    return f;
  }
};
struct __align__(2) bfloat16_t {
  unsigned short storage;
  bfloat16_t() = default;
  __device__ __forceinline__ explicit bfloat16_t(float x) { asm("cvt.rn.bf16.f32 %0, %1;\\n" : "=h"(storage) : "f"(x)); }
  __device__ __forceinline__ operator float() const { return __uint_as_float(((unsigned int)storage) << 16); }
};
#ifdef __CUDACC_RTC__
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
#else
#include <stdint.h>
#endif
"""

#: the include block TileLang puts at the top of every CUDA kernel source (0.1.15)
_TL_INCLUDE = re.compile(r"^#include <(tl_templates/[^>]+|cuda\.h|cutlass/[^>]+)>\s*$", re.M)
_MSVC_BLOCK = re.compile(r"^#if defined\(_MSC_VER\).*?^#endif\s*$", re.M | re.S)
_BF16_BLOCK = re.compile(r"^#ifdef ENABLE_BF16\s*$.*?^#endif\s*$", re.M | re.S)
#: names that mean the kernel uses TileLang's or CUTLASS's templates beyond the prelude
_TEMPLATE_NAMES = re.compile(r"\b(tl|cute|cutlass)::|\b(fp8_e[45]_t|half2_t|bfloat162_t)\b")


def device_source(kernel_source: str) -> str:
    """``kernel_source`` (TileLang's device code) with its template includes replaced by
    :data:`DEVICE_PRELUDE`; raises :class:`Unsupported` when the kernel needs more than that."""
    src = _MSVC_BLOCK.sub("", kernel_source)
    src = _BF16_BLOCK.sub("", src)
    src = _TL_INCLUDE.sub("", src)
    left = re.findall(r"^\s*#include\s*[<\"][^>\"]+[>\"]", src, re.M)
    if left:
        raise Unsupported(f"the kernel includes {', '.join(s.strip() for s in left)}")
    found = _TEMPLATE_NAMES.search(src)
    if found:
        raise Unsupported(f"the kernel uses {found.group(0)!r} from TileLang's templates")
    return DEVICE_PRELUDE + src


# ------------------------------------------------------------------------------------- toolchain
def cuda_home() -> str:
    """The CUDA toolkit: ``CUDA_HOME`` or ``CUDA_PATH``, else the one ``nvcc`` on PATH belongs to,
    else ``/usr/local/cuda``; the first that has ``include/cuda_runtime_api.h``."""
    cands = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        cands.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    cands.append("/usr/local/cuda")
    for c in cands:
        if c and os.path.exists(os.path.join(c, "include", "cuda_runtime_api.h")):
            return c
    raise Unsupported("no CUDA toolkit found (CUDA_HOME, nvcc on PATH, /usr/local/cuda)")


def _toolkit_dirs(sub: str) -> list[str]:
    home = cuda_home()
    dirs = [os.path.join(home, sub), os.path.join(home, "lib64" if sub == "lib" else sub)]
    dirs += sorted(glob.glob(os.path.join(home, "targets", "*", sub)))
    return [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]


def _host_toolchain() -> tuple[list[str], list[str], str]:
    """(the toolkit's include dirs, its library dirs, the C++ compiler) the host launcher is built
    with; raises :class:`Unsupported` naming what is missing."""
    libdirs = _toolkit_dirs("lib")
    if not any(os.path.exists(os.path.join(d, "libcudart_static.a")) for d in libdirs):
        raise Unsupported(f"no libcudart_static.a in {', '.join(libdirs) or 'the CUDA toolkit'}")
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise Unsupported("no C++ compiler ($CXX, c++, g++)")
    return _toolkit_dirs("include"), libdirs, cxx


def check_toolchain() -> None:
    """Raise :class:`Unsupported`, naming what is missing, unless this machine has what the lean build
    compiles with: the CUDA toolkit's headers and static runtime, NVRTC or nvcc, and a C++ compiler.
    No GPU and no driver are needed (the libraries link CUDA's static runtime, not ``libcuda``)."""
    _host_toolchain()
    if nvrtc_path() is None and not os.path.exists(os.path.join(cuda_home(), "bin", "nvcc")):
        raise Unsupported("neither NVRTC nor nvcc found")


def nvrtc_path() -> str | None:
    """The NVRTC library to compile with: ``TILEOPS_NVRTC``, else the toolkit's, else the one the
    ``nvidia-cuda-nvrtc`` wheel (a dependency of torch's CUDA builds) put beside torch; None if none."""
    given = os.environ.get("TILEOPS_NVRTC")
    if given:
        return given
    cands: list[str] = []
    try:
        for d in _toolkit_dirs("lib"):
            cands += sorted(glob.glob(os.path.join(d, "libnvrtc.so.*[0-9]")))
    except Unsupported:
        pass
    for p in sys.path:  # nvidia/cuda_nvrtc/lib, or where a later wheel puts it
        cands += sorted(glob.glob(os.path.join(p, "nvidia", "*", "lib", "libnvrtc.so.*[0-9]")))
    cands = [c for c in cands if ".alt." not in os.path.basename(c)]
    return cands[0] if cands else None


_nvrtc_lock = threading.Lock()
_nvrtc: Any = None


def _load_nvrtc() -> Any:
    global _nvrtc
    with _nvrtc_lock:
        if _nvrtc is None:
            _nvrtc, path = False, nvrtc_path()  # tried once
            try:
                if path is not None:
                    # NVRTC opens its builtins library by name: load the one beside it first, so that
                    # a library outside the loader's path (a wheel's) finds its own
                    for b in sorted(glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so.*"))):
                        if ".alt." not in os.path.basename(b):
                            ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
                            break
                    lib = ctypes.CDLL(path)
                    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
                    _nvrtc = lib
            except OSError as e:
                _log.debug("tileops: NVRTC at %s not loadable (%s)", path, e)
        return _nvrtc or None


def _nvrtc_cubin(lib: Any, source: str, arch: str, name: str) -> bytes:
    prog = ctypes.c_void_p()

    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"NVRTC {what}: {lib.nvrtcGetErrorString(rc).decode()}")

    check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None),
          "create")
    try:
        opts = [f"--gpu-architecture={arch}", "-std=c++17", "--generate-line-info"]
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
        if rc != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC compile of {name} failed: {lib.nvrtcGetErrorString(rc).decode()}\n"
                               f"{log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
        buf = ctypes.create_string_buffer(size.value)
        check(lib.nvrtcGetCUBIN(prog, buf), "cubin")
        return buf.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _nvcc_cubin(source: str, arch: str, workdir: str) -> bytes:
    src = os.path.join(workdir, "device.cu")
    out = os.path.join(workdir, "device.cubin")
    with open(src, "w") as f:
        f.write(source)
    num = arch.removeprefix("sm_")
    cmd = [os.path.join(cuda_home(), "bin", "nvcc"), "-cubin", "-std=c++17", "-w", "-lineinfo", "-gencode",
           f"arch=compute_{num},code={arch}", src, "-o", out]
    ret = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if ret.returncode != 0:
        raise RuntimeError(f"nvcc -cubin failed: {' '.join(cmd)}\n{ret.stderr[-4000:]}")
    with open(out, "rb") as f:
        return f.read()


def cubin(source: str, arch: str, name: str = "kernel", workdir: str | None = None) -> tuple[bytes, str]:
    """(cubin, compiler) for the lean device ``source``: NVRTC where found, else ``nvcc -cubin``."""
    lib = _load_nvrtc()
    if lib is not None:
        return _nvrtc_cubin(lib, source, arch, name), "nvrtc"
    with tempfile.TemporaryDirectory(prefix="tileops-cubin-", dir=workdir) as d:
        return _nvcc_cubin(source, arch, d), "nvcc"


# ------------------------------------------------------------------------------------ host code
HOST_PRELUDE = """\
/* tileops lean build: the host launcher of one kernel library (device code: the embedded cubin) */
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
struct half_t;      /* the host passes pointers only */
struct bfloat16_t;
#define TILELANG_CHECK_LAST_ERROR(name)  /* each launch checks its own result */
#define TL_EXPORT __attribute__((visibility("default")))
/* grid expressions use min/max as CUDA's host math does: on the operands' common type */
template <typename A, typename B> static inline auto min(A a, B b) -> decltype(a + b) { return a < b ? a : b; }
template <typename A, typename B> static inline auto max(A a, B b) -> decltype(a + b) { return a > b ? a : b; }
"""

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z_0-9]*$")
#: kernel parameter types the launcher may pass by value (a pointer is passed as ``void*``)
_SCALARS = {"int", "int8_t", "int16_t", "int32_t", "int64_t", "uint8_t", "uint16_t", "uint32_t", "uint64_t",
            "unsigned int", "float", "double", "bool"}


def _kernel_params(declaration: str) -> list[str]:
    """The C type of each parameter of a kernel declaration ``... name(T0 a, T1* __restrict__ b)``:
    ``void*`` for a pointer, else the scalar type; raises :class:`Unsupported` for anything else."""
    declaration = re.sub(r"__launch_bounds__\([^)]*\)", "", declaration)
    inner = declaration[declaration.index("(") + 1: declaration.rindex(")")]
    types = []
    for part in (p.strip() for p in inner.split(",") if p.strip()):
        if "*" in part:
            types.append("void*")
            continue
        words = [w for w in part.replace("const ", "").split() if w != "__restrict__"]
        t = " ".join(words[:-1])
        if t not in _SCALARS:
            raise Unsupported(f"kernel parameter {part!r}: not a pointer or a plain scalar")
        types.append(t)
    return types


def _wrapper_class() -> type:
    class LeanWrapper(tilelang_api.cuda_source_wrapper()):
        """TileLang's CUDA launcher generator, launching a kernel of the embedded cubin."""

        def parse_source_information(self) -> None:
            super().parse_source_information()
            for name in self.function_names:
                if self.dynamic_smem_buf.get(name) is not None:
                    raise Unsupported(f"{name} uses dynamic shared memory")
                if self.use_cooperative_groups.get(name):
                    raise Unsupported(f"{name} is a cooperative launch")
                if self.cluster_dims.get(name) is not None:
                    raise Unsupported(f"{name} is a cluster launch")
            if self.tma_descriptor_args:
                raise Unsupported("the kernel takes TMA descriptors")
            if any(self.l2_persistent_map.values()):
                raise Unsupported("the kernel sets an L2 persistence window")

        def get_cuda_host_adapter_include(self) -> str:
            return ""

        def get_stream_type(self) -> dict[str, str]:
            return {"name": "stream", "type": "cudaStream_t"}

        def get_init_func(self) -> str:
            names = self.function_names
            kernels = "".join(f"static cudaKernel_t tileops_k_{n};\n" for n in names)
            gets = "".join(
                f'    if (e == cudaSuccess) e = cudaLibraryGetKernel(&tileops_k_{n}, tileops_library, "{n}");\n'
                for n in names)
            return (
                "\n#define ERROR_BUF_SIZE 1024\nstatic char error_buf[ERROR_BUF_SIZE];\n"
                "extern \"C\" TL_EXPORT const char* get_last_error() { return error_buf; }\n\n"
                f"static cudaLibrary_t tileops_library;\n{kernels}"
                "static cudaError_t tileops_load_error = cudaSuccess;\n"
                "static pthread_once_t tileops_once = PTHREAD_ONCE_INIT;\n"
                "static void tileops_load_once(void) {\n"
                "    cudaError_t e = cudaLibraryLoadData(&tileops_library, tileops_cubin, NULL, NULL, 0, NULL, NULL, 0);\n"
                f"{gets}"
                "    tileops_load_error = e;\n"
                "}\n"
                "/* the cubin is loaded at the first launch (or load()): no CUDA work when the library is opened */\n"
                "extern \"C\" TL_EXPORT int load() {\n"
                "    pthread_once(&tileops_once, tileops_load_once);\n"
                "    if (tileops_load_error != cudaSuccess) {\n"
                "        snprintf(error_buf, ERROR_BUF_SIZE, \"loading the kernel's cubin failed: %s\",\n"
                "                 cudaGetErrorString(tileops_load_error));\n"
                "        return -1;\n"
                "    }\n"
                "    return 0;\n"
                "}\n"
                "extern \"C\" TL_EXPORT int init() { error_buf[0] = '\\0'; return 0; }\n"
            )

        def get_kernel_launch_code(self, function_name, grid_str, block_str, smem_str, call_args, cluster_dims):
            if cluster_dims is not None:
                raise Unsupported(f"{function_name} is a cluster launch")
            at = tilelang_api.match_declare_kernel(self.source, function_name + "(")
            types = _kernel_params(self.get_declaration(self.source[at:]))
            args = [a.strip() for a in call_args.split(",")] if call_args.strip() else []
            if len(args) != len(types) or not all(_IDENT.match(a) for a in args):
                raise Unsupported(f"{function_name}: launch arguments {call_args!r} are not plain names")
            temps = "".join(f"\t\t{t} a{i} = ({t}){a};\n" for i, (t, a) in enumerate(zip(types, args)))
            ptrs = ", ".join(f"(void*)&a{i}" for i in range(len(args))) or "0"
            return (
                "\n\t{\n"
                "\t\tif (load() != 0) return -1;\n"
                f"{temps}"
                f"\t\tvoid* kargs[] = {{{ptrs}}};\n"
                "\t\tcudaLaunchConfig_t config;\n"
                "\t\tcudaLaunchAttribute attribute[1];\n"
                "\t\tattribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;\n"
                "\t\tattribute[0].val.programmaticStreamSerializationAllowed = 1;\n"
                "\t\tconfig.attrs = attribute;\n"
                "\t\tconfig.numAttrs = 1;\n"
                "\t\tconfig.stream = stream;\n"
                f"\t\tconfig.gridDim = {grid_str};\n"
                f"\t\tconfig.blockDim = {block_str};\n"
                f"\t\tconfig.dynamicSmemBytes = {smem_str};\n"
                f"\t\tcudaError_t e = cudaLaunchKernelExC(&config, (const void*)tileops_k_{function_name}, kargs);\n"
                "\t\tif (e != cudaSuccess) {\n"
                f"\t\t\tsnprintf(error_buf, ERROR_BUF_SIZE, \"kernel {function_name}: %s - %s\", cudaGetErrorName(e),\n"
                "\t\t\t         cudaGetErrorString(e));\n"
                "\t\t\treturn -1;\n"
                "\t\t}\n"
                "\t}\n"
            )

    return LeanWrapper


def _cubin_array(blob: bytes) -> str:
    rows = (", ".join(str(b) for b in blob[i:i + 32]) for i in range(0, len(blob), 32))
    return ("alignas(64) static const unsigned char tileops_cubin[] = {\n" + ",\n".join(rows) + "\n};\n")


@dataclass
class LeanLibrary:
    """A library the lean build wrote: its path, its launch record (:func:`tileops.compile.entry.kernel_record`'s
    form), the device source, and which compiler made the cubin."""

    libpath: str
    record: dict[str, Any]
    device_source: str
    compiler: str
    #: seconds per step: lower (TileLang and its launcher generator), cubin, host (the C++ compile)
    seconds: dict[str, float] = field(default_factory=dict)


def _record(func: Any, dyn: list[tuple[str, str]]) -> dict[str, Any]:
    """The launch record of ``call``: each parameter's C type (a buffer is ``void*``), then each
    dynamic extent's, in the order the generated ``call`` takes them."""
    names = entry.C_TYPES
    args, taken = [], set()
    for p in func.params:
        if p in func.buffer_map:
            args.append("void*")
            taken.add(func.buffer_map[p].data.name)
        else:
            if str(p.dtype) not in names:
                raise Unsupported(f"scalar parameter {p.name} of dtype {p.dtype}")
            args.append(names[str(p.dtype)])
            taken.add(p.name)
    extents = [(n, t) for n, t in dyn if n not in taken]
    for n, t in extents:
        if t not in ("int32", "int64"):
            raise Unsupported(f"dynamic extent {n} of dtype {t}")
    return {"args": args + [names[t] for _, t in extents], "extents": [n for n, _ in extents]}


@dataclass(frozen=True)
class Sources:
    """What lowering a kernel gives the lean build: the device source (prelude included), the host
    launcher's source (without the prelude and cubin :func:`compile_sources` adds), the launch record
    and the kernel's name. Plain data: :mod:`tileops.compile.lowered` keeps these for kernels shipped lowered."""

    device: str
    host: str
    record: dict[str, Any]
    name: str


def _check_arch(arch: str) -> None:
    num = arch.removeprefix("sm_")
    if not num.isdigit() or int(num) < MIN_SM:
        raise Unsupported(f"arch {arch}: the prelude's bf16 conversion needs sm_{MIN_SM} or later")


def lower_sources(func: Any, arch: str, pass_configs: dict[str, Any]) -> Sources:
    """Lower ``func`` (a TileLang prim_func) for ``arch`` with TileLang and generate the lean build's
    sources; raises :class:`Unsupported` when this build cannot serve the kernel."""
    tilelang = tilelang_api.load()
    from tilelang import tvm
    from tvm import transform
    from tvm.target import Target

    _check_arch(arch)
    target = Target({"kind": "cuda", "arch": arch})
    with transform.PassContext(opt_level=3, config=pass_configs), target:
        art = tilelang.lower(func, target=target)
    mod = tvm.IRModule({func.attrs["global_symbol"]: func})
    wrapper = _wrapper_class()(scheduled_ir_module=mod, source=art.kernel_source, target=target,
                               device_mod=art.device_mod, host_mod=art.host_mod, pass_configs=pass_configs)
    if len(wrapper.function_names) != 1:
        raise Unsupported(f"{len(wrapper.function_names)} device kernels in one library")
    return Sources(device=device_source(art.kernel_source), host=wrapper.lib_code[len(art.kernel_source):],
                   record=_record(wrapper.prim_func, wrapper.get_dynamic_symbolic_set(wrapper.prim_func)),
                   name=wrapper.function_names[0])


def compile_sources(src: Sources, arch: str, out_dir: str | None = None) -> LeanLibrary:
    """Build the library of lowered ``src`` into ``out_dir`` (a fresh temporary directory by default):
    the cubin, then the launcher with it embedded. Needs no TileLang. Raises :class:`Unsupported`
    when a tool is missing, RuntimeError when a compiler fails."""
    _check_arch(arch)
    t0 = time.perf_counter()
    out_dir = out_dir or tempfile.mkdtemp(prefix="tileops-lean-")
    blob, compiler = cubin(src.device, arch, name=src.name, workdir=out_dir)
    t1 = time.perf_counter()
    host = os.path.join(out_dir, "host.cpp")
    lib = os.path.join(out_dir, "kernel.so")
    with open(host, "w") as f:
        f.write(HOST_PRELUDE + _cubin_array(blob) + src.host)
    inc, libdirs, cxx = _host_toolchain()
    cmd = [cxx, "-O2", "-shared", "-fPIC", "-std=c++17", "-w", host, "-o", lib, *[f"-I{d}" for d in inc],
           *[f"-L{d}" for d in libdirs], "-lcudart_static", "-ldl", "-lpthread", "-lrt"]
    ret = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if ret.returncode != 0:
        raise RuntimeError(f"host launcher compile failed: {' '.join(cmd)}\n{ret.stderr[-4000:]}")
    return LeanLibrary(libpath=lib, record=src.record, device_source=src.device, compiler=compiler,
                       seconds={"cubin": t1 - t0, "host": time.perf_counter() - t1})


def build(func: Any, arch: str, pass_configs: dict[str, Any], out_dir: str | None = None) -> LeanLibrary:
    """Lower ``func`` (a TileLang prim_func) for ``arch`` and build its library the lean way into
    ``out_dir`` (a fresh temporary directory by default). Raises :class:`Unsupported` when this build
    cannot serve the kernel, RuntimeError when a compiler fails."""
    t0 = time.perf_counter()
    src = lower_sources(func, arch, pass_configs)
    lowered = time.perf_counter() - t0
    lib = compile_sources(src, arch, out_dir)
    lib.seconds = {"lower": lowered, **lib.seconds}
    return lib
