// The scaling steps of a batch's requests (step_forward.cc, step_backward.cc): each request's cast
// of an activation or gradient is its own step, taken on a copy of the module's scaling state in
// the order a sequence of the requests alone would take them. Internal to the step runner.
#pragma once

#include <memory>
#include <vector>

#include "server/core/kinds/device_names.h"
#include "server/core/kinds/module_kind.h"
#include "server/device/device_scaling.h"
#include "server/device/quantizer.h"

namespace gradwire::core {

// One role's steps across a training batch, on a copy of the module's scaling state (shared by
// the batch's roles, each stepping only its own): stepped once per request as CastRows casts each
// request's rows, and the amaxes it saw. Under delayed scaling each request's cast reads the scale
// the copy holds after the steps before it (on a GPU in stream order: the cast is queued before
// the roll that follows it).
// Under current scaling no cast depends on an earlier one's amax: nothing is stepped during the
// batch (state null), and the amaxes are read after it, when its GEMMs are queued.
class RoleSteps final : public ScaleSteps {
 public:
  RoleSteps(std::shared_ptr<DeviceScaling> state, size_t role)
      : state_(std::move(state)), role_(role) {}
  void Next(QuantizerConfig& one) override {
    one.scale = 0.0f;
    one.scale_device = state_ ? state_->Scale(role_) : at::Tensor();
  }
  void Stepped(const CastScalars& cast) override {
    casts_.push_back(cast);
    if (state_) state_->Step({{role_, cast.amax()}});
  }
  size_t steps() const { return casts_.size(); }
  float amax(size_t j) const { return casts_.at(j).amax(); }

 private:
  std::shared_ptr<DeviceScaling> state_;
  size_t role_;
  std::vector<CastScalars> casts_;
};

// Gives the non-weight roles' quantizers a batch's row groups and, for training, their steps
// (on one copy of `state` under delayed scaling); returns the steps by role (null for weights,
// and for every role without training).
inline std::vector<std::shared_ptr<RoleSteps>> BatchQuantizers(
    const std::vector<RoleDef>& roles, const DeviceScaling& state, bool delayed, bool training,
    const std::shared_ptr<const std::vector<int64_t>>& groups,
    std::vector<QuantizerConfig>& quantizers) {
  const auto copy = training && delayed ? std::make_shared<DeviceScaling>(state.Copy()) : nullptr;
  std::vector<std::shared_ptr<RoleSteps>> steps(roles.size());
  for (size_t role = 0; role < roles.size(); ++role) {
    if (roles[role].weight) continue;
    quantizers[role].row_groups = groups;
    if (!training) continue;
    steps[role] = std::make_shared<RoleSteps>(copy, role);
    quantizers[role].steps = steps[role];
  }
  return steps;
}

}  // namespace gradwire::core
