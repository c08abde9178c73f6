#include "server/core/module_kind.h"

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "server/core/kind_common.h"
#include "server/core/status_macros.h"

namespace gradwire::core {

namespace {

constexpr int kMaxMargin = 32;
constexpr int64_t kMaxHistory = 1 << 16;

absl::Status CheckOpen01(const char* field, float value, bool zero_ok) {
  if (!(value >= 0.0f && value < 1.0f) || (!zero_ok && value == 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " must be in ", zero_ok ? "[0, 1)" : "(0, 1)", ", got ", value));
  }
  return absl::OkStatus();
}

absl::Status CheckNonNegative(const char* field, float value) {
  if (!(value >= 0.0f) || !std::isfinite(value)) {
    return absl::InvalidArgumentError(absl::StrCat(field, " must be finite and >= 0, got ", value));
  }
  return absl::OkStatus();
}

// What every kind requires of a spec. The enum fields are range-checked even though the RPC
// layer maps only known values: a checkpoint's spec is read back as integers.
absl::Status ValidateCommon(const ModuleSpec& s) {
  GW_RETURN_IF_ERROR(CheckSpecRange("spec.activation", int64_t(s.activation), 0,
                                    int64_t(kernels::Activation::kGeglu)));
  GW_RETURN_IF_ERROR(CheckSpecRange("spec.recipe.scaling", int64_t(s.recipe.mode), 0,
                                    int64_t(ScalingMode::kDelayed)));
  GW_RETURN_IF_ERROR(CheckSpecRange("spec.recipe.amax_compute_algo", int64_t(s.recipe.algo), 0,
                                    int64_t(AmaxAlgo::kMostRecent)));
  GW_RETURN_IF_ERROR(CheckSpecRange("spec.optimizer.kind", int64_t(s.optimizer.kind), 0,
                                    int64_t(OptimizerConfig::Kind::kAdamW)));
  GW_RETURN_IF_ERROR(CheckSpecRange("spec.in_features", s.in_features, 1, kMaxFeatures));
  GW_RETURN_IF_ERROR(CheckSpecRange("spec.out_features", s.out_features, 1, kMaxFeatures));
  GW_RETURN_IF_ERROR(CheckFinitePositive("spec.layernorm_eps", s.layernorm_eps));
  GW_RETURN_IF_ERROR(CheckSpecRange("spec.recipe.margin", s.recipe.margin, 0, kMaxMargin));
  GW_RETURN_IF_ERROR(
      CheckSpecRange("spec.recipe.amax_history_len", s.recipe.history_len, 1, kMaxHistory));
  if (s.optimizer.kind == OptimizerConfig::Kind::kSgd) {
    GW_RETURN_IF_ERROR(
        CheckFinitePositive("spec.optimizer.sgd.learning_rate", s.optimizer.sgd.learning_rate));
    GW_RETURN_IF_ERROR(CheckOpen01("spec.optimizer.sgd.momentum", s.optimizer.sgd.momentum, true));
    GW_RETURN_IF_ERROR(
        CheckNonNegative("spec.optimizer.sgd.weight_decay", s.optimizer.sgd.weight_decay));
  } else {
    const AdamWConfig& a = s.optimizer.adamw;
    GW_RETURN_IF_ERROR(CheckFinitePositive("spec.optimizer.adamw.learning_rate", a.learning_rate));
    GW_RETURN_IF_ERROR(CheckOpen01("spec.optimizer.adamw.beta1", a.beta1, true));
    GW_RETURN_IF_ERROR(CheckOpen01("spec.optimizer.adamw.beta2", a.beta2, true));
    GW_RETURN_IF_ERROR(CheckFinitePositive("spec.optimizer.adamw.eps", a.eps));
    GW_RETURN_IF_ERROR(CheckNonNegative("spec.optimizer.adamw.weight_decay", a.weight_decay));
  }
  return absl::OkStatus();
}

}  // namespace

const std::vector<RoleDef>& SingleGemmRoles() {
  static const std::vector<RoleDef> roles = {{"input", kernels::Fp8Format::kE4M3},
                                             {"weight", kernels::Fp8Format::kE4M3, true},
                                             {"grad_output", kernels::Fp8Format::kE5M2}};
  return roles;
}

std::vector<ParamDef> LayerNormParamDefs(const ModuleSpec& s) {
  const int64_t k = s.in_features;
  return {{Param::kLayerNormWeight,
           {k},
           s.zero_centered_gamma ? ParamDef::Init::kZeros : ParamDef::Init::kOnes},
          {Param::kLayerNormBias, {k}, ParamDef::Init::kZeros}};
}

LayerNormParams LayerNormOf(const ParamTable& p, const ModuleSpec& s) {
  return LayerNormParams{p[Param::kLayerNormWeight], p[Param::kLayerNormBias], s.layernorm_eps,
                         s.zero_centered_gamma};
}

absl::Status CheckNoMlpFields(const ModuleSpec& s) {
  if (s.ffn_features != 0) {
    return absl::InvalidArgumentError("spec.ffn_features is only for LAYERNORM_MLP");
  }
  if (s.activation != kernels::Activation::kGelu) {
    return absl::InvalidArgumentError("spec.activation is only for LAYERNORM_MLP");
  }
  return absl::OkStatus();
}

const char* ParamName(Param p) {
  static constexpr const char* kNames[kParamSlots] = {
      "layer_norm_weight", "layer_norm_bias", "weight",     "bias",
      "fc1_weight",        "fc1_bias",        "fc2_weight", "fc2_bias"};
  return kNames[size_t(p)];
}

const std::vector<const ModuleKindOps*>& Kinds() {
  // In enum order: FindKind indexes it.
  static const std::vector<const ModuleKindOps*> kinds = {&LinearKind(), &LayerNormLinearKind(),
                                                          &LayerNormMlpKind()};
  return kinds;
}

const ModuleKindOps* FindKind(ModuleKind kind) {
  const auto& kinds = Kinds();
  const auto i = size_t(kind);
  return i < kinds.size() ? kinds[i] : nullptr;
}

const char* ModuleKindName(ModuleKind kind) {
  const ModuleKindOps* k = FindKind(kind);
  return k ? k->name() : "unknown";
}

absl::Status CheckSpecRange(const char* field, int64_t value, int64_t lo, int64_t hi) {
  if (value < lo || value > hi) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " must be in [", lo, ", ", hi, "], got ", value));
  }
  return absl::OkStatus();
}

absl::Status CheckFinitePositive(const char* field, float value) {
  if (!(value > 0.0f) || !std::isfinite(value)) {
    return absl::InvalidArgumentError(absl::StrCat(field, " must be finite and > 0, got ", value));
  }
  return absl::OkStatus();
}

std::vector<std::pair<std::string, std::vector<int64_t>>> ParameterShapes(const ModuleSpec& spec) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
  const ModuleKindOps* kind = FindKind(spec.kind);
  if (kind == nullptr) return shapes;
  for (ParamDef& d : kind->Params(spec))
    shapes.emplace_back(ParamName(d.param), std::move(d.shape));
  return shapes;
}

int64_t ParameterCount(const ModuleSpec& spec) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  int64_t total = 0;
  for (const auto& [name, shape] : ParameterShapes(spec)) {
    int64_t n = 1;
    for (int64_t d : shape) {
      if (d <= 0) return 0;
      n = n > kMax / d ? kMax : n * d;
    }
    total = total > kMax - n ? kMax : total + n;
  }
  return total;
}

absl::Status ValidateModuleSpec(const ModuleSpec& spec) {
  const ModuleKindOps* kind = FindKind(spec.kind);
  if (kind == nullptr) {
    return CheckSpecRange("spec.kind", int64_t(spec.kind), 0, int64_t(Kinds().size()) - 1);
  }
  GW_RETURN_IF_ERROR(ValidateCommon(spec));
  GW_RETURN_IF_ERROR(kind->Validate(spec));
  const int64_t total = ParameterCount(spec);  // dimensions are within kMaxFeatures here
  if (total > kMaxParameters) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spec asks for ", total, " parameters; a module may have at most ", kMaxParameters));
  }
  return absl::OkStatus();
}

}  // namespace gradwire::core
