// The Train bidi stream: pipelined forwards, backwards and releases with bounded read-ahead.
#include <spdlog/spdlog.h>

#include <chrono>
#include <deque>
#include <memory>
#include <mutex>
#include <unordered_set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/rpc/service.h"
#include "server/rpc/status_map.h"

namespace gradwire::rpc {

// Reads requests while fewer than `read_ahead` are unanswered, runs each on the device executor
// in arrival order, writes responses one at a time in completion order, and finishes once the
// client is done (or the call is cancelled) and nothing is left in flight. Every context a forward
// on this stream created and no backward consumed is released at the end.
//
// The lifecycle is call.h's, per message: each request read is admitted (ownership, then the
// queue bounds) and submitted holding a reference to the call. A request read after the call
// finished (a read that completes after a cancel) is dropped unrun, and the call finishes only
// when every submitted request has answered, so no work can reach a call gRPC is done with.
class TrainCall final : public Call<grpc::ServerBidiReactor<v1::TrainRequest, v1::TrainResponse>> {
 public:
  TrainCall(GradwireService& service, grpc::CallbackServerContext* ctx)
      : Call(service, ctx, "Train") {
    ++service_.streams_open_;
    if (absl::Status s = Authenticate(ctx); !s.ok()) {
      End(s);
      return;
    }
    limit_ = std::max(1, service_.options_.stream_read_ahead);
    std::lock_guard<std::mutex> lock(mu_);
    StartReadLocked();
  }

  void OnReadDone(bool ok) override {
    // The message and its admission first, outside the call's lock: admission looks the module and
    // the context up and takes the queue lock, and neither belongs under the call's lock. No other
    // read is in flight until this one starts the next, so `incoming_` is ours here.
    std::shared_ptr<v1::TrainRequest> request;
    Admission admission;
    absl::Status refused;
    if (ok) {
      request = std::make_shared<v1::TrainRequest>(std::move(incoming_));
      incoming_.Clear();
      // Each message counts against the queue bounds like a unary call; one refused gets its
      // answer now, in its turn among the responses.
      const std::string* module_id = &kNone;
      const std::string* context_id = &kNone;
      if (request->has_forward()) module_id = &request->forward().module_id();
      if (request->has_backward()) context_id = &request->backward().context_id();
      if (request->has_release()) context_id = &request->release().context_id();
      refused = service_.Admit(caller(), *module_id, *context_id, &admission);
    }
    std::lock_guard<std::mutex> lock(mu_);
    reading_ = false;
    if (!ok) {  // the client is done writing (or the call broke)
      read_done_ = true;
      MaybeFinishLocked();
      return;
    }
    if (finished_ || broken_) return;  // nobody will read an answer: dropped, admission returned
    ++service_.stream_requests_read_;
    ++unanswered_;
    if (!refused.ok()) {
      v1::TrainResponse resp;
      resp.set_request_id(request->request_id());
      resp.set_code(int(ToGrpc(refused).error_code()));
      resp.set_message(std::string(refused.message()));
      RespondLocked(std::move(resp));
    } else {
      Submit(
          std::move(admission), [this, request] { Process(*request); },
          [this, request](absl::Status failed) {
            // Process itself failed past its own guard: answer so the stream can finish.
            v1::TrainResponse resp;
            resp.set_request_id(request->request_id());
            resp.set_code(int(ToGrpc(failed).error_code()));
            resp.set_message(std::string(failed.message()));
            std::lock_guard<std::mutex> lock(mu_);
            RespondLocked(std::move(resp));
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
    if (!outgoing_.empty() && !finished_) {
      writing_ = true;
      StartWrite(&outgoing_.front());
    }
    if (!reading_ && !read_done_ && !broken_ && unanswered_ < limit_) StartReadLocked();
    MaybeFinishLocked();
  }

 private:
  void Cancelled() override {
    std::lock_guard<std::mutex> lock(mu_);
    broken_ = true;
    if (status_.ok()) status_ = absl::CancelledError("the Train stream was cancelled");
    if (!writing_) DropQueuedLocked();
    MaybeFinishLocked();
  }

  void Ended() override {
    ReleaseLeftovers();
    --service_.streams_open_;
  }

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
    if (Abandoned()) {
      status = absl::CancelledError("the Train stream was cancelled");
    } else if (auto too_big = service_.CheckRequestBytes(int64_t(req.ByteSizeLong()));
               !too_big.ok()) {
      status = too_big;  // per message, as for the unary calls
    } else {
      switch (req.op_case()) {
        case v1::TrainRequest::kForward:
          status = service_.DoForward(caller(), req.forward(), resp.mutable_forward(), this);
          if (status.ok() && !resp.forward().context_id().empty()) {
            std::lock_guard<std::mutex> lock(mu_);
            contexts_.insert(resp.forward().context_id());
          }
          break;
        case v1::TrainRequest::kBackward:
          status = service_.DoBackward(caller(), req.backward(), resp.mutable_backward(), this);
          if (status.ok() && !req.backward().retain()) {
            std::lock_guard<std::mutex> lock(mu_);
            contexts_.erase(req.backward().context_id());
          }
          break;
        case v1::TrainRequest::kRelease:
          status = service_.DoRelease(caller(), req.release());
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
    if (broken_ || finished_) {
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
    EndLocked(status_);
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

  int limit_ = 8;
  // Under mu_ (CallBase's):
  v1::TrainRequest incoming_;
  std::deque<v1::TrainResponse> outgoing_;  // front is being written while writing_
  std::unordered_set<std::string> contexts_;
  int unanswered_ = 0;  // read and admitted, response not yet written
  bool reading_ = false;
  bool writing_ = false;
  bool read_done_ = false;
  bool broken_ = false;
};

grpc::ServerBidiReactor<v1::TrainRequest, v1::TrainResponse>* GradwireService::Train(
    grpc::CallbackServerContext* ctx) {
  return new TrainCall(*this, ctx);
}

}  // namespace gradwire::rpc
