// The per-element FP8 arithmetic of the CUDA backend, written once for host and device so that the
// host build can check it against the reference backend without a GPU
// (tests/kernels/cuda_host_test) and the kernels run the very same code. Every step is exact or
// correctly rounded (integer bit work, rintf, ldexpf, one IEEE division), so host and device give
// identical bits, and identical bits to kernels/ref/fp8.cc.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "gradwire/kernels/fp8.h"

#if defined(__CUDACC__)
#define GW_HD __host__ __device__ __forceinline__
#else
#define GW_HD inline
#endif

namespace gradwire::kernels::cuda {

GW_HD uint32_t FloatBitsHD(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

GW_HD float BitsFloatHD(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

GW_HD bool IsNanHD(float f) { return (FloatBitsHD(f) & 0x7FFFFFFFu) > 0x7F800000u; }
GW_HD bool IsFiniteHD(float f) { return (FloatBitsHD(f) & 0x7F800000u) != 0x7F800000u; }

GW_HD float Fp8MaxHD(Fp8Format format) { return format == Fp8Format::kE4M3 ? 448.0f : 57344.0f; }

// The same rule as EncodeFp8 in kernels/ref/fp8.cc: round to nearest even, saturate finite
// overflow and +-inf to the largest finite value of the sign, NaN -> sign | 0x7F.
GW_HD uint8_t EncodeFp8HD(float value, Fp8Format format) {
  const bool e4m3 = format == Fp8Format::kE4M3;
  const int mantissa_bits = e4m3 ? 3 : 2;
  const int exponent_bias = e4m3 ? 7 : 15;
  const int min_exponent = e4m3 ? -6 : -14;
  const uint8_t max_code = e4m3 ? 0x7E : 0x7B;
  const uint32_t bits = FloatBitsHD(value);
  const uint8_t sign = uint8_t((bits >> 24) & 0x80);
  const uint32_t magnitude_bits = bits & 0x7FFFFFFFu;
  if (magnitude_bits > 0x7F800000u) return sign | 0x7F;
  const float a = BitsFloatHD(magnitude_bits);
  if (a >= Fp8MaxHD(format)) return sign | max_code;
  int exponent = int(magnitude_bits >> 23) - 127;
  if (exponent < min_exponent) exponent = min_exponent;
  // a / quantum is exact (a power-of-two scaling); rintf rounds half to even.
  uint32_t mantissa = uint32_t(rintf(ldexpf(a, mantissa_bits - exponent)));
  const uint32_t implicit_one = 1u << mantissa_bits;
  if (mantissa >= 2 * implicit_one) {  // rounded up into the next binade
    mantissa >>= 1;
    ++exponent;
  }
  if (mantissa < implicit_one) return sign | uint8_t(mantissa);
  const uint32_t biased = uint32_t(exponent + exponent_bias);
  return sign | uint8_t((biased << mantissa_bits) | (mantissa - implicit_one));
}

// ComputeScale of kernels/ref/fp8.cc: fp8_max / amax / 2^margin; 1 for amax 0, inf or NaN; a
// scale that overflows becomes FLT_MAX.
GW_HD float ComputeScaleHD(float amax, Fp8Format format, int margin) {
  if (!(amax > 0.0f) || !IsFiniteHD(amax)) return 1.0f;
  const float scale = ldexpf(Fp8MaxHD(format) / amax, -margin);
  return IsFiniteHD(scale) ? scale : FLT_MAX;
}

// |x| as ordered bits for an unsigned max: for non-negative floats the integer order is the float
// order, and every NaN becomes the canonical quiet NaN 0x7FC00000, larger than +inf, so the
// amax of a tensor holding a NaN is NaN with the bits std::nanf gives on the host.
GW_HD uint32_t AmaxBitsHD(float x) {
  const uint32_t m = FloatBitsHD(x) & 0x7FFFFFFFu;
  return m > 0x7F800000u ? 0x7FC00000u : m;
}

// The max of the delayed-scaling roll (server/device/scaling_state.cc): a NaN on either side wins.
GW_HD float NanMaxHD(float acc, float a) { return IsNanHD(a) || a > acc ? a : acc; }

}  // namespace gradwire::kernels::cuda
