// LayerNormMLP (LayerNorm, FC1, activation, FC2) against float64 autograd, forward and
// backward; selective recompute (checkpoint) and inference against training.
#include "server/core/kinds/layernorm_mlp.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <utility>

#include "test_util.h"

namespace gradwire::core {
namespace {

using gradwire::testing::Act64;
using gradwire::testing::AllClose;
using gradwire::testing::D;
using gradwire::testing::MakeBwdArgs;
using gradwire::testing::MakeFwdArgs;
using gradwire::testing::NormwiseClose;
using gradwire::testing::RandN;
using gradwire::testing::RandomLn;
using kernels::Activation;

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
    spec_.kind = ModuleKind::kLayerNormMlp;
    spec_.in_features = kK;
    spec_.out_features = kN;
    spec_.ffn_features = kF;
    spec_.bias = c.bias;
    spec_.activation = c.act;
    spec_.layernorm_eps = ln_.eps;
    checkpoint_spec_ = spec_;
    checkpoint_spec_.checkpoint = true;
  }

  KindForwardArgs FwdArgs(bool checkpoint) const {
    ParamTable p;
    p[Param::kLayerNormWeight] = ln_.gamma;
    p[Param::kLayerNormBias] = ln_.beta;
    p[Param::kFc1Weight] = w1_;
    p[Param::kFc1Bias] = b1_;
    p[Param::kFc2Weight] = w2_;
    p[Param::kFc2Bias] = b2_;
    return MakeFwdArgs(checkpoint ? checkpoint_spec_ : spec_, x_, std::move(p), /*training=*/true);
  }

  struct Grads {
    at::Tensor dx, dgamma, dbeta, dw1, db1, dw2, db2;
  };

  Grads Backward(const SavedTensors* saved) const {
    const bool bias = GetParam().bias;
    const int64_t f1 = w1_.size(0);
    Grads g;
    ParamTable t;
    g.dgamma = t[Param::kLayerNormWeight] = at::zeros({kK});
    g.dbeta = t[Param::kLayerNormBias] = at::zeros({kK});
    g.dw1 = t[Param::kFc1Weight] = at::zeros({f1, kK});
    g.dw2 = t[Param::kFc2Weight] = at::zeros({kN, kF});
    if (bias) {
      g.db1 = t[Param::kFc1Bias] = at::zeros({f1});
      g.db2 = t[Param::kFc2Bias] = at::zeros({kN});
    }
    DirectGradients grads(*MakeReferenceBackend(), t);
    auto r = LayerNormMlpBackward(MakeBwdArgs(spec_, dy_, saved, &grads));
    EXPECT_TRUE(r.ok()) << r.status();
    g.dx = r->grad_input;
    return g;
  }

  static constexpr int64_t kM = 24, kK = 32, kF = 48, kN = 16;
  LayerNormParams ln_;
  at::Tensor x_, w1_, w2_, b1_, b2_, dy_;
  ModuleSpec spec_, checkpoint_spec_;
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
  KindForwardArgs args = FwdArgs(false);
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
