#include "server/core/host/parameter_store.h"

#include <ATen/ATen.h>

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/common/status_macros.h"
#include "server/core/host/module.h"
#include "server/core/host/module_registry.h"

namespace gradwire::core {

absl::StatusOr<uint64_t> ParameterStore::ApplyGradients(const std::string& module_id,
                                                        float learning_rate) {
  if (learning_rate != 0.0f)
    GW_RETURN_IF_ERROR(CheckFinitePositive("learning_rate", learning_rate));
  GW_ASSIGN_OR_RETURN(auto m, modules_.Find(module_id));
  std::lock_guard<std::mutex> lock(m->mu);
  const float lr = learning_rate > 0.0f ? learning_rate : m->spec.optimizer.learning_rate();
  // The step runs on copies, which replace the parameters and optimizer state only when every
  // value came out finite: a step that would overflow changes nothing.
  const int64_t step = m->optimizer_steps + 1;
  std::vector<at::Tensor> values;
  std::vector<OptimizerSlots> slots;
  for (Module::Parameter& p : m->params) {
    values.push_back(p.value.clone());
    slots.push_back(p.slots.Clone());
    OptimizerStep(m->spec.optimizer, lr, step, values.back(), backend_.ToHost(p.grad.grad),
                  slots.back());
    if (!AllFinite(values.back()) || !slots.back().AllFinite()) {
      return absl::OutOfRangeError(absl::StrCat(
          "this optimizer step (learning rate ", lr, ") would make ", p.name,
          " non-finite; nothing was changed (the gradients are kept): lower the learning rate or "
          "GetGradients(zero) to drop them"));
    }
  }
  for (size_t i = 0; i < m->params.size(); ++i) {
    m->params[i].value.copy_(values[i]);  // in place: the device copy may alias it
    m->params[i].slots = std::move(slots[i]);
    m->ZeroGrad(m->params[i]);
  }
  m->optimizer_steps = step;
  m->accumulated_backwards = 0;
  modules_.Renew(*m);
  return ++m->version;
}

absl::StatusOr<EncodedParameters> ParameterStore::GetGradients(const std::string& module_id,
                                                               bool zero, wire::DType dtype) {
  GW_ASSIGN_OR_RETURN(auto m, modules_.Find(module_id));
  std::vector<std::pair<std::string, at::Tensor>> copies;
  EncodedParameters out;
  {
    std::lock_guard<std::mutex> lock(m->mu);
    for (Module::Parameter& p : m->params) {
      copies.emplace_back(p.name, p.grad.grad.to(at::kCPU, at::kFloat, false, /*copy=*/true));
      if (zero) m->ZeroGrad(p);
    }
    out.weight_version = m->version;
    out.accumulated_backwards = m->accumulated_backwards;
    if (zero) m->accumulated_backwards = 0;
  }
  for (const auto& [name, t] : copies) out.tensors.emplace_back(name, EncodeHost(t, dtype));
  modules_.Renew(*m);
  return out;
}

}  // namespace gradwire::core
