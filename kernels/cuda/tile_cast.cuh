// The one tiled kernel behind every FP8 cast of the CUDA backend. A block owns a 32x32 tile of
// the (logical) source matrix; a Loader computes each source value (a plain read, a LayerNorm
// output, an activation or its gradient), and in the same pass the kernel can write the fp32
// value, the rowwise codes, the transposed codes (through shared memory, so both stores are
// coalesced), column sums (dbias) and the amax (warp and block reduction, then one atomicMax on
// the ordered float bits per block).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "check.h"
#include "fp8_math.h"
#include "gradwire/kernels/cuda/cast.h"

namespace gradwire::kernels::cuda::detail {

inline constexpr int kTile = 32;
inline constexpr int kTileRowsPerPass = 8;  // block = 32 x 8 threads, 4 rows each

struct TileOutputs {
  float* y = nullptr;  // fp32 copy of the source values
  Fp8Format format = Fp8Format::kE4M3;
  const float* scale = nullptr;  // null: no cast
  uint8_t* data = nullptr;
  uint8_t* data_t = nullptr;
  uint32_t* amax_bits = nullptr;  // zeroed before the launch
  float* scale_inv = nullptr;
  float* dbias = nullptr;  // zeroed before the launch
};

__device__ __forceinline__ uint32_t WarpMaxU32(uint32_t v) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const uint32_t other = __shfl_xor_sync(0xFFFFFFFFu, v, offset);
    v = other > v ? other : v;
  }
  return v;
}

template <class Loader>
__global__ void __launch_bounds__(kTile* kTileRowsPerPass)
    TileCastKernel(Loader load, int64_t rows, int64_t cols, TileOutputs o) {
  __shared__ uint8_t codes[kTile][kTile + 4];
  __shared__ float col_partial[kTileRowsPerPass][kTile];
  __shared__ uint32_t warp_amax[kTileRowsPerPass];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t r0 = int64_t(blockIdx.y) * kTile, c0 = int64_t(blockIdx.x) * kTile;
  const int64_t c = c0 + tx;
  const bool cast = o.scale != nullptr;
  const float scale = cast ? *o.scale : 1.0f;
  uint32_t amax = 0;
  float col_sum = 0.0f;
  for (int i = ty; i < kTile; i += kTileRowsPerPass) {
    const int64_t r = r0 + i;
    if (r < rows && c < cols) {
      const float v = load(r, c);
      if (o.y) o.y[r * cols + c] = v;
      const uint32_t a = AmaxBitsHD(v);
      amax = a > amax ? a : amax;
      col_sum += v;
      if (cast) {
        const uint8_t code = EncodeFp8HD(__fmul_rn(v, scale), o.format);
        if (o.data) o.data[r * cols + c] = code;
        codes[i][tx] = code;
      }
    }
  }
  if (o.data_t) {
    __syncthreads();
    for (int i = ty; i < kTile; i += kTileRowsPerPass) {
      const int64_t out_row = c0 + i, out_col = r0 + tx;  // data_t is [cols, rows]
      if (out_row < cols && out_col < rows) o.data_t[out_row * rows + out_col] = codes[tx][i];
    }
  }
  if (o.dbias) {
    col_partial[ty][tx] = col_sum;
    __syncthreads();
    if (ty == 0 && c < cols) {
      float s = 0.0f;
      for (int j = 0; j < kTileRowsPerPass; ++j) s += col_partial[j][tx];
      atomicAdd(o.dbias + c, s);
    }
  }
  if (o.amax_bits) {
    amax = WarpMaxU32(amax);
    if (tx == 0) warp_amax[ty] = amax;
    __syncthreads();
    if (tx == 0 && ty == 0) {
      for (int j = 1; j < kTileRowsPerPass; ++j) amax = warp_amax[j] > amax ? warp_amax[j] : amax;
      atomicMax(o.amax_bits, amax);
    }
  }
  if (o.scale_inv && cast && blockIdx.x == 0 && blockIdx.y == 0 && tx == 0 && ty == 0) {
    *o.scale_inv = __fdiv_rn(1.0f, scale);
  }
}

// Current scaling between the two passes: scale = ComputeScale(amax) on the device, so the host
// never waits for the amax.
static __global__ void ComputeScaleKernel(const float* amax, Fp8Format format, int margin,
                                          float* scale, float* scale_inv) {
  const float s = ComputeScaleHD(*amax, format, margin);
  *scale = s;
  if (scale_inv) *scale_inv = __fdiv_rn(1.0f, s);
}

static __global__ void ScaleInvKernel(const float* scale, float* scale_inv) {
  *scale_inv = __fdiv_rn(1.0f, *scale);
}

inline void CheckShape(const char* what, int64_t rows, int64_t cols) {
  if (rows < 0 || cols < 0) {
    throw std::invalid_argument(std::string(what) + ": negative shape [" + std::to_string(rows) +
                                ", " + std::to_string(cols) + "]");
  }
  if ((rows + kTile - 1) / kTile > 65535) {
    throw std::invalid_argument(std::string(what) + ": rows=" + std::to_string(rows) +
                                " exceeds the grid limit of " + std::to_string(65535 * kTile));
  }
}

inline void CheckOutput(const char* what, const Fp8Output& out) {
  if (out.scale == nullptr) {
    throw std::invalid_argument(std::string(what) + ": Fp8Output.scale is null");
  }
  if (out.current && out.amax == nullptr) {
    throw std::invalid_argument(std::string(what) +
                                ": current scaling needs Fp8Output.amax (the scale comes from it)");
  }
  if (out.format != Fp8Format::kE4M3 && out.format != Fp8Format::kE5M2) {
    throw std::invalid_argument(std::string(what) + ": unknown FP8 format");
  }
}

// Runs the tile kernel over the source that `load` defines: y (may be null), the cast described
// by `out` (may be null) and dbias (may be null). Current scaling takes two passes: amax (with y
// and dbias), the scale, then the cast; the loader computes the same bits both times.
template <class Loader>
void RunTileCast(const char* what, const Loader& load, int64_t rows, int64_t cols, float* y,
                 const Fp8Output* out, float* dbias, cudaStream_t stream) {
  CheckShape(what, rows, cols);
  if (out) CheckOutput(what, *out);
  if (dbias) GRADWIRE_CUDA_CHECK(cudaMemsetAsync(dbias, 0, size_t(cols) * sizeof(float), stream));
  if (out && out->amax) GRADWIRE_CUDA_CHECK(cudaMemsetAsync(out->amax, 0, sizeof(float), stream));
  if (rows == 0 || cols == 0) {  // no elements, but the scalars are still the cast's
    if (out && out->current) {
      ComputeScaleKernel<<<1, 1, 0, stream>>>(out->amax, out->format, out->margin, out->scale,
                                              out->scale_inv);
      GRADWIRE_CUDA_CHECK(cudaGetLastError());
    } else if (out && out->scale_inv) {
      ScaleInvKernel<<<1, 1, 0, stream>>>(out->scale, out->scale_inv);
      GRADWIRE_CUDA_CHECK(cudaGetLastError());
    }
    return;
  }
  const dim3 grid(unsigned((cols + kTile - 1) / kTile), unsigned((rows + kTile - 1) / kTile));
  const dim3 block(kTile, kTileRowsPerPass);
  TileOutputs o;
  o.y = y;
  o.dbias = dbias;
  if (out) {
    o.format = out->format;
    o.amax_bits = reinterpret_cast<uint32_t*>(out->amax);
  }
  if (out && out->current) {
    TileCastKernel<<<grid, block, 0, stream>>>(load, rows, cols, o);
    GRADWIRE_CUDA_CHECK(cudaGetLastError());
    ComputeScaleKernel<<<1, 1, 0, stream>>>(out->amax, out->format, out->margin, out->scale,
                                            nullptr);
    GRADWIRE_CUDA_CHECK(cudaGetLastError());
    o = TileOutputs{};
    o.format = out->format;
  }
  if (out) {
    o.scale = out->scale;
    o.data = out->data;
    o.data_t = out->data_t;
    o.scale_inv = out->scale_inv;
  }
  TileCastKernel<<<grid, block, 0, stream>>>(load, rows, cols, o);
  GRADWIRE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace gradwire::kernels::cuda::detail
