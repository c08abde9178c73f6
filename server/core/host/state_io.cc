#include "server/core/host/state_io.h"

#include <ATen/ATen.h>

#include <cmath>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/common/status_macros.h"
#include "server/core/host/module.h"
#include "server/core/host/module_registry.h"
#include "server/core/module_state.h"

namespace gradwire::core {

absl::StatusOr<EncodedParameters> StateIO::GetWeights(const std::string& module_id,
                                                      wire::DType dtype) const {
  GW_ASSIGN_OR_RETURN(auto m, modules_.Find(module_id));
  NamedTensors copies;
  EncodedParameters out;
  {
    std::lock_guard<std::mutex> lock(m->mu);
    for (const ModuleWeights::Weight& w : m->weights.list)
      copies.emplace_back(w.name, w.value.clone());
    out.weight_version = m->weights.version;
  }
  for (const auto& [name, t] : copies) out.tensors.emplace_back(name, EncodeHost(t, dtype));
  modules_.Renew(*m);
  return out;
}

absl::StatusOr<uint64_t> StateIO::SetWeights(const std::string& module_id,
                                             const NamedViews& params) {
  GW_ASSIGN_OR_RETURN(auto m, modules_.Find(module_id));
  if (params.empty()) return absl::InvalidArgumentError("parameters is empty: nothing to set");
  const std::vector<std::string> names = m->weights.Names();  // fixed at creation
  std::vector<std::pair<size_t, at::Tensor>> checked;
  std::set<std::string> seen;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& [name, v] = params[i];
    const std::string field = absl::StrCat("parameters[", i, "] (", name, ")");
    size_t index = 0;
    while (index < names.size() && names[index] != name) ++index;
    if (index == names.size()) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": not a parameter of this ",
                                                     ModuleKindName(m->spec.kind), "; it has ",
                                                     absl::StrJoin(names, ", ")));
    }
    if (!seen.insert(name).second) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": given twice"));
    }
    const at::IntArrayRef expected = m->weights.list[index].value.sizes();
    if (at::IntArrayRef(v.shape) != expected) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".shape must be ", ShapeString(expected), ", got ", ShapeString(v.shape)));
    }
    at::Tensor t = at::empty(v.shape, at::TensorOptions().dtype(at::kFloat));
    wire::DecodeView(v, t.data_ptr<float>());
    GW_RETURN_IF_ERROR(CheckFinite(field, t));
    checked.emplace_back(index, std::move(t));
  }
  std::lock_guard<std::mutex> lock(m->mu);
  for (const auto& [index, t] : checked) m->weights.list[index].value.copy_(t);
  modules_.Renew(*m);
  return ++m->weights.version;
}

absl::StatusOr<std::vector<RoleScaling>> StateIO::Scaling(const std::string& module_id) const {
  GW_ASSIGN_OR_RETURN(auto m, modules_.Find(module_id));
  std::lock_guard<std::mutex> lock(m->mu);
  return m->ReadScaling();
}

absl::Status StateIO::Export(const std::string& module_id, ModuleState* out) const {
  GW_ASSIGN_OR_RETURN(auto m, modules_.Find(module_id));
  std::lock_guard<std::mutex> lock(m->mu);
  ModuleState state;
  state.module_id = module_id;
  state.tenant = m->tenant;
  state.spec = m->spec;
  state.weight_version = m->weights.version;
  state.optimizer_steps = m->gradients.optimizer_steps;
  for (size_t i = 0; i < m->weights.list.size(); ++i) {
    const ModuleWeights::Weight& w = m->weights.list[i];
    const OptimizerSlots& slots = m->gradients.list[i].slots;
    state.parameters.emplace_back(w.name, w.value.clone());
    if (slots.first.defined()) {
      state.optimizer_slots.emplace_back(std::string(w.name) + ".first", slots.first.clone());
    }
    if (slots.second.defined()) {
      state.optimizer_slots.emplace_back(std::string(w.name) + ".second", slots.second.clone());
    }
  }
  state.scaling = m->ReadScaling();
  *out = std::move(state);
  return absl::OkStatus();
}

absl::Status StateIO::Import(const ModuleState& state) {
  if (state.module_id.empty()) return absl::InvalidArgumentError("module_id is required");
  GW_ASSIGN_OR_RETURN(ModulePtr m, NewModule(state.spec, backend_));
  m->tenant = state.tenant;
  auto find = [](const NamedTensors& list, const std::string& name) -> const at::Tensor* {
    for (const auto& [n, t] : list) {
      if (n == name) return &t;
    }
    return nullptr;
  };
  for (size_t i = 0; i < m->weights.list.size(); ++i) {
    ModuleWeights::Weight& p = m->weights.list[i];
    OptimizerSlots& slots = m->gradients.list[i].slots;
    const at::Tensor* value = find(state.parameters, p.name);
    if (!value) {
      return absl::InvalidArgumentError(absl::StrCat("parameter ", p.name, " is missing"));
    }
    GW_RETURN_IF_ERROR(CheckExactShape(p.name, *value, p.value.sizes()));
    p.value.copy_(*value);
    for (auto [suffix, slot] : {std::pair{".first", &slots.first}, {".second", &slots.second}}) {
      if (const at::Tensor* t = find(state.optimizer_slots, std::string(p.name) + suffix)) {
        GW_RETURN_IF_ERROR(
            CheckExactShape((std::string(p.name) + suffix).c_str(), *t, p.value.sizes()));
        *slot = t->clone();
      }
    }
  }
  for (const RoleScaling& r : state.scaling) {
    if (!std::isfinite(r.scale) || !(r.scale > 0.0f)) {
      return absl::InvalidArgumentError(absl::StrCat("the scaling state of role ", r.role,
                                                     " has scale ", r.scale,
                                                     ": it must be finite and > 0"));
    }
    DeviceScaling& scaling = *m->steps.scaling;
    for (size_t i = 0; i < scaling.roles(); ++i) {
      if (m->kind->Roles()[i].name == r.role) scaling.Set(i, r.history, r.scale);
    }
  }
  m->weights.version = state.weight_version;
  m->gradients.optimizer_steps = state.optimizer_steps;
  return modules_.Insert(state.module_id, std::move(m));
}

}  // namespace gradwire::core
