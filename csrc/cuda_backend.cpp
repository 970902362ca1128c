// CUDA page backend over the driver's virtual memory management API.
//
// Built only when cuda.h was found at build time (KVPAGES_WITH_CUDA). Even
// then nothing links against libcuda: it is dlopen'ed on first use, so one
// build imports and runs its CPU backend on a machine without a GPU or
// driver, and reports the CUDA backend as unavailable there.
//
// Pages of a CUDA range are NOT zeroed on map: cuMemCreate returns whatever
// the physical memory last held (KV blocks are always written before read).
#include "backend.h"

#ifdef KVPAGES_WITH_CUDA

#include <cuda.h>
#include <dlfcn.h>

#include <mutex>
#include <vector>

namespace kvpages {
namespace {

#define KVP_STR2(x) #x
// Expands the macro first: cuda.h maps some names to versioned symbols
// (cuCtxPushCurrent -> cuCtxPushCurrent_v2), and dlsym needs the real one.
#define KVP_STR(x) KVP_STR2(x)

// Function pointers into libcuda.so.1, typed from the declarations in cuda.h.
struct Driver {
#define KVP_FN(name) decltype(&name) name##_ = nullptr;
  KVP_FN(cuInit)
  KVP_FN(cuGetErrorName)
  KVP_FN(cuDeviceGet)
  KVP_FN(cuDeviceGetCount)
  KVP_FN(cuDevicePrimaryCtxRetain)
  KVP_FN(cuDevicePrimaryCtxRelease)
  KVP_FN(cuCtxPushCurrent)
  KVP_FN(cuCtxPopCurrent)
  KVP_FN(cuMemGetAllocationGranularity)
  KVP_FN(cuMemAddressReserve)
  KVP_FN(cuMemAddressFree)
  KVP_FN(cuMemCreate)
  KVP_FN(cuMemRelease)
  KVP_FN(cuMemMap)
  KVP_FN(cuMemUnmap)
  KVP_FN(cuMemSetAccess)
#undef KVP_FN

  bool loaded = false;
  std::string load_error;
};

Driver g_driver;
std::once_flag g_driver_once;

void load_driver() {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    g_driver.load_error =
        std::string("cannot load libcuda.so.1: ") + (why ? why : "unknown");
    return;
  }
#define KVP_LOAD(name)                                                     \
  g_driver.name##_ =                                                       \
      reinterpret_cast<decltype(&name)>(dlsym(lib, KVP_STR(name)));        \
  if (g_driver.name##_ == nullptr) {                                       \
    g_driver.load_error = "libcuda.so.1 lacks " KVP_STR(name);             \
    return;                                                                \
  }
  KVP_LOAD(cuInit)
  KVP_LOAD(cuGetErrorName)
  KVP_LOAD(cuDeviceGet)
  KVP_LOAD(cuDeviceGetCount)
  KVP_LOAD(cuDevicePrimaryCtxRetain)
  KVP_LOAD(cuDevicePrimaryCtxRelease)
  KVP_LOAD(cuCtxPushCurrent)
  KVP_LOAD(cuCtxPopCurrent)
  KVP_LOAD(cuMemGetAllocationGranularity)
  KVP_LOAD(cuMemAddressReserve)
  KVP_LOAD(cuMemAddressFree)
  KVP_LOAD(cuMemCreate)
  KVP_LOAD(cuMemRelease)
  KVP_LOAD(cuMemMap)
  KVP_LOAD(cuMemUnmap)
  KVP_LOAD(cuMemSetAccess)
#undef KVP_LOAD
  // The library stays loaded for the life of the process: ranges may outlive
  // any handle we could close it with.
  g_driver.loaded = true;
}

Status cuda_status(CUresult rc, const std::string& what) {
  Status s;
  s.kind = Status::Kind::kCuda;
  s.errnum = static_cast<int>(rc);
  const char* name = nullptr;
  if (g_driver.cuGetErrorName_ == nullptr ||
      g_driver.cuGetErrorName_(rc, &name) != CUDA_SUCCESS || name == nullptr) {
    s.cuda_name = "CUresult " + std::to_string(static_cast<int>(rc));
  } else {
    s.cuda_name = name;
  }
  s.message = what + ": " + s.cuda_name;
  return s;
}

// Loads and initialises the driver once; afterwards returns the cached result.
Status driver() {
  std::call_once(g_driver_once, load_driver);
  if (!g_driver.loaded) return Status::CudaUnavailable(g_driver.load_error);
  CUresult rc = g_driver.cuInit_(0);
  if (rc != CUDA_SUCCESS) return cuda_status(rc, "cuInit");
  return Status::Ok();
}

// Makes the device's primary context current for one operation, so that the
// range works whichever context (or none) the calling thread has current.
class ContextScope {
 public:
  explicit ContextScope(CUcontext ctx) {
    rc_ = g_driver.cuCtxPushCurrent_(ctx);
  }
  ~ContextScope() {
    if (rc_ == CUDA_SUCCESS) {
      CUcontext popped;
      g_driver.cuCtxPopCurrent_(&popped);
    }
  }
  CUresult rc() const { return rc_; }

 private:
  CUresult rc_;
};

class CudaBackend final : public Backend {
 public:
  CudaBackend(CUdevice dev, CUcontext ctx, std::size_t num_pages,
              std::size_t page_size)
      : dev_(dev), ctx_(ctx), page_size_(page_size),
        handles_(num_pages, 0), mapped_(num_pages, false) {
    prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop_.location.id = static_cast<int>(dev);
    access_.location = prop_.location;
    access_.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }

  ~CudaBackend() override {
    ContextScope scope(ctx_);
    for (std::size_t i = 0; i < mapped_.size(); ++i) {
      if (mapped_[i]) unmap(i);
    }
    if (base_ != 0) g_driver.cuMemAddressFree_(base_, total());
    g_driver.cuDevicePrimaryCtxRelease_(dev_);
  }

  Status reserve() {
    ContextScope scope(ctx_);
    if (scope.rc() != CUDA_SUCCESS) {
      return cuda_status(scope.rc(), "cuCtxPushCurrent");
    }
    std::size_t gran = 0;
    CUresult rc = g_driver.cuMemGetAllocationGranularity_(
        &gran, &prop_, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    if (rc != CUDA_SUCCESS) {
      return cuda_status(rc, "cuMemGetAllocationGranularity");
    }
    Status st = check_geometry(handles_.size(), page_size_, gran,
                               "CUDA allocation granularity");
    if (!st.ok()) return st;
    // Alignment 0: the driver's default (the granularity). The page size need
    // not be a power of two, and an alignment must be.
    rc = g_driver.cuMemAddressReserve_(&base_, total(), 0, 0, 0);
    if (rc != CUDA_SUCCESS) {
      base_ = 0;
      return cuda_status(rc, "cuMemAddressReserve");
    }
    return Status::Ok();
  }

  std::uintptr_t base() const override {
    return static_cast<std::uintptr_t>(base_);
  }
  bool host_accessible() const override { return false; }

  Status map(std::size_t index) override {
    ContextScope scope(ctx_);
    if (scope.rc() != CUDA_SUCCESS) {
      return cuda_status(scope.rc(), "cuCtxPushCurrent");
    }
    const std::string page = " (page " + std::to_string(index) + ")";
    const CUdeviceptr addr = base_ + index * page_size_;
    CUmemGenericAllocationHandle handle = 0;
    CUresult rc = g_driver.cuMemCreate_(&handle, page_size_, &prop_, 0);
    if (rc != CUDA_SUCCESS) return cuda_status(rc, "cuMemCreate" + page);
    rc = g_driver.cuMemMap_(addr, page_size_, 0, handle, 0);
    if (rc != CUDA_SUCCESS) {
      g_driver.cuMemRelease_(handle);
      return cuda_status(rc, "cuMemMap" + page);
    }
    rc = g_driver.cuMemSetAccess_(addr, page_size_, &access_, 1);
    if (rc != CUDA_SUCCESS) {
      g_driver.cuMemUnmap_(addr, page_size_);
      g_driver.cuMemRelease_(handle);
      return cuda_status(rc, "cuMemSetAccess" + page);
    }
    handles_[index] = handle;
    mapped_[index] = true;
    return Status::Ok();
  }

  Status unmap(std::size_t index) override {
    ContextScope scope(ctx_);
    if (scope.rc() != CUDA_SUCCESS) {
      return cuda_status(scope.rc(), "cuCtxPushCurrent");
    }
    const std::string page = " (page " + std::to_string(index) + ")";
    CUresult rc = g_driver.cuMemUnmap_(base_ + index * page_size_, page_size_);
    if (rc != CUDA_SUCCESS) return cuda_status(rc, "cuMemUnmap" + page);
    mapped_[index] = false;
    // The physical memory is freed once it is both unmapped and released.
    rc = g_driver.cuMemRelease_(handles_[index]);
    handles_[index] = 0;
    if (rc != CUDA_SUCCESS) return cuda_status(rc, "cuMemRelease" + page);
    return Status::Ok();
  }

 private:
  std::size_t total() const { return handles_.size() * page_size_; }

  CUdevice dev_;
  CUcontext ctx_;
  std::size_t page_size_;
  CUdeviceptr base_ = 0;
  CUmemAllocationProp prop_{};
  CUmemAccessDesc access_{};
  std::vector<CUmemGenericAllocationHandle> handles_;
  std::vector<bool> mapped_;
};

}  // namespace

bool cuda_built() { return true; }

int cuda_device_count(std::string* why_none) {
  Status st = driver();
  if (!st.ok()) {
    if (why_none) *why_none = st.message;
    return 0;
  }
  int count = 0;
  CUresult rc = g_driver.cuDeviceGetCount_(&count);
  if (rc != CUDA_SUCCESS) {
    if (why_none) *why_none = cuda_status(rc, "cuDeviceGetCount").message;
    return 0;
  }
  if (count == 0 && why_none) *why_none = "no CUDA device";
  return count;
}

Status make_cuda_backend(std::size_t num_pages, std::size_t page_size,
                         int device, std::unique_ptr<Backend>* out) {
  Status st = driver();
  if (!st.ok()) return st;
  CUdevice dev;
  CUresult rc = g_driver.cuDeviceGet_(&dev, device);
  if (rc != CUDA_SUCCESS) {
    return cuda_status(rc, "cuDeviceGet(" + std::to_string(device) + ")");
  }
  CUcontext ctx;
  rc = g_driver.cuDevicePrimaryCtxRetain_(&ctx, dev);
  if (rc != CUDA_SUCCESS) return cuda_status(rc, "cuDevicePrimaryCtxRetain");
  // From here the backend's destructor releases the primary context.
  auto backend = std::make_unique<CudaBackend>(dev, ctx, num_pages, page_size);
  st = backend->reserve();
  if (!st.ok()) return st;
  *out = std::move(backend);
  return Status::Ok();
}

}  // namespace kvpages

#else  // !KVPAGES_WITH_CUDA

namespace kvpages {

bool cuda_built() { return false; }

int cuda_device_count(std::string* why_none) {
  if (why_none) *why_none = "built without CUDA support (cuda.h not found)";
  return 0;
}

Status make_cuda_backend(std::size_t, std::size_t, int,
                         std::unique_ptr<Backend>*) {
  return Status::CudaUnavailable(
      "kvcached._kvpages was built without CUDA support (cuda.h not found "
      "at build time)");
}

}  // namespace kvpages

#endif  // KVPAGES_WITH_CUDA
