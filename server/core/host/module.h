// One hosted module as the host's parts share it, in the parts that own each piece of its state:
//  - ModuleWeights, the fp32 master weights and their version: the state I/O sets them, the
//    parameter store's optimizer steps them, the step runner reads their device copies;
//  - ModuleGradients, the gradient accumulators and the optimizer's slots and step count: the
//    parameter store's (the step runner only adds backwards to the accumulators);
//  - ModuleSteps, the FP8 scaling state of its roles and the cached weight workspace: the step
//    runner's (the state I/O reads and restores the scaling state for checkpoints);
// and, fixed at creation, its spec, kind, tenant and backend, with the registry's last-use clock.
// The module's lock guards the three parts. Internal to server/core (libtorch): the registry hands
// modules out, the step runner, parameter store and state I/O work on them.
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

// The fp32 master weights on the host, their device copies, and the weight version.
class ModuleWeights {
 public:
  struct Weight {
    Param id;
    const char* name;   // ParamName(id)
    at::Tensor value;   // fp32 master copy, on the host
    at::Tensor device;  // value on the backend's device, as of the last SyncDevice (CPU: value)
  };
  std::vector<Weight> list;  // kind->Params(spec) order
  uint64_t version = 1;

  // Brings the device copies to the current version (a no-op on the CPU, where they are the
  // master copies themselves).
  void SyncDevice(const Backend& backend) {
    if (device_version_ == version) return;
    for (Weight& w : list) w.device = backend.ToDevice(w.value);
    device_version_ = version;
  }
  // The weight called `name` at the boundary, or null.
  Weight* Find(const std::string& name) {
    for (Weight& w : list) {
      if (name == w.name) return &w;
    }
    return nullptr;
  }
  std::vector<std::string> Names() const {
    std::vector<std::string> names;
    for (const Weight& w : list) names.emplace_back(w.name);
    return names;
  }
  // The device copies by handle (call SyncDevice first).
  ParamTable DeviceTable() const {
    ParamTable table;
    for (const Weight& w : list) table[w.id] = w.device;
    return table;
  }

 private:
  uint64_t device_version_ = ~uint64_t(0);  // the version the device copies hold
};

// What backwards leave for the optimizer, and what the optimizer keeps between its steps: one
// entry per weight, in ModuleWeights' order.
class ModuleGradients {
 public:
  struct Entry {
    Param id;
    GradAccumulator grad;  // fp32 on the device, accumulated by backwards
    OptimizerSlots slots;
  };
  std::vector<Entry> list;
  int64_t accumulated_backwards = 0;  // since the last step or zeroing
  int64_t optimizer_steps = 0;

  // The accumulator of a gradient the kind hands over (DeferredGradients::Commit); a logic_error
  // for a parameter this module does not have.
  GradAccumulator* Accumulator(Param id);
  void Zero(Entry& e) {
    e.grad.grad.zero_();
    e.grad.bound = 0;
  }
  // Zeroes every accumulator and the backward count (after an optimizer step, or a failed commit
  // that may have added part of a backward).
  void ZeroAll() {
    for (Entry& e : list) Zero(e);
    accumulated_backwards = 0;
  }
};

// The cast of `role` under `spec`'s recipe as far as the recipe alone says: its format, margin
// and, under a block-scaled recipe, its blocks (every role E4M3 there, the gradients E5M2 under
// HYBRID). No scale: ModuleSteps::Quantizers adds a delayed recipe's from the scaling state.
inline QuantizerConfig RoleQuantizer(const ModuleSpec& spec, const RoleDef& role) {
  QuantizerConfig q;
  q.format = role.format;
  q.margin = spec.recipe.margin;
  if (BlockScaled(spec.recipe.mode)) {
    SetBlockScaling(q, spec.recipe.mode, role.weight);
    if (Hybrid(spec.recipe)) q.format = role.format;
  }
  return q;
}

// The FP8 side of the module's steps: its roles' scaling state on the backend's device and the
// weight workspace (the cached FP8 weights of the latest version built).
class ModuleSteps {
 public:
  std::optional<DeviceScaling> scaling;  // kind->Roles()' scaling
  WorkspacePtr workspace;

  // One quantizer per role. A weight role's scale is 0, which makes the cast take its scale from
  // the weight's own amax (with the recipe's margin) under either recipe: the weights are cast
  // once per weight version (the workspace), and a delayed scale would be whatever the history
  // held when the version was first used, 1.0 for a new or imported module.
  // Under delayed scaling the other roles' casts read their scale where it lives, on the device.
  std::vector<QuantizerConfig> Quantizers(const ModuleSpec& spec, const ModuleKindOps& kind) const {
    const std::vector<RoleDef>& roles = kind.Roles();
    std::vector<QuantizerConfig> q(roles.size());
    for (size_t i = 0; i < roles.size(); ++i) {
      q[i] = RoleQuantizer(spec, roles[i]);
      if (spec.recipe.mode == ScalingMode::kDelayed && !roles[i].weight) {
        q[i].scale_device = scaling->Scale(i);
      }
    }
    return q;
  }
  // Ends a step of the given roles: records their amaxes and rolls their histories.
  void EndStep(const std::vector<RoleAmax>& amaxes) { scaling->Step(amaxes); }
  // The roles' scaling state by name, read back to the host.
  std::vector<RoleScaling> ReadScaling(const ModuleKindOps& kind) const {
    std::vector<RoleScaling> out;
    std::vector<DeviceScaling::HostView> views = scaling->Read();
    for (size_t i = 0; i < views.size(); ++i) {
      out.push_back({kind.Roles()[i].name, views[i].scale, std::move(views[i].history)});
    }
    return out;
  }
};

struct Module {
  ModuleSpec spec;
  const ModuleKindOps* kind = nullptr;  // FindKind(spec.kind), never null
  std::string tenant;                   // set before the module is shared, then constant
  const Backend* backend = nullptr;
  // When a call last named it (ModuleRegistry::Find), on the registry's clock.
  mutable std::atomic<int64_t> last_used_ns{0};

  mutable std::mutex mu;  // guards the parts below
  ModuleWeights weights;
  ModuleGradients gradients;
  ModuleSteps steps;

  void SyncDevice() { weights.SyncDevice(*backend); }
  std::vector<QuantizerConfig> Quantizers() const { return steps.Quantizers(spec, *kind); }
  std::vector<RoleScaling> ReadScaling() const { return steps.ReadScaling(*kind); }
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
