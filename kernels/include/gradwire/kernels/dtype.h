// 16-bit float conversions used on the wire (bf16 and IEEE half), round to nearest even.
#pragma once

#include <cstdint>

namespace gradwire::kernels {

uint16_t FloatToBf16(float value);
float Bf16ToFloat(uint16_t bits);
uint16_t FloatToHalf(float value);
float HalfToFloat(uint16_t bits);

// Bulk forms over n contiguous elements; `in` and `out` must not overlap.
void FloatToBf16(const float* in, int64_t n, uint16_t* out);
void Bf16ToFloat(const uint16_t* in, int64_t n, float* out);
void FloatToHalf(const float* in, int64_t n, uint16_t* out);
void HalfToFloat(const uint16_t* in, int64_t n, float* out);

}  // namespace gradwire::kernels
