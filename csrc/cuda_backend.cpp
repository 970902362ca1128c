// CUDA page backend over the driver's virtual memory management API.
//
// Built only when cuda.h was found at build time (KVPAGES_WITH_CUDA). Even
// then nothing links against libcuda: it is dlopen'ed on first use, so one
// build imports and runs its CPU backend on a machine without a GPU or
// driver, and reports the CUDA backend as unavailable there.
//
// Pages of a CUDA range are NOT zeroed on map: cuMemCreate returns whatever
// the physical memory last held (KV blocks are always written before read).
//
// A page's allocation handle is released as soon as the page is mapped: the
// mapping alone keeps the memory alive (cuMemRelease documents this), so an
// unmap frees it and no handle is left to leak or to fail a later release.
//
// CUDA is not fork-safe: a child forked after cuInit cannot use the driver,
// and the parent's ranges mean nothing there. A range remembers the process
// that created it; in any other process it makes no driver call at all.
#include "backend.h"

#ifdef KVPAGES_WITH_CUDA

#include <cuda.h>
#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <mutex>
#include <set>
#include <vector>

namespace kvpages {
namespace {

#define KVP_STR2(x) #x
// Expands the macro first: cuda.h maps some names to versioned symbols
// (cuCtxPushCurrent -> cuCtxPushCurrent_v2), and dlsym needs the real one.
#define KVP_STR(x) KVP_STR2(x)

// Function pointers into libcuda.so.1, typed from the declarations in cuda.h.
#define KVP_DRIVER_FUNCTIONS(X)      \
  X(cuInit)                          \
  X(cuGetErrorName)                  \
  X(cuDeviceGet)                     \
  X(cuDeviceGetCount)                \
  X(cuDevicePrimaryCtxRetain)        \
  X(cuDevicePrimaryCtxRelease)       \
  X(cuCtxPushCurrent)                \
  X(cuCtxPopCurrent)                 \
  X(cuCtxGetCurrent)                 \
  X(cuCtxGetDevice)                  \
  X(cuMemGetAllocationGranularity)   \
  X(cuMemAddressReserve)             \
  X(cuMemAddressFree)                \
  X(cuMemCreate)                     \
  X(cuMemRelease)                    \
  X(cuMemMap)                        \
  X(cuMemUnmap)                      \
  X(cuMemSetAccess)

struct Driver {
#define KVP_FN(name) decltype(&name) name##_ = nullptr;
  KVP_DRIVER_FUNCTIONS(KVP_FN)
#undef KVP_FN

  bool loaded = false;
  std::string load_error;
  // The process whose cuInit succeeded, 0 before: a forked child inherits
  // this and learns from it that the driver is not usable there.
  pid_t init_pid = 0;
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
  KVP_DRIVER_FUNCTIONS(KVP_LOAD)
#undef KVP_LOAD
  // The library stays loaded for the life of the process: ranges may outlive
  // any handle we could close it with.
  g_driver.loaded = true;
}

// Loads libcuda once; loading initialises nothing (cuInit is separate).
bool load() {
  std::call_once(g_driver_once, load_driver);
  return g_driver.loaded;
}

// Whether libcuda.so.1 is in this process already (we or anyone else loaded
// it). Where it is not, nobody can have initialised CUDA here, and loading it
// only to ask would put the driver into a process that may fork: a child
// forked from it crashed in its first CUDA call on an H200 (gpu-check).
bool driver_in_process() {
  if (g_driver.loaded) return true;
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
  if (lib == nullptr) return false;
  dlclose(lib);  // drops only the reference RTLD_NOLOAD took
  return true;
}

bool forked_after_init() {
  return g_driver.init_pid != 0 && g_driver.init_pid != getpid();
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

// Loads and initialises the driver (cuInit is cheap after the first time).
Status driver() {
  if (!load()) return Status::CudaUnavailable(g_driver.load_error);
  CUresult rc = g_driver.cuInit_(0);
  if (rc != CUDA_SUCCESS) return cuda_status(rc, "cuInit");
  if (g_driver.init_pid == 0) g_driver.init_pid = getpid();
  return Status::Ok();
}

// The ordinal of a CUdevice handle. The driver API keeps the two apart
// (cuDeviceGet maps ordinal -> handle), and allocation locations take the
// ordinal, so the handle is looked up rather than assumed equal.
int ordinal_of(CUdevice dev) {
  int count = 0;
  if (g_driver.cuDeviceGetCount_(&count) != CUDA_SUCCESS) return -1;
  for (int i = 0; i < count; ++i) {
    CUdevice d;
    if (g_driver.cuDeviceGet_(&d, i) == CUDA_SUCCESS && d == dev) return i;
  }
  return -1;
}

std::string page_list(const std::vector<std::size_t>& pages) {
  std::string out = "[";
  for (std::size_t k = 0; k < pages.size(); ++k) {
    if (k != 0) out += ", ";
    out += std::to_string(pages[k]);
  }
  return out + "]";
}

// --- Counting devices without cuInit ---------------------------------------
//
// cuInit in a process that later forks leaves the children unable to use
// CUDA (every driver call there fails with CUDA_ERROR_NOT_INITIALIZED), and
// torch cannot see that it happened: vLLM decides whether it may fork its
// workers from torch.cuda.is_initialized(). So counting devices must not
// initialise the driver. The NVIDIA kernel module lists every GPU it drives
// under /proc/driver/nvidia/gpus (a container runtime exposes only the GPUs
// given to the container), and CUDA_VISIBLE_DEVICES narrows that list the way
// CUDA does. Only where that listing is absent (some sandboxes) does counting
// fall back to cuInit, because a wrong "no device" would be worse there.

const char* gpus_dir() {
  // Overridable so that tests can present a listing; sandboxes may need it.
  const char* dir = std::getenv("KVCACHED_NVIDIA_GPUS_DIR");
  return dir != nullptr && *dir != '\0' ? dir : "/proc/driver/nvidia/gpus";
}

// The "GPU UUID:" line of one listing entry ("" when unreadable). Plain read(2),
// not an ifstream: a process that had used iostreams here crashed (SIGSEGV) in
// a forked child's first CUDA call through torch on an H200 (gpu-check), and
// counting devices must leave a process fit to fork CUDA workers.
std::string gpu_uuid(const std::string& path) {
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "";
  char buf[4096];
  ssize_t n = read(fd, buf, sizeof(buf) - 1);
  close(fd);
  if (n <= 0) return "";
  std::string text(buf, static_cast<std::size_t>(n));
  std::size_t at = text.find("GPU UUID:");
  if (at == std::string::npos) return "";
  std::size_t end = text.find('\n', at);
  std::string uuid = text.substr(at + 9, end == std::string::npos ? std::string::npos : end - at - 9);
  uuid.erase(0, uuid.find_first_not_of(" \t"));
  uuid.erase(uuid.find_last_not_of(" \t\r") + 1);
  return uuid;
}

// The GPUs of the listing, each by its UUID ("" when unreadable); false when
// there is no listing to read.
bool listed_gpus(std::vector<std::string>* uuids) {
  DIR* dir = opendir(gpus_dir());
  if (dir == nullptr) return false;
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] == '.') continue;
    uuids->push_back(gpu_uuid(std::string(gpus_dir()) + "/" + e->d_name + "/information"));
  }
  closedir(dir);
  return true;
}

// How many of the listed GPUs CUDA_VISIBLE_DEVICES leaves visible. Like CUDA,
// the list ends at the first entry that names no device (out of range, a
// repeat, an unknown UUID, or anything else); an unset variable shows all.
int visible_count(const std::vector<std::string>& uuids) {
  const char* env = std::getenv("CUDA_VISIBLE_DEVICES");
  if (env == nullptr) return static_cast<int>(uuids.size());
  const bool uuids_known = std::any_of(uuids.begin(), uuids.end(),
                                       [](const std::string& u) { return !u.empty(); });
  std::set<std::size_t> seen;
  int count = 0;
  std::string list(env);
  std::size_t pos = 0;
  while (pos <= list.size()) {
    std::size_t comma = list.find(',', pos);
    if (comma == std::string::npos) comma = list.size();
    std::string token = list.substr(pos, comma - pos);
    pos = comma + 1;
    token.erase(0, token.find_first_not_of(" \t"));
    token.erase(token.find_last_not_of(" \t") + 1);
    std::size_t index = uuids.size();
    if (!token.empty() && token.size() < 10 &&
        std::all_of(token.begin(), token.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); })) {
      index = std::stoul(token);
    } else if (token.rfind("GPU-", 0) == 0 && uuids_known) {
      // CUDA accepts any unique prefix of a UUID.
      std::size_t matches = 0;
      for (std::size_t i = 0; i < uuids.size(); ++i) {
        if (uuids[i].rfind(token, 0) == 0) {
          index = i;
          ++matches;
        }
      }
      if (matches != 1) index = uuids.size();
    } else if (token.rfind("GPU-", 0) == 0 || token.rfind("MIG-", 0) == 0) {
      // Unverifiable without NVML (a MIG instance) or without UUIDs to
      // compare with: counted as the device it claims to be.
      ++count;
      continue;
    }
    if (index >= uuids.size() || !seen.insert(index).second) break;
    ++count;
  }
  return count;
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
  CudaBackend(int ordinal, CUdevice dev, CUcontext ctx, std::size_t num_pages,
              std::size_t page_size)
      : dev_(dev), ctx_(ctx), num_pages_(num_pages), page_size_(page_size),
        owner_pid_(getpid()) {
    prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    // A device ordinal, not the CUdevice handle (the two need not agree).
    prop_.location.id = ordinal;
    access_.location = prop_.location;
    access_.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }

  // Reached without teardown only when reserve() failed: nothing is mapped.
  ~CudaBackend() override { teardown(nullptr); }

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
    Status st = check_geometry(num_pages_, page_size_, gran,
                               "CUDA allocation granularity");
    if (!st.ok()) return st;
    // cuMemMap needs every page address to be a multiple of the granularity,
    // and alignment 0 promises only the driver's unspecified default; the
    // granularity is a power of two, as an alignment must be.
    rc = g_driver.cuMemAddressReserve_(&base_, total(), gran, 0, 0);
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
  bool owned_by_this_process() const override { return getpid() == owner_pid_; }

  Status map(std::size_t index) override {
    ContextScope scope(ctx_);
    if (scope.rc() != CUDA_SUCCESS) {
      return cuda_status(scope.rc(), "cuCtxPushCurrent");
    }
    const std::string page = " (page " + std::to_string(index) + ")";
    const CUdeviceptr addr = address(index);
    CUmemGenericAllocationHandle handle = 0;
    CUresult rc = g_driver.cuMemCreate_(&handle, page_size_, &prop_, 0);
    if (rc != CUDA_SUCCESS) return cuda_status(rc, "cuMemCreate" + page);
    rc = g_driver.cuMemMap_(addr, page_size_, 0, handle, 0);
    if (rc != CUDA_SUCCESS) {
      g_driver.cuMemRelease_(handle);
      return cuda_status(rc, "cuMemMap" + page);
    }
    rc = g_driver.cuMemSetAccess_(addr, page_size_, &access_, 1);
    if (rc == CUDA_SUCCESS) {
      rc = g_driver.cuMemRelease_(handle);
      if (rc == CUDA_SUCCESS) return Status::Ok();
      // The handle cannot be given back, so the page would hold memory that
      // nothing can ever free: undo the map and report the failure.
      g_driver.cuMemUnmap_(addr, page_size_);
      return cuda_status(rc, "cuMemRelease" + page);
    }
    g_driver.cuMemUnmap_(addr, page_size_);
    g_driver.cuMemRelease_(handle);
    return cuda_status(rc, "cuMemSetAccess" + page);
  }

  Status unmap(std::size_t index) override {
    ContextScope scope(ctx_);
    if (scope.rc() != CUDA_SUCCESS) {
      return cuda_status(scope.rc(), "cuCtxPushCurrent");
    }
    // The handle was released at map time: unmapping frees the memory.
    CUresult rc = g_driver.cuMemUnmap_(address(index), page_size_);
    if (rc != CUDA_SUCCESS) {
      return cuda_status(rc, "cuMemUnmap (page " + std::to_string(index) + ")");
    }
    return Status::Ok();
  }

  Status teardown(std::vector<unsigned char>* mapped) override {
    if (torn_down_) return Status::Ok();
    torn_down_ = true;
    // In a forked child every driver call would fail or, worse, act on the
    // parent's context: the parent still owns the range and frees it.
    if (!owned_by_this_process()) return Status::Ok();
    Status first;
    std::vector<std::size_t> stuck;
    {
      ContextScope scope(ctx_);
      const bool pushed = scope.rc() == CUDA_SUCCESS;
      if (!pushed) first = cuda_status(scope.rc(), "cuCtxPushCurrent");
      for (std::size_t i = 0; mapped != nullptr && i < mapped->size(); ++i) {
        if ((*mapped)[i] == 0) continue;
        Status st = pushed ? unmap(i) : first;
        if (st.ok()) {
          (*mapped)[i] = 0;
          continue;
        }
        stuck.push_back(i);
        if (first.ok()) first = st;
      }
      if (pushed && stuck.empty() && base_ != 0) {
        CUresult rc = g_driver.cuMemAddressFree_(base_, total());
        if (rc != CUDA_SUCCESS) first = cuda_status(rc, "cuMemAddressFree");
      }
      base_ = 0;
    }  // Popped before the release below: releasing the last reference resets
       // the primary context, and the driver does not pop it for us.
    if (!stuck.empty()) {
      // The mappings outlive us, so the reservation and the context that
      // holds them stay too: a leak, reported, instead of addresses that the
      // next reservation could be given while the memory is still mapped.
      first.message = "kept the range reserved (leaked): page(s) " +
                      page_list(stuck) + " are still mapped: " + first.message;
      return first;
    }
    CUresult rc = g_driver.cuDevicePrimaryCtxRelease_(dev_);
    if (rc != CUDA_SUCCESS && first.ok()) {
      first = cuda_status(rc, "cuDevicePrimaryCtxRelease");
    }
    return first;
  }

 private:
  std::size_t total() const { return num_pages_ * page_size_; }
  CUdeviceptr address(std::size_t index) const { return base_ + index * page_size_; }

  CUdevice dev_;
  CUcontext ctx_;
  std::size_t num_pages_;
  std::size_t page_size_;
  pid_t owner_pid_;
  bool torn_down_ = false;
  CUdeviceptr base_ = 0;
  CUmemAllocationProp prop_{};
  CUmemAccessDesc access_{};
};

}  // namespace

bool cuda_built() { return true; }

static std::string none_visible(const std::vector<std::string>& uuids) {
  const char* env = std::getenv("CUDA_VISIBLE_DEVICES");
  return "no CUDA device: " + std::to_string(uuids.size()) + " GPU(s) listed in " + gpus_dir() +
         ", none visible" + (env ? " with CUDA_VISIBLE_DEVICES=" + std::string(env) : std::string());
}

int cuda_device_count(std::string* why_none) {
  std::string why;
  int count = 0;
  std::vector<std::string> uuids;
  if (!driver_in_process() && listed_gpus(&uuids)) {
    count = visible_count(uuids);
    if (count == 0) why = none_visible(uuids);
  } else if (!load()) {
    why = g_driver.load_error;
  } else if (forked_after_init()) {
    why = "this process was forked from one that initialised CUDA (pid " +
          std::to_string(g_driver.init_pid) + "); CUDA cannot be used here";
  } else {
    // Succeeds only where the driver is initialised already: then asking
    // costs nothing and is exact.
    CUresult rc = g_driver.cuDeviceGetCount_(&count);
    uuids.clear();
    if (rc == CUDA_SUCCESS) {
      if (count == 0) why = "no CUDA device";
    } else if (rc != CUDA_ERROR_NOT_INITIALIZED) {
      why = cuda_status(rc, "cuDeviceGetCount").message;
    } else if (listed_gpus(&uuids)) {
      count = visible_count(uuids);
      if (count == 0) why = none_visible(uuids);
    } else {
      Status st = driver();
      if (!st.ok()) {
        why = st.message;
      } else if ((rc = g_driver.cuDeviceGetCount_(&count)) != CUDA_SUCCESS) {
        why = cuda_status(rc, "cuDeviceGetCount").message;
        count = 0;
      } else if (count == 0) {
        why = "no CUDA device";
      }
    }
  }
  if (count == 0 && why_none != nullptr) *why_none = why;
  return count;
}

int cuda_current_device() {
  // No driver in the process: no context can be current, and loading one to
  // find that out is what driver_in_process() avoids.
  if (!driver_in_process() || !load() || forked_after_init()) return -1;
  // Before cuInit this fails with CUDA_ERROR_NOT_INITIALIZED: then no
  // context can be current, and we must not initialise to find that out.
  CUcontext ctx = nullptr;
  if (g_driver.cuCtxGetCurrent_(&ctx) != CUDA_SUCCESS || ctx == nullptr) return -1;
  CUdevice dev;
  if (g_driver.cuCtxGetDevice_(&dev) != CUDA_SUCCESS) return -1;
  return ordinal_of(dev);
}

Status make_cuda_backend(std::size_t num_pages, std::size_t page_size,
                         int* device, std::unique_ptr<Backend>* out) {
  Status st = driver();
  if (!st.ok()) return st;
  int ordinal = *device;
  if (ordinal == kCurrentCudaDevice) ordinal = std::max(cuda_current_device(), 0);
  CUdevice dev;
  CUresult rc = g_driver.cuDeviceGet_(&dev, ordinal);
  if (rc != CUDA_SUCCESS) {
    return cuda_status(rc, "cuDeviceGet(" + std::to_string(ordinal) + ")");
  }
  CUcontext ctx;
  rc = g_driver.cuDevicePrimaryCtxRetain_(&ctx, dev);
  if (rc != CUDA_SUCCESS) return cuda_status(rc, "cuDevicePrimaryCtxRetain");
  // From here the backend's destructor releases the primary context.
  auto backend = std::make_unique<CudaBackend>(ordinal, dev, ctx, num_pages, page_size);
  st = backend->reserve();
  if (!st.ok()) return st;
  *device = ordinal;
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

int cuda_current_device() { return -1; }

Status make_cuda_backend(std::size_t, std::size_t, int*,
                         std::unique_ptr<Backend>*) {
  return Status::CudaUnavailable(
      "kvcached.runtime._kvpages was built without CUDA support (cuda.h not found "
      "at build time)");
}

}  // namespace kvpages

#endif  // KVPAGES_WITH_CUDA
