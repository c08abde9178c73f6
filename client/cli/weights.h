// `gradwire weights export|import`: a module's parameters to and from a safetensors file.
//
// Export writes every parameter as an F32 tensor under the server's parameter name, byte for byte
// the float32 values the server holds, so that a file exported twice from an unchanged module is
// identical and an import of it restores the module exactly. Import checks the whole file against
// the module before it sends anything and then replaces the parameters in one SetWeights call,
// so a file that does not fit leaves the module as it was.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "gradwire/client/client.h"
#include "gradwire/storage/safetensors_file.h"

namespace gradwire::cli {

struct ExportResult {
  std::string module_id;
  std::string path;
  int64_t parameters = 0;  // tensors written
  int64_t elements = 0;    // float32 values written
  int64_t file_bytes = 0;  // size of the file, header included
  uint64_t weight_version = 0;
};

// GetWeights(module_id) -> `path`, replaced atomically. The "__metadata__" has "format":
// "gradwire", "module_id" and "weight_version", plus "kind", "in_features" and "out_features"
// (and "ffn_features" for LAYERNORM_MLP) from the module's spec. Nothing in the file depends on
// when it was written.
absl::StatusOr<ExportResult> ExportWeights(client::Client& client, const std::string& module_id,
                                           const std::string& path);

struct ImportOptions {
  // Accept a file that has only some of the module's parameters and leave the others as they
  // are; by default every parameter must be in the file.
  bool partial = false;
};

struct ImportResult {
  std::string module_id;
  std::string path;
  int64_t parameters = 0;  // parameters replaced
  int64_t elements = 0;
  int64_t widened = 0;  // of those, tensors stored as BF16 or F16 in the file
  uint64_t previous_weight_version = 0;
  uint64_t weight_version = 0;  // after the import
};

// Reads `path`, checks it against the module's current parameters with ValidateImport and sends
// all of its tensors in one SetWeights call. Errors: the reader's (NOT_FOUND for a missing file,
// INVALID_ARGUMENT for a malformed one), ValidateImport's, and the server's.
absl::StatusOr<ImportResult> ImportWeights(client::Client& client, const std::string& module_id,
                                           const std::string& path,
                                           const ImportOptions& options = {});

// The parameters to send for `tensors` read from `path` into a module whose parameters are
// `current`: every tensor must name a parameter of the module, have exactly its shape, hold only
// finite values and be F32, or BF16/F16 (widened to float32, which is exact). FP8 is refused: a
// file carries no scale for it. Without options.partial every parameter must be present.
// INVALID_ARGUMENT naming `path` and the offending tensor otherwise. `widened` (optional)
// receives how many tensors were BF16/F16.
absl::StatusOr<std::vector<std::pair<std::string, client::HostTensor>>> ValidateImport(
    const std::vector<storage::StTensor>& tensors, const client::NamedTensors& current,
    const std::string& module_id, const std::string& path, const ImportOptions& options,
    int64_t* widened = nullptr);

// One line for the terminal, or one JSON object (no newline in either).
std::string FormatExportResult(const ExportResult& result, bool json);
std::string FormatImportResult(const ImportResult& result, bool json);

}  // namespace gradwire::cli
