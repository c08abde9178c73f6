// The hand-over between live servers that share a checkpoint directory (checkpoint.h says why
// fencing alone is not enough). A server taking a module over asks the holder its newest claim
// names, when that holder's heartbeat (heartbeat.h) is fresh, by writing a request,
// DIR/.servers/<holder>/<module id>/<taker> holding the epoch, and waits: the holder picks it up
// (removes it) within the wait, saves the module, stops serving it and then removes its claim
// (Release), which the taker waits for, at most kReleaseWithinS. A holder that is gone, whose
// heartbeat stops, or that does not pick the request up within the wait is fenced as before.
#pragma once

#include <string>
#include <vector>

#include "server/core/checkpoints/claims.h"
#include "server/core/checkpoints/heartbeat.h"
#include "server/core/checkpoints/layout.h"

namespace gradwire::core {

class HandOver {
 public:
  // A request older than this is a taker's that died waiting: its holder removes it unread.
  static constexpr double kStaleRequestS = 120.0;
  // How long a taker waits, after the holder picked its request up, for the holder's release.
  static constexpr double kReleaseWithinS = 30.0;

  HandOver(const checkpoint_files::Layout& layout, ClaimBook& claims, Heartbeat& heartbeat)
      : layout_(layout), claims_(claims), heartbeat_(heartbeat) {}
  HandOver(const HandOver&) = delete;
  HandOver& operator=(const HandOver&) = delete;

  // How long a taker waits for a live holder to pick its request up (2 s unless set); 0: it never
  // asks, and takes the module over at once (fencing the holder). Set before serving.
  void SetWait(double seconds) { wait_s_ = seconds; }
  double wait() const { return wait_s_; }

  // The taker's half: asks the live holder of `module_id`'s claim `epoch` to hand it over, and
  // waits for it (returns whatever happened, logging it).
  void Ask(const std::string& module_id, int64_t epoch) const;

  // The holder's half (only while the heartbeat runs). The modules other servers asked this one
  // to hand over, each once: the requests for a module held here under the epoch asked about are
  // picked up (their files removed, which their takers read as acknowledged). Requests about
  // anything else are left to their takers, who remove them when their wait ends.
  std::vector<std::string> Requests();
  // After the module was saved and let go of: removes this server's claim, which lets the taker go
  // on, and stops holding it. Only the holding Requests picked up: a take-over of the module here
  // since then is a new holding and stays.
  void Release(const std::string& module_id);
  // At a clean stop, after the last saves: releases the claims of the modules saved under them and
  // removes this server's folder, so that a server taking its modules over goes on from those
  // saves at once, asking nothing.
  void Leave();

 private:
  const checkpoint_files::Layout& layout_;
  ClaimBook& claims_;
  Heartbeat& heartbeat_;
  double wait_s_ = 2.0;
};

}  // namespace gradwire::core
