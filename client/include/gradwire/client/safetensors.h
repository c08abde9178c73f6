// Torch-free reader and writer of the safetensors format
// (https://github.com/huggingface/safetensors), restricted to the element types gradwire stores.
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

namespace gradwire::client {

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

// Writes SerializeSafetensors(tensors, metadata) to `path` atomically: the bytes go to
// `path` + ".tmp.<pid>", which is fsync'ed and then renamed over `path`, so readers see either the
// old file or the complete new one. The temporary file is removed on failure. NOT_FOUND when the
// directory does not exist, PERMISSION_DENIED when it cannot be written, INTERNAL for other I/O
// errors; each message names the path.
absl::Status WriteSafetensorsFile(const std::string& path, const std::vector<StTensor>& tensors,
                                  const std::map<std::string, std::string>& metadata);

// Reads and parses the safetensors file at `path`, with ParseSafetensors' checks and ordering.
// Reads each tensor's bytes straight into its StTensor, so memory peaks at about the size of the
// result. NOT_FOUND / PERMISSION_DENIED / INTERNAL for I/O errors and INVALID_ARGUMENT for a
// malformed file (or one that is not a regular file); messages name the path.
absl::StatusOr<std::vector<StTensor>> ReadSafetensorsFile(
    const std::string& path, std::map<std::string, std::string>* metadata);

}  // namespace gradwire::client
