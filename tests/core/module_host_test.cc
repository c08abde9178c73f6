// Module host: the weight-workspace cache, the context store's lifetimes, SGD and weights.
#include "server/core/module_host.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>

#include "server/core/checkpoints/checkpoint.h"
#include "server/core/kinds/linear.h"
#include "server/core/tensor_calls.h"
#include "server/device/reference_backend.h"
#include "test_util.h"

namespace gradwire::core {
namespace {

using device::Quantize;
using device::ReferenceBackend;
using device::ScalingState;

using gradwire::testing::DelayedRecipe;
using gradwire::testing::MakeLinearSpec;
using gradwire::testing::MakeModuleSpec;
using gradwire::testing::RandN;

at::Tensor Get(const ParametersCopy& p, const std::string& name) {
  for (const auto& [n, t] : p.tensors) {
    if (n == name) return t;
  }
  ADD_FAILURE() << "no parameter " << name;
  return at::Tensor();
}

// Every accumulated gradient of module `a` on `ha` bit for bit that of module `b` on `hb`.
::testing::AssertionResult SameGradients(ModuleHost& ha, const std::string& a, ModuleHost& hb,
                                         const std::string& b) {
  auto ga = TensorGradients(ha, a, false);
  auto gb = TensorGradients(hb, b, false);
  if (!ga.ok() || !gb.ok()) return ::testing::AssertionFailure() << "GetGradients failed";
  if (ga->tensors.size() != gb->tensors.size()) {
    return ::testing::AssertionFailure() << "different parameter lists";
  }
  for (size_t i = 0; i < ga->tensors.size(); ++i) {
    if (!ga->tensors[i].second.equal(gb->tensors[i].second)) {
      return ::testing::AssertionFailure() << "the gradient of " << ga->tensors[i].first;
    }
  }
  return ::testing::AssertionSuccess();
}

class ModuleHostTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto info = host_.Create(MakeLinearSpec(24, 10, /*seed=*/42));
    ASSERT_TRUE(info.ok()) << info.status();
    id_ = info->module_id;
    EXPECT_EQ(info->weight_version, 1u);
  }

  ForwardOutput Fwd(bool training, int64_t rows = 5) {
    auto out = TensorForward(host_, id_, RandN({rows, 24}), training);
    EXPECT_TRUE(out.ok()) << out.status();
    return *std::move(out);
  }

  const WorkspacePtr& SavedWorkspace(const std::string& ctx) {
    auto saved = host_.contexts().Peek(ctx).lock();
    EXPECT_TRUE(saved);
    return dynamic_cast<const LinearSaved&>(*saved).workspace;
  }

  ModuleHost host_;
  std::string id_;
};

TEST_F(ModuleHostTest, WorkspaceHitOnSameVersion) {
  Fwd(false);
  Fwd(false);
  Fwd(false);
  EXPECT_EQ(host_.Stats().workspace_builds, 1);
  EXPECT_EQ(host_.Stats().workspace_hits, 2);
}

TEST_F(ModuleHostTest, WorkspaceMissAfterVersionBump) {
  Fwd(false);
  ASSERT_TRUE(host_.ApplyGradients(id_, 0.1f).ok());
  Fwd(false);
  EXPECT_EQ(host_.Stats().workspace_builds, 2);
  ASSERT_TRUE(
      SetTensorWeights(host_, id_, {{"weight", RandN({10, 24})}, {"bias", RandN({10})}}).ok());
  Fwd(false);
  EXPECT_EQ(host_.Stats().workspace_builds, 3);
  EXPECT_EQ(host_.Stats().workspace_hits, 0);
}

TEST_F(ModuleHostTest, InferenceWorkspaceIsAMissForTraining) {
  Fwd(false);  // builds rowwise only
  const ForwardOutput t = Fwd(true);
  EXPECT_EQ(host_.Stats().workspace_builds, 2);
  EXPECT_TRUE(SavedWorkspace(t.context_id)->has_columnwise());
  Fwd(false);  // the training workspace serves inference too
  EXPECT_EQ(host_.Stats().workspace_builds, 2);
  EXPECT_EQ(host_.Stats().workspace_hits, 1);
}

TEST_F(ModuleHostTest, MicrobatchesQuantizeTheWeightsOncePerVersion) {
  std::vector<std::string> contexts;
  for (int i = 0; i < 4; ++i) contexts.push_back(Fwd(true).context_id);
  for (const auto& ctx : contexts)
    ASSERT_TRUE(TensorBackward(host_, ctx, RandN({5, 10}), false, false).ok());
  EXPECT_EQ(host_.Stats().workspace_builds, 1);
  EXPECT_EQ(host_.Stats().workspace_hits, 3);
}

TEST_F(ModuleHostTest, ContextKeepsItsVersionsWorkspaceUntilBackward) {
  const ForwardOutput old_fwd = Fwd(true);
  std::weak_ptr<const WeightWorkspace> v1 = SavedWorkspace(old_fwd.context_id);
  ASSERT_TRUE(host_.ApplyGradients(id_, 0.5f).ok());
  const ForwardOutput new_fwd = Fwd(true);
  EXPECT_EQ(new_fwd.weight_version, 2u);
  ASSERT_FALSE(v1.expired());  // only the old context holds it now
  EXPECT_EQ(v1.lock()->weight_version, 1u);
  EXPECT_EQ(SavedWorkspace(new_fwd.context_id)->weight_version, 2u);
  ASSERT_TRUE(TensorBackward(host_, old_fwd.context_id, RandN({5, 10}), false, false).ok());
  EXPECT_TRUE(v1.expired());
}

TEST_F(ModuleHostTest, AnOldVersionKeepsOnlyWhatItsBackwardReads) {
  // Two contexts of version 1 with the same input; the first backward runs while version 1 is
  // cached, the second after version 2 replaced it.
  const at::Tensor x = RandN({5, 24});
  auto a = TensorForward(host_, id_, x, true);
  auto b = TensorForward(host_, id_, x, true);
  ASSERT_TRUE(a.ok() && b.ok());
  std::weak_ptr<const WeightWorkspace> v1 = SavedWorkspace(b->context_id);
  ASSERT_EQ(v1.lock()->dgrad_panels.size(), 1u);
  std::weak_ptr<const kernels::cpu::GemmPanels> panels = v1.lock()->dgrad_panels[0];
  EXPECT_FALSE(panels.expired());  // the cache still holds the full workspace
  EXPECT_EQ(host_.Stats().contexts.pinned_weights, 1);
  EXPECT_EQ(host_.Stats().contexts.weight_bytes, 10 * 24);  // one byte per weight
  const at::Tensor dy = RandN({5, 10});
  auto ga = TensorBackward(host_, a->context_id, dy, false, false);
  ASSERT_TRUE(ga.ok()) << ga.status();
  ASSERT_TRUE(host_.ApplyGradients(id_, 0.5f).ok());
  Fwd(false);  // version 2 replaces version 1 in the cache
  // Version 1's rowwise codes and packed panels are gone; the context keeps its columnwise codes.
  EXPECT_TRUE(panels.expired());
  ASSERT_FALSE(v1.expired());
  EXPECT_FALSE(v1.lock()->weights[0].has_rowwise());
  auto gb = TensorBackward(host_, b->context_id, dy, false, false);
  ASSERT_TRUE(gb.ok()) << gb.status();
  // Packing per call gives the same bits as the cached panels.
  EXPECT_TRUE(at::equal(*ga, *gb));
  EXPECT_TRUE(v1.expired());
  EXPECT_EQ(host_.Stats().contexts.pinned_weights, 0);
  EXPECT_EQ(host_.Stats().contexts.weight_bytes, 0);
}

TEST_F(ModuleHostTest, InferenceCreatesNoContext) {
  const ForwardOutput out = Fwd(false);
  EXPECT_TRUE(out.context_id.empty());
  EXPECT_EQ(host_.Stats().live_contexts, 0);
  EXPECT_EQ(host_.Stats().context_bytes, 0);
}

TEST_F(ModuleHostTest, BackwardReleasesSavedBytesBeforeReturning) {
  const ForwardOutput out = Fwd(true, /*rows=*/7);
  EXPECT_EQ(out.context_id.size(), 32u);  // 128 random bits in hex
  EXPECT_EQ(host_.Stats().live_contexts, 1);
  EXPECT_EQ(host_.Stats().context_bytes, 7 * 24);
  std::weak_ptr<SavedTensors> saved = host_.contexts().Peek(out.context_id);
  ASSERT_FALSE(saved.expired());
  auto grad = TensorBackward(host_, out.context_id, RandN({7, 10}), false, false);
  ASSERT_TRUE(grad.ok()) << grad.status();
  EXPECT_TRUE(saved.expired()) << "saved tensors outlived Backward";
  EXPECT_EQ(host_.Stats().live_contexts, 0);
  EXPECT_EQ(host_.Stats().context_bytes, 0);
}

TEST_F(ModuleHostTest, SecondBackwardIsFailedPrecondition) {
  const ForwardOutput out = Fwd(true);
  ASSERT_TRUE(TensorBackward(host_, out.context_id, RandN({5, 10}), false, false).ok());
  auto again = TensorBackward(host_, out.context_id, RandN({5, 10}), false, false);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(again.status().message().find("already consumed"), std::string::npos);
  EXPECT_EQ(TensorBackward(host_, "0123456789abcdef0123456789abcdef", RandN({5, 10}), false, false)
                .status()
                .code(),
            absl::StatusCode::kNotFound);
}

TEST_F(ModuleHostTest, RetainAllowsAnotherBackwardWithTheSameResult) {
  const ForwardOutput out = Fwd(true);
  const at::Tensor dy = RandN({5, 10});
  auto first = TensorBackward(host_, out.context_id, dy, /*retain=*/true, false);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(host_.Stats().live_contexts, 1);
  auto second = TensorBackward(host_, out.context_id, dy, /*retain=*/false, false);
  ASSERT_TRUE(second.ok());
  EXPECT_TRUE(at::equal(*first, *second));
  EXPECT_EQ(host_.Stats().live_contexts, 0);
  EXPECT_EQ(TensorBackward(host_, out.context_id, dy, false, false).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(ModuleHostTest, FailedBackwardLeavesTheContextAndGradientsAsTheyWere) {
  const ForwardOutput out = Fwd(true);
  auto bad = TensorBackward(host_, out.context_id, RandN({5, 11}), false, false);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("grad_output.shape must be [5, 10]"), std::string::npos)
      << bad.status();
  EXPECT_EQ(host_.Stats().live_contexts, 1);
  // Gradients untouched: an SGD step now leaves the weights as they are.
  const ParametersCopy before = *TensorWeights(host_, id_);
  ASSERT_TRUE(host_.ApplyGradients(id_, 1.0f).ok());
  EXPECT_TRUE(at::equal(Get(*TensorWeights(host_, id_), "weight"), Get(before, "weight")));
  EXPECT_TRUE(TensorBackward(host_, out.context_id, RandN({5, 10}), false, false).ok());
}

// The reference backend with a device that fails on demand: while `armed`, AbsMax of a 2-D
// tensor throws, as a device or library error would. In a LayerNormLinear backward the first
// such call is the check of grad_input (its bound is not provable), after the kind has run.
class AbsMaxFails final : public ReferenceBackend {
 public:
  float AbsMax(const at::Tensor& x) const override {
    if (armed && x.dim() == 2) throw std::runtime_error("the device went away");
    return ReferenceBackend::AbsMax(x);
  }
  mutable bool armed = false;
};

TEST(ModuleHostDeviceFailureTest, AThrowAfterTheKindRanKeepsTheContextAndChangesNothing) {
  const ModuleSpec spec = MakeModuleSpec(ModuleKind::kLayerNormLinear, 12, 7, 0, /*seed=*/3);
  auto backend = std::make_shared<AbsMaxFails>();
  ModuleHost host(ContextLimits{}, nullptr, backend);
  auto info = host.Create(spec);
  ASSERT_TRUE(info.ok()) << info.status();
  const at::Tensor x = RandN({4, 12}), dy = RandN({4, 7});
  auto out = TensorForward(host, info->module_id, x, true);
  ASSERT_TRUE(out.ok()) << out.status();
  backend->armed = true;
  absl::StatusOr<at::Tensor> failed = absl::UnknownError("not run");
  ASSERT_NO_THROW(failed = TensorBackward(host, out->context_id, dy, false, false));
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kInternal) << failed.status();
  EXPECT_NE(failed.status().message().find("the device went away"), std::string::npos);
  backend->armed = false;
  // The context is still there and not held: the same backward now runs, once, and leaves the
  // gradients a healthy device leaves (nothing of the failed one was accumulated).
  EXPECT_EQ(host.Stats().live_contexts, 1);
  auto again = TensorBackward(host, out->context_id, dy, false, false);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(host.Stats().live_contexts, 0);
  EXPECT_EQ(TensorBackward(host, out->context_id, dy, false, false).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ModuleHost healthy(ContextLimits{}, nullptr, MakeReferenceBackend());
  auto twin = healthy.Create(spec);
  ASSERT_TRUE(twin.ok());
  auto twin_out = TensorForward(healthy, twin->module_id, x, true);
  ASSERT_TRUE(twin_out.ok());
  auto twin_dx = TensorBackward(healthy, twin_out->context_id, dy, false, false);
  ASSERT_TRUE(twin_dx.ok());
  EXPECT_TRUE(again->equal(*twin_dx));
  EXPECT_TRUE(SameGradients(host, info->module_id, healthy, twin->module_id));
}

TEST_F(ModuleHostTest, ReleaseAndDeleteFreeContexts) {
  const ForwardOutput a = Fwd(true), b = Fwd(true), c = Fwd(true);
  EXPECT_EQ(host_.Stats().live_contexts, 3);
  EXPECT_TRUE(host_.ReleaseContext(a.context_id).ok());
  EXPECT_EQ(host_.Stats().live_contexts, 2);
  EXPECT_EQ(host_.ReleaseContext("nope").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(TensorBackward(host_, a.context_id, RandN({5, 10}), false, false).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(host_.Delete(id_).ok());
  EXPECT_EQ(host_.Stats().live_contexts, 0);
  EXPECT_EQ(host_.Stats().context_bytes, 0);
  EXPECT_EQ(TensorBackward(host_, b.context_id, RandN({5, 10}), false, false).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(ModuleHostTest, SgdAppliesAccumulatedGradientsAndZeroesThem) {
  const ParametersCopy w0 = *TensorWeights(host_, id_);
  const at::Tensor x = RandN({5, 24}), dy = RandN({5, 10});
  for (int micro = 0; micro < 2; ++micro) {
    auto out = TensorForward(host_, id_, x, true);
    ASSERT_TRUE(TensorBackward(host_, out->context_id, dy, false, true).ok());
  }
  auto version = host_.ApplyGradients(id_, 0.25f);
  ASSERT_TRUE(version.ok());
  EXPECT_EQ(*version, 2u);
  const ParametersCopy w1 = *TensorWeights(host_, id_);
  // Two identical microbatches: the bias moved by 2 * lr * sum(dy) exactly as fp32 computes it.
  const at::Tensor expected_bias = Get(w0, "bias") - 0.25f * (dy.sum(0) + dy.sum(0));
  EXPECT_TRUE(at::allclose(Get(w1, "bias"), expected_bias, 1e-5, 1e-6));
  const at::Tensor dw = (Get(w0, "weight") - Get(w1, "weight")) / 0.25;
  EXPECT_TRUE(gradwire::testing::AllCloseToSum(dw, 2 * at::matmul(dy.t(), x),
                                               2 * at::matmul(dy.abs().t(), x.abs()), 0.25, 0.125));
  // Gradients were zeroed: another step changes nothing.
  ASSERT_TRUE(host_.ApplyGradients(id_, 0.25f).ok());
  EXPECT_TRUE(at::equal(Get(*TensorWeights(host_, id_), "weight"), Get(w1, "weight")));
}

TEST_F(ModuleHostTest, SameSeedGivesSameWeights) {
  auto other = host_.Create(MakeLinearSpec(24, 10, /*seed=*/42));
  ASSERT_TRUE(other.ok());
  EXPECT_TRUE(at::equal(Get(*TensorWeights(host_, id_), "weight"),
                        Get(*TensorWeights(host_, other->module_id), "weight")));
  const float bound = 1.0f / std::sqrt(24.0f);
  EXPECT_LE(Get(*TensorWeights(host_, id_), "weight").abs().max().item<float>(), bound);
}

TEST_F(ModuleHostTest, BadRequestsChangeNothing) {
  EXPECT_EQ(host_.Create(MakeLinearSpec(0, 4)).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(TensorForward(host_, id_, RandN({5, 23}), true).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(TensorForward(host_, "missing", RandN({5, 24}), true).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(host_.ApplyGradients(id_, -1.0f).status().code(), absl::StatusCode::kInvalidArgument);
  at::Tensor nan_weight = RandN({10, 24});
  nan_weight[3][4] = NAN;
  const ParametersCopy before = *TensorWeights(host_, id_);
  auto set = SetTensorWeights(
      host_, id_, {{"weight", RandN({10, 24})}, {"bias", RandN({10})}, {"weight", nan_weight}});
  EXPECT_EQ(set.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(set.status().message().find("given twice"), std::string::npos) << set.status();
  set = SetTensorWeights(host_, id_, {{"bias", RandN({10})}, {"weight", nan_weight}});
  EXPECT_EQ(set.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(set.status().message().find("must be finite"), std::string::npos) << set.status();
  set = SetTensorWeights(host_, id_, {{"bias", RandN({10})}, {"fc1_weight", RandN({10, 24})}});
  EXPECT_EQ(set.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(set.status().message().find("not a parameter"), std::string::npos) << set.status();
  set = SetTensorWeights(host_, id_, {{"bias", RandN({11})}});
  EXPECT_NE(set.status().message().find("shape must be [10]"), std::string::npos) << set.status();
  const ParametersCopy after = *TensorWeights(host_, id_);
  EXPECT_TRUE(at::equal(Get(before, "weight"), Get(after, "weight")) &&
              at::equal(Get(before, "bias"), Get(after, "bias")));
  EXPECT_EQ(after.weight_version, 1u);
  EXPECT_EQ(host_.Stats().modules, 1);
  EXPECT_EQ(host_.Stats().live_contexts, 0);
}

}  // namespace
}  // namespace gradwire::core

namespace gradwire::core {
namespace {

// A non-finite activation or gradient is refused before it reaches the amax history or the
// gradient buffers, where it would stay.
// Inference changes no module state: evaluation traffic between training steps must not move
// the delayed-scaling histories (nor their scales) that the training casts use.
TEST(ModuleHostScalingTest, InferenceLeavesTheScalingStateUntouched) {
  for (ModuleKind kind : {ModuleKind::kLinear, ModuleKind::kLayerNormMlp}) {
    ModuleHost host;
    ModuleSpec spec = MakeModuleSpec(kind, 16, 8, /*ffn=*/32);
    spec.recipe = DelayedRecipe(AmaxAlgo::kMax, 8);
    auto info = host.Create(spec);
    ASSERT_TRUE(info.ok()) << info.status();
    // One training step first, so the histories hold something.
    auto train = TensorForward(host, info->module_id, RandN({4, 16}), true);
    ASSERT_TRUE(train.ok());
    ASSERT_TRUE(TensorBackward(host, train->context_id, RandN({4, 8}), false, false).ok());
    auto before = host.Scaling(info->module_id);
    ASSERT_TRUE(before.ok());
    for (int i = 0; i < 3; ++i) {
      ASSERT_TRUE(TensorForward(host, info->module_id, RandN({4, 16}, 10.0), false).ok());
    }
    auto after = host.Scaling(info->module_id);
    ASSERT_TRUE(after.ok());
    ASSERT_EQ(before->size(), after->size());
    for (size_t r = 0; r < before->size(); ++r) {
      EXPECT_EQ((*after)[r].scale, (*before)[r].scale) << (*before)[r].role;
      EXPECT_EQ((*after)[r].history, (*before)[r].history) << (*before)[r].role;
    }
    // A training forward does move them.
    ASSERT_TRUE(TensorForward(host, info->module_id, RandN({4, 16}, 10.0), true).ok());
    auto trained = host.Scaling(info->module_id);
    ASSERT_TRUE(trained.ok());
    EXPECT_NE((*trained)[0].history, (*before)[0].history);
  }
}

// Under delayed scaling the weight is still cast with a scale from its own amax (once per weight
// version): small weights keep their precision instead of being cast at the initial scale 1.0,
// where E4M3 has only subnormals (and zero) for values near 0.001.
TEST(ModuleHostScalingTest, DelayedScalingCastsTheWeightFromItsOwnAmax) {
  ModuleHost host;
  ModuleSpec spec = MakeLinearSpec(256, 64);
  spec.bias = false;
  spec.recipe.mode = ScalingMode::kDelayed;
  auto info = host.Create(spec);
  ASSERT_TRUE(info.ok());
  const at::Tensor w = RandN({64, 256}, 0.001);
  ASSERT_TRUE(SetTensorWeights(host, info->module_id, {{"weight", w}}).ok());
  const at::Tensor x = RandN({32, 256});
  auto out = TensorForward(host, info->module_id, x, false);
  ASSERT_TRUE(out.ok());
  const at::Tensor want = x.to(at::kDouble).mm(w.to(at::kDouble).t());
  const double rel_rms = (out->output.to(at::kDouble) - want).pow(2).mean().sqrt().item<double>() /
                         want.pow(2).mean().sqrt().item<double>();
  // E4M3 with a fitted scale on both operands: about 0.04 (a weight cast at scale 1.0: 0.5+).
  EXPECT_LT(rel_rms, 0.08);
}

// Under delayed scaling a training forward casts its input with the scale the module's scaling
// state (on the backend's device, DeviceScaling) holds after the steps before it, and its step
// rolls that state as ScalingState does. On the reference backend the output is then bit for bit
// the reference GEMM of the input cast at ScalingState's scale and the weight cast from its own
// amax; amaxes that grow and shrink move the scale both ways.
TEST(ModuleHostScalingTest, DelayedCastsReadTheScaleTheStateHolds) {
  const BackendPtr ref = MakeReferenceBackend();
  ModuleHost host(ContextLimits{}, nullptr, ref);
  ModuleSpec spec = MakeLinearSpec(48, 24, 5);
  spec.recipe = DelayedRecipe(AmaxAlgo::kMax, 3);
  auto info = host.Create(spec);
  ASSERT_TRUE(info.ok()) << info.status();
  const std::string id = info->module_id;
  auto weights = TensorWeights(host, id);
  ASSERT_TRUE(weights.ok());
  at::Tensor w, bias;
  for (const auto& [name, t] : weights->tensors) (name == "weight" ? w : bias) = t;
  QuantizerConfig weight_config;  // current scaling, from the weight's own amax
  auto wq = Quantize(w, weight_config, {true, false});
  ASSERT_TRUE(wq.ok());
  ScalingState want(kernels::Fp8Format::kE4M3, spec.recipe);
  int step = 0;
  for (double size : {1.0, 16.0, 0.25, 3.0, 0.5, 0.5, 0.01}) {
    SCOPED_TRACE("step " + std::to_string(step++));
    const at::Tensor x = RandN({5, 48}, size);
    QuantizerConfig input_config;
    input_config.scale = want.scale();
    auto xq = Quantize(x, input_config, {true, false});
    ASSERT_TRUE(xq.ok());
    const at::Tensor y = ref->Fprop(*xq, *wq, bias);
    auto out = TensorForward(host, id, x, /*training=*/true);
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_TRUE(out->output.equal(y));
    ASSERT_TRUE(host.ReleaseContext(out->context_id).ok());
    want.Record(xq->amax());
    want.Roll();
    const RoleScaling input = (*host.Scaling(id))[kInputRole];
    EXPECT_EQ(input.scale, want.scale());
    EXPECT_EQ(input.history, want.history());
  }
}

// A Linear in -> out under delayed scaling (max of `history_len`) that has run one forward of
// 4 rows; its id.
std::string DelayedLinearAfterAForward(ModuleHost& host, int64_t in, int64_t out,
                                       int64_t history_len) {
  ModuleSpec spec = MakeLinearSpec(in, out);
  spec.recipe = DelayedRecipe(AmaxAlgo::kMax, history_len);
  auto info = host.Create(spec);
  EXPECT_TRUE(info.ok()) << info.status();
  if (!info.ok()) return "";
  EXPECT_TRUE(TensorForward(host, info->module_id, RandN({4, in}), false).ok());
  return info->module_id;
}

TEST(ModuleHostNonFiniteTest, ForwardAndBackwardRefuseNaNAndInfAndChangeNothing) {
  ModuleHost host;
  const std::string id = DelayedLinearAfterAForward(host, 12, 6, 3);  // some history to keep
  ASSERT_FALSE(id.empty());
  for (float bad : {NAN, INFINITY, -INFINITY}) {
    const auto scaling = *host.Scaling(id);
    at::Tensor x = RandN({4, 12});
    x[2][5] = bad;
    auto fwd = TensorForward(host, id, x, true);
    ASSERT_EQ(fwd.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(fwd.status().message().find("input must be finite; element 29"), std::string::npos)
        << fwd.status();
    EXPECT_EQ(host.Stats().live_contexts, 0);
    const auto after = *host.Scaling(id);
    ASSERT_EQ(after.size(), scaling.size());
    for (size_t i = 0; i < after.size(); ++i) {
      EXPECT_EQ(after[i].scale, scaling[i].scale) << after[i].role;
      EXPECT_EQ(after[i].history, scaling[i].history) << after[i].role;
    }

    auto ok = TensorForward(host, id, RandN({4, 12}), true);
    ASSERT_TRUE(ok.ok()) << ok.status();
    at::Tensor dy = RandN({4, 6});
    dy[1][1] = bad;
    auto back = TensorBackward(host, ok->context_id, dy, false, false);
    ASSERT_EQ(back.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(back.status().message().find("grad_output must be finite"), std::string::npos);
    auto grads = TensorGradients(host, id, false);
    EXPECT_EQ(grads->accumulated_backwards, 0);
    for (const auto& [name, g] : grads->tensors) EXPECT_EQ(g.abs().sum().item<float>(), 0.0f);
    // The context survives the refused backward and takes a good one.
    auto good = TensorBackward(host, ok->context_id, RandN({4, 6}), false, false);
    ASSERT_TRUE(good.ok()) << good.status();
    EXPECT_TRUE(at::isfinite(*good).all().item<bool>());
    ASSERT_TRUE(TensorGradients(host, id, /*zero=*/true).ok());
  }
}

// A spec read back from a checkpoint carries its enums as integers: out-of-range values are
// refused like any other bad spec (they would index past the tables that name them).
TEST(ModuleHostImportTest, RefusesOutOfRangeEnumsInAState) {
  ModuleHost host;
  auto info = host.Create(MakeLinearSpec(8, 4));
  ASSERT_TRUE(info.ok()) << info.status();
  const ModuleState good = *host.ExportState(info->module_id);
  struct Case {
    const char* field;
    std::function<void(ModuleSpec*)> edit;
  };
  const Case cases[] = {
      {"spec.kind", [](ModuleSpec* s) { s->kind = ModuleKind(3); }},
      {"spec.kind", [](ModuleSpec* s) { s->kind = ModuleKind(-1); }},
      {"spec.activation", [](ModuleSpec* s) { s->activation = kernels::Activation(7); }},
      {"spec.recipe.scaling", [](ModuleSpec* s) { s->recipe.mode = ScalingMode(4); }},
      {"spec.recipe.amax_compute_algo", [](ModuleSpec* s) { s->recipe.algo = AmaxAlgo(9); }},
      {"spec.optimizer.kind", [](ModuleSpec* s) { s->optimizer.kind = OptimizerConfig::Kind(5); }},
  };
  for (const Case& c : cases) {
    ModuleState state = good;
    state.module_id = "restored";
    c.edit(&state.spec);
    const absl::Status s = host.ImportState(state);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_NE(s.message().find(c.field), std::string::npos) << s;
    EXPECT_FALSE(host.Info("restored").ok());
  }
}

// A saved scale the casts could not use (0, negative, inf, NaN) is refused: under delayed
// scaling the casts read it as it is. A good one, restored, is what the module reports.
TEST(ModuleHostImportTest, RefusesAScalingStateWhoseScaleIsNotFiniteAndPositive) {
  ModuleHost host;
  const std::string id = DelayedLinearAfterAForward(host, 8, 4, 4);
  ASSERT_FALSE(id.empty());
  ModuleState good = *host.ExportState(id);
  ASSERT_FALSE(good.scaling.empty());
  good.module_id = "restored";
  good.scaling[0].scale = 2.5f;
  good.scaling[0].history = {3.0f, 1.0f};
  for (float bad : {0.0f, -1.0f, INFINITY, NAN}) {
    ModuleState state = good;
    state.scaling[0].scale = bad;
    const absl::Status s = host.ImportState(state);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("scaling state of role input"), std::string::npos) << s;
    EXPECT_FALSE(host.Info("restored").ok());
  }
  ASSERT_TRUE(host.ImportState(good).ok());
  const RoleScaling input = (*host.Scaling("restored"))[0];
  EXPECT_EQ(input.scale, 2.5f);
  EXPECT_EQ(input.history, (std::deque<float>{3.0f, 1.0f}));
}

TEST(ModuleHostTenantTest, OwnershipCoversModulesContextsAndCheckpoints) {
  ModuleHost host;
  const ModuleSpec spec = MakeLinearSpec(8, 4);
  auto mine = host.Create(spec, "alice");
  auto theirs = host.Create(spec, "bob");
  ASSERT_TRUE(mine.ok() && theirs.ok());
  EXPECT_TRUE(host.CheckTenant(mine->module_id, "alice").ok());
  const absl::Status foreign = host.CheckTenant(mine->module_id, "bob");
  EXPECT_EQ(foreign.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(host.CheckTenant("nope", "bob").code(), absl::StatusCode::kNotFound);
  const std::string alice = "alice";
  ASSERT_EQ(host.List(&alice).size(), 1u);
  EXPECT_EQ(host.List(&alice)[0].module_id, mine->module_id);
  EXPECT_EQ(host.List().size(), 2u);

  auto fwd = TensorForward(host, mine->module_id, gradwire::testing::RandN({3, 8}), true);
  ASSERT_TRUE(fwd.ok());
  EXPECT_TRUE(host.CheckContextTenant(fwd->context_id, "alice").ok());
  EXPECT_EQ(host.CheckContextTenant(fwd->context_id, "bob").code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(
      TensorBackward(host, fwd->context_id, gradwire::testing::RandN({3, 4}), false, false).ok());
  // Consumed: still alice's (she gets FAILED_PRECONDITION on a second backward), not bob's.
  EXPECT_TRUE(host.CheckContextTenant(fwd->context_id, "alice").ok());
  EXPECT_EQ(host.CheckContextTenant(fwd->context_id, "bob").code(), absl::StatusCode::kNotFound);

  // The owner survives a checkpoint and restore.
  const std::string dir = ::testing::TempDir() + "/tenant-checkpoints-" + mine->module_id;
  Checkpointer checkpointer(dir, 0);
  ASSERT_TRUE(checkpointer.Prepare().ok());
  ASSERT_TRUE(checkpointer.claims().ClaimNew(mine->module_id).ok());
  ASSERT_TRUE(checkpointer.Save(host, mine->module_id).ok());
  ModuleHost restored;
  ASSERT_EQ(*checkpointer.RestoreAll(restored), 1);
  EXPECT_EQ(restored.Info(mine->module_id)->tenant, "alice");
  EXPECT_EQ(restored.CheckTenant(mine->module_id, "bob").code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(checkpointer.Remove(mine->module_id).ok());
}

// Leases (--module-ttl) on a clock the test moves: a module created at 0 and named at 0.6 s is
// still there at 1.2 s under a TTL of 1 s only when that call renewed it. Lookups, refused calls,
// a checkpoint's export and a failed take-over renew nothing; every call that succeeds does.
TEST(ModuleHostLeaseTest, OnlyCallsThatSucceedRenewAModule) {
  using std::chrono::steady_clock;
  auto now = std::make_shared<steady_clock::time_point>(steady_clock::now());
  ModuleHost host(ContextLimits{}, [now] { return *now; });
  const auto advance = [&](double s) {
    *now += std::chrono::duration_cast<steady_clock::duration>(std::chrono::duration<double>(s));
  };
  const std::string dir = ::testing::TempDir() + "/lease-checkpoints-" + RandomId128();
  Checkpointer checkpointer(dir, 0);
  ASSERT_TRUE(checkpointer.Prepare().ok());
  // Whether `call` (on a module of alice's created, and given a training forward's context, at
  // 0) renewed the module at 0.6 s.
  const auto renews =
      [&](const std::function<void(const std::string& id, const std::string& context)>& call) {
        auto info = host.Create(MakeLinearSpec(8, 4), "alice");
        EXPECT_TRUE(info.ok()) << info.status();
        const std::string id = info->module_id;
        auto fwd = TensorForward(host, id, RandN({3, 8}), true);
        EXPECT_TRUE(fwd.ok()) << fwd.status();
        advance(0.6);
        call(id, fwd->context_id);
        advance(0.6);
        const std::vector<std::string> expired = host.ExpireIdleModules(1.0);
        const bool renewed = std::find(expired.begin(), expired.end(), id) == expired.end();
        if (renewed) EXPECT_TRUE(host.Delete(id).ok());
        EXPECT_FALSE(host.Has(id));
        return renewed;
      };
  // Lookups, whoever makes them.
  EXPECT_FALSE(renews([&](const std::string& id, const std::string&) {
    EXPECT_TRUE(host.Info(id).ok());
    EXPECT_TRUE(host.Spec(id).ok());
    EXPECT_TRUE(host.Has(id));
    EXPECT_TRUE(host.CheckTenant(id, "alice").ok());
    EXPECT_EQ(host.CheckTenant(id, "bob").code(), absl::StatusCode::kNotFound);
    EXPECT_TRUE(host.Scaling(id).ok());
    EXPECT_EQ(host.List().size(), 1u);
  }));
  // Refused calls.
  EXPECT_FALSE(renews([&](const std::string& id, const std::string& context) {
    EXPECT_EQ(TensorForward(host, id, RandN({3, 7}), true).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(TensorBackward(host, context, RandN({3, 5}), false, false).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(SetTensorWeights(host, id, {{"nope", RandN({4, 8})}}).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(host.ApplyGradients(id, -1.0f).status().code(), absl::StatusCode::kInvalidArgument);
  }));
  // A checkpoint's export, and a take-over refused because the module is here.
  EXPECT_FALSE(renews([&](const std::string& id, const std::string&) {
    ASSERT_TRUE(checkpointer.claims().ClaimNew(id).ok());
    ASSERT_TRUE(checkpointer.Save(host, id).ok());
    EXPECT_EQ(checkpointer.Take(host, id).status().code(), absl::StatusCode::kAlreadyExists);
  }));
  // Calls that succeed, each alone.
  const std::vector<std::function<void(const std::string&, const std::string&)>> succeeding = {
      [&](const std::string& id, const std::string&) {
        EXPECT_TRUE(TensorForward(host, id, RandN({2, 8}), false).ok());
      },
      [&](const std::string&, const std::string& context) {
        EXPECT_TRUE(TensorBackward(host, context, RandN({3, 4}), false, false).ok());
      },
      [&](const std::string& id, const std::string&) { EXPECT_TRUE(host.ApplyGradients(id).ok()); },
      [&](const std::string& id, const std::string&) {
        EXPECT_TRUE(TensorGradients(host, id, false).ok());
      },
      [&](const std::string& id, const std::string&) { EXPECT_TRUE(TensorWeights(host, id).ok()); },
      [&](const std::string& id, const std::string&) {
        EXPECT_TRUE(SetTensorWeights(host, id, {{"weight", RandN({4, 8})}}).ok());
      },
      [&](const std::string& id, const std::string&) { EXPECT_TRUE(host.Touch(id).ok()); },
  };
  for (size_t i = 0; i < succeeding.size(); ++i) EXPECT_TRUE(renews(succeeding[i])) << i;
  // A module that calls are queued for stays past its lease, and goes once they are done.
  auto info = host.Create(MakeLinearSpec(8, 4), "alice");
  ASSERT_TRUE(info.ok());
  advance(1.2);
  EXPECT_TRUE(host.ExpireIdleModules(1.0, [](const std::string&) { return true; }).empty());
  EXPECT_EQ(host.ExpireIdleModules(1.0), std::vector<std::string>{info->module_id});
  std::filesystem::remove_all(dir);
}

// A module dropped as moved (another server holds it now) is told moved to its owner's calls that
// look it up later, and is unknown to everyone else; a module of the id arriving again is served.
TEST(ModuleHostTenantTest, AModuleDroppedAsMovedIsToldMovedToItsOwnerOnly) {
  ModuleHost host;
  auto info = host.Create(MakeLinearSpec(8, 4), "alice");
  ASSERT_TRUE(info.ok());
  const std::string id = info->module_id;
  auto state = host.ExportState(id);
  ASSERT_TRUE(state.ok());
  ASSERT_TRUE(host.Delete(id, /*moved=*/true).ok());
  EXPECT_FALSE(host.Has(id));
  EXPECT_TRUE(IsModuleMoved(host.Spec(id).status())) << host.Spec(id).status();
  EXPECT_TRUE(IsModuleMoved(host.CheckTenant(id, "alice"))) << host.CheckTenant(id, "alice");
  EXPECT_TRUE(Checkpointer::IsMoved(TensorForward(host, id, RandN({2, 8}), false).status()));
  const absl::Status foreign = host.CheckTenant(id, "bob");
  EXPECT_EQ(foreign.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(foreign.message(), "module_id " + id + " is not a module");  // as for any unknown id
  EXPECT_EQ(host.Delete(id, true).code(), absl::StatusCode::kNotFound);
  // Back (taken over again): served, and once deleted plainly, unknown.
  ASSERT_TRUE(host.ImportState(*state).ok());
  EXPECT_TRUE(TensorForward(host, id, RandN({2, 8}), false).ok());
  ASSERT_TRUE(host.Delete(id).ok());
  EXPECT_EQ(host.Spec(id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(host.CheckTenant(id, "alice").code(), absl::StatusCode::kNotFound);
}

// The kind registry: one kind object per ModuleKind, each with its parameters, roles and checks;
// the host reaches parameters through typed handles and names them only at the boundary.
TEST(ModuleKindRegistryTest, EveryKindIsRegisteredWithItsParametersAndRoles) {
  ASSERT_EQ(Kinds().size(), 3u);
  for (const ModuleKindOps* kind : Kinds()) {
    EXPECT_EQ(FindKind(kind->kind()), kind);
    EXPECT_STREQ(ModuleKindName(kind->kind()), kind->name());
  }
  EXPECT_EQ(FindKind(static_cast<ModuleKind>(7)), nullptr);
  EXPECT_STREQ(ModuleKindName(static_cast<ModuleKind>(7)), "unknown");

  ModuleSpec s = MakeModuleSpec(ModuleKind::kLayerNormMlp, 6, 4, /*ffn=*/5);
  s.activation = Activation::kSwiglu;
  const std::vector<ParamDef> defs = LayerNormMlpKind().Params(s);
  std::vector<std::string> names;
  for (const ParamDef& d : defs) names.push_back(ParamName(d.param));
  EXPECT_EQ(names, (std::vector<std::string>{"layer_norm_weight", "layer_norm_bias", "fc1_weight",
                                             "fc1_bias", "fc2_weight", "fc2_bias"}));
  EXPECT_EQ(defs[2].shape, (std::vector<int64_t>{10, 6}));  // gated: FC1 makes 2 x ffn
  EXPECT_EQ(defs[4].shape, (std::vector<int64_t>{4, 5}));
  EXPECT_EQ(ParameterCount(s), 6 + 6 + 60 + 10 + 20 + 4);
  const auto widths = LayerNormMlpKind().BuiltWidths(s);
  ASSERT_EQ(widths.size(), 2u);
  EXPECT_EQ(widths[1].second, 10);
  int weights = 0;
  for (const RoleDef& r : LayerNormMlpKind().Roles()) weights += r.weight ? 1 : 0;
  EXPECT_EQ(weights, 2);
  EXPECT_EQ(LinearKind().Roles().size(), 3u);
  EXPECT_TRUE(LinearKind().UsesFp8Input());
  EXPECT_FALSE(LayerNormLinearKind().UsesFp8Input());

  // Each kind refuses, by field, what is not its own.
  ModuleSpec linear = MakeLinearSpec(4, 4);
  linear.ffn_features = 3;
  auto bad = ValidateModuleSpec(linear);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("spec.ffn_features"), absl::string_view::npos) << bad;
  s.ffn_features = 0;
  bad = ValidateModuleSpec(s);
  EXPECT_NE(bad.message().find("spec.ffn_features"), absl::string_view::npos) << bad;
  ModuleSpec ln = linear;
  ln.kind = ModuleKind::kLayerNormLinear;
  ln.ffn_features = 0;
  ln.checkpoint = true;
  EXPECT_TRUE(ValidateModuleSpec(ln).ok());
  linear.ffn_features = 0;
  linear.checkpoint = true;
  EXPECT_NE(ValidateModuleSpec(linear).message().find("LayerNorm modules"),
            absl::string_view::npos);
}

TEST(ModuleKindRegistryTest, ParamTableIsIndexedByHandle) {
  ParamTable t;
  t[Param::kFc2Bias] = at::ones({3});
  EXPECT_TRUE(t[Param::kFc2Bias].defined());
  EXPECT_FALSE(t[Param::kBias].defined());
  EXPECT_STREQ(ParamName(Param::kFc2Bias), "fc2_bias");
  EXPECT_STREQ(ParamName(Param::kLayerNormWeight), "layer_norm_weight");
}

// The wire forms of Forward and Backward compute exactly what the host forms do: the backend
// decodes the narrow dtypes and encodes the outputs with the wire codec's rounding.
TEST(ModuleHostWireTest, WireForwardAndBackwardMatchTheHostPath) {
  for (ModuleKind kind :
       {ModuleKind::kLinear, ModuleKind::kLayerNormLinear, ModuleKind::kLayerNormMlp}) {
    ModuleHost host;
    ModuleSpec spec = MakeModuleSpec(kind, 12, 7, /*ffn=*/9, /*seed=*/5);
    spec.return_layernorm_output = kind != ModuleKind::kLinear;
    auto a = host.Create(spec);
    auto b = host.Create(spec);  // same seed: same weights
    ASSERT_TRUE(a.ok() && b.ok());
    const at::Tensor x = RandN({2, 3, 12});
    // The wire input: bf16 bytes; the host path gets the same values widened.
    const wire::EncodedTensor xe =
        host.backend().ToWire(x, wire::DType::kBF16, {x.sizes().begin(), x.sizes().end()});
    at::Tensor widened = at::empty({2, 3, 12});
    wire::DecodeElements(wire::DType::kBF16, xe.bytes.data(), 72, 1.0f, widened.data_ptr<float>());
    WireForwardRequest req;
    req.input = {wire::DType::kBF16, xe.bytes.data(), xe.shape, 1.0f};
    req.training = true;
    req.output_dtype = wire::DType::kF32;
    auto wf = host.Forward(a->module_id, req);
    ASSERT_TRUE(wf.ok()) << wf.status();
    auto hf = TensorForward(host, b->module_id, widened, true);
    ASSERT_TRUE(hf.ok()) << hf.status();
    EXPECT_EQ(wf->output.shape, (std::vector<int64_t>{2, 3, 7}));
    ASSERT_EQ(wf->output.bytes.size(), size_t(hf->output.numel() * 4));
    EXPECT_EQ(
        std::memcmp(wf->output.bytes.data(), hf->output.data_ptr<float>(), wf->output.bytes.size()),
        0)
        << ModuleKindName(kind);
    EXPECT_EQ(wf->has_layernorm_output, spec.return_layernorm_output);

    const at::Tensor dy = RandN({2, 3, 7});
    const wire::EncodedTensor dye =
        host.backend().ToWire(dy, wire::DType::kF16, {dy.sizes().begin(), dy.sizes().end()});
    at::Tensor dy_widened = at::empty({2, 3, 7});
    wire::DecodeElements(wire::DType::kF16, dye.bytes.data(), 42, 1.0f,
                         dy_widened.data_ptr<float>());
    WireBackwardRequest breq;
    breq.grad_output = {wire::DType::kF16, dye.bytes.data(), dye.shape, 1.0f};
    breq.grad_input_dtype = wire::DType::kBF16;
    auto wb = host.Backward(wf->context_id, breq);
    ASSERT_TRUE(wb.ok()) << wb.status();
    ASSERT_TRUE(wb->has_value());
    auto hb = TensorBackward(host, hf->context_id, dy_widened, false, false);
    ASSERT_TRUE(hb.ok()) << hb.status();
    const wire::EncodedTensor hb_bf16 = host.backend().ToWire(*hb, wire::DType::kBF16, {2, 3, 12});
    EXPECT_EQ((*wb)->shape, (std::vector<int64_t>{2, 3, 12}));
    EXPECT_TRUE((*wb)->bytes == hb_bf16.bytes) << ModuleKindName(kind);
    EXPECT_TRUE(SameGradients(host, a->module_id, host, b->module_id)) << ModuleKindName(kind);
    EXPECT_EQ(host.Stats().live_contexts, 0);
  }
}

// A bf16 input to a LayerNorm module stays bf16 in its context (half the input's bytes) and
// gives exactly what the same values sent as F32 give: outputs, grad_input and gradients, with
// the saved activations and with selective recompute (checkpoint).
TEST(ModuleHostWireTest, Bf16InputOfALayerNormModuleIsKeptNarrowAndChangesNoBit) {
  for (ModuleKind kind : {ModuleKind::kLayerNormLinear, ModuleKind::kLayerNormMlp}) {
    for (bool checkpoint : {false, true}) {
      SCOPED_TRACE(std::string(ModuleKindName(kind)) + (checkpoint ? " checkpoint" : ""));
      ModuleSpec spec = MakeModuleSpec(kind, 16, 8, /*ffn=*/12, /*seed=*/9);
      spec.checkpoint = checkpoint;
      ModuleHost narrow_host, wide_host;
      auto a = narrow_host.Create(spec);
      auto b = wide_host.Create(spec);
      ASSERT_TRUE(a.ok() && b.ok());
      const at::Tensor x = RandN({6, 16});
      const wire::EncodedTensor xe = narrow_host.backend().ToWire(x, wire::DType::kBF16, {6, 16});
      at::Tensor widened = at::empty({6, 16});
      wire::DecodeElements(wire::DType::kBF16, xe.bytes.data(), 96, 1.0f,
                           widened.data_ptr<float>());
      WireForwardRequest nreq, wreq;
      nreq.input = {wire::DType::kBF16, xe.bytes.data(), xe.shape, 1.0f};
      wreq.input = {wire::DType::kF32, widened.data_ptr(), {6, 16}, 1.0f};
      nreq.training = wreq.training = true;
      auto nf = narrow_host.Forward(a->module_id, nreq);
      auto wf = wide_host.Forward(b->module_id, wreq);
      ASSERT_TRUE(nf.ok()) << nf.status();
      ASSERT_TRUE(wf.ok()) << wf.status();
      EXPECT_TRUE(nf->output.bytes == wf->output.bytes);
      auto nsaved = narrow_host.contexts().Peek(nf->context_id).lock();
      auto wsaved = wide_host.contexts().Peek(wf->context_id).lock();
      ASSERT_TRUE(nsaved && wsaved);
      EXPECT_EQ(wsaved->bytes() - nsaved->bytes(), 6 * 16 * 2) << "the input kept as bf16";
      const at::Tensor dy = RandN({6, 8});
      auto ndx = TensorBackward(narrow_host, nf->context_id, dy, false, false);
      auto wdx = TensorBackward(wide_host, wf->context_id, dy, false, false);
      ASSERT_TRUE(ndx.ok()) << ndx.status();
      ASSERT_TRUE(wdx.ok()) << wdx.status();
      EXPECT_TRUE(ndx->equal(*wdx));
      EXPECT_TRUE(SameGradients(narrow_host, a->module_id, wide_host, b->module_id));
    }
  }
}

// A batch of backwards over contexts whose forwards came as bf16 and as F32, mixed: the stacked
// inputs are widened where their dtypes differ, and every grad_input and the gradients are bit
// for bit those of the same backwards run one after another.
TEST(ModuleHostWireTest, BackwardBatchesOfBf16AndF32ContextsAreTheirSequence) {
  for (ModuleKind kind : {ModuleKind::kLayerNormLinear, ModuleKind::kLayerNormMlp}) {
    SCOPED_TRACE(ModuleKindName(kind));
    const ModuleSpec spec = MakeModuleSpec(kind, 16, 8, /*ffn=*/12, /*seed=*/11);
    ModuleHost batch_host, seq_host;
    auto a = batch_host.Create(spec);
    auto b = seq_host.Create(spec);
    ASSERT_TRUE(a.ok() && b.ok());
    const wire::DType dtypes[] = {wire::DType::kBF16, wire::DType::kF32, wire::DType::kBF16};
    std::vector<wire::EncodedTensor> xs, dys;
    std::vector<std::string> batch_ctx, seq_ctx;
    for (size_t i = 0; i < 3; ++i) {
      const int64_t rows = int64_t(i) + 2;
      xs.push_back(batch_host.backend().ToWire(RandN({rows, 16}), dtypes[i], {rows, 16}));
      WireForwardRequest f;
      f.input = {dtypes[i], xs.back().bytes.data(), xs.back().shape, 1.0f};
      f.training = true;
      auto fa = batch_host.Forward(a->module_id, f);
      auto fb = seq_host.Forward(b->module_id, f);
      ASSERT_TRUE(fa.ok() && fb.ok());
      EXPECT_TRUE(fa->output.bytes == fb->output.bytes);
      batch_ctx.push_back(fa->context_id);
      seq_ctx.push_back(fb->context_id);
      dys.push_back(batch_host.backend().ToWire(RandN({rows, 8}), wire::DType::kF32, {rows, 8}));
    }
    std::vector<WireBackwardRequest> breqs(3);
    std::vector<const WireBackwardRequest*> ptrs;
    for (size_t i = 0; i < 3; ++i) {
      breqs[i].grad_output = {wire::DType::kF32, dys[i].bytes.data(), dys[i].shape, 1.0f};
      ptrs.push_back(&breqs[i]);
    }
    ModuleHost::BatchRan ran;
    const auto batched = batch_host.BackwardBatch(batch_ctx, ptrs, &ran);
    EXPECT_EQ(ran.requests, 3) << "the mixed contexts ran as one batch";
    for (size_t i = 0; i < 3; ++i) {
      auto alone = seq_host.Backward(seq_ctx[i], breqs[i]);
      ASSERT_TRUE(alone.ok() && alone->has_value()) << alone.status();
      ASSERT_TRUE(batched[i].ok() && batched[i]->has_value()) << batched[i].status();
      EXPECT_TRUE((*batched[i])->bytes == (*alone)->bytes) << "grad_input " << i;
    }
    EXPECT_TRUE(SameGradients(batch_host, a->module_id, seq_host, b->module_id));
  }
}

// A wire request refused by the host changes nothing and leaves no context.
TEST(ModuleHostWireTest, BadWireRequestsAreRefusedByField) {
  ModuleHost host;
  auto m = host.Create(MakeLinearSpec(4, 3));
  ASSERT_TRUE(m.ok());
  std::vector<float> x(8, 0.5f);
  WireForwardRequest req;
  req.input = {wire::DType::kF32, x.data(), {2, 5}, 1.0f};  // last dimension is not in_features
  req.training = true;
  auto f = host.Forward(m->module_id, req);
  ASSERT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(f.status().message().find("input.shape must be [..., 4]"), absl::string_view::npos)
      << f.status();
  x[5] = NAN;
  req.input = {wire::DType::kF32, x.data(), {2, 4}, 1.0f};
  f = host.Forward(m->module_id, req);
  ASSERT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(f.status().message().find("element 5"), absl::string_view::npos) << f.status();
  EXPECT_EQ(host.Stats().live_contexts, 0);
  x[5] = 0.25f;
  auto ok = host.Forward(m->module_id, req);
  ASSERT_TRUE(ok.ok()) << ok.status();
  std::vector<float> dy(9, 1.0f);
  WireBackwardRequest back;
  back.grad_output = {wire::DType::kF32, dy.data(), {3, 3}, 1.0f};  // the forward made [2, 3]
  auto b = host.Backward(ok->context_id, back);
  ASSERT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(host.Stats().live_contexts, 1);  // kept for a retry
  back.grad_output.shape = {2, 3};
  back.skip_grad_input = true;
  b = host.Backward(ok->context_id, back);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_FALSE(b->has_value());
  EXPECT_EQ(host.Stats().live_contexts, 0);
}

}  // namespace
}  // namespace gradwire::core
