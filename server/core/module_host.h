// The module host: the server's core as one object. It owns the backend and the saved-context
// store, and puts together the parts that work on the hosted modules, each a class of its own:
//   ModuleRegistry  (module_registry.h)  which modules exist, their ids, tenants and lifetimes
//   StepRunner      (step_runner.h)      forwards and backwards: one path, a call alone is a
//                                        batch of one; workspace, scaling, finite checks, contexts
//   ParameterStore  (parameter_store.h)  accumulated gradients and the optimizer
//   StateIO         (state_io.h)         weights in and out, scaling state, checkpoint state
// A module itself (module.h: master weights, device copies, accumulators, scaling state, the FP8
// weight workspace) is internal to them. What a module computes, which parameters and roles it
// has and what its spec may hold is its kind's (module_kind.h): nothing here switches on the
// kind. Transport-free, thread-safe, and free of libtorch: the rpc layer sees the core through
// this header and host_types.h.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gradwire/wire/codec.h"
#include "server/core/contexts/context_store.h"
#include "server/core/host_types.h"
#include "server/core/kinds/kind_description.h"
#include "server/core/module_spec.h"

namespace gradwire::device {
class Backend;
using BackendPtr = std::shared_ptr<const Backend>;
}  // namespace gradwire::device

namespace gradwire::core {

using device::Backend;
using device::BackendPtr;
class ModuleRegistry;
class ParameterStore;
class StateIO;
class StepRunner;
struct ModuleState;

class ModuleHost {
 public:
  static constexpr int64_t kMaxFeatures = core::kMaxFeatures;
  static constexpr int64_t kMaxParameters = core::kMaxParameters;

  ModuleHost();
  // `limits` bound the saved-context memory; `clock` (tests) replaces the steady clock for TTLs;
  // `backend` is the device the modules compute on (null: the CPU backend). Master weights and
  // optimizer state stay on the host; gradients, the weight workspace and saved tensors live on
  // the backend's device.
  explicit ModuleHost(ContextLimits limits, ContextStore::Clock clock = nullptr,
                      BackendPtr backend = nullptr);
  ~ModuleHost();
  const Backend& backend() const { return *backend_; }

  // Validates `spec` and initialises the parameters from spec.seed: weights and biases uniform in
  // [-1/sqrt(fan_in), 1/sqrt(fan_in)), LayerNorm gamma 1 (0 when zero-centered) and beta 0.
  // The module belongs to `tenant`, and so does every context its forwards create.
  // `id`: the module's id (ALREADY_EXISTS when taken); empty, a fresh random one.
  absl::StatusOr<ModuleInfo> Create(const ModuleSpec& spec, const std::string& tenant = {},
                                    const std::string& id = {});
  absl::StatusOr<ModuleInfo> Info(const std::string& module_id) const;
  // The module's spec (fixed at creation), without Info's context count.
  absl::StatusOr<ModuleSpec> Spec(const std::string& module_id) const;
  // Every module, or only those of `*tenant`.
  std::vector<ModuleInfo> List(const std::string* tenant = nullptr) const;

  // Tenant isolation: NOT_FOUND, worded exactly as for an unknown id, unless the module (or the
  // context) belongs to `tenant`. Ownership never changes, so a check before the call suffices.
  absl::Status CheckTenant(const std::string& module_id, const std::string& tenant) const;
  absl::Status CheckContextTenant(const std::string& context_id, const std::string& tenant) const {
    return contexts_.CheckTenant(context_id, tenant);
  }
  // Deletes the module and releases its contexts (`moved`: another server holds it now, and a
  // later backward on one of them is told so).
  absl::Status Delete(const std::string& module_id, bool moved = false);
  // Whether a module has the id (whoever owns it), without renewing its lifetime.
  bool Has(const std::string& module_id) const;

  // Forwards and backwards: StepRunner's (step_runner.h), which says what each computes and
  // refuses. Forward and Backward are a batch of one.
  absl::StatusOr<WireForwardOutput> Forward(const std::string& module_id,
                                            const WireForwardRequest& req);
  std::vector<absl::StatusOr<WireForwardOutput>> ForwardBatch(
      const std::string& module_id, const std::vector<const WireForwardRequest*>& reqs);
  absl::StatusOr<std::optional<wire::EncodedTensor>> Backward(const std::string& context_id,
                                                              const WireBackwardRequest& req);
  using BatchRan = core::BatchRan;
  std::vector<absl::StatusOr<std::optional<wire::EncodedTensor>>> BackwardBatch(
      const std::vector<std::string>& context_ids,
      const std::vector<const WireBackwardRequest*>& reqs, BatchRan* ran = nullptr);
  absl::Status ReleaseContext(
      const std::string& context_id,
      ContextStore::ReleaseReason reason = ContextStore::ReleaseReason::kByClient);

  // One optimizer step on the accumulated gradients, which are then zeroed; bumps the weight
  // version and returns it. learning_rate > 0 overrides the configured rate.
  absl::StatusOr<uint64_t> ApplyGradients(const std::string& module_id, float learning_rate = 0);
  // The accumulated gradients (zeroed after the copy with `zero`) and the fp32 master weights,
  // encoded as `dtype` on the host.
  absl::StatusOr<EncodedParameters> GetGradients(const std::string& module_id, bool zero,
                                                 wire::DType dtype);
  absl::StatusOr<EncodedParameters> GetWeights(const std::string& module_id,
                                               wire::DType dtype) const;
  // Replaces the named parameters (exact shapes, finite values), decoded on the host where the
  // master weights live; all are checked before any changes. Bumps the weight version and
  // returns it.
  absl::StatusOr<uint64_t> SetWeights(const std::string& module_id, const NamedViews& params);

  absl::StatusOr<std::vector<RoleScaling>> Scaling(const std::string& module_id) const;

  // A copy of the module's state (checkpoints; module_state.h).
  absl::StatusOr<ModuleState> ExportState(const std::string& module_id) const;
  // Re-creates a module from a state under its original id: the spec is validated, every
  // parameter must be present with its shape; ALREADY_EXISTS when the id is taken.
  absl::Status ImportState(const ModuleState& state);
  HostStats Stats() const;
  const ContextStore& contexts() const { return contexts_; }
  // Evicts contexts past their TTL now; returns how many (a janitor calls this periodically).
  int64_t EvictExpiredContexts() { return contexts_.EvictExpired(); }

  // Module leases (--module-ttl). Only what succeeds renews a module: a forward, a backward of one
  // of its contexts, an optimizer step, a weights or gradients call, and Touch (a keep-alive).
  // Lookups (Info, Spec, CheckTenant, Has) and refused calls renew nothing. The rpc layer reaches
  // these only for the module's owner, so another tenant naming a module never renews it.
  // ExpireIdleModules deletes, with their contexts, the modules not renewed for `ttl_s` seconds
  // that no call holds now and `busy` (calls queued for them) does not name; returns their ids.
  absl::Status Touch(const std::string& module_id) const;
  std::vector<std::string> ExpireIdleModules(
      double ttl_s, const std::function<bool(const std::string& module_id)>& busy = nullptr);

 private:
  BackendPtr backend_;
  ContextStore contexts_;
  std::unique_ptr<ModuleRegistry> modules_;
  std::unique_ptr<StepRunner> steps_;
  std::unique_ptr<ParameterStore> parameters_;
  std::unique_ptr<StateIO> state_;
};

}  // namespace gradwire::core
