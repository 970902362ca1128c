// MappedWord: the limit an engine reads at every scheduler step, without a
// system call.
//
// A pread of the 24-byte segment costs 2-5 us at a step boundary (the step's
// torch work leaves nothing warm), most of what the elastic allocator adds to
// a step. Reading the same bytes through a shared mapping costs a load. The
// hazard is the mapping itself: once the file is truncated, touching its page
// raises SIGBUS, and a serve must not die because someone truncated a file in
// /dev/shm. So every load runs armed: a process-wide SIGBUS handler that
// long-jumps out of our own load (checked by faulting address and thread)
// and hands every other fault to the handler that was there before it.
//
// - The handler is installed once per process and never re-installed: a
//   handler installed after ours may have saved ours as its previous one, and
//   re-installing would make the two call each other. `guarded` tells whether
//   ours is still the one installed (one sigaction call, made where the
//   caller already makes a syscall: LimitWatch's periodic stat); once it is
//   not, the caller must drop the mapping and read with pread. What is left
//   is one window: a handler installed after ours and a truncation of the
//   file within the same recheck interval, when the later handler sees our
//   fault first. Nothing of ours or upstream's truncates a segment (upstream
//   re-creates a missing one as a new inode, which the mapping survives).
// - SA_NODEFER and sigsetjmp(env, 0): the signal is not blocked inside the
//   handler, so jumping out needs no signal-mask syscall on the way in or out.
// - Reads hold the GIL, so one guard slot serves the whole process; the thread
//   check keeps a fault of a thread running without the GIL from jumping into
//   ours.
#include "mapped_word.h"

#include <atomic>
#include <cerrno>
#include <csetjmp>
#include <cstdint>
#include <cstring>

#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace kvpages {
namespace {

struct Guard {
  sigjmp_buf env;
  const char* lo;  // the faulting addresses that are ours: [lo, hi)
  const char* hi;
  pthread_t thread;
};

Guard* volatile g_guard = nullptr;  // set around one load, with the GIL held
struct sigaction g_previous;        // what was installed before ours
bool g_installed = false;           // changed with the GIL held

void HandOn(int sig, siginfo_t* info, void* context) {
  if (g_previous.sa_flags & SA_SIGINFO) {
    if (g_previous.sa_sigaction != nullptr) g_previous.sa_sigaction(sig, info, context);
    return;
  }
  const bool sent = info->si_code <= 0;  // kill/raise/sigqueue, not a fault
  if (g_previous.sa_handler == SIG_IGN && sent) return;
  if (g_previous.sa_handler == SIG_DFL || g_previous.sa_handler == SIG_IGN) {
    // The default action, as if we had never been installed: a fault returns
    // to the faulting instruction and takes it there; a sent signal is raised
    // again (SA_NODEFER was ours; the default handler has no mask to defer).
    struct sigaction dfl;
    std::memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(SIGBUS, &dfl, nullptr);
    if (sent) raise(SIGBUS);
    return;
  }
  g_previous.sa_handler(sig);
}

void OnSigbus(int sig, siginfo_t* info, void* context) {
  Guard* guard = g_guard;
  if (guard != nullptr && info->si_code > 0 && pthread_equal(guard->thread, pthread_self())) {
    const char* addr = static_cast<const char*>(info->si_addr);
    if (addr >= guard->lo && addr < guard->hi) {
      g_guard = nullptr;
      siglongjmp(guard->env, 1);
    }
  }
  HandOn(sig, info, context);
}

bool OursInstalled() {
  struct sigaction now;
  if (sigaction(SIGBUS, nullptr, &now) != 0) return false;
  return (now.sa_flags & SA_SIGINFO) && now.sa_sigaction == OnSigbus;
}

// Installs the handler once; false (errno set) when it cannot be, or when a
// later handler replaced it.
bool EnsureInstalled() {
  if (g_installed) {
    if (OursInstalled()) return true;
    errno = EBUSY;
    return false;
  }
  struct sigaction ours;
  std::memset(&ours, 0, sizeof ours);
  ours.sa_sigaction = OnSigbus;
  ours.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
  sigemptyset(&ours.sa_mask);
  if (sigaction(SIGBUS, &ours, &g_previous) != 0) return false;
  g_installed = true;
  return true;
}

// One armed load of *p; false when it faulted (the page is gone: truncated).
bool GuardedLoad(const volatile std::int64_t* p, std::int64_t* out) {
  Guard guard;
  guard.lo = reinterpret_cast<const char*>(const_cast<const std::int64_t*>(p));
  guard.hi = guard.lo + sizeof(std::int64_t);
  guard.thread = pthread_self();
  if (sigsetjmp(guard.env, 0) != 0) return false;
  g_guard = &guard;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  const std::int64_t value = *p;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  g_guard = nullptr;
  *out = value;
  return true;
}

struct MappedWordObject {
  PyObject_HEAD
  void* base;           // the mapping (one OS page), null once closed
  std::size_t length;
  std::int64_t last;    // the value last returned, and its int object
  PyObject* last_obj;
};

int MappedWord_init(MappedWordObject* self, PyObject* args, PyObject* kwds) {
  static const char* kwlist[] = {"fd", nullptr};
  int fd = -1;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "i:MappedWord", const_cast<char**>(kwlist), &fd)) return -1;
  if (self->base != nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "MappedWord is already initialised");
    return -1;
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    PyErr_SetFromErrno(PyExc_OSError);
    return -1;
  }
  if (!S_ISREG(st.st_mode) || st.st_size < static_cast<off_t>(sizeof(std::int64_t))) {
    errno = EINVAL;
    PyErr_SetFromErrno(PyExc_OSError);
    return -1;
  }
  if (!EnsureInstalled()) {
    PyErr_SetFromErrno(PyExc_OSError);
    return -1;
  }
  const std::size_t length = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  void* base = mmap(nullptr, length, PROT_READ, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    PyErr_SetFromErrno(PyExc_OSError);
    return -1;
  }
  self->base = base;
  self->length = length;
  return 0;
}

void Unmap(MappedWordObject* self) {
  if (self->base != nullptr) {
    munmap(self->base, self->length);
    self->base = nullptr;
  }
  Py_CLEAR(self->last_obj);
}

void MappedWord_dealloc(MappedWordObject* self) {
  Unmap(self);
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

PyObject* MappedWord_read(MappedWordObject* self, PyObject*) {
  if (self->base == nullptr) {
    PyErr_SetString(PyExc_ValueError, "MappedWord is closed");
    return nullptr;
  }
  const volatile std::int64_t* p = static_cast<const volatile std::int64_t*>(self->base);
  std::int64_t value;
  if (!GuardedLoad(p, &value)) Py_RETURN_NONE;
  if (self->last_obj != nullptr && value == self->last) return Py_NewRef(self->last_obj);
  // Changed, or the first read: a value being rewritten (under the writer's
  // lock, which we do not take) can be read torn, but not the same way twice
  // in a row.
  for (int i = 0; i < 100; ++i) {
    std::int64_t again;
    if (!GuardedLoad(p, &again)) Py_RETURN_NONE;
    if (again == value) {
      PyObject* obj = PyLong_FromLongLong(value);
      if (obj == nullptr) return nullptr;
      Py_XSETREF(self->last_obj, obj);
      self->last = value;
      return Py_NewRef(obj);
    }
    value = again;
  }
  Py_RETURN_NONE;  // rewritten all along: the caller takes the lock
}

PyObject* MappedWord_close(MappedWordObject* self, PyObject*) {
  Unmap(self);
  Py_RETURN_NONE;
}

PyObject* MappedWord_guarded(MappedWordObject* self, void*) {
  return PyBool_FromLong(self->base != nullptr && OursInstalled());
}

PyObject* MappedWord_closed(MappedWordObject* self, void*) {
  return PyBool_FromLong(self->base == nullptr);
}

PyMethodDef MappedWord_methods[] = {
    {"read", reinterpret_cast<PyCFunction>(MappedWord_read), METH_NOARGS,
     "read() -> int | None: the file's first 8 bytes as a native int64, with no "
     "system call. None when the mapping cannot answer: the page is gone (the "
     "file was truncated) or the value kept changing; read the file instead."},
    {"close", reinterpret_cast<PyCFunction>(MappedWord_close), METH_NOARGS,
     "close(): unmap (idempotent)."},
    {nullptr, nullptr, 0, nullptr},
};

PyGetSetDef MappedWord_getset[] = {
    {"guarded", reinterpret_cast<getter>(MappedWord_guarded), nullptr,
     "Whether our SIGBUS handler is still the installed one (one sigaction "
     "call). Once False, stop reading: a truncated file would kill the process.",
     nullptr},
    {"closed", reinterpret_cast<getter>(MappedWord_closed), nullptr, "Whether close() ran.", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyTypeObject MappedWordType = {PyVarObject_HEAD_INIT(nullptr, 0)};

}  // namespace

int AddMappedWord(PyObject* module) {
  MappedWordType.tp_name = "kvcached.runtime._kvpages.MappedWord";
  MappedWordType.tp_basicsize = sizeof(MappedWordObject);
  MappedWordType.tp_flags = Py_TPFLAGS_DEFAULT;
  MappedWordType.tp_doc =
      "MappedWord(fd)\n\n"
      "The first 8 bytes of the regular file open at fd, read through a "
      "read-only shared mapping of its first page. Reads run behind a SIGBUS "
      "guard installed once per process, so a file truncated under the "
      "mapping makes read() return None instead of killing the process; "
      "every other SIGBUS goes to the handler installed before. Raises "
      "OSError(EBUSY) when a later handler has replaced the guard.";
  MappedWordType.tp_new = PyType_GenericNew;
  MappedWordType.tp_init = reinterpret_cast<initproc>(MappedWord_init);
  MappedWordType.tp_dealloc = reinterpret_cast<destructor>(MappedWord_dealloc);
  MappedWordType.tp_methods = MappedWord_methods;
  MappedWordType.tp_getset = MappedWord_getset;
  if (PyType_Ready(&MappedWordType) < 0) return -1;
  return PyModule_AddObjectRef(module, "MappedWord", reinterpret_cast<PyObject*>(&MappedWordType));
}

}  // namespace kvpages
