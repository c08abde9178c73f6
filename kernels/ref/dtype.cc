#include "gradwire/kernels/dtype.h"

#include <cmath>
#include <cstring>

namespace gradwire::kernels {
namespace {

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

}  // namespace

uint16_t FloatToBf16(float value) {
  const uint32_t u = Bits(value);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x0040);  // quiet NaN
  const uint32_t rounding = 0x7FFFu + ((u >> 16) & 1u);
  return uint16_t((u + rounding) >> 16);
}

float Bf16ToFloat(uint16_t bits) { return FromBits(uint32_t(bits) << 16); }

uint16_t FloatToHalf(float value) {
  uint32_t u = Bits(value);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  u &= 0x7FFFFFFFu;
  if (u > 0x7F800000u) return sign | 0x7E00;   // NaN
  if (u >= 0x477FF000u) return sign | 0x7C00;  // >= 65520 rounds to infinity
  if (u >= 0x38800000u) {                      // normal half (>= 2^-14)
    u += 0x0FFFu + ((u >> 13) & 1u);           // round to nearest even at bit 13
    return sign | uint16_t((u - 0x38000000u) >> 13);
  }
  // Subnormal half: multiples of 2^-24; rint rounds half to even (1024 becomes the min normal).
  return sign | uint16_t(std::rint(std::ldexp(FromBits(u), 24)));
}

float HalfToFloat(uint16_t bits) {
  const uint32_t sign = uint32_t(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1Fu;
  const uint32_t mantissa = bits & 0x3FFu;
  if (exponent == 0) {
    const float magnitude = std::ldexp(float(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) return FromBits(sign | 0x7F800000u | (mantissa << 13));
  return FromBits(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

void FloatToBf16(const float* in, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = FloatToBf16(in[i]);
}
void Bf16ToFloat(const uint16_t* in, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = Bf16ToFloat(in[i]);
}
void FloatToHalf(const float* in, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = FloatToHalf(in[i]);
}
void HalfToFloat(const uint16_t* in, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = HalfToFloat(in[i]);
}

}  // namespace gradwire::kernels
