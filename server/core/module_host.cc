#include "server/core/module_host.h"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>
#include <optional>
#include <set>
#include <stdexcept>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gradwire/kernels/random.h"
#include "server/core/device_scaling.h"
#include "server/core/gradients.h"
#include "server/core/status_macros.h"

namespace gradwire::core {

namespace {

at::TensorOptions Float32() { return at::TensorOptions().dtype(at::kFloat); }

std::string ShapeString(at::IntArrayRef shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

absl::Status CheckExactShape(const char* field, const at::Tensor& t, at::IntArrayRef expected,
                             bool bf16_ok = false) {
  if (!t.defined()) return absl::InvalidArgumentError(absl::StrCat(field, " is required"));
  if (t.scalar_type() != at::kFloat && !(bf16_ok && t.scalar_type() == at::kBFloat16)) {
    return absl::InvalidArgumentError(absl::StrCat(field, " must be float32"));
  }
  if (t.sizes() != expected) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".shape must be ", ShapeString(expected),
                                                   ", got ", ShapeString(t.sizes())));
  }
  return absl::OkStatus();
}

bool AllFinite(const at::Tensor& t) { return t.numel() == 0 || at::isfinite(t).all().item<bool>(); }

// Any device: one reduction, and on failure the first bad element for the message.
absl::Status CheckFinite(const std::string& field, const at::Tensor& t) {
  if (AllFinite(t)) return absl::OkStatus();
  const at::Tensor flat = t.reshape(-1);
  const int64_t i = at::nonzero(at::logical_not(at::isfinite(flat)))[0][0].item<int64_t>();
  return absl::InvalidArgumentError(
      absl::StrCat(field, " must be finite; element ", i, " is ", flat[i].item<float>()));
}

// A host fp32 tensor encoded for the wire, as the codec rounds (master weights and gradients live
// on the host, or are copied there first).
wire::EncodedTensor EncodeHost(const at::Tensor& t, wire::DType dtype) {
  const at::Tensor c = t.contiguous();
  wire::EncodedTensor e;
  e.dtype = dtype;
  e.shape.assign(c.sizes().begin(), c.sizes().end());
  e.bytes.resize(size_t(c.numel() * wire::ElementSize(dtype)));
  e.scale_inv = wire::EncodeTensor(c.data_ptr<float>(), c.numel(), dtype, e.bytes.data());
  return e;
}

absl::Status CheckViewShape(const char* field, const wire::TensorView& v, int64_t last_dim,
                            const char* what) {
  if (v.shape.empty() || v.shape.back() != last_dim || v.numel() == 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".shape must be [..., ", last_dim,
                                                   "] (the module's ", what, "), got [",
                                                   absl::StrJoin(v.shape, ", "), "]"));
  }
  return absl::OkStatus();
}

}  // namespace

struct ModuleHost::Module {
  struct Parameter {
    Param id;
    const char* name;      // ParamName(id)
    at::Tensor value;      // fp32 master copy, on the host
    at::Tensor device;     // value on the backend's device, as of device_version (CPU: value)
    GradAccumulator grad;  // fp32 on the device, accumulated by backwards
    OptimizerSlots slots;
  };

  ModuleSpec spec;
  const ModuleKindOps* kind = nullptr;   // FindKind(spec.kind), never null
  std::string tenant;                    // set before the module is shared, then constant
  mutable std::mutex mu;                 // guards everything below
  std::vector<Parameter> params;         // kind->Params(spec) order
  std::optional<DeviceScaling> scaling;  // kind->Roles()' scaling, on the backend's device
  uint64_t version = 1;
  int64_t optimizer_steps = 0;
  int64_t accumulated_backwards = 0;
  WorkspacePtr workspace;  // the cached FP8 weights (latest version built)
  // When a call last named it (ModuleHost::Find), on ModuleHost::NowNs's clock.
  mutable std::atomic<int64_t> last_used_ns{0};
  const Backend* backend = nullptr;
  uint64_t device_version = ~uint64_t(0);  // the version the device copies hold

  // Brings the device copies of the parameters to the current version (a no-op on the CPU,
  // where they are the master copies themselves).
  void SyncDevice() {
    if (device_version == version) return;
    for (Parameter& p : params) p.device = backend->ToDevice(p.value);
    device_version = version;
  }

  // The parameter called `name` at the boundary, or null.
  Parameter* Find(const std::string& name) {
    for (Parameter& p : params) {
      if (name == p.name) return &p;
    }
    return nullptr;
  }
  std::vector<std::string> Names() const {
    std::vector<std::string> names;
    for (const Parameter& p : params) names.emplace_back(p.name);
    return names;
  }
  // The device copies by handle (call SyncDevice first).
  ParamTable DeviceTable() const {
    ParamTable table;
    for (const Parameter& p : params) table[p.id] = p.device;
    return table;
  }
  // One quantizer per role. A weight role's scale is 0, which makes the cast take its scale from
  // the weight's own amax (with the recipe's margin) under either recipe: the weights are cast
  // once per weight version (the workspace), and a delayed scale would be whatever the history
  // held when the version was first used, 1.0 for a new or imported module.
  // Under delayed scaling the other roles' casts read their scale where it lives, on the device.
  std::vector<QuantizerConfig> Quantizers() const {
    const std::vector<RoleDef>& roles = kind->Roles();
    std::vector<QuantizerConfig> q(roles.size());
    for (size_t i = 0; i < roles.size(); ++i) {
      q[i].format = roles[i].format;
      q[i].margin = spec.recipe.margin;
      if (spec.recipe.mode == ScalingMode::kDelayed && !roles[i].weight) {
        q[i].scale_device = scaling->Scale(i);
      }
    }
    return q;
  }
  void ZeroGrad(Parameter& p) {
    p.grad.grad.zero_();
    p.grad.bound = 0;
  }
  // Ends a step of the given roles: records their amaxes and rolls their histories.
  void EndStep(const std::vector<RoleAmax>& amaxes) { scaling->Step(amaxes); }
  // The roles' scaling state by name, read back to the host.
  std::vector<RoleScaling> ReadScaling() const {
    std::vector<RoleScaling> out;
    std::vector<DeviceScaling::HostView> views = scaling->Read();
    for (size_t i = 0; i < views.size(); ++i) {
      out.push_back({kind->Roles()[i].name, views[i].scale, std::move(views[i].history)});
    }
    return out;
  }
};

ModuleHost::ModuleHost() : backend_(MakeCpuBackend()) {}
ModuleHost::ModuleHost(ContextLimits limits, ContextStore::Clock clock, BackendPtr backend)
    : backend_(backend ? std::move(backend) : MakeCpuBackend()),
      clock_(clock),
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
  m->last_used_ns.store(NowNs(), std::memory_order_relaxed);
  modules_.emplace(id, m);
  std::lock_guard<std::mutex> module_lock(m->mu);
  return InfoLocked(id, *m);
}

absl::StatusOr<std::shared_ptr<ModuleHost::Module>> ModuleHost::NewModule(
    const ModuleSpec& spec) const {
  GW_RETURN_IF_ERROR(ValidateModuleSpec(spec));
  auto m = std::make_shared<Module>();
  m->spec = spec;
  m->kind = FindKind(spec.kind);  // valid: ValidateModuleSpec checked it
  m->backend = backend_.get();
  uint64_t stream = 0;  // one random stream per parameter, in order
  for (const ParamDef& d : m->kind->Params(spec)) {
    Module::Parameter p;
    p.id = d.param;
    p.name = ParamName(d.param);
    p.value = at::empty(d.shape, Float32());
    switch (d.init) {
      case ParamDef::Init::kUniform: {
        const float bound = 1.0f / std::sqrt(float(d.fan_in));
        kernels::FillUniform(p.value.data_ptr<float>(), p.value.numel(), spec.seed, stream, -bound,
                             bound);
        break;
      }
      case ParamDef::Init::kOnes:
        p.value.fill_(1.0f);
        break;
      case ParamDef::Init::kZeros:
        p.value.fill_(0.0f);
        break;
    }
    ++stream;
    p.grad.grad = backend_->Zeros(d.shape);
    m->params.push_back(std::move(p));
  }
  std::vector<kernels::Fp8Format> formats;
  for (const RoleDef& r : m->kind->Roles()) formats.push_back(r.format);
  m->scaling.emplace(*backend_, std::move(formats), spec.recipe);
  return m;
}

absl::StatusOr<std::shared_ptr<ModuleHost::Module>> ModuleHost::Find(
    const std::string& module_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = modules_.find(module_id);
  if (it == modules_.end()) {
    return absl::NotFoundError(absl::StrCat("module_id ", module_id, " is not a module"));
  }
  it->second->last_used_ns.store(NowNs(), std::memory_order_relaxed);
  return it->second;
}

int64_t ModuleHost::NowNs() const {
  const auto now = clock_ ? clock_() : std::chrono::steady_clock::now();
  return std::chrono::duration_cast<std::chrono::nanoseconds>(now.time_since_epoch()).count();
}

std::vector<std::string> ModuleHost::ExpireIdleModules(double ttl_s) {
  std::vector<std::string> expired;
  if (!(ttl_s > 0)) return expired;
  const int64_t cutoff = NowNs() - int64_t(ttl_s * 1e9);
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = modules_.begin(); it != modules_.end();) {
      // Under mu_: a call that finds the module from here on renews it first, or finds it gone.
      if (it->second->last_used_ns.load(std::memory_order_relaxed) < cutoff) {
        expired.push_back(it->first);
        it = modules_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (const std::string& id : expired) contexts_.ReleaseModule(id);
  modules_expired_ += int64_t(expired.size());
  return expired;
}

ModuleInfo ModuleHost::InfoLocked(const std::string& id, const Module& m) const {
  return ModuleInfo{
      id, m.tenant, m.spec, m.version, contexts_.live_contexts(id), m.optimizer_steps, m.Names()};
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

absl::StatusOr<WireForwardOutput> ModuleHost::Forward(const std::string& module_id,
                                                      const WireForwardRequest& req) {
  GW_ASSIGN_OR_RETURN(auto m, Find(module_id));
  const wire::TensorView& v = req.input;
  const int64_t k = m->spec.in_features;
  GW_RETURN_IF_ERROR(CheckViewShape("input", v, k, "in_features"));
  const Backend& b = *backend_;
  // FP8 input reaches the device as its codes; a kind that UsesFp8Input takes them as they are.
  const bool use_codes = wire::IsFp8(v.dtype) && m->kind->UsesFp8Input();
  // bf16 input stays bf16 (half the bytes of fp32) for a kind whose casts read it.
  const bool use_bf16 = v.dtype == wire::DType::kBF16 && m->kind->UsesBf16Input();
  Fp8Tensor codes;
  const at::Tensor x = use_bf16 ? b.FromWireBf16(v, v.numel() / k, k)
                                : b.FromWire(v, v.numel() / k, k, use_codes ? &codes : nullptr,
                                             {true, req.training});
  // The outputs are encoded as soon as they are queued, before the forward's checks read back
  // what they need (ForwardOnDevice).
  WireForwardOutput out;
  auto deliver = [&](const at::Tensor& output, const at::Tensor& layernorm_output) {
    std::vector<int64_t> out_shape = v.shape;
    out_shape.back() = m->spec.out_features;
    out.output = b.ToWire(output, req.output_dtype, std::move(out_shape));
    if (layernorm_output.defined()) {
      out.layernorm_output = b.ToWire(layernorm_output, req.output_dtype, v.shape);
      out.has_layernorm_output = true;
    }
  };
  // A bf16 response: the module's output comes back in bf16 (FpropBf16: the bits ToWire would
  // round the fp32 output to).
  GW_ASSIGN_OR_RETURN(
      DeviceForward d,
      ForwardOnDevice(module_id, m, x, v.shape, req.training, use_codes ? &codes : nullptr,
                      req.client, req.context_id,
                      /*bf16_output=*/req.output_dtype == wire::DType::kBF16, deliver));
  out.context_id = std::move(d.context_id);
  out.weight_version = d.weight_version;
  return out;
}

namespace {

// One role's steps across a training batch, on a copy of the module's scaling state (shared by
// the batch's roles, each stepping only its own): stepped once per request as CastRows casts each
// request's rows, and the amaxes it saw. Under delayed scaling each request's cast reads the scale
// the copy holds after the steps before it (on a GPU in stream order: the cast is queued before
// the roll that follows it).
// Under current scaling no cast depends on an earlier one's amax: nothing is stepped during the
// batch (state null), and the amaxes are read after it, when its GEMMs are queued.
class RoleSteps final : public ScaleSteps {
 public:
  RoleSteps(std::shared_ptr<DeviceScaling> state, size_t role)
      : state_(std::move(state)), role_(role) {}
  void Next(QuantizerConfig& one) override {
    one.scale = 0.0f;
    one.scale_device = state_ ? state_->Scale(role_) : at::Tensor();
  }
  void Stepped(const CastScalars& cast) override {
    casts_.push_back(cast);
    if (state_) state_->Step({{role_, cast.amax()}});
  }
  size_t steps() const { return casts_.size(); }
  float amax(size_t j) const { return casts_.at(j).amax(); }

 private:
  std::shared_ptr<DeviceScaling> state_;
  size_t role_;
  std::vector<CastScalars> casts_;
};

// Gives the non-weight roles' quantizers a batch's row groups and, for training, their steps
// (on one copy of `state` under delayed scaling); returns the steps by role (null for weights,
// and for every role without training).
std::vector<std::shared_ptr<RoleSteps>> BatchQuantizers(
    const std::vector<RoleDef>& roles, const DeviceScaling& state, bool delayed, bool training,
    const std::shared_ptr<const std::vector<int64_t>>& groups,
    std::vector<QuantizerConfig>& quantizers) {
  const auto copy = training && delayed ? std::make_shared<DeviceScaling>(state.Copy()) : nullptr;
  std::vector<std::shared_ptr<RoleSteps>> steps(roles.size());
  for (size_t role = 0; role < roles.size(); ++role) {
    if (roles[role].weight) continue;
    quantizers[role].row_groups = groups;
    if (!training) continue;
    steps[role] = std::make_shared<RoleSteps>(copy, role);
    quantizers[role].steps = steps[role];
  }
  return steps;
}

}  // namespace

std::vector<absl::StatusOr<WireForwardOutput>> ModuleHost::ForwardBatch(
    const std::string& module_id, const std::vector<const WireForwardRequest*>& reqs) {
  std::vector<absl::StatusOr<WireForwardOutput>> results(
      reqs.size(), absl::InternalError("ForwardBatch: request not run"));
  auto alone = [&](const std::vector<size_t>& which) {
    for (size_t i : which) results[i] = Forward(module_id, *reqs[i]);
  };
  absl::StatusOr<std::shared_ptr<Module>> found = Find(module_id);
  if (!found.ok()) {
    for (auto& r : results) r = found.status();
    return results;
  }
  const std::shared_ptr<Module> m = *std::move(found);
  const int64_t k = m->spec.in_features;
  // The batch: the well-formed requests (a malformed one gets its own error, which changes
  // nothing). They must all be training or all inference, and reach the kind the same way (FP8
  // codes as they came, bf16 as it came, or fp32 values); a training batch takes values.
  // Otherwise every request runs alone, in order.
  std::vector<size_t> members;
  for (size_t i = 0; i < reqs.size(); ++i) {
    if (absl::Status s = CheckViewShape("input", reqs[i]->input, k, "in_features"); !s.ok()) {
      results[i] = s;
    } else {
      members.push_back(i);
    }
  }
  auto codes_of = [&](size_t i) {
    return wire::IsFp8(reqs[i]->input.dtype) && m->kind->UsesFp8Input();
  };
  auto bf16_of = [&](size_t i) {
    return reqs[i]->input.dtype == wire::DType::kBF16 && m->kind->UsesBf16Input();
  };
  const bool training = !members.empty() && reqs[members[0]]->training;
  const bool codes = !members.empty() && codes_of(members[0]);
  const bool bf16 = !members.empty() && bf16_of(members[0]);
  bool uniform = !(training && codes);
  for (size_t i : members) {
    uniform =
        uniform && reqs[i]->training == training && codes_of(i) == codes && bf16_of(i) == bf16;
  }
  if (members.size() <= 1 || !uniform) {
    alone(members);
    return results;
  }
  const Backend& b = *backend_;
  const size_t n = members.size();
  auto groups = std::make_shared<std::vector<int64_t>>();
  std::vector<at::Tensor> inputs;
  std::vector<Fp8Tensor> parts;
  for (size_t i : members) {
    const wire::TensorView& v = reqs[i]->input;
    groups->push_back(v.numel() / k);
    Fp8Tensor part;
    inputs.push_back(b.ToDevice(
        bf16 ? b.FromWireBf16(v, groups->back(), k)
             : b.FromWire(v, groups->back(), k, codes ? &part : nullptr, {true, false})));
    if (codes) parts.push_back(std::move(part));
  }
  const at::Tensor x = at::cat(inputs, 0);
  inputs.clear();
  const Fp8Tensor input_codes = StackRows(std::move(parts));
  compute_calls_.fetch_add(int64_t(n), std::memory_order_relaxed);
  KindForwardResult r;
  std::vector<WireForwardOutput> encoded(n);
  std::vector<std::string> context_ids(n);
  std::vector<absl::Status> put(n);
  uint64_t version = 0;
  bool batched = false;
  {
    std::lock_guard<std::mutex> lock(m->mu);
    m->SyncDevice();
    KindForwardArgs args;
    args.backend = &b;
    args.spec = &m->spec;
    args.input = x;
    args.input_fp8 = codes ? &input_codes : nullptr;
    // bf16 from the GEMM when every request's response is bf16 (else each narrows its own).
    args.bf16_output = true;
    for (size_t i : members) {
      args.bf16_output = args.bf16_output && reqs[i]->output_dtype == wire::DType::kBF16;
    }
    args.params = m->DeviceTable();
    args.quantizers = m->Quantizers();
    const std::vector<RoleDef>& roles = m->kind->Roles();
    const std::vector<std::shared_ptr<RoleSteps>> steps =
        BatchQuantizers(roles, *m->scaling, m->spec.recipe.mode == ScalingMode::kDelayed, training,
                        groups, args.quantizers);
    args.weight_version = m->version;
    args.workspace = m->workspace;
    args.training = training;
    // A refusal, a non-finite value, or saved state over the budget: the requests run alone, so
    // each gets the answer Forward gives it (and the one that caused it its message).
    absl::StatusOr<KindForwardResult> done = m->kind->Forward(args);
    batched = done.ok();
    if (batched) r = *std::move(done);
    // Each request's outputs are encoded as soon as they are queued, before anything below reads
    // a value back: on a GPU the first copy back is then the batch's only wait besides the other
    // results' copies, and brings every amax read below with it. Nothing has changed yet: after
    // a failure here each request runs alone and meets it (or not) there; a batch that falls
    // back to its requests one by one drops these bytes.
    if (batched) {
      try {
        int64_t row = 0;
        for (size_t j = 0; j < n; ++j) {
          const WireForwardRequest& req = *reqs[members[j]];
          const int64_t rows = (*groups)[j];
          WireForwardOutput& out = encoded[j];
          std::vector<int64_t> out_shape = req.input.shape;
          out_shape.back() = m->spec.out_features;
          out.output =
              b.ToWire(r.output.narrow(0, row, rows), req.output_dtype, std::move(out_shape));
          if (r.layernorm_output.defined()) {
            out.layernorm_output = b.ToWire(r.layernorm_output.narrow(0, row, rows),
                                            req.output_dtype, req.input.shape);
            out.has_layernorm_output = true;
          }
          row += rows;
        }
      } catch (const std::exception&) {
        batched = false;
      }
    }
    // Per request and role, the amax its step records: a cast's own, a weight's for every one.
    std::vector<std::vector<RoleAmax>> step_amaxes(n);
    for (const auto& [role, cast] : r.amaxes) {
      const float amax = cast.amax();
      if (!roles.at(role).weight && !std::isfinite(amax)) batched = false;
      const RoleSteps* st = steps.at(role).get();
      // Not one cast per request: the steps would not be the sequence's.
      if (st && st->steps() != n) batched = false;
      if (!batched || !training) continue;
      for (size_t j = 0; j < n; ++j) step_amaxes[j].emplace_back(role, st ? st->amax(j) : amax);
    }
    if (batched && training) {
      batched = r.saved_groups.size() == n;
      for (size_t j = 0; j < n && batched; ++j) {
        batched = contexts_.Fits(r.saved_groups[j]->bytes());
      }
    }
    if (batched) {
      if (training) {
        for (size_t j = 0; j < n; ++j) m->EndStep(step_amaxes[j]);
      }
      if (r.workspace_built) workspace_builds_.fetch_add(1);
      workspace_hits_.fetch_add(int64_t(n) - (r.workspace_built ? 1 : 0));
      m->workspace = r.workspace;
      version = m->version;
      try {
        for (size_t j = 0; training && j < n; ++j) {
          r.saved_groups[j]->input_shape = reqs[members[j]]->input.shape;
          absl::StatusOr<std::string> id =
              contexts_.Put(module_id, m->version, std::move(r.saved_groups[j]), m->tenant,
                            reqs[members[j]]->client, reqs[members[j]]->context_id);
          if (id.ok()) {
            context_ids[j] = *std::move(id);
          } else {
            put[j] = id.status();
          }
        }
      } catch (...) {
        for (const std::string& id : context_ids) {
          if (!id.empty()) (void)contexts_.Release(id);
        }
        throw;
      }
    }
  }
  if (!batched) {
    compute_calls_.fetch_sub(int64_t(n), std::memory_order_relaxed);
    alone(members);
    return results;
  }
  batched_forwards_.fetch_add(int64_t(n), std::memory_order_relaxed);
  for (size_t j = 0; j < n; ++j) {
    if (!put[j].ok()) {
      results[members[j]] = put[j];
      continue;
    }
    WireForwardOutput& out = encoded[j];
    out.context_id = std::move(context_ids[j]);
    out.weight_version = version;
    out.batch_requests = int32_t(n);
    results[members[j]] = std::move(out);
  }
  return results;
}

absl::StatusOr<ModuleHost::DeviceForward> ModuleHost::ForwardOnDevice(
    const std::string& module_id, const std::shared_ptr<Module>& m, const at::Tensor& input,
    const std::vector<int64_t>& input_shape, bool training, const Fp8Tensor* fp8,
    const std::string& client, const std::string& context_id, bool bf16_output,
    const DeliverForward& deliver) {
  const Backend& b = *backend_;
  compute_calls_.fetch_add(1, std::memory_order_relaxed);
  const at::Tensor x = b.ToDevice(input);
  std::lock_guard<std::mutex> lock(m->mu);
  const ModuleSpec& spec = m->spec;
  m->SyncDevice();
  KindForwardArgs args;
  args.backend = &b;
  args.spec = &spec;
  args.input = x;
  args.input_fp8 = fp8;
  args.params = m->DeviceTable();
  args.quantizers = m->Quantizers();
  args.weight_version = m->version;
  args.workspace = m->workspace;
  args.training = training;
  args.bf16_output = bf16_output;
  GW_ASSIGN_OR_RETURN(KindForwardResult r, m->kind->Forward(args));
  // The outputs first: their copy back brings the amaxes read below with it (no state has
  // changed yet, so an exception here leaves everything as it was).
  deliver(r.output, r.layernorm_output);
  // A NaN or inf would stick in the amax history and, through the backward, in the shared
  // gradient buffers: it is refused before it touches any state. The casts measured every
  // activation's amax on the way (a cast's amax is NaN or inf exactly when its input holds one),
  // so the input is only scanned, for the message, when one of them is not finite.
  const std::vector<RoleDef>& roles = m->kind->Roles();
  for (const auto& [role, cast] : r.amaxes) {
    if (roles.at(role).weight || std::isfinite(cast.amax())) continue;
    GW_RETURN_IF_ERROR(CheckFinite("input", x));
    return absl::OutOfRangeError(
        absl::StrCat("the ", roles[role].name,
                     " of this forward came out non-finite (fp32 overflow) from a "
                     "finite input; nothing was changed: scale the input down"));
  }
  // Inference leaves the scaling state alone: evaluation traffic must not move training scales.
  if (training) {
    GW_RETURN_IF_ERROR(contexts_.CheckFits(r.saved->bytes()));
    m->EndStep(ReadAmaxes(r.amaxes));
  }
  (r.workspace_built ? workspace_builds_ : workspace_hits_).fetch_add(1);
  m->workspace = std::move(r.workspace);
  DeviceForward out;
  out.weight_version = m->version;
  if (training) {
    r.saved->input_shape = input_shape;
    GW_ASSIGN_OR_RETURN(out.context_id, contexts_.Put(module_id, m->version, std::move(r.saved),
                                                      m->tenant, client, context_id));
  }
  return out;
}

absl::StatusOr<std::optional<wire::EncodedTensor>> ModuleHost::Backward(
    const std::string& context_id, const WireBackwardRequest& req) {
  const Backend& b = *backend_;
  // The gradients cross to the device in their wire dtype; the shapes are checked against the
  // context's in BackwardOnDevice.
  auto decode = [&](const wire::TensorView& v) {
    const int64_t cols = v.shape.empty() ? 1 : std::max<int64_t>(1, v.shape.back());
    return b.FromWire(v, v.numel() / cols, cols, nullptr, {}).reshape(v.shape);
  };
  if (req.grad_output.shape.empty() || req.grad_output.numel() == 0) {
    return absl::InvalidArgumentError("grad_output is required");
  }
  // A bf16 grad_output stays bf16 for a kind whose backward only casts it and sums its columns
  // (UsesBf16GradOutput; BackwardOnDevice widens it for any other).
  const wire::TensorView& g = req.grad_output;
  const int64_t g_cols = std::max<int64_t>(1, g.shape.back());
  const at::Tensor grad_output =
      g.dtype == wire::DType::kBF16 ? b.FromWireBf16(g, g.numel() / g_cols, g_cols).reshape(g.shape)
                                    : decode(g);
  at::Tensor grad_layernorm_output;
  if (req.grad_layernorm_output.data != nullptr) {
    grad_layernorm_output = decode(req.grad_layernorm_output);
  }
  // grad_input is encoded as soon as it is queued, before the backward's checks read back what
  // they need (BackwardOnDevice).
  std::optional<wire::EncodedTensor> out;
  GW_RETURN_IF_ERROR(BackwardOnDevice(
      context_id, grad_output, grad_layernorm_output, req.retain, req.skip_grad_input,
      [&](const at::Tensor& grad_input, const std::vector<int64_t>& input_shape) {
        if (grad_input.defined()) out = b.ToWire(grad_input, req.grad_input_dtype, input_shape);
      }));
  return out;
}

absl::Status ModuleHost::BackwardOnDevice(const std::string& context_id,
                                          const at::Tensor& grad_output,
                                          const at::Tensor& grad_layernorm_output, bool retain,
                                          bool skip_grad_input, const DeliverBackward& deliver) {
  compute_calls_.fetch_add(1, std::memory_order_relaxed);
  GW_ASSIGN_OR_RETURN(ContextStore::Lease lease, contexts_.Acquire(context_id));
  // Until Finish(consumed=true), every exit leaves the context as it was, an exception's too
  // (the scan of a refused request and the grad_input check run on the device and may throw).
  bool finished = false;
  auto fail = [&](absl::Status status) {
    lease.saved.reset();
    finished = true;
    contexts_.Finish(context_id, /*consumed=*/false, retain);
    return status;
  };
  try {
    auto found = Find(lease.module_id);
    if (!found.ok()) return fail(found.status());
    std::shared_ptr<Module> m = *std::move(found);
    const std::vector<int64_t> input_shape = lease.saved->input_shape;
    std::vector<int64_t> expected = input_shape;
    expected.back() = m->spec.out_features;
    if (auto s = CheckExactShape("grad_output", grad_output, expected, /*bf16_ok=*/true); !s.ok()) {
      return fail(s);
    }
    if (grad_layernorm_output.defined()) {
      if (!m->spec.return_layernorm_output) {
        return fail(absl::InvalidArgumentError(
            "grad_layernorm_output is only for modules created with return_layernorm_output"));
      }
      if (auto s = CheckExactShape("grad_layernorm_output", grad_layernorm_output, input_shape);
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
      // The kind hands its parameter gradients to `grads`, which adds them to the accumulators only
      // after everything below has checked out: a refused backward changes nothing.
      DeferredGradients grads(b);
      KindBackwardArgs args;
      absl::StatusOr<KindBackwardResult> r;
      try {
        m->SyncDevice();
        args.backend = &b;
        args.spec = &m->spec;
        args.grad_output = b.ToDevice(As2D(grad_output));
        if (args.grad_output.scalar_type() != at::kFloat && !m->kind->UsesBf16GradOutput()) {
          args.grad_output = args.grad_output.to(at::kFloat);  // exact
        }
        if (grad_layernorm_output.defined()) {
          args.grad_layernorm_output = b.ToDevice(As2D(grad_layernorm_output));
        }
        args.saved = lease.saved.get();
        args.grads = &grads;
        args.quantizers = m->Quantizers();
        args.compute_grad_input = !skip_grad_input;
        r = m->kind->Backward(args);
      } catch (const std::exception& e) {
        // A device or library error: nothing was accumulated (the gradients are still only
        // collected) and the context stays as it was.
        return fail(absl::InternalError(absl::StrCat("backward failed: ", e.what())));
      }
      if (!r.ok()) return fail(r.status());
      grad_input = std::move(r->grad_input);
      // grad_input's own check, queued before it leaves when the kind has no bound for it; then
      // it leaves, and its copy back brings every value read below with it.
      const bool bounded = static_cast<bool>(r->grad_input_bound);
      const CastScalars grad_input_amax = grad_input.defined() && !bounded
                                              ? b.AbsMaxLater(grad_input)
                                              : CastScalars(1.0f, 1.0f, 0.0f);
      try {
        deliver(grad_input, input_shape);
      } catch (const std::exception& e) {
        return fail(absl::InternalError(absl::StrCat("backward failed: ", e.what())));
      }
      // A non-finite value anywhere comes from the request (a NaN or inf in a gradient sent) or
      // from fp32 overflow of finite values; the scan that tells which runs only then.
      auto refuse = [&](const std::string& what) {
        if (auto s = CheckFinite("grad_output", args.grad_output); !s.ok()) return fail(s);
        if (args.grad_layernorm_output.defined()) {
          if (auto s = CheckFinite("grad_layernorm_output", args.grad_layernorm_output); !s.ok()) {
            return fail(s);
          }
        }
        return fail(absl::OutOfRangeError(
            absl::StrCat("the ", what,
                         " of this backward came out non-finite (fp32 overflow); nothing was "
                         "accumulated, the scaling state is unchanged and context_id ",
                         context_id, " is kept: scale grad_output down and retry, or release it")));
      };
      // The casts' amaxes: the gradients as they were cast (grad_output first).
      for (const auto& [role, cast] : r->amaxes) {
        if (!std::isfinite(cast.amax())) return refuse(m->kind->Roles().at(role).name);
      }
      if (!std::isfinite(grad_input_amax.amax())) return refuse("grad_input");
      // A bound that does not prove it finite (rare: values near fp32's range) is measured.
      if (grad_input.defined() && bounded && !ProvablyFinite(r->grad_input_bound()) &&
          !std::isfinite(b.AbsMax(grad_input))) {
        return refuse("grad_input");
      }
      std::optional<Param> overflowed;
      try {
        overflowed = grads.Commit([&](Param id) -> GradAccumulator* {
          for (Module::Parameter& p : m->params) {
            if (p.id == id) return &p.grad;
          }
          throw std::logic_error(absl::StrCat("the kind gave a gradient of ", ParamName(id),
                                              ", which this module does not have"));
        });
        // The step's roll runs on the device and can fail as the sums can: with them.
        if (!overflowed.has_value()) m->EndStep(ReadAmaxes(r->amaxes));
      } catch (const std::exception& e) {
        // Only a device or library failure gets here (a refused sum returns, changing nothing);
        // the accumulators may then hold part of this backward, so they are zeroed.
        for (Module::Parameter& p : m->params) m->ZeroGrad(p);
        m->accumulated_backwards = 0;
        return fail(absl::InternalError(absl::StrCat(
            "backward failed while accumulating gradients (they were reset): ", e.what())));
      }
      if (overflowed.has_value()) {
        return refuse(absl::StrCat("accumulated ", ParamName(*overflowed), " gradient"));
      }
      ++m->accumulated_backwards;
    }
    // Free the saved tensors now, before the caller sends the reply.
    lease.saved.reset();
    finished = true;
    contexts_.Finish(context_id, /*consumed=*/true, retain);
    return absl::OkStatus();
  } catch (const std::exception& e) {
    if (finished) throw;
    return fail(absl::InternalError(absl::StrCat("backward failed: ", e.what())));
  }
}

std::vector<absl::StatusOr<std::optional<wire::EncodedTensor>>> ModuleHost::BackwardBatch(
    const std::vector<std::string>& context_ids,
    const std::vector<const WireBackwardRequest*>& reqs, BatchRan* ran) {
  using Result = absl::StatusOr<std::optional<wire::EncodedTensor>>;
  if (ran != nullptr) *ran = BatchRan{};
  if (context_ids.size() != reqs.size()) {
    return std::vector<Result>(
        std::max(context_ids.size(), reqs.size()),
        absl::InternalError("BackwardBatch: as many context ids as requests are needed"));
  }
  const size_t count = reqs.size();
  std::vector<Result> results(count, absl::InternalError("BackwardBatch: request not run"));
  // Requests that run alone through Backward once the batch is done, in order: those that change
  // nothing wherever they run (a failed check), and every request from the first one that could
  // change something but cannot join (so the sequence's order holds).
  std::vector<size_t> alone;
  auto run_alone = [&] {
    std::sort(alone.begin(), alone.end());
    for (size_t i : alone) {
      try {
        results[i] = Backward(context_ids[i], *reqs[i]);
      } catch (const std::exception& e) {
        results[i] = absl::InternalError(absl::StrCat("Backward failed: ", e.what()));
      }
    }
  };
  const Backend& b = *backend_;
  struct Member {
    size_t index = 0;
    ContextStore::Lease lease;
    at::Tensor grad_output, grad_layernorm_output;  // on the device, 2-D
    bool done = false;      // its context was finished (consumed, or given back and answered)
    bool consumed = false;  // ran in the batch
    std::optional<wire::EncodedTensor> grad_input;  // its rows of the batch's, encoded
  };
  std::vector<Member> members;
  std::shared_ptr<Module> m;
  bool skip = false, with_ln = false;  // the batch's, from its first member
  // Hands a leased context back untouched (as Backward's refusals do).
  auto give_back = [&](Member& one) {
    if (one.done) return;
    one.done = true;
    one.lease.saved.reset();
    contexts_.Finish(context_ids[one.index], /*consumed=*/false, reqs[one.index]->retain);
  };
  // Every lease not consumed goes back, whatever happens below.
  auto give_back_all = [&] {
    for (Member& one : members) {
      if (!one.consumed) {
        give_back(one);
      } else if (!one.done) {
        one.done = true;
        one.lease.saved.reset();
        contexts_.Finish(context_ids[one.index], /*consumed=*/true, reqs[one.index]->retain);
      }
    }
  };
  int64_t counted = 0;   // compute calls counted for the batch
  size_t committed = 0;  // members[0, committed) ran in the batch
  try {
    for (size_t i = 0; i < count; ++i) {
      const WireBackwardRequest& req = *reqs[i];
      const bool has_ln = req.grad_layernorm_output.data != nullptr;
      if (req.grad_output.shape.empty() || req.grad_output.numel() == 0) {
        alone.push_back(i);  // malformed: refused, nothing changes
        continue;
      }
      if (!members.empty() && (req.skip_grad_input != skip || has_ln != with_ln)) {
        for (size_t rest = i; rest < count; ++rest) alone.push_back(rest);  // the batch ends
        break;
      }
      absl::StatusOr<ContextStore::Lease> lease = contexts_.Acquire(context_ids[i]);
      if (!lease.ok()) {
        alone.push_back(i);
        // Unknown or gone for good: refused wherever it runs. Live but not available now (its
        // backward running, no room to restore it): the batch ends before it.
        if (contexts_.Locate(context_ids[i]) == ContextStore::Residence::kNone) continue;
        for (size_t rest = i + 1; rest < count; ++rest) alone.push_back(rest);
        break;
      }
      Member one;
      one.index = i;
      one.lease = *std::move(lease);
      std::shared_ptr<Module> mine = m;
      if (!mine) {
        absl::StatusOr<std::shared_ptr<Module>> found = Find(one.lease.module_id);
        if (found.ok()) mine = *std::move(found);
      }
      if (!mine || (!members.empty() && one.lease.module_id != members[0].lease.module_id)) {
        // Another module's context (or a module gone): alone, and the batch ends before it.
        members.push_back(std::move(one));
        give_back(members.back());
        members.pop_back();
        for (size_t rest = i; rest < count; ++rest) alone.push_back(rest);
        break;
      }
      const std::vector<int64_t>& input_shape = one.lease.saved->input_shape;
      std::vector<int64_t> expected = input_shape;
      expected.back() = mine->spec.out_features;
      const bool fits = req.grad_output.shape == expected &&
                        (!has_ln || (mine->spec.return_layernorm_output &&
                                     req.grad_layernorm_output.shape == input_shape));
      members.push_back(std::move(one));
      Member& added = members.back();
      if (!fits) {  // refused wherever it runs: nothing changes
        give_back(added);
        members.pop_back();
        alone.push_back(i);
        continue;
      }
      auto decode = [&](const wire::TensorView& v) {
        const int64_t cols = std::max<int64_t>(1, v.shape.back());
        return b.ToDevice(
            As2D(b.FromWire(v, v.numel() / cols, cols, nullptr, {}).reshape(v.shape)));
      };
      added.grad_output = decode(req.grad_output);
      if (has_ln) added.grad_layernorm_output = decode(req.grad_layernorm_output);
      if (members.size() == 1) {
        m = mine;
        skip = req.skip_grad_input;
        with_ln = has_ln;
      }
    }
    if (members.size() >= 2) {
      counted = int64_t(members.size());
      compute_calls_.fetch_add(counted, std::memory_order_relaxed);
      std::lock_guard<std::mutex> lock(m->mu);
      // Contexts past the module's staleness bound get Backward's refusal, alone (it changes
      // nothing).
      for (size_t j = 0; j < members.size();) {
        if (m->spec.max_staleness >= 0 &&
            m->version - members[j].lease.weight_version > uint64_t(m->spec.max_staleness)) {
          give_back(members[j]);
          alone.push_back(members[j].index);
          members.erase(members.begin() + std::ptrdiff_t(j));
        } else {
          ++j;
        }
      }
      const size_t n = members.size();
      if (n >= 2)
        committed = [&]() -> size_t {
          // The batch: one kind call over the members' stacked rows. Anything that fails before a
          // gradient is committed changes nothing, and every member runs alone.
          auto groups = std::make_shared<std::vector<int64_t>>();
          DeferredGradients grads(b);
          const std::vector<RoleDef>& roles = m->kind->Roles();
          std::vector<std::shared_ptr<RoleSteps>> steps(roles.size());
          absl::StatusOr<KindBackwardResult> r = absl::InternalError("not run");
          try {
            std::vector<const SavedTensors*> parts;
            std::vector<at::Tensor> grads_out, grads_ln;
            for (const Member& one : members) {
              parts.push_back(one.lease.saved.get());
              groups->push_back(one.grad_output.size(0));
              grads_out.push_back(one.grad_output);
              if (with_ln) grads_ln.push_back(one.grad_layernorm_output);
            }
            const std::shared_ptr<SavedTensors> stacked = m->kind->StackSaved(parts);
            if (!stacked) return 0;
            m->SyncDevice();
            KindBackwardArgs args;
            args.backend = &b;
            args.spec = &m->spec;
            args.grad_output = at::cat(grads_out, 0);
            if (with_ln) args.grad_layernorm_output = at::cat(grads_ln, 0);
            args.saved = stacked.get();
            args.grads = &grads;
            args.quantizers = m->Quantizers();
            args.compute_grad_input = !skip;
            args.row_groups = groups;
            steps =
                BatchQuantizers(roles, *m->scaling, m->spec.recipe.mode == ScalingMode::kDelayed,
                                /*training=*/true, groups, args.quantizers);
            r = m->kind->Backward(args);
          } catch (const std::exception&) {
            return 0;  // each request meets the failure alone
          }
          if (!r.ok()) return 0;
          // Each request's step: the amax of each gradient cast of its rows, in the kind's order.
          for (const auto& [role, amax] : r->amaxes) {
            const RoleSteps* st = steps.at(role).get();
            if (st == nullptr || st->steps() != n) return 0;
          }
          // Each request's grad_input check where no bound covers it, queued now for them all:
          // the first read below waits once for every one of them.
          std::vector<CastScalars> grad_input_amax(n);
          if (r->grad_input.defined() && !r->grad_input_bound) {
            try {
              int64_t at = 0;
              for (size_t j = 0; j < n; ++j) {
                grad_input_amax[j] = b.AbsMaxLater(r->grad_input.narrow(0, at, (*groups)[j]));
                at += (*groups)[j];
              }
            } catch (const std::exception&) {
              return 0;  // each request meets the failure alone
            }
          }
          // Each request's grad_input is encoded now, before anything below reads a value back:
          // on a GPU the first copy back is then the batch's only wait besides the other
          // results' copies, and brings every check and amax read below with it. Nothing has
          // changed yet: a failure here sends every request alone; the members that do not
          // commit below drop their bytes.
          std::vector<std::optional<wire::EncodedTensor>> encoded(n);
          if (r->grad_input.defined()) {
            try {
              int64_t at = 0;
              for (size_t j = 0; j < n; ++j) {
                encoded[j] = b.ToWire(r->grad_input.narrow(0, at, (*groups)[j]),
                                      reqs[members[j].index]->grad_input_dtype,
                                      members[j].lease.saved->input_shape);
                at += (*groups)[j];
              }
            } catch (const std::exception&) {
              return 0;  // each request meets the failure alone
            }
          }
          int64_t row = 0;
          for (size_t j = 0; j < n; ++j) {
            const int64_t rows = (*groups)[j];
            std::vector<RoleAmax> step;
            bool finite = true;
            for (const auto& [role, amax] : r->amaxes) {
              const float a = steps[role]->amax(j);
              finite = finite && std::isfinite(a);
              step.emplace_back(role, a);
            }
            at::Tensor mine;
            try {
              if (finite && r->grad_input.defined()) {
                mine = r->grad_input.narrow(0, row, rows);
                finite = r->grad_input_bound ? ProvablyFinite(r->grad_input_bound()) ||
                                                   std::isfinite(b.AbsMax(mine))
                                             : std::isfinite(grad_input_amax[j].amax());
              }
            } catch (const std::exception&) {
              finite = false;
            }
            // A non-finite value: this request and those after it run alone (its refusal is
            // Backward's; theirs depend on its step not being taken).
            if (!finite) return j;
            std::optional<Param> overflowed;
            try {
              overflowed = grads.Commit(
                  [&](Param id) -> GradAccumulator* {
                    for (Module::Parameter& p : m->params) {
                      if (p.id == id) return &p.grad;
                    }
                    throw std::logic_error(absl::StrCat("the kind gave a gradient of ",
                                                        ParamName(id),
                                                        ", which this module does not have"));
                  },
                  j);
              if (!overflowed.has_value()) m->EndStep(step);  // on the device: as the sums
            } catch (const std::exception& e) {
              // As Backward: the accumulators may hold part of this request's sums, so they are
              // zeroed; it fails with its context kept, and the rest run alone.
              for (Module::Parameter& p : m->params) m->ZeroGrad(p);
              m->accumulated_backwards = 0;
              results[members[j].index] = absl::InternalError(absl::StrCat(
                  "backward failed while accumulating gradients (they were reset): ", e.what()));
              give_back(members[j]);
              return j;
            }
            if (overflowed.has_value()) return j;
            ++m->accumulated_backwards;
            members[j].consumed = true;
            members[j].grad_input = std::move(encoded[j]);
            row += rows;
          }
          return n;
        }();
    }
  } catch (...) {
    give_back_all();
    throw;
  }
  // The members not run in the batch go back untouched and run alone after it, in order.
  for (size_t j = committed; j < members.size(); ++j) {
    if (!members[j].done) {
      give_back(members[j]);
      alone.push_back(members[j].index);
    }
  }
  if (committed > 0) {
    batched_backwards_.fetch_add(int64_t(committed), std::memory_order_relaxed);
    if (ran != nullptr) {
      ran->requests = int64_t(committed);
      for (size_t j = 0; j < committed; ++j) ran->rows += members[j].grad_output.size(0);
    }
  }
  // Those that run alone count themselves there.
  compute_calls_.fetch_sub(counted - int64_t(committed), std::memory_order_relaxed);
  // Every consumed context is finished (its saved tensors freed); its grad_input was encoded
  // before the batch's checks.
  for (size_t j = 0; j < committed; ++j) {
    Member& one = members[j];
    one.lease.saved.reset();
    one.done = true;
    contexts_.Finish(context_ids[one.index], /*consumed=*/true, reqs[one.index]->retain);
    results[one.index] = Result(std::move(one.grad_input));
  }
  run_alone();
  return results;
}

absl::Status ModuleHost::ReleaseContext(const std::string& context_id,
                                        ContextStore::ReleaseReason reason) {
  return contexts_.Release(context_id, reason);
}

absl::StatusOr<uint64_t> ModuleHost::ApplyGradients(const std::string& module_id,
                                                    float learning_rate) {
  if (learning_rate != 0.0f)
    GW_RETURN_IF_ERROR(CheckFinitePositive("learning_rate", learning_rate));
  GW_ASSIGN_OR_RETURN(auto m, Find(module_id));
  std::lock_guard<std::mutex> lock(m->mu);
  const float lr = learning_rate > 0.0f ? learning_rate : m->spec.optimizer.learning_rate();
  // The step runs on copies, which replace the parameters and optimizer state only when every
  // value came out finite: a step that would overflow changes nothing.
  const int64_t step = m->optimizer_steps + 1;
  std::vector<at::Tensor> values;
  std::vector<OptimizerSlots> slots;
  for (Module::Parameter& p : m->params) {
    values.push_back(p.value.clone());
    slots.push_back(p.slots.Clone());
    OptimizerStep(m->spec.optimizer, lr, step, values.back(), backend_->ToHost(p.grad.grad),
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
    m->ZeroGrad(m->params[i]);
  }
  m->optimizer_steps = step;
  m->accumulated_backwards = 0;
  return ++m->version;
}

absl::StatusOr<EncodedParameters> ModuleHost::GetGradients(const std::string& module_id, bool zero,
                                                           wire::DType dtype) {
  GW_ASSIGN_OR_RETURN(auto m, Find(module_id));
  NamedTensors copies;
  EncodedParameters out;
  {
    std::lock_guard<std::mutex> lock(m->mu);
    for (Module::Parameter& p : m->params) {
      copies.emplace_back(p.name, p.grad.grad.to(at::kCPU, at::kFloat, false, /*copy=*/true));
      if (zero) m->ZeroGrad(p);
    }
    out.weight_version = m->version;
    out.accumulated_backwards = m->accumulated_backwards;
    if (zero) m->accumulated_backwards = 0;
  }
  for (const auto& [name, t] : copies) out.tensors.emplace_back(name, EncodeHost(t, dtype));
  return out;
}

absl::StatusOr<EncodedParameters> ModuleHost::GetWeights(const std::string& module_id,
                                                         wire::DType dtype) const {
  GW_ASSIGN_OR_RETURN(auto m, Find(module_id));
  NamedTensors copies;
  EncodedParameters out;
  {
    std::lock_guard<std::mutex> lock(m->mu);
    for (const Module::Parameter& p : m->params) copies.emplace_back(p.name, p.value.clone());
    out.weight_version = m->version;
  }
  for (const auto& [name, t] : copies) out.tensors.emplace_back(name, EncodeHost(t, dtype));
  return out;
}

absl::StatusOr<uint64_t> ModuleHost::SetWeights(const std::string& module_id,
                                                const NamedViews& params) {
  GW_ASSIGN_OR_RETURN(auto m, Find(module_id));
  if (params.empty()) return absl::InvalidArgumentError("parameters is empty: nothing to set");
  const std::vector<std::string> names = m->Names();
  std::vector<std::pair<size_t, at::Tensor>> checked;
  std::set<std::string> seen;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& [name, v] = params[i];
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
    const at::IntArrayRef expected = m->params[index].value.sizes();
    if (at::IntArrayRef(v.shape) != expected) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".shape must be ", ShapeString(expected), ", got ", ShapeString(v.shape)));
    }
    at::Tensor t = at::empty(v.shape, Float32());
    wire::DecodeElements(v.dtype, v.data, v.numel(), v.scale_inv, t.data_ptr<float>());
    GW_RETURN_IF_ERROR(CheckFinite(field, t));
    checked.emplace_back(index, std::move(t));
  }
  std::lock_guard<std::mutex> lock(m->mu);
  for (const auto& [index, t] : checked) m->params[index].value.copy_(t);
  return ++m->version;
}

absl::StatusOr<std::vector<RoleScaling>> ModuleHost::Scaling(const std::string& module_id) const {
  GW_ASSIGN_OR_RETURN(auto m, Find(module_id));
  std::lock_guard<std::mutex> lock(m->mu);
  return m->ReadScaling();
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
  for (const Module::Parameter& p : m->params) {
    state.parameters.emplace_back(p.name, p.value.clone());
    if (p.slots.first.defined()) {
      state.optimizer_slots.emplace_back(std::string(p.name) + ".first", p.slots.first.clone());
    }
    if (p.slots.second.defined()) {
      state.optimizer_slots.emplace_back(std::string(p.name) + ".second", p.slots.second.clone());
    }
  }
  state.scaling = m->ReadScaling();
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
  for (Module::Parameter& p : m->params) {
    const at::Tensor* value = find(state.parameters, p.name);
    if (!value) {
      return absl::InvalidArgumentError(absl::StrCat("parameter ", p.name, " is missing"));
    }
    GW_RETURN_IF_ERROR(CheckExactShape(p.name, *value, p.value.sizes()));
    p.value.copy_(*value);
    for (auto [suffix, slot] :
         {std::pair{".first", &p.slots.first}, {".second", &p.slots.second}}) {
      if (const at::Tensor* t = find(state.optimizer_slots, std::string(p.name) + suffix)) {
        GW_RETURN_IF_ERROR(
            CheckExactShape((std::string(p.name) + suffix).c_str(), *t, p.value.sizes()));
        *slot = t->clone();
      }
    }
  }
  for (const RoleScaling& r : state.scaling) {
    if (!std::isfinite(r.scale) || !(r.scale > 0.0f)) {
      return absl::InvalidArgumentError(absl::StrCat("the scaling state of role ", r.role,
                                                     " has scale ", r.scale,
                                                     ": it must be finite and > 0"));
    }
    for (size_t i = 0; i < m->scaling->roles(); ++i) {
      if (m->kind->Roles()[i].name == r.role) m->scaling->Set(i, r.history, r.scale);
    }
  }
  m->version = state.weight_version;
  m->optimizer_steps = state.optimizer_steps;
  m->last_used_ns.store(NowNs(), std::memory_order_relaxed);
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
  s.compute_calls = compute_calls_.load();
  s.modules_expired = modules_expired_.load();
  s.batched_forwards = batched_forwards_.load();
  s.batched_backwards = batched_backwards_.load();
  return s;
}

}  // namespace gradwire::core
