// Helpers for core tests: fresh random tensors and float64 references.
#pragma once

#include <ATen/ATen.h>

#include <random>

#include "server/core/quantizer.h"

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

}  // namespace gradwire::testing
