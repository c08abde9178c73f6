// Server-side optimizers over fp32 master weights. Formulas follow the usual definitions
// (PyTorch's SGD with momentum/dampening-free, and decoupled-weight-decay AdamW).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "server/core/optimizer_config.h"

namespace gradwire::core {

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
