// LayerNorm and activation kernels against float64 autograd, and the LayerNorm modules
// (LayerNormLinear, LayerNormMLP) against float64 references, forward and backward.
#include <gtest/gtest.h>

#include <tuple>

#include "gradwire/kernels/activation.h"
#include "gradwire/kernels/layernorm.h"
#include "server/core/layernorm_linear.h"
#include "server/core/layernorm_mlp.h"
#include "test_util.h"

namespace gradwire::core {
namespace {

using gradwire::testing::AllClose;
using gradwire::testing::AllCloseToSum;
using gradwire::testing::RandN;
using kernels::Activation;
using kernels::Fp8Format;

using gradwire::testing::kE4M3;
using gradwire::testing::kE5M2;

at::Tensor D(const at::Tensor& t) { return t.to(at::kDouble); }

// ||actual - expected|| / ||expected|| <= tol: for results that pass through several FP8 casts
// and a LayerNorm backward, where no per-element bound is tight.
::testing::AssertionResult NormwiseClose(const at::Tensor& actual, const at::Tensor& expected,
                                         double tol) {
  const double err = (D(actual) - D(expected)).norm().item<double>();
  const double ref = D(expected).norm().item<double>();
  if (err <= tol * ref + 1e-9) return ::testing::AssertionSuccess();  // floor: all-zero refs
  return ::testing::AssertionFailure() << "relative error " << err / ref << " > " << tol;
}

TEST(LayerNormKernelTest, MatchesFloat64Autograd) {
  for (bool zero_centered : {false, true}) {
    for (auto [m, k] : {std::pair<int64_t, int64_t>{1, 1}, {7, 13}, {33, 64}}) {
      const at::Tensor x = RandN({m, k}, 3.0) + 1.5, gamma = RandN({k}), beta = RandN({k});
      const at::Tensor dy = RandN({m, k});
      at::Tensor y = at::empty({m, k}), mu = at::empty({m}), rstd = at::empty({m});
      kernels::LayerNormForward(x.data_ptr<float>(), m, k, gamma.data_ptr<float>(),
                                beta.data_ptr<float>(), 1e-5f, zero_centered, y.data_ptr<float>(),
                                mu.data_ptr<float>(), rstd.data_ptr<float>());
      at::Tensor dx = at::full({m, k}, NAN), dgamma = RandN({k}), dbeta = RandN({k});
      const at::Tensor dgamma0 = dgamma.clone(), dbeta0 = dbeta.clone();
      kernels::LayerNormBackward(dy.data_ptr<float>(), x.data_ptr<float>(), mu.data_ptr<float>(),
                                 rstd.data_ptr<float>(), gamma.data_ptr<float>(), m, k,
                                 zero_centered, dx.data_ptr<float>(), dgamma.data_ptr<float>(),
                                 dbeta.data_ptr<float>());
      at::Tensor x64 = D(x).set_requires_grad(true), g64 = D(gamma).set_requires_grad(true),
                 b64 = D(beta).set_requires_grad(true);
      at::Tensor y64 = at::layer_norm(x64, {k}, zero_centered ? g64 + 1 : g64, b64, 1e-5);
      y64.backward(D(dy));
      EXPECT_TRUE(AllClose(y, y64, 1e-5, 1e-5));
      EXPECT_TRUE(AllClose(dx, x64.grad(), 1e-4, 1e-4));
      EXPECT_TRUE(AllClose(D(dgamma) - D(dgamma0), g64.grad(), 1e-4, 1e-4));
      EXPECT_TRUE(AllClose(D(dbeta) - D(dbeta0), b64.grad(), 1e-5, 1e-5));
    }
  }
}

at::Tensor Act64(Activation act, const at::Tensor& in, int64_t width) {
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

class ActivationKernelTest : public ::testing::TestWithParam<Activation> {};

TEST_P(ActivationKernelTest, ForwardAndBackwardMatchFloat64Autograd) {
  const Activation act = GetParam();
  const int64_t m = 9, w = 17, in_w = kernels::IsGated(act) ? 2 * w : w;
  const at::Tensor in = RandN({m, in_w}, 2.0), dout = RandN({m, w});
  at::Tensor out = at::full({m, w}, NAN), din = at::full({m, in_w}, NAN);
  kernels::ActivationForward(act, in.data_ptr<float>(), m, w, out.data_ptr<float>());
  kernels::ActivationBackward(act, dout.data_ptr<float>(), in.data_ptr<float>(), m, w,
                              din.data_ptr<float>());
  at::Tensor in64 = D(in).set_requires_grad(true);
  at::Tensor out64 = Act64(act, in64, w);
  out64.backward(D(dout));
  EXPECT_TRUE(AllClose(out, out64, 1e-5, 1e-6));
  EXPECT_TRUE(AllClose(din, in64.grad(), 1e-5, 1e-5));
}

INSTANTIATE_TEST_SUITE_P(All, ActivationKernelTest,
                         ::testing::Values(Activation::kGelu, Activation::kRelu,
                                           Activation::kSwiglu, Activation::kGeglu),
                         [](const auto& info) { return kernels::ActivationName(info.param); });

LayerNormParams RandomLn(int64_t k, bool zero_centered) {
  return LayerNormParams{RandN({k}, 0.3) + (zero_centered ? 0.0 : 1.0), RandN({k}, 0.3), 1e-5f,
                         zero_centered};
}

// (M, K, N, bias, checkpoint)
class LayerNormLinearTest
    : public ::testing::TestWithParam<std::tuple<int64_t, int64_t, int64_t, bool, bool>> {};

TEST_P(LayerNormLinearTest, ForwardAndBackwardMatchFloat64) {
  const auto [m, k, n, has_bias, checkpoint] = GetParam();
  const LayerNormParams ln = RandomLn(k, checkpoint);
  const at::Tensor x = RandN({m, k}, 2.0), w = RandN({n, k}, 1.0 / std::sqrt(double(k)));
  const at::Tensor b = has_bias ? RandN({n}) : at::Tensor(), dy = RandN({m, n});
  const at::Tensor d_ln_extra = RandN({m, k}, 0.5);

  LayerNormLinearFwdArgs fa;
  fa.input = x;
  fa.ln = ln;
  fa.weight = w;
  fa.bias = b;
  fa.weight_version = 1;
  fa.input_quantizer = kE4M3;
  fa.weight_quantizer = kE4M3;
  fa.training = true;
  fa.return_layernorm_output = true;
  fa.checkpoint = checkpoint;
  auto fwd = LayerNormLinearForward(fa);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  EXPECT_EQ(fwd->saved->ln_out.has_columnwise(), !checkpoint);

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

  LayerNormLinearBwdArgs ba;
  ba.grad_output = dy;
  ba.grad_layernorm_output = d_ln_extra;
  ba.saved = fwd->saved.get();
  ba.ln = ln;
  ba.grad_quantizer = kE5M2;
  ba.weight_grad = at::zeros({n, k});
  ba.bias_grad = has_bias ? at::zeros({n}) : at::Tensor();
  ba.gamma_grad = at::zeros({k});
  ba.beta_grad = at::zeros({k});
  auto bwd = LayerNormLinearBackward(ba);
  ASSERT_TRUE(bwd.ok()) << bwd.status();
  EXPECT_TRUE(AllCloseToSum(ba.weight_grad, w64u.grad(),
                            at::matmul(D(dy).abs().t(), ln64.detach().abs()), 0.25, 0.125));
  if (has_bias) {
    EXPECT_TRUE(AllClose(ba.bias_grad, b64.grad(), 1e-5, 1e-5));
  }
  EXPECT_TRUE(NormwiseClose(bwd->grad_input, x64.grad(), 0.25));
  EXPECT_TRUE(NormwiseClose(ba.gamma_grad, g64.grad(), 0.25));
  EXPECT_TRUE(NormwiseClose(ba.beta_grad, be64.grad(), 0.25));
}

INSTANTIATE_TEST_SUITE_P(Shapes, LayerNormLinearTest,
                         ::testing::Values(std::make_tuple(1, 1, 1, true, false),
                                           std::make_tuple(7, 13, 5, true, true),
                                           std::make_tuple(31, 64, 1, false, false),
                                           std::make_tuple(48, 96, 80, true, false),
                                           std::make_tuple(48, 96, 80, false, true)));

struct MlpCase {
  Activation act;
  bool bias;
  bool checkpoint;
};

class LayerNormMlpTest : public ::testing::TestWithParam<MlpCase> {
 protected:
  void SetUp() override {
    const MlpCase c = GetParam();
    const int64_t f1 = kernels::IsGated(c.act) ? 2 * kF : kF;
    ln_ = RandomLn(kK, false);
    x_ = RandN({kM, kK}, 2.0);
    w1_ = RandN({f1, kK}, 1.0 / std::sqrt(double(kK)));
    w2_ = RandN({kN, kF}, 1.0 / std::sqrt(double(kF)));
    if (c.bias) b1_ = RandN({f1}, 0.5), b2_ = RandN({kN}, 0.5);
    dy_ = RandN({kM, kN});
  }

  LayerNormMlpFwdArgs FwdArgs(bool checkpoint) const {
    LayerNormMlpFwdArgs a;
    a.input = x_;
    a.ln = ln_;
    a.fc1_weight = w1_;
    a.fc1_bias = b1_;
    a.fc2_weight = w2_;
    a.fc2_bias = b2_;
    a.activation = GetParam().act;
    a.weight_version = 1;
    a.fc1_input_quantizer = a.fc1_weight_quantizer = kE4M3;
    a.fc2_input_quantizer = a.fc2_weight_quantizer = kE4M3;
    a.training = true;
    a.checkpoint = checkpoint;
    return a;
  }

  struct Grads {
    at::Tensor dx, dgamma, dbeta, dw1, db1, dw2, db2;
  };

  Grads Backward(const LayerNormMlpSaved* saved) const {
    const bool bias = GetParam().bias;
    const int64_t f1 = w1_.size(0);
    LayerNormMlpBwdArgs b;
    b.grad_output = dy_;
    b.saved = saved;
    b.ln = ln_;
    b.activation = GetParam().act;
    b.fc1_grad_quantizer = b.fc2_grad_quantizer = kE5M2;
    Grads g;
    g.dgamma = b.gamma_grad = at::zeros({kK});
    g.dbeta = b.beta_grad = at::zeros({kK});
    g.dw1 = b.fc1_weight_grad = at::zeros({f1, kK});
    g.dw2 = b.fc2_weight_grad = at::zeros({kN, kF});
    if (bias) g.db1 = b.fc1_bias_grad = at::zeros({f1}), g.db2 = b.fc2_bias_grad = at::zeros({kN});
    auto r = LayerNormMlpBackward(b);
    EXPECT_TRUE(r.ok()) << r.status();
    g.dx = r->grad_input;
    return g;
  }

  static constexpr int64_t kM = 24, kK = 32, kF = 48, kN = 16;
  LayerNormParams ln_;
  at::Tensor x_, w1_, w2_, b1_, b2_, dy_;
};

TEST_P(LayerNormMlpTest, ForwardAndBackwardMatchFloat64Autograd) {
  const MlpCase c = GetParam();
  auto fwd = LayerNormMlpForward(FwdArgs(c.checkpoint));
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  const Grads g = Backward(fwd->saved.get());

  at::Tensor x64 = D(x_).set_requires_grad(true), g64 = D(ln_.gamma).set_requires_grad(true),
             be64 = D(ln_.beta).set_requires_grad(true), w1 = D(w1_).set_requires_grad(true),
             w2 = D(w2_).set_requires_grad(true);
  at::Tensor b1 = c.bias ? D(b1_).set_requires_grad(true) : at::Tensor();
  at::Tensor b2 = c.bias ? D(b2_).set_requires_grad(true) : at::Tensor();
  at::Tensor h = at::matmul(at::layer_norm(x64, {kK}, g64, be64, 1e-5), w1.t());
  if (c.bias) h = h + b1;
  at::Tensor y = at::matmul(Act64(c.act, h, kF), w2.t());
  if (c.bias) y = y + b2;
  y.backward(D(dy_));

  // ReLU's derivative jumps at 0: FP8 rounding of FC1's output flips a few entries of its mask,
  // each a whole-size error in every gradient upstream of it, so those get a wider bound.
  const double sums_tol = c.act == Activation::kRelu ? 0.45 : 0.25, tol = sums_tol;
  EXPECT_TRUE(NormwiseClose(fwd->output, y.detach(), 0.125));
  EXPECT_TRUE(NormwiseClose(g.dx, x64.grad(), tol));
  EXPECT_TRUE(NormwiseClose(g.dgamma, g64.grad(), tol));
  EXPECT_TRUE(NormwiseClose(g.dbeta, be64.grad(), sums_tol));
  EXPECT_TRUE(NormwiseClose(g.dw1, w1.grad(), tol));
  EXPECT_TRUE(NormwiseClose(g.dw2, w2.grad(), 0.25));
  if (c.bias) {
    EXPECT_TRUE(NormwiseClose(g.db1, b1.grad(), sums_tol));
    EXPECT_TRUE(AllClose(g.db2, b2.grad(), 1e-5, 1e-5));  // from the unquantized dy
  }
}

TEST_P(LayerNormMlpTest, CheckpointSavesLessAndGivesTheSameResults) {
  auto full = LayerNormMlpForward(FwdArgs(false));
  auto ckpt = LayerNormMlpForward(FwdArgs(true));
  ASSERT_TRUE(full.ok() && ckpt.ok());
  EXPECT_TRUE(at::equal(full->output, ckpt->output));
  EXPECT_LT(ckpt->saved->bytes(), full->saved->bytes());
  EXPECT_EQ(ckpt->saved->bytes(), (kM * kK + 2 * kM) * 4);  // input, mu, rstd: nothing else
  const Grads a = Backward(full->saved.get()), b = Backward(ckpt->saved.get());
  for (auto [p, q] : {std::pair{a.dx, b.dx},
                      {a.dgamma, b.dgamma},
                      {a.dbeta, b.dbeta},
                      {a.dw1, b.dw1},
                      {a.dw2, b.dw2}}) {
    EXPECT_TRUE(at::equal(p, q));  // the recompute replays the exact casts
  }
}

TEST_P(LayerNormMlpTest, InferenceSavesNothingAndMatchesTraining) {
  LayerNormMlpFwdArgs args = FwdArgs(false);
  auto train = LayerNormMlpForward(args);
  args.training = false;
  auto infer = LayerNormMlpForward(args);
  ASSERT_TRUE(train.ok() && infer.ok());
  EXPECT_FALSE(infer->saved);
  EXPECT_FALSE(infer->workspace->has_columnwise());
  EXPECT_TRUE(at::equal(train->output, infer->output));
}

INSTANTIATE_TEST_SUITE_P(Activations, LayerNormMlpTest,
                         ::testing::Values(MlpCase{Activation::kGelu, true, false},
                                           MlpCase{Activation::kGelu, false, true},
                                           MlpCase{Activation::kRelu, true, true},
                                           MlpCase{Activation::kRelu, false, false},
                                           MlpCase{Activation::kSwiglu, true, false},
                                           MlpCase{Activation::kSwiglu, false, true},
                                           MlpCase{Activation::kGeglu, true, true},
                                           MlpCase{Activation::kGeglu, false, false}),
                         [](const auto& info) {
                           return std::string(kernels::ActivationName(info.param.act)) +
                                  (info.param.bias ? "_bias" : "_nobias") +
                                  (info.param.checkpoint ? "_ckpt" : "");
                         });

}  // namespace
}  // namespace gradwire::core
