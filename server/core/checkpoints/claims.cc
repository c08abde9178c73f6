#include "server/core/checkpoints/claims.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "gradwire/storage/durable_file.h"
#include "server/common/status_macros.h"
#include "server/core/checkpoints/checkpoint_files.h"
#include "server/core/contexts/context_store.h"
#include "server/core/host_types.h"

namespace gradwire::core {

namespace fs = std::filesystem;

absl::Status ClaimBook::ClaimNew(const std::string& module_id) {
  GW_RETURN_IF_ERROR(checkpoint_files::CheckFolderName(module_id));
  const std::string folder = layout_.FolderOf(module_id);
  const auto taken = [&] {
    return absl::AlreadyExistsError(absl::StrCat(
        "module_id ", module_id,
        " has a checkpoint in --checkpoint-dir already (a module of another server, or one not "
        "loaded here yet): choose another id"));
  };
  struct stat st;
  if (::stat(layout_.LegacyPathOf(module_id).c_str(), &st) == 0) return taken();
  if (::mkdir(folder.c_str(), 0755) != 0) {
    if (errno == EEXIST) return taken();
    return absl::InternalError(
        absl::StrCat("cannot create ", storage::QuotePath(folder), ": ", std::strerror(errno)));
  }
  const std::string token = RandomId128();
  GW_RETURN_IF_ERROR(
      checkpoint_files::WriteClaim(layout_.ClaimPathOf(module_id, 1), token, server_));
  std::lock_guard<std::mutex> lock(mu_);
  held_[module_id] = Holding{1, token, /*superseded=*/true, /*took_over=*/false};
  return absl::OkStatus();
}

absl::StatusOr<std::string> ClaimBook::ClaimNext(const std::string& module_id, int64_t epoch,
                                                 const std::vector<int64_t>& earlier) {
  std::error_code ec;
  fs::create_directories(layout_.FolderOf(module_id), ec);
  const std::string token = RandomId128();
  GW_RETURN_IF_ERROR(
      checkpoint_files::WriteClaim(layout_.ClaimPathOf(module_id, epoch), token, server_));
  for (int64_t e : earlier) {
    if (e < epoch) fs::remove(layout_.ClaimPathOf(module_id, e), ec);
  }
  return token;
}

void ClaimBook::Hold(const std::string& module_id, int64_t epoch, const std::string& token) {
  std::lock_guard<std::mutex> lock(mu_);
  held_[module_id] = Holding{epoch, token, /*superseded=*/false, /*took_over=*/true};
}

absl::Status ClaimBook::CheckHeld(const std::string& module_id, const Holding& holding) const {
  struct stat st;
  const bool mine =
      checkpoint_files::ReadToken(layout_.ClaimPathOf(module_id, holding.epoch)) == holding.token;
  if (mine && ::stat(layout_.ClaimPathOf(module_id, holding.epoch + 1).c_str(), &st) != 0) {
    return absl::OkStatus();
  }
  return ModuleMovedError(
      module_id, absl::StrCat("this server held it under checkpoint epoch ", holding.epoch,
                              ", and another server has claimed it since (or deleted it); this "
                              "server no longer serves or saves it. Behind a proxy, retry: the "
                              "call goes where the module is now"));
}

absl::StatusOr<ClaimBook::Holding> ClaimBook::HoldingOf(const std::string& module_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = held_.find(module_id);
  if (it == held_.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("module ", module_id, " is not held by this server's checkpoints"));
  }
  return it->second;
}

absl::Status ClaimBook::CheckHeld(const std::string& module_id) const {
  GW_ASSIGN_OR_RETURN(const Holding holding, HoldingOf(module_id));
  return CheckHeld(module_id, holding);
}

std::vector<std::pair<std::string, absl::Status>> ClaimBook::Lost() const {
  std::map<std::string, Holding> held;
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

int64_t ClaimBook::EpochOf(const std::string& module_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = held_.find(module_id);
  return it == held_.end() ? 0 : it->second.epoch;
}

bool ClaimBook::TookOver(const std::string& module_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = held_.find(module_id);
  return it != held_.end() && it->second.took_over;
}

void ClaimBook::MarkSuperseded(const std::string& module_id, int64_t epoch) {
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = held_.find(module_id); it != held_.end() && it->second.epoch == epoch) {
    it->second.superseded = true;
  }
}

void ClaimBook::Forget(const std::string& module_id) {
  std::lock_guard<std::mutex> lock(mu_);
  held_.erase(module_id);
}

std::optional<int64_t> ClaimBook::PickUp(const std::string& module_id,
                                         const std::vector<int64_t>& asked) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = held_.find(module_id);
  if (it == held_.end() || it->second.handing_over) return std::nullopt;
  for (int64_t e : asked) {
    if (e == it->second.epoch) {
      it->second.handing_over = true;
      return e;
    }
  }
  return std::nullopt;
}

std::optional<ClaimBook::Holding> ClaimBook::EndPickedUp(const std::string& module_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = held_.find(module_id);
  if (it == held_.end() || !it->second.handing_over) return std::nullopt;
  Holding holding = std::move(it->second);
  held_.erase(it);
  return holding;
}

std::map<std::string, ClaimBook::Holding> ClaimBook::EndAll() {
  std::map<std::string, Holding> held;
  std::lock_guard<std::mutex> lock(mu_);
  held.swap(held_);
  return held;
}

}  // namespace gradwire::core
