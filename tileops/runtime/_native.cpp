// tileops' native runtime (built and loaded by tileops/runtime/native.py).
//
//   Binding   one call signature's launch, made by a family through tileops/runtime/binding.py: the
//             kernel's argument array with every shape, stride and scalar filled, and where each
//             tensor's pointer goes. Names no family's tensors: tensors are numbered as the op's
//             manifest lists them (inputs, then outputs).
//   serve     the executor: per call only what the pointers decide (alignment, overlap of the
//             outputs written into), new outputs allocated, one trampoline call (compile/entry.py).
//   Tracker   the one deferred error tracker (tileops/runtime/errors.py): per (thread, device,
//             stream) pending calls judged without blocking at the op's next call, strict mode,
//             the words of graph-captured calls kept for op.check().
//   Dispatch  one op's bindings by signature (what Op._signature reads, plus the dispatch key set,
//             so a tensor subclass, a functorch wrapper or a fake tensor never matches), and the
//             Python-facing calls: run (a repeated eager call), execute (the general path's
//             binding), add, check, reap.
//   tileops::apply, apply_out, apply_backward   the custom ops for torch.compile, with C++ kernels
//             that serve a known signature through the same executor and call the Python general
//             path for anything else.
//
// A call the executor cannot serve exactly as the general path would is refused before anything
// is allocated, launched or called: the Python path then checks, copies or raises. The executor
// runs with or without the GIL (the custom ops' kernels run without it): what it shares between
// threads is under mutexes, each thread's pending calls are its own, and the GIL is taken only to
// call Python and released around every launch and every wait on the GPU. CUDA is reached through
// c10's device guard interface and driver function addresses handed over from Python, so no CUDA
// header is needed.

#include <Python.h>
#include <torch/library.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/record_function.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

using packed_t = int32_t (*)(void*, const int64_t*, void*, void*, void*, void*);
using cu_event_t = int (*)(void*);
using cu_exchange_t = int (*)(int*);
using last_error_t = const char* (*)();

constexpr int kNotReady = 600;  // CUDA_ERROR_NOT_READY
constexpr int kMaxTensors = 16;  // inputs and outputs of one op (the attention prologue: 9 + 1)
constexpr int kMaxDims = 8;
constexpr size_t kMaxKey = 256;
constexpr size_t kMaxArgs = 128;
constexpr int kMaxLaunches = 8;  // kernels of one binding (a plan: the norm backward's two)
constexpr int kMaxWork = 8;  // per-call workspaces of one binding
constexpr int kMaxScalars = 8;  // per-call scalars of one execute
constexpr int kChunk = 4096;  // error entries per chunk of a pool (192 KiB)
// an entry (tileops/kernels/report.py): a kernel may check up to kWords inputs, ERR[0..3] holding the
// call's tag for each that was bad, then a two-word record of each one's first bad element
constexpr int kWords = 4;
constexpr int kEntry = kWords + 2 * kWords;
constexpr int kRecordDims = 4;  // a checked tensor's dims the tracker keeps to place a record (positions: 3)
constexpr int kMaxChunks = 4096;
// Every kEventEvery-th tracked call of a stream's queue records a CUDA event. An event is a cuEventRecord
// after the kernel and, at a later call, a cuEventQuery between two capture-mode exchanges: with one a
// call, the host table's call with positions took 8.94 us against 6.59 us without (H100, 2026-12-06;
// a bare `mul` 6.6 us). The calls between are judged when a later event of their stream completes
// (calls on a stream complete in order), or at once where a word already holds its tag (see reap).
constexpr int kEventEvery = 8;
enum Mode : int8_t { ABSENT = 0, NEW = 1, IN_PLACE = 2, GIVEN = 3 };  // as tileops/runtime/binding.py

struct NoCopy {  // what a scope or a binding holds is released once: never copied
  NoCopy() = default;
  NoCopy(const NoCopy&) = delete;
  NoCopy& operator=(const NoCopy&) = delete;
};

// ------------------------------------------------------------------------------ Python, the GIL
struct Gil : NoCopy {  // held within the scope (a no-op re-entry when it already is)
  PyGILState_STATE s;
  Gil() : s(PyGILState_Ensure()) {}
  ~Gil() { PyGILState_Release(s); }
};

struct NoGil : NoCopy {  // released within the scope when this thread holds it
  PyThreadState* s;
  NoGil() : s(PyGILState_Check() ? PyEval_SaveThread() : nullptr) {}
  ~NoGil() {
    if (s != nullptr) PyEval_RestoreThread(s);
  }
};

// the Python error just set, as an exception: the GIL is held here; torch's boundaries restore it
[[noreturn]] void throw_python() {
  python_error e;
  e.persist();
  throw std::move(e);
}

PyObject* checked(PyObject* r) {
  if (r == nullptr) throw_python();
  return r;
}

struct Ref : NoCopy {  // a new reference, released with the scope (the GIL held)
  PyObject* p;
  explicit Ref(PyObject* o) : p(checked(o)) {}
  ~Ref() { Py_XDECREF(p); }
};

int64_t as_i64(PyObject* o) {
  long long v = PyLong_AsLongLong(o);
  if (v == -1 && PyErr_Occurred()) throw_python();
  return (int64_t)v;
}

// ------------------------------------------------------------------------------ configuration
struct Driver {  // cuEventRecord, cuStreamIsCapturing, cuEventQuery, cuEventSynchronize, the capture mode
  void* record;
  void* capturing;
  cu_event_t query;
  cu_event_t synchronize;
  cu_exchange_t exchange;
  PyObject* make_event;  // (device index) -> raw event handle, made by torch (the owner kept in Python)
  bool pinned;  // error words in pinned memory (false only for tests that fake the driver on a CPU)
  PyObject* given;  // set_driver's arguments (holding make_event): what it returns when this is replaced
};
std::atomic<const Driver*> driver{nullptr};  // replaced, never freed: a launch may be reading the old one

struct Config {  // set once by tileops/runtime/library.py (GIL held), before any op exists
  // data: the launch's return codes (tileops/compile/entry.py), TILEOPS_STRICT, and the `when`
  // words of tileops.runtime.errors that name a reported call
  int32_t rc_record_failed = 0, rc_capturing = 0;
  bool env_strict = false;
  PyObject* when_now = nullptr;
  PyObject* when_earlier = nullptr;
  PyObject* when_graph = nullptr;
  // the four ways back into Python, each for what only Python has:
  PyObject* raise_bad = nullptr;  // (handle, values, when, name, record) -> raises the op's error, worded by its family
  PyObject* disjoint = nullptr;  // (x, y) -> whether they share no byte: tileops.runtime.memory.disjoint
  PyObject* late = nullptr;  // (binding key, inputs) -> the tensors of its late-bound slots, picked by the family
  PyObject* general = nullptr;  // (custom op, handle, *its schema's arguments) -> the Python body of a call not served
} cfg;
std::atomic<bool> configured{false};

thread_local int tl_strict = -1;  // tileops.strict(): -1 unset (TILEOPS_STRICT decides)
bool is_strict() { return tl_strict < 0 ? cfg.env_strict : tl_strict > 0; }

std::atomic<uint64_t> tags{0};
int32_t next_tag() { return (int32_t)((tags.fetch_add(1, std::memory_order_relaxed) + 1) % 0x7FFFFFFF + 1); }

const Driver& need_driver() {
  const Driver* d = driver.load();
  if (d == nullptr) throw std::runtime_error("tileops: the CUDA driver functions were not handed to the native runtime");
  return *d;
}

// ------------------------------------------------------------------------------ error words
// A device's words: int32 that kernels write (pinned host memory mapped on the GPU), each with a
// CUDA event made at its first use. Chunks are never freed nor moved, so a word's address is
// stable; the free list is under the mutex, and a taken word is its taker's alone.
struct Pool {
  struct Chunk {
    at::Tensor buf;
    int32_t* base = nullptr;
    void* events[kChunk] = {};
  };
  std::mutex mu;
  int index;  // CUDA device, or -1 (the CPU)
  std::array<Chunk*, kMaxChunks> chunks{};
  int n_chunks = 0;
  std::vector<int> free_list;

  explicit Pool(int i) : index(i) {}

  int take() {
    std::lock_guard<std::mutex> g(mu);
    if (free_list.empty()) {
      if (n_chunks == kMaxChunks) throw std::runtime_error("tileops: too many calls pending their value check");
      const Driver* d = driver.load();
      auto opts = at::TensorOptions().dtype(at::kInt);
      if (index >= 0 && (d == nullptr || d->pinned)) opts = opts.pinned_memory(true);
      auto* c = new Chunk();
      c->buf = at::zeros({kChunk * kEntry}, opts);
      c->base = c->buf.data_ptr<int32_t>();
      int first = n_chunks * kChunk;
      chunks[n_chunks++] = c;
      for (int i = first + kChunk - 1; i >= first; --i) free_list.push_back(i);
    }
    int i = free_list.back();
    free_list.pop_back();
    return i;
  }
  void give_back(int i) {
    std::lock_guard<std::mutex> g(mu);
    free_list.push_back(i);
  }
  // the first of entry i's kEntry words (the kernel's ERR)
  volatile int32_t* word(int i) const { return chunks[i / kChunk]->base + (i % kChunk) * kEntry; }
  void clear(int i) const {  // after a bad call: its records would outrank the next call's
    for (int j = 0; j < kEntry; ++j) word(i)[j] = 0;
  }
  void* event(int i, const Driver& d) {  // the word's event, made at its first use (by its taker)
    void*& ev = chunks[i / kChunk]->events[i % kChunk];
    if (ev == nullptr) {
      Gil g;
      Ref idx(PyLong_FromLong(index));
      Ref r(PyObject_CallOneArg(d.make_event, idx.p));
      ev = PyLong_AsVoidPtr(r.p);
      if (ev == nullptr) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "tileops: make_event returned no event");
        throw_python();
      }
    }
    return ev;
  }
};

Pool& pool_for(int index) {
  static std::mutex mu;
  static std::unordered_map<int, Pool*> pools;  // one per device, for the process's life
  std::lock_guard<std::mutex> g(mu);
  Pool*& p = pools[index];
  if (p == nullptr) p = new Pool(index);
  return *p;
}

// ------------------------------------------------------------------------------ Binding
struct LaunchData {  // one kernel of a binding (tileops/runtime/binding.py's Launch)
  struct Ptr {
    int t, slot;
    uint64_t align;
  };
  std::vector<int64_t> tmpl;
  packed_t packed = nullptr;
  void* entry = nullptr;
  last_error_t last_error = nullptr;
  PyObject* launch_py = nullptr;  // RawKernel.launch: the launch without a trampoline (no C compiler); a new reference
  int device = -1;
  std::vector<Ptr> ptrs;  // t: a tensor of the call (inputs, outputs), then the per-call workspaces
};

struct BindingData : NoCopy {
  struct Pair {
    int a, b;
    int64_t sa, sb;  // byte spans
  };
  std::vector<LaunchData> launches;  // in order, on one device
  int device = -1;
  int n_in = 0, n_out = 0;
  std::vector<PyObject*> names;  // interned, new references: what execute gathers the call's tensors by
  Mode mode[kMaxTensors] = {};
  int like[kMaxTensors] = {};
  int dtype[kMaxTensors] = {};  // a new output's scalar type, or -1: its like input's
  std::vector<int64_t> strides[kMaxTensors];  // a new output's (empty_like's for this signature)
  std::vector<int64_t> sizes[kMaxTensors];  // a new output's own shape (empty: its like input's)
  std::vector<Pair> pairs;
  std::vector<int> late;  // slots of the first launch whose tensor Python picks per call
  int64_t late_key = 0;  // the binding's key for tileops.runtime.library.late
  std::vector<std::array<int, 2>> checks;  // (input, word): the kernel writes the tag into ERR[word] for a bad value
  int checked = 0;  // the launch that checks them
  int word_slot = -1, tag_slot = -1;
  std::vector<int64_t> work;  // the per-call workspaces' byte offsets in one allocation of work_bytes
  int64_t work_bytes = 0;
  std::vector<std::array<int, 3>> scalars;  // (launch, slot, index): the call's per-call scalar `index`
  std::vector<at::Tensor> keep;  // tensors whose addresses the templates hold
  std::mutex memo_mu;  // the exact overlap test's answers by (pair, offset)
  std::vector<std::array<int64_t, 3>> memo;

  ~BindingData() {
    if (Py_IsInitialized()) {  // the last holder may be a call without the GIL
      Gil g;
      for (auto& l : launches) Py_XDECREF(l.launch_py);
      for (PyObject* n : names) Py_XDECREF(n);
    }
  }
};

// the ints of a sequence (the GIL held): all, or its first `width` (late rows: (slot, fn))
std::vector<int64_t> ints_of(PyObject* seq, const char* what, size_t width = 0) {
  Ref fast(PySequence_Fast(seq, what));
  size_t n = (size_t)PySequence_Fast_GET_SIZE(fast.p);
  if (n < width) {
    PyErr_Format(PyExc_TypeError, "tileops: Binding.%s: rows of %zu", what, width);
    throw_python();
  }
  std::vector<int64_t> got;
  for (size_t i = 0; i < (width > 0 ? width : n); ++i) got.push_back(as_i64(PySequence_Fast_GET_ITEM(fast.p, i)));
  return got;
}

std::vector<std::vector<int64_t>> int_rows(PyObject* seq, size_t width, const char* what) {
  Ref fast(PySequence_Fast(seq, what));
  std::vector<std::vector<int64_t>> rows;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast.p); ++i)
    rows.push_back(ints_of(PySequence_Fast_GET_ITEM(fast.p, i), what, width));
  return rows;
}

std::vector<at::Tensor> tensors_of(PyObject* seq) {
  Ref fast(PySequence_Fast(seq, "tileops: expected a list of tensors"));
  std::vector<at::Tensor> got;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast.p); ++i) {
    PyObject* o = PySequence_Fast_GET_ITEM(fast.p, i);
    if (!THPVariable_Check(o)) throw std::runtime_error("tileops: expected a list of tensors");
    got.push_back(THPVariable_Unpack(o));
  }
  return got;
}

int64_t attr_i64(PyObject* o, const char* name) {
  Ref v(PyObject_GetAttrString(o, name));
  return v.p == Py_None ? -1 : as_i64(v.p);
}

// one launch of a binding: its template, its kernel's entry points and device, its pointers (the GIL held)
void launch_from(PyObject* pl, LaunchData& l, int n_tensors) {
  {
    Ref tmpl(PyObject_GetAttrString(pl, "template"));
    Py_buffer view;
    if (PyObject_GetBuffer(tmpl.p, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) throw_python();
    bool ok = view.itemsize == 8 && view.format != nullptr &&
              (std::strcmp(view.format, "q") == 0 || std::strcmp(view.format, "l") == 0);
    if (ok) l.tmpl.assign((const int64_t*)view.buf, (const int64_t*)view.buf + view.len / 8);
    PyBuffer_Release(&view);
    if (!ok || l.tmpl.size() > kMaxArgs) throw std::invalid_argument("tileops: Launch.template: int64, at most 128");
  }
  Ref kernel(PyObject_GetAttrString(pl, "kernel"));
  Ref addresses(PyObject_GetAttrString(kernel.p, "addresses"));
  std::vector<int64_t> a = ints_of(addresses.p, "addresses");
  if (a.size() != 3) throw std::invalid_argument("tileops: RawKernel.addresses: (trampoline, entry, last error)");
  l.packed = (packed_t)(intptr_t)a[0];
  l.entry = (void*)(intptr_t)a[1];
  l.last_error = (last_error_t)(intptr_t)a[2];
  if (l.packed == nullptr) l.launch_py = checked(PyObject_GetAttrString(kernel.p, "launch"));
  l.device = (int)attr_i64(kernel.p, "device_index");
  Ref ptrs(PyObject_GetAttrString(pl, "pointers"));
  for (auto& r : int_rows(ptrs.p, 3, "pointers")) {
    if (r[0] < 0 || r[0] >= n_tensors || r[1] < 0 || r[1] >= (int64_t)l.tmpl.size() || r[2] < 1)
      throw std::invalid_argument("tileops: Launch.pointers");
    l.ptrs.push_back({(int)r[0], (int)r[1], (uint64_t)r[2]});
  }
}

// A BindingData from a tileops.runtime.binding.Binding (the GIL held)
std::shared_ptr<BindingData> binding_from(PyObject* pb) {
  auto b = std::make_shared<BindingData>();
  b->n_in = (int)attr_i64(pb, "inputs");
  Ref outputs(PyObject_GetAttrString(pb, "outputs"));
  Ref likes(PyObject_GetAttrString(pb, "likes"));
  Ref strides(PyObject_GetAttrString(pb, "strides"));
  Ref sizes(PyObject_GetAttrString(pb, "sizes"));
  Ref dtypes(PyObject_GetAttrString(pb, "dtypes"));
  std::vector<int64_t> modes = ints_of(outputs.p, "outputs"), like = ints_of(likes.p, "likes");
  b->n_out = (int)modes.size();
  if (b->n_in < 1 || b->n_in + b->n_out > kMaxTensors || like.size() != modes.size())
    throw std::invalid_argument("tileops: Binding: 1 to 16 tensors, one like per output");
  for (int j = 0; j < b->n_out; ++j) {
    if (modes[j] < ABSENT || modes[j] > GIVEN || like[j] < 0 || like[j] >= b->n_in)
      throw std::invalid_argument("tileops: Binding: an output's mode or like input is out of range");
    b->mode[j] = (Mode)modes[j];
    b->like[j] = (int)like[j];
    b->dtype[j] = -1;
    if (modes[j] == NEW) {
      Ref st(PySequence_GetItem(strides.p, j));
      b->strides[j] = ints_of(st.p, "strides");
      if (PySequence_Size(sizes.p) > j) {
        Ref sz(PySequence_GetItem(sizes.p, j));
        b->sizes[j] = ints_of(sz.p, "sizes");
      }
      if (!b->sizes[j].empty() && b->sizes[j].size() != b->strides[j].size())
        throw std::invalid_argument("tileops: Binding.sizes: one size per stride");
      if (PySequence_Size(dtypes.p) > j) {
        Ref dt(PySequence_GetItem(dtypes.p, j));
        if (dt.p != Py_None) {
          if (!THPDtype_Check(dt.p)) throw std::invalid_argument("tileops: Binding.dtypes: torch dtypes or None");
          b->dtype[j] = (int)((THPDtype*)dt.p)->scalar_type;
        }
      }
    }
  }
  Ref names(PyObject_GetAttrString(pb, "names"));
  {
    Ref fast(PySequence_Fast(names.p, "names"));
    if (PySequence_Fast_GET_SIZE(fast.p) != b->n_in + b->n_out) throw std::invalid_argument("tileops: Binding.names");
    for (int i = 0; i < b->n_in + b->n_out; ++i) {
      PyObject* name = PySequence_Fast_GET_ITEM(fast.p, i);
      if (!PyUnicode_Check(name)) throw std::invalid_argument("tileops: Binding.names: strings");
      Py_INCREF(name);
      PyUnicode_InternInPlace(&name);
      b->names.push_back(name);
    }
  }
  int n = b->n_in + b->n_out;
  Ref work(PyObject_GetAttrString(pb, "work"));
  b->work = ints_of(work.p, "work");
  b->work_bytes = attr_i64(pb, "work_bytes");
  for (int64_t off : b->work)
    if (off < 0 || off >= std::max<int64_t>(b->work_bytes, 1)) throw std::invalid_argument("tileops: Binding.work");
  if (n + (int)b->work.size() > kMaxTensors + kMaxWork) throw std::invalid_argument("tileops: Binding.work: too many");
  Ref launches(PyObject_GetAttrString(pb, "launches"));
  {
    Ref fast(PySequence_Fast(launches.p, "launches"));
    Py_ssize_t nl = PySequence_Fast_GET_SIZE(fast.p);
    if (nl < 1 || nl > kMaxLaunches) throw std::invalid_argument("tileops: Binding.launches: 1 to 8");
    b->launches.resize((size_t)nl);
    for (Py_ssize_t i = 0; i < nl; ++i)
      launch_from(PySequence_Fast_GET_ITEM(fast.p, i), b->launches[(size_t)i], n + (int)b->work.size());
  }
  b->device = b->launches[0].device;
  for (auto& l : b->launches)
    if (l.device != b->device) throw std::invalid_argument("tileops: Binding.launches: one device");
  int first_args = (int)b->launches[0].tmpl.size();
  Ref pairs(PyObject_GetAttrString(pb, "pairs"));
  for (auto& r : int_rows(pairs.p, 4, "pairs")) {
    if (r[0] < 0 || r[0] >= n || r[2] < 0 || r[2] >= n) throw std::invalid_argument("tileops: Binding.pairs");
    b->pairs.push_back({(int)r[0], (int)r[2], r[1], r[3]});
  }
  Ref late(PyObject_GetAttrString(pb, "late"));
  for (auto& r : int_rows(late.p, 1, "late")) {
    if (r[0] < 0 || r[0] >= first_args) throw std::invalid_argument("tileops: Binding.late");
    b->late.push_back((int)r[0]);
  }
  b->late_key = (int64_t)(intptr_t)pb;  // tileops.runtime.library.late finds the Binding by id()
  Ref checks(PyObject_GetAttrString(pb, "checks"));
  for (auto& r : int_rows(checks.p, 2, "checks")) {
    if (r[0] < 0 || r[0] >= b->n_in || r[1] < 0 || r[1] >= kWords) throw std::invalid_argument("tileops: Binding.checks");
    b->checks.push_back({(int)r[0], (int)r[1]});
  }
  b->checked = (int)attr_i64(pb, "checked");
  b->word_slot = (int)attr_i64(pb, "word_slot");
  b->tag_slot = (int)attr_i64(pb, "tag_slot");
  if (!b->checks.empty()) {
    if (b->checked < 0 || b->checked >= (int)b->launches.size()) throw std::invalid_argument("tileops: Binding.checked");
    int nargs = (int)b->launches[(size_t)b->checked].tmpl.size();
    if (b->word_slot < 0 || b->word_slot >= nargs || b->tag_slot < 0 || b->tag_slot >= nargs)
      throw std::invalid_argument("tileops: Binding.checks");
  }
  Ref scalars(PyObject_GetAttrString(pb, "scalars"));
  for (auto& r : int_rows(scalars.p, 3, "scalars")) {
    if (r[0] < 0 || r[0] >= (int64_t)b->launches.size() || r[1] < 0 ||
        r[1] >= (int64_t)b->launches[(size_t)r[0]].tmpl.size() || r[2] < 0 || r[2] >= kMaxScalars)
      throw std::invalid_argument("tileops: Binding.scalars");
    b->scalars.push_back({(int)r[0], (int)r[1], (int)r[2]});
  }
  Ref keep(PyObject_GetAttrString(pb, "keep"));
  b->keep = tensors_of(keep.p);
  return b;
}

constexpr const char* kCapsule = "tileops.NativeBinding";
void drop_binding(PyObject* c) { delete (std::shared_ptr<BindingData>*)PyCapsule_GetPointer(c, kCapsule); }

// the BindingData of a tileops Binding, made once and kept on it as `_native`, a capsule (the GIL held)
std::shared_ptr<BindingData> native_binding(PyObject* pb) {
  static PyObject* name = PyUnicode_InternFromString("_native");
  PyObject* got = PyObject_GenericGetDict(pb, nullptr);
  if (got == nullptr) throw_python();
  PyObject* nb = PyDict_GetItemWithError(got, name);  // borrowed, held by the dict
  Py_DECREF(got);
  if (nb == nullptr && PyErr_Occurred()) throw_python();
  if (nb == nullptr) {
    auto* data = new std::shared_ptr<BindingData>(binding_from(pb));
    nb = PyCapsule_New(data, kCapsule, drop_binding);
    if (nb == nullptr) delete data;
    Ref held(nb);
    if (PyObject_GenericSetAttr(pb, name, nb) < 0) throw_python();  // a frozen dataclass: set past its __setattr__
  }
  auto* data = (std::shared_ptr<BindingData>*)PyCapsule_GetPointer(nb, kCapsule);
  if (data == nullptr) throw_python();
  return *data;
}

// ------------------------------------------------------------------------------ one op
// A reference that does not keep a tensor's memory alive. The tracker holds a call's checked inputs
// only to name the bad value in its report: a strong reference kept them until the call was judged
// (for a graph-captured call, for the graph's life), and torch's CUDA-graph trees (torch.compile's
// "reduce-overhead") free a recording's inputs and temporaries and then refuse the run, finding our
// tensor alive in their pool. A tensor gone by the report is reported without its index.
using WeakTensor = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
WeakTensor weak(const at::Tensor& t) { return WeakTensor(t.getIntrusivePtr()); }
at::Tensor lock(const WeakTensor& w) { return at::Tensor(w.lock()); }  // undefined once freed

struct Shape {  // a checked tensor's sizes and strides as launched, to place its record's offset
  int ndim = -1;  // -1: more than kRecordDims dims (the report then names no index)
  int64_t sizes[kRecordDims];
  int64_t strides[kRecordDims];
};
Shape shape_of(const at::Tensor& t) {
  Shape s;
  if (t.dim() > kRecordDims) return s;
  s.ndim = (int)t.dim();
  for (int d = 0; d < s.ndim; ++d) {
    s.sizes[d] = t.size(d);
    s.strides[d] = t.stride(d);
  }
  return s;
}
struct Checked {  // the inputs a call's kernel checks: values[k] is judged by ERR[k]; input[k] -1: none
  std::array<WeakTensor, kWords> values{weak({}), weak({}), weak({}), weak({})};
  std::array<int, kWords> input{-1, -1, -1, -1};
  std::array<Shape, kWords> shapes;
};
struct Record {  // the two words of a bad input's record, read before its entry is given back
  int32_t lo = 0, hi = 0;
};
Record record_of(const Pool& pool, int w, int k) {
  return Record{pool.word(w)[kWords + 2 * k], pool.word(w)[kWords + 2 * k + 1]};
}
struct Pending {  // a call whose words are not judged yet (a graph-captured call's: no event)
  Pool* pool;
  int word;
  int32_t tag;
  Checked checked;
  void* event;
};
// the word of entry w holding the call's tag (the first checked input's), or -1
int bad_word(const Pool& pool, int w, int32_t tag, const Checked& c) {
  for (int k = 0; k < kWords; ++k)
    if (c.input[k] >= 0 && pool.word(w)[k] == tag) return k;
  return -1;
}
struct StreamCalls {
  Pool* pool;
  void* stream;
  std::deque<Pending> calls;  // in launch order: judged in order, stopping at the first unfinished
  int since_event = 0;  // calls queued since the last that recorded an event
};
struct Key {
  int64_t v[kMaxKey];
  size_t n = 0;
  bool push(int64_t x) {
    if (n == kMaxKey) return false;
    v[n++] = x;
    return true;
  }
};
struct Entry {
  std::vector<int64_t> key;
  std::shared_ptr<BindingData> b;  // null: this signature has no binding (the general path serves it)
};

struct Core {
  uint64_t id;
  int64_t handle;
  int n_in, n_out;
  int like[kMaxTensors];
  std::vector<int> written;  // the inputs the op writes in place (a KV cache), in the manifest's order
  std::vector<std::string> names;  // the inputs', then the outputs'
  std::mutex mu;  // table, graph
  std::unordered_map<uint64_t, std::vector<Entry>> table;
  size_t count = 0;
  std::vector<Pending> graph;
  std::atomic<uint64_t> hits{0}, misses{0};
};

std::atomic<uint64_t> core_ids{0};

struct ThreadCalls {
  std::weak_ptr<Core> owner;
  std::vector<StreamCalls> streams;  // in the order first used
};

// this thread's pending calls, by op: they go with the thread (a word not judged is never reused,
// as a stream may still write it)
std::unordered_map<uint64_t, ThreadCalls>& thread_calls() {
  thread_local std::unordered_map<uint64_t, ThreadCalls> calls;
  return calls;
}

std::mutex registry_mu;
std::unordered_map<int64_t, std::weak_ptr<Core>>& registry() {  // handle -> op, for the custom ops
  static auto* r = new std::unordered_map<int64_t, std::weak_ptr<Core>>();
  return *r;
}

// (low, high, sizes, strides): what tileops.runtime.errors.found places the record with
PyObject* record_tuple(const Record& r, const Shape& s) {
  if (s.ndim < 0) return Py_NewRef(Py_None);
  Ref sizes(PyTuple_New(s.ndim)), strides(PyTuple_New(s.ndim));
  for (int d = 0; d < s.ndim; ++d) {
    PyTuple_SET_ITEM(sizes.p, d, checked(PyLong_FromLongLong((long long)s.sizes[d])));
    PyTuple_SET_ITEM(strides.p, d, checked(PyLong_FromLongLong((long long)s.strides[d])));
  }
  return checked(Py_BuildValue("(iiOO)", (int)r.lo, (int)r.hi, sizes.p, strides.p));
}

[[noreturn]] void raise_bad(const Core& core, const Checked& c, int k, const Record& rec, PyObject* when) {
  Gil g;
  Ref handle(PyLong_FromLongLong((long long)core.handle));
  at::Tensor values = lock(c.values[k]);
  Ref p(values.defined() ? THPVariable_Wrap(values) : Py_NewRef(Py_None));
  const std::string& name = core.names[(size_t)c.input[k]];
  Ref n(PyUnicode_FromStringAndSize(name.data(), (Py_ssize_t)name.size()));
  Ref found(record_tuple(rec, c.shapes[k]));
  Ref r(PyObject_CallFunctionObjArgs(cfg.raise_bad, handle.p, p.p, when, n.p, found.p, nullptr));
  PyErr_SetString(PyExc_RuntimeError, "tileops: a checked value was out of range");  // raise_bad always raises
  throw_python();
}

bool has_pending(const Core& core) {
  auto& m = thread_calls();
  auto it = m.find(core.id);
  return it != m.end() && !it->second.streams.empty();
}

// whether event ev has completed: waited for (the GIL released) with `wait`; throws on a CUDA error
bool finished(const Driver& d, void* ev, bool wait) {
  int rc;
  if (wait) {
    NoGil released;
    rc = d.synchronize(ev);
  } else {  // a query in the relaxed capture mode: safe while another thread captures a graph
    int mode = 2;  // CU_STREAM_CAPTURE_MODE_RELAXED
    d.exchange(&mode);
    rc = d.query(ev);
    d.exchange(&mode);
    if (rc == kNotReady) return false;
  }
  if (rc != 0)
    throw std::runtime_error(std::string("tileops: ") + (wait ? "cuEventSynchronize" : "cuEventQuery") +
                             " failed with CUDA error " + std::to_string(rc));
  return true;
}

// whether stream is being captured into a graph (then nothing may be recorded on it)
bool stream_capturing(const Driver& d, void* stream) {
  int status = 0;
  return ((int (*)(void*, int*))d.capturing)(stream, &status) != 0 || status != 0;
}

// give the stream's last pending call an event recorded now, which completes when every call before
// it has; false where the stream is being captured (its calls then wait for a later call or check())
bool cover(const Driver& d, StreamCalls& sc) {
  Pending& last = sc.calls.back();
  if (last.event != nullptr) return true;
  void* ev = sc.pool->event(last.word, d);  // the word's own event, made at its first use
  int mode = 2;  // CU_STREAM_CAPTURE_MODE_RELAXED: safe while another thread captures a graph
  d.exchange(&mode);
  bool capturing = stream_capturing(d, sc.stream);
  int rc = capturing ? 0 : ((int (*)(void*, void*))d.record)(ev, sc.stream);
  d.exchange(&mode);
  if (capturing) return false;
  if (rc != 0) throw std::runtime_error("tileops: cuEventRecord failed with CUDA error " + std::to_string(rc));
  last.event = ev;
  sc.since_event = 0;
  return true;
}

// judge this thread's finished calls of the op (all of them with `wait`); raises for the first bad one.
// Most calls record no event (kEventEvery): a call is finished when the first event at or after it is,
// and a stream's events are queried at the call after one was recorded, so once every kEventEvery calls.
// A call whose word already holds its tag has run and found a bad value, so its stream is waited for
// then (its record may still be in flight), as with `wait`: the report is no later than with an event
// a call, and only a bad call's stream is ever waited for without `wait`.
void reap(const Core& core, bool wait) {
  auto& m = thread_calls();
  auto it = m.find(core.id);
  if (it == m.end() || it->second.streams.empty()) return;
  auto& streams = it->second.streams;
  const Driver& d = need_driver();  // pending calls are CUDA calls
  Checked failed;
  Record failed_record;
  int failed_word = -1;
  for (size_t s = 0; s < streams.size() && failed_word < 0;) {
    StreamCalls& sc = streams[s];
    bool hurry = wait;
    for (size_t i = 0; i < sc.calls.size() && !hurry; ++i)
      hurry = bad_word(*sc.calls[i].pool, sc.calls[i].word, sc.calls[i].tag, sc.calls[i].checked) >= 0;
    if (!hurry && sc.since_event != 0) {  // queried once an event, at the call after it: not every call
      ++s;
      continue;
    }
    while (!sc.calls.empty() && failed_word < 0) {
      auto covering =
          std::find_if(sc.calls.begin(), sc.calls.end(), [](const Pending& c) { return c.event != nullptr; });
      if (covering == sc.calls.end()) {
        if (!hurry || !cover(d, sc)) break;
        covering = std::prev(sc.calls.end());
      }
      if (!finished(d, covering->event, hurry)) break;
      for (size_t n = (size_t)(covering - sc.calls.begin()) + 1; n > 0; --n) {
        Pending& c = sc.calls.front();
        int k = bad_word(*c.pool, c.word, c.tag, c.checked);
        bool bad = k >= 0;
        if (bad) {
          failed_record = record_of(*c.pool, c.word, k);
          c.pool->clear(c.word);
        }
        c.pool->give_back(c.word);  // only after reading it
        if (bad) {
          failed = std::move(c.checked);
          failed_word = k;
        }
        sc.calls.pop_front();
        if (bad) break;  // one error per bad call: later calls stay pending, for the next report
      }
    }
    if (sc.calls.empty())
      streams.erase(streams.begin() + (std::ptrdiff_t)s);
    else
      ++s;
  }
  if (failed_word >= 0) raise_bad(core, failed, failed_word, failed_record, cfg.when_earlier);
}

void check(Core& core) {  // op.check(): wait for this thread's calls, then judge and clear the graph's words
  reap(core, true);
  Checked bad;
  Record bad_record;
  int bad_k = -1;
  {
    std::lock_guard<std::mutex> g(core.mu);
    for (auto& w : core.graph) {
      int k = bad_word(*w.pool, w.word, w.tag, w.checked);
      if (bad_k < 0 && k >= 0) {
        bad = w.checked;
        bad_k = k;
        bad_record = record_of(*w.pool, w.word, k);
      }
      w.pool->clear(w.word);
    }
  }
  if (bad_k >= 0) raise_bad(core, bad, bad_k, bad_record, cfg.when_graph);
}

// this thread's queue of the op's calls on (pool, stream), or null
const StreamCalls* stream_calls(const Core& core, const Pool* pool, void* stream) {
  auto& m = thread_calls();
  auto it = m.find(core.id);
  if (it == m.end()) return nullptr;
  for (const StreamCalls& sc : it->second.streams)
    if (sc.pool == pool && sc.stream == stream) return &sc;
  return nullptr;
}

void queue_pending(Core& core, std::shared_ptr<Core> owner, void* stream, Pending p) {
  auto& m = thread_calls();
  auto it = m.find(core.id);
  if (it == m.end()) {
    for (auto e = m.begin(); e != m.end();) e = e->second.owner.expired() ? m.erase(e) : std::next(e);
    it = m.emplace(core.id, ThreadCalls{owner, {}}).first;
  }
  auto& streams = it->second.streams;
  auto s = std::find_if(streams.begin(), streams.end(),
                        [&](const StreamCalls& sc) { return sc.pool == p.pool && sc.stream == stream; });
  if (s == streams.end()) s = streams.insert(s, StreamCalls{p.pool, stream, {}});
  s->since_event = p.event != nullptr ? 0 : s->since_event + 1;
  s->calls.push_back(std::move(p));
}

// ------------------------------------------------------------------------------ the executor
struct DeviceScope : NoCopy {  // the binding's CUDA device current during the launch (the entry point uses it)
  const c10::impl::DeviceGuardImplInterface* g = nullptr;
  c10::Device prev{c10::DeviceType::CPU};
  explicit DeviceScope(int index) {
    if (index < 0) return;
    auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    prev = impl->getDevice();
    if (prev.index() != index) {
      impl->setDevice(c10::Device(c10::DeviceType::CUDA, (c10::DeviceIndex)index));
      g = impl;
    }
  }
  ~DeviceScope() {
    if (g != nullptr) g->uncheckedSetDevice(prev);
  }
};

void* current_stream(int index) {
  if (index < 0) return nullptr;
  auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  return impl->getStreamNativeHandle(impl->getStream(c10::Device(c10::DeviceType::CUDA, (c10::DeviceIndex)index)));
}

void check_rc(const LaunchData& b, int32_t rc) {
  if (rc == 0 || rc == cfg.rc_capturing) return;
  if (rc == cfg.rc_record_failed) throw std::runtime_error("tileops: recording the CUDA event after a kernel failed");
  const char* msg = b.last_error != nullptr ? b.last_error() : "unknown error";
  throw std::runtime_error(std::string("TileLang kernel failed: ") + (msg != nullptr ? msg : ""));
}

// the kernel queued (run, on the CPU): the entry point's return code, or rc_capturing. A `tracked`
// launch asks whether the stream is being captured, and records `event` after the kernel if given.
int32_t run_kernel(const LaunchData& b, int64_t* args, void* stream, void* event, bool tracked = false) {
  const Driver* d = tracked || event != nullptr ? &need_driver() : nullptr;
  void* record = d != nullptr ? d->record : nullptr;
  void* capturing = d != nullptr ? d->capturing : nullptr;
  if (b.packed != nullptr) {
    NoGil released;
    return b.packed(b.entry, args, stream, record, event, capturing);
  }
  Gil g;  // no trampoline: the kernel's own launch through ctypes (raises as the Python path does)
  Ref list(PyList_New((Py_ssize_t)b.tmpl.size()));
  for (size_t i = 0; i < b.tmpl.size(); ++i) PyList_SET_ITEM(list.p, (Py_ssize_t)i, checked(PyLong_FromLongLong(args[i])));
  Ref st(PyLong_FromVoidPtr(stream)), rec(PyLong_FromVoidPtr(record)), ev(PyLong_FromVoidPtr(event)),
      cap(PyLong_FromVoidPtr(capturing));
  Ref r(PyObject_CallFunctionObjArgs(b.launch_py, list.p, st.p, rec.p, ev.p, cap.p, nullptr));
  int captured = PyObject_IsTrue(r.p);
  if (captured < 0) throw_python();
  return captured ? cfg.rc_capturing : 0;
}

// a launch whose kernel checks an input's values: judged now (CPU, strict mode), with a graph, or later
void tracked(Core& core, const std::shared_ptr<Core>& owner, const BindingData& b, const LaunchData& l,
             int64_t* args, const at::Tensor* t, void* stream) {
  Checked values;
  for (auto& c : b.checks) {
    values.values[c[1]] = weak(t[c[0]]);
    values.input[c[1]] = c[0];
    values.shapes[c[1]] = shape_of(t[c[0]]);
  }
  Pool& pool = pool_for(b.device);
  int w = pool.take();
  int32_t tag = next_tag();
  args[b.word_slot] = (int64_t)(intptr_t)pool.word(w);
  args[b.tag_slot] = tag;
  const Driver* d = nullptr;  // none on the CPU, where the kernel runs synchronously
  int32_t rc;
  void* ev = nullptr;
  try {
    if (b.device >= 0) {
      d = &need_driver();
      const StreamCalls* sc = stream_calls(core, &pool, stream);
      if (is_strict() || (sc != nullptr ? sc->since_event : 0) + 1 >= kEventEvery) ev = pool.event(w, *d);
    }
    rc = run_kernel(l, args, stream, ev, d != nullptr);
    check_rc(l, rc);
  } catch (...) {
    pool.give_back(w);
    throw;
  }
  if (rc == cfg.rc_capturing) {  // replays write the word: op.check() reads and clears it
    std::lock_guard<std::mutex> g(core.mu);
    core.graph.push_back({&pool, w, tag, values, nullptr});
    return;
  }
  if (d != nullptr && !is_strict()) {
    queue_pending(core, owner, stream, Pending{&pool, w, tag, values, ev});
    return;
  }
  if (d != nullptr) finished(*d, ev, true);
  int k = bad_word(pool, w, tag, values);
  Record rec;
  if (k >= 0) {
    rec = record_of(pool, w, k);
    pool.clear(w);
  }
  pool.give_back(w);  // only after reading it: another call may take it at once
  if (k >= 0) raise_bad(core, values, k, rec, cfg.when_now);
}

// the exact overlap test (tileops.runtime.memory.disjoint) of pair k, remembered by the offset
// when both tensors share one storage (what it decides then depends on the offset alone)
bool exactly_disjoint(BindingData& b, int k, const at::Tensor& x, const at::Tensor& y, int64_t offset) {
  bool shared = x.storage().data() == y.storage().data();
  if (shared) {
    std::lock_guard<std::mutex> g(b.memo_mu);
    for (auto& m : b.memo)
      if (m[0] == k && m[1] == offset) return m[2] != 0;
  }
  int ok = -1;
  {
    Gil g;
    try {
      Ref px(THPVariable_Wrap(x)), py(THPVariable_Wrap(y));
      Ref r(PyObject_CallFunctionObjArgs(cfg.disjoint, px.p, py.p, nullptr));
      ok = PyObject_IsTrue(r.p);
    } catch (const python_error&) {
    }
    PyErr_Clear();  // an error: refused, the general path says what is wrong
    if (ok < 0) return false;
  }
  if (shared) {
    std::lock_guard<std::mutex> g(b.memo_mu);
    if (b.memo.size() < 64) b.memo.push_back({k, offset, ok});
  }
  return ok == 1;
}

std::vector<at::Tensor> late_tensors(const BindingData& b, const at::Tensor* t) {
  Gil g;
  Ref inputs(PyTuple_New(b.n_in));
  for (int i = 0; i < b.n_in; ++i)
    PyTuple_SET_ITEM(inputs.p, i, t[i].defined() ? checked(THPVariable_Wrap(t[i])) : Py_NewRef(Py_None));
  Ref key(PyLong_FromLongLong((long long)b.late_key));
  Ref r(PyObject_CallFunctionObjArgs(cfg.late, key.p, inputs.p, nullptr));
  std::vector<at::Tensor> got = tensors_of(r.p);
  if (got.size() != b.late.size()) throw std::runtime_error("tileops: a late-bound slot got no tensor");
  return got;
}

// Whether anything may watch this thread's ATen calls: a TorchDispatchMode or any other key it includes
// besides the defaults, or the profiler's callbacks (then a new output is made through the dispatcher
// from the top, so that what they see of a call is as before).
bool watched() {
  return !(c10::impl::tls_local_dispatch_key_set().included_ - c10::default_included_set).empty() ||
         at::getStepCallbacksUnlessEmpty(at::RecordScope::FUNCTION).has_value();
}

// A new output on like's device. Unwatched, ATen's empty_strided kernel of that backend (CPU or CUDA:
// encode refuses every other) entered past the dispatcher's BackendSelect step, which reads the
// options to pick it: callgrind, 20,000 q+k calls on HF views with two new outputs, 14,680 -> 13,800
// instructions a call inside run (the kernel's own fill of uninitialised memory under
// torch.use_deterministic_algorithms is in that kernel, so it stays).
at::Tensor new_output(const at::Tensor& like, c10::IntArrayRef sizes, c10::IntArrayRef strides, c10::ScalarType dtype,
                      bool watch) {
  if (watch) return at::empty_strided(sizes, strides, like.options().dtype(dtype));
  const c10::DispatchKeySet backend(like.is_cuda() ? c10::DispatchKey::CUDA : c10::DispatchKey::CPU);
  return at::_ops::empty_strided::redispatch(backend, c10::fromIntArrayRefSlow(sizes),
                                             c10::fromIntArrayRefSlow(strides), dtype, c10::kStrided, like.device(),
                                             std::nullopt);
}

// Serve a call of binding b on t (inputs, then outputs; undefined: not given) with the call's per-call
// scalars: false when the pointers refuse it (nothing done); on success the outputs are in t; throws
// on failure.
bool serve(Core& core, const std::shared_ptr<Core>& owner, BindingData& b, at::Tensor* t,
           const int64_t* scalars = nullptr) {
  const int n_in = b.n_in, n = b.n_in + b.n_out;
  for (int j = 0; j < b.n_out; ++j)
    if (b.mode[j] == IN_PLACE && !t[n_in + j].is_same(t[b.like[j]]))  // (never over a borrowed tensor)
      t[n_in + j] = t[b.like[j]];
  int64_t ptr[kMaxTensors + kMaxWork] = {};
  for (int i = 0; i < n; ++i)
    if (t[i].defined()) ptr[i] = (int64_t)(intptr_t)t[i].data_ptr();
  for (auto& l : b.launches)
    for (auto& p : l.ptrs)
      if (p.t < n && t[p.t].defined() && (uint64_t)ptr[p.t] % p.align) return false;
  for (size_t k = 0; k < b.pairs.size(); ++k) {  // the outputs written into, against the others
    auto& pr = b.pairs[k];
    int64_t a0 = ptr[pr.a], a1 = ptr[pr.b];
    if (a0 + pr.sa <= a1 || a1 + pr.sb <= a0) continue;
    if (!exactly_disjoint(b, (int)k, t[pr.a], t[pr.b], a1 - a0)) return false;
  }
  // from here on the call is served: what fails raises
  int watch = -1;  // watched(), asked once a call that makes an output
  for (int j = 0; j < b.n_out; ++j)
    if (b.mode[j] == NEW) {
      const at::Tensor& like = t[b.like[j]];
      if (b.sizes[j].empty() && (int64_t)b.strides[j].size() != like.dim())
        throw std::runtime_error("tileops: Binding.strides");
      if (watch < 0) watch = watched();
      t[n_in + j] = new_output(like, b.sizes[j].empty() ? like.sizes() : c10::IntArrayRef(b.sizes[j]), b.strides[j],
                               b.dtype[j] < 0 ? like.scalar_type() : (c10::ScalarType)b.dtype[j], watch > 0);
      ptr[n_in + j] = (int64_t)(intptr_t)t[n_in + j].data_ptr();
    }
  at::Tensor work;  // the per-call workspaces, alive until every launch is queued (stream-ordered reuse)
  if (b.work_bytes > 0) {
    auto opts = at::TensorOptions().dtype(at::kByte);
    if (b.device >= 0) opts = opts.device(c10::Device(c10::DeviceType::CUDA, (c10::DeviceIndex)b.device));
    work = at::empty({b.work_bytes}, opts);
    for (size_t w = 0; w < b.work.size(); ++w) ptr[n + (int)w] = (int64_t)(intptr_t)work.data_ptr() + b.work[w];
  }
  std::vector<at::Tensor> late;  // alive until the kernel is queued
  if (!b.late.empty()) late = late_tensors(b, t);
  DeviceScope scope(b.device);
  void* stream = current_stream(b.device);
  int64_t args[kMaxArgs];
  for (size_t k = 0; k < b.launches.size(); ++k) {
    const LaunchData& l = b.launches[k];
    std::memcpy(args, l.tmpl.data(), l.tmpl.size() * sizeof(int64_t));
    for (auto& p : l.ptrs) args[p.slot] = ptr[p.t];
    for (auto& sc : b.scalars)
      if (sc[0] == (int)k) args[sc[1]] = scalars != nullptr ? scalars[sc[2]] : 0;
    if (k == 0)
      for (size_t i = 0; i < late.size(); ++i) args[b.late[i]] = (int64_t)(intptr_t)late[i].data_ptr();
    if (!b.checks.empty() && (int)k == b.checked)
      tracked(core, owner, b, l, args, t, stream);
    else
      check_rc(l, run_kernel(l, args, stream, nullptr));
  }
  return true;
}

// ------------------------------------------------------------------------------ signatures
const c10::DispatchKeySet kPlainKeys({c10::DispatchKey::CPU, c10::DispatchKey::CUDA, c10::DispatchKey::ADInplaceOrView,
                                      c10::DispatchKey::AutogradCPU, c10::DispatchKey::AutogradCUDA,
                                      c10::DispatchKey::AutocastCPU, c10::DispatchKey::AutocastCUDA});

// what Op._signature reads of a tensor, and its dispatch key set; false: no binding serves it
bool encode(Key& k, const at::Tensor& t) {
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  c10::DispatchKeySet ks = impl->key_set();
  if ((ks - kPlainKeys).highestFunctionalityKey() != c10::DispatchKey::Undefined) return false;
  if (impl->layout() != c10::kStrided) return false;
  int64_t dim = impl->dim();
  if (dim > kMaxDims || k.n + 5 + 2 * (size_t)dim > kMaxKey) return false;
  c10::Device dev = impl->device();
  k.push(1);
  k.push((int64_t)impl->dtype().toScalarType());
  k.push(((int64_t)dev.type() << 16) | (int64_t)(uint8_t)dev.index());
  k.push((int64_t)ks.raw_repr());
  k.push(dim);
  c10::IntArrayRef sizes = impl->sizes(), strides = impl->strides();
  for (int64_t i = 0; i < dim; ++i) k.v[k.n++] = sizes[i];
  for (int64_t i = 0; i < dim; ++i) k.v[k.n++] = strides[i];
  return true;
}

// the key of a call whose tensors are t; false: no binding serves it
bool key_of(const Core& core, const at::Tensor* t, Key& k) {
  for (int i = 0; i < core.n_in; ++i)
    if (!(t[i].defined() ? encode(k, t[i]) : k.push(0))) return false;
  for (int j = 0; j < core.n_out; ++j) {
    const at::Tensor& o = t[core.n_in + j];
    bool ok = !o.defined() ? k.push(0) : o.is_same(t[core.like[j]]) ? k.push(2) : encode(k, o);  // 2: in place
    if (!ok) return false;
  }
  return true;
}

uint64_t hash_key(const Key& k) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < k.n; ++i) {
    h ^= (uint64_t)k.v[i];
    h *= 1099511628211ull;
    h ^= h >> 29;
  }
  return h;
}

Entry* entry_of(Core& core, const Key& k) {  // the table's entry of a key, or null (core.mu held)
  auto it = core.table.find(hash_key(k));
  if (it != core.table.end())
    for (Entry& e : it->second)
      if (e.key.size() == k.n && std::memcmp(e.key.data(), k.v, k.n * sizeof(int64_t)) == 0) return &e;
  return nullptr;
}

// the binding of a key: (found, binding), the binding null for a signature known to have none
std::pair<bool, std::shared_ptr<BindingData>> find(Core& core, const Key& k) {
  std::lock_guard<std::mutex> g(core.mu);
  Entry* e = entry_of(core, k);
  return {e != nullptr, e != nullptr ? e->b : nullptr};
}

void add(Core& core, const Key& k, std::shared_ptr<BindingData> b) {
  std::lock_guard<std::mutex> g(core.mu);
  if (Entry* e = entry_of(core, k)) {
    e->b = std::move(b);
    return;
  }
  core.table[hash_key(k)].push_back(Entry{std::vector<int64_t>(k.v, k.v + k.n), std::move(b)});
  ++core.count;
}

bool any_requires_grad(std::initializer_list<at::TensorList> lists) {
  if (!c10::GradMode::is_enabled()) return false;
  for (auto l : lists)
    for (const auto& t : l)
      if (t.defined() && t.requires_grad()) return true;
  return false;
}

// a call of a known signature served (t: its inputs, and the outputs written into; `ok`: a call a
// binding may serve), or counted as passed on (false: nothing done)
bool serve_op(const std::shared_ptr<Core>& core, bool ok, at::Tensor* t, std::shared_ptr<BindingData>& b) {
  Key k;
  if (ok && key_of(*core, t, k) && (b = find(*core, k).second) != nullptr) {
    if (has_pending(*core)) reap(*core, false);  // an earlier call's bad value, raised before this call runs
    if (serve(*core, core, *b, t)) {
      core->hits.fetch_add(1, std::memory_order_relaxed);
      return true;
    }
  }
  core->misses.fetch_add(1, std::memory_order_relaxed);
  return false;
}

// ------------------------------------------------------------------------------ Dispatch
struct Dispatch {
  PyObject_HEAD
  std::shared_ptr<Core> core;
  PyObject* names[kMaxTensors];  // interned: the dicts of an eager call are keyed by them
};

// Tensors gather took from a call's Python objects without a reference of their own (see gather_by),
// handed back, not released, when the call's t goes (declared after it, so it goes first)
struct Borrowed : NoCopy {
  at::Tensor* t;
  uint32_t slots = 0;  // bit i: t[i] is borrowed
  explicit Borrowed(at::Tensor* tensors) : t(tensors) {}
  ~Borrowed() {
    for (int i = 0; i < kMaxTensors; ++i)
      if (slots >> i & 1u) c10::MaybeOwnedTraits<at::Tensor>::destroyBorrow(t[i]);
  }
};

// the call's tensors from its dicts (by the manifest's names) into t, and its Python objects into
// obj; false: not a call a signature's binding can serve (a name the op lacks; unless `any`, a
// tensor subclass). With `borrow`, t holds the tensors without a reference (the objects, which the
// caller's dicts keep for the call, hold them): a copy costs torch's incref and decref of the tensor's
// Python object (callgrind, a served q+k call on HF views: 13,800 -> 12,540 instructions inside run).
bool gather_by(PyObject* const* names, int n_in, int n_out, PyObject* tensors, PyObject* outs, PyObject** obj,
               at::Tensor* t, bool any, Borrowed* borrow = nullptr) {
  if (!PyDict_CheckExact(tensors) || PyDict_GET_SIZE(tensors) != n_in) return false;
  bool has_outs = outs != nullptr && outs != Py_None;
  if (has_outs && !PyDict_CheckExact(outs)) return false;
  Py_ssize_t found = 0;
  for (int i = 0; i < n_in + n_out; ++i) {
    bool output = i >= n_in;
    PyObject* o = output ? (has_outs ? PyDict_GetItemWithError(outs, names[i]) : nullptr)
                         : PyDict_GetItemWithError(tensors, names[i]);
    if (o == nullptr) {
      if (PyErr_Occurred() || !output) {
        PyErr_Clear();
        return false;
      }
      o = Py_None;  // an output not passed: not given
    } else if (output) {
      ++found;
    }
    obj[i] = o;
    if (o != Py_None) {
      if (!(any ? THPVariable_Check(o) : THPVariable_CheckExact(o))) return false;
      if (borrow == nullptr) {
        t[i] = THPVariable_Unpack(o);
      } else {
        t[i] = c10::MaybeOwnedTraits<at::Tensor>::createBorrow(THPVariable_Unpack(o));
        borrow->slots |= 1u << i;
      }
    }
  }
  return !has_outs || found == PyDict_GET_SIZE(outs);  // else a name the op does not have
}

bool gather(Dispatch* d, PyObject* tensors, PyObject* outs, PyObject** obj, at::Tensor* t,
            Borrowed* borrow = nullptr) {
  return gather_by(d->names, d->core->n_in, d->core->n_out, tensors, outs, obj, t, false, borrow);
}

// what the call returns: its one produced output, or a tuple of them
PyObject* result(const BindingData& b, at::Tensor* t, PyObject* const* obj) {
  Py_ssize_t n = 0;
  for (int j = 0; j < b.n_out; ++j) n += b.mode[j] != ABSENT;
  if (n == 0) Py_RETURN_NONE;
  Ref got(PyTuple_New(n));
  for (int j = 0, i = 0; j < b.n_out; ++j) {
    int k = b.n_in + j;
    if (b.mode[j] == ABSENT) continue;
    PyObject* o = b.mode[j] == NEW ? THPVariable_Wrap(std::move(t[k]))
                                   : Py_NewRef(obj[b.mode[j] == IN_PLACE ? b.like[j] : k]);
    PyTuple_SET_ITEM(got.p, i++, checked(o));
  }
  return Py_NewRef(n == 1 ? PyTuple_GET_ITEM(got.p, 0) : got.p);
}

// run(tensors, outs=None): a repeated eager call served, or NotImplemented (nothing done)
PyObject* Dispatch_run(Dispatch* d, PyObject* const* a, Py_ssize_t n) {
  HANDLE_TH_ERRORS
  if (n < 1 || n > 2) throw std::invalid_argument("run(tensors, outs=None)");
  PyObject* obj[kMaxTensors];
  at::Tensor t[kMaxTensors];
  Borrowed borrowed(t);
  std::shared_ptr<BindingData> b;
  bool plain = gather(d, a[0], n == 2 ? a[1] : Py_None, obj, t, &borrowed);
  // autograd must see a call that requires grad: the general path records it
  if (!serve_op(d->core, plain && !any_requires_grad({at::TensorList(t, d->core->n_in)}), t, b))
    Py_RETURN_NOTIMPLEMENTED;
  return result(*b, t, obj);
  END_HANDLE_TH_ERRORS
}

// execute(binding, tensors, outs, scalars=()): a binding's launches on the tensors given by the
// binding's names (the general path's, a plan's), with the call's per-call scalars
PyObject* Dispatch_execute(Dispatch* d, PyObject* const* a, Py_ssize_t n) {
  HANDLE_TH_ERRORS
  if (n < 3 || n > 4) throw std::invalid_argument("execute(binding, tensors, outs, scalars=())");
  std::shared_ptr<BindingData> b = native_binding(a[0]);
  PyObject* obj[kMaxTensors];
  at::Tensor t[kMaxTensors];
  if (!gather_by(b->names.data(), b->n_in, b->n_out, a[1], a[2], obj, t, true))
    throw std::invalid_argument("tileops: execute: tensors the binding does not take");
  int64_t scalars[kMaxScalars] = {};
  if (n == 4) {
    std::vector<int64_t> got = ints_of(a[3], "scalars");
    if (got.size() > (size_t)kMaxScalars) throw std::invalid_argument("tileops: execute: at most 8 scalars");
    std::copy(got.begin(), got.end(), scalars);
  }
  if (!serve(*d->core, d->core, *b, t, scalars)) Py_RETURN_NOTIMPLEMENTED;
  return result(*b, t, obj);
  END_HANDLE_TH_ERRORS
}

// add(tensors, outs, binding | None): the binding of calls shaped like this one (False if none can serve them)
PyObject* Dispatch_add(Dispatch* d, PyObject* const* a, Py_ssize_t n) {
  HANDLE_TH_ERRORS
  if (n != 3) throw std::invalid_argument("add(tensors, outs, binding)");
  PyObject* obj[kMaxTensors];
  at::Tensor t[kMaxTensors];
  Key k;
  if (!gather(d, a[0], a[1], obj, t) || !key_of(*d->core, t, k)) Py_RETURN_FALSE;
  if (a[2] == Py_None) {
    if (!find(*d->core, k).first) add(*d->core, k, nullptr);
  } else {
    std::shared_ptr<BindingData> b = native_binding(a[2]);
    if (find(*d->core, k).second != b) add(*d->core, k, std::move(b));
  }
  Py_RETURN_TRUE;
  END_HANDLE_TH_ERRORS
}

PyObject* Dispatch_reap(Dispatch* d, PyObject*) {
  HANDLE_TH_ERRORS
  reap(*d->core, false);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyObject* Dispatch_has_pending(Dispatch* d, PyObject*) { return PyBool_FromLong(has_pending(*d->core)); }

PyObject* Dispatch_check(Dispatch* d, PyObject*) {
  HANDLE_TH_ERRORS
  check(*d->core);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyObject* Dispatch_clear(Dispatch* d, PyObject*) {
  std::unordered_map<uint64_t, std::vector<Entry>> old;
  {
    std::lock_guard<std::mutex> g(d->core->mu);
    old.swap(d->core->table);
    d->core->count = 0;
  }
  Py_RETURN_NONE;  // `old` goes here, outside the lock (a binding's last holder takes the GIL)
}

PyObject* Dispatch_stats(Dispatch* d, PyObject*) {
  Core& c = *d->core;
  size_t bindings, graph;
  {
    std::lock_guard<std::mutex> g(c.mu);
    bindings = c.count;
    graph = c.graph.size();
  }
  size_t pending = 0;  // this thread's calls of the op not judged yet
  auto& m = thread_calls();
  auto it = m.find(c.id);
  if (it != m.end())
    for (const StreamCalls& sc : it->second.streams) pending += sc.calls.size();
  return Py_BuildValue("{s:n,s:K,s:K,s:n,s:n}", "bindings", (Py_ssize_t)bindings, "hits",
                       (unsigned long long)c.hits.load(), "misses", (unsigned long long)c.misses.load(),
                       "graph_words", (Py_ssize_t)graph, "pending", (Py_ssize_t)pending);
}

// _track(launch, values, stream, device): a tracked CUDA launch with `launch` standing in for
// the kernel (RawKernel.launch's signature), for tests that fake the driver on a machine without a GPU
PyObject* Dispatch_track(Dispatch* d, PyObject* const* a, Py_ssize_t n) {
  HANDLE_TH_ERRORS
  if (n != 4 || !THPVariable_Check(a[1])) throw std::invalid_argument("_track(launch, values, stream, device)");
  BindingData b;
  b.launches.resize(1);
  LaunchData& l = b.launches[0];
  l.tmpl.assign(2, 0);
  l.device = b.device = (int)as_i64(a[3]);
  b.word_slot = 0;
  b.tag_slot = 1;
  b.checks.push_back({0, 0});  // the values stand for the op's first input
  l.launch_py = Py_NewRef(a[0]);
  int64_t args[2] = {0, 0};
  at::Tensor values = THPVariable_Unpack(a[1]);
  tracked(*d->core, d->core, b, l, args, &values, (void*)(intptr_t)as_i64(a[2]));
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyObject* Dispatch_new(PyTypeObject* type, PyObject* args, PyObject* kw) {
  HANDLE_TH_ERRORS
  static const char* kwlist[] = {"handle", "inputs", "outputs", "likes", "written", nullptr};
  long long handle;
  PyObject *ins, *outs, *likes, *written = nullptr;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "LO!O!O!|O!", (char**)kwlist, &handle, &PyTuple_Type, &ins,
                                   &PyTuple_Type, &outs, &PyTuple_Type, &likes, &PyTuple_Type, &written))
    return nullptr;
  Py_ssize_t ni = PyTuple_GET_SIZE(ins), no = PyTuple_GET_SIZE(outs);
  if (ni < 1 || ni + no > kMaxTensors || PyTuple_GET_SIZE(likes) != no)
    throw std::invalid_argument("tileops: Dispatch: 1 to 16 inputs and outputs, a like per output");
  auto core = std::make_shared<Core>();
  core->id = core_ids.fetch_add(1) + 1;
  core->handle = handle;
  core->n_in = (int)ni;
  core->n_out = (int)no;
  std::vector<int64_t> like = ints_of(likes, "likes");
  for (Py_ssize_t j = 0; j < no; ++j) {
    if (like[j] < 0 || like[j] >= ni) throw std::invalid_argument("tileops: Dispatch: likes index the inputs");
    core->like[j] = (int)like[j];
  }
  if (written != nullptr)
    for (int64_t w : ints_of(written, "written")) {
      if (w < 0 || w >= ni || (!core->written.empty() && w <= core->written.back()))
        throw std::invalid_argument("tileops: Dispatch: written indexes the inputs, in order");
      core->written.push_back((int)w);
    }
  auto* d = (Dispatch*)type->tp_alloc(type, 0);
  if (d == nullptr) return nullptr;
  new (&d->core) std::shared_ptr<Core>(core);
  for (Py_ssize_t i = 0; i < ni + no; ++i) {
    PyObject* s = i < ni ? PyTuple_GET_ITEM(ins, i) : PyTuple_GET_ITEM(outs, i - ni);
    if (!PyUnicode_Check(s)) {
      Py_DECREF(d);
      throw std::invalid_argument("tileops: Dispatch: names are str");
    }
    Py_INCREF(s);
    PyUnicode_InternInPlace(&s);
    d->names[i] = s;
    core->names.emplace_back(PyUnicode_AsUTF8(s));
  }
  {
    std::lock_guard<std::mutex> g(registry_mu);
    registry()[handle] = core;
  }
  return (PyObject*)d;
  END_HANDLE_TH_ERRORS
}

void Dispatch_dealloc(Dispatch* d) {
  PyTypeObject* tp = Py_TYPE(d);
  if (d->core) {
    for (size_t i = 0; i < d->core->names.size(); ++i) Py_XDECREF(d->names[i]);
    Dispatch_clear(d, nullptr);
    std::lock_guard<std::mutex> g(registry_mu);
    auto it = registry().find(d->core->handle);
    if (it != registry().end() && it->second.lock() == d->core) registry().erase(it);
  }
  d->core.~shared_ptr<Core>();
  tp->tp_free((PyObject*)d);
  Py_DECREF(tp);
}

PyMethodDef Dispatch_methods[] = {
    {"run", (PyCFunction)(void (*)(void))Dispatch_run, METH_FASTCALL,
     "run(tensors, outs=None): the call's result, or NotImplemented when no binding serves it."},
    {"execute", (PyCFunction)(void (*)(void))Dispatch_execute, METH_FASTCALL,
     "execute(binding, tensors, outs): run a Binding on these tensors (NotImplemented when refused)."},
    {"add", (PyCFunction)(void (*)(void))Dispatch_add, METH_FASTCALL,
     "add(tensors, outs, binding): the Binding (or None) of calls shaped like this one."},
    {"reap", (PyCFunction)Dispatch_reap, METH_NOARGS, "Judge this thread's finished calls (raises for a bad one)."},
    {"has_pending", (PyCFunction)Dispatch_has_pending, METH_NOARGS, "Whether this thread has calls to judge."},
    {"check", (PyCFunction)Dispatch_check, METH_NOARGS, "op.check(): wait, judge, and judge the graphs' words."},
    {"clear", (PyCFunction)Dispatch_clear, METH_NOARGS, "Forget every binding."},
    {"stats", (PyCFunction)Dispatch_stats, METH_NOARGS, "Bindings known, calls served, calls passed on."},
    {"_track", (PyCFunction)(void (*)(void))Dispatch_track, METH_FASTCALL, "A tracked launch (tests)."},
    {nullptr, nullptr, 0, nullptr}};
PyType_Slot Dispatch_slots[] = {{Py_tp_new, (void*)Dispatch_new},
                                {Py_tp_dealloc, (void*)Dispatch_dealloc},
                                {Py_tp_methods, Dispatch_methods},
                                {Py_tp_doc, (void*)"One op's bindings, executor and error tracker."},
                                {0, nullptr}};
PyType_Spec Dispatch_spec = {"tileops._tileops_native.Dispatch", sizeof(Dispatch), 0, Py_TPFLAGS_DEFAULT,
                             Dispatch_slots};

// ------------------------------------------------------------------------------ the custom ops
std::shared_ptr<Core> core_of(int64_t handle) {
  if (!configured.load()) throw std::runtime_error("tileops: the native runtime is not configured");
  std::lock_guard<std::mutex> g(registry_mu);
  auto it = registry().find(handle);
  std::shared_ptr<Core> c = it != registry().end() ? it->second.lock() : nullptr;
  if (c == nullptr) throw std::runtime_error("tileops: op handle " + std::to_string(handle) + " names no live op");
  return c;
}

// the given inputs by the names a custom op passes ("a,b"): into t by manifest index
bool place(const Core& c, at::TensorList inputs, c10::string_view names, at::Tensor* t) {
  size_t at = 0, given = 0;
  while (at <= names.size() && !names.empty()) {
    size_t end = names.find(',', at);
    if (end == c10::string_view::npos) end = names.size();
    c10::string_view name = names.substr(at, end - at);
    int i = 0;
    while (i < c.n_in && c10::string_view(c.names[i]) != name) ++i;
    if (i == c.n_in || given >= inputs.size() || t[i].defined()) return false;
    t[i] = inputs[given++];
    at = end + 1;
  }
  return given == inputs.size();
}

PyObject* tensor_list(at::TensorList ts) {  // new reference (the GIL held)
  Ref l(PyList_New((Py_ssize_t)ts.size()));
  for (size_t i = 0; i < ts.size(); ++i) PyList_SET_ITEM(l.p, (Py_ssize_t)i, checked(THPVariable_Wrap(ts[i])));
  return Py_NewRef(l.p);
}

// the Python general path of a custom op: general(what, handle, *lists, names, *after) as its schema
// -> a list of tensors, or None
std::vector<at::Tensor> python_path(const char* what, int64_t handle, std::initializer_list<at::TensorList> lists,
                                    c10::string_view names, std::initializer_list<at::TensorList> after = {}) {
  Gil g;
  Ref args(PyTuple_New((Py_ssize_t)(lists.size() + after.size()) + 3));
  PyTuple_SET_ITEM(args.p, 0, checked(PyUnicode_FromString(what)));
  PyTuple_SET_ITEM(args.p, 1, checked(PyLong_FromLongLong((long long)handle)));
  Py_ssize_t i = 2;
  for (auto l : lists) PyTuple_SET_ITEM(args.p, i++, tensor_list(l));
  PyTuple_SET_ITEM(args.p, i++, checked(PyUnicode_FromStringAndSize(names.data(), (Py_ssize_t)names.size())));
  for (auto l : after) PyTuple_SET_ITEM(args.p, i++, tensor_list(l));
  Ref r(PyObject_Call(cfg.general, args.p, nullptr));
  return r.p == Py_None ? std::vector<at::Tensor>() : tensors_of(r.p);
}

std::vector<at::Tensor> apply_kernel(c10::SymInt handle, at::TensorList inputs, c10::string_view names) {
  int64_t h = handle.expect_int();
  auto core = core_of(h);
  at::Tensor t[kMaxTensors];
  std::shared_ptr<BindingData> b;
  if (!serve_op(core, place(*core, inputs, names, t), t, b)) return python_path("apply", h, {inputs}, names);
  std::vector<at::Tensor> got;
  for (int j = 0; j < core->n_out; ++j)
    if (b->mode[j] != ABSENT) got.push_back(std::move(t[core->n_in + j]));
  return got;
}

void apply_out_kernel(c10::SymInt handle, at::TensorList inputs, c10::string_view names, at::TensorList outs) {
  int64_t h = handle.expect_int();
  auto core = core_of(h);
  at::Tensor t[kMaxTensors];
  std::shared_ptr<BindingData> b;
  bool placed = place(*core, inputs, names, t);
  size_t k = 0;  // one tensor per output whose like input is given, in the manifest's order
  for (int j = 0; placed && j < core->n_out; ++j)
    if (t[core->like[j]].defined()) {
      if (k == outs.size()) placed = false;
      else t[core->n_in + j] = outs[k++];
    }
  // then the inputs the op writes in place, which `inputs` leaves out (tileops/runtime/library.py)
  for (size_t w = 0; placed && w < core->written.size(); ++w) {
    if (k == outs.size() || t[core->written[w]].defined()) placed = false;
    else t[core->written[w]] = outs[k++];
  }
  if (!serve_op(core, placed && k == outs.size(), t, b)) python_path("apply_out", h, {inputs}, names, {outs});
}

std::vector<at::Tensor> apply_backward_kernel(c10::SymInt handle, at::TensorList grads, at::TensorList inputs,
                                              c10::string_view names) {
  return python_path("apply_backward", handle.expect_int(), {grads, inputs}, names);
}

// the CPU or CUDA kernel of the custom op `name`, called below autograd (its schema found once)
template <auto& kernel, typename... Args>
auto below_autograd(const char* name, Args&&... args) {
  using Fn = std::remove_reference_t<decltype(kernel)>;
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
  at::AutoDispatchBelowADInplaceOrView below;
  return op.call(std::forward<Args>(args)...);
}

// autograd: a call that needs none goes below autograd in C++; one that does, to Python's
// autograd.Function around the op (tileops/runtime/library.py)
std::vector<at::Tensor> apply_autograd(c10::SymInt handle, at::TensorList inputs, c10::string_view names) {
  if (any_requires_grad({inputs})) return python_path("apply_grad", handle.expect_int(), {inputs}, names);
  return below_autograd<apply_kernel>("tileops::apply", std::move(handle), inputs, names);
}

void apply_out_autograd(c10::SymInt handle, at::TensorList inputs, c10::string_view names, at::TensorList outs) {
  TORCH_CHECK(!any_requires_grad({inputs, outs}), "tileops::apply_out: outputs given while an input requires grad "
              "(autograd does not follow writes into given tensors)");
  below_autograd<apply_out_kernel>("tileops::apply_out", std::move(handle), inputs, names, outs);
  for (const auto& o : outs) o.unsafeGetTensorImpl()->bump_version();  // as an in-place aten op does
}

std::vector<at::Tensor> apply_backward_autograd(c10::SymInt handle, at::TensorList grads, at::TensorList inputs,
                                                c10::string_view names) {
  if (any_requires_grad({grads, inputs}))  // create_graph=True: results that raise only when differentiated
    return python_path("apply_backward_grad", handle.expect_int(), {grads, inputs}, names);
  return below_autograd<apply_backward_kernel>("tileops::apply_backward", std::move(handle), grads, inputs, names);
}

// ------------------------------------------------------------------------------ module
PyObject* configure(PyObject*, PyObject* args, PyObject* kw) {
  static const char* kwlist[] = {"rc_record_failed", "rc_capturing", "env_strict", "when_now", "when_earlier",
                                 "when_graph", "raise_bad", "disjoint", "late", "general", nullptr};
  if (configured.load()) {  // before parsing: parsing writes into cfg
    PyErr_SetString(PyExc_RuntimeError, "tileops: the native runtime is configured once");
    return nullptr;
  }
  int strict;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "iipUUUOOOO", (char**)kwlist, &cfg.rc_record_failed,
                                   &cfg.rc_capturing, &strict, &cfg.when_now, &cfg.when_earlier, &cfg.when_graph,
                                   &cfg.raise_bad, &cfg.disjoint, &cfg.late, &cfg.general))
    return nullptr;
  cfg.env_strict = strict != 0;
  Py_INCREF(args);  // the objects cfg borrows from the arguments: held for the process's life
  Py_XINCREF(kw);
  configured.store(true);
  Py_RETURN_NONE;
}

// set_driver(record, capturing, query, synchronize, exchange, make_event, pinned=True): returns the
// ones it replaces (all 0 and None: none)
PyObject* set_driver(PyObject*, PyObject* args) {
  unsigned long long rec, cap, q, sync, ex;
  PyObject* make_event;
  int pinned = 1;
  if (!PyArg_ParseTuple(args, "KKKKKO|p", &rec, &cap, &q, &sync, &ex, &make_event, &pinned)) return nullptr;
  bool none = !rec && !cap && !q && !sync && !ex;
  if (!none && (!rec || !cap || !q || !sync || !ex || make_event == Py_None)) {
    PyErr_SetString(PyExc_ValueError, "tileops: set_driver: a null address");
    return nullptr;
  }
  const Driver* old = driver.load();
  PyObject* was = old != nullptr ? Py_NewRef(old->given)
                                 : Py_BuildValue("(KKKKKO)", 0ull, 0ull, 0ull, 0ull, 0ull, Py_None);
  if (was == nullptr) return nullptr;
  driver.store(none ? nullptr  // the old one stays: a launch may still read it
                    : new Driver{(void*)(uintptr_t)rec, (void*)(uintptr_t)cap, (cu_event_t)(uintptr_t)q,
                                 (cu_event_t)(uintptr_t)sync, (cu_exchange_t)(uintptr_t)ex, make_event, pinned != 0,
                                 Py_NewRef(args)});
  return was;
}

PyObject* set_strict(PyObject*, PyObject* v) {  // returns the previous value (-1: unset)
  long s = PyLong_AsLong(v);
  if (s == -1 && PyErr_Occurred()) return nullptr;
  long before = tl_strict;
  tl_strict = s < 0 ? -1 : s > 0;
  return PyLong_FromLong(before);
}

PyObject* strict_now(PyObject*, PyObject*) { return PyBool_FromLong(is_strict()); }

PyObject* is_plain(PyObject*, PyObject* o) {  // whether a binding could serve this tensor (for tests)
  if (!THPVariable_CheckExact(o)) Py_RETURN_FALSE;
  Key k;
  return PyBool_FromLong(encode(k, THPVariable_Unpack(o)));
}

PyMethodDef module_methods[] = {
    {"configure", (PyCFunction)(void (*)(void))configure, METH_VARARGS | METH_KEYWORDS,
     "The constants and callbacks of tileops.runtime (once, by tileops/runtime/library.py)."},
    {"set_driver", (PyCFunction)set_driver, METH_VARARGS,
     "set_driver(cuEventRecord, cuStreamIsCapturing, cuEventQuery, cuEventSynchronize, "
     "cuThreadExchangeStreamCaptureMode, make_event, pinned=True): the driver's addresses."},
    {"set_strict", (PyCFunction)set_strict, METH_O, "This thread's strict mode (1, 0, -1 unset); returns the old."},
    {"is_strict", (PyCFunction)strict_now, METH_NOARGS, "Whether this thread's calls are judged at the call."},
    {"is_plain", (PyCFunction)is_plain, METH_O, "Whether a binding could serve this tensor (a plain tensor)."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_tileops_native",
                          "tileops' native runtime (see tileops/runtime/native.py).", -1, module_methods,
                          nullptr, nullptr, nullptr, nullptr};

}  // namespace

TORCH_LIBRARY(tileops, m) {
  m.def("apply(SymInt handle, Tensor[] inputs, str names) -> Tensor[]");
  m.def("apply_out(SymInt handle, Tensor[] inputs, str names, Tensor(a3!)[] outs) -> ()");
  m.def("apply_backward(SymInt handle, Tensor[] grads, Tensor[] inputs, str names) -> Tensor[]");
}

static void backend_kernels(torch::Library& m) {  // the same for CPU and CUDA tensors
  m.impl("apply", TORCH_FN(apply_kernel));
  m.impl("apply_out", TORCH_FN(apply_out_kernel));
  m.impl("apply_backward", TORCH_FN(apply_backward_kernel));
}

TORCH_LIBRARY_IMPL(tileops, CPU, m) { backend_kernels(m); }
TORCH_LIBRARY_IMPL(tileops, CUDA, m) { backend_kernels(m); }

TORCH_LIBRARY_IMPL(tileops, Autograd, m) {
  m.impl("apply", TORCH_FN(apply_autograd));
  m.impl("apply_out", TORCH_FN(apply_out_autograd));
  m.impl("apply_backward", TORCH_FN(apply_backward_autograd));
}

PyMODINIT_FUNC PyInit__tileops_native(void) {
  PyObject* m = PyModule_Create(&module_def);
  PyObject* dispatch = m != nullptr ? PyType_FromSpec(&Dispatch_spec) : nullptr;
  if (dispatch == nullptr || PyModule_AddObject(m, "Dispatch", dispatch) < 0) {
    Py_XDECREF(dispatch);
    Py_XDECREF(m);
    return nullptr;
  }
  return m;
}
