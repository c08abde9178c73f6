// libFuzzer target: the safetensors parser of the client library (weights import/export in the
// CLI) and of the server (checkpoints), through both entry points: ParseSafetensors on bytes in
// memory and ReadSafetensorsFile on the same bytes as a file, which reads each tensor straight
// from the file. The two must agree; whatever parses must serialize and parse back to the same
// tensors and metadata; every failure is INVALID_ARGUMENT.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "gradwire/storage/safetensors_file.h"

namespace {

using gradwire::storage::StTensor;

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "safetensors_fuzzer invariant broken: %s\n", what.c_str());
  std::abort();
}

bool Same(const std::vector<StTensor>& a, const std::vector<StTensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].name != b[i].name || a[i].dtype != b[i].dtype || a[i].shape != b[i].shape ||
        a[i].data != b[i].data) {
      return false;
    }
  }
  return true;
}

// The bytes as a file without touching the disk: a memfd, read back through /proc/self/fd.
absl::StatusOr<std::vector<StTensor>> ReadAsFile(const uint8_t* data, size_t size,
                                                 std::map<std::string, std::string>* metadata) {
  static const int fd = memfd_create("safetensors_fuzzer", 0);
  if (fd < 0) Fail("memfd_create");
  if (ftruncate(fd, 0) != 0 || pwrite(fd, data, size, 0) != ssize_t(size)) Fail("memfd write");
  return gradwire::storage::ReadSafetensorsFile("/proc/self/fd/" + std::to_string(fd), metadata);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  std::map<std::string, std::string> metadata = {{"untouched", "on failure"}};
  auto parsed = gradwire::storage::ParseSafetensors(bytes, &metadata);
  std::map<std::string, std::string> file_metadata;
  auto from_file = ReadAsFile(data, size, &file_metadata);
  if (parsed.ok() != from_file.ok()) {
    Fail("ParseSafetensors says " + parsed.status().ToString() + ", ReadSafetensorsFile says " +
         from_file.status().ToString());
  }
  if (!parsed.ok()) {
    if (parsed.status().code() != absl::StatusCode::kInvalidArgument ||
        from_file.status().code() != absl::StatusCode::kInvalidArgument) {
      Fail("unexpected code " + parsed.status().ToString() + " / " + from_file.status().ToString());
    }
    if (metadata.size() != 1 || metadata.count("untouched") != 1) Fail("metadata touched");
    return 0;
  }
  if (!Same(*parsed, *from_file) || metadata != file_metadata) Fail("parse vs file read differ");
  uint64_t data_bytes = 0;
  for (const StTensor& t : *parsed) {
    uint64_t numel = 1;
    for (int64_t d : t.shape) {
      if (d < 0) Fail("negative dimension in " + t.name);
      numel *= uint64_t(d);
    }
    if (numel * uint64_t(gradwire::storage::StDTypeSize(t.dtype)) != t.data.size()) {
      Fail("data size of " + t.name);
    }
    data_bytes += t.data.size();
  }
  if (data_bytes + 8 > size) Fail("more tensor bytes than input bytes");
  auto again = gradwire::storage::SerializeSafetensors(*parsed, metadata);
  if (!again.ok()) Fail("a parsed file does not serialize: " + again.status().ToString());
  std::map<std::string, std::string> metadata2;
  auto reparsed = gradwire::storage::ParseSafetensors(*again, &metadata2);
  if (!reparsed.ok()) Fail("a serialized file does not parse: " + reparsed.status().ToString());
  // Serialization lays the tensors out in the parsed order, so the order survives as well.
  if (!Same(*parsed, *reparsed) || metadata != metadata2) Fail("round trip changed the tensors");
  return 0;
}
