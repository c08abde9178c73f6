#include "server/rpc/service.h"

#include <ATen/ATen.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <limits>
#include <map>
#include <new>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gradwire/wire/chunking.h"
#include "gradwire/wire/tensor.h"
#include "server/core/heap_trim.h"
#include "server/core/status_macros.h"
#include "server/rpc/boundary.h"
#include "server/rpc/status_map.h"

namespace gradwire::rpc {
namespace {

// The peer's address without its port: "ipv4:10.0.0.7:51234" -> "ipv4:10.0.0.7",
// "ipv6:[::1]:5000" -> "ipv6:[::1]"; anything else (unix sockets) as it is.
std::string PeerHost(const std::string& peer) {
  if (peer.rfind("ipv4:", 0) != 0 && peer.rfind("ipv6:", 0) != 0) return peer;
  const auto colon = peer.rfind(':');
  return colon <= 4 ? peer : peer.substr(0, colon);
}

// Elements of a tensor as its shape declares them (saturating; 0 without a shape), known before
// anything is decoded.
// Adds the seconds of its scope to `total`: shared-memory copies are transport, like protobuf
// parsing, and stay out of a call's server_seconds.
class TransferTimer {
 public:
  explicit TransferTimer(double& total) : total_(total) {}
  ~TransferTimer() {
    total_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

 private:
  double& total_;
  const std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

// Whose shared-memory regions a caller sees: its tenant with tokens, else everyone's.
std::string RegionOwner(const Caller& caller) { return caller.isolated ? caller.tenant : ""; }

// The chunked calls carry bytes in chunks; a shared-memory reference has no place there.
absl::Status NoSharedMemory(const v1::Tensor& t, absl::string_view field) {
  if (t.has_shared_memory()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field,
        ".shared_memory: shared-memory tensors travel on the unary calls and Train, not on "
        "the chunked calls"));
  }
  return absl::OkStatus();
}

int64_t ShapeElements(const v1::Tensor& t) {
  if (t.shape_size() == 0) return 0;
  int64_t n = 1;
  for (int64_t d : t.shape()) {
    if (d <= 0) return 0;  // the decoder names the bad dimension
    if (n > std::numeric_limits<int64_t>::max() / d) return std::numeric_limits<int64_t>::max();
    n *= d;
  }
  return n;
}

absl::Status CheckElements(absl::string_view what, int64_t elements, int64_t limit) {
  if (limit > 0 && elements > limit) {
    return absl::ResourceExhaustedError(absl::StrCat(what, " has ", elements,
                                                     " elements, over the limit of ", limit,
                                                     " (--max-tensor-elements)"));
  }
  return absl::OkStatus();
}

absl::Status CheckOutputDType(v1::DType dtype, absl::string_view field) {
  return wire::OutputDType(dtype, field).status();
}

std::string EnumName(const std::string& name, int value) {
  return name.empty() ? std::to_string(value) : name;
}

absl::StatusOr<core::ModuleSpec> SpecFromProto(const v1::ModuleSpec& p) {
  core::ModuleSpec spec;
  switch (p.kind()) {
    case v1::LINEAR:
      spec.kind = core::ModuleKind::kLinear;
      break;
    case v1::LAYERNORM_LINEAR:
      spec.kind = core::ModuleKind::kLayerNormLinear;
      break;
    case v1::LAYERNORM_MLP:
      spec.kind = core::ModuleKind::kLayerNormMlp;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("spec.kind must be LINEAR, LAYERNORM_LINEAR or LAYERNORM_MLP, got ",
                       EnumName(v1::ModuleKind_Name(p.kind()), p.kind())));
  }
  switch (p.activation()) {
    case v1::ACTIVATION_UNSPECIFIED:
    case v1::GELU:
      spec.activation = core::Activation::kGelu;
      break;
    case v1::RELU:
      spec.activation = core::Activation::kRelu;
      break;
    case v1::SWIGLU:
      spec.activation = core::Activation::kSwiglu;
      break;
    case v1::GEGLU:
      spec.activation = core::Activation::kGeglu;
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "spec.activation must be GELU, RELU, SWIGLU or GEGLU, got ", int(p.activation())));
  }
  const v1::Fp8Recipe& r = p.recipe();
  switch (r.scaling()) {
    case v1::SCALING_RECIPE_UNSPECIFIED:
    case v1::CURRENT:
      spec.recipe.mode = core::ScalingMode::kCurrent;
      break;
    case v1::DELAYED:
      spec.recipe.mode = core::ScalingMode::kDelayed;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("spec.recipe.scaling must be CURRENT or DELAYED, got ", int(r.scaling())));
  }
  switch (r.amax_compute_algo()) {
    case v1::AMAX_COMPUTE_ALGO_UNSPECIFIED:
    case v1::MAX:
      spec.recipe.algo = core::AmaxAlgo::kMax;
      break;
    case v1::MOST_RECENT:
      spec.recipe.algo = core::AmaxAlgo::kMostRecent;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("spec.recipe.amax_compute_algo must be MAX or MOST_RECENT, got ",
                       int(r.amax_compute_algo())));
  }
  spec.recipe.margin = r.margin();
  spec.recipe.history_len = r.amax_history_len() == 0 ? 1024 : r.amax_history_len();
  if (p.optimizer().has_adamw()) {
    const v1::AdamWConfig& a = p.optimizer().adamw();
    spec.optimizer.kind = core::OptimizerConfig::Kind::kAdamW;
    spec.optimizer.adamw.learning_rate = a.learning_rate();
    if (a.beta1() != 0) spec.optimizer.adamw.beta1 = a.beta1();
    if (a.beta2() != 0) spec.optimizer.adamw.beta2 = a.beta2();
    if (a.eps() != 0) spec.optimizer.adamw.eps = a.eps();
    spec.optimizer.adamw.weight_decay = a.weight_decay();
  } else if (p.optimizer().has_sgd()) {
    const v1::SgdConfig& g = p.optimizer().sgd();
    spec.optimizer.sgd.learning_rate = g.learning_rate();
    spec.optimizer.sgd.momentum = g.momentum();
    spec.optimizer.sgd.weight_decay = g.weight_decay();
    spec.optimizer.sgd.nesterov = g.nesterov();
  }
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

v1::ModuleKind KindToProto(core::ModuleKind kind) {
  static constexpr v1::ModuleKind kKinds[] = {v1::LINEAR, v1::LAYERNORM_LINEAR, v1::LAYERNORM_MLP};
  return kKinds[int(kind)];
}

v1::ModuleSpec SpecToProto(const core::ModuleSpec& s) {
  v1::ModuleSpec p;
  static constexpr v1::Activation kActivations[] = {v1::GELU, v1::RELU, v1::SWIGLU, v1::GEGLU};
  p.set_kind(KindToProto(s.kind));
  p.set_in_features(s.in_features);
  p.set_out_features(s.out_features);
  p.set_bias(s.bias);
  v1::Fp8Recipe* r = p.mutable_recipe();
  r->set_scaling(s.recipe.mode == core::ScalingMode::kDelayed ? v1::DELAYED : v1::CURRENT);
  r->set_margin(s.recipe.margin);
  r->set_amax_history_len(int32_t(s.recipe.history_len));
  r->set_amax_compute_algo(s.recipe.algo == core::AmaxAlgo::kMax ? v1::MAX : v1::MOST_RECENT);
  p.set_seed(s.seed);
  p.set_name(s.name);
  if (s.kind == core::ModuleKind::kLayerNormMlp) {
    p.set_ffn_features(s.ffn_features);
    p.set_activation(kActivations[int(s.activation)]);
  }
  if (s.kind != core::ModuleKind::kLinear) {
    p.set_layernorm_eps(s.layernorm_eps);
    p.set_zero_centered_gamma(s.zero_centered_gamma);
    p.set_return_layernorm_output(s.return_layernorm_output);
    p.set_checkpoint(s.checkpoint);
  }
  if (s.optimizer.kind == core::OptimizerConfig::Kind::kAdamW) {
    v1::AdamWConfig* a = p.mutable_optimizer()->mutable_adamw();
    a->set_learning_rate(s.optimizer.adamw.learning_rate);
    a->set_beta1(s.optimizer.adamw.beta1);
    a->set_beta2(s.optimizer.adamw.beta2);
    a->set_eps(s.optimizer.adamw.eps);
    a->set_weight_decay(s.optimizer.adamw.weight_decay);
  } else {
    v1::SgdConfig* g = p.mutable_optimizer()->mutable_sgd();
    g->set_learning_rate(s.optimizer.sgd.learning_rate);
    g->set_momentum(s.optimizer.sgd.momentum);
    g->set_weight_decay(s.optimizer.sgd.weight_decay);
    g->set_nesterov(s.optimizer.sgd.nesterov);
  }
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
}

// Host fp32 parameters (the master copies, or gradients copied to the host) as wire tensors.
absl::Status EncodeNamed(const core::NamedTensors& tensors, v1::DType dtype,
                         google::protobuf::RepeatedPtrField<v1::NamedTensor>* out) {
  GW_ASSIGN_OR_RETURN(const wire::DType d, wire::OutputDType(dtype, "dtype"));
  for (const auto& [name, tensor] : tensors) {
    v1::NamedTensor* named = out->Add();
    named->set_name(name);
    const at::Tensor t = tensor.contiguous();
    wire::EncodeToMessage(t.data_ptr<float>(), {t.sizes().begin(), t.sizes().end()}, d,
                          named->mutable_tensor());
  }
  return absl::OkStatus();
}

}  // namespace

GradwireService::GradwireService(core::ModuleHost& host, core::DeviceExecutor& executor,
                                 ServiceOptions options)
    : host_(host),
      executor_(executor),
      options_(std::move(options)),
      shared_memory_(options_.shared_memory),
      instance_id_(core::RandomId128()),
      control_(std::make_unique<core::DeviceExecutor>("control")) {
  // Modules already here (restored from checkpoints) count for their tenants.
  for (const core::ModuleInfo& info : host_.List()) {
    if (info.tenant.empty()) continue;
    const std::string client = "tenant " + info.tenant;
    const int64_t bytes = core::ParameterCount(info.spec) * int64_t(sizeof(float));
    parameter_bytes_[client] += bytes;
    module_bytes_[info.module_id] = {client, bytes};
  }
}

// The control thread is joined first: a creation still running there finishes against a live
// service.
GradwireService::~GradwireService() { control_.reset(); }

void GradwireService::Persist(const std::string& module_id) const {
  if (!options_.checkpointer) return;
  if (auto s = options_.checkpointer->Save(host_, module_id); !s.ok()) {
    spdlog::warn("checkpoint of module {} failed: {}", module_id, std::string(s.message()));
  }
}

absl::StatusOr<Caller> GradwireService::Authenticate(const grpc::CallbackServerContext* ctx) const {
  Caller caller;
  if (options_.authenticator == nullptr) {
    caller.client = "peer " + PeerHost(ctx->peer());
    return caller;
  }
  const auto& metadata = ctx->client_metadata();
  auto it = metadata.find("authorization");
  const std::string_view header = it == metadata.end()
                                      ? std::string_view()
                                      : std::string_view(it->second.data(), it->second.size());
  GW_ASSIGN_OR_RETURN(caller.tenant, options_.authenticator->Authenticate(header));
  caller.isolated = true;
  caller.client = "tenant " + caller.tenant;
  return caller;
}

absl::Status GradwireService::CheckRequestBytes(int64_t bytes) const {
  const int64_t limit = options_.limits.max_request_bytes;
  if (limit <= 0) return absl::OkStatus();
  if (bytes > limit) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the request is ", bytes, " bytes, over the limit of ", limit,
                     " (--max-request-bytes); send fewer rows per call"));
  }
  return absl::OkStatus();
}

absl::Status GradwireService::Admit(const Caller& caller, const std::string& module_id,
                                    const std::string& context_id, Admission* admission) {
  // Ownership first: a call for a module the caller may not see is NOT_FOUND before it counts
  // anywhere. A call naming a context counts for that context's module only when the caller may
  // see it; otherwise its work fails at once anyway. This runs on reactor threads: the module map's
  // lock is only held for lookups, and the context index never waits behind an offload.
  std::string module_key;
  if (!module_id.empty()) {
    GW_RETURN_IF_ERROR(CheckModule(caller, module_id));
    module_key = module_id;
  } else if (!context_id.empty()) {
    GW_RETURN_IF_ERROR(CheckId("context_id", context_id));
    module_key = host_.contexts().ModuleOf(context_id, caller.isolated ? &caller.tenant : nullptr);
  }
  const int64_t per_module = options_.limits.max_queued_per_module;
  const int64_t per_client = options_.limits.max_queued_per_client;
  std::lock_guard<std::mutex> lock(queue_mu_);
  if (!module_key.empty() && per_module > 0) {
    auto it = queued_.find(module_key);
    if (it != queued_.end() && it->second >= per_module) {
      return absl::ResourceExhaustedError(
          absl::StrCat("module ", module_key, " has ", per_module,
                       " calls queued, the limit (--max-queued-per-module); retry with backoff"));
    }
  }
  if (per_client > 0) {
    auto it = queued_by_client_.find(caller.client);
    if (it != queued_by_client_.end() && it->second >= per_client) {
      return absl::ResourceExhaustedError(
          absl::StrCat(caller.client, " has ", per_client,
                       " calls queued, the limit (--max-queued-per-client); retry with backoff"));
    }
  }
  if (!module_key.empty()) ++queued_[module_key];
  ++queued_by_client_[caller.client];
  *admission = Admission(this, std::move(module_key), caller.client);
  return absl::OkStatus();
}

int64_t GradwireService::queued_calls(const std::string& module_id) const {
  std::lock_guard<std::mutex> lock(queue_mu_);
  auto it = queued_.find(module_id);
  return it == queued_.end() ? 0 : it->second;
}

void GradwireService::Dequeued(const std::string& module_key, const std::string& client_key) {
  std::lock_guard<std::mutex> lock(queue_mu_);
  if (auto it = queued_.find(module_key); it != queued_.end() && --it->second <= 0) {
    queued_.erase(it);
  }
  if (auto it = queued_by_client_.find(client_key);
      it != queued_by_client_.end() && --it->second <= 0) {
    queued_by_client_.erase(it);
  }
}

absl::Status GradwireService::ReserveStreamBytes(const Caller& caller, int64_t bytes) {
  const int64_t quota = options_.quotas.stream_bytes;
  std::lock_guard<std::mutex> lock(queue_mu_);
  int64_t& held = stream_bytes_[caller.client];
  if (quota > 0 && held + bytes > quota) {
    const int64_t was = held;
    if (held == 0) stream_bytes_.erase(caller.client);
    return absl::ResourceExhaustedError(
        absl::StrCat("this chunked request declares ", bytes, " bytes and ", caller.client, " has ",
                     was, " in flight already, over the quota of ", quota,
                     " bytes (--max-stream-bytes-per-client); finish or cancel the others first"));
  }
  held += bytes;
  return absl::OkStatus();
}

void GradwireService::ReturnStreamBytes(const std::string& client, int64_t bytes) {
  std::lock_guard<std::mutex> lock(queue_mu_);
  auto it = stream_bytes_.find(client);
  if (it != stream_bytes_.end() && (it->second -= bytes) <= 0) stream_bytes_.erase(it);
}

std::vector<ClientUsage> GradwireService::Usage() const {
  std::map<std::string, ClientUsage> by_client;
  auto at = [&](const std::string& client) -> ClientUsage& {
    ClientUsage& u = by_client[client];
    u.client = client;
    return u;
  };
  for (const auto& [client, bytes] : host_.contexts().live_bytes_by_client()) {
    at(client).context_bytes = bytes;
  }
  std::lock_guard<std::mutex> lock(queue_mu_);
  for (const auto& [client, bytes] : parameter_bytes_) at(client).parameter_bytes = bytes;
  for (const auto& [client, bytes] : stream_bytes_) at(client).stream_bytes = bytes;
  for (const auto& [client, n] : queued_by_client_) at(client).queued = n;
  std::vector<ClientUsage> out;
  for (auto& [client, usage] : by_client) out.push_back(std::move(usage));
  return out;
}

absl::Status GradwireService::CheckModule(const Caller& caller,
                                          const std::string& module_id) const {
  GW_RETURN_IF_ERROR(CheckId("module_id", module_id));
  return caller.isolated ? host_.CheckTenant(module_id, caller.tenant) : absl::OkStatus();
}

absl::Status GradwireService::CheckContext(const Caller& caller,
                                           const std::string& context_id) const {
  GW_RETURN_IF_ERROR(CheckId("context_id", context_id));
  return caller.isolated ? host_.CheckContextTenant(context_id, caller.tenant) : absl::OkStatus();
}

void GradwireService::Report(const char* method, const absl::Status& status, double seconds,
                             const std::string& module_id, const std::string& context_id,
                             const Caller& caller, const RequestId& request) const {
  if (!options_.on_rpc_done) return;
  RpcRecord record;
  record.method = method;
  record.code = status.code();
  record.message = std::string(status.message());
  record.seconds = seconds;
  record.module_id = Escaped(module_id, kIdLength);
  record.context_id = Escaped(context_id, kIdLength);
  record.tenant = Escaped(caller.tenant, kMaxNameLength);
  record.client = Escaped(caller.client, kMaxNameLength);
  record.request = request;
  options_.on_rpc_done(record);
}

void ReleaseUnconsumed(core::DeviceExecutor& executor, core::ModuleHost& host,
                       std::vector<std::string> ids, core::ContextStore::ReleaseReason reason,
                       std::string what) {
  if (ids.empty()) return;
  // Logged under the request id of the call that let them go, when there is one.
  const RequestId* current = CurrentRequest();
  executor.Submit([&host, ids = std::move(ids), reason, what = std::move(what),
                   request = current ? *current : RequestId{}] {
    RequestScope scope(request);
    std::vector<std::string> released;
    for (const std::string& id : ids) {
      if (host.ReleaseContext(id, reason).ok()) released.push_back(id);
    }
    if (released.size() == 1) {
      spdlog::info("{}; released context {}", what, released[0]);
    } else if (!released.empty()) {
      spdlog::info("{}; released {} contexts", what, released.size());
    }
  });
}

// A unary call. When it ends without its status reaching the client (cancelled, past its
// deadline, a broken connection), it releases the context its work created: the client never
// learnt the id, so nobody would consume it and it would pin its saved tensors and weight version
// until the TTL.
class UnaryCall final : public Call<grpc::ServerUnaryReactor> {
 public:
  UnaryCall(GradwireService& service, grpc::CallbackServerContext* ctx, const char* method)
      : Call(service, ctx, method) {}

  void Start(grpc::CallbackServerContext* ctx, GradwireService::Work work, std::string module_id,
             std::string context_id, RequestSize request,
             std::function<std::string()> created_context, core::DeviceExecutor* executor) {
    NoteIds(module_id, context_id);
    absl::Status refused = Authenticate(ctx);
    if (refused.ok() && request.bytes >= 0) refused = service_.CheckRequestBytes(request.bytes);
    Admission admission;
    if (refused.ok()) refused = service_.Admit(caller(), module_id, context_id, &admission);
    if (!refused.ok()) {
      End(refused);
      return;
    }
    auto run = [this, work = std::move(work), created_context = std::move(created_context)] {
      absl::Status status =
          Abandoned()
              ? absl::CancelledError(absl::StrCat(method_, " was cancelled before it started"))
              : work(caller(), *this);
      if (service_.options_.before_unary_finish) {
        service_.options_.before_unary_finish(method_, status);
      }
      std::lock_guard<std::mutex> lock(mu_);
      if (status.ok() && created_context) created_ = created_context();
      EndLocked(std::move(status));
    };
    auto on_error = [this](absl::Status status) { End(std::move(status)); };
    if (executor == nullptr) {
      Submit(std::move(admission), std::move(run), std::move(on_error));
    } else {
      SubmitTo(*executor, std::move(admission), std::move(run), std::move(on_error));
    }
  }

 private:
  void Cancelled() override {
    if (service_.options_.on_unary_cancel) service_.options_.on_unary_cancel(method_);
  }
  void Ended() override {
    // OnDone: finished, so created_ is settled. Past the deadline counts as undelivered even when
    // gRPC did not see the cancellation: the client stopped waiting at its deadline.
    if (!created_.empty() && Abandoned()) {
      ReleaseUnconsumed(service_.executor_, service_.host_, {std::move(created_)},
                        core::ContextStore::ReleaseReason::kUndelivered,
                        absl::StrCat(method_, ": response not delivered"));
    }
  }

  std::string created_;  // the context the work created (under mu_)
};

grpc::ServerUnaryReactor* GradwireService::RunUnary(grpc::CallbackServerContext* ctx,
                                                    const char* method, Work work,
                                                    std::string module_id, std::string context_id,
                                                    RequestSize request,
                                                    std::function<std::string()> created_context,
                                                    bool control) {
  auto* call = new UnaryCall(*this, ctx, method);
  call->Start(ctx, std::move(work), std::move(module_id), std::move(context_id), request,
              std::move(created_context), control ? control_.get() : nullptr);
  return call;
}

grpc::ServerUnaryReactor* GradwireService::GetServerInfo(grpc::CallbackServerContext* ctx,
                                                         const v1::GetServerInfoRequest*,
                                                         v1::GetServerInfoResponse* resp) {
  // Counters only, so it answers in the reactor even while compute runs; reading the context
  // store's counters takes its lock briefly, and waits while an offload copy holds it.
  const auto start = std::chrono::steady_clock::now();
  const RequestId request = RequestIdOf(*ctx);
  RequestScope scope(request);
  auto* reactor = ctx->DefaultReactor();
  absl::StatusOr<Caller> caller = Authenticate(ctx);
  if (!caller.ok()) {
    Report("GetServerInfo", caller.status(), 0.0, {}, {}, Caller{}, request);
    reactor->Finish(ToGrpc(WithRequestId(caller.status(), request)));
    return reactor;
  }
  const core::HostStats stats = host_.Stats();
  resp->set_version(options_.version);
  resp->set_device(options_.device);
  resp->set_device_name(options_.device_name);
  resp->set_instance_id(instance_id_);
  for (const core::ModuleKindOps* kind : core::Kinds()) {
    resp->add_module_kinds(KindToProto(kind->kind()));
  }
  resp->set_modules(stats.modules);
  resp->set_live_contexts(stats.live_contexts);
  resp->set_context_bytes(stats.context_bytes);
  Report("GetServerInfo", absl::OkStatus(),
         std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), {}, {},
         *caller, request);
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* GradwireService::CreateModule(grpc::CallbackServerContext* ctx,
                                                        const v1::CreateModuleRequest* req,
                                                        v1::CreateModuleResponse* resp) {
  // On the control thread: creating a module allocates and initialises host memory only, and a
  // big one must not hold the device executor while other clients wait.
  return RunUnary(
      ctx, "CreateModule",
      [this, req, resp](const Caller& caller, const CallBase&) -> absl::Status {
        if (!req->has_spec()) return absl::InvalidArgumentError("spec is required");
        GW_RETURN_IF_ERROR(CheckName("spec.name", req->spec().name()));
        GW_ASSIGN_OR_RETURN(core::ModuleSpec spec, SpecFromProto(req->spec()));
        GW_RETURN_IF_ERROR(core::ValidateModuleSpec(spec));
        // The parameter quota is reserved before anything is allocated, and returned on failure.
        const int64_t bytes = core::ParameterCount(spec) * int64_t(sizeof(float));
        const int64_t quota = options_.quotas.parameter_bytes;
        {
          std::lock_guard<std::mutex> lock(queue_mu_);
          int64_t& held = parameter_bytes_[caller.client];
          if (quota > 0 && held + bytes > quota) {
            const int64_t was = held;
            if (held == 0) parameter_bytes_.erase(caller.client);
            return absl::ResourceExhaustedError(
                absl::StrCat("this module's parameters take ", bytes, " bytes and ", caller.client,
                             "'s modules ", was, " already, over the quota of ", quota,
                             " bytes (--max-parameter-bytes-per-client); delete modules first"));
          }
          held += bytes;
        }
        absl::StatusOr<core::ModuleInfo> info = host_.Create(spec, caller.tenant);
        {
          std::lock_guard<std::mutex> lock(queue_mu_);
          if (info.ok()) {
            module_bytes_[info->module_id] = {caller.client, bytes};
          } else if ((parameter_bytes_[caller.client] -= bytes) <= 0) {
            parameter_bytes_.erase(caller.client);
          }
        }
        if (!info.ok()) return info.status();
        InfoToProto(*info, resp->mutable_module());
        Persist(info->module_id);
        spdlog::info("created {} \"{}\" ({} -> {}, bias {}, {} scaling) as module {}{}{}",
                     core::ModuleKindName(spec.kind), Escaped(spec.name, kMaxNameLength),
                     spec.in_features, spec.out_features, spec.bias,
                     spec.recipe.mode == core::ScalingMode::kDelayed ? "delayed" : "current",
                     info->module_id, caller.isolated ? " of tenant " : "",
                     Escaped(caller.tenant, kMaxNameLength));
        return absl::OkStatus();
      },
      {}, {}, req, nullptr, /*control=*/true);
}

grpc::ServerUnaryReactor* GradwireService::ListModules(grpc::CallbackServerContext* ctx,
                                                       const v1::ListModulesRequest*,
                                                       v1::ListModulesResponse* resp) {
  return RunUnary(ctx, "ListModules",
                  [this, resp](const Caller& caller, const CallBase&) -> absl::Status {
                    for (const core::ModuleInfo& info :
                         host_.List(caller.isolated ? &caller.tenant : nullptr)) {
                      InfoToProto(info, resp->add_modules());
                    }
                    return absl::OkStatus();
                  });
}

grpc::ServerUnaryReactor* GradwireService::DeleteModule(grpc::CallbackServerContext* ctx,
                                                        const v1::DeleteModuleRequest* req,
                                                        v1::DeleteModuleResponse*) {
  return RunUnary(
      ctx, "DeleteModule",
      [this, req](const Caller& caller, const CallBase&) -> absl::Status {
        GW_RETURN_IF_ERROR(CheckModule(caller, req->module_id()));
        GW_RETURN_IF_ERROR(host_.Delete(req->module_id()));
        {
          std::lock_guard<std::mutex> lock(queue_mu_);
          if (auto it = module_bytes_.find(req->module_id()); it != module_bytes_.end()) {
            const auto& [client, bytes] = it->second;
            if (auto held = parameter_bytes_.find(client);
                held != parameter_bytes_.end() && (held->second -= bytes) <= 0) {
              parameter_bytes_.erase(held);
            }
            module_bytes_.erase(it);
          }
        }
        if (options_.checkpointer) {
          if (auto s = options_.checkpointer->Remove(req->module_id()); !s.ok()) {
            spdlog::warn("{}", std::string(s.message()));
          }
        }
        spdlog::info("deleted module {}", req->module_id());
        return absl::OkStatus();
      },
      req->module_id());
}

absl::Status GradwireService::CheckForwardLimits(const Caller& caller,
                                                 const v1::ForwardRequest& req) const {
  const int64_t limit = options_.limits.max_tensor_elements;
  const int64_t elements = ShapeElements(req.input());
  GW_RETURN_IF_ERROR(CheckElements("input", elements, limit));
  GW_ASSIGN_OR_RETURN(core::ModuleSpec spec, host_.Spec(req.module_id()));
  auto saturating = [](int64_t a, int64_t b) {
    return b != 0 && a > std::numeric_limits<int64_t>::max() / b
               ? std::numeric_limits<int64_t>::max()
               : a * b;
  };
  if (const int dims = req.input().shape_size(); dims > 0) {
    // What the forward would build, from the rows the input declares (a wrong last dimension is
    // the forward's INVALID_ARGUMENT).
    const int64_t rows = elements / std::max<int64_t>(1, req.input().shape(dims - 1));
    for (const auto& [what, width] : core::FindKind(spec.kind)->BuiltWidths(spec)) {
      GW_RETURN_IF_ERROR(CheckElements(what, saturating(rows, width), limit));
    }
  }
  const int64_t max_contexts = options_.limits.max_contexts_per_client;
  if (req.training() && max_contexts > 0) {
    const int64_t live = host_.contexts().live_contexts_of_client(caller.client);
    if (live >= max_contexts) {
      return absl::ResourceExhaustedError(
          absl::StrCat(caller.client, " has ", live, " live training contexts, the limit (",
                       "--max-contexts-per-client ", max_contexts,
                       "); run their backwards or ReleaseContext them first"));
    }
  }
  return absl::OkStatus();
}

absl::Status GradwireService::CheckHeader(const Caller& caller,
                                          const v1::ForwardRequest& req) const {
  GW_RETURN_IF_ERROR(CheckModule(caller, req.module_id()));
  if (!req.has_input()) return absl::InvalidArgumentError("input is required");
  GW_RETURN_IF_ERROR(NoSharedMemory(req.input(), "input"));
  if (req.has_output_shared_memory() || req.has_layernorm_output_shared_memory()) {
    return absl::InvalidArgumentError(
        "output_shared_memory: shared-memory results are written by the unary calls and Train, "
        "not by the chunked calls");
  }
  GW_RETURN_IF_ERROR(CheckOutputDType(req.output_dtype(), "output_dtype"));
  GW_ASSIGN_OR_RETURN(core::ModuleSpec spec, host_.Spec(req.module_id()));
  const int dims = req.input().shape_size();
  if (dims == 0 || req.input().shape(dims - 1) != spec.in_features) {
    return absl::InvalidArgumentError(absl::StrCat("input.shape must be [..., ", spec.in_features,
                                                   "] (the module's in_features)"));
  }
  return CheckForwardLimits(caller, req);
}

absl::Status GradwireService::CheckHeader(const Caller& caller,
                                          const v1::BackwardRequest& req) const {
  GW_RETURN_IF_ERROR(CheckId("context_id", req.context_id()));
  // The live index only (reactor thread): an unknown, foreign or evicted context is refused here;
  // the unary path's messages say which.
  const std::string module_id =
      host_.contexts().ModuleOf(req.context_id(), caller.isolated ? &caller.tenant : nullptr);
  if (module_id.empty()) {
    return absl::NotFoundError(
        absl::StrCat("context_id ", req.context_id(), " is not a live context"));
  }
  if (!req.has_grad_output()) return absl::InvalidArgumentError("grad_output is required");
  GW_RETURN_IF_ERROR(NoSharedMemory(req.grad_output(), "grad_output"));
  GW_RETURN_IF_ERROR(NoSharedMemory(req.grad_layernorm_output(), "grad_layernorm_output"));
  if (req.has_grad_input_shared_memory()) {
    return absl::InvalidArgumentError(
        "grad_input_shared_memory: shared-memory results are written by the unary calls and "
        "Train, not by the chunked calls");
  }
  GW_RETURN_IF_ERROR(CheckOutputDType(req.grad_input_dtype(), "grad_input_dtype"));
  GW_ASSIGN_OR_RETURN(core::ModuleSpec spec, host_.Spec(module_id));
  const int dims = req.grad_output().shape_size();
  if (dims == 0 || req.grad_output().shape(dims - 1) != spec.out_features) {
    return absl::InvalidArgumentError(absl::StrCat(
        "grad_output.shape must be [..., ", spec.out_features, "] (the module's out_features)"));
  }
  const int64_t limit = options_.limits.max_tensor_elements;
  GW_RETURN_IF_ERROR(CheckElements("grad_output", ShapeElements(req.grad_output()), limit));
  if (req.has_grad_layernorm_output()) {
    GW_RETURN_IF_ERROR(
        CheckElements("grad_layernorm_output", ShapeElements(req.grad_layernorm_output()), limit));
  }
  return absl::OkStatus();
}

absl::Status GradwireService::CheckHeader(const Caller& caller,
                                          const v1::SetWeightsRequest& req) const {
  GW_RETURN_IF_ERROR(CheckModule(caller, req.module_id()));
  GW_ASSIGN_OR_RETURN(core::ModuleSpec spec, host_.Spec(req.module_id()));
  const auto shapes = core::ParameterShapes(spec);
  for (int i = 0; i < req.parameters_size(); ++i) {
    const v1::NamedTensor& named = req.parameters(i);
    auto it = shapes.begin();
    while (it != shapes.end() && it->first != named.name()) ++it;
    if (it == shapes.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameters[", i, "] (\"", Escaped(named.name()), "\"): not a parameter of this module"));
    }
    const auto& shape = named.tensor().shape();
    if (!std::equal(shape.begin(), shape.end(), it->second.begin(), it->second.end())) {
      return absl::InvalidArgumentError(absl::StrCat("parameters[", i, "] (", it->first,
                                                     "): the shape must be [",
                                                     absl::StrJoin(it->second, ", "), "]"));
    }
  }
  return absl::OkStatus();
}

// Where shared-memory reads land, and a tensor's bytes when they arrived over several received
// slices: buffers reused by the thread that runs the calls, never zero-filled, and backed by
// transparent huge pages when large (core/heap_trim.h). In a fresh buffer a large tensor
// pays a page fault per 4 KiB page, several times the cost of the copy itself. Each thread keeps
// at most two buffers of at most kMaxRetained bytes.
class StagingBuffer {
 public:
  static constexpr size_t kMaxRetained = size_t(512) << 20;
  StagingBuffer() = default;
  ~StagingBuffer() {
    std::vector<Buffer>& pool = Pool();
    if (!buffer_.bytes || buffer_.capacity > kMaxRetained) return;  // freed by its deleter
    pool.push_back(std::move(buffer_));
    if (pool.size() > 2) {  // keep the two largest: the next large tensor finds its buffer warm
      pool.erase(std::min_element(pool.begin(), pool.end(), [](const Buffer& a, const Buffer& b) {
        return a.capacity < b.capacity;
      }));
    }
  }
  StagingBuffer(const StagingBuffer&) = delete;
  StagingBuffer& operator=(const StagingBuffer&) = delete;

  // `n` bytes, valid while this lives; their contents are whatever was there.
  char* Get(size_t n) {
    if (buffer_.capacity < n) {
      std::vector<Buffer>& pool = Pool();
      auto fits =
          std::find_if(pool.begin(), pool.end(), [n](const Buffer& b) { return b.capacity >= n; });
      if (fits != pool.end()) {
        buffer_ = std::move(*fits);
        pool.erase(fits);
      } else {
        buffer_.bytes.reset(static_cast<char*>(core::AllocateHostBuffer(n)));
        if (!buffer_.bytes) throw std::bad_alloc();
        buffer_.capacity = n;
      }
    }
    return buffer_.bytes.get();
  }

 private:
  struct Free {
    void operator()(char* p) const { core::FreeHostBuffer(p); }
  };
  struct Buffer {
    std::unique_ptr<char, Free> bytes;
    size_t capacity = 0;
  };
  static std::vector<Buffer>& Pool() {
    thread_local std::vector<Buffer> pool;
    return pool;
  }
  Buffer buffer_;
};

absl::StatusOr<wire::TensorView> GradwireService::Stage(const Caller& caller, const v1::Tensor& t,
                                                        absl::string_view field,
                                                        StagingBuffer* staged,
                                                        const wire::ReceivedMessage* raw,
                                                        int raw_field) const {
  if (!t.has_shared_memory() && raw != nullptr && raw->pieces(raw_field).size() > 1) {
    // The bytes arrived in several slices: gathered once into a reused buffer (the copy an f32
    // tensor needs anyway to be contiguous), not joined into a fresh one.
    const size_t n = raw->size(raw_field);
    char* at = staged->Get(n);
    size_t offset = 0;
    for (absl::string_view piece : raw->pieces(raw_field)) {
      std::memcpy(at + offset, piece.data(), piece.size());
      offset += piece.size();
    }
    return wire::ViewOf(t, absl::string_view(at, n), field);
  }
  const absl::string_view received = raw != nullptr ? raw->data(raw_field) : t.data();
  if (!t.has_shared_memory()) return wire::ViewOf(t, received, field);
  if (!received.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " carries both data and shared_memory; send one of them"));
  }
  // The header first: nothing is read (or allocated) for a malformed or oversize tensor.
  GW_ASSIGN_OR_RETURN(const int64_t bytes, wire::DataBytes(t, field));
  if (uint64_t(bytes) != t.shared_memory().byte_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".shared_memory.byte_size is ", t.shared_memory().byte_size(), "; shape [",
        absl::StrJoin(t.shape(), ", "), "] of ", v1::DType_Name(t.dtype()), " needs ", bytes));
  }
  GW_RETURN_IF_ERROR(CheckElements(field, ShapeElements(t), options_.limits.max_tensor_elements));
  char* bytes_at = staged->Get(size_t(bytes));
  GW_RETURN_IF_ERROR(shared_memory_.Read(RegionOwner(caller), t.shared_memory(),
                                         absl::StrCat(field, ".shared_memory"), bytes_at));
  // The view checks the header as for any tensor; the shared-memory reference is what it was.
  v1::Tensor header;
  header.set_dtype(t.dtype());
  *header.mutable_shape() = t.shape();
  header.set_scale_inv(t.scale_inv());
  return wire::ViewOf(header, absl::string_view(bytes_at, size_t(bytes)), field);
}

absl::Status GradwireService::Deliver(const Caller& caller, bool has_ref,
                                      const v1::SharedMemoryRef& ref, absl::string_view field,
                                      wire::EncodedTensor&& e, v1::Tensor* out) const {
  if (!has_ref) {
    wire::ToMessage(std::move(e), out);
    return absl::OkStatus();
  }
  GW_RETURN_IF_ERROR(shared_memory_.Write(RegionOwner(caller), ref, field, e.bytes));
  const uint64_t written = e.bytes.size();
  wire::ToMessage(std::move(e), out);
  out->clear_data();
  *out->mutable_shared_memory() = ref;
  out->mutable_shared_memory()->set_byte_size(written);
  return absl::OkStatus();
}

absl::Status GradwireService::DoForward(const Caller& caller, const v1::ForwardRequest& req,
                                        v1::ForwardResponse* resp, const CallBase* call,
                                        const wire::ReceivedMessage* raw) {
  const auto start = std::chrono::steady_clock::now();
  GW_RETURN_IF_ERROR(CheckModule(caller, req.module_id()));
  if (!req.has_input()) return absl::InvalidArgumentError("input is required");
  GW_ASSIGN_OR_RETURN(const wire::DType output_dtype,
                      wire::OutputDType(req.output_dtype(), "output_dtype"));
  // Malformed tensors are INVALID_ARGUMENT first; the limits apply to well-formed ones.
  core::WireForwardRequest f;
  StagingBuffer staged;  // the input's bytes, when they lie in shared memory
  double transfer = 0;
  {
    TransferTimer timer(transfer);
    absl::StatusOr<wire::TensorView> input = Stage(caller, req.input(), "input", &staged, raw, 2);
    if (!input.ok()) return input.status();
    f.input = std::move(*input);
  }
  GW_RETURN_IF_ERROR(CheckForwardLimits(caller, req));
  f.training = req.training();
  f.output_dtype = output_dtype;
  if (req.has_output_shared_memory() || req.has_layernorm_output_shared_memory()) {
    // Room for the results, checked before the compute: rows x out_features (and x in_features).
    GW_ASSIGN_OR_RETURN(core::ModuleSpec spec, host_.Spec(req.module_id()));
    const uint64_t rows = uint64_t(f.input.numel() / std::max<int64_t>(1, f.input.shape.back()));
    const uint64_t element = uint64_t(wire::ElementSize(output_dtype));
    if (req.has_output_shared_memory()) {
      GW_RETURN_IF_ERROR(shared_memory_.CheckRoom(RegionOwner(caller), req.output_shared_memory(),
                                                  "output_shared_memory",
                                                  rows * uint64_t(spec.out_features) * element));
    }
    if (req.has_layernorm_output_shared_memory()) {
      GW_RETURN_IF_ERROR(shared_memory_.CheckRoom(
          RegionOwner(caller), req.layernorm_output_shared_memory(),
          "layernorm_output_shared_memory", rows * uint64_t(spec.in_features) * element));
    }
  }
  f.client = caller.client;
  if (call != nullptr && call->Abandoned()) {  // stop before the compute
    return absl::CancelledError("Forward was cancelled or passed its deadline; nothing was run");
  }
  if (options_.before_forward_compute) options_.before_forward_compute();
  // The request's bytes go to the backend as they are (FP8 as codes, bf16 as 2-byte values); the
  // outputs come back encoded.
  GW_ASSIGN_OR_RETURN(core::WireForwardOutput out, host_.Forward(req.module_id(), f));
  // A context is only worth returning when the response can still reach the client in time.
  if (call != nullptr && !out.context_id.empty() && call->Abandoned(options_.delivery_slack)) {
    (void)host_.ReleaseContext(out.context_id, core::ContextStore::ReleaseReason::kUndelivered);
    return absl::CancelledError(
        "Forward was cancelled, passed its deadline or came too close to it during the compute; "
        "its context was released");
  }
  absl::Status delivered;
  {
    TransferTimer timer(transfer);
    delivered = Deliver(caller, req.has_output_shared_memory(), req.output_shared_memory(),
                        "output_shared_memory", std::move(out.output), resp->mutable_output());
    if (delivered.ok() && out.has_layernorm_output) {
      delivered = Deliver(caller, req.has_layernorm_output_shared_memory(),
                          req.layernorm_output_shared_memory(), "layernorm_output_shared_memory",
                          std::move(out.layernorm_output), resp->mutable_layernorm_output());
    }
  }
  if (!delivered.ok()) {  // a region its owner shrank meanwhile: nobody will get the context
    if (!out.context_id.empty()) (void)host_.ReleaseContext(out.context_id);
    return delivered;
  }
  resp->set_context_id(out.context_id);
  resp->set_weight_version(out.weight_version);
  resp->set_server_seconds(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() - transfer);
  return absl::OkStatus();
}

absl::Status GradwireService::DoBackward(const Caller& caller, const v1::BackwardRequest& req,
                                         v1::BackwardResponse* resp, const CallBase* call,
                                         const wire::ReceivedMessage* raw) {
  const auto start = std::chrono::steady_clock::now();
  GW_RETURN_IF_ERROR(CheckContext(caller, req.context_id()));
  if (!req.has_grad_output()) return absl::InvalidArgumentError("grad_output is required");
  core::WireBackwardRequest in;
  GW_ASSIGN_OR_RETURN(in.grad_input_dtype,
                      wire::OutputDType(req.grad_input_dtype(), "grad_input_dtype"));
  StagingBuffer staged, staged_ln;  // bytes that lie in shared memory
  double transfer = 0;
  {
    TransferTimer timer(transfer);
    absl::StatusOr<wire::TensorView> grad_output =
        Stage(caller, req.grad_output(), "grad_output", &staged, raw, 2);
    if (!grad_output.ok()) return grad_output.status();
    in.grad_output = std::move(*grad_output);
  }
  GW_RETURN_IF_ERROR(
      CheckElements("grad_output", in.grad_output.numel(), options_.limits.max_tensor_elements));
  if (req.has_grad_layernorm_output()) {
    TransferTimer timer(transfer);
    GW_ASSIGN_OR_RETURN(
        in.grad_layernorm_output,
        Stage(caller, req.grad_layernorm_output(), "grad_layernorm_output", &staged_ln, raw, 6));
    GW_RETURN_IF_ERROR(CheckElements("grad_layernorm_output", in.grad_layernorm_output.numel(),
                                     options_.limits.max_tensor_elements));
  }
  in.retain = req.retain();
  in.skip_grad_input = req.skip_grad_input();
  if (req.has_grad_input_shared_memory() && !in.skip_grad_input) {
    // Room for grad_input, checked before the backward accumulates anything.
    const std::string module_id =
        host_.contexts().ModuleOf(req.context_id(), caller.isolated ? &caller.tenant : nullptr);
    GW_ASSIGN_OR_RETURN(core::ModuleSpec spec, host_.Spec(module_id));
    const uint64_t rows =
        uint64_t(in.grad_output.numel() / std::max<int64_t>(1, spec.out_features));
    GW_RETURN_IF_ERROR(shared_memory_.CheckRoom(
        RegionOwner(caller), req.grad_input_shared_memory(), "grad_input_shared_memory",
        rows * uint64_t(spec.in_features) * uint64_t(wire::ElementSize(in.grad_input_dtype))));
  }
  if (call != nullptr && call->Abandoned()) {  // the context stays for a retry
    return absl::CancelledError("Backward was cancelled or passed its deadline; nothing was run");
  }
  GW_ASSIGN_OR_RETURN(std::optional<wire::EncodedTensor> grad_input,
                      host_.Backward(req.context_id(), in));
  if (grad_input) {
    TransferTimer timer(transfer);
    absl::Status delivered =
        Deliver(caller, req.has_grad_input_shared_memory(), req.grad_input_shared_memory(),
                "grad_input_shared_memory", std::move(*grad_input), resp->mutable_grad_input());
    if (!delivered.ok()) {
      return absl::Status(delivered.code(),
                          absl::StrCat(delivered.message(),
                                       "; the backward ran (its gradients were accumulated) but "
                                       "grad_input could not be delivered"));
    }
  }
  resp->set_server_seconds(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() - transfer);
  return absl::OkStatus();
}

absl::Status GradwireService::DoRelease(const Caller& caller,
                                        const v1::ReleaseContextRequest& req) {
  GW_RETURN_IF_ERROR(CheckContext(caller, req.context_id()));
  return host_.ReleaseContext(req.context_id());
}

namespace {

// A raw unary call's request and response, alive until its work is done.
template <typename Req, typename Resp>
struct RawUnary {
  wire::ReceivedMessage received;
  Req req;
  Resp resp;
  absl::Status parsed;
};

}  // namespace

grpc::ServerUnaryReactor* GradwireService::Forward(grpc::CallbackServerContext* ctx,
                                                   const grpc::ByteBuffer* req,
                                                   grpc::ByteBuffer* resp) {
  // Parsed here, as gRPC parses a protobuf request before its handler: the tensor's bytes stay in
  // the received slices (or are copied once when they span several).
  auto raw = std::make_shared<RawUnary<v1::ForwardRequest, v1::ForwardResponse>>();
  raw->parsed = raw->received.Parse(*req, &raw->req, wire::kForwardRequestTensors);
  return RunUnary(
      ctx, "Forward",
      [this, raw, resp](const Caller& caller, const CallBase& call) -> absl::Status {
        GW_RETURN_IF_ERROR(raw->parsed);
        GW_RETURN_IF_ERROR(DoForward(caller, raw->req, &raw->resp, &call, &raw->received));
        wire::SerializeMoving(&raw->resp, wire::kForwardResponseTensors, resp);
        return absl::OkStatus();
      },
      raw->parsed.ok() ? raw->req.module_id() : std::string(), {},
      RequestSize(int64_t(req->Length())), [raw] { return raw->resp.context_id(); });
}

grpc::ServerUnaryReactor* GradwireService::Backward(grpc::CallbackServerContext* ctx,
                                                    const grpc::ByteBuffer* req,
                                                    grpc::ByteBuffer* resp) {
  auto raw = std::make_shared<RawUnary<v1::BackwardRequest, v1::BackwardResponse>>();
  raw->parsed = raw->received.Parse(*req, &raw->req, wire::kBackwardRequestTensors);
  return RunUnary(
      ctx, "Backward",
      [this, raw, resp](const Caller& caller, const CallBase& call) -> absl::Status {
        GW_RETURN_IF_ERROR(raw->parsed);
        GW_RETURN_IF_ERROR(DoBackward(caller, raw->req, &raw->resp, &call, &raw->received));
        wire::SerializeMoving(&raw->resp, wire::kBackwardResponseTensors, resp);
        return absl::OkStatus();
      },
      {}, raw->parsed.ok() ? raw->req.context_id() : std::string(),
      RequestSize(int64_t(req->Length())));
}

grpc::ServerUnaryReactor* GradwireService::ReleaseContext(grpc::CallbackServerContext* ctx,
                                                          const v1::ReleaseContextRequest* req,
                                                          v1::ReleaseContextResponse*) {
  return RunUnary(
      ctx, "ReleaseContext",
      [this, req](const Caller& caller, const CallBase&) { return DoRelease(caller, *req); }, {},
      req->context_id());
}

grpc::ServerUnaryReactor* GradwireService::ApplyGradients(grpc::CallbackServerContext* ctx,
                                                          const v1::ApplyGradientsRequest* req,
                                                          v1::ApplyGradientsResponse* resp) {
  return RunUnary(
      ctx, "ApplyGradients",
      [this, req, resp](const Caller& caller, const CallBase&) -> absl::Status {
        GW_RETURN_IF_ERROR(CheckModule(caller, req->module_id()));
        GW_ASSIGN_OR_RETURN(uint64_t version,
                            host_.ApplyGradients(req->module_id(), req->learning_rate()));
        resp->set_weight_version(version);
        GW_ASSIGN_OR_RETURN(core::ModuleInfo info, host_.Info(req->module_id()));
        resp->set_optimizer_steps(info.optimizer_steps);
        if (options_.checkpointer && options_.checkpointer->Due(info.optimizer_steps)) {
          Persist(req->module_id());
        }
        return absl::OkStatus();
      },
      req->module_id());
}

grpc::ServerUnaryReactor* GradwireService::GetGradients(grpc::CallbackServerContext* ctx,
                                                        const v1::GetGradientsRequest* req,
                                                        v1::GetGradientsResponse* resp) {
  return RunUnary(
      ctx, "GetGradients",
      [this, req, resp](const Caller& caller, const CallBase&) -> absl::Status {
        GW_RETURN_IF_ERROR(CheckModule(caller, req->module_id()));
        GW_RETURN_IF_ERROR(CheckOutputDType(req->dtype(), "dtype"));
        GW_ASSIGN_OR_RETURN(core::ParametersCopy g,
                            host_.GetGradients(req->module_id(), req->zero()));
        GW_RETURN_IF_ERROR(EncodeNamed(g.tensors, req->dtype(), resp->mutable_gradients()));
        resp->set_weight_version(g.weight_version);
        resp->set_accumulated_backwards(g.accumulated_backwards);
        return absl::OkStatus();
      },
      req->module_id());
}

absl::Status GradwireService::DoGetWeights(const Caller& caller, const v1::GetWeightsRequest& req,
                                           v1::GetWeightsResponse* resp) {
  GW_RETURN_IF_ERROR(CheckModule(caller, req.module_id()));
  GW_RETURN_IF_ERROR(CheckOutputDType(req.dtype(), "dtype"));
  GW_ASSIGN_OR_RETURN(core::ParametersCopy w, host_.GetWeights(req.module_id()));
  GW_RETURN_IF_ERROR(EncodeNamed(w.tensors, req.dtype(), resp->mutable_parameters()));
  resp->set_weight_version(w.weight_version);
  return absl::OkStatus();
}

absl::Status GradwireService::DoSetWeights(const Caller& caller, const v1::SetWeightsRequest& req,
                                           v1::SetWeightsResponse* resp) {
  GW_RETURN_IF_ERROR(CheckModule(caller, req.module_id()));
  core::NamedViews params;
  for (int i = 0; i < req.parameters_size(); ++i) {
    const v1::NamedTensor& named = req.parameters(i);
    const std::string field = absl::StrCat("parameters[", i, "].tensor");
    GW_ASSIGN_OR_RETURN(wire::TensorView v, wire::ViewOf(named.tensor(), field));
    GW_RETURN_IF_ERROR(CheckElements(field, v.numel(), options_.limits.max_tensor_elements));
    params.emplace_back(named.name(), std::move(v));
  }
  GW_ASSIGN_OR_RETURN(uint64_t version, host_.SetWeights(req.module_id(), params));
  resp->set_weight_version(version);
  Persist(req.module_id());
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* GradwireService::GetWeights(grpc::CallbackServerContext* ctx,
                                                      const v1::GetWeightsRequest* req,
                                                      v1::GetWeightsResponse* resp) {
  return RunUnary(
      ctx, "GetWeights",
      [this, req, resp](const Caller& caller, const CallBase&) {
        return DoGetWeights(caller, *req, resp);
      },
      req->module_id());
}

grpc::ServerUnaryReactor* GradwireService::SetWeights(grpc::CallbackServerContext* ctx,
                                                      const v1::SetWeightsRequest* req,
                                                      v1::SetWeightsResponse* resp) {
  return RunUnary(
      ctx, "SetWeights",
      [this, req, resp](const Caller& caller, const CallBase&) {
        return DoSetWeights(caller, *req, resp);
      },
      req->module_id(), {}, req);
}

grpc::ServerUnaryReactor* GradwireService::RegisterSharedMemory(
    grpc::CallbackServerContext* ctx, const v1::RegisterSharedMemoryRequest* req,
    v1::RegisterSharedMemoryResponse*) {
  // On the control thread: opening an object is a system call, never compute.
  return RunUnary(
      ctx, "RegisterSharedMemory",
      [this, req](const Caller& caller, const CallBase&) {
        return shared_memory_.Register(RegionOwner(caller), req->name(), req->key(), req->offset(),
                                       req->byte_size());
      },
      {}, {}, req, nullptr, /*control=*/true);
}

grpc::ServerUnaryReactor* GradwireService::UnregisterSharedMemory(
    grpc::CallbackServerContext* ctx, const v1::UnregisterSharedMemoryRequest* req,
    v1::UnregisterSharedMemoryResponse* resp) {
  return RunUnary(
      ctx, "UnregisterSharedMemory",
      [this, req, resp](const Caller& caller, const CallBase&) -> absl::Status {
        GW_ASSIGN_OR_RETURN(const int n,
                            shared_memory_.Unregister(RegionOwner(caller), req->name()));
        resp->set_unregistered(n);
        return absl::OkStatus();
      },
      {}, {}, req, nullptr, /*control=*/true);
}

grpc::ServerUnaryReactor* GradwireService::ListSharedMemory(grpc::CallbackServerContext* ctx,
                                                            const v1::ListSharedMemoryRequest* req,
                                                            v1::ListSharedMemoryResponse* resp) {
  return RunUnary(
      ctx, "ListSharedMemory",
      [this, req, resp](const Caller& caller, const CallBase&) -> absl::Status {
        GW_ASSIGN_OR_RETURN(auto regions, shared_memory_.List(RegionOwner(caller), req->name()));
        for (const SharedMemoryRegionInfo& r : regions) {
          auto* out = resp->add_regions();
          out->set_name(r.name);
          out->set_key(r.key);
          out->set_offset(r.offset);
          out->set_byte_size(r.byte_size);
        }
        return absl::OkStatus();
      },
      {}, {}, req, nullptr, /*control=*/true);
}

}  // namespace gradwire::rpc
