// What a client remembers to predict a response's size before it asks, so that it can pick the
// unary or the chunked call: each module's widths (from CreateModule and ListModules) and each
// training context's input size (= its grad_input's), and whether the exact wire sends a module's
// input as FP8. Thread-safe.
#pragma once

#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

#include "gradwire/client/kinds.h"
#include "gradwire/v1/module.pb.h"

namespace gradwire::client {

// A module's widths, as far as response sizes go.
struct ModuleShape {
  int64_t in = 0, out = 0, ffn = 0;
  bool layernorm_output = false;  // forward also returns the LayerNorm output
  bool gated = false;             // SWIGLU / GEGLU: fc1 is twice as wide
  bool fp8_input = false;         // the exact wire sends its input as E4M3 (ExactWireTakesFp8)
  int64_t fp8_block = 0;          // its FP8 tensors' row blocks (RecipeBlockLength; 0: none)
  // The exact wire's grad_output form (ExactWireGradForm) and whether it carries column sums (the
  // module has a bias).
  ExactGradForm fp8_grad = ExactGradForm::kNone;
  bool bias = false;
};

class ShapeCache {
 public:
  void Remember(const v1::ModuleInfo& info);
  std::optional<ModuleShape> Find(const std::string& module_id) const;
  // A training forward of `module_id` made `context_id` from an input of `grad_input_elements`
  // elements. Only the newest 65536 contexts are remembered: ones never consumed must not grow
  // this forever.
  void NoteContext(const std::string& context_id, const std::string& module_id,
                   int64_t grad_input_elements);
  // The elements noted for `context_id` (-1: unknown); forgets it unless `keep`.
  int64_t TakeContext(const std::string& context_id, bool keep);
  // The module noted for `context_id` ("" when unknown): a backward's route.
  std::string ModuleOfContext(const std::string& context_id) const;

 private:
  mutable std::mutex mu_;
  std::unordered_map<std::string, ModuleShape> modules_;
  struct NotedContext {
    std::string module_id;
    int64_t elements;
  };
  std::unordered_map<std::string, NotedContext> contexts_;
  std::deque<std::string> context_order_;  // oldest first, to bound contexts_
};

}  // namespace gradwire::client
