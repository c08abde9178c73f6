#include "gradwire/kernels/ref/activation.h"

#include <cmath>

namespace gradwire::kernels {
namespace {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;

float Gelu(float x) {
  return 0.5f * x * (1.0f + std::tanh(kSqrt2OverPi * (x + kGeluCubic * x * x * x)));
}
float GeluGrad(float x) {
  const float t = std::tanh(kSqrt2OverPi * (x + kGeluCubic * x * x * x));
  const float dinner = kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * x * x);
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * dinner;
}
float Sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
float Silu(float x) { return x * Sigmoid(x); }
float SiluGrad(float x) {
  const float s = Sigmoid(x);
  return s * (1.0f + x * (1.0f - s));
}
float Relu(float x) { return x > 0.0f ? x : 0.0f; }
float ReluGrad(float x) { return x > 0.0f ? 1.0f : 0.0f; }

float Apply(Activation act, float x) {
  switch (act) {
    case Activation::kRelu:
      return Relu(x);
    case Activation::kSwiglu:
      return Silu(x);
    default:
      return Gelu(x);
  }
}
float Grad(Activation act, float x) {
  switch (act) {
    case Activation::kRelu:
      return ReluGrad(x);
    case Activation::kSwiglu:
      return SiluGrad(x);
    default:
      return GeluGrad(x);
  }
}

}  // namespace

const char* ActivationName(Activation act) {
  switch (act) {
    case Activation::kGelu:
      return "gelu";
    case Activation::kRelu:
      return "relu";
    case Activation::kSwiglu:
      return "swiglu";
    case Activation::kGeglu:
      return "geglu";
  }
  return "unknown";
}

void ActivationForward(Activation act, const float* in, int64_t rows, int64_t width, float* out) {
  const int64_t in_width = IsGated(act) ? 2 * width : width;
  for (int64_t r = 0; r < rows; ++r) {
    const float* a = in + r * in_width;
    float* o = out + r * width;
    if (IsGated(act)) {
      const float* gate = a + width;
      for (int64_t c = 0; c < width; ++c) o[c] = Apply(act, a[c]) * gate[c];
    } else {
      for (int64_t c = 0; c < width; ++c) o[c] = Apply(act, a[c]);
    }
  }
}

void ActivationBackward(Activation act, const float* dout, const float* in, int64_t rows,
                        int64_t width, float* din) {
  const int64_t in_width = IsGated(act) ? 2 * width : width;
  for (int64_t r = 0; r < rows; ++r) {
    const float* a = in + r * in_width;
    const float* d = dout + r * width;
    float* g = din + r * in_width;
    if (IsGated(act)) {
      const float* gate = a + width;
      for (int64_t c = 0; c < width; ++c) {
        g[c] = d[c] * gate[c] * Grad(act, a[c]);
        g[width + c] = d[c] * Apply(act, a[c]);
      }
    } else {
      for (int64_t c = 0; c < width; ++c) g[c] = d[c] * Grad(act, a[c]);
    }
  }
}

}  // namespace gradwire::kernels
