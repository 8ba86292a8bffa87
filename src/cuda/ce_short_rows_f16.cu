// The short-row ce kernel's instances for f16_t logits (ce_short_rows_kernel.cuh).
#include "cuda/ce_short_rows_kernel.cuh"

namespace xent::cuda {

void ce_short_rows_f16(const short_rows::ShortRowsParams& p, cudaStream_t stream) {
  short_rows::launch_for_vocab<f16_t>(p, stream);
}

}  // namespace xent::cuda
