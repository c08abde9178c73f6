// The one call lifecycle of server/rpc. Every RPC goes through the same steps, in order, whatever
// its gRPC shape (unary, chunked, the Train stream):
//
//   authenticate -> admit -> submit -> run -> finish -> report
//
// 1. authenticate: the bearer token names the tenant (CallBase::Authenticate, on the reactor).
// 2. admit: the caller may see what the request names (ownership first), then the queue bounds
//    per module and per client have room (CallEnv::Admit, QuotaBook). What is admitted holds an
//    Admission until its work starts.
// 3. submit: the work is queued on an executor holding a reference to the call.
// 4. run: told CANCELLED when the call is abandoned by then; exceptions become INTERNAL. The
//    thread works under the call's request id (request_id.h), so its log lines carry it.
//    Steps 2 to 4 are one step, CallBase::AdmitAndRun, which every call shape uses.
// 5. finish: at most once (End); after it nothing new is admitted, submitted or written. An
//    error's message ends with the request id.
// 6. report: OnDone releases what the client never learnt of, reports once, and drops gRPC's
//    reference.
//
// Lifetime: a call is reference counted. gRPC holds one reference until OnDone; each piece of
// work on an executor holds one until it returns. The call is deleted when the last goes, so
// work that outlives OnDone (a Train request read just before a cancel) still finds its call,
// sees it finished, and touches nothing of gRPC's. No work reads the grpc::ServerContext: the
// deadline is copied at the start and cancellation arrives through OnCancel.
//
// A call sees the service only through its CallEnv: the service's part of the steps above, the
// executors, the options. What a call computes is handed to it as a function.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/core/contexts/context_store.h"
#include "server/rpc/options.h"
#include "server/rpc/quota_book.h"
#include "server/rpc/request_id.h"
#include "server/rpc/status_map.h"

namespace gradwire::core {
class DeviceExecutor;
class ModuleHost;
struct ModuleInfo;
}  // namespace gradwire::core

namespace gradwire::rpc {

// Who is calling. Without tokens every caller sees every module (`isolated` false); with tokens
// a caller sees only its tenant's modules and contexts.
struct Caller {
  bool isolated = false;
  std::string tenant;
  // Whom per-client limits count against: the tenant with tokens, else the peer's address
  // (without its port, so reconnecting does not make a new client).
  std::string client;
  std::string peer;  // gRPC's peer string: "ipv4:127.0.0.1:51234", "unix:..."
  // The call's "gradwire-route" header (kRouteHeader), "" without one: the module a proxy in
  // front of several servers routed it by (docs/scaling-out.md). A call about another module is
  // refused (CheckRoute).
  std::string route;
};

// The metadata header a client names a call's module in, for proxies that route on it.
inline constexpr char kRouteHeader[] = "gradwire-route";

// What a call needs of the service, and all it sees of it. The service owns one and hands it to
// every call it starts.
class CallEnv {
 public:
  // `host`, `executor`, `options` and `quotas` must outlive the environment.
  CallEnv(core::ModuleHost& host, scheduling::DeviceExecutor& executor,
          const ServiceOptions& options, QuotaBook& quotas);
  // Joins the control thread: work still running there finishes against a live service.
  ~CallEnv();
  CallEnv(const CallEnv&) = delete;
  CallEnv& operator=(const CallEnv&) = delete;

  const ServiceOptions& options() const { return options_; }
  QuotaBook& quotas() { return quotas_; }
  // Where compute runs (one per device).
  scheduling::DeviceExecutor& executor() { return executor_; }
  // Where host-only work runs (module creation, shared-memory registration), so that it never
  // holds the device executor while other clients wait.
  scheduling::DeviceExecutor& control() { return *control_; }

  // Step 1: who `ctx` is; UNAUTHENTICATED when tokens are on and it has none that is valid.
  absl::StatusOr<Caller> Authenticate(const grpc::CallbackServerContext* ctx) const;
  // INVALID_ARGUMENT for a malformed id; NOT_FOUND (as for an unknown id) when the caller's tenant
  // does not own it.
  // Both also refuse a call whose route header names another module (CheckRoute); a context's
  // module is the one its forward ran.
  // `admitted`: the context's module as the call's admission found it (Admit's `module`), whose
  // ownership and route were checked there and never change; empty, they are looked up here.
  absl::Status CheckModule(const Caller& caller, const std::string& module_id) const;
  absl::Status CheckContext(const Caller& caller, const std::string& context_id,
                            const std::string& admitted = {}) const;
  // INVALID_ARGUMENT when the call has a route header and it is not `module_id`: a proxy routed
  // the call by another module than the one it is about, and serving it here would hide the
  // routing fault (the module's calls would be split over servers). Without a header, OK.
  static absl::Status CheckRoute(const Caller& caller, absl::string_view module_id);
  // Step 2: ownership, then the queue bounds. A call naming a module must name one the caller may
  // see (NOT_FOUND otherwise, before anything is counted); a call naming a context counts for
  // that context's module only when the caller may see the context. Every call counts for its
  // client. With `admission` null only ownership is checked (work that never waits in a queue).
  // `module`, when given, gets the module the call counts for: the one it names, or its context's
  // (live, the caller's, its route checked here); empty when neither.
  absl::Status Admit(const Caller& caller, const std::string& module_id,
                     const std::string& context_id, Admission* admission,
                     std::string* module = nullptr);
  // Take-over on first touch (docs/scaling-out.md). With checkpoints, a call about a module this
  // server does not have may be about one whose checkpoint is in the directory: another server's
  // that left, or one not loaded yet. Such a call waits, on the control thread (reading storage
  // never blocks a reactor), for the module to be taken over, and is admitted after (ownership
  // is then checked against the loaded module's tenant).
  //
  // The module a call must wait for: the one it names (unless its route header names another:
  // that call is refused as it is, and moves nothing), or, naming neither a module nor a context,
  // the one its route header names; empty when the module is here and no take-over of it is
  // pending. A call naming only a context takes nothing over: its context cannot be here when its
  // module is not, and it fails as it would anyway. A non-empty answer
  // counts the call as waiting for it until TakeOverDone, so that later calls about the module
  // queue behind it and keep their order.
  std::string ToTakeOver(const Caller& caller, const std::string& module_id,
                         const std::string& context_id);
  void TakeOverDone(const std::string& module_id);
  // On the control thread: takes `module_id` over from the checkpoint directory unless it is
  // here. OK too when it has no checkpoint: the call then fails as for any unknown module.
  absl::Status TakeOver(const std::string& module_id);
  // Counts a module made before this call (restored or taken over from a checkpoint) for its
  // tenant's parameter quota, whatever the quota.
  void CountExisting(const core::ModuleInfo& info);
  // A backward's or release's NOT_FOUND for an unknown context, told why when its route header
  // names a module the caller may see that this server process took over from a checkpoint (a
  // restart, or a move from a server that left): the context was made before, by another process.
  // Any other status as it is.
  absl::Status ExplainLostContext(const Caller& caller, absl::Status status) const;
  // RESOURCE_EXHAUSTED naming --max-request-bytes when `bytes` is over it.
  absl::Status CheckRequestBytes(int64_t bytes) const;
  // Step 6: logs and metrics of one finished call; ids are bounded and escaped here.
  void Report(const char* method, const absl::Status& status, double seconds,
              const std::string& module_id, const std::string& context_id, const Caller& caller,
              const RequestId& request) const;
  // Releases contexts nobody will consume (a forward's response that never arrived, a Train
  // stream's leftovers) on the device executor, in order behind the work queued there, never on
  // the calling reactor thread: the context store's lock may be held across an offload copy.
  // Logs `what` with what was released.
  void ReleaseUnconsumed(std::vector<std::string> ids, core::ContextStore::ReleaseReason reason,
                         std::string what);

  // Train streams open now and the requests they have read (tests, metrics).
  std::atomic<int64_t> streams_open{0};
  std::atomic<int64_t> stream_requests_read{0};

 private:
  core::ModuleHost& host_;
  scheduling::DeviceExecutor& executor_;
  const ServiceOptions& options_;
  QuotaBook& quotas_;
  std::mutex takeover_mu_;                  // guards waiting_for_
  std::map<std::string, int> waiting_for_;  // calls waiting for a take-over, by module
  std::unique_ptr<scheduling::DeviceExecutor> control_;
};

// The part of a call that does not depend on its gRPC shape.
class CallBase {
 public:
  CallBase(CallEnv& env, grpc::CallbackServerContext* ctx, const char* method);
  virtual ~CallBase();
  CallBase(const CallBase&) = delete;
  CallBase& operator=(const CallBase&) = delete;

  // Calls alive now (admitted or not, until gRPC's OnDone and the last queued work), for tests.
  static int64_t live_calls();

  // The one definition of abandoned: cancelled (by the client, a broken transport or the deadline,
  // as gRPC reports through OnCancel), or the deadline is less than `slack` away (checked against
  // the clock too, so work stops before gRPC has processed the deadline's cancellation).
  bool Abandoned(std::chrono::milliseconds slack = std::chrono::milliseconds(0)) const;
  const Caller& caller() const { return *caller_; }
  const char* method() const { return method_; }
  const RequestId& request() const { return request_; }

  // A reference to the call, held until the pointer is dropped: work that finishes the call
  // after its queued task returned (a job of a batch) holds one.
  std::shared_ptr<const CallBase> Hold() const {
    const_cast<CallBase*>(this)->Ref();
    return std::shared_ptr<const CallBase>(
        this, [](const CallBase* c) { const_cast<CallBase*>(c)->Unref(); });
  }

  // What queues a call's work instead of its executor (the batch former, which runs it on the
  // device executor in a batch): see AdmitAndRun. `module`: the module the admission counted the
  // call for (CallEnv::Admit's), so that the work need not look a context's up again.
  using Submitter = std::function<void(std::function<void()> task, const std::string& module)>;

  // Where a call's work runs.
  enum class RunOn {
    kDevice,   // the device executor (compute)
    kControl,  // the control thread (host-only work)
    kInline,   // here, before AdmitAndRun returns (counters only; it never queues)
  };

 protected:
  // Step 1, on the reactor, before anything else.
  absl::Status Authenticate(grpc::CallbackServerContext* ctx);
  // Steps 2 to 4: admits the call for `module_id` / `context_id`, then queues `run` on `on` with
  // a reference to this call held; the admission is released when `run` starts. `run` gets OK, or
  // CANCELLED when the call was abandoned before it started (it must then only answer). An
  // exception from `run` is logged and becomes `on_error(INTERNAL)`. Returns the refusal, and
  // runs nothing, when the call is not admitted. Inline work is counted in no queue.
  // `submit`, when given, queues the work instead of `on`'s executor (a batch former that puts
  // it in a batch and runs it on the device executor).
  // When the module must be taken over first (CallEnv::ToTakeOver), all of this happens on the
  // control thread once it is, and a refusal then reaches `on_error`.
  absl::Status AdmitAndRun(const std::string& module_id, const std::string& context_id, RunOn on,
                           std::function<void(absl::Status started)> run,
                           std::function<void(absl::Status)> on_error, Submitter submit = nullptr);
  // What the report names (bounded and escaped when reported).
  void NoteIds(std::string module_id, std::string context_id);
  // Step 6, from OnDone.
  void Report() const;

  void Ref() { refs_.fetch_add(1, std::memory_order_relaxed); }
  void Unref() {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) Destroy();
  }
  virtual void Destroy() = 0;

  CallEnv& env_;
  const char* const method_;
  const std::chrono::steady_clock::time_point start_;
  const std::chrono::system_clock::time_point deadline_;
  const RequestId request_;  // the client's traceparent, or made here: in its logs and errors
  std::unique_ptr<Caller> caller_;
  std::atomic<bool> cancelled_{false};

  // Guards finished_ and status_, and the state of the derived call.
  std::mutex mu_;
  bool finished_ = false;  // Finish was called: nothing new starts on this call
  absl::Status status_;    // what the call finished with (reported)

 private:
  // AdmitAndRun's steps once the module is here.
  absl::Status AdmitAndQueue(const std::string& module_id, const std::string& context_id, RunOn on,
                             std::function<void(absl::Status started)> run,
                             std::function<void(absl::Status)> on_error, Submitter submit);

  std::atomic<int> refs_{1};  // gRPC's, until OnDone
  std::string module_id_, context_id_;
};

// A call of gRPC reactor shape `Reactor`.
template <typename Reactor>
class Call : public Reactor, public CallBase {
 public:
  Call(CallEnv& env, grpc::CallbackServerContext* ctx, const char* method)
      : CallBase(env, ctx, method) {}

  void OnCancel() final {
    RequestScope scope(request_);
    cancelled_.store(true, std::memory_order_release);
    Cancelled();
  }
  void OnDone() final {
    RequestScope scope(request_);
    Ended();
    Report();
    Unref();
  }

 protected:
  // Step 5: finishes the call with `status` unless it finished already (then false).
  bool EndLocked(absl::Status status) {
    if (finished_) return false;
    finished_ = true;
    status_ = std::move(status);
    this->Finish(ToGrpc(WithRequestId(status_, request_)));
    return true;
  }
  bool End(absl::Status status) {
    std::lock_guard<std::mutex> lock(mu_);
    return EndLocked(std::move(status));
  }
  // On the gRPC thread that saw the cancellation; must not block.
  virtual void Cancelled() {}
  // From OnDone, before the report: release what a client that never got the status cannot know.
  virtual void Ended() {}

 private:
  void Destroy() final { delete this; }
};

// What --max-request-bytes measures of a unary call: a parsed message's size, or a raw one's
// length; negative: nothing to check.
struct RequestSize {
  RequestSize() = default;
  RequestSize(const google::protobuf::Message* m)  // NOLINT: implicit from a request pointer
      : bytes(m != nullptr ? int64_t(m->ByteSizeLong()) : -1) {}
  explicit RequestSize(int64_t n) : bytes(n) {}
  int64_t bytes = -1;
};

// A unary call's work: runs once, unless the call was abandoned before it started, and returns
// the status the call finishes with.
using UnaryWork = std::function<absl::Status(const Caller&, const CallBase&)>;

// A unary call whose end was handed on by its work (to the rest of a batch): it holds a reference
// to the call until it finishes it. Destroyed unfinished, it finishes the call with INTERNAL.
class PendingUnary {
 public:
  virtual ~PendingUnary() = default;
  // Finishes the call with `status` (at most once). `created_context` names a context the work
  // created: released when the response does not reach the client.
  virtual void Finish(absl::Status status, std::string created_context = {}) = 0;
  virtual const CallBase& call() const = 0;
};

// Work that may finish its call later: it returns the status to finish with now, or moves
// `*pending` out, returns OK, and finishes the call through it.
using DeferrableWork = std::function<absl::Status(const Caller&, const CallBase&,
                                                  std::unique_ptr<PendingUnary>* pending)>;

// StartUnary for deferrable work queued by `submit` (which gets the caller, for its client and
// tenant, the task to queue and the module it was admitted for) instead of on an executor: a
// request the dynamic batcher puts in a batch.
grpc::ServerUnaryReactor* StartDeferrableUnary(
    CallEnv& env, grpc::CallbackServerContext* ctx, const char* method, DeferrableWork work,
    std::function<void(const Caller&, std::function<void()> task, const std::string& module)>
        submit,
    std::string module_id, RequestSize request, std::function<std::string()> created_context,
    std::string context_id = {});

// Starts a unary call through the lifecycle: authenticated, measured against --max-request-bytes
// (`request`), admitted for `module_id` / `context_id`, then `work` runs `on` its executor.
// `created_context`, when given, names the context a successful `work` created (read after it
// returns): when its response never reaches the client, the call's end releases it, since nobody
// holds its id. Returns the reactor for gRPC.
grpc::ServerUnaryReactor* StartUnary(CallEnv& env, grpc::CallbackServerContext* ctx,
                                     const char* method, UnaryWork work, std::string module_id = {},
                                     std::string context_id = {}, RequestSize request = {},
                                     std::function<std::string()> created_context = nullptr,
                                     CallBase::RunOn on = CallBase::RunOn::kDevice);

}  // namespace gradwire::rpc
