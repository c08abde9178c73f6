// Helpers for core tests: fresh random tensors, float64 references, and the module specs and
// argument blocks the tests build again and again.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "gradwire/kernels/activation.h"
#include "server/core/kinds/gradients.h"
#include "server/core/kinds/module_kind.h"
#include "server/core/module_spec.h"
#include "server/device/backend.h"
#include "server/device/quantizer.h"
#include "server/device/recipe.h"

namespace gradwire::testing {

// Current-scaling casts of the HYBRID recipe.
inline const device::QuantizerConfig kE4M3{kernels::Fp8Format::kE4M3, 0, 0.0f, nullptr, nullptr};
inline const device::QuantizerConfig kE5M2{kernels::Fp8Format::kE5M2, 0, 0.0f, nullptr, nullptr};

inline at::Generator& Gen() {
  static at::Generator gen = [] {
    auto g = at::detail::createCPUGenerator(std::random_device{}());
    return g;
  }();
  return gen;
}

// float32 N(0, stddev) of `shape`, fresh each call.
inline at::Tensor RandN(at::IntArrayRef shape, double stddev = 1.0) {
  return at::normal(0.0, stddev, shape, Gen(), at::TensorOptions().dtype(at::kFloat));
}

// |actual - expected| <= atol + rtol * |expected| elementwise (TE's allclose).
inline ::testing::AssertionResult AllClose(const at::Tensor& actual, const at::Tensor& expected,
                                           double rtol, double atol) {
  const at::Tensor a = actual.to(at::kDouble), e = expected.to(at::kDouble);
  if (a.sizes() != e.sizes()) return ::testing::AssertionFailure() << "shapes differ";
  const at::Tensor excess = (a - e).abs() - (atol + rtol * e.abs());
  const double worst = excess.max().item<double>();
  if (worst <= 0) return ::testing::AssertionSuccess();
  const int64_t at_index = excess.argmax().item<int64_t>();
  return ::testing::AssertionFailure()
         << "element " << at_index << ": " << a.flatten()[at_index].item<double>() << " vs "
         << e.flatten()[at_index].item<double>() << " (rtol " << rtol << ", atol " << atol
         << ", over by " << worst << ")";
}

// TE's allclose carried over to sums (GEMM outputs): |actual - expected| <= atol + rtol * terms,
// where terms = the sum of |summands| of each element. For a single summand this is exactly
// |a - e| <= atol + rtol * |e|; for a sum, an FP8 rounding of relative size r per value moves
// the result by at most ~r * terms, however much the summands cancel.
inline ::testing::AssertionResult AllCloseToSum(const at::Tensor& actual,
                                                const at::Tensor& expected, const at::Tensor& terms,
                                                double rtol, double atol) {
  const at::Tensor a = actual.to(at::kDouble), e = expected.to(at::kDouble);
  if (a.sizes() != e.sizes()) return ::testing::AssertionFailure() << "shapes differ";
  const at::Tensor excess = (a - e).abs() - (atol + rtol * terms.to(at::kDouble));
  const double worst = excess.max().item<double>();
  if (worst <= 0) return ::testing::AssertionSuccess();
  const int64_t at_index = excess.argmax().item<int64_t>();
  return ::testing::AssertionFailure()
         << "element " << at_index << ": " << a.flatten()[at_index].item<double>() << " vs "
         << e.flatten()[at_index].item<double>() << " (terms "
         << terms.flatten()[at_index].item<double>() << ", over by " << worst << ")";
}

// The float64 copy of t (what the references compute in).
inline at::Tensor D(const at::Tensor& t) { return t.to(at::kDouble); }

// ||actual - expected|| / ||expected|| <= tol: for results that pass through several FP8 casts
// and a LayerNorm backward, where no per-element bound is tight.
inline ::testing::AssertionResult NormwiseClose(const at::Tensor& actual,
                                                const at::Tensor& expected, double tol) {
  const double err = (D(actual) - D(expected)).norm().item<double>();
  const double ref = D(expected).norm().item<double>();
  if (err <= tol * ref + 1e-9) return ::testing::AssertionSuccess();  // floor: all-zero refs
  return ::testing::AssertionFailure() << "relative error " << err / ref << " > " << tol;
}

// The activation `act` in libtorch ops (autograd follows it): in is [rows, (gated ? 2 : 1) *
// width], the result [rows, width].
inline at::Tensor Act64(kernels::Activation act, const at::Tensor& in, int64_t width) {
  using kernels::Activation;
  const at::Tensor a = in.narrow(1, 0, width);
  switch (act) {
    case Activation::kRelu:
      return at::relu(in);
    case Activation::kGelu:
      return at::gelu(in, "tanh");
    case Activation::kSwiglu:
      return at::silu(a) * in.narrow(1, width, width);
    case Activation::kGeglu:
      return at::gelu(a, "tanh") * in.narrow(1, width, width);
  }
  return {};
}

// Random LayerNorm parameters of width k: gamma near 1 (near 0 when zero_centered, whose scale
// is 1 + gamma), beta near 0.
inline device::LayerNormParams RandomLn(int64_t k, bool zero_centered) {
  return device::LayerNormParams{RandN({k}, 0.3) + (zero_centered ? 0.0 : 1.0), RandN({k}, 0.3),
                                 1e-5f, zero_centered};
}

// A module of `kind` with these widths and seed, every other field at its default. ffn is
// LayerNormMLP's activation width; the other kinds get 0 whatever is passed.
inline core::ModuleSpec MakeModuleSpec(core::ModuleKind kind, int64_t in, int64_t out,
                                       int64_t ffn = 0, uint64_t seed = 0) {
  core::ModuleSpec spec;
  spec.kind = kind;
  spec.in_features = in;
  spec.out_features = out;
  spec.ffn_features = kind == core::ModuleKind::kLayerNormMlp ? ffn : 0;
  spec.seed = seed;
  return spec;
}

// A Linear module (with bias) of these widths and seed.
inline core::ModuleSpec MakeLinearSpec(int64_t in, int64_t out, uint64_t seed = 0) {
  return MakeModuleSpec(core::ModuleKind::kLinear, in, out, 0, seed);
}

// The delayed-scaling recipe: history_len amaxes remembered, `algo` picks the scale's amax.
inline device::RecipeConfig DelayedRecipe(device::AmaxAlgo algo, int64_t history_len,
                                          int margin = 0) {
  device::RecipeConfig config;
  config.mode = device::ScalingMode::kDelayed;
  config.algo = algo;
  config.history_len = history_len;
  config.margin = margin;
  return config;
}

// Current-scaling quantizers for every role of `kind`, in its Roles() order: E4M3 casts forward,
// E5M2 casts of the gradients (the HYBRID recipe).
inline std::vector<device::QuantizerConfig> CurrentScaling(core::ModuleKind kind) {
  std::vector<device::QuantizerConfig> q;
  for (const core::RoleDef& r : core::FindKind(kind)->Roles())
    q.push_back({r.format, 0, 0.0f, nullptr, nullptr});
  return q;
}

// The parameters of a layer with one GEMM: weight [N, K], bias [N] (undefined: none) and, for
// LayerNormLinear, the LayerNorm's gamma and beta.
inline core::ParamTable GemmParams(const at::Tensor& weight, const at::Tensor& bias,
                                   const device::LayerNormParams* ln = nullptr) {
  core::ParamTable t;
  t[core::Param::kWeight] = weight;
  t[core::Param::kBias] = bias;
  if (ln != nullptr) {
    t[core::Param::kLayerNormWeight] = ln->gamma;
    t[core::Param::kLayerNormBias] = ln->beta;
  }
  return t;
}

// A kind's forward arguments as the tests make them: weight version 1, every cast with current
// scaling. `spec` (which names the kind and what it asks for) must outlive them.
inline core::KindForwardArgs MakeFwdArgs(const core::ModuleSpec& spec, const at::Tensor& input,
                                         core::ParamTable params, bool training) {
  core::KindForwardArgs args;
  args.spec = &spec;
  args.input = input;
  args.params = std::move(params);
  args.quantizers = CurrentScaling(spec.kind);
  args.weight_version = 1;
  args.training = training;
  return args;
}

// The spec of a layer with one GEMM of this weight, with a bias when `bias` is defined.
inline core::ModuleSpec GemmSpec(core::ModuleKind kind, const at::Tensor& weight,
                                 const at::Tensor& bias) {
  core::ModuleSpec spec;
  spec.kind = kind;
  spec.in_features = weight.size(1);
  spec.out_features = weight.size(0);
  spec.bias = bias.defined();
  return spec;
}

// One role's amax among those a forward or backward measured (NaN when it measured none).
inline float AmaxOf(const std::vector<core::RoleCast>& amaxes, size_t role) {
  for (const auto& [r, cast] : amaxes) {
    if (r == role) return cast.amax();
  }
  return NAN;
}

// A forward's saved state as its kind's type.
template <class Saved>
const Saved& SavedAs(const core::KindForwardResult& r) {
  return dynamic_cast<const Saved&>(*r.saved);
}

// A sink that accumulates a backward's gradients straight into these tensors (on the reference
// backend): dW into weight_grad, dbias into bias_grad (undefined: no bias), and for the LayerNorm
// kinds dgamma and dbeta into gamma_grad and beta_grad.
inline core::DirectGradients Into(const at::Tensor& weight_grad, const at::Tensor& bias_grad,
                                  const at::Tensor& gamma_grad = at::Tensor(),
                                  const at::Tensor& beta_grad = at::Tensor()) {
  core::ParamTable t;
  t[core::Param::kWeight] = weight_grad;
  t[core::Param::kBias] = bias_grad;
  t[core::Param::kLayerNormWeight] = gamma_grad;
  t[core::Param::kLayerNormBias] = beta_grad;
  return core::DirectGradients(*device::MakeReferenceBackend(), std::move(t));
}

// The matching backward: the gradients cast with current scaling, every parameter gradient into
// `grads` (see Into). `spec` must outlive the arguments; its bias says whether dbias is wanted.
inline core::KindBackwardArgs MakeBwdArgs(const core::ModuleSpec& spec,
                                          const at::Tensor& grad_output,
                                          const core::SavedTensors* saved,
                                          core::GradientSink* grads,
                                          bool compute_grad_input = true) {
  core::KindBackwardArgs args;
  args.spec = &spec;
  args.grad_output = grad_output;
  args.saved = saved;
  args.grads = grads;
  args.quantizers = CurrentScaling(spec.kind);
  args.compute_grad_input = compute_grad_input;
  return args;
}

}  // namespace gradwire::testing
