#include "gradwire/kernels/fp8.h"

#include <array>
#include <cfloat>
#include <cmath>
#include <cstring>

namespace gradwire::kernels {
namespace {

struct FormatTraits {
  int mantissa_bits;
  int exponent_bias;
  int min_exponent;  // exponent of the smallest normal value
  uint8_t max_code;  // code of the largest finite positive value
  uint8_t nan_code;  // canonical positive NaN
};

constexpr FormatTraits Traits(Fp8Format format) {
  return format == Fp8Format::kE4M3 ? FormatTraits{3, 7, -6, 0x7E, 0x7F}
                                    : FormatTraits{2, 15, -14, 0x7B, 0x7F};
}

uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

std::array<float, 256> BuildTable(Fp8Format format) {
  std::array<float, 256> table{};
  for (int code = 0; code < 256; ++code) table[code] = DecodeFp8(uint8_t(code), format);
  return table;
}

}  // namespace

const char* Fp8FormatName(Fp8Format format) { return format == Fp8Format::kE4M3 ? "E4M3" : "E5M2"; }

uint8_t EncodeFp8(float value, Fp8Format format) {
  const FormatTraits t = Traits(format);
  const uint32_t bits = FloatBits(value);
  const uint8_t sign = uint8_t((bits >> 24) & 0x80);
  if (std::isnan(value)) return sign | t.nan_code;
  const float a = std::fabs(value);
  if (a >= Fp8Max(format)) return sign | t.max_code;  // finite overflow and inf saturate
  // Exponent of a (float subnormals are far below the FP8 range and land on min_exponent).
  int exponent = int((bits >> 23) & 0xFF) - 127;
  if (exponent < t.min_exponent) exponent = t.min_exponent;
  // a / quantum is exact (power-of-two scaling); rint rounds half to even.
  const float steps = std::rint(std::ldexp(a, t.mantissa_bits - exponent));
  uint32_t mantissa = uint32_t(steps);
  const uint32_t implicit_one = 1u << t.mantissa_bits;
  if (mantissa >= 2 * implicit_one) {  // rounded up into the next binade
    mantissa >>= 1;
    ++exponent;
  }
  if (mantissa < implicit_one) return sign | uint8_t(mantissa);  // subnormal (or zero)
  const uint32_t biased = uint32_t(exponent + t.exponent_bias);
  return sign | uint8_t((biased << t.mantissa_bits) | (mantissa - implicit_one));
}

float DecodeFp8(uint8_t code, Fp8Format format) {
  const FormatTraits t = Traits(format);
  const bool negative = code & 0x80;
  const int exponent_field = (code & 0x7F) >> t.mantissa_bits;
  const int mantissa = code & ((1 << t.mantissa_bits) - 1);
  float magnitude;
  if (format == Fp8Format::kE4M3 && exponent_field == 15 && mantissa == 7) {
    magnitude = NAN;
  } else if (format == Fp8Format::kE5M2 && exponent_field == 31) {
    magnitude = mantissa == 0 ? INFINITY : NAN;
  } else if (exponent_field == 0) {
    magnitude = std::ldexp(float(mantissa), t.min_exponent - t.mantissa_bits);
  } else {
    magnitude = std::ldexp(float((1 << t.mantissa_bits) + mantissa),
                           exponent_field - t.exponent_bias - t.mantissa_bits);
  }
  return negative ? -magnitude : magnitude;
}

const float* DecodeTable(Fp8Format format) {
  static const std::array<float, 256> e4m3 = BuildTable(Fp8Format::kE4M3);
  static const std::array<float, 256> e5m2 = BuildTable(Fp8Format::kE5M2);
  return format == Fp8Format::kE4M3 ? e4m3.data() : e5m2.data();
}

float ComputeScale(float amax, Fp8Format format, int margin) {
  if (!(amax > 0.0f) || !std::isfinite(amax)) return 1.0f;
  const float scale = std::ldexp(Fp8Max(format) / amax, -margin);
  return std::isfinite(scale) ? scale : FLT_MAX;
}

}  // namespace gradwire::kernels
