#include "server/device/device_scaling.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <stdexcept>

namespace gradwire::device {

DeviceScaling::DeviceScaling(const Backend& backend, std::vector<kernels::Fp8Format> formats,
                             const RecipeConfig& config)
    : backend_(&backend),
      formats_(std::move(formats)),
      config_(config),
      filled_(formats_.size(), 0) {
  const int64_t n = int64_t(formats_.size());
  const int64_t len = std::max<int64_t>(1, config_.history_len);
  tensors_.history = backend.Zeros({n, len});
  tensors_.scale = backend.Zeros({n});
  tensors_.scale.fill_(1.0f);
  tensors_.scale_inv = backend.Zeros({n});
  tensors_.scale_inv.fill_(1.0f);
}

DeviceScaling DeviceScaling::Copy() const {
  DeviceScaling copy = *this;
  copy.tensors_ = {tensors_.history.clone(), tensors_.scale.clone(), tensors_.scale_inv.clone()};
  return copy;
}

at::Tensor DeviceScaling::Scale(size_t role) const {
  if (role >= formats_.size()) throw std::logic_error("DeviceScaling: role out of range");
  return tensors_.scale.narrow(0, int64_t(role), 1);
}

void DeviceScaling::Step(const std::vector<std::pair<size_t, float>>& amaxes) {
  std::vector<bool> seen(formats_.size(), false);
  for (const auto& [role, amax] : amaxes) {
    if (role >= formats_.size()) throw std::logic_error("DeviceScaling: role out of range");
    if (seen[role]) throw std::logic_error("DeviceScaling::Step: a role stepped twice in one step");
    seen[role] = true;
  }
  // The roles of each format in one call.
  for (kernels::Fp8Format format : {kernels::Fp8Format::kE4M3, kernels::Fp8Format::kE5M2}) {
    std::vector<int64_t> roles;
    std::vector<float> values;
    for (const auto& [role, amax] : amaxes) {
      if (formats_[role] != format) continue;
      roles.push_back(int64_t(role));
      values.push_back(amax);
    }
    if (roles.empty()) continue;
    backend_->RollScaling(tensors_, roles, values, format, config_);
    for (int64_t role : roles) {
      filled_[size_t(role)] = std::min(filled_[size_t(role)] + 1, tensors_.history.size(1));
    }
  }
}

std::vector<DeviceScaling::HostView> DeviceScaling::Read() const {
  const at::Tensor history = backend_->ToHost(tensors_.history);
  const at::Tensor scale = backend_->ToHost(tensors_.scale);
  const at::Tensor scale_inv = backend_->ToHost(tensors_.scale_inv);
  const int64_t len = history.size(1);
  std::vector<HostView> out(formats_.size());
  for (size_t i = 0; i < out.size(); ++i) {
    const float* row = history.data_ptr<float>() + int64_t(i) * len;
    out[i].scale = scale.data_ptr<float>()[i];
    out[i].scale_inv = scale_inv.data_ptr<float>()[i];
    out[i].history.assign(row, row + filled_[i]);
  }
  return out;
}

void DeviceScaling::Set(size_t role, const std::deque<float>& history, float scale) {
  if (role >= formats_.size()) throw std::logic_error("DeviceScaling: role out of range");
  const int64_t len = tensors_.history.size(1);
  const int64_t kept = std::min<int64_t>(int64_t(history.size()), len);
  at::Tensor row = at::zeros({len}, at::kFloat);
  std::copy(history.begin(), history.begin() + kept, row.data_ptr<float>());
  tensors_.history.select(0, int64_t(role)).copy_(backend_->ToDevice(row));
  tensors_.scale.narrow(0, int64_t(role), 1).fill_(scale);
  tensors_.scale_inv.narrow(0, int64_t(role), 1).fill_(1.0f / scale);
  filled_[role] = kept;
}

}  // namespace gradwire::device
