// What the three module kinds share (internal to linear.cc, layernorm_linear.cc,
// layernorm_mlp.cc and module_kind.cc): the single-GEMM roles, the LayerNorm parameters, and the
// spec check of the kinds without an MLP.
#pragma once

#include <vector>

#include "absl/status/status.h"
#include "server/core/module_kind.h"

namespace gradwire::core {

// Roles of a kind with one GEMM (Linear, LayerNormLinear): input, weight, grad_output.
const std::vector<RoleDef>& SingleGemmRoles();
// LayerNorm gamma (ones, zeros when zero-centered) and beta (zeros), [in_features] each.
std::vector<ParamDef> LayerNormParamDefs(const ModuleSpec& spec);
// The LayerNorm of `params` (device copies) under `spec`'s eps and gamma convention.
LayerNormParams LayerNormOf(const ParamTable& params, const ModuleSpec& spec);
// INVALID_ARGUMENT when a non-MLP spec sets ffn_features or a non-GELU activation.
absl::Status CheckNoMlpFields(const ModuleSpec& spec);

}  // namespace gradwire::core
