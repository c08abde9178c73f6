// The FP8 formats written out from their definitions in float64, independent of kernels/: what
// the codec and block-scaling tests check the library against.
#pragma once

#include <cmath>
#include <vector>

#include "gradwire/kernels/fp8.h"

namespace gradwire::kernels {
namespace {

struct FormatModel {
  Fp8Format format;
  int exponent_bits;
  int mantissa_bits;
  int bias;
  bool ieee_specials;  // E5M2: top exponent is inf/NaN; E4M3 (fn): only S.1111.111 is NaN
};

const FormatModel kE4M3{Fp8Format::kE4M3, 4, 3, 7, false};
const FormatModel kE5M2{Fp8Format::kE5M2, 5, 2, 15, true};

// float64 value of a code, written from the format definition (not from the library).
double ModelDecode(const FormatModel& f, int code) {
  const int exponent = (code >> f.mantissa_bits) & ((1 << f.exponent_bits) - 1);
  const int mantissa = code & ((1 << f.mantissa_bits) - 1);
  const int top = (1 << f.exponent_bits) - 1;
  double v;
  if (f.ieee_specials && exponent == top) {
    v = mantissa == 0 ? INFINITY : NAN;
  } else if (!f.ieee_specials && exponent == top && mantissa == (1 << f.mantissa_bits) - 1) {
    v = NAN;
  } else if (exponent == 0) {
    v = std::ldexp(double(mantissa), 1 - f.bias - f.mantissa_bits);
  } else {
    v = std::ldexp(1.0 + double(mantissa) / double(1 << f.mantissa_bits), exponent - f.bias);
  }
  return (code & 0x80) ? -v : v;
}

// The 128 non-negative codes' values, decoded once per format.
const std::vector<double>& ModelValues(const FormatModel& f) {
  static const auto build = [](const FormatModel& g) {
    std::vector<double> v(128);
    for (int code = 0; code < 128; ++code) v[size_t(code)] = ModelDecode(g, code);
    return v;
  };
  static const std::vector<double> e4m3 = build(kE4M3), e5m2 = build(kE5M2);
  return f.format == Fp8Format::kE4M3 ? e4m3 : e5m2;
}

// Reference encoder: the nearest finite value by float64 distance, ties to the even code;
// beyond the largest finite value (and +-inf) saturate; -1 ("some NaN") for NaN.
int ModelEncode(const FormatModel& f, double x) {
  if (std::isnan(x)) return -1;
  const int sign = std::signbit(x) ? 0x80 : 0;
  const double a = std::fabs(x);
  int best = 0, max_code = 0;
  double best_distance = INFINITY, max = 0;
  const std::vector<double>& values = ModelValues(f);
  for (int code = 0; code < 128; ++code) {
    const double v = values[size_t(code)];
    if (!std::isfinite(v)) continue;
    if (v > max) max = v, max_code = code;
    const double d = std::fabs(v - a);
    if (d < best_distance || (d == best_distance && (code & 1) == 0)) {
      best = code;
      best_distance = d;
    }
  }
  return sign | (a >= max ? max_code : best);
}

bool IsNanCode(const FormatModel& f, int code) { return std::isnan(ModelDecode(f, code)); }

}  // namespace
}  // namespace gradwire::kernels
