// kvcached.runtime._kvpages: reserve a virtual range of pages, map and unmap pages by
// index, report which are mapped, export the range as a DLPack tensor. Plain
// CPython API; no torch headers.
//
// The object keeps the page bookkeeping and validates every request under its
// own mutex before it calls the backend, with the GIL released, so that a
// background pre-mapping thread and the engine thread can share one range.
// Lock order: the GIL is never requested while the mutex is held, and nothing
// waits for the mutex while holding the GIL (the getters read an atomic or
// drop the GIL first): a thread holding the mutex inside a slow driver call
// must not stall every Python thread.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <unistd.h>

#include "backend.h"
#include "dlpack_abi.h"
#include "mapped_word.h"

namespace {

constexpr Py_ssize_t kDefaultPageSize = 2 * 1024 * 1024;
constexpr int kCpu = -1;  // PageRangeObject::device of a CPU range

PyObject* g_cuda_error = nullptr;         // CudaError(RuntimeError)
PyObject* g_cuda_unavailable = nullptr;   // CudaUnavailableError(CudaError)
PyObject* g_forked_error = nullptr;       // ForkedError(RuntimeError)
PyObject* g_partial_unmap = nullptr;      // PartialUnmapError(RuntimeError)

struct State {
  std::unique_ptr<kvpages::Backend> backend;
  std::mutex mu;                      // guards mapped, closed, backend calls
  std::vector<unsigned char> mapped;
  std::atomic<std::size_t> num_mapped{0};  // read without the mutex
  bool closed = false;                // the backend is torn down
};

struct PageRangeObject {
  PyObject_HEAD
  // Shared so that a thread inside map/unmap (GIL released) keeps the state
  // alive if another thread closes the range meanwhile; null once closed.
  std::shared_ptr<State>* state;
  // Live buffer views and DLPack tensors, changed only with the GIL held.
  // Each holds a reference to this object, so it cannot be deallocated
  // under them, and close() refuses while any is alive.
  Py_ssize_t exports;
  Py_ssize_t num_pages;   // kept after close, for repr and errors
  std::size_t page_size;
  int device;             // -1: CPU; otherwise the CUDA device ordinal
};

PyObject* set_error(const kvpages::Status& st) {
  using Kind = kvpages::Status::Kind;
  switch (st.kind) {
    case Kind::kOs: {
      // OSError(errno, msg) picks the errno subclass (FileNotFoundError, ...).
      PyObject* args = Py_BuildValue("(is)", st.errnum, st.message.c_str());
      if (args != nullptr) {
        PyErr_SetObject(PyExc_OSError, args);
        Py_DECREF(args);
      }
      return nullptr;
    }
    case Kind::kCuda:
    case Kind::kCudaUnavailable: {
      const bool driver = st.kind == Kind::kCuda;
      PyObject* type = driver ? g_cuda_error : g_cuda_unavailable;
      PyObject* exc = PyObject_CallFunction(type, "s", st.message.c_str());
      if (exc == nullptr) return nullptr;
      PyObject* code = driver ? PyLong_FromLong(st.errnum) : Py_NewRef(Py_None);
      PyObject* name = driver ? PyUnicode_FromString(st.cuda_name.c_str())
                              : Py_NewRef(Py_None);
      if (code != nullptr && name != nullptr &&
          PyObject_SetAttrString(exc, "code", code) == 0 &&
          PyObject_SetAttrString(exc, "name", name) == 0) {
        PyErr_SetObject(type, exc);
      }
      Py_XDECREF(code);
      Py_XDECREF(name);
      Py_DECREF(exc);
      return nullptr;
    }
    case Kind::kValue:
      PyErr_SetString(PyExc_ValueError, st.message.c_str());
      return nullptr;
    case Kind::kOk:
      break;
  }
  PyErr_SetString(PyExc_SystemError, "kvpages: error without a status");
  return nullptr;
}

std::shared_ptr<State> live_state(PageRangeObject* self) {
  if (self->state == nullptr) {
    PyErr_SetString(PyExc_ValueError, "operation on a closed PageRange");
    return nullptr;
  }
  return *self->state;
}

// A live state that this process may act on: a CUDA range inherited through
// fork() belongs to the parent's driver context, and any driver call in the
// child would fail or act on the parent's memory.
std::shared_ptr<State> owned_state(PageRangeObject* self) {
  std::shared_ptr<State> st = live_state(self);
  if (st != nullptr && !st->backend->owned_by_this_process()) {
    PyErr_Format(g_forked_error,
                 "this cuda:%d PageRange belongs to the process that created it, "
                 "not to this one (pid %d, a forked child?): its CUDA mappings "
                 "cannot be used, changed or closed here",
                 self->device, static_cast<int>(getpid()));
    return nullptr;
  }
  return st;
}

// Parses "cpu", "cuda" or "cuda:N" into kCpu, kCurrentCudaDevice or N.
bool parse_device(const char* text, int* device) {
  std::string s(text);
  if (s == "cpu") {
    *device = kCpu;
    return true;
  }
  if (s == "cuda") {
    *device = kvpages::kCurrentCudaDevice;
    return true;
  }
  if (s.rfind("cuda:", 0) == 0 && s.size() > 5 && s.size() <= 9 &&
      std::all_of(s.begin() + 5, s.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    *device = std::stoi(s.substr(5));
    return true;
  }
  PyErr_Format(PyExc_ValueError,
               "device must be 'cpu', 'cuda' or 'cuda:N', not '%s'", text);
  return false;
}

// Reads page indices from an int or an iterable of ints, checking range.
bool collect_indices(PyObject* arg, Py_ssize_t num_pages,
                     std::vector<std::size_t>* out) {
  auto one = [&](PyObject* item) -> bool {
    if (!PyLong_Check(item) || PyBool_Check(item)) {
      PyErr_Format(PyExc_TypeError, "page index must be an int, not %.100s",
                   Py_TYPE(item)->tp_name);
      return false;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (v == -1 && PyErr_Occurred()) return false;
    if (overflow != 0 || v < 0 || v >= num_pages) {
      PyErr_Format(PyExc_IndexError,
                   "page index %R out of range for %zd pages", item, num_pages);
      return false;
    }
    out->push_back(static_cast<std::size_t>(v));
    return true;
  };
  if (PyLong_Check(arg) || PyBool_Check(arg)) return one(arg);
  PyObject* it = PyObject_GetIter(arg);
  if (it == nullptr) {
    PyErr_Format(PyExc_TypeError,
                 "pages must be an int or an iterable of ints, not %.100s",
                 Py_TYPE(arg)->tp_name);
    return false;
  }
  PyObject* item;
  while ((item = PyIter_Next(it)) != nullptr) {
    const bool ok = one(item);
    Py_DECREF(item);
    if (!ok) {
      Py_DECREF(it);
      return false;
    }
  }
  Py_DECREF(it);
  return !PyErr_Occurred();
}

PyObject* index_list(const std::vector<std::size_t>& pages) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(pages.size()));
  if (list == nullptr) return nullptr;
  for (std::size_t k = 0; k < pages.size(); ++k) {
    PyObject* v = PyLong_FromSize_t(pages[k]);
    if (v == nullptr) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(k), v);
  }
  return list;
}

// Raises PartialUnmapError carrying what did and did not happen, with the
// first backend failure as its __cause__.
PyObject* set_partial_unmap(const kvpages::Status& first,
                            const std::vector<std::size_t>& unmapped,
                            const std::vector<std::size_t>& failed) {
  set_error(first);
  PyObject *type, *cause, *tb;
  PyErr_Fetch(&type, &cause, &tb);
  PyErr_NormalizeException(&type, &cause, &tb);
  if (tb != nullptr) PyException_SetTraceback(cause, tb);
  Py_XDECREF(type);
  Py_XDECREF(tb);
  PyObject* done = index_list(unmapped);
  PyObject* stuck = index_list(failed);
  PyObject* exc = nullptr;
  if (done != nullptr && stuck != nullptr) {
    PyObject* message = PyUnicode_FromFormat(
        "unmapped %zu of %zu page(s); page(s) %R stay mapped (first failure: %s)",
        unmapped.size(), unmapped.size() + failed.size(), stuck, first.message.c_str());
    if (message != nullptr) exc = PyObject_CallOneArg(g_partial_unmap, message);
    Py_XDECREF(message);
  }
  if (exc != nullptr && PyObject_SetAttrString(exc, "unmapped", done) == 0 &&
      PyObject_SetAttrString(exc, "failed", stuck) == 0) {
    PyException_SetCause(exc, cause);  // steals cause
    cause = nullptr;
    PyErr_SetObject(g_partial_unmap, exc);
  }
  Py_XDECREF(cause);
  Py_XDECREF(done);
  Py_XDECREF(stuck);
  Py_XDECREF(exc);
  return nullptr;
}

// Maps (map=true) or unmaps every index. The whole request is validated
// first (no duplicates, every page in the expected state), so a bad request
// changes nothing. A backend failure part way through a map rolls back the
// pages this call mapped: all or nothing. An unmap is not rolled back: a page
// mapped again would get fresh memory, its contents gone all the same, so it
// goes on with the other pages and reports exactly which were unmapped and
// which stay mapped (PartialUnmapError); the bookkeeping stays true.
PyObject* change_pages(PageRangeObject* self, PyObject* arg, bool map) {
  std::shared_ptr<State> st = owned_state(self);
  if (st == nullptr) return nullptr;
  std::vector<std::size_t> idx;
  if (!collect_indices(arg, self->num_pages, &idx)) return nullptr;

  kvpages::Status status;
  std::size_t bad_index = 0;
  std::vector<std::size_t> unmapped, failed;
  enum { kOk, kClosed, kWrongState, kDuplicate, kBackend } outcome = kOk;
  Py_BEGIN_ALLOW_THREADS
  {
    std::lock_guard<std::mutex> lock(st->mu);
    if (st->closed) outcome = kClosed;  // closed by another thread meanwhile
    for (std::size_t k = 0; outcome == kOk && k < idx.size(); ++k) {
      if ((st->mapped[idx[k]] != 0) == map) {
        outcome = kWrongState;
        bad_index = idx[k];
      }
    }
    if (outcome == kOk && idx.size() > 1) {
      std::vector<std::size_t> sorted(idx);
      std::sort(sorted.begin(), sorted.end());
      auto dup = std::adjacent_find(sorted.begin(), sorted.end());
      if (dup != sorted.end()) {
        outcome = kDuplicate;
        bad_index = *dup;
      }
    }
    if (outcome == kOk && map) {
      std::size_t done = 0;
      for (; done < idx.size(); ++done) {
        status = st->backend->map(idx[done]);
        if (!status.ok()) {
          outcome = kBackend;
          break;
        }
        st->mapped[idx[done]] = 1;
      }
      // Roll back, best effort; the first error is the one reported. A page
      // whose unmap fails stays mapped and is counted as such.
      for (std::size_t k = 0; outcome == kBackend && k < done; ++k) {
        if (st->backend->unmap(idx[k]).ok()) st->mapped[idx[k]] = 0;
      }
    } else if (outcome == kOk) {
      for (std::size_t i : idx) {
        kvpages::Status one = st->backend->unmap(i);
        if (one.ok()) {
          st->mapped[i] = 0;
          unmapped.push_back(i);
        } else {
          failed.push_back(i);
          if (status.ok()) status = one;
        }
      }
      if (!failed.empty()) outcome = kBackend;
    }
    st->num_mapped.store(static_cast<std::size_t>(
        std::count(st->mapped.begin(), st->mapped.end(), 1)));
  }
  Py_END_ALLOW_THREADS

  switch (outcome) {
    case kClosed:
      PyErr_SetString(PyExc_ValueError, "operation on a closed PageRange");
      return nullptr;
    case kWrongState:
      PyErr_Format(PyExc_ValueError, map ? "page %zu is already mapped"
                                         : "page %zu is not mapped",
                   bad_index);
      return nullptr;
    case kDuplicate:
      PyErr_Format(PyExc_ValueError, "page %zu is listed more than once",
                   bad_index);
      return nullptr;
    case kBackend:
      return map ? set_error(status) : set_partial_unmap(status, unmapped, failed);
    case kOk:
      break;
  }
  Py_RETURN_NONE;
}

bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// Tears the backend down (unmapping every page, releasing the range) and
// drops this object's reference to the state. Driver calls can be slow, so
// the GIL is released around them, except while the interpreter finalizes:
// then another thread taking the GIL could be stopped dead holding it. A
// thread still inside map/unmap holds the mutex; teardown waits for it, and
// that thread then finds the range closed.
kvpages::Status close_state(PageRangeObject* self) {
  std::shared_ptr<State>* holder = self->state;
  self->state = nullptr;
  if (holder == nullptr) return kvpages::Status::Ok();
  kvpages::Status status;
  const bool release_gil = !interpreter_finalizing();
  PyThreadState* saved = release_gil ? PyEval_SaveThread() : nullptr;
  {
    State& st = **holder;
    std::lock_guard<std::mutex> lock(st.mu);
    if (!st.closed) {
      status = st.backend->teardown(&st.mapped);
      st.closed = true;
      st.num_mapped.store(0);
    }
  }
  delete holder;
  if (saved != nullptr) PyEval_RestoreThread(saved);
  return status;
}

int PageRange_init(PageRangeObject* self, PyObject* args, PyObject* kwds) {
  static const char* kwlist[] = {"num_pages", "page_size", "device", nullptr};
  Py_ssize_t num_pages = 0;
  Py_ssize_t page_size = kDefaultPageSize;
  const char* device_text = "cpu";
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "n|n$s",
                                   const_cast<char**>(kwlist), &num_pages,
                                   &page_size, &device_text)) {
    return -1;
  }
  if (self->state != nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "PageRange is already initialised");
    return -1;
  }
  if (num_pages <= 0) {
    PyErr_Format(PyExc_ValueError, "num_pages must be positive, not %zd",
                 num_pages);
    return -1;
  }
  if (page_size <= 0) {
    PyErr_Format(PyExc_ValueError, "page_size must be positive, not %zd",
                 page_size);
    return -1;
  }
  int device = kCpu;
  if (!parse_device(device_text, &device)) return -1;

  auto st = std::make_shared<State>();
  kvpages::Status status;
  const std::size_t n = static_cast<std::size_t>(num_pages);
  const std::size_t ps = static_cast<std::size_t>(page_size);
  Py_BEGIN_ALLOW_THREADS
  status = device == kCpu
               ? kvpages::make_cpu_backend(n, ps, &st->backend)
               : kvpages::make_cuda_backend(n, ps, &device, &st->backend);
  Py_END_ALLOW_THREADS
  if (!status.ok()) {
    set_error(status);
    return -1;
  }
  st->mapped.assign(n, 0);
  self->state = new std::shared_ptr<State>(std::move(st));
  self->num_pages = num_pages;
  self->page_size = ps;
  self->device = device;
  return 0;
}

void PageRange_dealloc(PageRangeObject* self) {
  // No export can be live here: every view and DLPack tensor holds a
  // reference to us, so the range outlives the last of them.
  kvpages::Status st = close_state(self);
  if (!st.ok()) {
    // Nothing can raise from here; report it as an unraisable error, naming
    // the type rather than the dying object (a reference to it now would
    // resurrect it).
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    set_error(st);
    PyErr_WriteUnraisable(reinterpret_cast<PyObject*>(Py_TYPE(self)));
    PyErr_Restore(type, value, tb);
  }
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

PyObject* PageRange_map(PageRangeObject* self, PyObject* arg) {
  return change_pages(self, arg, true);
}

PyObject* PageRange_unmap(PageRangeObject* self, PyObject* arg) {
  return change_pages(self, arg, false);
}

// A copy of the mapped flags, taken under the mutex with the GIL released:
// the mutex may be held by a thread inside a slow driver call.
std::vector<unsigned char> mapped_snapshot(State& st) {
  std::vector<unsigned char> out;
  Py_BEGIN_ALLOW_THREADS
  {
    std::lock_guard<std::mutex> lock(st.mu);
    out = st.mapped;
  }
  Py_END_ALLOW_THREADS
  return out;
}

PyObject* PageRange_is_mapped(PageRangeObject* self, PyObject* arg) {
  std::shared_ptr<State> st = live_state(self);
  if (st == nullptr) return nullptr;
  if (!PyLong_Check(arg) || PyBool_Check(arg)) {
    PyErr_Format(PyExc_TypeError, "page index must be an int, not %.100s",
                 Py_TYPE(arg)->tp_name);
    return nullptr;
  }
  std::vector<std::size_t> idx;
  if (!collect_indices(arg, self->num_pages, &idx)) return nullptr;
  return PyBool_FromLong(mapped_snapshot(*st)[idx[0]]);
}

PyObject* PageRange_mapped_pages(PageRangeObject* self, PyObject*) {
  std::shared_ptr<State> st = live_state(self);
  if (st == nullptr) return nullptr;
  const std::vector<unsigned char> mapped = mapped_snapshot(*st);
  std::vector<std::size_t> out;
  for (std::size_t i = 0; i < mapped.size(); ++i) {
    if (mapped[i]) out.push_back(i);
  }
  return index_list(out);
}

PyObject* PageRange_close(PageRangeObject* self, PyObject*) {
  if (self->exports > 0) {
    PyErr_Format(PyExc_BufferError,
                 "cannot close a PageRange while %zd export(s) of it are "
                 "alive (buffer views or DLPack tensors)",
                 self->exports);
    return nullptr;
  }
  if (self->state != nullptr && owned_state(self) == nullptr) return nullptr;
  kvpages::Status st = close_state(self);
  if (!st.ok()) return set_error(st);
  Py_RETURN_NONE;
}

PyObject* PageRange_enter(PageRangeObject* self, PyObject*) {
  if (live_state(self) == nullptr) return nullptr;
  return Py_NewRef(reinterpret_cast<PyObject*>(self));
}

PyObject* PageRange_exit(PageRangeObject* self, PyObject*) {
  return PageRange_close(self, nullptr);
}

std::string device_name(int device) {
  return device == kCpu ? "cpu" : "cuda:" + std::to_string(device);
}

PyObject* PageRange_repr(PageRangeObject* self) {
  const std::string dev = device_name(self->device);
  if (self->state == nullptr) {
    return PyUnicode_FromFormat("<PageRange closed num_pages=%zd device=%s>",
                                self->num_pages, dev.c_str());
  }
  return PyUnicode_FromFormat(
      "<PageRange num_pages=%zd page_size=%zu mapped=%zu device=%s>",
      self->num_pages, self->page_size, (*self->state)->num_mapped.load(),
      dev.c_str());
}

PyObject* get_num_pages(PageRangeObject* self, void*) {
  return PyLong_FromSsize_t(self->num_pages);
}

PyObject* get_page_size(PageRangeObject* self, void*) {
  return PyLong_FromSize_t(self->page_size);
}

PyObject* get_size(PageRangeObject* self, void*) {
  return PyLong_FromSize_t(self->page_size * static_cast<std::size_t>(self->num_pages));
}

PyObject* get_address(PageRangeObject* self, void*) {
  std::shared_ptr<State> st = live_state(self);
  if (st == nullptr) return nullptr;
  return PyLong_FromUnsignedLongLong(st->backend->base());
}

PyObject* get_num_mapped(PageRangeObject* self, void*) {
  std::shared_ptr<State> st = live_state(self);
  if (st == nullptr) return nullptr;
  return PyLong_FromSize_t(st->num_mapped.load());
}

PyObject* get_device(PageRangeObject* self, void*) {
  return PyUnicode_FromString(device_name(self->device).c_str());
}

PyObject* get_closed(PageRangeObject* self, void*) {
  return PyBool_FromLong(self->state == nullptr);
}

int PageRange_getbuffer(PageRangeObject* self, Py_buffer* view, int flags) {
  if (self->state == nullptr) {
    PyErr_SetString(PyExc_BufferError, "PageRange is closed");
    view->obj = nullptr;
    return -1;
  }
  const std::shared_ptr<State>& st = *self->state;
  if (!st->backend->host_accessible()) {
    PyErr_SetString(PyExc_BufferError,
                    "a CUDA PageRange has no host buffer; use its DLPack "
                    "export (torch.from_dlpack, kvcached.runtime.pages.as_tensor)");
    view->obj = nullptr;
    return -1;
  }
  void* buf = reinterpret_cast<void*>(st->backend->base());
  const Py_ssize_t len =
      static_cast<Py_ssize_t>(self->page_size) * self->num_pages;
  if (PyBuffer_FillInfo(view, reinterpret_cast<PyObject*>(self), buf, len,
                        /*readonly=*/0, flags) != 0) {
    return -1;
  }
  ++self->exports;
  return 0;
}

void PageRange_releasebuffer(PageRangeObject* self, Py_buffer*) {
  --self->exports;
}

// --- DLPack export -----------------------------------------------------------
//
// One export is one managed tensor: a 1-D uint8 tensor over the whole range,
// holding a reference to the PageRange and counted in `exports` until its
// deleter runs, so close() is refused and the range stays reserved while a
// consumer (a torch tensor) can still reach it.

struct DlExport {
  kvpages::dl::ManagedTensor legacy;
  kvpages::dl::ManagedTensorVersioned versioned;
  std::int64_t shape[1];
  std::int64_t strides[1];
  PageRangeObject* owner;
};

void release_export(DlExport* e) {
  // Consumers free their tensors on any thread, with or without the GIL.
  // After the interpreter is gone there is nothing left to release into.
  if (!Py_IsInitialized()) return;
  PyGILState_STATE gil = PyGILState_Ensure();
  PageRangeObject* owner = e->owner;
  delete e;
  --owner->exports;
  Py_DECREF(owner);  // may be the last reference: the range is freed here
  PyGILState_Release(gil);
}

void legacy_deleter(kvpages::dl::ManagedTensor* t) {
  release_export(static_cast<DlExport*>(t->manager_ctx));
}

void versioned_deleter(kvpages::dl::ManagedTensorVersioned* t) {
  release_export(static_cast<DlExport*>(t->manager_ctx));
}

// A consumer that takes the tensor renames the capsule ("used_dltensor") and
// calls the deleter itself; a capsule never consumed still owns its tensor.
void dlpack_capsule_destructor(PyObject* capsule) {
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  using kvpages::dl::kCapsuleName;
  using kvpages::dl::kVersionedCapsuleName;
  if (PyCapsule_IsValid(capsule, kCapsuleName)) {
    auto* t = static_cast<kvpages::dl::ManagedTensor*>(
        PyCapsule_GetPointer(capsule, kCapsuleName));
    t->deleter(t);
  } else if (PyCapsule_IsValid(capsule, kVersionedCapsuleName)) {
    auto* t = static_cast<kvpages::dl::ManagedTensorVersioned*>(
        PyCapsule_GetPointer(capsule, kVersionedCapsuleName));
    t->deleter(t);
  }
  PyErr_Restore(type, value, tb);
}

kvpages::dl::Device dlpack_device(const PageRangeObject* self) {
  if (self->device == kCpu) return {kvpages::dl::kDLCPU, 0};
  return {kvpages::dl::kDLCUDA, self->device};
}

PyObject* PageRange_dlpack_device(PageRangeObject* self, PyObject*) {
  const kvpages::dl::Device d = dlpack_device(self);
  return Py_BuildValue("(ii)", d.device_type, d.device_id);
}

// Whether `max_version` (None or (major, minor)) admits a DLPack 1.x tensor.
bool wants_versioned(PyObject* max_version, bool* ok) {
  *ok = true;
  if (max_version == Py_None) return false;
  long major = -1;
  if (PyTuple_Check(max_version) && PyTuple_GET_SIZE(max_version) == 2) {
    major = PyLong_AsLong(PyTuple_GET_ITEM(max_version, 0));
  }
  if (major < 0) {
    PyErr_Clear();
    PyErr_SetString(PyExc_TypeError, "max_version must be None or (major, minor)");
    *ok = false;
    return false;
  }
  return major >= static_cast<long>(kvpages::dl::kMajorVersion);
}

PyObject* PageRange_dlpack(PageRangeObject* self, PyObject* args, PyObject* kwds) {
  static const char* kwlist[] = {"stream", "max_version", "dl_device", "copy", nullptr};
  PyObject* stream = Py_None;
  PyObject* max_version = Py_None;
  PyObject* dl_device = Py_None;
  PyObject* copy = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O$OOO", const_cast<char**>(kwlist),
                                   &stream, &max_version, &dl_device, &copy)) {
    return nullptr;
  }
  if (self->state == nullptr) {
    PyErr_SetString(PyExc_BufferError, "PageRange is closed");
    return nullptr;
  }
  std::shared_ptr<State> st = owned_state(self);
  if (st == nullptr) return nullptr;
  // The range is memory with no work of ours pending on any stream, so every
  // consumer stream is already in order with it: nothing to synchronise.
  if (stream != Py_None && !PyLong_Check(stream)) {
    PyErr_SetString(PyExc_TypeError, "stream must be None or an int");
    return nullptr;
  }
  if (copy == Py_True) {
    PyErr_SetString(PyExc_BufferError,
                    "a PageRange exports its own memory only; it cannot copy");
    return nullptr;
  }
  const kvpages::dl::Device device = dlpack_device(self);
  if (dl_device != Py_None) {
    int type = -1, id = -1;
    if (!PyArg_ParseTuple(dl_device, "ii;dl_device must be (device_type, device_id)",
                          &type, &id)) {
      return nullptr;
    }
    if (type != device.device_type || id != device.device_id) {
      PyErr_Format(PyExc_BufferError,
                   "the range lives on DLPack device (%d, %d), not (%d, %d)",
                   device.device_type, device.device_id, type, id);
      return nullptr;
    }
  }
  bool ok = true;
  const bool versioned = wants_versioned(max_version, &ok);
  if (!ok) return nullptr;

  auto* e = new DlExport{};
  e->shape[0] = static_cast<std::int64_t>(self->page_size) * self->num_pages;
  e->strides[0] = 1;
  e->owner = self;
  kvpages::dl::Tensor tensor{};
  tensor.data = reinterpret_cast<void*>(st->backend->base());
  tensor.device = device;
  tensor.ndim = 1;
  tensor.dtype = {kvpages::dl::kDLUInt, 8, 1};
  tensor.shape = e->shape;
  tensor.strides = e->strides;
  tensor.byte_offset = 0;
  void* managed;
  const char* name;
  if (versioned) {
    e->versioned.version = {kvpages::dl::kMajorVersion, kvpages::dl::kMinorVersion};
    e->versioned.manager_ctx = e;
    e->versioned.deleter = versioned_deleter;
    e->versioned.flags = 0;
    e->versioned.dl_tensor = tensor;
    managed = &e->versioned;
    name = kvpages::dl::kVersionedCapsuleName;
  } else {
    e->legacy.dl_tensor = tensor;
    e->legacy.manager_ctx = e;
    e->legacy.deleter = legacy_deleter;
    managed = &e->legacy;
    name = kvpages::dl::kCapsuleName;
  }
  Py_INCREF(self);
  ++self->exports;
  PyObject* capsule = PyCapsule_New(managed, name, dlpack_capsule_destructor);
  if (capsule == nullptr) release_export(e);
  return capsule;
}

PyMethodDef PageRange_methods[] = {
    {"map", reinterpret_cast<PyCFunction>(PageRange_map), METH_O,
     "map(pages) -> None\n\nMap one page index or an iterable of them (all or "
     "nothing)."},
    {"unmap", reinterpret_cast<PyCFunction>(PageRange_unmap), METH_O,
     "unmap(pages) -> None\n\nUnmap one page index or an iterable of them and "
     "return their memory. A bad request changes nothing; a driver failure "
     "part way raises PartialUnmapError (.unmapped, .failed), the other pages "
     "unmapped all the same."},
    {"is_mapped", reinterpret_cast<PyCFunction>(PageRange_is_mapped), METH_O,
     "is_mapped(index) -> bool"},
    {"mapped_pages", reinterpret_cast<PyCFunction>(PageRange_mapped_pages),
     METH_NOARGS, "mapped_pages() -> list[int]: the mapped page indices, ascending."},
    {"close", reinterpret_cast<PyCFunction>(PageRange_close), METH_NOARGS,
     "close() -> None\n\nUnmap every page and release the range. Idempotent; "
     "refused (BufferError) while buffer views or DLPack tensors are alive. "
     "A page that cannot be unmapped keeps the range reserved (leaked) and "
     "raises."},
    {"__dlpack__", reinterpret_cast<PyCFunction>(PageRange_dlpack),
     METH_VARARGS | METH_KEYWORDS,
     "__dlpack__(stream=None, *, max_version=None, dl_device=None, copy=None)"
     "\n\nA DLPack capsule of a 1-D uint8 tensor over the whole range (kDLCPU, "
     "or kDLCUDA with the device ordinal). Counts as an export until the "
     "consumer frees the tensor."},
    {"__dlpack_device__", reinterpret_cast<PyCFunction>(PageRange_dlpack_device),
     METH_NOARGS, "__dlpack_device__() -> (device_type, device_id)"},
    {"__enter__", reinterpret_cast<PyCFunction>(PageRange_enter), METH_NOARGS,
     nullptr},
    {"__exit__", reinterpret_cast<PyCFunction>(PageRange_exit), METH_VARARGS,
     nullptr},
    {nullptr, nullptr, 0, nullptr},
};

PyGetSetDef PageRange_getset[] = {
    {"num_pages", reinterpret_cast<getter>(get_num_pages), nullptr,
     "Number of pages in the range.", nullptr},
    {"page_size", reinterpret_cast<getter>(get_page_size), nullptr,
     "Bytes per page.", nullptr},
    {"size", reinterpret_cast<getter>(get_size), nullptr,
     "Bytes in the range (num_pages * page_size).", nullptr},
    {"address", reinterpret_cast<getter>(get_address), nullptr,
     "Start of the range (host or CUDA device address).", nullptr},
    {"num_mapped", reinterpret_cast<getter>(get_num_mapped), nullptr,
     "Number of pages mapped now.", nullptr},
    {"device", reinterpret_cast<getter>(get_device), nullptr,
     "'cpu' or 'cuda:N'.", nullptr},
    {"closed", reinterpret_cast<getter>(get_closed), nullptr,
     "Whether close() has run.", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyBufferProcs PageRange_as_buffer = {
    reinterpret_cast<getbufferproc>(PageRange_getbuffer),
    reinterpret_cast<releasebufferproc>(PageRange_releasebuffer),
};

PyTypeObject PageRangeType = {
    PyVarObject_HEAD_INIT(nullptr, 0)
};

PyObject* kvpages_cuda_built(PyObject*, PyObject*) {
  return PyBool_FromLong(kvpages::cuda_built());
}

PyObject* kvpages_cuda_device_count(PyObject*, PyObject*) {
  int count;
  Py_BEGIN_ALLOW_THREADS
  count = kvpages::cuda_device_count(nullptr);
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(count);
}

PyObject* kvpages_cuda_unavailable_reason(PyObject*, PyObject*) {
  std::string why;
  int count;
  Py_BEGIN_ALLOW_THREADS
  count = kvpages::cuda_device_count(&why);
  Py_END_ALLOW_THREADS
  if (count > 0) Py_RETURN_NONE;
  return PyUnicode_FromString(why.c_str());
}

PyObject* kvpages_cuda_current_device(PyObject*, PyObject*) {
  int device;
  Py_BEGIN_ALLOW_THREADS
  device = kvpages::cuda_current_device();
  Py_END_ALLOW_THREADS
  if (device < 0) Py_RETURN_NONE;
  return PyLong_FromLong(device);
}

PyObject* kvpages_os_page_size(PyObject*, PyObject*) {
  return PyLong_FromLong(sysconf(_SC_PAGESIZE));
}

PyMethodDef module_methods[] = {
    {"cuda_built", kvpages_cuda_built, METH_NOARGS,
     "cuda_built() -> bool: whether the CUDA backend was compiled in."},
    {"cuda_device_count", kvpages_cuda_device_count, METH_NOARGS,
     "cuda_device_count() -> int: CUDA devices visible (0 without a driver).\n\n"
     "Does not initialise the driver (cuInit), so a process may still fork "
     "CUDA workers afterwards: where the driver is initialised already it "
     "asks it; else it counts /proc/driver/nvidia/gpus (or "
     "$KVCACHED_NVIDIA_GPUS_DIR) narrowed by CUDA_VISIBLE_DEVICES. Only where "
     "that listing is absent does it call cuInit."},
    {"cuda_unavailable_reason", kvpages_cuda_unavailable_reason, METH_NOARGS,
     "cuda_unavailable_reason() -> str | None: why device='cuda' cannot work "
     "here, or None when it can. Initialises the driver only where "
     "cuda_device_count() does."},
    {"cuda_current_device", kvpages_cuda_current_device, METH_NOARGS,
     "cuda_current_device() -> int | None: the ordinal of the device whose "
     "CUDA context is current on the calling thread, or None. Never "
     "initialises the driver."},
    {"os_page_size", kvpages_os_page_size, METH_NOARGS,
     "os_page_size() -> int: the kernel page size (granularity of CPU pages)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kvpages_module = {
    PyModuleDef_HEAD_INIT,
    "kvcached.runtime._kvpages",
    "Reserved virtual page ranges with per-page physical backing "
    "(CPU memfd backend; CUDA VMM backend loaded at run time).",
    -1,
    module_methods,
};

}  // namespace

PyMODINIT_FUNC PyInit__kvpages(void) {
  PageRangeType.tp_name = "kvcached.runtime._kvpages.PageRange";
  PageRangeType.tp_basicsize = sizeof(PageRangeObject);
  PageRangeType.tp_flags = Py_TPFLAGS_DEFAULT;
  PageRangeType.tp_doc =
      "PageRange(num_pages, page_size=2 MiB, *, device='cpu')\n\n"
      "A reserved virtual range of num_pages pages. Pages are mapped and "
      "unmapped by index; touching an unmapped page faults. CPU pages read "
      "zero when mapped again; CUDA pages are not zeroed. device is 'cpu', "
      "'cuda:N' or 'cuda' (the device of the CUDA context current on the "
      "calling thread, else 0). A CUDA range belongs to the process that "
      "created it: in a forked child, using or closing it raises ForkedError "
      "and dropping it makes no driver call.";
  PageRangeType.tp_new = PyType_GenericNew;
  PageRangeType.tp_init = reinterpret_cast<initproc>(PageRange_init);
  PageRangeType.tp_dealloc = reinterpret_cast<destructor>(PageRange_dealloc);
  PageRangeType.tp_repr = reinterpret_cast<reprfunc>(PageRange_repr);
  PageRangeType.tp_methods = PageRange_methods;
  PageRangeType.tp_getset = PageRange_getset;
  PageRangeType.tp_as_buffer = &PageRange_as_buffer;
  if (PyType_Ready(&PageRangeType) < 0) return nullptr;

  PyObject* m = PyModule_Create(&kvpages_module);
  if (m == nullptr) return nullptr;
  {
    struct ExceptionSpec {
      PyObject** type;
      const char* name;
      PyObject** base;  // null: RuntimeError
      const char* doc;
    };
    const ExceptionSpec exceptions[] = {
        {&g_cuda_error, "CudaError", nullptr,
         "A CUDA driver call failed; .name is the CUresult name "
         "(e.g. 'CUDA_ERROR_OUT_OF_MEMORY'), .code its number."},
        {&g_cuda_unavailable, "CudaUnavailableError", &g_cuda_error,
         "The CUDA backend cannot run here: built without cuda.h, or "
         "libcuda.so.1 is missing. .name and .code are None."},
        {&g_forked_error, "ForkedError", nullptr,
         "A CUDA PageRange was used, changed or closed in a process other "
         "than the one that created it (a forked child): its driver state is "
         "the parent's."},
        {&g_partial_unmap, "PartialUnmapError", nullptr,
         "unmap() failed for some pages and went on with the others: "
         ".unmapped lists the pages now unmapped (their contents are gone), "
         ".failed those still mapped; __cause__ is the first failure."},
    };
    for (const ExceptionSpec& e : exceptions) {
      const std::string qualified = std::string("kvcached.runtime._kvpages.") + e.name;
      *e.type = PyErr_NewExceptionWithDoc(
          qualified.c_str(), e.doc, e.base ? *e.base : PyExc_RuntimeError, nullptr);
      if (*e.type == nullptr || PyModule_AddObjectRef(m, e.name, *e.type) < 0) {
        Py_DECREF(m);
        return nullptr;
      }
    }
  }
  if (PyModule_AddObjectRef(m, "PageRange",
                            reinterpret_cast<PyObject*>(&PageRangeType)) < 0 ||
      PyModule_AddIntConstant(m, "DEFAULT_PAGE_SIZE", kDefaultPageSize) < 0 ||
      kvpages::AddMappedWord(m) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
