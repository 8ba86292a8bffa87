// Row-major matrix products through cuBLASLt for the bench's own use (the GEMM floor F and the
// naive form): 16-bit or fp32 operands, fp32 accumulation, no TF32.
#pragma once

#include <cstdint>

#include "xent/types.hpp"

namespace xent::bench {

struct RowMajor {
  const void* data = nullptr;
  DType dtype = DType::bf16;
  int64_t rows = 0, cols = 0;  // as stored
};

// c[M×N] = op(a)·op(b) on `stream`, where op transposes when asked; c has its own dtype (fp32 or
// the operands'). Throws std::runtime_error when cuBLASLt fails or has no algorithm.
void lt_product(const RowMajor& a, bool transpose_a, const RowMajor& b, bool transpose_b, void* c,
                DType c_dtype, void* stream);

}  // namespace xent::bench
