#include "binding_support.hpp"

#include <algorithm>
#include <string>

#if defined(XENT_TORCH_CUDA)
#include <c10/cuda/CUDAStream.h>
#endif

namespace xent::torch_binding {
namespace {

// The names Python users see (torch.int8 prints as int8; c10 would say Char).
std::string torch_dtype_name(at::ScalarType type) {
  switch (type) {
    case at::kByte:
      return "uint8";
    case at::kChar:
      return "int8";
    case at::kShort:
      return "int16";
    case at::kBool:
      return "bool";
    case at::kComplexFloat:
      return "complex64";
    case at::kComplexDouble:
      return "complex128";
    default:
      return c10::toString(type);
  }
}

// What an argument takes: targets are class indices (argmax, an output, holds them too); every
// other tensor is floating point (the core then checks each against the op's rules).
const char* expected_dtypes(const std::string& argument) {
  if (argument == "target") return "int64 or int32 (class indices)";
  if (argument == "argmax") return "int64";
  return "float32, bfloat16, float16 or float64";
}

DType dtype_of(const at::Tensor& tensor, const char* function, const char* argument) {
  switch (tensor.scalar_type()) {
    case at::kFloat:
      return DType::f32;
    case at::kBFloat16:
      return DType::bf16;
    case at::kHalf:
      return DType::f16;
    case at::kDouble:
      return DType::f64;
    case at::kLong:
      return DType::i64;
    case at::kInt:
      return DType::i32;
    default:
      TORCH_CHECK_VALUE(false, function, ": ", argument, " dtype unsupported: got ",
                        torch_dtype_name(tensor.scalar_type()), "; expected ",
                        expected_dtypes(argument));
  }
}

}  // namespace

Device xent_device(const at::Tensor& tensor) {
  Device device;
  if (tensor.is_cuda()) {
    device.kind = DeviceKind::cuda;
    device.index = tensor.get_device();
  }
  return device;
}

at::Tensor contiguous_rows(const at::Tensor& tensor) {
  if (tensor.dim() != 2) return tensor.contiguous();
  const bool columns_contiguous = tensor.stride(1) == 1 || tensor.size(1) <= 1;
  const bool rows_ordered = tensor.stride(0) >= tensor.size(1) || tensor.size(0) <= 1;
  return columns_contiguous && rows_ordered ? tensor : tensor.contiguous();
}

at::Tensor contiguous_vector(const at::Tensor& tensor) { return tensor.contiguous(); }

namespace {
// "[a, b]" by std::to_string: printing the numbers through an ostream (c10's operator<< for an
// IntArrayRef) crashed the CUDA build's module in a PyTorch process on the GPU machine.
std::string dims_text(at::IntArrayRef dims) {
  std::string text = "[";
  for (std::size_t i = 0; i < dims.size(); ++i) {
    text += (i ? ", " : "") + std::to_string(dims[i]);
  }
  return text + "]";
}
}  // namespace

void require_in_place_rows(const char* function, const char* argument, const at::Tensor& tensor,
                           const char* remedy) {
  const bool readable = tensor.dim() == 2 && contiguous_rows(tensor).is_same(tensor);
  if (readable) return;
  const std::string message = std::string(function) + ": " + argument +
                              " cannot take the gradient in place: got a tensor of shape " +
                              dims_text(tensor.sizes()) + " and strides " +
                              dims_text(tensor.strides()) +
                              "; expected 2-D rows with contiguous columns (" + remedy + ")";
  TORCH_CHECK_VALUE(false, message);
}

TensorView matrix_view(const at::Tensor& tensor, const char* function, const char* argument) {
  if (tensor.dim() != 2) return vector_view(tensor, function, argument);
  const int64_t row_stride = tensor.size(0) <= 1 ? tensor.size(1) : tensor.stride(0);
  return matrix(tensor.data_ptr(), dtype_of(tensor, function, argument), tensor.size(0),
                tensor.size(1), row_stride, xent_device(tensor));
}

// 0-D gives a scalar view and 1-D a vector; any other rank keeps its ndim so the core reports
// the shape mismatch by name.
TensorView vector_view(const at::Tensor& tensor, const char* function, const char* argument) {
  const DType dtype = dtype_of(tensor, function, argument);
  if (tensor.dim() == 0) return scalar(tensor.data_ptr(), dtype, xent_device(tensor));
  TensorView view = vector(tensor.data_ptr(), dtype, tensor.numel(), xent_device(tensor));
  if (tensor.dim() > 1) {
    view.ndim = static_cast<int>(tensor.dim());
    view.rows = tensor.size(0);
    view.cols = tensor.numel() / std::max<int64_t>(tensor.size(0), 1);
    view.row_stride = view.cols;
  }
  return view;
}

TensorView optional_matrix_view(const c10::optional<at::Tensor>& tensor, const char* function,
                                const char* argument) {
  return tensor.has_value() ? matrix_view(*tensor, function, argument) : TensorView{};
}

TensorView optional_vector_view(const c10::optional<at::Tensor>& tensor, const char* function,
                                const char* argument) {
  return tensor.has_value() ? vector_view(*tensor, function, argument) : TensorView{};
}

Stream current_stream(const at::Tensor& tensor) {
#if defined(XENT_TORCH_CUDA)
  if (tensor.is_cuda()) {
    return Stream{c10::cuda::getCurrentCUDAStream(tensor.get_device()).stream()};
  }
#else
  (void)tensor;
#endif
  return Stream{};
}

bool stream_is_capturing(const at::Tensor& tensor) {
#if defined(XENT_TORCH_CUDA)
  if (tensor.is_cuda()) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    const cudaError_t error = cudaStreamIsCapturing(
        c10::cuda::getCurrentCUDAStream(tensor.get_device()).stream(), &status);
    TORCH_CHECK(error == cudaSuccess, "cudaStreamIsCapturing: ", cudaGetErrorString(error));
    return status != cudaStreamCaptureStatusNone;
  }
#else
  (void)tensor;
#endif
  return false;
}

Reduction parse_reduction(const char* function, c10::string_view reduction_view) {
  const std::string reduction(reduction_view.data(), reduction_view.size());
  if (reduction == "none") return Reduction::none;
  if (reduction == "sum") return Reduction::sum;
  if (reduction == "mean") return Reduction::mean;
  TORCH_CHECK_VALUE(false, function, ": reduction unknown: got '", reduction,
                    "'; expected one of 'none', 'sum', 'mean'");
}

DistillKind parse_distill_kind(const char* function, c10::string_view kind_view) {
  const std::string kind(kind_view.data(), kind_view.size());
  if (kind == "forward_kl") return DistillKind::forward_kl;
  if (kind == "reverse_kl") return DistillKind::reverse_kl;
  if (kind == "jsd") return DistillKind::jsd;
  if (kind == "soft_ce") return DistillKind::soft_ce;
  if (kind == "tvd") return DistillKind::tvd;
  TORCH_CHECK_VALUE(false, function, ": kind unknown: got '", kind,
                    "'; expected one of 'forward_kl', 'reverse_kl', 'jsd', 'soft_ce', 'tvd'");
}

at::ScalarType result_dtype(const at::Tensor& input) {
  return input.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

c10::optional<at::Tensor> as_result_dtype(const c10::optional<at::Tensor>& tensor,
                                          const at::Tensor& like) {
  if (!tensor.has_value()) return tensor;
  return tensor->to(result_dtype(like)).contiguous();
}

at::Tensor new_loss(const at::Tensor& like, Reduction reduction, int64_t rows) {
  const auto options = like.options().dtype(result_dtype(like));
  return reduction == Reduction::none ? at::empty({rows}, options) : at::empty({}, options);
}

LossOutputs make_loss_outputs(const char* function, const at::Tensor& like, Reduction reduction,
                              int64_t rows, bool with_stats) {
  const auto f32 = like.options().dtype(result_dtype(like));
  const int64_t stat_rows = with_stats ? rows : 0;
  LossOutputs o;
  o.loss = new_loss(like, reduction, rows);
  o.lse = at::empty({rows}, f32);
  o.logprob = at::empty({stat_rows}, f32);
  o.entropy = at::empty({stat_rows}, f32);
  o.argmax = at::empty({stat_rows}, like.options().dtype(at::kLong));
  o.accuracy = with_stats ? at::empty({}, f32) : at::empty({0}, f32);
  o.z_loss_value = with_stats ? new_loss(like, reduction, rows) : at::empty({0}, f32);
  o.loss_view = vector_view(o.loss, function, "loss");
  o.stats.lse = vector_view(o.lse, function, "lse");
  if (with_stats) {
    o.stats.logprob = vector_view(o.logprob, function, "logprob");
    o.stats.entropy = vector_view(o.entropy, function, "entropy");
    o.stats.argmax = vector_view(o.argmax, function, "argmax");
    o.stats.accuracy = vector_view(o.accuracy, function, "accuracy");
    o.stats.z_loss_value = vector_view(o.z_loss_value, function, "z_loss_value");
  }
  return o;
}

c10::optional<at::Tensor> as_fp32_vector(const c10::optional<at::Tensor>& tensor) {
  if (!tensor.has_value()) return c10::nullopt;
  if (!tensor->is_floating_point()) return tensor->contiguous();  // the core rejects it by name
  return tensor->to(at::kFloat).contiguous();
}

CeOptions make_ce_options(const char* function, int64_t ignore_index, c10::string_view reduction,
                          double label_smoothing, double z_loss, c10::optional<double> softcap,
                          double logit_scale, const TensorView& class_weight,
                          const TensorView& row_weight) {
  CeOptions options;
  options.ignore_index = ignore_index;
  options.reduction = parse_reduction(function, reduction);
  options.label_smoothing = label_smoothing;
  options.z_loss = z_loss;
  if (softcap.has_value()) options.softcap = *softcap;
  options.logit_scale = logit_scale;
  options.class_weight = class_weight;
  options.row_weight = row_weight;
  return options;
}

DistillOptions make_distill_options(const char* function, c10::string_view kind, double temperature,
                                    double beta, c10::optional<double> softcap, double soft_weight,
                                    double hard_weight, int64_t ignore_index,
                                    c10::string_view reduction, double label_smoothing,
                                    double z_loss, const TensorView& class_weight) {
  DistillOptions options;
  options.kind = parse_distill_kind(function, kind);
  options.temperature = temperature;
  options.beta = beta;
  if (softcap.has_value()) options.softcap = *softcap;
  options.soft_weight = soft_weight;
  options.hard_weight = hard_weight;
  options.ce = make_ce_options(function, ignore_index, reduction, label_smoothing, z_loss, softcap,
                               1.0, class_weight, TensorView{});
  return options;
}

std::size_t workspace_budget(int64_t workspace_bytes, std::size_t default_budget) {
  return workspace_bytes > 0 ? static_cast<std::size_t>(workspace_bytes) : default_budget;
}

std::pair<at::Tensor, Workspace> allocate_workspace(const at::Tensor& like, std::size_t bytes) {
  if (bytes == 0) return {at::Tensor(), Workspace{}};
  at::Tensor buffer = at::empty({static_cast<int64_t>(bytes)}, like.options().dtype(at::kByte));
  return {buffer, Workspace{buffer.data_ptr(), bytes}};
}

}  // namespace xent::torch_binding
