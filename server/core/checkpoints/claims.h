// Epoch claims: which modules of a checkpoint directory this server holds, under which epoch, and
// whether it still does (checkpoint.h says how epochs fence a server that lost a module). The
// claim files themselves are checkpoint_files.h's; the hand-over (handover.h) marks a holding it
// picked up and ends it.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/core/checkpoints/layout.h"

namespace gradwire::core {

class ClaimBook {
 public:
  // One module's holding.
  struct Holding {
    int64_t epoch = 0;
    std::string token;        // written in the claim file: whose claim it is
    bool superseded = false;  // the earlier epochs' state files are removed (after the first save)
    bool took_over = false;   // held by a take-over, not a create
    bool handing_over = false;  // a hand-over request was picked up
  };

  // `server`: this process's token, written in its claims (whom a taker asks for a hand-over).
  ClaimBook(const checkpoint_files::Layout& layout, std::string server)
      : layout_(layout), server_(std::move(server)) {}
  ClaimBook(const ClaimBook&) = delete;
  ClaimBook& operator=(const ClaimBook&) = delete;

  // This process's token, written in its claims.
  const std::string& server() const { return server_; }

  // Starts the checkpoints of a module just created here: its folder and claim 1. ALREADY_EXISTS
  // when the id has a checkpoint already (another server's module, or one not loaded here yet).
  absl::Status ClaimNew(const std::string& module_id);
  // A take-over's claim: claim file `epoch` for this server, then the claims `earlier` than it
  // removed (each of their holders is fenced from then on). Returns the claim's token, which
  // Hold records once the state was read; ABORTED when another server claimed `epoch` first.
  absl::StatusOr<std::string> ClaimNext(const std::string& module_id, int64_t epoch,
                                        const std::vector<int64_t>& earlier);
  // Holds the module under the epoch ClaimNext claimed with `token`.
  void Hold(const std::string& module_id, int64_t epoch, const std::string& token);

  // A copy of the module's holding; FAILED_PRECONDITION when this server does not hold it.
  absl::StatusOr<Holding> HoldingOf(const std::string& module_id) const;
  // OK while this server still holds the module (its claim is there with its token, and no later
  // one); the moved refusal (IsModuleMoved) otherwise, or FAILED_PRECONDITION when it never did.
  absl::Status CheckHeld(const std::string& module_id) const;
  absl::Status CheckHeld(const std::string& module_id, const Holding& holding) const;
  // The held modules another server holds now (their claims superseded or removed), each with
  // CheckHeld's refusal. Reads one small file and stats one name per held module.
  std::vector<std::pair<std::string, absl::Status>> Lost() const;
  // The epoch this server holds the module under, 0 when it does not.
  int64_t EpochOf(const std::string& module_id) const;
  // Whether this server process holds the module by a take-over (a restore at start, or a first
  // touch), not by creating it: contexts made before then were made by another process.
  bool TookOver(const std::string& module_id) const;
  // After the first save under `epoch`: the earlier states are gone.
  void MarkSuperseded(const std::string& module_id, int64_t epoch);
  // Stops holding the module, leaving its files (another server holds it now, or it was deleted).
  void Forget(const std::string& module_id);

  // The hand-over's side. Marks the module handed over when it is held here under one of the
  // epochs `asked` and not picked up already; returns that epoch.
  std::optional<int64_t> PickUp(const std::string& module_id, const std::vector<int64_t>& asked);
  // Ends the holding PickUp marked and returns it; nothing when there is none (a take-over of the
  // module here since then is a new holding and stays).
  std::optional<Holding> EndPickedUp(const std::string& module_id);
  // Ends every holding and returns them (a clean stop).
  std::map<std::string, Holding> EndAll();

 private:
  const checkpoint_files::Layout& layout_;
  const std::string server_;
  mutable std::mutex mu_;  // guards held_
  std::map<std::string, Holding> held_;
};

}  // namespace gradwire::core
