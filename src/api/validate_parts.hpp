// Checks shared by the validators of several ops (see validate.hpp).
#pragma once

#include <cstddef>
#include <string>

#include "api/argument_checker.hpp"
#include "xent/xent.hpp"

namespace xent::api {

// logits-like [N, V] primary input (shape, dtype, V >= 1).
void check_logits(const ArgumentChecker& check, const TensorView& logits, const char* name);
// target [N] int64/int32; `required` false lets it be absent.
void check_target(const ArgumentChecker& check, const TensorView& target, int64_t rows,
                  const char* expected_when_missing, bool required);
// Every CE option of §1 (scalars and the class/row weight tensors, shapes and dtypes).
void check_ce_options(const ArgumentChecker& check, const CeOptions& options, int64_t rows,
                      int64_t vocab);
void check_loss(const ArgumentChecker& check, const TensorView& loss, Reduction reduction,
                int64_t rows);
void check_grad_output(const ArgumentChecker& check, const TensorView& grad_output,
                       Reduction reduction, int64_t rows);
void check_ce_stats(const ArgumentChecker& check, const CeStats& stats, Reduction reduction,
                    int64_t rows);
// Checks that read values (CPU only): class weights, targets in range.
void check_ce_values(const ArgumentChecker& check, const TensorView& target,
                     const CeOptions& options, int64_t vocab);
void check_workspace(const ArgumentChecker& check, const Workspace& workspace,
                     std::size_t required);
void check_distill_options(const ArgumentChecker& check, const DistillOptions& options,
                           const TensorView& target, int64_t rows, int64_t vocab);

}  // namespace xent::api
