// LayerNormLinear (LayerNorm, then an FP8 Linear) against float64 references, forward and
// backward.
#include "server/core/kinds/layernorm_linear.h"

#include <gtest/gtest.h>

#include <cmath>
#include <tuple>

#include "server/device/reference_ops.h"
#include "test_util.h"

namespace gradwire::core {
namespace {

using device::Dequantize;
using device::Quantize;
using device::RunLayerNorm;

using gradwire::testing::AllClose;
using gradwire::testing::AllCloseToSum;
using gradwire::testing::D;
using gradwire::testing::GemmParams;
using gradwire::testing::GemmSpec;
using gradwire::testing::Into;
using gradwire::testing::MakeBwdArgs;
using gradwire::testing::MakeFwdArgs;
using gradwire::testing::NormwiseClose;
using gradwire::testing::RandN;
using gradwire::testing::RandomLn;
using gradwire::testing::SavedAs;

using gradwire::testing::kE4M3;

// (M, K, N, bias, checkpoint)
class LayerNormLinearTest
    : public ::testing::TestWithParam<std::tuple<int64_t, int64_t, int64_t, bool, bool>> {};

TEST_P(LayerNormLinearTest, ForwardAndBackwardMatchFloat64) {
  const auto [m, k, n, has_bias, checkpoint] = GetParam();
  const LayerNormParams ln = RandomLn(k, checkpoint);
  const at::Tensor x = RandN({m, k}, 2.0), w = RandN({n, k}, 1.0 / std::sqrt(double(k)));
  const at::Tensor b = has_bias ? RandN({n}) : at::Tensor(), dy = RandN({m, n});
  const at::Tensor d_ln_extra = RandN({m, k}, 0.5);

  ModuleSpec spec = GemmSpec(ModuleKind::kLayerNormLinear, w, b);
  spec.layernorm_eps = ln.eps;
  spec.zero_centered_gamma = ln.zero_centered_gamma;
  spec.return_layernorm_output = true;
  spec.checkpoint = checkpoint;
  auto fwd = LayerNormLinearForward(MakeFwdArgs(spec, x, GemmParams(w, b, &ln), /*training=*/true));
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  EXPECT_EQ(SavedAs<LayerNormLinearSaved>(*fwd).ln_out.has_columnwise(), !checkpoint);

  // Tight: the GEMM on the dequantized FP8 operands it used.
  auto lnq = Quantize(RunLayerNorm(x, ln).y, kE4M3, {true, false});
  auto wq = Quantize(w, kE4M3, {true, false});
  const at::Tensor a64 = D(Dequantize(*lnq, true)), w64 = D(Dequantize(*wq, true));
  at::Tensor ref = at::matmul(a64, w64.t()), terms = at::matmul(a64.abs(), w64.abs().t());
  if (has_bias) ref = ref + D(b), terms = terms + D(b).abs();
  EXPECT_TRUE(AllCloseToSum(fwd->output, ref, terms, (k / 8 + 4) * 0x1.0p-23, 1e-6));

  // Against float64 autograd on unquantized operands.
  at::Tensor x64 = D(x).set_requires_grad(true), g64 = D(ln.gamma).set_requires_grad(true),
             be64 = D(ln.beta).set_requires_grad(true), w64u = D(w).set_requires_grad(true);
  at::Tensor b64 = has_bias ? D(b).set_requires_grad(true) : at::Tensor();
  at::Tensor ln64 = at::layer_norm(x64, {k}, checkpoint ? g64 + 1 : g64, be64, 1e-5);
  at::Tensor y64 = at::matmul(ln64, w64u.t());
  if (has_bias) y64 = y64 + b64;
  EXPECT_TRUE(AllClose(fwd->layernorm_output, ln64.detach(), 1e-5, 1e-5));
  EXPECT_TRUE(AllCloseToSum(fwd->output, y64.detach(),
                            at::matmul(ln64.detach().abs(), w64u.detach().abs().t()) +
                                (has_bias ? D(b).abs() : at::zeros({n}, at::kDouble)),
                            0.125, 0.0675));
  ((y64 * D(dy)).sum() + (ln64 * D(d_ln_extra)).sum()).backward();

  const at::Tensor weight_grad = at::zeros({n, k}),
                   bias_grad = has_bias ? at::zeros({n}) : at::Tensor(),
                   gamma_grad = at::zeros({k}), beta_grad = at::zeros({k});
  DirectGradients grads = Into(weight_grad, bias_grad, gamma_grad, beta_grad);
  auto ba = MakeBwdArgs(spec, dy, fwd->saved.get(), &grads);
  ba.grad_layernorm_output = d_ln_extra;
  auto bwd = LayerNormLinearBackward(ba);
  ASSERT_TRUE(bwd.ok()) << bwd.status();
  EXPECT_TRUE(AllCloseToSum(weight_grad, w64u.grad(),
                            at::matmul(D(dy).abs().t(), ln64.detach().abs()), 0.25, 0.125));
  if (has_bias) {
    EXPECT_TRUE(AllClose(bias_grad, b64.grad(), 1e-5, 1e-5));
  }
  EXPECT_TRUE(NormwiseClose(bwd->grad_input, x64.grad(), 0.25));
  EXPECT_TRUE(NormwiseClose(gamma_grad, g64.grad(), 0.25));
  EXPECT_TRUE(NormwiseClose(beta_grad, be64.grad(), 0.25));
}

INSTANTIATE_TEST_SUITE_P(Shapes, LayerNormLinearTest,
                         ::testing::Values(std::make_tuple(1, 1, 1, true, false),
                                           std::make_tuple(7, 13, 5, true, true),
                                           std::make_tuple(31, 64, 1, false, false),
                                           std::make_tuple(48, 96, 80, true, false),
                                           std::make_tuple(48, 96, 80, false, true)));

}  // namespace
}  // namespace gradwire::core
