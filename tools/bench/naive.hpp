// The naive form every measurement is compared with: the full N×V logits materialised in fp32,
// a plain softmax cross-entropy (or distillation loss) and its gradient as N×V buffers, products
// through a plain BLAS call. It is written straight from docs/semantics.md, independently of src/common, so
// agreement between the two means something.
#pragma once

#include "bench/problem.hpp"

namespace xent::bench {

// Bytes of scratch (fp32 logits, their gradient, fp32 copies of 16-bit operands, row arrays).
std::size_t naive_scratch_bytes(const Case& c, DeviceKind device);

// CPU: computed on the calling thread's OpenMP team. Products through OpenBLAS when xent was
// built with it, else a blocked loop.
void naive_cpu(const Case& c, const Inputs& in, const Outputs& out, void* scratch);

#if defined(XENT_BENCH_CUDA)
// CUDA: cuBLASLt products (16-bit operands straight from the inputs, fp32 logits out) and one
// block per row for the softmax, on the given stream.
void naive_cuda(const Case& c, const Inputs& in, const Outputs& out, void* scratch, Stream stream);
#endif

// The scratch layout of either backend (base == nullptr: only the size is computed). The CPU
// widens 16-bit operands to fp32 copies for sgemm; CUDA multiplies them as they are and instead
// rounds G to the input dtype (grad_narrow) for the backward products, as autograd would.
struct NaiveScratch {
  float* hidden = nullptr;          // fp32 copy of hidden (16-bit inputs only)
  float* weight = nullptr;          // fp32 copy of weight (16-bit inputs only)
  float* teacher_hidden = nullptr;  // linear_distill, 16-bit inputs
  float* teacher_weight = nullptr;
  float* logits = nullptr;       // N×V fp32 (student logits for distill)
  float* teacher = nullptr;      // N×V fp32 teacher logits (distill)
  float* grad = nullptr;         // N×V fp32 gradient w.r.t. the logits
  float* grad_hidden = nullptr;  // fp32 products before rounding (16-bit inputs)
  float* grad_weight = nullptr;
  void* grad_narrow = nullptr;        // CUDA, 16-bit inputs: G in the input dtype
  double* totals = nullptr;           // CUDA: loss, z, denominator, valid, class weight sum
  double* row_loss = nullptr;         // [N] r_n·ℓ_n
  double* row_z = nullptr;            // [N] r_n·ζ_n
  double* row_lse = nullptr;          // [N]
  double* row_denominator = nullptr;  // [N] w_y (or 1) for valid rows, 0 for ignored ones
  std::size_t bytes = 0;
};
NaiveScratch naive_layout(const Case& c, void* base, DeviceKind device);

}  // namespace xent::bench
