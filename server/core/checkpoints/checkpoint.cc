// Checkpointer: the directory's lock, take-overs, saves and restores, over its parts (claims.h,
// heartbeat.h, handover.h; the files themselves: checkpoint_files.h).
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
using checkpoint_files::kSuffix;
using checkpoint_files::ReadState;
using checkpoint_files::Scan;
using checkpoint_files::ScanFolder;

}  // namespace

Checkpointer::Checkpointer(std::string dir, int64_t every_steps)
    : layout_(std::move(dir)),
      every_steps_(every_steps),
      claims_(layout_, RandomId128()),
      heartbeat_(layout_, claims_.server()),
      handover_(layout_, claims_, heartbeat_) {}

Checkpointer::~Checkpointer() {
  if (lock_fd_ >= 0) ::close(lock_fd_);
}

absl::Status Checkpointer::Prepare(bool shared) {
  const std::string& dir = layout_.dir();
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir)) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint dir ", dir, " cannot be created: ", ec.message()));
  }
  const std::string lock = layout_.LockPath();
  const int fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::FailedPreconditionError(absl::StrCat("checkpoint dir ", dir,
                                                      " is not writable: cannot open ", lock, ": ",
                                                      std::strerror(errno)));
  }
  if (::flock(fd, (shared ? LOCK_SH : LOCK_EX) | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd);
    if (err == EWOULDBLOCK) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint dir ", dir, " is in use by another gradwire-server ",
          shared ? "that holds it alone" : "",
          ": servers that share a checkpoint directory must all be started with "
          "--checkpoint-shared, and a server without it must be the directory's only one"));
    }
    return absl::FailedPreconditionError(
        absl::StrCat("cannot lock ", lock, ": ", std::strerror(err)));
  }
  if (lock_fd_ >= 0) ::close(lock_fd_);
  lock_fd_ = fd;
  return shared ? heartbeat_.Start() : absl::OkStatus();
}

absl::StatusOr<Checkpointer::TakeOver> Checkpointer::Take(ModuleHost& host,
                                                          const std::string& module_id) {
  GW_RETURN_IF_ERROR(CheckFolderName(module_id));
  const std::string& dir = layout_.dir();
  const std::string folder = layout_.FolderOf(module_id);
  const std::string legacy = layout_.LegacyPathOf(module_id);
  Scan before = ScanFolder(folder, legacy);
  if (!before.any_state()) {
    return absl::NotFoundError(
        absl::StrCat("module_id ", module_id, " has no checkpoint in ", dir));
  }
  if (shared() && handover_.wait() > 0 && before.max_claim() > 0) {
    const int64_t asked = before.max_claim();
    handover_.Ask(module_id, asked);
    before = ScanFolder(folder, legacy);  // the holder's last save and released claim
    if (!before.any_state()) {            // deleted there meanwhile
      return absl::NotFoundError(
          absl::StrCat("module_id ", module_id, " has no checkpoint in ", dir));
    }
    if (before.max_claim() > asked) {  // another server took it over meanwhile: not asked yet
      return absl::AbortedError(absl::StrCat(
          "module ", module_id,
          " was taken over by another server while this one waited for its hand-over; retry"));
    }
  }
  TakeOver out;
  out.epoch = std::max(before.max_claim(), before.max_state()) + 1;
  // The earlier holders' claims go: each of them is fenced from now on (ClaimBook::CheckHeld).
  GW_ASSIGN_OR_RETURN(const std::string token,
                      claims_.ClaimNext(module_id, out.epoch, before.claims));
  // Scanned again after the claim: a state the last holder saved in between is the newest.
  const Scan after = ScanFolder(folder, legacy);
  out.from_epoch = std::max<int64_t>(after.max_state(), 0);
  const std::string path =
      after.states.empty() ? legacy : layout_.StatePathOf(module_id, out.from_epoch);
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
  claims_.Hold(module_id, out.epoch, token);
  return out;
}

absl::Status Checkpointer::Save(const ModuleHost& host, const std::string& module_id) {
  GW_ASSIGN_OR_RETURN(const ClaimBook::Holding held, claims_.HoldingOf(module_id));
  GW_RETURN_IF_ERROR(claims_.CheckHeld(module_id, held));
  GW_ASSIGN_OR_RETURN(ModuleState state, host.ExportState(module_id));
  GW_RETURN_IF_ERROR(checkpoint_files::WriteState(layout_.StatePathOf(state.module_id, held.epoch),
                                                  state, held.epoch));
  if (held.superseded) return absl::OkStatus();
  // The first save under this epoch: the states it superseded go.
  std::error_code ec;
  for (int64_t e :
       ScanFolder(layout_.FolderOf(module_id), layout_.LegacyPathOf(module_id)).states) {
    if (e < held.epoch) fs::remove(layout_.StatePathOf(module_id, e), ec);
  }
  fs::remove(layout_.LegacyPathOf(module_id), ec);
  claims_.MarkSuperseded(module_id, held.epoch);
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

absl::Status Checkpointer::Remove(const std::string& module_id) {
  GW_RETURN_IF_ERROR(CheckFolderName(module_id));
  claims_.Forget(module_id);
  std::error_code ec;
  fs::remove_all(layout_.FolderOf(module_id), ec);
  if (!ec) fs::remove(layout_.LegacyPathOf(module_id), ec);
  if (ec) {
    return absl::InternalError(
        absl::StrCat("cannot remove the checkpoint of module ", module_id, ": ", ec.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> Checkpointer::RestoreAll(ModuleHost& host) {
  const std::string& dir = layout_.dir();
  std::set<std::string> ids;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
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
        absl::StrCat("cannot read checkpoint dir ", dir, ": ", ec.message()));
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
