// Plumbing shared by the CUDA kernels: error checking that throws xent::Error, the stream of an
// xent::Stream, the current-device guard, element load/store of fp32/bf16/fp16 storage, and the
// device-side error state that kernels fill for out-of-range targets.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda/core/arch.hpp"
#include "common/numeric.hpp"
#include "xent/types.hpp"

namespace xent::cuda {

// Throws a runtime xent::Error naming the failing call; used through XENT_CUDA_CHECK so the
// message carries the expression as written.
inline void check_cuda(cudaError_t status, const char* call, const char* file, int line) {
  if (status == cudaSuccess) return;
  throw Error(ErrorKind::runtime, std::string("CUDA error in ") + call + " (" + file + ":" +
                                      std::to_string(line) + "): " + cudaGetErrorName(status) +
                                      ": " + cudaGetErrorString(status));
}
#define XENT_CUDA_CHECK(call) ::xent::cuda::check_cuda((call), #call, __FILE__, __LINE__)
// After a launch: configuration errors surface here, asynchronous faults at the next check.
#define XENT_CUDA_CHECK_LAUNCH() XENT_CUDA_CHECK(cudaGetLastError())

inline cudaStream_t stream_of(Stream stream) { return static_cast<cudaStream_t>(stream.handle); }

inline int multiprocessor_count(int device) {
  int count = 0;
  XENT_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

// Programmatic dependent launch (sm_90): a grid launched with
// cudaLaunchAttributeProgrammaticStreamSerialization may start while the grid before it on the
// stream still runs, once every CTA of that grid has called let_next_grid_start (or exited).
// wait_for_previous_grid then blocks the calling thread until that grid has finished and its
// writes are visible; in a grid launched the ordinary way it returns at once. sm_80 code has
// neither: the portable paths never launch that way, so there both are empty.
__device__ __forceinline__ void let_next_grid_start() {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_previous_grid() {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Launches a one-CTA finishing kernel (the fixed-order reductions) as a programmatic dependent of
// the grid before it, so its launch is prepared while that grid runs and it starts as soon as the
// grid's last CTA exits, instead of after a launch gap. The kernel must call
// wait_for_previous_grid before it reads anything. On the portable paths, an ordinary launch.
template <class Args>
void launch_finishing_kernel(void (*kernel)(Args), unsigned threads, const Args& args,
                             cudaStream_t stream) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(1);
  config.blockDim = dim3(threads);
  config.stream = stream;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = hopper_paths() ? 1 : 0;
  XENT_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, args));
}

// Makes the tensors' device current for the duration of an op (a host-side setting, no sync).
class DeviceGuard {
 public:
  explicit DeviceGuard(int index) {
    XENT_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != index) XENT_CUDA_CHECK(cudaSetDevice(index));
  }
  ~DeviceGuard() {
    int current = previous_;
    cudaGetDevice(&current);
    if (current != previous_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

// ---- element storage ----------------------------------------------------------------------------

using common::bf16_t;
using common::f16_t;

// Storage types are plain 16-bit words; the hardware conversions are used on the device (cvt.rn
// matches the round-to-nearest-even of common::to_bf16/to_f16, including NaN and overflow).
__device__ __forceinline__ float load_float(float v) { return v; }
__device__ __forceinline__ float load_float(bf16_t v) {
  return __uint_as_float(uint32_t{v.bits} << 16);
}
__device__ __forceinline__ float load_float(f16_t v) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
  return f;
}

template <class S>
__device__ __forceinline__ S store_float(float v);
template <>
__device__ __forceinline__ float store_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ bf16_t store_float<bf16_t>(float v) {
  uint16_t bits;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(v));
  return bf16_t{bits};
}
template <>
__device__ __forceinline__ f16_t store_float<f16_t>(float v) {
  uint16_t bits;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(v));
  return f16_t{bits};
}

// Elements of a 16-byte vector of storage type S.
template <class S>
inline constexpr int kVectorElements = 16 / static_cast<int>(sizeof(S));

// A 16-byte vector converted to float. `Packed` is what one 16-byte access moves.
template <class S>
struct Vector {
  float value[kVectorElements<S>];
};

template <class S>
__device__ __forceinline__ Vector<S> unpack(const uint4& raw) {
  Vector<S> v;
  const S* elements = reinterpret_cast<const S*>(&raw);
#pragma unroll
  for (int k = 0; k < kVectorElements<S>; ++k) v.value[k] = load_float(elements[k]);
  return v;
}

// bf16 is the top half of an fp32: two bit operations per pair of columns (nvcc otherwise emits a
// byte permute and a multiply for every odd column; the sweeps are issue-bound, so it counts).
template <>
__device__ __forceinline__ Vector<bf16_t> unpack<bf16_t>(const uint4& raw) {
  Vector<bf16_t> v;
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    v.value[2 * k] = __uint_as_float(words[k] << 16);
    v.value[2 * k + 1] = __uint_as_float(words[k] & 0xffff0000u);
  }
  return v;
}

template <class S>
__device__ __forceinline__ uint4 pack(const Vector<S>& v) {
  uint4 raw;
  S* elements = reinterpret_cast<S*>(&raw);
#pragma unroll
  for (int k = 0; k < kVectorElements<S>; ++k) elements[k] = store_float<S>(v.value[k]);
  return raw;
}

// cvt.rn.bf16x2.f32 rounds two columns in one instruction (same rounding as store_float).
template <>
__device__ __forceinline__ uint4 pack<bf16_t>(const Vector<bf16_t>& v) {
  uint32_t words[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;"
        : "=r"(words[k])
        : "f"(v.value[2 * k + 1]), "f"(v.value[2 * k]));
  }
  return make_uint4(words[0], words[1], words[2], words[3]);
}

// e^x through the ex2 unit: ex2.approx has a relative error of about 2^-22; the x·log2(e)
// product adds |x|·2^-24 relative, which matters only for probabilities far below the ones
// that set a row's loss and gradient. Flushes results below 2^-126 to 0 (p_i < 1e-38).
__device__ __forceinline__ float fast_exp(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
  return y;
}

// 2^x on the ex2 unit. The sweeps form e^(v−m) as 2^(v·log2(e) − m·log2(e)) with one fused
// multiply-add: m·log2(e) is rounded once per row (an absolute error of |m|·2^-23.5 in the
// exponent, the size of the fp32 rounding of m itself), the rest as fast_exp.
inline constexpr float kLog2e = 1.4426950408889634f;
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// True when `pointer` and every row start (row_stride elements apart) are 16-byte aligned, so a
// row can move in 16-byte vectors; otherwise the scalar path is taken.
inline bool rows_are_vector_aligned(const void* pointer, int64_t row_stride, std::size_t element) {
  return reinterpret_cast<uintptr_t>(pointer) % 16 == 0 &&
         (static_cast<uint64_t>(row_stride) * element) % 16 == 0;
}

// ---- device-side error state ---------------------------------------------------------------------

// Which op raised the error, so check_errors can name it as the CPU backend does.
enum class OpCode : int32_t {
  none = 0,
  ce_forward,
  ce_backward,
  distill_forward,
  distill_backward,
  linear_ce_forward,
  linear_ce_backward,
  linear_distill_forward,
  linear_distill_backward,
  linear_policy_forward
};
const char* op_name(OpCode op);

// Filled by the first kernel that finds an out-of-range target (the batch pre-pass, which sees
// every row in one CTA, so "first" is the lowest row index of that call), cleared by
// check_errors. Later calls never overwrite a pending error.
struct DeviceErrorState {
  int32_t pending;  // 0: none
  int32_t op;       // OpCode
  int64_t row;      // first offending row
  int64_t value;    // its target value
  int64_t vocab;    // V of that call
  int64_t ignore_index;
};

// Device address of the current device's error state (a __device__ variable of this library).
DeviceErrorState* device_error_state();

}  // namespace xent::cuda
