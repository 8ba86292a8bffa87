// Dispatch of the short-row ce kernel (ce_short_rows_kernel.cuh; docs/perf-notes.md decision
// 30): the setting XENT_CUDA_SHORT_ROWS, the row limit, and the launch for the logits dtype.
#include <cstdlib>

#include "cuda/ce_short_rows_kernel.cuh"

namespace xent::cuda {
namespace {

using short_rows::kMaxVectors;
using short_rows::ShortRowsParams;

// XENT_CUDA_SHORT_ROWS (ce_short_rows.cuh), read at every call (a getenv, well under a
// microsecond beside the launch) so one process can run both kernels (cuda_short_rows_test.cpp).
int64_t short_row_setting() {
  const char* text = std::getenv("XENT_CUDA_SHORT_ROWS");
  return text != nullptr && text[0] != '\0' ? std::atoll(text) : int64_t{-1};
}

}  // namespace

int64_t short_row_limit(DType dtype) {
  if (dtype != DType::f32 && dtype != DType::bf16 && dtype != DType::f16) return 0;
  const int64_t capacity =  // a pair of warps, kMaxVectors 16-byte vectors a lane
      2 * 32 * kMaxVectors * (16 / static_cast<int64_t>(dtype_size(dtype)));
  const int64_t setting = short_row_setting();
  return setting < 0 ? capacity : (setting < capacity ? setting : capacity);
}

void ce_short_rows(const CeRowsArgs& args, cudaStream_t stream) {
  if (args.rows <= 0) return;
  const std::size_t element = dtype_size(args.dtype);
  ShortRowsParams p{};
  p.args = args;
  p.logits_vector_ok = rows_are_vector_aligned(args.logits, args.row_stride, element);
  p.grad_vector_ok =
      args.grad != nullptr && rows_are_vector_aligned(args.grad, args.grad_row_stride, element);
  switch (args.dtype) {
    case DType::f32: ce_short_rows_f32(p, stream); break;
    case DType::bf16: ce_short_rows_bf16(p, stream); break;
    case DType::f16: ce_short_rows_f16(p, stream); break;
    default:
      throw Error(ErrorKind::invalid_argument,
                  std::string("ce_rows: logits dtype unsupported on CUDA: got ") +
                      dtype_name(args.dtype) + "; expected float32, bfloat16 or float16");
  }
}

}  // namespace xent::cuda
