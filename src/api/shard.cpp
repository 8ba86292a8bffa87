// Public entry points of the vocabulary-parallel ce pieces (xent/shard.hpp): validate, then
// dispatch by device. The messages follow the ce ones; what is new is the shard description.
#include "xent/shard.hpp"

#include "api/argument_checker.hpp"
#include "api/shard_backend.hpp"
#include "api/shard_checks.hpp"
#include "api/validate_parts.hpp"

namespace xent {
namespace {

CeOptions without_class_weight(CeOptions options) {
  options.class_weight = TensorView{};
  return options;
}

}  // namespace

void ce_shard_stats(TensorView logits, TensorView target, VocabShard shard,
                    const CeOptions& options, TensorView partial, Stream stream) {
  const api::ArgumentChecker check("ce_shard_stats", logits.device, logits.dtype);
  api::check_logits(check, logits, "logits");
  api::check_shard(check, shard, logits.cols);
  api::check_target(check, target, logits.rows, "a [N] tensor", true);
  api::check_ce_options(check, options, logits.rows, logits.cols);
  api::check_records(check, partial, "partial", logits.rows, kCeShardStatsWidth, false,
                     logits.dtype);
  check.same_device(partial, "partial");
  api::check_ce_values(check, TensorView{}, options, logits.cols);
  check.targets_in_range(target, shard.vocab, options.ignore_index);
  api::require_backend("ce_shard_stats", logits.device);
#if defined(XENT_WITH_CUDA)
  if (logits.device.kind == DeviceKind::cuda) {
    return cuda::ce_shard_stats(logits, target, shard, options, partial, stream);
  }
#endif
  cpu::ce_shard_stats(logits, target, shard, options, partial, stream);
}

std::size_t ce_shard_workspace_size(int64_t rows, Device device) {
  api::require_backend("ce_shard_workspace_size", device);
#if defined(XENT_WITH_CUDA)
  if (device.kind == DeviceKind::cuda) return cuda::ce_shard_workspace_size(rows);
#endif
  return cpu::ce_shard_workspace_size(rows);
}

void ce_shard_loss(TensorView gathered, TensorView target, VocabShard shard,
                   const CeOptions& options, const CeOutputs& out, Workspace workspace,
                   Stream stream) {
  const api::ArgumentChecker check("ce_shard_loss", gathered.device, gathered.dtype);
  const int64_t rows = target.present() ? target.rows : 0;
  api::check_target(check, target, rows, "a [N] tensor", true);
  api::check_shard(check, shard, 0);
  api::check_records(check, gathered, "gathered", rows, kCeShardStatsWidth, true,
                     gathered.dtype == DType::f64 ? DType::f64 : DType::f32);
  const CeOptions plain = without_class_weight(options);
  api::check_ce_options(check, plain, rows, 0);
  api::check_loss(check, out.loss, options.reduction, rows);
  api::check_ce_stats(check, out.stats, options.reduction, rows);
  check.require_absent(out.grad_logits, "grad_logits",
                       "ce_shard_loss reads no logits; use ce_shard_backward");
  if (!check.on_cpu())
    api::check_workspace(check, workspace, ce_shard_workspace_size(rows, gathered.device));
  check.targets_in_range(target, shard.vocab, options.ignore_index);
  api::require_backend("ce_shard_loss", gathered.device);
#if defined(XENT_WITH_CUDA)
  if (gathered.device.kind == DeviceKind::cuda) {
    return cuda::ce_shard_loss(gathered, target, shard, plain, out, workspace, stream);
  }
#endif
  cpu::ce_shard_loss(gathered, target, shard, plain, out, workspace, stream);
}

void ce_shard_backward(TensorView logits, TensorView target, VocabShard shard, TensorView gathered,
                       TensorView grad_output, const CeOptions& options, TensorView grad_logits,
                       int64_t first_row, Workspace workspace, Stream stream) {
  const api::ArgumentChecker check("ce_shard_backward", logits.device, logits.dtype);
  api::check_logits(check, logits, "logits");
  const int64_t rows = target.present() ? target.rows : 0;
  api::check_shard(check, shard, logits.cols);
  api::check_target(check, target, rows, "a [N] tensor", true);
  if (first_row < 0 || first_row + logits.rows > rows) {
    check.fail(
        "first_row", "out of range",
        std::to_string(first_row) + " with " + std::to_string(logits.rows) + " rows of logits",
        "a block of rows inside the N = " + std::to_string(rows) + " rows of target");
  }
  api::check_ce_options(check, options, rows, logits.cols);
  api::check_records(check, gathered, "gathered", rows, kCeShardStatsWidth, true, logits.dtype);
  check.same_device(gathered, "gathered");
  api::check_grad_output(check, grad_output, options.reduction, rows);
  check.require_present(grad_logits, "grad_logits", "a tensor shaped like logits");
  check.matrix(grad_logits, "grad_logits", logits.rows, logits.cols,
               "the shape of logits " + api::shape_string(logits));
  check.same_dtype(grad_logits, "grad_logits", logits, "logits");
  check.no_overlap(grad_logits, "grad_logits", logits, "logits", true);
  if (!check.on_cpu())
    api::check_workspace(check, workspace, ce_shard_workspace_size(rows, logits.device));
  api::check_ce_values(check, TensorView{}, options, logits.cols);
  check.targets_in_range(target, shard.vocab, options.ignore_index);
  api::require_backend("ce_shard_backward", logits.device);
#if defined(XENT_WITH_CUDA)
  if (logits.device.kind == DeviceKind::cuda) {
    return cuda::ce_shard_backward(logits, target, shard, gathered, grad_output, options,
                                   grad_logits, first_row, workspace, stream);
  }
#endif
  cpu::ce_shard_backward(logits, target, shard, gathered, grad_output, options, grad_logits,
                         first_row, workspace, stream);
}

}  // namespace xent
