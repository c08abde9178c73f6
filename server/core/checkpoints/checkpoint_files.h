// The files of a checkpoint directory (checkpoint.h describes them; layout.h names them): a
// module folder's scan, claim files, and a module's state file (safetensors, its spec
// and scaling state as JSON metadata). Names and formats only: the claims (claims.h), heartbeats
// (heartbeat.h), hand-overs (handover.h) and Checkpointer's saves and restores (checkpoint.h)
// decide what to read and write, and when.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/core/checkpoints/layout.h"
#include "server/core/module_state.h"

namespace gradwire::core::checkpoint_files {

bool EndsWith(const std::string& s, const char* suffix);
// A module id that can name a folder: not empty, no separators, not hidden.
absl::Status CheckFolderName(const std::string& id);

// The claims and states in a module's folder, by epoch.
struct Scan {
  std::vector<int64_t> claims;
  std::vector<int64_t> states;
  bool legacy = false;
  int64_t max_claim() const;
  int64_t max_state() const;
  bool any_state() const { return legacy || !states.empty(); }
};
// `folder`'s claims and states; `legacy`: the flat layout's file of the module.
Scan ScanFolder(const std::string& folder, const std::string& legacy);

// A claim file: the claim's token, then (from servers that hand modules over) "server <token>".
struct Claim {
  std::string token;   // empty when the file cannot be read
  std::string server;  // whom to ask for a hand-over; empty in claims of older servers
};
Claim ReadClaim(const std::string& path);
std::string ReadToken(const std::string& path);
// Creates claim file `path` holding `token` and this process's `server` token, only if no claim
// has its name (O_EXCL): ABORTED when another server made it first.
absl::Status WriteClaim(const std::string& path, const std::string& token,
                        const std::string& server);

// Seconds since the epoch, as file times count them.
double WallSeconds();

// A module's state file: DATA_LOSS when it is damaged or not a gradwire checkpoint.
absl::StatusOr<ModuleState> ReadState(const std::string& path);
// Writes `state`, saved under `epoch`, to `path` (atomically replaced).
absl::Status WriteState(const std::string& path, const ModuleState& state, int64_t epoch);

}  // namespace gradwire::core::checkpoint_files
