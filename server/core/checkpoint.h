// Durable module state: one safetensors file per module in a directory, written to a temporary
// file and renamed (a crash leaves the old checkpoint or the new one, never a torn one).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/core/module_host.h"

namespace gradwire::core {

class Checkpointer {
 public:
  // `every_steps` > 0: a module is saved after every that many optimizer steps.
  Checkpointer(std::string dir, int64_t every_steps);

  const std::string& dir() const { return dir_; }
  // Whether a module that just reached `optimizer_steps` is due for a save.
  bool Due(int64_t optimizer_steps) const {
    return every_steps_ > 0 && optimizer_steps % every_steps_ == 0;
  }

  // Creates the directory if needed and checks it is writable.
  absl::Status Prepare() const;
  absl::Status Save(const ModuleState& state) const;
  absl::Status Save(const ModuleHost& host, const std::string& module_id) const;
  // Saves every module; returns how many.
  absl::StatusOr<int64_t> SaveAll(const ModuleHost& host) const;
  // Removes a deleted module's checkpoint (no error when there is none).
  absl::Status Remove(const std::string& module_id) const;
  // Reads every checkpoint in the directory into `host`; returns how many modules it restored.
  absl::StatusOr<int64_t> RestoreAll(ModuleHost& host) const;

  std::string PathOf(const std::string& module_id) const;

 private:
  std::string dir_;
  int64_t every_steps_;
};

}  // namespace gradwire::core
