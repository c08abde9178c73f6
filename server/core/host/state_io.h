// State I/O: a module's master weights in and out (encoded for the wire), its scaling state for
// inspection, and its whole state as a checkpoint holds it (module_state.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gradwire/wire/codec.h"
#include "server/core/host_types.h"

namespace gradwire::device {
class Backend;
}  // namespace gradwire::device

namespace gradwire::core {

using device::Backend;
class ModuleRegistry;
struct ModuleState;

class StateIO {
 public:
  StateIO(const Backend& backend, ModuleRegistry& modules) : backend_(backend), modules_(modules) {}

  // The fp32 master weights, encoded as `dtype` on the host.
  absl::StatusOr<EncodedParameters> GetWeights(const std::string& module_id,
                                               wire::DType dtype) const;
  // Replaces the named parameters (exact shapes, finite values), decoded on the host where the
  // master weights live; all are checked before any changes. Bumps the weight version and
  // returns it.
  absl::StatusOr<uint64_t> SetWeights(const std::string& module_id, const NamedViews& params);
  absl::StatusOr<std::vector<RoleScaling>> Scaling(const std::string& module_id) const;

  // A copy of the module's state (checkpoints).
  absl::Status Export(const std::string& module_id, ModuleState* out) const;
  // Re-creates a module from a state under its original id: the spec is validated, every
  // parameter must be present with its shape; ALREADY_EXISTS when the id is taken.
  absl::Status Import(const ModuleState& state);

 private:
  const Backend& backend_;
  ModuleRegistry& modules_;
};

}  // namespace gradwire::core
