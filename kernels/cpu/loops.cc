#include "gradwire/kernels/cpu/loops.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "gradwire/kernels/cpu/parallel.h"
#include "vector_clones.h"

namespace gradwire::kernels::cpu {
namespace {

// Elements per range: below this a loop runs on the calling thread (a pool wake-up costs more).
constexpr int64_t kGrain = int64_t(1) << 15;
// Per-range partial results live on the stack (SetThreads allows at most kMaxThreads).
constexpr int64_t kMaxRanges = kMaxThreads;
// Columns summed at once by AddColumnSums (their partial sums on the stack).
constexpr int64_t kColumnBlock = 256;

// max |x| as bits (AbsMaxFromBits): an integer max vectorises where a float max with NaNs
// does not.
GRADWIRE_VECTOR_CLONES
uint32_t AbsMaxBitsSerial(const float* x, int64_t n) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t a = __builtin_bit_cast(uint32_t, x[i]) & 0x7FFFFFFFu;
    m = a > m ? a : m;
  }
  return m;
}

GRADWIRE_VECTOR_CLONES
uint32_t AddAbsMaxBitsSerial(const float* a, const float* b, float* out, int64_t n) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float s = a[i] + b[i];
    out[i] = s;
    const uint32_t v = __builtin_bit_cast(uint32_t, s) & 0x7FFFFFFFu;
    m = v > m ? v : m;
  }
  return m;
}

// Columns [c0, c1) (at most kColumnBlock) of x summed over all rows in row order, then added to
// acc.
GRADWIRE_VECTOR_CLONES
void AddColumnSumsSerial(const float* x, int64_t rows, int64_t cols, int64_t c0, int64_t c1,
                         float* acc) {
  float sums[kColumnBlock];
  const int64_t w = c1 - c0;
  for (int64_t c = 0; c < w; ++c) sums[c] = 0.0f;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * cols + c0;
    for (int64_t c = 0; c < w; ++c) sums[c] += row[c];
  }
  for (int64_t c = 0; c < w; ++c) acc[c0 + c] += sums[c];
}

GRADWIRE_VECTOR_CLONES
void DecodeSerial(const uint8_t* codes, int64_t n, const float* table, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = table[codes[i]];
}

}  // namespace

float AbsMax(const float* x, int64_t n) {
  uint32_t part[kMaxRanges] = {};  // ranges that did not run (none) count as 0
  ParallelForRanges(n, kGrain, [&](int64_t i, int64_t b, int64_t e) {
    part[i] = AbsMaxBitsSerial(x + b, e - b);
  });
  uint32_t m = 0;
  for (uint32_t p : part) m = std::max(m, p);
  return AbsMaxFromBits(m);
}

float AddAbsMax(const float* a, const float* b, float* out, int64_t n) {
  uint32_t part[kMaxRanges] = {};
  ParallelForRanges(n, kGrain, [&](int64_t i, int64_t lo, int64_t hi) {
    part[i] = AddAbsMaxBitsSerial(a + lo, b + lo, out + lo, hi - lo);
  });
  uint32_t m = 0;
  for (uint32_t p : part) m = std::max(m, p);
  return AbsMaxFromBits(m);
}

void AddColumnSums(const float* x, int64_t rows, int64_t cols, float* acc) {
  if (cols <= 0) return;
  // Column blocks of at least 64 floats, and enough rows per block to pay for a thread.
  const int64_t grain = std::max<int64_t>(64, kGrain / std::max<int64_t>(1, rows));
  ParallelFor(cols, grain, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; c += kColumnBlock) {
      AddColumnSumsSerial(x, rows, cols, c, std::min(c1, c + kColumnBlock), acc);
    }
  });
}

void DecodeCodes(const uint8_t* codes, int64_t n, Fp8Format format, float* out) {
  const float* table = DecodeTable(format);
  ParallelFor(n, kGrain,
              [&](int64_t b, int64_t e) { DecodeSerial(codes + b, e - b, table, out + b); });
}

void FillRows(const float* row, int64_t rows, int64_t cols, float* out) {
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(1, cols));
  ParallelFor(rows, grain, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) std::memcpy(out + r * cols, row, size_t(cols) * sizeof(float));
  });
}

}  // namespace gradwire::kernels::cpu
