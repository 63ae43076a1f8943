"""RMSNorm and LayerNorm as TileLang tile programs: forward, backward and the weight-gradient sum.

One builder serves the whole ``norm`` family; a spec's ``kind`` picks the program:

* ``fwd``: ``y = norm(x)``, optionally of ``h = x + residual`` (rounded to the input dtype, as
  vLLM's ``fused_add_rms_norm`` and HF's decoder layers compute it), writing ``h`` too;
* ``bwd``: ``dx`` from ``dy`` (plus the gradient that reached ``h``, with a residual: ``dx`` is
  then also the residual's gradient), and per-block partial sums of the weight and bias gradients
  in fp32, ``DWP[p, :]``, one row ``p`` per block (per warp in the row-per-warp schedule);
* ``wsum``: ``dw[c] = sum_p DWP[p, c]`` (and ``db``), the partials summed in a fixed order. The
  host fixes the number of blocks ``G`` from the row count alone, so the gradient is deterministic:
  the same rows give the same bits, run after run.

Rounding (``rounding``, RMSNorm). HF's modules differ in where they round, and a bf16 model's
output depends on it:

* ``llama`` (LlamaRMSNorm, Mistral, Qwen2/3, Phi-3): fp32 variance, ``n = x * rsqrt(var + eps)``
  in fp32, ``n`` rounded to the input dtype, then ``y = n * w`` (the exact product of two 16-bit
  floats fits fp32, so computing it in fp32 and rounding once to the output dtype is torch's
  ``bf16 * bf16``; an fp32 weight makes torch's product, and so HF's output, fp32: ``out_dtype``);
* ``fp32`` (Gemma 1/2/3 with ``offset=1``, Olmo2, and every LayerNorm): ``y = n * (offset + w)``
  with ``offset + w`` and the product in fp32, rounded once to the output dtype.

The backward differentiates what was computed: with ``llama`` the weight's gradient sums
``dy * round(n)``, as autograd does through HF's module; the rounding itself passes gradients
unchanged. ``rstd`` is recomputed from ``x`` (the backward reads ``x`` anyway): the forward writes
nothing but ``y`` and ``h``.

Layout. A row is ``hidden`` contiguous elements; row ``r`` of a tensor lies at ``t * st + h * sh``
with ``t = r // NH``, ``h = r % NH``: ``[rows, hidden]`` is ``NH = 1``; per-head norm of a
``[tokens, heads, head_dim]`` view (the q slice of a fused qkv buffer, whose token stride is not
``heads * head_dim``) is ``NH = heads`` with the view's two strides; ``[batch, seq, hidden]``
sliced along seq is ``NH = seq``. Every tensor has its own two strides, so an output may be a new
tensor, a given ``out=`` or an input itself: in place is safe because each element is read before
it is written, by the thread that writes it. ``M`` (rows), ``NH``, ``G`` and the strides are
runtime scalars; ``hidden`` is compiled in. ``eps`` is a runtime scalar too, passed as the bits of
the fp32 value torch adds (``variance + eps`` rounds eps to fp32), so that no float travels through
the launcher's integer slots and TileLang's C backend, which prints float constants with 7 digits,
never rounds it (``torch.finfo(torch.float32).eps`` is not 7 digits).

Absent tensors (no residual, weight or bias) keep their parameters, which the kernel never reads:
the launcher passes 0. The spec's ``residual``, ``weight`` and ``bias`` say which are used.

Two schedules from one description:

* ``cuda``: SIMT, 16-byte accesses (the host checks every pointer and stride is a multiple of
  ``vec`` elements; strides are taken in units of ``vec``). A row is held in registers, in its own
  dtype, between the reduction and the scale: x is read once. A row that 32 lanes hold at
  ``vectors_per_thread`` vectors each takes a group of ``lanes <= 32`` lanes of a warp (a head of
  128 bf16 is 16 vectors: 16 lanes, two rows a warp), reduced with ``__shfl_xor_sync`` alone. A
  wider row takes a block of ``lanes`` threads, ``vectors_per_thread`` vectors each: warp shuffles,
  then the warps' sums through shared memory, added by every thread in the same order (so every
  thread holds the same bits). The backward runs ``G`` blocks over the rows in a fixed stride,
  loads each next row while it reduces the current one, and keeps each thread's weight-gradient
  columns in registers across its rows. Every kernel asks nvcc for at most 64 registers a thread
  (``_RESIDENT_THREADS``).
* ``c``: TileLang's C backend has no threads: plain loops per row, fp32 arithmetic (row sums in
  float64, see "Row sums" below), the row kept in a local fp32 array between passes.
"""


import struct
from dataclasses import dataclass
from typing import Any

from .storage import load_f32, round_to, storage_dtype, to_storage

#: ``tilelang.language``, imported when a kernel is first built (:func:`_tl`)
T: Any = None

__all__ = ["NormKernelSpec", "build_norm", "build", "Spec", "STATIC", "FWD_ARGS", "BWD_ARGS", "WSUM_ARGS",
           "eps_bits", "WSUM_SLICES", "row_rstd", "row_value", "norm_row", "RowGroup", "lane_value",
           "lane_allsum", "lane_rstd", "CUDA_HELPERS"]

#: The schedule choices a manifest's ``kernel.static`` may set (:mod:`tileops.kernels` reads this literal
#: without importing the module). Every other field of :class:`NormKernelSpec` the op derives from the call.
STATIC = {
    "threads": (32, 1024, "threads per block of the row-per-warp schedule, a power of two (CUDA)"),
    "vectors_per_thread": (1, 16, "16-byte vectors of a row each thread holds in the forward's row-per-block "
                                  "schedule; sets the block size (CUDA)"),
    "bwd_vectors_per_thread": (1, 16, "the same for the backward, whose threads also hold dy and the weight "
                                      "gradient's column sums (CUDA)"),
    "rows_per_group": (1, 8, "rows each lane group of the forward's row-per-warp schedule holds at once, their "
                             "loads in flight together (CUDA)"),
    "bwd_prefetch": (0, 4, "the backward asks L2 for the rows (row groups) this many ahead of the one it loads "
                           "into registers (x, dy, and the residual's gradient), so that more bytes are in "
                           "flight than registers hold; 0: none (CUDA)"),
    "bwd_one_sync": (0, 1, "1: the row-per-block backward's row sums alternate between two shared-memory slots, "
                           "one block barrier a row instead of two (CUDA)"),
    "bwd_w_shared": (0, 1, "1: the row-per-block backward keeps the weight in shared memory, not registers: a "
                           "thread of 2 vectors then holds its next row without spilling (CUDA)"),
    "bwd_async": (0, 2, ("row-per-block backward: the next this many rows' x and dy (and the residual's "
                         "gradient) copied global -> shared memory by cp.async, no register holding them while in "
                         "flight (the register prefetch of the next row holds 16 of a thread's 64 at 2 vectors); 0: "
                         "that prefetch (CUDA)")),
    "nh1_path": (0, 1, "1: when a launch's NH is 1 (rows one run of stride st), a row's offset is row * st, "
                       "without the division and remainder by NH (CUDA)"),
}

_ELEM_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
_KINDS = ("fwd", "bwd", "wsum")
#: threads that split one column's partial rows in the ``wsum`` kernel (CUDA): 32 columns x 8 slices
WSUM_SLICES = 8
_WSUM_COLS = 32
#: CUDA: threads an SM should hold at once (half of an H100/H200's 2048): the kernels ask nvcc for
#: 64 registers a thread at most (the backward took 70, the fp32-weight forward 80, left alone: one
#: block of 512 threads, or 3 of 256, an SM). A row-per-block forward of 128 threads holds 64 bytes
#: of x a thread in flight: 64 KB an SM at 1024 threads, past the ~30 KB an H200 needs
#: (4.8 TB/s / 132 SMs x ~0.8 us of latency).
_RESIDENT_THREADS = 1024
#: at most this many vectors per thread in the row-per-block schedule's knobs
_MAX_VECTORS = 16
#: at most this many bytes of a row per thread (CUDA): 16 vectors of 16 bytes, 64 registers of x
_MAX_THREAD_BYTES = 256
#: at most this many rows a lane group holds at once (the forward's row-per-warp schedule)
_MAX_GROUP_ROWS = 8
_MAX_BLOCK_THREADS = 1024
#: CUDA: shared memory an SM of an H100/H200 holds (228 KB), and what the driver keeps of it for each
#: block (1 KB): ``bwd_async``'s rows ahead are as many as leave the backward's blocks resident
_SM_SHARED_BYTES = 228 << 10
_BLOCK_RESERVED_SHARED = 1 << 10

#: the generated functions' parameters, in order, per kind. The launcher binds arguments by these
#: names; a tensor the spec does not use is passed as 0.
FWD_ARGS = ("X", "R", "W", "B", "Y", "RO", "M", "NH", "xst", "xsh", "rst", "rsh", "yst", "ysh", "rost", "rosh",
            "eps_bits")
BWD_ARGS = ("X", "DY", "DRO", "W", "DX", "DWP", "DBP", "M", "NH", "G", "xst", "xsh", "dyst", "dysh", "drost",
            "drosh", "dxst", "dxsh", "eps_bits")
WSUM_ARGS = ("DWP", "DBP", "DW", "DB", "P")


def eps_bits(eps: float) -> int:
    """The ``eps_bits`` argument for ``eps``: the bits of ``float32(eps)``, as a signed int32."""
    return struct.unpack("<i", struct.pack("<f", eps))[0]


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class NormKernelSpec:
    """Everything a norm kernel is compiled for; two equal specs share one compiled kernel."""

    kind: str  # fwd | bwd | wsum
    hidden: int  # elements of a row (the normalised dim), compiled in
    dtype: str = "bfloat16"  # x, residual, h, dx (float16 | bfloat16 | float32)
    weight: "str | None" = None  # the weight's dtype, None without a weight
    bias: "str | None" = None  # the bias's dtype (LayerNorm), None without a bias
    out_dtype: "str | None" = None  # y's (and so dy's) dtype; None: ``dtype``
    norm: str = "rms"  # rms | layer
    rounding: str = "llama"  # llama | fp32 (see the module's docstring); LayerNorm: fp32
    offset: float = 0.0  # RMSNorm scales by ``offset + w`` (Gemma: 1.0), computed in fp32
    residual: bool = False  # fwd: h = x + residual, written to RO; bwd: DRO added to dx
    backend: str = "cuda"  # cuda | c
    threads: int = 256  # cuda: threads per block of the row-per-warp schedule
    vectors_per_thread: int = 4  # cuda: forward, row-per-block schedule
    bwd_vectors_per_thread: int = 1  # cuda: backward, row-per-block schedule
    rows_per_group: int = 1  # cuda: forward, row-per-warp schedule: rows a lane group holds at once
    bwd_prefetch: int = 0  # cuda: backward: row groups ahead asked of L2 (0: none)
    bwd_one_sync: int = 0  # cuda: row-per-block backward: one barrier a row (two reduction slots)
    bwd_w_shared: int = 0  # cuda: row-per-block backward: the weight in shared memory, not registers
    bwd_async: int = 0  # cuda: row-per-block backward: rows ahead copied to shared memory by cp.async (0: none)
    nh1_path: int = 0  # cuda: row offsets without a division where the launch's NH is 1

    def __post_init__(self) -> None:
        def one_of(name: str, value: Any, choices: tuple) -> None:
            if value not in choices:
                raise ValueError(f"{name}: expected one of {', '.join(map(repr, choices))}, got {value!r}")

        one_of("kind", self.kind, _KINDS)
        one_of("dtype", self.dtype, tuple(_ELEM_BYTES))
        one_of("weight", self.weight, (None, *_ELEM_BYTES))
        one_of("bias", self.bias, (None, *_ELEM_BYTES))
        one_of("out_dtype", self.out_dtype, (None, *_ELEM_BYTES))
        one_of("norm", self.norm, ("rms", "layer"))
        one_of("rounding", self.rounding, ("llama", "fp32"))
        one_of("backend", self.backend, ("cuda", "c"))
        if type(self.hidden) is not int or self.hidden < 1:
            raise ValueError(f"hidden: expected a positive int, got {self.hidden!r}")
        if self.norm == "layer" and self.rounding != "fp32":
            raise ValueError(f"rounding: LayerNorm computes in fp32 and rounds once; expected 'fp32', got "
                             f"{self.rounding!r}")
        if self.bias is not None and self.norm != "layer":
            raise ValueError("bias: expected None for RMSNorm (only LayerNorm has a bias)")
        if self.offset != 0.0 and (self.norm != "rms" or self.weight is None):
            raise ValueError(f"offset: expected 0.0 without an RMSNorm weight, got {self.offset!r}")
        # compiled in as a float constant: it must survive fp32 and the C backend's 7-digit printing
        if (self.offset != struct.unpack("<f", struct.pack("<f", self.offset))[0]
                or float(f"{self.offset:.6e}") != self.offset):
            raise ValueError(f"offset: expected a value exact in fp32 and in 7 digits (0.0, 1.0, 0.5 ...), got "
                             f"{self.offset!r}")
        if self.kind == "wsum" and self.weight is None and self.bias is None:
            raise ValueError("weight, bias: a wsum kernel sums a weight or a bias gradient; both are None")
        if self.kind == "wsum" and self.residual:
            raise ValueError("residual: expected False for a wsum kernel")
        if self.threads < 32 or self.threads > _MAX_BLOCK_THREADS or self.threads & (self.threads - 1):
            raise ValueError(f"threads: expected a power of two in [32, 1024], got {self.threads}")
        for name in ("vectors_per_thread", "bwd_vectors_per_thread"):
            if not 1 <= getattr(self, name) <= _MAX_VECTORS:
                raise ValueError(f"{name}: expected an int in [1, {_MAX_VECTORS}], got {getattr(self, name)}")
        if not 1 <= self.rows_per_group <= _MAX_GROUP_ROWS:
            raise ValueError(f"rows_per_group: expected an int in [1, {_MAX_GROUP_ROWS}], got {self.rows_per_group}")
        for name in ("bwd_prefetch", "bwd_one_sync", "bwd_w_shared", "bwd_async", "nh1_path"):
            lo, hi, _ = STATIC[name]
            if type(getattr(self, name)) is not int or not lo <= getattr(self, name) <= hi:
                raise ValueError(f"{name}: expected an int in [{lo}, {hi}], got {getattr(self, name)!r}")
        if self.backend == "cuda" and self._thread_bytes(self.lanes) > _MAX_THREAD_BYTES:
            limit = _MAX_THREAD_BYTES * _MAX_BLOCK_THREADS // _ELEM_BYTES[self.dtype]
            raise ValueError(f"hidden: a {self.dtype} row of {self.hidden} elements puts "
                             f"{self._thread_bytes(self.lanes)} bytes in each of 1024 threads; at most "
                             f"{_MAX_THREAD_BYTES} (hidden <= {limit} when it divides by 16 bytes)")

    # ------------------------------------------------------------------------ derived layout
    @property
    def y_dtype(self) -> str:
        """The output's dtype (and the incoming gradient's): ``out_dtype``, else ``dtype``."""
        return self.out_dtype or self.dtype

    @property
    def vec(self) -> int:
        """Elements per 16-byte access of x, shrunk until it divides ``hidden``."""
        v = 16 // _ELEM_BYTES[self.dtype]
        while v > 1 and self.hidden % v:
            v //= 2
        return v

    @property
    def stride_unit(self) -> int:
        """The unit of the row strides the kernel takes: ``vec`` elements on CUDA (so that the
        compiler can prove every row starts on a vector boundary and keep 16-byte accesses; the
        host checks each stride and pointer divides), one element on the C backend."""
        return self.vec if self.backend == "cuda" else 1

    @property
    def nvec(self) -> int:
        """Vectors in a row."""
        return self.hidden // self.vec

    def _thread_bytes(self, lanes: int) -> int:
        """Bytes of x each of ``lanes`` threads holds."""
        return -(-self.nvec // lanes) * self.vec * _ELEM_BYTES[self.dtype]

    @property
    def _per_thread(self) -> int:
        """CUDA: the vectors a thread may hold: the knob of this kind."""
        return self.bwd_vectors_per_thread if self.kind == "bwd" else self.vectors_per_thread

    @property
    def per_warp(self) -> bool:
        """CUDA: whether a row takes (part of) a warp rather than a block: when 32 lanes hold it at
        ``vectors_per_thread`` vectors each (``bwd_vectors_per_thread`` for the backward, whose lanes
        also hold dy, the next row and the gradient's column sums): up to 1024 bf16 forward, 256
        backward."""
        return self.nvec <= 32 * self._per_thread

    @property
    def lanes(self) -> int:
        """CUDA: threads that share one row (a power of two)."""
        if self.per_warp:
            return min(32, _pow2_at_least(self.nvec))
        return min(_MAX_BLOCK_THREADS, max(32, _pow2_at_least(-(-self.nvec // self._per_thread))))

    @property
    def vectors(self) -> int:
        """CUDA: vectors of a row each thread holds (the last may lie past the row for some lanes)."""
        return -(-self.nvec // self.lanes)

    @property
    def block_threads(self) -> int:
        """CUDA: threads of one block."""
        if self.kind == "wsum":
            return _WSUM_COLS * WSUM_SLICES
        return max(self.threads, self.lanes) if self.per_warp else self.lanes

    @property
    def group_rows(self) -> int:
        """CUDA: rows each lane group holds at once: ``rows_per_group`` in the forward's row-per-warp
        schedule (a head of 128 bf16 is one 16-byte load a lane: a second row doubles the bytes in
        flight), else 1."""
        if self.kind == "fwd" and self.per_warp and self.norm == "rms":  # (LayerNorm's mean: one row a group)
            # up to 4 loads of x in flight a lane, as the row-per-block forward's 4 vectors a thread: on
            # the H200, per head [16384, 32, 128] bf16 (1 vector a lane) took 73.5 us with one row a
            # group, 68.9 with two, 71.1 with four; hidden 1024 (4 vectors a lane) 65.9 with one, 67.1 with two
            return max(1, min(self.rows_per_group, 4 // self.vectors))
        return 1

    @property
    def rows_per_block(self) -> int:
        """CUDA: rows one block handles."""
        return self.block_threads // self.lanes * self.group_rows

    @property
    def async_rows(self) -> int:
        """CUDA backward: the rows ahead ``bwd_async`` copies to shared memory, at most as many as keep
        ``1024 / block_threads`` blocks an SM, each with its slots (x, dy, and the residual's gradient
        of ``async_rows + 1`` rows), the weight where ``bwd_w_shared`` puts it there, the row sums and
        1 KB of alignment beside the driver's 1 KB: at 16384 bf16 wide with a residual, 2 rows ahead
        would take 288 KB a block (so 1, 192 KB); at 4096 with a residual and the weight, 2 would
        leave 2 blocks an SM of the 4 the grid counts on. 0 for a row-per-warp schedule."""
        if self.kind != "bwd" or self.backend != "cuda" or self.per_warp:
            return 0
        e = _ELEM_BYTES
        slot = self.vectors * self.lanes * self.vec * (e[self.dtype] * (2 if self.residual else 1) + e[self.y_dtype])
        fixed = (self.hidden * e[self.weight] if self.bwd_w_shared and self.weight else 0) + 2 * 3 * 4 * (
            self.block_threads // 32) + 1024
        budget = _SM_SHARED_BYTES // max(1, _RESIDENT_THREADS // self.block_threads) - _BLOCK_RESERVED_SHARED
        d = self.bwd_async
        while d and (d + 1) * slot + fixed > budget:
            d -= 1
        return d

    @property
    def partials_per_block(self) -> int:
        """Rows of ``DWP``/``DBP`` one backward block writes: one per warp in the row-per-warp CUDA
        schedule (a warp's row slots are summed by shuffles first), else one. A backward launched on
        ``G`` blocks needs ``G * partials_per_block`` partial rows, and ``wsum`` sums them all."""
        if self.backend == "cuda" and self.per_warp:
            return self.block_threads // 32
        return 1

    @property
    def args(self) -> tuple[str, ...]:
        """The generated function's parameter names, in order."""
        return {"fwd": FWD_ARGS, "bwd": BWD_ARGS, "wsum": WSUM_ARGS}[self.kind]


def build_norm(spec: NormKernelSpec):
    """The ``T.prim_func`` for ``spec``; its parameters are ``spec.args``.

    ``X``, ``R``, ``Y``, ``RO``, ``DY``, ``DRO``, ``DX`` are flat buffers of their element type
    addressed through the two row strides that follow them (units of ``spec.stride_unit``);
    ``W``, ``B`` are ``[hidden]``; ``DWP``, ``DBP`` flat fp32 buffers of ``[P, hidden]`` partial rows;
    ``DW``, ``DB`` ``[hidden]`` in the weight's and bias's dtypes.
    """
    _tl()
    if spec.kind == "wsum":
        return _wsum(spec)
    return (_fwd if spec.kind == "fwd" else _bwd)(spec)


def _tl() -> Any:
    """Import TileLang's language (once); returns it."""
    global T
    if T is None:
        import tilelang.language as tl

        T = tl
    return T


# ------------------------------------------------------------------------------ shared pieces
# A lane's shuffle partner: a plain CUDA helper rather than T.shfl_xor, whose generated mask is cast
# to ``uint``, a name NVRTC (the lean build, tileops.compile.cuda_build) does not define.
# 16-byte stores through st.global.cg: a local bf16 vector filled element by element and stored as a
# plain uint4 became four 4-byte stores (``st.global.v2.u16`` x 4 in the PTX for sm_90, head_dim 128),
# as kernels/rope.py saw; .cg also keeps the streamed outputs out of L1, which holds the weight.
CUDA_HELPERS = """
__device__ __forceinline__ float tileops_xor_lane(float v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
template <typename T> __device__ __forceinline__ void tileops_st16(T* dst, const T* src) {
  __stcg(reinterpret_cast<uint4*>(dst), *reinterpret_cast<const uint4*>(src));
}
"""

#: ``bwd_prefetch``'s helper: ask L2 for the line of ``p`` (no register, no wait). Compiled for the device
#: alone: elsewhere (the CPU harness of the tests) it does nothing.
PREFETCH_HELPER = """
template <typename T> __device__ __forceinline__ void tileops_prefetch_l2(const T* p) {
#ifdef __CUDA_ARCH__
  asm volatile("prefetch.global.L2 [%0];" :: "l"(p));
#endif
}
"""

#: ``bwd_async``'s helpers: ``tileops_cp_async<N>`` copies N bytes global -> shared without a register
#: (``cp.async``; 16-byte pieces through L2 alone, 4 and 8 through L1; any other size a plain copy), a
#: group of them committed, then awaited until at most ``N`` groups are pending. Each thread waits for
#: its own copies, and reads back only what it copied: no barrier. Off the device (the CPU harness of
#: the tests) the copy is a plain one and the rest does nothing.
ASYNC_HELPER = """
template <int N> __device__ __forceinline__ void tileops_cp_async(void* dst, const void* src) {
#ifdef __CUDA_ARCH__
  unsigned s = (unsigned)__cvta_generic_to_shared(dst);
  if constexpr (N % 16 == 0) {
    #pragma unroll
    for (int i = 0; i < N; i += 16)
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(s + i), "l"((const char*)src + i) : "memory");
  } else if constexpr (N == 8 || N == 4) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" :: "r"(s), "l"(src), "n"(N) : "memory");
  } else {
    for (int i = 0; i < N; ++i) ((char*)dst)[i] = ((const char*)src)[i];
  }
#else
  __builtin_memcpy(dst, src, N);
#endif
}
__device__ __forceinline__ void tileops_cp_async_commit() {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
__device__ __forceinline__ float tileops_ld_volatile(const float* p) { return *(const volatile float*)p; }
template <int N> __device__ __forceinline__ void tileops_cp_async_wait() {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
#endif
}
"""


def _storages(spec: NormKernelSpec) -> dict[str, str]:
    """Buffer element type of each tensor role on the spec's backend."""
    s = lambda dt: storage_dtype(dt, spec.backend)  # noqa: E731
    return {"x": s(spec.dtype), "y": s(spec.y_dtype), "w": s(spec.weight or "float32"),
            "b": s(spec.bias or "float32")}


def _row_offset(row, NH, st, sh, one=False):
    """Offset of row ``row`` (``t = row // NH``, ``h = row % NH``) from its two strides, in the
    strides' unit. Truncating division: both are non-negative, and floor division costs sign fixes.
    ``one``: the caller knows ``NH`` is 1 (:func:`_nh_paths`): ``row * st``."""
    if one:
        return T.cast(row, "int64") * st
    return T.cast(T.truncdiv(row, NH), "int64") * st + T.cast(T.truncmod(row, NH), "int64") * sh


def _nh_paths(spec: NormKernelSpec, run):
    """A CUDA kernel's rows through the macro ``run(one, *args)`` (``one``: offsets by :func:`_row_offset`'s
    ``one``): with ``nh1_path``, two copies of it behind a branch on ``NH == 1`` that every thread of
    the launch takes alike, so that a launch whose rows are one run of stride ``st`` (a dense
    ``[rows, hidden]``, and a dense per-head ``[tokens, heads, head_dim]``, whose dims merge) computes
    each row's offset with a multiply: the division and remainder by the runtime ``NH`` are some
    twenty instructions, ahead of a row's first load, where a per-head row is a single 16-byte load
    a lane. Without it, one copy, dividing (the generated code as before the knob)."""
    @T.macro
    def paths(NH, *args):
        if spec.nh1_path:
            if NH == 1:
                run(True, *args)
            else:
                run(False, *args)
        else:
            run(False, *args)

    return paths


def _centered(spec: NormKernelSpec, value, mean):
    """``value - mean`` for LayerNorm; ``value`` for RMSNorm."""
    return value - mean if spec.norm == "layer" else value


def _wterm(spec: NormKernelSpec, w):
    """``offset + w`` in fp32 (``w`` already fp32)."""
    return w + T.float32(spec.offset) if spec.offset != 0.0 else w


def _weighted(spec: NormKernelSpec, value, w):
    """``value * (offset + w)`` with a weight, ``value`` without (``w`` already fp32)."""
    return value * _wterm(spec, w) if spec.weight is not None else value


def _flat(*tensors: str):
    """The dynamic extents of flat buffers, one per tensor, named ``N<tensor>`` (the launcher passes
    them after the parameters; the kernels never read them)."""
    got = T.dynamic(", ".join(f"N{t}" for t in tensors))
    return got if len(tensors) > 1 else (got,)


# ------------------------------------------------------------------------------------ forward
def _fwd(spec: NormKernelSpec):
    st = _storages(spec)
    H = spec.hidden
    NX, NR, NY, NRO = _flat("X", "R", "Y", "RO")
    sig = dict(X=T.Tensor((NX,), st["x"]), R=T.Tensor((NR,), st["x"]), W=T.Tensor((H,), st["w"]),
               B=T.Tensor((H,), st["b"]), Y=T.Tensor((NY,), st["y"]), RO=T.Tensor((NRO,), st["x"]))
    body = _fwd_cuda(spec) if spec.backend == "cuda" else _fwd_c(spec, st)

    @T.prim_func
    def norm_fwd(X: sig["X"], R: sig["R"], W: sig["W"], B: sig["B"], Y: sig["Y"], RO: sig["RO"],
                 M: T.int32, NH: T.int32, xst: T.int64, xsh: T.int64, rst: T.int64, rsh: T.int64,
                 yst: T.int64, ysh: T.int64, rost: T.int64, rosh: T.int64, eps_bits: T.int32):
        body(X, R, W, B, Y, RO, M, NH, xst, xsh, rst, rsh, yst, ysh, rost, rosh, eps_bits)

    return norm_fwd


# Row sums. The C schedule adds each row's values (squares, products, elements) in float64 and
# rounds the mean to fp32 once: a sequential fp32 sum of 4096 squares is off by about
# sqrt(4096) * 2^-24 = 4e-6 relative, which put 0.17% of Llama-rounded bf16 outputs (7 x 4096) on
# the neighbouring value of HF's (torch's vectorized pairwise sum is far closer to exact). Every
# product itself stays fp32, as torch computes ``h.pow(2)``. The CUDA schedule adds at most
# ``_MAX_THREAD_BYTES`` of a row per thread in sequence, then a tree across lanes.


def row_rstd(spec: NormKernelSpec):
    """The C schedule's row statistics stage: a macro ``rstd = row_rstd(f, acc, eps)`` on the fp32
    row ``f[0:hidden]`` (``acc``: a local float64 array of 2): for LayerNorm the mean is subtracted
    from ``f`` in place first; ``rstd = 1 / sqrt(mean(f^2) + eps)``, the row sums in float64 (see
    "Row sums" above) and the mean rounded to fp32 once."""
    _tl()
    H = spec.hidden
    layer = spec.norm == "layer"

    @T.macro
    def row_rstd(f, acc, eps):
        acc[0] = T.float64(0)
        acc[1] = T.float64(0)
        if layer:
            for c in T.serial(H):
                acc[0] = acc[0] + T.cast(f[c], "float64")
            for c in T.serial(H):
                f[c] = f[c] - T.cast(acc[0] / T.float64(H), "float32")
        for c in T.serial(H):
            acc[1] = acc[1] + T.cast(f[c] * f[c], "float64")
        rstd = T.float32(1) / T.sqrt(T.cast(acc[1] / T.float64(H), "float32") + eps)
        return rstd

    return row_rstd


def row_value(spec: NormKernelSpec):
    """The C schedule's per-element stage: a macro ``n = row_value(f, c, rstd, W, B)``, element ``c``
    of the normalised row in fp32 before its store: ``f[c] * rstd``, rounded to the input dtype
    with ``llama`` rounding, times ``offset + W[c]`` with a weight, plus ``B[c]`` with a bias
    (``W``, ``B``: ``[hidden]`` buffers of the weight's and bias's storage; not read when absent)."""
    _tl()
    st = _storages(spec)
    dt = spec.dtype
    has_w = spec.weight is not None

    @T.macro
    def row_value(f, c, rstd, W, B):
        n = f[c] * rstd
        if spec.rounding == "llama":
            n = round_to(n, dt, st["x"])
        if has_w:
            n = n * _wterm(spec, load_f32(W, c, st["w"], spec.weight))
        if spec.bias is not None:
            n = n + load_f32(B, c, st["b"], spec.bias)
        return n

    return row_value


def norm_row(spec: NormKernelSpec):
    """The norm as a stage of a fused kernel (C schedule): a macro ``norm_row(f, acc, W, B, eps)``
    that normalises the fp32 row ``f[0:hidden]`` in place (:func:`row_rstd`, :func:`row_value`) and
    rounds each element to the output dtype, as storing the norm's output and reading it back
    gives: a kernel that feeds it to the next stage (the prologue's RoPE) sees what the unfused
    chain's second op reads."""
    _tl()
    H, ydt = spec.hidden, spec.y_dtype
    yst = _storages(spec)["y"]
    rstd_of, value = row_rstd(spec), row_value(spec)

    @T.macro
    def norm_row(f, acc, W, B, eps):
        rstd = rstd_of(f, acc, eps)
        for c in T.serial(H):
            f[c] = round_to(value(f, c, rstd, W, B), ydt, yst)

    return norm_row


def _fwd_c(spec: NormKernelSpec, st: dict[str, str]):
    H, dt, ydt = spec.hidden, spec.dtype, spec.y_dtype
    rstd_of, value = row_rstd(spec), row_value(spec)

    @T.macro
    def body(X, R, W, B, Y, RO, M, NH, xst, xsh, rst, rsh, yst, ysh, rost, rosh, eps_bits):
        with T.Kernel(M, threads=1) as row:
            f = T.alloc_local((H,), "float32")
            acc = T.alloc_local((2,), "float64")  # row sums: see "Row sums" above _fwd_c
            xo = _row_offset(row, NH, xst, xsh)
            for c in T.serial(H):
                if spec.residual:
                    hv = round_to(load_f32(X, xo + c, st["x"], dt)
                                  + load_f32(R, _row_offset(row, NH, rst, rsh) + c, st["x"], dt), dt, st["x"])
                    RO[_row_offset(row, NH, rost, rosh) + c] = to_storage(hv, st["x"], dt)
                    f[c] = hv
                else:
                    f[c] = load_f32(X, xo + c, st["x"], dt)
            eps = T.reinterpret(eps_bits, "float32")
            rstd = rstd_of(f, acc, eps)
            yo = _row_offset(row, NH, yst, ysh)
            for c in T.serial(H):
                n = value(f, c, rstd, W, B)
                Y[yo + c] = to_storage(n, st["y"], ydt)

    return body


def lane_value(spec: NormKernelSpec):
    """The CUDA schedule's per-element stage: a macro ``n = lane_value(xr, wr, br, j, v, mean, rstd,
    at=0)``, element ``j * vec + v`` of a lane's row slice ``xr[at:]`` (local, the input dtype; ``at``
    selects one of several rows a lane holds) normalised in fp32
    before its store: ``x - mean`` for LayerNorm, times the row's ``rstd``, rounded to the input dtype
    with ``llama`` rounding, times ``offset + w`` (``wr``, the lane's weights at the same index),
    plus the bias (``br``); ``wr``, ``br`` are not read where the spec has no weight or bias. (Its
    parameters are named as the norm kernel's own variables, so that calling it there binds nothing
    new and the kernel's code stays as it was.)"""
    _tl()
    dt, V = spec.dtype, spec.vec
    has_w = spec.weight is not None

    @T.macro
    def lane_value(xr, wr, br, j, v, mean, rstd, at=0):
        n = _centered(spec, T.cast(xr[at + j * V + v], "float32"), mean) * rstd
        if spec.rounding == "llama":
            n = round_to(n, dt, dt)
        if has_w:
            n = n * _wterm(spec, T.cast(wr[j * V + v], "float32"))
        if spec.bias is not None:
            n = n + T.cast(br[j * V + v], "float32")
        return n

    return lane_value


def lane_allsum(lanes: int):
    """The CUDA schedule's row sum within a warp: a macro ``lane_allsum(acc, k)`` that adds
    ``acc[0:k]`` (local fp32) over the ``lanes`` consecutive lanes of a group (a power of two, at most
    32; the groups aligned on multiples of ``lanes``), by an xor butterfly of ``log2(lanes)`` shuffles
    (``tileops_xor_lane`` of :data:`CUDA_HELPERS`): every lane ends with the same bits. Every lane of
    the warp must reach it (the shuffles take the full mask)."""
    _tl()
    log = lanes.bit_length() - 1

    @T.macro
    def lane_allsum(acc, k):
        for d in T.unroll(log):
            for i in T.unroll(k):
                acc[i] = acc[i] + T.call_extern("float32", "tileops_xor_lane", acc[i], T.shift_right(lanes, d + 1))

    return lane_allsum


def lane_rstd(spec: NormKernelSpec):
    """The CUDA schedule's row statistic: a macro ``rstd = lane_rstd(acc, eps, i=0)`` from the row's sum
    of squares in ``acc[i]`` (local fp32, every lane's the same bits): ``rsqrt(acc[i] / hidden + eps)``."""
    _tl()
    H = spec.hidden

    @T.macro
    def lane_rstd(acc, eps, i=0):
        return T.rsqrt(acc[i] / T.float32(H) + eps)

    return lane_rstd


class RowGroup:
    """The CUDA schedule's constants for one spec, and the macros its programs share: a row's
    vectors, the predicate of each, and the all-reduce across the lanes of a row."""

    def __init__(self, spec: NormKernelSpec):
        self.spec = spec
        self.V, self.NV, self.L = spec.vec, spec.vectors, spec.lanes
        self.TPB, self.RPB = spec.block_threads, spec.rows_per_block
        self.wide = not spec.per_warp
        self.warps = self.TPB // 32
        self.full = spec.nvec % self.L == 0  # every lane's every vector lies inside the row
        self.sh = min(self.L, 32)  # lanes one shuffle butterfly spans
        # __launch_bounds__(TPB, min_blocks): nvcc keeps to 65536 / _RESIDENT_THREADS = 64 registers a
        # thread, so that blocks of _RESIDENT_THREADS threads in all fit an SM (see _RESIDENT_THREADS)
        self.min_blocks = max(1, _RESIDENT_THREADS // self.TPB)
        self.log_sh = self.sh.bit_length() - 1

    def ok(self, live, lane, j):
        """Whether vector ``j`` of a lane exists: its row is live and it lies inside the row."""
        if self.full:
            return live
        return T.And(live, j * self.L + lane < self.spec.nvec)

    def col(self, lane, j):
        """First element of vector ``j`` of a lane within its row."""
        return (j * self.L + lane) * self.V

    def allsum_macro(self, one_by_one: bool = False):
        """``one_by_one``: the warps' sums are read back through volatile loads (``tileops_ld_volatile``
        of :data:`ASYNC_HELPER`), in order, not gathered at once: at 1024 threads a row's two sums are 64
        floats, which nvcc read in 16 ``LDS.128`` into 64 registers and spilled around (the same adds in
        the same order: the same bits)."""
        L, wide, warps = self.L, self.wide, self.warps
        butterfly = lane_allsum(self.sh)

        @T.macro
        def allsum(acc, k, red, stage, tx):
            """``acc[0:k]`` summed over the lanes of a row; every lane ends with the same bits (an xor
            butterfly adds the same two values on both sides; the warps' sums are added in order)."""
            butterfly(acc, k)
            if wide:
                if tx % 32 == 0:
                    for i in T.unroll(k):
                        red[stage, i, tx // 32] = acc[i]
                T.sync_threads()
                for i in T.unroll(k):
                    acc[i] = T.float32(0)
                    for w in T.unroll(warps):
                        if one_by_one:
                            acc[i] = acc[i] + T.call_extern("float32", "tileops_ld_volatile",
                                                            T.address_of(red[stage, i, w]))
                        else:
                            acc[i] = acc[i] + red[stage, i, w]

        return allsum

    def store_macro(self, dtype: str):
        V, e = self.V, _ELEM_BYTES[dtype]
        chunk, n = 16 // e, (V * e) // 16 if (V * e) % 16 == 0 else 0

        @T.macro
        def store(buf, off, vals, at):
            """``buf[off : off + V] = vals[at : at + V]``: 16-byte ``tileops_st16`` stores where the
            vector is whole 16-byte chunks, else a vectorized loop."""
            if n:
                for q in T.unroll(n):
                    T.call_extern("handle", "tileops_st16", T.address_of(buf[off + q * chunk]),
                                  T.address_of(vals[at + q * chunk]))
            else:
                for v in T.vectorized(V):
                    buf[off + v] = vals[at + v]

        return store

    def mean_macro(self, allsum):
        spec, NV, V, H = self.spec, self.NV, self.V, self.spec.hidden
        layer = spec.norm == "layer"
        ok = self.ok

        @T.macro
        def row_mean(xr, acc, red, tx, live, lane):
            """The mean of the row in ``xr`` for LayerNorm, the same bits in every lane (through
            ``acc[0]`` and shared stage 1); 0 for RMSNorm, which never reads it."""
            mean = T.alloc_var("float32")
            mean = T.float32(0)
            if layer:
                acc[0] = T.float32(0)
                for j in T.unroll(NV):
                    if ok(live, lane, j):
                        for v in T.unroll(V):
                            acc[0] = acc[0] + T.cast(xr[j * V + v], "float32")
                allsum(acc, 1, red, 1, tx)
                mean = acc[0] / T.float32(H)
            return mean

        return row_mean


def _fwd_cuda(spec: NormKernelSpec):
    k = RowGroup(spec)
    V, NV, L, TPB, RPB = k.V, k.NV, k.L, k.TPB, k.RPB
    dt, ydt, H = spec.dtype, spec.y_dtype, spec.hidden
    wdt, bdt = spec.weight or "float32", spec.bias or "float32"
    has_w = spec.weight is not None
    layer = spec.norm == "layer"
    allsum = k.allsum_macro()
    row_mean = k.mean_macro(allsum)
    store_x, store_y = k.store_macro(spec.dtype), k.store_macro(spec.y_dtype)
    value, rstd_of = lane_value(spec), lane_rstd(spec)

    # A lane group holds RG rows at once, GPB groups a block apart: each row's loads are issued before
    # any row is reduced, so a lane keeps RG 16-byte loads of x in flight (a head of 128 bf16 is one
    # load a lane). RG is 1 but in the row-per-warp RMSNorm (NormKernelSpec.group_rows).
    RG = spec.group_rows
    GPB, RW = RPB // RG, NV * V

    @T.macro
    def rows(one, X, R, W, B, Y, RO, M, NH, xst, xsh, rst, rsh, yst, ysh, rost, rosh, eps_bits, tx, lane, first,
             xr, rr, wr, br, yr, acc, red):
        for r in T.unroll(RG):
            row = first + r * GPB
            live = row < M
            xo = _row_offset(row, NH, xst, xsh, one) * V
            for j in T.unroll(NV):
                if k.ok(live, lane, j):
                    c = k.col(lane, j)
                    for v in T.vectorized(V):
                        xr[r * RW + j * V + v] = X[xo + c + v]
                    if spec.residual:
                        for v in T.vectorized(V):
                            rr[v] = R[_row_offset(row, NH, rst, rsh, one) * V + c + v]
                        for v in T.unroll(V):
                            xr[r * RW + j * V + v] = T.cast(T.cast(xr[r * RW + j * V + v], "float32")
                                                            + T.cast(rr[v], "float32"), dt)
                        store_x(RO, _row_offset(row, NH, rost, rosh, one) * V + c, xr, r * RW + j * V)
                    if r == 0:  # the weight's columns are every row's
                        if has_w:
                            for v in T.vectorized(V):
                                wr[j * V + v] = W[c + v]
                        if spec.bias is not None:
                            for v in T.vectorized(V):
                                br[j * V + v] = B[c + v]
        eps = T.reinterpret(eps_bits, "float32")
        mean = row_mean(xr, acc, red, tx, first < M, lane)  # (LayerNorm: RG is 1)
        for r in T.unroll(RG):
            acc[r] = T.float32(0)
            for j in T.unroll(NV):
                if k.ok(first + r * GPB < M, lane, j):
                    for v in T.unroll(V):
                        f = _centered(spec, T.cast(xr[r * RW + j * V + v], "float32"), mean)
                        acc[r] = acc[r] + f * f
        allsum(acc, RG, red, 0, tx)
        for r in T.unroll(RG):
            rstd = rstd_of(acc, eps, r)
            row = first + r * GPB
            yo = _row_offset(row, NH, yst, ysh, one) * V
            for j in T.unroll(NV):
                if k.ok(row < M, lane, j):
                    for v in T.unroll(V):
                        yr[v] = T.cast(value(xr, wr, br, j, v, mean, rstd, r * RW), ydt)
                    store_y(Y, yo + k.col(lane, j), yr, 0)

    paths = _nh_paths(spec, rows)

    @T.macro
    def body(X, R, W, B, Y, RO, M, NH, xst, xsh, rst, rsh, yst, ysh, rost, rosh, eps_bits):
        with T.Kernel(T.ceildiv(M, RPB), threads=TPB) as bx:
            T.import_source(CUDA_HELPERS)
            T.annotate_min_blocks_per_sm(k.min_blocks)
            tx = T.get_thread_binding()
            lane = tx % L
            first = bx * RPB + tx // L
            xr = T.alloc_local((RG * RW,), dt)
            rr = T.alloc_local((V,), dt)
            wr = T.alloc_local((RW,), wdt)
            br = T.alloc_local((RW,), bdt)
            yr = T.alloc_local((V,), ydt)
            acc = T.alloc_local((RG,), "float32")
            red = T.alloc_shared((2, 1, k.warps), "float32", scope="shared")
            paths(NH, X, R, W, B, Y, RO, M, NH, xst, xsh, rst, rsh, yst, ysh, rost, rosh, eps_bits, tx, lane, first,
                  xr, rr, wr, br, yr, acc, red)

    return body


# ----------------------------------------------------------------------------------- backward
def _bwd(spec: NormKernelSpec):
    st = _storages(spec)
    H = spec.hidden
    NX, NDY, NDRO, NDX, NP = _flat("X", "DY", "DRO", "DX", "P")
    sig = dict(X=T.Tensor((NX,), st["x"]), DY=T.Tensor((NDY,), st["y"]), DRO=T.Tensor((NDRO,), st["x"]),
               W=T.Tensor((H,), st["w"]), DX=T.Tensor((NDX,), st["x"]), DWP=T.Tensor((NP,), "float32"),
               DBP=T.Tensor((NP,), "float32"))
    body = _bwd_cuda(spec) if spec.backend == "cuda" else _bwd_c(spec, st)

    @T.prim_func
    def norm_bwd(X: sig["X"], DY: sig["DY"], DRO: sig["DRO"], W: sig["W"], DX: sig["DX"], DWP: sig["DWP"],
                 DBP: sig["DBP"], M: T.int32, NH: T.int32, G: T.int32, xst: T.int64, xsh: T.int64,
                 dyst: T.int64, dysh: T.int64, drost: T.int64, drosh: T.int64, dxst: T.int64, dxsh: T.int64,
                 eps_bits: T.int32):
        body(X, DY, DRO, W, DX, DWP, DBP, M, NH, G, xst, xsh, dyst, dysh, drost, drosh, dxst, dxsh, eps_bits)

    return norm_bwd


def _bwd_c(spec: NormKernelSpec, st: dict[str, str]):
    """Block ``g`` of ``G`` takes rows ``g, g + G, ...`` and sums its weight (bias) gradient into
    partial row ``g`` directly."""
    H, dt, ydt = spec.hidden, spec.dtype, spec.y_dtype
    wdt = spec.weight or "float32"
    has_w = spec.weight is not None
    layer = spec.norm == "layer"

    @T.macro
    def body(X, DY, DRO, W, DX, DWP, DBP, M, NH, G, xst, xsh, dyst, dysh, drost, drosh, dxst, dxsh, eps_bits):
        with T.Kernel(G, threads=1) as g:
            f = T.alloc_local((H,), "float32")  # x (minus the mean)
            dn = T.alloc_local((H,), "float32")  # dy times the weight term
            acc = T.alloc_local((4,), "float64")  # row sums: see "Row sums" above _fwd_c
            eps = T.reinterpret(eps_bits, "float32")
            for c in T.serial(H):
                if has_w:
                    DWP[T.cast(g, "int64") * H + c] = T.float32(0)
                if spec.bias is not None:
                    DBP[T.cast(g, "int64") * H + c] = T.float32(0)
            for it in T.serial(T.truncdiv(M - g + G - 1, G)):  # ceil((M - g) / G); M - g + G - 1 >= 0
                row = g + it * G
                xo = _row_offset(row, NH, xst, xsh)
                dyo = _row_offset(row, NH, dyst, dysh)
                acc[3] = T.float64(0)
                for c in T.serial(H):
                    f[c] = load_f32(X, xo + c, st["x"], dt)
                    dn[c] = _weighted(spec, load_f32(DY, dyo + c, st["y"], ydt), load_f32(W, c, st["w"], wdt))
                    acc[3] = acc[3] + T.cast(f[c], "float64")
                if layer:
                    for c in T.serial(H):
                        f[c] = f[c] - T.cast(acc[3] / T.float64(H), "float32")
                # acc: sum f^2, sum dn * f, and for LayerNorm sum dn (f = x - mean, dn = dy * (offset + w))
                for i in T.serial(3):
                    acc[i] = T.float64(0)
                for c in T.serial(H):
                    acc[0] = acc[0] + T.cast(f[c] * f[c], "float64")
                    acc[1] = acc[1] + T.cast(dn[c] * f[c], "float64")
                    if layer:
                        acc[2] = acc[2] + T.cast(dn[c], "float64")
                rstd = T.float32(1) / T.sqrt(T.cast(acc[0] / T.float64(H), "float32") + eps)
                b = T.cast(acc[1] / T.float64(H), "float32") * rstd * rstd
                a = T.cast(acc[2] / T.float64(H), "float32")
                dxo = _row_offset(row, NH, dxst, dxsh)
                p = T.cast(g, "int64") * H
                for c in T.serial(H):
                    # dx = rstd * (dn - mean(dn) - n * mean(dn * n)), n = f * rstd; mean(dn) for LayerNorm
                    d = rstd * (_centered(spec, dn[c], a) - f[c] * b)
                    if spec.residual:
                        d = d + load_f32(DRO, _row_offset(row, NH, drost, drosh) + c, st["x"], dt)
                    DX[dxo + c] = to_storage(d, st["x"], dt)
                    gy = load_f32(DY, dyo + c, st["y"], ydt)
                    if has_w:
                        n = f[c] * rstd
                        if spec.rounding == "llama":
                            n = round_to(n, dt, st["x"])
                        DWP[p + c] = DWP[p + c] + gy * n
                    if spec.bias is not None:
                        DBP[p + c] = DBP[p + c] + gy

    return body


def _warp_slot(wide: bool, tx):
    """The partial row of a thread within its block: its warp's (row-per-warp), else the block's one."""
    return 0 if wide else tx // 32


def _bwd_cuda(spec: NormKernelSpec):
    """Block ``g`` of ``G`` takes row groups ``g, g + G, ...`` (``rows_per_block`` rows each); each
    thread keeps the weight (bias) gradient of its columns in registers across them, and writes them
    once to its block's (warp's) partial row.

    ``bwd_prefetch`` (``PF``): while it loads row group ``i + 1`` into registers, a thread asks L2 for
    its vectors of group ``i + 1 + PF`` (x, dy and the residual's gradient; ``prefetch.global.L2``,
    which holds no register and waits for nothing), so that a block keeps ``PF`` more groups' bytes
    in flight than its registers hold; the register loads then find their lines in L2. A row of
    16384 bf16 held in registers is one 1024-thread block an SM, whose next row's loads are all an
    SM has in flight while its barriers stall it. ``bwd_one_sync``: the row-per-block schedule's
    sums alternate between the two shared slots (RMSNorm: by the row's parity; LayerNorm's mean and
    sums take one each), so a thread that writes a slot has passed the barrier after which every
    thread read it last: the barrier at each row's end goes."""
    k = RowGroup(spec)
    V, NV, L, TPB, RPB = k.V, k.NV, k.L, k.TPB, k.RPB
    dt, ydt, H = spec.dtype, spec.y_dtype, spec.hidden
    wdt = spec.weight or "float32"
    has_w = spec.weight is not None
    layer = spec.norm == "layer"
    has_b = spec.bias is not None
    D = spec.async_rows
    allsum = k.allsum_macro(one_by_one=bool(D))
    row_mean = k.mean_macro(allsum)
    store_x, store_y = k.store_macro(spec.dtype), k.store_macro(spec.y_dtype)
    # row slots of one warp (row-per-warp schedule), whose column sums are merged by shuffles
    slots_per_warp = 32 // L if not k.wide else 1
    K = 3 if layer else 2  # values each row reduces after the mean
    PPB = spec.partials_per_block
    PF = spec.bwd_prefetch
    one_sync = bool(spec.bwd_one_sync) and k.wide
    # the weight in shared memory (row-per-block, with a weight): each thread stores its own columns and
    # reads back only those, so no barrier orders them
    w_sh = bool(spec.bwd_w_shared) and k.wide and has_w
    wi = (lambda j, v: v) if w_sh else (lambda j, v: j * V + v)  # noqa: E731 - vector j's weight v in wr
    # bwd_async (row-per-block; D: NormKernelSpec.async_rows): D rows ahead in shared slots, D + 1 of them: iteration ``it`` reads slot
    # ``it % (D + 1)`` and refills slot ``(it + D) % (D + 1)``, the one it read the iteration before (whose
    # values its registers had consumed by then), so a copy never lands on a slot still being read
    RW = NV * L * V  # a slot: every vector of a row, lanes past the row included
    xb, yb = V * _ELEM_BYTES[dt], V * _ELEM_BYTES[ydt]  # bytes of a vector of x, of dy

    @T.macro
    def copy_row(one, X, DY, DRO, xs, gs, ds, slot, row, M, NH, xst, xsh, dyst, dysh, drost, drosh, lane):
        """Start copying this thread's vectors of x, dy (and the residual's gradient) of ``row`` (when it
        exists) into shared slot ``slot``; one commit group, empty past the last row, so that every
        thread's groups count alike."""
        xo = _row_offset(row, NH, xst, xsh, one) * V
        dyo = _row_offset(row, NH, dyst, dysh, one) * V
        for j in T.unroll(NV):
            if k.ok(row < M, lane, j):
                c = k.col(lane, j)
                T.call_extern("handle", f"tileops_cp_async<{xb}>", T.address_of(xs[slot * RW + c]),
                              T.address_of(X[xo + c]))
                T.call_extern("handle", f"tileops_cp_async<{yb}>", T.address_of(gs[slot * RW + c]),
                              T.address_of(DY[dyo + c]))
                if spec.residual:
                    T.call_extern("handle", f"tileops_cp_async<{xb}>", T.address_of(ds[slot * RW + c]),
                                  T.address_of(DRO[_row_offset(row, NH, drost, drosh, one) * V + c]))
        T.call_extern("handle", "tileops_cp_async_commit")

    @T.macro
    def load_row(one, X, DY, xn, gn, row, M, NH, xst, xsh, dyst, dysh, lane):
        """x and dy of ``row`` (when it exists) into ``xn``, ``gn``."""
        xo = _row_offset(row, NH, xst, xsh, one) * V
        dyo = _row_offset(row, NH, dyst, dysh, one) * V
        for j in T.unroll(NV):
            if k.ok(row < M, lane, j):
                for v in T.vectorized(V):
                    xn[j * V + v] = X[xo + k.col(lane, j) + v]
                for v in T.vectorized(V):
                    gn[j * V + v] = DY[dyo + k.col(lane, j) + v]

    @T.macro
    def prefetch_row(one, X, DY, DRO, row, M, NH, xst, xsh, dyst, dysh, drost, drosh, lane):
        """Ask L2 for this thread's vectors of x, dy (and the residual's gradient) of ``row``."""
        xo = _row_offset(row, NH, xst, xsh, one) * V
        dyo = _row_offset(row, NH, dyst, dysh, one) * V
        for j in T.unroll(NV):
            if k.ok(row < M, lane, j):
                T.call_extern("handle", "tileops_prefetch_l2", T.address_of(X[xo + k.col(lane, j)]))
                T.call_extern("handle", "tileops_prefetch_l2", T.address_of(DY[dyo + k.col(lane, j)]))
                if spec.residual:
                    T.call_extern("handle", "tileops_prefetch_l2",
                                  T.address_of(DRO[_row_offset(row, NH, drost, drosh, one) * V + k.col(lane, j)]))

    @T.macro
    def rows(one, X, DY, DRO, W, DX, M, NH, G, xst, xsh, dyst, dysh, drost, drosh, dxst, dxsh, eps_bits, g, tx, lane,
             xr, gr, xn, gn, dr, ds, xo_, wr, ws, dwa, dba, acc, red):
        eps = T.reinterpret(eps_bits, "float32")
        # row groups g, g + G, ...: ceil((groups - g) / G) of them; groups - g + G - 1 >= 0 as g < G.
        # Each iteration first issues the loads of its next row into xn, gn, so that they are in
        # flight while this row is reduced and written (without, a block's loads and its two
        # barriers alternate, and the 2 blocks an SM holds keep about 16 KB of loads in flight).
        if D:  # (xn, gn are then the shared slots)
            for d in T.unroll(D):
                copy_row(one, X, DY, DRO, xn, gn, ds, d, (g + d * G) * RPB + tx // L, M, NH, xst, xsh, dyst, dysh,
                         drost, drosh, lane)
        else:
            load_row(one, X, DY, xn, gn, g * RPB + tx // L, M, NH, xst, xsh, dyst, dysh, lane)
        if PF:
            for d in T.unroll(1, PF + 1):
                prefetch_row(one, X, DY, DRO, (g + d * G) * RPB + tx // L, M, NH, xst, xsh, dyst, dysh, drost,
                             drosh, lane)
        for it in T.serial(T.truncdiv(T.ceildiv(M, RPB) - g + G - 1, G)):
            row = (g + it * G) * RPB + tx // L
            live = row < M
            if D:
                copy_row(one, X, DY, DRO, xn, gn, ds, (it + D) % (D + 1), row + D * G * RPB, M, NH, xst, xsh, dyst,
                         dysh, drost, drosh, lane)
                T.call_extern("handle", f"tileops_cp_async_wait<{D}>")  # this row's group is done
                for j in T.unroll(NV):
                    if k.ok(live, lane, j):
                        for v in T.vectorized(V):
                            xr[j * V + v] = xn[(it % (D + 1)) * RW + k.col(lane, j) + v]
                        for v in T.vectorized(V):
                            gr[j * V + v] = gn[(it % (D + 1)) * RW + k.col(lane, j) + v]
            else:
                for i in T.unroll(NV * V):
                    xr[i] = xn[i]
                    gr[i] = gn[i]
                load_row(one, X, DY, xn, gn, row + G * RPB, M, NH, xst, xsh, dyst, dysh, lane)
            if PF:
                prefetch_row(one, X, DY, DRO, row + (PF + 1) * G * RPB, M, NH, xst, xsh, dyst, dysh, drost, drosh,
                             lane)
            mean = row_mean(xr, acc, red, tx, live, lane)
            # acc: sum f^2, sum dn * f, and for LayerNorm sum dn (f = x - mean, dn = dy * (offset + w))
            for i in T.unroll(K):
                acc[i] = T.float32(0)
            for j in T.unroll(NV):
                if k.ok(live, lane, j):
                    if w_sh:
                        for v in T.vectorized(V):
                            wr[v] = ws[k.col(lane, j) + v]
                    for v in T.unroll(V):
                        f = _centered(spec, T.cast(xr[j * V + v], "float32"), mean)
                        dn = _weighted(spec, T.cast(gr[j * V + v], "float32"), T.cast(wr[wi(j, v)], "float32"))
                        acc[0] = acc[0] + f * f
                        acc[1] = acc[1] + dn * f
                        if layer:
                            acc[2] = acc[2] + dn
            if one_sync and not layer:
                allsum(acc, K, red, it % 2, tx)
            else:
                allsum(acc, K, red, 0, tx)
            rstd = T.rsqrt(acc[0] / T.float32(H) + eps)
            b = acc[1] * rstd * rstd / T.float32(H)
            a = T.alloc_var("float32")
            a = T.float32(0)
            if layer:
                a = acc[2] / T.float32(H)
            dxo = _row_offset(row, NH, dxst, dxsh, one) * V
            for j in T.unroll(NV):
                if k.ok(live, lane, j):
                    c = k.col(lane, j)
                    if spec.residual:
                        if D:
                            for v in T.vectorized(V):
                                dr[v] = ds[(it % (D + 1)) * RW + c + v]
                        else:
                            for v in T.vectorized(V):
                                dr[v] = DRO[_row_offset(row, NH, drost, drosh, one) * V + c + v]
                    if w_sh:
                        for v in T.vectorized(V):
                            wr[v] = ws[c + v]
                    for v in T.unroll(V):
                        f = _centered(spec, T.cast(xr[j * V + v], "float32"), mean)
                        gy = T.cast(gr[j * V + v], "float32")
                        dn = _weighted(spec, gy, T.cast(wr[wi(j, v)], "float32"))
                        # dx = rstd * (dn - mean(dn) - n * mean(dn * n)), n = f * rstd; mean(dn) for LayerNorm
                        d = rstd * (_centered(spec, dn, a) - f * b)
                        if spec.residual:
                            d = d + T.cast(dr[v], "float32")
                        xo_[v] = T.cast(d, dt)
                        if has_w:
                            n = f * rstd
                            if spec.rounding == "llama":
                                n = round_to(n, dt, dt)
                            dwa[j * V + v] = dwa[j * V + v] + gy * n
                        if has_b:
                            dba[j * V + v] = dba[j * V + v] + gy
                    store_x(DX, dxo + c, xo_, 0)
            if k.wide and not one_sync:
                T.sync_threads()  # the next row's sums reuse the shared slots

    paths = _nh_paths(spec, rows)

    @T.macro
    def body(X, DY, DRO, W, DX, DWP, DBP, M, NH, G, xst, xsh, dyst, dysh, drost, drosh, dxst, dxsh, eps_bits):
        with T.Kernel(G, threads=TPB) as g:
            T.import_source(CUDA_HELPERS + (PREFETCH_HELPER if PF else "") + (ASYNC_HELPER if D else ""))
            T.annotate_min_blocks_per_sm(k.min_blocks)
            tx = T.get_thread_binding()
            lane = tx % L
            xr = T.alloc_local((NV * V,), dt)
            gr = T.alloc_local((NV * V,), ydt)
            if D:
                # dynamic shared memory: (D + 1) slots of x and dy, 128 KB a block at 16384 wide and D = 1
                xn = T.alloc_shared(((D + 1) * RW,), dt, scope="shared.dyn")
                gn = T.alloc_shared(((D + 1) * RW,), ydt, scope="shared.dyn")
            else:
                xn = T.alloc_local((NV * V,), dt)
                gn = T.alloc_local((NV * V,), ydt)
            dr = T.alloc_local((V,), dt)
            if D and spec.residual:
                ds = T.alloc_shared(((D + 1) * RW,), dt, scope="shared.dyn")
            xo_ = T.alloc_local((V,), dt)
            wr = T.alloc_local((V if w_sh else NV * V,), wdt)
            ws = T.alloc_shared((H if w_sh else 1,), wdt, scope="shared")
            dwa = T.alloc_local((NV * V,), "float32")
            dba = T.alloc_local((NV * V,), "float32")
            acc = T.alloc_local((3,), "float32")
            red = T.alloc_shared((2, 3, k.warps), "float32", scope="shared")
            for i in T.unroll(NV * V):
                dwa[i] = T.float32(0)
                dba[i] = T.float32(0)
            if has_w:
                for j in T.unroll(NV):
                    if k.ok(True, lane, j):
                        for v in T.vectorized(V):
                            if w_sh:
                                ws[k.col(lane, j) + v] = W[k.col(lane, j) + v]
                            else:
                                wr[j * V + v] = W[k.col(lane, j) + v]
            paths(NH, X, DY, DRO, W, DX, M, NH, G, xst, xsh, dyst, dysh, drost, drosh, dxst, dxsh, eps_bits, g, tx,
                  lane, xr, gr, xn, gn, dr, ds if D and spec.residual else dr, xo_, wr, ws, dwa, dba, acc, red)
            # a warp's row slots hold sums of the same columns: merge them, in a fixed butterfly
            for d in T.unroll(slots_per_warp.bit_length() - 1):
                for i in T.unroll(NV * V):
                    if has_w:
                        dwa[i] = dwa[i] + T.call_extern("float32", "tileops_xor_lane", dwa[i], L << d)
                    if has_b:
                        dba[i] = dba[i] + T.call_extern("float32", "tileops_xor_lane", dba[i], L << d)
            if tx % 32 < L:  # row-per-warp: lane group 0 of each warp writes the warp's partial row
                p = T.cast(g * PPB + _warp_slot(k.wide, tx), "int64") * H
                for j in T.unroll(NV):
                    if k.ok(True, lane, j):
                        for v in T.vectorized(V):
                            if has_w:
                                DWP[p + k.col(lane, j) + v] = dwa[j * V + v]
                        for v in T.vectorized(V):
                            if has_b:
                                DBP[p + k.col(lane, j) + v] = dba[j * V + v]

    return body


# ------------------------------------------------------------------------------- weight sum
def _wsum(spec: NormKernelSpec):
    H = spec.hidden
    wst = storage_dtype(spec.weight or "float32", spec.backend)
    bst = storage_dtype(spec.bias or "float32", spec.backend)
    NP, = _flat("P")
    sig = dict(DWP=T.Tensor((NP,), "float32"), DBP=T.Tensor((NP,), "float32"), DW=T.Tensor((H,), wst),
               DB=T.Tensor((H,), bst))
    has_w, has_b = spec.weight is not None, spec.bias is not None
    wdt, bdt = spec.weight or "float32", spec.bias or "float32"

    if spec.backend == "c":
        @T.macro
        def body(DWP, DBP, DW, DB, P):
            with T.Kernel(1, threads=1) as _:
                acc = T.alloc_local((2,), "float32")
                for c in T.serial(H):
                    acc[0] = T.float32(0)
                    acc[1] = T.float32(0)
                    for p in T.serial(P):
                        if has_w:
                            acc[0] = acc[0] + DWP[T.cast(p, "int64") * H + c]
                        if has_b:
                            acc[1] = acc[1] + DBP[T.cast(p, "int64") * H + c]
                    if has_w:
                        DW[c] = to_storage(acc[0], wst, wdt)
                    if has_b:
                        DB[c] = to_storage(acc[1], bst, bdt)
    else:
        S, C = WSUM_SLICES, _WSUM_COLS

        @T.macro
        def body(DWP, DBP, DW, DB, P):
            # thread (s, c): partial rows s, s + S, ... of column c, then the S sums added in order
            with T.Kernel(T.ceildiv(H, C), threads=S * C) as bx:
                tx = T.get_thread_binding()
                col = bx * C + tx % C
                s = tx // C
                red = T.alloc_shared((2, S, C), "float32", scope="shared")
                acc = T.alloc_local((2,), "float32")
                acc[0] = T.float32(0)
                acc[1] = T.float32(0)
                if col < H:
                    for i in T.serial(T.ceildiv(P - s, S)):
                        p = T.cast(s + i * S, "int64")
                        if has_w:
                            acc[0] = acc[0] + DWP[p * H + col]
                        if has_b:
                            acc[1] = acc[1] + DBP[p * H + col]
                red[0, s, tx % C] = acc[0]
                red[1, s, tx % C] = acc[1]
                T.sync_threads()
                if s == 0 and col < H:
                    for q in T.unroll(1, S):
                        acc[0] = acc[0] + red[0, q, tx % C]
                        acc[1] = acc[1] + red[1, q, tx % C]
                    if has_w:
                        DW[col] = T.cast(acc[0], wdt)
                    if has_b:
                        DB[col] = T.cast(acc[1], bdt)

    @T.prim_func
    def norm_wsum(DWP: sig["DWP"], DBP: sig["DBP"], DW: sig["DW"], DB: sig["DB"], P: T.int32):
        body(DWP, DBP, DW, DB, P)

    return norm_wsum


#: the names :mod:`tileops.kernels` looks up in a builder module
build = build_norm
Spec = NormKernelSpec
