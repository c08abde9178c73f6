// What every backend shares: fresh fp32 tensors on its device.
#include "server/device/backend.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <stdexcept>
#include <vector>

namespace gradwire::device {

at::Tensor Backend::Empty(at::IntArrayRef shape) const {
  return at::empty(shape, at::TensorOptions().dtype(at::kFloat).device(device()));
}

at::Tensor Backend::Zeros(at::IntArrayRef shape) const {
  return at::zeros(shape, at::TensorOptions().dtype(at::kFloat).device(device()));
}

void Backend::FpropInto(const Fp8Tensor& x, const Fp8Tensor& w, const at::Tensor& bias,
                        at::Tensor& y) const {
  y.copy_(Fprop(x, w, bias));
}

void Backend::DgradInto(const Fp8Tensor& dy, const Fp8Tensor& w, at::Tensor& dx) const {
  dx.copy_(Dgrad(dy, w));
}

bool Backend::Supports(Op op) const { return !device::Describe(op).has_default; }

at::Tensor Backend::FpropGroups(const Fp8Tensor& x, const Fp8Tensor& w,
                                const at::Tensor& bias) const {
  std::vector<at::Tensor> parts;
  parts.reserve(x.groups.size());
  for (const Fp8Tensor& g : x.groups) parts.push_back(Fprop(g, w, bias));
  return parts.size() == 1 ? parts[0] : at::cat(parts, 0);
}

at::Tensor Backend::DgradGroups(const Fp8Tensor& dy, const Fp8Tensor& w) const {
  std::vector<at::Tensor> parts;
  parts.reserve(dy.groups.size());
  for (const Fp8Tensor& g : dy.groups) parts.push_back(Dgrad(g, w));
  return parts.size() == 1 ? parts[0] : at::cat(parts, 0);
}

CastScalars Backend::AbsMaxLater(const at::Tensor& x) const {
  return CastScalars(1.0f, 1.0f, AbsMax(x));
}

void Backend::RollScaling(ScalingTensors& s, const std::vector<int64_t>& roles,
                          const std::vector<float>& amaxes, kernels::Fp8Format format,
                          const RecipeConfig& config) const {
  if (roles.size() != amaxes.size()) {
    throw std::logic_error("RollScaling: one amax per role");
  }
  const bool host = s.history.device().is_cpu();
  ScalingTensors h =
      host ? s
           : ScalingTensors{s.history.to(at::kCPU).contiguous(), s.scale.to(at::kCPU).contiguous(),
                            s.scale_inv.to(at::kCPU).contiguous()};
  const int64_t n = h.history.size(0), len = h.history.size(1);
  if (len != std::max<int64_t>(1, config.history_len)) {
    throw std::logic_error("RollScaling: the history is not the recipe's length");
  }
  float* history = h.history.data_ptr<float>();
  float* scale = h.scale.data_ptr<float>();
  float* scale_inv = h.scale_inv.data_ptr<float>();
  for (size_t i = 0; i < roles.size(); ++i) {
    const int64_t role = roles[i];
    if (role < 0 || role >= n) throw std::logic_error("RollScaling: role out of range");
    // The whole zero-padded row as the history: zeros never change the roll's max, and the
    // oldest entry drops exactly as the shift of a full row does.
    float* row = history + role * len;
    ScalingState state(format, config);
    state.Set(std::deque<float>(row, row + len), scale[role]);
    state.Record(amaxes[i]);
    state.Roll();
    std::copy(state.history().begin(), state.history().end(), row);
    scale[role] = state.scale();
  }
  for (int64_t i = 0; i < n; ++i) scale_inv[i] = 1.0f / scale[i];
  if (!host) {
    s.history.copy_(h.history);
    s.scale.copy_(h.scale);
    s.scale_inv.copy_(h.scale_inv);
  }
}

at::Tensor Backend::Widen(const at::Tensor& x) const {
  return x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
}

at::Tensor Backend::NarrowBf16(const at::Tensor& x) const { return x.to(at::kBFloat16); }

at::Tensor Backend::FpropBf16(const Fp8Tensor& x, const Fp8Tensor& w,
                              const at::Tensor& bias) const {
  return NarrowBf16(Fprop(x, w, bias));
}

wire::EncodedTensor Backend::ToWireScaled(const at::Tensor& x, wire::DType dtype,
                                          std::vector<int64_t> shape,
                                          wire::Fp8Scaling scaling) const {
  if (!wire::IsFp8(dtype) || scaling.block <= 0) return ToWire(x, dtype, std::move(shape));
  const at::Tensor host = ToHost(x.to(at::kFloat)).contiguous();
  return wire::Encode(host.data_ptr<float>(), std::move(shape), dtype, scaling);
}

at::Tensor HostFromBlockScaledWire(const wire::TensorView& v, int64_t rows, int64_t cols,
                                   Fp8Tensor* codes, CastUsage usage) {
  if (codes != nullptr) *codes = FromBlockCodes(v, rows, cols, usage);
  at::Tensor out = at::empty({rows, cols}, at::TensorOptions().dtype(at::kFloat));
  wire::DecodeView(v, out.data_ptr<float>());
  return out;
}

at::Tensor Backend::FromWireBf16(const wire::TensorView& v, int64_t rows, int64_t cols) const {
  if (v.dtype != wire::DType::kBF16 || rows * cols != v.numel()) {
    throw std::logic_error("FromWireBf16: not a bf16 view of rows x cols");
  }
  const auto options = at::TensorOptions().dtype(at::kBFloat16);
  at::Tensor host;
  if (reinterpret_cast<uintptr_t>(v.data) % 2 == 0) {
    host = at::from_blob(const_cast<void*>(v.data), {rows, cols}, options);
  } else {  // protobuf keeps no alignment promise: one aligned copy
    host = at::empty({rows, cols}, options);
    std::memcpy(host.data_ptr(), v.data, size_t(rows * cols) * 2);
  }
  return ToDevice(host);
}

absl::StatusOr<Fp8Tensor> Backend::LayerNormCast(const at::Tensor& x, const LayerNormParams& ln,
                                                 const QuantizerConfig& config, CastUsage usage,
                                                 bool keep_y, LayerNormOut* ln_out) const {
  LayerNormOut out = LayerNormForward(x, ln);
  absl::StatusOr<Fp8Tensor> cast = Cast(out.y, config, usage);
  if (!keep_y) out.y = at::Tensor();
  if (ln_out != nullptr) *ln_out = std::move(out);
  return cast;
}

absl::StatusOr<Fp8Tensor> Backend::ActivationCast(kernels::Activation act, const at::Tensor& in,
                                                  int64_t width, const QuantizerConfig& config,
                                                  CastUsage usage, at::Tensor* y) const {
  at::Tensor out = ActivationForward(act, in, width);
  absl::StatusOr<Fp8Tensor> cast = Cast(out, config, usage);
  if (y != nullptr) *y = std::move(out);
  return cast;
}

absl::StatusOr<Fp8Tensor> Backend::DActivationCast(kernels::Activation act, const at::Tensor& dout,
                                                   const at::Tensor& in, int64_t width,
                                                   const QuantizerConfig& config, CastUsage usage,
                                                   at::Tensor* din) const {
  at::Tensor out = ActivationBackward(act, dout, in, width);
  absl::StatusOr<Fp8Tensor> cast = Cast(out, config, usage);
  if (din != nullptr) *din = std::move(out);
  return cast;
}

namespace {
std::atomic<int64_t> cuda_staging{-1};  // -1: not set, read the environment
}  // namespace

void SetCudaStaging(int64_t chunk_bytes) { cuda_staging = std::max<int64_t>(chunk_bytes, 0); }

int64_t CudaStaging() {
  int64_t v = cuda_staging.load();
  if (v >= 0) return v;
  const char* env = std::getenv("GRADWIRE_CUDA_STAGING_MIB");
  v = env != nullptr ? std::clamp<int64_t>(std::atoll(env), 0, 1024) << 20 : 0;
  cuda_staging = v;
  return v;
}

}  // namespace gradwire::device
