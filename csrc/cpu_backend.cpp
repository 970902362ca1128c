// CPU page backend: one memfd per range.
//
// The range is reserved PROT_NONE and page i of it is backed, when mapped, by
// bytes [i * page_size, (i + 1) * page_size) of an anonymous memfd. This is
// the host analogue of the CUDA VMM API: a fixed virtual range whose physical
// backing comes and goes page by page. Touching an unmapped page faults
// (SIGSEGV), exactly like touching an unmapped device page.
//
// Map commits the memory at once (MADV_POPULATE_WRITE, or fallocate on older
// kernels), so resident memory rises on map, not on first touch; unmap
// replaces the page with a PROT_NONE reservation and punches a hole in the
// memfd, so the memory goes back to the kernel and the page reads as zeros
// when it is mapped again.
#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <limits>
#include <string>

#include "backend.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older libc headers lack it
#endif

namespace kvpages {

Status Status::Os(int err, std::string what) {
  Status s;
  s.kind = Kind::kOs;
  s.errnum = err;
  s.message = std::move(what);
  return s;
}

Status Status::Value(std::string what) {
  Status s;
  s.kind = Kind::kValue;
  s.message = std::move(what);
  return s;
}

Status Status::CudaUnavailable(std::string what) {
  Status s;
  s.kind = Kind::kCudaUnavailable;
  s.message = std::move(what);
  return s;
}

Status check_geometry(std::size_t num_pages, std::size_t page_size,
                      std::size_t granularity, const char* granularity_name) {
  if (num_pages == 0) return Status::Value("num_pages must be positive");
  if (page_size == 0 || page_size % granularity != 0) {
    return Status::Value("page_size " + std::to_string(page_size) +
                         " is not a positive multiple of the " +
                         granularity_name + " (" + std::to_string(granularity) +
                         " bytes)");
  }
  // The memfd size is an off_t, so the range must fit in a signed 64-bit int.
  const std::size_t max_total =
      static_cast<std::size_t>(std::numeric_limits<off_t>::max()) - page_size;
  if (num_pages > max_total / page_size) {
    return Status::Value("num_pages * page_size overflows the address space");
  }
  return Status::Ok();
}

namespace {

class CpuBackend final : public Backend {
 public:
  CpuBackend(int fd, char* base, std::size_t page_size)
      : fd_(fd), base_(base), page_size_(page_size),
        os_page_(static_cast<std::size_t>(sysconf(_SC_PAGESIZE))) {}

  ~CpuBackend() override { teardown(nullptr); }

  // Unmapping the whole range and closing the memfd frees every page still
  // mapped; nothing else refers to the memfd. In a forked child this drops
  // only the child's own mapping and descriptor, so it is safe there too.
  Status teardown(std::vector<unsigned char>* mapped) override {
    if (torn_down_) return Status::Ok();
    torn_down_ = true;
    Status st;
    if (munmap(base_, total_) != 0) st = Status::Os(errno, "munmap the range");
    close(fd_);
    if (mapped != nullptr && st.ok()) mapped->assign(mapped->size(), 0);
    return st;
  }

  void set_total(std::size_t total) { total_ = total; }

  std::uintptr_t base() const override {
    return reinterpret_cast<std::uintptr_t>(base_);
  }
  bool host_accessible() const override { return true; }

  Status map(std::size_t index) override {
    const off_t off = static_cast<off_t>(index * page_size_);
    char* addr = base_ + index * page_size_;
    void* got = mmap(addr, page_size_, PROT_READ | PROT_WRITE,
                     MAP_SHARED | MAP_FIXED, fd_, off);
    if (got == MAP_FAILED) {
      return Status::Os(errno, "map page " + std::to_string(index) + ": mmap");
    }
    // Commit the memory now: MADV_POPULATE_WRITE allocates every page and
    // installs its page-table entry in one call, and unlike MAP_POPULATE it
    // reports failure (ENOMEM, or EFAULT when shmem cannot allocate) instead
    // of leaving a SIGBUS for the first touch.
    if (madvise(addr, page_size_, MADV_POPULATE_WRITE) == 0) {
      return Status::Ok();
    }
    int err = errno;
    if (err == EINVAL) {
      // Kernels before 5.14 lack MADV_POPULATE_WRITE: fallocate commits the
      // memory with a clean ENOSPC/ENOMEM, and touching maps it.
      if (fallocate(fd_, 0, off, static_cast<off_t>(page_size_)) == 0) {
        for (std::size_t b = 0; b < page_size_; b += os_page_) addr[b] = 0;
        return Status::Ok();
      }
      err = errno;
    }
    // Leave the page as it was: reserved, with no memory behind it.
    unmap(index);
    return Status::Os(err, "map page " + std::to_string(index) +
                               ": commit memory");
  }

  Status unmap(std::size_t index) override {
    const off_t off = static_cast<off_t>(index * page_size_);
    char* addr = base_ + index * page_size_;
    // Replace the shared mapping with a PROT_NONE reservation first, then
    // punch the hole: the pages are then mapped nowhere, so the punch frees
    // them without walking our page tables, and the range never has a window
    // in which it is unreserved (another thread's mmap could land there).
    void* got = mmap(addr, page_size_, PROT_NONE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE,
                     -1, 0);
    if (got == MAP_FAILED) {
      return Status::Os(errno, "unmap page " + std::to_string(index) +
                                   ": mmap PROT_NONE");
    }
    // The punched hole reads back as zeros, so a page mapped again is zeroed.
    if (fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, off,
                  static_cast<off_t>(page_size_)) != 0) {
      return Status::Os(errno, "unmap page " + std::to_string(index) +
                                   ": fallocate PUNCH_HOLE");
    }
    return Status::Ok();
  }

 private:
  int fd_;
  char* base_;
  std::size_t page_size_;
  std::size_t os_page_;
  std::size_t total_ = 0;
  bool torn_down_ = false;
};

}  // namespace

Status make_cpu_backend(std::size_t num_pages, std::size_t page_size,
                        std::unique_ptr<Backend>* out) {
  const long os_page = sysconf(_SC_PAGESIZE);
  Status st = check_geometry(num_pages, page_size,
                             static_cast<std::size_t>(os_page), "OS page size");
  if (!st.ok()) return st;
  const std::size_t total = num_pages * page_size;

  const int fd = memfd_create("kvcached-pages", MFD_CLOEXEC);
  if (fd < 0) return Status::Os(errno, "memfd_create");
  if (ftruncate(fd, static_cast<off_t>(total)) != 0) {
    const int err = errno;
    close(fd);
    return Status::Os(err, "ftruncate memfd");
  }

  // Reserve one extra page and trim, so that the range is aligned to the page
  // size: a 2 MiB-aligned page can be backed by a huge page where shmem THP
  // is enabled, and offsets in the range match offsets in the memfd.
  const std::size_t span = total + page_size;
  void* raw = mmap(nullptr, span, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) {
    const int err = errno;
    close(fd);
    return Status::Os(err, "reserve " + std::to_string(total) + " bytes");
  }
  const std::uintptr_t start = reinterpret_cast<std::uintptr_t>(raw);
  const std::uintptr_t aligned =
      (start + page_size - 1) / page_size * page_size;
  const std::size_t head = aligned - start;
  const std::size_t tail = span - head - total;
  if (head != 0) munmap(raw, head);
  if (tail != 0) munmap(reinterpret_cast<char*>(aligned + total), tail);

  auto backend = std::make_unique<CpuBackend>(
      fd, reinterpret_cast<char*>(aligned), page_size);
  backend->set_total(total);
  *out = std::move(backend);
  return Status::Ok();
}

}  // namespace kvpages
