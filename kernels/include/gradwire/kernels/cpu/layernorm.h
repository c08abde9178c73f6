// The reference LayerNorm and activations (kernels/ref) split over the CPU backend's pool, with
// the reference's results bit for bit: rows are independent, and LayerNorm's gamma and beta
// gradients sum each column over the rows in the reference's order (threads split the columns,
// never the rows of a sum). Same arguments and memory rules as kernels/ref/layernorm.h and
// kernels/ref/activation.h.
#pragma once

#include <cstdint>

#include "gradwire/kernels/activation.h"

namespace gradwire::kernels::cpu {

void LayerNormForward(const float* x, int64_t rows, int64_t cols, const float* gamma,
                      const float* beta, float eps, bool zero_centered_gamma, float* y, float* mu,
                      float* rstd);

void LayerNormBackward(const float* dy, const float* x, const float* mu, const float* rstd,
                       const float* gamma, int64_t rows, int64_t cols, bool zero_centered_gamma,
                       float* dx, float* dgamma, float* dbeta);

void ActivationForward(Activation act, const float* in, int64_t rows, int64_t width, float* out);

void ActivationBackward(Activation act, const float* dout, const float* in, int64_t rows,
                        int64_t width, float* din);

}  // namespace gradwire::kernels::cpu
