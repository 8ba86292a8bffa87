// Validation of distillation from a top-k teacher (docs/semantics.md §3.1).
#include <cmath>
#include <vector>

#include "api/backend.hpp"
#include "api/topk_access.hpp"
#include "api/validate.hpp"
#include "api/validate_parts.hpp"

namespace xent::api {
namespace {

// Host memory only: on a GPU the values are not read (the top-k teacher runs on the CPU for now).
void check_topk_values(const ArgumentChecker& check, const TopKTeacher& teacher, int64_t vocab) {
  if (!check.on_cpu()) return;
  const TensorView& ids = teacher.ids;
  // A log-probability a little above 0 is the rounding of a probability near 1.
  const double slack = teacher.logprobs.dtype == DType::f32 ? 0x1p-20 : 0x1p-48;
  std::vector<int64_t> seen(static_cast<std::size_t>(vocab), -1);
  for (int64_t n = 0; n < ids.rows; ++n) {
    for (int64_t j = 0; j < ids.cols; ++j) {
      const int64_t id = topk_id(ids, n, j);
      std::string where = "[";
      where.append(std::to_string(n)).append(", ").append(std::to_string(j)).append("]");
      if (id == -1) continue;
      if (id < -1 || id >= vocab) {
        check.fail("teacher.ids", "out of range", "ids" + where + " = " + std::to_string(id),
                   "a token id in [0, " + std::to_string(vocab) + ") or -1 (absent)");
      }
      if (seen[id] == n) {
        check.fail(
            "teacher.ids", "has a duplicate id",
            "ids" + where + " = " + std::to_string(id) + " twice in row " + std::to_string(n),
            "distinct ids in each row (-1 may repeat)");
      }
      seen[id] = n;
      const double l = topk_logprob(teacher.logprobs, n, j);
      if (l > slack) {
        check.fail("teacher.logprobs", "above 0", "logprobs" + where + " = " + number_string(l),
                   "log-probabilities <= 0");
      }
    }
  }
}

void check_topk_common(const ArgumentChecker& check, const TensorView& student,
                       const TopKTeacher& teacher, const TensorView& target,
                       const DistillOptions& options, const TensorView& grad_output) {
  check_logits(check, student, "student");
  const int64_t rows = student.rows, vocab = student.cols;
  check.require_present(teacher.ids, "teacher.ids", "a [N, k] integer tensor");
  check.require_present(teacher.logprobs, "teacher.logprobs", "a [N, k] float tensor");
  check.matrix(teacher.ids, "teacher.ids", rows, -1,
               "[N, k] with N = " + std::to_string(rows) + " (the rows of student)");
  check.dtype_in(teacher.ids, "teacher.ids", {DType::i32, DType::i64}, "int32 or int64");
  check.same_device(teacher.ids, "teacher.ids");
  check.matrix(teacher.logprobs, "teacher.logprobs", rows, teacher.ids.cols,
               "the shape of teacher.ids " + shape_string(teacher.ids));
  check.dtype_in(teacher.logprobs, "teacher.logprobs", {DType::f32, DType::f64},
                 "float32 or float64");
  check.same_device(teacher.logprobs, "teacher.logprobs");
  check_target(check, target, rows, "a [N] tensor", false);
  check_distill_options(check, options, target, rows, vocab);
  if (teacher.mass != TopKMass::renormalize && options.temperature != 1.0) {
    check.fail("temperature", "needs topk_mass renormalize", number_string(options.temperature),
               std::string("temperature 1 with topk_mass ") + topk_mass_name(teacher.mass) +
                   " (the top-k does not fix the tempered teacher's tail), or renormalize");
  }
  if (teacher.mass == TopKMass::ignore && options.kind != DistillKind::forward_kl &&
      options.kind != DistillKind::soft_ce) {
    check.fail("kind", "not defined with topk_mass ignore", distill_kind_name(options.kind),
               "forward_kl or soft_ce (or topk_mass renormalize / tail)");
  }
  check_grad_output(check, grad_output, options.ce.reduction, rows);
}

// On a CUDA device: k within the row kernel's staging, and distill's workspace.
void check_topk_device(const ArgumentChecker& check, const TopKTeacher& teacher,
                       const TensorView& student, const DistillOptions& options,
                       const Workspace& workspace) {
  if (check.on_cpu()) return;
  if (teacher.ids.cols > kDistillTopKMaxK) {
    check.fail("teacher.ids", "too many entries a row for a CUDA device",
               "k = " + std::to_string(teacher.ids.cols),
               "k <= " + std::to_string(kDistillTopKMaxK));
  }
#if defined(XENT_WITH_CUDA)
  check_workspace(check, workspace,
                  cuda::distill_workspace_size(student.rows, student.cols, options));
#else
  (void)student;
  (void)options;
  (void)workspace;
#endif
}

void check_topk_grad(const ArgumentChecker& check, const TensorView& grad,
                     const TensorView& student) {
  check.matrix(grad, "grad_student", student.rows, student.cols,
               "the shape of student " + shape_string(student));
  check.same_dtype(grad, "grad_student", student, "student");
  check.no_overlap(grad, "grad_student", student, "student", true);
}

}  // namespace

void validate_distill_topk_forward(const TensorView& student, const TopKTeacher& teacher,
                                   const TensorView& target, const DistillOptions& options,
                                   const DistillOutputs& out, const TensorView& grad_output,
                                   const Workspace& workspace) {
  const ArgumentChecker check("distill_topk_forward", student.device, student.dtype);
  check_topk_common(check, student, teacher, target, options, grad_output);
  check_loss(check, out.loss, options.ce.reduction, student.rows);
  if (out.grad_student.present()) check_topk_grad(check, out.grad_student, student);
  check_topk_device(check, teacher, student, options, workspace);
  check_ce_values(check, target, options.ce, student.cols);
  check_topk_values(check, teacher, student.cols);
}

void validate_distill_topk_backward(const TensorView& student, const TopKTeacher& teacher,
                                    const TensorView& target, const TensorView& grad_output,
                                    const DistillOptions& options, const TensorView& grad_student,
                                    const Workspace& workspace) {
  const ArgumentChecker check("distill_topk_backward", student.device, student.dtype);
  check_topk_common(check, student, teacher, target, options, grad_output);
  check.require_present(grad_student, "grad_student", "a tensor shaped like student");
  check_topk_grad(check, grad_student, student);
  check_topk_device(check, teacher, student, options, workspace);
  check_ce_values(check, target, options.ce, student.cols);
  check_topk_values(check, teacher, student.cols);
}

}  // namespace xent::api
