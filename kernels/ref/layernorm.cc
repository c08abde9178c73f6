#include "gradwire/kernels/ref/layernorm.h"

#include <cmath>

namespace gradwire::kernels {

void LayerNormForward(const float* x, int64_t rows, int64_t cols, const float* gamma,
                      const float* beta, float eps, bool zero_centered_gamma, float* y, float* mu,
                      float* rstd) {
  const float offset = zero_centered_gamma ? 1.0f : 0.0f;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * cols;
    float sum = 0.0f;
    for (int64_t c = 0; c < cols; ++c) sum += xr[c];
    const float mean = sum / float(cols);
    float sq = 0.0f;  // two passes: no cancellation from E[x^2] - E[x]^2
    for (int64_t c = 0; c < cols; ++c) sq += (xr[c] - mean) * (xr[c] - mean);
    const float inv = 1.0f / std::sqrt(sq / float(cols) + eps);
    mu[r] = mean;
    rstd[r] = inv;
    float* yr = y + r * cols;
    for (int64_t c = 0; c < cols; ++c) {
      yr[c] = (xr[c] - mean) * inv * (gamma[c] + offset) + beta[c];
    }
  }
}

void LayerNormBackward(const float* dy, const float* x, const float* mu, const float* rstd,
                       const float* gamma, int64_t rows, int64_t cols, bool zero_centered_gamma,
                       float* dx, float* dgamma, float* dbeta) {
  const float offset = zero_centered_gamma ? 1.0f : 0.0f;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * cols;
    const float* dyr = dy + r * cols;
    float* dxr = dx + r * cols;
    // dxhat = dy * g; dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
    float sum_dxhat = 0.0f, sum_dxhat_xhat = 0.0f;
    for (int64_t c = 0; c < cols; ++c) {
      const float xhat = (xr[c] - mu[r]) * rstd[r];
      const float dxhat = dyr[c] * (gamma[c] + offset);
      sum_dxhat += dxhat;
      sum_dxhat_xhat += dxhat * xhat;
      dgamma[c] += dyr[c] * xhat;
      dbeta[c] += dyr[c];
    }
    const float mean_dxhat = sum_dxhat / float(cols);
    const float mean_dxhat_xhat = sum_dxhat_xhat / float(cols);
    for (int64_t c = 0; c < cols; ++c) {
      const float xhat = (xr[c] - mu[r]) * rstd[r];
      const float dxhat = dyr[c] * (gamma[c] + offset);
      dxr[c] = rstd[r] * (dxhat - mean_dxhat - xhat * mean_dxhat_xhat);
    }
  }
}

}  // namespace gradwire::kernels
