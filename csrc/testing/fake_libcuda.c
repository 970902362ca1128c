/* A stand-in libcuda.so.1 for testing the extension's CUDA plumbing without a GPU.
 *
 * It implements the driver entry points the CUDA backend resolves with dlsym,
 * backing "device" memory with host memory so that a test can see where pages
 * were mapped. It is as strict as the CUDA driver API documentation (the
 * comments in cuda.h) where the real driver is strict, and as permissive where
 * the real driver is permissive, so that a backend passing here is not merely
 * passing a kind double:
 *
 * - Nothing works before cuInit (CUDA_ERROR_NOT_INITIALIZED), and nothing
 *   works in a forked child of a process that called cuInit: there every
 *   call, cuInit included, returns CUDA_ERROR_NOT_INITIALIZED, which is what
 *   the real driver returns in such a child (reported in triton-lang/triton
 *   PR 10443 and tensorflow/tensorflow issue 57877). Such calls are counted.
 * - Device handles are not ordinals (handle = 0x100 + ordinal), so a backend
 *   that passes one where the other is due fails. FAKE_CUDA_DEVICES=N gives N
 *   devices (default 1), each with its own primary context.
 * - cuMemAddressReserve honours its alignment. Alignment 0 gets the weakest
 *   alignment the documentation promises, the host page size, and the fake
 *   deliberately starts such a reservation one host page past a granularity
 *   boundary: a backend relying on an undocumented default alignment fails.
 * - cuMemCreate checks the allocation type and location (type DEVICE, id a
 *   device ordinal). cuMemMap requires offset 0, flags 0, size and address
 *   multiples of the granularity, a range inside one reservation and not
 *   mapped already. cuMemSetAccess requires a fully mapped range and a valid
 *   device location. cuMemUnmap takes whole mappings only.
 * - cuMemRelease is allowed while the allocation is mapped, as in the real
 *   driver: the memory lives until it is both released and unmapped.
 * - cuDevicePrimaryCtxRelease does not pop the context (documented); releasing
 *   the last reference while the context is on the calling thread's stack is
 *   counted as a violation, since every later call on that thread would use a
 *   destroyed context. cuMemAddressFree of a range with a page still mapped is
 *   undocumented: the fake refuses it (CUDA_ERROR_INVALID_VALUE) and counts a
 *   violation.
 * - Its tables sit behind one mutex; the context stack is per thread.
 *
 * It is NOT a model of CUDA: only a run on a real GPU
 * (tests/ext/test_kvpages_cuda.py, scripts/gpu-check.sh) proves the backend.
 *
 * Environment, read by cuInit: FAKE_CUDA_NO_DEVICE=1 makes cuInit fail with
 * CUDA_ERROR_NO_DEVICE; FAKE_CUDA_MEM_BYTES caps what cuMemCreate hands out
 * (CUDA_ERROR_OUT_OF_MEMORY past it); FAKE_CUDA_DEVICES sets the device count.
 *
 * For tests, through ctypes: fake_cuda_stat(name) reads a counter, and
 * fake_cuda_fail(fn, after, times, rc) makes the named entry point fail with
 * rc `times` times once it has succeeded `after` more times.
 *
 * Holds, so that a test knows a thread is inside the driver instead of
 * sleeping to guess it: fake_cuda_hold(fn, max_ms) makes the next call of the
 * named entry point stop on entry, before it takes the fake's lock (as a slow
 * driver call would, with the caller's own locks held);
 * fake_cuda_wait_held(fn, ms) blocks until a thread is held there (1) or `ms`
 * pass (0); fake_cuda_release(fn) lets it go on (a release before the call
 * arrives cancels the hold). A hold nobody releases ends by itself after
 * `max_ms` and is counted (stat "hold_timeouts"): the test that armed it could
 * not run meanwhile, which is what such a test checks.
 *
 * Built by the test: cc -shared -fPIC -pthread -o libcuda.so.1 fake_libcuda.c
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;

/* The leading members of cuda.h's CUmemAllocationProp and CUmemAccessDesc,
 * which are all the fake reads (every enum in them is int-sized). */
typedef struct {
  int type;
  int id;
} CUmemLocation;
typedef struct {
  int type;
  int requestedHandleTypes;
  CUmemLocation location;
} CUmemAllocationProp;
typedef struct {
  CUmemLocation location;
  int flags;
} CUmemAccessDesc;

enum {
  OK = 0,
  INVALID_VALUE = 1,
  OUT_OF_MEMORY = 2,
  NOT_INITIALIZED = 3,
  NO_DEVICE = 100,
  INVALID_DEVICE = 101,
  INVALID_CONTEXT = 201,
};

enum { LOCATION_DEVICE = 1, ALLOCATION_PINNED = 1 };
enum { ACCESS_NONE = 0, ACCESS_READ = 1, ACCESS_READWRITE = 3 };

#define GRANULARITY ((size_t)2 << 20)
#define MAX_DEVICES 8
#define DEVICE_HANDLE_BASE 0x100
#define MAX_PUSH 16

typedef struct fake_ctx {
  int ordinal;
  int refs; /* primary context retains; the context is reset at 0 */
} fake_ctx;
typedef fake_ctx* CUcontext;

struct reservation {
  uintptr_t base;
  size_t size;
  uintptr_t mapping_base; /* what mmap returned, for munmap */
  size_t mapping_size;
  struct reservation* next;
};

struct allocation {
  size_t size;
  int ordinal;
  int released;         /* cuMemRelease ran: the handle is gone */
  CUdeviceptr mapped_at; /* 0 when not mapped */
  struct allocation* next;
};

struct fault {
  char fn[40];
  int after;
  int times;
  CUresult rc;
  int hold_armed;  /* the next call stops on entry */
  int hold_max_ms;
  int held;        /* threads stopped on entry right now */
  int released;    /* fake_cuda_release ran since the hold was armed */
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pid_t g_init_pid; /* the process that called cuInit; 0 before */
static int g_devices = 1;
static long long g_budget = -1;
static fake_ctx g_ctx[MAX_DEVICES];
static struct reservation* g_reservations;
static struct allocation* g_allocations;
static struct fault g_faults[8];
static long long g_init_calls, g_foreign_calls, g_violations, g_hold_timeouts;
/* Signalled when a thread is held and when a hold is released; waits use the
 * monotonic clock, so a clock step cannot end or stretch them. */
static pthread_cond_t g_hold_cv;
static pthread_once_t g_hold_once = PTHREAD_ONCE_INIT;
static __thread CUcontext t_stack[MAX_PUSH];
static __thread int t_depth;

static size_t host_page(void) { return (size_t)sysconf(_SC_PAGESIZE); }

static struct fault* fault_for(const char* fn, int create) {
  for (size_t i = 0; i < sizeof g_faults / sizeof g_faults[0]; i++) {
    if (strcmp(g_faults[i].fn, fn) == 0) return &g_faults[i];
  }
  if (!create) return NULL;
  for (size_t i = 0; i < sizeof g_faults / sizeof g_faults[0]; i++) {
    if (g_faults[i].fn[0] == 0) {
      strncpy(g_faults[i].fn, fn, sizeof g_faults[i].fn - 1);
      return &g_faults[i];
    }
  }
  return NULL;
}

void fake_cuda_fail(const char* fn, int after, int times, int rc) {
  pthread_mutex_lock(&g_mu);
  struct fault* f = fault_for(fn, 1);
  if (f) {
    f->after = after;
    f->times = times;
    f->rc = rc;
  }
  pthread_mutex_unlock(&g_mu);
}

static void hold_cv_init(void) {
  pthread_condattr_t attr;
  pthread_condattr_init(&attr);
  pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
  pthread_cond_init(&g_hold_cv, &attr);
  pthread_condattr_destroy(&attr);
}

static struct timespec deadline_in(int ms) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  t.tv_sec += ms / 1000;
  t.tv_nsec += (long)(ms % 1000) * 1000000L;
  if (t.tv_nsec >= 1000000000L) {
    t.tv_sec++;
    t.tv_nsec -= 1000000000L;
  }
  return t;
}

void fake_cuda_hold(const char* fn, int max_ms) {
  pthread_once(&g_hold_once, hold_cv_init);
  pthread_mutex_lock(&g_mu);
  struct fault* f = fault_for(fn, 1);
  if (f) {
    f->hold_armed = 1;
    f->hold_max_ms = max_ms;
    f->released = 0;
  }
  pthread_mutex_unlock(&g_mu);
}

int fake_cuda_wait_held(const char* fn, int ms) {
  pthread_once(&g_hold_once, hold_cv_init);
  struct timespec until = deadline_in(ms);
  int rc = 0, held = 0;
  pthread_mutex_lock(&g_mu);
  struct fault* f = fault_for(fn, 0);
  while (f && f->held == 0 && rc == 0) rc = pthread_cond_timedwait(&g_hold_cv, &g_mu, &until);
  held = f && f->held > 0;
  pthread_mutex_unlock(&g_mu);
  return held;
}

void fake_cuda_release(const char* fn) {
  pthread_once(&g_hold_once, hold_cv_init);
  pthread_mutex_lock(&g_mu);
  struct fault* f = fault_for(fn, 0);
  if (f) {
    f->released = 1;
    f->hold_armed = 0;
    pthread_cond_broadcast(&g_hold_cv);
  }
  pthread_mutex_unlock(&g_mu);
}

static long long count_allocations(int want_unreleased) {
  long long n = 0;
  for (struct allocation* a = g_allocations; a; a = a->next) {
    if (!want_unreleased || !a->released) n++;
  }
  return n;
}

long long fake_cuda_stat(const char* name) {
  long long v = -1;
  pthread_mutex_lock(&g_mu);
  if (strcmp(name, "handles") == 0) {
    v = count_allocations(1); /* created and not yet released */
  } else if (strcmp(name, "allocations") == 0) {
    v = count_allocations(0); /* physical memory still alive */
  } else if (strcmp(name, "mapped") == 0) {
    v = 0;
    for (struct allocation* a = g_allocations; a; a = a->next) v += a->mapped_at != 0;
  } else if (strcmp(name, "reservations") == 0) {
    v = 0;
    for (struct reservation* r = g_reservations; r; r = r->next) v++;
  } else if (strcmp(name, "ctx_refs") == 0) {
    v = 0;
    for (int i = 0; i < MAX_DEVICES; i++) v += g_ctx[i].refs;
  } else if (strcmp(name, "push_depth") == 0) {
    v = t_depth; /* the calling thread's */
  } else if (strcmp(name, "init_calls") == 0) {
    v = g_init_calls;
  } else if (strcmp(name, "foreign_calls") == 0) {
    v = g_foreign_calls;
  } else if (strcmp(name, "violations") == 0) {
    v = g_violations;
  } else if (strcmp(name, "hold_timeouts") == 0) {
    v = g_hold_timeouts;
  }
  pthread_mutex_unlock(&g_mu);
  return v;
}

/* Every entry point but cuInit and cuGetErrorName goes through here, with the
 * lock held: the process check, then any injected failure. */
static CUresult admit(const char* fn) {
  if (g_init_pid == 0) return NOT_INITIALIZED;
  if (g_init_pid != getpid()) {
    g_foreign_calls++;
    return NOT_INITIALIZED;
  }
  struct fault* f = fault_for(fn, 0);
  if (f && f->times > 0) {
    if (f->after > 0) {
      f->after--;
    } else {
      f->times--;
      return f->rc;
    }
  }
  return OK;
}

/* Stops here while a hold on `fn` is armed (see the header); the wait gives
 * the fake's lock up, so other threads' driver calls go on meanwhile. */
static void hold_if_asked(const char* fn) {
  pthread_mutex_lock(&g_mu);
  struct fault* f = fault_for(fn, 0);
  if (f && f->hold_armed && !f->released) {
    f->hold_armed = 0;
    f->held++;
    pthread_cond_broadcast(&g_hold_cv);
    struct timespec until = deadline_in(f->hold_max_ms);
    int rc = 0;
    while (!f->released && rc == 0) rc = pthread_cond_timedwait(&g_hold_cv, &g_mu, &until);
    if (!f->released) g_hold_timeouts++;
    f->released = 0;
    f->held--;
  }
  pthread_mutex_unlock(&g_mu);
}

/* Defines entry point `name` around `impl`: hold, lock, admit, run, unlock. */
#define ENTRY(name, params, args)                   \
  static CUresult name##_impl params;               \
  CUresult name params {                            \
    hold_if_asked(#name);                           \
    pthread_mutex_lock(&g_mu);                      \
    CUresult rc = admit(#name);                     \
    if (rc == OK) rc = name##_impl args;            \
    pthread_mutex_unlock(&g_mu);                    \
    return rc;                                      \
  }                                                 \
  static CUresult name##_impl params

static CUcontext current(void) { return t_depth ? t_stack[t_depth - 1] : NULL; }

/* Memory calls need a current, live context, as in the real driver. */
#define NEED_CONTEXT()                                      \
  do {                                                      \
    if (current() == NULL || current()->refs == 0) return INVALID_CONTEXT; \
  } while (0)

static int ordinal_of(CUdevice dev) {
  int ord = dev - DEVICE_HANDLE_BASE;
  return ord >= 0 && ord < g_devices ? ord : -1;
}

CUresult cuInit(unsigned int flags) {
  pthread_mutex_lock(&g_mu);
  CUresult rc = OK;
  g_init_calls++;
  const char* nodev = getenv("FAKE_CUDA_NO_DEVICE");
  if (g_init_pid != 0 && g_init_pid != getpid()) {
    g_foreign_calls++;
    rc = NOT_INITIALIZED;
  } else if (flags != 0) {
    rc = INVALID_VALUE;
  } else if (nodev && *nodev == '1') {
    rc = NO_DEVICE;
  } else if (g_init_pid == 0) {
    const char* mem = getenv("FAKE_CUDA_MEM_BYTES");
    const char* devs = getenv("FAKE_CUDA_DEVICES");
    if (mem) g_budget = atoll(mem);
    if (devs) g_devices = atoi(devs);
    if (g_devices < 1 || g_devices > MAX_DEVICES) g_devices = 1;
    for (int i = 0; i < MAX_DEVICES; i++) g_ctx[i].ordinal = i;
    g_init_pid = getpid();
  }
  pthread_mutex_unlock(&g_mu);
  return rc;
}

CUresult cuGetErrorName(CUresult rc, const char** name) {
  switch (rc) {
    case OK: *name = "CUDA_SUCCESS"; return OK;
    case INVALID_VALUE: *name = "CUDA_ERROR_INVALID_VALUE"; return OK;
    case OUT_OF_MEMORY: *name = "CUDA_ERROR_OUT_OF_MEMORY"; return OK;
    case NOT_INITIALIZED: *name = "CUDA_ERROR_NOT_INITIALIZED"; return OK;
    case NO_DEVICE: *name = "CUDA_ERROR_NO_DEVICE"; return OK;
    case INVALID_DEVICE: *name = "CUDA_ERROR_INVALID_DEVICE"; return OK;
    case INVALID_CONTEXT: *name = "CUDA_ERROR_INVALID_CONTEXT"; return OK;
  }
  *name = NULL;
  return INVALID_VALUE;
}

ENTRY(cuDeviceGetCount, (int* count), (count)) {
  *count = g_devices;
  return OK;
}

ENTRY(cuDeviceGet, (CUdevice* dev, int ordinal), (dev, ordinal)) {
  if (ordinal < 0 || ordinal >= g_devices) return INVALID_DEVICE;
  *dev = DEVICE_HANDLE_BASE + ordinal;
  return OK;
}

ENTRY(cuDevicePrimaryCtxRetain, (CUcontext* ctx, CUdevice dev), (ctx, dev)) {
  int ord = ordinal_of(dev);
  if (ord < 0) return INVALID_DEVICE;
  g_ctx[ord].refs++;
  *ctx = &g_ctx[ord];
  return OK;
}

ENTRY(cuDevicePrimaryCtxRelease_v2, (CUdevice dev), (dev)) {
  int ord = ordinal_of(dev);
  if (ord < 0) return INVALID_DEVICE;
  if (g_ctx[ord].refs == 0) return INVALID_CONTEXT;
  if (--g_ctx[ord].refs == 0) {
    for (int i = 0; i < t_depth; i++) {
      if (t_stack[i] == &g_ctx[ord]) g_violations++; /* reset while current */
    }
  }
  return OK;
}

static int known_context(CUcontext ctx) {
  return ctx >= &g_ctx[0] && ctx < &g_ctx[MAX_DEVICES] && ctx->ordinal < g_devices;
}

ENTRY(cuCtxPushCurrent_v2, (CUcontext ctx), (ctx)) {
  if (!known_context(ctx) || ctx->refs == 0 || t_depth == MAX_PUSH) return INVALID_CONTEXT;
  t_stack[t_depth++] = ctx;
  return OK;
}

ENTRY(cuCtxPopCurrent_v2, (CUcontext* ctx), (ctx)) {
  if (t_depth == 0) return INVALID_CONTEXT;
  CUcontext top = t_stack[--t_depth];
  if (ctx) *ctx = top;
  return OK;
}

ENTRY(cuCtxGetCurrent, (CUcontext* ctx), (ctx)) {
  *ctx = current();
  return OK;
}

ENTRY(cuCtxGetDevice, (CUdevice* dev), (dev)) {
  NEED_CONTEXT();
  *dev = DEVICE_HANDLE_BASE + current()->ordinal;
  return OK;
}

static CUresult check_prop(const CUmemAllocationProp* prop) {
  if (prop == NULL || prop->type != ALLOCATION_PINNED || prop->location.type != LOCATION_DEVICE) {
    return INVALID_VALUE;
  }
  if (prop->location.id < 0 || prop->location.id >= g_devices) return INVALID_DEVICE;
  return OK;
}

ENTRY(cuMemGetAllocationGranularity, (size_t* gran, const CUmemAllocationProp* prop, int option),
      (gran, prop, option)) {
  NEED_CONTEXT();
  CUresult rc = check_prop(prop);
  if (rc != OK) return rc;
  if (option != 0 && option != 1) return INVALID_VALUE;
  *gran = GRANULARITY;
  return OK;
}

ENTRY(cuMemAddressReserve,
      (CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr addr, unsigned long long flags),
      (ptr, size, alignment, addr, flags)) {
  NEED_CONTEXT();
  const size_t hp = host_page();
  if (size == 0 || size % hp || addr % hp || flags != 0) return INVALID_VALUE;
  if (alignment & (alignment - 1)) return INVALID_VALUE; /* a power of two, or 0 */
  /* Alignment 0: only the host page is promised, and that is all we give. */
  const size_t align = alignment > hp ? alignment : hp;
  const size_t skew = alignment == 0 ? hp : 0;
  const size_t span = size + align + skew + GRANULARITY;
  void* p = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return OUT_OF_MEMORY;
  uintptr_t base = ((uintptr_t)p + GRANULARITY - 1) / GRANULARITY * GRANULARITY;
  base = (base + align - 1) / align * align + skew;
  struct reservation* r = calloc(1, sizeof *r);
  r->base = base;
  r->size = size;
  r->mapping_base = (uintptr_t)p;
  r->mapping_size = span;
  r->next = g_reservations;
  g_reservations = r;
  *ptr = base;
  return OK;
}

static struct allocation* mapping_in(uintptr_t lo, uintptr_t hi) {
  for (struct allocation* a = g_allocations; a; a = a->next) {
    if (a->mapped_at && a->mapped_at < hi && a->mapped_at + a->size > lo) return a;
  }
  return NULL;
}

ENTRY(cuMemAddressFree, (CUdeviceptr ptr, size_t size), (ptr, size)) {
  NEED_CONTEXT();
  for (struct reservation** pp = &g_reservations; *pp; pp = &(*pp)->next) {
    struct reservation* r = *pp;
    if (r->base != ptr || r->size != size) continue;
    if (mapping_in(ptr, ptr + size)) {
      g_violations++;
      return INVALID_VALUE;
    }
    *pp = r->next;
    munmap((void*)r->mapping_base, r->mapping_size);
    free(r);
    return OK;
  }
  return INVALID_VALUE;
}

static struct allocation* find_handle(CUmemGenericAllocationHandle handle) {
  for (struct allocation* a = g_allocations; a; a = a->next) {
    if ((CUmemGenericAllocationHandle)(uintptr_t)a == handle && !a->released) return a;
  }
  return NULL;
}

static void free_if_unused(struct allocation* a) {
  if (!a->released || a->mapped_at) return;
  for (struct allocation** pp = &g_allocations; *pp; pp = &(*pp)->next) {
    if (*pp == a) {
      *pp = a->next;
      break;
    }
  }
  if (g_budget >= 0) g_budget += (long long)a->size;
  free(a);
}

ENTRY(cuMemCreate,
      (CUmemGenericAllocationHandle* out, size_t size, const CUmemAllocationProp* prop,
       unsigned long long flags),
      (out, size, prop, flags)) {
  NEED_CONTEXT();
  CUresult rc = check_prop(prop);
  if (rc != OK) return rc;
  if (size == 0 || size % GRANULARITY || flags != 0) return INVALID_VALUE;
  if (g_budget >= 0) {
    if ((long long)size > g_budget) return OUT_OF_MEMORY;
    g_budget -= (long long)size;
  }
  struct allocation* a = calloc(1, sizeof *a);
  a->size = size;
  a->ordinal = prop->location.id;
  a->next = g_allocations;
  g_allocations = a;
  *out = (CUmemGenericAllocationHandle)(uintptr_t)a;
  return OK;
}

ENTRY(cuMemRelease, (CUmemGenericAllocationHandle handle), (handle)) {
  NEED_CONTEXT();
  struct allocation* a = find_handle(handle);
  if (a == NULL) return INVALID_VALUE;
  a->released = 1; /* a mapping keeps the memory alive until it is unmapped */
  free_if_unused(a);
  return OK;
}

static struct reservation* reservation_holding(uintptr_t lo, uintptr_t hi) {
  for (struct reservation* r = g_reservations; r; r = r->next) {
    if (lo >= r->base && hi <= r->base + r->size && lo < hi) return r;
  }
  return NULL;
}

ENTRY(cuMemMap,
      (CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
       unsigned long long flags),
      (ptr, size, offset, handle, flags)) {
  NEED_CONTEXT();
  struct allocation* a = find_handle(handle);
  if (a == NULL || a->mapped_at || offset != 0 || flags != 0) return INVALID_VALUE;
  if (size == 0 || size % GRANULARITY || size > a->size || ptr % GRANULARITY) return INVALID_VALUE;
  if (reservation_holding(ptr, ptr + size) == NULL || mapping_in(ptr, ptr + size)) {
    return INVALID_VALUE;
  }
  /* Mapped but not yet accessible: the backend must call cuMemSetAccess. */
  void* p = mmap((void*)(uintptr_t)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
  if (p == MAP_FAILED) return OUT_OF_MEMORY;
  a->mapped_at = ptr;
  return OK;
}

ENTRY(cuMemSetAccess, (CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count),
      (ptr, size, desc, count)) {
  NEED_CONTEXT();
  if (desc == NULL || count == 0 || size == 0) return INVALID_VALUE;
  int prot = PROT_NONE;
  for (size_t i = 0; i < count; i++) {
    if (desc[i].location.type != LOCATION_DEVICE) return INVALID_VALUE;
    if (desc[i].location.id < 0 || desc[i].location.id >= g_devices) return INVALID_DEVICE;
    if (desc[i].flags == ACCESS_READWRITE) {
      prot = PROT_READ | PROT_WRITE;
    } else if (desc[i].flags == ACCESS_READ) {
      prot = PROT_READ;
    } else if (desc[i].flags != ACCESS_NONE) {
      return INVALID_VALUE;
    }
  }
  /* The whole range must be mapped, granule by granule. */
  for (uintptr_t g = ptr; g < ptr + size; g += GRANULARITY) {
    if (mapping_in(g, g + 1) == NULL) return INVALID_VALUE;
  }
  return mprotect((void*)(uintptr_t)ptr, size, prot) == 0 ? OK : INVALID_VALUE;
}

ENTRY(cuMemUnmap, (CUdeviceptr ptr, size_t size), (ptr, size)) {
  NEED_CONTEXT();
  struct allocation* a = mapping_in(ptr, ptr + 1);
  if (a == NULL || a->mapped_at != ptr || size != a->size) return INVALID_VALUE;
  void* p = mmap((void*)(uintptr_t)ptr, size, PROT_NONE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return INVALID_VALUE;
  a->mapped_at = 0;
  free_if_unused(a);
  return OK;
}
