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
// shared server touches `DIR/.servers/<its token>/alive` four times a second (Heartbeat) and, at
// a clean stop, releases its claims and removes its folder (Leave). When that file is younger
// than kAliveWithinS, the taker writes a request, `DIR/.servers/<holder>/<module id>/<taker>`
// holding the epoch, and waits: the holder picks it up (removes it) within the hand-over wait,
// saves the module, stops serving it and then removes its claim (Release), which the taker waits
// for, at most kReleaseWithinS. A holder that is gone, whose heartbeat stops, or that does not
// pick the request up within the wait is fenced as before. docs/scaling-out.md says when steps
// can still be lost.
//
// One race remains, and it is narrow: a holder checks its claim, a takeover claims the next
// epoch and reads the newest state, and only then the old holder's rename lands. That file
// carries the old epoch: the new holder's first save supersedes it, and until then a third
// takeover would read it (state the new holder never saw, though never a rollback of a save the
// new holder made).
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/core/module_host.h"

namespace gradwire::core {

class Checkpointer {
 public:
  // `every_steps` > 0: a module is saved after every that many optimizer steps.
  Checkpointer(std::string dir, int64_t every_steps);
  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  const std::string& dir() const { return dir_; }
  bool shared() const { return shared_; }
  // Whether a module that just reached `optimizer_steps` is due for a save.
  bool Due(int64_t optimizer_steps) const {
    return every_steps_ > 0 && optimizer_steps % every_steps_ == 0;
  }

  // Creates the directory if needed and locks it: exclusively (this server alone restores and
  // holds every module), or `shared` with other servers started the same way (modules are taken
  // over on first touch; this server's hand-over folder is made and its heartbeat started).
  // FAILED_PRECONDITION when another live server holds a lock that conflicts (the lock is
  // flock(2) on DIR/.gradwire-lock, released when the process exits).
  absl::Status Prepare(bool shared = false);

  // A holder whose heartbeat is younger than this is asked to hand a module over, and waited for
  // while it stays so. Shorter than a proxy takes to mark a killed server down (about 2-4 s with
  // deploy/haproxy's checks), so a failure's take-over does not wait.
  static constexpr double kAliveWithinS = 1.0;
  // Seconds between a shared server's heartbeats (its hand-over watcher's).
  static constexpr double kHeartbeatEveryS = 0.25;
  // A request older than this is a taker's that died waiting: its holder removes it unread.
  static constexpr double kStaleRequestS = 120.0;
  // How long a taker waits, after the holder picked its request up, for the holder's release.
  static constexpr double kReleaseWithinS = 30.0;
  // A server starting on the directory removes the hand-over folders of servers whose heartbeat
  // stopped longer ago than this (killed: a clean stop removes its own).
  static constexpr double kForgetServerAfterS = 3600.0;
  // How long Take waits for a live holder to pick a hand-over request up (2 s unless set); 0: it
  // never asks, and takes the module over at once (fencing the holder). Set before serving.
  void SetHandOverWait(double seconds) { handover_wait_s_ = seconds; }
  // Touches this server's heartbeat file (shared mode; its watcher calls it every
  // kHeartbeatEveryS).
  void Heartbeat() const;
  // The modules other servers asked this one to hand over, each once: the requests for a module
  // held here under the epoch asked about are picked up (their files removed, which their takers
  // read as acknowledged). Requests about anything else are left to their takers, who remove them
  // when their wait ends.
  std::vector<std::string> HandOverRequests();
  // After the module was saved and let go of (the hand-over): removes this server's claim, which
  // lets the taker go on, and stops holding it. Only the holding HandOverRequests picked up: a
  // take-over of the module here since then is a new holding and stays.
  void Release(const std::string& module_id);
  // At a clean stop, after the last saves: releases the claims of the modules saved under them and
  // removes this server's hand-over folder, so that a server taking its modules over goes on from
  // those saves at once, asking nothing.
  void Leave();

  // Starts the checkpoints of a module just created here: its folder and claim 1. ALREADY_EXISTS
  // when the id has a checkpoint already (another server's module, or one not loaded here yet).
  absl::Status ClaimNew(const std::string& module_id);
  // What a takeover found.
  struct TakeOver {
    int64_t epoch = 0;       // the epoch this server now holds the module under
    int64_t from_epoch = 0;  // the epoch of the state it read (0: the flat layout)
    uint64_t weight_version = 0;
    int64_t optimizer_steps = 0;
  };
  // Takes the module over: claims the next epoch and imports the newest state into `host`.
  // NOT_FOUND when the directory has no checkpoint of the id; ABORTED when another server claimed
  // the same epoch at the same moment (retry); DATA_LOSS for a damaged checkpoint.
  absl::StatusOr<TakeOver> Take(ModuleHost& host, const std::string& module_id);

  // Saves a held module under its epoch. FAILED_PRECONDITION when this server does not hold it,
  // or no longer does (IsMoved: another server claimed a later epoch, or it was deleted there):
  // nothing is written then.
  absl::Status Save(const ModuleHost& host, const std::string& module_id);
  // OK while this server still holds the module; the Save refusal otherwise.
  absl::Status CheckHeld(const std::string& module_id) const;
  // Whether `status` is the refusal of a module another server holds now.
  static bool IsMoved(const absl::Status& status);
  // Saves every module of `host` this server still holds; returns how many. Modules it lost are
  // skipped (logged), and neither stop it nor count.
  absl::StatusOr<int64_t> SaveAll(const ModuleHost& host);
  // The held modules another server holds now (their claims superseded or removed), each with
  // CheckHeld's refusal: for the server to let them go. Reads one small file and stats one name
  // per held module.
  std::vector<std::pair<std::string, absl::Status>> Lost() const;
  // Stops holding the module, leaving its files (another server holds it now).
  void Forget(const std::string& module_id);
  // Removes a deleted module's folder and files (no error when there are none).
  absl::Status Remove(const std::string& module_id);
  // Takes over every module with a checkpoint into `host`; returns how many.
  absl::StatusOr<int64_t> RestoreAll(ModuleHost& host);

  // The epoch this server holds the module under, 0 when it does not.
  int64_t EpochOf(const std::string& module_id) const;
  // Whether this server process holds the module by a take-over (a restore at start, or a first
  // touch), not by creating it: contexts made before then were made by another process.
  bool TookOver(const std::string& module_id) const;
  std::string FolderOf(const std::string& module_id) const;
  std::string StatePathOf(const std::string& module_id, int64_t epoch) const;
  std::string ClaimPathOf(const std::string& module_id, int64_t epoch) const;
  // The flat layout's file of a module (read as epoch 0).
  std::string LegacyPathOf(const std::string& module_id) const;

 private:
  struct Held {
    int64_t epoch = 0;
    std::string token;        // written in the claim file: whose claim it is
    bool superseded = false;  // the earlier epochs' state files are removed (after the first save)
    bool took_over = false;   // held by a take-over, not a create
    bool handing_over = false;  // a hand-over request was picked up
  };
  // A copy of the module's holding; FAILED_PRECONDITION when this server does not hold it.
  absl::StatusOr<Held> HeldOf(const std::string& module_id) const;
  absl::Status CheckHeld(const std::string& module_id, const Held& held) const;
  absl::Status SaveState(const ModuleState& state, int64_t epoch) const;
  // Asks the live holder of `module_id`'s claim `epoch` to hand it over, and waits for it (the
  // taker's half of a hand-over; returns whatever happened, logging it).
  void AskHolder(const std::string& module_id, int64_t epoch) const;
  double HeartbeatAge(const std::string& server) const;
  std::string ServerFolder(const std::string& server) const;

  std::string dir_;
  int64_t every_steps_;
  bool shared_ = false;
  int lock_fd_ = -1;
  const std::string server_;  // this process's token, in its claims: whom to ask for a hand-over
  double handover_wait_s_ = 2.0;
  mutable std::mutex mu_;  // guards held_
  std::map<std::string, Held> held_;
};

}  // namespace gradwire::core
