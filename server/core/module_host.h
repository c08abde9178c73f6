// The module host: owns the modules, their fp32 master weights, gradient buffers and optimizer
// state, the FP8 weight-workspace cache (outside the compute functions), the FP8 scaling state of
// every tensor role, and the saved-context store. Transport-free; thread-safe. What a module
// computes, which parameters and roles it has and what its spec may hold is its kind's
// (module_kind.h): the host never switches on the kind.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "gradwire/wire/codec.h"
#include "server/core/backend.h"
#include "server/core/context_store.h"
#include "server/core/module_kind.h"
#include "server/core/module_spec.h"
#include "server/core/optimizer.h"
#include "server/core/recipe.h"

namespace gradwire::core {

struct Fp8Tensor;

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

struct ModuleInfo {
  std::string module_id;
  std::string tenant;  // owner; empty when the server runs without tokens
  ModuleSpec spec;
  uint64_t weight_version = 0;
  int64_t live_contexts = 0;
  int64_t optimizer_steps = 0;
  std::vector<std::string> parameter_names;
};

// Forward and Backward take the input as it arrived, as a view of its bytes, and return outputs
// encoded as asked. The backend converts both ways on its own device: nothing is widened to fp32
// on the host first. (Tests and tools holding tensors use tensor_calls.h.)
struct WireForwardRequest {
  wire::TensorView input;  // [..., in_features]
  bool training = false;
  wire::DType output_dtype = wire::DType::kF32;  // of output and layernorm_output
  std::string client;                            // who asked (per-client context counts)
  // Training: the id the context takes (ContextStore::Put); empty: a fresh random one.
  std::string context_id;
};

struct WireForwardOutput {
  wire::EncodedTensor output;            // [..., out_features]
  wire::EncodedTensor layernorm_output;  // [..., in_features]; empty shape unless returned
  bool has_layernorm_output = false;
  std::string context_id;  // empty for inference
  uint64_t weight_version = 0;
  int32_t batch_requests = 0;  // ForwardBatch: the requests computed together (0: alone)
};

struct WireBackwardRequest {
  wire::TensorView grad_output;            // the shape of that forward's output
  wire::TensorView grad_layernorm_output;  // optional (data null when absent)
  bool retain = false;
  bool skip_grad_input = false;
  wire::DType grad_input_dtype = wire::DType::kF32;
};

using NamedViews = std::vector<std::pair<std::string, wire::TensorView>>;

// Parameters (weights or gradients) encoded for the wire.
struct EncodedParameters {
  std::vector<std::pair<std::string, wire::EncodedTensor>> tensors;  // the module's order
  uint64_t weight_version = 0;
  int64_t accumulated_backwards = 0;  // gradients only
};

// One tensor role's FP8 scaling state, for inspection.
struct RoleScaling {
  std::string role;  // "input", "weight", "grad_output"; "fc1_input", ... for LayerNormMLP
  float scale = 1.0f;
  std::deque<float> history;  // most recent first
};

// Everything that defines a module between steps (accumulated gradients are not part of it):
// what a checkpoint holds.
struct ModuleState {
  std::string module_id;
  std::string tenant;
  ModuleSpec spec;
  uint64_t weight_version = 0;
  int64_t optimizer_steps = 0;
  NamedTensors parameters;       // float32, the module's order
  NamedTensors optimizer_slots;  // "<param>.first" / "<param>.second" where allocated
  std::vector<RoleScaling> scaling;
};

struct HostStats {
  int64_t modules = 0;
  int64_t live_contexts = 0;
  int64_t context_bytes = 0;     // device + host
  ContextStats contexts;         // budgets: offloads, restores, evictions
  int64_t workspace_builds = 0;  // FP8 weight casts (cache misses)
  int64_t workspace_hits = 0;
  int64_t compute_calls = 0;      // forwards and backwards started (housekeeping's idle test)
  int64_t batched_forwards = 0;   // forwards computed in a batch with others (ForwardBatch)
  int64_t batched_backwards = 0;  // backwards computed in a batch with others (BackwardBatch)
  int64_t modules_expired = 0;    // modules released unused for --module-ttl (ExpireIdleModules)
};

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
  const Backend& backend() const { return *backend_; }
  ~ModuleHost();

  // Validates `spec` and initialises the parameters from spec.seed: weights and biases uniform in
  // [-1/sqrt(fan_in), 1/sqrt(fan_in)), LayerNorm gamma 1 (0 when zero-centered) and beta 0.
  // The module belongs to `tenant`, and so does every context its forwards create.
  absl::StatusOr<ModuleInfo> Create(const ModuleSpec& spec, const std::string& tenant = {});
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
  // Deletes the module and releases its contexts.
  absl::Status Delete(const std::string& module_id);

  // input: [..., in_features] in any wire dtype. Training stores the saved tensors under a new
  // context id; inference creates nothing. An FP8 input reaches the kind as its codes when the
  // kind UsesFp8Input (a Linear: no re-quantization); the LayerNorm kinds normalise its decoded
  // values. `req.client` names who asked (ContextStore::live_contexts_of_client).
  // RESOURCE_EXHAUSTED, before anything changes, when a training forward's saved tensors alone
  // exceed the context memory budget.
  absl::StatusOr<WireForwardOutput> Forward(const std::string& module_id,
                                            const WireForwardRequest& req);
  // Forwards of several requests to one module as one backend call over their rows stacked
  // (docs/batching.md): every request's result, and for training its context and the scaling
  // state after it, is bit for bit what Forward gives when the requests run alone one after
  // another in this order. Each cast of an activation is one per request (its own amax and
  // scale; under delayed scaling a training request casts with the scale the steps of the
  // requests before it left, and is one step of the history), and the GEMMs apply each
  // request's scale_inv to its rows. Each training request's context holds only its own rows.
  // A malformed request gets its own error and the others go on; when a value comes out
  // non-finite, a context would not fit, or the requests are not all of one kind (all training
  // or all inference, reaching the module the same way; training with FP8 codes is not
  // batched), every request runs alone through Forward, in order. One result per request.
  std::vector<absl::StatusOr<WireForwardOutput>> ForwardBatch(
      const std::string& module_id, const std::vector<const WireForwardRequest*>& reqs);
  // Accumulates the parameter gradients into the module's buffers; the context is freed before
  // this returns unless `req.retain`. Returns grad_input encoded as asked (none with
  // skip_grad_input).
  absl::StatusOr<std::optional<wire::EncodedTensor>> Backward(const std::string& context_id,
                                                              const WireBackwardRequest& req);
  // Backwards of several contexts of one module as one backend call over their gradients'
  // rows stacked (docs/batching.md): every request's grad_input, the accumulated gradients and
  // the scaling state after each are bit for bit what Backward gives when the requests run alone
  // one after another in this order. Each gradient cast is one per request (under delayed
  // scaling one step of the history each, in order); the dgrad GEMMs apply each request's
  // scale_inv to its rows; each request's weight gradients are its own GEMMs, added to the
  // accumulators request by request. A request that fails a check gets Backward's answer alone
  // and changes nothing; when a value comes out non-finite at request j, j and those after it
  // run alone, in order, after the ones before it were committed. Contexts that cannot share a
  // call (another module or weight workspace, checkpointed LayerNorm kinds, mixed
  // skip_grad_input or grad_layernorm_output) run alone, in order. One result per request.
  // `ran`, when given, gets the requests and rows that ran as the one call (0 when none did).
  struct BatchRan {
    int64_t requests = 0;
    int64_t rows = 0;
  };
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

  // A copy of the module's state (checkpoints).
  absl::StatusOr<ModuleState> ExportState(const std::string& module_id) const;
  // Re-creates a module from a state under its original id: the spec is validated, every
  // parameter must be present with its shape; ALREADY_EXISTS when the id is taken.
  absl::Status ImportState(const ModuleState& state);
  HostStats Stats() const;
  const ContextStore& contexts() const { return contexts_; }
  // Evicts contexts past their TTL now; returns how many (a janitor calls this periodically).
  int64_t EvictExpiredContexts() { return contexts_.EvictExpired(); }

  // Module lifetimes (--module-ttl). Every call that names a module, its backwards and a
  // client's keep-alive (Touch) renew it; ExpireIdleModules deletes, with their contexts, the
  // modules none of these touched for `ttl_s` seconds, and returns their ids.
  absl::Status Touch(const std::string& module_id) const { return Find(module_id).status(); }
  std::vector<std::string> ExpireIdleModules(double ttl_s);

 private:
  struct Module;
  // A validated, initialised module not yet in the map.
  absl::StatusOr<std::shared_ptr<Module>> NewModule(const ModuleSpec& spec) const;
  absl::StatusOr<std::shared_ptr<Module>> Find(const std::string& module_id) const;
  ModuleInfo InfoLocked(const std::string& id, const Module& m) const;
  // What Forward and Backward compute, on the backend's device: `x` is [rows, in_features] there,
  // `input_fp8` the input's codes on the device when it arrived in FP8. Outputs stay 2-D on the
  // device; with bf16_output the output is bfloat16 (for a bf16 response).
  //
  // The results reach `deliver` (which encodes them for the caller) as soon as they are queued,
  // before the checks that decide whether the call succeeds: on a GPU their copy back is the
  // call's one wait, and the values the checks read (the casts' amaxes, finite checks) crossed
  // behind the kernels before it. A refused call then drops what was delivered. An exception from
  // `deliver` fails the call with nothing changed.
  struct DeviceForward {
    std::string context_id;
    uint64_t weight_version = 0;
  };
  // deliver(output, layernorm_output): both 2-D on the device; layernorm_output undefined unless
  // the module returns it.
  using DeliverForward = std::function<void(const at::Tensor&, const at::Tensor&)>;
  absl::StatusOr<DeviceForward> ForwardOnDevice(
      const std::string& module_id, const std::shared_ptr<Module>& m, const at::Tensor& x,
      const std::vector<int64_t>& input_shape, bool training, const Fp8Tensor* input_fp8,
      const std::string& client, const std::string& context_id, bool bf16_output,
      const DeliverForward& deliver);
  // deliver(grad_input, input_shape): grad_input on the device as [rows, in_features] (undefined
  // with skip_grad_input), and the forward input's shape. The gradients are on the device, shaped
  // as sent (grad_layernorm_output may be undefined). The context is finished (consumed or kept)
  // when this returns.
  using DeliverBackward = std::function<void(const at::Tensor&, const std::vector<int64_t>&)>;
  absl::Status BackwardOnDevice(const std::string& context_id, const at::Tensor& grad_output,
                                const at::Tensor& grad_layernorm_output, bool retain,
                                bool skip_grad_input, const DeliverBackward& deliver);

  int64_t NowNs() const;

  BackendPtr backend_;
  ContextStore::Clock clock_;  // null: the steady clock
  std::atomic<int64_t> modules_expired_{0};
  mutable std::mutex mu_;  // guards modules_ (each Module has its own lock)
  std::map<std::string, std::shared_ptr<Module>> modules_;
  ContextStore contexts_;
  std::atomic<int64_t> workspace_builds_{0};
  std::atomic<int64_t> workspace_hits_{0};
  std::atomic<int64_t> compute_calls_{0};
  std::atomic<int64_t> batched_forwards_{0};
  std::atomic<int64_t> batched_backwards_{0};
};

}  // namespace gradwire::core
