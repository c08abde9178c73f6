// Activations of the MLP block (reference backend); the kinds are in gradwire/kernels/activation.h.
#pragma once

#include <cstdint>

#include "gradwire/kernels/activation.h"

namespace gradwire::kernels {

// in: [rows, (gated ? 2 : 1) * width], out: [rows, width].
void ActivationForward(Activation act, const float* in, int64_t rows, int64_t width, float* out);

// dout: [rows, width]; in: the forward input; din: [rows, (gated ? 2 : 1) * width].
void ActivationBackward(Activation act, const float* dout, const float* in, int64_t rows,
                        int64_t width, float* din);

}  // namespace gradwire::kernels
