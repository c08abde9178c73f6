#include "gradwire/kernels/cpu/cast.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cast_isa.h"
#include "gradwire/kernels/cpu/loops.h"
#include "gradwire/kernels/cpu/ordered_gemm.h"
#include "gradwire/kernels/cpu/parallel.h"
#include "gradwire/kernels/cpu/scratch.h"
#include "vector_clones.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

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

void EncodeRowPlain(const float* x, int64_t n, float scale, Fp8Format format, uint8_t* out) {
  if (format == Fp8Format::kE4M3) {
    EncodeRowE4M3(x, n, scale, out);
  } else {
    EncodeRowE5M2(x, n, scale, out);
  }
}

void EncodeRowScaled(const float* x, const float* scale, int64_t n, Fp8Format format,
                     uint8_t* out) {
  if (format == Fp8Format::kE4M3) {
    EncodeRowScaledE4M3(x, scale, n, out);
  } else {
    EncodeRowScaledE5M2(x, scale, n, out);
  }
}

// out[i] = table[codes[i]] * scale[i].
GRADWIRE_VECTOR_CLONES
void DecodeRowScaled(const uint8_t* codes, const float* table, const float* scale, int64_t n,
                     float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = table[codes[i]] * scale[i];
}

#if defined(__SSE2__)
// out[c * 64 + r] = in[r * ld_in + c] for r, c < 16: four rounds of interleaving, each doubling
// the width of the units that already sit in transposed order (bytes, pairs, quads, octets).
inline void Transpose16(const uint8_t* in, int64_t ld_in, uint8_t* out) {
  __m128i a[16], b[16];
  for (int i = 0; i < 16; ++i) {
    a[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i * ld_in));
  }
  // b[2k], b[2k + 1]: columns 0-7 and 8-15 of rows 2k and 2k + 1, as byte pairs.
  for (int k = 0; k < 8; ++k) {
    b[2 * k] = _mm_unpacklo_epi8(a[2 * k], a[2 * k + 1]);
    b[2 * k + 1] = _mm_unpackhi_epi8(a[2 * k], a[2 * k + 1]);
  }
  // a[4k + q]: columns 4q to 4q + 3 of rows 4k to 4k + 3, as 4-byte quads.
  for (int k = 0; k < 4; ++k) {
    a[4 * k] = _mm_unpacklo_epi16(b[4 * k], b[4 * k + 2]);
    a[4 * k + 1] = _mm_unpackhi_epi16(b[4 * k], b[4 * k + 2]);
    a[4 * k + 2] = _mm_unpacklo_epi16(b[4 * k + 1], b[4 * k + 3]);
    a[4 * k + 3] = _mm_unpackhi_epi16(b[4 * k + 1], b[4 * k + 3]);
  }
  // b[8g + m]: columns 2m and 2m + 1 of rows 8g to 8g + 7, as 8-byte octets.
  for (int g = 0; g < 2; ++g) {
    for (int j = 0; j < 4; ++j) {
      b[8 * g + 2 * j] = _mm_unpacklo_epi32(a[8 * g + j], a[8 * g + 4 + j]);
      b[8 * g + 2 * j + 1] = _mm_unpackhi_epi32(a[8 * g + j], a[8 * g + 4 + j]);
    }
  }
  // Column 2m and 2m + 1, all 16 rows.
  for (int m = 0; m < 8; ++m) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + (2 * m) * kTile),
                     _mm_unpacklo_epi64(b[m], b[8 + m]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + (2 * m + 1) * kTile),
                     _mm_unpackhi_epi64(b[m], b[8 + m]));
  }
}
#endif

// out[c * ld_out + r] = in[r * ld_in + c] for a tile of rows x cols (each at most kTile). A tile
// of whole 16 x 16 blocks (every tile of a layer whose widths are multiples of 16) is transposed
// in registers, a block at a time, into a packed tile whose rows are then stored whole: each
// output row is written at once, where a byte-by-byte transpose writes lines that lie ld_out
// apart (a multiple of 4 KiB for every wide layer, so all in one set of L1) a few bytes at a
// time. Other tiles' rows are first copied side by side: read down a column in place, rows whose
// stride is a multiple of 1 KiB fall into a few sets of L1 and evict each other.
void TransposeTile(const uint8_t* in, int64_t ld_in, int64_t rows, int64_t cols, uint8_t* out,
                   int64_t ld_out) {
  alignas(64) uint8_t packed[kTile * kTile];
#if defined(__SSE2__)
  if (rows % 16 == 0 && cols % 16 == 0) {
    for (int64_t bi = 0; bi < rows; bi += 16) {
      for (int64_t bj = 0; bj < cols; bj += 16) {
        Transpose16(in + bi * ld_in + bj, ld_in, packed + bj * kTile + bi);
      }
    }
    if (rows == kTile) {  // a constant size: the copies are inlined
      for (int64_t c = 0; c < cols; ++c) std::memcpy(out + c * ld_out, packed + c * kTile, kTile);
    } else {
      for (int64_t c = 0; c < cols; ++c) {
        std::memcpy(out + c * ld_out, packed + c * kTile, size_t(rows));
      }
    }
    return;
  }
#endif
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

// The line-blocked cast's statistics of one block of a row (QuantizeLineBlocks), as bits of |x|
// in one vectorisable pass: returns the largest finite |x|; raises *all to the largest |x| of
// every element (NaN above +inf, as AbsMaxBits orders them) and, kColumns, colmax[i] to x[i]'s
// finite |x|. Inlined into each clone below, so each is vectorised for its own instruction set.
template <bool kColumns>
__attribute__((always_inline)) inline uint32_t BlockStatsOf(const float* x, int64_t n,
                                                            uint32_t* __restrict colmax,
                                                            uint32_t* all) {
  // The finite |x| as a mask, not a selection: GCC vectorises the two reductions only so.
  uint32_t fin = 0, any = *all;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t a = __builtin_bit_cast(uint32_t, x[i]) & 0x7FFFFFFFu;
    any = any < a ? a : any;
    const uint32_t f = a & (0u - uint32_t(a < 0x7F800000u));
    fin = fin < f ? f : fin;
    if constexpr (kColumns) colmax[i] = colmax[i] < f ? f : colmax[i];
  }
  *all = any;
  return fin;
}

GRADWIRE_VECTOR_CLONES
uint32_t BlockStats(const float* x, int64_t n, uint32_t* all) {
  return BlockStatsOf<false>(x, n, nullptr, all);
}

GRADWIRE_VECTOR_CLONES
uint32_t BlockStatsColumns(const float* x, int64_t n, uint32_t* __restrict colmax, uint32_t* all) {
  return BlockStatsOf<true>(x, n, colmax, all);
}

// The line-blocked cast's row and tile loops (cast_isa.h) on the loops above.
uint32_t RowBlocksVectorised(const float* x, int64_t n, int64_t length, Fp8Format format,
                             uint8_t* out, float* scale_inv, uint32_t* colmax, uint32_t all) {
  for (int64_t b0 = 0, j = 0; b0 < n; b0 += length, ++j) {
    const int64_t m = std::min(n, b0 + length) - b0;
    const uint32_t fin = colmax != nullptr ? BlockStatsColumns(x + b0, m, colmax + b0, &all)
                                           : BlockStats(x + b0, m, &all);
    if (out == nullptr) continue;
    const int e = isa::ScaleExponentOfBits(fin, format);
    scale_inv[j] = isa::Pow2(e);
    EncodeRowPlain(x + b0, m, isa::Pow2(-e), format, out + b0);
  }
  return all;
}

void TileScaledVectorised(const float* x, int64_t ld, int64_t rows, int64_t n, const float* scale,
                          Fp8Format format, uint8_t* out, int64_t out_ld) {
  for (int64_t r = 0; r < rows; ++r)
    EncodeRowScaled(x + r * ld, scale, n, format, out + r * out_ld);
}

// The element loops every cast below runs: the AVX-512F ones (cast_avx512.cc) where the CPU has
// AVX-512F and the process runs a copy of the FP8 GEMM that uses it (so --cpu-isa narrows both
// alike), else the compiler-vectorised ones above. The same codes either way.
const isa::CastLoops& Loops() {
  static const isa::CastLoops kVectorised{&EncodeRowPlain, &EncodeRowAmax, &EncodeRowScaled,
                                          &RowBlocksVectorised, &TileScaledVectorised};
#if defined(GRADWIRE_CPU_X86)
  const OrderedGemmCopy copy = OrderedGemmActiveCopy();
  if (copy == OrderedGemmCopy::kAvx512 || copy == OrderedGemmCopy::kAvx512Bf16) {
    return *isa::Avx512CastLoops();
  }
#endif
  return kVectorised;
}

}  // namespace

int ScaleExponentOfBits(uint32_t amax_bits, Fp8Format format) {
  return isa::ScaleExponentOfBits(amax_bits, format);
}

void EncodeFp8(const float* x, int64_t n, float scale, Fp8Format format, uint8_t* codes) {
  Loops().encode(x, n, scale, format, codes);
}

void QuantizeFp8(const float* x, int64_t rows, int64_t cols, float scale, Fp8Format format,
                 uint8_t* out, uint8_t* out_t, float* amax) {
  const isa::CastLoops& loops = Loops();
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
    // A tile of rows is encoded whole rows at a time (long vector loops), in place when the
    // rowwise copy is wanted, else into a strip of scratch; the transposed copy is then written
    // from those codes while they are still in cache.
    std::vector<uint8_t> strip(out == nullptr ? size_t(kTile * cols) : 0);
    uint32_t m = 0;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r0 = t * kTile, r1 = std::min(rows, r0 + kTile);
      uint8_t* dst = out != nullptr ? out + r0 * cols : strip.data();
      for (int64_t r = r0; r < r1; ++r) {
        m = std::max(m,
                     loops.encode_amax(x + r * cols, cols, scale, format, dst + (r - r0) * cols));
      }
      if (out_t == nullptr) continue;
      for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
        const int64_t w = std::min(cols, c0 + kTile) - c0;
        TransposeTile(dst + c0, cols, r1 - r0, w, out_t + c0 * rows + r0, rows);
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
  const isa::CastLoops& loops = Loops();
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
        loops.encode_scaled(x + r * cols, colscale.data(), cols, format, codes + r * cols);
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

void QuantizeLineBlocks(const float* x, int64_t rows, int64_t cols, int64_t length,
                        Fp8Format format, uint8_t* out, float* scale_inv, uint8_t* out_t,
                        float* scale_inv_t, float* amax) {
  const isa::CastLoops& loops = Loops();
  if (rows <= 0 || cols <= 0 || length <= 0) {
    if (amax != nullptr) *amax = 0.0f;
    return;
  }
  const int64_t grid_cols = (cols + length - 1) / length;  // the rowwise copy's blocks per row
  const int64_t strips = (rows + length - 1) / length;     // the columnwise copy's per column
  // A unit of work: one strip of `length` rows (the columnwise copy's blocks) across a panel of
  // columns, a whole number of rowwise blocks of at most 512 KiB of values, so that the strip's
  // values are read from memory once, for the statistics and the rowwise codes, and again from
  // cache for the columnwise codes. The whole width when it fits (a wide layer's 1024 or 4096
  // columns under BLOCK and MXFP8): the strip is then one run of memory, read in order.
  const int64_t fits = std::max<int64_t>(1, (int64_t(1) << 17) / (length * length));
  const int64_t panel = std::min(length * fits, ((cols + length - 1) / length) * length);
  const int64_t panels = (cols + panel - 1) / panel;
  const int64_t units = strips * panels;
  const int64_t unit_elems = std::min(rows, length) * std::min(cols, panel);
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / unit_elems);
  uint32_t part[kMaxThreads] = {};  // max |x| bits per range
  ParallelForRanges(units, grain, [&](int64_t range, int64_t u0, int64_t u1) {
    std::vector<uint32_t> colmax(out_t != nullptr ? size_t(panel) : 0);
    std::vector<float> colscale(out_t != nullptr ? size_t(panel) : 0);
    alignas(64) uint8_t tile[kTile * kTile];
    uint32_t all = 0;
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t s = u / panels, p = u % panels;
      const int64_t r0 = s * length, r1 = std::min(rows, r0 + length);
      const int64_t c0 = p * panel, c1 = std::min(cols, c0 + panel);
      if (out_t != nullptr) std::fill(colmax.begin(), colmax.end(), 0u);
      for (int64_t r = r0; r < r1; ++r) {
        all = loops.row_blocks(x + r * cols + c0, c1 - c0, length, format,
                               out != nullptr ? out + r * cols + c0 : nullptr,
                               out != nullptr ? scale_inv + r * grid_cols + c0 / length : nullptr,
                               out_t != nullptr ? colmax.data() : nullptr, all);
      }
      if (out_t == nullptr) continue;
      for (int64_t c = c0; c < c1; ++c) {
        const int e = isa::ScaleExponentOfBits(colmax[size_t(c - c0)], format);
        colscale[size_t(c - c0)] = isa::Pow2(-e);
        scale_inv_t[c * strips + s] = isa::Pow2(e);
      }
      for (int64_t cc = c0; cc < c1; cc += kTile) {
        const int64_t w = std::min(c1, cc + kTile) - cc;
        for (int64_t rr = r0; rr < r1; rr += kTile) {
          const int64_t h = std::min(r1, rr + kTile) - rr;
          loops.tile_scaled(x + rr * cols + cc, cols, h, w, colscale.data() + (cc - c0), format,
                            tile, kTile);
          TransposeTile(tile, kTile, h, w, out_t + cc * rows + rr, rows);
        }
      }
    }
    part[range] = all;
  });
  if (amax != nullptr) {
    uint32_t m = 0;
    for (uint32_t v : part) m = std::max(m, v);
    *amax = AbsMaxFromBits(m);
  }
}

}  // namespace gradwire::kernels::cpu
