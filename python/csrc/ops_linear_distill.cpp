// torch ops xent::linear_distill_forward and xent::linear_distill_backward (docs/semantics.md §4).
#include <c10/core/DeviceGuard.h>

#include <tuple>

#include "binding_support.hpp"

namespace xent::torch_binding {
namespace {

using at::Tensor;

struct DistillInputs {
  Tensor student_hidden, student_weight;
  c10::optional<Tensor> teacher_logits, teacher_hidden, teacher_weight, target, class_weight;
};

c10::optional<Tensor> optional_rows(const c10::optional<Tensor>& tensor) {
  return tensor.has_value() ? c10::optional<Tensor>(contiguous_rows(*tensor)) : tensor;
}

DistillInputs prepare_inputs(const Tensor& student_hidden, const Tensor& student_weight,
                             const c10::optional<Tensor>& teacher_logits,
                             const c10::optional<Tensor>& teacher_hidden,
                             const c10::optional<Tensor>& teacher_weight,
                             const c10::optional<Tensor>& target,
                             const c10::optional<Tensor>& class_weight) {
  DistillInputs inputs;
  inputs.student_hidden = contiguous_rows(student_hidden);
  inputs.student_weight = contiguous_rows(student_weight);
  inputs.teacher_logits = optional_rows(teacher_logits);
  inputs.teacher_hidden = optional_rows(teacher_hidden);
  inputs.teacher_weight = optional_rows(teacher_weight);
  inputs.target = target.has_value() ? c10::optional<Tensor>(target->contiguous()) : target;
  inputs.class_weight = as_fp32_vector(class_weight);
  return inputs;
}

Teacher teacher_views(const char* function, const DistillInputs& inputs) {
  Teacher teacher;
  teacher.logits = optional_matrix_view(inputs.teacher_logits, function, "teacher_logits");
  teacher.hidden = optional_matrix_view(inputs.teacher_hidden, function, "teacher_hidden");
  teacher.weight = optional_matrix_view(inputs.teacher_weight, function, "teacher_weight");
  return teacher;
}

struct StudentGradients {
  Tensor hidden, weight;
  LinearGradients views;
};

StudentGradients make_gradients(const char* function, const DistillInputs& inputs, bool grad_hidden,
                                bool grad_weight) {
  StudentGradients grads;
  const Tensor& hidden = inputs.student_hidden;
  const Tensor& weight = inputs.student_weight;
  grads.hidden =
      grad_hidden ? at::empty(hidden.sizes(), hidden.options()) : at::empty({0}, hidden.options());
  grads.weight =
      grad_weight ? at::empty(weight.sizes(), weight.options()) : at::empty({0}, weight.options());
  if (grad_hidden) grads.views.hidden = matrix_view(grads.hidden, function, "grad_hidden");
  if (grad_weight) grads.views.weight = matrix_view(grads.weight, function, "grad_weight");
  return grads;
}

std::size_t workspace_bytes_for(const DistillInputs& inputs, const LinearDistillOptions& options,
                                const TensorView& hidden_view, const TensorView& weight_view,
                                bool with_gradients) {
  const int64_t rows = hidden_view.ndim >= 1 ? hidden_view.rows : 0;
  const int64_t teacher_hidden =
      inputs.teacher_hidden.has_value() && inputs.teacher_hidden->dim() == 2
          ? inputs.teacher_hidden->size(1)
          : 0;
  return linear_distill_workspace_size(rows, hidden_view.cols, teacher_hidden, weight_view.rows,
                                       hidden_view.dtype, options, hidden_view.device,
                                       with_gradients);
}

LinearDistillOptions make_options(const char* function, const DistillInputs& inputs,
                                  c10::string_view kind, double temperature, double beta,
                                  c10::optional<double> softcap, double soft_weight,
                                  double hard_weight, int64_t ignore_index,
                                  c10::string_view reduction, double label_smoothing, double z_loss,
                                  int64_t workspace_bytes, bool fp32_logits) {
  LinearDistillOptions options;
  options.distill = make_distill_options(
      function, kind, temperature, beta, softcap, soft_weight, hard_weight, ignore_index, reduction,
      label_smoothing, z_loss, optional_vector_view(inputs.class_weight, function, "class_weight"));
  options.workspace_budget = workspace_budget(workspace_bytes, options.workspace_budget);
  options.fp32_logits = fp32_logits;
  return options;
}

std::tuple<Tensor, Tensor, Tensor> linear_distill_forward_op(
    const Tensor& student_hidden, const Tensor& student_weight,
    const c10::optional<Tensor>& teacher_logits, const c10::optional<Tensor>& teacher_hidden,
    const c10::optional<Tensor>& teacher_weight, const c10::optional<Tensor>& target,
    const c10::optional<Tensor>& class_weight, c10::string_view kind, double temperature,
    double beta, c10::optional<double> softcap, double soft_weight, double hard_weight,
    int64_t ignore_index, c10::string_view reduction, double label_smoothing, double z_loss,
    int64_t workspace_bytes, bool fp32_logits, bool grad_hidden, bool grad_weight) {
  constexpr const char* function = "linear_distill_forward";
  return translate_errors([&] {
    c10::DeviceGuard guard(student_hidden.device());
    const DistillInputs inputs =
        prepare_inputs(student_hidden, student_weight, teacher_logits, teacher_hidden,
                       teacher_weight, target, class_weight);
    const LinearDistillOptions options = make_options(
        function, inputs, kind, temperature, beta, softcap, soft_weight, hard_weight, ignore_index,
        reduction, label_smoothing, z_loss, workspace_bytes, fp32_logits);
    const int64_t rows = student_hidden.dim() >= 1 ? student_hidden.size(0) : 0;
    Tensor loss = new_loss(student_hidden, options.distill.ce.reduction, rows);
    StudentGradients grads = make_gradients(function, inputs, grad_hidden, grad_weight);
    LinearDistillOutputs out;
    out.loss = vector_view(loss, function, "loss");
    out.grads = grads.views;

    const TensorView hidden_view = matrix_view(inputs.student_hidden, function, "student_hidden");
    const TensorView weight_view = matrix_view(inputs.student_weight, function, "student_weight");
    const std::size_t bytes =
        workspace_bytes_for(inputs, options, hidden_view, weight_view, grad_hidden || grad_weight);
    auto [buffer, workspace] = allocate_workspace(student_hidden, bytes);
    linear_distill_forward(hidden_view, weight_view, teacher_views(function, inputs),
                           optional_vector_view(inputs.target, function, "target"), options, out,
                           TensorView{}, workspace, current_stream(student_hidden));
    return std::make_tuple(loss, grads.hidden, grads.weight);
  });
}

std::tuple<Tensor, Tensor> linear_distill_backward_op(
    const Tensor& student_hidden, const Tensor& student_weight,
    const c10::optional<Tensor>& teacher_logits, const c10::optional<Tensor>& teacher_hidden,
    const c10::optional<Tensor>& teacher_weight, const c10::optional<Tensor>& target,
    const Tensor& grad_output, const c10::optional<Tensor>& class_weight, c10::string_view kind,
    double temperature, double beta, c10::optional<double> softcap, double soft_weight,
    double hard_weight, int64_t ignore_index, c10::string_view reduction, double label_smoothing,
    double z_loss, int64_t workspace_bytes, bool fp32_logits, bool grad_hidden, bool grad_weight) {
  constexpr const char* function = "linear_distill_backward";
  return translate_errors([&] {
    c10::DeviceGuard guard(student_hidden.device());
    const DistillInputs inputs =
        prepare_inputs(student_hidden, student_weight, teacher_logits, teacher_hidden,
                       teacher_weight, target, class_weight);
    const LinearDistillOptions options = make_options(
        function, inputs, kind, temperature, beta, softcap, soft_weight, hard_weight, ignore_index,
        reduction, label_smoothing, z_loss, workspace_bytes, fp32_logits);
    const Tensor grad_output32 = grad_output.to(result_dtype(student_hidden)).contiguous();
    StudentGradients grads = make_gradients(function, inputs, grad_hidden, grad_weight);

    const TensorView hidden_view = matrix_view(inputs.student_hidden, function, "student_hidden");
    const TensorView weight_view = matrix_view(inputs.student_weight, function, "student_weight");
    const std::size_t bytes = workspace_bytes_for(inputs, options, hidden_view, weight_view, true);
    auto [buffer, workspace] = allocate_workspace(student_hidden, bytes);
    linear_distill_backward(hidden_view, weight_view, teacher_views(function, inputs),
                            optional_vector_view(inputs.target, function, "target"),
                            vector_view(grad_output32, function, "grad_output"), options,
                            grads.views, workspace, current_stream(student_hidden));
    return std::make_tuple(grads.hidden, grads.weight);
  });
}

}  // namespace
}  // namespace xent::torch_binding

TORCH_LIBRARY_FRAGMENT(xent, m) {
  m.def(
      "linear_distill_forward(Tensor student_hidden, Tensor student_weight, "
      "Tensor? teacher_logits, Tensor? teacher_hidden, Tensor? teacher_weight, Tensor? target, "
      "Tensor? class_weight, str kind, float temperature, float beta, float? softcap, "
      "float soft_weight, float hard_weight, int ignore_index, str reduction, "
      "float label_smoothing, float z_loss, int workspace_bytes, bool fp32_logits, "
      "bool grad_hidden, bool grad_weight) -> (Tensor, Tensor, Tensor)");
  m.def(
      "linear_distill_backward(Tensor student_hidden, Tensor student_weight, "
      "Tensor? teacher_logits, Tensor? teacher_hidden, Tensor? teacher_weight, Tensor? target, "
      "Tensor grad_output, Tensor? class_weight, str kind, float temperature, float beta, "
      "float? softcap, float soft_weight, float hard_weight, int ignore_index, str reduction, "
      "float label_smoothing, float z_loss, int workspace_bytes, bool fp32_logits, "
      "bool grad_hidden, bool grad_weight) -> (Tensor, Tensor)");
  xent::torch_binding::impl_on_devices(m, "linear_distill_forward",
                                       &xent::torch_binding::linear_distill_forward_op);
  xent::torch_binding::impl_on_devices(m, "linear_distill_backward",
                                       &xent::torch_binding::linear_distill_backward_op);
}
