// MLP activations of the CUDA backend fused with the FP8 casts around them. The formulas are
// those of kernels/ref/activation.cc (gelu and geglu in the tanh form, swiglu = silu(a) * b);
// tanhf/expf of the device differ from the host's in the last bit, so results equal the
// reference to fp32 rounding. Device pointers, row-major, asynchronous on `stream`.
#pragma once

#include <cstdint>

#include "gradwire/kernels/activation.h"
#include "gradwire/kernels/cuda/cast.h"
#include "gradwire/kernels/cuda/stream.h"

namespace gradwire::kernels::cuda {

// in: [rows, (gated ? 2 : 1) * width]. y[rows, width] (fp32) is written when not null; `out`
// (when not null) receives the FP8 cast of the activation output (FC2's input).
void ActivationForward(Activation act, const float* in, int64_t rows, int64_t width, float* y,
                       const Fp8Output* out, cudaStream_t stream);

// din = d act(in) given dout[rows, width]; din is [rows, (gated ? 2 : 1) * width].
// din_f32 (fp32) is written when not null; `out` (when not null) receives the FP8 cast of din
// (FC1's gradient: rowwise for dgrad, transposed for wgrad); dbias[in width] (when not null) is
// overwritten with the column sums of din (FC1's bias gradient).
void DActivationDbiasCast(Activation act, const float* dout, const float* in, int64_t rows,
                          int64_t width, float* din_f32, const Fp8Output* out, float* dbias,
                          cudaStream_t stream);

}  // namespace gradwire::kernels::cuda
