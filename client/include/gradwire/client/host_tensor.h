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

struct HostTensor;

// The wire codec's element types (gradwire/wire/codec.h), which the server decodes alike. The FP8
// kinds are cast with a current-scaling scale of their own (amax of the tensor maps to the
// format's largest value), sent with its scale_inv; the server uses FP8 input codes as they are.
using WireDType = wire::DType;
using wire::ToProto;

// How a client's activations and gradients cross (docs/wire.md).
//
// The exact wire (the default: WireForm{} or kExactWire) changes no result: every tensor crosses
// as F32, except a forward's input to a module that casts it to FP8 first and takes FP8 input
// codes in its place (KindDescription.fp8_input: a Linear) under CURRENT scaling with margin 0.
// That input crosses as the server's own cast of it, E4M3 codes and scale_inv bit for bit, a
// quarter of the bytes; an input that is not all finite crosses as F32 (the server's answer to it
// is the F32 wire's). Outputs and gradients stay F32 both ways. The results are the F32 wire's,
// bit for bit.
//
// A WireForm made from a WireDType (`options.wire_dtype = WireDType::kBF16`) sends every
// activation and gradient, both ways, in that dtype; BF16, F16 and FP8 lose precision.
struct WireForm {
  constexpr WireForm() = default;
  constexpr WireForm(WireDType d) : exact(false), dtype(d) {}  // NOLINT: one dtype both ways
  bool exact = true;
  WireDType dtype = WireDType::kF32;  // every tensor's dtype; F32 under the exact wire
};
inline constexpr WireForm kExactWire{};
// "exact", or the dtype's name ("F32", "BF16", ...).
const char* WireFormName(const WireForm& form);
// The dtype the exact wire sends a forward's `input` in, for a module that takes E4M3 input codes
// under current scaling with margin 0 (`fp8_input`, ExactWireTakesFp8(spec)): kFp8E4M3 when the
// module does and every value is finite, else kF32.
WireDType ExactInputDType(const HostTensor& input, bool fp8_input);

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
