// The chunked RPCs: ForwardChunked, BackwardChunked, GetWeightsChunked and SetWeightsChunked.
// Each reads its request (header, then chunks placed straight into the tensors), runs the same
// body as the unary call on the device executor, and writes its response as header + chunks. A
// bad sequence finishes the call with INVALID_ARGUMENT at once and frees what was assembled; a
// forward whose response cannot be delivered releases its context.
#include <spdlog/spdlog.h>

#include <chrono>
#include <exception>
#include <memory>
#include <optional>

#include "absl/strings/str_cat.h"
#include "gradwire/wire/chunking.h"
#include "server/rpc/service.h"
#include "server/rpc/status_map.h"

namespace gradwire::rpc {
namespace {

using Clock = std::chrono::steady_clock;

// Header first, then chunks: what a chunked request must look like.
template <typename Req, typename ReqPart>
class PartReader {
 public:
  PartReader(const ServiceOptions& options) : options_(options) {}

  absl::Status Add(ReqPart& part) {
    if (part.has_header()) {
      if (started_) return absl::InvalidArgumentError("the header was sent twice");
      started_ = true;
      request_ = std::move(*part.mutable_header());
      return assembler_.Start(wire::Slots(request_), options_.max_stream_bytes, "--max-stream-mib",
                              options_.chunk_bytes);
    }
    if (!part.has_chunk()) {
      return absl::InvalidArgumentError("a message of a chunked call must set header or chunk");
    }
    if (!started_) {
      return absl::InvalidArgumentError("the first message of a chunked call must be the header");
    }
    return assembler_.Add(part.chunk());
  }

  absl::Status Complete() const {
    if (!started_) return absl::InvalidArgumentError("the chunked call ended before its header");
    return assembler_.Complete();
  }

  Req& request() { return request_; }

 private:
  const ServiceOptions& options_;
  bool started_ = false;
  Req request_;
  wire::ChunkAssembler assembler_;
};

// Header, then chunks of the response.
template <typename Resp, typename RespPart>
class PartWriter {
 public:
  // Takes the data out of `response`.
  PartWriter(Resp response, int64_t chunk_bytes)
      : response_(std::move(response)), splitter_(wire::Slots(response_), chunk_bytes) {}

  bool Next(RespPart* part) {
    part->Clear();
    if (!header_sent_) {
      header_sent_ = true;
      *part->mutable_header() = std::move(response_);
      return true;
    }
    return splitter_.Next(part->mutable_chunk());
  }

 private:
  Resp response_;
  wire::ChunkSplitter splitter_;
  bool header_sent_ = false;
};

// Runs `body` and turns an exception into INTERNAL, so none escapes into gRPC.
template <typename F>
absl::Status Guarded(const char* method, F&& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(method, " failed: ", e.what()));
  } catch (...) {
    return absl::InternalError(absl::StrCat(method, " failed with an unknown exception"));
  }
}

}  // namespace

// Forward and Backward: chunked request in, chunked response out.
template <typename Req, typename ReqPart, typename Resp, typename RespPart>
class ChunkedBidiReactor final : public grpc::ServerBidiReactor<ReqPart, RespPart> {
 public:
  using Work = std::function<absl::Status(const Caller&, Req&, Resp*)>;
  // What the response leaves on the server that an undelivered response must release.
  using ContextOf = std::function<std::string(const Resp&)>;

  ChunkedBidiReactor(GradwireService& service, grpc::CallbackServerContext* ctx, const char* method,
                     Work work, ContextOf context_of)
      : service_(service),
        ctx_(ctx),
        method_(method),
        work_(std::move(work)),
        context_of_(std::move(context_of)),
        reader_(service.options_),
        start_(Clock::now()) {
    absl::StatusOr<Caller> caller = service_.Authenticate(ctx);
    if (!caller.ok()) {
      End(caller.status());
      return;
    }
    caller_ = std::move(*caller);
    this->StartRead(&incoming_);
  }

  void OnReadDone(bool ok) override {
    if (ok) {
      absl::Status s = reader_.Add(incoming_);
      incoming_.Clear();
      if (!s.ok()) return End(s);
      this->StartRead(&incoming_);
      return;
    }
    if (ctx_->IsCancelled())
      return End(absl::CancelledError(absl::StrCat(method_, " was cancelled")));
    if (absl::Status s = reader_.Complete(); !s.ok()) return End(s);
    NoteIds(reader_.request());
    if (absl::Status s = service_.AdmitQueued(caller_, module_id_, context_id_, &queue_key_);
        !s.ok()) {
      return End(s);
    }
    service_.executor_.Submit([this] { Run(); });
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      ReleaseUndelivered();
      return End(absl::CancelledError(
          absl::StrCat(method_, ": the client went away while the response was being sent")));
    }
    if (writer_->Next(&outgoing_)) {
      this->StartWrite(&outgoing_);
    } else {
      End(absl::OkStatus());
    }
  }

  void OnDone() override {
    // The status never reached the client (it cancelled, or the connection broke, after the last
    // write): to the client the call failed, so nobody will consume what it created.
    if (ctx_->IsCancelled()) {
      ReleaseUndelivered();
      if (status_.ok()) status_ = absl::CancelledError(absl::StrCat(method_, " was cancelled"));
    }
    service_.Report(method_, status_, std::chrono::duration<double>(Clock::now() - start_).count(),
                    module_id_, context_id_, caller_.tenant);
    delete this;
  }

 private:
  // On the executor.
  void Run() {
    if (!queue_key_.empty()) service_.Dequeued(queue_key_);
    Resp response;
    Req& request = reader_.request();
    absl::Status s =
        GwAbandoned()
            ? absl::CancelledError(absl::StrCat(method_, " was cancelled before it started"))
            : Guarded(method_, [&] { return work_(caller_, request, &response); });
    request = Req();  // the request's tensors are no longer needed
    if (!s.ok()) return End(s);
    created_context_ = context_of_ ? context_of_(response) : std::string();
    writer_.emplace(std::move(response), service_.options_.chunk_bytes);
    writer_->Next(&outgoing_);
    this->StartWrite(&outgoing_);
  }

  bool GwAbandoned() const {
    return ctx_->IsCancelled() || ctx_->deadline() <= std::chrono::system_clock::now();
  }

  void NoteIds(const v1::ForwardRequest& r) { module_id_ = r.module_id(); }
  void NoteIds(const v1::BackwardRequest& r) { context_id_ = r.context_id(); }

  void ReleaseUndelivered() {
    if (created_context_.empty()) return;
    ReleaseUnconsumed(service_.executor_, service_.host_, {std::move(created_context_)},
                      core::ContextStore::ReleaseReason::kUndelivered,
                      absl::StrCat(method_, ": response not delivered"));
    created_context_.clear();
  }

  void End(absl::Status status) {
    status_ = std::move(status);
    this->Finish(ToGrpc(status_));
  }

  GradwireService& service_;
  grpc::CallbackServerContext* ctx_;
  const char* method_;
  Work work_;
  ContextOf context_of_;
  Caller caller_;
  PartReader<Req, ReqPart> reader_;
  ReqPart incoming_;
  std::optional<PartWriter<Resp, RespPart>> writer_;
  RespPart outgoing_;
  std::string created_context_;
  std::string module_id_, context_id_;
  std::string queue_key_;  // counted in by AdmitQueued
  absl::Status status_;
  const Clock::time_point start_;
};

// SetWeights: chunked request in, one response out.
class SetWeightsChunkedReactor final : public grpc::ServerReadReactor<v1::SetWeightsRequestPart> {
 public:
  SetWeightsChunkedReactor(GradwireService& service, grpc::CallbackServerContext* ctx,
                           v1::SetWeightsResponse* response)
      : service_(service),
        ctx_(ctx),
        response_(response),
        reader_(service.options_),
        start_(Clock::now()) {
    absl::StatusOr<Caller> caller = service_.Authenticate(ctx);
    if (!caller.ok()) {
      End(caller.status());
      return;
    }
    caller_ = std::move(*caller);
    StartRead(&incoming_);
  }

  void OnReadDone(bool ok) override {
    if (ok) {
      absl::Status s = reader_.Add(incoming_);
      incoming_.Clear();
      if (!s.ok()) return End(s);
      StartRead(&incoming_);
      return;
    }
    if (ctx_->IsCancelled()) return End(absl::CancelledError("SetWeightsChunked was cancelled"));
    if (absl::Status s = reader_.Complete(); !s.ok()) return End(s);
    module_id_ = reader_.request().module_id();
    if (absl::Status s = service_.AdmitQueued(caller_, module_id_, {}, &queue_key_); !s.ok()) {
      return End(s);
    }
    service_.executor_.Submit([this] {
      if (!queue_key_.empty()) service_.Dequeued(queue_key_);
      absl::Status s =
          ctx_->IsCancelled()
              ? absl::CancelledError("SetWeightsChunked was cancelled before it started")
              : Guarded("SetWeightsChunked", [&] {
                  return service_.DoSetWeights(caller_, reader_.request(), response_);
                });
      reader_.request() = v1::SetWeightsRequest();
      End(s);
    });
  }

  void OnDone() override {
    service_.Report("SetWeightsChunked", status_,
                    std::chrono::duration<double>(Clock::now() - start_).count(), module_id_, {},
                    caller_.tenant);
    delete this;
  }

 private:
  void End(absl::Status status) {
    status_ = std::move(status);
    Finish(ToGrpc(status_));
  }

  GradwireService& service_;
  grpc::CallbackServerContext* ctx_;
  v1::SetWeightsResponse* response_;
  Caller caller_;
  PartReader<v1::SetWeightsRequest, v1::SetWeightsRequestPart> reader_;
  v1::SetWeightsRequestPart incoming_;
  std::string module_id_;
  std::string queue_key_;  // counted in by AdmitQueued
  absl::Status status_;
  const Clock::time_point start_;
};

// GetWeights: one request in, chunked response out.
class GetWeightsChunkedReactor final : public grpc::ServerWriteReactor<v1::GetWeightsResponsePart> {
 public:
  GetWeightsChunkedReactor(GradwireService& service, grpc::CallbackServerContext* ctx,
                           const v1::GetWeightsRequest* request)
      : service_(service), ctx_(ctx), module_id_(request->module_id()), start_(Clock::now()) {
    absl::StatusOr<Caller> caller = service_.Authenticate(ctx);
    if (!caller.ok()) {
      End(caller.status());
      return;
    }
    caller_ = std::move(*caller);
    if (absl::Status s = service_.AdmitQueued(caller_, module_id_, {}, &queue_key_); !s.ok()) {
      End(s);
      return;
    }
    service_.executor_.Submit([this, request] {
      if (!queue_key_.empty()) service_.Dequeued(queue_key_);
      v1::GetWeightsResponse response;
      absl::Status s =
          ctx_->IsCancelled()
              ? absl::CancelledError("GetWeightsChunked was cancelled before it started")
              : Guarded("GetWeightsChunked",
                        [&] { return service_.DoGetWeights(caller_, *request, &response); });
      if (!s.ok()) return End(s);
      writer_.emplace(std::move(response), service_.options_.chunk_bytes);
      writer_->Next(&outgoing_);
      StartWrite(&outgoing_);
    });
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      return End(absl::CancelledError(
          "GetWeightsChunked: the client went away while the response was being sent"));
    }
    if (writer_->Next(&outgoing_)) {
      StartWrite(&outgoing_);
    } else {
      End(absl::OkStatus());
    }
  }

  void OnDone() override {
    service_.Report("GetWeightsChunked", status_,
                    std::chrono::duration<double>(Clock::now() - start_).count(), module_id_, {},
                    caller_.tenant);
    delete this;
  }

 private:
  void End(absl::Status status) {
    status_ = std::move(status);
    Finish(ToGrpc(status_));
  }

  GradwireService& service_;
  grpc::CallbackServerContext* ctx_;
  std::string module_id_;
  std::string queue_key_;  // counted in by AdmitQueued
  Caller caller_;
  std::optional<PartWriter<v1::GetWeightsResponse, v1::GetWeightsResponsePart>> writer_;
  v1::GetWeightsResponsePart outgoing_;
  absl::Status status_;
  const Clock::time_point start_;
};

grpc::ServerBidiReactor<v1::ForwardRequestPart, v1::ForwardResponsePart>*
GradwireService::ForwardChunked(grpc::CallbackServerContext* ctx) {
  return new ChunkedBidiReactor<v1::ForwardRequest, v1::ForwardRequestPart, v1::ForwardResponse,
                                v1::ForwardResponsePart>(
      *this, ctx, "ForwardChunked",
      [this, ctx](const Caller& caller, v1::ForwardRequest& req, v1::ForwardResponse* resp) {
        return DoForward(caller, req, resp, ctx);
      },
      [](const v1::ForwardResponse& resp) { return resp.context_id(); });
}

grpc::ServerBidiReactor<v1::BackwardRequestPart, v1::BackwardResponsePart>*
GradwireService::BackwardChunked(grpc::CallbackServerContext* ctx) {
  return new ChunkedBidiReactor<v1::BackwardRequest, v1::BackwardRequestPart, v1::BackwardResponse,
                                v1::BackwardResponsePart>(
      *this, ctx, "BackwardChunked",
      [this, ctx](const Caller& caller, v1::BackwardRequest& req, v1::BackwardResponse* resp) {
        return DoBackward(caller, req, resp, ctx);
      },
      nullptr);
}

grpc::ServerWriteReactor<v1::GetWeightsResponsePart>* GradwireService::GetWeightsChunked(
    grpc::CallbackServerContext* ctx, const v1::GetWeightsRequest* req) {
  return new GetWeightsChunkedReactor(*this, ctx, req);
}

grpc::ServerReadReactor<v1::SetWeightsRequestPart>* GradwireService::SetWeightsChunked(
    grpc::CallbackServerContext* ctx, v1::SetWeightsResponse* resp) {
  return new SetWeightsChunkedReactor(*this, ctx, resp);
}

}  // namespace gradwire::rpc
