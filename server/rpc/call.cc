#include "server/rpc/call.h"

#include <spdlog/spdlog.h>

#include <exception>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/common/status_macros.h"
#include "server/core/checkpoints/checkpoint.h"
#include "server/core/kinds/kind_description.h"
#include "server/core/module_host.h"
#include "server/rpc/auth.h"
#include "server/rpc/boundary.h"
#include "server/rpc/scheduling/executor.h"

namespace gradwire::rpc {
namespace {

std::atomic<int64_t> g_live_calls{0};

// The peer's address without its port: "ipv4:10.0.0.7:51234" -> "ipv4:10.0.0.7",
// "ipv6:[::1]:5000" -> "ipv6:[::1]"; anything else (unix sockets) as it is.
std::string PeerHost(const std::string& peer) {
  if (peer.rfind("ipv4:", 0) != 0 && peer.rfind("ipv6:", 0) != 0) return peer;
  const auto colon = peer.rfind(':');
  return colon <= 4 ? peer : peer.substr(0, colon);
}

}  // namespace

CallEnv::CallEnv(core::ModuleHost& host, scheduling::DeviceExecutor& executor,
                 const ServiceOptions& options, QuotaBook& quotas)
    : host_(host),
      executor_(executor),
      options_(options),
      quotas_(quotas),
      control_(std::make_unique<scheduling::DeviceExecutor>("control")) {}

CallEnv::~CallEnv() { control_.reset(); }

absl::StatusOr<Caller> CallEnv::Authenticate(const grpc::CallbackServerContext* ctx) const {
  Caller caller;
  caller.peer = ctx->peer();
  const auto& metadata = ctx->client_metadata();
  if (auto route = metadata.find(kRouteHeader); route != metadata.end()) {
    caller.route.assign(route->second.data(), route->second.size());
  }
  if (options_.authenticator == nullptr) {
    caller.client = "peer " + PeerHost(ctx->peer());
    return caller;
  }
  auto it = metadata.find("authorization");
  const std::string_view header = it == metadata.end()
                                      ? std::string_view()
                                      : std::string_view(it->second.data(), it->second.size());
  GW_ASSIGN_OR_RETURN(caller.tenant, options_.authenticator->Authenticate(header));
  caller.isolated = true;
  caller.client = "tenant " + caller.tenant;
  return caller;
}

absl::Status CallEnv::CheckRoute(const Caller& caller, absl::string_view module_id) {
  if (caller.route.empty() || caller.route == module_id) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "the ", kRouteHeader, " header names module \"", Escaped(caller.route),
      "\" but this call is about module \"", Escaped(module_id),
      "\": a call routed by another module's id is refused (a proxy sends each module's calls "
      "to the server that holds it by this header; docs/scaling-out.md)"));
}

absl::Status CallEnv::CheckModule(const Caller& caller, const std::string& module_id) const {
  GW_RETURN_IF_ERROR(CheckId("module_id", module_id));
  GW_RETURN_IF_ERROR(CheckRoute(caller, module_id));
  return caller.isolated ? host_.CheckTenant(module_id, caller.tenant) : absl::OkStatus();
}

absl::Status CallEnv::CheckContext(const Caller& caller, const std::string& context_id,
                                   const std::string& admitted) const {
  GW_RETURN_IF_ERROR(CheckId("context_id", context_id));
  if (!admitted.empty()) return absl::OkStatus();  // the admission's lookup answered both
  GW_RETURN_IF_ERROR(caller.isolated ? host_.CheckContextTenant(context_id, caller.tenant)
                                     : absl::OkStatus());
  if (caller.route.empty()) return absl::OkStatus();
  // An unknown context fails later with NOT_FOUND, as without a header.
  const std::string module_id =
      host_.contexts().ModuleOf(context_id, caller.isolated ? &caller.tenant : nullptr);
  return module_id.empty() ? absl::OkStatus() : CheckRoute(caller, module_id);
}

absl::Status CallEnv::Admit(const Caller& caller, const std::string& module_id,
                            const std::string& context_id, Admission* admission,
                            std::string* module) {
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
    if (!module_key.empty()) GW_RETURN_IF_ERROR(CheckRoute(caller, module_key));
  }
  if (module != nullptr) *module = module_key;
  if (admission == nullptr) return absl::OkStatus();
  return quotas_.Admit(caller.client, std::move(module_key), admission);
}

std::string CallEnv::ToTakeOver(const Caller& caller, const std::string& module_id,
                                const std::string& context_id) {
  if (options_.checkpointer == nullptr || (module_id.empty() && !context_id.empty())) return {};
  const std::string& id = module_id.empty() ? caller.route : module_id;
  if (id.empty() || !CheckId("module_id", id).ok() || !CheckRoute(caller, id).ok()) return {};
  std::lock_guard<std::mutex> lock(takeover_mu_);
  auto it = waiting_for_.find(id);
  if (it == waiting_for_.end()) {
    if (host_.Has(id)) return {};
    it = waiting_for_.emplace(id, 0).first;
  }
  ++it->second;
  return id;
}

void CallEnv::TakeOverDone(const std::string& module_id) {
  std::lock_guard<std::mutex> lock(takeover_mu_);
  auto it = waiting_for_.find(module_id);
  if (it != waiting_for_.end() && --it->second <= 0) waiting_for_.erase(it);
}

void CallEnv::CountExisting(const core::ModuleInfo& info) {
  if (info.tenant.empty()) return;
  quotas_.CountExisting(info.module_id, "tenant " + info.tenant,
                        core::ParameterCount(info.spec) * int64_t(sizeof(float)));
}

absl::Status CallEnv::TakeOver(const std::string& module_id) {
  if (options_.checkpointer == nullptr || host_.Has(module_id)) return absl::OkStatus();
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<core::Checkpointer::TakeOver> took = options_.checkpointer->Take(host_, module_id);
  if (took.status().code() == absl::StatusCode::kNotFound ||
      took.status().code() == absl::StatusCode::kAlreadyExists) {
    return absl::OkStatus();
  }
  if (!took.ok()) {
    spdlog::error("cannot take over module {}: {}", module_id,
                  std::string(took.status().message()));
    return absl::Status(took.status().code(),
                        absl::StrCat("module ", module_id,
                                     " could not be taken over from the checkpoint directory: ",
                                     took.status().message()));
  }
  if (absl::StatusOr<core::ModuleInfo> info = host_.Info(module_id); info.ok()) {
    CountExisting(*info);
  }
  spdlog::info(
      "took over module {} from its checkpoint (epoch {}, now held under epoch {}): weight version "
      "{}, {} optimizer steps, in {:.1f} ms",
      module_id, took->from_epoch, took->epoch, took->weight_version, took->optimizer_steps,
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  return absl::OkStatus();
}

absl::Status CallEnv::ExplainLostContext(const Caller& caller, absl::Status status) const {
  if (status.code() != absl::StatusCode::kNotFound || caller.route.empty() ||
      options_.checkpointer == nullptr ||
      status.message().find(" is not a live context") == absl::string_view::npos ||
      !options_.checkpointer->claims().TookOver(caller.route) ||
      !CheckModule(caller, caller.route).ok()) {
    return status;
  }
  return absl::NotFoundError(absl::StrCat(
      status.message(), ": module ", caller.route,
      " came to this server process from its checkpoint (the server restarted, or the server "
      "that held it left), and the contexts made before that were made by another process, "
      "which took them with it; run the forward again"));
}

absl::Status CallEnv::CheckRequestBytes(int64_t bytes) const {
  const int64_t limit = options_.limits.max_request_bytes;
  if (limit <= 0) return absl::OkStatus();
  if (bytes > limit) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the request is ", bytes, " bytes, over the limit of ", limit,
                     " (--max-request-bytes); send fewer rows per call"));
  }
  return absl::OkStatus();
}

void CallEnv::Report(const char* method, const absl::Status& status, double seconds,
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

void CallEnv::ReleaseUnconsumed(std::vector<std::string> ids,
                                core::ContextStore::ReleaseReason reason, std::string what) {
  if (ids.empty()) return;
  // Logged under the request id of the call that let them go, when there is one.
  const RequestId* current = CurrentRequest();
  executor_.Submit([&host = host_, ids = std::move(ids), reason, what = std::move(what),
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

CallBase::CallBase(CallEnv& env, grpc::CallbackServerContext* ctx, const char* method)
    : env_(env),
      method_(method),
      start_(std::chrono::steady_clock::now()),
      deadline_(ctx->deadline()),
      request_(RequestIdOf(*ctx)),
      caller_(std::make_unique<Caller>()) {
  ++g_live_calls;
}

CallBase::~CallBase() { --g_live_calls; }

int64_t CallBase::live_calls() { return g_live_calls.load(); }

bool CallBase::Abandoned(std::chrono::milliseconds slack) const {
  return cancelled_.load(std::memory_order_acquire) ||
         std::chrono::system_clock::now() + slack >= deadline_;
}

absl::Status CallBase::Authenticate(grpc::CallbackServerContext* ctx) {
  absl::StatusOr<Caller> caller = env_.Authenticate(ctx);
  if (!caller.ok()) return caller.status();
  *caller_ = std::move(*caller);
  return absl::OkStatus();
}

absl::Status CallBase::AdmitAndRun(const std::string& module_id, const std::string& context_id,
                                   RunOn on, std::function<void(absl::Status)> run,
                                   std::function<void(absl::Status)> on_error, Submitter submit) {
  const std::string take =
      on == RunOn::kInline ? std::string() : env_.ToTakeOver(*caller_, module_id, context_id);
  if (take.empty()) {
    return AdmitAndQueue(module_id, context_id, on, std::move(run), std::move(on_error),
                         std::move(submit));
  }
  // While it waits for the take-over the call counts for its client's queue bound.
  Admission waiting;
  if (absl::Status s = env_.quotas().Admit(caller_->client, {}, &waiting); !s.ok()) {
    env_.TakeOverDone(take);
    return s;
  }
  Ref();
  auto ticket = std::make_shared<Admission>(std::move(waiting));
  env_.control().Submit(
      caller_->client,
      [this, take, ticket = std::move(ticket), module_id, context_id, on, run = std::move(run),
       on_error = std::move(on_error), submit = std::move(submit)]() mutable {
        RequestScope scope(request_);
        ticket->Release();
        absl::Status s;
        try {
          s = env_.TakeOver(take);
        } catch (const std::exception& e) {
          s = absl::InternalError(absl::StrCat("taking over module ", take, " failed: ", e.what()));
        }
        if (s.ok()) {
          s = AdmitAndQueue(module_id, context_id, on, std::move(run), on_error, std::move(submit));
        }
        env_.TakeOverDone(take);
        if (!s.ok() && on_error) on_error(s);
        Unref();
      });
  return absl::OkStatus();
}

absl::Status CallBase::AdmitAndQueue(const std::string& module_id, const std::string& context_id,
                                     RunOn on, std::function<void(absl::Status)> run,
                                     std::function<void(absl::Status)> on_error, Submitter submit) {
  Admission admission;
  std::string admitted;
  GW_RETURN_IF_ERROR(env_.Admit(*caller_, module_id, context_id,
                                on == RunOn::kInline ? nullptr : &admission, &admitted));
  Ref();
  // The executors keep copyable tasks; the admission rides in a shared holder.
  auto ticket = std::make_shared<Admission>(std::move(admission));
  // Queued under its client, whose share of the device the executor keeps fair.
  auto task = [this, ticket = std::move(ticket), run = std::move(run),
               on_error = std::move(on_error), queued = std::chrono::steady_clock::now(),
               waited = on != RunOn::kInline] {
    RequestScope scope(request_);
    // Out of the queue bounds from here; the module stays busy, safe from its TTL, until the
    // call's work returns (a call admitted while its module was alive finds it).
    ticket->Start();
    if (const auto& observe = env_.options().on_queue_wait; observe && waited) {
      observe(method_, caller_->client,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - queued).count());
    }
    const absl::Status started =
        Abandoned()
            ? absl::CancelledError(absl::StrCat(method_, " was cancelled before it started"))
            : absl::OkStatus();
    absl::Status failed;
    try {
      run(started);
    } catch (const std::exception& e) {
      failed = absl::InternalError(absl::StrCat(method_, " failed: ", e.what()));
    } catch (...) {
      failed = absl::InternalError(absl::StrCat(method_, " failed with an unknown exception"));
    }
    ticket->Release();
    if (!failed.ok()) {
      spdlog::error("{}", std::string(failed.message()));
      if (on_error) on_error(failed);
    }
    Unref();
  };
  switch (on) {
    case RunOn::kInline:
      task();
      break;
    case RunOn::kDevice:
      if (submit) {
        submit(std::move(task), admitted);
      } else {
        env_.executor().Submit(caller_->client, std::move(task));
      }
      break;
    case RunOn::kControl:
      env_.control().Submit(caller_->client, std::move(task));
      break;
  }
  return absl::OkStatus();
}

void CallBase::NoteIds(std::string module_id, std::string context_id) {
  module_id_ = std::move(module_id);
  context_id_ = std::move(context_id);
}

void CallBase::Report() const {
  env_.Report(method_, status_,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(),
              module_id_, context_id_, *caller_, request_);
}

namespace {

// A unary call. When it ends without its status reaching the client (cancelled, past its
// deadline, a broken connection), it releases the context its work created: the client never
// learnt the id, so nobody would consume it and it would pin its saved tensors and weight version
// until the TTL.
class UnaryCall final : public Call<grpc::ServerUnaryReactor> {
 public:
  UnaryCall(CallEnv& env, grpc::CallbackServerContext* ctx, const char* method)
      : Call(env, ctx, method) {}

  void Start(grpc::CallbackServerContext* ctx, DeferrableWork work, std::string module_id,
             std::string context_id, RequestSize request,
             std::function<std::string()> created_context, RunOn on,
             std::function<void(const Caller&, std::function<void()>, const std::string&)> submit =
                 nullptr) {
    NoteIds(module_id, context_id);
    absl::Status refused = Authenticate(ctx);
    if (refused.ok() && request.bytes >= 0) refused = env_.CheckRequestBytes(request.bytes);
    if (refused.ok()) {
      Submitter submitter;
      if (submit) {
        submitter = [this, submit = std::move(submit)](std::function<void()> task,
                                                       const std::string& module) {
          submit(caller(), std::move(task), module);
        };
      }
      refused = AdmitAndRun(
          module_id, context_id, on,
          [this, work = std::move(work),
           created_context = std::move(created_context)](absl::Status started) {
            std::unique_ptr<PendingUnary> pending = std::make_unique<Pending>(this);
            absl::Status status = started;
            // An exception from the work finishes the call here with its cause (as AdmitAndRun
            // words it), not through the pending end's fallback.
            try {
              if (started.ok()) status = work(caller(), *this, &pending);
            } catch (const std::exception& e) {
              status = absl::InternalError(absl::StrCat(method_, " failed: ", e.what()));
              spdlog::error("{}", std::string(status.message()));
            } catch (...) {
              status =
                  absl::InternalError(absl::StrCat(method_, " failed with an unknown exception"));
              spdlog::error("{}", std::string(status.message()));
            }
            if (pending == nullptr) return;  // the work finishes the call later
            static_cast<Pending*>(pending.get())
                ->Finish(status,
                         status.ok() && created_context ? created_context() : std::string());
          },
          [this](absl::Status failed) { End(std::move(failed)); }, std::move(submitter));
    }
    if (!refused.ok()) End(refused);
  }

 private:
  // The call's end, now or later; holds a reference to the call while unfinished.
  class Pending final : public PendingUnary {
   public:
    explicit Pending(UnaryCall* call) : call_(call) { call_->Ref(); }
    ~Pending() override {
      if (call_ != nullptr) {
        Finish(absl::InternalError(absl::StrCat(call_->method_, " failed before it finished")), {});
      }
    }
    void Finish(absl::Status status, std::string created_context) override {
      if (call_ == nullptr) return;
      UnaryCall* call = std::exchange(call_, nullptr);
      if (call->env_.options().before_unary_finish) {
        call->env_.options().before_unary_finish(call->method_, status);
      }
      {
        std::lock_guard<std::mutex> lock(call->mu_);
        if (status.ok()) call->created_ = std::move(created_context);
        call->EndLocked(std::move(status));
      }
      call->Unref();
    }
    const CallBase& call() const override { return *call_; }

   private:
    UnaryCall* call_;
  };

  void Cancelled() override {
    if (env_.options().on_unary_cancel) env_.options().on_unary_cancel(method_);
  }
  void Ended() override {
    // OnDone: finished, so created_ is settled. Past the deadline counts as undelivered even when
    // gRPC did not see the cancellation: the client stopped waiting at its deadline.
    if (!created_.empty() && Abandoned()) {
      env_.ReleaseUnconsumed({std::move(created_)}, core::ContextStore::ReleaseReason::kUndelivered,
                             absl::StrCat(method_, ": response not delivered"));
    }
  }

  std::string created_;  // the context the work created (under mu_)
};

}  // namespace

grpc::ServerUnaryReactor* StartUnary(CallEnv& env, grpc::CallbackServerContext* ctx,
                                     const char* method, UnaryWork work, std::string module_id,
                                     std::string context_id, RequestSize request,
                                     std::function<std::string()> created_context,
                                     CallBase::RunOn on) {
  auto* call = new UnaryCall(env, ctx, method);
  call->Start(
      ctx,
      [work = std::move(work)](const Caller& caller, const CallBase& c,
                               std::unique_ptr<PendingUnary>*) { return work(caller, c); },
      std::move(module_id), std::move(context_id), request, std::move(created_context), on);
  return call;
}

grpc::ServerUnaryReactor* StartDeferrableUnary(
    CallEnv& env, grpc::CallbackServerContext* ctx, const char* method, DeferrableWork work,
    std::function<void(const Caller&, std::function<void()> task, const std::string& module)>
        submit,
    std::string module_id, RequestSize request, std::function<std::string()> created_context,
    std::string context_id) {
  auto* call = new UnaryCall(env, ctx, method);
  call->Start(ctx, std::move(work), std::move(module_id), std::move(context_id), request,
              std::move(created_context), CallBase::RunOn::kDevice, std::move(submit));
  return call;
}

}  // namespace gradwire::rpc
