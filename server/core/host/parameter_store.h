// The parameter store: a module's accumulated gradients and its optimizer. Backwards add to the
// accumulators (the step runner); here they are read out, and an optimizer step turns them into
// new master weights and a new weight version. Weights in and out and whole-module state are the
// state I/O's (state_io.h).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "gradwire/wire/codec.h"
#include "server/core/host_types.h"

namespace gradwire::device {
class Backend;
}  // namespace gradwire::device

namespace gradwire::core {

using device::Backend;
class ModuleRegistry;

class ParameterStore {
 public:
  ParameterStore(const Backend& backend, const ModuleRegistry& modules)
      : backend_(backend), modules_(modules) {}

  // One optimizer step on the accumulated gradients, which are then zeroed; bumps the weight
  // version and returns it. learning_rate > 0 overrides the configured rate. A step that would
  // make a value non-finite changes nothing.
  absl::StatusOr<uint64_t> ApplyGradients(const std::string& module_id, float learning_rate);
  // The accumulated gradients (zeroed after the copy with `zero`), encoded as `dtype` on the host.
  absl::StatusOr<EncodedParameters> GetGradients(const std::string& module_id, bool zero,
                                                 wire::DType dtype);

 private:
  const Backend& backend_;
  const ModuleRegistry& modules_;
};

}  // namespace gradwire::core
