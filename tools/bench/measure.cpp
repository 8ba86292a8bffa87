// Timing, memory and agreement of one case. Progress goes to stderr, a line per measurement.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <new>
#include <optional>

#include "bench/measure.hpp"
#include "bench/naive.hpp"
#include "bench/problem.hpp"
#include "bench/xent_ops.hpp"
#include "common/numeric.hpp"

namespace xent::bench {

namespace {

// Agreement is checked on at most this many elements per tensor (the leading rows), so a check
// of a GPU-sized problem stays within host memory and seconds.
constexpr int64_t kCheckElements = int64_t{1} << 27;

std::vector<double> to_host_doubles(BenchDevice& device, const TensorView& view) {
  int64_t count = view.numel();
  if (count > kCheckElements && view.ndim == 2)
    count = std::max<int64_t>(1, kCheckElements / view.cols) * view.cols;
  std::vector<double> values(static_cast<std::size_t>(count));
  std::vector<unsigned char> raw(elements_bytes(count, view.dtype));
  device.to_host(raw.data(), view.data, raw.size());
  for (int64_t i = 0; i < count; ++i) {
    switch (view.dtype) {
      case DType::f32:
        values[i] = reinterpret_cast<const float*>(raw.data())[i];
        break;
      case DType::bf16:
        values[i] = common::to_float(reinterpret_cast<const common::bf16_t*>(raw.data())[i]);
        break;
      case DType::f16:
        values[i] = common::to_float(reinterpret_cast<const common::f16_t*>(raw.data())[i]);
        break;
      default:
        break;
    }
  }
  return values;
}

// ‖a − b‖ / ‖b‖ (‖a‖ when b is zero); NaN anywhere gives NaN.
double relative_error(const std::vector<double>& a, const std::vector<double>& b) {
  double difference = 0, reference = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    difference += (a[i] - b[i]) * (a[i] - b[i]);
    reference += b[i] * b[i];
  }
  return reference > 0 ? std::sqrt(difference / reference) : std::sqrt(difference);
}

std::size_t outputs_bytes(const Outputs& out) {
  std::size_t bytes = 0;
  for (const TensorView* view : {&out.loss, &out.lse})
    if (view->present()) bytes += elements_bytes(view->numel(), view->dtype);
  return bytes;
}

void set_ratio(Record& record, const Case& c, double gemm_floor_ms) {
  const double seconds = record.time.median_ms / 1e3;
  if (is_linear(c.op)) {
    record.ratio_kind = "gemm";
    record.gemm_floor_ms = gemm_floor_ms;
    if (gemm_floor_ms > 0) record.ratio = record.time.median_ms / gemm_floor_ms;
    return;
  }
  // ce: read the logits once (+ write the gradient once); distill: read s and t (+ write grad).
  const std::size_t tensor = elements_bytes(c.n * c.v, c.dtype);
  record.ratio_kind = "bandwidth";
  record.min_bytes = tensor * ((c.op == Op::distill ? 2 : 1) + (c.mode == Mode::fwdbwd ? 1 : 0));
  if (record.copy_bandwidth > 0 && seconds > 0)
    record.ratio = static_cast<double>(record.min_bytes) / seconds / record.copy_bandwidth;
}

// Host copies of the loss and the gradients of one implementation.
struct Snapshot {
  std::vector<double> loss;
  std::vector<std::vector<double>> grads;
};

Snapshot snapshot(BenchDevice& device, const Outputs& out) {
  Snapshot s;
  s.loss = to_host_doubles(device, out.loss);
  for (const TensorView* view : {&out.grad_logits, &out.grad_hidden, &out.grad_weight})
    if (view->present()) s.grads.push_back(to_host_doubles(device, *view));
  return s;
}

}  // namespace

void measure_case(BenchDevice& device, const Case& c, const MeasureSettings& settings,
                  std::vector<Record>& records) {
  char shape[96];
  if (c.h > 0) {
    std::snprintf(shape, sizeof shape, "%lldx%lldx%lld", static_cast<long long>(c.n),
                  static_cast<long long>(c.h), static_cast<long long>(c.v));
  } else {
    std::snprintf(shape, sizeof shape, "%lldx%lld", static_cast<long long>(c.n),
                  static_cast<long long>(c.v));
  }
  const std::string title = std::string(op_name(c.op)) +
                            (is_distill(c.op) ? std::string(":") + distill_kind_name(c.kind) : "") +
                            " " + shape + " " + dtype_name(c.dtype) + " " + mode_name(c.mode) +
                            " " + c.options.describe() + (c.fp32_logits ? " fp32-logits" : "");
  Record base;
  base.spec = c;
  base.device_name = device.name();
  base.copy_bandwidth = settings.copy_bandwidth;

  // Inputs smaller than the cache are rotated among copies so no repetition finds them hot.
  std::optional<Problem> problem;
  try {
    const std::size_t probe = Problem::input_bytes(c);
    int copies = 1;
    if (device.cache_bytes() > 0 && probe < device.cache_bytes())
      copies = static_cast<int>(std::min<std::size_t>(16, 2 * device.cache_bytes() / probe + 1));
    problem.emplace(device, c, copies);
  } catch (const std::exception& error) {
    Record record = base;
    record.impl = "xent";
    record.error = std::string("inputs: ") + error.what();
    std::fprintf(stderr, "[xent-bench] %s: cannot allocate inputs: %s\n", title.c_str(),
                 error.what());
    records.push_back(record);
    return;
  }
  Problem& p = *problem;
  const double gemm_floor =
      is_linear(c.op)
          ? device.gemm_floor_ms(c.n, c.h, c.v, c.dtype, c.mode == Mode::fwdbwd) +
                (c.op == Op::linear_distill
                     ? device.gemm_floor_ms(c.n, c.h, c.v, c.dtype, false)  // teacher logits
                     : 0)
          : 0;

  // --- xent ---
  Record xent_record = base;
  xent_record.impl = "xent";
  Snapshot xent_result;
  try {
    std::fprintf(stderr, "[xent-bench] xent  %s: %d warm-up + %d timed ...\n", title.c_str(),
                 settings.warmup, settings.repeat);
    const std::size_t in_use_before = device.memory_in_use();
    const std::size_t workspace_bytes = xent_workspace_bytes(p, device.device());
    Buffer workspace(device, workspace_bytes);
    const Outputs out = p.make_outputs(p.gradients());
    const Workspace ws{workspace.data(), workspace_bytes};
    run_xent(p, p.inputs(0), out, ws, device.stream());  // first call: errors surface here
    device.synchronize();
    const std::size_t in_use_after = device.memory_in_use();
    if (settings.profile_one_call) {
      // After the first call, so one-time work (lazy module loading, cuBLASLt plan choice,
      // first-touch of the workspace) is not what the profiler sees.
      device.begin_profiled_call();
      run_xent(p, p.inputs(0), out, ws, device.stream());
      device.end_profiled_call();
    }
    xent_record.workspace_bytes = workspace_bytes;
    xent_record.peak_extra_bytes =
        std::max(workspace_bytes + outputs_bytes(out),
                 in_use_after > in_use_before ? in_use_after - in_use_before : std::size_t{0});
    const auto times =
        device.time([&](int i) { run_xent(p, p.inputs(i % p.copies()), out, ws, device.stream()); },
                    settings.warmup, settings.repeat);
    xent_record.time = summarize(times);
    set_ratio(xent_record, c, gemm_floor);
    std::fprintf(stderr, "[xent-bench] xent  %s: median %.3f ms\n", title.c_str(),
                 xent_record.time.median_ms);
    if (settings.check && settings.naive) {
      // The gradients are shared with the naive form: keep xent's result of input copy 0 first.
      run_xent(p, p.inputs(0), out, ws, device.stream());
      device.synchronize();
      xent_result = snapshot(device, out);
    }
  } catch (const std::exception& error) {
    xent_record.error = error.what();
    std::fprintf(stderr, "[xent-bench] xent  %s: error: %s\n", title.c_str(), error.what());
  }

  // --- naive ---
  Record naive_record = base;
  naive_record.impl = "naive";
  if (settings.naive) {
    try {
      std::fprintf(stderr, "[xent-bench] naive %s: %d warm-up + %d timed ...\n", title.c_str(),
                   settings.warmup, settings.repeat);
      const std::size_t scratch_bytes = naive_scratch_bytes(c, device.device().kind);
      Buffer scratch(device, scratch_bytes);
      const Outputs out = p.make_outputs(p.gradients());
      auto run_naive = [&](int i) {
#if defined(XENT_BENCH_CUDA)
        if (device.device().kind == DeviceKind::cuda) {
          naive_cuda(c, p.inputs(i % p.copies()), out, scratch.data(), device.stream());
          return;
        }
#endif
        naive_cpu(c, p.inputs(i % p.copies()), out, scratch.data());
      };
      const auto times = device.time(run_naive, settings.warmup, settings.repeat);
      naive_record.time = summarize(times);
      naive_record.workspace_bytes = scratch_bytes;
      naive_record.peak_extra_bytes = scratch_bytes + outputs_bytes(out);
      set_ratio(naive_record, c, gemm_floor);
      std::fprintf(stderr, "[xent-bench] naive %s: median %.3f ms\n", title.c_str(),
                   naive_record.time.median_ms);
      if (!xent_result.loss.empty()) {
        run_naive(0);
        device.synchronize();
        const Snapshot reference = snapshot(device, out);
        xent_record.loss_rel_err = relative_error(xent_result.loss, reference.loss);
        double worst = 0;
        for (std::size_t g = 0; g < reference.grads.size(); ++g)
          worst = std::max(worst, relative_error(xent_result.grads[g], reference.grads[g]));
        if (!reference.grads.empty()) xent_record.grad_rel_err = worst;
        std::fprintf(stderr, "[xent-bench] check %s: loss rel err %.2e, grad rel err %.2e\n",
                     title.c_str(), xent_record.loss_rel_err, xent_record.grad_rel_err);
      }
    } catch (const std::bad_alloc&) {
      naive_record.error = "out of memory (the naive form materialises N x V logits)";
      std::fprintf(stderr, "[xent-bench] naive %s: %s\n", title.c_str(),
                   naive_record.error.c_str());
    } catch (const std::exception& error) {
      naive_record.error = error.what();
      std::fprintf(stderr, "[xent-bench] naive %s: error: %s\n", title.c_str(), error.what());
    }
  }
  records.push_back(xent_record);
  if (settings.naive) records.push_back(naive_record);
}

}  // namespace xent::bench
