// Block-scaled FP8 on the host (reference backend): the definition of the BLOCK and MXFP8
// recipes' casts (docs/block-scaling.md). All pointers are host memory, row-major,
// non-owning; no call allocates.
//
// A matrix x[rows, cols] is cut into blocks of block.rows x block.cols elements, starting at
// (0, 0); blocks at the bottom and right edges hold what is left (a partial block). Block
// (i, j) covers rows [i * block.rows, min((i + 1) * block.rows, rows)) and columns
// [j * block.cols, min((j + 1) * block.cols, cols)). Its scale_inv is a power of two 2^e and
// its codes are Encode(x / 2^e) (round to nearest even, saturate, NaN stays NaN; fp8.h), so a
// code decodes back to Decode(code) * 2^e exactly. The scales form a grid
// [BlockGridRows, BlockGridCols], row-major.
#pragma once

#include <cstdint>

#include "gradwire/kernels/fp8.h"

namespace gradwire::kernels {

// Block edge of BLOCK's activations and gradients (1 x 128) and weights (128 x 128).
inline constexpr int64_t kBlockScalingEdge = 128;
// Block length of MXFP8 (1 x 32 along each GEMM's reduction dimension).
inline constexpr int64_t kMxfp8BlockLength = 32;

// The range of a block's scale exponent e (scale_inv = 2^e). It keeps every dequantized value
// a normal bf16 and every product of two dequantized values (E4M3 x E4M3 or E5M2 x E4M3), and
// every nonzero partial sum of such products, at least 2^-126 in magnitude and exact in fp32:
// the conditions under which the CPU's FP8 GEMM reproduces the reference bit for bit.
//   smallest nonzero dequantized value: 2^-16 (E5M2) * 2^-50 = 2^-66;
//   smallest nonzero product: 2^-66 * 2^-59 (E4M3's 2^-9 * 2^-50) = 2^-125;
//   largest product magnitude: below 2^66 * 2^59 = 2^125.
inline constexpr int kBlockScaleExponentMin = -50;
inline constexpr int kBlockScaleExponentMax = 50;

struct BlockShape {
  int64_t rows = 1;
  int64_t cols = 1;
};

// Number of block rows / columns of the scale grid of a [rows, cols] matrix.
inline int64_t BlockGridRows(int64_t rows, BlockShape block) {
  return (rows + block.rows - 1) / block.rows;
}
inline int64_t BlockGridCols(int64_t cols, BlockShape block) {
  return (cols + block.cols - 1) / block.cols;
}

// The scale exponent of a block whose finite elements have absolute maximum `amax` (>= 0, not
// NaN): the smallest integer e with amax <= Fp8Max(format) * 2^e, so no finite element
// saturates; 0 for amax == 0 (a block of zeros, or of no finite values, takes scale 1); clamped
// to [kBlockScaleExponentMin, kBlockScaleExponentMax]. A block with amax beyond
// Fp8Max * 2^kBlockScaleExponentMax saturates there; below Fp8Max * 2^kBlockScaleExponentMin
// its values round on the grid of 2^kBlockScaleExponentMin (the smallest flush to zero).
int BlockScaleExponent(float amax, Fp8Format format);

// Casts x[rows, cols] with one power-of-two scale per block of `block`.
//   out         [rows, cols] codes, or nullptr to skip.
//   scale_inv   [BlockGridRows(rows), BlockGridCols(cols)] the blocks' 2^e; required with out.
//   out_t       [cols, rows] the same codes transposed (a GEMM reducing over rows), or nullptr.
//   scale_inv_t [BlockGridCols(cols), BlockGridRows(rows)] the same scales transposed, so out_t
//               reads as a matrix blocked by {block.cols, block.rows}; required with out_t.
// A block's amax is taken over its finite elements: a NaN stays NaN and a +-inf saturates to
// +-Fp8Max * 2^e, neither changes the scale of the values beside it. rows, cols >= 0 and
// block.rows, block.cols >= 1.
void QuantizeBlocks(const float* x, int64_t rows, int64_t cols, BlockShape block, Fp8Format format,
                    uint8_t* out, float* scale_inv, uint8_t* out_t, float* scale_inv_t);

// out[r, c] = Decode(codes[r, c]) * scale_inv[block of (r, c)]: exact, since each scale_inv is
// a power of two within the range above.
void DequantizeBlocks(const uint8_t* codes, int64_t rows, int64_t cols, BlockShape block,
                      const float* scale_inv, Fp8Format format, float* out);

}  // namespace gradwire::kernels
