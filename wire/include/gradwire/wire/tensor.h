// gradwire.v1.Tensor in terms of the wire codec (codec.h): dtype mapping, checked views of
// received tensors, and encoded tensors moved into messages. Shared by the server's rpc layer
// and the C++ client; torch-free.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "gradwire/v1/tensor.pb.h"
#include "gradwire/wire/codec.h"

namespace gradwire::wire {

v1::DType ToProto(DType dtype);
// INVALID_ARGUMENT naming `field` for an unset or unknown dtype.
absl::StatusOr<DType> FromProto(v1::DType dtype, absl::string_view field);
// The dtype a request asks an output to travel as: unset means F32.
absl::StatusOr<DType> OutputDType(v1::DType dtype, absl::string_view field);

// A view of a received tensor after every check its fields allow, each naming `field`: a known
// dtype, a shape of dimensions >= 1 within kMaxTensorElements, exactly the bytes they call for,
// and for FP8 a finite scale_inv > 0 or block scales (DataBytes) each finite and > 0. The view
// borrows `t`'s data bytes and copies its block scales.
absl::StatusOr<TensorView> ViewOf(const v1::Tensor& t, absl::string_view field);
// The same for a tensor whose bytes arrived apart from its message (zero_copy.h): `t` gives the
// dtype, shape and scale_inv, `data` the bytes (borrowed).
absl::StatusOr<TensorView> ViewOf(const v1::Tensor& t, absl::string_view data,
                                  absl::string_view field);

// Moves an encoded tensor into `out` (its bytes are not copied).
void ToMessage(EncodedTensor&& e, v1::Tensor* out);
// Block scales into their message.
void ToMessage(const BlockScales& b, v1::BlockScales* out);
// Encodes float32 values of `shape` as `dtype` into `out` (FP8 with a scale of their own, or
// block scales of their own under `scaling`; `known_amax` as wire::Encode's).
void EncodeToMessage(const float* x, const std::vector<int64_t>& shape, DType dtype,
                     v1::Tensor* out, Fp8Scaling scaling = {}, float known_amax = -1.0f);
// Decodes a received tensor (checked as ViewOf does) to float32 values in row-major order.
absl::StatusOr<std::vector<float>> DecodeMessage(const v1::Tensor& t, absl::string_view field);

}  // namespace gradwire::wire
