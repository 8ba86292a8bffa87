// Glue between torch tensors and the C++ API: non-owning views, option parsing, workspace from
// the PyTorch caching allocator, the current stream, and xent::Error -> Python exception types.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>
#include <c10/util/string_view.h>
#include <torch/library.h>

#include <string>
#include <tuple>
#include <utility>

#include "xent/xent.hpp"

namespace xent::torch_binding {

// Views require contiguous columns; rows may be padded (row_stride >= cols). `contiguous_rows`
// returns the tensor itself when the core can read it as it is, a contiguous copy otherwise.
at::Tensor contiguous_rows(const at::Tensor& tensor);
at::Tensor contiguous_vector(const at::Tensor& tensor);
// For outputs written over an input: raises ValueError naming `argument` when the core could not
// read `tensor` as it is (contiguous_rows would copy it, and the copy would take the output).
// `remedy` ends the message: what the caller can do instead.
void require_in_place_rows(
    const char* function, const char* argument, const at::Tensor& tensor,
    const char* remedy = "inplace_backward=False writes the gradient to a new tensor instead");

// `function` and `argument` name the tensor in the error raised for a dtype xent has no name for.
TensorView matrix_view(const at::Tensor& tensor, const char* function, const char* argument);
TensorView vector_view(const at::Tensor& tensor, const char* function, const char* argument);
TensorView optional_matrix_view(const c10::optional<at::Tensor>& tensor, const char* function,
                                const char* argument);
TensorView optional_vector_view(const c10::optional<at::Tensor>& tensor, const char* function,
                                const char* argument);

Device xent_device(const at::Tensor& tensor);
Stream current_stream(const at::Tensor& tensor);
// Whether work on tensor's current stream is being captured into a CUDA graph (false on the CPU):
// an op must then not read device values on the host, as a replay would not read them again.
bool stream_is_capturing(const at::Tensor& tensor);

Reduction parse_reduction(const char* function, c10::string_view reduction);
DistillKind parse_distill_kind(const char* function, c10::string_view kind);

// The dtype of the results (loss, statistics, grad_output) of an op on `input`: float32, or
// float64 for float64 inputs (the core's compute type, so float64 math reaches the caller).
at::ScalarType result_dtype(const at::Tensor& input);
// An optional upstream gradient (or its scale) converted to result_dtype(like), contiguous.
c10::optional<at::Tensor> as_result_dtype(const c10::optional<at::Tensor>& tensor,
                                          const at::Tensor& like);

// Loss-shaped output in result_dtype(like): scalar for sum/mean, [rows] for none.
at::Tensor new_loss(const at::Tensor& like, Reduction reduction, int64_t rows);

// The loss and statistics outputs of ce and linear_ce: (loss, lse, logprob, entropy, argmax,
// accuracy, z_loss_value). lse is always computed (the backward reads it); the other statistics
// are empty [0] tensors unless with_stats, so the op signatures stay fixed for torch.compile.
struct LossOutputs {
  at::Tensor loss, lse, logprob, entropy, argmax, accuracy, z_loss_value;
  TensorView loss_view;
  CeStats stats;
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
  as_tuple() const {
    return {loss, lse, logprob, entropy, argmax, accuracy, z_loss_value};
  }
};
LossOutputs make_loss_outputs(const char* function, const at::Tensor& like, Reduction reduction,
                              int64_t rows, bool with_stats);

// Optional per-class and per-row fp32 weights, converted once here (the core takes fp32).
c10::optional<at::Tensor> as_fp32_vector(const c10::optional<at::Tensor>& tensor);

CeOptions make_ce_options(const char* function, int64_t ignore_index, c10::string_view reduction,
                          double label_smoothing, double z_loss, c10::optional<double> softcap,
                          double logit_scale, const TensorView& class_weight,
                          const TensorView& row_weight);

// The hard-label term of a distillation sees the student through the same softcap as the soft
// term, so one `softcap` argument configures both.
DistillOptions make_distill_options(const char* function, c10::string_view kind, double temperature,
                                    double beta, c10::optional<double> softcap, double soft_weight,
                                    double hard_weight, int64_t ignore_index,
                                    c10::string_view reduction, double label_smoothing,
                                    double z_loss, const TensorView& class_weight);

// workspace_bytes <= 0 keeps the core's default budget.
std::size_t workspace_budget(int64_t workspace_bytes, std::size_t default_budget);

// Scratch memory through the caching allocator, so it shows in torch.cuda.memory_allocated and
// is reused across steps. The returned tensor owns the bytes; keep it alive for the call.
std::pair<at::Tensor, Workspace> allocate_workspace(const at::Tensor& like, std::size_t bytes);

// Runs `body`, re-raising xent::Error as the exception torch maps to ValueError
// (invalid_argument) or RuntimeError (runtime), with the core's message unchanged.
template <class Body>
decltype(auto) translate_errors(Body&& body) {
  try {
    return body();
  } catch (const Error& error) {
    if (error.kind() == ErrorKind::invalid_argument) {
      TORCH_CHECK_VALUE(false, error.what());
    }
    TORCH_CHECK(false, error.what());
  }
}

// Registers `kernel` as the op's implementation on CPU tensors and, in a build with CUDA, on CUDA
// tensors: one registration per op, whatever the device (the kernels dispatch by device below).
template <class Kernel>
void impl_on_devices(torch::Library& m, const char* name, Kernel* kernel) {
  m.impl(name, torch::dispatch(c10::DispatchKey::CPU, kernel));
#if defined(XENT_TORCH_CUDA)
  m.impl(name, torch::dispatch(c10::DispatchKey::CUDA, kernel));
#endif
}

}  // namespace xent::torch_binding
