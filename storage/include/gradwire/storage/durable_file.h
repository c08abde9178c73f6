// Durable file I/O for what the server and the CLI keep on disk (checkpoints, exported weights):
// whole-file atomic replacement that survives a crash, and exact positional reads. POSIX only,
// torch- and gRPC-free. Every error is a status whose message names the path; the code says what
// went wrong: NOT_FOUND (no such file or directory), PERMISSION_DENIED (not allowed, read-only
// file system), RESOURCE_EXHAUSTED (no space, quota), INVALID_ARGUMENT (not a regular file, or a
// file shorter than a read asked for), INTERNAL (any other I/O error).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace gradwire::storage {

// Replaces the file at `path` with `bytes` so that a reader, or the file system after a crash,
// sees either the old file or the whole new one: the bytes go to `path` + ".tmp.<pid>", which is
// fsync'ed, renamed over `path`, and then the directory is synced so that the rename itself is
// durable. The temporary file is removed on failure.
absl::Status WriteFileAtomically(const std::string& path, absl::string_view bytes);

// A regular file opened for reading at explicit offsets. Movable, not copyable; closes on
// destruction.
class ReadOnlyFile {
 public:
  // Opens `path`; INVALID_ARGUMENT when it is not a regular file (a directory, a device).
  static absl::StatusOr<ReadOnlyFile> Open(const std::string& path);
  ReadOnlyFile(ReadOnlyFile&& other) noexcept;
  ReadOnlyFile& operator=(ReadOnlyFile&& other) noexcept;
  ReadOnlyFile(const ReadOnlyFile&) = delete;
  ReadOnlyFile& operator=(const ReadOnlyFile&) = delete;
  ~ReadOnlyFile();

  // The file's size when it was opened.
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }
  // Reads exactly `size` bytes at `offset` into `out`; a file that ends first is INVALID_ARGUMENT
  // naming the offset where it ended.
  absl::Status ReadExactly(char* out, uint64_t size, uint64_t offset) const;

 private:
  ReadOnlyFile(int fd, uint64_t size, std::string path)
      : fd_(fd), size_(size), path_(std::move(path)) {}
  int fd_ = -1;
  uint64_t size_ = 0;
  std::string path_;
};

// `path` quoted for a message: C-escaped, and cut after 80 characters (with its length) so that a
// hostile or runaway name cannot flood a log.
std::string QuotePath(absl::string_view path);

}  // namespace gradwire::storage
