// Checkpointer: the directory's lock, claims and take-overs, saves and restores (heartbeats and
// hand-overs: checkpoint_handover.cc; the files themselves: checkpoint_files.h).
#include "server/core/checkpoints/checkpoint.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <set>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "gradwire/storage/durable_file.h"
#include "server/common/status_macros.h"
#include "server/core/checkpoints/checkpoint_files.h"
#include "server/core/contexts/context_store.h"
#include "server/core/module_state.h"

namespace gradwire::core {
namespace {

namespace fs = std::filesystem;
using checkpoint_files::CheckFolderName;
using checkpoint_files::EndsWith;
using checkpoint_files::kAliveFile;
using checkpoint_files::kLockFile;
using checkpoint_files::kServersDir;
using checkpoint_files::kSuffix;
using checkpoint_files::ReadState;
using checkpoint_files::ReadToken;
using checkpoint_files::Scan;
using checkpoint_files::ScanFolder;
using checkpoint_files::WallSeconds;
using checkpoint_files::WriteClaim;

}  // namespace

Checkpointer::Checkpointer(std::string dir, int64_t every_steps)
    : dir_(std::move(dir)), every_steps_(every_steps), server_(RandomId128()) {}

Checkpointer::~Checkpointer() {
  if (lock_fd_ >= 0) ::close(lock_fd_);
}

std::string Checkpointer::FolderOf(const std::string& module_id) const {
  return (fs::path(dir_) / module_id).string();
}

std::string Checkpointer::StatePathOf(const std::string& module_id, int64_t epoch) const {
  return (fs::path(dir_) / module_id / absl::StrCat("state.", epoch, kSuffix)).string();
}

std::string Checkpointer::ClaimPathOf(const std::string& module_id, int64_t epoch) const {
  return (fs::path(dir_) / module_id / absl::StrCat("claim.", epoch)).string();
}

std::string Checkpointer::LegacyPathOf(const std::string& module_id) const {
  return (fs::path(dir_) / (module_id + kSuffix)).string();
}

std::string Checkpointer::ServerFolder(const std::string& server) const {
  return (fs::path(dir_) / kServersDir / server).string();
}

absl::Status Checkpointer::Prepare(bool shared) {
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec || !fs::is_directory(dir_)) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint dir ", dir_, " cannot be created: ", ec.message()));
  }
  const std::string lock = (fs::path(dir_) / kLockFile).string();
  const int fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::FailedPreconditionError(absl::StrCat("checkpoint dir ", dir_,
                                                      " is not writable: cannot open ", lock, ": ",
                                                      std::strerror(errno)));
  }
  if (::flock(fd, (shared ? LOCK_SH : LOCK_EX) | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd);
    if (err == EWOULDBLOCK) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint dir ", dir_, " is in use by another gradwire-server ",
          shared ? "that holds it alone" : "",
          ": servers that share a checkpoint directory must all be started with "
          "--checkpoint-shared, and a server without it must be the directory's only one"));
    }
    return absl::FailedPreconditionError(
        absl::StrCat("cannot lock ", lock, ": ", std::strerror(err)));
  }
  if (lock_fd_ >= 0) ::close(lock_fd_);
  lock_fd_ = fd;
  shared_ = shared;
  if (shared) {
    // Folders of servers that were killed long ago (a clean stop removes its own).
    std::error_code it_ec;
    fs::directory_iterator it(fs::path(dir_) / kServersDir, it_ec), end;
    for (; !it_ec && it != end; it.increment(it_ec)) {
      struct stat st;
      const std::string alive = (it->path() / kAliveFile).string();
      const bool stale = ::stat(alive.c_str(), &st) != 0 ||
                         WallSeconds() - double(st.st_mtim.tv_sec) > kForgetServerAfterS;
      std::error_code rm;
      if (stale) fs::remove_all(it->path(), rm);
    }
    std::error_code mk;
    fs::create_directories(ServerFolder(server_), mk);
    if (mk) {
      return absl::FailedPreconditionError(absl::StrCat(
          "cannot create ", storage::QuotePath(ServerFolder(server_)), ": ", mk.message()));
    }
    Heartbeat();
  }
  return absl::OkStatus();
}

absl::Status Checkpointer::ClaimNew(const std::string& module_id) {
  GW_RETURN_IF_ERROR(CheckFolderName(module_id));
  const std::string folder = FolderOf(module_id);
  const auto taken = [&] {
    return absl::AlreadyExistsError(absl::StrCat(
        "module_id ", module_id,
        " has a checkpoint in --checkpoint-dir already (a module of another server, or one not "
        "loaded here yet): choose another id"));
  };
  struct stat st;
  if (::stat(LegacyPathOf(module_id).c_str(), &st) == 0) return taken();
  if (::mkdir(folder.c_str(), 0755) != 0) {
    if (errno == EEXIST) return taken();
    return absl::InternalError(
        absl::StrCat("cannot create ", storage::QuotePath(folder), ": ", std::strerror(errno)));
  }
  const std::string token = RandomId128();
  GW_RETURN_IF_ERROR(WriteClaim(ClaimPathOf(module_id, 1), token, server_));
  std::lock_guard<std::mutex> lock(mu_);
  held_[module_id] = Held{1, token, true, false};
  return absl::OkStatus();
}

absl::StatusOr<Checkpointer::TakeOver> Checkpointer::Take(ModuleHost& host,
                                                          const std::string& module_id) {
  GW_RETURN_IF_ERROR(CheckFolderName(module_id));
  const std::string folder = FolderOf(module_id), legacy = LegacyPathOf(module_id);
  Scan before = ScanFolder(folder, legacy);
  if (!before.any_state()) {
    return absl::NotFoundError(
        absl::StrCat("module_id ", module_id, " has no checkpoint in ", dir_));
  }
  if (shared_ && handover_wait_s_ > 0 && before.max_claim() > 0) {
    const int64_t asked = before.max_claim();
    AskHolder(module_id, asked);
    before = ScanFolder(folder, legacy);  // the holder's last save and released claim
    if (!before.any_state()) {            // deleted there meanwhile
      return absl::NotFoundError(
          absl::StrCat("module_id ", module_id, " has no checkpoint in ", dir_));
    }
    if (before.max_claim() > asked) {  // another server took it over meanwhile: not asked yet
      return absl::AbortedError(absl::StrCat(
          "module ", module_id,
          " was taken over by another server while this one waited for its hand-over; retry"));
    }
  }
  std::error_code ec;
  fs::create_directories(folder, ec);
  TakeOver out;
  out.epoch = std::max(before.max_claim(), before.max_state()) + 1;
  const std::string token = RandomId128();
  GW_RETURN_IF_ERROR(WriteClaim(ClaimPathOf(module_id, out.epoch), token, server_));
  // The earlier holders' claims go: each of them is fenced from now on (CheckHeld).
  for (int64_t e : before.claims) {
    if (e < out.epoch) fs::remove(ClaimPathOf(module_id, e), ec);
  }
  // Scanned again after the claim: a state the last holder saved in between is the newest.
  const Scan after = ScanFolder(folder, legacy);
  out.from_epoch = std::max<int64_t>(after.max_state(), 0);
  const std::string path = after.states.empty() ? legacy : StatePathOf(module_id, out.from_epoch);
  GW_ASSIGN_OR_RETURN(ModuleState state, ReadState(path));
  if (state.module_id != module_id) {
    return absl::DataLossError(
        absl::StrCat(path, " holds module ", state.module_id, ", not module ", module_id));
  }
  if (auto s = host.ImportState(state); !s.ok()) {
    return absl::Status(
        s.code() == absl::StatusCode::kAlreadyExists ? s.code() : absl::StatusCode::kDataLoss,
        absl::StrCat(path, ": ", s.message()));
  }
  out.weight_version = state.weight_version;
  out.optimizer_steps = state.optimizer_steps;
  std::lock_guard<std::mutex> lock(mu_);
  held_[module_id] = Held{out.epoch, token, false, true};
  return out;
}

absl::Status Checkpointer::CheckHeld(const std::string& module_id, const Held& held) const {
  struct stat st;
  const bool mine = ReadToken(ClaimPathOf(module_id, held.epoch)) == held.token;
  if (mine && ::stat(ClaimPathOf(module_id, held.epoch + 1).c_str(), &st) != 0) {
    return absl::OkStatus();
  }
  return ModuleMovedError(
      module_id, absl::StrCat("this server held it under checkpoint epoch ", held.epoch,
                              ", and another server has claimed it since (or deleted it); this "
                              "server no longer serves or saves it. Behind a proxy, retry: the "
                              "call goes where the module is now"));
}

absl::StatusOr<Checkpointer::Held> Checkpointer::HeldOf(const std::string& module_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = held_.find(module_id);
  if (it == held_.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("module ", module_id, " is not held by this server's checkpoints"));
  }
  return it->second;
}

absl::Status Checkpointer::CheckHeld(const std::string& module_id) const {
  GW_ASSIGN_OR_RETURN(const Held held, HeldOf(module_id));
  return CheckHeld(module_id, held);
}

bool Checkpointer::IsMoved(const absl::Status& status) { return IsModuleMoved(status); }

int64_t Checkpointer::EpochOf(const std::string& module_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = held_.find(module_id);
  return it == held_.end() ? 0 : it->second.epoch;
}

bool Checkpointer::TookOver(const std::string& module_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = held_.find(module_id);
  return it != held_.end() && it->second.took_over;
}

absl::Status Checkpointer::SaveState(const ModuleState& state, int64_t epoch) const {
  return checkpoint_files::WriteState(StatePathOf(state.module_id, epoch), state, epoch);
}

absl::Status Checkpointer::Save(const ModuleHost& host, const std::string& module_id) {
  GW_ASSIGN_OR_RETURN(const Held held, HeldOf(module_id));
  GW_RETURN_IF_ERROR(CheckHeld(module_id, held));
  GW_ASSIGN_OR_RETURN(ModuleState state, host.ExportState(module_id));
  GW_RETURN_IF_ERROR(SaveState(state, held.epoch));
  if (held.superseded) return absl::OkStatus();
  // The first save under this epoch: the states it superseded go.
  std::error_code ec;
  for (int64_t e : ScanFolder(FolderOf(module_id), LegacyPathOf(module_id)).states) {
    if (e < held.epoch) fs::remove(StatePathOf(module_id, e), ec);
  }
  fs::remove(LegacyPathOf(module_id), ec);
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = held_.find(module_id); it != held_.end() && it->second.epoch == held.epoch) {
    it->second.superseded = true;
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> Checkpointer::SaveAll(const ModuleHost& host) {
  int64_t saved = 0;
  for (const ModuleInfo& info : host.List()) {
    absl::Status s = Save(host, info.module_id);
    if (IsMoved(s)) {
      spdlog::warn("not saving module {}: {}", info.module_id, std::string(s.message()));
      continue;
    }
    GW_RETURN_IF_ERROR(s);
    ++saved;
  }
  return saved;
}

std::vector<std::pair<std::string, absl::Status>> Checkpointer::Lost() const {
  std::map<std::string, Held> held;
  {
    std::lock_guard<std::mutex> lock(mu_);
    held = held_;
  }
  std::vector<std::pair<std::string, absl::Status>> lost;
  for (const auto& [id, h] : held) {
    if (absl::Status s = CheckHeld(id, h); !s.ok()) lost.emplace_back(id, std::move(s));
  }
  return lost;
}

void Checkpointer::Forget(const std::string& module_id) {
  std::lock_guard<std::mutex> lock(mu_);
  held_.erase(module_id);
}

absl::Status Checkpointer::Remove(const std::string& module_id) {
  GW_RETURN_IF_ERROR(CheckFolderName(module_id));
  Forget(module_id);
  std::error_code ec;
  fs::remove_all(FolderOf(module_id), ec);
  if (!ec) fs::remove(LegacyPathOf(module_id), ec);
  if (ec) {
    return absl::InternalError(
        absl::StrCat("cannot remove the checkpoint of module ", module_id, ": ", ec.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> Checkpointer::RestoreAll(ModuleHost& host) {
  std::set<std::string> ids;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir_, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.empty() || name[0] == '.') continue;
    std::error_code dir_ec;
    if (entry.is_directory(dir_ec)) {
      ids.insert(name);
    } else if (EndsWith(name, kSuffix) && name.size() > strlen(kSuffix)) {
      ids.insert(name.substr(0, name.size() - strlen(kSuffix)));
    }  // else: temporary files of an interrupted write, or foreign files
  }
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot read checkpoint dir ", dir_, ": ", ec.message()));
  }
  int64_t restored = 0;
  for (const std::string& id : ids) {
    absl::StatusOr<TakeOver> took = Take(host, id);
    if (took.status().code() == absl::StatusCode::kNotFound) continue;  // a create cut short
    if (!took.ok()) return took.status();
    ++restored;
  }
  return restored;
}

}  // namespace gradwire::core
