#include "cuda/plan/hidden_sums.hpp"

#include <cstdlib>
#include <cstring>

namespace xent::cuda {

namespace {

bool aligned_16(const void* data) { return reinterpret_cast<std::uintptr_t>(data) % 16 == 0; }

HiddenSums hidden_sums_switch() {
  const char* knob = std::getenv("XENT_CUDA_HIDDEN_SUMS");
  if (knob && std::strcmp(knob, "workspace") == 0) return HiddenSums::workspace;
  if (knob && std::strcmp(knob, "weight_grad") == 0) return HiddenSums::weight_grad;
  return HiddenSums::planned;
}

HiddenSumsHead hidden_sums_head_switch() {
  const char* knob = std::getenv("XENT_CUDA_HIDDEN_SUMS_HEAD");
  if (knob && std::strcmp(knob, "0") == 0) return HiddenSumsHead::never;
  if (knob && std::strcmp(knob, "1") == 0) return HiddenSumsHead::always;
  return HiddenSumsHead::planned;
}

}  // namespace

HiddenSumsScratch hidden_sums_scratch(const LinearGradients& grads) {
  HiddenSumsScratch scratch;
  const TensorView& weight = grads.weight;
  if (weight.present() && !grads.accumulate_weight && weight.row_stride == weight.cols &&
      aligned_16(weight.data)) {
    scratch.weight_grad_row_bytes =
        static_cast<std::size_t>(weight.cols) * dtype_size(weight.dtype);
    scratch.weight_grad_bytes = static_cast<std::size_t>(weight.rows) * scratch.weight_grad_row_bytes;
  }
  const TensorView& hidden = grads.hidden;
  if (hidden.present() && dtype_size(hidden.dtype) == 2 && hidden.row_stride == hidden.cols &&
      aligned_16(hidden.data)) {
    scratch.hidden_grad_bytes =
        static_cast<std::size_t>(hidden.rows) * static_cast<std::size_t>(hidden.cols) * 2;
  }
  return scratch;
}

HiddenSumsScratch contiguous_hidden_sums_scratch(int64_t rows, int64_t hidden, int64_t vocab,
                                                 bool weight_16_bit, bool half) {
  HiddenSumsScratch scratch;
  scratch.weight_grad_row_bytes =
      static_cast<std::size_t>(hidden) * (weight_16_bit ? 2 : sizeof(float));
  scratch.weight_grad_bytes = static_cast<std::size_t>(vocab) * scratch.weight_grad_row_bytes;
  scratch.hidden_grad_bytes =
      half ? static_cast<std::size_t>(rows) * static_cast<std::size_t>(hidden) * 2 : 0;
  return scratch;
}

void set_hidden_sums_places(ChunkRequest& request, const HiddenSumsScratch& scratch) {
  request.weight_grad_bytes = scratch.weight_grad_bytes;
  request.weight_grad_row_bytes = scratch.weight_grad_row_bytes;
  request.hidden_grad_bytes = scratch.hidden_grad_bytes;
  request.hidden_sums = hidden_sums_switch();
  request.hidden_sums_head = hidden_sums_head_switch();
}

}  // namespace xent::cuda
