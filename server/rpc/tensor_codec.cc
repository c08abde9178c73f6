#include "server/rpc/tensor_codec.h"

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gradwire/kernels/dtype.h"
#include "gradwire/kernels/quantize.h"
#include "gradwire/wire/chunking.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the wire format is little-endian; this host would need byte swaps");

namespace gradwire::rpc {
namespace {

at::TensorOptions Float32() { return at::TensorOptions().dtype(at::kFloat); }

}  // namespace

absl::StatusOr<at::Tensor> DecodeTensor(const v1::Tensor& t, absl::string_view field) {
  absl::StatusOr<int64_t> expected = wire::DataBytes(t, field);
  if (!expected.ok()) return expected.status();
  const int64_t expected_bytes = *expected;
  const int64_t numel = expected_bytes / wire::ElementSize(t.dtype());
  const std::vector<int64_t> shape(t.shape().begin(), t.shape().end());
  if (int64_t(t.data().size()) != expected_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".data has ", t.data().size(), " bytes; shape [", absl::StrJoin(shape, ", "),
        "] of ", v1::DType_Name(t.dtype()), " needs ", expected_bytes));
  }
  const bool fp8 = t.dtype() == v1::FP8_E4M3 || t.dtype() == v1::FP8_E5M2;
  if (fp8 && !(std::isfinite(t.scale_inv()) && t.scale_inv() > 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".scale_inv must be finite and > 0 for FP8 data, got ", t.scale_inv()));
  }
  const void* bytes = t.data().data();
  if (t.dtype() == v1::F32) {
    if (reinterpret_cast<uintptr_t>(bytes) % alignof(float) == 0) {
      // Borrow the request's bytes: no copy on the hot path.
      return at::from_blob(const_cast<void*>(bytes), shape, Float32());
    }
    at::Tensor out = at::empty(shape, Float32());
    std::memcpy(out.data_ptr<float>(), bytes, size_t(expected_bytes));
    return out;
  }
  at::Tensor out = at::empty(shape, Float32());
  float* dst = out.data_ptr<float>();
  if (t.dtype() == v1::BF16 || t.dtype() == v1::F16) {
    std::vector<uint16_t> bits(
        static_cast<size_t>(numel));  // the bytes may be unaligned for uint16_t
    std::memcpy(bits.data(), bytes, size_t(expected_bytes));
    if (t.dtype() == v1::BF16) {
      kernels::Bf16ToFloat(bits.data(), numel, dst);
    } else {
      kernels::HalfToFloat(bits.data(), numel, dst);
    }
  } else {
    const auto format =
        t.dtype() == v1::FP8_E4M3 ? kernels::Fp8Format::kE4M3 : kernels::Fp8Format::kE5M2;
    kernels::DequantizeFp8(reinterpret_cast<const uint8_t*>(bytes), numel, t.scale_inv(), format,
                           dst);
  }
  return out;
}

absl::Status CheckOutputDType(v1::DType dtype, absl::string_view field) {
  switch (dtype) {
    case v1::DTYPE_UNSPECIFIED:
    case v1::F32:
    case v1::BF16:
    case v1::F16:
    case v1::FP8_E4M3:
    case v1::FP8_E5M2:
      return absl::OkStatus();
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          field, " must be F32, BF16, F16, FP8_E4M3 or FP8_E5M2 (or unset for F32), got ",
          v1::DType_Name(dtype).empty() ? std::to_string(int(dtype)) : v1::DType_Name(dtype)));
  }
}

absl::Status EncodeTensor(const at::Tensor& t, v1::DType dtype, absl::string_view field,
                          v1::Tensor* out) {
  if (auto s = CheckOutputDType(dtype, field); !s.ok()) return s;
  if (dtype == v1::DTYPE_UNSPECIFIED) dtype = v1::F32;
  const at::Tensor src = t.to(at::kFloat).contiguous();
  const int64_t n = src.numel();
  out->set_dtype(dtype);
  out->mutable_shape()->Assign(src.sizes().begin(), src.sizes().end());
  std::string* data = out->mutable_data();
  data->resize(size_t(n * wire::ElementSize(dtype)));
  const float* p = src.data_ptr<float>();
  if (dtype == v1::F32) {
    std::memcpy(data->data(), p, size_t(n) * sizeof(float));
  } else if (dtype == v1::FP8_E4M3 || dtype == v1::FP8_E5M2) {
    // Current scaling of this tensor alone; the scale_inv travels with the codes.
    const auto format =
        dtype == v1::FP8_E4M3 ? kernels::Fp8Format::kE4M3 : kernels::Fp8Format::kE5M2;
    const float scale = kernels::ComputeScale(kernels::Amax(p, n), format, 0);
    kernels::QuantizeFp8(p, 1, n, scale, format, reinterpret_cast<uint8_t*>(data->data()), nullptr,
                         nullptr);
    out->set_scale_inv(1.0f / scale);
  } else {
    std::vector<uint16_t> bits(static_cast<size_t>(n));
    if (dtype == v1::BF16) {
      kernels::FloatToBf16(p, n, bits.data());
    } else {
      kernels::FloatToHalf(p, n, bits.data());
    }
    std::memcpy(data->data(), bits.data(), bits.size() * sizeof(uint16_t));
  }
  return absl::OkStatus();
}

}  // namespace gradwire::rpc
