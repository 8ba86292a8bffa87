// Fused linear policy loss, CPU backend (docs/semantics.md §7 "Fused with the LM head"): per row
// chunk, the logits, each row's statistics (lse, ℓ, H), its policy coefficients from
// common/policy_row.hpp, its gradient c_ℓ·∂ℓ/∂x + c_H·∂H/∂x written over the logits, then the
// chunk's products. Three products, against four for the composition.
#include <vector>

#include "api/backend.hpp"
#include "api/policy_options.hpp"
#include "common/policy_row.hpp"
#include "cpu/ce_rows.hpp"
#include "cpu/linear_chunks.hpp"

namespace xent::cpu {
namespace {

// One valid token's inputs read from the caller's [N] views.
template <class T>
common::PolicyToken<T> read_token(const PolicyTokens& tokens, const common::PolicyOptions<T>& o,
                                  int64_t n, T logprob, T entropy) {
  common::PolicyToken<T> t;
  t.logprob = logprob;
  t.entropy = entropy;
  t.advantage = read_scalar<T>(tokens.advantages, n);
  if (o.has_old) t.old = read_scalar<T>(tokens.old_logprobs, n);
  if (o.has_ref) t.ref = read_scalar<T>(tokens.ref_logprobs, n);
  if (o.has_rollout) t.rollout = read_scalar<T>(tokens.rollout_logprobs, n);
  t.weight = read_scalar<T>(tokens.weight, n);
  return t;
}

template <class S>
void linear_policy_forward_typed(TensorView hidden, TensorView weight, TensorView bias,
                                 TensorView target, const PolicyTokens& tokens,
                                 const LinearPolicyOptions& options, const LinearPolicyOutputs& out,
                                 Workspace workspace) {
  using T = ComputeType<S>;
  const LinearCeOptions linear = api::linear_policy_chunk_options(options);
  const int64_t rows = hidden.rows, vocab = weight.rows;
  const auto call = make_ce_call<T>(linear.ce, vocab, ValidCounts{});
  const auto policy = api::policy_options<T>(options.policy, tokens);
  const bool with_gradients = any_gradient(out.grads);
  // Per-token results kept until every row is done, then summed in row order (deterministic).
  std::vector<common::PolicyResult<T>> results(static_cast<std::size_t>(rows));
  std::vector<char> valid(static_cast<std::size_t>(rows), 0);
  for_each_chunk<S>(
      hidden, weight, bias, out.grads, linear, CacheUse::none, workspace, [&](int64_t n, T* x) {
        const int64_t y = read_target(target, n);
        const auto row = ce_process_row(call, x, y, n, CeRowRequest{}, T(1), x);
        write_result(out.logprob, n, row.logprob);
        write_result(out.entropy, n, row.entropy);
        if (!row.valid) {
          if (with_gradients) zero_row(x, vocab);
          return;
        }
        const auto r =
            common::policy_token(policy, read_token(tokens, policy, n, row.logprob, row.entropy));
        results[n] = r;
        valid[n] = 1;
        if (!with_gradients) return;
        // loss_ce = −ℓ, so c_ℓ·∂ℓ/∂x is the ce gradient with coefficient −c_ℓ.
        common::EntropyGradRow<T> entropy_row;
        const bool entropy_term = r.grad_entropy != T(0);
        if (entropy_term)
          entropy_row = common::entropy_grad_row(r.grad_entropy, row.lse, row.entropy);
        ce_write_row_gradient(call, x, x, row.lse, y, -r.grad_logprob, T(0),
                              entropy_term ? &entropy_row : nullptr);
      });
  double loss = 0, clipped_low = 0, clipped_high = 0, kl = 0, ratio = 0;
  for (int64_t n = 0; n < rows; ++n) {
    if (!valid[n]) continue;
    const auto& r = results[n];
    loss += r.loss;
    clipped_low += r.clipped_low ? 1.0 : 0.0;
    clipped_high += r.clipped_high ? 1.0 : 0.0;
    kl += r.kl;
    ratio += r.ratio;
  }
  write_result(out.loss, 0, loss);
  const double stats[] = {clipped_low, clipped_high, kl, ratio};
  for (int i = 0; i < 4; ++i) write_result(out.stats, i, stats[i]);
}

}  // namespace

// The chunk plan of the row loop; the per-token results live in host vectors of the call.
std::size_t linear_policy_workspace_size(int64_t rows, int64_t hidden, int64_t vocab, DType dtype,
                                         const LinearPolicyOptions& options, bool with_gradients) {
  return linear_ce_workspace_size(rows, hidden, vocab, dtype,
                                  api::linear_policy_chunk_options(options), with_gradients);
}

void linear_policy_forward(TensorView hidden, TensorView weight, TensorView bias, TensorView target,
                           const PolicyTokens& tokens, const LinearPolicyOptions& options,
                           const LinearPolicyOutputs& out, Workspace workspace, Stream) {
  dispatch_float(hidden.dtype, [&](auto storage) {
    linear_policy_forward_typed<decltype(storage)>(hidden, weight, bias, target, tokens, options,
                                                   out, workspace);
  });
}

}  // namespace xent::cpu
