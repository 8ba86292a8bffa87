// The building blocks of argument validation: every check throws xent::Error(invalid_argument)
// with the one message format of the project,
//   "<function>: <argument> <problem>: got <value>; expected <expectation>",
// so callers of every layer (C++, Python) can rely on it.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "xent/types.hpp"

namespace xent::api {

std::string shape_string(const TensorView& view);
// "[<length>]" followed by `suffix`. Built by appending: GCC 12 warns falsely (-Wrestrict) about
// "literal" + std::string at -O3.
std::string bracketed(int64_t length, const char* suffix = "");
std::string device_string(Device device);
std::string number_string(double value);

class ArgumentChecker {
 public:
  // `device` is the device of the op's primary input; every other tensor must be on it.
  // `input` is its dtype, which fixes the dtype of the op's results (see `result`).
  ArgumentChecker(const char* function, Device device, DType input = DType::f32)
      : function_(function),
        device_(device),
        result_dtype_(input == DType::f64 ? DType::f64 : DType::f32) {}

  const char* function() const { return function_; }
  Device device() const { return device_; }
  bool on_cpu() const { return device_.kind == DeviceKind::cpu; }

  [[noreturn]] void fail(const std::string& argument, const std::string& problem,
                         const std::string& got, const std::string& expected) const;

  void require_present(const TensorView& view, const char* name, const char* expected) const;
  void require_absent(const TensorView& view, const char* name, const char* why) const;

  // Shape checks; a negative expected length means "any". `what` describes the expected form,
  // e.g. "[N, V] with N = 37 rows of logits".
  void matrix(const TensorView& view, const char* name, int64_t rows, int64_t cols,
              const std::string& what) const;
  void vector(const TensorView& view, const char* name, int64_t length,
              const std::string& what) const;
  void scalar(const TensorView& view, const char* name) const;
  // A loss-shaped tensor: a scalar for sum/mean, [N] for none.
  void loss_shaped(const TensorView& view, const char* name, Reduction reduction,
                   int64_t rows) const;

  void dtype_in(const TensorView& view, const char* name, std::initializer_list<DType> allowed,
                const char* expected) const;
  // Logits-like inputs: fp32, bf16, fp16, and fp64 on the CPU only.
  void floating_input(const TensorView& view, const char* name) const;
  void same_dtype(const TensorView& view, const char* name, const TensorView& reference,
                  const char* reference_name) const;
  void fp32(const TensorView& view, const char* name) const {
    dtype_in(view, name, {DType::f32}, "float32");
  }
  // Results (loss, statistics) and what comes back to them (grad_output, a saved lse) are float32
  // for fp32/bf16/fp16 inputs and float64 for float64 inputs: the op's compute type, so float64
  // math is never rounded to float32 on the way out (torch.autograd.gradcheck needs that).
  void result(const TensorView& view, const char* name) const;

  void same_device(const TensorView& view, const char* name) const;

  // `output` may equal `input` exactly (in place) only when allow_in_place; a partial overlap
  // is always an error, because rows would be read after another row overwrote them.
  void no_overlap(const TensorView& output, const char* output_name, const TensorView& input,
                  const char* input_name, bool allow_in_place) const;

  void in_unit_interval(double value, const char* name) const;     // [0, 1]
  void non_negative_finite(double value, const char* name) const;  // >= 0, finite
  void positive_finite(double value, const char* name) const;      // > 0, finite

  // CPU tensors only: class weights finite and >= 0; valid targets in [0, vocab).
  void class_weights_valid(const TensorView& class_weight, int64_t vocab) const;
  void targets_in_range(const TensorView& target, int64_t vocab, int64_t ignore_index) const;

 private:
  const char* function_;
  Device device_;
  DType result_dtype_;
};

// Throws a runtime Error when `device` is a GPU and the library was built without CUDA.
void require_backend(const char* function, Device device);

}  // namespace xent::api
