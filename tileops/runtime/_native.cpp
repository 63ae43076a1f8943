// tileops' native fast path for repeated eager calls (built and loaded by tileops/native.py).
//
// What it holds, each mirroring a Python object that stays the reference implementation for
// machines without a compiler (tileops/errors.py, tileops/op.py, tileops/rope/builtin.py):
//
//   Pool      a device's error words (errors.ErrorWords): int32 words in pinned host memory that
//             kernels write, a CUDA event per word, a free list;
//   Tracker   one op's calls that read positions and are not judged yet (errors.Tracker): per
//             (thread, pool, stream) lists judged in order without blocking, strict mode, the
//             words of graph-captured calls kept for op.check();
//   Plan      one call signature's launch (RopeKernels.plan's closure): per call only what the
//             pointers decide (alignment, overlap of given outputs), then one trampoline call;
//   Dispatch  one op's plans keyed by what Op._signature reads (each tensor's shape, strides,
//             dtype, device, and which outputs are given or in place), plus the tensor's dispatch
//             key set, so a tensor subclass, a functorch wrapper or a fake tensor never matches.
//
// Anything a plan cannot serve returns NotImplemented before it has touched anything, and the
// Python path takes the call (it checks, copies or raises as it must). Every Python object here
// is used with the GIL held; the GIL is released only around the kernel launch itself. CUDA is
// reached only through driver function addresses handed over from Python, so no CUDA header is
// needed; the current device is read and set through c10's device guard interface.

#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>
#include <ATen/ops/empty_like_ops.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

// ------------------------------------------------------------------------------ configuration
typedef int32_t (*packed_t)(void*, const int64_t*, void*, void*, void*, void*);
typedef int (*cu_event_t)(void*);
typedef int (*cu_exchange_t)(int*);

constexpr int kNotReady = 600;  // CUDA_ERROR_NOT_READY
constexpr int kMaxDims = 8;
constexpr size_t kMaxKey = 256;
constexpr size_t kMaxArgs = 128;
constexpr size_t kMaxPlans = 4096;  // as Op._fast: many distinct shapes clear the table

struct Config {
  int32_t rc_record_failed = 0, rc_capturing = 0;
  PyObject* when_earlier = nullptr;  // the `when` strings of errors.Tracker
  PyObject* when_graph = nullptr;
  PyObject* when_now = nullptr;
  PyObject* strict_local = nullptr;  // errors._strict
  PyObject* errors_module = nullptr;  // errors._ENV_STRICT is read from it
  PyObject* py_tracker = nullptr;  // errors.Tracker, for calls on a pool made before this module
  void* record = nullptr;  // cuEventRecord
  void* capturing = nullptr;  // cuStreamIsCapturing
  cu_event_t query = nullptr, synchronize = nullptr;
  cu_exchange_t exchange = nullptr;
} cfg;

PyObject *s_on, *s_env_strict, *s_state, *s_has_pending, *s_reap, *s_check, *s_launch, *s_fail, *s_wait;
std::atomic<uint64_t> tags{0};
std::atomic<uint64_t> tracker_ids{0};

int32_t next_tag() { return (int32_t)((tags.fetch_add(1) + 1) % 0x7FFFFFFF + 1); }

bool is_strict() {
  PyObject* on = PyObject_GetAttr(cfg.strict_local, s_on);
  if (on == nullptr) {
    PyErr_Clear();
    on = Py_NewRef(Py_None);
  }
  PyObject* v = on;
  if (on == Py_None) {
    Py_DECREF(on);
    v = PyObject_GetAttr(cfg.errors_module, s_env_strict);
    if (v == nullptr) {
      PyErr_Clear();
      return false;
    }
  }
  int r = PyObject_IsTrue(v);
  Py_DECREF(v);
  if (r < 0) {
    PyErr_Clear();
    return false;
  }
  return r == 1;
}

int event_query(void* ev) {  // with this thread's capture mode relaxed, as errors._QUERY_SOURCE
  int mode = 2;  // CU_STREAM_CAPTURE_MODE_RELAXED
  cfg.exchange(&mode);
  int rc = cfg.query(ev);
  cfg.exchange(&mode);
  return rc;
}

PyObject* as_long(int64_t v) { return PyLong_FromLongLong((long long)v); }

bool get_i64(PyObject* o, int64_t* out) {
  long long v = PyLong_AsLongLong(o);
  if (v == -1 && PyErr_Occurred()) return false;
  *out = (int64_t)v;
  return true;
}

// tp_dealloc of a GC type: untrack, drop references (clear), destroy the C++ members, free
template <class T, int (*clear)(T*)>
void gc_dealloc(PyObject* self) {
  PyTypeObject* tp = Py_TYPE(self);
  PyObject_GC_UnTrack(self);
  clear((T*)self);
  ((T*)self)->~T();
  tp->tp_free(self);
  Py_DECREF(tp);
}

template <class T>
T* alloc_object(PyTypeObject* type) {
  PyObject* self = type->tp_alloc(type, 0);
  if (self == nullptr) return nullptr;
  PyObject head = *self;  // constructing the C++ members must leave the header tp_alloc set
  T* t = new (self) T();
  *(PyObject*)t = head;
  return t;
}

// ------------------------------------------------------------------------------ Pool
struct Pool {
  PyObject_HEAD
  bool cuda = false;
  int index = -1;
  int chunk = 0;
  std::vector<int64_t> bases;
  std::vector<int64_t> events;
  std::vector<int32_t> free_list;
  PyObject* grow = nullptr;  // () -> (owner, base address)
  PyObject* make_event = nullptr;  // () -> (owner, raw event)
  PyObject* owners = nullptr;  // list: the buffers and events the addresses belong to
  PyObject* device = nullptr;
};
PyTypeObject* PoolType = nullptr;

int pool_grow(Pool* p) {
  PyObject* r = PyObject_CallNoArgs(p->grow);
  if (r == nullptr) return -1;
  int64_t base;
  if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 2 || !get_i64(PyTuple_GET_ITEM(r, 1), &base)) {
    Py_DECREF(r);
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "tileops: Pool.grow must return (owner, address)");
    return -1;
  }
  if (PyList_Append(p->owners, PyTuple_GET_ITEM(r, 0)) < 0) {
    Py_DECREF(r);
    return -1;
  }
  Py_DECREF(r);
  int first = (int)p->bases.size() * p->chunk;
  p->bases.push_back(base);
  p->events.resize(p->events.size() + p->chunk, 0);
  for (int i = first + p->chunk - 1; i >= first; --i) p->free_list.push_back(i);
  return 0;
}

int pool_take(Pool* p) {
  while (p->free_list.empty()) {
    if (pool_grow(p) < 0) return -1;
  }
  int i = p->free_list.back();
  p->free_list.pop_back();
  return i;
}

inline void pool_give_back(Pool* p, int i) { p->free_list.push_back(i); }
inline int64_t pool_address(Pool* p, int i) { return p->bases[i / p->chunk] + 4 * (int64_t)(i % p->chunk); }
inline int32_t pool_read(Pool* p, int i) { return *(volatile int32_t*)(intptr_t)pool_address(p, i); }
inline void pool_clear(Pool* p, int i) { *(volatile int32_t*)(intptr_t)pool_address(p, i) = 0; }

int64_t pool_event(Pool* p, int i) {  // 0 with an exception set on failure
  if (p->events[i] == 0) {
    PyObject* r = PyObject_CallNoArgs(p->make_event);
    if (r == nullptr) return 0;
    int64_t ev;
    if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 2 || !get_i64(PyTuple_GET_ITEM(r, 1), &ev) ||
        PyList_Append(p->owners, PyTuple_GET_ITEM(r, 0)) < 0) {
      Py_DECREF(r);
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "tileops: Pool.make_event must return (owner, handle)");
      return 0;
    }
    Py_DECREF(r);
    p->events[i] = ev;
  }
  return p->events[i];
}

bool pool_index(Pool* p, PyObject* arg, int* out) {
  long i = PyLong_AsLong(arg);
  if (i == -1 && PyErr_Occurred()) return false;
  if (i < 0 || (size_t)i >= p->events.size()) {
    PyErr_Format(PyExc_IndexError, "tileops: error word %ld out of range", i);
    return false;
  }
  *out = (int)i;
  return true;
}

PyObject* Pool_new(PyTypeObject* type, PyObject* args, PyObject* kw) {
  static const char* names[] = {"device", "cuda", "index", "chunk", "grow", "make_event", nullptr};
  PyObject *device, *grow, *make_event;
  int cuda, index, chunk;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OpiiOO", (char**)names, &device, &cuda, &index, &chunk, &grow,
                                   &make_event))
    return nullptr;
  if (chunk <= 0) {
    PyErr_SetString(PyExc_ValueError, "tileops: chunk must be positive");
    return nullptr;
  }
  Pool* p = alloc_object<Pool>(type);
  if (p == nullptr) return nullptr;
  p->cuda = cuda;
  p->index = index;
  p->chunk = chunk;
  p->device = Py_NewRef(device);
  p->grow = Py_NewRef(grow);
  p->make_event = Py_NewRef(make_event);
  p->owners = PyList_New(0);
  if (p->owners == nullptr || pool_grow(p) < 0) {
    Py_DECREF(p);
    return nullptr;
  }
  return (PyObject*)p;
}

void Pool_dealloc(Pool* p) {
  PyTypeObject* tp = Py_TYPE(p);
  Py_XDECREF(p->device);
  Py_XDECREF(p->grow);
  Py_XDECREF(p->make_event);
  Py_XDECREF(p->owners);
  p->~Pool();
  tp->tp_free((PyObject*)p);
  Py_DECREF(tp);
}

PyObject* Pool_take(Pool* p, PyObject*) {
  int i = pool_take(p);
  return i < 0 ? nullptr : PyLong_FromLong(i);
}
PyObject* Pool_give_back(Pool* p, PyObject* arg) {
  int i;
  if (!pool_index(p, arg, &i)) return nullptr;
  pool_give_back(p, i);
  Py_RETURN_NONE;
}
PyObject* Pool_address(Pool* p, PyObject* arg) {
  int i;
  return pool_index(p, arg, &i) ? as_long(pool_address(p, i)) : nullptr;
}
PyObject* Pool_read(Pool* p, PyObject* arg) {
  int i;
  return pool_index(p, arg, &i) ? PyLong_FromLong(pool_read(p, i)) : nullptr;
}
PyObject* Pool_clear(Pool* p, PyObject* arg) {
  int i;
  if (!pool_index(p, arg, &i)) return nullptr;
  pool_clear(p, i);
  Py_RETURN_NONE;
}
PyObject* Pool_event(Pool* p, PyObject* arg) {
  int i;
  if (!pool_index(p, arg, &i)) return nullptr;
  int64_t ev = pool_event(p, i);
  return ev == 0 ? nullptr : as_long(ev);
}
PyObject* Pool_get_cuda(Pool* p, void*) { return PyBool_FromLong(p->cuda); }
PyObject* Pool_get_index(Pool* p, void*) { return PyLong_FromLong(p->index); }
PyObject* Pool_get_device(Pool* p, void*) { return Py_NewRef(p->device); }
PyObject* Pool_get_free(Pool* p, void*) { return PyLong_FromSsize_t((Py_ssize_t)p->free_list.size()); }
PyObject* Pool_get_size(Pool* p, void*) { return PyLong_FromSsize_t((Py_ssize_t)p->events.size()); }

PyMethodDef Pool_methods[] = {
    {"take", (PyCFunction)Pool_take, METH_NOARGS, "A free word."},
    {"give_back", (PyCFunction)Pool_give_back, METH_O, "Return a judged word."},
    {"address", (PyCFunction)Pool_address, METH_O, "The word's address, as the kernel writes it."},
    {"read", (PyCFunction)Pool_read, METH_O, "The word's value."},
    {"clear", (PyCFunction)Pool_clear, METH_O, "Set the word to 0."},
    {"event", (PyCFunction)Pool_event, METH_O, "The word's CUDA event (made at its first use)."},
    {nullptr, nullptr, 0, nullptr}};
PyGetSetDef Pool_getset[] = {
    {"cuda", (getter)Pool_get_cuda, nullptr, nullptr, nullptr},
    {"index", (getter)Pool_get_index, nullptr, nullptr, nullptr},
    {"device", (getter)Pool_get_device, nullptr, nullptr, nullptr},
    {"free", (getter)Pool_get_free, nullptr, "words not in use", nullptr},
    {"size", (getter)Pool_get_size, nullptr, "words in all", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};
PyType_Slot Pool_slots[] = {{Py_tp_new, (void*)Pool_new},
                            {Py_tp_dealloc, (void*)Pool_dealloc},
                            {Py_tp_methods, Pool_methods},
                            {Py_tp_getset, Pool_getset},
                            {Py_tp_doc, (void*)"A device's pool of error words (see tileops.runtime.errors.ErrorWords)."},
                            {0, nullptr}};
PyType_Spec Pool_spec = {"tileops._tileops_native.Pool", sizeof(Pool), 0, Py_TPFLAGS_DEFAULT, Pool_slots};

// ------------------------------------------------------------------------------ Tracker
struct Pending {
  Pool* pool;  // strong
  int word;
  int32_t tag;
  PyObject* pos;  // strong
  int64_t event;
};

struct StreamCalls {
  Pool* pool;  // borrowed (a Pending holds a reference)
  int64_t stream;
  std::vector<Pending> calls;
  size_t head = 0;  // calls before it are judged
};

// one thread's pending calls of one tracker: kept in the tracker's threading.local, so they go
// with the thread (or the tracker) as errors.Tracker's do
struct ThreadState {
  PyObject_HEAD
  std::vector<StreamCalls> streams;  // in the order they were first used, like the Python dict
  bool legacy_clear = false;  // this thread has nothing left in the tracker's legacy (Python) one
};
PyTypeObject* ThreadStateType = nullptr;

void release_pending(Pending& c) {
  Py_XDECREF(c.pos);
  Py_XDECREF((PyObject*)c.pool);
  c.pos = nullptr;
  c.pool = nullptr;
}

void ThreadState_dealloc(ThreadState* t) {
  // the thread (or the tracker) is gone: its unjudged words are never given back (a stream may
  // still write them), as when errors.Tracker's thread-local dict goes
  PyTypeObject* tp = Py_TYPE(t);
  for (auto& s : t->streams)
    for (size_t i = s.head; i < s.calls.size(); ++i) release_pending(s.calls[i]);
  t->~ThreadState();
  tp->tp_free((PyObject*)t);
  Py_DECREF(tp);
}
PyType_Slot ThreadState_slots[] = {{Py_tp_dealloc, (void*)ThreadState_dealloc}, {0, nullptr}};
PyType_Spec ThreadState_spec = {"tileops._tileops_native.ThreadState", sizeof(ThreadState), 0, Py_TPFLAGS_DEFAULT,
                                ThreadState_slots};

struct GraphWord {
  Pool* pool;  // strong
  int word;
  int32_t tag;
  PyObject* pos;  // strong
};

struct Tracker {
  PyObject_HEAD
  uint64_t id = 0;
  PyObject* raise_bad = nullptr;  // (position_ids, when) -> raises
  PyObject* local = nullptr;  // a threading.local whose class has state = None
  PyObject* legacy = nullptr;  // an errors.Tracker holding calls made before this one existed, or None
  std::vector<GraphWord> graph;
};
PyTypeObject* TrackerType = nullptr;

thread_local uint64_t tl_tracker = 0;  // a one-entry cache of this thread's state of one tracker
thread_local ThreadState* tl_state = nullptr;  // borrowed: the tracker's threading.local owns it

// this thread's state (borrowed), or nullptr (no exception) when it has none and !create
ThreadState* thread_state(Tracker* tr, bool create) {
  if (tr->id != 0 && tl_tracker == tr->id) return tl_state;
  if (tr->local == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "tileops: a cleared tracker was used");
    return nullptr;
  }
  PyObject* st = PyObject_GetAttr(tr->local, s_state);
  if (st == nullptr) return nullptr;
  if (st == Py_None) {
    Py_DECREF(st);
    if (!create) return nullptr;
    ThreadState* t = alloc_object<ThreadState>(ThreadStateType);
    if (t == nullptr) return nullptr;
    int rc = PyObject_SetAttr(tr->local, s_state, (PyObject*)t);
    Py_DECREF(t);  // the local holds it
    if (rc < 0) return nullptr;
    st = Py_NewRef((PyObject*)t);
  }
  Py_DECREF(st);  // still held by the local
  tl_tracker = tr->id;
  tl_state = (ThreadState*)st;
  return tl_state;
}

PyObject* raise_bad(Tracker* tr, PyObject* pos, PyObject* when) {
  if (tr->raise_bad == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "tileops: a cleared tracker was used");
    return nullptr;
  }
  PyObject* r = PyObject_CallFunctionObjArgs(tr->raise_bad, pos, when, nullptr);
  if (r == nullptr) return nullptr;
  Py_DECREF(r);
  Py_RETURN_NONE;
}

PyObject* legacy_tracker(Tracker* tr) {  // borrowed; made on first need
  if (tr->legacy == Py_None) {
    PyObject* t = PyObject_CallOneArg(cfg.py_tracker, tr->raise_bad);
    if (t == nullptr) return nullptr;
    Py_SETREF(tr->legacy, t);
  }
  return tr->legacy;
}

// judge this thread's finished calls (all with `wait`); 0, or -1 with the exception set
int tracker_reap(Tracker* tr, bool wait) {
  ThreadState* ts = thread_state(tr, false);
  if (ts == nullptr && PyErr_Occurred()) return -1;
  if (tr->legacy != nullptr && tr->legacy != Py_None && !(ts != nullptr && ts->legacy_clear)) {
    PyObject* has = PyObject_CallMethodNoArgs(tr->legacy, s_has_pending);
    if (has == nullptr) return -1;
    int h = PyObject_IsTrue(has);
    Py_DECREF(has);
    if (h < 0) return -1;
    if (h) {
      PyObject* r = PyObject_CallMethodObjArgs(tr->legacy, s_reap, wait ? Py_True : Py_False, nullptr);
      if (r == nullptr) return -1;
      Py_DECREF(r);
    } else {
      if (ts == nullptr && (ts = thread_state(tr, true)) == nullptr) return -1;
      ts->legacy_clear = true;
    }
  }
  if (ts == nullptr || ts->streams.empty()) return 0;
  PyObject* failed = nullptr;
  int err = 0;
  for (size_t s = 0; s < ts->streams.size();) {
    StreamCalls& sc = ts->streams[s];
    while (sc.head < sc.calls.size()) {  // in order: stop at the first unfinished
      Pending& c = sc.calls[sc.head];
      int rc = wait ? cfg.synchronize((void*)(intptr_t)c.event) : event_query((void*)(intptr_t)c.event);
      if (!wait && rc == kNotReady) break;
      if (rc != 0) {
        PyErr_Format(PyExc_RuntimeError, "tileops: %s failed with CUDA error %d",
                     wait ? "cuEventSynchronize" : "cuEventQuery", rc);
        err = -1;
        break;
      }
      bool bad = pool_read(c.pool, c.word) == c.tag;
      pool_give_back(c.pool, c.word);  // only after reading it
      if (bad) failed = Py_NewRef(c.pos);
      release_pending(c);
      ++sc.head;
      if (bad) break;  // one error per bad call: later calls stay pending, for the next report
    }
    if (sc.head == sc.calls.size()) {
      ts->streams.erase(ts->streams.begin() + s);
    } else {
      if (sc.head) {
        sc.calls.erase(sc.calls.begin(), sc.calls.begin() + sc.head);
        sc.head = 0;
      }
      ++s;
    }
    if (err || failed != nullptr) break;
  }
  if (err) {
    Py_XDECREF(failed);
    return -1;
  }
  if (failed != nullptr) {
    PyObject* r = raise_bad(tr, failed, cfg.when_earlier);
    Py_DECREF(failed);
    if (r == nullptr) return -1;
    Py_DECREF(r);
  }
  return 0;
}

// whether this thread has calls to judge (its own, or in the legacy tracker); never raises: when
// it cannot tell, it says yes and the reap that follows reports what went wrong
bool tracker_has_pending(Tracker* tr) {
  ThreadState* ts = thread_state(tr, false);
  if (ts == nullptr && PyErr_Occurred()) {
    PyErr_Clear();
    return true;
  }
  if (ts != nullptr && !ts->streams.empty()) return true;
  if (tr->legacy == nullptr || tr->legacy == Py_None || (ts != nullptr && ts->legacy_clear)) return false;
  PyObject* has = PyObject_CallMethodNoArgs(tr->legacy, s_has_pending);
  int h = has != nullptr ? PyObject_IsTrue(has) : -1;
  Py_XDECREF(has);
  if (h != 0) {
    PyErr_Clear();
    return true;
  }
  if (ts == nullptr && (ts = thread_state(tr, true)) == nullptr) {
    PyErr_Clear();
    return false;
  }
  ts->legacy_clear = true;  // until a call of this thread goes to the legacy tracker again
  return false;
}

// How a tracked call's kernel is launched: returns 0 (ran), 1 (ran while the stream was being
// captured: no event recorded) or -1 (an exception is set; the kernel did not run, or failed).
struct Launcher {
  virtual int run(int64_t stream, void* record, void* event, void* capturing) = 0;
  virtual ~Launcher() = default;
};

// After the launch of a call that took `word` and `tag` from `pool`: judged now (CPU, strict
// mode), with a graph, or later (errors.Tracker.launch)
PyObject* tracked_launch(Tracker* tr, Pool* pool, int word, int32_t tag, PyObject* pos, int64_t stream,
                         Launcher& launch) {
  if (!pool->cuda) {  // the kernel runs synchronously: judge the call now
    int r = launch.run(0, nullptr, nullptr, nullptr);
    bool bad = r >= 0 && pool_read(pool, word) == tag;
    pool_give_back(pool, word);  // only after reading it: another call may take it at once
    if (r < 0) return nullptr;
    if (bad) return raise_bad(tr, pos, cfg.when_now);
    Py_RETURN_NONE;
  }
  int64_t event = pool_event(pool, word);
  if (event == 0) {
    pool_give_back(pool, word);
    return nullptr;
  }
  int r = launch.run(stream, cfg.record, (void*)(intptr_t)event, cfg.capturing);
  if (r < 0) {
    pool_give_back(pool, word);
    return nullptr;
  }
  if (r == 1) {  // replays write the word: op.check() reads and clears it
    Py_INCREF(pool);
    Py_INCREF(pos);
    tr->graph.push_back({pool, word, tag, pos});
    Py_RETURN_NONE;
  }
  if (is_strict()) {
    int rc = cfg.synchronize((void*)(intptr_t)event);
    if (rc != 0) return PyErr_Format(PyExc_RuntimeError, "tileops: cuEventSynchronize failed with CUDA error %d", rc);
    bool bad = pool_read(pool, word) == tag;
    pool_give_back(pool, word);
    if (bad) return raise_bad(tr, pos, cfg.when_now);
    Py_RETURN_NONE;
  }
  ThreadState* ts = thread_state(tr, true);
  if (ts == nullptr) return nullptr;  // the word stays taken: the stream may write it
  StreamCalls* sc = nullptr;
  for (auto& s : ts->streams)
    if (s.pool == pool && s.stream == stream) {
      sc = &s;
      break;
    }
  if (sc == nullptr) {
    ts->streams.push_back(StreamCalls{pool, stream, {}, 0});
    sc = &ts->streams.back();
  }
  Py_INCREF(pool);
  Py_INCREF(pos);
  sc->calls.push_back({pool, word, tag, pos, event});
  Py_RETURN_NONE;
}

// Tracker.launch(kernel, args, err_slot, tag_slot, position_ids, pool, stream): the Python
// path's launch (errors.Tracker.launch's signature): kernel.launch(args, ...) does the launch
struct PyLauncher : Launcher {
  PyObject* kernel;
  PyObject* args;
  int run(int64_t stream, void* record, void* event, void* capturing) override {
    PyObject* r;
    if (event == nullptr) {
      PyObject* zero = PyLong_FromLong(0);
      r = zero ? PyObject_CallMethodObjArgs(kernel, s_launch, args, zero, nullptr) : nullptr;
      Py_XDECREF(zero);
    } else {
      PyObject* st = as_long(stream);
      PyObject* rec = PyLong_FromVoidPtr(record);
      PyObject* ev = PyLong_FromVoidPtr(event);
      PyObject* cap = PyLong_FromVoidPtr(capturing);
      r = (st && rec && ev && cap) ? PyObject_CallMethodObjArgs(kernel, s_launch, args, st, rec, ev, cap, nullptr)
                                   : nullptr;
      Py_XDECREF(st);
      Py_XDECREF(rec);
      Py_XDECREF(ev);
      Py_XDECREF(cap);
    }
    if (r == nullptr) return -1;
    int captured = PyObject_IsTrue(r);
    Py_DECREF(r);
    return captured < 0 ? -1 : captured;
  }
};

PyObject* Tracker_launch(Tracker* tr, PyObject* const* a, Py_ssize_t n) {
  if (n != 7) {
    PyErr_SetString(PyExc_TypeError,
                    "Tracker.launch(kernel, args, err_slot, tag_slot, position_ids, pool, stream)");
    return nullptr;
  }
  if (!PyObject_TypeCheck(a[5], PoolType)) {  // a pool of the Python implementation: its calls
    PyObject* leg = legacy_tracker(tr);  // are followed by a Python tracker this one judges first
    if (leg == nullptr) return nullptr;
    ThreadState* ts = thread_state(tr, true);
    if (ts == nullptr) return nullptr;
    ts->legacy_clear = false;
    PyObject* m = PyObject_GetAttr(leg, s_launch);
    if (m == nullptr) return nullptr;
    PyObject* r = PyObject_Vectorcall(m, a, (size_t)n, nullptr);
    Py_DECREF(m);
    return r;
  }
  Pool* pool = (Pool*)a[5];
  int64_t stream;
  if (!get_i64(a[6], &stream)) return nullptr;
  int word = pool_take(pool);
  if (word < 0) return nullptr;
  int32_t tag = next_tag();
  PyObject* addr = as_long(pool_address(pool, word));
  PyObject* tg = PyLong_FromLong(tag);
  if (addr == nullptr || tg == nullptr || PyObject_SetItem(a[1], a[2], addr) < 0 ||
      PyObject_SetItem(a[1], a[3], tg) < 0) {
    Py_XDECREF(addr);
    Py_XDECREF(tg);
    pool_give_back(pool, word);
    return nullptr;
  }
  Py_DECREF(addr);
  Py_DECREF(tg);
  PyLauncher launch;
  launch.kernel = a[0];
  launch.args = a[1];
  return tracked_launch(tr, pool, word, tag, a[4], stream, launch);
}

PyObject* Tracker_reap(Tracker* tr, PyObject* const* a, Py_ssize_t n) {
  int wait = 0;
  if (n > 1) {
    PyErr_SetString(PyExc_TypeError, "Tracker.reap(wait=False)");
    return nullptr;
  }
  if (n == 1 && (wait = PyObject_IsTrue(a[0])) < 0) return nullptr;
  if (tracker_reap(tr, wait) < 0) return nullptr;
  Py_RETURN_NONE;
}

PyObject* Tracker_has_pending(Tracker* tr, PyObject*) { return PyBool_FromLong(tracker_has_pending(tr)); }

PyObject* Tracker_check(Tracker* tr, PyObject*) {
  if (tr->legacy != Py_None) {
    PyObject* r = PyObject_CallMethodNoArgs(tr->legacy, s_check);
    if (r == nullptr) return nullptr;
    Py_DECREF(r);
  }
  if (tracker_reap(tr, true) < 0) return nullptr;
  PyObject* bad = nullptr;
  for (auto& g : tr->graph) {  // no Python runs in this loop: the list cannot change under it
    if (bad == nullptr && pool_read(g.pool, g.word) == g.tag) bad = Py_NewRef(g.pos);
    pool_clear(g.pool, g.word);
  }
  if (bad == nullptr) Py_RETURN_NONE;
  PyObject* r = raise_bad(tr, bad, cfg.when_graph);
  Py_DECREF(bad);
  return r;
}

PyObject* Tracker_get_legacy(Tracker* tr, void*) { return Py_NewRef(tr->legacy); }
int Tracker_set_legacy(Tracker* tr, PyObject* v, void*) {
  if (v == nullptr) v = Py_None;
  Py_INCREF(v);
  Py_SETREF(tr->legacy, v);
  return 0;
}
PyObject* Tracker_get_graph_words(Tracker* tr, void*) { return PyLong_FromSsize_t((Py_ssize_t)tr->graph.size()); }

PyObject* Tracker_new(PyTypeObject* type, PyObject* args, PyObject* kw) {
  static const char* names[] = {"raise_bad", "local", nullptr};
  PyObject *rb, *local;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OO", (char**)names, &rb, &local)) return nullptr;
  Tracker* tr = alloc_object<Tracker>(type);
  if (tr == nullptr) return nullptr;
  tr->id = tracker_ids.fetch_add(1) + 1;
  tr->raise_bad = Py_NewRef(rb);
  tr->local = Py_NewRef(local);
  tr->legacy = Py_NewRef(Py_None);
  return (PyObject*)tr;
}

int Tracker_traverse(Tracker* tr, visitproc visit, void* arg) {
  Py_VISIT(Py_TYPE(tr));
  Py_VISIT(tr->raise_bad);
  Py_VISIT(tr->local);
  Py_VISIT(tr->legacy);
  for (auto& g : tr->graph) Py_VISIT(g.pos);
  return 0;
}

int Tracker_clear(Tracker* tr) {
  tr->id = 0;  // no thread's cached state is found for it any more
  Py_CLEAR(tr->raise_bad);
  Py_CLEAR(tr->local);
  Py_CLEAR(tr->legacy);
  for (auto& g : tr->graph) {
    Py_CLEAR(g.pos);
    Py_CLEAR(g.pool);
  }
  tr->graph.clear();
  return 0;
}

PyMethodDef Tracker_methods[] = {
    {"launch", (PyCFunction)(void (*)(void))Tracker_launch, METH_FASTCALL,
     "launch(kernel, args, err_slot, tag_slot, position_ids, pool, stream): as errors.Tracker.launch."},
    {"reap", (PyCFunction)(void (*)(void))Tracker_reap, METH_FASTCALL, "reap(wait=False): as errors.Tracker.reap."},
    {"has_pending", (PyCFunction)Tracker_has_pending, METH_NOARGS, "Whether this thread has calls to judge."},
    {"check", (PyCFunction)Tracker_check, METH_NOARGS, "As errors.Tracker.check."},
    {nullptr, nullptr, 0, nullptr}};
PyGetSetDef Tracker_getset[] = {
    {"legacy", (getter)Tracker_get_legacy, (setter)Tracker_set_legacy,
     "an errors.Tracker whose calls are judged before this one's", nullptr},
    {"graph_words", (getter)Tracker_get_graph_words, nullptr, "words kept for graph replays", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};
PyType_Slot Tracker_slots[] = {{Py_tp_new, (void*)Tracker_new},
                               {Py_tp_dealloc, (void*)gc_dealloc<Tracker, Tracker_clear>},
                               {Py_tp_traverse, (void*)Tracker_traverse},
                               {Py_tp_clear, (void*)Tracker_clear},
                               {Py_tp_methods, Tracker_methods},
                               {Py_tp_getset, Tracker_getset},
                               {Py_tp_doc, (void*)"One op's calls whose positions are not judged yet (see "
                                                  "tileops.runtime.errors.Tracker)."},
                               {0, nullptr}};
PyType_Spec Tracker_spec = {"tileops._tileops_native.Tracker", sizeof(Tracker), 0,
                            Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, Tracker_slots};

// ------------------------------------------------------------------------------ Plan
// roles of the tensors a plan reads: x, position_ids, key (inputs), out, key_out (outputs)
enum Role { X = 0, P = 1, K = 2, Y = 3, KY = 4, NROLES = 5 };

struct OverlapPair {
  int r0;
  int64_t s0;  // bytes from the first element to past the last
  int r1;
  int64_t s1;
};

struct Disjoint {
  int pair;
  int64_t offset;
  bool ok;
};

struct Plan {
  PyObject_HEAD
  std::vector<int64_t> tmpl;
  int at[NROLES];  // where each role's tensor is: index into the inputs (X, P, K) or outputs (Y, KY), or -1
  int iX, iY, iK, iKY, iP, iTD, iERR, itag;  // kernel argument slots, -1 when absent
  bool x_in_place = false, k_in_place = false;
  uint64_t align = 1;
  std::vector<OverlapPair> pairs;
  std::vector<Disjoint> disjoint;  // the exact test's answers by offset (one storage only)
  PyObject* disjoint_fn = nullptr;  // tileops.op._disjoint
  PyObject* tables_for = nullptr;  // (x, position_ids) -> tables, or None (fixed in the template)
  PyObject* kernel = nullptr;  // the RawKernel: kernel._fail(rc) raises for a failed launch
  packed_t packed = nullptr;
  void* entry = nullptr;
  int device_index = -1;  // CUDA device, or -1 on the CPU
  PyObject* raw_stream = nullptr;  // torch._C._cuda_getCurrentRawStream (CUDA)
  PyObject* device_arg = nullptr;  // its argument
  Tracker* tracker = nullptr;  // with positions
  Pool* pool = nullptr;
};
PyTypeObject* PlanType = nullptr;

int dict_int(PyObject* d, const char* name, int64_t* out) {
  PyObject* v = PyDict_GetItemString(d, name);
  if (v == nullptr) {
    PyErr_Format(PyExc_KeyError, "tileops: Plan: missing %s", name);
    return -1;
  }
  return get_i64(v, out) ? 0 : -1;
}

int dict_slot(PyObject* d, const char* name, int* out) {
  int64_t v;
  if (dict_int(d, name, &v) < 0) return -1;
  *out = (int)v;
  return 0;
}

PyObject* dict_obj(PyObject* d, const char* name) {  // new reference
  PyObject* v = PyDict_GetItemString(d, name);
  if (v == nullptr) {
    PyErr_Format(PyExc_KeyError, "tileops: Plan: missing %s", name);
    return nullptr;
  }
  return Py_NewRef(v);
}

PyObject* Plan_new(PyTypeObject* type, PyObject* args, PyObject* kw) {
  PyObject* d;
  if (!PyArg_ParseTuple(args, "O!", &PyDict_Type, &d)) return nullptr;
  Plan* p = alloc_object<Plan>(type);
  if (p == nullptr) return nullptr;
  auto fail = [&]() -> PyObject* {
    Py_DECREF(p);
    return nullptr;
  };
  PyObject* tmpl = PyDict_GetItemString(d, "template");
  Py_buffer view;
  if (tmpl == nullptr || PyObject_GetBuffer(tmpl, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_KeyError, "tileops: Plan: missing template");
    return fail();
  }
  bool ok = view.itemsize == 8 && view.format != nullptr && (std::strcmp(view.format, "q") == 0 ||
                                                             std::strcmp(view.format, "l") == 0);
  if (ok) {
    const int64_t* v = (const int64_t*)view.buf;
    p->tmpl.assign(v, v + view.len / 8);
  }
  PyBuffer_Release(&view);
  if (!ok || p->tmpl.size() > kMaxArgs) {
    PyErr_SetString(PyExc_TypeError, "tileops: Plan: template must be an int64 array of at most 128 items");
    return fail();
  }
  const char* at_names[NROLES] = {"at_x", "at_position_ids", "at_key", "at_out", "at_key_out"};
  for (int r = 0; r < NROLES; ++r)
    if (dict_slot(d, at_names[r], &p->at[r]) < 0) return fail();
  if (dict_slot(d, "X", &p->iX) < 0 || dict_slot(d, "Y", &p->iY) < 0 || dict_slot(d, "K", &p->iK) < 0 ||
      dict_slot(d, "KY", &p->iKY) < 0 || dict_slot(d, "P", &p->iP) < 0 || dict_slot(d, "TD", &p->iTD) < 0 ||
      dict_slot(d, "ERR", &p->iERR) < 0 || dict_slot(d, "tag", &p->itag) < 0 ||
      dict_slot(d, "device_index", &p->device_index) < 0)
    return fail();
  int slots[] = {p->iX, p->iY, p->iK, p->iKY, p->iP, p->iTD, p->iERR, p->itag};
  for (int s : slots)
    if (s < -1 || s >= (int)p->tmpl.size()) {
      PyErr_SetString(PyExc_ValueError, "tileops: Plan: a slot outside the template");
      return fail();
    }
  int64_t v;
  if (dict_int(d, "x_in_place", &v) < 0) return fail();
  p->x_in_place = v != 0;
  if (dict_int(d, "k_in_place", &v) < 0) return fail();
  p->k_in_place = v != 0;
  if (dict_int(d, "align", &v) < 0) return fail();
  p->align = v > 1 ? (uint64_t)v : 1;
  int64_t packed, entry;
  if (dict_int(d, "packed", &packed) < 0 || dict_int(d, "entry", &entry) < 0) return fail();
  if (packed == 0 || entry == 0) {
    PyErr_SetString(PyExc_ValueError, "tileops: Plan: no packed launcher");
    return fail();
  }
  p->packed = (packed_t)(intptr_t)packed;
  p->entry = (void*)(intptr_t)entry;
  PyObject* pairs = PyDict_GetItemString(d, "pairs");
  if (pairs == nullptr || !PyList_Check(pairs)) {
    PyErr_SetString(PyExc_TypeError, "tileops: Plan: pairs must be a list");
    return fail();
  }
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(pairs); ++i) {
    OverlapPair op;
    long long s0, s1;
    if (!PyArg_ParseTuple(PyList_GET_ITEM(pairs, i), "iLiL", &op.r0, &s0, &op.r1, &s1)) return fail();
    if (op.r0 < 0 || op.r0 >= NROLES || op.r1 < 0 || op.r1 >= NROLES) {
      PyErr_SetString(PyExc_ValueError, "tileops: Plan: a pair names an unknown role");
      return fail();
    }
    op.s0 = s0;
    op.s1 = s1;
    p->pairs.push_back(op);
  }
  if ((p->disjoint_fn = dict_obj(d, "disjoint")) == nullptr || (p->tables_for = dict_obj(d, "tables_for")) == nullptr ||
      (p->kernel = dict_obj(d, "kernel")) == nullptr || (p->raw_stream = dict_obj(d, "raw_stream")) == nullptr)
    return fail();
  PyObject* tr = PyDict_GetItemString(d, "tracker");
  PyObject* pool = PyDict_GetItemString(d, "pool");
  if (tr == nullptr || pool == nullptr) {
    PyErr_SetString(PyExc_KeyError, "tileops: Plan: missing tracker or pool");
    return fail();
  }
  if (p->at[P] >= 0) {
    if (!PyObject_TypeCheck(tr, TrackerType) || !PyObject_TypeCheck(pool, PoolType) || p->iP < 0 || p->iERR < 0 ||
        p->itag < 0) {
      PyErr_SetString(PyExc_TypeError, "tileops: Plan: positions need a native Tracker and Pool and their slots");
      return fail();
    }
    p->tracker = (Tracker*)Py_NewRef(tr);
    p->pool = (Pool*)Py_NewRef(pool);
  }
  if (p->iX < 0 || p->iY < 0 || (p->at[K] >= 0 && (p->iK < 0 || p->iKY < 0)) ||
      (p->tables_for != Py_None && p->iTD < 0)) {
    PyErr_SetString(PyExc_ValueError, "tileops: Plan: a tensor without its slot");
    return fail();
  }
  p->device_arg = PyLong_FromLong(p->device_index);
  if (p->device_arg == nullptr) return fail();
  if (p->device_index >= 0 && p->raw_stream == Py_None) {
    PyErr_SetString(PyExc_ValueError, "tileops: Plan: a CUDA plan needs raw_stream");
    return fail();
  }
  return (PyObject*)p;
}

int Plan_traverse(Plan* p, visitproc visit, void* arg) {
  Py_VISIT(Py_TYPE(p));
  Py_VISIT(p->disjoint_fn);
  Py_VISIT(p->tables_for);
  Py_VISIT(p->kernel);
  Py_VISIT(p->raw_stream);
  Py_VISIT((PyObject*)p->tracker);
  Py_VISIT((PyObject*)p->pool);
  return 0;
}

int Plan_clear(Plan* p) {
  Py_CLEAR(p->disjoint_fn);
  Py_CLEAR(p->tables_for);
  Py_CLEAR(p->kernel);
  Py_CLEAR(p->raw_stream);
  Py_CLEAR(p->device_arg);
  Py_CLEAR(p->tracker);
  Py_CLEAR(p->pool);
  return 0;
}

PyType_Slot Plan_slots[] = {{Py_tp_new, (void*)Plan_new},
                            {Py_tp_dealloc, (void*)gc_dealloc<Plan, Plan_clear>},
                            {Py_tp_traverse, (void*)Plan_traverse},
                            {Py_tp_clear, (void*)Plan_clear},
                            {Py_tp_doc, (void*)"One call signature's launch (see RopeKernels.native_plan)."},
                            {0, nullptr}};
PyType_Spec Plan_spec = {"tileops._tileops_native.Plan", sizeof(Plan), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
                         Plan_slots};

// the launch of a plan's call: the trampoline, on the plan's device, without the GIL
struct PlanLauncher : Launcher {
  Plan* p;
  const int64_t* args;
  int run(int64_t stream, void* record, void* event, void* capturing) override {
    int32_t rc = 0;
    bool failed_guard = false;
    Py_BEGIN_ALLOW_THREADS;
    try {
      if (p->device_index >= 0) {  // the C entry point launches on the current device
        const c10::impl::DeviceGuardImplInterface* g = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
        c10::Device cur = g->getDevice();
        if (cur.index() != p->device_index) {
          g->setDevice(c10::Device(c10::DeviceType::CUDA, (c10::DeviceIndex)p->device_index));
          rc = p->packed(p->entry, args, (void*)(intptr_t)stream, record, event, capturing);
          g->uncheckedSetDevice(cur);
        } else {
          rc = p->packed(p->entry, args, (void*)(intptr_t)stream, record, event, capturing);
        }
      } else {
        rc = p->packed(p->entry, args, (void*)(intptr_t)stream, record, event, capturing);
      }
    } catch (...) {
      failed_guard = true;
    }
    Py_END_ALLOW_THREADS;
    if (failed_guard) {
      PyErr_SetString(PyExc_RuntimeError, "tileops: setting the CUDA device for a launch failed");
      return -1;
    }
    if (rc == 0) return 0;
    if (rc == cfg.rc_capturing) return 1;
    PyObject* code = PyLong_FromLong(rc);  // kernel._fail(rc) raises the Python path's error
    PyObject* r = code ? PyObject_CallMethodOneArg(p->kernel, s_fail, code) : nullptr;
    Py_XDECREF(code);
    Py_XDECREF(r);
    if (!PyErr_Occurred()) PyErr_Format(PyExc_RuntimeError, "tileops: launch failed (%d)", rc);
    return -1;
  }
};

inline int64_t ptr_of(const at::Tensor& t) { return (int64_t)(intptr_t)t.data_ptr(); }

// run plan p on the call's tensors: in = x, position_ids, key as the Dispatch orders them; out =
// out, key_out. Returns a new reference, NotImplemented (nothing was done), or nullptr (raised)
PyObject* plan_run(Plan* p, PyObject* const* in, PyObject* const* out) {
  int64_t args[kMaxArgs];
  std::memcpy(args, p->tmpl.data(), p->tmpl.size() * sizeof(int64_t));
  PyObject* obj[NROLES] = {in[p->at[X]], p->at[P] >= 0 ? in[p->at[P]] : Py_None,
                           p->at[K] >= 0 ? in[p->at[K]] : Py_None, out[p->at[Y]],
                           p->at[K] >= 0 ? out[p->at[KY]] : Py_None};
  int64_t ptr[NROLES] = {0, 0, 0, 0, 0};
  at::Tensor y_new, ky_new, tables;
  try {
    // an input and its output (in place, given, or new like torch.empty_like): their pointers,
    // and whether both are aligned as the kernel needs
    auto pair = [&](int src, int dst, bool in_place, at::Tensor& fresh) {
      const at::Tensor& t = THPVariable_Unpack(obj[src]);
      ptr[src] = ptr_of(t);
      if (in_place) {
        ptr[dst] = ptr[src];
      } else if (obj[dst] != Py_None) {
        ptr[dst] = ptr_of(THPVariable_Unpack(obj[dst]));
      } else {
        fresh = at::_ops::empty_like::call(t, std::nullopt, std::nullopt, std::nullopt, std::nullopt, std::nullopt);
        ptr[dst] = ptr_of(fresh);
      }
      return p->align <= 1 || ((uint64_t)(ptr[src] | ptr[dst]) % p->align) == 0;
    };
    if (!pair(X, Y, p->x_in_place, y_new)) Py_RETURN_NOTIMPLEMENTED;
    args[p->iX] = ptr[X];
    args[p->iY] = ptr[Y];
    if (obj[K] != Py_None) {
      if (!pair(K, KY, p->k_in_place, ky_new)) Py_RETURN_NOTIMPLEMENTED;
      args[p->iK] = ptr[K];
      args[p->iKY] = ptr[KY];
    }
    if (obj[P] != Py_None) ptr[P] = ptr_of(THPVariable_Unpack(obj[P]));
    for (size_t i = 0; i < p->pairs.size(); ++i) {  // given outputs against the others, by bytes
      const OverlapPair& pr = p->pairs[i];
      int64_t a0 = ptr[pr.r0], a1 = ptr[pr.r1];
      if (a0 + pr.s0 <= a1 || a1 + pr.s1 <= a0) continue;
      // the ranges meet: the exact test (tileops.op._disjoint), remembered by offset when the
      // two share one storage (what it then decides depends on the offset alone)
      const at::Tensor& t0 = THPVariable_Unpack(obj[pr.r0]);
      const at::Tensor& t1 = THPVariable_Unpack(obj[pr.r1]);
      bool shared = t0.storage().data() == t1.storage().data();
      int known = -1;
      if (shared)
        for (const Disjoint& dj : p->disjoint)
          if (dj.pair == (int)i && dj.offset == a1 - a0) {
            known = dj.ok;
            break;
          }
      if (known < 0) {
        PyObject* r = PyObject_CallFunctionObjArgs(p->disjoint_fn, obj[pr.r0], obj[pr.r1], nullptr);
        if (r == nullptr) {
          PyErr_Clear();
          Py_RETURN_NOTIMPLEMENTED;
        }
        known = PyObject_IsTrue(r);
        Py_DECREF(r);
        if (known < 0) {
          PyErr_Clear();
          Py_RETURN_NOTIMPLEMENTED;
        }
        if (shared && p->disjoint.size() < 64) p->disjoint.push_back({(int)i, a1 - a0, known == 1});
      }
      if (!known) Py_RETURN_NOTIMPLEMENTED;  // the Python path names the overlap
    }
  } catch (const std::exception&) {
    Py_RETURN_NOTIMPLEMENTED;  // e.g. a tensor without storage: the Python path says what it is
  }
  // from here on the call is served: what fails raises
  if (p->tables_for != Py_None) {  // picked on the device; kept alive until launched
    PyObject* td = PyObject_CallFunctionObjArgs(p->tables_for, obj[X], obj[P], nullptr);
    if (td == nullptr) return nullptr;
    if (!THPVariable_Check(td)) {
      Py_DECREF(td);
      PyErr_SetString(PyExc_TypeError, "tileops: tables_for must return a tensor");
      return nullptr;
    }
    tables = THPVariable_Unpack(td);
    Py_DECREF(td);
    args[p->iTD] = ptr_of(tables);
  }
  int64_t stream = 0;
  if (p->device_index >= 0) {
    PyObject* s = PyObject_CallOneArg(p->raw_stream, p->device_arg);
    if (s == nullptr) return nullptr;
    bool ok = get_i64(s, &stream);
    Py_DECREF(s);
    if (!ok) return nullptr;
  }
  PlanLauncher launch;
  launch.p = p;
  launch.args = args;
  if (obj[P] != Py_None) {
    args[p->iP] = ptr[P];
    int word = pool_take(p->pool);
    if (word < 0) return nullptr;
    int32_t tag = next_tag();
    args[p->iERR] = pool_address(p->pool, word);
    args[p->itag] = tag;
    PyObject* r = tracked_launch(p->tracker, p->pool, word, tag, obj[P], stream, launch);
    if (r == nullptr) return nullptr;
    Py_DECREF(r);
  } else if (launch.run(stream, nullptr, nullptr, nullptr) < 0) {
    return nullptr;
  }
  auto result = [&](at::Tensor& fresh, bool in_place, int src, int dst) {
    return fresh.defined() ? THPVariable_Wrap(std::move(fresh)) : Py_NewRef(in_place ? obj[src] : obj[dst]);
  };
  PyObject* y = result(y_new, p->x_in_place, X, Y);
  if (obj[K] == Py_None || y == nullptr) return y;
  PyObject* ky = result(ky_new, p->k_in_place, K, KY);
  if (ky == nullptr) {
    Py_DECREF(y);
    return nullptr;
  }
  PyObject* t = PyTuple_Pack(2, y, ky);
  Py_DECREF(y);
  Py_DECREF(ky);
  return t;
}

// ------------------------------------------------------------------------------ Dispatch
constexpr int kMaxIn = 4, kMaxOut = 2;

struct Entry {
  std::vector<int64_t> key;
  PyObject* plan;  // strong; None: this signature has no native plan (the Python path serves it)
};

struct Dispatch {
  PyObject_HEAD
  int n_in = 0, n_out = 0;
  PyObject* in_names[kMaxIn] = {};
  PyObject* out_names[kMaxOut] = {};
  int like[kMaxOut] = {};  // each output's input, by index into the inputs
  std::unordered_map<uint64_t, std::vector<Entry>> table;
  size_t count = 0;
  uint64_t hits = 0, misses = 0;
  PyObject* tracker = nullptr;  // the op's tracker once it has one (Op._calls sets it)
};
PyTypeObject* DispatchType = nullptr;

const c10::DispatchKeySet kPlainKeys({c10::DispatchKey::CPU, c10::DispatchKey::CUDA, c10::DispatchKey::ADInplaceOrView,
                                      c10::DispatchKey::AutogradCPU, c10::DispatchKey::AutogradCUDA,
                                      c10::DispatchKey::AutocastCPU, c10::DispatchKey::AutocastCUDA});

// A call's key: for each input and output what Op._signature reads, and the dispatch key set.
// Returns 1 (the key is in `k`), 0 (not a call a plan can serve: a tensor subclass, more than
// kMaxDims dims, dispatch keys beyond a plain CPU/CUDA tensor's, an unknown name, ...).
struct Key {
  int64_t v[kMaxKey];
  size_t n = 0;
  bool push(int64_t x) {
    if (n == kMaxKey) return false;
    v[n++] = x;
    return true;
  }
};

bool encode_tensor(Key& k, PyObject* o) {
  if (!THPVariable_CheckExact(o)) return false;
  const at::Tensor& t = THPVariable_Unpack(o);
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  c10::DispatchKeySet ks = impl->key_set();
  if ((ks - kPlainKeys).highestFunctionalityKey() != c10::DispatchKey::Undefined) return false;
  if (impl->layout() != c10::kStrided) return false;
  int64_t dim = impl->dim();
  if (dim > kMaxDims || k.n + 5 + 2 * dim > kMaxKey) return false;
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

// gather the call's tensors by name and encode them; false: a plan cannot serve this call
bool gather(Dispatch* d, PyObject* tensors, PyObject* outs, PyObject** in, PyObject** out, Key& k) {
  if (!PyDict_CheckExact(tensors) || PyDict_GET_SIZE(tensors) != d->n_in) return false;
  for (int i = 0; i < d->n_in; ++i) {
    in[i] = PyDict_GetItemWithError(tensors, d->in_names[i]);  // borrowed
    if (in[i] == nullptr) return false;
  }
  Py_ssize_t found = 0;
  bool has_outs = outs != Py_None && outs != nullptr;
  if (has_outs && !PyDict_CheckExact(outs)) return false;
  for (int i = 0; i < d->n_out; ++i) {
    out[i] = has_outs ? PyDict_GetItemWithError(outs, d->out_names[i]) : nullptr;
    if (out[i] == nullptr) {
      if (PyErr_Occurred()) return false;
      out[i] = Py_None;  // not passed: not given
    } else {
      ++found;
    }
  }
  if (has_outs && found != PyDict_GET_SIZE(outs)) return false;  // a name the op does not have
  try {
    for (int i = 0; i < d->n_in; ++i) {
      if (in[i] == Py_None) {
        if (!k.push(0)) return false;
      } else if (!encode_tensor(k, in[i])) {
        return false;
      }
    }
    for (int i = 0; i < d->n_out; ++i) {
      if (out[i] == Py_None) {
        if (!k.push(0)) return false;
      } else if (out[i] == in[d->like[i]]) {
        if (!k.push(2)) return false;  // in place
      } else if (!encode_tensor(k, out[i])) {
        return false;
      }
    }
  } catch (const std::exception&) {
    return false;
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

Entry* find(Dispatch* d, const Key& k, uint64_t h) {
  auto it = d->table.find(h);
  if (it == d->table.end()) return nullptr;
  for (Entry& e : it->second)
    if (e.key.size() == k.n && std::memcmp(e.key.data(), k.v, k.n * sizeof(int64_t)) == 0) return &e;
  return nullptr;
}

// what Op._eager_call does before a call runs: the op's finished calls judged (its tracker is
// native, or, if the op was given a Python one, called through Python)
int reap_op(PyObject* tracker) {
  if (PyObject_TypeCheck(tracker, TrackerType)) {
    Tracker* tr = (Tracker*)tracker;
    return tracker_has_pending(tr) ? tracker_reap(tr, false) : 0;
  }
  PyObject* has = PyObject_CallMethodNoArgs(tracker, s_has_pending);
  if (has == nullptr) return -1;
  int h = PyObject_IsTrue(has);
  Py_DECREF(has);
  if (h <= 0) return h;
  PyObject* r = PyObject_CallMethodNoArgs(tracker, s_reap);
  Py_XDECREF(r);
  return r == nullptr ? -1 : 0;
}

PyObject* dispatch_run(Dispatch* d, PyObject* tensors, PyObject* outs) {
  PyObject *in[kMaxIn], *out[kMaxOut];
  Key k;
  if (!gather(d, tensors, outs, in, out, k)) {
    PyErr_Clear();
    ++d->misses;
    Py_RETURN_NOTIMPLEMENTED;
  }
  Entry* e = find(d, k, hash_key(k));
  if (e == nullptr || e->plan == Py_None) {
    ++d->misses;
    Py_RETURN_NOTIMPLEMENTED;
  }
  if (c10::GradMode::is_enabled()) {  // autograd must see this call: the Python path records it
    for (int i = 0; i < d->n_in; ++i)
      if (in[i] != Py_None && THPVariable_Unpack(in[i]).requires_grad()) {
        ++d->misses;
        Py_RETURN_NOTIMPLEMENTED;
      }
  }
  Plan* p = (Plan*)Py_NewRef(e->plan);  // held: Python code run by the plan may clear the table
  if (d->tracker != nullptr && reap_op(d->tracker) < 0) {
    Py_DECREF(p);  // an earlier call's bad position (of any signature), raised before this call runs
    return nullptr;
  }
  PyObject* r = plan_run(p, in, out);
  Py_DECREF(p);
  if (r == Py_NotImplemented) ++d->misses; else ++d->hits;
  return r;
}

// run(tensors, outs=None): what Op._call calls (a METH_FASTCALL method: no argument tuple)
PyObject* Dispatch_run(Dispatch* d, PyObject* const* a, Py_ssize_t n) {
  if (n < 1 || n > 2) {
    PyErr_SetString(PyExc_TypeError, "run(tensors, outs=None)");
    return nullptr;
  }
  return dispatch_run(d, a[0], n == 2 ? a[1] : Py_None);
}

PyObject* Dispatch_call(Dispatch* d, PyObject* args, PyObject* kw) {
  if (kw != nullptr && PyDict_GET_SIZE(kw)) {
    PyErr_SetString(PyExc_TypeError, "Dispatch(tensors, outs=None) takes no keywords");
    return nullptr;
  }
  return Dispatch_run(d, &PyTuple_GET_ITEM(args, 0), PyTuple_GET_SIZE(args));
}

// lookup(tensors, outs): None when no plan can serve such a call, else whether one is known
PyObject* Dispatch_lookup(Dispatch* d, PyObject* const* a, Py_ssize_t n) {
  if (n != 2) {
    PyErr_SetString(PyExc_TypeError, "lookup(tensors, outs)");
    return nullptr;
  }
  PyObject *in[kMaxIn], *out[kMaxOut];
  Key k;
  if (!gather(d, a[0], a[1], in, out, k)) {
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  return PyBool_FromLong(find(d, k, hash_key(k)) != nullptr);
}

// add(tensors, outs, plan): the plan (or None) for calls shaped like this one; False if no plan
// can serve such calls
PyObject* Dispatch_add(Dispatch* d, PyObject* const* a, Py_ssize_t n) {
  if (n != 3 || (a[2] != Py_None && !PyObject_TypeCheck(a[2], PlanType))) {
    PyErr_SetString(PyExc_TypeError, "add(tensors, outs, plan: Plan | None)");
    return nullptr;
  }
  PyObject *in[kMaxIn], *out[kMaxOut];
  Key k;
  if (!gather(d, a[0], a[1], in, out, k)) {
    PyErr_Clear();
    Py_RETURN_FALSE;
  }
  uint64_t h = hash_key(k);
  Entry* e = find(d, k, h);
  if (e != nullptr) {
    Py_INCREF(a[2]);
    Py_SETREF(e->plan, a[2]);
    Py_RETURN_TRUE;
  }
  if (d->count >= kMaxPlans) {  // many distinct shapes: keep the table bounded
    std::unordered_map<uint64_t, std::vector<Entry>> old;
    old.swap(d->table);
    d->count = 0;
    for (auto& kv : old)
      for (Entry& x : kv.second) Py_DECREF(x.plan);
  }
  d->table[h].push_back(Entry{std::vector<int64_t>(k.v, k.v + k.n), Py_NewRef(a[2])});
  ++d->count;
  Py_RETURN_TRUE;
}

void dispatch_clear_table(Dispatch* d) {
  std::unordered_map<uint64_t, std::vector<Entry>> old;
  old.swap(d->table);  // decrefs below may run Python code that uses this table
  d->count = 0;
  for (auto& kv : old)
    for (Entry& x : kv.second) Py_CLEAR(x.plan);
}

PyObject* Dispatch_clear_m(Dispatch* d, PyObject*) {
  dispatch_clear_table(d);
  Py_RETURN_NONE;
}

PyObject* Dispatch_stats(Dispatch* d, PyObject*) {
  return Py_BuildValue("{s:n,s:K,s:K}", "plans", (Py_ssize_t)d->count, "hits", (unsigned long long)d->hits, "misses",
                       (unsigned long long)d->misses);
}

Py_ssize_t Dispatch_len(Dispatch* d) { return (Py_ssize_t)d->count; }

PyObject* Dispatch_get_tracker(Dispatch* d, void*) { return Py_NewRef(d->tracker ? d->tracker : Py_None); }
int Dispatch_set_tracker(Dispatch* d, PyObject* v, void*) {
  Py_XINCREF(v == Py_None ? nullptr : v);
  Py_XSETREF(d->tracker, v == Py_None ? nullptr : v);
  return 0;
}
PyGetSetDef Dispatch_getset[] = {
    {"tracker", (getter)Dispatch_get_tracker, (setter)Dispatch_set_tracker,
     "the op's tracker: judged before every call it serves, as Op._eager_call does", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyObject* Dispatch_new(PyTypeObject* type, PyObject* args, PyObject* kw) {
  static const char* names[] = {"inputs", "outputs", "likes", nullptr};
  PyObject *ins, *outs_, *likes;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O!O!O!", (char**)names, &PyTuple_Type, &ins, &PyTuple_Type, &outs_,
                                   &PyTuple_Type, &likes))
    return nullptr;
  Py_ssize_t ni = PyTuple_GET_SIZE(ins), no = PyTuple_GET_SIZE(outs_);
  if (ni < 1 || ni > kMaxIn || no > kMaxOut || PyTuple_GET_SIZE(likes) != no) {
    PyErr_SetString(PyExc_ValueError, "tileops: Dispatch: 1-4 inputs, at most 2 outputs, a like per output");
    return nullptr;
  }
  Dispatch* d = alloc_object<Dispatch>(type);
  if (d == nullptr) return nullptr;
  d->n_in = (int)ni;
  d->n_out = (int)no;
  for (Py_ssize_t i = 0; i < ni; ++i) {
    PyObject* s = PyTuple_GET_ITEM(ins, i);
    if (!PyUnicode_Check(s)) {
      Py_DECREF(d);
      PyErr_SetString(PyExc_TypeError, "tileops: Dispatch: input names are str");
      return nullptr;
    }
    d->in_names[i] = Py_NewRef(s);
  }
  for (Py_ssize_t i = 0; i < no; ++i) {
    PyObject* s = PyTuple_GET_ITEM(outs_, i);
    long l = PyLong_AsLong(PyTuple_GET_ITEM(likes, i));
    if (!PyUnicode_Check(s) || l < 0 || l >= ni) {
      Py_DECREF(d);
      PyErr_Clear();
      PyErr_SetString(PyExc_ValueError, "tileops: Dispatch: output names are str, likes index the inputs");
      return nullptr;
    }
    d->out_names[i] = Py_NewRef(s);
    d->like[i] = (int)l;
  }
  return (PyObject*)d;
}

int Dispatch_traverse(Dispatch* d, visitproc visit, void* arg) {
  Py_VISIT(Py_TYPE(d));
  Py_VISIT(d->tracker);
  for (auto& kv : d->table)
    for (Entry& e : kv.second) Py_VISIT(e.plan);
  return 0;
}

int Dispatch_clear(Dispatch* d) {
  dispatch_clear_table(d);
  Py_CLEAR(d->tracker);
  return 0;
}

int Dispatch_release(Dispatch* d) {  // everything, names too: for dealloc only
  Dispatch_clear(d);
  for (auto& s : d->in_names) Py_CLEAR(s);
  for (auto& s : d->out_names) Py_CLEAR(s);
  return 0;
}

PyMethodDef Dispatch_methods[] = {
    {"run", (PyCFunction)(void (*)(void))Dispatch_run, METH_FASTCALL,
     "run(tensors, outs=None): the call's result, or NotImplemented when no plan serves it."},
    {"lookup", (PyCFunction)(void (*)(void))Dispatch_lookup, METH_FASTCALL,
     "lookup(tensors, outs): None when no plan can serve such a call, else whether one is known."},
    {"add", (PyCFunction)(void (*)(void))Dispatch_add, METH_FASTCALL,
     "add(tensors, outs, plan): the plan (or None) for calls shaped like this one."},
    {"clear", (PyCFunction)Dispatch_clear_m, METH_NOARGS, "Forget every plan."},
    {"stats", (PyCFunction)Dispatch_stats, METH_NOARGS, "Plans known, calls served, calls passed on."},
    {nullptr, nullptr, 0, nullptr}};
PyType_Slot Dispatch_slots[] = {{Py_tp_new, (void*)Dispatch_new},
                                {Py_tp_dealloc, (void*)gc_dealloc<Dispatch, Dispatch_release>},
                                {Py_tp_traverse, (void*)Dispatch_traverse},
                                {Py_tp_clear, (void*)Dispatch_clear},
                                {Py_tp_call, (void*)Dispatch_call},
                                {Py_tp_methods, Dispatch_methods},
                                {Py_tp_getset, Dispatch_getset},
                                {Py_mp_length, (void*)Dispatch_len},
                                {Py_tp_doc, (void*)"One op's native plans: dispatch(tensors, outs) runs the call "
                                                   "or returns NotImplemented."},
                                {0, nullptr}};
PyType_Spec Dispatch_spec = {"tileops._tileops_native.Dispatch", sizeof(Dispatch), 0,
                             Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, Dispatch_slots};

// ------------------------------------------------------------------------------ module
PyObject* configure(PyObject*, PyObject* args, PyObject* kw) {
  static const char* names[] = {"rc_record_failed", "rc_capturing", "when_now", "when_earlier", "when_graph",
                                "strict_local", "errors_module", "py_tracker", nullptr};
  int rf, rcap;
  PyObject *now, *earlier, *graph, *sl, *em, *pt;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "iiUUUOOO", (char**)names, &rf, &rcap, &now, &earlier, &graph, &sl, &em,
                                   &pt))
    return nullptr;
  cfg.rc_record_failed = rf;
  cfg.rc_capturing = rcap;
  Py_XSETREF(cfg.when_now, Py_NewRef(now));
  Py_XSETREF(cfg.when_earlier, Py_NewRef(earlier));
  Py_XSETREF(cfg.when_graph, Py_NewRef(graph));
  Py_XSETREF(cfg.strict_local, Py_NewRef(sl));
  Py_XSETREF(cfg.errors_module, Py_NewRef(em));
  Py_XSETREF(cfg.py_tracker, Py_NewRef(pt));
  Py_RETURN_NONE;
}

PyObject* set_driver(PyObject*, PyObject* args) {  // returns the addresses it replaces
  unsigned long long rec, cap, q, sync, ex;
  if (!PyArg_ParseTuple(args, "KKKKK", &rec, &cap, &q, &sync, &ex)) return nullptr;
  bool none = !rec && !cap && !q && !sync && !ex;  // all 0: unset (tests that fake the driver restore so)
  if (!none && (!rec || !cap || !q || !sync || !ex)) {
    PyErr_SetString(PyExc_ValueError, "tileops: set_driver: a null address");
    return nullptr;
  }
  PyObject* old = Py_BuildValue("(KKKKK)", (unsigned long long)(uintptr_t)cfg.record,
                                (unsigned long long)(uintptr_t)cfg.capturing, (unsigned long long)(uintptr_t)cfg.query,
                                (unsigned long long)(uintptr_t)cfg.synchronize,
                                (unsigned long long)(uintptr_t)cfg.exchange);
  cfg.record = (void*)(uintptr_t)rec;
  cfg.capturing = (void*)(uintptr_t)cap;
  cfg.query = (cu_event_t)(uintptr_t)q;
  cfg.synchronize = (cu_event_t)(uintptr_t)sync;
  cfg.exchange = (cu_exchange_t)(uintptr_t)ex;
  return old;
}

PyObject* has_driver(PyObject*, PyObject*) { return PyBool_FromLong(cfg.record != nullptr); }

PyObject* is_plain(PyObject*, PyObject* o) {  // what encode_tensor accepts (for tests)
  Key k;
  try {
    return PyBool_FromLong(encode_tensor(k, o));
  } catch (const std::exception&) {
    Py_RETURN_FALSE;
  }
}

PyMethodDef module_methods[] = {
    {"configure", (PyCFunction)(void (*)(void))configure, METH_VARARGS | METH_KEYWORDS,
     "The constants and objects of tileops.runtime.errors this module mirrors."},
    {"set_driver", (PyCFunction)set_driver, METH_VARARGS,
     "set_driver(cuEventRecord, cuStreamIsCapturing, cuEventQuery, cuEventSynchronize, "
     "cuThreadExchangeStreamCaptureMode): the driver's addresses."},
    {"has_driver", (PyCFunction)has_driver, METH_NOARGS, "Whether set_driver was called."},
    {"is_plain", (PyCFunction)is_plain, METH_O, "Whether a plan could serve this tensor (a plain tensor)."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_tileops_native",
                          "tileops' native fast path (see tileops/native.py).", -1, module_methods};

bool add_type(PyObject* m, PyType_Spec* spec, PyTypeObject** out, const char* name) {
  PyObject* t = PyType_FromSpec(spec);
  if (t == nullptr) return false;
  *out = (PyTypeObject*)t;
  Py_INCREF(t);  // one reference kept here, one owned by the module
  return PyModule_AddObject(m, name, t) == 0;
}

}  // namespace

PyMODINIT_FUNC PyInit__tileops_native(void) {
  struct {
    PyObject** s;
    const char* v;
  } strs[] = {{&s_on, "on"},           {&s_env_strict, "_ENV_STRICT"}, {&s_state, "state"},
              {&s_has_pending, "has_pending"}, {&s_reap, "reap"},      {&s_check, "check"},
              {&s_launch, "launch"},   {&s_fail, "_fail"},              {&s_wait, "wait"}};
  for (auto& s : strs)
    if ((*s.s = PyUnicode_InternFromString(s.v)) == nullptr) return nullptr;
  PyObject* m = PyModule_Create(&module_def);
  if (m == nullptr) return nullptr;
  if (!add_type(m, &Pool_spec, &PoolType, "Pool") || !add_type(m, &ThreadState_spec, &ThreadStateType, "ThreadState") ||
      !add_type(m, &Tracker_spec, &TrackerType, "Tracker") || !add_type(m, &Plan_spec, &PlanType, "Plan") ||
      !add_type(m, &Dispatch_spec, &DispatchType, "Dispatch")) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
