// One hosted module as the host's parts share it: its spec and kind, fp32 master weights on the
// host and their device copies, gradient accumulators and optimizer slots, the FP8 scaling state of
// its roles and the cached weight workspace. Its own lock guards all that changes. Internal to
// server/core (libtorch): the registry hands it out, the step runner, parameter store and state
// I/O work on it.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gradwire/wire/codec.h"
#include "server/core/host/optimizer.h"
#include "server/core/host_types.h"
#include "server/core/kinds/device_names.h"
#include "server/core/kinds/gradients.h"
#include "server/core/kinds/module_kind.h"
#include "server/device/backend.h"
#include "server/device/device_scaling.h"

namespace gradwire::core {

struct Module {
  struct Parameter {
    Param id;
    const char* name;      // ParamName(id)
    at::Tensor value;      // fp32 master copy, on the host
    at::Tensor device;     // value on the backend's device, as of device_version (CPU: value)
    GradAccumulator grad;  // fp32 on the device, accumulated by backwards
    OptimizerSlots slots;
  };

  ModuleSpec spec;
  const ModuleKindOps* kind = nullptr;   // FindKind(spec.kind), never null
  std::string tenant;                    // set before the module is shared, then constant
  mutable std::mutex mu;                 // guards everything below
  std::vector<Parameter> params;         // kind->Params(spec) order
  std::optional<DeviceScaling> scaling;  // kind->Roles()' scaling, on the backend's device
  uint64_t version = 1;
  int64_t optimizer_steps = 0;
  int64_t accumulated_backwards = 0;
  WorkspacePtr workspace;  // the cached FP8 weights (latest version built)
  // When a call last named it (ModuleRegistry::Find), on the registry's clock.
  mutable std::atomic<int64_t> last_used_ns{0};
  const Backend* backend = nullptr;
  uint64_t device_version = ~uint64_t(0);  // the version the device copies hold

  // Brings the device copies of the parameters to the current version (a no-op on the CPU,
  // where they are the master copies themselves).
  void SyncDevice() {
    if (device_version == version) return;
    for (Parameter& p : params) p.device = backend->ToDevice(p.value);
    device_version = version;
  }

  // The parameter called `name` at the boundary, or null.
  Parameter* Find(const std::string& name) {
    for (Parameter& p : params) {
      if (name == p.name) return &p;
    }
    return nullptr;
  }
  std::vector<std::string> Names() const {
    std::vector<std::string> names;
    for (const Parameter& p : params) names.emplace_back(p.name);
    return names;
  }
  // The device copies by handle (call SyncDevice first).
  ParamTable DeviceTable() const {
    ParamTable table;
    for (const Parameter& p : params) table[p.id] = p.device;
    return table;
  }
  // One quantizer per role. A weight role's scale is 0, which makes the cast take its scale from
  // the weight's own amax (with the recipe's margin) under either recipe: the weights are cast
  // once per weight version (the workspace), and a delayed scale would be whatever the history
  // held when the version was first used, 1.0 for a new or imported module.
  // Under delayed scaling the other roles' casts read their scale where it lives, on the device.
  std::vector<QuantizerConfig> Quantizers() const {
    const std::vector<RoleDef>& roles = kind->Roles();
    std::vector<QuantizerConfig> q(roles.size());
    for (size_t i = 0; i < roles.size(); ++i) {
      q[i].format = roles[i].format;
      q[i].margin = spec.recipe.margin;
      // Block-scaled: every role E4M3, its blocks by whether it is a weight.
      if (BlockScaled(spec.recipe.mode)) SetBlockScaling(q[i], spec.recipe.mode, roles[i].weight);
      if (spec.recipe.mode == ScalingMode::kDelayed && !roles[i].weight) {
        q[i].scale_device = scaling->Scale(i);
      }
    }
    return q;
  }
  // The accumulator of a gradient the kind hands over (DeferredGradients::Commit); a logic_error
  // for a parameter this module does not have.
  GradAccumulator* Accumulator(Param id);
  // Zeroes every accumulator (after a failed commit, which may have added part of a backward).
  void ResetGrads() {
    for (Parameter& p : params) ZeroGrad(p);
    accumulated_backwards = 0;
  }
  void ZeroGrad(Parameter& p) {
    p.grad.grad.zero_();
    p.grad.bound = 0;
  }
  // Ends a step of the given roles: records their amaxes and rolls their histories.
  void EndStep(const std::vector<RoleAmax>& amaxes) { scaling->Step(amaxes); }
  // The roles' scaling state by name, read back to the host.
  std::vector<RoleScaling> ReadScaling() const {
    std::vector<RoleScaling> out;
    std::vector<DeviceScaling::HostView> views = scaling->Read();
    for (size_t i = 0; i < views.size(); ++i) {
      out.push_back({kind->Roles()[i].name, views[i].scale, std::move(views[i].history)});
    }
    return out;
  }
};

using ModulePtr = std::shared_ptr<Module>;

// A validated module with its parameters initialised from spec.seed (weights and biases uniform
// in [-1/sqrt(fan_in), 1/sqrt(fan_in)), LayerNorm gamma 1, or 0 when zero-centered, and beta 0),
// its accumulators zero on `backend`'s device and its scaling state fresh. Not yet registered.
absl::StatusOr<ModulePtr> NewModule(const ModuleSpec& spec, const Backend& backend);

// Checks and conversions the host's parts share.
std::string ShapeString(at::IntArrayRef shape);
// INVALID_ARGUMENT unless `t` is defined, float32 (or bfloat16 with bf16_ok) and of `expected`
// shape.
absl::Status CheckExactShape(const char* field, const at::Tensor& t, at::IntArrayRef expected,
                             bool bf16_ok = false);
// INVALID_ARGUMENT unless a view's shape is exactly `expected`.
absl::Status CheckViewExactShape(const char* field, const wire::TensorView& v,
                                 const std::vector<int64_t>& expected);
// INVALID_ARGUMENT unless a view is [..., last_dim] and not empty (`what` names last_dim).
absl::Status CheckViewShape(const char* field, const wire::TensorView& v, int64_t last_dim,
                            const char* what);
bool AllFinite(const at::Tensor& t);
// Any device: one reduction, and on failure the first bad element for the message.
absl::Status CheckFinite(const std::string& field, const at::Tensor& t);
// A host fp32 tensor encoded for the wire, as the codec rounds (master weights and gradients live
// on the host, or are copied there first).
wire::EncodedTensor EncodeHost(const at::Tensor& t, wire::DType dtype);

}  // namespace gradwire::core
