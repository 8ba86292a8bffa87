// The short-row ce kernel's instances for bf16_t logits (ce_short_rows_kernel.cuh).
#include "cuda/ce_short_rows_kernel.cuh"

namespace xent::cuda {

void ce_short_rows_bf16(const short_rows::ShortRowsParams& p, cudaStream_t stream) {
  short_rows::launch_for_vocab<bf16_t>(p, stream);
}

}  // namespace xent::cuda
