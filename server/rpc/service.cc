#include "server/rpc/service.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "gradwire/wire/tensor.h"
#include "server/core/checkpoint.h"
#include "server/core/status_macros.h"
#include "server/rpc/boundary.h"
#include "server/rpc/chunked.h"
#include "server/rpc/spec_convert.h"

namespace gradwire::rpc {
namespace {

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

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Whose shared-memory regions a caller sees: its tenant with tokens, else everyone's.
std::string RegionOwner(const Caller& caller) { return caller.isolated ? caller.tenant : ""; }

// A batch's first half (docs/batching.md): runs each member's queued work up to its compute (its
// checks and cancellation; a member answered there drops out) and returns the members still
// waiting for the compute. With yielding on, it stops after the member it is on when another
// client's work waits, and gives the members not started back to the batch former.
template <typename Slot>
std::vector<std::shared_ptr<Slot>> PrepareMembers(std::vector<core::BatchFormer::Member>& members,
                                                  core::BatchFormer::Run& run) {
  std::vector<std::shared_ptr<Slot>> ready;
  ready.reserve(members.size());
  for (size_t i = 0; i < members.size(); ++i) {
    auto s = std::static_pointer_cast<Slot>(members[i].item);
    std::function<void()> task = std::move(s->task);
    s->task = nullptr;
    task();
    if (s->pending) ready.push_back(std::move(s));
    if (i + 1 < members.size() && run.OthersWaiting()) {
      run.GiveBack(members, i + 1);
      break;
    }
  }
  return ready;
}

const std::string* TenantOf(const Caller& caller) {
  return caller.isolated ? &caller.tenant : nullptr;
}

// Encoded parameters (weights or gradients) into a response's named tensors.
void ToMessages(core::EncodedParameters&& params,
                google::protobuf::RepeatedPtrField<v1::NamedTensor>* out) {
  for (auto& [name, tensor] : params.tensors) {
    v1::NamedTensor* named = out->Add();
    named->set_name(name);
    wire::ToMessage(std::move(tensor), named->mutable_tensor());
  }
}

}  // namespace

GradwireService::GradwireService(core::ModuleHost& host, core::DeviceExecutor& executor,
                                 ServiceOptions options)
    : host_(host),
      options_(std::move(options)),
      shared_memory_(options_.shared_memory),
      staging_(shared_memory_, options_.limits.max_tensor_elements),
      instance_id_(core::RandomId128()),
      quotas_(options_.limits, options_.quotas),
      train_{
          [this](const Caller& caller, const v1::ForwardRequest& req, v1::ForwardResponse* resp,
                 const CallBase& call) { return DoForward(caller, req, resp, call); },
          [this](const Caller& caller, const v1::BackwardRequest& req, v1::BackwardResponse* resp,
                 const CallBase& call) { return DoBackward(caller, req, resp, call); },
          [this](const Caller& caller, const v1::ReleaseContextRequest& req) {
            return DoRelease(caller, req);
          }},
      checks_(host_, env_, options_.limits),
      env_(host, executor, options_, quotas_) {
  if (options_.batching.enabled()) {
    batcher_ = std::make_unique<core::BatchFormer>(executor, options_.batching);
  }
  // Modules already here (restored from checkpoints) count for their tenants.
  for (const core::ModuleInfo& info : host_.List()) {
    if (info.tenant.empty()) continue;
    quotas_.CountExisting(info.module_id, "tenant " + info.tenant,
                          core::ParameterCount(info.spec) * int64_t(sizeof(float)));
  }
}

GradwireService::~GradwireService() = default;

int64_t GradwireService::batched_waiting() const { return batcher_ ? batcher_->waiting() : 0; }

void GradwireService::Persist(const std::string& module_id) const {
  if (!options_.checkpointer) return;
  if (auto s = options_.checkpointer->Save(host_, module_id); !s.ok()) {
    spdlog::warn("checkpoint of module {} failed: {}", module_id, std::string(s.message()));
  }
}

std::vector<ClientUsage> GradwireService::Usage() const {
  return quotas_.Usage(host_.contexts().live_bytes_by_client());
}

GradwireService::Unary* GradwireService::GetServerInfo(Ctx* ctx, const v1::GetServerInfoRequest*,
                                                       v1::GetServerInfoResponse* resp) {
  // Counters only, so it answers on the reactor even while compute runs; reading the context
  // store's counters takes its lock briefly, and waits while an offload copy holds it.
  return StartUnary(
      env_, ctx, "GetServerInfo",
      [this, resp](const Caller&, const CallBase&) {
        const core::HostStats stats = host_.Stats();
        resp->set_version(options_.version);
        resp->set_device(options_.device);
        resp->set_device_name(options_.device_name);
        resp->set_instance_id(instance_id_);
        resp->set_module_ttl_s(module_ttl_s());
        for (const core::ModuleKindOps* kind : core::Kinds()) {
          resp->add_module_kinds(KindToProto(*kind));
        }
        resp->set_modules(stats.modules);
        resp->set_live_contexts(stats.live_contexts);
        resp->set_context_bytes(stats.context_bytes);
        return absl::OkStatus();
      },
      {}, {}, {}, nullptr, CallBase::RunOn::kInline);
}

GradwireService::Unary* GradwireService::CreateModule(Ctx* ctx, const v1::CreateModuleRequest* req,
                                                      v1::CreateModuleResponse* resp) {
  // On the control thread: creating a module allocates and initialises host memory only, and a
  // big one must not hold the device executor while other clients wait.
  return StartUnary(
      env_, ctx, "CreateModule",
      [this, req, resp](const Caller& caller, const CallBase&) -> absl::Status {
        if (!req->has_spec()) return absl::InvalidArgumentError("spec is required");
        GW_RETURN_IF_ERROR(CheckName("spec.name", req->spec().name()));
        GW_ASSIGN_OR_RETURN(core::ModuleSpec spec, SpecFromProto(req->spec()));
        GW_RETURN_IF_ERROR(core::ValidateModuleSpec(spec));
        // The parameter quota is reserved before anything is allocated, and returned on failure.
        const int64_t bytes = core::ParameterCount(spec) * int64_t(sizeof(float));
        GW_RETURN_IF_ERROR(quotas_.ReserveParameters(caller.client, bytes));
        absl::StatusOr<core::ModuleInfo> info = host_.Create(spec, caller.tenant);
        if (!info.ok()) {
          quotas_.ReturnParameters(caller.client, bytes);
          return info.status();
        }
        quotas_.KeepParameters(info->module_id, caller.client, bytes);
        InfoToProto(*info, resp->mutable_module());
        Persist(info->module_id);
        spdlog::info("created {} \"{}\" ({} scaling) as module {}{}{}", core::DescribeModule(spec),
                     Escaped(spec.name, kMaxNameLength),
                     spec.recipe.mode == core::ScalingMode::kDelayed ? "delayed" : "current",
                     info->module_id, caller.isolated ? " of tenant " : "",
                     Escaped(caller.tenant, kMaxNameLength));
        return absl::OkStatus();
      },
      {}, {}, req, nullptr, CallBase::RunOn::kControl);
}

GradwireService::Unary* GradwireService::ListModules(Ctx* ctx, const v1::ListModulesRequest*,
                                                     v1::ListModulesResponse* resp) {
  return StartUnary(env_, ctx, "ListModules",
                    [this, resp](const Caller& caller, const CallBase&) -> absl::Status {
                      for (const core::ModuleInfo& info : host_.List(TenantOf(caller))) {
                        InfoToProto(info, resp->add_modules());
                      }
                      return absl::OkStatus();
                    });
}

GradwireService::Unary* GradwireService::DeleteModule(Ctx* ctx, const v1::DeleteModuleRequest* req,
                                                      v1::DeleteModuleResponse*) {
  return StartUnary(
      env_, ctx, "DeleteModule",
      [this, req](const Caller& caller, const CallBase&) -> absl::Status {
        GW_RETURN_IF_ERROR(env_.CheckModule(caller, req->module_id()));
        GW_RETURN_IF_ERROR(host_.Delete(req->module_id()));
        quotas_.ModuleDeleted(req->module_id());
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

GradwireService::Unary* GradwireService::KeepAlive(Ctx* ctx, const v1::KeepAliveRequest* req,
                                                   v1::KeepAliveResponse* resp) {
  // On the control thread: a lookup per module, never compute.
  return StartUnary(
      env_, ctx, "KeepAlive",
      [this, req, resp](const Caller& caller, const CallBase&) -> absl::Status {
        constexpr int kMaxIds = 4096;
        if (req->module_ids_size() > kMaxIds) {
          return absl::InvalidArgumentError(absl::StrCat(
              "module_ids holds ", req->module_ids_size(), " ids; at most ", kMaxIds, " a call"));
        }
        for (const std::string& id : req->module_ids()) {
          GW_RETURN_IF_ERROR(CheckId("module_ids", id));
        }
        for (const std::string& id : req->module_ids()) {
          if (!env_.CheckModule(caller, id).ok() || !host_.Touch(id).ok()) {
            resp->add_unknown(id);
          }
        }
        return absl::OkStatus();
      },
      {}, {}, req, nullptr, CallBase::RunOn::kControl);
}

double GradwireService::module_ttl_s() const {
  return options_.checkpointer != nullptr ? 0.0 : options_.module_ttl_s;
}

int GradwireService::ExpireIdleModules() {
  const double ttl = module_ttl_s();
  if (!(ttl > 0)) return 0;
  const std::vector<std::string> expired = host_.ExpireIdleModules(ttl);
  for (const std::string& id : expired) {
    quotas_.ModuleDeleted(id);
    spdlog::info("released module {}: no call or keep-alive for {} s (--module-ttl)", id, ttl);
  }
  return int(expired.size());
}

absl::Status GradwireService::DoForward(const Caller& caller, const v1::ForwardRequest& req,
                                        v1::ForwardResponse* resp, const CallBase& call,
                                        const wire::ReceivedMessage* raw) {
  PreparedForward p;
  GW_RETURN_IF_ERROR(PrepareForward(caller, req, call, raw, &p));
  // The request's bytes go to the backend as they are (FP8 as codes, bf16 as 2-byte values); the
  // outputs come back encoded.
  return FinishForward(caller, req, resp, call, p, host_.Forward(req.module_id(), p.f));
}

absl::Status GradwireService::PrepareForward(const Caller& caller, const v1::ForwardRequest& req,
                                             const CallBase& call, const wire::ReceivedMessage* raw,
                                             PreparedForward* p) {
  p->start = std::chrono::steady_clock::now();
  GW_RETURN_IF_ERROR(env_.CheckModule(caller, req.module_id()));
  if (!req.has_input()) return absl::InvalidArgumentError("input is required");
  GW_ASSIGN_OR_RETURN(const wire::DType output_dtype,
                      wire::OutputDType(req.output_dtype(), "output_dtype"));
  const std::string owner = RegionOwner(caller);
  // Malformed tensors are INVALID_ARGUMENT first; the limits apply to well-formed ones.
  core::WireForwardRequest& f = p->f;
  {
    TransferTimer timer(p->transfer);
    GW_ASSIGN_OR_RETURN(f.input,
                        staging_.Stage(owner, req.input(), "input", p->staged.get(), raw, 2));
  }
  GW_RETURN_IF_ERROR(checks_.CheckForward(caller, req));
  f.training = req.training();
  f.output_dtype = output_dtype;
  if (req.has_output_shared_memory() || req.has_layernorm_output_shared_memory()) {
    // Room for the results, checked before the compute: rows x out_features (and x in_features).
    GW_ASSIGN_OR_RETURN(core::ModuleSpec spec, host_.Spec(req.module_id()));
    const uint64_t rows = uint64_t(f.input.numel() / std::max<int64_t>(1, f.input.shape.back()));
    const uint64_t element = uint64_t(wire::ElementSize(output_dtype));
    if (req.has_output_shared_memory()) {
      GW_RETURN_IF_ERROR(staging_.CheckRoom(owner, req.output_shared_memory(),
                                            "output_shared_memory",
                                            rows * uint64_t(spec.out_features) * element));
    }
    if (req.has_layernorm_output_shared_memory()) {
      GW_RETURN_IF_ERROR(staging_.CheckRoom(owner, req.layernorm_output_shared_memory(),
                                            "layernorm_output_shared_memory",
                                            rows * uint64_t(spec.in_features) * element));
    }
  }
  f.client = caller.client;
  if (call.Abandoned()) {  // stop before the compute
    return absl::CancelledError("Forward was cancelled or passed its deadline; nothing was run");
  }
  if (options_.before_forward_compute) options_.before_forward_compute();
  return absl::OkStatus();
}

absl::Status GradwireService::FinishForward(const Caller& caller, const v1::ForwardRequest& req,
                                            v1::ForwardResponse* resp, const CallBase& call,
                                            PreparedForward& p,
                                            absl::StatusOr<core::WireForwardOutput> computed) {
  GW_RETURN_IF_ERROR(computed.status());
  core::WireForwardOutput& out = *computed;
  const std::string owner = RegionOwner(caller);
  // A context is only worth returning when the response can still reach the client in time.
  if (!out.context_id.empty() && call.Abandoned(options_.delivery_slack)) {
    (void)host_.ReleaseContext(out.context_id, core::ContextStore::ReleaseReason::kUndelivered);
    return absl::CancelledError(
        "Forward was cancelled, passed its deadline or came too close to it during the compute; "
        "its context was released");
  }
  absl::Status delivered;
  {
    TransferTimer timer(p.transfer);
    delivered =
        staging_.Deliver(owner, req.has_output_shared_memory(), req.output_shared_memory(),
                         "output_shared_memory", std::move(out.output), resp->mutable_output());
    if (delivered.ok() && out.has_layernorm_output) {
      delivered =
          staging_.Deliver(owner, req.has_layernorm_output_shared_memory(),
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
  resp->set_batch_requests(out.batch_requests);
  resp->set_server_seconds(SecondsSince(p.start) - p.transfer);
  return absl::OkStatus();
}

absl::Status GradwireService::DoBackward(const Caller& caller, const v1::BackwardRequest& req,
                                         v1::BackwardResponse* resp, const CallBase& call,
                                         const wire::ReceivedMessage* raw) {
  PreparedBackward p;
  GW_RETURN_IF_ERROR(PrepareBackward(caller, req, call, raw, &p));
  return FinishBackward(caller, req, resp, p, host_.Backward(req.context_id(), p.in));
}

absl::Status GradwireService::PrepareBackward(const Caller& caller, const v1::BackwardRequest& req,
                                              const CallBase& call,
                                              const wire::ReceivedMessage* raw,
                                              PreparedBackward* p) {
  p->start = std::chrono::steady_clock::now();
  GW_RETURN_IF_ERROR(env_.CheckContext(caller, req.context_id()));
  if (!req.has_grad_output()) return absl::InvalidArgumentError("grad_output is required");
  core::WireBackwardRequest& in = p->in;
  GW_ASSIGN_OR_RETURN(in.grad_input_dtype,
                      wire::OutputDType(req.grad_input_dtype(), "grad_input_dtype"));
  const std::string owner = RegionOwner(caller);
  const int64_t limit = options_.limits.max_tensor_elements;
  {
    TransferTimer timer(p->transfer);
    GW_ASSIGN_OR_RETURN(in.grad_output, staging_.Stage(owner, req.grad_output(), "grad_output",
                                                       p->staged.get(), raw, 2));
  }
  GW_RETURN_IF_ERROR(CheckElements("grad_output", in.grad_output.numel(), limit));
  if (req.has_grad_layernorm_output()) {
    TransferTimer timer(p->transfer);
    GW_ASSIGN_OR_RETURN(in.grad_layernorm_output,
                        staging_.Stage(owner, req.grad_layernorm_output(), "grad_layernorm_output",
                                       p->staged_ln.get(), raw, 6));
    GW_RETURN_IF_ERROR(
        CheckElements("grad_layernorm_output", in.grad_layernorm_output.numel(), limit));
  }
  in.retain = req.retain();
  in.skip_grad_input = req.skip_grad_input();
  if (req.has_grad_input_shared_memory() && !in.skip_grad_input) {
    // Room for grad_input, checked before the backward accumulates anything.
    const std::string module_id = host_.contexts().ModuleOf(req.context_id(), TenantOf(caller));
    GW_ASSIGN_OR_RETURN(core::ModuleSpec spec, host_.Spec(module_id));
    const uint64_t rows =
        uint64_t(in.grad_output.numel() / std::max<int64_t>(1, spec.out_features));
    GW_RETURN_IF_ERROR(staging_.CheckRoom(
        owner, req.grad_input_shared_memory(), "grad_input_shared_memory",
        rows * uint64_t(spec.in_features) * uint64_t(wire::ElementSize(in.grad_input_dtype))));
  }
  if (call.Abandoned()) {  // the context stays for a retry
    return absl::CancelledError("Backward was cancelled or passed its deadline; nothing was run");
  }
  return absl::OkStatus();
}

absl::Status GradwireService::FinishBackward(
    const Caller& caller, const v1::BackwardRequest& req, v1::BackwardResponse* resp,
    PreparedBackward& p, absl::StatusOr<std::optional<wire::EncodedTensor>> computed) {
  GW_RETURN_IF_ERROR(computed.status());
  std::optional<wire::EncodedTensor>& grad_input = *computed;
  if (grad_input) {
    TransferTimer timer(p.transfer);
    absl::Status delivered = staging_.Deliver(
        RegionOwner(caller), req.has_grad_input_shared_memory(), req.grad_input_shared_memory(),
        "grad_input_shared_memory", std::move(*grad_input), resp->mutable_grad_input());
    if (!delivered.ok()) {
      return absl::Status(delivered.code(),
                          absl::StrCat(delivered.message(),
                                       "; the backward ran (its gradients were accumulated) but "
                                       "grad_input could not be delivered"));
    }
  }
  resp->set_server_seconds(SecondsSince(p.start) - p.transfer);
  return absl::OkStatus();
}

absl::Status GradwireService::DoRelease(const Caller& caller,
                                        const v1::ReleaseContextRequest& req) {
  GW_RETURN_IF_ERROR(env_.CheckContext(caller, req.context_id()));
  return host_.ReleaseContext(req.context_id());
}

template <typename Req, typename Resp, typename Body>
GradwireService::Unary* GradwireService::RawUnary(Ctx* ctx, const char* method,
                                                  const grpc::ByteBuffer* req,
                                                  grpc::ByteBuffer* resp,
                                                  std::initializer_list<int> request_tensors,
                                                  std::initializer_list<int> response_tensors,
                                                  Body body) {
  // The request and response live until the work is done.
  struct Raw {
    wire::ReceivedMessage received;
    Req req;
    Resp resp;
    absl::Status parsed;
  };
  auto raw = std::make_shared<Raw>();
  raw->parsed = raw->received.Parse(*req, &raw->req, request_tensors);
  const RequestIds ids = raw->parsed.ok() ? IdsOf(raw->req) : RequestIds{};
  return StartUnary(
      env_, ctx, method,
      [this, raw, resp, body, response_tensors](const Caller& caller,
                                                const CallBase& call) -> absl::Status {
        GW_RETURN_IF_ERROR(raw->parsed);
        GW_RETURN_IF_ERROR((this->*body)(caller, raw->req, &raw->resp, call, &raw->received));
        wire::SerializeMoving(&raw->resp, response_tensors, resp);
        return absl::OkStatus();
      },
      ids.module_id, ids.context_id, RequestSize(int64_t(req->Length())),
      [raw] { return CreatedBy(raw->resp); });
}

GradwireService::Unary* GradwireService::Forward(Ctx* ctx, const grpc::ByteBuffer* req,
                                                 grpc::ByteBuffer* resp) {
  if (batcher_) return BatchedForward(ctx, req, resp);
  return RawUnary<v1::ForwardRequest, v1::ForwardResponse>(
      ctx, "Forward", req, resp, wire::kForwardRequestTensors, wire::kForwardResponseTensors,
      &GradwireService::DoForward);
}

GradwireService::Unary* GradwireService::BatchedForward(Ctx* ctx, const grpc::ByteBuffer* req,
                                                        grpc::ByteBuffer* resp) {
  // One request: its message, and what passes between the halves of its work.
  struct Slot {
    wire::ReceivedMessage received;
    v1::ForwardRequest req;
    v1::ForwardResponse resp;
    absl::Status parsed;
    grpc::ByteBuffer* out = nullptr;
    PreparedForward prepared;
    const Caller* caller = nullptr;         // the call's, alive while `pending` holds it
    std::unique_ptr<PendingUnary> pending;  // set when prepared: the batch finishes the call
    std::function<void()> task;             // the call's queued work, until the batch runs it
  };
  auto slot = std::make_shared<Slot>();
  slot->out = resp;
  slot->parsed = slot->received.Parse(*req, &slot->req, wire::kForwardRequestTensors);
  const RequestIds ids = slot->parsed.ok() ? IdsOf(slot->req) : RequestIds{};
  // In a batch: forwards keyed by module, training or not, and input dtype (how the input
  // reaches the kind); rows bound the batch.
  const bool batchable = slot->parsed.ok() && slot->req.has_input() &&
                         !slot->req.input().shape().empty() &&
                         slot->req.input().shape(slot->req.input().shape_size() - 1) > 0;
  int64_t rows = 1;
  if (batchable) {
    for (int i = 0; i + 1 < slot->req.input().shape_size(); ++i) {
      rows = std::min<int64_t>(int64_t(1) << 40,
                               rows * std::max<int64_t>(0, slot->req.input().shape(i)));
    }
  }
  const std::string key =
      absl::StrCat(slot->req.module_id(), slot->req.training() ? "/train/" : "/",
                   int(slot->req.input().dtype()));
  return StartDeferrableUnary(
      env_, ctx, "Forward",
      [this, slot, batchable](const Caller& caller, const CallBase& call,
                              std::unique_ptr<PendingUnary>* pending) -> absl::Status {
        GW_RETURN_IF_ERROR(slot->parsed);
        if (!batchable) {
          GW_RETURN_IF_ERROR(DoForward(caller, slot->req, &slot->resp, call, &slot->received));
          wire::SerializeMoving(&slot->resp, wire::kForwardResponseTensors, slot->out);
          return absl::OkStatus();
        }
        GW_RETURN_IF_ERROR(
            PrepareForward(caller, slot->req, call, &slot->received, &slot->prepared));
        slot->caller = &caller;
        slot->pending = std::move(*pending);
        return absl::OkStatus();
      },
      [this, slot, batchable, key, rows](const Caller& caller, std::function<void()> task) {
        if (!batchable) {
          env_.executor().Submit(caller.client, std::move(task));
          return;
        }
        slot->task = std::move(task);
        batcher_->Add(key, {caller.client, rows, slot}, [this](auto& members, auto& run) {
          // Each request's work up to the compute (its own checks, its own cancellation), then
          // one compute for those still there, then each one's delivery and end.
          std::vector<std::shared_ptr<Slot>> ready = PrepareMembers<Slot>(members, run);
          if (ready.empty()) return;
          std::vector<const core::WireForwardRequest*> reqs;
          for (const auto& s : ready) reqs.push_back(&s->prepared.f);
          std::vector<absl::StatusOr<core::WireForwardOutput>> outs;
          try {
            outs = host_.ForwardBatch(ready[0]->req.module_id(), reqs);
          } catch (const std::exception& e) {
            const absl::Status failed =
                absl::InternalError(absl::StrCat("Forward failed: ", e.what()));
            spdlog::error("a batch of {} forwards failed: {}", ready.size(), e.what());
            for (const auto& s : ready) s->pending->Finish(failed);
            return;
          }
          // What ran as one backend call (a batch that fell back to its requests one by one
          // reports none), for the metrics.
          int64_t together = 0, rows = 0;
          for (size_t i = 0; i < ready.size(); ++i) {
            ready[i]->prepared.staged.reset();  // the input was read: its staging goes now
            if (!outs[i].ok() || outs[i]->batch_requests == 0) continue;
            together = outs[i]->batch_requests;
            const wire::TensorView& in = ready[i]->prepared.f.input;
            rows += in.numel() / std::max<int64_t>(1, in.shape.back());
          }
          if (together > 0 && options_.on_batch) options_.on_batch("Forward", together, rows);
          // Delivery and the end of each call are host work: on the control thread, so the
          // device executor goes on to the next task (another tenant's) at once.
          for (size_t i = 0; i < ready.size(); ++i) {
            env_.control().Submit(
                ready[i]->caller->client, [this, s = ready[i], out = std::move(outs[i])]() mutable {
                  RequestScope scope(s->pending->call().request());
                  absl::Status status;
                  try {
                    status = FinishForward(*s->caller, s->req, &s->resp, s->pending->call(),
                                           s->prepared, std::move(out));
                    if (status.ok()) {
                      wire::SerializeMoving(&s->resp, wire::kForwardResponseTensors, s->out);
                    }
                  } catch (const std::exception& e) {
                    status = absl::InternalError(absl::StrCat("Forward failed: ", e.what()));
                    spdlog::error("{}", std::string(status.message()));
                  }
                  std::string created = status.ok() ? s->resp.context_id() : std::string();
                  s->pending->Finish(std::move(status), std::move(created));
                });
          }
        });
      },
      ids.module_id, RequestSize(int64_t(req->Length())), [slot] { return CreatedBy(slot->resp); });
}

GradwireService::Unary* GradwireService::Backward(Ctx* ctx, const grpc::ByteBuffer* req,
                                                  grpc::ByteBuffer* resp) {
  if (batcher_) return BatchedBackward(ctx, req, resp);
  return RawUnary<v1::BackwardRequest, v1::BackwardResponse>(
      ctx, "Backward", req, resp, wire::kBackwardRequestTensors, wire::kBackwardResponseTensors,
      &GradwireService::DoBackward);
}

GradwireService::Unary* GradwireService::BatchedBackward(Ctx* ctx, const grpc::ByteBuffer* req,
                                                         grpc::ByteBuffer* resp) {
  // One request: its message, and what passes between the halves of its work.
  struct Slot {
    wire::ReceivedMessage received;
    v1::BackwardRequest req;
    v1::BackwardResponse resp;
    absl::Status parsed;
    grpc::ByteBuffer* out = nullptr;
    PreparedBackward prepared;
    const Caller* caller = nullptr;         // the call's, alive while `pending` holds it
    std::unique_ptr<PendingUnary> pending;  // set when prepared: the batch finishes the call
    std::function<void()> task;             // the call's queued work, until the batch runs it
    bool batched = false;                   // queued in a batch (set before the work runs)
  };
  auto slot = std::make_shared<Slot>();
  slot->out = resp;
  slot->parsed = slot->received.Parse(*req, &slot->req, wire::kBackwardRequestTensors);
  const RequestIds ids = slot->parsed.ok() ? IdsOf(slot->req) : RequestIds{};
  // Rows bound the batch: grad_output's leading dimensions.
  const bool shaped =
      slot->parsed.ok() && slot->req.has_grad_output() && !slot->req.grad_output().shape().empty();
  int64_t rows = 1;
  if (shaped) {
    for (int i = 0; i + 1 < slot->req.grad_output().shape_size(); ++i) {
      rows = std::min<int64_t>(int64_t(1) << 40,
                               rows * std::max<int64_t>(0, slot->req.grad_output().shape(i)));
    }
  }
  return StartDeferrableUnary(
      env_, ctx, "Backward",
      [this, slot](const Caller& caller, const CallBase& call,
                   std::unique_ptr<PendingUnary>* pending) -> absl::Status {
        GW_RETURN_IF_ERROR(slot->parsed);
        if (!slot->batched) {  // not in a batch: the whole call
          GW_RETURN_IF_ERROR(DoBackward(caller, slot->req, &slot->resp, call, &slot->received));
          wire::SerializeMoving(&slot->resp, wire::kBackwardResponseTensors, slot->out);
          return absl::OkStatus();
        }
        GW_RETURN_IF_ERROR(
            PrepareBackward(caller, slot->req, call, &slot->received, &slot->prepared));
        slot->caller = &caller;
        slot->pending = std::move(*pending);
        return absl::OkStatus();
      },
      [this, slot, shaped, rows](const Caller& caller, std::function<void()> task) {
        // Backwards of one module's contexts share a batch; the module is looked up as the
        // call's admission does (a context of another tenant, or none, runs alone and fails).
        const std::string module =
            shaped ? host_.contexts().ModuleOf(slot->req.context_id(), TenantOf(caller))
                   : std::string();
        if (module.empty()) {
          env_.executor().Submit(caller.client, std::move(task));
          return;
        }
        slot->task = std::move(task);
        slot->batched = true;
        // Keyed also by what the kind computes (grad_input or not, a LayerNorm output's
        // gradient or not): a batch is one kind call.
        const std::string key = absl::StrCat(module, "/backward/", int(slot->req.skip_grad_input()),
                                             int(slot->req.has_grad_layernorm_output()));
        batcher_->Add(key, {caller.client, rows, slot}, [this](auto& members, auto& run) {
          // Each request's work up to the compute, one compute for those still there, then each
          // one's delivery and end, as for forwards.
          std::vector<std::shared_ptr<Slot>> ready = PrepareMembers<Slot>(members, run);
          if (ready.empty()) return;
          std::vector<std::string> contexts;
          std::vector<const core::WireBackwardRequest*> reqs;
          for (const auto& s : ready) {
            contexts.push_back(s->req.context_id());
            reqs.push_back(&s->prepared.in);
          }
          std::vector<absl::StatusOr<std::optional<wire::EncodedTensor>>> outs;
          core::ModuleHost::BatchRan together;
          try {
            outs = host_.BackwardBatch(contexts, reqs, &together);
          } catch (const std::exception& e) {
            const absl::Status failed =
                absl::InternalError(absl::StrCat("Backward failed: ", e.what()));
            spdlog::error("a batch of {} backwards failed: {}", ready.size(), e.what());
            for (const auto& s : ready) s->pending->Finish(failed, {});
            return;
          }
          for (const auto& s : ready) {  // the gradients were read: their staging goes now
            s->prepared.staged.reset();
            s->prepared.staged_ln.reset();
          }
          if (together.requests > 0 && options_.on_batch) {
            options_.on_batch("Backward", together.requests, together.rows);
          }
          for (size_t i = 0; i < ready.size(); ++i) {
            env_.control().Submit(ready[i]->caller->client, [this, s = ready[i],
                                                             out = std::move(outs[i])]() mutable {
              RequestScope scope(s->pending->call().request());
              absl::Status status;
              try {
                status = FinishBackward(*s->caller, s->req, &s->resp, s->prepared, std::move(out));
                if (status.ok()) {
                  wire::SerializeMoving(&s->resp, wire::kBackwardResponseTensors, s->out);
                }
              } catch (const std::exception& e) {
                status = absl::InternalError(absl::StrCat("Backward failed: ", e.what()));
                spdlog::error("{}", std::string(status.message()));
              }
              s->pending->Finish(std::move(status), {});
            });
          }
        });
      },
      ids.module_id, RequestSize(int64_t(req->Length())), nullptr, ids.context_id);
}

GradwireService::Unary* GradwireService::ReleaseContext(Ctx* ctx,
                                                        const v1::ReleaseContextRequest* req,
                                                        v1::ReleaseContextResponse*) {
  return StartUnary(
      env_, ctx, "ReleaseContext",
      [this, req](const Caller& caller, const CallBase&) { return DoRelease(caller, *req); }, {},
      req->context_id());
}

grpc::ServerBidiReactor<v1::TrainRequest, v1::TrainResponse>* GradwireService::Train(Ctx* ctx) {
  return StartTrain(env_, ctx, train_);
}

GradwireService::Unary* GradwireService::ApplyGradients(Ctx* ctx,
                                                        const v1::ApplyGradientsRequest* req,
                                                        v1::ApplyGradientsResponse* resp) {
  return StartUnary(
      env_, ctx, "ApplyGradients",
      [this, req, resp](const Caller& caller, const CallBase&) -> absl::Status {
        GW_RETURN_IF_ERROR(env_.CheckModule(caller, req->module_id()));
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

GradwireService::Unary* GradwireService::GetGradients(Ctx* ctx, const v1::GetGradientsRequest* req,
                                                      v1::GetGradientsResponse* resp) {
  return StartUnary(
      env_, ctx, "GetGradients",
      [this, req, resp](const Caller& caller, const CallBase&) -> absl::Status {
        GW_RETURN_IF_ERROR(env_.CheckModule(caller, req->module_id()));
        // The dtype is checked before the gradients are read (and, with `zero`, zeroed).
        GW_ASSIGN_OR_RETURN(const wire::DType dtype, wire::OutputDType(req->dtype(), "dtype"));
        GW_ASSIGN_OR_RETURN(core::EncodedParameters g,
                            host_.GetGradients(req->module_id(), req->zero(), dtype));
        resp->set_weight_version(g.weight_version);
        resp->set_accumulated_backwards(g.accumulated_backwards);
        ToMessages(std::move(g), resp->mutable_gradients());
        return absl::OkStatus();
      },
      req->module_id());
}

absl::Status GradwireService::DoGetWeights(const Caller& caller, const v1::GetWeightsRequest& req,
                                           v1::GetWeightsResponse* resp) {
  GW_RETURN_IF_ERROR(env_.CheckModule(caller, req.module_id()));
  GW_ASSIGN_OR_RETURN(const wire::DType dtype, wire::OutputDType(req.dtype(), "dtype"));
  GW_ASSIGN_OR_RETURN(core::EncodedParameters w, host_.GetWeights(req.module_id(), dtype));
  resp->set_weight_version(w.weight_version);
  ToMessages(std::move(w), resp->mutable_parameters());
  return absl::OkStatus();
}

absl::Status GradwireService::DoSetWeights(const Caller& caller, const v1::SetWeightsRequest& req,
                                           v1::SetWeightsResponse* resp) {
  GW_RETURN_IF_ERROR(env_.CheckModule(caller, req.module_id()));
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

GradwireService::Unary* GradwireService::GetWeights(Ctx* ctx, const v1::GetWeightsRequest* req,
                                                    v1::GetWeightsResponse* resp) {
  return StartUnary(
      env_, ctx, "GetWeights",
      [this, req, resp](const Caller& caller, const CallBase&) {
        return DoGetWeights(caller, *req, resp);
      },
      req->module_id());
}

GradwireService::Unary* GradwireService::SetWeights(Ctx* ctx, const v1::SetWeightsRequest* req,
                                                    v1::SetWeightsResponse* resp) {
  return StartUnary(
      env_, ctx, "SetWeights",
      [this, req, resp](const Caller& caller, const CallBase&) {
        return DoSetWeights(caller, *req, resp);
      },
      req->module_id(), {}, req);
}

GradwireService::RawBidi* GradwireService::ForwardChunked(Ctx* ctx) {
  return StartForwardChunked(
      env_, ctx, checks_,
      [this](const Caller& caller, const CallBase& call, v1::ForwardRequest& req,
             v1::ForwardResponse* resp) { return DoForward(caller, req, resp, call); });
}

GradwireService::RawBidi* GradwireService::BackwardChunked(Ctx* ctx) {
  return StartBackwardChunked(
      env_, ctx, checks_,
      [this](const Caller& caller, const CallBase& call, v1::BackwardRequest& req,
             v1::BackwardResponse* resp) { return DoBackward(caller, req, resp, call); });
}

grpc::ServerWriteReactor<v1::GetWeightsResponsePart>* GradwireService::GetWeightsChunked(
    Ctx* ctx, const v1::GetWeightsRequest* req) {
  return StartGetWeightsChunked(
      env_, ctx, *req,
      [this](const Caller& caller, const CallBase&, const v1::GetWeightsRequest& r,
             v1::GetWeightsResponse* resp) { return DoGetWeights(caller, r, resp); });
}

grpc::ServerReadReactor<v1::SetWeightsRequestPart>* GradwireService::SetWeightsChunked(
    Ctx* ctx, v1::SetWeightsResponse* resp) {
  return StartSetWeightsChunked(
      env_, ctx, resp, checks_,
      [this](const Caller& caller, const CallBase&, v1::SetWeightsRequest& req,
             v1::SetWeightsResponse* out) { return DoSetWeights(caller, req, out); });
}

GradwireService::Unary* GradwireService::CreateSharedMemory(
    Ctx* ctx, const v1::CreateSharedMemoryRequest* req, v1::CreateSharedMemoryResponse* resp) {
  // On the control thread: making an object and reserving its pages is host work, never compute.
  return StartUnary(
      env_, ctx, "CreateSharedMemory",
      [this, req, resp](const Caller& caller, const CallBase&) -> absl::Status {
        GW_ASSIGN_OR_RETURN(
            CreatedRegion made,
            shared_memory_.Create(RegionOwner(caller), caller.peer, req->byte_size()));
        resp->set_region(made.name);
        resp->set_key(made.key);
        resp->set_byte_size(made.byte_size);
        resp->set_idle_timeout_s(shared_memory_.options().idle_timeout_s);
        return absl::OkStatus();
      },
      {}, {}, req, nullptr, CallBase::RunOn::kControl);
}

GradwireService::Unary* GradwireService::RegisterSharedMemory(
    Ctx* ctx, const v1::RegisterSharedMemoryRequest* req, v1::RegisterSharedMemoryResponse*) {
  // On the control thread: opening an object is a system call, never compute.
  return StartUnary(
      env_, ctx, "RegisterSharedMemory",
      [this, req](const Caller& caller, const CallBase&) {
        return shared_memory_.Register(RegionOwner(caller), req->name(), req->key(), req->offset(),
                                       req->byte_size());
      },
      {}, {}, req, nullptr, CallBase::RunOn::kControl);
}

GradwireService::Unary* GradwireService::UnregisterSharedMemory(
    Ctx* ctx, const v1::UnregisterSharedMemoryRequest* req,
    v1::UnregisterSharedMemoryResponse* resp) {
  return StartUnary(
      env_, ctx, "UnregisterSharedMemory",
      [this, req, resp](const Caller& caller, const CallBase&) -> absl::Status {
        GW_ASSIGN_OR_RETURN(const int n,
                            shared_memory_.Unregister(RegionOwner(caller), req->name()));
        resp->set_unregistered(n);
        return absl::OkStatus();
      },
      {}, {}, req, nullptr, CallBase::RunOn::kControl);
}

GradwireService::Unary* GradwireService::ListSharedMemory(Ctx* ctx,
                                                          const v1::ListSharedMemoryRequest* req,
                                                          v1::ListSharedMemoryResponse* resp) {
  return StartUnary(
      env_, ctx, "ListSharedMemory",
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
      {}, {}, req, nullptr, CallBase::RunOn::kControl);
}

}  // namespace gradwire::rpc
