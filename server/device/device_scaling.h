// The FP8 scaling state of one module's tensor roles, kept on the module's backend's device
// (docs/backends.md, "Scaling state on the device"): every role's amax history, scale and
// scale_inv live in device tensors, the delayed casts read their scale there, and the end of a
// step rolls them there (Backend::RollScaling). The host reads them only to report them (metrics,
// GetState) and to checkpoint them.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <deque>
#include <utility>
#include <vector>

#include "gradwire/kernels/fp8.h"
#include "server/device/backend.h"
#include "server/device/recipe.h"

namespace gradwire::device {

class DeviceScaling {
 public:
  // One role per entry of `formats`, each with an empty history and scale 1 (ScalingState's
  // start).
  DeviceScaling(const Backend& backend, std::vector<kernels::Fp8Format> formats,
                const RecipeConfig& config);

  // A copy of its own (a batch of training forwards steps a copy, request by request).
  DeviceScaling Copy() const;

  size_t roles() const { return formats_.size(); }
  // Role `role`'s scale as a device tensor fp32 [1], for QuantizerConfig::scale_device. A view:
  // it reads whatever the state holds when the cast runs (in stream order on a GPU).
  at::Tensor Scale(size_t role) const;

  // Ends one step of the given roles (distinct), each having measured its amax: as
  // ScalingState::Record then Roll on each, one backend call per FP8 format among them.
  void Step(const std::vector<std::pair<size_t, float>>& amaxes);

  struct HostView {
    float scale = 1.0f;
    float scale_inv = 1.0f;
    std::deque<float> history;  // most recent first, as many entries as steps so far (<= len)
  };
  // Every role's state on the host (a device-to-host copy on a GPU).
  std::vector<HostView> Read() const;
  // Sets role `role` to a saved state (checkpoints); a history longer than the recipe's length
  // keeps its most recent entries.
  void Set(size_t role, const std::deque<float>& history, float scale);

 private:
  const Backend* backend_;
  std::vector<kernels::Fp8Format> formats_;
  RecipeConfig config_;
  ScalingTensors tensors_;
  std::vector<int64_t> filled_;  // per role: history entries written so far (host bookkeeping)
};

}  // namespace gradwire::device
