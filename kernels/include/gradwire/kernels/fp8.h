// FP8 formats, shared by both backends: the definition of gradwire's FP8 numerics
// (kernels/ref/fp8.cc; the CUDA backend repeats the element math on the device, bit for bit, in
// kernels/cuda/fp8_math.h).
//
// E4M3 is the OCP "fn" variant (no infinities; S.1111.111 is NaN; max 448).
// E5M2 is IEEE-like (infinities and NaNs in the top exponent; max 57344).
// Encoding rounds to nearest, ties to even, saturates finite overflow and +-inf to the largest
// finite value of the sign, and keeps NaN a NaN.
#pragma once

#include <cstdint>

namespace gradwire::kernels {

enum class Fp8Format : uint8_t { kE4M3 = 0, kE5M2 = 1 };

inline constexpr float kE4M3Max = 448.0f;
inline constexpr float kE5M2Max = 57344.0f;

// Largest finite magnitude of `format`.
constexpr float Fp8Max(Fp8Format format) {
  return format == Fp8Format::kE4M3 ? kE4M3Max : kE5M2Max;
}

const char* Fp8FormatName(Fp8Format format);

// One value to its FP8 code (see the rounding rules above).
uint8_t EncodeFp8(float value, Fp8Format format);

// One FP8 code to its exact value as a float (every FP8 value is representable).
float DecodeFp8(uint8_t code, Fp8Format format);

// The 256-entry decode table of `format`: DecodeTable(f)[code] == DecodeFp8(code, f).
const float* DecodeTable(Fp8Format format);

// Per-tensor scale for a cast of a tensor with absolute maximum `amax`:
//   scale = Fp8Max(format) / amax / 2^margin.
// amax == 0, +inf or NaN give 1 (nothing is known about the range, so leave values as they are);
// a scale that would overflow (tiny amax) is clamped to the largest finite float.
float ComputeScale(float amax, Fp8Format format, int margin);

}  // namespace gradwire::kernels
