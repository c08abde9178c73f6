#include "server/core/module_host.h"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gradwire/kernels/random.h"
#include "server/core/layernorm_linear.h"
#include "server/core/layernorm_mlp.h"
#include "server/core/linear.h"
#include "server/core/status_macros.h"

namespace gradwire::core {

namespace {

using kernels::Fp8Format;

constexpr int kMaxMargin = 32;
constexpr int64_t kMaxHistory = 1 << 16;

// Tensor roles of each kind, in the order of Module::scaling.
enum LinearRole { kIn = 0, kWeight = 1, kGrad = 2 };
enum MlpRole { kFc1In = 0, kFc1Weight, kFc2In, kFc2Weight, kFc1Grad, kFc2Grad };

struct RoleDef {
  const char* name;
  Fp8Format format;
};
const std::vector<RoleDef> kLinearRoles = {
    {"input", Fp8Format::kE4M3}, {"weight", Fp8Format::kE4M3}, {"grad_output", Fp8Format::kE5M2}};
const std::vector<RoleDef> kMlpRoles = {
    {"fc1_input", Fp8Format::kE4M3},       {"fc1_weight", Fp8Format::kE4M3},
    {"fc2_input", Fp8Format::kE4M3},       {"fc2_weight", Fp8Format::kE4M3},
    {"fc1_grad_output", Fp8Format::kE5M2}, {"fc2_grad_output", Fp8Format::kE5M2}};

at::TensorOptions Float32() { return at::TensorOptions().dtype(at::kFloat); }

std::string ShapeString(at::IntArrayRef shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::Status CheckRange(const char* field, int64_t value, int64_t lo, int64_t hi) {
  if (value < lo || value > hi) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " must be in [", lo, ", ", hi, "], got ", value));
  }
  return absl::OkStatus();
}

absl::Status CheckOpen01(const char* field, float value, bool zero_ok) {
  if (!(value >= 0.0f && value < 1.0f) || (!zero_ok && value == 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " must be in ", zero_ok ? "[0, 1)" : "(0, 1)", ", got ", value));
  }
  return absl::OkStatus();
}

absl::Status CheckPositive(const char* field, float value) {
  if (!(value > 0.0f) || !std::isfinite(value)) {
    return absl::InvalidArgumentError(absl::StrCat(field, " must be finite and > 0, got ", value));
  }
  return absl::OkStatus();
}

absl::Status CheckNonNegative(const char* field, float value) {
  if (!(value >= 0.0f) || !std::isfinite(value)) {
    return absl::InvalidArgumentError(absl::StrCat(field, " must be finite and >= 0, got ", value));
  }
  return absl::OkStatus();
}

absl::Status ValidateSpec(const ModuleSpec& s) {
  // The RPC layer maps only known enum values, but a checkpoint's spec is read back as integers:
  // an unknown value would index past the tables that name them.
  GW_RETURN_IF_ERROR(
      CheckRange("spec.kind", int64_t(s.kind), 0, int64_t(ModuleKind::kLayerNormMlp)));
  GW_RETURN_IF_ERROR(CheckRange("spec.activation", int64_t(s.activation), 0,
                                int64_t(kernels::Activation::kGeglu)));
  GW_RETURN_IF_ERROR(
      CheckRange("spec.recipe.scaling", int64_t(s.recipe.mode), 0, int64_t(ScalingMode::kDelayed)));
  GW_RETURN_IF_ERROR(CheckRange("spec.recipe.amax_compute_algo", int64_t(s.recipe.algo), 0,
                                int64_t(AmaxAlgo::kMostRecent)));
  GW_RETURN_IF_ERROR(CheckRange("spec.optimizer.kind", int64_t(s.optimizer.kind), 0,
                                int64_t(OptimizerConfig::Kind::kAdamW)));
  GW_RETURN_IF_ERROR(CheckRange("spec.in_features", s.in_features, 1, ModuleHost::kMaxFeatures));
  GW_RETURN_IF_ERROR(CheckRange("spec.out_features", s.out_features, 1, ModuleHost::kMaxFeatures));
  if (s.kind == ModuleKind::kLayerNormMlp) {
    GW_RETURN_IF_ERROR(
        CheckRange("spec.ffn_features", s.ffn_features, 1, ModuleHost::kMaxFeatures));
  } else if (s.ffn_features != 0) {
    return absl::InvalidArgumentError("spec.ffn_features is only for LAYERNORM_MLP");
  }
  if (s.kind != ModuleKind::kLayerNormMlp && s.activation != kernels::Activation::kGelu) {
    return absl::InvalidArgumentError("spec.activation is only for LAYERNORM_MLP");
  }
  if (s.kind == ModuleKind::kLinear &&
      (s.zero_centered_gamma || s.return_layernorm_output || s.checkpoint)) {
    return absl::InvalidArgumentError(
        "spec.zero_centered_gamma, return_layernorm_output and checkpoint are for the LayerNorm "
        "modules");
  }
  GW_RETURN_IF_ERROR(CheckPositive("spec.layernorm_eps", s.layernorm_eps));
  GW_RETURN_IF_ERROR(CheckRange("spec.recipe.margin", s.recipe.margin, 0, kMaxMargin));
  GW_RETURN_IF_ERROR(
      CheckRange("spec.recipe.amax_history_len", s.recipe.history_len, 1, kMaxHistory));
  if (s.optimizer.kind == OptimizerConfig::Kind::kSgd) {
    GW_RETURN_IF_ERROR(
        CheckPositive("spec.optimizer.sgd.learning_rate", s.optimizer.sgd.learning_rate));
    GW_RETURN_IF_ERROR(CheckOpen01("spec.optimizer.sgd.momentum", s.optimizer.sgd.momentum, true));
    GW_RETURN_IF_ERROR(
        CheckNonNegative("spec.optimizer.sgd.weight_decay", s.optimizer.sgd.weight_decay));
  } else {
    const AdamWConfig& a = s.optimizer.adamw;
    GW_RETURN_IF_ERROR(CheckPositive("spec.optimizer.adamw.learning_rate", a.learning_rate));
    GW_RETURN_IF_ERROR(CheckOpen01("spec.optimizer.adamw.beta1", a.beta1, true));
    GW_RETURN_IF_ERROR(CheckOpen01("spec.optimizer.adamw.beta2", a.beta2, true));
    GW_RETURN_IF_ERROR(CheckPositive("spec.optimizer.adamw.eps", a.eps));
    GW_RETURN_IF_ERROR(CheckNonNegative("spec.optimizer.adamw.weight_decay", a.weight_decay));
  }
  return absl::OkStatus();
}

// Parameter shapes of a spec, in order: (name, shape, fan_in or 0 for LayerNorm params).
struct ParamDef {
  std::string name;
  std::vector<int64_t> shape;
  int64_t fan_in;  // > 0: uniform(+-1/sqrt(fan_in)); 0: LayerNorm gamma; -1: LayerNorm beta
};

std::vector<ParamDef> ParamDefs(const ModuleSpec& s) {
  std::vector<ParamDef> defs;
  const int64_t k = s.in_features, n = s.out_features;
  if (s.kind != ModuleKind::kLinear) {
    defs.push_back({"layer_norm_weight", {k}, 0});
    defs.push_back({"layer_norm_bias", {k}, -1});
  }
  if (s.kind == ModuleKind::kLayerNormMlp) {
    const int64_t f = s.ffn_features, f1 = kernels::IsGated(s.activation) ? 2 * f : f;
    defs.push_back({"fc1_weight", {f1, k}, k});
    if (s.bias) defs.push_back({"fc1_bias", {f1}, k});
    defs.push_back({"fc2_weight", {n, f}, f});
    if (s.bias) defs.push_back({"fc2_bias", {n}, f});
  } else {
    defs.push_back({"weight", {n, k}, k});
    if (s.bias) defs.push_back({"bias", {n}, k});
  }
  return defs;
}

}  // namespace

std::vector<std::pair<std::string, std::vector<int64_t>>> ParameterShapes(const ModuleSpec& spec) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
  for (ParamDef& d : ParamDefs(spec)) shapes.emplace_back(std::move(d.name), std::move(d.shape));
  return shapes;
}

absl::Status ValidateModuleSpec(const ModuleSpec& spec) {
  GW_RETURN_IF_ERROR(ValidateSpec(spec));
  const int64_t total = ParameterCount(spec);  // dimensions are within kMaxFeatures here
  if (total > ModuleHost::kMaxParameters) {
    return absl::InvalidArgumentError(absl::StrCat("spec asks for ", total,
                                                   " parameters; a module may have at most ",
                                                   ModuleHost::kMaxParameters));
  }
  return absl::OkStatus();
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

namespace {

absl::Status CheckInputTensor(const char* field, const at::Tensor& t, int64_t last_dim,
                              const char* what) {
  if (!t.defined()) return absl::InvalidArgumentError(absl::StrCat(field, " is required"));
  if (t.scalar_type() != at::kFloat) {
    return absl::InvalidArgumentError(absl::StrCat(field, " must be float32"));
  }
  if (t.dim() < 1 || t.size(-1) != last_dim || t.numel() == 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".shape must be [..., ", last_dim,
                                                   "] (the module's ", what, "), got ",
                                                   ShapeString(t.sizes())));
  }
  return absl::OkStatus();
}

absl::Status CheckExactShape(const char* field, const at::Tensor& t, at::IntArrayRef expected) {
  if (!t.defined()) return absl::InvalidArgumentError(absl::StrCat(field, " is required"));
  if (t.scalar_type() != at::kFloat) {
    return absl::InvalidArgumentError(absl::StrCat(field, " must be float32"));
  }
  if (t.sizes() != expected) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".shape must be ", ShapeString(expected),
                                                   ", got ", ShapeString(t.sizes())));
  }
  return absl::OkStatus();
}

bool AllFinite(const at::Tensor& t) { return t.numel() == 0 || at::isfinite(t).all().item<bool>(); }

absl::Status CheckFinite(const std::string& field, const at::Tensor& t) {
  const float* p = t.data_ptr<float>();
  for (int64_t i = 0, n = t.numel(); i < n; ++i) {
    if (!std::isfinite(p[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " must be finite; element ", i, " is ", p[i]));
    }
  }
  return absl::OkStatus();
}

}  // namespace

const char* ModuleKindName(ModuleKind kind) {
  switch (kind) {
    case ModuleKind::kLinear:
      return "Linear";
    case ModuleKind::kLayerNormLinear:
      return "LayerNormLinear";
    case ModuleKind::kLayerNormMlp:
      return "LayerNormMLP";
  }
  return "unknown";
}

struct ModuleHost::Module {
  struct Param {
    std::string name;
    at::Tensor value;   // fp32 master copy, on the host
    at::Tensor device;  // value on the backend's device, as of device_version (CPU: value)
    at::Tensor grad;    // fp32 on the device, accumulated by backwards
    OptimizerSlots slots;
  };

  ModuleSpec spec;
  std::string tenant;     // set before the module is shared, then constant
  mutable std::mutex mu;  // guards everything below
  std::vector<Param> params;
  std::vector<ScalingState> scaling;  // one per tensor role (kLinearRoles / kMlpRoles)
  std::vector<std::string> role_names;
  uint64_t version = 1;
  int64_t optimizer_steps = 0;
  int64_t accumulated_backwards = 0;
  WorkspacePtr workspace;  // the cached FP8 weights (latest version built)
  const Backend* backend = nullptr;
  uint64_t device_version = ~uint64_t(0);  // the version the device copies hold

  // Brings the device copies of the parameters to the current version (a no-op on the CPU,
  // where they are the master copies themselves).
  void SyncDevice() {
    if (device_version == version) return;
    for (Param& p : params) p.device = backend->ToDevice(p.value);
    device_version = version;
  }

  const Param* Find(const std::string& name) const {
    for (const Param& p : params) {
      if (p.name == name) return &p;
    }
    return nullptr;
  }
  // The device copy (call SyncDevice first).
  at::Tensor Value(const char* name) const {
    const Param* p = Find(name);
    return p ? p->device : at::Tensor();
  }
  at::Tensor Grad(const char* name) const {
    const Param* p = Find(name);
    return p ? p->grad : at::Tensor();
  }
  LayerNormParams Ln() const {
    return LayerNormParams{Value("layer_norm_weight"), Value("layer_norm_bias"), spec.layernorm_eps,
                           spec.zero_centered_gamma};
  }
  // The quantizer of a weight role. The weights are cast once per weight version (the
  // workspace), so the cast takes its scale from the weight's own amax (with the recipe's margin)
  // under either recipe: a delayed scale would be whatever the history held when the version was
  // first used, 1.0 for a new or imported module, and would stay until the next version.
  QuantizerConfig WeightQuantizer(int role) const {
    QuantizerConfig q = scaling[size_t(role)].Quantizer();
    q.scale = 0.0f;
    return q;
  }
  // Ends a step of the given roles: records their amaxes and rolls their histories.
  void EndStep(std::initializer_list<std::pair<int, float>> amaxes) {
    for (const auto& [role, amax] : amaxes) {
      scaling[size_t(role)].Record(amax);
      scaling[size_t(role)].Roll();
    }
  }
};

ModuleHost::ModuleHost() : backend_(MakeCpuBackend()) {}
ModuleHost::ModuleHost(ContextLimits limits, ContextStore::Clock clock, BackendPtr backend)
    : backend_(backend ? std::move(backend) : MakeCpuBackend()),
      contexts_(limits, std::move(clock)) {}
ModuleHost::~ModuleHost() = default;

absl::StatusOr<ModuleInfo> ModuleHost::Create(const ModuleSpec& spec, const std::string& tenant) {
  GW_ASSIGN_OR_RETURN(std::shared_ptr<Module> m, NewModule(spec));
  m->tenant = tenant;
  std::lock_guard<std::mutex> lock(mu_);
  std::string id;
  do {
    id = RandomId128();
  } while (modules_.count(id));
  modules_.emplace(id, m);
  std::lock_guard<std::mutex> module_lock(m->mu);
  return InfoLocked(id, *m);
}

absl::StatusOr<std::shared_ptr<ModuleHost::Module>> ModuleHost::NewModule(
    const ModuleSpec& spec) const {
  GW_RETURN_IF_ERROR(ValidateModuleSpec(spec));
  const std::vector<ParamDef> defs = ParamDefs(spec);
  auto m = std::make_shared<Module>();
  m->spec = spec;
  m->backend = backend_.get();
  uint64_t stream = 0;
  for (const ParamDef& d : defs) {
    Module::Param p;
    p.name = d.name;
    p.value = at::empty(d.shape, Float32());
    if (d.fan_in > 0) {
      const float bound = 1.0f / std::sqrt(float(d.fan_in));
      kernels::FillUniform(p.value.data_ptr<float>(), p.value.numel(), spec.seed, stream, -bound,
                           bound);
    } else {
      p.value.fill_(d.fan_in == 0 && !spec.zero_centered_gamma ? 1.0f : 0.0f);
    }
    ++stream;
    p.grad = backend_->Zeros(d.shape);
    m->params.push_back(std::move(p));
  }
  const auto& roles = spec.kind == ModuleKind::kLayerNormMlp ? kMlpRoles : kLinearRoles;
  for (const RoleDef& r : roles) {
    m->scaling.emplace_back(r.format, spec.recipe);
    m->role_names.push_back(r.name);
  }
  return m;
}

absl::StatusOr<std::shared_ptr<ModuleHost::Module>> ModuleHost::Find(
    const std::string& module_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = modules_.find(module_id);
  if (it == modules_.end()) {
    return absl::NotFoundError(absl::StrCat("module_id ", module_id, " is not a module"));
  }
  return it->second;
}

ModuleInfo ModuleHost::InfoLocked(const std::string& id, const Module& m) const {
  ModuleInfo info{id, m.tenant, m.spec, m.version, contexts_.live_contexts(id), m.optimizer_steps,
                  {}};
  for (const auto& p : m.params) info.parameter_names.push_back(p.name);
  return info;
}

absl::StatusOr<ModuleInfo> ModuleHost::Info(const std::string& module_id) const {
  GW_ASSIGN_OR_RETURN(auto m, Find(module_id));
  std::lock_guard<std::mutex> lock(m->mu);
  return InfoLocked(module_id, *m);
}

absl::Status ModuleHost::CheckTenant(const std::string& module_id,
                                     const std::string& tenant) const {
  auto m = Find(module_id);
  if (!m.ok()) return m.status();
  if ((*m)->tenant != tenant) {
    return absl::NotFoundError(absl::StrCat("module_id ", module_id, " is not a module"));
  }
  return absl::OkStatus();
}

std::vector<ModuleInfo> ModuleHost::List(const std::string* tenant) const {
  std::map<std::string, std::shared_ptr<Module>> snapshot;
  {
    std::lock_guard<std::mutex> lock(mu_);
    snapshot = modules_;
  }
  std::vector<ModuleInfo> out;
  for (const auto& [id, m] : snapshot) {
    if (tenant != nullptr && m->tenant != *tenant) continue;
    std::lock_guard<std::mutex> lock(m->mu);
    out.push_back(InfoLocked(id, *m));
  }
  return out;
}

absl::StatusOr<ModuleSpec> ModuleHost::Spec(const std::string& module_id) const {
  GW_ASSIGN_OR_RETURN(auto m, Find(module_id));
  return m->spec;
}

absl::Status ModuleHost::Delete(const std::string& module_id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!modules_.erase(module_id)) {
      return absl::NotFoundError(absl::StrCat("module_id ", module_id, " is not a module"));
    }
  }
  contexts_.ReleaseModule(module_id);
  return absl::OkStatus();
}

absl::StatusOr<ForwardOutput> ModuleHost::Forward(const std::string& module_id,
                                                  const at::Tensor& input, bool training,
                                                  const Fp8Tensor* input_fp8,
                                                  const std::string& client) {
  GW_ASSIGN_OR_RETURN(auto m, Find(module_id));
  GW_RETURN_IF_ERROR(CheckInputTensor("input", input, m->spec.in_features, "in_features"));
  // A NaN or inf would stick in the amax history and, through the backward, in the shared
  // gradient buffers: refuse it before it touches any state.
  GW_RETURN_IF_ERROR(CheckFinite("input", input.contiguous()));
  std::lock_guard<std::mutex> lock(m->mu);
  const ModuleSpec& spec = m->spec;
  const Backend& b = *backend_;
  m->SyncDevice();
  const at::Tensor x = b.ToDevice(As2D(input));
  // FP8 codes from the wire arrive on the host; other backends take their own copy. Only a
  // Linear uses them as they are (the LayerNorm modules normalise the dequantized input).
  Fp8Tensor fp8_on_device;
  if (input_fp8 != nullptr && spec.kind == ModuleKind::kLinear && !b.device().is_cpu()) {
    if (!input_fp8->has_rowwise()) {
      return absl::InternalError("Forward: FP8 input codes without their rowwise copy");
    }
    fp8_on_device =
        b.FromCodes(input_fp8->rowwise.data_ptr<uint8_t>(), input_fp8->rows, input_fp8->cols,
                    input_fp8->format, input_fp8->scale_inv, {true, training});
    input_fp8 = &fp8_on_device;
  }
  ForwardOutput out;
  std::shared_ptr<SavedTensors> saved;
  WorkspacePtr workspace;
  bool built = false;
  at::Tensor y, ln_out;
  switch (spec.kind) {
    case ModuleKind::kLinear: {
      LinearFwdArgs args;
      args.backend = &b;
      args.input = x;
      args.weight = m->Value("weight");
      args.bias = m->Value("bias");
      args.weight_version = m->version;
      args.workspace = m->workspace;
      args.input_quantizer = m->scaling[kIn].Quantizer();
      args.weight_quantizer = m->WeightQuantizer(kWeight);
      args.training = training;
      if (input_fp8 != nullptr) {
        if (input_fp8->rows != x.size(0) || input_fp8->cols != x.size(1)) {
          return absl::InternalError("Forward: FP8 input codes do not match the input's shape");
        }
        args.input_fp8 = input_fp8;
      }
      GW_ASSIGN_OR_RETURN(LinearFwdResult r, LinearForward(args));
      if (training) GW_RETURN_IF_ERROR(contexts_.CheckFits(r.saved->bytes()));
      if (training) m->EndStep({{kIn, r.input_amax}, {kWeight, r.weight_amax}});
      y = r.output, workspace = r.workspace, built = r.workspace_built, saved = r.saved;
      break;
    }
    case ModuleKind::kLayerNormLinear: {
      LayerNormLinearFwdArgs args;
      args.backend = &b;
      args.input = x;
      args.ln = m->Ln();
      args.weight = m->Value("weight");
      args.bias = m->Value("bias");
      args.weight_version = m->version;
      args.workspace = m->workspace;
      args.input_quantizer = m->scaling[kIn].Quantizer();
      args.weight_quantizer = m->WeightQuantizer(kWeight);
      args.training = training;
      args.return_layernorm_output = spec.return_layernorm_output;
      args.checkpoint = spec.checkpoint;
      GW_ASSIGN_OR_RETURN(LayerNormLinearFwdResult r, LayerNormLinearForward(args));
      if (training) GW_RETURN_IF_ERROR(contexts_.CheckFits(r.saved->bytes()));
      if (training) m->EndStep({{kIn, r.input_amax}, {kWeight, r.weight_amax}});
      y = r.output, ln_out = r.layernorm_output, workspace = r.workspace;
      built = r.workspace_built, saved = r.saved;
      break;
    }
    case ModuleKind::kLayerNormMlp: {
      LayerNormMlpFwdArgs args;
      args.backend = &b;
      args.input = x;
      args.ln = m->Ln();
      args.fc1_weight = m->Value("fc1_weight");
      args.fc1_bias = m->Value("fc1_bias");
      args.fc2_weight = m->Value("fc2_weight");
      args.fc2_bias = m->Value("fc2_bias");
      args.activation = spec.activation;
      args.weight_version = m->version;
      args.workspace = m->workspace;
      args.fc1_input_quantizer = m->scaling[kFc1In].Quantizer();
      args.fc1_weight_quantizer = m->WeightQuantizer(kFc1Weight);
      args.fc2_input_quantizer = m->scaling[kFc2In].Quantizer();
      args.fc2_weight_quantizer = m->WeightQuantizer(kFc2Weight);
      args.training = training;
      args.return_layernorm_output = spec.return_layernorm_output;
      args.checkpoint = spec.checkpoint;
      GW_ASSIGN_OR_RETURN(LayerNormMlpFwdResult r, LayerNormMlpForward(args));
      if (training) GW_RETURN_IF_ERROR(contexts_.CheckFits(r.saved->bytes()));
      if (training) {
        m->EndStep({{kFc1In, r.fc1_input_amax},
                    {kFc1Weight, r.fc1_weight_amax},
                    {kFc2In, r.fc2_input_amax},
                    {kFc2Weight, r.fc2_weight_amax}});
      }
      y = r.output, ln_out = r.layernorm_output, workspace = r.workspace;
      built = r.workspace_built, saved = r.saved;
      break;
    }
  }
  (built ? workspace_builds_ : workspace_hits_).fetch_add(1);
  m->workspace = workspace;
  std::vector<int64_t> out_shape(input.sizes().begin(), input.sizes().end());
  out_shape.back() = spec.out_features;
  out.output = b.ToHost(y).reshape(out_shape);
  if (ln_out.defined()) out.layernorm_output = b.ToHost(ln_out).reshape(input.sizes());
  out.weight_version = m->version;
  if (training) {
    saved->input_shape.assign(input.sizes().begin(), input.sizes().end());
    GW_ASSIGN_OR_RETURN(out.context_id,
                        contexts_.Put(module_id, m->version, std::move(saved), m->tenant, client));
  }
  return out;
}

absl::StatusOr<at::Tensor> ModuleHost::Backward(const std::string& context_id,
                                                const at::Tensor& grad_output, bool retain,
                                                bool skip_grad_input) {
  BackwardInput in;
  in.grad_output = grad_output;
  in.retain = retain;
  in.skip_grad_input = skip_grad_input;
  return Backward(context_id, in);
}

absl::StatusOr<at::Tensor> ModuleHost::Backward(const std::string& context_id,
                                                const BackwardInput& in) {
  GW_ASSIGN_OR_RETURN(ContextStore::Lease lease, contexts_.Acquire(context_id));
  // Until Finish(consumed=true), every exit leaves the context as it was.
  auto fail = [&](absl::Status status) {
    lease.saved.reset();
    contexts_.Finish(context_id, /*consumed=*/false, in.retain);
    return status;
  };
  auto found = Find(lease.module_id);
  if (!found.ok()) return fail(found.status());
  std::shared_ptr<Module> m = *std::move(found);
  const std::vector<int64_t>& input_shape = lease.saved->input_shape;
  std::vector<int64_t> expected = input_shape;
  expected.back() = m->spec.out_features;
  if (auto s = CheckExactShape("grad_output", in.grad_output, expected); !s.ok()) return fail(s);
  if (auto s = CheckFinite("grad_output", in.grad_output.contiguous()); !s.ok()) return fail(s);
  if (in.grad_layernorm_output.defined()) {
    if (!m->spec.return_layernorm_output) {
      return fail(absl::InvalidArgumentError(
          "grad_layernorm_output is only for modules created with return_layernorm_output"));
    }
    if (auto s = CheckExactShape("grad_layernorm_output", in.grad_layernorm_output, input_shape);
        !s.ok()) {
      return fail(s);
    }
    if (auto s = CheckFinite("grad_layernorm_output", in.grad_layernorm_output.contiguous());
        !s.ok()) {
      return fail(s);
    }
  }
  at::Tensor grad_input;
  {
    std::lock_guard<std::mutex> lock(m->mu);
    if (m->spec.max_staleness >= 0 &&
        m->version - lease.weight_version > uint64_t(m->spec.max_staleness)) {
      return fail(absl::FailedPreconditionError(
          absl::StrCat("context_id ", context_id, " was made under weight version ",
                       lease.weight_version, "; the module is at version ", m->version,
                       " and allows max_staleness ", m->spec.max_staleness)));
    }
    const Backend& b = *backend_;
    m->SyncDevice();
    // A backward whose gradients come out non-finite must leave the accumulators as they were.
    // The first backward after a step accumulates straight into the (zero) buffers and zeroes
    // them again on failure; later ones accumulate into fresh buffers that are checked and then
    // added, the sums checked again before they replace the accumulators.
    const bool direct = m->accumulated_backwards == 0;
    std::vector<std::pair<Module::Param*, at::Tensor>> targets;
    auto grad = [&](const char* name) -> at::Tensor {
      for (Module::Param& p : m->params) {
        if (p.name != name) continue;
        targets.emplace_back(&p, direct ? p.grad : at::zeros_like(p.grad));
        return targets.back().second;
      }
      return at::Tensor();
    };
    std::vector<std::pair<int, float>> amaxes;
    const at::Tensor dy = b.ToDevice(As2D(in.grad_output));
    const at::Tensor d_ln = in.grad_layernorm_output.defined()
                                ? b.ToDevice(As2D(in.grad_layernorm_output))
                                : at::Tensor();
    switch (m->spec.kind) {
      case ModuleKind::kLinear: {
        LinearBwdArgs args;
        args.backend = &b;
        args.grad_output = dy;
        args.saved = dynamic_cast<const LinearSaved*>(lease.saved.get());
        args.grad_quantizer = m->scaling[kGrad].Quantizer();
        args.compute_grad_input = !in.skip_grad_input;
        args.weight_grad = grad("weight");
        args.bias_grad = grad("bias");
        if (!args.saved) return fail(absl::InternalError("context is not a Linear context"));
        auto r = LinearBackward(args);
        if (!r.ok()) return fail(r.status());
        amaxes = {{kGrad, r->grad_output_amax}};
        grad_input = r->grad_input;
        break;
      }
      case ModuleKind::kLayerNormLinear: {
        LayerNormLinearBwdArgs args;
        args.backend = &b;
        args.grad_output = dy;
        args.grad_layernorm_output = d_ln;
        args.saved = dynamic_cast<const LayerNormLinearSaved*>(lease.saved.get());
        args.ln = m->Ln();
        args.grad_quantizer = m->scaling[kGrad].Quantizer();
        args.compute_grad_input = !in.skip_grad_input;
        args.weight_grad = grad("weight");
        args.bias_grad = grad("bias");
        args.gamma_grad = grad("layer_norm_weight");
        args.beta_grad = grad("layer_norm_bias");
        if (!args.saved) return fail(absl::InternalError("context is not a LayerNormLinear one"));
        auto r = LayerNormLinearBackward(args);
        if (!r.ok()) return fail(r.status());
        amaxes = {{kGrad, r->grad_output_amax}};
        grad_input = r->grad_input;
        break;
      }
      case ModuleKind::kLayerNormMlp: {
        LayerNormMlpBwdArgs args;
        args.backend = &b;
        args.grad_output = dy;
        args.grad_layernorm_output = d_ln;
        args.saved = dynamic_cast<const LayerNormMlpSaved*>(lease.saved.get());
        args.ln = m->Ln();
        args.activation = m->spec.activation;
        args.fc1_grad_quantizer = m->scaling[kFc1Grad].Quantizer();
        args.fc2_grad_quantizer = m->scaling[kFc2Grad].Quantizer();
        args.compute_grad_input = !in.skip_grad_input;
        args.gamma_grad = grad("layer_norm_weight");
        args.beta_grad = grad("layer_norm_bias");
        args.fc1_weight_grad = grad("fc1_weight");
        args.fc1_bias_grad = grad("fc1_bias");
        args.fc2_weight_grad = grad("fc2_weight");
        args.fc2_bias_grad = grad("fc2_bias");
        if (!args.saved) return fail(absl::InternalError("context is not a LayerNormMLP one"));
        auto r = LayerNormMlpBackward(args);
        if (!r.ok()) return fail(r.status());
        amaxes = {{kFc1Grad, r->fc1_grad_amax}, {kFc2Grad, r->fc2_grad_amax}};
        grad_input = r->grad_input;
        break;
      }
    }
    auto overflowed = [&](const std::string& what) {
      if (direct) {
        for (auto& [p, g] : targets) p->grad.zero_();
      }
      return fail(absl::OutOfRangeError(
          absl::StrCat("the ", what,
                       " of this backward came out non-finite (fp32 overflow); nothing was "
                       "accumulated, the scaling state is unchanged and context_id ",
                       context_id, " is kept: scale grad_output down and retry, or release it")));
    };
    if (grad_input.defined() && !AllFinite(grad_input)) return overflowed("grad_input");
    for (auto& [p, g] : targets) {
      if (!AllFinite(g)) return overflowed(absl::StrCat(p->name, " gradient"));
    }
    if (!direct) {
      std::vector<at::Tensor> sums;
      for (auto& [p, g] : targets) {
        sums.push_back(p->grad + g);
        if (!AllFinite(sums.back())) {
          return overflowed(absl::StrCat("accumulated ", p->name, " gradient"));
        }
      }
      for (size_t i = 0; i < targets.size(); ++i) targets[i].first->grad.copy_(sums[i]);
    }
    for (const auto& [role, amax] : amaxes) {
      m->scaling[size_t(role)].Record(amax);
      m->scaling[size_t(role)].Roll();
    }
    ++m->accumulated_backwards;
  }
  if (grad_input.defined()) grad_input = backend_->ToHost(grad_input).reshape(input_shape);
  // Free the saved tensors now, before the caller sends the reply.
  lease.saved.reset();
  contexts_.Finish(context_id, /*consumed=*/true, in.retain);
  return grad_input;
}

absl::Status ModuleHost::ReleaseContext(const std::string& context_id,
                                        ContextStore::ReleaseReason reason) {
  return contexts_.Release(context_id, reason);
}

absl::StatusOr<uint64_t> ModuleHost::ApplyGradients(const std::string& module_id,
                                                    float learning_rate) {
  if (learning_rate != 0.0f) GW_RETURN_IF_ERROR(CheckPositive("learning_rate", learning_rate));
  GW_ASSIGN_OR_RETURN(auto m, Find(module_id));
  std::lock_guard<std::mutex> lock(m->mu);
  const float lr = learning_rate > 0.0f ? learning_rate : m->spec.optimizer.learning_rate();
  // The step runs on copies, which replace the parameters and optimizer state only when every
  // value came out finite: a step that would overflow changes nothing.
  const int64_t step = m->optimizer_steps + 1;
  std::vector<at::Tensor> values;
  std::vector<OptimizerSlots> slots;
  for (Module::Param& p : m->params) {
    values.push_back(p.value.clone());
    slots.push_back(p.slots.Clone());
    OptimizerStep(m->spec.optimizer, lr, step, values.back(), backend_->ToHost(p.grad),
                  slots.back());
    if (!AllFinite(values.back()) || !slots.back().AllFinite()) {
      return absl::OutOfRangeError(absl::StrCat(
          "this optimizer step (learning rate ", lr, ") would make ", p.name,
          " non-finite; nothing was changed (the gradients are kept): lower the learning rate or "
          "GetGradients(zero) to drop them"));
    }
  }
  for (size_t i = 0; i < m->params.size(); ++i) {
    m->params[i].value.copy_(values[i]);  // in place: the device copy may alias it
    m->params[i].slots = std::move(slots[i]);
    m->params[i].grad.zero_();
  }
  m->optimizer_steps = step;
  m->accumulated_backwards = 0;
  return ++m->version;
}

absl::StatusOr<ParametersCopy> ModuleHost::GetGradients(const std::string& module_id, bool zero) {
  GW_ASSIGN_OR_RETURN(auto m, Find(module_id));
  std::lock_guard<std::mutex> lock(m->mu);
  ParametersCopy out;
  for (Module::Param& p : m->params) {
    out.tensors.emplace_back(p.name, p.grad.to(at::kCPU, at::kFloat, false, /*copy=*/true));
    if (zero) p.grad.zero_();
  }
  out.weight_version = m->version;
  out.accumulated_backwards = m->accumulated_backwards;
  if (zero) m->accumulated_backwards = 0;
  return out;
}

absl::StatusOr<ParametersCopy> ModuleHost::GetWeights(const std::string& module_id) const {
  GW_ASSIGN_OR_RETURN(auto m, Find(module_id));
  std::lock_guard<std::mutex> lock(m->mu);
  ParametersCopy out;
  for (const Module::Param& p : m->params) out.tensors.emplace_back(p.name, p.value.clone());
  out.weight_version = m->version;
  return out;
}

absl::StatusOr<uint64_t> ModuleHost::SetWeights(const std::string& module_id,
                                                const NamedTensors& params) {
  GW_ASSIGN_OR_RETURN(auto m, Find(module_id));
  if (params.empty()) return absl::InvalidArgumentError("parameters is empty: nothing to set");
  std::vector<std::string> names;
  for (const auto& p : m->params) names.push_back(p.name);
  std::vector<std::pair<size_t, at::Tensor>> checked;
  std::set<std::string> seen;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& [name, tensor] = params[i];
    const std::string field = absl::StrCat("parameters[", i, "] (", name, ")");
    size_t index = 0;
    while (index < names.size() && names[index] != name) ++index;
    if (index == names.size()) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": not a parameter of this ",
                                                     ModuleKindName(m->spec.kind), "; it has ",
                                                     absl::StrJoin(names, ", ")));
    }
    if (!seen.insert(name).second) {
      return absl::InvalidArgumentError(absl::StrCat(field, ": given twice"));
    }
    GW_RETURN_IF_ERROR(CheckExactShape(field.c_str(), tensor, m->params[index].value.sizes()));
    at::Tensor t = tensor.contiguous();
    GW_RETURN_IF_ERROR(CheckFinite(field, t));
    checked.emplace_back(index, t);
  }
  std::lock_guard<std::mutex> lock(m->mu);
  for (const auto& [index, t] : checked) m->params[index].value.copy_(t);
  return ++m->version;
}

absl::StatusOr<std::vector<RoleScaling>> ModuleHost::Scaling(const std::string& module_id) const {
  GW_ASSIGN_OR_RETURN(auto m, Find(module_id));
  std::lock_guard<std::mutex> lock(m->mu);
  std::vector<RoleScaling> out;
  for (size_t i = 0; i < m->scaling.size(); ++i) {
    out.push_back({m->role_names[i], m->scaling[i].scale(), m->scaling[i].history()});
  }
  return out;
}

absl::StatusOr<ModuleState> ModuleHost::ExportState(const std::string& module_id) const {
  GW_ASSIGN_OR_RETURN(auto m, Find(module_id));
  std::lock_guard<std::mutex> lock(m->mu);
  ModuleState state;
  state.module_id = module_id;
  state.tenant = m->tenant;
  state.spec = m->spec;
  state.weight_version = m->version;
  state.optimizer_steps = m->optimizer_steps;
  for (const Module::Param& p : m->params) {
    state.parameters.emplace_back(p.name, p.value.clone());
    if (p.slots.first.defined()) {
      state.optimizer_slots.emplace_back(p.name + ".first", p.slots.first.clone());
    }
    if (p.slots.second.defined()) {
      state.optimizer_slots.emplace_back(p.name + ".second", p.slots.second.clone());
    }
  }
  for (size_t i = 0; i < m->scaling.size(); ++i) {
    state.scaling.push_back({m->role_names[i], m->scaling[i].scale(), m->scaling[i].history()});
  }
  return state;
}

absl::Status ModuleHost::ImportState(const ModuleState& state) {
  if (state.module_id.empty()) return absl::InvalidArgumentError("module_id is required");
  GW_ASSIGN_OR_RETURN(std::shared_ptr<Module> m, NewModule(state.spec));
  m->tenant = state.tenant;
  auto find = [](const NamedTensors& list, const std::string& name) -> const at::Tensor* {
    for (const auto& [n, t] : list) {
      if (n == name) return &t;
    }
    return nullptr;
  };
  for (Module::Param& p : m->params) {
    const at::Tensor* value = find(state.parameters, p.name);
    if (!value) {
      return absl::InvalidArgumentError(absl::StrCat("parameter ", p.name, " is missing"));
    }
    GW_RETURN_IF_ERROR(CheckExactShape(p.name.c_str(), *value, p.value.sizes()));
    p.value.copy_(*value);
    for (auto [suffix, slot] :
         {std::pair{".first", &p.slots.first}, {".second", &p.slots.second}}) {
      if (const at::Tensor* t = find(state.optimizer_slots, p.name + suffix)) {
        GW_RETURN_IF_ERROR(CheckExactShape((p.name + suffix).c_str(), *t, p.value.sizes()));
        *slot = t->clone();
      }
    }
  }
  for (const RoleScaling& r : state.scaling) {
    for (size_t i = 0; i < m->role_names.size(); ++i) {
      if (m->role_names[i] == r.role) m->scaling[i].Set(r.history, r.scale);
    }
  }
  m->version = state.weight_version;
  m->optimizer_steps = state.optimizer_steps;
  std::lock_guard<std::mutex> lock(mu_);
  if (!modules_.emplace(state.module_id, m).second) {
    return absl::AlreadyExistsError(absl::StrCat("module_id ", state.module_id, " exists"));
  }
  return absl::OkStatus();
}

HostStats ModuleHost::Stats() const {
  HostStats s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    s.modules = int64_t(modules_.size());
  }
  s.contexts = contexts_.stats();
  s.live_contexts = s.contexts.live;
  s.context_bytes = s.contexts.device_bytes + s.contexts.host_bytes;
  s.workspace_builds = workspace_builds_.load();
  s.workspace_hits = workspace_hits_.load();
  return s;
}

}  // namespace gradwire::core
