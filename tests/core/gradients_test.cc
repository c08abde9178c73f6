// How a backward's gradients reach the accumulators (server/core/kinds/gradients.h): the bounds
// that let most commits skip every check, the checked path, and all-or-nothing on overflow.
#include "server/core/kinds/gradients.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "server/core/kinds/fp8_ops.h"
#include "test_util.h"

namespace gradwire::core {
namespace {

using gradwire::testing::kE4M3;
using gradwire::testing::kE5M2;
using gradwire::testing::RandN;

const Backend* kBackendsUnderTest[] = {MakeReferenceBackend().get(), MakeCpuBackend().get()};

Fp8Tensor CastBoth(const Backend& b, const at::Tensor& t, const QuantizerConfig& q) {
  auto r = b.Cast(t, q, {true, true});
  EXPECT_TRUE(r.ok()) << r.status();
  return *r;
}

bool SameBits(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() &&
         std::memcmp(a.data_ptr<float>(), b.data_ptr<float>(), size_t(a.numel()) * 4) == 0;
}

// The bounds hold on the values the GEMMs actually produce, whatever the data's spread, on both
// host backends; and with ordinary data they are far from FLT_MAX, so no check runs.
TEST(GradientBoundsTest, BoundTheGemmsTheyStandFor) {
  for (const Backend* b : kBackendsUnderTest) {
    for (int trial = 0; trial < 20; ++trial) {
      const int64_t m = 1 + trial * 37, k = 3 + trial * 11, n = 1 + trial * 5;
      const double spread = std::pow(10.0, trial % 7 - 3);
      const Fp8Tensor x = CastBoth(*b, RandN({m, k}, spread), kE4M3);
      const Fp8Tensor dy = CastBoth(*b, RandN({m, n}, 1.0 / spread), kE5M2);
      const Fp8Tensor w = CastBoth(*b, RandN({n, k}, 0.1), kE4M3);
      at::Tensor wgrad = b->Zeros({n, k});
      b->Wgrad(dy, x, wgrad, /*accumulate=*/false);
      const double wbound = WgradBound(dy, x);
      EXPECT_LE(double(b->AbsMax(wgrad)), wbound) << b->name() << " trial " << trial;
      EXPECT_TRUE(ProvablyFinite(wbound));
      const at::Tensor dx = b->Dgrad(dy, w);
      EXPECT_LE(double(b->AbsMax(dx)), DgradBound(dy, w)) << b->name() << " trial " << trial;
    }
  }
  // Values near FLT_MAX: no bound proves such a sum finite.
  const Backend& ref = *MakeReferenceBackend();
  const Fp8Tensor big = CastBoth(ref, at::full({4, 4}, 3e38f), kE5M2);
  EXPECT_FALSE(ProvablyFinite(WgradBound(big, big)));
}

// With bounds far from FLT_MAX the commit accumulates straight into the accumulator: the same bits
// as a direct accumulation. With the accumulator's bound set high, the same sum is built in the
// spare buffer, checked and swapped in: the same bits again (reference backend: both paths add
// the GEMM's result to the old value once).
TEST(DeferredGradientsTest, DirectAndCheckedCommitsGiveTheDirectSum) {
  const Backend& b = *MakeReferenceBackend();
  const int64_t m = 9, k = 13, n = 7;
  const Fp8Tensor x = CastBoth(b, RandN({m, k}), kE4M3);
  const Fp8Tensor dy = CastBoth(b, RandN({m, n}), kE5M2);
  const at::Tensor g = RandN({m, n});
  const at::Tensor v = RandN({k});
  const at::Tensor w0 = RandN({n, k}), b0 = RandN({n}), v0 = RandN({k});

  at::Tensor want_w = w0.clone(), want_b = b0.clone(), want_v = v0.clone();
  {
    ParamTable t;
    t[Param::kWeight] = want_w;
    t[Param::kBias] = want_b;
    t[Param::kLayerNormWeight] = want_v;
    DirectGradients direct(b, t);
    direct.Wgrad(Param::kWeight, dy, x);
    direct.BiasGrad(Param::kBias, g, b.AbsMax(g));
    direct.Add(Param::kLayerNormWeight, v);
  }
  for (bool checked : {false, true}) {
    GradAccumulator w{w0.clone(), {}, checked ? 1e38 : 10.0};
    GradAccumulator bias{b0.clone(), {}, checked ? 1e38 : 10.0};
    GradAccumulator ln{v0.clone(), {}, checked ? 1e38 : 10.0};
    DeferredGradients grads(b);
    grads.Wgrad(Param::kWeight, dy, x);
    grads.BiasGrad(Param::kBias, g, b.AbsMax(g));
    grads.Add(Param::kLayerNormWeight, v);
    // Nothing moves before the commit.
    EXPECT_TRUE(SameBits(w.grad, w0));
    const auto failed = grads.Commit([&](Param p) {
      return p == Param::kWeight ? &w : p == Param::kBias ? &bias : &ln;
    });
    EXPECT_FALSE(failed.has_value());
    EXPECT_TRUE(SameBits(w.grad, want_w)) << "checked " << checked;
    EXPECT_TRUE(SameBits(bias.grad, want_b)) << "checked " << checked;
    EXPECT_TRUE(SameBits(ln.grad, want_v)) << "checked " << checked;
    EXPECT_EQ(w.spare.defined(), checked);  // the spare buffer exists only where a check ran
    // The bound keeps covering what the accumulator holds.
    EXPECT_LE(double(b.AbsMax(w.grad)), w.bound);
    if (checked) {
      EXPECT_EQ(w.bound, double(b.AbsMax(w.grad)));  // measured on the way
    }
  }
}

// One sum that overflows refuses the whole commit: every accumulator keeps its bits, the direct
// ones included.
TEST(DeferredGradientsTest, AnOverflowChangesNoAccumulator) {
  for (const Backend* b : kBackendsUnderTest) {
    const int64_t m = 4, k = 6, n = 5;
    const Fp8Tensor x = CastBoth(*b, RandN({m, k}), kE4M3);
    const Fp8Tensor dy = CastBoth(*b, RandN({m, n}), kE5M2);
    // The bias accumulator already holds values near FLT_MAX, with the bound to say so; its
    // gradient pushes it over.
    const at::Tensor near_max = at::full({n}, 3.3e38f);
    const at::Tensor g = at::full({m, n}, 1e38f);
    GradAccumulator w{RandN({n, k}), {}, 1.0};
    GradAccumulator bias{near_max.clone(), {}, 3.3e38};
    const at::Tensor w_before = w.grad.clone();
    DeferredGradients grads(*b);
    grads.Wgrad(Param::kWeight, dy, x);
    grads.BiasGrad(Param::kBias, g, 1e38f);
    const auto failed = grads.Commit([&](Param p) { return p == Param::kWeight ? &w : &bias; });
    ASSERT_TRUE(failed.has_value()) << b->name();
    EXPECT_EQ(*failed, Param::kBias);
    EXPECT_TRUE(SameBits(w.grad, w_before)) << b->name();
    EXPECT_TRUE(SameBits(bias.grad, near_max)) << b->name();
    EXPECT_EQ(bias.bound, 3.3e38);
  }
}

// A cast's scalars as a GPU leaves them: pending until first asked for, then read once for every
// copy of the tensor; a reader that fails is asked again.
Fp8Tensor WithPendingScalars(Fp8Tensor t, int* reads) {
  const std::array<float, 3> v{t.scale(), t.scale_inv(), t.amax()};
  t.scalars = CastScalars([v, reads] {
    ++*reads;
    return v;
  });
  return t;
}

TEST(CastScalarsTest, APendingReadRunsOnceForEveryCopyAndAgainAfterAFailure) {
  int reads = 0;
  const Fp8Tensor cast = CastBoth(*MakeReferenceBackend(), RandN({3, 5}), kE4M3);
  const Fp8Tensor t = WithPendingScalars(cast, &reads);
  const Fp8Tensor copy = t;
  EXPECT_TRUE(t.scalars.pending());
  EXPECT_EQ(reads, 0);
  const float amax = copy.amax();
  EXPECT_EQ(reads, 1);
  EXPECT_FALSE(t.scalars.pending());
  EXPECT_EQ(t.amax(), amax);
  EXPECT_EQ(copy.scale(), cast.scale());  // the cast's own values, read once
  EXPECT_EQ(t.scale_inv(), cast.scale_inv());
  EXPECT_EQ(amax, cast.amax());
  EXPECT_EQ(reads, 1);

  int tries = 0;
  const CastScalars flaky([&tries]() -> std::array<float, 3> {
    if (++tries == 1) throw std::runtime_error("the device failed");
    return {2.0f, 0.5f, 7.0f};
  });
  EXPECT_THROW((void)flaky.amax(), std::runtime_error);
  EXPECT_TRUE(flaky.pending());
  EXPECT_EQ(flaky.amax(), 7.0f);
  EXPECT_EQ(tries, 2);
}

// A row-grouped tensor's amax is its parts' largest (NaN when one is NaN), read only when asked:
// stacking reads no part.
TEST(CastScalarsTest, AGroupedAmaxReadsItsPartsOnlyWhenAskedFor) {
  const Backend& b = *MakeReferenceBackend();
  int reads = 0;
  std::vector<Fp8Tensor> parts;
  for (double size : {1.0, 40.0, 0.5}) {
    parts.push_back(WithPendingScalars(CastBoth(b, RandN({2, 4}, size), kE4M3), &reads));
  }
  const float largest = std::max({parts[0].amax(), parts[1].amax(), parts[2].amax()});
  reads = 0;
  for (Fp8Tensor& p : parts) p = WithPendingScalars(p, &reads);
  const Fp8Tensor stacked = StackRows(parts);
  EXPECT_EQ(reads, 0);
  EXPECT_EQ(stacked.amax(), largest);
  EXPECT_EQ(reads, 3);

  parts[1].scalars = CastScalars(1.0f, 1.0f, NAN);
  EXPECT_TRUE(std::isnan(StackRows(parts).amax()));
}

// The deferred gradients read the casts' scalars for their bounds at Commit, not when a
// contribution is collected: on a GPU the backward's later GEMMs are queued before any wait.
TEST(DeferredGradientsTest, BoundsReadTheCastsOnlyAtCommit) {
  const Backend& b = *MakeReferenceBackend();
  const int64_t m = 6, k = 5, n = 4;
  int reads = 0;
  const Fp8Tensor x = WithPendingScalars(CastBoth(b, RandN({m, k}), kE4M3), &reads);
  const Fp8Tensor dy = WithPendingScalars(CastBoth(b, RandN({m, n}), kE5M2), &reads);
  GradAccumulator w{b.Zeros({n, k}), {}, 0.0}, bias{b.Zeros({n}), {}, 0.0};
  DeferredGradients grads(b);
  grads.Wgrad(Param::kWeight, dy, x);
  grads.BiasGrad(Param::kBias, RandN({m, n}), dy);
  EXPECT_EQ(reads, 0);
  EXPECT_FALSE(grads.Commit([&](Param p) { return p == Param::kWeight ? &w : &bias; }));
  EXPECT_EQ(reads, 2);  // x and dy, each once
  EXPECT_GT(w.bound, 0.0);
  EXPECT_GT(bias.bound, 0.0);
}

TEST(DeferredGradientsTest, TwoContributionsToOneParameterAreAProgrammingError) {
  const Backend& b = *MakeReferenceBackend();
  DeferredGradients grads(b);
  grads.Add(Param::kBias, RandN({3}));
  EXPECT_THROW(grads.Add(Param::kBias, RandN({3})), std::logic_error);
}

}  // namespace
}  // namespace gradwire::core
