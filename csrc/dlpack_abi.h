// The slice of the DLPack ABI (https://dmlc.github.io/dlpack/latest/) that a
// PageRange exports: a 1-D uint8 tensor over the whole range.
//
// Declared here rather than included: the extension builds without torch or
// any DLPack header on the include path. The layouts must match the C ABI of
// DLPack 1.x field for field; every consumer (torch, CuPy, JAX) reads them.
#pragma once

#include <cstdint>

namespace kvpages {
namespace dl {

constexpr std::int32_t kDLCPU = 1;
constexpr std::int32_t kDLCUDA = 2;
constexpr std::uint8_t kDLUInt = 1;

// The capsule names of the protocol: a consumer renames the capsule to
// "used_..." when it takes ownership of the managed tensor inside.
constexpr const char* kCapsuleName = "dltensor";
constexpr const char* kVersionedCapsuleName = "dltensor_versioned";

// The ABI version this producer writes into a versioned managed tensor.
constexpr std::uint32_t kMajorVersion = 1;
constexpr std::uint32_t kMinorVersion = 0;

struct Device {
  std::int32_t device_type;  // an enum in DLPack, int-sized
  std::int32_t device_id;
};

struct DataType {
  std::uint8_t code;
  std::uint8_t bits;
  std::uint16_t lanes;
};

struct Tensor {
  void* data;
  Device device;
  std::int32_t ndim;
  DataType dtype;
  std::int64_t* shape;
  std::int64_t* strides;  // in elements; null would mean compact row-major
  std::uint64_t byte_offset;
};

// What a "dltensor" capsule holds (DLPack before 1.0, still accepted by all).
struct ManagedTensor {
  Tensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(ManagedTensor* self);
};

struct PackVersion {
  std::uint32_t major;
  std::uint32_t minor;
};

// What a "dltensor_versioned" capsule holds (DLPack 1.0 and later).
struct ManagedTensorVersioned {
  PackVersion version;
  void* manager_ctx;
  void (*deleter)(ManagedTensorVersioned* self);
  std::uint64_t flags;  // bit 0: read only; bit 1: a copy
  Tensor dl_tensor;
};

}  // namespace dl
}  // namespace kvpages
