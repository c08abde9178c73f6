// safetensors files on disk: the format (gradwire/storage/safetensors.h) written and read through
// the durable file I/O (gradwire/storage/durable_file.h). Used by the server's checkpoints and the
// CLI's weights export and import.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gradwire/storage/safetensors.h"

namespace gradwire::storage {

// Writes SerializeSafetensors(tensors, metadata) to `path` atomically (WriteFileAtomically):
// readers see either the old file or the complete new one. INVALID_ARGUMENT for what
// SerializeSafetensors refuses, NOT_FOUND when the directory does not exist, PERMISSION_DENIED
// when it cannot be written, INTERNAL for other I/O errors; each message names the path.
absl::Status WriteSafetensorsFile(const std::string& path, const std::vector<StTensor>& tensors,
                                  const std::map<std::string, std::string>& metadata);

// Reads and parses the safetensors file at `path`, with ParseSafetensors' checks and ordering.
// Reads each tensor's bytes straight into its StTensor, so memory peaks at about the size of the
// result. NOT_FOUND / PERMISSION_DENIED / INTERNAL for I/O errors and INVALID_ARGUMENT for a
// malformed file (or one that is not a regular file); messages name the path.
absl::StatusOr<std::vector<StTensor>> ReadSafetensorsFile(
    const std::string& path, std::map<std::string, std::string>* metadata);

}  // namespace gradwire::storage
