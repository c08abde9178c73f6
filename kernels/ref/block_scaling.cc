#include "gradwire/kernels/ref/block_scaling.h"

#include <algorithm>
#include <cmath>

namespace gradwire::kernels {

int BlockScaleExponent(float amax, Fp8Format format) {
  if (!(amax > 0.0f)) return 0;  // zeros (and, defensively, NaN) take scale 1
  if (std::isinf(amax)) return kBlockScaleExponentMax;
  // Every Fp8Max(format) * 2^e below is exact in double, so the comparisons are exact.
  const double a = amax;
  const double m = Fp8Max(format);
  int e = std::ilogb(a) - std::ilogb(m);
  while (a > std::ldexp(m, e)) ++e;
  while (a <= std::ldexp(m, e - 1)) --e;
  return std::clamp(e, kBlockScaleExponentMin, kBlockScaleExponentMax);
}

void QuantizeBlocks(const float* x, int64_t rows, int64_t cols, BlockShape block, Fp8Format format,
                    uint8_t* out, float* scale_inv, uint8_t* out_t, float* scale_inv_t) {
  const int64_t grid_rows = BlockGridRows(rows, block);
  const int64_t grid_cols = BlockGridCols(cols, block);
  for (int64_t bi = 0; bi < grid_rows; ++bi) {
    const int64_t r0 = bi * block.rows;
    const int64_t r1 = std::min(r0 + block.rows, rows);
    for (int64_t bj = 0; bj < grid_cols; ++bj) {
      const int64_t c0 = bj * block.cols;
      const int64_t c1 = std::min(c0 + block.cols, cols);
      float amax = 0.0f;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) {
          const float a = std::fabs(x[r * cols + c]);
          if (std::isfinite(a) && a > amax) amax = a;
        }
      }
      const int e = BlockScaleExponent(amax, format);
      // Both are normal floats for e in the clamped range: the multiplication is exact
      // wherever its result is a normal float, and a result below that encodes to zero anyway.
      const float scale = std::ldexp(1.0f, -e);
      const float inv = std::ldexp(1.0f, e);
      if (scale_inv) scale_inv[bi * grid_cols + bj] = inv;
      if (scale_inv_t) scale_inv_t[bj * grid_rows + bi] = inv;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) {
          const uint8_t code = EncodeFp8(x[r * cols + c] * scale, format);
          if (out) out[r * cols + c] = code;
          if (out_t) out_t[c * rows + r] = code;
        }
      }
    }
  }
}

void DequantizeBlocks(const uint8_t* codes, int64_t rows, int64_t cols, BlockShape block,
                      const float* scale_inv, Fp8Format format, float* out) {
  const float* table = DecodeTable(format);
  const int64_t grid_cols = BlockGridCols(cols, block);
  for (int64_t r = 0; r < rows; ++r) {
    const float* scales = scale_inv + (r / block.rows) * grid_cols;
    for (int64_t c = 0; c < cols; ++c) {
      out[r * cols + c] = table[codes[r * cols + c]] * scales[c / block.cols];
    }
  }
}

}  // namespace gradwire::kernels
