// Wire tensors (gradwire.v1.Tensor) to and from float32 host tensors. Every check names the
// field, so a client sees exactly which part of its request was wrong.
#pragma once

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "gradwire/v1/tensor.pb.h"
#include "gradwire/wire/chunking.h"

namespace gradwire::rpc {

// Most elements one tensor may have (also bounds the byte arithmetic).
inline constexpr int64_t kMaxTensorElements = wire::kMaxTensorElements;

// Decodes `t` to float32 with its shape. F32 data is viewed in place when aligned (the result
// then borrows `t`'s bytes: keep `t` alive while the tensor is used); BF16/F16/FP8 are converted.
// `field` names the tensor in error messages ("input", "grad_output", ...).
absl::StatusOr<at::Tensor> DecodeTensor(const v1::Tensor& t, absl::string_view field);

// Encodes a float32 host tensor as `dtype` (F32, BF16, F16, or FP8_E4M3 / FP8_E5M2 with a
// current-scaling scale_inv of its own; DTYPE_UNSPECIFIED means F32).
absl::Status EncodeTensor(const at::Tensor& t, v1::DType dtype, absl::string_view field,
                          v1::Tensor* out);

// Checks that `dtype` is acceptable for an output; `field` names the request field.
absl::Status CheckOutputDType(v1::DType dtype, absl::string_view field);

}  // namespace gradwire::rpc
