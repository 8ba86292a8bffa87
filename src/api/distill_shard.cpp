// Public entry points of vocabulary-parallel distillation (xent/distill_shard.hpp): validate,
// then dispatch by device. The option checks are distill's; what is new is the slice
// description and the record tensors.
#include "xent/distill_shard.hpp"

#include "api/argument_checker.hpp"
#include "api/shard_backend.hpp"
#include "api/shard_checks.hpp"
#include "api/validate_parts.hpp"

namespace xent {
namespace {

DType record_dtype(DType input) { return input == DType::f64 ? DType::f64 : DType::f32; }

// Student and teacher slices of one shape and dtype, the target, the options (class weights
// of the local slice) and the slice; targets are global ids (checked on the CPU).
void check_slices(const api::ArgumentChecker& check, const TensorView& student,
                  const TensorView& teacher, const TensorView& target, VocabShard shard,
                  const DistillOptions& options) {
  api::check_logits(check, student, "student");
  check.require_present(teacher, "teacher", "a tensor shaped like student");
  check.matrix(teacher, "teacher", student.rows, student.cols,
               "the shape of student " + api::shape_string(student));
  check.same_dtype(teacher, "teacher", student, "student");
  check.same_device(teacher, "teacher");
  api::check_shard(check, shard, student.cols);
  api::check_target(check, target, student.rows, "a [N] tensor", false);
  api::check_distill_options(check, options, target, student.rows, student.cols);
  api::check_ce_values(check, TensorView{}, options.ce, student.cols);
  if (target.present()) check.targets_in_range(target, shard.vocab, options.ce.ignore_index);
}

void check_gathered(const api::ArgumentChecker& check, const TensorView& gathered,
                    const TensorView& gathered_sums, int64_t rows, const DistillOptions& options,
                    DType input) {
  api::check_records(check, gathered, "gathered", rows, kDistillShardStatsWidth, true,
                     record_dtype(input));
  check.same_device(gathered, "gathered");
  if (distill_shard_needs_sums(options.kind)) {
    api::check_records(check, gathered_sums, "gathered_sums", rows, kDistillShardSumsWidth, true,
                       record_dtype(input));
    check.same_device(gathered_sums, "gathered_sums");
    if (gathered_sums.rows != gathered.rows) {
      check.fail("gathered_sums", "row count mismatch", std::to_string(gathered_sums.rows),
                 std::to_string(gathered.rows) + " (the rows of gathered: P ranks × N rows)");
    }
  } else {
    check.require_absent(gathered_sums, "gathered_sums",
                         "only jsd and tvd have pass-2 sums (xent/distill_shard.hpp)");
  }
}

void check_workspace(const api::ArgumentChecker& check, const Workspace& workspace, int64_t rows) {
  if (!check.on_cpu()) {
    api::check_workspace(check, workspace, distill_shard_workspace_size(rows, check.device()));
  }
}

}  // namespace

bool distill_shard_needs_sums(DistillKind kind) {
  return kind == DistillKind::jsd || kind == DistillKind::tvd;
}

std::size_t distill_shard_workspace_size(int64_t rows, Device device) {
  api::require_backend("distill_shard_workspace_size", device);
#if defined(XENT_WITH_CUDA)
  if (device.kind == DeviceKind::cuda) return cuda::distill_shard_workspace_size(rows);
#endif
  return cpu::distill_shard_workspace_size(rows);
}

void distill_shard_stats(TensorView student, TensorView teacher, TensorView target,
                         VocabShard shard, const DistillOptions& options, TensorView partial,
                         Workspace workspace, Stream stream) {
  const api::ArgumentChecker check("distill_shard_stats", student.device, student.dtype);
  check_slices(check, student, teacher, target, shard, options);
  api::check_records(check, partial, "partial", student.rows, kDistillShardStatsWidth, false,
                     record_dtype(student.dtype));
  check.same_device(partial, "partial");
  check_workspace(check, workspace, student.rows);
  api::require_backend("distill_shard_stats", student.device);
#if defined(XENT_WITH_CUDA)
  if (student.device.kind == DeviceKind::cuda) {
    return cuda::distill_shard_stats(student, teacher, target, shard, options, partial, workspace,
                                     stream);
  }
#endif
  cpu::distill_shard_stats(student, teacher, target, shard, options, partial, workspace, stream);
}

void distill_shard_sums(TensorView student, TensorView teacher, TensorView target, VocabShard shard,
                        TensorView gathered, const DistillOptions& options, TensorView sums,
                        Workspace workspace, Stream stream) {
  const api::ArgumentChecker check("distill_shard_sums", student.device, student.dtype);
  if (!distill_shard_needs_sums(options.kind)) {
    check.fail("kind", "has no pass-2 sums", distill_kind_name(options.kind),
               "jsd or tvd (the other kinds merge from the pass-1 records alone)");
  }
  check_slices(check, student, teacher, target, shard, options);
  api::check_records(check, gathered, "gathered", student.rows, kDistillShardStatsWidth, true,
                     record_dtype(student.dtype));
  check.same_device(gathered, "gathered");
  api::check_records(check, sums, "sums", student.rows, kDistillShardSumsWidth, false,
                     record_dtype(student.dtype));
  check.same_device(sums, "sums");
  check_workspace(check, workspace, student.rows);
  api::require_backend("distill_shard_sums", student.device);
#if defined(XENT_WITH_CUDA)
  if (student.device.kind == DeviceKind::cuda) {
    return cuda::distill_shard_sums(student, teacher, target, shard, gathered, options, sums,
                                    workspace, stream);
  }
#endif
  cpu::distill_shard_sums(student, teacher, target, shard, gathered, options, sums, workspace,
                          stream);
}

void distill_shard_loss(TensorView gathered, TensorView gathered_sums, TensorView target,
                        int64_t rows, VocabShard shard, const DistillOptions& options,
                        TensorView loss, Workspace workspace, Stream stream) {
  const DType input = gathered.dtype == DType::f64 ? DType::f64 : DType::f32;
  const api::ArgumentChecker check("distill_shard_loss", gathered.device, input);
  if (rows < 0) check.fail("rows", "out of range", std::to_string(rows), "N >= 0");
  api::check_target(check, target, rows, "a [N] tensor", false);
  api::check_shard(check, shard, 0);
  DistillOptions global = options;
  global.ce.class_weight = TensorView{};  // not read: W and w_y arrive in the records
  api::check_distill_options(check, global, target, rows, 0);
  check_gathered(check, gathered, gathered_sums, rows, options, input);
  api::check_loss(check, loss, options.ce.reduction, rows);
  check_workspace(check, workspace, rows);
  if (target.present()) check.targets_in_range(target, shard.vocab, options.ce.ignore_index);
  api::require_backend("distill_shard_loss", gathered.device);
#if defined(XENT_WITH_CUDA)
  if (gathered.device.kind == DeviceKind::cuda) {
    return cuda::distill_shard_loss(gathered, gathered_sums, target, rows, shard, global, loss,
                                    workspace, stream);
  }
#endif
  cpu::distill_shard_loss(gathered, gathered_sums, target, rows, shard, global, loss, workspace,
                          stream);
}

void distill_shard_backward(TensorView student, TensorView teacher, TensorView target,
                            VocabShard shard, TensorView gathered, TensorView gathered_sums,
                            TensorView grad_output, const DistillOptions& options,
                            TensorView grad_student, Workspace workspace, Stream stream) {
  const api::ArgumentChecker check("distill_shard_backward", student.device, student.dtype);
  check_slices(check, student, teacher, target, shard, options);
  check_gathered(check, gathered, gathered_sums, student.rows, options, student.dtype);
  api::check_grad_output(check, grad_output, options.ce.reduction, student.rows);
  check.require_present(grad_student, "grad_student", "a tensor shaped like student");
  check.matrix(grad_student, "grad_student", student.rows, student.cols,
               "the shape of student " + api::shape_string(student));
  check.same_dtype(grad_student, "grad_student", student, "student");
  check.no_overlap(grad_student, "grad_student", student, "student", true);
  check.no_overlap(grad_student, "grad_student", teacher, "teacher", false);
  check_workspace(check, workspace, student.rows);
  api::require_backend("distill_shard_backward", student.device);
#if defined(XENT_WITH_CUDA)
  if (student.device.kind == DeviceKind::cuda) {
    return cuda::distill_shard_backward(student, teacher, target, shard, gathered, gathered_sums,
                                        grad_output, options, grad_student, workspace, stream);
  }
#endif
  cpu::distill_shard_backward(student, teacher, target, shard, gathered, gathered_sums, grad_output,
                              options, grad_student, workspace, stream);
}

}  // namespace xent
