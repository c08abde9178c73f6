// FP8 scaling recipes: per-tensor current scaling, delayed scaling from an amax history, and the
// block-scaled recipes BLOCK and MXFP8 (docs/block-scaling.md). The recipe's settings; the state
// it keeps per tensor role is scaling_state.h's.
#pragma once

#include <cstdint>
#include <string_view>

namespace gradwire::device {

// The values are stored in checkpoints: append only.
enum class ScalingMode {
  kCurrent = 0,  // per tensor, from its own amax
  kDelayed = 1,  // per tensor role, from an amax history of earlier steps
  kBlock = 2,    // power-of-two scales per 1x128 block (activations, gradients), 128x128 (weights)
  kMxfp8 = 3,    // power-of-two scales per 32 elements along each GEMM's reduction dimension
};
enum class AmaxAlgo { kMax, kMostRecent };

// True for the recipes with a scale per block (BLOCK, MXFP8).
inline bool BlockScaled(ScalingMode mode) {
  return mode == ScalingMode::kBlock || mode == ScalingMode::kMxfp8;
}

// The block length along a row of the block-scaled recipes' activations and gradients (BLOCK
// 128, MXFP8 32), which their FP8 wire tensors use too; 0 for the per-tensor recipes.
inline int64_t ActivationBlockLength(ScalingMode mode) {
  return mode == ScalingMode::kBlock ? 128 : mode == ScalingMode::kMxfp8 ? 32 : 0;
}

// "current", "delayed", "block", "mxfp8": what logs, GetState and the CLI call it.
inline const char* ScalingModeName(ScalingMode mode) {
  switch (mode) {
    case ScalingMode::kCurrent:
      return "current";
    case ScalingMode::kDelayed:
      return "delayed";
    case ScalingMode::kBlock:
      return "block";
    case ScalingMode::kMxfp8:
      return "mxfp8";
  }
  return "unknown";
}
// The mode of a name ScalingModeName gives; false for any other.
inline bool ScalingModeByName(std::string_view name, ScalingMode* mode) {
  for (ScalingMode m :
       {ScalingMode::kCurrent, ScalingMode::kDelayed, ScalingMode::kBlock, ScalingMode::kMxfp8}) {
    if (name == ScalingModeName(m)) {
      *mode = m;
      return true;
    }
  }
  return false;
}

struct RecipeConfig {
  ScalingMode mode = ScalingMode::kCurrent;
  int margin = 0;                  // headroom in powers of two (per-tensor recipes; 0 for blocks)
  int64_t history_len = 1024;      // delayed: amaxes remembered
  AmaxAlgo algo = AmaxAlgo::kMax;  // delayed: which remembered amax sets the scale
  // BLOCK only: its gradients (the grad_output roles) in E5M2 (HYBRID) instead of E4M3. The
  // per-tensor recipes are always HYBRID and MXFP8 always E4M3 (Hybrid below).
  bool block_hybrid = false;
};

// Whether a recipe casts its gradients to E5M2 (the HYBRID formats) and everything else to E4M3;
// else it is E4M3 throughout.
inline bool Hybrid(const RecipeConfig& r) {
  return !BlockScaled(r.mode) || (r.mode == ScalingMode::kBlock && r.block_hybrid);
}

}  // namespace gradwire::device
