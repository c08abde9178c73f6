// The device delayed-scaling roll against ScalingState (server/device/scaling_state.cc), step by
// step, bit for bit: history, scale, scale_inv. Skipped, visibly, where there is no CUDA device.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "gradwire/kernels/cuda/recipe.h"
#include "server/device/scaling_state.h"
#include "test_util.h"
#include "tests/kernels/cuda_test_util.h"

namespace gradwire::kernels::cuda {
namespace {

using testing::Bits;
using testing::DeviceBuffer;
using testing::FreshSeed;

void RunRecipe(device::AmaxAlgo algo, int64_t history_len, int margin, Fp8Format format) {
  const uint64_t seed = FreshSeed();
  SCOPED_TRACE("seed " + std::to_string(seed) + " history " + std::to_string(history_len));
  std::mt19937_64 rng(seed);
  std::lognormal_distribution<float> amax_dist(0.0f, 3.0f);
  const int64_t n = 5;
  const device::RecipeConfig config = gradwire::testing::DelayedRecipe(algo, history_len, margin);
  std::vector<device::ScalingState> states(static_cast<size_t>(n),
                                           device::ScalingState(format, config));
  DeviceBuffer<float> history(std::vector<float>(static_cast<size_t>(n * history_len), 0.0f));
  DeviceBuffer<float> scale(std::vector<float>(static_cast<size_t>(n), 1.0f)),
      scale_inv(static_cast<size_t>(n));
  DeviceBuffer<float> pending(static_cast<size_t>(n));
  DeviceBuffer<uint8_t> recorded(static_cast<size_t>(n));
  const kernels::cuda::AmaxAlgo dalgo =
      algo == device::AmaxAlgo::kMax ? AmaxAlgo::kMax : AmaxAlgo::kMostRecent;
  for (int step = 0; step < 3 * history_len + 7; ++step) {
    std::vector<float> p(static_cast<size_t>(n));
    std::vector<uint8_t> rec(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t roll = rng() % 40;
      p[size_t(i)] = roll == 0 ? 0.0f : roll == 1 ? NAN : roll == 2 ? INFINITY : amax_dist(rng);
      rec[size_t(i)] = rng() % 8 != 0;  // some tensors skip a step
      if (rec[size_t(i)]) states[size_t(i)].Record(p[size_t(i)]);
      states[size_t(i)].Roll();
    }
    pending.Upload(p);
    recorded.Upload(rec);
    DelayedScalingRoll(history.get(), pending.get(), recorded.get(), n, history_len, format, margin,
                       dalgo, scale.get(), scale_inv.get(), nullptr);
    const std::vector<float> h = history.Download(), sc = scale.Download(),
                             si = scale_inv.Download();
    for (int64_t i = 0; i < n; ++i) {
      const device::ScalingState& st = states[size_t(i)];
      ASSERT_EQ(Bits(sc[size_t(i)]), Bits(st.scale())) << "step " << step << " tensor " << i;
      ASSERT_EQ(Bits(si[size_t(i)]), Bits(1.0f / st.scale())) << "step " << step;
      for (int64_t j = 0; j < history_len; ++j) {
        const float want = j < int64_t(st.history().size()) ? st.history()[size_t(j)] : 0.0f;
        ASSERT_EQ(Bits(h[size_t(i * history_len + j)]), Bits(want))
            << "step " << step << " tensor " << i << " slot " << j;
      }
    }
  }
}

TEST(CudaRecipe, DelayedScalingRollMatchesScalingState) {
  GW_REQUIRE_CUDA_DEVICE();
  for (int64_t len : {1, 4, 37, 1024}) {
    RunRecipe(device::AmaxAlgo::kMax, len, 0, Fp8Format::kE4M3);
    RunRecipe(device::AmaxAlgo::kMostRecent, len, 2, Fp8Format::kE5M2);
  }
}

}  // namespace
}  // namespace gradwire::kernels::cuda
