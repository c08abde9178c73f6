#include "server/device/quantizer.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "gradwire/kernels/cpu/loops.h"
#include "gradwire/kernels/ref/cast.h"

namespace gradwire::core {

float HostScale(const QuantizerConfig& config) {
  if (config.scale_of.has_value()) return config.scale_of->scale();
  if (!config.scale_device.defined()) return config.scale;
  const at::Tensor& s = config.scale_device;
  if (!s.device().is_cpu() || s.scalar_type() != at::kFloat || s.numel() != 1) {
    throw std::logic_error("a host cast was given a scale that is not one fp32 value on the host");
  }
  return *s.data_ptr<float>();
}

absl::StatusOr<Fp8Tensor> Quantize(const at::Tensor& x, const QuantizerConfig& config,
                                   CastUsage usage) {
  if (x.dim() != 2 || x.scalar_type() != at::kFloat || !x.is_contiguous() || !x.is_cpu()) {
    return absl::InternalError("Quantize expects a contiguous 2-D float32 CPU tensor");
  }
  if (!usage.rowwise && !usage.columnwise) {
    return absl::InternalError("Quantize asked for neither rowwise nor columnwise data");
  }
  Fp8Tensor out;
  out.format = config.format;
  out.rows = x.size(0);
  out.cols = x.size(1);
  const auto options = at::TensorOptions().dtype(at::kByte);
  if (usage.rowwise) out.rowwise = at::empty({out.rows, out.cols}, options);
  if (usage.columnwise) out.columnwise = at::empty({out.cols, out.rows}, options);
  const float* data = x.data_ptr<float>();
  uint8_t* rowwise = usage.rowwise ? out.rowwise.data_ptr<uint8_t>() : nullptr;
  uint8_t* columnwise = usage.columnwise ? out.columnwise.data_ptr<uint8_t>() : nullptr;
  if (GivenScale(config)) {  // delayed: the scale is given; amax comes out of the same pass
    const float given = HostScale(config);
    float amax = 0.0f;
    kernels::QuantizeFp8(data, out.rows, out.cols, given, config.format, rowwise, columnwise,
                         &amax);
    out.scalars = CastScalars(given, 1.0f / given, amax);
    return out;
  }
  const float amax = kernels::Amax(data, x.numel());
  const float scale = kernels::ComputeScale(amax, config.format, config.margin);
  out.scalars = CastScalars(scale, 1.0f / scale, amax);
  kernels::QuantizeFp8(data, out.rows, out.cols, scale, config.format, rowwise, columnwise,
                       nullptr);
  return out;
}

Fp8Tensor FromCodes(const uint8_t* codes, int64_t rows, int64_t cols, kernels::Fp8Format format,
                    float scale_inv, CastUsage usage) {
  Fp8Tensor out;
  out.format = format;
  out.rows = rows;
  out.cols = cols;
  const auto options = at::TensorOptions().dtype(at::kByte);
  const float* table = kernels::DecodeTable(format);
  // max |value| with NaN and inf kept (E5M2 has both, E4M3 a NaN): what a cast's amax would be,
  // so a caller can tell a non-finite input from it.
  uint32_t max_bits = 0;
  for (int64_t i = 0; i < rows * cols; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &table[codes[i]], sizeof bits);
    max_bits = std::max(max_bits, bits & 0x7FFFFFFFu);
  }
  out.scalars =
      CastScalars(1.0f / scale_inv, scale_inv, kernels::cpu::AbsMaxFromBits(max_bits) * scale_inv);
  if (usage.rowwise) {
    out.rowwise = at::empty({rows, cols}, options);
    std::memcpy(out.rowwise.data_ptr<uint8_t>(), codes, size_t(rows * cols));
  }
  if (usage.columnwise) {
    out.columnwise = at::empty({cols, rows}, options);
    uint8_t* t = out.columnwise.data_ptr<uint8_t>();
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) t[c * rows + r] = codes[r * cols + c];
    }
  }
  return out;
}

at::Tensor Dequantize(const Fp8Tensor& t, bool rowwise) {
  const at::Tensor& codes = rowwise ? t.rowwise : t.columnwise;
  at::Tensor out = at::empty(codes.sizes(), at::TensorOptions().dtype(at::kFloat));
  kernels::DequantizeFp8(codes.data_ptr<uint8_t>(), codes.numel(), t.scale_inv(), t.format,
                         out.data_ptr<float>());
  return out;
}

}  // namespace gradwire::core
