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
  virtual Status map(std::size_t index) = 0;
  virtual Status unmap(std::size_t index) = 0;
};

// Checks the common arguments: num_pages > 0, page_size a positive multiple
// of `granularity`, and num_pages * page_size without overflow.
Status check_geometry(std::size_t num_pages, std::size_t page_size,
                      std::size_t granularity, const char* granularity_name);

Status make_cpu_backend(std::size_t num_pages, std::size_t page_size,
                        std::unique_ptr<Backend>* out);

// Always declared; without CUDA headers at build time it reports
// kCudaUnavailable.
Status make_cuda_backend(std::size_t num_pages, std::size_t page_size,
                         int device, std::unique_ptr<Backend>* out);

bool cuda_built();
// Number of CUDA devices, or 0 when libcuda cannot be loaded or initialised.
// Never fails: it is what tests and callers use to decide whether to try.
int cuda_device_count(std::string* why_none);

}  // namespace kvpages
