// Durable module state in a checkpoint directory that one server owns or several share.
//
// Layout: a folder per module, `DIR/<module id>/`, holding
//   claim.<E>                     the module's current claim: epoch E and the token of the server
//                                 holding it (written with O_EXCL, so one server wins an epoch)
//   state.<E>.gradwire.safetensors the module's state as the holder of epoch E last saved it
//                                 (written to a temporary file and renamed: a crash leaves the old
//                                 checkpoint or the new one, never a torn one)
// A checkpoint of the earlier flat layout, `DIR/<module id>.gradwire.safetensors`, reads as
// epoch 0 and is replaced by the first save.
//
// Ownership is fenced by epochs. A server holds a module under the epoch it claimed: claim 1 when
// it created the module, the newest claim + 1 when it took the module over from the newest
// checkpoint (first touch on a server that shares the directory, or a restore at start). A
// holder writes only the state file of its own epoch, and only while its claim file is still
// there with its token and no later claim exists; a takeover removes the earlier claims. So a
// server that lost a module (the proxy moved it, another server took it over) can no longer
// save it, and whatever it wrote before noticing carries an older epoch than the newest state,
// which is the one a takeover reads. docs/scaling-out.md says what this gives a client.
//
// Hand-over between live servers. Fencing alone would lose what a live holder did since its last
// save when a proxy moves one of its modules (a server coming back, one added). So a server
// taking a module over first looks at the newest claim's holder (a claim names its server): each
// shared server touches `DIR/.servers/<its token>/alive` four times a second (Heartbeat::Beat)
// and, at a clean stop, releases its claims and removes its folder (HandOver::Leave). When that
// file is younger than Heartbeat::kAliveWithinS, the taker writes a request,
// `DIR/.servers/<holder>/<module id>/<taker>` holding the epoch, and waits: the holder picks it up
// (removes it) within the hand-over wait, saves the module, stops serving it and then removes its
// claim (HandOver::Release), which the taker waits for, at most HandOver::kReleaseWithinS. A holder
// that is gone, whose heartbeat stops, or that does not pick the request up within the wait is
// fenced as before. docs/scaling-out.md says when steps can still be lost.
//
// The parts, each a class of its own: the layout (layout.h: Layout) and the files' formats
// (checkpoint_files.h: claim and state files, JSON metadata), the epoch claims (claims.h:
// ClaimBook), the heartbeats (heartbeat.h: Heartbeat), the live hand-over (handover.h: HandOver),
// and here, the directory's lock, saves and restores (Checkpointer, which composes the others).
//
// One race remains, and it is narrow: a holder checks its claim, a takeover claims the next
// epoch and reads the newest state, and only then the old holder's rename lands. That file
// carries the old epoch: the new holder's first save supersedes it, and until then a third
// takeover would read it (state the new holder never saw, though never a rollback of a save the
// new holder made).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/core/checkpoints/claims.h"
#include "server/core/checkpoints/handover.h"
#include "server/core/checkpoints/heartbeat.h"
#include "server/core/checkpoints/layout.h"
#include "server/core/module_host.h"

namespace gradwire::core {

class Checkpointer {
 public:
  // `every_steps` > 0: a module is saved after every that many optimizer steps.
  Checkpointer(std::string dir, int64_t every_steps);
  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  const std::string& dir() const { return layout_.dir(); }
  bool shared() const { return heartbeat_.started(); }
  // Whether a module that just reached `optimizer_steps` is due for a save.
  bool Due(int64_t optimizer_steps) const {
    return every_steps_ > 0 && optimizer_steps % every_steps_ == 0;
  }

  // Creates the directory if needed and locks it: exclusively (this server alone restores and
  // holds every module), or `shared` with other servers started the same way (modules are taken
  // over on first touch; this server's heartbeat starts). FAILED_PRECONDITION when another live
  // server holds a lock that conflicts (the lock is flock(2) on DIR/.gradwire-lock, released when
  // the process exits).
  absl::Status Prepare(bool shared = false);

  // What a takeover found.
  struct TakeOver {
    int64_t epoch = 0;       // the epoch this server now holds the module under
    int64_t from_epoch = 0;  // the epoch of the state it read (0: the flat layout)
    uint64_t weight_version = 0;
    int64_t optimizer_steps = 0;
  };
  // Takes the module over: asks its live holder for a hand-over (shared), claims the next epoch
  // and imports the newest state into `host`. NOT_FOUND when the directory has no checkpoint of
  // the id; ABORTED when another server claimed the same epoch at the same moment (retry);
  // DATA_LOSS for a damaged checkpoint.
  absl::StatusOr<TakeOver> Take(ModuleHost& host, const std::string& module_id);
  // Takes over every module with a checkpoint into `host`; returns how many.
  absl::StatusOr<int64_t> RestoreAll(ModuleHost& host);

  // Saves a held module under its epoch. FAILED_PRECONDITION when this server does not hold it,
  // or no longer does (IsMoved: another server claimed a later epoch, or it was deleted there):
  // nothing is written then.
  absl::Status Save(const ModuleHost& host, const std::string& module_id);
  // Saves every module of `host` this server still holds; returns how many. Modules it lost are
  // skipped (logged), and neither stop it nor count.
  absl::StatusOr<int64_t> SaveAll(const ModuleHost& host);
  // Removes a deleted module's folder and files (no error when there are none).
  absl::Status Remove(const std::string& module_id);
  // Whether `status` is the refusal of a module another server holds now.
  static bool IsMoved(const absl::Status& status) { return IsModuleMoved(status); }

  // The parts.
  const checkpoint_files::Layout& layout() const { return layout_; }
  ClaimBook& claims() { return claims_; }
  const ClaimBook& claims() const { return claims_; }
  Heartbeat& heartbeat() { return heartbeat_; }
  HandOver& handover() { return handover_; }

 private:
  const checkpoint_files::Layout layout_;
  const int64_t every_steps_;
  int lock_fd_ = -1;
  ClaimBook claims_;
  Heartbeat heartbeat_;
  HandOver handover_;
};

}  // namespace gradwire::core
