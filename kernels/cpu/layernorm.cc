#include "gradwire/kernels/cpu/layernorm.h"

#include <algorithm>

#include "gradwire/kernels/cpu/parallel.h"
#include "gradwire/kernels/ref/activation.h"
#include "gradwire/kernels/ref/layernorm.h"

namespace gradwire::kernels::cpu {
namespace {

constexpr int64_t kGrain = int64_t(1) << 14;  // elements per range, at least

int64_t RowGrain(int64_t cols) { return std::max<int64_t>(1, kGrain / std::max<int64_t>(1, cols)); }

}  // namespace

void LayerNormForward(const float* x, int64_t rows, int64_t cols, const float* gamma,
                      const float* beta, float eps, bool zero_centered_gamma, float* y, float* mu,
                      float* rstd) {
  ParallelFor(rows, RowGrain(cols), [&](int64_t r0, int64_t r1) {
    kernels::LayerNormForward(x + r0 * cols, r1 - r0, cols, gamma, beta, eps, zero_centered_gamma,
                              y + r0 * cols, mu + r0, rstd + r0);
  });
}

void LayerNormBackward(const float* dy, const float* x, const float* mu, const float* rstd,
                       const float* gamma, int64_t rows, int64_t cols, bool zero_centered_gamma,
                       float* dx, float* dgamma, float* dbeta) {
  const float offset = zero_centered_gamma ? 1.0f : 0.0f;
  // dx, row by row: the reference's per-row arithmetic.
  ParallelFor(rows, RowGrain(cols), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * cols;
      const float* dyr = dy + r * cols;
      float* dxr = dx + r * cols;
      float sum_dxhat = 0.0f, sum_dxhat_xhat = 0.0f;
      for (int64_t c = 0; c < cols; ++c) {
        const float xhat = (xr[c] - mu[r]) * rstd[r];
        const float dxhat = dyr[c] * (gamma[c] + offset);
        sum_dxhat += dxhat;
        sum_dxhat_xhat += dxhat * xhat;
      }
      const float mean_dxhat = sum_dxhat / float(cols);
      const float mean_dxhat_xhat = sum_dxhat_xhat / float(cols);
      for (int64_t c = 0; c < cols; ++c) {
        const float xhat = (xr[c] - mu[r]) * rstd[r];
        const float dxhat = dyr[c] * (gamma[c] + offset);
        dxr[c] = rstd[r] * (dxhat - mean_dxhat - xhat * mean_dxhat_xhat);
      }
    }
  });
  // dgamma and dbeta, column by column, rows in order, added to what they held: the reference's
  // order of additions for each element.
  ParallelFor(cols, std::max<int64_t>(16, kGrain / std::max<int64_t>(1, rows)),
              [&](int64_t c0, int64_t c1) {
                for (int64_t r = 0; r < rows; ++r) {
                  const float* xr = x + r * cols;
                  const float* dyr = dy + r * cols;
                  for (int64_t c = c0; c < c1; ++c) {
                    const float xhat = (xr[c] - mu[r]) * rstd[r];
                    dgamma[c] += dyr[c] * xhat;
                    dbeta[c] += dyr[c];
                  }
                }
              });
}

void ActivationForward(Activation act, const float* in, int64_t rows, int64_t width, float* out) {
  const int64_t in_width = IsGated(act) ? 2 * width : width;
  ParallelFor(rows, RowGrain(in_width), [&](int64_t r0, int64_t r1) {
    kernels::ActivationForward(act, in + r0 * in_width, r1 - r0, width, out + r0 * width);
  });
}

void ActivationBackward(Activation act, const float* dout, const float* in, int64_t rows,
                        int64_t width, float* din) {
  const int64_t in_width = IsGated(act) ? 2 * width : width;
  ParallelFor(rows, RowGrain(in_width), [&](int64_t r0, int64_t r1) {
    kernels::ActivationBackward(act, dout + r0 * width, in + r0 * in_width, r1 - r0, width,
                                din + r0 * in_width);
  });
}

}  // namespace gradwire::kernels::cpu
