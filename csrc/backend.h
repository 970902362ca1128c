// Page backends of the kvcached._kvpages extension.
//
// A backend owns one reserved virtual range of `num_pages * page_size` bytes
// and maps or unmaps whole pages of it by index. It keeps no bookkeeping of
// which pages are mapped: the Python object (module.cpp) validates indices and
// state under its own lock before it calls in here, so a backend method is
// only ever asked to map an unmapped page or unmap a mapped one.
//
// No Python API in this file or the backends: they can be tested and reused
// without the interpreter, and they run with the GIL released.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kvpages {

// Why an operation failed, turned into a Python exception by module.cpp.
struct Status {
  enum class Kind { kOk, kOs, kCuda, kCudaUnavailable, kValue };
  Kind kind = Kind::kOk;
  int errnum = 0;         // errno (kOs) or CUresult (kCuda)
  std::string cuda_name;  // e.g. "CUDA_ERROR_OUT_OF_MEMORY" (kCuda)
  std::string message;

  bool ok() const { return kind == Kind::kOk; }
  static Status Ok() { return Status(); }
  static Status Os(int err, std::string what);
  static Status Value(std::string what);
  static Status CudaUnavailable(std::string what);
};

class Backend {
 public:
  virtual ~Backend() = default;
  // Start of the reserved range (a host address, or a CUDA device address).
  virtual std::uintptr_t base() const = 0;
  // Whether the CPU may read and write the mapped pages (buffer protocol).
  virtual bool host_accessible() const = 0;
  // False in a process other than the one that created the range (a forked
  // child): there the range must not be used, and teardown does nothing.
  virtual bool owned_by_this_process() const { return true; }
  virtual Status map(std::size_t index) = 0;
  virtual Status unmap(std::size_t index) = 0;
  // Unmaps every page flagged in `mapped` (null: none), clearing the flag of
  // each page it unmaps, then releases the range. Runs once; later calls and
  // the destructor do nothing. A range with a page still mapped afterwards is
  // not released but leaked, and the status says which pages and why:
  // freeing the addresses under a live mapping would let the next
  // reservation alias memory that is still in use.
  virtual Status teardown(std::vector<unsigned char>* mapped) = 0;
};

// Checks the common arguments: num_pages > 0, page_size a positive multiple
// of `granularity`, and num_pages * page_size without overflow.
Status check_geometry(std::size_t num_pages, std::size_t page_size,
                      std::size_t granularity, const char* granularity_name);

Status make_cpu_backend(std::size_t num_pages, std::size_t page_size,
                        std::unique_ptr<Backend>* out);

// `*device` asking make_cuda_backend for the calling thread's current device.
constexpr int kCurrentCudaDevice = -2;

// Always declared; without CUDA headers at build time it reports
// kCudaUnavailable. `*device` is an ordinal or kCurrentCudaDevice (the device
// of the context current on this thread, else 0), and on success the ordinal
// used.
Status make_cuda_backend(std::size_t num_pages, std::size_t page_size,
                         int* device, std::unique_ptr<Backend>* out);

bool cuda_built();
// Number of CUDA devices, or 0 when there is none or libcuda cannot be loaded.
// Never fails: it is what tests and callers use to decide whether to try. It
// does not initialise the driver where it can help it (see cuda_backend.cpp).
int cuda_device_count(std::string* why_none);
// The ordinal of the device whose context is current on the calling thread,
// or -1 when none is (or the driver was never initialised in this process).
// Never initialises the driver.
int cuda_current_device();

}  // namespace kvpages
