#include "weights.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <system_error>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "gradwire/client/kinds.h"
#include "gradwire/wire/codec.h"

namespace gradwire::cli {
namespace {

using client::HostTensor;
using storage::StDType;
using storage::StTensor;

// File paths and tensor names come from the user or from the file itself: escape them so that a
// message stays one readable line whatever they contain. Paths are quoted as the safetensors
// reader quotes them, tensor names as the file's JSON does.
std::string QuotePath(absl::string_view s) { return absl::StrCat("'", absl::CHexEscape(s), "'"); }
std::string QuoteName(absl::string_view s) { return absl::StrCat("\"", absl::CHexEscape(s), "\""); }

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Not HostTensor::numel(): that is 0 for a scalar, a safetensors shape [] has one element.
int64_t Elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

}  // namespace

absl::StatusOr<ExportResult> ExportWeights(client::Client& client, const std::string& module_id,
                                           const std::string& path) {
  absl::StatusOr<client::NamedTensors> weights = client.GetWeights(module_id);
  if (!weights.ok()) return weights.status();

  std::map<std::string, std::string> metadata = {
      {"format", "gradwire"},
      {"module_id", module_id},
      {"weight_version", absl::StrCat(weights->weight_version)}};
  // The spec only labels the file; the module may have been deleted since GetWeights, and the
  // weights are still worth writing then.
  absl::StatusOr<std::vector<v1::ModuleInfo>> modules = client.ListModules(module_id);
  if (!modules.ok()) return modules.status();
  for (const v1::ModuleInfo& m : *modules) {
    if (m.module_id() != module_id) continue;
    metadata["kind"] = v1::ModuleKind_Name(m.spec().kind());
    for (const auto& [field, width] : client::KindWidths(m.spec())) {
      metadata[field] = absl::StrCat(width);
    }
  }

  ExportResult result;
  result.module_id = module_id;
  result.path = path;
  result.weight_version = weights->weight_version;
  std::vector<StTensor> tensors;
  tensors.reserve(weights->tensors.size());
  for (auto& [name, t] : weights->tensors) {
    StTensor st;
    st.name = name;
    st.dtype = StDType::kF32;
    st.shape = t.shape;
    // A byte copy, not a conversion: the file must hold exactly the server's bits. Safetensors
    // is little-endian, like the wire format.
    st.data.assign(reinterpret_cast<const char*>(t.data.data()), t.data.size() * sizeof(float));
    result.elements += int64_t(t.data.size());
    std::vector<float>().swap(t.data);  // the writer makes one more full copy; free as we go
    tensors.push_back(std::move(st));
  }
  result.parameters = int64_t(tensors.size());
  if (absl::Status s = storage::WriteSafetensorsFile(path, tensors, metadata); !s.ok()) return s;
  std::error_code ec;
  const std::uintmax_t size = std::filesystem::file_size(path, ec);
  if (!ec) result.file_bytes = int64_t(size);
  return result;
}

absl::StatusOr<std::vector<std::pair<std::string, HostTensor>>> ValidateImport(
    const std::vector<StTensor>& tensors, const client::NamedTensors& current,
    const std::string& module_id, const std::string& path, const ImportOptions& options,
    int64_t* widened) {
  const std::string file = QuotePath(path);
  if (tensors.empty()) return absl::InvalidArgumentError(absl::StrCat(file, " holds no tensors"));
  std::vector<std::string> names;
  for (const auto& [name, t] : current.tensors) names.push_back(name);

  std::vector<std::pair<std::string, HostTensor>> out;
  std::set<std::string> seen;
  int64_t widened_count = 0;
  for (const StTensor& st : tensors) {
    const std::string where = absl::StrCat(file, ": tensor ", QuoteName(st.name));
    const HostTensor* target = current.Find(st.name);
    if (target == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(where, " is not a parameter of module ",
                                                     module_id, "; its parameters are ",
                                                     absl::StrJoin(names, ", ")));
    }
    if (!seen.insert(st.name).second) {
      return absl::InvalidArgumentError(absl::StrCat(where, " appears twice"));
    }
    if (st.dtype != StDType::kF32 && st.dtype != StDType::kBF16 && st.dtype != StDType::kF16) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, " is ", storage::StDTypeName(st.dtype),
                       "; import takes F32, BF16 or F16 (a file carries no scale for FP8 values)"));
    }
    if (st.shape != target->shape) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, " has shape ", ShapeString(st.shape), " but parameter ", QuoteName(st.name),
          " of module ", module_id, " has shape ", ShapeString(target->shape)));
    }
    const int64_t n = Elements(st.shape);
    if (int64_t(st.data.size()) != n * storage::StDTypeSize(st.dtype)) {
      return absl::InvalidArgumentError(absl::StrCat(where, " has ", st.data.size(),
                                                     " bytes, its shape needs ",
                                                     n * storage::StDTypeSize(st.dtype)));
    }
    HostTensor h;
    h.shape = st.shape;
    h.data.resize(size_t(n));
    // Every BF16 and F16 value is a float32 value, so widening loses nothing.
    const wire::DType dtype = st.dtype == StDType::kF32    ? wire::DType::kF32
                              : st.dtype == StDType::kBF16 ? wire::DType::kBF16
                                                           : wire::DType::kF16;
    wire::DecodeElements(dtype, st.data.data(), n, 1.0f, h.data.data());
    if (dtype != wire::DType::kF32) ++widened_count;
    // The server refuses these as well, but only after the whole request has been sent; saying
    // which element is wrong helps to find where the file went bad.
    for (size_t i = 0; i < h.data.size(); ++i) {
      if (!std::isfinite(h.data[i])) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, " has the non-finite value ", absl::StrFormat("%g", h.data[i]),
                         " at flat index ", i, "; weights must be finite"));
      }
    }
    out.emplace_back(st.name, std::move(h));
  }

  if (!options.partial) {
    std::vector<std::string> missing;
    for (const std::string& name : names) {
      if (seen.count(name) == 0) missing.push_back(name);
    }
    if (!missing.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(file, " lacks ", absl::StrJoin(missing, ", "), " of module ", module_id,
                       " (--partial replaces only the parameters the file has)"));
    }
  }
  if (widened != nullptr) *widened = widened_count;
  return out;
}

absl::StatusOr<ImportResult> ImportWeights(client::Client& client, const std::string& module_id,
                                           const std::string& path, const ImportOptions& options) {
  // The file first: a missing or malformed file is reported without asking the server anything.
  absl::StatusOr<std::vector<StTensor>> tensors = storage::ReadSafetensorsFile(path, nullptr);
  if (!tensors.ok()) return tensors.status();
  absl::StatusOr<client::NamedTensors> current = client.GetWeights(module_id);
  if (!current.ok()) return current.status();
  // Only the names and shapes are needed from here on.
  for (auto& [name, t] : current->tensors) std::vector<float>().swap(t.data);

  ImportResult result;
  result.module_id = module_id;
  result.path = path;
  result.previous_weight_version = current->weight_version;
  absl::StatusOr<std::vector<std::pair<std::string, HostTensor>>> params =
      ValidateImport(*tensors, *current, module_id, path, options, &result.widened);
  if (!params.ok()) return params.status();
  tensors->clear();
  tensors->shrink_to_fit();
  for (const auto& [name, t] : *params) result.elements += int64_t(t.data.size());
  result.parameters = int64_t(params->size());

  absl::StatusOr<uint64_t> version = client.SetWeights(module_id, *params);
  if (!version.ok()) return version.status();
  result.weight_version = *version;
  return result;
}

std::string FormatExportResult(const ExportResult& r, bool json) {
  if (json) {
    return nlohmann::json{{"module_id", r.module_id},   {"path", r.path},
                          {"parameters", r.parameters}, {"elements", r.elements},
                          {"bytes", r.file_bytes},      {"weight_version", r.weight_version}}
        .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  }
  return absl::StrCat("exported ", r.parameters, " parameters (", r.elements, " float32 values, ",
                      r.file_bytes, " bytes) of module ", r.module_id, " at weight version ",
                      r.weight_version, " to ", r.path);
}

std::string FormatImportResult(const ImportResult& r, bool json) {
  if (json) {
    return nlohmann::json{{"module_id", r.module_id},
                          {"path", r.path},
                          {"parameters", r.parameters},
                          {"elements", r.elements},
                          {"widened", r.widened},
                          {"previous_weight_version", r.previous_weight_version},
                          {"weight_version", r.weight_version}}
        .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  }
  return absl::StrCat("imported ", r.parameters, " parameters (", r.elements, " values",
                      r.widened > 0 ? absl::StrCat(", ", r.widened, " widened from BF16/F16") : "",
                      ") from ", r.path, " into module ", r.module_id, ": weight version ",
                      r.previous_weight_version, " -> ", r.weight_version);
}

}  // namespace gradwire::cli
