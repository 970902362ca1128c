/* A stand-in libcuda.so.1 for testing the extension's CUDA plumbing without a GPU.
 *
 * It implements the driver entry points the CUDA backend resolves with dlsym,
 * backing "device" memory with host memory so that a test can see where pages
 * were mapped. It checks what a real driver would reject (unreserved ranges,
 * double maps, unbalanced contexts) and counts live handles, retained
 * contexts and pushed contexts so that a test can see nothing leaks.
 *
 * It is NOT a model of CUDA: it proves that the extension loads libcuda at
 * run time, calls the right symbols, maps pages at the right addresses,
 * unwinds on errors and reports CUresult names. Only a run on a real GPU
 * (tests/ext/test_kvpages_cuda.py) proves the backend itself.
 *
 * Environment: FAKE_CUDA_NO_DEVICE=1 makes cuInit fail with
 * CUDA_ERROR_NO_DEVICE; FAKE_CUDA_MEM_BYTES caps what cuMemCreate hands out
 * (CUDA_ERROR_OUT_OF_MEMORY past it).
 *
 * Built by the test: cc -shared -fPIC -o libcuda.so.1 fake_libcuda.c
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef void* CUcontext;

enum {
  OK = 0,
  INVALID_VALUE = 1,
  OUT_OF_MEMORY = 2,
  NOT_INITIALIZED = 3,
  NO_DEVICE = 100,
  INVALID_DEVICE = 101,
  INVALID_CONTEXT = 201,
};

#define GRANULARITY (2u << 20)

static int g_initialised;
static long long g_budget = -1;
static int g_live_handles;
static int g_ctx_refs;
static __thread int g_push_depth; /* contexts pushed and not popped, this thread */
static int g_ctx_dummy;

/* For the test, through ctypes; single-threaded use only, like the whole fake. */
void fake_cuda_counters(int* live_handles, int* ctx_refs, int* push_depth) {
  *live_handles = g_live_handles;
  *ctx_refs = g_ctx_refs;
  *push_depth = g_push_depth;
}

CUresult cuInit(unsigned int flags) {
  (void)flags;
  const char* nodev = getenv("FAKE_CUDA_NO_DEVICE");
  if (nodev && *nodev == '1') return NO_DEVICE;
  const char* mem = getenv("FAKE_CUDA_MEM_BYTES");
  if (!g_initialised && mem) g_budget = atoll(mem);
  g_initialised = 1;
  return OK;
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

CUresult cuDeviceGetCount(int* count) {
  if (!g_initialised) return NOT_INITIALIZED;
  *count = 1;
  return OK;
}

CUresult cuDeviceGet(CUdevice* dev, int ordinal) {
  if (!g_initialised) return NOT_INITIALIZED;
  if (ordinal != 0) return INVALID_DEVICE;
  *dev = 0;
  return OK;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext* ctx, CUdevice dev) {
  if (dev != 0) return INVALID_DEVICE;
  g_ctx_refs++;
  *ctx = &g_ctx_dummy;
  return OK;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
  if (dev != 0 || g_ctx_refs == 0) return INVALID_CONTEXT;
  g_ctx_refs--;
  return OK;
}

CUresult cuCtxPushCurrent_v2(CUcontext ctx) {
  if (ctx != &g_ctx_dummy || g_ctx_refs == 0) return INVALID_CONTEXT;
  g_push_depth++;
  return OK;
}

CUresult cuCtxPopCurrent_v2(CUcontext* ctx) {
  if (g_push_depth == 0) return INVALID_CONTEXT;
  g_push_depth--;
  *ctx = &g_ctx_dummy;
  return OK;
}

/* Every memory call below needs a current context, as the real driver does. */
#define NEED_CONTEXT() \
  do {                 \
    if (g_push_depth == 0) return INVALID_CONTEXT; \
  } while (0)

CUresult cuMemGetAllocationGranularity(size_t* gran, const void* prop, int option) {
  (void)prop;
  (void)option;
  NEED_CONTEXT();
  *gran = GRANULARITY;
  return OK;
}

CUresult cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags) {
  (void)alignment;
  (void)addr;
  (void)flags;
  NEED_CONTEXT();
  if (size == 0 || size % GRANULARITY) return INVALID_VALUE;
  void* p = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return OUT_OF_MEMORY;
  *ptr = (CUdeviceptr)(uintptr_t)p;
  return OK;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  NEED_CONTEXT();
  return munmap((void*)(uintptr_t)ptr, size) == 0 ? OK : INVALID_VALUE;
}

struct handle {
  size_t size;
  CUdeviceptr mapped_at; /* 0 when not mapped */
  struct handle* next;   /* every live handle, so cuMemUnmap can find its owner */
};

static struct handle* g_handles;

CUresult cuMemCreate(CUmemGenericAllocationHandle* out, size_t size, const void* prop,
                     unsigned long long flags) {
  (void)prop;
  (void)flags;
  NEED_CONTEXT();
  if (size == 0 || size % GRANULARITY) return INVALID_VALUE;
  if (g_budget >= 0) {
    if ((long long)size > g_budget) return OUT_OF_MEMORY;
    g_budget -= (long long)size;
  }
  struct handle* h = calloc(1, sizeof *h);
  h->size = size;
  h->next = g_handles;
  g_handles = h;
  g_live_handles++;
  *out = (CUmemGenericAllocationHandle)(uintptr_t)h;
  return OK;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
  NEED_CONTEXT();
  struct handle* h = (struct handle*)(uintptr_t)handle;
  if (h == NULL || h->mapped_at) return INVALID_VALUE;
  if (g_budget >= 0) g_budget += (long long)h->size;
  for (struct handle** pp = &g_handles; *pp; pp = &(*pp)->next) {
    if (*pp == h) {
      *pp = h->next;
      break;
    }
  }
  free(h);
  g_live_handles--;
  return OK;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags) {
  (void)flags;
  NEED_CONTEXT();
  struct handle* h = (struct handle*)(uintptr_t)handle;
  if (h == NULL || h->mapped_at || offset != 0 || size != h->size) return INVALID_VALUE;
  /* Mapped but not yet accessible: the backend must call cuMemSetAccess. */
  void* p = mmap((void*)(uintptr_t)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
  if (p == MAP_FAILED) return INVALID_VALUE;
  h->mapped_at = ptr;
  return OK;
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const void* desc, size_t count) {
  (void)desc;
  NEED_CONTEXT();
  if (count != 1) return INVALID_VALUE;
  return mprotect((void*)(uintptr_t)ptr, size, PROT_READ | PROT_WRITE) == 0 ? OK : INVALID_VALUE;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  NEED_CONTEXT();
  struct handle* h = g_handles;
  while (h && h->mapped_at != ptr) h = h->next;
  if (h == NULL || h->size != size) return INVALID_VALUE;
  h->mapped_at = 0;
  void* p = mmap((void*)(uintptr_t)ptr, size, PROT_NONE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  return p == MAP_FAILED ? INVALID_VALUE : OK;
}
