#include "server/core/checkpoints/checkpoint_files.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <system_error>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "gradwire/storage/durable_file.h"
#include "gradwire/storage/safetensors_file.h"
#include "server/common/status_macros.h"

namespace gradwire::core::checkpoint_files {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using storage::StDType;
using storage::StTensor;

json SpecToJson(const ModuleSpec& s) {
  return json{{"kind", int(s.kind)},
              {"in_features", s.in_features},
              {"out_features", s.out_features},
              {"ffn_features", s.ffn_features},
              {"bias", s.bias},
              {"activation", int(s.activation)},
              {"layernorm_eps", s.layernorm_eps},
              {"zero_centered_gamma", s.zero_centered_gamma},
              {"return_layernorm_output", s.return_layernorm_output},
              {"checkpoint", s.checkpoint},
              {"recipe",
               {{"mode", int(s.recipe.mode)},
                {"margin", s.recipe.margin},
                {"history_len", s.recipe.history_len},
                {"algo", int(s.recipe.algo)},
                {"block_hybrid", s.recipe.block_hybrid}}},
              {"optimizer",
               {{"kind", int(s.optimizer.kind)},
                {"sgd",
                 {{"learning_rate", s.optimizer.sgd.learning_rate},
                  {"momentum", s.optimizer.sgd.momentum},
                  {"weight_decay", s.optimizer.sgd.weight_decay},
                  {"nesterov", s.optimizer.sgd.nesterov}}},
                {"adamw",
                 {{"learning_rate", s.optimizer.adamw.learning_rate},
                  {"beta1", s.optimizer.adamw.beta1},
                  {"beta2", s.optimizer.adamw.beta2},
                  {"eps", s.optimizer.adamw.eps},
                  {"weight_decay", s.optimizer.adamw.weight_decay}}}}},
              {"max_staleness", s.max_staleness},
              {"seed", s.seed},
              {"name", s.name}};
}

// Strict readers for the metadata's numbers. A checkpoint is read back from disk, so a number may
// be anything: an integer field takes only an integer in its type's range, a float field only a
// number a float holds (or an infinity or NaN, which validation judges). A plain conversion of an
// out-of-range number would be undefined behaviour, not an error.
template <typename T>
T Integer(const json& j, const char* key) {
  const json& v = j.at(key);
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u <= uint64_t(std::numeric_limits<T>::max())) return T(u);
  } else if (v.is_number_integer()) {
    const int64_t i = v.get<int64_t>();
    if (i >= int64_t(std::numeric_limits<T>::min()) &&
        (i < 0 || uint64_t(i) <= uint64_t(std::numeric_limits<T>::max()))) {
      return T(i);
    }
  } else {
    throw std::invalid_argument(absl::StrCat(key, " is not an integer"));
  }
  throw std::out_of_range(absl::StrCat(key, " is out of range"));
}

float Real(const json& v, const char* key) {
  if (!v.is_number()) throw std::invalid_argument(absl::StrCat(key, " is not a number"));
  const double d = v.get<double>();
  if (std::isfinite(d) && std::fabs(d) > double(std::numeric_limits<float>::max())) {
    throw std::out_of_range(absl::StrCat(key, " is out of range"));
  }
  return float(d);
}
float RealAt(const json& j, const char* key) { return Real(j.at(key), key); }

bool Flag(const json& j, const char* key) {
  const json& v = j.at(key);
  if (!v.is_boolean()) throw std::invalid_argument(absl::StrCat(key, " is not a boolean"));
  return v.get<bool>();
}

ModuleSpec SpecFromJson(const json& j) {
  ModuleSpec s;
  s.kind = ModuleKind(Integer<int>(j, "kind"));
  s.in_features = Integer<int64_t>(j, "in_features");
  s.out_features = Integer<int64_t>(j, "out_features");
  s.ffn_features = Integer<int64_t>(j, "ffn_features");
  s.bias = Flag(j, "bias");
  s.activation = kernels::Activation(Integer<int>(j, "activation"));
  s.layernorm_eps = RealAt(j, "layernorm_eps");
  s.zero_centered_gamma = Flag(j, "zero_centered_gamma");
  s.return_layernorm_output = Flag(j, "return_layernorm_output");
  s.checkpoint = Flag(j, "checkpoint");
  const json& r = j.at("recipe");
  s.recipe.mode = ScalingMode(Integer<int>(r, "mode"));
  s.recipe.margin = Integer<int>(r, "margin");
  s.recipe.history_len = Integer<int64_t>(r, "history_len");
  s.recipe.algo = AmaxAlgo(Integer<int>(r, "algo"));
  // Files written before the formats were a setting: E4M3 throughout under BLOCK.
  s.recipe.block_hybrid = r.contains("block_hybrid") && Flag(r, "block_hybrid");
  const json& o = j.at("optimizer");
  s.optimizer.kind = OptimizerConfig::Kind(Integer<int>(o, "kind"));
  const json& sgd = o.at("sgd");
  s.optimizer.sgd.learning_rate = RealAt(sgd, "learning_rate");
  s.optimizer.sgd.momentum = RealAt(sgd, "momentum");
  s.optimizer.sgd.weight_decay = RealAt(sgd, "weight_decay");
  s.optimizer.sgd.nesterov = Flag(sgd, "nesterov");
  const json& adamw = o.at("adamw");
  s.optimizer.adamw.learning_rate = RealAt(adamw, "learning_rate");
  s.optimizer.adamw.beta1 = RealAt(adamw, "beta1");
  s.optimizer.adamw.beta2 = RealAt(adamw, "beta2");
  s.optimizer.adamw.eps = RealAt(adamw, "eps");
  s.optimizer.adamw.weight_decay = RealAt(adamw, "weight_decay");
  s.max_staleness = Integer<int64_t>(j, "max_staleness");
  s.seed = Integer<uint64_t>(j, "seed");
  s.name = j.at("name").get<std::string>();
  return s;
}

StTensor ToSt(const std::string& name, const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  StTensor out;
  out.name = name;
  out.dtype = StDType::kF32;
  out.shape.assign(c.sizes().begin(), c.sizes().end());
  out.data.assign(reinterpret_cast<const char*>(c.data_ptr<float>()),
                  size_t(c.numel()) * sizeof(float));
  return out;
}

absl::StatusOr<at::Tensor> FromSt(const StTensor& t) {
  if (t.dtype != StDType::kF32) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", t.name, " is not F32"));
  }
  at::Tensor out = at::empty(t.shape, at::TensorOptions().dtype(at::kFloat));
  std::memcpy(out.data_ptr<float>(), t.data.data(), t.data.size());
  return out;
}

}  // namespace

std::string Layout::FolderOf(const std::string& module_id) const {
  return (fs::path(dir_) / module_id).string();
}

std::string Layout::StatePathOf(const std::string& module_id, int64_t epoch) const {
  return (fs::path(dir_) / module_id / absl::StrCat("state.", epoch, kSuffix)).string();
}

std::string Layout::ClaimPathOf(const std::string& module_id, int64_t epoch) const {
  return (fs::path(dir_) / module_id / absl::StrCat("claim.", epoch)).string();
}

std::string Layout::LegacyPathOf(const std::string& module_id) const {
  return (fs::path(dir_) / (module_id + kSuffix)).string();
}

std::string Layout::ServersDir() const { return (fs::path(dir_) / kServersDir).string(); }

std::string Layout::ServerFolder(const std::string& server) const {
  return (fs::path(ServersDir()) / server).string();
}

std::string Layout::AlivePathOf(const std::string& server) const {
  return (fs::path(ServerFolder(server)) / kAliveFile).string();
}

std::string Layout::LockPath() const { return (fs::path(dir_) / kLockFile).string(); }

bool EndsWith(const std::string& s, const char* suffix) {
  const size_t n = strlen(suffix);
  return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

absl::Status CheckFolderName(const std::string& id) {
  if (id.empty() || id.size() > 255 || id[0] == '.' || id.find('/') != std::string::npos ||
      id.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("module id \"", id, "\" cannot name a checkpoint folder"));
  }
  return absl::OkStatus();
}

int64_t Scan::max_claim() const {
  return claims.empty() ? 0 : *std::max_element(claims.begin(), claims.end());
}
int64_t Scan::max_state() const {
  return states.empty() ? -1 : *std::max_element(states.begin(), states.end());
}

Scan ScanFolder(const std::string& folder, const std::string& legacy) {
  Scan scan;
  std::error_code ec;
  scan.legacy = fs::exists(legacy, ec);
  for (const auto& entry : fs::directory_iterator(folder, ec)) {
    const std::string name = entry.path().filename().string();
    int64_t epoch = 0;
    if (name.rfind("claim.", 0) == 0) {
      if (absl::SimpleAtoi(name.substr(6), &epoch) && epoch > 0) scan.claims.push_back(epoch);
    } else if (name.rfind("state.", 0) == 0 && EndsWith(name, kSuffix)) {
      const std::string digits = name.substr(6, name.size() - 6 - strlen(kSuffix));
      if (absl::SimpleAtoi(digits, &epoch) && epoch > 0) scan.states.push_back(epoch);
    }
  }
  return scan;
}

Claim ReadClaim(const std::string& path) {
  Claim claim;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return claim;
  char buf[512] = {};
  const ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
  ::close(fd);
  if (n <= 0) return claim;
  const std::string text(buf, size_t(n));
  claim.token = text.substr(0, text.find('\n'));
  if (const size_t at = text.find("\nserver "); at != std::string::npos) {
    const size_t from = at + 8;
    claim.server = text.substr(from, text.find('\n', from) - from);
  }
  return claim;
}
std::string ReadToken(const std::string& path) { return ReadClaim(path).token; }

double WallSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

absl::Status WriteClaim(const std::string& path, const std::string& token,
                        const std::string& server) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    if (errno == EEXIST) {
      return absl::AbortedError(absl::StrCat(
          storage::QuotePath(path),
          " was claimed by another server at the same moment: the module is being taken over "
          "there; retry"));
    }
    return absl::InternalError(
        absl::StrCat("cannot create ", storage::QuotePath(path), ": ", std::strerror(errno)));
  }
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  const std::string text =
      absl::StrCat(token, "\nserver ", server, "\n", host, " pid ", ::getpid(), "\n");
  bool ok = ::write(fd, text.data(), text.size()) == ssize_t(text.size());
  ok = ::fsync(fd) == 0 && ok;
  ok = ::close(fd) == 0 && ok;
  if (!ok) {
    ::unlink(path.c_str());
    return absl::InternalError(absl::StrCat("cannot write ", storage::QuotePath(path)));
  }
  return absl::OkStatus();
}

absl::StatusOr<ModuleState> ReadState(const std::string& path) {
  std::map<std::string, std::string> metadata;
  auto tensors = storage::ReadSafetensorsFile(path, &metadata);
  if (!tensors.ok()) {
    return absl::DataLossError(absl::StrCat(path, ": ", tensors.status().message()));
  }
  ModuleState state;
  try {
    if (metadata.at("format") != "gradwire-checkpoint") {
      return absl::DataLossError(absl::StrCat(path, " is not a gradwire checkpoint"));
    }
    state.module_id = metadata.at("module_id");
    if (auto t = metadata.find("tenant"); t != metadata.end()) state.tenant = t->second;
    state.weight_version = std::stoull(metadata.at("weight_version"));
    state.optimizer_steps = std::stoll(metadata.at("optimizer_steps"));
    state.spec = SpecFromJson(json::parse(metadata.at("spec")));
    for (const json& r : json::parse(metadata.at("scaling"))) {
      std::deque<float> history;
      const json& remembered = r.at("history");
      if (!remembered.is_array()) throw std::invalid_argument("history is not an array");
      for (const json& h : remembered) history.push_back(Real(h, "history"));
      state.scaling.push_back({r.at("role").get<std::string>(), RealAt(r, "scale"), history});
    }
  } catch (const std::exception& e) {
    return absl::DataLossError(absl::StrCat(path, ": bad checkpoint metadata: ", e.what()));
  }
  for (const StTensor& t : *tensors) {
    GW_ASSIGN_OR_RETURN(at::Tensor value, FromSt(t));
    if (t.name.rfind("param.", 0) == 0) {
      state.parameters.emplace_back(t.name.substr(6), value);
    } else if (t.name.rfind("slot.", 0) == 0) {
      state.optimizer_slots.emplace_back(t.name.substr(5), value);
    }
  }
  return state;
}

absl::Status WriteState(const std::string& path, const ModuleState& state, int64_t epoch) {
  std::vector<StTensor> tensors;
  for (const auto& [name, t] : state.parameters) tensors.push_back(ToSt("param." + name, t));
  for (const auto& [name, t] : state.optimizer_slots) tensors.push_back(ToSt("slot." + name, t));
  json scaling = json::array();
  for (const RoleScaling& r : state.scaling) {
    scaling.push_back({{"role", r.role},
                       {"scale", r.scale},
                       {"history", std::vector<float>(r.history.begin(), r.history.end())}});
  }
  const std::map<std::string, std::string> metadata = {
      {"format", "gradwire-checkpoint"},
      {"format_version", std::to_string(kFormatVersion)},
      {"module_id", state.module_id},
      {"tenant", state.tenant},
      {"epoch", std::to_string(epoch)},
      {"weight_version", std::to_string(state.weight_version)},
      {"optimizer_steps", std::to_string(state.optimizer_steps)},
      {"spec", SpecToJson(state.spec).dump()},
      {"scaling", scaling.dump()}};
  return storage::WriteSafetensorsFile(path, tensors, metadata);
}

}  // namespace gradwire::core::checkpoint_files
