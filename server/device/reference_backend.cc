#include "server/device/reference_backend.h"

#include <ATen/ATen.h>

#include <memory>

#include "gradwire/kernels/ref/activation.h"
#include "gradwire/kernels/ref/cast.h"
#include "server/device/reference_ops.h"

namespace gradwire::device {

at::Device ReferenceBackend::device() const { return at::kCPU; }

at::Tensor ReferenceBackend::ToDevice(const at::Tensor& t) const {
  return t.device().is_cpu() ? t.contiguous() : t.to(at::kCPU).contiguous();
}

absl::StatusOr<Fp8Tensor> ReferenceBackend::Cast(const at::Tensor& x, const QuantizerConfig& config,
                                                 CastUsage usage) const {
  // bfloat16 widens to fp32 exactly: its cast is that of the widened values.
  if (x.scalar_type() == at::kBFloat16) return Quantize(x.to(at::kFloat), config, usage);
  return Quantize(x, config, usage);
}

Fp8Tensor ReferenceBackend::FromCodes(const uint8_t* host_codes, int64_t rows, int64_t cols,
                                      kernels::Fp8Format format, float scale_inv,
                                      CastUsage usage) const {
  return device::FromCodes(host_codes, rows, cols, format, scale_inv, usage);
}

at::Tensor ReferenceBackend::Dequantize(const Fp8Tensor& t, bool rowwise) const {
  return device::Dequantize(t, rowwise);
}

at::Tensor ReferenceBackend::FromWire(const wire::TensorView& v, int64_t rows, int64_t cols,
                                      Fp8Tensor* codes, CastUsage usage) const {
  if (v.blocks.present()) return HostFromBlockScaledWire(v, rows, cols, codes, usage);
  if (wire::IsFp8(v.dtype) && codes != nullptr) {
    *codes = device::FromCodes(static_cast<const uint8_t*>(v.data), rows, cols,
                               Fp8FormatOf(v.dtype), v.scale_inv, usage);
  }
  // An aligned f32 request is borrowed: no copy on the hot path.
  at::Tensor out = BorrowF32(v, rows, cols);
  if (out.defined()) return out;
  out = Empty({rows, cols});
  wire::DecodeElements(v.dtype, v.data, v.numel(), v.scale_inv, out.data_ptr<float>());
  return out;
}

at::Tensor ReferenceBackend::NarrowBf16(const at::Tensor& x) const {
  const at::Tensor src = x.contiguous();
  at::Tensor out = at::empty(src.sizes(), at::TensorOptions().dtype(at::kBFloat16));
  wire::EncodeElements(src.data_ptr<float>(), src.numel(), wire::DType::kBF16, 1.0f,
                       out.data_ptr());
  return out;
}

wire::EncodedTensor ReferenceBackend::ToWire(const at::Tensor& x, wire::DType dtype,
                                             std::vector<int64_t> shape) const {
  if (x.scalar_type() == at::kBFloat16 && dtype == wire::DType::kBF16) {
    return Bf16AsItIs(x, std::move(shape));
  }
  const at::Tensor src = ToHost(x.to(at::kFloat));
  wire::EncodedTensor out = EncodedFor(dtype, std::move(shape), src.numel());
  out.scale_inv = wire::EncodeTensor(src.data_ptr<float>(), src.numel(), dtype, out.bytes.data());
  return out;
}

LayerNormOut ReferenceBackend::LayerNormForward(const at::Tensor& x,
                                                const LayerNormParams& ln) const {
  return RunLayerNorm(Widen(x), ln);  // a bf16 x as its exact widening
}

at::Tensor ReferenceBackend::LayerNormBackward(const at::Tensor& dy, const at::Tensor& x,
                                               const at::Tensor& mu, const at::Tensor& rstd,
                                               const LayerNormParams& ln, at::Tensor& gamma_grad,
                                               at::Tensor& beta_grad) const {
  return RunLayerNormBackward(dy, Widen(x), mu, rstd, ln, gamma_grad, beta_grad);
}

at::Tensor ReferenceBackend::ActivationForward(kernels::Activation act, const at::Tensor& in,
                                               int64_t width) const {
  at::Tensor out = Empty({in.size(0), width});
  kernels::ActivationForward(act, in.data_ptr<float>(), in.size(0), width, out.data_ptr<float>());
  return out;
}

at::Tensor ReferenceBackend::ActivationBackward(kernels::Activation act, const at::Tensor& dout,
                                                const at::Tensor& in, int64_t width) const {
  at::Tensor din = at::empty_like(in);
  kernels::ActivationBackward(act, dout.data_ptr<float>(), in.data_ptr<float>(), in.size(0), width,
                              din.data_ptr<float>());
  return din;
}

at::Tensor ReferenceBackend::Fprop(const Fp8Tensor& x, const Fp8Tensor& w,
                                   const at::Tensor& bias) const {
  return Fp8Fprop(x, w, bias);
}

at::Tensor ReferenceBackend::Dgrad(const Fp8Tensor& dy, const Fp8Tensor& w) const {
  return Fp8Dgrad(dy, w);
}

void ReferenceBackend::Wgrad(const Fp8Tensor& dy, const Fp8Tensor& x, at::Tensor& acc,
                             bool accumulate) const {
  Fp8Wgrad(dy, x, acc, accumulate);
}

void ReferenceBackend::AccumulateBiasGrad(const at::Tensor& g, at::Tensor& acc) const {
  device::AccumulateBiasGrad(g, acc);
}

float ReferenceBackend::AbsMax(const at::Tensor& x) const {
  return kernels::Amax(x.data_ptr<float>(), x.numel());
}

float ReferenceBackend::AddAbsMax(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) const {
  const float* pa = a.data_ptr<float>();
  const float* pb = b.data_ptr<float>();
  float* po = out.data_ptr<float>();
  for (int64_t i = 0; i < out.numel(); ++i) po[i] = pa[i] + pb[i];
  return kernels::Amax(po, out.numel());
}

BackendPtr MakeReferenceBackend() {
  static const BackendPtr reference = std::make_shared<ReferenceBackend>();
  return reference;
}

}  // namespace gradwire::device
