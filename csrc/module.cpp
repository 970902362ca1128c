// kvcached._kvpages: reserve a virtual range of pages, map and unmap pages by
// index, report which are mapped. Plain CPython API; no torch headers.
//
// The object keeps the page bookkeeping and validates every request under its
// own mutex before it calls the backend, with the GIL released, so that a
// background pre-mapping thread and the engine thread can share one range.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <unistd.h>

#include "backend.h"

namespace {

constexpr Py_ssize_t kDefaultPageSize = 2 * 1024 * 1024;

PyObject* g_cuda_error = nullptr;         // CudaError(RuntimeError)
PyObject* g_cuda_unavailable = nullptr;   // CudaUnavailableError(CudaError)

struct State {
  std::unique_ptr<kvpages::Backend> backend;
  std::mutex mu;
  std::vector<unsigned char> mapped;
  std::size_t page_size = 0;
  std::size_t num_mapped = 0;
  int device = -1;  // -1: CPU; otherwise the CUDA device ordinal
};

struct PageRangeObject {
  PyObject_HEAD
  // Shared so that a thread inside map/unmap (GIL released) keeps the state
  // alive if another thread closes the range meanwhile; null once closed.
  std::shared_ptr<State>* state;
  Py_ssize_t exports;     // live buffer-protocol views
  Py_ssize_t num_pages;   // kept after close, for repr and errors
  std::size_t page_size;
  int device;
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

// Parses "cpu", "cuda" or "cuda:N" into -1 (CPU) or N.
bool parse_device(const char* text, int* device) {
  std::string s(text);
  if (s == "cpu") {
    *device = -1;
    return true;
  }
  if (s == "cuda") {
    *device = 0;
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

// Maps (map=true) or unmaps every index, all or nothing: the whole request is
// validated first (no duplicates, every page in the expected state), and a
// backend failure part way rolls back the pages this call already changed.
PyObject* change_pages(PageRangeObject* self, PyObject* arg, bool map) {
  std::shared_ptr<State> st = live_state(self);
  if (st == nullptr) return nullptr;
  std::vector<std::size_t> idx;
  if (!collect_indices(arg, self->num_pages, &idx)) return nullptr;

  kvpages::Status status;
  std::size_t bad_index = 0;
  enum { kOk, kWrongState, kDuplicate, kBackend } outcome = kOk;
  Py_BEGIN_ALLOW_THREADS
  {
    std::lock_guard<std::mutex> lock(st->mu);
    for (std::size_t i : idx) {
      if ((st->mapped[i] != 0) == map) {
        outcome = kWrongState;
        bad_index = i;
        break;
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
    std::size_t done = 0;
    for (; outcome == kOk && done < idx.size(); ++done) {
      const std::size_t i = idx[done];
      status = map ? st->backend->map(i) : st->backend->unmap(i);
      if (!status.ok()) {
        outcome = kBackend;
        break;
      }
      st->mapped[i] = map ? 1 : 0;
    }
    std::size_t changed = done;
    if (outcome == kBackend) {
      // Roll back, best effort; the first error is the one reported. (An
      // unmap rolled back maps the page again: on the CPU it comes back
      // zeroed, which is harmless for a page its owner was releasing.)
      for (std::size_t k = 0; k < done; ++k) {
        const std::size_t i = idx[k];
        kvpages::Status undo = map ? st->backend->unmap(i) : st->backend->map(i);
        if (undo.ok()) {
          st->mapped[i] = map ? 0 : 1;
          --changed;
        }
      }
    }
    if (map) {
      st->num_mapped += changed;
    } else {
      st->num_mapped -= changed;
    }
  }
  Py_END_ALLOW_THREADS

  switch (outcome) {
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
      return set_error(status);
    case kOk:
      break;
  }
  Py_RETURN_NONE;
}

void close_state(PageRangeObject* self) {
  std::shared_ptr<State>* holder = self->state;
  self->state = nullptr;
  if (holder == nullptr) return;
  // Destroying the backend releases every mapped page and the reservation;
  // for CUDA that can take a while, so let other threads run. A thread still
  // inside map/unmap holds its own reference and destroys it when done.
  Py_BEGIN_ALLOW_THREADS
  delete holder;
  Py_END_ALLOW_THREADS
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
  int device = -1;
  if (!parse_device(device_text, &device)) return -1;

  auto st = std::make_shared<State>();
  kvpages::Status status;
  const std::size_t n = static_cast<std::size_t>(num_pages);
  const std::size_t ps = static_cast<std::size_t>(page_size);
  Py_BEGIN_ALLOW_THREADS
  status = device < 0 ? kvpages::make_cpu_backend(n, ps, &st->backend)
                      : kvpages::make_cuda_backend(n, ps, device, &st->backend);
  Py_END_ALLOW_THREADS
  if (!status.ok()) {
    set_error(status);
    return -1;
  }
  st->mapped.assign(n, 0);
  st->page_size = ps;
  st->device = device;
  self->state = new std::shared_ptr<State>(std::move(st));
  self->num_pages = num_pages;
  self->page_size = ps;
  self->device = device;
  return 0;
}

void PageRange_dealloc(PageRangeObject* self) {
  // No export can be live here: every view holds a reference to us.
  close_state(self);
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

PyObject* PageRange_map(PageRangeObject* self, PyObject* arg) {
  return change_pages(self, arg, true);
}

PyObject* PageRange_unmap(PageRangeObject* self, PyObject* arg) {
  return change_pages(self, arg, false);
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
  std::lock_guard<std::mutex> lock(st->mu);
  return PyBool_FromLong(st->mapped[idx[0]]);
}

PyObject* PageRange_mapped_pages(PageRangeObject* self, PyObject*) {
  std::shared_ptr<State> st = live_state(self);
  if (st == nullptr) return nullptr;
  std::vector<std::size_t> out;
  {
    std::lock_guard<std::mutex> lock(st->mu);
    for (std::size_t i = 0; i < st->mapped.size(); ++i) {
      if (st->mapped[i]) out.push_back(i);
    }
  }
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(out.size()));
  if (list == nullptr) return nullptr;
  for (std::size_t k = 0; k < out.size(); ++k) {
    PyObject* v = PyLong_FromSize_t(out[k]);
    if (v == nullptr) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(k), v);
  }
  return list;
}

PyObject* PageRange_close(PageRangeObject* self, PyObject*) {
  if (self->exports > 0) {
    PyErr_Format(PyExc_BufferError,
                 "cannot close a PageRange with %zd live buffer view(s)",
                 self->exports);
    return nullptr;
  }
  close_state(self);
  Py_RETURN_NONE;
}

PyObject* PageRange_enter(PageRangeObject* self, PyObject*) {
  if (live_state(self) == nullptr) return nullptr;
  return Py_NewRef(reinterpret_cast<PyObject*>(self));
}

PyObject* PageRange_exit(PageRangeObject* self, PyObject*) {
  return PageRange_close(self, nullptr);
}

PyObject* PageRange_repr(PageRangeObject* self) {
  std::string dev = self->device < 0 ? "cpu" : "cuda:" + std::to_string(self->device);
  if (self->state == nullptr) {
    return PyUnicode_FromFormat("<PageRange closed num_pages=%zd device=%s>",
                                self->num_pages, dev.c_str());
  }
  std::size_t mapped;
  {
    std::lock_guard<std::mutex> lock((*self->state)->mu);
    mapped = (*self->state)->num_mapped;
  }
  return PyUnicode_FromFormat(
      "<PageRange num_pages=%zd page_size=%zu mapped=%zu device=%s>",
      self->num_pages, self->page_size, mapped, dev.c_str());
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
  std::lock_guard<std::mutex> lock(st->mu);
  return PyLong_FromSize_t(st->num_mapped);
}

PyObject* get_device(PageRangeObject* self, void*) {
  if (self->device < 0) return PyUnicode_FromString("cpu");
  return PyUnicode_FromFormat("cuda:%d", self->device);
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
                    "a CUDA PageRange has no host buffer; use "
                    "kvcached.runtime.pages.as_tensor");
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

PyMethodDef PageRange_methods[] = {
    {"map", reinterpret_cast<PyCFunction>(PageRange_map), METH_O,
     "map(pages) -> None\n\nMap one page index or an iterable of them (all or "
     "nothing)."},
    {"unmap", reinterpret_cast<PyCFunction>(PageRange_unmap), METH_O,
     "unmap(pages) -> None\n\nUnmap one page index or an iterable of them and "
     "return their memory (all or nothing)."},
    {"is_mapped", reinterpret_cast<PyCFunction>(PageRange_is_mapped), METH_O,
     "is_mapped(index) -> bool"},
    {"mapped_pages", reinterpret_cast<PyCFunction>(PageRange_mapped_pages),
     METH_NOARGS, "mapped_pages() -> list[int]: the mapped page indices, ascending."},
    {"close", reinterpret_cast<PyCFunction>(PageRange_close), METH_NOARGS,
     "close() -> None\n\nUnmap every page and release the range. Idempotent; "
     "refused while buffer views are alive."},
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

PyObject* kvpages_os_page_size(PyObject*, PyObject*) {
  return PyLong_FromLong(sysconf(_SC_PAGESIZE));
}

PyMethodDef module_methods[] = {
    {"cuda_built", kvpages_cuda_built, METH_NOARGS,
     "cuda_built() -> bool: whether the CUDA backend was compiled in."},
    {"cuda_device_count", kvpages_cuda_device_count, METH_NOARGS,
     "cuda_device_count() -> int: CUDA devices usable now (0 without a driver)."},
    {"cuda_unavailable_reason", kvpages_cuda_unavailable_reason, METH_NOARGS,
     "cuda_unavailable_reason() -> str | None: why device='cuda' cannot work "
     "here, or None when it can."},
    {"os_page_size", kvpages_os_page_size, METH_NOARGS,
     "os_page_size() -> int: the kernel page size (granularity of CPU pages)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kvpages_module = {
    PyModuleDef_HEAD_INIT,
    "kvcached._kvpages",
    "Reserved virtual page ranges with per-page physical backing "
    "(CPU memfd backend; CUDA VMM backend loaded at run time).",
    -1,
    module_methods,
};

}  // namespace

PyMODINIT_FUNC PyInit__kvpages(void) {
  PageRangeType.tp_name = "kvcached._kvpages.PageRange";
  PageRangeType.tp_basicsize = sizeof(PageRangeObject);
  PageRangeType.tp_flags = Py_TPFLAGS_DEFAULT;
  PageRangeType.tp_doc =
      "PageRange(num_pages, page_size=2 MiB, *, device='cpu')\n\n"
      "A reserved virtual range of num_pages pages. Pages are mapped and "
      "unmapped by index; touching an unmapped page faults. CPU pages read "
      "zero when mapped again; CUDA pages are not zeroed.";
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
  g_cuda_error = PyErr_NewExceptionWithDoc(
      "kvcached._kvpages.CudaError",
      "A CUDA driver call failed; .name is the CUresult name "
      "(e.g. 'CUDA_ERROR_OUT_OF_MEMORY'), .code its number.",
      PyExc_RuntimeError, nullptr);
  if (g_cuda_error == nullptr) goto fail;
  g_cuda_unavailable = PyErr_NewExceptionWithDoc(
      "kvcached._kvpages.CudaUnavailableError",
      "The CUDA backend cannot run here: built without cuda.h, or libcuda.so.1 "
      "is missing. .name and .code are None.",
      g_cuda_error, nullptr);
  if (g_cuda_unavailable == nullptr) goto fail;
  if (PyModule_AddObjectRef(m, "CudaError", g_cuda_error) < 0 ||
      PyModule_AddObjectRef(m, "CudaUnavailableError", g_cuda_unavailable) < 0 ||
      PyModule_AddObjectRef(m, "PageRange",
                            reinterpret_cast<PyObject*>(&PageRangeType)) < 0 ||
      PyModule_AddIntConstant(m, "DEFAULT_PAGE_SIZE", kDefaultPageSize) < 0) {
    goto fail;
  }
  return m;
fail:
  Py_DECREF(m);
  return nullptr;
}
