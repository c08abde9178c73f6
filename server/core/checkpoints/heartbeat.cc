#include "server/core/checkpoints/heartbeat.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "gradwire/storage/durable_file.h"
#include "server/core/checkpoints/checkpoint_files.h"

namespace gradwire::core {

namespace fs = std::filesystem;
using checkpoint_files::kAliveFile;
using checkpoint_files::WallSeconds;

absl::Status Heartbeat::Start() {
  // Folders of servers that were killed long ago (a clean stop removes its own).
  std::error_code it_ec;
  fs::directory_iterator it(layout_.ServersDir(), it_ec), end;
  for (; !it_ec && it != end; it.increment(it_ec)) {
    struct stat st;
    const std::string alive = (it->path() / kAliveFile).string();
    const bool stale = ::stat(alive.c_str(), &st) != 0 ||
                       WallSeconds() - double(st.st_mtim.tv_sec) > kForgetServerAfterS;
    std::error_code rm;
    if (stale) fs::remove_all(it->path(), rm);
  }
  std::error_code mk;
  const std::string folder = layout_.ServerFolder(server_);
  fs::create_directories(folder, mk);
  if (mk) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create ", storage::QuotePath(folder), ": ", mk.message()));
  }
  started_ = true;
  Beat();
  return absl::OkStatus();
}

void Heartbeat::Beat() const {
  const std::string alive = layout_.AlivePathOf(server_);
  if (::utimensat(AT_FDCWD, alive.c_str(), nullptr, 0) == 0) return;
  std::error_code ec;  // gone: made again (a server starting beside this one took it for stale)
  fs::create_directories(layout_.ServerFolder(server_), ec);
  const int fd = ::open(alive.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  if (fd >= 0) ::close(fd);
}

double Heartbeat::AgeOf(const std::string& server) const {
  struct stat st;
  if (::stat(layout_.AlivePathOf(server).c_str(), &st) != 0) return -1;
  return std::max(0.0, WallSeconds() - (double(st.st_mtim.tv_sec) + 1e-9 * st.st_mtim.tv_nsec));
}

void Heartbeat::Stop() {
  std::error_code ec;
  fs::remove_all(layout_.ServerFolder(server_), ec);
}

}  // namespace gradwire::core
