// What an optimizer is configured with: plain values, shared with the rpc layer (module_spec.h).
// The step itself is optimizer.h's.
#pragma once

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

}  // namespace gradwire::core
