// The linear layer x = h·Wᵀ (+ bias) of the CPU fused ops, chunk by chunk: chunk logits in the
// compute type, and the gradient products ∂h = G·W, ∂W += Gᵀ·h, ∂bias += Σ_n G_n with fp32 (or
// fp64) accumulation across chunks, written to the outputs once at the end.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include "cpu/gemm.hpp"
#include "cpu/linear_plan.hpp"
#include "cpu/tensor_access.hpp"
#include "xent/linear_ce.hpp"

namespace xent::cpu {

// Hands out the plan's buffers from the caller's workspace, or from memory of its own when the
// workspace is empty (allowed on the CPU).
class WorkspaceCursor {
 public:
  WorkspaceCursor(Workspace workspace, std::size_t total) {
    if (workspace.data == nullptr || workspace.bytes == 0) {
      owned_ = std::make_unique<std::byte[]>(total);
      next_ = owned_.get();
      end_ = next_ + total;
    } else {
      next_ = static_cast<std::byte*>(workspace.data);
      end_ = next_ + workspace.bytes;
    }
  }

  template <class T>
  T* take(std::size_t bytes) {
    if (bytes == 0) return nullptr;
    auto address = reinterpret_cast<std::uintptr_t>(next_);
    const std::size_t pad =
        (LinearPlan::alignment - address % LinearPlan::alignment) % LinearPlan::alignment;
    T* result = reinterpret_cast<T*>(next_ + pad);
    next_ += pad + bytes;
    if (next_ > end_) {  // validation sized the workspace by the same plan: a bug if reached
      throw Error(ErrorKind::runtime, "linear workspace: plan exceeds the workspace");
    }
    return result;
  }

 private:
  std::unique_ptr<std::byte[]> owned_;
  std::byte* next_ = nullptr;
  std::byte* end_ = nullptr;
};

// A compute-type view of a matrix: the input itself when it is already in the compute type, else
// a converted copy in the workspace.
template <class T>
struct ComputeMatrix {
  const T* data = nullptr;
  int64_t stride = 0;
};

template <class T, class S>
ComputeMatrix<T> as_compute_matrix(TensorView view, int64_t row0, int64_t rows, T* copy) {
  if constexpr (std::is_same_v<S, T>) {
    return {row_pointer<const S>(view, row0), view.row_stride};
  } else {
    const int64_t cols = view.cols;
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelWork)
    for (int64_t r = 0; r < rows; ++r) {
      const S* source = row_pointer<const S>(view, row0 + r);
      T* destination = copy + r * cols;
      for (int64_t i = 0; i < cols; ++i) destination[i] = to_compute<T>(source[i]);
    }
    return {copy, cols};
  }
}

// Rows [row0, row0 + rows) of `out` (any float dtype) from a dense compute-type buffer.
template <class T>
void store_compute_rows(TensorView out, int64_t row0, int64_t rows, const T* source,
                        int64_t stride) {
  dispatch_float(out.dtype, [&](auto storage) {
    using D = decltype(storage);
#pragma omp parallel for schedule(static) if (rows * out.cols >= kParallelWork)
    for (int64_t r = 0; r < rows; ++r) {
      D* destination = row_pointer<D>(out, row0 + r);
      for (int64_t i = 0; i < out.cols; ++i)
        destination[i] = from_compute<D>(source[r * stride + i]);
    }
  });
}

// The reverse: rows of `in` (any float dtype) into a dense compute-type buffer.
template <class T>
void load_compute_rows(TensorView in, int64_t row0, int64_t rows, T* destination, int64_t stride) {
  dispatch_float(in.dtype, [&](auto storage) {
    using D = decltype(storage);
#pragma omp parallel for schedule(static) if (rows * in.cols >= kParallelWork)
    for (int64_t r = 0; r < rows; ++r) {
      const D* source = row_pointer<const D>(in, row0 + r);
      for (int64_t i = 0; i < in.cols; ++i) destination[r * stride + i] = to_compute<T>(source[i]);
    }
  });
}

// One linear layer (student, or teacher of linear distillation) over the chunks of a call.
template <class S>
class LinearLayer {
 public:
  using T = ComputeType<S>;

  LinearLayer(TensorView hidden, TensorView weight, TensorView bias, std::size_t weight_copy,
              std::size_t bias_copy, WorkspaceCursor& cursor)
      : hidden_(hidden), vocab_(weight.rows), width_(weight.cols) {
    weight_ = as_compute_matrix<T, S>(weight, 0, vocab_, cursor.take<T>(weight_copy));
    T* bias_buffer = cursor.take<T>(bias_copy);
    if (bias.present()) {
      bias_ = as_compute_matrix<T, S>(as_row(bias), 0, 1, bias_buffer).data;
    }
  }

  // Chunk rows [row0, row0 + rows) of h·Wᵀ + bias into `logits` (rows × V, dense). With
  // `round_logits` each value is rounded to the input dtype, as a framework computing the
  // logits in that dtype would (docs/semantics.md §2).
  // `fixed_order`: the product sums each element the same way whatever `rows` is (batch
  // invariance, slower than OpenBLAS).
  void logits(int64_t row0, int64_t rows, T* hidden_copy, T* logits, bool round_logits,
              bool fixed_order = false) const {
    const auto h = as_compute_matrix<T, S>(hidden_, row0, rows, hidden_copy);
    const auto product = fixed_order ? gemm_fixed_order<T> : gemm<T>;
    product(false, true, rows, vocab_, width_, T(1), h.data, h.stride, weight_.data, weight_.stride,
            T(0), logits, vocab_);
    if (!bias_ && !(round_logits && !std::is_same_v<S, T>)) return;
#pragma omp parallel for schedule(static) if (rows * vocab_ >= kParallelWork)
    for (int64_t r = 0; r < rows; ++r) {
      T* row = logits + r * vocab_;
      if (bias_) {
        for (int64_t i = 0; i < vocab_; ++i) row[i] += bias_[i];
      }
      if constexpr (!std::is_same_v<S, T>) {
        if (round_logits) {
          for (int64_t i = 0; i < vocab_; ++i) row[i] = round_to<S>(row[i]);
        }
      }
    }
  }

  // Like logits(), with the values a forward stored in `cache` instead of the product; the
  // hidden chunk is still converted, because the ∂W product needs it.
  void cached_logits(int64_t row0, int64_t rows, T* hidden_copy, T* logits,
                     TensorView cache) const {
    as_compute_matrix<T, S>(hidden_, row0, rows, hidden_copy);
    load_compute_rows(cache, row0, rows, logits, vocab_);
  }

  const ComputeMatrix<T>& weight() const { return weight_; }
  TensorView hidden() const { return hidden_; }
  int64_t vocab() const { return vocab_; }
  int64_t width() const { return width_; }

 private:
  static TensorView as_row(TensorView vector) {
    TensorView row = vector;
    row.ndim = 2;
    row.cols = vector.rows;
    row.rows = 1;
    row.row_stride = vector.rows;
    return row;
  }

  TensorView hidden_;
  int64_t vocab_, width_;
  ComputeMatrix<T> weight_;
  const T* bias_ = nullptr;
};

// Accumulates the gradients of one layer from the chunk gradients G = ∂loss/∂logits.
template <class S>
class LinearGradientAccumulator {
 public:
  using T = ComputeType<S>;

  LinearGradientAccumulator(const LinearGradients& grads, const LinearPlan& plan,
                            WorkspaceCursor& cursor, int64_t vocab, int64_t width,
                            WeightGradAccumulation accumulation = WeightGradAccumulation::fp32)
      : grads_(grads), vocab_(vocab), width_(width) {
    grad_hidden_copy_ = cursor.take<T>(plan.grad_hidden);
    T* weight_buffer = cursor.take<T>(plan.grad_weight_accumulator);
    T* bias_buffer = cursor.take<T>(plan.grad_bias_accumulator);
    // A 16-bit ∂W summed in its own dtype: each chunk's product is staged block by block in the
    // compute type (the output's rows read, the product added, one rounding back), as a product
    // with a 16-bit C and beta = 1 does on a GPU.
    in_weight_dtype_ = accumulation == WeightGradAccumulation::weight_dtype &&
                       grads.weight.present() && dtype_size(grads.weight.dtype) == 2;
    if (in_weight_dtype_) {
      staging_ = own(weight_buffer, std::min(vocab, kWeightGradBlockRows) * width);
    } else if (grads.weight.present()) {
      grad_weight_ =
          direct<T>(grads.weight)
              ? ComputeMatrix<T>{static_cast<T*>(grads.weight.data), grads.weight.row_stride}
              : ComputeMatrix<T>{own(weight_buffer, vocab * width), width};
      // accumulate_weight: the caller's buffer (the compute type, validated) keeps what it holds
      // and the chunk products add to it.
      if (!grads.accumulate_weight) {
        zero(const_cast<T*>(grad_weight_.data), vocab, width, grad_weight_.stride);
      }
    }
    if (grads.bias.present()) {
      grad_bias_ =
          direct<T>(grads.bias) ? static_cast<T*>(grads.bias.data) : own(bias_buffer, vocab);
      zero(grad_bias_, 1, vocab, vocab);
    }
  }

  // Adds the products of chunk rows [row0, row0 + rows): G (rows × V, dense) and the layer's
  // hidden chunk (already converted into `hidden_copy` by LinearLayer::logits when needed).
  // G is rounded to the input dtype first (in place): the products take 16-bit operands with
  // fp32 accumulation (docs/semantics.md §2), as the GPU's tensor-core products and PyTorch's bf16 autograd
  // do. Keeping G in fp32 was slightly more accurate on average but not bounded by PyTorch's
  // error: 4-5 % of bf16 cases exceeded it by more than docs/semantics.md §6's 1e-3 slack.
  void add_chunk(const LinearLayer<S>& layer, int64_t row0, int64_t rows, T* gradient,
                 const T* hidden_copy) {
    if constexpr (!std::is_same_v<S, T>) {
      const int64_t elements = rows * vocab_;
#pragma omp parallel for schedule(static) if (elements >= kParallelWork)
      for (int64_t i = 0; i < elements; ++i) gradient[i] = round_to<S>(gradient[i]);
    }
    const auto& w = layer.weight();
    if (grads_.hidden.present()) {
      if (direct<T>(grads_.hidden)) {
        gemm<T>(false, false, rows, width_, vocab_, T(1), gradient, vocab_, w.data, w.stride, T(0),
                row_pointer<T>(grads_.hidden, row0), grads_.hidden.row_stride);
      } else {
        gemm<T>(false, false, rows, width_, vocab_, T(1), gradient, vocab_, w.data, w.stride, T(0),
                grad_hidden_copy_, width_);
        store_compute_rows(grads_.hidden, row0, rows, grad_hidden_copy_, width_);
      }
    }
    if (in_weight_dtype_) {
      add_weight_in_weight_dtype(layer, row0, rows, gradient, hidden_copy);
    } else if (grad_weight_.data) {
      const ComputeMatrix<T> h = std::is_same_v<S, T>
                                     ? ComputeMatrix<T>{row_pointer<const T>(layer.hidden(), row0),
                                                        layer.hidden().row_stride}
                                     : ComputeMatrix<T>{hidden_copy, width_};
      gemm<T>(true, false, vocab_, width_, rows, T(1), gradient, vocab_, h.data, h.stride, T(1),
              const_cast<T*>(grad_weight_.data), grad_weight_.stride);
    }
    if (grad_bias_) {
      // Each column summed over the chunk's rows in order: deterministic.
#pragma omp parallel for schedule(static) if (rows * vocab_ >= kParallelWork)
      for (int64_t i = 0; i < vocab_; ++i) {
        T sum = 0;
        for (int64_t r = 0; r < rows; ++r) sum += gradient[r * vocab_ + i];
        grad_bias_[i] += sum;
      }
    }
  }

  // Writes accumulated ∂W and ∂bias in the outputs' dtypes (once, after the last chunk).
  void finish() {
    if (in_weight_dtype_ && !weight_started_) {  // no rows: ∂W is zero
      const int64_t block = std::min(vocab_, kWeightGradBlockRows);
      zero(staging_, block, width_, width_);
      for (int64_t v0 = 0; v0 < vocab_; v0 += block) {
        store_compute_rows(grads_.weight, v0, std::min(block, vocab_ - v0), staging_, width_);
      }
    }
    if (grad_weight_.data && !direct<T>(grads_.weight)) {
      store_compute_rows(grads_.weight, 0, vocab_, grad_weight_.data, width_);
    }
    if (grad_bias_ && !direct<T>(grads_.bias)) {
      TensorView row = grads_.bias;
      row.ndim = 2;
      row.rows = 1;
      row.cols = vocab_;
      row.row_stride = vocab_;
      store_compute_rows(row, 0, 1, grad_bias_, vocab_);
    }
  }

 private:
  template <class U>
  static bool direct(const TensorView& view) {
    return view.dtype == (std::is_same_v<U, double> ? DType::f64 : DType::f32);
  }

  // fp64 inputs with fp32 weight gradients: the plan counts no accumulator (it cannot know the
  // output dtype), so that rare case keeps one of its own.
  T* own(T* planned, int64_t elements) {
    if (planned) return planned;
    owned_.push_back(std::make_unique<T[]>(elements));
    return owned_.back().get();
  }

  static void zero(T* data, int64_t rows, int64_t cols, int64_t stride) {
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelWork)
    for (int64_t r = 0; r < rows; ++r) std::fill(data + r * stride, data + r * stride + cols, T(0));
  }

  void add_weight_in_weight_dtype(const LinearLayer<S>& layer, int64_t row0, int64_t rows,
                                  const T* gradient, const T* hidden_copy) {
    const ComputeMatrix<T> h = std::is_same_v<S, T>
                                   ? ComputeMatrix<T>{row_pointer<const T>(layer.hidden(), row0),
                                                      layer.hidden().row_stride}
                                   : ComputeMatrix<T>{hidden_copy, width_};
    const int64_t block = std::min(vocab_, kWeightGradBlockRows);
    for (int64_t v0 = 0; v0 < vocab_; v0 += block) {
      const int64_t count = std::min(block, vocab_ - v0);
      if (weight_started_) load_compute_rows(grads_.weight, v0, count, staging_, width_);
      gemm<T>(true, false, count, width_, rows, T(1), gradient + v0, vocab_, h.data, h.stride,
              weight_started_ ? T(1) : T(0), staging_, width_);
      store_compute_rows(grads_.weight, v0, count, staging_, width_);
    }
    weight_started_ = true;
  }

  LinearGradients grads_;
  int64_t vocab_, width_;
  bool in_weight_dtype_ = false;
  bool weight_started_ = false;
  T* staging_ = nullptr;
  T* grad_hidden_copy_ = nullptr;
  ComputeMatrix<T> grad_weight_;
  T* grad_bias_ = nullptr;
  std::vector<std::unique_ptr<T[]>> owned_;
};

}  // namespace xent::cpu
