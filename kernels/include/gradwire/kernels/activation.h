// Activations of the MLP block (reference backend). Gated activations read an input twice as
// wide as their output: the first half goes through the nonlinearity, the second half is the
// linear gate (out = act(in[:, :w]) * in[:, w:]).
#pragma once

#include <cstdint>

namespace gradwire::kernels {

enum class Activation : uint8_t {
  kGelu = 0,  // tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
  kRelu = 1,
  kSwiglu = 2,  // silu(a) * b
  kGeglu = 3,   // gelu(a) * b (tanh approximation)
};

const char* ActivationName(Activation act);
constexpr bool IsGated(Activation act) {
  return act == Activation::kSwiglu || act == Activation::kGeglu;
}

// in: [rows, (gated ? 2 : 1) * width], out: [rows, width].
void ActivationForward(Activation act, const float* in, int64_t rows, int64_t width, float* out);

// dout: [rows, width]; in: the forward input; din: [rows, (gated ? 2 : 1) * width].
void ActivationBackward(Activation act, const float* dout, const float* in, int64_t rows,
                        int64_t width, float* din);

}  // namespace gradwire::kernels
