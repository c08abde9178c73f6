// Host tensors of the C++ client (float32, row-major) and their conversion to and from wire
// tensors in any of the wire's element types (gradwire/wire/codec.h, which the server decodes
// alike).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "gradwire/v1/tensor.pb.h"
#include "gradwire/wire/codec.h"
#include "gradwire/wire/tensor.h"

namespace gradwire::client {

// How float tensors travel to the server. The FP8 kinds are cast with a current-scaling scale of
// their own (amax of the tensor maps to the format's largest value), sent with its scale_inv; the
// server uses FP8 input codes as they are. Activations are usually E4M3, gradients E5M2.
// The wire codec's element types (gradwire/wire/codec.h), which the server decodes alike.
using WireDType = wire::DType;
using wire::ToProto;

// A float32 host tensor, row-major.
struct HostTensor {
  std::vector<int64_t> shape;
  std::vector<float> data;

  int64_t numel() const;
  static HostTensor Zeros(std::vector<int64_t> shape);
};

// HostTensor -> wire tensor in `dtype`.
v1::Tensor ToWire(const HostTensor& t, WireDType dtype);
// Wire tensor (any dtype, FP8 included) -> HostTensor; INVALID_ARGUMENT when malformed.
absl::StatusOr<HostTensor> FromWire(const v1::Tensor& t);
// The same for a tensor whose bytes arrived apart from its message (gradwire/wire/zero_copy.h).
absl::StatusOr<HostTensor> FromWire(const v1::Tensor& t, absl::string_view data);

// Parameters (or their gradients) by name, in the module's order.
struct NamedTensors {
  std::vector<std::pair<std::string, HostTensor>> tensors;
  uint64_t weight_version = 0;
  int64_t accumulated_backwards = 0;  // gradients only
  // nullptr when there is no such parameter.
  const HostTensor* Find(const std::string& name) const;
};

}  // namespace gradwire::client
