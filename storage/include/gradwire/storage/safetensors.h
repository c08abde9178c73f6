// The safetensors format (https://github.com/huggingface/safetensors), restricted to the element
// types gradwire stores: serialising and parsing in memory, torch- and gRPC-free. Files on disk
// are gradwire/storage/safetensors_file.h.
//
// Layout: an 8-byte little-endian unsigned header length N, N bytes of a UTF-8 JSON object, then
// the data section. Every tensor entry of the header gives its dtype, shape and
// [begin, end) byte offsets relative to the start of the data section; "__metadata__", when
// present, maps strings to strings. The tensors' byte ranges must cover the data section exactly,
// without overlaps or holes.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace gradwire::storage {

// Element types gradwire stores in safetensors files. Their safetensors names are "F32", "BF16",
// "F16", "F8_E4M3" and "F8_E5M2".
enum class StDType { kF32, kBF16, kF16, kF8E4M3, kF8E5M2 };

// The safetensors name of `dtype`, e.g. "F8_E4M3".
absl::string_view StDTypeName(StDType dtype);
// Bytes per element of `dtype`.
int64_t StDTypeSize(StDType dtype);

// One named tensor. A shape of [] is a scalar (one element).
struct StTensor {
  std::string name;
  StDType dtype = StDType::kF32;
  std::vector<int64_t> shape;
  std::string data;  // raw little-endian bytes, exactly numel * element size
};

// Largest header accepted by the parser, as in the reference implementation: a bound on the
// memory a hostile file can make the JSON parser use.
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = uint64_t{100} << 20;
// Tensors must have fewer elements than this; it keeps byte sizes far from overflowing.
inline constexpr uint64_t kMaxSafetensorsElements = uint64_t{1} << 40;

// Serializes `tensors` (their data laid out back to back, in the given order) and `metadata`
// (written as "__metadata__", omitted when empty). The header is padded with spaces so that the
// data section starts at a multiple of 8 bytes from the start of the file.
// INVALID_ARGUMENT for an empty or duplicate name, the name "__metadata__", a negative dimension,
// too many elements, data whose size does not match the shape, or a name, metadata key or value
// that is not valid UTF-8.
absl::StatusOr<std::string> SerializeSafetensors(
    const std::vector<StTensor>& tensors, const std::map<std::string, std::string>& metadata);

// Parses a whole safetensors file held in `bytes`. The tensors come back sorted by their byte
// offsets (ties, which only zero-sized tensors can have, by name). On success, a non-null
// `metadata` receives "__metadata__" (empty when absent); on failure it is left alone.
// INVALID_ARGUMENT, with a message naming the offending tensor and field, for any malformed,
// truncated or inconsistent input, including tensor byte ranges that overlap or leave bytes of the
// data section uncovered. Unknown keys in a tensor entry are ignored, as the reference
// implementation does. Memory use stays proportional to the input: sizes declared in the file are
// checked against the bytes actually present before anything is allocated for them.
absl::StatusOr<std::vector<StTensor>> ParseSafetensors(
    absl::string_view bytes, std::map<std::string, std::string>* metadata);

// For readers that do not hold the whole file (safetensors_file.h reads each tensor's bytes
// straight into place): the 8-byte little-endian length prefix, the header it announces, then the
// data section.
inline constexpr uint64_t kSafetensorsPrefixBytes = 8;

// The header length announced by `prefix` (the file's first bytes, up to 8), checked against the
// 100 MiB limit and against the bytes of a `file_size`-byte file that follow the prefix.
// INVALID_ARGUMENT when the prefix is short or the length does not fit.
absl::StatusOr<uint64_t> SafetensorsHeaderLength(absl::string_view prefix, uint64_t file_size);

// A tensor of the header, before its data is read: `tensor` has name, dtype and shape (its data
// empty), and its bytes are [begin, end) of the data section.
struct StEntry {
  StTensor tensor;
  uint64_t begin = 0;
  uint64_t end = 0;
};

// Parses and validates the JSON header `json` of a file whose data section is `data_size` bytes,
// with ParseSafetensors' checks. The entries come back sorted by their offsets, and their byte
// ranges tile the data section exactly. A non-null `metadata` receives "__metadata__" on success.
absl::StatusOr<std::vector<StEntry>> ParseSafetensorsHeader(
    absl::string_view json, uint64_t data_size, std::map<std::string, std::string>* metadata);

}  // namespace gradwire::storage
