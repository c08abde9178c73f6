#include "check.h"
#include "fp8_math.h"
#include "gradwire/kernels/cuda/cast.h"
#include "tile_cast.cuh"

namespace gradwire::kernels::cuda {
namespace {

struct PlainLoader {
  const float* x;
  int64_t cols;
  __device__ float operator()(int64_t r, int64_t c) const { return x[r * cols + c]; }
};

// bfloat16 is the upper half of a float32: widening is a shift, exact.
struct Bf16Loader {
  const uint16_t* x;
  int64_t cols;
  __device__ float operator()(int64_t r, int64_t c) const {
    return __uint_as_float(uint32_t(x[r * cols + c]) << 16);
  }
};

__global__ void AmaxKernel(const float* x, int64_t n, uint32_t* amax_bits) {
  uint32_t amax = 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const uint32_t a = AmaxBitsHD(x[i]);
    amax = a > amax ? a : amax;
  }
  __shared__ uint32_t warp_amax[32];
  amax = detail::WarpMaxU32(amax);
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (unsigned w = 1; w < blockDim.x / 32; ++w) amax = warp_amax[w] > amax ? warp_amax[w] : amax;
    atomicMax(amax_bits, amax);
  }
}

__global__ void TransposeKernel(const uint8_t* in, int64_t rows, int64_t cols, uint8_t* out) {
  __shared__ uint8_t tile[detail::kTile][detail::kTile + 4];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t r0 = int64_t(blockIdx.y) * detail::kTile, c0 = int64_t(blockIdx.x) * detail::kTile;
  for (int i = ty; i < detail::kTile; i += detail::kTileRowsPerPass) {
    if (r0 + i < rows && c0 + tx < cols) tile[i][tx] = in[(r0 + i) * cols + c0 + tx];
  }
  __syncthreads();
  for (int i = ty; i < detail::kTile; i += detail::kTileRowsPerPass) {
    if (c0 + i < cols && r0 + tx < rows) out[(c0 + i) * rows + r0 + tx] = tile[tx][i];
  }
}

__global__ void DequantizeKernel(const uint8_t* codes, int64_t n, Fp8Format format,
                                 const float* scale_inv, float* out) {
  __shared__ float table[256];
  for (int i = threadIdx.x; i < 256; i += blockDim.x) {
    // Decode by building each value from its fields, as kernels/ref/fp8.cc DecodeFp8 does.
    const bool e4m3 = format == Fp8Format::kE4M3;
    const int mbits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15, min_exp = e4m3 ? -6 : -14;
    const int e = (i & 0x7F) >> mbits, m = i & ((1 << mbits) - 1);
    float v;
    if (e4m3 && e == 15 && m == 7) {
      v = __uint_as_float(0x7FC00000u);
    } else if (!e4m3 && e == 31) {
      v = m == 0 ? __uint_as_float(0x7F800000u) : __uint_as_float(0x7FC00000u);
    } else if (e == 0) {
      v = ldexpf(float(m), min_exp - mbits);
    } else {
      v = ldexpf(float((1 << mbits) + m), e - bias - mbits);
    }
    table[i] = (i & 0x80) ? -v : v;
  }
  __syncthreads();
  const float s = *scale_inv;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = __fmul_rn(table[codes[i]], s);
  }
}

unsigned GridFor(int64_t n, int block) {
  const int64_t blocks = (n + block - 1) / block;
  return unsigned(blocks < 4096 ? (blocks > 0 ? blocks : 1) : 4096);
}

}  // namespace

void CastTranspose(const float* x, int64_t rows, int64_t cols, const Fp8Output& out,
                   cudaStream_t stream) {
  detail::RunTileCast("CastTranspose", PlainLoader{x, cols}, rows, cols, nullptr, &out, nullptr,
                      stream);
}

void CastTransposeBf16(const uint16_t* x, int64_t rows, int64_t cols, const Fp8Output& out,
                       cudaStream_t stream) {
  detail::RunTileCast("CastTransposeBf16", Bf16Loader{x, cols}, rows, cols, nullptr, &out, nullptr,
                      stream);
}

void CastTransposeDbiasBf16(const uint16_t* x, int64_t rows, int64_t cols, const Fp8Output& out,
                            float* dbias, cudaStream_t stream) {
  if (dbias == nullptr) throw std::invalid_argument("CastTransposeDbiasBf16: dbias is null");
  detail::RunTileCast("CastTransposeDbiasBf16", Bf16Loader{x, cols}, rows, cols, nullptr, &out,
                      dbias, stream);
}

void CastTransposeDbias(const float* x, int64_t rows, int64_t cols, const Fp8Output& out,
                        float* dbias, cudaStream_t stream) {
  if (dbias == nullptr) throw std::invalid_argument("CastTransposeDbias: dbias is null");
  detail::RunTileCast("CastTransposeDbias", PlainLoader{x, cols}, rows, cols, nullptr, &out, dbias,
                      stream);
}

void Amax(const float* x, int64_t n, float* amax, cudaStream_t stream) {
  if (n < 0) throw std::invalid_argument("Amax: negative size " + std::to_string(n));
  if (amax == nullptr) throw std::invalid_argument("Amax: amax is null");
  GRADWIRE_CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(float), stream));
  if (n == 0) return;
  AmaxKernel<<<GridFor(n, 512), 512, 0, stream>>>(x, n, reinterpret_cast<uint32_t*>(amax));
  GRADWIRE_CUDA_CHECK(cudaGetLastError());
}

void ComputeScaleFromAmax(const float* amax, Fp8Format format, int margin, float* scale,
                          float* scale_inv, cudaStream_t stream) {
  if (amax == nullptr || scale == nullptr) {
    throw std::invalid_argument("ComputeScaleFromAmax: amax and scale must not be null");
  }
  detail::ComputeScaleKernel<<<1, 1, 0, stream>>>(amax, format, margin, scale, scale_inv);
  GRADWIRE_CUDA_CHECK(cudaGetLastError());
}

void TransposeCodes(const uint8_t* codes, int64_t rows, int64_t cols, uint8_t* out,
                    cudaStream_t stream) {
  detail::CheckShape("TransposeCodes", rows, cols);
  if (rows == 0 || cols == 0) return;
  const dim3 grid(unsigned((cols + detail::kTile - 1) / detail::kTile),
                  unsigned((rows + detail::kTile - 1) / detail::kTile));
  TransposeKernel<<<grid, dim3(detail::kTile, detail::kTileRowsPerPass), 0, stream>>>(codes, rows,
                                                                                      cols, out);
  GRADWIRE_CUDA_CHECK(cudaGetLastError());
}

void Dequantize(const uint8_t* codes, int64_t n, Fp8Format format, const float* scale_inv,
                float* out, cudaStream_t stream) {
  if (n < 0) throw std::invalid_argument("Dequantize: negative size " + std::to_string(n));
  if (n == 0) return;
  DequantizeKernel<<<GridFor(n, 256), 256, 0, stream>>>(codes, n, format, scale_inv, out);
  GRADWIRE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace gradwire::kernels::cuda
