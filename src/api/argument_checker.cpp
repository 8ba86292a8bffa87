#include "api/argument_checker.hpp"

#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace xent::api {

std::string shape_string(const TensorView& view) {
  switch (view.ndim) {
    case -1:
      return "an absent tensor";
    case 0:
      return "a scalar []";
    case 1:
      return bracketed(view.rows);
    case 2: {
      std::string text = "[";
      text.append(std::to_string(view.rows)).append(", ").append(std::to_string(view.cols));
      return text.append("]");
    }
    default:
      return std::to_string(view.ndim) + "-D tensor";
  }
}

std::string bracketed(int64_t length, const char* suffix) {
  std::string text = "[";
  return text.append(std::to_string(length)).append("]").append(suffix);
}

std::string device_string(Device device) {
  return std::string(device.kind == DeviceKind::cpu ? "cpu:" : "cuda:") +
         std::to_string(device.index);
}

std::string number_string(double value) {
  if (std::isnan(value)) return "nan";  // printf may write "-nan" for 0/0
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, "%.17g", value);
  // Prefer the shortest form that reads back exactly (1.5, not 1.5000000000000000).
  for (int precision = 1; precision <= 17; ++precision) {
    char shorter[64];
    std::snprintf(shorter, sizeof shorter, "%.*g", precision, value);
    if (std::strtod(shorter, nullptr) == value) return shorter;
  }
  return buffer;
}

void ArgumentChecker::fail(const std::string& argument, const std::string& problem,
                           const std::string& got, const std::string& expected) const {
  throw Error(ErrorKind::invalid_argument, std::string(function_) + ": " + argument + " " +
                                               problem + ": got " + got + "; expected " + expected);
}

void ArgumentChecker::require_present(const TensorView& view, const char* name,
                                      const char* expected) const {
  if (!view.present()) fail(name, "missing", "an absent tensor", expected);
}

void ArgumentChecker::require_absent(const TensorView& view, const char* name,
                                     const char* why) const {
  if (view.present())
    fail(name, "not allowed", shape_string(view), std::string("an absent tensor ") + why);
}

void ArgumentChecker::matrix(const TensorView& view, const char* name, int64_t rows, int64_t cols,
                             const std::string& what) const {
  if (view.ndim != 2 || view.rows < 0 || view.cols < 0 || (rows >= 0 && view.rows != rows) ||
      (cols >= 0 && view.cols != cols)) {
    fail(name, "has wrong shape", shape_string(view), what);
  }
  if (view.row_stride < view.cols) {
    fail(name, "has row_stride smaller than its columns", std::to_string(view.row_stride),
         "at least " + std::to_string(view.cols));
  }
  if (view.data == nullptr && view.rows > 0 && view.cols > 0) {
    fail(name, "has no data", "a null pointer", "memory for " + shape_string(view));
  }
  same_device(view, name);
}

void ArgumentChecker::vector(const TensorView& view, const char* name, int64_t length,
                             const std::string& what) const {
  if (view.ndim != 1 || view.rows < 0 || (length >= 0 && view.rows != length)) {
    fail(name, "has wrong shape", shape_string(view), what);
  }
  if (view.data == nullptr && view.rows > 0) {
    fail(name, "has no data", "a null pointer", "memory for " + shape_string(view));
  }
  same_device(view, name);
}

void ArgumentChecker::scalar(const TensorView& view, const char* name) const {
  if (view.ndim != 0) fail(name, "has wrong shape", shape_string(view), "a scalar []");
  if (view.data == nullptr) fail(name, "has no data", "a null pointer", "memory for a scalar");
  same_device(view, name);
}

void ArgumentChecker::loss_shaped(const TensorView& view, const char* name, Reduction reduction,
                                  int64_t rows) const {
  if (reduction == Reduction::none) {
    vector(view, name, rows, bracketed(rows, " (one value per row for reduction none)"));
  } else {
    if (view.ndim != 0) {
      fail(name, "has wrong shape", shape_string(view),
           std::string("a scalar [] for reduction ") + reduction_name(reduction));
    }
    scalar(view, name);
  }
}

void ArgumentChecker::dtype_in(const TensorView& view, const char* name,
                               std::initializer_list<DType> allowed, const char* expected) const {
  for (const DType dtype : allowed) {
    if (view.dtype == dtype) return;
  }
  fail(name, "has unsupported dtype", dtype_name(view.dtype), expected);
}

void ArgumentChecker::result(const TensorView& view, const char* name) const {
  if (result_dtype_ == DType::f64) {
    dtype_in(view, name, {DType::f64}, "float64 (the result dtype of float64 inputs)");
  } else {
    dtype_in(view, name, {DType::f32}, "float32 (float64 only for float64 inputs)");
  }
}

void ArgumentChecker::floating_input(const TensorView& view, const char* name) const {
  if (on_cpu()) {
    dtype_in(view, name, {DType::f32, DType::bf16, DType::f16, DType::f64},
             "float32, bfloat16, float16 or float64");
  } else {
    dtype_in(view, name, {DType::f32, DType::bf16, DType::f16},
             "float32, bfloat16 or float16 (float64 only on the CPU)");
  }
}

void ArgumentChecker::same_dtype(const TensorView& view, const char* name,
                                 const TensorView& reference, const char* reference_name) const {
  if (view.dtype != reference.dtype) {
    fail(name, "has wrong dtype", dtype_name(view.dtype),
         std::string(dtype_name(reference.dtype)) + " (the dtype of " + reference_name + ")");
  }
}

void ArgumentChecker::same_device(const TensorView& view, const char* name) const {
  if (view.device.kind != device_.kind || view.device.index != device_.index) {
    fail(name, "is on another device", device_string(view.device), device_string(device_));
  }
}

namespace {
struct ByteRange {
  const char* begin;
  const char* end;
};
ByteRange byte_range(const TensorView& view) {
  const char* begin = static_cast<const char*>(view.data);
  if (view.numel() == 0 || begin == nullptr) return {begin, begin};
  const int64_t elements =
      view.ndim == 2 ? (view.rows - 1) * view.row_stride + view.cols : view.numel();
  return {begin, begin + elements * static_cast<int64_t>(dtype_size(view.dtype))};
}
}  // namespace

void ArgumentChecker::no_overlap(const TensorView& output, const char* output_name,
                                 const TensorView& input, const char* input_name,
                                 bool allow_in_place) const {
  if (!output.present() || !input.present()) return;
  const ByteRange a = byte_range(output), b = byte_range(input);
  if (a.begin == a.end || b.begin == b.end || a.end <= b.begin || b.end <= a.begin) return;
  const bool exact = output.data == input.data && output.dtype == input.dtype &&
                     output.ndim == input.ndim && output.rows == input.rows &&
                     output.cols == input.cols &&
                     (output.ndim != 2 || output.row_stride == input.row_stride);
  if (exact && allow_in_place) return;
  fail(output_name, std::string("overlaps ") + input_name,
       exact ? "the same memory" : "a partial overlap",
       allow_in_place
           ? std::string("exactly the memory of ") + input_name + " (in place) or no overlap"
           : std::string("no overlap with ") + input_name);
}

void ArgumentChecker::in_unit_interval(double value, const char* name) const {
  if (!(value >= 0.0 && value <= 1.0)) {
    fail(name, "out of range", number_string(value), "a value in [0, 1]");
  }
}

void ArgumentChecker::non_negative_finite(double value, const char* name) const {
  if (!(value >= 0.0) || !std::isfinite(value)) {
    fail(name, "out of range", number_string(value), "a finite value >= 0");
  }
}

void ArgumentChecker::positive_finite(double value, const char* name) const {
  if (!(value > 0.0) || !std::isfinite(value)) {
    fail(name, "out of range", number_string(value), "a finite value > 0");
  }
}

void ArgumentChecker::class_weights_valid(const TensorView& class_weight, int64_t vocab) const {
  if (!class_weight.present() || !on_cpu()) return;  // device memory is not read on the host
  const float* w = static_cast<const float*>(class_weight.data);
  for (int64_t i = 0; i < vocab; ++i) {
    if (!(w[i] >= 0.0f) || !std::isfinite(w[i])) {
      fail("class_weight", "has a negative or non-finite entry",
           "class_weight[" + std::to_string(i) + "] = " + number_string(w[i]),
           "finite values >= 0");
    }
  }
}

void ArgumentChecker::targets_in_range(const TensorView& target, int64_t vocab,
                                       int64_t ignore_index) const {
  if (!target.present() || !on_cpu())
    return;  // on a GPU the kernel flags them (docs/semantics.md §1)
  for (int64_t n = 0; n < target.rows; ++n) {
    const int64_t y = target.dtype == DType::i32 ? static_cast<const int32_t*>(target.data)[n]
                                                 : static_cast<const int64_t*>(target.data)[n];
    if (y != ignore_index && (y < 0 || y >= vocab)) {
      fail("target", "out of range", "target[" + std::to_string(n) + "] = " + std::to_string(y),
           "a class index in [0, " + std::to_string(vocab) + ") or ignore_index (" +
               std::to_string(ignore_index) + ")");
    }
  }
}

void require_backend(const char* function, Device device) {
#if defined(XENT_WITH_CUDA)
  (void)function;
  (void)device;
#else
  if (device.kind == DeviceKind::cuda) {
    throw Error(ErrorKind::runtime, std::string(function) + ": device not available: got " +
                                        device_string(device) +
                                        "; expected a CPU tensor (xent was built without CUDA)");
  }
#endif
}

}  // namespace xent::api
