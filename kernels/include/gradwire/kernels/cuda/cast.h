// FP8 casts of the CUDA backend: bit-exact with the reference backend (kernels/ref/cast.cc,
// fp8.cc) for the same fp32 input and scale: same codes, same transposed codes, same amax, same
// scale_inv = 1 / scale, same current-scaling scale.
//
// All pointers are device memory, row-major, non-owning; every call is asynchronous on `stream`
// and allocates nothing. Bad arguments throw std::invalid_argument before anything is launched;
// CUDA failures throw CudaError (kernels/cuda/check.h).
#pragma once

#include <cstdint>

#include "gradwire/kernels/cuda/stream.h"
#include "gradwire/kernels/fp8.h"

namespace gradwire::kernels::cuda {

// Where a cast writes and how it scales. Any of data, data_t, amax, scale_inv may be null.
struct Fp8Output {
  Fp8Format format = Fp8Format::kE4M3;
  // device [1]. Delayed scaling (current = false): the scale to multiply by, read.
  // Current scaling (current = true): written with ComputeScale(amax, format, margin) of this
  // tensor, which then casts with it (two passes over the input; amax must be set).
  float* scale = nullptr;
  bool current = false;
  int margin = 0;              // current scaling only
  uint8_t* data = nullptr;     // device [rows, cols] FP8 codes
  uint8_t* data_t = nullptr;   // device [cols, rows] the transposed codes
  float* amax = nullptr;       // device [1], overwritten with max |x| (NaN if any x is NaN)
  float* scale_inv = nullptr;  // device [1], overwritten with 1 / scale
};

// Casts x[rows, cols] (fp32): one read of x writes the rowwise codes, the transposed codes and
// the amax.
void CastTranspose(const float* x, int64_t rows, int64_t cols, const Fp8Output& out,
                   cudaStream_t stream);

// CastTranspose of x[rows, cols] in bfloat16 (raw 16-bit patterns): each value widened to fp32
// exactly, so the codes, transposed codes and amax are CastTranspose's of the widened tensor.
void CastTransposeBf16(const uint16_t* x, int64_t rows, int64_t cols, const Fp8Output& out,
                       cudaStream_t stream);
// CastTransposeDbias of a bfloat16 x (the widened values' column sums, in fp32).
void CastTransposeDbiasBf16(const uint16_t* x, int64_t rows, int64_t cols, const Fp8Output& out,
                            float* dbias, cudaStream_t stream);

// CastTranspose plus dbias[cols] = column sums of x (the unquantized gradient, overwritten;
// fp32 sums whose order differs from the reference's, so equal only to rounding).
void CastTransposeDbias(const float* x, int64_t rows, int64_t cols, const Fp8Output& out,
                        float* dbias, cudaStream_t stream);

// amax[0] = max |x_i| over n elements (NaN if any is NaN, 0 for n == 0).
void Amax(const float* x, int64_t n, float* amax, cudaStream_t stream);

// scale[0] = ComputeScale(amax[0], format, margin); scale_inv[0] = 1 / scale[0] (if not null).
void ComputeScaleFromAmax(const float* amax, Fp8Format format, int margin, float* scale,
                          float* scale_inv, cudaStream_t stream);

// out[cols, rows] = codes[rows, cols]^T.
void TransposeCodes(const uint8_t* codes, int64_t rows, int64_t cols, uint8_t* out,
                    cudaStream_t stream);

// out[i] = decode(codes[i]) * scale_inv[0] (fp32).
void Dequantize(const uint8_t* codes, int64_t n, Fp8Format format, const float* scale_inv,
                float* out, cudaStream_t stream);

}  // namespace gradwire::kernels::cuda
