// Where everything of a checkpoint directory lies (checkpoint.h describes the layout). Torch-free:
// the rpc layer sees it through checkpoint.h. Its definitions are with the files' formats, in
// checkpoint_files.cc.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

namespace gradwire::core::checkpoint_files {

inline constexpr char kSuffix[] = ".gradwire.safetensors";
inline constexpr char kLockFile[] = ".gradwire-lock";
// DIR/.servers/<token>/: a shared server's heartbeat and the hand-over requests addressed to it.
inline constexpr char kServersDir[] = ".servers";
inline constexpr char kAliveFile[] = "alive";
inline constexpr int kFormatVersion = 1;

// Where everything of a checkpoint directory `dir` lies.
class Layout {
 public:
  explicit Layout(std::string dir) : dir_(std::move(dir)) {}
  const std::string& dir() const { return dir_; }
  // DIR/<module id>/
  std::string FolderOf(const std::string& module_id) const;
  // DIR/<module id>/state.<epoch>.gradwire.safetensors
  std::string StatePathOf(const std::string& module_id, int64_t epoch) const;
  // DIR/<module id>/claim.<epoch>
  std::string ClaimPathOf(const std::string& module_id, int64_t epoch) const;
  // The flat layout's file of a module, DIR/<module id>.gradwire.safetensors (read as epoch 0).
  std::string LegacyPathOf(const std::string& module_id) const;
  // DIR/.servers/
  std::string ServersDir() const;
  // DIR/.servers/<server>/: a shared server's heartbeat and the hand-over requests addressed to it.
  std::string ServerFolder(const std::string& server) const;
  // DIR/.servers/<server>/alive
  std::string AlivePathOf(const std::string& server) const;
  // DIR/.gradwire-lock
  std::string LockPath() const;

 private:
  std::string dir_;
};

}  // namespace gradwire::core::checkpoint_files
