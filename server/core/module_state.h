// A module's state as a checkpoint holds it: fp32 tensors on the host (libtorch). Only the state
// I/O (state_io.cc) and the checkpointer (checkpoint.cc) need it whole.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "server/core/host_types.h"
#include "server/core/module_spec.h"

namespace gradwire::core {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// Everything that defines a module between steps (accumulated gradients are not part of it):
// what a checkpoint holds.
struct ModuleState {
  std::string module_id;
  std::string tenant;
  ModuleSpec spec;
  uint64_t weight_version = 0;
  int64_t optimizer_steps = 0;
  NamedTensors parameters;       // float32, the module's order
  NamedTensors optimizer_slots;  // "<param>.first" / "<param>.second" where allocated
  std::vector<RoleScaling> scaling;
};

}  // namespace gradwire::core
