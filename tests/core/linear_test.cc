// FP8 Linear forward/backward against float64 references: tight against the product of the
// dequantized FP8 operands, and within TE's FP8 tolerances against the unquantized product.
#include "server/core/kinds/linear.h"

#include <gtest/gtest.h>

#include <tuple>

#include "test_util.h"

namespace gradwire::core {
namespace {

using device::Dequantize;
using device::Quantize;

using gradwire::testing::AllClose;
using gradwire::testing::AllCloseToSum;
using gradwire::testing::GemmParams;
using gradwire::testing::GemmSpec;
using gradwire::testing::Into;
using gradwire::testing::MakeBwdArgs;
using gradwire::testing::MakeFwdArgs;
using gradwire::testing::RandN;
using gradwire::testing::SavedAs;
using kernels::Fp8Format;

using gradwire::testing::kE4M3;
using gradwire::testing::kE5M2;

// Tolerances of TE's FP8 tests; on GEMM outputs rtol applies to the sum of |terms|
// (AllCloseToSum).
constexpr double kE4M3Rtol = 0.125, kE4M3Atol = 0.0675;
constexpr double kE5M2Rtol = 0.25, kE5M2Atol = 0.125;

at::Tensor Dq(const at::Tensor& x, const QuantizerConfig& q) {
  auto t = Quantize(x.contiguous(), q, {true, false});
  EXPECT_TRUE(t.ok());
  return Dequantize(*t, /*rowwise=*/true).to(at::kDouble);
}

// Tight bound for an fp32-accumulated product of the given (float64) operands.
::testing::AssertionResult CloseToProduct(const at::Tensor& actual, const at::Tensor& expected,
                                          const at::Tensor& magnitude, int64_t k) {
  const double eps = (double(k) / 8 + 4) * 0x1.0p-23;
  const at::Tensor excess = (actual.to(at::kDouble) - expected).abs() - (eps * magnitude + 1e-12);
  const double worst = excess.max().item<double>();
  if (worst <= 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "exceeds fp32-accumulation bound by " << worst;
}

// (M tokens, K in_features, N out_features, bias)
class LinearTest : public ::testing::TestWithParam<std::tuple<int64_t, int64_t, int64_t, bool>> {
 protected:
  void SetUp() override {
    std::tie(m_, k_, n_, has_bias_) = GetParam();
    x_ = RandN({m_, k_});
    w_ = RandN({n_, k_}, 1.0 / std::sqrt(double(k_)));
    if (has_bias_) b_ = RandN({n_});
    dy_ = RandN({m_, n_});
    spec_ = GemmSpec(ModuleKind::kLinear, w_, b_);
  }

  KindForwardResult Forward(bool training) {
    auto r = LinearForward(MakeFwdArgs(spec_, x_, GemmParams(w_, b_), training));
    EXPECT_TRUE(r.ok()) << r.status();
    return *std::move(r);
  }

  int64_t m_, k_, n_;
  bool has_bias_;
  at::Tensor x_, w_, b_, dy_;
  ModuleSpec spec_;
};

TEST_P(LinearTest, ForwardMatchesFloat64References) {
  for (bool training : {false, true}) {
    const KindForwardResult r = Forward(training);
    ASSERT_EQ(r.output.sizes(), (at::IntArrayRef{m_, n_}));
    const at::Tensor xq = Dq(x_, kE4M3), wq = Dq(w_, kE4M3);
    at::Tensor ref = at::matmul(xq, wq.t());
    at::Tensor magnitude = at::matmul(xq.abs(), wq.abs().t());
    if (has_bias_) {
      ref = ref + b_.to(at::kDouble);
      magnitude = magnitude + b_.to(at::kDouble).abs();
    }
    EXPECT_TRUE(CloseToProduct(r.output, ref, magnitude, k_));
    const at::Tensor xd = x_.to(at::kDouble), wd = w_.to(at::kDouble);
    at::Tensor exact = at::matmul(xd, wd.t());
    at::Tensor terms = at::matmul(xd.abs(), wd.abs().t());
    if (has_bias_) {
      exact = exact + b_.to(at::kDouble);
      terms = terms + b_.to(at::kDouble).abs();
    }
    EXPECT_TRUE(AllCloseToSum(r.output, exact, terms, kE4M3Rtol, kE4M3Atol));
  }
}

TEST_P(LinearTest, BackwardMatchesFloat64References) {
  const KindForwardResult fwd = Forward(/*training=*/true);
  ASSERT_TRUE(fwd.saved);
  at::Tensor weight_grad = RandN({n_, k_});  // accumulation target, not zero
  const at::Tensor weight_grad_before = weight_grad.clone();
  at::Tensor bias_grad;
  if (has_bias_) bias_grad = RandN({n_});
  const at::Tensor bias_grad_before = has_bias_ ? bias_grad.clone() : at::Tensor();

  DirectGradients grads = Into(weight_grad, bias_grad);
  auto r = LinearBackward(MakeBwdArgs(spec_, dy_, fwd.saved.get(), &grads));
  ASSERT_TRUE(r.ok()) << r.status();

  const at::Tensor xq = Dq(x_, kE4M3), wq = Dq(w_, kE4M3), dyq = Dq(dy_, kE5M2);
  // dgrad
  EXPECT_TRUE(
      CloseToProduct(r->grad_input, at::matmul(dyq, wq), at::matmul(dyq.abs(), wq.abs()), n_));
  const at::Tensor xd = x_.to(at::kDouble), wd = w_.to(at::kDouble), dyd = dy_.to(at::kDouble);
  EXPECT_TRUE(AllCloseToSum(r->grad_input, at::matmul(dyd, wd), at::matmul(dyd.abs(), wd.abs()),
                            kE5M2Rtol, kE5M2Atol));
  // wgrad, accumulated
  const at::Tensor dw = weight_grad.to(at::kDouble) - weight_grad_before.to(at::kDouble);
  EXPECT_TRUE(CloseToProduct(
      weight_grad, weight_grad_before.to(at::kDouble) + at::matmul(dyq.t(), xq),
      weight_grad_before.to(at::kDouble).abs() + at::matmul(dyq.abs().t(), xq.abs()), m_));
  EXPECT_TRUE(AllCloseToSum(dw, at::matmul(dyd.t(), xd), at::matmul(dyd.abs().t(), xd.abs()),
                            kE5M2Rtol, kE5M2Atol));
  // dbias from the unquantized gradient
  if (has_bias_) {
    const at::Tensor db = bias_grad.to(at::kDouble) - bias_grad_before.to(at::kDouble);
    EXPECT_TRUE(AllClose(db, dy_.to(at::kDouble).sum(0), 1e-5, 1e-5));
  }
}

TEST_P(LinearTest, TrainingSavesOnlyTheTransposedFp8Input) {
  const KindForwardResult inference = Forward(false);
  EXPECT_FALSE(inference.saved);
  EXPECT_FALSE(inference.workspace->weights[0].has_columnwise());
  const KindForwardResult training = Forward(true);
  ASSERT_TRUE(training.saved);
  const LinearSaved& saved = SavedAs<LinearSaved>(training);
  EXPECT_FALSE(saved.input.has_rowwise());
  ASSERT_TRUE(saved.input.has_columnwise());
  EXPECT_EQ(saved.input.columnwise.sizes(), (at::IntArrayRef{k_, m_}));
  EXPECT_EQ(saved.bytes(), m_ * k_);  // one byte per input element, nothing twice
  EXPECT_TRUE(training.workspace->weights[0].has_columnwise());
  // The context keeps the workspace's slim backward part: the same columnwise codes and nothing
  // else, so it pins one byte per weight.
  ASSERT_TRUE(training.workspace->for_backward);
  EXPECT_EQ(saved.workspace, training.workspace->for_backward);
  const Fp8Tensor& kept = saved.workspace->weights[0];
  EXPECT_FALSE(kept.has_rowwise());
  EXPECT_FALSE(kept.fprop_panels);
  EXPECT_FALSE(kept.dgrad_panels);
  EXPECT_TRUE(kept.columnwise.is_same(training.workspace->weights[0].columnwise));
  EXPECT_EQ(saved.shared_bytes(), n_ * k_);
  EXPECT_EQ(saved.shared_key(), saved.workspace.get());
}

TEST_P(LinearTest, SkippingGradInputStillAccumulatesWeightGradient) {
  const KindForwardResult fwd = Forward(true);
  at::Tensor weight_grad = at::zeros({n_, k_}, at::kFloat);
  DirectGradients grads = Into(weight_grad, at::Tensor());
  ModuleSpec no_bias_grad = spec_;  // the sink has no bias target
  no_bias_grad.bias = false;
  auto r = LinearBackward(MakeBwdArgs(no_bias_grad, dy_, fwd.saved.get(), &grads,
                                      /*compute_grad_input=*/false));
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->grad_input.defined());
  const at::Tensor xd = x_.to(at::kDouble), dyd = dy_.to(at::kDouble);
  EXPECT_TRUE(AllCloseToSum(weight_grad, at::matmul(dyd.t(), xd),
                            at::matmul(dyd.abs().t(), xd.abs()), kE5M2Rtol, kE5M2Atol));
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, LinearTest,
    ::testing::Values(std::make_tuple(1, 1, 1, true), std::make_tuple(1, 64, 3, false),
                      std::make_tuple(7, 13, 5, true), std::make_tuple(31, 17, 1, true),
                      std::make_tuple(3, 1, 29, false), std::make_tuple(64, 128, 96, true)),
    [](const auto& info) {
      return "M" + std::to_string(std::get<0>(info.param)) + "_K" +
             std::to_string(std::get<1>(info.param)) + "_N" +
             std::to_string(std::get<2>(info.param)) +
             (std::get<3>(info.param) ? "_bias" : "_nobias");
    });

TEST(WorkspaceTest, UsableOnlyForItsVersionAndTrainingNeedsColumnwise) {
  auto ws = std::make_shared<WeightWorkspace>();
  ws->weight_version = 3;
  ws->weights.resize(1);
  ws->weights[0].rows = ws->weights[0].cols = 2;
  ws->weights[0].rowwise = at::zeros({2, 2}, at::kByte);
  EXPECT_TRUE(WorkspaceUsable(ws, 3, /*training=*/false));
  EXPECT_FALSE(WorkspaceUsable(ws, 3, /*training=*/true));
  EXPECT_FALSE(WorkspaceUsable(ws, 4, false));
  EXPECT_FALSE(WorkspaceUsable(nullptr, 3, false));
  ws->weights[0].columnwise = at::zeros({2, 2}, at::kByte);
  EXPECT_TRUE(WorkspaceUsable(ws, 3, true));
  EXPECT_TRUE(WorkspaceUsable(ws, 3, false));
}

}  // namespace
}  // namespace gradwire::core
