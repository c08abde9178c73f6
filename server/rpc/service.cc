#include "server/rpc/service.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "gradwire/wire/tensor.h"
#include "server/common/status_macros.h"
#include "server/core/checkpoints/checkpoint.h"
#include "server/rpc/boundary.h"
#include "server/rpc/chunked.h"
#include "server/rpc/service_util.h"
#include "server/rpc/spec_convert.h"

namespace gradwire::rpc {
namespace {

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

GradwireService::GradwireService(core::ModuleHost& host, scheduling::DeviceExecutor& executor,
                                 ServiceOptions options)
    : host_(host),
      options_(std::move(options)),
      shared_memory_(options_.shared_memory),
      request_tensors_(shared_memory_, options_.limits.max_tensor_elements),
      instance_id_(core::RandomId128()),
      quotas_(options_.limits, options_.quotas),
      train_{this, [this](const Caller& caller,
                          const v1::ReleaseContextRequest& req) { return DoRelease(caller, req); }},
      checks_(host_, env_, options_.limits),
      env_(host, executor, options_, quotas_) {
  if (options_.batching.enabled()) {
    batcher_ = std::make_unique<scheduling::BatchFormer>(executor, options_.batching);
  }
  // Modules already here (restored from checkpoints) count for their tenants.
  for (const core::ModuleInfo& info : host_.List()) env_.CountExisting(info);
}

GradwireService::~GradwireService() = default;

int64_t GradwireService::batched_waiting() const { return batcher_ ? batcher_->waiting() : 0; }

void GradwireService::Persist(const std::string& module_id) {
  if (!options_.checkpointer) return;
  absl::Status s = options_.checkpointer->Save(host_, module_id);
  if (core::Checkpointer::IsMoved(s)) {
    LetGo(module_id, s);
  } else if (!s.ok()) {
    spdlog::warn("checkpoint of module {} failed: {}", module_id, std::string(s.message()));
  }
}

absl::Status GradwireService::CheckStillHeld(const std::string& module_id) {
  if (!options_.checkpointer) return absl::OkStatus();
  absl::Status s = options_.checkpointer->claims().CheckHeld(module_id);
  if (!core::Checkpointer::IsMoved(s)) return absl::OkStatus();
  LetGo(module_id, s);
  return s;
}

std::optional<int64_t> GradwireService::DropMoved(const std::string& module_id) {
  const int64_t contexts = host_.contexts().live_contexts(module_id);
  if (!host_.Delete(module_id, /*moved=*/true).ok()) return std::nullopt;  // dropped already
  quotas_.ModuleDeleted(module_id);
  return contexts;
}

void GradwireService::LetGo(const std::string& module_id, const absl::Status& why) {
  options_.checkpointer->claims().Forget(module_id);
  const std::optional<int64_t> contexts = DropMoved(module_id);
  if (!contexts) return;
  spdlog::warn("let go of module {} and its {} live contexts: {}", module_id, *contexts,
               std::string(why.message()));
}

int GradwireService::LetGoOfMovedModules() {
  if (!options_.checkpointer || !options_.checkpointer->shared()) return 0;
  int n = 0;
  for (const auto& [id, why] : options_.checkpointer->claims().Lost()) {
    LetGo(id, why);
    ++n;
  }
  return n;
}

int GradwireService::HandOverRequested() {
  if (!options_.checkpointer || !options_.checkpointer->shared()) return 0;
  const std::vector<std::string> ids = options_.checkpointer->handover().Requests();
  for (const std::string& id : ids) env_.executor().Submit([this, id] { HandOver(id); });
  return int(ids.size());
}

void GradwireService::HandOver(const std::string& module_id) {
  const auto start = std::chrono::steady_clock::now();
  absl::Status saved;
  int64_t contexts = 0;
  try {
    saved = options_.checkpointer->Save(host_, module_id);
  } catch (const std::exception& e) {
    saved = absl::InternalError(e.what());
  }
  try {
    contexts = DropMoved(module_id).value_or(0);
  } catch (const std::exception& e) {
    spdlog::error("handing module {} over: dropping it here failed: {}", module_id, e.what());
  }
  options_.checkpointer->handover().Release(
      module_id);  // whatever happened: the taker must not wait on
  if (!saved.ok()) {
    spdlog::error(
        "handed module {} over without saving it ({}): the server taking it over reads its last "
        "checkpoint",
        module_id, std::string(saved.message()));
    return;
  }
  spdlog::info(
      "handed module {} and its {} live contexts over to the server that asked, saved "
      "in {:.1f} ms",
      module_id, contexts,
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
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
        for (const core::KindDescription* kind : core::KindDescriptions()) {
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
        // A routed create names its module before it exists: the id it proposes.
        GW_RETURN_IF_ERROR(CheckOptionalId("module_id", req->module_id()));
        if (!caller.route.empty() && req->module_id().empty()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "a CreateModule with a ", kRouteHeader,
              " header must propose its module_id (the same id): the module must live where its "
              "id routes"));
        }
        GW_RETURN_IF_ERROR(CallEnv::CheckRoute(caller, req->module_id()));
        GW_ASSIGN_OR_RETURN(core::ModuleSpec spec,
                            SpecFromProto(req->spec(), options_.default_recipe));
        GW_RETURN_IF_ERROR(core::ValidateModuleSpec(spec));
        // The parameter quota is reserved before anything is allocated, and returned on failure.
        const int64_t bytes = core::ParameterCount(spec) * int64_t(sizeof(float));
        GW_RETURN_IF_ERROR(quotas_.ReserveParameters(caller.client, bytes));
        absl::StatusOr<core::ModuleInfo> info = host_.Create(spec, caller.tenant, req->module_id());
        if (!info.ok()) {
          quotas_.ReturnParameters(caller.client, bytes);
          return info.status();
        }
        if (options_.checkpointer) {
          // Its checkpoint folder and first claim: no other server sharing the directory has or
          // makes a module of this id.
          if (absl::Status claimed = options_.checkpointer->claims().ClaimNew(info->module_id);
              !claimed.ok()) {
            (void)host_.Delete(info->module_id);
            quotas_.ReturnParameters(caller.client, bytes);
            return claimed;
          }
        }
        quotas_.KeepParameters(info->module_id, caller.client, bytes);
        InfoToProto(*info, resp->mutable_module());
        Persist(info->module_id);
        spdlog::info("created {} \"{}\" ({} scaling{}) as module {}{}{}",
                     core::DescribeModule(spec), Escaped(spec.name, kMaxNameLength),
                     core::ScalingModeName(spec.recipe.mode),
                     spec.recipe.block_hybrid ? ", E5M2 gradients" : "", info->module_id,
                     caller.isolated ? " of tenant " : "", Escaped(caller.tenant, kMaxNameLength));
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
        GW_RETURN_IF_ERROR(CheckStillHeld(req->module_id()));  // its files are another's now
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
          GW_RETURN_IF_ERROR(CallEnv::CheckRoute(caller, id));
        }
        for (const std::string& id : req->module_ids()) {
          // Already on the control thread: a module with a checkpoint is taken over here.
          if (!env_.TakeOver(id).ok() || !env_.CheckModule(caller, id).ok() ||
              !host_.Touch(id).ok()) {
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
  // A module with an admitted call, queued or running, stays until that call ends (its success
  // renews it).
  const std::vector<std::string> expired = host_.ExpireIdleModules(
      ttl, [this](const std::string& id) { return quotas_.busy_calls(id) > 0; });
  for (const std::string& id : expired) {
    quotas_.ModuleDeleted(id);
    spdlog::info(
        "released module {}: no successful call or keep-alive of its owner for {} s "
        "(--module-ttl)",
        id, ttl);
  }
  return int(expired.size());
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
        GW_RETURN_IF_ERROR(CheckStillHeld(req->module_id()));
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
  GW_RETURN_IF_ERROR(CheckStillHeld(req.module_id()));
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
  return StartForwardChunked(env_, ctx, checks_, *this);
}

GradwireService::RawBidi* GradwireService::BackwardChunked(Ctx* ctx) {
  return StartBackwardChunked(env_, ctx, checks_, *this);
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
