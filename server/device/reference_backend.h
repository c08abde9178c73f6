// The reference backend: the reference kernels (kernels/ref) on host tensors, single-threaded,
// through reference_ops.h. It defines the numerics every other backend is checked against
// (tests/core/backend_parity_test.cc). The CPU backend (cpu_backend.cc) derives from it and
// replaces what it runs faster; what it keeps (host tensors in and out, the dequantize, a cast it
// does not take) it inherits unchanged, and nothing here calls back into it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "server/device/backend.h"

namespace gradwire::device {

class ReferenceBackend : public Backend {
 public:
  const char* name() const override { return "reference"; }
  bool SumsColumnsInRowOrder() const override { return true; }  // kernels::ColumnSums
  at::Device device() const override;
  std::string Describe() const override {
    return "host CPU, reference FP8 kernels (single-threaded)";
  }
  // Its own NarrowBf16 (the wire codec's rounding); every other defaulted op is the default.
  bool Supports(Op op) const override { return op == Op::kNarrowBf16 || Backend::Supports(op); }

  at::Tensor ToDevice(const at::Tensor& t) const override;
  at::Tensor ToHost(const at::Tensor& t) const override { return ToDevice(t); }

  absl::StatusOr<Fp8Tensor> Cast(const at::Tensor& x, const QuantizerConfig& config,
                                 CastUsage usage) const override;
  Fp8Tensor FromCodes(const uint8_t* host_codes, int64_t rows, int64_t cols,
                      kernels::Fp8Format format, float scale_inv, CastUsage usage) const override;
  at::Tensor Dequantize(const Fp8Tensor& t, bool rowwise) const override;

  at::Tensor FromWire(const wire::TensorView& v, int64_t rows, int64_t cols, Fp8Tensor* codes,
                      CastUsage usage) const override;
  at::Tensor NarrowBf16(const at::Tensor& x) const override;
  wire::EncodedTensor ToWire(const at::Tensor& x, wire::DType dtype,
                             std::vector<int64_t> shape) const override;

  LayerNormOut LayerNormForward(const at::Tensor& x, const LayerNormParams& ln) const override;
  at::Tensor LayerNormBackward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mu,
                               const at::Tensor& rstd, const LayerNormParams& ln,
                               at::Tensor& gamma_grad, at::Tensor& beta_grad) const override;

  at::Tensor ActivationForward(kernels::Activation act, const at::Tensor& in,
                               int64_t width) const override;
  at::Tensor ActivationBackward(kernels::Activation act, const at::Tensor& dout,
                                const at::Tensor& in, int64_t width) const override;

  at::Tensor Fprop(const Fp8Tensor& x, const Fp8Tensor& w, const at::Tensor& bias) const override;
  at::Tensor Dgrad(const Fp8Tensor& dy, const Fp8Tensor& w) const override;
  void Wgrad(const Fp8Tensor& dy, const Fp8Tensor& x, at::Tensor& acc,
             bool accumulate) const override;
  void AccumulateBiasGrad(const at::Tensor& g, at::Tensor& acc) const override;
  float AbsMax(const at::Tensor& x) const override;
  float AddAbsMax(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) const override;

  void Synchronize() const override {}
};

}  // namespace gradwire::device
