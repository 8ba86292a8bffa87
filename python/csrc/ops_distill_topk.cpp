// torch ops xent::distill_topk_forward, _forward_grad and _backward: distill with a teacher given
// as its top-k ids and log-probabilities (docs/semantics.md §3.1).
#include <c10/core/DeviceGuard.h>

#include <string>
#include <tuple>

#include "binding_support.hpp"

namespace xent::torch_binding {
namespace {

using at::Tensor;

TopKMass parse_topk_mass(const char* function, c10::string_view mass_view) {
  const std::string mass(mass_view.data(), mass_view.size());
  if (mass == "renormalize") return TopKMass::renormalize;
  if (mass == "tail") return TopKMass::tail;
  if (mass == "ignore") return TopKMass::ignore;
  TORCH_CHECK_VALUE(false, function, ": topk_mass unknown: got '", mass,
                    "'; expected one of 'renormalize', 'tail', 'ignore'");
}

// The tensors the views point into, the views and the options.
struct TopKCall {
  Tensor student_rows, ids_rows, logprobs_rows;
  c10::optional<Tensor> target_vector, class_weight32;
  DistillOptions options;
  TensorView student_view, target_view;
  TopKTeacher teacher;
  Tensor workspace_buffer;
  Workspace workspace;
};

TopKCall prepare_topk(const char* function, const Tensor& student, const Tensor& ids,
                      const Tensor& logprobs, const c10::optional<Tensor>& target,
                      const c10::optional<Tensor>& class_weight, c10::string_view mass,
                      c10::string_view kind, double temperature, double beta,
                      c10::optional<double> softcap, double soft_weight, double hard_weight,
                      int64_t ignore_index, c10::string_view reduction, double label_smoothing,
                      double z_loss) {
  TopKCall call;
  call.student_rows = contiguous_rows(student);
  call.ids_rows = contiguous_rows(ids);
  call.logprobs_rows = contiguous_rows(logprobs);
  call.target_vector = target.has_value() ? c10::optional<Tensor>(target->contiguous()) : target;
  call.class_weight32 = as_fp32_vector(class_weight);
  call.options = make_distill_options(
      function, kind, temperature, beta, softcap, soft_weight, hard_weight, ignore_index, reduction,
      label_smoothing, z_loss, optional_vector_view(call.class_weight32, function, "class_weight"));
  call.student_view = matrix_view(call.student_rows, function, "student");
  call.target_view = optional_vector_view(call.target_vector, function, "target");
  call.teacher.ids = matrix_view(call.ids_rows, function, "teacher.ids");
  call.teacher.logprobs = matrix_view(call.logprobs_rows, function, "teacher.logprobs");
  call.teacher.mass = parse_topk_mass(function, mass);
  const int64_t rows = student.dim() >= 1 ? student.size(0) : 0;
  const int64_t vocab = student.dim() == 2 ? student.size(1) : 0;
  const std::size_t bytes =
      distill_workspace_size(rows, vocab, call.options, call.student_view.device);
  std::tie(call.workspace_buffer, call.workspace) = allocate_workspace(student, bytes);
  return call;
}

// grad_student: where the gradient goes (the student itself for the in-place form), or null.
Tensor run_topk_forward(const Tensor& student, const Tensor& ids, const Tensor& logprobs,
                        const c10::optional<Tensor>& target,
                        const c10::optional<Tensor>& class_weight, c10::string_view mass,
                        c10::string_view kind, double temperature, double beta,
                        c10::optional<double> softcap, double soft_weight, double hard_weight,
                        int64_t ignore_index, c10::string_view reduction, double label_smoothing,
                        double z_loss, const Tensor* grad_student,
                        const c10::optional<Tensor>& grad_scale) {
  constexpr const char* function = "distill_topk_forward";
  c10::DeviceGuard guard(student.device());
  const TopKCall call = prepare_topk(function, student, ids, logprobs, target, class_weight, mass,
                                     kind, temperature, beta, softcap, soft_weight, hard_weight,
                                     ignore_index, reduction, label_smoothing, z_loss);
  const auto grad_scale32 = as_result_dtype(grad_scale, student);
  const int64_t rows = student.dim() >= 1 ? student.size(0) : 0;
  Tensor loss = new_loss(student, call.options.ce.reduction, rows);
  DistillOutputs out;
  out.loss = vector_view(loss, function, "loss");
  if (grad_student != nullptr) {
    out.grad_student = matrix_view(*grad_student, function, "grad_student");
  }
  distill_topk_forward(call.student_view, call.teacher, call.target_view, call.options, out,
                       optional_vector_view(grad_scale32, function, "grad_scale"), call.workspace,
                       current_stream(student));
  return loss;
}

Tensor distill_topk_forward_op(const Tensor& student, const Tensor& ids, const Tensor& logprobs,
                               const c10::optional<Tensor>& target,
                               const c10::optional<Tensor>& class_weight, c10::string_view mass,
                               c10::string_view kind, double temperature, double beta,
                               c10::optional<double> softcap, double soft_weight,
                               double hard_weight, int64_t ignore_index, c10::string_view reduction,
                               double label_smoothing, double z_loss) {
  return translate_errors([&] {
    return run_topk_forward(student, ids, logprobs, target, class_weight, mass, kind, temperature,
                            beta, softcap, soft_weight, hard_weight, ignore_index, reduction,
                            label_smoothing, z_loss, nullptr, c10::nullopt);
  });
}

// (loss, gradient) in one pass over the student.
std::tuple<Tensor, Tensor> distill_topk_forward_grad_op(
    const Tensor& student, const Tensor& ids, const Tensor& logprobs,
    const c10::optional<Tensor>& target, const c10::optional<Tensor>& class_weight,
    c10::string_view mass, c10::string_view kind, double temperature, double beta,
    c10::optional<double> softcap, double soft_weight, double hard_weight, int64_t ignore_index,
    c10::string_view reduction, double label_smoothing, double z_loss,
    const c10::optional<Tensor>& grad_scale) {
  return translate_errors([&] {
    Tensor grad = at::empty(student.sizes(), student.options());  // contiguous_rows keeps the shape
    Tensor loss =
        run_topk_forward(student, ids, logprobs, target, class_weight, mass, kind, temperature,
                         beta, softcap, soft_weight, hard_weight, ignore_index, reduction,
                         label_smoothing, z_loss, &grad, grad_scale);
    return std::make_tuple(loss, grad);
  });
}

// The gradient written over the student logits (no N×V memory added).
Tensor distill_topk_forward_grad_inplace_op(
    const Tensor& student, const Tensor& ids, const Tensor& logprobs,
    const c10::optional<Tensor>& target, const c10::optional<Tensor>& class_weight,
    c10::string_view mass, c10::string_view kind, double temperature, double beta,
    c10::optional<double> softcap, double soft_weight, double hard_weight, int64_t ignore_index,
    c10::string_view reduction, double label_smoothing, double z_loss,
    const c10::optional<Tensor>& grad_scale) {
  return translate_errors([&] {
    require_in_place_rows("distill_topk_forward", "student", student);
    return run_topk_forward(student, ids, logprobs, target, class_weight, mass, kind, temperature,
                            beta, softcap, soft_weight, hard_weight, ignore_index, reduction,
                            label_smoothing, z_loss, &student, grad_scale);
  });
}

Tensor distill_topk_backward_op(const Tensor& student, const Tensor& ids, const Tensor& logprobs,
                                const c10::optional<Tensor>& target, const Tensor& grad_output,
                                const c10::optional<Tensor>& class_weight, c10::string_view mass,
                                c10::string_view kind, double temperature, double beta,
                                c10::optional<double> softcap, double soft_weight,
                                double hard_weight, int64_t ignore_index,
                                c10::string_view reduction, double label_smoothing, double z_loss) {
  constexpr const char* function = "distill_topk_backward";
  return translate_errors([&] {
    c10::DeviceGuard guard(student.device());
    const TopKCall call = prepare_topk(function, student, ids, logprobs, target, class_weight, mass,
                                       kind, temperature, beta, softcap, soft_weight, hard_weight,
                                       ignore_index, reduction, label_smoothing, z_loss);
    const Tensor grad_output32 = grad_output.to(result_dtype(student)).contiguous();
    Tensor grad_student = at::empty(call.student_rows.sizes(), student.options());
    distill_topk_backward(call.student_view, call.teacher, call.target_view,
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
      "distill_topk_forward(Tensor student, Tensor ids, Tensor logprobs, Tensor? target, "
      "Tensor? class_weight, str topk_mass, str kind, float temperature, float beta, "
      "float? softcap, float soft_weight, float hard_weight, int ignore_index, str reduction, "
      "float label_smoothing, float z_loss) -> Tensor");
  m.def(
      "distill_topk_forward_grad(Tensor student, Tensor ids, Tensor logprobs, Tensor? target, "
      "Tensor? class_weight, str topk_mass, str kind, float temperature, float beta, "
      "float? softcap, float soft_weight, float hard_weight, int ignore_index, str reduction, "
      "float label_smoothing, float z_loss, Tensor? grad_scale) -> (Tensor, Tensor)");
  m.def(
      "distill_topk_forward_grad_inplace(Tensor(a!) student, Tensor ids, Tensor logprobs, "
      "Tensor? target, Tensor? class_weight, str topk_mass, str kind, float temperature, "
      "float beta, float? softcap, float soft_weight, float hard_weight, int ignore_index, "
      "str reduction, float label_smoothing, float z_loss, Tensor? grad_scale) -> Tensor");
  m.def(
      "distill_topk_backward(Tensor student, Tensor ids, Tensor logprobs, Tensor? target, "
      "Tensor grad_output, Tensor? class_weight, str topk_mass, str kind, float temperature, "
      "float beta, float? softcap, float soft_weight, float hard_weight, int ignore_index, "
      "str reduction, float label_smoothing, float z_loss) -> Tensor");
  xent::torch_binding::impl_on_devices(m, "distill_topk_forward",
                                       &xent::torch_binding::distill_topk_forward_op);
  xent::torch_binding::impl_on_devices(m, "distill_topk_forward_grad",
                                       &xent::torch_binding::distill_topk_forward_grad_op);
  xent::torch_binding::impl_on_devices(m, "distill_topk_forward_grad_inplace",
                                       &xent::torch_binding::distill_topk_forward_grad_inplace_op);
  xent::torch_binding::impl_on_devices(m, "distill_topk_backward",
                                       &xent::torch_binding::distill_topk_backward_op);
}
