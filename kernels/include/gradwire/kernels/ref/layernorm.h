// LayerNorm of the reference backend over the last dimension of a [rows, cols] matrix.
// All pointers are host memory, row-major, non-owning; fp32 throughout.
#pragma once

#include <cstdint>

namespace gradwire::kernels {

// y = (x - mu) * rstd * g + beta with g = gamma, or g = 1 + gamma when zero_centered_gamma.
// mu[rows] and rstd[rows] (1 / sqrt(var + eps), biased variance) are written for backward.
void LayerNormForward(const float* x, int64_t rows, int64_t cols, const float* gamma,
                      const float* beta, float eps, bool zero_centered_gamma, float* y, float* mu,
                      float* rstd);

// Given dy = dL/dy, writes dx and accumulates (+=) dgamma[cols] and dbeta[cols].
void LayerNormBackward(const float* dy, const float* x, const float* mu, const float* rstd,
                       const float* gamma, int64_t rows, int64_t cols, bool zero_centered_gamma,
                       float* dx, float* dgamma, float* dbeta);

}  // namespace gradwire::kernels
