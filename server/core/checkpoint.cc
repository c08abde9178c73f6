#include "server/core/checkpoint.h"

#include <ATen/ATen.h>

#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "gradwire/storage/safetensors_file.h"
#include "server/core/module_state.h"
#include "server/common/status_macros.h"

namespace gradwire::core {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using storage::StDType;
using storage::StTensor;

constexpr char kSuffix[] = ".gradwire.safetensors";
constexpr int kFormatVersion = 1;

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
                {"algo", int(s.recipe.algo)}}},
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

ModuleSpec SpecFromJson(const json& j) {
  ModuleSpec s;
  s.kind = ModuleKind(j.at("kind").get<int>());
  s.in_features = j.at("in_features");
  s.out_features = j.at("out_features");
  s.ffn_features = j.at("ffn_features");
  s.bias = j.at("bias");
  s.activation = kernels::Activation(j.at("activation").get<int>());
  s.layernorm_eps = j.at("layernorm_eps");
  s.zero_centered_gamma = j.at("zero_centered_gamma");
  s.return_layernorm_output = j.at("return_layernorm_output");
  s.checkpoint = j.at("checkpoint");
  const json& r = j.at("recipe");
  s.recipe.mode = ScalingMode(r.at("mode").get<int>());
  s.recipe.margin = r.at("margin");
  s.recipe.history_len = r.at("history_len");
  s.recipe.algo = AmaxAlgo(r.at("algo").get<int>());
  const json& o = j.at("optimizer");
  s.optimizer.kind = OptimizerConfig::Kind(o.at("kind").get<int>());
  s.optimizer.sgd.learning_rate = o.at("sgd").at("learning_rate");
  s.optimizer.sgd.momentum = o.at("sgd").at("momentum");
  s.optimizer.sgd.weight_decay = o.at("sgd").at("weight_decay");
  s.optimizer.sgd.nesterov = o.at("sgd").at("nesterov");
  s.optimizer.adamw.learning_rate = o.at("adamw").at("learning_rate");
  s.optimizer.adamw.beta1 = o.at("adamw").at("beta1");
  s.optimizer.adamw.beta2 = o.at("adamw").at("beta2");
  s.optimizer.adamw.eps = o.at("adamw").at("eps");
  s.optimizer.adamw.weight_decay = o.at("adamw").at("weight_decay");
  s.max_staleness = j.at("max_staleness");
  s.seed = j.at("seed");
  s.name = j.at("name");
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

Checkpointer::Checkpointer(std::string dir, int64_t every_steps)
    : dir_(std::move(dir)), every_steps_(every_steps) {}

std::string Checkpointer::PathOf(const std::string& module_id) const {
  return (fs::path(dir_) / (module_id + kSuffix)).string();
}

absl::Status Checkpointer::Prepare() const {
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec || !fs::is_directory(dir_)) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint dir ", dir_, " cannot be created: ", ec.message()));
  }
  return absl::OkStatus();
}

absl::Status Checkpointer::Save(const ModuleState& state) const {
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
      {"weight_version", std::to_string(state.weight_version)},
      {"optimizer_steps", std::to_string(state.optimizer_steps)},
      {"spec", SpecToJson(state.spec).dump()},
      {"scaling", scaling.dump()}};
  return storage::WriteSafetensorsFile(PathOf(state.module_id), tensors, metadata);
}

absl::Status Checkpointer::Save(const ModuleHost& host, const std::string& module_id) const {
  GW_ASSIGN_OR_RETURN(ModuleState state, host.ExportState(module_id));
  return Save(state);
}

absl::StatusOr<int64_t> Checkpointer::SaveAll(const ModuleHost& host) const {
  int64_t saved = 0;
  for (const ModuleInfo& info : host.List()) {
    GW_RETURN_IF_ERROR(Save(host, info.module_id));
    ++saved;
  }
  return saved;
}

absl::Status Checkpointer::Remove(const std::string& module_id) const {
  std::error_code ec;
  fs::remove(PathOf(module_id), ec);
  if (ec) {
    return absl::InternalError(
        absl::StrCat("cannot remove ", PathOf(module_id), ": ", ec.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> Checkpointer::RestoreAll(ModuleHost& host) const {
  int64_t restored = 0;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir_, ec)) {
    const std::string path = entry.path().string();
    if (path.size() < sizeof(kSuffix) ||
        path.compare(path.size() - strlen(kSuffix), strlen(kSuffix), kSuffix) != 0) {
      continue;  // temporary files of an interrupted write, or foreign files
    }
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
        const std::vector<float> history = r.at("history");
        state.scaling.push_back(
            {r.at("role"), r.at("scale"), std::deque<float>(history.begin(), history.end())});
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
    if (auto s = host.ImportState(state); !s.ok()) {
      return absl::DataLossError(absl::StrCat(path, ": ", s.message()));
    }
    ++restored;
  }
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot read checkpoint dir ", dir_, ": ", ec.message()));
  }
  return restored;
}

}  // namespace gradwire::core
