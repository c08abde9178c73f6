#include "server/rpc/call.h"

#include <spdlog/spdlog.h>

#include <exception>

#include "absl/strings/str_cat.h"
#include "server/rpc/service.h"

namespace gradwire::rpc {

Admission& Admission::operator=(Admission&& other) noexcept {
  if (this != &other) {
    Release();
    service_ = std::exchange(other.service_, nullptr);
    module_key_ = std::move(other.module_key_);
    client_key_ = std::move(other.client_key_);
  }
  return *this;
}

void Admission::Release() {
  if (service_ == nullptr) return;
  std::exchange(service_, nullptr)->Dequeued(module_key_, client_key_);
}

namespace {
std::atomic<int64_t> g_live_calls{0};
}  // namespace

int64_t GradwireService::live_calls() { return g_live_calls.load(); }

CallBase::CallBase(GradwireService& service, grpc::CallbackServerContext* ctx, const char* method)
    : service_(service),
      method_(method),
      start_(std::chrono::steady_clock::now()),
      deadline_(ctx->deadline()),
      request_(RequestIdOf(*ctx)),
      caller_(std::make_unique<Caller>()) {
  ++g_live_calls;
}

CallBase::~CallBase() { --g_live_calls; }

bool CallBase::Abandoned(std::chrono::milliseconds slack) const {
  return cancelled_.load(std::memory_order_acquire) ||
         std::chrono::system_clock::now() + slack >= deadline_;
}

absl::Status CallBase::Authenticate(grpc::CallbackServerContext* ctx) {
  absl::StatusOr<Caller> caller = service_.Authenticate(ctx);
  if (!caller.ok()) return caller.status();
  *caller_ = std::move(*caller);
  return absl::OkStatus();
}

void CallBase::Submit(Admission admission, std::function<void()> body,
                      std::function<void(absl::Status)> on_error) {
  SubmitTo(service_.executor_, std::move(admission), std::move(body), std::move(on_error));
}

void CallBase::SubmitTo(core::DeviceExecutor& executor, Admission admission,
                        std::function<void()> body, std::function<void(absl::Status)> on_error) {
  Ref();
  // The executor keeps copyable tasks; the admission rides in a shared holder.
  auto ticket = std::make_shared<Admission>(std::move(admission));
  // Queued under its client, whose share of the device the executor keeps fair.
  executor.Submit(
      caller_->client, [this, ticket = std::move(ticket), body = std::move(body),
                        on_error = std::move(on_error), queued = std::chrono::steady_clock::now()] {
        RequestScope scope(request_);
        ticket->Release();
        if (const auto& observe = service_.options_.on_queue_wait) {
          observe(method_, caller_->client,
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - queued).count());
        }
        absl::Status failed;
        try {
          body();
        } catch (const std::exception& e) {
          failed = absl::InternalError(absl::StrCat(method_, " failed: ", e.what()));
        } catch (...) {
          failed = absl::InternalError(absl::StrCat(method_, " failed with an unknown exception"));
        }
        if (!failed.ok()) {
          spdlog::error("{}", std::string(failed.message()));
          if (on_error) on_error(failed);
        }
        Unref();
      });
}

void CallBase::NoteIds(std::string module_id, std::string context_id) {
  module_id_ = std::move(module_id);
  context_id_ = std::move(context_id);
}

void CallBase::Report() const {
  service_.Report(method_, status_,
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(),
                  module_id_, context_id_, *caller_, request_);
}

}  // namespace gradwire::rpc
