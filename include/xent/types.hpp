// Vocabulary shared by every xent op: tensor views, devices, errors, workspace and stream.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace xent {

enum class DType : int8_t { f32, bf16, f16, f64, i64, i32 };
enum class DeviceKind : int8_t { cpu, cuda };
enum class Reduction : int8_t { none, sum, mean };

const char* dtype_name(DType dtype);
std::size_t dtype_size(DType dtype);
const char* reduction_name(Reduction reduction);

struct Device {
  DeviceKind kind = DeviceKind::cpu;
  int index = 0;
};

// Non-owning view of a 0-, 1- or 2-D tensor. 2-D views have contiguous columns and may have
// padded rows (row_stride >= cols); 1-D and 0-D views are contiguous. A default-constructed
// view is "absent": optional arguments and outputs are left out by passing one.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  int ndim = -1;           // -1 absent, 0 scalar, 1 vector, 2 matrix
  int64_t rows = 0;        // length of dim 0 (vector length; 1 for a scalar)
  int64_t cols = 1;        // length of dim 1 (matrices only)
  int64_t row_stride = 0;  // elements between row starts (matrices only)
  Device device{};

  bool present() const { return ndim >= 0; }
  int64_t numel() const { return ndim < 0 ? 0 : rows * cols; }
};

// Inputs are taken through the same view type as outputs; xent never writes an input.
inline TensorView matrix(const void* data, DType dtype, int64_t rows, int64_t cols,
                         int64_t row_stride = -1, Device device = {}) {
  return TensorView{
      const_cast<void*>(data), dtype, 2, rows, cols, row_stride < 0 ? cols : row_stride, device};
}
inline TensorView vector(const void* data, DType dtype, int64_t length, Device device = {}) {
  return TensorView{const_cast<void*>(data), dtype, 1, length, 1, 1, device};
}
inline TensorView scalar(const void* data, DType dtype, Device device = {}) {
  return TensorView{const_cast<void*>(data), dtype, 0, 1, 1, 1, device};
}

// Scratch memory given by the caller (size from the op's *_workspace_size query). The core never
// allocates device memory itself, so memory shows up in the caller's allocator.
struct Workspace {
  void* data = nullptr;
  std::size_t bytes = 0;
};

// A CUDA stream (cudaStream_t) or nothing; ignored on the CPU.
struct Stream {
  void* handle = nullptr;
};

// invalid_argument: the caller passed something docs/semantics.md rejects, out-of-range targets reported by
// check_errors included (ValueError in Python); runtime: the environment failed (CUDA error;
// RuntimeError).
enum class ErrorKind : int8_t { invalid_argument, runtime };

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

// Reports (and clears) the device-side error flag that CUDA kernels set for out-of-range
// targets, with the same message the CPU backend raises at once. Synchronises the stream; call it
// only where a check is wanted (ops themselves never synchronise). A no-op on the CPU.
void check_errors(Device device, Stream stream = {});

}  // namespace xent
