// The vocabulary-parallel op set every backend implements (xent/shard.hpp,
// xent/distill_shard.hpp), declared beside api/backend_ops.inc; arguments arrive validated by
// src/api/shard.cpp and src/api/distill_shard.cpp.
#pragma once

#include "xent/distill_shard.hpp"
#include "xent/shard.hpp"

#define XENT_SHARD_BACKEND_OPS                                                                  \
  void ce_shard_stats(TensorView logits, TensorView target, VocabShard shard,                   \
                      const CeOptions& options, TensorView partial, Stream stream);             \
  std::size_t ce_shard_workspace_size(int64_t rows);                                            \
  void ce_shard_loss(TensorView gathered, TensorView target, VocabShard shard,                  \
                     const CeOptions& options, const CeOutputs& out, Workspace workspace,       \
                     Stream stream);                                                            \
  void ce_shard_backward(TensorView logits, TensorView target, VocabShard shard,                \
                         TensorView gathered, TensorView grad_output, const CeOptions& options, \
                         TensorView grad_logits, int64_t first_row, Workspace workspace,        \
                         Stream stream);                                                        \
  void distill_shard_stats(TensorView student, TensorView teacher, TensorView target,           \
                           VocabShard shard, const DistillOptions& options, TensorView partial, \
                           Workspace workspace, Stream stream);                                 \
  std::size_t distill_shard_workspace_size(int64_t rows);                                       \
  void distill_shard_sums(TensorView student, TensorView teacher, TensorView target,            \
                          VocabShard shard, TensorView gathered, const DistillOptions& options, \
                          TensorView sums, Workspace workspace, Stream stream);                 \
  void distill_shard_loss(TensorView gathered, TensorView gathered_sums, TensorView target,     \
                          int64_t rows, VocabShard shard, const DistillOptions& options,        \
                          TensorView loss, Workspace workspace, Stream stream);                 \
  void distill_shard_backward(TensorView student, TensorView teacher, TensorView target,        \
                              VocabShard shard, TensorView gathered, TensorView gathered_sums,  \
                              TensorView grad_output, const DistillOptions& options,            \
                              TensorView grad_student, Workspace workspace, Stream stream);

namespace xent::cpu {
XENT_SHARD_BACKEND_OPS
}  // namespace xent::cpu

#if defined(XENT_WITH_CUDA)
namespace xent::cuda {
XENT_SHARD_BACKEND_OPS
}  // namespace xent::cuda
#endif
