#include "gradwire/kernels/cpu/cast.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "gradwire/kernels/cpu/loops.h"
#include "gradwire/kernels/cpu/parallel.h"
#include "gradwire/kernels/cpu/scratch.h"
#include "vector_clones.h"

namespace gradwire::kernels::cpu {
namespace {

constexpr int64_t kTile = 64;  // a tile of kTile x kTile codes is 4 KiB: both sides stay in L1

// The reference encoder (kernels/ref/fp8.cc) restated without branches or libm calls, so that the
// loop vectorises. For |v| in the normal range the float's own mantissa is rounded to M bits, ties
// to even, by adding a bias below the cut (a carry moves into the exponent exactly as the
// reference's "rounded up into the next binade"), and the float exponent bias is exchanged for
// FP8's. Below the smallest normal, |v| * 2^(M - MinExp) is exact (a power-of-two scaling of a
// value far from overflow) and adding 2^23 rounds it to an integer, ties to even; that integer is
// the code (the reference's subnormal mantissa, or the smallest normal's code when it rounds up
// to it). NaN keeps its sign and becomes the NaN code; |v| >= the largest finite value (inf
// included) saturates, before any rounding, as in the reference.
template <int M, int Bias, int MinExp, uint32_t MaxBits, uint8_t MaxCode>
inline uint8_t EncodeOne(float v) {
  // Selections are masks, not branches, so that the compiler vectorises the loops around this.
  const uint32_t u = __builtin_bit_cast(uint32_t, v);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7FFFFFFFu;
  constexpr int kShift = 23 - M;
  const uint32_t rounded = a + ((1u << (kShift - 1)) - 1u) + ((a >> kShift) & 1u);
  const uint32_t normal = (rounded >> kShift) - (uint32_t(127 - Bias) << M);
  constexpr float kSubScale = float(1u << (M - MinExp));  // 2^(M - MinExp), exact
  const uint32_t sub =
      __builtin_bit_cast(uint32_t, __builtin_bit_cast(float, a) * kSubScale + 8388608.0f) -
      0x4B000000u;
  constexpr uint32_t kMinNormalBits = uint32_t(MinExp + 127) << 23;
  const uint32_t is_normal = 0u - uint32_t(a >= kMinNormalBits);
  const uint32_t saturate = 0u - uint32_t(a >= MaxBits);  // MaxBits: the largest finite value
  const uint32_t nan = 0u - uint32_t(a > 0x7F800000u);
  uint32_t code = (normal & is_normal) | (sub & ~is_normal);
  code = (uint32_t(MaxCode) & saturate) | (code & ~saturate);
  code = (0x7Fu & nan) | (code & ~nan);
  return uint8_t(sign | code);
}

inline uint8_t EncodeE4M3(float v) { return EncodeOne<3, 7, -6, 0x43E00000u, 0x7E>(v); }
inline uint8_t EncodeE5M2(float v) { return EncodeOne<2, 15, -14, 0x47600000u, 0x7B>(v); }

GRADWIRE_VECTOR_CLONES
void EncodeRowE4M3(const float* x, int64_t n, float scale, uint8_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = EncodeE4M3(x[i] * scale);
}

GRADWIRE_VECTOR_CLONES
void EncodeRowE5M2(const float* x, int64_t n, float scale, uint8_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = EncodeE5M2(x[i] * scale);
}

// Encodes and measures max |x| in one pass, as the bits of |x| (see AbsMaxBits in loops.h): an
// integer max, which vectorises, and sorts every NaN above +inf.
GRADWIRE_VECTOR_CLONES
uint32_t EncodeRowAmaxE4M3(const float* x, int64_t n, float scale, uint8_t* out) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t a = __builtin_bit_cast(uint32_t, x[i]) & 0x7FFFFFFFu;
    m = a > m ? a : m;
    out[i] = EncodeE4M3(x[i] * scale);
  }
  return m;
}

GRADWIRE_VECTOR_CLONES
uint32_t EncodeRowAmaxE5M2(const float* x, int64_t n, float scale, uint8_t* out) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t a = __builtin_bit_cast(uint32_t, x[i]) & 0x7FFFFFFFu;
    m = a > m ? a : m;
    out[i] = EncodeE5M2(x[i] * scale);
  }
  return m;
}

uint32_t EncodeRowAmax(const float* x, int64_t n, float scale, Fp8Format format, uint8_t* out) {
  return format == Fp8Format::kE4M3 ? EncodeRowAmaxE4M3(x, n, scale, out)
                                    : EncodeRowAmaxE5M2(x, n, scale, out);
}

// The block-scaled cast's loops (kernels/ref/block_scaling.h). colmax[i] = max(colmax[i], |x[i]|)
// over finite x[i] only, as bits of |x| (an integer max of non-negative floats' bits orders them
// as the floats): the amax that sets a block's scale ignores NaN and inf.
GRADWIRE_VECTOR_CLONES
void FiniteAbsMaxInto(const float* x, int64_t n, uint32_t* colmax) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t a = __builtin_bit_cast(uint32_t, x[i]) & 0x7FFFFFFFu;
    const uint32_t finite = a < 0x7F800000u ? a : 0u;
    colmax[i] = finite > colmax[i] ? finite : colmax[i];
  }
}

// out[i] = Encode(x[i] * scale[i]): each element with its own block's scale.
GRADWIRE_VECTOR_CLONES
void EncodeRowScaledE4M3(const float* x, const float* scale, int64_t n, uint8_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = EncodeE4M3(x[i] * scale[i]);
}

GRADWIRE_VECTOR_CLONES
void EncodeRowScaledE5M2(const float* x, const float* scale, int64_t n, uint8_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = EncodeE5M2(x[i] * scale[i]);
}

// out[i] = table[codes[i]] * scale[i].
GRADWIRE_VECTOR_CLONES
void DecodeRowScaled(const uint8_t* codes, const float* table, const float* scale, int64_t n,
                     float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = table[codes[i]] * scale[i];
}

// out[c * ld_out + r] = in[r * ld_in + c] for a tile of rows x cols (each at most kTile). The
// tile's rows are first copied side by side: read down a column in place, rows whose stride is a
// multiple of 1 KiB (every wide layer's) fall into a few sets of L1 and evict each other.
void TransposeTile(const uint8_t* in, int64_t ld_in, int64_t rows, int64_t cols, uint8_t* out,
                   int64_t ld_out) {
  alignas(64) uint8_t packed[kTile * kTile];
  if (ld_in != kTile) {
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(packed + r * kTile, in + r * ld_in, size_t(cols));
    in = packed;
  }
  for (int64_t c = 0; c < cols; ++c) {
    uint8_t* o = out + c * ld_out;
    for (int64_t r = 0; r < rows; ++r) o[r] = in[r * kTile + c];
  }
}

}  // namespace

void EncodeFp8(const float* x, int64_t n, float scale, Fp8Format format, uint8_t* codes) {
  if (format == Fp8Format::kE4M3) {
    EncodeRowE4M3(x, n, scale, codes);
  } else {
    EncodeRowE5M2(x, n, scale, codes);
  }
}

void QuantizeFp8(const float* x, int64_t rows, int64_t cols, float scale, Fp8Format format,
                 uint8_t* out, uint8_t* out_t, float* amax) {
  if (out == nullptr && out_t == nullptr) {
    if (amax != nullptr) *amax = AbsMax(x, rows * cols);
    return;
  }
  const int64_t row_tiles = (rows + kTile - 1) / kTile;
  // Enough row tiles per range to pay for a thread: about 32 K elements.
  const int64_t grain =
      std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(1, cols * kTile));
  uint32_t part[kMaxThreads] = {};  // max |x| bits per range
  ParallelForRanges(row_tiles, grain, [&](int64_t range, int64_t t0, int64_t t1) {
    alignas(64) uint8_t tile[kTile * kTile];
    uint32_t m = 0;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r0 = t * kTile, r1 = std::min(rows, r0 + kTile);
      if (out_t == nullptr) {  // rowwise only: straight through, row by row
        for (int64_t r = r0; r < r1; ++r) {
          m = std::max(m, EncodeRowAmax(x + r * cols, cols, scale, format, out + r * cols));
        }
        continue;
      }
      for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
        const int64_t w = std::min(cols, c0 + kTile) - c0;
        // Rowwise codes land in place when wanted, else in the tile; the tile then feeds the
        // transposed copy.
        uint8_t* dst = out != nullptr ? out + r0 * cols + c0 : tile;
        const int64_t ld = out != nullptr ? cols : kTile;
        for (int64_t r = r0; r < r1; ++r) {
          m = std::max(m, EncodeRowAmax(x + r * cols + c0, w, scale, format, dst + (r - r0) * ld));
        }
        TransposeTile(dst, ld, r1 - r0, w, out_t + c0 * rows + r0, rows);
      }
    }
    part[range] = m;
  });
  if (amax != nullptr) {
    uint32_t m = 0;
    for (uint32_t p : part) m = std::max(m, p);
    *amax = AbsMaxFromBits(m);
  }
}

void TransposeCodes(const uint8_t* codes, int64_t rows, int64_t cols, uint8_t* out) {
  const int64_t row_tiles = (rows + kTile - 1) / kTile;
  const int64_t grain =
      std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, cols * kTile));
  ParallelFor(row_tiles, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r0 = t * kTile, r1 = std::min(rows, r0 + kTile);
      for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
        const int64_t w = std::min(cols, c0 + kTile) - c0;
        TransposeTile(codes + r0 * cols + c0, cols, r1 - r0, w, out + c0 * rows + r0, rows);
      }
    }
  });
}

void QuantizeBlocks(const float* x, int64_t rows, int64_t cols, BlockShape block, Fp8Format format,
                    uint8_t* out, float* scale_inv, uint8_t* out_t, float* scale_inv_t) {
  if (rows <= 0 || cols <= 0) return;
  const int64_t grid_rows = BlockGridRows(rows, block);
  const int64_t grid_cols = BlockGridCols(cols, block);
  // The transposed copy is written from the rowwise codes: in place when those are wanted, else
  // from scratch.
  Scratch spare;
  uint8_t* codes = out;
  if (codes == nullptr && out_t != nullptr) {
    spare = TakeScratch(size_t(rows * cols));
    codes = static_cast<uint8_t*>(spare.data());
  }
  // A range of block rows per thread: about 16 K elements each at least.
  const int64_t grain =
      std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>(1, block.rows * cols));
  ParallelFor(grid_rows, grain, [&](int64_t b0, int64_t b1) {
    std::vector<uint32_t> colmax(static_cast<size_t>(cols));
    std::vector<float> colscale(static_cast<size_t>(cols));
    for (int64_t bi = b0; bi < b1; ++bi) {
      const int64_t r0 = bi * block.rows, r1 = std::min(r0 + block.rows, rows);
      // Per column, the largest finite |x| over the block row's rows; then per block, the
      // largest over its columns.
      std::fill(colmax.begin(), colmax.end(), 0u);
      for (int64_t r = r0; r < r1; ++r) FiniteAbsMaxInto(x + r * cols, cols, colmax.data());
      for (int64_t bj = 0; bj < grid_cols; ++bj) {
        const int64_t c0 = bj * block.cols, c1 = std::min(c0 + block.cols, cols);
        const uint32_t m = *std::max_element(colmax.begin() + c0, colmax.begin() + c1);
        const int e = BlockScaleExponent(__builtin_bit_cast(float, m), format);
        const float scale = std::ldexp(1.0f, -e);
        const float inv = std::ldexp(1.0f, e);
        if (scale_inv) scale_inv[bi * grid_cols + bj] = inv;
        if (scale_inv_t) scale_inv_t[bj * grid_rows + bi] = inv;
        std::fill(colscale.begin() + c0, colscale.begin() + c1, scale);
      }
      if (codes == nullptr) continue;
      for (int64_t r = r0; r < r1; ++r) {
        if (format == Fp8Format::kE4M3) {
          EncodeRowScaledE4M3(x + r * cols, colscale.data(), cols, codes + r * cols);
        } else {
          EncodeRowScaledE5M2(x + r * cols, colscale.data(), cols, codes + r * cols);
        }
      }
    }
  });
  if (out_t != nullptr) TransposeCodes(codes, rows, cols, out_t);
}

void DequantizeBlocks(const uint8_t* codes, int64_t rows, int64_t cols, BlockShape block,
                      const float* scale_inv, Fp8Format format, float* out) {
  if (rows <= 0 || cols <= 0) return;
  const float* table = DecodeTable(format);
  const int64_t grid_cols = BlockGridCols(cols, block);
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / cols);
  ParallelFor(rows, grain, [&](int64_t r0, int64_t r1) {
    std::vector<float> colscale(static_cast<size_t>(cols));
    int64_t built = -1;  // the block row colscale holds
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t bi = r / block.rows;
      if (bi != built) {
        for (int64_t bj = 0; bj < grid_cols; ++bj) {
          const int64_t c0 = bj * block.cols, c1 = std::min(c0 + block.cols, cols);
          std::fill(colscale.begin() + c0, colscale.begin() + c1, scale_inv[bi * grid_cols + bj]);
        }
        built = bi;
      }
      DecodeRowScaled(codes + r * cols, table, colscale.data(), cols, out + r * cols);
    }
  });
}

}  // namespace gradwire::kernels::cpu
