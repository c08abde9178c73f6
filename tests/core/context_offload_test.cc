// Offload through the module host: contexts of every module kind moved to host memory and back
// give exactly the gradients of contexts that never moved; a context larger than the whole budget
// is refused before anything changes.
#include <gtest/gtest.h>

#include "server/core/module_host.h"
#include "server/core/tensor_calls.h"
#include "test_util.h"

namespace gradwire::core {
namespace {

using gradwire::testing::MakeModuleSpec;
using gradwire::testing::RandN;

struct KindCase {
  const char* name;
  ModuleKind kind;
  bool checkpoint;
};

ModuleSpec SpecFor(const KindCase& c) {
  ModuleSpec spec = MakeModuleSpec(c.kind, 24, 12, /*ffn=*/20, /*seed=*/7);
  spec.checkpoint = c.checkpoint;
  spec.recipe.mode = ScalingMode::kDelayed;
  return spec;
}

class OffloadParityTest : public ::testing::TestWithParam<KindCase> {};

TEST_P(OffloadParityTest, OffloadedContextsGiveTheSameGradients) {
  const ModuleSpec spec = SpecFor(GetParam());
  constexpr int kMicrobatches = 4;
  constexpr int64_t kRows = 9;
  std::vector<at::Tensor> inputs, grads;
  for (int i = 0; i < kMicrobatches; ++i) {
    inputs.push_back(RandN({kRows, spec.in_features}));
    grads.push_back(RandN({kRows, spec.out_features}));
  }
  // The size of one context, measured on a throwaway host.
  int64_t one = 0;
  {
    ModuleHost probe;
    auto id = probe.Create(spec);
    ASSERT_TRUE(id.ok());
    ASSERT_TRUE(TensorForward(probe, id->module_id, inputs[0], true).ok());
    one = probe.Stats().context_bytes;
    ASSERT_GT(one, 0);
  }
  ModuleHost ref;
  // Room for one context on the device: every new forward pushes the previous one to host.
  ModuleHost tight(ContextLimits{one, int64_t(1) << 30, 0});
  auto ref_id = ref.Create(spec), tight_id = tight.Create(spec);
  ASSERT_TRUE(ref_id.ok() && tight_id.ok());
  std::vector<std::string> ref_ctx, tight_ctx;
  for (int i = 0; i < kMicrobatches; ++i) {
    auto a = TensorForward(ref, ref_id->module_id, inputs[i], true);
    auto b = TensorForward(tight, tight_id->module_id, inputs[i], true);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_TRUE(at::equal(a->output, b->output));
    ref_ctx.push_back(a->context_id);
    tight_ctx.push_back(b->context_id);
  }
  HostStats s = tight.Stats();
  EXPECT_EQ(s.contexts.offloaded, kMicrobatches - 1);
  EXPECT_EQ(s.contexts.device_bytes, one);
  // The pack holds exactly what bytes() counts: every owned tensor moved, nothing shared.
  EXPECT_EQ(s.contexts.host_bytes, (kMicrobatches - 1) * one);
  EXPECT_EQ(s.context_bytes, ref.Stats().context_bytes);
  // Oldest first: each backward restores an offloaded context.
  for (int i = 0; i < kMicrobatches; ++i) {
    auto a = TensorBackward(ref, ref_ctx[i], grads[i], false, false);
    auto b = TensorBackward(tight, tight_ctx[i], grads[i], false, false);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_TRUE(at::equal(*a, *b)) << "grad_input of microbatch " << i;
  }
  s = tight.Stats();
  // Restoring the oldest pushed the newest out, so every context made the round trip.
  EXPECT_EQ(s.contexts.restores, kMicrobatches);
  EXPECT_EQ(s.contexts.offloads, kMicrobatches);
  EXPECT_EQ(s.contexts.live, 0);
  EXPECT_EQ(s.contexts.device_bytes + s.contexts.host_bytes, 0);
  EXPECT_LE(s.contexts.peak_device_bytes, one);
  auto ga = TensorGradients(ref, ref_id->module_id, false);
  auto gb = TensorGradients(tight, tight_id->module_id, false);
  ASSERT_TRUE(ga.ok() && gb.ok());
  ASSERT_EQ(ga->tensors.size(), gb->tensors.size());
  for (size_t i = 0; i < ga->tensors.size(); ++i) {
    EXPECT_TRUE(at::equal(ga->tensors[i].second, gb->tensors[i].second)) << ga->tensors[i].first;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Kinds, OffloadParityTest,
    ::testing::Values(KindCase{"Linear", ModuleKind::kLinear, false},
                      KindCase{"LayerNormLinear", ModuleKind::kLayerNormLinear, false},
                      KindCase{"LayerNormLinearCheckpoint", ModuleKind::kLayerNormLinear, true},
                      KindCase{"LayerNormMlp", ModuleKind::kLayerNormMlp, false},
                      KindCase{"LayerNormMlpCheckpoint", ModuleKind::kLayerNormMlp, true}),
    [](const ::testing::TestParamInfo<KindCase>& info) { return std::string(info.param.name); });

TEST(ContextBudgetTest, AForwardWhoseContextExceedsTheBudgetChangesNothing) {
  const ModuleSpec spec = SpecFor({"LayerNormMlp", ModuleKind::kLayerNormMlp, false});
  ModuleHost host(ContextLimits{4096, int64_t(1) << 20, 0});
  auto id = host.Create(spec);
  ASSERT_TRUE(id.ok());
  // A small forward fits and records one step of scaling history.
  auto small = TensorForward(host, id->module_id, RandN({2, spec.in_features}), true);
  ASSERT_TRUE(small.ok()) << small.status();
  ASSERT_TRUE(host.ReleaseContext(small->context_id).ok());
  const auto before = *host.Scaling(id->module_id);
  const HostStats stats_before = host.Stats();
  auto big = TensorForward(host, id->module_id, RandN({200, spec.in_features}), true);
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(big.status().message().find("--context-memory"), std::string::npos) << big.status();
  // No context, no history step, no cached workspace change.
  const auto after = *host.Scaling(id->module_id);
  ASSERT_EQ(before.size(), after.size());
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_EQ(before[i].history, after[i].history) << before[i].role;
    EXPECT_EQ(before[i].scale, after[i].scale) << before[i].role;
  }
  const HostStats stats_after = host.Stats();
  EXPECT_EQ(stats_after.live_contexts, 0);
  EXPECT_EQ(stats_after.contexts.rejected_too_large, 1);
  EXPECT_EQ(stats_after.workspace_builds + stats_after.workspace_hits,
            stats_before.workspace_builds + stats_before.workspace_hits);
  // Inference of the same size saves nothing, so it is not limited by the budget.
  EXPECT_TRUE(TensorForward(host, id->module_id, RandN({200, spec.in_features}), false).ok());
}

}  // namespace
}  // namespace gradwire::core
