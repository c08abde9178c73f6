#include "server/rpc/spec_convert.h"

#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/core/kinds/kind_description.h"

namespace gradwire::rpc {
namespace {

std::string EnumName(const std::string& name, int value) {
  return name.empty() ? std::to_string(value) : name;
}

// "A, B or C": the contract's names of every kind.
std::string KindNames() {
  std::vector<std::string> names;
  for (const core::KindDescription* kind : core::KindDescriptions())
    names.push_back(kind->spec_name());
  const std::string last = names.back();
  names.pop_back();
  return names.empty() ? last : absl::StrCat(absl::StrJoin(names, ", "), " or ", last);
}

absl::StatusOr<core::Activation> ActivationFromProto(v1::Activation a) {
  switch (a) {
    case v1::ACTIVATION_UNSPECIFIED:  // the default
    case v1::GELU:
      return core::Activation::kGelu;
    case v1::RELU:
      return core::Activation::kRelu;
    case v1::SWIGLU:
      return core::Activation::kSwiglu;
    case v1::GEGLU:
      return core::Activation::kGeglu;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("spec.activation must be GELU, RELU, SWIGLU or GEGLU, got ", int(a)));
  }
}

core::ScalingMode ScalingModeFromProto(v1::ScalingRecipe r) {
  switch (r) {
    case v1::DELAYED:
      return core::ScalingMode::kDelayed;
    case v1::BLOCK:
      return core::ScalingMode::kBlock;
    case v1::MXFP8:
      return core::ScalingMode::kMxfp8;
    default:
      return core::ScalingMode::kCurrent;
  }
}

v1::ScalingRecipe ScalingModeToProto(core::ScalingMode mode) {
  switch (mode) {
    case core::ScalingMode::kDelayed:
      return v1::DELAYED;
    case core::ScalingMode::kBlock:
      return v1::BLOCK;
    case core::ScalingMode::kMxfp8:
      return v1::MXFP8;
    default:
      return v1::CURRENT;
  }
}

absl::Status RecipeFromProto(const v1::Fp8Recipe& r, core::ScalingMode default_recipe,
                             core::RecipeConfig* recipe) {
  // Values outside the contract are refused; unset ones are the defaults (the server's recipe,
  // the history's max).
  if (!v1::ScalingRecipe_IsValid(r.scaling())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spec.recipe.scaling must be CURRENT, DELAYED, BLOCK or MXFP8, got ", int(r.scaling())));
  }
  if (!v1::AmaxComputeAlgo_IsValid(r.amax_compute_algo())) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.recipe.amax_compute_algo must be MAX or MOST_RECENT, got ",
                     int(r.amax_compute_algo())));
  }
  recipe->mode = ScalingModeFromProto(r.scaling());
  if (r.scaling() == v1::SCALING_RECIPE_UNSPECIFIED) {
    recipe->mode = core::BlockScaled(default_recipe) && r.margin() != 0
                       ? core::ScalingMode::kCurrent
                       : default_recipe;
  }
  if (!v1::Fp8Format_IsValid(r.format())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spec.recipe.format must be E4M3_ONLY or HYBRID (or unset), got ", int(r.format())));
  }
  // The formats: HYBRID is the per-tensor recipes' only one, E4M3_ONLY MXFP8's; BLOCK takes
  // either (E4M3_ONLY unless asked).
  const bool per_tensor = !core::BlockScaled(recipe->mode);
  if ((r.format() == v1::E4M3_ONLY && per_tensor) ||
      (r.format() == v1::HYBRID && recipe->mode == core::ScalingMode::kMxfp8)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spec.recipe.format ", v1::Fp8Format_Name(r.format()), " is not one of ",
        absl::AsciiStrToUpper(core::ScalingModeName(recipe->mode)), "'s: it takes only ",
        per_tensor ? "HYBRID (E5M2 gradients)" : "E4M3_ONLY (E4M3 throughout)",
        "; BLOCK takes either"));
  }
  recipe->block_hybrid = recipe->mode == core::ScalingMode::kBlock && r.format() == v1::HYBRID;
  recipe->algo =
      r.amax_compute_algo() == v1::MOST_RECENT ? core::AmaxAlgo::kMostRecent : core::AmaxAlgo::kMax;
  recipe->margin = r.margin();
  recipe->history_len = r.amax_history_len() == 0 ? 1024 : r.amax_history_len();
  return absl::OkStatus();
}

void OptimizerFromProto(const v1::OptimizerConfig& o, core::OptimizerConfig* optimizer) {
  if (o.has_adamw()) {
    const v1::AdamWConfig& a = o.adamw();
    optimizer->kind = core::OptimizerConfig::Kind::kAdamW;
    optimizer->adamw.learning_rate = a.learning_rate();
    if (a.beta1() != 0) optimizer->adamw.beta1 = a.beta1();
    if (a.beta2() != 0) optimizer->adamw.beta2 = a.beta2();
    if (a.eps() != 0) optimizer->adamw.eps = a.eps();
    optimizer->adamw.weight_decay = a.weight_decay();
  } else if (o.has_sgd()) {
    const v1::SgdConfig& g = o.sgd();
    optimizer->sgd.learning_rate = g.learning_rate();
    optimizer->sgd.momentum = g.momentum();
    optimizer->sgd.weight_decay = g.weight_decay();
    optimizer->sgd.nesterov = g.nesterov();
  }
}

void OptimizerToProto(const core::OptimizerConfig& o, v1::OptimizerConfig* out) {
  if (o.kind == core::OptimizerConfig::Kind::kAdamW) {
    v1::AdamWConfig* a = out->mutable_adamw();
    a->set_learning_rate(o.adamw.learning_rate);
    a->set_beta1(o.adamw.beta1);
    a->set_beta2(o.adamw.beta2);
    a->set_eps(o.adamw.eps);
    a->set_weight_decay(o.adamw.weight_decay);
  } else {
    v1::SgdConfig* g = out->mutable_sgd();
    g->set_learning_rate(o.sgd.learning_rate);
    g->set_momentum(o.sgd.momentum);
    g->set_weight_decay(o.sgd.weight_decay);
    g->set_nesterov(o.sgd.nesterov);
  }
}

}  // namespace

absl::StatusOr<core::ModuleSpec> SpecFromProto(const v1::ModuleSpec& p,
                                               core::ScalingMode default_recipe) {
  core::ModuleSpec spec;
  const core::KindDescription* kind = core::DescribeKindBySpecName(v1::ModuleKind_Name(p.kind()));
  if (kind == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.kind must be ", KindNames(), ", got ",
                     EnumName(v1::ModuleKind_Name(p.kind()), p.kind())));
  }
  spec.kind = kind->kind();
  absl::StatusOr<core::Activation> activation = ActivationFromProto(p.activation());
  if (!activation.ok()) return activation.status();
  spec.activation = *activation;
  if (absl::Status s = RecipeFromProto(p.recipe(), default_recipe, &spec.recipe); !s.ok()) {
    return s;
  }
  OptimizerFromProto(p.optimizer(), &spec.optimizer);
  spec.in_features = p.in_features();
  spec.out_features = p.out_features();
  spec.ffn_features = p.ffn_features();
  spec.bias = p.bias();
  spec.layernorm_eps = p.layernorm_eps() == 0 ? 1e-5f : p.layernorm_eps();
  spec.zero_centered_gamma = p.zero_centered_gamma();
  spec.return_layernorm_output = p.return_layernorm_output();
  spec.checkpoint = p.checkpoint();
  spec.max_staleness = p.max_staleness() < 0 ? -1 : p.max_staleness();
  spec.seed = p.seed();
  spec.name = p.name();
  return spec;
}

v1::ModuleKind KindToProto(const core::KindDescription& kind) {
  v1::ModuleKind out = v1::MODULE_KIND_UNSPECIFIED;
  v1::ModuleKind_Parse(kind.spec_name(), &out);
  return out;
}

v1::ModuleSpec SpecToProto(const core::ModuleSpec& s) {
  static constexpr v1::Activation kActivations[] = {v1::GELU, v1::RELU, v1::SWIGLU, v1::GEGLU};
  v1::ModuleSpec p;
  const core::KindDescription* kind = core::DescribeKind(s.kind);
  const core::SpecFields reads = kind != nullptr ? kind->spec_fields() : core::SpecFields{};
  if (kind != nullptr) p.set_kind(KindToProto(*kind));
  p.set_in_features(s.in_features);
  p.set_out_features(s.out_features);
  p.set_bias(s.bias);
  v1::Fp8Recipe* r = p.mutable_recipe();
  r->set_scaling(ScalingModeToProto(s.recipe.mode));
  r->set_margin(s.recipe.margin);
  r->set_amax_history_len(int32_t(s.recipe.history_len));
  r->set_amax_compute_algo(s.recipe.algo == core::AmaxAlgo::kMax ? v1::MAX : v1::MOST_RECENT);
  r->set_format(core::Hybrid(s.recipe) ? v1::HYBRID : v1::E4M3_ONLY);
  p.set_seed(s.seed);
  p.set_name(s.name);
  if (reads.ffn) {
    p.set_ffn_features(s.ffn_features);
    p.set_activation(kActivations[int(s.activation)]);
  }
  if (reads.layernorm) {
    p.set_layernorm_eps(s.layernorm_eps);
    p.set_zero_centered_gamma(s.zero_centered_gamma);
    p.set_return_layernorm_output(s.return_layernorm_output);
    p.set_checkpoint(s.checkpoint);
  }
  OptimizerToProto(s.optimizer, p.mutable_optimizer());
  p.set_max_staleness(s.max_staleness);
  return p;
}

void InfoToProto(const core::ModuleInfo& info, v1::ModuleInfo* out) {
  out->set_module_id(info.module_id);
  *out->mutable_spec() = SpecToProto(info.spec);
  out->set_weight_version(info.weight_version);
  out->set_live_contexts(info.live_contexts);
  out->set_optimizer_steps(info.optimizer_steps);
  for (const std::string& name : info.parameter_names) out->add_parameter_names(name);
  out->set_description(core::DescribeModule(info.spec));
  out->set_row_order_bias_sums(info.row_order_bias_sums);
}

}  // namespace gradwire::rpc
