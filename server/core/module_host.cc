#include "server/core/module_host.h"

#include <ATen/ATen.h>

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gradwire/kernels/random.h"
#include "server/core/linear.h"
#include "server/core/status_macros.h"

namespace gradwire::core {

struct ModuleHost::Module {
  ModuleSpec spec;
  mutable std::mutex mu;   // guards everything below
  at::Tensor weight;       // fp32 master weight [N, K]
  at::Tensor bias;         // fp32 [N] or undefined
  at::Tensor weight_grad;  // fp32 [N, K], accumulated by backwards
  at::Tensor bias_grad;    // fp32 [N] or undefined
  uint64_t version = 1;
  WorkspacePtr workspace;  // the cached FP8 weight (latest version built)
};

namespace {

constexpr kernels::Fp8Format kForwardFormat = kernels::Fp8Format::kE4M3;
constexpr kernels::Fp8Format kGradFormat = kernels::Fp8Format::kE5M2;
constexpr int kMaxMargin = 32;

at::TensorOptions Float32() { return at::TensorOptions().dtype(at::kFloat); }

std::string ShapeString(at::IntArrayRef shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::Status CheckFeatures(const char* field, int64_t value) {
  if (value < 1 || value > ModuleHost::kMaxFeatures) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " must be in [1, ", ModuleHost::kMaxFeatures, "], got ", value));
  }
  return absl::OkStatus();
}

absl::Status CheckFloat32(const char* field, const at::Tensor& t) {
  if (!t.defined()) return absl::InvalidArgumentError(absl::StrCat(field, " is required"));
  if (t.scalar_type() != at::kFloat) {
    return absl::InvalidArgumentError(absl::StrCat(field, " must be float32"));
  }
  return absl::OkStatus();
}

absl::Status CheckShape(const char* field, const at::Tensor& t, at::IntArrayRef expected) {
  if (t.sizes() != expected) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".shape must be ", ShapeString(expected),
                                                   ", got ", ShapeString(t.sizes())));
  }
  return absl::OkStatus();
}

absl::Status CheckFinite(const char* field, const at::Tensor& t) {
  const float* p = t.data_ptr<float>();
  for (int64_t i = 0, n = t.numel(); i < n; ++i) {
    if (!std::isfinite(p[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " must be finite; element ", i, " is ", p[i]));
    }
  }
  return absl::OkStatus();
}

// Flattens [..., last] to a contiguous float32 [rows, last] (a view when already contiguous).
at::Tensor As2D(const at::Tensor& t) { return t.contiguous().reshape({-1, t.size(-1)}); }

}  // namespace

ModuleHost::ModuleHost() = default;
ModuleHost::~ModuleHost() = default;

absl::StatusOr<ModuleInfo> ModuleHost::Create(const ModuleSpec& spec) {
  GW_RETURN_IF_ERROR(CheckFeatures("spec.in_features", spec.in_features));
  GW_RETURN_IF_ERROR(CheckFeatures("spec.out_features", spec.out_features));
  if (spec.margin < 0 || spec.margin > kMaxMargin) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.recipe.margin must be in [0, ", kMaxMargin, "], got ", spec.margin));
  }
  auto m = std::make_shared<Module>();
  m->spec = spec;
  const int64_t n = spec.out_features, k = spec.in_features;
  const float bound = 1.0f / std::sqrt(float(k));
  m->weight = at::empty({n, k}, Float32());
  kernels::FillUniform(m->weight.data_ptr<float>(), n * k, spec.seed, /*stream=*/0, -bound, bound);
  m->weight_grad = at::zeros({n, k}, Float32());
  if (spec.bias) {
    m->bias = at::empty({n}, Float32());
    kernels::FillUniform(m->bias.data_ptr<float>(), n, spec.seed, /*stream=*/1, -bound, bound);
    m->bias_grad = at::zeros({n}, Float32());
  }
  std::lock_guard<std::mutex> lock(mu_);
  std::string id;
  do {
    id = RandomId128();
  } while (modules_.count(id));
  modules_.emplace(id, m);
  std::lock_guard<std::mutex> module_lock(m->mu);
  return InfoLocked(id, *m);
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
  return ModuleInfo{id, m.spec, m.version, contexts_.live_contexts(id)};
}

absl::StatusOr<ModuleInfo> ModuleHost::Info(const std::string& module_id) const {
  GW_ASSIGN_OR_RETURN(auto m, Find(module_id));
  std::lock_guard<std::mutex> lock(m->mu);
  return InfoLocked(module_id, *m);
}

std::vector<ModuleInfo> ModuleHost::List() const {
  std::map<std::string, std::shared_ptr<Module>> snapshot;
  {
    std::lock_guard<std::mutex> lock(mu_);
    snapshot = modules_;
  }
  std::vector<ModuleInfo> out;
  for (const auto& [id, m] : snapshot) {
    std::lock_guard<std::mutex> lock(m->mu);
    out.push_back(InfoLocked(id, *m));
  }
  return out;
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
                                                  const at::Tensor& input, bool training) {
  GW_ASSIGN_OR_RETURN(auto m, Find(module_id));
  GW_RETURN_IF_ERROR(CheckFloat32("input", input));
  if (input.dim() < 1 || input.size(-1) != m->spec.in_features) {
    return absl::InvalidArgumentError(
        absl::StrCat("input.shape must be [..., ", m->spec.in_features,
                     "] (the module's in_features), got ", ShapeString(input.sizes())));
  }
  if (input.numel() == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("input.shape ", ShapeString(input.sizes()), " has no elements"));
  }
  std::lock_guard<std::mutex> lock(m->mu);
  LinearFwdArgs args;
  args.input = As2D(input);
  args.weight = m->weight;
  args.bias = m->bias;
  args.weight_version = m->version;
  args.workspace = m->workspace;
  args.input_quantizer = {kForwardFormat, m->spec.margin};
  args.weight_quantizer = {kForwardFormat, m->spec.margin};
  args.training = training;
  GW_ASSIGN_OR_RETURN(LinearFwdResult result, LinearForward(args));
  (result.workspace_built ? workspace_builds_ : workspace_hits_).fetch_add(1);
  m->workspace = result.workspace;
  ForwardOutput out;
  std::vector<int64_t> out_shape(input.sizes().begin(), input.sizes().end());
  out_shape.back() = m->spec.out_features;
  out.output = result.output.reshape(out_shape);
  out.weight_version = m->version;
  if (training) {
    result.saved->input_shape.assign(input.sizes().begin(), input.sizes().end());
    out.context_id = contexts_.Put(module_id, m->version, std::move(result.saved));
  }
  return out;
}

absl::StatusOr<at::Tensor> ModuleHost::Backward(const std::string& context_id,
                                                const at::Tensor& grad_output, bool retain,
                                                bool skip_grad_input) {
  GW_ASSIGN_OR_RETURN(ContextStore::Lease lease, contexts_.Acquire(context_id));
  // Until Finish(consumed=true), every exit leaves the context as it was.
  auto fail = [&](absl::Status status) {
    lease.saved.reset();
    contexts_.Finish(context_id, /*consumed=*/false, retain);
    return status;
  };
  auto found = Find(lease.module_id);
  if (!found.ok()) return fail(found.status());
  std::shared_ptr<Module> m = *std::move(found);
  const auto* saved = dynamic_cast<const LinearSaved*>(lease.saved.get());
  if (saved == nullptr) return fail(absl::InternalError("context does not hold Linear tensors"));
  std::vector<int64_t> expected = saved->input_shape;
  expected.back() = m->spec.out_features;
  if (auto s = CheckFloat32("grad_output", grad_output); !s.ok()) return fail(s);
  if (auto s = CheckShape("grad_output", grad_output, expected); !s.ok()) return fail(s);

  at::Tensor grad_input;
  {
    std::lock_guard<std::mutex> lock(m->mu);
    LinearBwdArgs args;
    args.grad_output = As2D(grad_output);
    args.saved = saved;
    args.grad_quantizer = {kGradFormat, m->spec.margin};
    args.compute_grad_input = !skip_grad_input;
    args.weight_grad = m->weight_grad;
    args.bias_grad = m->bias_grad;
    auto result = LinearBackward(args);
    if (!result.ok()) return fail(result.status());
    if (!skip_grad_input) grad_input = result->grad_input.reshape(saved->input_shape);
  }
  // Free the saved tensors now, before the caller sends the reply.
  saved = nullptr;
  lease.saved.reset();
  contexts_.Finish(context_id, /*consumed=*/true, retain);
  return grad_input;
}

absl::Status ModuleHost::ReleaseContext(const std::string& context_id) {
  return contexts_.Release(context_id);
}

absl::StatusOr<uint64_t> ModuleHost::ApplySgd(const std::string& module_id, float learning_rate) {
  if (!(learning_rate > 0.0f) || !std::isfinite(learning_rate)) {
    return absl::InvalidArgumentError(
        absl::StrCat("sgd.learning_rate must be finite and > 0, got ", learning_rate));
  }
  GW_ASSIGN_OR_RETURN(auto m, Find(module_id));
  std::lock_guard<std::mutex> lock(m->mu);
  m->weight.sub_(m->weight_grad, learning_rate);
  m->weight_grad.zero_();
  if (m->bias.defined()) {
    m->bias.sub_(m->bias_grad, learning_rate);
    m->bias_grad.zero_();
  }
  return ++m->version;
}

absl::StatusOr<WeightsCopy> ModuleHost::GetWeights(const std::string& module_id) const {
  GW_ASSIGN_OR_RETURN(auto m, Find(module_id));
  std::lock_guard<std::mutex> lock(m->mu);
  WeightsCopy out;
  out.weight = m->weight.clone();
  if (m->bias.defined()) out.bias = m->bias.clone();
  out.weight_version = m->version;
  return out;
}

absl::StatusOr<uint64_t> ModuleHost::SetWeights(const std::string& module_id,
                                                const at::Tensor& weight, const at::Tensor& bias) {
  GW_ASSIGN_OR_RETURN(auto m, Find(module_id));
  const int64_t n = m->spec.out_features, k = m->spec.in_features;
  GW_RETURN_IF_ERROR(CheckFloat32("weight", weight));
  GW_RETURN_IF_ERROR(CheckShape("weight", weight, {n, k}));
  at::Tensor w = weight.contiguous();
  GW_RETURN_IF_ERROR(CheckFinite("weight", w));
  at::Tensor b;
  if (m->spec.bias) {
    GW_RETURN_IF_ERROR(CheckFloat32("bias", bias));
    GW_RETURN_IF_ERROR(CheckShape("bias", bias, {n}));
    b = bias.contiguous();
    GW_RETURN_IF_ERROR(CheckFinite("bias", b));
  } else if (bias.defined()) {
    return absl::InvalidArgumentError("bias must be unset: the module was created without bias");
  }
  std::lock_guard<std::mutex> lock(m->mu);
  m->weight.copy_(w);
  if (b.defined()) m->bias.copy_(b);
  return ++m->version;
}

HostStats ModuleHost::Stats() const {
  HostStats s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    s.modules = int64_t(modules_.size());
  }
  s.live_contexts = contexts_.live_contexts();
  s.context_bytes = contexts_.live_bytes();
  s.workspace_builds = workspace_builds_.load();
  s.workspace_hits = workspace_hits_.load();
  return s;
}

}  // namespace gradwire::core
