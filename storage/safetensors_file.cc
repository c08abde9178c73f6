#include "gradwire/storage/safetensors_file.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "gradwire/storage/durable_file.h"

namespace gradwire::storage {
namespace {

absl::Status WithPath(const absl::Status& s, const std::string& path) {
  return absl::Status(s.code(), absl::StrCat(QuotePath(path), ": ", s.message()));
}

}  // namespace

absl::Status WriteSafetensorsFile(const std::string& path, const std::vector<StTensor>& tensors,
                                  const std::map<std::string, std::string>& metadata) {
  absl::StatusOr<std::string> bytes = SerializeSafetensors(tensors, metadata);
  if (!bytes.ok()) return WithPath(bytes.status(), path);
  return WriteFileAtomically(path, *bytes);
}

absl::StatusOr<std::vector<StTensor>> ReadSafetensorsFile(
    const std::string& path, std::map<std::string, std::string>* metadata) {
  absl::StatusOr<ReadOnlyFile> file = ReadOnlyFile::Open(path);
  if (!file.ok()) return file.status();
  const uint64_t file_size = file->size();

  char prefix[kSafetensorsPrefixBytes];
  const uint64_t prefix_size = std::min<uint64_t>(file_size, kSafetensorsPrefixBytes);
  if (absl::Status s = file->ReadExactly(prefix, prefix_size, 0); !s.ok()) return s;
  absl::StatusOr<uint64_t> n =
      SafetensorsHeaderLength(absl::string_view(prefix, prefix_size), file_size);
  if (!n.ok()) return WithPath(n.status(), path);

  // Bounded by both the 100 MiB limit and the file's size, checked above.
  std::string header(*n, '\0');
  if (absl::Status s = file->ReadExactly(header.data(), *n, kSafetensorsPrefixBytes); !s.ok()) {
    return s;
  }
  const uint64_t data_start = kSafetensorsPrefixBytes + *n;
  absl::StatusOr<std::vector<StEntry>> entries =
      ParseSafetensorsHeader(header, file_size - data_start, metadata);
  if (!entries.ok()) return WithPath(entries.status(), path);
  header = std::string();

  std::vector<StTensor> tensors;
  tensors.reserve(entries->size());
  for (StEntry& e : *entries) {
    // Sizes were checked against the file's size, so this allocates no more than the file holds.
    e.tensor.data.resize(e.end - e.begin);
    if (absl::Status s =
            file->ReadExactly(e.tensor.data.data(), e.end - e.begin, data_start + e.begin);
        !s.ok()) {
      return s;
    }
    tensors.push_back(std::move(e.tensor));
  }
  return tensors;
}

}  // namespace gradwire::storage
