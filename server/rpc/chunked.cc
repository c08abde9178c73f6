#include "server/rpc/chunked.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gradwire/wire/chunking.h"
#include "gradwire/wire/zero_copy.h"
#include "server/rpc/status_map.h"

namespace gradwire::rpc {
namespace {

// Header first, then chunks: what a chunked request must look like. Nothing is allocated for the
// tensors until the header passed every check it allows (`checks`: ids, ownership, shapes, element
// limits) and its bytes were reserved against the client's in-flight quota; the reservation is
// returned when the request is dropped.
template <typename Req, typename ReqPart>
class PartReader {
 public:
  PartReader(CallEnv& env, const RequestChecks& checks)
      : env_(env), options_(env.options()), checks_(checks) {}
  ~PartReader() { Drop(); }

  // `chunk_data`: the bytes of the part's chunk, in pieces (they may have arrived apart from its
  // message, in several received slices).
  absl::Status Add(ReqPart& part, const std::vector<absl::string_view>& chunk_data,
                   const Caller& caller) {
    if (part.has_header()) {
      if (started_) return absl::InvalidArgumentError("the header was sent twice");
      started_ = true;
      request_ = std::move(*part.mutable_header());
      if (absl::Status s = checks_.CheckHeader(caller, request_); !s.ok()) return s;
      return assembler_.Start(wire::Slots(request_), options_.max_stream_bytes, "--max-stream-mib",
                              options_.chunk_bytes, [&](int64_t total) {
                                absl::Status s =
                                    env_.quotas().ReserveStreamBytes(caller.client, total);
                                if (s.ok()) {
                                  reserved_ = total;
                                  client_ = caller.client;
                                }
                                return s;
                              });
    }
    if (!part.has_chunk()) {
      return absl::InvalidArgumentError("a message of a chunked call must set header or chunk");
    }
    if (!started_) {
      return absl::InvalidArgumentError("the first message of a chunked call must be the header");
    }
    return assembler_.Add(part.chunk().tensor(), part.chunk().offset(), chunk_data);
  }

  absl::Status Complete() const {
    if (!started_) return absl::InvalidArgumentError("the chunked call ended before its header");
    return assembler_.Complete();
  }

  Req& request() { return request_; }

  // Frees the request's tensors and returns their reservation.
  void Drop() {
    request_ = Req();
    if (reserved_ > 0) env_.quotas().ReturnStreamBytes(client_, std::exchange(reserved_, 0));
  }

 private:
  CallEnv& env_;
  const ServiceOptions& options_;
  const RequestChecks& checks_;
  bool started_ = false;
  Req request_;
  wire::ChunkAssembler assembler_;
  int64_t reserved_ = 0;
  std::string client_;
};

// Header, then chunks of the response.
template <typename Resp, typename RespPart>
class PartWriter {
 public:
  // Takes the data out of `response`.
  PartWriter(Resp response, int64_t chunk_bytes)
      : response_(std::move(response)),
        splitter_(std::make_shared<wire::ChunkSplitter>(wire::Slots(response_), chunk_bytes)) {}

  // As messages (each chunk's bytes copied into it).
  bool Next(RespPart* part) {
    part->Clear();
    if (!header_sent_) {
      header_sent_ = true;
      *part->mutable_header() = std::move(response_);
      return true;
    }
    return splitter_->Next(part->mutable_chunk());
  }

  // Serialised, each chunk's bytes a slice that points into the response (kept alive until gRPC
  // drops the slice): no copy.
  bool Next(grpc::ByteBuffer* out) {
    RespPart part;
    if (!header_sent_) {
      header_sent_ = true;
      *part.mutable_header() = std::move(response_);
      grpc::Slice header(part.SerializeAsString());
      *out = grpc::ByteBuffer(&header, 1);
      return true;
    }
    uint32_t tensor = 0;
    uint64_t offset = 0;
    absl::string_view data;
    if (!splitter_->Next(&tensor, &offset, &data)) return false;
    part.mutable_chunk()->set_tensor(tensor);
    part.mutable_chunk()->set_offset(offset);
    wire::SerializeReferencing(
        part, {{2, data}}, [keep = splitter_] {}, out);
    return true;
  }

 private:
  Resp response_;
  std::shared_ptr<wire::ChunkSplitter> splitter_;
  bool header_sent_ = false;
};

// A call that reads a chunked request (`Incoming` is what one read receives), then admits and
// runs it once the client is done sending.
template <typename Reactor, typename Incoming, typename Req, typename ReqPart>
class ChunkedRequestCall : public Call<Reactor> {
 protected:
  ChunkedRequestCall(CallEnv& env, grpc::CallbackServerContext* ctx, const char* method,
                     const RequestChecks& checks)
      : Call<Reactor>(env, ctx, method), reader_(env, checks) {}

  // Steps the derived constructor ends with: authenticated, then the first read.
  void Begin(grpc::CallbackServerContext* ctx) {
    if (absl::Status s = this->Authenticate(ctx); !s.ok()) {
      this->End(s);
      return;
    }
    this->StartRead(&incoming_);
  }

  // After a part was read and added (`added`): the next read, or the call ended.
  void PartAdded(const absl::Status& added) {
    if (!added.ok()) {
      reader_.Drop();
      this->End(added);
      return;
    }
    this->StartRead(&incoming_);
  }

  // The client is done sending: the request admitted and run on the device executor, or the
  // call ended with why not.
  void RequestComplete() {
    if (this->Abandoned()) {
      this->End(absl::CancelledError(absl::StrCat(this->method_, " was cancelled")));
      return;
    }
    absl::Status s = reader_.Complete();
    const RequestIds ids = IdsOf(reader_.request());
    this->NoteIds(ids.module_id, ids.context_id);
    if (s.ok()) s = Admit(ids);
    if (!s.ok()) {
      reader_.Drop();
      this->End(s);
    }
  }

  // Admits the assembled request (in reader_) and queues its work.
  virtual absl::Status Admit(const RequestIds& ids) = 0;

  PartReader<Req, ReqPart> reader_;
  Incoming incoming_;
};

// Forward and Backward. Raw: parts arrive and leave as grpc::ByteBuffers, so a chunk's bytes are
// copied once, from the received slices into place, and leave as slices of the response
// (zero_copy.h).
template <typename Req, typename ReqPart, typename Resp, typename RespPart>
class ChunkedBidiCall final
    : public ChunkedRequestCall<grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>,
                                grpc::ByteBuffer, Req, ReqPart> {
  using Base = ChunkedRequestCall<grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>,
                                  grpc::ByteBuffer, Req, ReqPart>;

 public:
  // `enter` hands the request to the pipeline (StepPipeline::Forward or Backward).
  using Enter = StepEntry (StepPipeline::*)(const CallBase&, StepJob<Req, Resp>,
                                            StepPipeline::Order*);
  ChunkedBidiCall(CallEnv& env, grpc::CallbackServerContext* ctx, const char* method,
                  const RequestChecks& checks, StepPipeline& steps, Enter enter)
      : Base(env, ctx, method, checks), steps_(steps), enter_(enter) {
    this->Begin(ctx);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      this->RequestComplete();
      return;
    }
    ReqPart part;
    wire::ReceivedMessage received;
    absl::Status s = received.Parse(this->incoming_, &part, wire::kPartChunk);
    if (s.ok()) s = this->reader_.Add(part, received.pieces(2), this->caller());
    this->incoming_.Clear();
    this->PartAdded(s);
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      ReleaseUndelivered();
      this->End(absl::CancelledError(
          absl::StrCat(this->method_, ": the client went away while the response was being sent")));
      return;
    }
    std::lock_guard<std::mutex> lock(this->mu_);
    if (writer_->Next(&outgoing_)) {
      if (!this->finished_) this->StartWrite(&outgoing_);
    } else {
      this->EndLocked(absl::OkStatus());
    }
  }

 private:
  // The request as a job of the pipeline, batched with other calls' (it lives in reader_ until
  // the job's end).
  absl::Status Admit(const RequestIds& ids) override {
    StepEntry entry = (steps_.*enter_)(*this,
                                       {&this->reader_.request(), &response_, nullptr,
                                        [this](absl::Status s) { Answered(std::move(s)); }},
                                       nullptr);
    return this->AdmitAndRun(
        ids.module_id, ids.context_id, CallBase::RunOn::kDevice, std::move(entry.run),
        [this](absl::Status failed) { this->End(std::move(failed)); }, std::move(entry.submit));
  }

  // The job's end: the response starts on its way, or the call ends with why not.
  void Answered(absl::Status s) {
    this->reader_.Drop();  // the request's tensors are no longer needed
    if (!s.ok()) {
      this->End(s);
      return;
    }
    std::lock_guard<std::mutex> lock(this->mu_);
    created_context_ = CreatedBy(response_);
    writer_.emplace(std::move(response_), this->env_.options().chunk_bytes);
    writer_->Next(&outgoing_);
    if (!this->finished_) this->StartWrite(&outgoing_);
  }

  // OnDone: the status never reached the client (it cancelled, or the connection broke, after the
  // last write): to the client the call failed, so nobody will consume what it created.
  void Ended() override {
    if (this->Abandoned()) {
      ReleaseUndelivered();
      if (this->status_.ok()) {
        this->status_ = absl::CancelledError(absl::StrCat(this->method_, " was cancelled"));
      }
    }
  }

  void ReleaseUndelivered() {
    std::string id;
    {
      std::lock_guard<std::mutex> lock(this->mu_);
      id.swap(created_context_);
    }
    if (id.empty()) return;
    this->env_.ReleaseUnconsumed({std::move(id)}, core::ContextStore::ReleaseReason::kUndelivered,
                                 absl::StrCat(this->method_, ": response not delivered"));
  }

  StepPipeline& steps_;
  const Enter enter_;
  Resp response_;                                     // filled by the job
  std::optional<PartWriter<Resp, RespPart>> writer_;  // under mu_
  grpc::ByteBuffer outgoing_;
  std::string created_context_;  // under mu_
};

// SetWeights: chunked request in, one response out.
class SetWeightsChunkedCall final
    : public ChunkedRequestCall<grpc::ServerReadReactor<v1::SetWeightsRequestPart>,
                                v1::SetWeightsRequestPart, v1::SetWeightsRequest,
                                v1::SetWeightsRequestPart> {
 public:
  SetWeightsChunkedCall(CallEnv& env, grpc::CallbackServerContext* ctx,
                        v1::SetWeightsResponse* response, const RequestChecks& checks,
                        ChunkedWork<v1::SetWeightsRequest, v1::SetWeightsResponse> work)
      : ChunkedRequestCall(env, ctx, "SetWeightsChunked", checks),
        response_(response),
        work_(std::move(work)) {
    Begin(ctx);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      RequestComplete();
      return;
    }
    absl::Status s =
        reader_.Add(incoming_, std::vector<absl::string_view>{incoming_.chunk().data()}, caller());
    incoming_.Clear();
    PartAdded(s);
  }

 private:
  absl::Status Admit(const RequestIds& ids) override {
    return AdmitAndRun(
        ids.module_id, ids.context_id, RunOn::kDevice,
        [this](absl::Status started) { Run(std::move(started)); },
        [this](absl::Status failed) { End(std::move(failed)); });
  }

  // On the executor, with the assembled request in reader_ (`started`: see AdmitAndRun).
  void Run(absl::Status started) {
    absl::Status s = started.ok() ? work_(caller(), *this, reader_.request(), response_) : started;
    reader_.Drop();
    End(s);
  }

  v1::SetWeightsResponse* response_;
  ChunkedWork<v1::SetWeightsRequest, v1::SetWeightsResponse> work_;
};

// GetWeights: one request in, chunked response out.
class GetWeightsChunkedCall final
    : public Call<grpc::ServerWriteReactor<v1::GetWeightsResponsePart>> {
 public:
  GetWeightsChunkedCall(CallEnv& env, grpc::CallbackServerContext* ctx,
                        const v1::GetWeightsRequest& request,
                        ChunkedWork<const v1::GetWeightsRequest, v1::GetWeightsResponse> work)
      : Call(env, ctx, "GetWeightsChunked"), request_(request), work_(std::move(work)) {
    NoteIds(request_.module_id(), {});
    absl::Status s = Authenticate(ctx);
    if (s.ok()) {
      s = AdmitAndRun(
          request_.module_id(), {}, RunOn::kDevice,
          [this](absl::Status started) { Run(std::move(started)); },
          [this](absl::Status failed) { End(std::move(failed)); });
    }
    if (!s.ok()) End(s);
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      End(absl::CancelledError(
          "GetWeightsChunked: the client went away while the response was being sent"));
      return;
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (writer_->Next(&outgoing_)) {
      if (!finished_) StartWrite(&outgoing_);
    } else {
      EndLocked(absl::OkStatus());
    }
  }

 private:
  void Run(absl::Status started) {
    v1::GetWeightsResponse response;
    absl::Status s = started.ok() ? work_(caller(), *this, request_, &response) : started;
    if (!s.ok()) {
      End(s);
      return;
    }
    std::lock_guard<std::mutex> lock(mu_);
    writer_.emplace(std::move(response), env_.options().chunk_bytes);
    writer_->Next(&outgoing_);
    if (!finished_) StartWrite(&outgoing_);
  }

  const v1::GetWeightsRequest request_;
  ChunkedWork<const v1::GetWeightsRequest, v1::GetWeightsResponse> work_;
  std::optional<PartWriter<v1::GetWeightsResponse, v1::GetWeightsResponsePart>> writer_;
  v1::GetWeightsResponsePart outgoing_;
};

}  // namespace

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* StartForwardChunked(
    CallEnv& env, grpc::CallbackServerContext* ctx, const RequestChecks& checks,
    StepPipeline& steps) {
  return new ChunkedBidiCall<v1::ForwardRequest, v1::ForwardRequestPart, v1::ForwardResponse,
                             v1::ForwardResponsePart>(env, ctx, "ForwardChunked", checks, steps,
                                                      &StepPipeline::Forward);
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* StartBackwardChunked(
    CallEnv& env, grpc::CallbackServerContext* ctx, const RequestChecks& checks,
    StepPipeline& steps) {
  return new ChunkedBidiCall<v1::BackwardRequest, v1::BackwardRequestPart, v1::BackwardResponse,
                             v1::BackwardResponsePart>(env, ctx, "BackwardChunked", checks, steps,
                                                       &StepPipeline::Backward);
}

grpc::ServerWriteReactor<v1::GetWeightsResponsePart>* StartGetWeightsChunked(
    CallEnv& env, grpc::CallbackServerContext* ctx, const v1::GetWeightsRequest& request,
    ChunkedWork<const v1::GetWeightsRequest, v1::GetWeightsResponse> work) {
  return new GetWeightsChunkedCall(env, ctx, request, std::move(work));
}

grpc::ServerReadReactor<v1::SetWeightsRequestPart>* StartSetWeightsChunked(
    CallEnv& env, grpc::CallbackServerContext* ctx, v1::SetWeightsResponse* response,
    const RequestChecks& checks, ChunkedWork<v1::SetWeightsRequest, v1::SetWeightsResponse> work) {
  return new SetWeightsChunkedCall(env, ctx, response, checks, std::move(work));
}

}  // namespace gradwire::rpc
