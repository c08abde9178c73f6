#include "server/core/module_host.h"

#include "server/common/status_macros.h"
#include "server/core/host/module_registry.h"
#include "server/core/host/parameter_store.h"
#include "server/core/host/state_io.h"
#include "server/core/host/step_runner.h"
#include "server/core/kinds/device_names.h"
#include "server/core/module_state.h"
#include "server/device/backend.h"

namespace gradwire::core {

ModuleHost::ModuleHost() : ModuleHost(ContextLimits{}) {}

ModuleHost::ModuleHost(ContextLimits limits, ContextStore::Clock clock, BackendPtr backend)
    : backend_(backend ? std::move(backend) : MakeCpuBackend()),
      contexts_(limits, clock),
      modules_(std::make_unique<ModuleRegistry>(*backend_, contexts_, clock)),
      steps_(std::make_unique<StepRunner>(*backend_, *modules_, contexts_)),
      parameters_(std::make_unique<ParameterStore>(*backend_, *modules_)),
      state_(std::make_unique<StateIO>(*backend_, *modules_)) {}

ModuleHost::~ModuleHost() = default;

absl::StatusOr<ModuleInfo> ModuleHost::Create(const ModuleSpec& spec, const std::string& tenant,
                                              const std::string& id) {
  return modules_->Create(spec, tenant, id);
}
absl::StatusOr<ModuleInfo> ModuleHost::Info(const std::string& module_id) const {
  return modules_->Info(module_id);
}
absl::StatusOr<ModuleSpec> ModuleHost::Spec(const std::string& module_id) const {
  return modules_->Spec(module_id);
}
std::vector<ModuleInfo> ModuleHost::List(const std::string* tenant) const {
  return modules_->List(tenant);
}
absl::Status ModuleHost::CheckTenant(const std::string& module_id,
                                     const std::string& tenant) const {
  return modules_->CheckTenant(module_id, tenant);
}
absl::Status ModuleHost::Delete(const std::string& module_id, bool moved) {
  return modules_->Delete(module_id, moved);
}
bool ModuleHost::Has(const std::string& module_id) const { return modules_->Has(module_id); }
absl::Status ModuleHost::Touch(const std::string& module_id) const {
  return modules_->Touch(module_id);
}
std::vector<std::string> ModuleHost::ExpireIdleModules(
    double ttl_s, const std::function<bool(const std::string&)>& busy) {
  return modules_->ExpireIdle(ttl_s, busy);
}

absl::StatusOr<WireForwardOutput> ModuleHost::Forward(const std::string& module_id,
                                                      const WireForwardRequest& req) {
  return std::move(steps_->Forward(module_id, {&req})[0]);
}
std::vector<absl::StatusOr<WireForwardOutput>> ModuleHost::ForwardBatch(
    const std::string& module_id, const std::vector<const WireForwardRequest*>& reqs) {
  return steps_->Forward(module_id, reqs);
}
absl::StatusOr<std::optional<wire::EncodedTensor>> ModuleHost::Backward(
    const std::string& context_id, const WireBackwardRequest& req) {
  return std::move(steps_->Backward({context_id}, {&req})[0]);
}
std::vector<absl::StatusOr<std::optional<wire::EncodedTensor>>> ModuleHost::BackwardBatch(
    const std::vector<std::string>& context_ids,
    const std::vector<const WireBackwardRequest*>& reqs, BatchRan* ran) {
  return steps_->Backward(context_ids, reqs, ran);
}
absl::Status ModuleHost::ReleaseContext(const std::string& context_id,
                                        ContextStore::ReleaseReason reason) {
  return contexts_.Release(context_id, reason);
}

absl::StatusOr<uint64_t> ModuleHost::ApplyGradients(const std::string& module_id,
                                                    float learning_rate) {
  return parameters_->ApplyGradients(module_id, learning_rate);
}
absl::StatusOr<EncodedParameters> ModuleHost::GetGradients(const std::string& module_id, bool zero,
                                                           wire::DType dtype) {
  return parameters_->GetGradients(module_id, zero, dtype);
}
absl::StatusOr<EncodedParameters> ModuleHost::GetWeights(const std::string& module_id,
                                                         wire::DType dtype) const {
  return state_->GetWeights(module_id, dtype);
}
absl::StatusOr<uint64_t> ModuleHost::SetWeights(const std::string& module_id,
                                                const NamedViews& params) {
  return state_->SetWeights(module_id, params);
}
absl::StatusOr<std::vector<RoleScaling>> ModuleHost::Scaling(const std::string& module_id) const {
  return state_->Scaling(module_id);
}
absl::StatusOr<ModuleState> ModuleHost::ExportState(const std::string& module_id) const {
  ModuleState state;
  GW_RETURN_IF_ERROR(state_->Export(module_id, &state));
  return state;
}
absl::Status ModuleHost::ImportState(const ModuleState& state) { return state_->Import(state); }

HostStats ModuleHost::Stats() const {
  HostStats s;
  s.modules = modules_->size();
  s.contexts = contexts_.stats();
  s.live_contexts = s.contexts.live;
  s.context_bytes = s.contexts.device_bytes + s.contexts.host_bytes;
  s.workspace_builds = steps_->workspace_builds();
  s.workspace_hits = steps_->workspace_hits();
  s.compute_calls = steps_->compute_calls();
  s.modules_expired = modules_->expired();
  s.batched_forwards = steps_->batched_forwards();
  s.batched_backwards = steps_->batched_backwards();
  s.results_in_place = steps_->results_in_place();
  return s;
}

}  // namespace gradwire::core
