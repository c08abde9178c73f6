#include "gradwire/storage/durable_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace gradwire::storage {
namespace {

// strerror_r comes in a GNU flavour (returns the message) and an XSI one (fills the buffer).
[[maybe_unused]] const char* StrerrorResult(const char* message, const char*) { return message; }
[[maybe_unused]] const char* StrerrorResult(int, const char* buffer) { return buffer; }

std::string ErrnoText(int err) {
  char buffer[256] = "unknown error";
  return StrerrorResult(strerror_r(err, buffer, sizeof(buffer)), buffer);
}

absl::Status ErrnoStatus(int err, absl::string_view what) {
  std::string message = absl::StrCat(what, ": ", ErrnoText(err));
  switch (err) {
    case ENOENT:
    case ENOTDIR:
      return absl::NotFoundError(message);
    case EACCES:
    case EPERM:
    case EROFS:
      return absl::PermissionDeniedError(message);
    case ENOSPC:
    case EDQUOT:
      return absl::ResourceExhaustedError(message);
    default:
      return absl::InternalError(message);
  }
}

class FdCloser {
 public:
  explicit FdCloser(int fd) : fd_(fd) {}
  ~FdCloser() {
    if (fd_ >= 0) ::close(fd_);
  }
  FdCloser(const FdCloser&) = delete;
  FdCloser& operator=(const FdCloser&) = delete;
  // Closes now, for callers that must see close(2)'s error.
  int Close() {
    const int rc = ::close(fd_);
    fd_ = -1;
    return rc;
  }
  // Hands the descriptor over without closing it.
  int Release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

absl::Status WriteAll(int fd, absl::string_view bytes, const std::string& path) {
  while (!bytes.empty()) {
    const ssize_t n = ::write(fd, bytes.data(), bytes.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, absl::StrCat("cannot write ", QuotePath(path)));
    }
    bytes.remove_prefix(static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

// Reads exactly `size` bytes at `offset`; a file that ends early is INVALID_ARGUMENT.
absl::Status PreadAll(int fd, char* out, uint64_t size, uint64_t offset, const std::string& path) {
  while (size > 0) {
    const ssize_t n = ::pread(fd, out, size, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, absl::StrCat("cannot read ", QuotePath(path)));
    }
    if (n == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(QuotePath(path), ": file ended at byte ", offset, " while reading it"));
    }
    out += n;
    size -= static_cast<uint64_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

// Makes the rename itself durable. Filesystems that cannot sync directories report EINVAL; there
// is nothing more to do on those.
absl::Status SyncParentDirectory(const std::string& path) {
  const size_t slash = path.rfind('/');
  const std::string dir =
      slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    return ErrnoStatus(errno, absl::StrCat(QuotePath(path), " was written but its directory ",
                                           QuotePath(dir), " could not be opened to sync it"));
  }
  FdCloser closer(fd);
  if (::fsync(fd) != 0 && errno != EINVAL) {
    return ErrnoStatus(errno, absl::StrCat(QuotePath(path), " was written but its directory ",
                                           QuotePath(dir), " could not be synced"));
  }
  return absl::OkStatus();
}

}  // namespace

std::string QuotePath(absl::string_view path) {
  constexpr size_t kMaxQuotedChars = 80;
  if (path.size() <= kMaxQuotedChars) return absl::StrCat("'", absl::CHexEscape(path), "'");
  return absl::StrCat("'", absl::CHexEscape(path.substr(0, kMaxQuotedChars)), "'... (", path.size(),
                      " bytes)");
}

absl::Status WriteFileAtomically(const std::string& path, absl::string_view bytes) {
  const std::string tmp = absl::StrCat(path, ".tmp.", ::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    return ErrnoStatus(
        errno, absl::StrCat("cannot create ", QuotePath(tmp), " to write ", QuotePath(path)));
  }
  FdCloser closer(fd);
  absl::Status status = WriteAll(fd, bytes, tmp);
  // Without the fsync, a crash soon after the rename can leave `path` naming an empty file.
  if (status.ok() && ::fsync(fd) != 0) {
    status = ErrnoStatus(errno, absl::StrCat("cannot fsync ", QuotePath(tmp)));
  }
  if (closer.Close() != 0 && status.ok()) {
    status = ErrnoStatus(errno, absl::StrCat("cannot close ", QuotePath(tmp)));
  }
  if (status.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    status =
        ErrnoStatus(errno, absl::StrCat("cannot rename ", QuotePath(tmp), " to ", QuotePath(path)));
  }
  if (!status.ok()) {
    ::unlink(tmp.c_str());
    return status;
  }
  return SyncParentDirectory(path);
}

absl::StatusOr<ReadOnlyFile> ReadOnlyFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("cannot open ", QuotePath(path)));
  FdCloser closer(fd);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    return ErrnoStatus(errno, absl::StrCat("cannot stat ", QuotePath(path)));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(QuotePath(path), " is not a regular file"));
  }
  return ReadOnlyFile(closer.Release(), static_cast<uint64_t>(st.st_size), path);
}

ReadOnlyFile::ReadOnlyFile(ReadOnlyFile&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), size_(other.size_), path_(std::move(other.path_)) {}

ReadOnlyFile& ReadOnlyFile::operator=(ReadOnlyFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    size_ = other.size_;
    path_ = std::move(other.path_);
  }
  return *this;
}

ReadOnlyFile::~ReadOnlyFile() {
  if (fd_ >= 0) ::close(fd_);
}

absl::Status ReadOnlyFile::ReadExactly(char* out, uint64_t size, uint64_t offset) const {
  return PreadAll(fd_, out, size, offset, path_);
}

}  // namespace gradwire::storage
