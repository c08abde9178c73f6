// The scaling state of one tensor role under a recipe (recipe.h), on the host: the definition the
// device's copy (device_scaling.h) is held to.
#pragma once

#include <cstdint>
#include <deque>

#include "gradwire/kernels/fp8.h"
#include "server/device/quantizer.h"
#include "server/device/recipe.h"

namespace gradwire::device {

// The scaling state of one tensor role (e.g. "fc1 input") of one module.
//
// Delayed scaling: a cast in step t uses scale(), computed from the history at the end of step
// t-1. Record() notes the amax of this step's casts (the largest, if several); Roll() ends the
// step: it pushes that amax into the history (dropping the oldest beyond history_len), takes the
// history's max (kMax) or this step's amax (kMostRecent) and sets the scale for the next step to
// fp8_max / amax / 2^margin. An amax of 0, inf or NaN leaves the scale as it was.
// Current scaling: casts scale from their own amax; the history is still kept (for metrics).
// This is the recipe's definition, on the host. A module keeps its roles' state on its backend's
// device (DeviceScaling, device_scaling.h), whose steps are held to this class bit for bit.
class ScalingState {
 public:
  ScalingState(kernels::Fp8Format format, const RecipeConfig& config);

  // The quantizer for this role's next cast.
  QuantizerConfig Quantizer() const;
  void Record(float amax);
  void Roll();

  kernels::Fp8Format format() const { return format_; }
  float scale() const { return scale_; }
  float pending_amax() const { return pending_; }
  // Most recent first.
  const std::deque<float>& history() const { return history_; }
  // Restores a saved state (checkpoints) or sets one up (tests).
  void Set(std::deque<float> history, float scale);

 private:
  kernels::Fp8Format format_;
  RecipeConfig config_;
  std::deque<float> history_;
  float pending_ = 0.0f;
  bool recorded_ = false;
  float scale_ = 1.0f;
};

}  // namespace gradwire::device
