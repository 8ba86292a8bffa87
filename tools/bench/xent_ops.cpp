// Public-API calls of the measured ops (include/xent only).
#include "bench/xent_ops.hpp"

namespace xent::bench {

namespace {

LinearCeOptions linear_ce_options(const Problem& p, const Inputs& in) {
  LinearCeOptions o;
  o.ce = p.ce_options(in);
  o.workspace_budget = p.spec().budget_bytes;
  o.fp32_logits = p.spec().fp32_logits;
  return o;
}

LinearDistillOptions linear_distill_options(const Problem& p, const Inputs& in) {
  LinearDistillOptions o;
  o.distill = p.distill_options(in);
  o.workspace_budget = p.spec().budget_bytes;
  o.fp32_logits = p.spec().fp32_logits;
  return o;
}

}  // namespace

std::size_t xent_workspace_bytes(const Problem& p, Device device) {
  const Case& c = p.spec();
  const Inputs& in = p.inputs(0);
  const bool grads = c.mode == Mode::fwdbwd;
  switch (c.op) {
    case Op::ce:
      return ce_workspace_size(c.n, c.v, p.ce_options(in), device);
    case Op::distill:
      return distill_workspace_size(c.n, c.v, p.distill_options(in), device);
    case Op::linear_ce:
      return linear_ce_workspace_size(c.n, c.h, c.v, c.dtype, linear_ce_options(p, in), device,
                                      grads);
    case Op::linear_distill:
      return linear_distill_workspace_size(c.n, c.h, c.h, c.v, c.dtype,
                                           linear_distill_options(p, in), device, grads);
  }
  return 0;
}

void run_xent(const Problem& p, const Inputs& in, const Outputs& out, Workspace ws, Stream stream) {
  const Case& c = p.spec();
  const bool grads = c.mode == Mode::fwdbwd;
  // sum/mean: the gradient is formed in the forward pass; none needs the real g_n afterwards.
  const bool fused_backward = grads && c.reduction != Reduction::none;
  const bool separate_backward = grads && c.reduction == Reduction::none;
  switch (c.op) {
    case Op::ce: {
      const CeOptions o = p.ce_options(in);
      CeOutputs outputs{out.loss, {}, fused_backward ? out.grad_logits : TensorView{}};
      if (separate_backward) outputs.stats.lse = out.lse;
      ce_forward(in.logits, in.target, o, outputs, {}, ws, stream);
      if (separate_backward)
        ce_backward(in.logits, in.target, out.lse, in.grad_output, o, out.grad_logits, ws, stream);
      return;
    }
    case Op::distill: {
      const DistillOptions o = p.distill_options(in);
      distill_forward(in.logits, in.teacher, in.target, o,
                      {out.loss, fused_backward ? out.grad_logits : TensorView{}}, {}, ws, stream);
      if (separate_backward)
        distill_backward(in.logits, in.teacher, in.target, in.grad_output, o, out.grad_logits, ws,
                         stream);
      return;
    }
    case Op::linear_ce: {
      const LinearCeOptions o = linear_ce_options(p, in);
      const LinearGradients gradients{out.grad_hidden, out.grad_weight, {}};
      LinearCeOutputs outputs{out.loss, {}, fused_backward ? gradients : LinearGradients{}};
      if (separate_backward) outputs.stats.lse = out.lse;
      linear_ce_forward(in.hidden, in.weight, {}, in.target, o, outputs, {}, ws, stream);
      if (separate_backward)
        linear_ce_backward(in.hidden, in.weight, {}, in.target, out.lse, in.grad_output, o,
                           gradients, ws, stream);
      return;
    }
    case Op::linear_distill: {
      const LinearDistillOptions o = linear_distill_options(p, in);
      const Teacher teacher{{}, in.teacher_hidden, in.teacher_weight};
      const LinearGradients gradients{out.grad_hidden, out.grad_weight, {}};
      linear_distill_forward(in.hidden, in.weight, teacher, in.target, o,
                             {out.loss, fused_backward ? gradients : LinearGradients{}}, {}, ws,
                             stream);
      if (separate_backward)
        linear_distill_backward(in.hidden, in.weight, teacher, in.target, in.grad_output, o,
                                gradients, ws, stream);
      return;
    }
  }
}

}  // namespace xent::bench
