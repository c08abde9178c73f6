// Server-side optimizers over fp32 master weights. Formulas follow the usual definitions
// (PyTorch's SGD with momentum/dampening-free, and decoupled-weight-decay AdamW).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace gradwire::core {

struct SgdConfig {
  float learning_rate = 0.01f;
  float momentum = 0.0f;      // 0: plain SGD
  float weight_decay = 0.0f;  // L2, added to the gradient
  bool nesterov = false;
};

struct AdamWConfig {
  float learning_rate = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.01f;  // decoupled: w -= lr * wd * w
};

struct OptimizerConfig {
  enum class Kind { kSgd, kAdamW } kind = Kind::kSgd;
  SgdConfig sgd;
  AdamWConfig adamw;
  float learning_rate() const {
    return kind == Kind::kSgd ? sgd.learning_rate : adamw.learning_rate;
  }
};

// Per-parameter optimizer state: the momentum buffer (SGD) or the two moments (AdamW).
struct OptimizerSlots {
  at::Tensor first;   // SGD momentum buffer / AdamW exp_avg; undefined until the first step
  at::Tensor second;  // AdamW exp_avg_sq
  OptimizerSlots Clone() const;
  bool AllFinite() const;  // every defined slot
};

// One step on `weight` (float32, contiguous) from `grad`. `step` counts from 1 (AdamW's bias
// correction); `learning_rate` overrides the configured rate.
void OptimizerStep(const OptimizerConfig& config, float learning_rate, int64_t step,
                   at::Tensor& weight, const at::Tensor& grad, OptimizerSlots& slots);

}  // namespace gradwire::core
