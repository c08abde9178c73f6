// The one call lifecycle of server/rpc. Every RPC that reaches the device goes through the same
// steps, in order, whatever its gRPC shape (unary, chunked, the Train stream):
//
//   authenticate -> admit -> submit -> run -> finish -> report
//
// 1. authenticate: the bearer token names the tenant (CallBase::Authenticate, on the reactor).
// 2. admit: the caller may see what the request names (ownership first), then the queue bounds
//    per module and per tenant have room (GradwireService::Admit). What is admitted holds an
//    Admission until its work starts.
// 3. submit: the work is queued on the device executor holding a reference to the call.
// 4. run: skipped with CANCELLED when the call is abandoned; exceptions become INTERNAL. The
//    thread works under the call's request id (request_id.h), so its log lines carry it.
// 5. finish: at most once (End); after it nothing new is admitted, submitted or written. An
//    error's message ends with the request id.
// 6. report: OnDone releases what the client never learnt of, reports once, and drops gRPC's
//    reference.
//
// Lifetime: a call is reference counted. gRPC holds one reference until OnDone; each piece of
// work on the executor holds one until it returns. The call is deleted when the last goes, so
// work that outlives OnDone (a Train request read just before a cancel) still finds its call,
// sees it finished, and touches nothing of gRPC's. No work reads the grpc::ServerContext: the
// deadline is copied at the start and cancellation arrives through OnCancel.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "server/rpc/request_id.h"
#include "server/rpc/status_map.h"

namespace gradwire::core {
class DeviceExecutor;
}

namespace gradwire::rpc {

class GradwireService;
struct Caller;

// A call counted in the queue bounds (its module's and its tenant's) from admission until its
// work starts, or until it is dropped.
class Admission {
 public:
  Admission() = default;
  Admission(GradwireService* service, std::string module_key, std::string client_key)
      : service_(service), module_key_(std::move(module_key)), client_key_(std::move(client_key)) {}
  Admission(Admission&& other) noexcept { *this = std::move(other); }
  Admission& operator=(Admission&& other) noexcept;
  Admission(const Admission&) = delete;
  Admission& operator=(const Admission&) = delete;
  ~Admission() { Release(); }
  void Release();

 private:
  GradwireService* service_ = nullptr;
  std::string module_key_, client_key_;
};

// The part of a call that does not depend on its gRPC shape.
class CallBase {
 public:
  CallBase(GradwireService& service, grpc::CallbackServerContext* ctx, const char* method);
  virtual ~CallBase();
  CallBase(const CallBase&) = delete;
  CallBase& operator=(const CallBase&) = delete;

  // The one definition of abandoned: cancelled (by the client, a broken transport or the deadline,
  // as gRPC reports through OnCancel), or the deadline is less than `slack` away (checked against
  // the clock too, so work stops before gRPC has processed the deadline's cancellation).
  bool Abandoned(std::chrono::milliseconds slack = std::chrono::milliseconds(0)) const;
  const Caller& caller() const { return *caller_; }
  const char* method() const { return method_; }
  const RequestId& request() const { return request_; }

 protected:
  // Step 1, on the reactor, before anything else.
  absl::Status Authenticate(grpc::CallbackServerContext* ctx);
  // Steps 3 and 4: queues `body` on the device executor with a reference to this call held.
  // `admission` is released when the body starts. An exception from `body` is logged and
  // becomes `on_error(INTERNAL)`.
  void Submit(Admission admission, std::function<void()> body,
              std::function<void(absl::Status)> on_error);
  // The same on another executor (the service's control thread).
  void SubmitTo(core::DeviceExecutor& executor, Admission admission, std::function<void()> body,
                std::function<void(absl::Status)> on_error);
  // What the report names (bounded and escaped when reported).
  void NoteIds(std::string module_id, std::string context_id);
  // Step 6, from OnDone.
  void Report() const;

  void Ref() { refs_.fetch_add(1, std::memory_order_relaxed); }
  void Unref() {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) Destroy();
  }
  virtual void Destroy() = 0;

  GradwireService& service_;
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
  std::atomic<int> refs_{1};  // gRPC's, until OnDone
  std::string module_id_, context_id_;
};

// A call of gRPC reactor shape `Reactor`.
template <typename Reactor>
class Call : public Reactor, public CallBase {
 public:
  Call(GradwireService& service, grpc::CallbackServerContext* ctx, const char* method)
      : CallBase(service, ctx, method) {}

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

}  // namespace gradwire::rpc
