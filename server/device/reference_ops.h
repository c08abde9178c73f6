// The reference numerics on host tensors, below every backend: the FP8 GEMMs of kernels/ref, the
// LayerNorm, the wire conversions, and the GEMM counters
// that metrics report. The reference backend (reference_backend.cc) is made of these; the CPU
// backend shares the counters and the wire helpers. Nothing here calls back into a backend or a
// module.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "gradwire/kernels/fp8.h"
#include "gradwire/wire/codec.h"
#include "server/device/backend.h"
#include "server/device/fp8_tensor.h"
#include "server/device/gemm_counters.h"

namespace gradwire::device {

// y[M, N] = x[M, K] . w[N, K]^T (+ bias[N]); x and w rowwise. fp32 out.
at::Tensor Fp8Fprop(const Fp8Tensor& x, const Fp8Tensor& w, const at::Tensor& bias);

// dx[M, K] = dy[M, N] . w[N, K]; dy rowwise, w columnwise.
at::Tensor Fp8Dgrad(const Fp8Tensor& dy, const Fp8Tensor& w);

// acc[N, K] = (accumulate ? acc : 0) + dy[M, N]^T . x[M, K]; dy and x columnwise.
void Fp8Wgrad(const Fp8Tensor& dy, const Fp8Tensor& x, at::Tensor& acc, bool accumulate);

// acc[N] += column sums of g[M, N] (fp32, unquantized).
void AccumulateBiasGrad(const at::Tensor& g, at::Tensor& acc);

// The reference LayerNorm: forward into fresh tensors, and the backward that returns dx and
// accumulates gamma_grad / beta_grad.
LayerNormOut RunLayerNorm(const at::Tensor& x, const LayerNormParams& ln);
at::Tensor RunLayerNormBackward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mu,
                                const at::Tensor& rstd, const LayerNormParams& ln,
                                at::Tensor& gamma_grad, at::Tensor& beta_grad);

// The FP8 format of an FP8 wire dtype.
kernels::Fp8Format Fp8FormatOf(wire::DType dtype);
// The bytes of an F32 view as a host fp32 [rows, cols] tensor, without a copy, when they are
// aligned for floats; undefined otherwise (the caller decodes them). The view's bytes must
// outlive the result.
at::Tensor BorrowF32(const wire::TensorView& v, int64_t rows, int64_t cols);
// An encoded tensor of `dtype` reporting `shape`, with room for n elements.
wire::EncodedTensor EncodedFor(wire::DType dtype, std::vector<int64_t> shape, int64_t n);
// A bfloat16 host tensor's bytes as a BF16 wire tensor, copied as they are.
wire::EncodedTensor Bf16AsItIs(const at::Tensor& x, std::vector<int64_t> shape);

}  // namespace gradwire::device
