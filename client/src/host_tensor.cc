#include "gradwire/client/host_tensor.h"

#include <cmath>

#include "gradwire/wire/tensor.h"

namespace gradwire::client {

const HostTensor* NamedTensors::Find(const std::string& name) const {
  for (const auto& [n, t] : tensors) {
    if (n == name) return &t;
  }
  return nullptr;
}

int64_t HostTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return shape.empty() ? 0 : n;
}

HostTensor HostTensor::Zeros(std::vector<int64_t> shape) {
  HostTensor t;
  t.shape = std::move(shape);
  t.data.assign(size_t(t.numel()), 0.0f);
  return t;
}

const char* WireFormName(const WireForm& form) {
  return form.exact ? "exact" : wire::DTypeName(form.dtype);
}

WireDType ExactInputDType(const HostTensor& input, bool fp8_input) {
  if (!fp8_input || input.numel() == 0) return WireDType::kF32;
  // NaN propagates through the amax, and an infinity is its own: both stay F32, so the server
  // sees the values themselves and answers as it does on the F32 wire.
  const float amax = wire::AbsMax(input.data.data(), input.numel());
  return std::isfinite(amax) ? WireDType::kFp8E4M3 : WireDType::kF32;
}

v1::Tensor ToWire(const HostTensor& t, WireDType dtype) {
  v1::Tensor out;
  wire::EncodeToMessage(t.data.data(), t.shape, dtype, &out);
  return out;
}

absl::StatusOr<HostTensor> FromWire(const v1::Tensor& t) { return FromWire(t, t.data()); }

absl::StatusOr<HostTensor> FromWire(const v1::Tensor& t, absl::string_view data) {
  absl::StatusOr<wire::TensorView> view = wire::ViewOf(t, data, "response tensor");
  if (!view.ok()) return view.status();
  HostTensor out;
  out.shape = view->shape;
  out.data.resize(size_t(view->numel()));
  wire::DecodeElements(view->dtype, view->data, view->numel(), view->scale_inv, out.data.data());
  return out;
}

}  // namespace gradwire::client
