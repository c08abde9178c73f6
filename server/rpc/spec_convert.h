// The module spec between the wire and the core: gradwire.v1.ModuleSpec <-> core::ModuleSpec, and
// a module's description out. A pure mapping: no state, no I/O. Kinds are mapped by their
// contract names (core::KindDescription::spec_name) and a spec reports the fields its kind reads
// (spec_fields), so a new kind needs nothing here.
#pragma once

#include "absl/status/statusor.h"
#include "gradwire/v1/module.pb.h"
#include "gradwire/v1/service.pb.h"
#include "server/core/module_host.h"
#include "server/core/module_spec.h"

namespace gradwire::rpc {

// The core spec of a CreateModule request; INVALID_ARGUMENT naming the field for an enum value
// outside the contract. Zero means the default where the contract says so (layernorm_eps,
// amax_history_len, the AdamW betas and eps). The core validates the rest
// (core::ValidateModuleSpec). An unset recipe (SCALING_RECIPE_UNSPECIFIED) is `default_recipe`,
// the server's --default-recipe, except that a block-scaled default with a margin set is CURRENT:
// a margin asks for per-tensor scaling.
absl::StatusOr<core::ModuleSpec> SpecFromProto(
    const v1::ModuleSpec& p, core::ScalingMode default_recipe = core::ScalingMode::kCurrent);
// The wire spec of a module: the fields its kind reads, the recipe and the optimizer.
v1::ModuleSpec SpecToProto(const core::ModuleSpec& s);
// The contract's name of a kind (MODULE_KIND_UNSPECIFIED for none).
v1::ModuleKind KindToProto(const core::KindDescription& kind);
void InfoToProto(const core::ModuleInfo& info, v1::ModuleInfo* out);

}  // namespace gradwire::rpc
