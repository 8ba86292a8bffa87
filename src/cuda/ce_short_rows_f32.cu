// The short-row ce kernel's instances for float logits (ce_short_rows_kernel.cuh).
#include "cuda/ce_short_rows_kernel.cuh"

namespace xent::cuda {

void ce_short_rows_f32(const short_rows::ShortRowsParams& p, cudaStream_t stream) {
  short_rows::launch_for_vocab<float>(p, stream);
}

}  // namespace xent::cuda
