// Heartbeats of the servers that share a checkpoint directory (checkpoint.h): each touches
// DIR/.servers/<its token>/alive four times a second, so that a server taking one of its modules
// over knows whether to ask it for a hand-over (handover.h) or fence it.
#pragma once

#include <string>
#include <utility>

#include "absl/status/status.h"
#include "server/core/checkpoints/layout.h"

namespace gradwire::core {

class Heartbeat {
 public:
  // A server whose heartbeat is younger than this is alive: asked to hand a module over, and
  // waited for while it stays so. Shorter than a proxy takes to mark a killed server down (about
  // 2-4 s with deploy/haproxy's checks), so a failure's take-over does not wait.
  static constexpr double kAliveWithinS = 1.0;
  // Seconds between a shared server's beats (its hand-over watcher's).
  static constexpr double kEveryS = 0.25;
  // A server starting on the directory removes the folders of servers whose heartbeat stopped
  // longer ago than this (killed: a clean stop removes its own).
  static constexpr double kForgetServerAfterS = 3600.0;

  // `server`: this process's token, which names its folder.
  Heartbeat(const checkpoint_files::Layout& layout, std::string server)
      : layout_(layout), server_(std::move(server)) {}

  const std::string& server() const { return server_; }
  // Whether Start ran: this server shares the directory and beats.
  bool started() const { return started_; }
  // Removes the folders of servers killed long ago, makes this server's folder and beats once.
  absl::Status Start();
  // Touches this server's heartbeat file (made again if a server starting beside this one took it
  // for stale and removed it).
  void Beat() const;
  // The age of `server`'s heartbeat in seconds; negative when it has none (it stopped, or was
  // never here).
  double AgeOf(const std::string& server) const;
  bool Alive(const std::string& server) const {
    const double age = AgeOf(server);
    return age >= 0 && age <= kAliveWithinS;
  }
  // Removes this server's folder (a clean stop: its heartbeat and any requests addressed to it).
  void Stop();

 private:
  const checkpoint_files::Layout& layout_;
  const std::string server_;
  bool started_ = false;
};

}  // namespace gradwire::core
