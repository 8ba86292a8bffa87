// torch ops of the vocabulary-parallel ce pieces (xent/shard.hpp): xent::ce_shard_stats,
// xent::ce_shard_loss and xent::ce_shard_backward. The collective between them lives in
// python/xent/distributed.py; these ops never communicate.
#include <c10/core/DeviceGuard.h>

#include <tuple>

#include "binding_support.hpp"
#include "xent/shard.hpp"

namespace xent::torch_binding {
namespace {

using at::Tensor;

CeOptions shard_options(const char* function, const c10::optional<Tensor>& class_weight32,
                        const c10::optional<Tensor>& row_weight32, int64_t ignore_index,
                        c10::string_view reduction, double label_smoothing, double z_loss,
                        c10::optional<double> softcap, double logit_scale) {
  return make_ce_options(function, ignore_index, reduction, label_smoothing, z_loss, softcap,
                         logit_scale,
                         optional_vector_view(class_weight32, function, "class_weight"),
                         optional_vector_view(row_weight32, function, "row_weight"));
}

// [N, width] partial records of the local slice (float64 for float64 logits, else float32).
Tensor ce_shard_stats_op(const Tensor& logits, const Tensor& target,
                         const c10::optional<Tensor>& class_weight, int64_t vocab_offset,
                         int64_t vocab, int64_t ignore_index, c10::string_view reduction,
                         double label_smoothing, double z_loss, c10::optional<double> softcap,
                         double logit_scale) {
  return translate_errors([&] {
    const char* function = "ce_shard_stats";
    c10::DeviceGuard guard(logits.device());
    const Tensor logits_rows = contiguous_rows(logits);
    const Tensor target_vector = contiguous_vector(target);
    const auto class_weight32 = as_fp32_vector(class_weight);
    const CeOptions options =
        shard_options(function, class_weight32, c10::nullopt, ignore_index, reduction,
                      label_smoothing, z_loss, softcap, logit_scale);
    const int64_t rows = logits.dim() >= 1 ? logits.size(0) : 0;
    const auto dtype = logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    Tensor partial = at::empty({rows, kCeShardStatsWidth}, logits.options().dtype(dtype));
    ce_shard_stats(matrix_view(logits_rows, function, "logits"),
                   vector_view(target_vector, function, "target"), {vocab_offset, vocab}, options,
                   matrix_view(partial, function, "partial"), current_stream(logits));
    return partial;
  });
}

// (loss, lse, logprob, entropy, argmax, accuracy, z_loss_value) as xent::ce_forward returns them
// (statistics empty [0] unless with_stats), from the gathered records [P·N, width].
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> ce_shard_loss_op(
    const Tensor& gathered, const Tensor& target, const c10::optional<Tensor>& row_weight,
    int64_t vocab, int64_t ignore_index, c10::string_view reduction, double label_smoothing,
    double z_loss, c10::optional<double> softcap, double logit_scale, bool with_stats) {
  return translate_errors([&] {
    const char* function = "ce_shard_loss";
    c10::DeviceGuard guard(gathered.device());
    const Tensor records = gathered.contiguous();
    const Tensor target_vector = contiguous_vector(target);
    const auto row_weight32 = as_fp32_vector(row_weight);
    const CeOptions options =
        shard_options(function, c10::nullopt, row_weight32, ignore_index, reduction,
                      label_smoothing, z_loss, softcap, logit_scale);
    const int64_t rows = target.dim() == 1 ? target.size(0) : 0;
    const auto f32 = gathered.options().dtype(result_dtype(gathered));
    Tensor loss = new_loss(records, options.reduction, rows);
    const int64_t stat_rows = with_stats ? rows : 0;
    Tensor lse = at::empty({stat_rows}, f32);
    Tensor logprob = at::empty({stat_rows}, f32);
    Tensor entropy = at::empty({stat_rows}, f32);
    Tensor argmax = at::empty({stat_rows}, gathered.options().dtype(at::kLong));
    Tensor accuracy = with_stats ? at::empty({}, f32) : at::empty({0}, f32);
    Tensor z_loss_value =
        with_stats ? new_loss(records, options.reduction, rows) : at::empty({0}, f32);
    CeOutputs out;
    out.loss = vector_view(loss, function, "loss");
    if (with_stats) {
      out.stats.lse = vector_view(lse, function, "lse");
      out.stats.logprob = vector_view(logprob, function, "logprob");
      out.stats.entropy = vector_view(entropy, function, "entropy");
      out.stats.argmax = vector_view(argmax, function, "argmax");
      out.stats.accuracy = vector_view(accuracy, function, "accuracy");
      out.stats.z_loss_value = vector_view(z_loss_value, function, "z_loss_value");
    }
    const TensorView records_view = matrix_view(records, function, "gathered");
    auto [buffer, workspace] =
        allocate_workspace(records, ce_shard_workspace_size(rows, records_view.device));
    ce_shard_loss(records_view, vector_view(target_vector, function, "target"), {0, vocab}, options,
                  out, workspace, current_stream(records));
    return std::make_tuple(loss, lse, logprob, entropy, argmax, accuracy, z_loss_value);
  });
}

Tensor ce_shard_backward_op(const Tensor& logits, const Tensor& target, const Tensor& gathered,
                            const Tensor& grad_output, const c10::optional<Tensor>& class_weight,
                            const c10::optional<Tensor>& row_weight, int64_t vocab_offset,
                            int64_t vocab, int64_t first_row, int64_t ignore_index,
                            c10::string_view reduction, double label_smoothing, double z_loss,
                            c10::optional<double> softcap, double logit_scale) {
  return translate_errors([&] {
    const char* function = "ce_shard_backward";
    c10::DeviceGuard guard(logits.device());
    const Tensor logits_rows = contiguous_rows(logits);
    const Tensor target_vector = contiguous_vector(target);
    const Tensor records = gathered.contiguous();
    const Tensor grad_output32 = grad_output.to(result_dtype(logits)).contiguous();
    const auto class_weight32 = as_fp32_vector(class_weight);
    const auto row_weight32 = as_fp32_vector(row_weight);
    const CeOptions options =
        shard_options(function, class_weight32, row_weight32, ignore_index, reduction,
                      label_smoothing, z_loss, softcap, logit_scale);
    const int64_t rows = target.dim() == 1 ? target.size(0) : 0;
    Tensor grad_logits = at::empty(logits_rows.sizes(), logits.options());
    const TensorView logits_view = matrix_view(logits_rows, function, "logits");
    auto [buffer, workspace] =
        allocate_workspace(logits, ce_shard_workspace_size(rows, logits_view.device));
    ce_shard_backward(logits_view, vector_view(target_vector, function, "target"),
                      {vocab_offset, vocab}, matrix_view(records, function, "gathered"),
                      vector_view(grad_output32, function, "grad_output"), options,
                      matrix_view(grad_logits, function, "grad_logits"), first_row, workspace,
                      current_stream(logits));
    return grad_logits;
  });
}

}  // namespace
}  // namespace xent::torch_binding

TORCH_LIBRARY_FRAGMENT(xent, m) {
  m.def(
      "ce_shard_stats(Tensor logits, Tensor target, Tensor? class_weight, int vocab_offset, "
      "int vocab, int ignore_index, str reduction, float label_smoothing, float z_loss, "
      "float? softcap, float logit_scale) -> Tensor");
  m.def(
      "ce_shard_loss(Tensor gathered, Tensor target, Tensor? row_weight, int vocab, "
      "int ignore_index, str reduction, float label_smoothing, float z_loss, float? softcap, "
      "float logit_scale, bool with_stats) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "
      "Tensor)");
  m.def(
      "ce_shard_backward(Tensor logits, Tensor target, Tensor gathered, Tensor grad_output, "
      "Tensor? class_weight, Tensor? row_weight, int vocab_offset, int vocab, int first_row, "
      "int ignore_index, "
      "str reduction, float label_smoothing, float z_loss, float? softcap, float logit_scale) "
      "-> Tensor");
  xent::torch_binding::impl_on_devices(m, "ce_shard_stats",
                                       &xent::torch_binding::ce_shard_stats_op);
  xent::torch_binding::impl_on_devices(m, "ce_shard_loss", &xent::torch_binding::ce_shard_loss_op);
  xent::torch_binding::impl_on_devices(m, "ce_shard_backward",
                                       &xent::torch_binding::ce_shard_backward_op);
}
