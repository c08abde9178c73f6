#include "gradwire/kernels/ref/activation.h"

#include <cstdint>

#include "../cpu/vector_clones.h"

// The element functions and row loops below are forced inline into each clone of ForwardRow and
// BackwardRow, so that every clone vectorises them for its own instruction set.
#define GRADWIRE_INLINE inline __attribute__((always_inline))

namespace gradwire::kernels {
namespace {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;

// e^x from IEEE operations alone (no libm), so that every clone of a loop over it, vectorised or
// not, rounds identically: x = n ln2 + r with n = round(x / ln2) (Cody-Waite, |r| <= ln2 / 2), a
// degree-6 Taylor polynomial of e^r (relative error below 2e-7 there), scaled by 2^n through the
// exponent bits. x is clamped to [-80, 80]: the callers only need e^x to saturate beyond (a
// sigmoid of -80 is 1.8e-35, of 80 is 1), and in that range neither e^x nor a sigmoid times an
// input of ordinary size comes near the subnormals, whose arithmetic costs a hundred cycles.
GRADWIRE_INLINE float ExpF(float x) {
  x = x < -80.0f ? -80.0f : (x > 80.0f ? 80.0f : x);
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693145751953125f;          // 16 bits: n * kLn2Hi is exact
  constexpr float kLn2Lo = 1.42860682030941723212e-6f;  // ln 2 - kLn2Hi
  constexpr float kRound = 12582912.0f;                 // 1.5 * 2^23: adding it rounds to integer
  const float n = (x * kLog2e + kRound) - kRound;
  const float r = (x - n * kLn2Hi) - n * kLn2Lo;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  // A NaN x leaves n NaN, whose conversion to int is undefined: the exponent then comes from 0,
  // and the result is NaN through p.
  const float n_finite = n == n ? n : 0.0f;
  const float two_n = __builtin_bit_cast(float, uint32_t(int32_t(n_finite) + 127) << 23);
  return p * two_n;
}

GRADWIRE_INLINE float Sigmoid(float x) { return 1.0f / (1.0f + ExpF(-x)); }
// GELU's tanh form through the sigmoid: 0.5 (1 + tanh(u)) = sigmoid(2u).
GRADWIRE_INLINE float GeluInner(float x) { return kSqrt2OverPi * (x + kGeluCubic * x * x * x); }
GRADWIRE_INLINE float Gelu(float x) { return x * Sigmoid(2.0f * GeluInner(x)); }
// d/dx x s(2u) = s + 2 x s (1 - s) u', u' = sqrt(2/pi) (1 + 3 c x^2).
GRADWIRE_INLINE float GeluGrad(float x) {
  const float s = Sigmoid(2.0f * GeluInner(x));
  const float du = kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * x * x);
  return s + 2.0f * x * s * (1.0f - s) * du;
}
GRADWIRE_INLINE float Silu(float x) { return x * Sigmoid(x); }
GRADWIRE_INLINE float SiluGrad(float x) {
  const float s = Sigmoid(x);
  return s * (1.0f + x * (1.0f - s));
}
// A NaN stays a NaN (a NaN from an overflowing FC1 sum must reach the next cast's amax, not
// become 0); -0 gives +0.
GRADWIRE_INLINE float Relu(float x) { return x > 0.0f ? x : (x != x ? x : 0.0f); }
GRADWIRE_INLINE float ReluGrad(float x) { return x > 0.0f ? 1.0f : (x != x ? x : 0.0f); }

// One row's loops for activation F (its derivative G): vectorised per CPU at load time, every
// clone computing the same bits (element-wise IEEE arithmetic, no contraction in this library).
template <float (*F)(float)>
GRADWIRE_INLINE void Forward(const float* a, const float* gate, int64_t width, float* o) {
  if (gate != nullptr) {
    for (int64_t c = 0; c < width; ++c) o[c] = F(a[c]) * gate[c];
  } else {
    for (int64_t c = 0; c < width; ++c) o[c] = F(a[c]);
  }
}
template <float (*F)(float), float (*G)(float)>
GRADWIRE_INLINE void Backward(const float* d, const float* a, const float* gate, int64_t width,
                              float* g) {
  if (gate != nullptr) {
    for (int64_t c = 0; c < width; ++c) {
      g[c] = d[c] * gate[c] * G(a[c]);
      g[width + c] = d[c] * F(a[c]);
    }
  } else {
    for (int64_t c = 0; c < width; ++c) g[c] = d[c] * G(a[c]);
  }
}

GRADWIRE_VECTOR_CLONES
void ForwardRow(Activation act, const float* a, const float* gate, int64_t width, float* o) {
  switch (act) {
    case Activation::kRelu:
      return Forward<Relu>(a, gate, width, o);
    case Activation::kSwiglu:
      return Forward<Silu>(a, gate, width, o);
    default:  // kGelu, kGeglu
      return Forward<Gelu>(a, gate, width, o);
  }
}

GRADWIRE_VECTOR_CLONES
void BackwardRow(Activation act, const float* d, const float* a, const float* gate, int64_t width,
                 float* g) {
  switch (act) {
    case Activation::kRelu:
      return Backward<Relu, ReluGrad>(d, a, gate, width, g);
    case Activation::kSwiglu:
      return Backward<Silu, SiluGrad>(d, a, gate, width, g);
    default:
      return Backward<Gelu, GeluGrad>(d, a, gate, width, g);
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
    ForwardRow(act, a, IsGated(act) ? a + width : nullptr, width, out + r * width);
  }
}

void ActivationBackward(Activation act, const float* dout, const float* in, int64_t rows,
                        int64_t width, float* din) {
  const int64_t in_width = IsGated(act) ? 2 * width : width;
  for (int64_t r = 0; r < rows; ++r) {
    const float* a = in + r * in_width;
    BackwardRow(act, dout + r * width, a, IsGated(act) ? a + width : nullptr, width,
                din + r * in_width);
  }
}

}  // namespace gradwire::kernels
