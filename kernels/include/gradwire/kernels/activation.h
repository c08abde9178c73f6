// The activations of the MLP block, shared by both backends: the kinds and their names. The
// functions are each backend's: gradwire/kernels/ref/activation.h (reference) and
// gradwire/kernels/cuda/activation.h (CUDA). Gated activations read an input twice as wide as
// their output: the first half goes through the nonlinearity, the second half is the linear gate
// (out = act(in[:, :w]) * in[:, w:]).
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

}  // namespace gradwire::kernels
