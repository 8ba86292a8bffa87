// Scratch layout of the naive form (shared by the CPU and CUDA naive code).
#include <cstdint>
#include <type_traits>

#include "bench/naive.hpp"

namespace xent::bench {

NaiveScratch naive_layout(const Case& c, void* base, DeviceKind device) {
  NaiveScratch s;
  auto* cursor = static_cast<char*>(base);
  std::size_t offset = 0;
  auto carve = [&](auto*& pointer, int64_t count) {
    using T = std::remove_reference_t<decltype(*pointer)>;
    if (base) pointer = reinterpret_cast<T*>(cursor + offset);
    // 256-byte alignment keeps every array aligned for vector loads and cuBLASLt.
    offset += (static_cast<std::size_t>(count) * sizeof(T) + 255) / 256 * 256;
  };
  const bool wide = c.dtype == DType::f32;
  const bool grads = c.mode == Mode::fwdbwd;
  const int64_t nv = c.n * c.v;
  const bool cuda = device == DeviceKind::cuda;
  if (is_linear(c.op)) {
    if (!wide && cuda && grads) {
      uint16_t* narrow = nullptr;
      carve(narrow, nv);
      s.grad_narrow = narrow;
    } else if (!wide && !cuda) {
      carve(s.hidden, c.n * c.h);
      carve(s.weight, c.v * c.h);
      if (c.op == Op::linear_distill) {
        carve(s.teacher_hidden, c.n * c.h);
        carve(s.teacher_weight, c.v * c.h);
      }
      if (grads) {
        carve(s.grad_hidden, c.n * c.h);
        carve(s.grad_weight, c.v * c.h);
      }
    }
    carve(s.logits, nv);
    if (c.op == Op::linear_distill) carve(s.teacher, nv);
  } else if (!wide) {
    carve(s.logits, nv);
    if (c.op == Op::distill) carve(s.teacher, nv);
  }
  if (grads) carve(s.grad, nv);
  carve(s.row_loss, c.n);
  carve(s.row_z, c.n);
  carve(s.row_lse, c.n);
  carve(s.row_denominator, c.n);
  if (cuda) carve(s.totals, 8);
  s.bytes = offset;
  return s;
}

std::size_t naive_scratch_bytes(const Case& c, DeviceKind device) {
  return naive_layout(c, nullptr, device).bytes;
}

}  // namespace xent::bench
