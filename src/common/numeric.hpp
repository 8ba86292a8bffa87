// Scalar helpers usable from host and device code: the host/device qualifier, float <-> bf16 / fp16
// conversions, and the math functions picked by compute type (float or double).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__CUDACC__)
#define XENT_HD __host__ __device__ __forceinline__
#else
#define XENT_HD inline
#endif

namespace xent::common {

// Storage types of 16-bit floats, bit-compatible with __nv_bfloat16 / __half.
struct bf16_t {
  uint16_t bits;
};
struct f16_t {
  uint16_t bits;
};

XENT_HD float bits_to_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

XENT_HD uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
#endif
}

XENT_HD float to_float(bf16_t v) { return bits_to_float(uint32_t{v.bits} << 16); }

// Round to nearest even; NaN stays NaN (quiet bit forced so truncation cannot make it Inf).
XENT_HD bf16_t to_bf16(float f) {
  uint32_t bits = float_to_bits(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u)
    return bf16_t{static_cast<uint16_t>((bits >> 16) | 0x40u)};
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return bf16_t{static_cast<uint16_t>(bits >> 16)};
}

XENT_HD float to_float(f16_t v) {
  const uint32_t sign = uint32_t{v.bits & 0x8000u} << 16;
  const uint32_t exponent = (v.bits >> 10) & 0x1fu;
  uint32_t mantissa = v.bits & 0x3ffu;
  if (exponent == 0x1f) return bits_to_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent != 0) return bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  if (mantissa == 0) return bits_to_float(sign);
  // Subnormal half: value = mantissa · 2^-24, exact in float.
  const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
  return sign ? -magnitude : magnitude;
}

// Round to nearest even, with overflow to Inf and gradual underflow to subnormals.
XENT_HD f16_t to_f16(float f) {
  const uint32_t bits = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs_bits = bits & 0x7fffffffu;
  if (abs_bits > 0x7f800000u) return f16_t{static_cast<uint16_t>(sign | 0x7e00u)};
  if (abs_bits >= 0x477ff000u) return f16_t{static_cast<uint16_t>(sign | 0x7c00u)};  // >= 65520
  if (abs_bits < 0x38800000u) {  // below the smallest normal half, 2^-14
    // Scale so the subnormal step 2^-24 becomes 1, then round half to even by hand.
    const float scaled = bits_to_float(abs_bits) * 16777216.0f;
    const float floor_value = std::floor(scaled);
    uint32_t q = static_cast<uint32_t>(floor_value);
    const float rest = scaled - floor_value;
    if (rest > 0.5f || (rest == 0.5f && (q & 1u))) ++q;
    return f16_t{static_cast<uint16_t>(sign | q)};
  }
  uint32_t rounded = abs_bits + 0xfffu + ((abs_bits >> 13) & 1u);
  rounded -= 112u << 23;
  return f16_t{static_cast<uint16_t>(sign | (rounded >> 13))};
}

template <class T>
XENT_HD T infinity() {
  return std::numeric_limits<T>::infinity();
}

}  // namespace xent::common
