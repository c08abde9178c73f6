#include "server/rpc/train_stream.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/rpc/scheduling/executor.h"
#include "server/rpc/status_map.h"

namespace gradwire::rpc {
namespace {

// A request's status as its response carries it.
v1::TrainResponse Refusal(uint64_t request_id, const absl::Status& status) {
  v1::TrainResponse resp;
  resp.set_request_id(request_id);
  resp.set_code(int(ToGrpc(status).error_code()));
  resp.set_message(std::string(status.message()));
  return resp;
}

// Reads requests while fewer than `read_ahead` are unanswered, runs each on the device executor
// in arrival order (its forwards and backwards batched with other calls' where that order holds),
// writes responses one at a time in completion order, and finishes once the
// client is done (or the call is cancelled) and nothing is left in flight. Every context a forward
// on this stream created and no backward consumed is released at the end.
//
// The lifecycle is call.h's, per message: each request read is counted as unanswered, then
// admitted (ownership, then the queue bounds) and run through AdmitAndRun like a unary call. A
// request read after the call finished (a read that completes after a cancel) is dropped unrun,
// and the call finishes only when every counted request has answered, so no work can reach a
// call gRPC is done with.
class TrainCall final : public Call<grpc::ServerBidiReactor<v1::TrainRequest, v1::TrainResponse>> {
 public:
  TrainCall(CallEnv& env, grpc::CallbackServerContext* ctx, const TrainBodies& bodies)
      : Call(env, ctx, "Train"), bodies_(bodies) {
    ++env_.streams_open;
    if (absl::Status s = Authenticate(ctx); !s.ok()) {
      End(s);
      return;
    }
    limit_ = std::max(1, env_.options().stream_read_ahead);
    std::lock_guard<std::mutex> lock(mu_);
    StartReadLocked();
  }

  void OnReadDone(bool ok) override {
    // No other read is in flight until this one starts the next, so `incoming_` is ours here.
    std::shared_ptr<v1::TrainRequest> request;
    {
      std::lock_guard<std::mutex> lock(mu_);
      reading_ = false;
      if (!ok) {  // the client is done writing (or the call broke)
        read_done_ = true;
        MaybeFinishLocked();
        return;
      }
      if (finished_ || broken_) return;  // nobody will read an answer: dropped unrun
      request = std::make_shared<v1::TrainRequest>(std::move(incoming_));
      incoming_.Clear();
      // Counted before it is admitted, so the call cannot finish before it answers.
      ++env_.stream_requests_read;
      ++unanswered_;
    }
    // Admission outside the call's lock: it looks the module and the context up and takes the
    // quota book's lock, and neither belongs under the call's lock. Each message counts against
    // --max-request-bytes and the queue bounds like a unary call; one refused gets its answer
    // now, in its turn among the responses.
    absl::Status refused = env_.CheckRequestBytes(int64_t(request->ByteSizeLong()));
    if (refused.ok()) refused = Submit(request);
    std::lock_guard<std::mutex> lock(mu_);
    if (!refused.ok()) RespondLocked(Refusal(request->request_id(), refused));
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
    --env_.streams_open;
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

  // Admits `request` and queues it: a forward or a backward as a job of the pipeline, which keeps
  // the stream's order (order_), anything else on the device executor. On the reactor, one
  // request at a time.
  absl::Status Submit(const std::shared_ptr<v1::TrainRequest>& request) {
    auto on_error = [this, request](absl::Status failed) {
      // The work failed past its own guard: answer so the stream can finish.
      std::lock_guard<std::mutex> lock(mu_);
      RespondLocked(Refusal(request->request_id(), failed));
    };
    if (request->has_forward() || request->has_backward()) {
      auto resp = std::make_shared<v1::TrainResponse>();
      resp->set_request_id(request->request_id());
      auto done = [this, request, resp](absl::Status status) {
        Answer(*request, std::move(*resp), status);
      };
      StepEntry entry;
      const std::string* module_id = &kNone;
      const std::string* context_id = &kNone;
      if (request->has_forward()) {
        module_id = &request->forward().module_id();
        entry = bodies_.steps->Forward(
            *this, {&request->forward(), resp->mutable_forward(), nullptr, std::move(done)},
            &order_);
      } else {
        context_id = &request->backward().context_id();
        entry = bodies_.steps->Backward(
            *this, {&request->backward(), resp->mutable_backward(), nullptr, std::move(done)},
            &order_);
      }
      return AdmitAndRun(*module_id, *context_id, RunOn::kDevice, std::move(entry.run),
                         std::move(on_error), std::move(entry.submit));
    }
    const std::string* context_id =
        request->has_release() ? &request->release().context_id() : &kNone;
    return AdmitAndRun(
        kNone, *context_id, RunOn::kDevice,
        [this, request](absl::Status started) { Process(*request, started); }, std::move(on_error),
        [this](std::function<void()> task, const std::string&) {
          order_.Alone();  // later jobs of the stream must not overtake it
          env_.executor().Submit(caller().client, std::move(task));
        });
  }

  // A release (or a request that names nothing to do), on the executor (`started`: see
  // AdmitAndRun).
  void Process(const v1::TrainRequest& req, const absl::Status& started) {
    v1::TrainResponse resp;
    resp.set_request_id(req.request_id());
    absl::Status status;
    if (!started.ok()) {
      status = absl::CancelledError("the Train stream was cancelled");
    } else if (req.has_release()) {
      status = bodies_.release(caller(), req.release());
    } else {
      status = absl::InvalidArgumentError(
          absl::StrCat("request ", req.request_id(), ": set forward, backward or release"));
    }
    Answer(req, std::move(resp), status);
  }

  // A request's answer: the contexts the stream holds updated, then its response queued.
  void Answer(const v1::TrainRequest& req, v1::TrainResponse resp, const absl::Status& status) {
    std::lock_guard<std::mutex> lock(mu_);
    if (status.ok()) {
      if (req.has_forward() && !resp.forward().context_id().empty()) {
        contexts_.insert(resp.forward().context_id());
      } else if (req.has_backward() && !req.backward().retain()) {
        contexts_.erase(req.backward().context_id());
      } else if (req.has_release()) {
        resp.mutable_release();
        contexts_.erase(req.release().context_id());
      }
    } else {
      resp.clear_result();
      resp.set_code(int(ToGrpc(status).error_code()));
      resp.set_message(std::string(status.message()));
    }
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
    env_.ReleaseUnconsumed(std::vector<std::string>(left.begin(), left.end()),
                           core::ContextStore::ReleaseReason::kStreamEnded,
                           "Train stream ended before the backwards of its contexts");
  }

  static inline const std::string kNone;

  const TrainBodies& bodies_;
  int limit_ = 8;
  StepPipeline::Order order_;  // on the reactor, one read at a time
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

}  // namespace

grpc::ServerBidiReactor<v1::TrainRequest, v1::TrainResponse>* StartTrain(
    CallEnv& env, grpc::CallbackServerContext* ctx, const TrainBodies& bodies) {
  return new TrainCall(env, ctx, bodies);
}

}  // namespace gradwire::rpc
