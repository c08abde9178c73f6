#include "gradwire/kernels/ref/cast.h"

#include <cmath>

namespace gradwire::kernels {

float Amax(const float* x, int64_t n) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    if (std::isnan(a)) return NAN;
    if (a > amax) amax = a;
  }
  return amax;
}

void QuantizeFp8(const float* x, int64_t rows, int64_t cols, float scale, Fp8Format format,
                 uint8_t* out, uint8_t* out_t, float* amax) {
  float running = 0.0f;
  bool saw_nan = false;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * cols;
    for (int64_t c = 0; c < cols; ++c) {
      const float a = std::fabs(row[c]);
      saw_nan |= std::isnan(a);
      running = a > running ? a : running;
      const uint8_t code = EncodeFp8(row[c] * scale, format);
      if (out) out[r * cols + c] = code;
      if (out_t) out_t[c * rows + r] = code;
    }
  }
  if (amax) *amax = saw_nan ? NAN : running;
}

void DequantizeFp8(const uint8_t* codes, int64_t n, float scale_inv, Fp8Format format, float* out) {
  const float* table = DecodeTable(format);
  for (int64_t i = 0; i < n; ++i) out[i] = table[codes[i]] * scale_inv;
}

void TransposeCodes(const uint8_t* codes, int64_t rows, int64_t cols, uint8_t* out) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) out[c * rows + r] = codes[r * cols + c];
  }
}

void ColumnSums(const float* x, int64_t rows, int64_t cols, float* sums) {
  for (int64_t c = 0; c < cols; ++c) sums[c] = 0.0f;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * cols;
    for (int64_t c = 0; c < cols; ++c) sums[c] += row[c];
  }
}

}  // namespace gradwire::kernels
