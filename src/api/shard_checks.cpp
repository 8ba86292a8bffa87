// Checks of the vocabulary-parallel entry points (shard_checks.hpp).
#include "api/shard_checks.hpp"

#include <string>

namespace xent::api {
namespace {

std::string rows_of(int64_t rows, int64_t width, const char* what) {
  return bracketed(rows, ", ").append(std::to_string(width)).append("] ").append(what);
}

}  // namespace

void check_shard(const ArgumentChecker& check, VocabShard shard, int64_t cols) {
  if (shard.vocab < 1 || shard.vocab > INT32_MAX) {
    check.fail("vocab", "out of range", std::to_string(shard.vocab),
               "the global vocabulary size, 1 <= V < 2^31");
  }
  if (shard.offset < 0 || shard.offset + cols > shard.vocab) {
    check.fail("vocab_offset", "out of range",
               std::to_string(shard.offset) + " with " + std::to_string(cols) + " local columns",
               "0 <= offset and offset + local columns <= V = " + std::to_string(shard.vocab));
  }
}

void check_records(const ArgumentChecker& check, const TensorView& records, const char* name,
                   int64_t rows, int64_t width, bool gathered, DType dtype) {
  check.require_present(records, name,
                        rows_of(rows, width, "tensor of partial statistics").c_str());
  check.matrix(records, name, gathered ? -1 : rows, width,
               gathered ? rows_of(rows, width, "times the number of ranks, rank-major")
                        : rows_of(rows, width, "(one record per row)"));
  if (gathered && (rows == 0 ? records.rows != 0 : records.rows % rows != 0 || records.rows == 0)) {
    check.fail(name, "row count mismatch", std::to_string(records.rows),
               "a positive multiple of N = " + std::to_string(rows) + " (P ranks × N rows)");
  }
  if (dtype == DType::f64) {
    check.dtype_in(records, name, {DType::f64}, "float64 (the logits are float64)");
  } else {
    check.fp32(records, name);
  }
  if (records.row_stride != width) {
    check.fail(name, "not contiguous", "row stride " + std::to_string(records.row_stride),
               std::to_string(width));
  }
}

}  // namespace xent::api
