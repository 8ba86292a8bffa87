// Checks shared by the validators of the vocabulary-parallel entry points (src/api/shard.cpp,
// src/api/distill_shard.cpp): the slice description and the tensors of partial records.
#pragma once

#include "api/argument_checker.hpp"
#include "xent/shard.hpp"

namespace xent::api {

// The slice [offset, offset + cols) must lie inside [0, vocab).
void check_shard(const ArgumentChecker& check, VocabShard shard, int64_t cols);

// Records of `width` columns: of the local rank (rows == N, gathered false) or of every rank
// (rows == P·N, gathered true), contiguous, float64 for float64 inputs (`dtype`), else float32.
void check_records(const ArgumentChecker& check, const TensorView& records, const char* name,
                   int64_t rows, int64_t width, bool gathered, DType dtype);

}  // namespace xent::api
