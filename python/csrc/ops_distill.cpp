// torch ops xent::distill_forward and xent::distill_backward (docs/semantics.md §3).
#include <c10/core/DeviceGuard.h>

#include <tuple>

#include "binding_support.hpp"

namespace xent::torch_binding {
namespace {

using at::Tensor;

// What the forward and the backward both take from their arguments: contiguous rows, the
// target and class weights in the dtypes the core reads, the options and the workspace.
// The tensors are kept here because the views point into them.
struct DistillCall {
  Tensor student_rows, teacher_rows;
  c10::optional<Tensor> target_vector, class_weight32;
  DistillOptions options;
  TensorView student_view, teacher_view, target_view;
  Tensor workspace_buffer;
  Workspace workspace;
};

DistillCall prepare_distill(const char* function, const Tensor& student, const Tensor& teacher,
                            const c10::optional<Tensor>& target,
                            const c10::optional<Tensor>& class_weight, c10::string_view kind,
                            double temperature, double beta, c10::optional<double> softcap,
                            double soft_weight, double hard_weight, int64_t ignore_index,
                            c10::string_view reduction, double label_smoothing, double z_loss) {
  DistillCall call;
  call.student_rows = contiguous_rows(student);
  call.teacher_rows = contiguous_rows(teacher);
  call.target_vector = target.has_value() ? c10::optional<Tensor>(target->contiguous()) : target;
  call.class_weight32 = as_fp32_vector(class_weight);
  call.options = make_distill_options(
      function, kind, temperature, beta, softcap, soft_weight, hard_weight, ignore_index, reduction,
      label_smoothing, z_loss, optional_vector_view(call.class_weight32, function, "class_weight"));
  call.student_view = matrix_view(call.student_rows, function, "student");
  call.teacher_view = matrix_view(call.teacher_rows, function, "teacher");
  call.target_view = optional_vector_view(call.target_vector, function, "target");
  const int64_t rows = student.dim() >= 1 ? student.size(0) : 0;
  const int64_t vocab = student.dim() == 2 ? student.size(1) : 0;
  const std::size_t bytes =
      distill_workspace_size(rows, vocab, call.options, call.student_view.device);
  std::tie(call.workspace_buffer, call.workspace) = allocate_workspace(student, bytes);
  return call;
}

// The loss, and when `grad_student` is given the gradient in the same pass (it may be the
// student logits themselves) for the upstream scalar `grad_scale` (absent means 1).
Tensor run_distill_forward(const Tensor& student, const Tensor& teacher,
                           const c10::optional<Tensor>& target,
                           const c10::optional<Tensor>& class_weight, c10::string_view kind,
                           double temperature, double beta, c10::optional<double> softcap,
                           double soft_weight, double hard_weight, int64_t ignore_index,
                           c10::string_view reduction, double label_smoothing, double z_loss,
                           const Tensor* grad_student, const c10::optional<Tensor>& grad_scale) {
  constexpr const char* function = "distill_forward";
  c10::DeviceGuard guard(student.device());
  const DistillCall call = prepare_distill(function, student, teacher, target, class_weight, kind,
                                           temperature, beta, softcap, soft_weight, hard_weight,
                                           ignore_index, reduction, label_smoothing, z_loss);
  const auto grad_scale32 = as_result_dtype(grad_scale, student);
  const int64_t rows = student.dim() >= 1 ? student.size(0) : 0;
  Tensor loss = new_loss(student, call.options.ce.reduction, rows);
  DistillOutputs out;
  out.loss = vector_view(loss, function, "loss");
  if (grad_student != nullptr) {
    out.grad_student = matrix_view(*grad_student, function, "grad_student");
  }
  distill_forward(call.student_view, call.teacher_view, call.target_view, call.options, out,
                  optional_vector_view(grad_scale32, function, "grad_scale"), call.workspace,
                  current_stream(student));
  return loss;
}

Tensor distill_forward_op(const Tensor& student, const Tensor& teacher,
                          const c10::optional<Tensor>& target,
                          const c10::optional<Tensor>& class_weight, c10::string_view kind,
                          double temperature, double beta, c10::optional<double> softcap,
                          double soft_weight, double hard_weight, int64_t ignore_index,
                          c10::string_view reduction, double label_smoothing, double z_loss) {
  return translate_errors([&] {
    return run_distill_forward(student, teacher, target, class_weight, kind, temperature, beta,
                               softcap, soft_weight, hard_weight, ignore_index, reduction,
                               label_smoothing, z_loss, nullptr, c10::nullopt);
  });
}

// (loss, gradient) in one pass over student and teacher.
std::tuple<Tensor, Tensor> distill_forward_grad_op(
    const Tensor& student, const Tensor& teacher, const c10::optional<Tensor>& target,
    const c10::optional<Tensor>& class_weight, c10::string_view kind, double temperature,
    double beta, c10::optional<double> softcap, double soft_weight, double hard_weight,
    int64_t ignore_index, c10::string_view reduction, double label_smoothing, double z_loss,
    const c10::optional<Tensor>& grad_scale) {
  return translate_errors([&] {
    Tensor grad = at::empty(student.sizes(), student.options());  // contiguous_rows keeps the shape
    Tensor loss = run_distill_forward(student, teacher, target, class_weight, kind, temperature,
                                      beta, softcap, soft_weight, hard_weight, ignore_index,
                                      reduction, label_smoothing, z_loss, &grad, grad_scale);
    return std::make_tuple(loss, grad);
  });
}

// The gradient written over the student logits (no N×V memory added).
Tensor distill_forward_grad_inplace_op(const Tensor& student, const Tensor& teacher,
                                       const c10::optional<Tensor>& target,
                                       const c10::optional<Tensor>& class_weight,
                                       c10::string_view kind, double temperature, double beta,
                                       c10::optional<double> softcap, double soft_weight,
                                       double hard_weight, int64_t ignore_index,
                                       c10::string_view reduction, double label_smoothing,
                                       double z_loss, const c10::optional<Tensor>& grad_scale) {
  return translate_errors([&] {
    require_in_place_rows("distill_forward", "student", student);
    return run_distill_forward(student, teacher, target, class_weight, kind, temperature, beta,
                               softcap, soft_weight, hard_weight, ignore_index, reduction,
                               label_smoothing, z_loss, &student, grad_scale);
  });
}

Tensor distill_backward_op(const Tensor& student, const Tensor& teacher,
                           const c10::optional<Tensor>& target, const Tensor& grad_output,
                           const c10::optional<Tensor>& class_weight, c10::string_view kind,
                           double temperature, double beta, c10::optional<double> softcap,
                           double soft_weight, double hard_weight, int64_t ignore_index,
                           c10::string_view reduction, double label_smoothing, double z_loss) {
  constexpr const char* function = "distill_backward";
  return translate_errors([&] {
    c10::DeviceGuard guard(student.device());
    const DistillCall call = prepare_distill(function, student, teacher, target, class_weight, kind,
                                             temperature, beta, softcap, soft_weight, hard_weight,
                                             ignore_index, reduction, label_smoothing, z_loss);
    const Tensor grad_output32 = grad_output.to(result_dtype(student)).contiguous();
    Tensor grad_student = at::empty(call.student_rows.sizes(), student.options());
    distill_backward(call.student_view, call.teacher_view, call.target_view,
                     vector_view(grad_output32, function, "grad_output"), call.options,
                     matrix_view(grad_student, function, "grad_student"), call.workspace,
                     current_stream(student));
    return grad_student;
  });
}

}  // namespace
}  // namespace xent::torch_binding

TORCH_LIBRARY_FRAGMENT(xent, m) {
  m.def(
      "distill_forward(Tensor student, Tensor teacher, Tensor? target, Tensor? class_weight, "
      "str kind, float temperature, float beta, float? softcap, float soft_weight, "
      "float hard_weight, int ignore_index, str reduction, float label_smoothing, "
      "float z_loss) -> Tensor");
  m.def(
      "distill_forward_grad(Tensor student, Tensor teacher, Tensor? target, "
      "Tensor? class_weight, str kind, float temperature, float beta, float? softcap, "
      "float soft_weight, float hard_weight, int ignore_index, str reduction, "
      "float label_smoothing, float z_loss, Tensor? grad_scale) -> (Tensor, Tensor)");
  m.def(
      "distill_forward_grad_inplace(Tensor(a!) student, Tensor teacher, Tensor? target, "
      "Tensor? class_weight, str kind, float temperature, float beta, float? softcap, "
      "float soft_weight, float hard_weight, int ignore_index, str reduction, "
      "float label_smoothing, float z_loss, Tensor? grad_scale) -> Tensor");
  m.def(
      "distill_backward(Tensor student, Tensor teacher, Tensor? target, Tensor grad_output, "
      "Tensor? class_weight, str kind, float temperature, float beta, float? softcap, "
      "float soft_weight, float hard_weight, int ignore_index, str reduction, "
      "float label_smoothing, float z_loss) -> Tensor");
  xent::torch_binding::impl_on_devices(m, "distill_forward",
                                       &xent::torch_binding::distill_forward_op);
  xent::torch_binding::impl_on_devices(m, "distill_forward_grad",
                                       &xent::torch_binding::distill_forward_grad_op);
  xent::torch_binding::impl_on_devices(m, "distill_forward_grad_inplace",
                                       &xent::torch_binding::distill_forward_grad_inplace_op);
  xent::torch_binding::impl_on_devices(m, "distill_backward",
                                       &xent::torch_binding::distill_backward_op);
}
