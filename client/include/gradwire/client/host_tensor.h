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
#include "gradwire/client/kinds.h"
#include "gradwire/v1/tensor.pb.h"
#include "gradwire/wire/codec.h"
#include "gradwire/wire/tensor.h"

namespace gradwire::v1 {
class BackwardRequest;
}  // namespace gradwire::v1

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
// as F32, except two that the server casts to FP8 first where the client can make that cast bit
// for bit (CURRENT scaling with margin 0, BLOCK, MXFP8):
// - a forward's input to a module that takes FP8 input codes (KindDescription.fp8_input: a
//   Linear) crosses as the server's own cast of it (E4M3 codes and scales; under BLOCK and MXFP8
//   in training with the columnwise copy too): a quarter to a half of the bytes;
// - a backward's grad_output (every kind: KindDescription.fp8_grad_output) crosses as the
//   server's cast of it (E5M2 under CURRENT, the recipe's format and blocks with the columnwise
//   copy under BLOCK and MXFP8) with, for a module with a bias, the bias gradient beside it: its
//   column sums, as a server with ModuleInfo.row_order_bias_sums sums them.
// A tensor that is not all finite crosses as F32 (the server's answer to it is the F32 wire's).
// Outputs, grad_input and grad_layernorm_output stay F32. The results are the F32 wire's, bit for
// bit.
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
  // A backward's FP8 grad_output under the exact wire to a module with a bias: its column sums
  // (ColumnSums), which go with it (BackwardRequest.grad_output_column_sums), the bias gradient
  // the server would sum.
  std::vector<float> column_sums;
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
// The form of a backward's grad_output `grad` under `form`, to a module whose exact-wire form of it
// is `exact` (ExactWireGradForm; kNone when the module is unknown), with column sums when
// `column_sums` (the module has a bias) and row blocks of `block`: exact: that FP8 cast (under
// BLOCK and MXFP8 with its columnwise copy) where every value and every column sum is finite
// (else F32: the server's answer is the F32 wire's); one dtype: GradientForm's.
TensorForm GradOutputForm(const WireForm& form, const HostTensor& grad, ExactGradForm exact,
                          bool column_sums, int64_t block);
// Each column's sum of `t` (its last dimension the columns), summed in float32 in row order from
// 0: the bias gradient as a server with ModuleInfo.row_order_bias_sums sums it.
std::vector<float> ColumnSums(const HostTensor& t);
// Sets req's grad_output_column_sums to form.column_sums (none when it has none).
void SetColumnSums(const TensorForm& form, v1::BackwardRequest* req);

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
