// torch ops of vocabulary-parallel distillation (xent/distill_shard.hpp):
// xent::distill_shard_stats, xent::distill_shard_sums, xent::distill_shard_loss and
// xent::distill_shard_backward. The collectives between them live in python/xent/distributed.py;
// these ops never communicate. Distill options come in distill_forward's order.
#include <c10/core/DeviceGuard.h>

#include "binding_support.hpp"
#include "xent/distill_shard.hpp"

namespace xent::torch_binding {
namespace {

using at::Tensor;

// The tensors the views of one call point into, kept alive with them.
struct ShardSlices {
  Tensor student_rows, teacher_rows;
  c10::optional<Tensor> target_vector, class_weight32;
  DistillOptions options;
  TensorView student, teacher, target;
};

ShardSlices prepare_slices(const char* function, const Tensor& student, const Tensor& teacher,
                           const c10::optional<Tensor>& target,
                           const c10::optional<Tensor>& class_weight, c10::string_view kind,
                           double temperature, double beta, c10::optional<double> softcap,
                           double soft_weight, double hard_weight, int64_t ignore_index,
                           c10::string_view reduction, double label_smoothing, double z_loss) {
  ShardSlices s;
  s.student_rows = contiguous_rows(student);
  s.teacher_rows = contiguous_rows(teacher);
  s.target_vector = target.has_value() ? c10::optional<Tensor>(target->contiguous()) : target;
  s.class_weight32 = as_fp32_vector(class_weight);
  s.options = make_distill_options(
      function, kind, temperature, beta, softcap, soft_weight, hard_weight, ignore_index, reduction,
      label_smoothing, z_loss, optional_vector_view(s.class_weight32, function, "class_weight"));
  s.student = matrix_view(s.student_rows, function, "student");
  s.teacher = matrix_view(s.teacher_rows, function, "teacher");
  s.target = optional_vector_view(s.target_vector, function, "target");
  return s;
}

at::TensorOptions record_options(const Tensor& like) {
  return like.options().dtype(like.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
}

c10::optional<Tensor> contiguous_optional(const c10::optional<Tensor>& tensor) {
  return tensor.has_value() ? c10::optional<Tensor>(tensor->contiguous()) : tensor;
}

// [N, kDistillShardStatsWidth] records of the local slice (pass 1).
Tensor distill_shard_stats_op(const Tensor& student, const Tensor& teacher,
                              const c10::optional<Tensor>& target,
                              const c10::optional<Tensor>& class_weight, int64_t vocab_offset,
                              int64_t vocab, c10::string_view kind, double temperature, double beta,
                              c10::optional<double> softcap, double soft_weight, double hard_weight,
                              int64_t ignore_index, c10::string_view reduction,
                              double label_smoothing, double z_loss) {
  return translate_errors([&] {
    const char* function = "distill_shard_stats";
    c10::DeviceGuard guard(student.device());
    const ShardSlices s = prepare_slices(function, student, teacher, target, class_weight, kind,
                                         temperature, beta, softcap, soft_weight, hard_weight,
                                         ignore_index, reduction, label_smoothing, z_loss);
    const int64_t rows = student.dim() >= 1 ? student.size(0) : 0;
    Tensor partial = at::empty({rows, kDistillShardStatsWidth}, record_options(student));
    auto [buffer, workspace] =
        allocate_workspace(student, distill_shard_workspace_size(rows, s.student.device));
    distill_shard_stats(s.student, s.teacher, s.target, {vocab_offset, vocab}, s.options,
                        matrix_view(partial, function, "partial"), workspace,
                        current_stream(student));
    return partial;
  });
}

// [N, kDistillShardSumsWidth] sums of the local slice with the merged lse (pass 2: jsd, tvd).
Tensor distill_shard_sums_op(const Tensor& student, const Tensor& teacher,
                             const c10::optional<Tensor>& target, const Tensor& gathered,
                             int64_t vocab_offset, int64_t vocab, c10::string_view kind,
                             double temperature, double beta, c10::optional<double> softcap,
                             double soft_weight, double hard_weight, int64_t ignore_index,
                             c10::string_view reduction, double label_smoothing, double z_loss) {
  return translate_errors([&] {
    const char* function = "distill_shard_sums";
    c10::DeviceGuard guard(student.device());
    const ShardSlices s = prepare_slices(function, student, teacher, target, c10::nullopt, kind,
                                         temperature, beta, softcap, soft_weight, hard_weight,
                                         ignore_index, reduction, label_smoothing, z_loss);
    const Tensor records = gathered.contiguous();
    const int64_t rows = student.dim() >= 1 ? student.size(0) : 0;
    Tensor sums = at::empty({rows, kDistillShardSumsWidth}, record_options(student));
    auto [buffer, workspace] =
        allocate_workspace(student, distill_shard_workspace_size(rows, s.student.device));
    distill_shard_sums(s.student, s.teacher, s.target, {vocab_offset, vocab},
                       matrix_view(records, function, "gathered"), s.options,
                       matrix_view(sums, function, "sums"), workspace, current_stream(student));
    return sums;
  });
}

// The loss of the N = `rows` rows from the gathered records (and sums).
Tensor distill_shard_loss_op(const Tensor& gathered, const c10::optional<Tensor>& gathered_sums,
                             const c10::optional<Tensor>& target, int64_t rows, int64_t vocab,
                             c10::string_view kind, double temperature, double beta,
                             c10::optional<double> softcap, double soft_weight, double hard_weight,
                             int64_t ignore_index, c10::string_view reduction,
                             double label_smoothing, double z_loss) {
  return translate_errors([&] {
    const char* function = "distill_shard_loss";
    c10::DeviceGuard guard(gathered.device());
    const Tensor records = gathered.contiguous();
    const auto sums = contiguous_optional(gathered_sums);
    const auto target_vector = contiguous_optional(target);
    const DistillOptions options =
        make_distill_options(function, kind, temperature, beta, softcap, soft_weight, hard_weight,
                             ignore_index, reduction, label_smoothing, z_loss, TensorView{});
    Tensor loss = new_loss(records, options.ce.reduction, rows);
    const TensorView records_view = matrix_view(records, function, "gathered");
    auto [buffer, workspace] =
        allocate_workspace(records, distill_shard_workspace_size(rows, records_view.device));
    distill_shard_loss(records_view, optional_matrix_view(sums, function, "gathered_sums"),
                       optional_vector_view(target_vector, function, "target"), rows, {0, vocab},
                       options, vector_view(loss, function, "loss"), workspace,
                       current_stream(records));
    return loss;
  });
}

Tensor distill_shard_backward_op(
    const Tensor& student, const Tensor& teacher, const c10::optional<Tensor>& target,
    const Tensor& gathered, const c10::optional<Tensor>& gathered_sums, const Tensor& grad_output,
    const c10::optional<Tensor>& class_weight, int64_t vocab_offset, int64_t vocab,
    c10::string_view kind, double temperature, double beta, c10::optional<double> softcap,
    double soft_weight, double hard_weight, int64_t ignore_index, c10::string_view reduction,
    double label_smoothing, double z_loss) {
  return translate_errors([&] {
    const char* function = "distill_shard_backward";
    c10::DeviceGuard guard(student.device());
    const ShardSlices s = prepare_slices(function, student, teacher, target, class_weight, kind,
                                         temperature, beta, softcap, soft_weight, hard_weight,
                                         ignore_index, reduction, label_smoothing, z_loss);
    const Tensor records = gathered.contiguous();
    const auto sums = contiguous_optional(gathered_sums);
    const Tensor grad_output32 = grad_output.to(result_dtype(student)).contiguous();
    const int64_t rows = student.dim() >= 1 ? student.size(0) : 0;
    Tensor grad_student = at::empty(s.student_rows.sizes(), student.options());
    auto [buffer, workspace] =
        allocate_workspace(student, distill_shard_workspace_size(rows, s.student.device));
    distill_shard_backward(s.student, s.teacher, s.target, {vocab_offset, vocab},
                           matrix_view(records, function, "gathered"),
                           optional_matrix_view(sums, function, "gathered_sums"),
                           vector_view(grad_output32, function, "grad_output"), s.options,
                           matrix_view(grad_student, function, "grad_student"), workspace,
                           current_stream(student));
    return grad_student;
  });
}

}  // namespace
}  // namespace xent::torch_binding

#define XENT_DISTILL_OPTIONS                                                     \
  "str kind, float temperature, float beta, float? softcap, float soft_weight, " \
  "float hard_weight, int ignore_index, str reduction, float label_smoothing, float z_loss"

TORCH_LIBRARY_FRAGMENT(xent, m) {
  m.def(
      "distill_shard_stats(Tensor student, Tensor teacher, Tensor? target, "
      "Tensor? class_weight, int vocab_offset, int vocab, " XENT_DISTILL_OPTIONS ") -> Tensor");
  m.def(
      "distill_shard_sums(Tensor student, Tensor teacher, Tensor? target, Tensor gathered, "
      "int vocab_offset, int vocab, " XENT_DISTILL_OPTIONS ") -> Tensor");
  m.def(
      "distill_shard_loss(Tensor gathered, Tensor? gathered_sums, Tensor? target, int rows, "
      "int vocab, " XENT_DISTILL_OPTIONS ") -> Tensor");
  m.def(
      "distill_shard_backward(Tensor student, Tensor teacher, Tensor? target, "
      "Tensor gathered, Tensor? gathered_sums, Tensor grad_output, Tensor? class_weight, "
      "int vocab_offset, int vocab, " XENT_DISTILL_OPTIONS ") -> Tensor");
  xent::torch_binding::impl_on_devices(m, "distill_shard_stats",
                                       &xent::torch_binding::distill_shard_stats_op);
  xent::torch_binding::impl_on_devices(m, "distill_shard_sums",
                                       &xent::torch_binding::distill_shard_sums_op);
  xent::torch_binding::impl_on_devices(m, "distill_shard_loss",
                                       &xent::torch_binding::distill_shard_loss_op);
  xent::torch_binding::impl_on_devices(m, "distill_shard_backward",
                                       &xent::torch_binding::distill_shard_backward_op);
}
