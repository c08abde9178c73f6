#include "server/rpc/service.h"

#include <ATen/ATen.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <exception>

#include "absl/strings/str_cat.h"
#include "server/core/status_macros.h"
#include "server/rpc/status_map.h"
#include "server/rpc/tensor_codec.h"

namespace gradwire::rpc {
namespace {

absl::Status RequireId(absl::string_view field, const std::string& id) {
  if (id.empty()) return absl::InvalidArgumentError(absl::StrCat(field, " is required"));
  return absl::OkStatus();
}

absl::StatusOr<core::ModuleSpec> SpecFromProto(const v1::ModuleSpec& p) {
  core::ModuleSpec spec;
  switch (p.kind()) {
    case v1::LINEAR:
      spec.kind = core::ModuleKind::kLinear;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("spec.kind must be LINEAR, got ", v1::ModuleKind_Name(p.kind()).empty()
                                                             ? std::to_string(int(p.kind()))
                                                             : v1::ModuleKind_Name(p.kind())));
  }
  switch (p.recipe().scaling()) {
    case v1::SCALING_RECIPE_UNSPECIFIED:
    case v1::CURRENT:
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("spec.recipe.scaling must be CURRENT, got ", int(p.recipe().scaling())));
  }
  spec.in_features = p.in_features();
  spec.out_features = p.out_features();
  spec.bias = p.bias();
  spec.margin = p.recipe().margin();
  spec.seed = p.seed();
  spec.name = p.name();
  return spec;
}

void InfoToProto(const core::ModuleInfo& info, v1::ModuleInfo* out) {
  out->set_module_id(info.module_id);
  v1::ModuleSpec* spec = out->mutable_spec();
  spec->set_kind(v1::LINEAR);
  spec->set_in_features(info.spec.in_features);
  spec->set_out_features(info.spec.out_features);
  spec->set_bias(info.spec.bias);
  spec->mutable_recipe()->set_scaling(v1::CURRENT);
  spec->mutable_recipe()->set_margin(info.spec.margin);
  spec->set_seed(info.spec.seed);
  spec->set_name(info.spec.name);
  out->set_weight_version(info.weight_version);
  out->set_live_contexts(info.live_contexts);
}

}  // namespace

GradwireService::GradwireService(core::ModuleHost& host, core::DeviceExecutor& executor,
                                 ServiceOptions options)
    : host_(host), executor_(executor), options_(std::move(options)) {}

grpc::ServerUnaryReactor* GradwireService::RunOnDevice(grpc::CallbackServerContext* ctx,
                                                       const char* method,
                                                       std::function<absl::Status()> work) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  const auto queued_at = std::chrono::steady_clock::now();
  executor_.Submit([ctx, reactor, method, queued_at, work = std::move(work)] {
    absl::Status status;
    if (ctx->IsCancelled()) {
      status = absl::CancelledError(absl::StrCat(method, " was cancelled before it started"));
    } else {
      try {
        status = work();
      } catch (const std::exception& e) {
        status = absl::InternalError(absl::StrCat(method, " failed: ", e.what()));
      } catch (...) {
        status = absl::InternalError(absl::StrCat(method, " failed with an unknown exception"));
      }
    }
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - queued_at)
            .count();
    if (status.ok()) {
      spdlog::debug("{} OK in {:.2f} ms", method, ms);
    } else {
      spdlog::info("{} {} in {:.2f} ms: {}", method, absl::StatusCodeToString(status.code()), ms,
                   std::string(status.message()));
    }
    reactor->Finish(ToGrpc(status));
  });
  return reactor;
}

grpc::ServerUnaryReactor* GradwireService::GetServerInfo(grpc::CallbackServerContext* ctx,
                                                         const v1::GetServerInfoRequest*,
                                                         v1::GetServerInfoResponse* resp) {
  // Counters only: cheap and lock-light, so it answers in the reactor even while compute runs.
  const core::HostStats stats = host_.Stats();
  resp->set_version(options_.version);
  resp->set_device(options_.device);
  resp->set_device_name(options_.device_name);
  resp->add_module_kinds(v1::LINEAR);
  resp->set_modules(stats.modules);
  resp->set_live_contexts(stats.live_contexts);
  resp->set_context_bytes(stats.context_bytes);
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* GradwireService::CreateModule(grpc::CallbackServerContext* ctx,
                                                        const v1::CreateModuleRequest* req,
                                                        v1::CreateModuleResponse* resp) {
  return RunOnDevice(ctx, "CreateModule", [this, req, resp]() -> absl::Status {
    if (!req->has_spec()) return absl::InvalidArgumentError("spec is required");
    GW_ASSIGN_OR_RETURN(core::ModuleSpec spec, SpecFromProto(req->spec()));
    GW_ASSIGN_OR_RETURN(core::ModuleInfo info, host_.Create(spec));
    InfoToProto(info, resp->mutable_module());
    spdlog::info("created Linear {} ({} -> {}, bias {}) as module {}", spec.name, spec.in_features,
                 spec.out_features, spec.bias, info.module_id);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* GradwireService::ListModules(grpc::CallbackServerContext* ctx,
                                                       const v1::ListModulesRequest*,
                                                       v1::ListModulesResponse* resp) {
  return RunOnDevice(ctx, "ListModules", [this, resp]() -> absl::Status {
    for (const core::ModuleInfo& info : host_.List()) InfoToProto(info, resp->add_modules());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* GradwireService::DeleteModule(grpc::CallbackServerContext* ctx,
                                                        const v1::DeleteModuleRequest* req,
                                                        v1::DeleteModuleResponse*) {
  return RunOnDevice(ctx, "DeleteModule", [this, req]() -> absl::Status {
    GW_RETURN_IF_ERROR(RequireId("module_id", req->module_id()));
    GW_RETURN_IF_ERROR(host_.Delete(req->module_id()));
    spdlog::info("deleted module {}", req->module_id());
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* GradwireService::Forward(grpc::CallbackServerContext* ctx,
                                                   const v1::ForwardRequest* req,
                                                   v1::ForwardResponse* resp) {
  return RunOnDevice(ctx, "Forward", [this, req, resp]() -> absl::Status {
    GW_RETURN_IF_ERROR(RequireId("module_id", req->module_id()));
    if (!req->has_input()) return absl::InvalidArgumentError("input is required");
    GW_RETURN_IF_ERROR(CheckOutputDType(req->output_dtype(), "output_dtype"));
    GW_ASSIGN_OR_RETURN(at::Tensor input, DecodeTensor(req->input(), "input"));
    GW_ASSIGN_OR_RETURN(core::ForwardOutput out,
                        host_.Forward(req->module_id(), input, req->training()));
    GW_RETURN_IF_ERROR(
        EncodeTensor(out.output, req->output_dtype(), "output_dtype", resp->mutable_output()));
    resp->set_context_id(out.context_id);
    resp->set_weight_version(out.weight_version);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* GradwireService::Backward(grpc::CallbackServerContext* ctx,
                                                    const v1::BackwardRequest* req,
                                                    v1::BackwardResponse* resp) {
  return RunOnDevice(ctx, "Backward", [this, req, resp]() -> absl::Status {
    GW_RETURN_IF_ERROR(RequireId("context_id", req->context_id()));
    if (!req->has_grad_output()) return absl::InvalidArgumentError("grad_output is required");
    GW_RETURN_IF_ERROR(CheckOutputDType(req->grad_input_dtype(), "grad_input_dtype"));
    GW_ASSIGN_OR_RETURN(at::Tensor grad_output, DecodeTensor(req->grad_output(), "grad_output"));
    GW_ASSIGN_OR_RETURN(
        at::Tensor grad_input,
        host_.Backward(req->context_id(), grad_output, req->retain(), req->skip_grad_input()));
    if (grad_input.defined()) {
      GW_RETURN_IF_ERROR(EncodeTensor(grad_input, req->grad_input_dtype(), "grad_input_dtype",
                                      resp->mutable_grad_input()));
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* GradwireService::ReleaseContext(grpc::CallbackServerContext* ctx,
                                                          const v1::ReleaseContextRequest* req,
                                                          v1::ReleaseContextResponse*) {
  return RunOnDevice(ctx, "ReleaseContext", [this, req]() -> absl::Status {
    GW_RETURN_IF_ERROR(RequireId("context_id", req->context_id()));
    return host_.ReleaseContext(req->context_id());
  });
}

grpc::ServerUnaryReactor* GradwireService::ApplyGradients(grpc::CallbackServerContext* ctx,
                                                          const v1::ApplyGradientsRequest* req,
                                                          v1::ApplyGradientsResponse* resp) {
  return RunOnDevice(ctx, "ApplyGradients", [this, req, resp]() -> absl::Status {
    GW_RETURN_IF_ERROR(RequireId("module_id", req->module_id()));
    if (!req->has_sgd()) {
      return absl::InvalidArgumentError("optimizer is required (sgd is the one supported)");
    }
    GW_ASSIGN_OR_RETURN(uint64_t version,
                        host_.ApplySgd(req->module_id(), req->sgd().learning_rate()));
    resp->set_weight_version(version);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* GradwireService::GetWeights(grpc::CallbackServerContext* ctx,
                                                      const v1::GetWeightsRequest* req,
                                                      v1::GetWeightsResponse* resp) {
  return RunOnDevice(ctx, "GetWeights", [this, req, resp]() -> absl::Status {
    GW_RETURN_IF_ERROR(RequireId("module_id", req->module_id()));
    GW_RETURN_IF_ERROR(CheckOutputDType(req->dtype(), "dtype"));
    GW_ASSIGN_OR_RETURN(core::WeightsCopy w, host_.GetWeights(req->module_id()));
    GW_RETURN_IF_ERROR(EncodeTensor(w.weight, req->dtype(), "dtype", resp->mutable_weight()));
    if (w.bias.defined()) {
      GW_RETURN_IF_ERROR(EncodeTensor(w.bias, req->dtype(), "dtype", resp->mutable_bias()));
    }
    resp->set_weight_version(w.weight_version);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* GradwireService::SetWeights(grpc::CallbackServerContext* ctx,
                                                      const v1::SetWeightsRequest* req,
                                                      v1::SetWeightsResponse* resp) {
  return RunOnDevice(ctx, "SetWeights", [this, req, resp]() -> absl::Status {
    GW_RETURN_IF_ERROR(RequireId("module_id", req->module_id()));
    if (!req->has_weight()) return absl::InvalidArgumentError("weight is required");
    GW_ASSIGN_OR_RETURN(at::Tensor weight, DecodeTensor(req->weight(), "weight"));
    at::Tensor bias;
    if (req->has_bias()) {
      GW_ASSIGN_OR_RETURN(bias, DecodeTensor(req->bias(), "bias"));
    }
    GW_ASSIGN_OR_RETURN(uint64_t version, host_.SetWeights(req->module_id(), weight, bias));
    resp->set_weight_version(version);
    return absl::OkStatus();
  });
}

}  // namespace gradwire::rpc
