#include "server/core/kinds/module_kind.h"

#include <cmath>
#include <limits>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "server/common/status_macros.h"

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
                                    int64_t(ScalingMode::kMxfp8)));
  GW_RETURN_IF_ERROR(CheckSpecRange("spec.recipe.amax_compute_algo", int64_t(s.recipe.algo), 0,
                                    int64_t(AmaxAlgo::kMostRecent)));
  GW_RETURN_IF_ERROR(CheckSpecRange("spec.optimizer.kind", int64_t(s.optimizer.kind), 0,
                                    int64_t(OptimizerConfig::Kind::kAdamW)));
  GW_RETURN_IF_ERROR(CheckSpecRange("spec.in_features", s.in_features, 1, kMaxFeatures));
  GW_RETURN_IF_ERROR(CheckSpecRange("spec.out_features", s.out_features, 1, kMaxFeatures));
  GW_RETURN_IF_ERROR(CheckFinitePositive("spec.layernorm_eps", s.layernorm_eps));
  GW_RETURN_IF_ERROR(CheckSpecRange("spec.recipe.margin", s.recipe.margin, 0, kMaxMargin));
  // A block's scale is the power of two that fits its amax (docs/block-scaling.md): no margin.
  if (BlockScaled(s.recipe.mode) && s.recipe.margin != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spec.recipe.margin must be 0 under ",
        absl::AsciiStrToUpper(ScalingModeName(s.recipe.mode)),
        " (each block's scale is the power of two that fits it), got ", s.recipe.margin));
  }
  // E5M2 gradients are a choice only under BLOCK (the others' formats are fixed).
  if (s.recipe.block_hybrid && s.recipe.mode != ScalingMode::kBlock) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.recipe.format HYBRID is a choice of BLOCK only, not of ",
                     absl::AsciiStrToUpper(ScalingModeName(s.recipe.mode))));
  }
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

// The optional fields: the MLP's width in range where it is read; a field a kind does not read
// must keep its default, since a spec that sets one asks for something the module would
// silently not do.
absl::Status CheckSpecFields(const ModuleSpec& s, SpecFields reads) {
  if (reads.ffn) {
    GW_RETURN_IF_ERROR(CheckSpecRange("spec.ffn_features", s.ffn_features, 1, kMaxFeatures));
  } else {
    if (s.ffn_features != 0) {
      return absl::InvalidArgumentError("spec.ffn_features is only for LAYERNORM_MLP");
    }
    if (s.activation != kernels::Activation::kGelu) {
      return absl::InvalidArgumentError("spec.activation is only for LAYERNORM_MLP");
    }
  }
  if (!reads.layernorm && (s.zero_centered_gamma || s.return_layernorm_output || s.checkpoint)) {
    return absl::InvalidArgumentError(
        "spec.zero_centered_gamma, return_layernorm_output and checkpoint are for the LayerNorm "
        "modules");
  }
  return absl::OkStatus();
}

}  // namespace

const char* ParamName(Param p) {
  static constexpr const char* kNames[kParamSlots] = {
      "layer_norm_weight", "layer_norm_bias", "weight",     "bias",
      "fc1_weight",        "fc1_bias",        "fc2_weight", "fc2_bias"};
  return kNames[size_t(p)];
}

std::vector<RoleAmax> ReadAmaxes(const std::vector<RoleCast>& casts) {
  std::vector<RoleAmax> out;
  out.reserve(casts.size());
  for (const auto& [role, cast] : casts) out.emplace_back(role, cast.amax());
  return out;
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

const ModuleKindOps* FindKindBySpecName(absl::string_view name) {
  for (const ModuleKindOps* kind : Kinds()) {
    if (name == kind->spec_name()) return kind;
  }
  return nullptr;
}

const KindDescription* DescribeKind(ModuleKind kind) { return FindKind(kind); }

const std::vector<const KindDescription*>& KindDescriptions() {
  static const std::vector<const KindDescription*> kinds(Kinds().begin(), Kinds().end());
  return kinds;
}

const KindDescription* DescribeKindBySpecName(absl::string_view name) {
  return FindKindBySpecName(name);
}

const char* ModuleKindName(ModuleKind kind) {
  const ModuleKindOps* k = FindKind(kind);
  return k ? k->name() : "unknown";
}

std::string DescribeModule(const ModuleSpec& spec) {
  const ModuleKindOps* k = FindKind(spec.kind);
  if (k == nullptr) return "unknown";
  std::string out = absl::StrCat(k->name(), " ", spec.in_features, " -> ");
  if (k->spec_fields().ffn) {
    absl::StrAppend(&out, spec.ffn_features, " -> ", spec.out_features, ", ",
                    kernels::ActivationName(spec.activation));
  } else {
    absl::StrAppend(&out, spec.out_features);
  }
  if (spec.bias) absl::StrAppend(&out, ", bias");
  return out;
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
  GW_RETURN_IF_ERROR(CheckSpecFields(spec, kind->spec_fields()));
  GW_RETURN_IF_ERROR(kind->Validate(spec));
  const int64_t total = ParameterCount(spec);  // dimensions are within kMaxFeatures here
  if (total > kMaxParameters) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spec asks for ", total, " parameters; a module may have at most ", kMaxParameters));
  }
  return absl::OkStatus();
}

absl::StatusOr<Fp8Tensor> GradOutputCast(const Backend& b, const KindBackwardArgs& args,
                                         size_t role, CastUsage usage) {
  const Fp8Tensor* codes = args.grad_output_fp8;
  if (codes == nullptr) return CastRows(b, args.grad_output, args.quantizers.at(role), usage);
  const QuantizerConfig& q = args.quantizers.at(role);
  const Fp8Tensor& first = codes->grouped() ? codes->groups[0] : *codes;  // a batch's: alike
  if (codes->rows != args.grad_output.size(0) || codes->cols != args.grad_output.size(1) ||
      first.format != q.format || first.block_scaled != q.block_scaled ||
      (first.block_scaled && !first.has_columnwise()) ||
      (args.row_groups && (!codes->grouped() || codes->groups.size() != args.row_groups->size()))) {
    return absl::InternalError("Backward: FP8 grad_output codes do not serve this module's cast");
  }
  if (const auto& steps = q.steps) {
    if (codes->grouped()) {
      for (const Fp8Tensor& g : codes->groups) steps->Stepped(g.scalars);
    } else {
      steps->Stepped(codes->scalars);
    }
  }
  return *codes;
}

void GradOutputBiasGrad(const Backend& b, const KindBackwardArgs& args, Param p,
                        const Fp8Tensor& dy) {
  if (!args.grad_output_sums.defined()) return args.grads->BiasGrad(p, args.grad_output, dy);
  args.grads->BiasSums(p, args.grad_output_sums, b);
}

}  // namespace gradwire::core
