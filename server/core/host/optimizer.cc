#include "server/core/host/optimizer.h"

#include <ATen/ATen.h>

#include <cmath>

namespace gradwire::core {
namespace {

void Sgd(const SgdConfig& c, float lr, at::Tensor& weight, const at::Tensor& grad,
         OptimizerSlots& slots) {
  float* w = weight.data_ptr<float>();
  const float* g = grad.data_ptr<float>();
  const int64_t n = weight.numel();
  const bool first_step = !slots.first.defined();
  if (c.momentum != 0.0f && first_step) slots.first = at::zeros_like(weight);
  float* buf = c.momentum != 0.0f ? slots.first.data_ptr<float>() : nullptr;
  for (int64_t i = 0; i < n; ++i) {
    float d = g[i] + c.weight_decay * w[i];
    if (buf) {
      buf[i] = first_step ? d : c.momentum * buf[i] + d;
      d = c.nesterov ? d + c.momentum * buf[i] : buf[i];
    }
    w[i] -= lr * d;
  }
}

void AdamW(const AdamWConfig& c, float lr, int64_t step, at::Tensor& weight, const at::Tensor& grad,
           OptimizerSlots& slots) {
  if (!slots.first.defined()) {
    slots.first = at::zeros_like(weight);
    slots.second = at::zeros_like(weight);
  }
  float* w = weight.data_ptr<float>();
  const float* g = grad.data_ptr<float>();
  float* m = slots.first.data_ptr<float>();
  float* v = slots.second.data_ptr<float>();
  const double correction1 = 1.0 - std::pow(double(c.beta1), double(step));
  const double correction2 = 1.0 - std::pow(double(c.beta2), double(step));
  const float step_size = float(lr / correction1);
  const float sqrt_correction2 = float(std::sqrt(correction2));
  for (int64_t i = 0, n = weight.numel(); i < n; ++i) {
    w[i] *= 1.0f - lr * c.weight_decay;
    m[i] = c.beta1 * m[i] + (1.0f - c.beta1) * g[i];
    v[i] = c.beta2 * v[i] + (1.0f - c.beta2) * g[i] * g[i];
    const float denom = std::sqrt(v[i]) / sqrt_correction2 + c.eps;
    w[i] -= step_size * m[i] / denom;
  }
}

}  // namespace

OptimizerSlots OptimizerSlots::Clone() const {
  return {first.defined() ? first.clone() : at::Tensor(),
          second.defined() ? second.clone() : at::Tensor()};
}

bool OptimizerSlots::AllFinite() const {
  for (const at::Tensor* t : {&first, &second}) {
    if (t->defined() && !at::isfinite(*t).all().item<bool>()) return false;
  }
  return true;
}

void OptimizerStep(const OptimizerConfig& config, float learning_rate, int64_t step,
                   at::Tensor& weight, const at::Tensor& grad, OptimizerSlots& slots) {
  if (config.kind == OptimizerConfig::Kind::kSgd) {
    Sgd(config.sgd, learning_rate, weight, grad, slots);
  } else {
    AdamW(config.adamw, learning_rate, step, weight, grad, slots);
  }
}

}  // namespace gradwire::core
