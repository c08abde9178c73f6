#include "check.h"
#include "gradwire/kernels/cuda/activation.h"
#include "tile_cast.cuh"

namespace gradwire::kernels::cuda {
namespace {

// The formulas of kernels/ref/activation.cc.
constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;

__device__ __forceinline__ float Gelu(float x) {
  return 0.5f * x * (1.0f + tanhf(kSqrt2OverPi * (x + kGeluCubic * x * x * x)));
}
__device__ __forceinline__ float GeluGrad(float x) {
  const float t = tanhf(kSqrt2OverPi * (x + kGeluCubic * x * x * x));
  const float dinner = kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * x * x);
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * dinner;
}
__device__ __forceinline__ float Sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float Silu(float x) { return x * Sigmoid(x); }
__device__ __forceinline__ float SiluGrad(float x) {
  const float s = Sigmoid(x);
  return s * (1.0f + x * (1.0f - s));
}

__device__ __forceinline__ float Apply(Activation act, float x) {
  switch (act) {
    case Activation::kRelu:  // a NaN stays a NaN, as in the reference
      return x > 0.0f ? x : (x != x ? x : 0.0f);
    case Activation::kSwiglu:
      return Silu(x);
    default:
      return Gelu(x);
  }
}
__device__ __forceinline__ float Grad(Activation act, float x) {
  switch (act) {
    case Activation::kRelu:
      return x > 0.0f ? 1.0f : (x != x ? x : 0.0f);
    case Activation::kSwiglu:
      return SiluGrad(x);
    default:
      return GeluGrad(x);
  }
}

struct ForwardLoader {
  Activation act;
  const float* in;
  int64_t width;
  int64_t in_width;
  bool gated;
  __device__ float operator()(int64_t r, int64_t c) const {
    const float* a = in + r * in_width;
    const float v = Apply(act, a[c]);
    return gated ? v * a[width + c] : v;
  }
};

// One element of din [rows, in_width]: the activation's half reads the gate, the gate's half
// reads the activation.
struct BackwardLoader {
  Activation act;
  const float* dout;
  const float* in;
  int64_t width;
  int64_t in_width;
  bool gated;
  __device__ float operator()(int64_t r, int64_t c) const {
    const float* a = in + r * in_width;
    const float* d = dout + r * width;
    if (!gated) return d[c] * Grad(act, a[c]);
    if (c < width) return d[c] * a[width + c] * Grad(act, a[c]);
    return d[c - width] * Apply(act, a[c - width]);
  }
};

void CheckAct(const char* what, Activation act) {
  if (act != Activation::kGelu && act != Activation::kRelu && act != Activation::kSwiglu &&
      act != Activation::kGeglu) {
    throw std::invalid_argument(std::string(what) + ": unknown activation " +
                                std::to_string(int(act)));
  }
}

}  // namespace

void ActivationForward(Activation act, const float* in, int64_t rows, int64_t width, float* y,
                       const Fp8Output* out, cudaStream_t stream) {
  CheckAct("ActivationForward", act);
  const bool gated = IsGated(act);
  const ForwardLoader load{act, in, width, gated ? 2 * width : width, gated};
  detail::RunTileCast("ActivationForward", load, rows, width, y, out, nullptr, stream);
}

void DActivationDbiasCast(Activation act, const float* dout, const float* in, int64_t rows,
                          int64_t width, float* din_f32, const Fp8Output* out, float* dbias,
                          cudaStream_t stream) {
  CheckAct("DActivationDbiasCast", act);
  const bool gated = IsGated(act);
  const int64_t in_width = gated ? 2 * width : width;
  const BackwardLoader load{act, dout, in, width, in_width, gated};
  detail::RunTileCast("DActivationDbiasCast", load, rows, in_width, din_f32, out, dbias, stream);
}

}  // namespace gradwire::kernels::cuda
