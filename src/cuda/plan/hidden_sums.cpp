#include "cuda/plan/hidden_sums.hpp"

#include <cstdint>

#include "cuda/test_hook.hpp"

namespace xent::cuda {

namespace {

bool aligned_16(const void* data) { return reinterpret_cast<std::uintptr_t>(data) % 16 == 0; }

}  // namespace

HiddenSumsScratch hidden_sums_scratch(const LinearGradients& grads) {
  HiddenSumsScratch scratch;
  const TensorView& weight = grads.weight;
  if (weight.present() && !grads.accumulate_weight && weight.row_stride == weight.cols &&
      aligned_16(weight.data)) {
    scratch.weight_grad_row_bytes =
        static_cast<std::size_t>(weight.cols) * dtype_size(weight.dtype);
    scratch.weight_grad_bytes =
        static_cast<std::size_t>(weight.rows) * scratch.weight_grad_row_bytes;
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
  request.hidden_sums = test_hook().hidden_sums;
  request.hidden_sums_head = test_hook().hidden_sums_head;
}

}  // namespace xent::cuda
