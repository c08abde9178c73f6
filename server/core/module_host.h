// The module host: owns the modules, their fp32 master weights and gradient buffers, the FP8
// weight-workspace cache (outside the compute functions) and the saved-context store.
// Transport-free; thread-safe.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/core/context_store.h"

namespace gradwire::core {

enum class ModuleKind { kLinear };

struct ModuleSpec {
  ModuleKind kind = ModuleKind::kLinear;
  int64_t in_features = 0;
  int64_t out_features = 0;
  bool bias = true;
  int margin = 0;     // FP8 scale headroom in powers of two (current scaling)
  uint64_t seed = 0;  // deterministic initialisation
  std::string name;   // free-form label
};

struct ModuleInfo {
  std::string module_id;
  ModuleSpec spec;
  uint64_t weight_version = 0;
  int64_t live_contexts = 0;
};

struct ForwardOutput {
  at::Tensor output;       // float32 [..., out_features]
  std::string context_id;  // empty for inference
  uint64_t weight_version = 0;
};

struct WeightsCopy {
  at::Tensor weight;  // float32 [out_features, in_features]
  at::Tensor bias;    // float32 [out_features], undefined without bias
  uint64_t weight_version = 0;
};

struct HostStats {
  int64_t modules = 0;
  int64_t live_contexts = 0;
  int64_t context_bytes = 0;
  int64_t workspace_builds = 0;  // FP8 weight casts (cache misses)
  int64_t workspace_hits = 0;
};

class ModuleHost {
 public:
  // Largest in/out feature count a module may have.
  static constexpr int64_t kMaxFeatures = 1 << 16;

  ModuleHost();
  ~ModuleHost();

  // Validates `spec`, initialises weights from spec.seed: W and b uniform in
  // [-1/sqrt(in), 1/sqrt(in)) (the usual Linear initialisation), gradients zero, version 1.
  absl::StatusOr<ModuleInfo> Create(const ModuleSpec& spec);
  absl::StatusOr<ModuleInfo> Info(const std::string& module_id) const;
  std::vector<ModuleInfo> List() const;
  // Deletes the module and releases its contexts.
  absl::Status Delete(const std::string& module_id);

  // input: float32 [..., in_features] on the host. Training stores the saved tensors under a new
  // context id; inference creates nothing.
  absl::StatusOr<ForwardOutput> Forward(const std::string& module_id, const at::Tensor& input,
                                        bool training);
  // grad_output: float32, the shape of that forward's output. Accumulates dW (and db) into the
  // module's gradient buffers; the context is freed before this returns unless `retain`.
  // Returns grad_input [..., in_features], or an undefined tensor with skip_grad_input.
  absl::StatusOr<at::Tensor> Backward(const std::string& context_id, const at::Tensor& grad_output,
                                      bool retain, bool skip_grad_input);
  absl::Status ReleaseContext(const std::string& context_id);

  // w -= lr * dW (and b), zero the gradients, bump the weight version; returns the new version.
  absl::StatusOr<uint64_t> ApplySgd(const std::string& module_id, float learning_rate);
  absl::StatusOr<WeightsCopy> GetWeights(const std::string& module_id) const;
  // Replaces the weights (float32; bias iff the module has one); returns the new version.
  absl::StatusOr<uint64_t> SetWeights(const std::string& module_id, const at::Tensor& weight,
                                      const at::Tensor& bias);

  HostStats Stats() const;
  const ContextStore& contexts() const { return contexts_; }

 private:
  struct Module;
  absl::StatusOr<std::shared_ptr<Module>> Find(const std::string& module_id) const;
  ModuleInfo InfoLocked(const std::string& id, const Module& m) const;

  mutable std::mutex mu_;  // guards modules_ (each Module has its own lock)
  std::map<std::string, std::shared_ptr<Module>> modules_;
  ContextStore contexts_;
  std::atomic<int64_t> workspace_builds_{0};
  std::atomic<int64_t> workspace_hits_{0};
};

}  // namespace gradwire::core
