// Durable file I/O on its own: atomic replacement (whole old or whole new file, no temporary file
// left behind, errors naming the path with the right code) and exact positional reads.
#include "gradwire/storage/durable_file.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "temp_dir.h"

namespace gradwire::storage {
namespace {

namespace fs = std::filesystem;

std::string RandomBytes(size_t n) {
  static std::mt19937 rng(std::random_device{}());
  std::uniform_int_distribution<int> byte(0, 255);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(byte(rng));
  return s;
}

std::string Slurp(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

bool Mentions(const absl::Status& s, const std::string& text) {
  return std::string(s.message()).find(text) != std::string::npos;
}

class DurableFileTest : public TempDirTest {};

TEST_F(DurableFileTest, AtomicWriteCreatesThenReplacesTheWholeFile) {
  const fs::path path = dir_ / "f.bin";
  const std::string first = RandomBytes(4099);
  ASSERT_TRUE(WriteFileAtomically(path, first).ok());
  EXPECT_EQ(Slurp(path), first);
  const std::string second = RandomBytes(17);  // shorter: nothing of the old file may remain
  ASSERT_TRUE(WriteFileAtomically(path, second).ok());
  EXPECT_EQ(Slurp(path), second);
  ASSERT_TRUE(WriteFileAtomically(path, "").ok());
  EXPECT_EQ(fs::file_size(path), 0u);
  EXPECT_EQ(DirEntries(), std::vector<std::string>{"f.bin"});
}

TEST_F(DurableFileTest, AtomicWriteErrorsNameThePathAndLeaveNothing) {
  const fs::path missing = dir_ / "no_such_dir" / "f.bin";
  absl::Status s = WriteFileAtomically(missing, "abc");
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_TRUE(Mentions(s, missing.string())) << s;

  // rename(2) cannot replace a directory with a file: the old "file" stays, no temporary is left.
  const fs::path dir_target = dir_ / "is_a_dir";
  fs::create_directory(dir_target);
  s = WriteFileAtomically(dir_target, "abc");
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(Mentions(s, dir_target.string())) << s;
  EXPECT_TRUE(fs::is_directory(dir_target));
  EXPECT_EQ(DirEntries(), std::vector<std::string>{"is_a_dir"});
}

TEST_F(DurableFileTest, ReadExactlyReadsAtOffsetsAndRefusesToReadPastTheEnd) {
  const fs::path path = dir_ / "r.bin";
  const std::string bytes = RandomBytes(1000);
  std::ofstream(path, std::ios::binary) << bytes;
  absl::StatusOr<ReadOnlyFile> file = ReadOnlyFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->size(), 1000u);
  EXPECT_EQ(file->path(), path.string());
  std::string out(300, '\x5a');
  ASSERT_TRUE(file->ReadExactly(out.data(), 300, 650).ok());
  EXPECT_EQ(out, bytes.substr(650, 300));
  ASSERT_TRUE(file->ReadExactly(out.data(), 0, 1000).ok());  // an empty read at the end is fine

  const absl::Status past = file->ReadExactly(out.data(), 300, 800);
  EXPECT_EQ(past.code(), absl::StatusCode::kInvalidArgument) << past;
  EXPECT_TRUE(Mentions(past, "ended at byte 1000")) << past;
  EXPECT_TRUE(Mentions(past, path.string())) << past;

  // A moved-from file no longer owns the descriptor; the moved-to one reads as before.
  ReadOnlyFile moved = *std::move(file);
  ASSERT_TRUE(moved.ReadExactly(out.data(), 10, 0).ok());
  EXPECT_EQ(out.substr(0, 10), bytes.substr(0, 10));
}

TEST_F(DurableFileTest, OpenRefusesMissingFilesAndDirectories) {
  const fs::path missing = dir_ / "missing";
  absl::StatusOr<ReadOnlyFile> file = ReadOnlyFile::Open(missing);
  EXPECT_EQ(file.status().code(), absl::StatusCode::kNotFound) << file.status();
  EXPECT_TRUE(Mentions(file.status(), missing.string())) << file.status();
  file = ReadOnlyFile::Open(dir_);
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument) << file.status();
  EXPECT_TRUE(Mentions(file.status(), "not a regular file")) << file.status();
}

TEST(QuotePathTest, EscapesAndBoundsLongPaths) {
  EXPECT_EQ(QuotePath("a/b\n"), "'a/b\\n'");
  const std::string long_path(5000, 'x');
  const std::string quoted = QuotePath(long_path);
  EXPECT_LT(quoted.size(), 120u);
  EXPECT_NE(quoted.find("(5000 bytes)"), std::string::npos) << quoted;
}

}  // namespace
}  // namespace gradwire::storage
