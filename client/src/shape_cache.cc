#include "gradwire/client/shape_cache.h"

#include "gradwire/client/kinds.h"

namespace gradwire::client {

void ShapeCache::Remember(const v1::ModuleInfo& info) {
  const v1::ModuleSpec& spec = info.spec();
  ModuleShape shape;
  shape.in = spec.in_features();
  shape.out = spec.out_features();
  shape.ffn = KindReads(spec.kind(), "ffn_features") ? spec.ffn_features() : 0;
  shape.layernorm_output =
      KindReads(spec.kind(), "return_layernorm_output") && spec.return_layernorm_output();
  shape.gated = spec.activation() == v1::SWIGLU || spec.activation() == v1::GEGLU;
  shape.fp8_input = ExactWireTakesFp8(spec);
  shape.fp8_block = RecipeBlockLength(spec);
  shape.fp8_grad = ExactWireGradForm(spec, info.row_order_bias_sums());
  shape.bias = spec.bias();
  std::lock_guard<std::mutex> lock(mu_);
  modules_[info.module_id()] = shape;
}

std::optional<ModuleShape> ShapeCache::Find(const std::string& module_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = modules_.find(module_id); it != modules_.end()) return it->second;
  return std::nullopt;
}

void ShapeCache::NoteContext(const std::string& context_id, const std::string& module_id,
                             int64_t grad_input_elements) {
  constexpr size_t kMaxRemembered = 1 << 16;
  std::lock_guard<std::mutex> lock(mu_);
  if (!contexts_.emplace(context_id, NotedContext{module_id, grad_input_elements}).second) return;
  context_order_.push_back(context_id);
  while (context_order_.size() > kMaxRemembered) {
    contexts_.erase(context_order_.front());
    context_order_.pop_front();
  }
}

int64_t ShapeCache::TakeContext(const std::string& context_id, bool keep) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = contexts_.find(context_id);
  if (it == contexts_.end()) return -1;
  const int64_t elements = it->second.elements;
  if (!keep) contexts_.erase(it);  // context_order_ keeps the id until it ages out: harmless
  return elements;
}

std::string ShapeCache::ModuleOfContext(const std::string& context_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = contexts_.find(context_id);
  return it == contexts_.end() ? std::string() : it->second.module_id;
}

}  // namespace gradwire::client
