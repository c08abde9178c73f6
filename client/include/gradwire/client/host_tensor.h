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
// The dtype the exact wire sends a forward's `input` in, for a module whose input cast the client
// can make (`fp8_input`, ExactWireTakesFp8(spec)): kFp8E4M3 when the module does and every value
// is finite, else kF32.
// `amax`, when given, receives the input's AbsMax where it was measured (else -1).
WireDType ExactInputDType(const HostTensor& input, bool fp8_input, float* amax = nullptr);

// How one tensor crosses: its dtype and, for FP8, its scaling (one scale, or row blocks).
struct TensorForm {
  WireDType dtype = WireDType::kF32;
  wire::Fp8Scaling scaling;
  float amax = -1.0f;  // the tensor's AbsMax when measured already (else -1): not measured twice
  // Bytes of n elements in this form.
  int64_t Bytes(int64_t n) const {
    return wire::IsFp8(dtype) ? wire::Fp8Bytes(n, scaling) : n * wire::ElementSize(dtype);
  }
};
// The form of a forward's input under `form`, to a module that the client knows (`known`, with
// `fp8_input` and `block` as ExactWireTakesFp8 and RecipeBlockLength of its spec) or not:
// - exact: E4M3 where ExactInputDType says so, scaled as the module's input cast is (row blocks
//   of `block` under BLOCK and MXFP8 and, in `training`, their columnwise copy too), else F32;
// - one dtype: that dtype; FP8 with row blocks of `block` (no columnwise copy).
TensorForm InputForm(const WireForm& form, const HostTensor& input, bool known, bool fp8_input,
                     int64_t block, bool training);
// The form of a gradient (grad_output, grad_layernorm_output) and of results under `form`: F32
// under the exact wire; else the form's dtype, FP8 with row blocks of `block`.
TensorForm GradientForm(const WireForm& form, int64_t block);

// A float32 host tensor, row-major.
struct HostTensor {
  std::vector<int64_t> shape;
  std::vector<float> data;

  int64_t numel() const;
  static HostTensor Zeros(std::vector<int64_t> shape);
};

// HostTensor -> wire tensor in `dtype` (FP8 scaled as `scaling` says).
v1::Tensor ToWire(const HostTensor& t, WireDType dtype, wire::Fp8Scaling scaling = {});
// HostTensor -> wire tensor in `form` (the input it was formed for: its amax, if it has one).
v1::Tensor ToWire(const HostTensor& t, const TensorForm& form);
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
