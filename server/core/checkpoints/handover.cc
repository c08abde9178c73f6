#include "server/core/checkpoints/handover.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "server/core/checkpoints/checkpoint_files.h"

namespace gradwire::core {
namespace {

namespace fs = std::filesystem;
using checkpoint_files::Claim;
using checkpoint_files::ReadClaim;
using checkpoint_files::ReadToken;
using checkpoint_files::WallSeconds;

// A hand-over request: DIR/.servers/<holder>/<module id>/<taker>, holding the epoch asked about.
struct Request {
  std::string path;
  int64_t epoch = 0;
  double age_s = 0;
};

}  // namespace

std::vector<std::string> HandOver::Requests() {
  std::vector<std::string> picked;
  if (!heartbeat_.started()) return picked;
  const double now = WallSeconds();
  std::error_code ec;
  fs::directory_iterator it(layout_.ServerFolder(heartbeat_.server()), ec), end;
  for (; !ec && it != end; it.increment(ec)) {
    const std::string id = it->path().filename().string();
    std::error_code type_ec;
    if (id.empty() || id[0] == '.' || !it->is_directory(type_ec)) continue;
    std::vector<Request> requests;
    std::error_code in_ec;
    fs::directory_iterator r(it->path(), in_ec);
    for (; !in_ec && r != end; r.increment(in_ec)) {
      Request q;
      q.path = r->path().string();
      struct stat st;
      const int fd = ::open(q.path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) continue;
      char buf[32] = {};
      const ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
      const bool stat_ok = ::fstat(fd, &st) == 0;
      ::close(fd);
      if (n <= 0 || !absl::SimpleAtoi(absl::StripAsciiWhitespace(buf), &q.epoch) || !stat_ok) {
        continue;
      }
      q.age_s = now - (double(st.st_mtim.tv_sec) + 1e-9 * st.st_mtim.tv_nsec);
      if (q.age_s > kStaleRequestS) {  // a taker that died waiting
        ::unlink(q.path.c_str());
        continue;
      }
      requests.push_back(std::move(q));
    }
    if (requests.empty()) {
      ::rmdir(it->path().c_str());  // empty: every taker is done with it
      continue;
    }
    std::vector<int64_t> asked;
    for (const Request& q : requests) asked.push_back(q.epoch);
    const std::optional<int64_t> epoch = claims_.PickUp(id, asked);
    if (!epoch) continue;  // not held here under the epoch asked about: left to its takers
    // Picked up: each taker asking about this epoch reads its request's removal as that.
    for (const Request& q : requests) {
      if (q.epoch == *epoch) ::unlink(q.path.c_str());
    }
    picked.push_back(id);
  }
  return picked;
}

void HandOver::Release(const std::string& module_id) {
  // Only the holding that was picked up: a take-over of the module here since is a new one.
  const std::optional<ClaimBook::Holding> held = claims_.EndPickedUp(module_id);
  if (!held) return;
  // Removed even when the hand-over's save failed, so that the taker does not wait: it then reads
  // the last state saved, and may claim this epoch again (under a token of its own, which keeps
  // this server fenced).
  const std::string claim = layout_.ClaimPathOf(module_id, held->epoch);
  if (ReadToken(claim) == held->token) ::unlink(claim.c_str());
}

void HandOver::Leave() {
  if (!heartbeat_.started()) return;
  const std::map<std::string, ClaimBook::Holding> held = claims_.EndAll();
  // The claims of the modules saved under them go (a taker waiting on one goes on with that
  // state; the state file keeps the epoch from being claimed again), then its folder.
  struct stat st;
  for (const auto& [id, h] : held) {
    const std::string claim = layout_.ClaimPathOf(id, h.epoch);
    if (::stat(layout_.StatePathOf(id, h.epoch).c_str(), &st) == 0 && ReadToken(claim) == h.token) {
      ::unlink(claim.c_str());
    }
  }
  heartbeat_.Stop();
}

void HandOver::Ask(const std::string& module_id, int64_t epoch) const {
  const std::string claim_path = layout_.ClaimPathOf(module_id, epoch);
  const Claim claim = ReadClaim(claim_path);
  const std::string& server = heartbeat_.server();
  if (claim.server.empty() || claim.server == server ||
      claim.server.find('/') != std::string::npos || claim.server[0] == '.') {
    return;
  }
  const auto alive = [&] { return heartbeat_.Alive(claim.server); };
  if (!alive()) return;  // gone: killed (its heartbeat stopped), or stopped (its folder went)
  const std::string folder = (fs::path(layout_.ServerFolder(claim.server)) / module_id).string();
  if (::mkdir(folder.c_str(), 0755) != 0 && errno != EEXIST) return;
  const std::string request = (fs::path(folder) / server).string();
  {
    const int fd = ::open(request.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return;
    const std::string text = absl::StrCat(epoch, "\n");
    const bool ok = ::write(fd, text.data(), text.size()) == ssize_t(text.size());
    ::close(fd);
    if (!ok) {
      ::unlink(request.c_str());
      return;
    }
  }
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  const auto seconds = [&] { return std::chrono::duration<double>(Clock::now() - start).count(); };
  struct stat st;
  // Picked up when the holder removes the request (or, stopping, its claim); then handed over
  // when its claim goes. A holder whose heartbeat stops meanwhile is not waited for.
  bool picked = false;
  while (!picked) {
    if (::stat(request.c_str(), &st) != 0 || ::stat(claim_path.c_str(), &st) != 0) {
      picked = true;
    } else if (seconds() >= wait_s_ || !alive()) {
      if (::unlink(request.c_str()) == 0) {  // else the holder picked it up just now
        ::rmdir(folder.c_str());
        spdlog::warn(
            "module {}: its holder (server {}) did not pick up a hand-over request within {:.1f} "
            "s (--checkpoint-handover-wait {} s){}; taking it over from its last checkpoint",
            module_id, claim.server, seconds(), wait_s_,
            alive() ? "" : ", and its heartbeat stopped");
        return;
      }
      picked = true;
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  while (::stat(claim_path.c_str(), &st) == 0) {
    if (seconds() >= wait_s_ + kReleaseWithinS || !alive()) {
      spdlog::warn(
          "module {}: its holder (server {}) picked up a hand-over request but did not release "
          "the module within {:.1f} s{}; taking it over from its last checkpoint",
          module_id, claim.server, seconds(), alive() ? "" : " (its heartbeat stopped)");
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  spdlog::info("module {}: handed over by its holder (server {}) in {:.1f} ms", module_id,
               claim.server, 1e3 * seconds());
}

}  // namespace gradwire::core
