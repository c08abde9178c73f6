#include "gradwire/client/host_tensor.h"

#include <algorithm>
#include <cmath>

#include "gradwire/v1/service.pb.h"
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

WireDType ExactInputDType(const HostTensor& input, bool fp8_input, float* amax_out) {
  if (amax_out != nullptr) *amax_out = -1.0f;
  if (!fp8_input || input.numel() == 0) return WireDType::kF32;
  // NaN propagates through the amax, and an infinity is its own: both stay F32, so the server
  // sees the values themselves and answers as it does on the F32 wire.
  const float amax = wire::AbsMax(input.data.data(), input.numel());
  if (amax_out != nullptr) *amax_out = amax;
  return std::isfinite(amax) ? WireDType::kFp8E4M3 : WireDType::kF32;
}

TensorForm InputForm(const WireForm& form, const HostTensor& input, bool known, bool fp8_input,
                     int64_t block, bool training) {
  if (form.exact) {
    TensorForm f;
    f.dtype = ExactInputDType(input, known && fp8_input, &f.amax);
    if (wire::IsFp8(f.dtype)) f.scaling = {block, training && block > 0};
    return f;
  }
  TensorForm f{form.dtype, {}};
  if (wire::IsFp8(f.dtype) && known) f.scaling = {block, false};
  return f;
}

TensorForm GradientForm(const WireForm& form, int64_t block) {
  if (form.exact) return {};
  TensorForm f{form.dtype, {}};
  if (wire::IsFp8(f.dtype)) f.scaling = {block, false};
  return f;
}

TensorForm GradOutputForm(const WireForm& form, const HostTensor& grad, ExactGradForm exact,
                          bool column_sums, int64_t block) {
  if (!form.exact) return GradientForm(form, block);
  TensorForm f;
  if (exact == ExactGradForm::kNone || grad.numel() == 0) return f;
  // A NaN or an infinity stays F32, so the server sees the values themselves and answers as it
  // does on the F32 wire.
  const float amax = wire::AbsMax(grad.data.data(), grad.numel());
  if (!std::isfinite(amax)) return f;
  if (column_sums) {
    f.column_sums = ColumnSums(grad);
    for (float s : f.column_sums) {
      if (!std::isfinite(s)) return TensorForm{};  // overflow: the F32 wire's answer
    }
  }
  f.amax = amax;
  f.dtype = exact == ExactGradForm::kE4M3 ? WireDType::kFp8E4M3 : WireDType::kFp8E5M2;
  f.scaling = {block, block > 0};
  return f;
}

std::vector<float> ColumnSums(const HostTensor& t) {
  const int64_t cols = t.shape.empty() ? 0 : t.shape.back();
  std::vector<float> sums(size_t(std::max<int64_t>(cols, 0)), 0.0f);
  if (cols <= 0) return sums;
  const int64_t rows = t.numel() / cols;
  const float* x = t.data.data();
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * cols;
    for (int64_t c = 0; c < cols; ++c) sums[size_t(c)] += row[c];
  }
  return sums;
}

void SetColumnSums(const TensorForm& form, v1::BackwardRequest* req) {
  req->clear_grad_output_column_sums();
  req->mutable_grad_output_column_sums()->Add(form.column_sums.begin(), form.column_sums.end());
}

v1::Tensor ToWire(const HostTensor& t, const TensorForm& form) {
  v1::Tensor out;
  wire::EncodeToMessage(t.data.data(), t.shape, form.dtype, &out, form.scaling, form.amax);
  return out;
}

v1::Tensor ToWire(const HostTensor& t, WireDType dtype, wire::Fp8Scaling scaling) {
  v1::Tensor out;
  wire::EncodeToMessage(t.data.data(), t.shape, dtype, &out, scaling);
  return out;
}

absl::StatusOr<HostTensor> FromWire(const v1::Tensor& t) { return FromWire(t, t.data()); }

absl::StatusOr<HostTensor> FromWire(const v1::Tensor& t, absl::string_view data) {
  absl::StatusOr<wire::TensorView> view = wire::ViewOf(t, data, "response tensor");
  if (!view.ok()) return view.status();
  HostTensor out;
  out.shape = view->shape;
  out.data.resize(size_t(view->numel()));
  wire::DecodeView(*view, out.data.data());
  return out;
}

}  // namespace gradwire::client
