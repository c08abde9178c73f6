// Parameters by typed handle: a kind's compute reads and writes them through a ParamTable, so a
// misspelt parameter is a compile error, not an undefined tensor. Names exist only at the
// boundary (weights in and out, gradients out, checkpoints): ParamName.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstddef>
#include <cstdint>

namespace gradwire::core {

// Every parameter any kind has. A module has a subset (ModuleKindOps::Params).
enum class Param : uint8_t {
  kLayerNormWeight,  // "layer_norm_weight" (gamma)
  kLayerNormBias,    // "layer_norm_bias" (beta)
  kWeight,           // "weight"
  kBias,             // "bias"
  kFc1Weight,        // "fc1_weight"
  kFc1Bias,          // "fc1_bias"
  kFc2Weight,        // "fc2_weight"
  kFc2Bias,          // "fc2_bias"
};
inline constexpr size_t kParamSlots = 8;
// The wire and checkpoint name of a parameter.
const char* ParamName(Param p);

// Tensors by parameter handle; undefined for a parameter the module does not have.
class ParamTable {
 public:
  at::Tensor& operator[](Param p) { return slots_[size_t(p)]; }
  const at::Tensor& operator[](Param p) const { return slots_[size_t(p)]; }

 private:
  std::array<at::Tensor, kParamSlots> slots_;
};

}  // namespace gradwire::core
