#include "gradwire/wire/tensor.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gradwire/wire/chunking.h"

namespace gradwire::wire {
namespace {

std::string ProtoName(v1::DType dtype) {
  const std::string& name = v1::DType_Name(dtype);
  return name.empty() ? std::to_string(int(dtype)) : name;
}

#define GW_WIRE_RETURN_IF_ERROR(expr) \
  do {                                \
    absl::Status _s = (expr);         \
    if (!_s.ok()) return _s;          \
  } while (false)

// The scales of `b` (sizes checked by DataBytes) copied out, each finite and > 0.
absl::Status ScalesOf(const v1::BlockScales& b, absl::string_view field, const char* name,
                      BlockScales* out) {
  out->block_rows = b.block_rows();
  out->block_cols = b.block_cols();
  out->scale_inv.resize(b.scale_inv().size() / sizeof(float));
  std::memcpy(out->scale_inv.data(), b.scale_inv().data(), out->scale_inv.size() * sizeof(float));
  for (size_t i = 0; i < out->scale_inv.size(); ++i) {
    const float s = out->scale_inv[i];
    if (!(std::isfinite(s) && s > 0.0f)) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".", name, ".scale_inv[", i, "] must be finite and > 0, got ", s));
    }
  }
  return absl::OkStatus();
}

}  // namespace

v1::DType ToProto(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return v1::F32;
    case DType::kBF16:
      return v1::BF16;
    case DType::kF16:
      return v1::F16;
    case DType::kFp8E4M3:
      return v1::FP8_E4M3;
    case DType::kFp8E5M2:
      return v1::FP8_E5M2;
  }
  return v1::DTYPE_UNSPECIFIED;
}

absl::StatusOr<DType> FromProto(v1::DType dtype, absl::string_view field) {
  switch (dtype) {
    case v1::F32:
      return DType::kF32;
    case v1::BF16:
      return DType::kBF16;
    case v1::F16:
      return DType::kF16;
    case v1::FP8_E4M3:
      return DType::kFp8E4M3;
    case v1::FP8_E5M2:
      return DType::kFp8E5M2;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          field, " must be one of F32, BF16, F16, FP8_E4M3, FP8_E5M2, got ", ProtoName(dtype)));
  }
}

absl::StatusOr<DType> OutputDType(v1::DType dtype, absl::string_view field) {
  if (dtype == v1::DTYPE_UNSPECIFIED) return DType::kF32;
  auto d = FromProto(dtype, field);
  if (!d.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " must be F32, BF16, F16, FP8_E4M3 or FP8_E5M2 (or unset for F32), got ",
        ProtoName(dtype)));
  }
  return d;
}

absl::StatusOr<TensorView> ViewOf(const v1::Tensor& t, absl::string_view field) {
  return ViewOf(t, t.data(), field);
}

absl::StatusOr<TensorView> ViewOf(const v1::Tensor& t, absl::string_view data,
                                  absl::string_view field) {
  if (t.has_shared_memory()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".shared_memory: this call takes tensors with their bytes in data"));
  }
  absl::StatusOr<int64_t> expected = DataBytes(t, field);
  if (!expected.ok()) return expected.status();
  TensorView view;
  view.shape.assign(t.shape().begin(), t.shape().end());
  if (int64_t(data.size()) != *expected) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".data has ", data.size(), " bytes; shape [", absl::StrJoin(view.shape, ", "),
        "] of ", v1::DType_Name(t.dtype()), " needs ", *expected));
  }
  view.dtype = *FromProto(t.dtype(), field);  // DataBytes accepted it
  if (t.has_block_scales()) {  // DataBytes checked the block shapes and the grids' sizes
    GW_WIRE_RETURN_IF_ERROR(ScalesOf(t.block_scales(), field, "block_scales", &view.blocks));
    if (t.has_columnwise_scales()) {
      GW_WIRE_RETURN_IF_ERROR(
          ScalesOf(t.columnwise_scales(), field, "columnwise_scales", &view.columnwise));
    }
    view.scale_inv = 1.0f;
  } else if (IsFp8(view.dtype)) {
    if (!(std::isfinite(t.scale_inv()) && t.scale_inv() > 0.0f)) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".scale_inv must be finite and > 0 for FP8 data, got ", t.scale_inv()));
    }
    view.scale_inv = t.scale_inv();
  }
  view.data = data.data();
  return view;
}

void ToMessage(EncodedTensor&& e, v1::Tensor* out) {
  out->set_dtype(ToProto(e.dtype));
  out->mutable_shape()->Assign(e.shape.begin(), e.shape.end());
  out->set_data(std::move(e.bytes));
  out->clear_block_scales();
  out->clear_columnwise_scales();
  if (IsFp8(e.dtype) && e.blocks.present()) {
    out->clear_scale_inv();
    ToMessage(e.blocks, out->mutable_block_scales());
    if (e.columnwise.present()) ToMessage(e.columnwise, out->mutable_columnwise_scales());
  } else if (IsFp8(e.dtype)) {
    out->set_scale_inv(e.scale_inv);
  } else {
    out->clear_scale_inv();
  }
}

void ToMessage(const BlockScales& b, v1::BlockScales* out) {
  out->set_block_rows(b.block_rows);
  out->set_block_cols(b.block_cols);
  out->set_scale_inv(b.scale_inv.data(), b.scale_inv.size() * sizeof(float));
}

void EncodeToMessage(const float* x, const std::vector<int64_t>& shape, DType dtype,
                     v1::Tensor* out, Fp8Scaling scaling, float known_amax) {
  ToMessage(Encode(x, shape, dtype, scaling, known_amax), out);
}

absl::StatusOr<std::vector<float>> DecodeMessage(const v1::Tensor& t, absl::string_view field) {
  absl::StatusOr<TensorView> view = ViewOf(t, field);
  if (!view.ok()) return view.status();
  std::vector<float> out(size_t(view->numel()));
  DecodeView(*view, out.data());
  return out;
}

}  // namespace gradwire::wire
