// What the server outside the compute knows of a module kind: its names, the spec fields it reads
// and checks, and the tensors a forward builds. No libtorch here: the rpc layer maps and checks
// specs through this header, and the compute side of a kind (module_kind.h: parameters, roles,
// forward, backward) derives from it.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "server/core/module_spec.h"

namespace gradwire::core {

// The optional fields of a ModuleSpec a kind reads. ValidateModuleSpec refuses the others set
// away from their defaults, and the rpc layer maps only these back to the wire.
struct SpecFields {
  bool ffn = false;        // ffn_features and activation (the MLP)
  bool layernorm = false;  // layernorm_eps, zero_centered_gamma, return_layernorm_output and
                           // checkpoint (the LayerNorm kinds)
};

class KindDescription {
 public:
  virtual ~KindDescription() = default;
  virtual ModuleKind kind() const = 0;
  virtual const char* name() const = 0;  // "Linear", "LayerNormLinear", "LayerNormMLP"
  // The kind's name in the wire contract (gradwire.v1.ModuleKind): "LINEAR", "LAYERNORM_LINEAR",
  // "LAYERNORM_MLP". The rpc layer maps kinds by it, so a new kind needs no case there.
  virtual const char* spec_name() const = 0;
  virtual SpecFields spec_fields() const = 0;
  // INVALID_ARGUMENT naming the field for what this kind refuses in the fields it reads; the
  // checks common to every kind, and of the fields it does not read, are ValidateModuleSpec's.
  virtual absl::Status Validate(const ModuleSpec& /*spec*/) const { return absl::OkStatus(); }
  // The widths of the [rows, width] tensors a forward builds, named for error messages (the
  // output, LayerNormMLP's FC1 output), so a request can be bounded before it runs.
  virtual std::vector<std::pair<const char*, int64_t>> BuiltWidths(
      const ModuleSpec& spec) const = 0;
};

// The description of `kind`, or null for a value outside the enum (a spec read back from a
// damaged checkpoint).
const KindDescription* DescribeKind(ModuleKind kind);
// Every kind, in enum order.
const std::vector<const KindDescription*>& KindDescriptions();
// The kind whose spec_name() is `name`, or null.
const KindDescription* DescribeKindBySpecName(absl::string_view name);
const char* ModuleKindName(ModuleKind kind);
// The module in a few words, from its kind (ModuleInfo.description, the creation log line):
// "Linear 1024 -> 1024, bias", "LayerNormMLP 1024 -> 4096 -> 1024, gelu".
std::string DescribeModule(const ModuleSpec& spec);

// INVALID_ARGUMENT naming `field` unless lo <= value <= hi (the kinds' spec checks).
absl::Status CheckSpecRange(const char* field, int64_t value, int64_t lo, int64_t hi);
// INVALID_ARGUMENT naming `field` unless `value` is finite and > 0.
absl::Status CheckFinitePositive(const char* field, float value);

// The parameters a spec makes, in the module's order: names and shapes (empty for an unknown
// kind; dimensions taken as they are).
std::vector<std::pair<std::string, std::vector<int64_t>>> ParameterShapes(const ModuleSpec& spec);
// Their total element count (saturating; 0 when a dimension is not positive).
int64_t ParameterCount(const ModuleSpec& spec);
// INVALID_ARGUMENT naming the field unless `spec` is one ModuleHost::Create accepts: the common
// checks (recipe, optimizer, dimensions), the kind's own, and the parameter count.
absl::Status ValidateModuleSpec(const ModuleSpec& spec);

}  // namespace gradwire::core
