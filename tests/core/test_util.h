// Helpers for core tests: fresh random tensors, float64 references, and the module specs and
// argument blocks the tests build again and again.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <random>

#include "gradwire/kernels/activation.h"
#include "server/core/backend.h"
#include "server/core/gradients.h"
#include "server/core/module_spec.h"
#include "server/core/quantizer.h"
#include "server/core/recipe.h"

namespace gradwire::testing {

// Current-scaling casts of the HYBRID recipe.
inline const core::QuantizerConfig kE4M3{kernels::Fp8Format::kE4M3, 0, 0.0f};
inline const core::QuantizerConfig kE5M2{kernels::Fp8Format::kE5M2, 0, 0.0f};

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
inline core::LayerNormParams RandomLn(int64_t k, bool zero_centered) {
  return core::LayerNormParams{RandN({k}, 0.3) + (zero_centered ? 0.0 : 1.0), RandN({k}, 0.3),
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
inline core::RecipeConfig DelayedRecipe(core::AmaxAlgo algo, int64_t history_len, int margin = 0) {
  core::RecipeConfig config;
  config.mode = core::ScalingMode::kDelayed;
  config.algo = algo;
  config.history_len = history_len;
  config.margin = margin;
  return config;
}

// The arguments every FP8 GEMM module with one weight (Linear, LayerNormLinear) takes in forward:
// weight version 1, input and weight cast to E4M3 with current scaling. Args is the module's
// forward arguments (core::LinearFwdArgs, core::LayerNormLinearFwdArgs); the rest is the caller's.
template <class Args>
Args MakeFwdArgs(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias,
                 bool training) {
  Args args;
  args.input = input;
  args.weight = weight;
  args.bias = bias;
  args.weight_version = 1;
  args.input_quantizer = args.weight_quantizer = kE4M3;
  args.training = training;
  return args;
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
  return core::DirectGradients(*core::MakeReferenceBackend(), std::move(t));
}

// The matching backward, the gradient cast to E5M2 with current scaling, its gradients into
// `grads` (see Into; `bias`: the layer has one). Args is core::LinearBwdArgs or
// core::LayerNormLinearBwdArgs.
template <class Args>
Args MakeBwdArgs(const at::Tensor& grad_output, decltype(Args::saved) saved,
                 core::GradientSink* grads, bool bias, bool compute_grad_input = true) {
  Args args;
  args.grad_output = grad_output;
  args.saved = saved;
  args.grad_quantizer = kE5M2;
  args.compute_grad_input = compute_grad_input;
  args.grads = grads;
  args.bias = bias;
  return args;
}

}  // namespace gradwire::testing
