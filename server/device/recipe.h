// FP8 scaling recipes: per-tensor current scaling, and delayed scaling from an amax history.
// The recipe's settings; the state it keeps per tensor role is scaling_state.h's.
#pragma once

#include <cstdint>

namespace gradwire::core {

enum class ScalingMode { kCurrent, kDelayed };
enum class AmaxAlgo { kMax, kMostRecent };

struct RecipeConfig {
  ScalingMode mode = ScalingMode::kCurrent;
  int margin = 0;                  // headroom in powers of two
  int64_t history_len = 1024;      // delayed: amaxes remembered
  AmaxAlgo algo = AmaxAlgo::kMax;  // delayed: which remembered amax sets the scale
};

}  // namespace gradwire::core
