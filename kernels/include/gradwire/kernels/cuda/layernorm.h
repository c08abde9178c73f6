// LayerNorm of the CUDA backend, with its output cast to FP8 in the same kernel. The formulas are
// those of kernels/ref/layernorm.cc (two-pass biased variance, rstd = 1 / sqrt(var + eps));
// the row reductions run in a different order, so results equal the reference to fp32 rounding,
// not bit for bit. Device pointers, row-major, asynchronous on `stream`.
#pragma once

#include <cstdint>

#include "gradwire/kernels/cuda/cast.h"
#include "gradwire/kernels/cuda/stream.h"

namespace gradwire::kernels::cuda {

// mu[rows], rstd[rows] are written for backward. y[rows, cols] (fp32) is written when not null;
// `out` (when not null) receives the FP8 cast of y, its transposed copy and amax (see Fp8Output).
void LayerNormForward(const float* x, int64_t rows, int64_t cols, const float* gamma,
                      const float* beta, float eps, bool zero_centered_gamma, float* y,
                      const Fp8Output* out, float* mu, float* rstd, cudaStream_t stream);

// dx[rows, cols] is written; dgamma[cols] and dbeta[cols] are accumulated (+=).
void LayerNormBackward(const float* dy, const float* x, const float* mu, const float* rstd,
                       const float* gamma, int64_t rows, int64_t cols, bool zero_centered_gamma,
                       float* dx, float* dgamma, float* dbeta, cudaStream_t stream);

// The same with x in bfloat16 (raw bits), read as its exact float32 widening: every output bit
// for bit what the float32 forms give on the widened x, without a widened copy of x in memory.
void LayerNormForwardBf16(const uint16_t* x, int64_t rows, int64_t cols, const float* gamma,
                          const float* beta, float eps, bool zero_centered_gamma, float* y,
                          const Fp8Output* out, float* mu, float* rstd, cudaStream_t stream);
void LayerNormBackwardBf16(const float* dy, const uint16_t* x, const float* mu, const float* rstd,
                           const float* gamma, int64_t rows, int64_t cols, bool zero_centered_gamma,
                           float* dx, float* dgamma, float* dbeta, cudaStream_t stream);

}  // namespace gradwire::kernels::cuda
