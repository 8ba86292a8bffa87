// Fused linear distillation, CPU backend (docs/semantics.md §4): student chunk logits h_s·W_sᵀ, teacher
// chunk logits from the teacher's logits or from h_t·W_tᵀ, the §3 row math on them (turning the
// student chunk into its gradient in place), then the student's gradient products.
#include <algorithm>
#include <optional>

#include "api/backend.hpp"
#include "cpu/distill_rows.hpp"
#include "cpu/linear_layer.hpp"

namespace xent::cpu {
namespace {

bool any_gradient(const LinearGradients& grads) {
  return grads.hidden.present() || grads.weight.present();
}

LinearShape linear_distill_shape(int64_t rows, int64_t student_hidden, int64_t teacher_hidden,
                                 int64_t vocab, DType dtype, bool with_gradients) {
  LinearShape shape;
  shape.rows = rows;
  shape.hidden = student_hidden;
  shape.vocab = vocab;
  shape.dtype = dtype;
  shape.distill = true;
  shape.teacher_hidden = teacher_hidden;
  shape.with_gradients = with_gradients;
  return shape;
}

// Converts teacher logits rows [row0, row0 + rows) of any floating dtype into the compute type.
template <class T>
void teacher_logits_chunk(TensorView logits, int64_t row0, int64_t rows, T* out) {
  dispatch_float(logits.dtype, [&](auto storage) {
    using U = decltype(storage);
#pragma omp parallel for schedule(static) if (rows * logits.cols >= kParallelWork)
    for (int64_t r = 0; r < rows; ++r) {
      const U* source = row_pointer<const U>(logits, row0 + r);
      for (int64_t i = 0; i < logits.cols; ++i) out[r * logits.cols + i] = to_compute<T>(source[i]);
    }
  });
}

template <class S>
void linear_distill_typed(TensorView student_hidden, TensorView student_weight,
                          const Teacher& teacher, TensorView target, TensorView grad_output,
                          const LinearDistillOptions& options, TensorView loss,
                          const LinearGradients& grads, Workspace workspace) {
  using T = ComputeType<S>;
  const DistillOptions& distill = options.distill;
  const Reduction reduction = distill.ce.reduction;
  const int64_t rows = student_hidden.rows, vocab = student_weight.rows;
  const bool teacher_is_linear = !teacher.logits.present();
  const bool with_gradients = any_gradient(grads);
  const auto plan = plan_linear(
      linear_distill_shape(rows, student_hidden.cols, teacher_is_linear ? teacher.hidden.cols : 0,
                           vocab, student_hidden.dtype, with_gradients),
      options.workspace_budget);

  WorkspaceCursor cursor(workspace, plan.total_bytes());
  LinearLayer<S> student(student_hidden, student_weight, TensorView{}, plan.weight_copy, 0, cursor);
  std::optional<LinearLayer<S>> teacher_layer;
  if (teacher_is_linear) {
    teacher_layer.emplace(teacher.hidden, teacher.weight, TensorView{}, plan.teacher_weight_copy, 0,
                          cursor);
  }
  std::unique_ptr<LinearGradientAccumulator<S>> accumulator;
  if (with_gradients) {
    accumulator =
        std::make_unique<LinearGradientAccumulator<S>>(grads, plan, cursor, vocab, student.width());
  }
  T* logits = cursor.take<T>(plan.logits);
  T* hidden_copy = cursor.take<T>(plan.hidden_copy);
  T* teacher_logits = cursor.take<T>(plan.teacher_logits);
  T* teacher_hidden_copy = cursor.take<T>(plan.teacher_hidden_copy);

  const auto counts =
      count_valid_rows(target, rows, distill.ce.ignore_index, distill.ce.class_weight);
  const auto call = make_distill_call<T>(distill, vocab, counts);
  const bool has_target = target.present();
  const bool want_loss = loss.present();
  std::vector<T> soft(rows), hard_loss(rows), hard_z(rows);

  for (int64_t row0 = 0; row0 < rows; row0 += plan.chunk_rows) {
    const int64_t count = std::min(plan.chunk_rows, rows - row0);
    student.logits(row0, count, hidden_copy, logits, !options.fp32_logits);
    if (teacher_layer) {
      teacher_layer->logits(row0, count, teacher_hidden_copy, teacher_logits, !options.fp32_logits);
    } else {
      teacher_logits_chunk(teacher.logits, row0, count, teacher_logits);
    }
#pragma omp parallel for schedule(static) if (count * vocab >= kParallelWork)
    for (int64_t r = 0; r < count; ++r) {
      const int64_t n = row0 + r;
      T* row = logits + r * vocab;
      const T upstream = upstream_of_row<T>(grad_output, reduction, n);
      const auto result = distill_process_row<T>(
          call, row, teacher_logits + r * vocab, has_target ? read_target(target, n) : 0,
          has_target, n, upstream, with_gradients ? row : static_cast<T*>(nullptr), want_loss);
      soft[n] = result.soft;
      hard_loss[n] = result.hard_loss;
      hard_z[n] = result.hard_z_loss;
      if (want_loss && reduction == Reduction::none) {
        write_result(loss, n, distill_row_loss(call, result));
      }
    }
    if (accumulator) accumulator->add_chunk(student, row0, count, logits, hidden_copy);
  }
  if (accumulator) accumulator->finish();
  if (want_loss && reduction != Reduction::none) {
    write_result(loss, 0, reduce_distill_loss(call, reduction, soft, hard_loss, hard_z));
  }
}

void linear_distill_dispatch(TensorView student_hidden, TensorView student_weight,
                             const Teacher& teacher, TensorView target, TensorView grad_output,
                             const LinearDistillOptions& options, TensorView loss,
                             const LinearGradients& grads, Workspace workspace) {
  dispatch_float(student_hidden.dtype, [&](auto storage) {
    linear_distill_typed<decltype(storage)>(student_hidden, student_weight, teacher, target,
                                            grad_output, options, loss, grads, workspace);
  });
}

}  // namespace

std::size_t linear_distill_workspace_size(int64_t rows, int64_t student_hidden,
                                          int64_t teacher_hidden, int64_t vocab, DType dtype,
                                          const LinearDistillOptions& options,
                                          bool with_gradients) {
  return plan_linear(linear_distill_shape(rows, student_hidden, teacher_hidden, vocab, dtype,
                                          with_gradients),
                     options.workspace_budget)
      .total_bytes();
}

void linear_distill_forward(TensorView student_hidden, TensorView student_weight,
                            const Teacher& teacher, TensorView target,
                            const LinearDistillOptions& options, const LinearDistillOutputs& out,
                            TensorView grad_output, Workspace workspace, Stream) {
  linear_distill_dispatch(student_hidden, student_weight, teacher, target, grad_output, options,
                          out.loss, out.grads, workspace);
}

void linear_distill_backward(TensorView student_hidden, TensorView student_weight,
                             const Teacher& teacher, TensorView target, TensorView grad_output,
                             const LinearDistillOptions& options, const LinearGradients& grads,
                             Workspace workspace, Stream) {
  linear_distill_dispatch(student_hidden, student_weight, teacher, target, grad_output, options,
                          TensorView{}, grads, workspace);
}

}  // namespace xent::cpu
