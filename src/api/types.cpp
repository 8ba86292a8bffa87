// Names and sizes of the public enums, and the device-side error check.
#include "api/backend.hpp"
#include "xent/xent.hpp"

namespace xent {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return "float32";
    case DType::bf16:
      return "bfloat16";
    case DType::f16:
      return "float16";
    case DType::f64:
      return "float64";
    case DType::i64:
      return "int64";
    case DType::i32:
      return "int32";
  }
  return "unknown";
}

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::f32:
    case DType::i32:
      return 4;
    case DType::bf16:
    case DType::f16:
      return 2;
    case DType::f64:
    case DType::i64:
      return 8;
  }
  return 0;
}

const char* reduction_name(Reduction reduction) {
  switch (reduction) {
    case Reduction::none:
      return "none";
    case Reduction::sum:
      return "sum";
    case Reduction::mean:
      return "mean";
  }
  return "unknown";
}

const char* distill_kind_name(DistillKind kind) {
  switch (kind) {
    case DistillKind::forward_kl:
      return "forward_kl";
    case DistillKind::reverse_kl:
      return "reverse_kl";
    case DistillKind::jsd:
      return "jsd";
    case DistillKind::soft_ce:
      return "soft_ce";
    case DistillKind::tvd:
      return "tvd";
  }
  return "unknown";
}

const char* topk_mass_name(TopKMass mass) {
  switch (mass) {
    case TopKMass::renormalize:
      return "renormalize";
    case TopKMass::tail:
      return "tail";
    case TopKMass::ignore:
      return "ignore";
  }
  return "unknown";
}

void check_errors(Device device, Stream stream) {
  if (device.kind == DeviceKind::cpu) return;  // the CPU backend reports errors at once
#if defined(XENT_WITH_CUDA)
  cuda::check_errors(device, stream);
#else
  (void)stream;
  throw Error(ErrorKind::runtime,
              "check_errors: device not available: got a CUDA device; expected a CPU device "
              "(xent was built without CUDA)");
#endif
}

}  // namespace xent
