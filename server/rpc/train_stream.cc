// The Train bidi stream: pipelined forwards, backwards and releases with bounded read-ahead.
#include <spdlog/spdlog.h>

#include <chrono>
#include <deque>
#include <memory>
#include <mutex>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "server/rpc/service.h"
#include "server/rpc/status_map.h"

namespace gradwire::rpc {

// Reads requests while fewer than `read_ahead` are unanswered, runs each on the device executor
// in arrival order, writes responses one at a time in completion order, and finishes once the
// client is done (or the call is cancelled) and nothing is left in flight. Every context a forward
// on this stream created and no backward consumed is released at the end.
class TrainReactor final : public grpc::ServerBidiReactor<v1::TrainRequest, v1::TrainResponse> {
 public:
  TrainReactor(GradwireService& service, grpc::CallbackServerContext* ctx)
      : service_(service), ctx_(ctx), start_(std::chrono::steady_clock::now()) {
    ++service_.streams_open_;
    auto caller = service_.Authenticate(ctx);
    if (!caller.ok()) {
      status_ = caller.status();
      finished_ = true;
      Finish(ToGrpc(status_));
      return;
    }
    caller_ = std::move(*caller);
    limit_ = std::max(1, service_.options_.stream_read_ahead);
    std::lock_guard<std::mutex> lock(mu_);
    StartReadLocked();
  }

  void OnReadDone(bool ok) override {
    // The message and its queue admission first, outside the stream's lock: admission looks the
    // context up in the store's live index and takes the queue lock, and neither belongs under the
    // stream's lock. No other read is in flight until this one starts the next, so `incoming_` is
    // ours here.
    std::shared_ptr<v1::TrainRequest> request;
    std::string queue_key;
    absl::Status refused;
    if (ok) {
      request = std::make_shared<v1::TrainRequest>(std::move(incoming_));
      incoming_.Clear();
      // Each message counts against its module's queue limit like a unary call; one refused gets
      // its RESOURCE_EXHAUSTED answer now, in its turn among the responses.
      const std::string* module_id = &kNone;
      const std::string* context_id = &kNone;
      if (request->has_forward()) module_id = &request->forward().module_id();
      if (request->has_backward()) context_id = &request->backward().context_id();
      if (request->has_release()) context_id = &request->release().context_id();
      refused = service_.AdmitQueued(caller_, *module_id, *context_id, &queue_key);
    }
    std::lock_guard<std::mutex> lock(mu_);
    reading_ = false;
    if (!ok) {  // the client is done writing (or the call broke)
      read_done_ = true;
      MaybeFinishLocked();
      return;
    }
    ++service_.stream_requests_read_;
    ++unanswered_;
    if (!refused.ok()) {
      v1::TrainResponse resp;
      resp.set_request_id(request->request_id());
      resp.set_code(int(ToGrpc(refused).error_code()));
      resp.set_message(std::string(refused.message()));
      RespondLocked(std::move(resp));
    } else {
      service_.executor_.Submit([this, request, queue_key = std::move(queue_key)] {
        if (!queue_key.empty()) service_.Dequeued(queue_key);
        Process(*request);
      });
    }
    if (unanswered_ < limit_) StartReadLocked();
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = false;
    outgoing_.pop_front();
    --unanswered_;
    if (!ok) broken_ = true;
    if (broken_) DropQueuedLocked();
    if (!outgoing_.empty()) {
      writing_ = true;
      StartWrite(&outgoing_.front());
    }
    if (!reading_ && !read_done_ && !broken_ && unanswered_ < limit_) StartReadLocked();
    MaybeFinishLocked();
  }

  void OnCancel() override {
    std::lock_guard<std::mutex> lock(mu_);
    broken_ = true;
    status_ = absl::CancelledError("the Train stream was cancelled");
    if (!writing_) DropQueuedLocked();
    MaybeFinishLocked();
  }

  void OnDone() override {
    ReleaseLeftovers();
    --service_.streams_open_;
    service_.Report(
        "Train", status_,
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(), {}, {},
        caller_.tenant);
    delete this;
  }

 private:
  // After a cancel or a failed write nothing more is written: responses not being written now are
  // dropped (they count as answered).
  void DropQueuedLocked() {
    unanswered_ -= int(outgoing_.size());
    outgoing_.clear();
  }

  void StartReadLocked() {
    if (reading_ || read_done_ || broken_ || finished_) return;
    reading_ = true;
    StartRead(&incoming_);
  }

  // On the executor.
  void Process(const v1::TrainRequest& req) {
    v1::TrainResponse resp;
    resp.set_request_id(req.request_id());
    absl::Status status;
    if (ctx_->IsCancelled()) {
      status = absl::CancelledError("the Train stream was cancelled");
    } else if (auto too_big = service_.CheckRequestBytes(req); !too_big.ok()) {
      status = too_big;  // per message, as for the unary calls
    } else {
      try {
        switch (req.op_case()) {
          case v1::TrainRequest::kForward:
            status = service_.DoForward(caller_, req.forward(), resp.mutable_forward(), ctx_);
            if (status.ok() && !resp.forward().context_id().empty()) {
              std::lock_guard<std::mutex> lock(mu_);
              contexts_.insert(resp.forward().context_id());
            }
            break;
          case v1::TrainRequest::kBackward:
            status = service_.DoBackward(caller_, req.backward(), resp.mutable_backward(), ctx_);
            if (status.ok() && !req.backward().retain()) {
              std::lock_guard<std::mutex> lock(mu_);
              contexts_.erase(req.backward().context_id());
            }
            break;
          case v1::TrainRequest::kRelease:
            status = service_.DoRelease(caller_, req.release());
            if (status.ok()) {
              resp.mutable_release();
              std::lock_guard<std::mutex> lock(mu_);
              contexts_.erase(req.release().context_id());
            }
            break;
          default:
            status = absl::InvalidArgumentError(
                absl::StrCat("request ", req.request_id(), ": set forward, backward or release"));
        }
      } catch (const std::exception& e) {
        status = absl::InternalError(absl::StrCat("Train request failed: ", e.what()));
      }
    }
    if (!status.ok()) {
      resp.clear_result();
      resp.set_code(int(ToGrpc(status).error_code()));
      resp.set_message(std::string(status.message()));
    }
    std::lock_guard<std::mutex> lock(mu_);
    RespondLocked(std::move(resp));
  }

  // Queues a response for writing (dropped when nobody will read it).
  void RespondLocked(v1::TrainResponse resp) {
    if (broken_) {
      --unanswered_;
      MaybeFinishLocked();
      return;
    }
    outgoing_.push_back(std::move(resp));
    if (!writing_) {
      writing_ = true;
      StartWrite(&outgoing_.front());
    }
  }

  void MaybeFinishLocked() {
    if (finished_ || writing_ || unanswered_ > 0) return;
    if (!read_done_ && !broken_) return;
    finished_ = true;
    Finish(ToGrpc(status_));
  }

  void ReleaseLeftovers() {
    std::unordered_set<std::string> left;
    {
      std::lock_guard<std::mutex> lock(mu_);
      left.swap(contexts_);
    }
    ReleaseUnconsumed(service_.executor_, service_.host_,
                      std::vector<std::string>(left.begin(), left.end()),
                      core::ContextStore::ReleaseReason::kStreamEnded,
                      "Train stream ended before the backwards of its contexts");
  }

  static inline const std::string kNone;

  GradwireService& service_;
  grpc::CallbackServerContext* ctx_;
  const std::chrono::steady_clock::time_point start_;
  Caller caller_;
  int limit_ = 8;
  absl::Status status_;

  std::mutex mu_;  // guards everything below
  v1::TrainRequest incoming_;
  std::deque<v1::TrainResponse> outgoing_;  // front is being written while writing_
  std::unordered_set<std::string> contexts_;
  int unanswered_ = 0;  // read, response not yet written
  bool reading_ = false;
  bool writing_ = false;
  bool read_done_ = false;
  bool broken_ = false;
  bool finished_ = false;
};

grpc::ServerBidiReactor<v1::TrainRequest, v1::TrainResponse>* GradwireService::Train(
    grpc::CallbackServerContext* ctx) {
  return new TrainReactor(*this, ctx);
}

}  // namespace gradwire::rpc
