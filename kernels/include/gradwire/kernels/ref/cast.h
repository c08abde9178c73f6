// Casts between fp32 and FP8 on the host (reference backend). All pointers are host memory,
// row-major, non-owning; no call allocates.
#pragma once

#include <cstdint>

#include "gradwire/kernels/fp8.h"

namespace gradwire::kernels {

// max |x_i| over n elements; NaN if any element is NaN; 0 for n == 0.
float Amax(const float* x, int64_t n);

// Casts x[rows, cols] to FP8 codes of x * scale.
//   out   [rows, cols] rowwise codes, or nullptr to skip.
//   out_t [cols, rows] the transposed codes (what a GEMM reducing over rows needs), or nullptr.
//   amax  receives Amax(x) when not nullptr (one pass for both, as the fused GPU kernel does).
void QuantizeFp8(const float* x, int64_t rows, int64_t cols, float scale, Fp8Format format,
                 uint8_t* out, uint8_t* out_t, float* amax);

// out[i] = decode(codes[i]) * scale_inv.
void DequantizeFp8(const uint8_t* codes, int64_t n, float scale_inv, Fp8Format format, float* out);

// Transposes codes [rows, cols] into out [cols, rows].
void TransposeCodes(const uint8_t* codes, int64_t rows, int64_t cols, uint8_t* out);

// sums[c] = sum over r of x[r, c] (fp32 accumulation, rows in order); x is [rows, cols].
void ColumnSums(const float* x, int64_t rows, int64_t cols, float* sums);

}  // namespace gradwire::kernels
