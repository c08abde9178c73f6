#include "server/device/scaling_state.h"

#include <algorithm>
#include <cmath>

namespace gradwire::device {

ScalingState::ScalingState(kernels::Fp8Format format, const RecipeConfig& config)
    : format_(format), config_(config) {}

QuantizerConfig ScalingState::Quantizer() const {
  QuantizerConfig q;
  q.format = format_;
  q.margin = config_.margin;
  q.scale = config_.mode == ScalingMode::kDelayed ? scale_ : 0.0f;
  return q;
}

void ScalingState::Record(float amax) {
  // The step's amax is the largest of its casts; a NaN sticks (the roll then keeps the scale).
  if (!recorded_ || std::isnan(amax) || amax > pending_) pending_ = amax;
  recorded_ = true;
}

void ScalingState::Roll() {
  if (!recorded_) return;  // no cast this step, nothing to learn
  history_.push_front(pending_);
  while (int64_t(history_.size()) > std::max<int64_t>(1, config_.history_len)) {
    history_.pop_back();
  }
  float amax = pending_;
  if (config_.algo == AmaxAlgo::kMax) {
    for (float a : history_) amax = std::isnan(a) || a > amax ? a : amax;
  }
  if (amax > 0.0f && std::isfinite(amax)) {
    scale_ = kernels::ComputeScale(amax, format_, config_.margin);
  }
  pending_ = 0.0f;
  recorded_ = false;
}

void ScalingState::Set(std::deque<float> history, float scale) {
  history_ = std::move(history);
  scale_ = scale;
  pending_ = 0.0f;
  recorded_ = false;
}

}  // namespace gradwire::device
