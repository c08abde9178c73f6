// The CPU backend's FP8 cast: the reference cast (kernels/ref/cast.h) computed with bit operations
// instead of rint/ldexp per element, vectorised, and threaded over row tiles, with the transposed
// copy written from cache-sized tiles. Its codes and amax are the reference's bit for bit
// (tests/kernels/cpu_kernels_test.cc checks every float of the FP8 range exhaustively).
//
// All pointers are host memory, row-major, non-owning; no call allocates beyond a stack tile.
#pragma once

#include <cstdint>

#include "gradwire/kernels/fp8.h"
#include "gradwire/kernels/ref/block_scaling.h"

namespace gradwire::kernels::cpu {

// codes[i] = EncodeFp8(x[i] * scale, format) for i < n, on the calling thread.
void EncodeFp8(const float* x, int64_t n, float scale, Fp8Format format, uint8_t* codes);

// As kernels::QuantizeFp8: codes of x[rows, cols] * scale into `out` [rows, cols] and/or `out_t`
// [cols, rows] (either may be null), and Amax(x) into `amax` when not null.
void QuantizeFp8(const float* x, int64_t rows, int64_t cols, float scale, Fp8Format format,
                 uint8_t* out, uint8_t* out_t, float* amax);

// out[c, r] = codes[r, c]: codes [rows, cols] transposed, in cache-sized tiles, threaded.
void TransposeCodes(const uint8_t* codes, int64_t rows, int64_t cols, uint8_t* out);

// As kernels::QuantizeBlocks (kernels/ref/block_scaling.h), bit for bit: threaded over block
// rows and vectorised; out_t is the transpose of the rowwise codes (written to scratch first when
// out is null).
void QuantizeBlocks(const float* x, int64_t rows, int64_t cols, BlockShape block, Fp8Format format,
                    uint8_t* out, float* scale_inv, uint8_t* out_t, float* scale_inv_t);

// The block-scaled cast of activations and gradients (BLOCK: length 128, MXFP8: 32) in one
// threaded pass over x: the rowwise copy blocked 1 x length, and the columnwise copy [cols, rows]
// blocked 1 x length along its own rows (x's length x 1 blocks, transposed), each bit for bit
// kernels::QuantizeBlocks's with that block (scale_inv [rows, ceil(cols / length)], scale_inv_t
// [cols, ceil(rows / length)]); either copy may be null. amax (when not null) receives Amax(x).
void QuantizeLineBlocks(const float* x, int64_t rows, int64_t cols, int64_t length,
                        Fp8Format format, uint8_t* out, float* scale_inv, uint8_t* out_t,
                        float* scale_inv_t, float* amax);

// kernels::BlockScaleExponent of a finite amax >= 0 given as its bits, without libm.
int ScaleExponentOfBits(uint32_t amax_bits, Fp8Format format);

// As kernels::DequantizeBlocks, bit for bit, threaded over rows.
void DequantizeBlocks(const uint8_t* codes, int64_t rows, int64_t cols, BlockShape block,
                      const float* scale_inv, Fp8Format format, float* out);

}  // namespace gradwire::kernels::cpu
