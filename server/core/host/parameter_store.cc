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
  ModuleGradients& grads = m->gradients;
  const int64_t step = grads.optimizer_steps + 1;
  std::vector<at::Tensor> values;
  std::vector<OptimizerSlots> slots;
  for (size_t i = 0; i < m->weights.list.size(); ++i) {
    const ModuleWeights::Weight& p = m->weights.list[i];
    const ModuleGradients::Entry& g = grads.list[i];
    values.push_back(p.value.clone());
    slots.push_back(g.slots.Clone());
    OptimizerStep(m->spec.optimizer, lr, step, values.back(), backend_.ToHost(g.grad.grad),
                  slots.back());
    if (!AllFinite(values.back()) || !slots.back().AllFinite()) {
      return absl::OutOfRangeError(absl::StrCat(
          "this optimizer step (learning rate ", lr, ") would make ", p.name,
          " non-finite; nothing was changed (the gradients are kept): lower the learning rate or "
          "GetGradients(zero) to drop them"));
    }
  }
  for (size_t i = 0; i < m->weights.list.size(); ++i) {
    m->weights.list[i].value.copy_(values[i]);  // in place: the device copy may alias it
    grads.list[i].slots = std::move(slots[i]);
  }
  grads.ZeroAll();
  grads.optimizer_steps = step;
  modules_.Renew(*m);
  return ++m->weights.version;
}

absl::StatusOr<EncodedParameters> ParameterStore::GetGradients(const std::string& module_id,
                                                               bool zero, wire::DType dtype) {
  GW_ASSIGN_OR_RETURN(auto m, modules_.Find(module_id));
  std::vector<std::pair<std::string, at::Tensor>> copies;
  EncodedParameters out;
  {
    std::lock_guard<std::mutex> lock(m->mu);
    ModuleGradients& grads = m->gradients;
    for (size_t i = 0; i < grads.list.size(); ++i) {
      copies.emplace_back(m->weights.list[i].name,
                          grads.list[i].grad.grad.to(at::kCPU, at::kFloat, false, /*copy=*/true));
      if (zero) grads.Zero(grads.list[i]);
    }
    out.weight_version = m->weights.version;
    out.accumulated_backwards = grads.accumulated_backwards;
    if (zero) grads.accumulated_backwards = 0;
  }
  for (const auto& [name, t] : copies) out.tensors.emplace_back(name, EncodeHost(t, dtype));
  modules_.Renew(*m);
  return out;
}

}  // namespace gradwire::core
