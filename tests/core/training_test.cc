// Training on the server: delayed scaling, optimizers, staleness, gradients for the client.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>

#include "server/core/host/optimizer.h"
#include "server/core/kinds/linear.h"
#include "server/core/module_host.h"
#include "server/core/tensor_calls.h"
#include "server/device/recipe.h"
#include "test_util.h"

namespace gradwire::core {
namespace {

using device::ScalingState;

using gradwire::testing::DelayedRecipe;
using gradwire::testing::MakeLinearSpec;
using gradwire::testing::MakeModuleSpec;
using gradwire::testing::RandN;
using kernels::Fp8Format;

TEST(ScalingStateTest, CastUsesTheScaleFromBeforeTheStepThenTheHistoryRolls) {
  ScalingState s(Fp8Format::kE4M3, DelayedRecipe(AmaxAlgo::kMax, 3));
  EXPECT_EQ(s.scale(), 1.0f);
  EXPECT_EQ(s.Quantizer().scale, 1.0f);  // the first step casts with scale 1
  s.Record(2.0f);
  s.Record(3.5f);                        // the step's amax is the largest of its casts
  EXPECT_EQ(s.Quantizer().scale, 1.0f);  // unchanged until the step ends
  s.Roll();
  EXPECT_FLOAT_EQ(s.scale(), 448.0f / 3.5f);
  EXPECT_EQ(s.history(), (std::deque<float>{3.5f}));
  s.Record(1.0f);
  s.Roll();  // max over the history keeps 3.5
  EXPECT_FLOAT_EQ(s.scale(), 448.0f / 3.5f);
  s.Record(0.5f);
  s.Roll();
  s.Record(0.25f);
  s.Roll();  // history length 3: 3.5 has dropped out
  EXPECT_EQ(s.history(), (std::deque<float>{0.25f, 0.5f, 1.0f}));
  EXPECT_FLOAT_EQ(s.scale(), 448.0f / 1.0f);
}

TEST(ScalingStateTest, MostRecentAlgoAndMarginOnAPerturbedHistory) {
  ScalingState s(Fp8Format::kE5M2, DelayedRecipe(AmaxAlgo::kMostRecent, 8, /*margin=*/2));
  s.Set({100.0f, 7.0f, 3.0f}, 0.125f);
  EXPECT_EQ(s.Quantizer().scale, 0.125f);
  EXPECT_EQ(s.Quantizer().format, Fp8Format::kE5M2);
  s.Record(4.0f);
  s.Roll();
  EXPECT_FLOAT_EQ(s.scale(), 57344.0f / 4.0f / 4.0f);  // most recent, 2^-margin
  EXPECT_EQ(s.history().front(), 4.0f);
  EXPECT_EQ(s.history().size(), 4u);

  ScalingState m(Fp8Format::kE5M2, DelayedRecipe(AmaxAlgo::kMax, 8, 2));
  m.Set({100.0f, 7.0f, 3.0f}, 0.125f);
  m.Record(4.0f);
  m.Roll();
  EXPECT_FLOAT_EQ(m.scale(), 57344.0f / 100.0f / 4.0f);
}

TEST(ScalingStateTest, ZeroOrNanAmaxKeepsTheScaleAndCurrentModeCastsOnItsOwn) {
  ScalingState s(Fp8Format::kE4M3, DelayedRecipe(AmaxAlgo::kMostRecent, 4));
  s.Set({}, 5.0f);
  s.Record(0.0f);
  s.Roll();
  EXPECT_EQ(s.scale(), 5.0f);
  s.Record(2.0f);
  s.Record(NAN);
  s.Record(1.0f);
  s.Roll();
  EXPECT_EQ(s.scale(), 5.0f);
  s.Roll();  // a step without a cast changes nothing
  EXPECT_EQ(s.history().size(), 2u);
  ScalingState c(Fp8Format::kE4M3, RecipeConfig{});
  EXPECT_EQ(c.Quantizer().scale, 0.0f);  // current scaling
}

// The seed of the Linear modules below.
constexpr uint64_t kSeed = 3;

TEST(DelayedScalingHostTest, EachContextKeepsTheScaleItWasCastWith) {
  ModuleSpec spec = MakeLinearSpec(16, 8, kSeed);
  spec.recipe = DelayedRecipe(AmaxAlgo::kMax, 16);
  ModuleHost host;
  const std::string id = host.Create(spec)->module_id;
  const at::Tensor x = RandN({4, 16}), dy = RandN({4, 8});
  auto a = TensorForward(host, id, x, true);
  ASSERT_TRUE(a.ok());
  auto scaling = host.Scaling(id);
  ASSERT_TRUE(scaling.ok());
  EXPECT_EQ((*scaling)[0].role, "input");
  EXPECT_FLOAT_EQ((*scaling)[0].scale, 448.0f / x.abs().max().item<float>());
  // Training forwards with 1000x larger inputs move the input scale far away (inference ones
  // would not: they leave the scaling state alone)...
  for (int i = 0; i < 3; ++i)
    ASSERT_TRUE(TensorForward(host, id, RandN({4, 16}, 1000.0), true).ok());
  EXPECT_LT(host.Scaling(id)->at(0).scale, (*scaling)[0].scale / 100);
  // ...yet the first context still holds the FP8 input cast with scale 1 (the first step's).
  auto saved = host.contexts().Peek(a->context_id).lock();
  ASSERT_TRUE(saved);
  EXPECT_EQ(dynamic_cast<const LinearSaved&>(*saved).input.scale_inv(), 1.0f);
  ASSERT_TRUE(TensorBackward(host, a->context_id, dy, false, false).ok());
  EXPECT_EQ(host.Scaling(id)->at(2).role, "grad_output");
  EXPECT_EQ(host.Scaling(id)->at(2).history.size(), 1u);
}

TEST(DelayedScalingHostTest, DelayedTrainingStepsStayAccurate) {
  ModuleSpec spec = MakeLinearSpec(32, 16, kSeed);
  spec.recipe = DelayedRecipe(AmaxAlgo::kMostRecent, 4);
  ModuleHost host;
  const std::string id = host.Create(spec)->module_id;
  at::Tensor out;
  const at::Tensor x = RandN({8, 32});
  for (int step = 0; step < 3; ++step) {  // after the first step the scales fit the data
    // Training forwards: only they record amaxes and roll the histories.
    auto f = TensorForward(host, id, x, true);
    ASSERT_TRUE(f.ok());
    out = f->output;
    ASSERT_TRUE(host.ReleaseContext(f->context_id).ok());
  }
  auto w = TensorWeights(host, id);
  at::Tensor exact = at::matmul(x.to(at::kDouble), w->tensors[0].second.to(at::kDouble).t()) +
                     w->tensors[1].second.to(at::kDouble);
  EXPECT_LT((out.to(at::kDouble) - exact).norm().item<double>(), 0.1 * exact.norm().item<double>());
}

// Float64 re-statements of the optimizers, written from their definitions.
void SgdRef(std::vector<double>& w, const std::vector<double>& g, std::vector<double>& buf,
            bool first, const SgdConfig& c) {
  for (size_t i = 0; i < w.size(); ++i) {
    double d = g[i] + c.weight_decay * w[i];
    if (c.momentum != 0) {
      buf[i] = first ? d : c.momentum * buf[i] + d;
      d = c.nesterov ? d + c.momentum * buf[i] : buf[i];
    }
    w[i] -= c.learning_rate * d;
  }
}

void AdamWRef(std::vector<double>& w, const std::vector<double>& g, std::vector<double>& m,
              std::vector<double>& v, int step, const AdamWConfig& c) {
  for (size_t i = 0; i < w.size(); ++i) {
    w[i] *= 1 - c.learning_rate * c.weight_decay;
    m[i] = c.beta1 * m[i] + (1 - c.beta1) * g[i];
    v[i] = c.beta2 * v[i] + (1 - c.beta2) * g[i] * g[i];
    const double mhat = m[i] / (1 - std::pow(c.beta1, step));
    const double vhat = v[i] / (1 - std::pow(c.beta2, step));
    w[i] -= c.learning_rate * mhat / (std::sqrt(vhat) + c.eps);
  }
}

std::vector<double> ToVec(const at::Tensor& t) {
  const at::Tensor d = t.to(at::kDouble).contiguous();
  return std::vector<double>(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
}

TEST(OptimizerTest, SgdVariantsMatchFloat64) {
  for (SgdConfig c : {SgdConfig{0.1f, 0.0f, 0.0f, false}, SgdConfig{0.05f, 0.9f, 0.01f, false},
                      SgdConfig{0.05f, 0.9f, 0.0f, true}}) {
    at::Tensor w = RandN({37});
    std::vector<double> ref = ToVec(w), buf(37, 0.0);
    OptimizerSlots slots;
    OptimizerConfig config;
    config.sgd = c;
    for (int step = 1; step <= 4; ++step) {
      const at::Tensor g = RandN({37});
      OptimizerStep(config, c.learning_rate, step, w, g, slots);
      SgdRef(ref, ToVec(g), buf, step == 1, c);
    }
    const std::vector<double> got = ToVec(w);
    for (size_t i = 0; i < ref.size(); ++i) ASSERT_NEAR(got[i], ref[i], 1e-5) << i;
  }
}

TEST(OptimizerTest, AdamWMatchesFloat64) {
  OptimizerConfig config;
  config.kind = OptimizerConfig::Kind::kAdamW;
  config.adamw = AdamWConfig{0.01f, 0.9f, 0.99f, 1e-8f, 0.1f};
  at::Tensor w = RandN({41});
  std::vector<double> ref = ToVec(w), m(41, 0.0), v(41, 0.0);
  OptimizerSlots slots;
  for (int step = 1; step <= 5; ++step) {
    const at::Tensor g = RandN({41});
    OptimizerStep(config, config.adamw.learning_rate, step, w, g, slots);
    AdamWRef(ref, ToVec(g), m, v, step, config.adamw);
  }
  const std::vector<double> got = ToVec(w);
  for (size_t i = 0; i < ref.size(); ++i) ASSERT_NEAR(got[i], ref[i], 1e-5) << i;
}

TEST(HostTrainingTest, AdamWModuleStepsAndCountsThem) {
  ModuleSpec spec = MakeLinearSpec(8, 4, kSeed);
  spec.optimizer.kind = OptimizerConfig::Kind::kAdamW;
  spec.optimizer.adamw.learning_rate = 0.01f;
  ModuleHost host;
  const std::string id = host.Create(spec)->module_id;
  const at::Tensor w0 = TensorWeights(host, id)->tensors[0].second;
  auto f = TensorForward(host, id, RandN({3, 8}), true);
  ASSERT_TRUE(TensorBackward(host, f->context_id, RandN({3, 4}), false, true).ok());
  ASSERT_EQ(*host.ApplyGradients(id), 2u);
  EXPECT_EQ(host.Info(id)->optimizer_steps, 1);
  // AdamW's first step moves every weight with a nonzero gradient by about lr.
  const at::Tensor moved = (TensorWeights(host, id)->tensors[0].second - w0).abs();
  EXPECT_NEAR(moved.mean().item<float>(), 0.01f, 0.002f);
}

TEST(HostTrainingTest, MaxStalenessRefusesOldContextsNamingBothVersions) {
  for (int64_t staleness : {1, 2}) {
    ModuleSpec spec = MakeLinearSpec(8, 4, kSeed);
    spec.max_staleness = staleness;
    ModuleHost host;
    const std::string id = host.Create(spec)->module_id;
    auto f = TensorForward(host, id, RandN({3, 8}), true);
    ASSERT_TRUE(host.ApplyGradients(id).ok());
    ASSERT_TRUE(host.ApplyGradients(id).ok());  // module at version 3, context from version 1
    auto b = TensorBackward(host, f->context_id, RandN({3, 4}), false, false);
    if (staleness == 1) {
      EXPECT_EQ(b.status().code(), absl::StatusCode::kFailedPrecondition);
      EXPECT_NE(b.status().message().find("weight version 1"), std::string::npos) << b.status();
      EXPECT_NE(b.status().message().find("at version 3"), std::string::npos) << b.status();
      EXPECT_EQ(host.Stats().live_contexts, 1);  // refused, not consumed
    } else {
      EXPECT_TRUE(b.ok()) << b.status();
    }
  }
}

TEST(HostTrainingTest, StaleContextComputesWithItsOwnVersionsParameters) {
  for (ModuleKind kind : {ModuleKind::kLayerNormLinear, ModuleKind::kLayerNormMlp}) {
    ModuleSpec spec = MakeModuleSpec(kind, 12, 6, /*ffn=*/10, kSeed);
    spec.checkpoint = kind == ModuleKind::kLayerNormMlp;  // the recompute too
    const at::Tensor x = RandN({4, 12}), dy = RandN({4, 6});
    // Host 1: context A, then another step changes every parameter, then A's backward.
    ModuleHost one;
    const std::string id1 = one.Create(spec)->module_id;
    auto a = TensorForward(one, id1, x, true);
    auto b = TensorForward(one, id1, RandN({4, 12}), true);
    ASSERT_TRUE(TensorBackward(one, b->context_id, RandN({4, 6}), false, false).ok());
    ASSERT_TRUE(one.ApplyGradients(id1, 0.5f).ok());
    auto stale = TensorBackward(one, a->context_id, dy, false, false);
    ASSERT_TRUE(stale.ok()) << stale.status();
    // Host 2: the same module and context A's backward right away.
    ModuleHost two;
    const std::string id2 = two.Create(spec)->module_id;
    auto a2 = TensorForward(two, id2, x, true);
    auto fresh = TensorBackward(two, a2->context_id, dy, false, false);
    ASSERT_TRUE(fresh.ok());
    EXPECT_TRUE(at::equal(*stale, *fresh)) << ModuleKindName(kind);
  }
}

TEST(HostTrainingTest, GetGradientsReturnsTheAccumulationAndCanZeroIt) {
  ModuleHost host;
  const std::string id = host.Create(MakeLinearSpec(8, 4, kSeed))->module_id;
  const at::Tensor x = RandN({3, 8}), dy = RandN({3, 4});
  for (int micro = 0; micro < 3; ++micro) {
    auto f = TensorForward(host, id, x, true);
    ASSERT_TRUE(TensorBackward(host, f->context_id, dy, false, true).ok());
  }
  auto g = TensorGradients(host, id, /*zero=*/false);
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g->accumulated_backwards, 3);
  EXPECT_EQ(g->tensors[1].first, "bias");
  EXPECT_TRUE(at::allclose(g->tensors[1].second, 3 * dy.sum(0), 1e-5, 1e-5));
  auto again = TensorGradients(host, id, /*zero=*/true);
  EXPECT_TRUE(at::equal(again->tensors[0].second, g->tensors[0].second));
  auto cleared = TensorGradients(host, id, false);
  EXPECT_EQ(cleared->accumulated_backwards, 0);
  EXPECT_EQ(cleared->tensors[0].second.abs().max().item<float>(), 0.0f);
  EXPECT_EQ(host.Info(id)->weight_version, 1u);  // reading gradients changes no weights
}

TEST(HostTrainingTest, LayerNormMlpQuantizesWeightsOncePerVersionAcrossMicrobatches) {
  ModuleSpec spec = MakeModuleSpec(ModuleKind::kLayerNormMlp, 16, 16, /*ffn=*/24);
  spec.activation = kernels::Activation::kSwiglu;
  ModuleHost host;
  auto info = host.Create(spec);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->parameter_names,
            (std::vector<std::string>{"layer_norm_weight", "layer_norm_bias", "fc1_weight",
                                      "fc1_bias", "fc2_weight", "fc2_bias"}));
  EXPECT_EQ(TensorWeights(host, info->module_id)->tensors[2].second.size(0), 48);  // gated: 2 x ffn
  for (int step = 0; step < 2; ++step) {
    for (int micro = 0; micro < 4; ++micro) {
      auto f = TensorForward(host, info->module_id, RandN({2, 5, 16}), true);
      ASSERT_TRUE(f.ok()) << f.status();
      auto b = TensorBackward(host, f->context_id, RandN({2, 5, 16}), false, false);
      ASSERT_TRUE(b.ok()) << b.status();
      EXPECT_EQ(b->sizes(), (at::IntArrayRef{2, 5, 16}));
    }
    ASSERT_TRUE(host.ApplyGradients(info->module_id).ok());
  }
  EXPECT_EQ(host.Stats().workspace_builds, 2);
  EXPECT_EQ(host.Stats().workspace_hits, 6);
  EXPECT_EQ(host.Stats().live_contexts, 0);
}

TEST(HostTrainingTest, ReturnedLayerNormOutputAndItsGradient) {
  ModuleSpec spec = MakeModuleSpec(ModuleKind::kLayerNormLinear, 12, 6);
  spec.return_layernorm_output = true;
  ModuleHost host;
  const std::string id = host.Create(spec)->module_id;
  const at::Tensor x = RandN({5, 12});
  auto f = TensorForward(host, id, x, true);
  ASSERT_TRUE(f.ok());
  ASSERT_TRUE(f->layernorm_output.defined());
  EXPECT_TRUE(at::allclose(f->layernorm_output, at::layer_norm(x, {12}), 1e-4, 1e-5));
  BackwardInput in;
  in.grad_output = RandN({5, 6});
  in.grad_layernorm_output = RandN({5, 11});
  auto bad = TensorBackward(host, f->context_id, in);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("grad_layernorm_output.shape must be [5, 12]"),
            std::string::npos);
  in.grad_layernorm_output = RandN({5, 12});
  EXPECT_TRUE(TensorBackward(host, f->context_id, in).ok());
}

}  // namespace
}  // namespace gradwire::core
