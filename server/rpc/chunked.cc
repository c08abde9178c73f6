// The chunked RPCs: ForwardChunked, BackwardChunked, GetWeightsChunked and SetWeightsChunked.
// Each reads its request (header, then chunks placed straight into the tensors), runs the same
// body as the unary call on the device executor, and writes its response as header + chunks. A
// bad sequence finishes the call with INVALID_ARGUMENT at once and frees what was assembled; a
// forward whose response cannot be delivered releases its context. All four follow the lifecycle
// of call.h.
#include <spdlog/spdlog.h>

#include <chrono>
#include <exception>
#include <memory>
#include <optional>

#include "absl/strings/str_cat.h"
#include "gradwire/wire/chunking.h"
#include "gradwire/wire/zero_copy.h"
#include "server/rpc/service.h"
#include "server/rpc/status_map.h"

namespace gradwire::rpc {

// Header first, then chunks: what a chunked request must look like. Nothing is allocated for the
// tensors until the header passed every check it allows (`check`: ids, ownership, shapes, element
// limits) and its bytes were reserved against the client's in-flight quota; the reservation is
// returned when the request is dropped.
template <typename Req, typename ReqPart>
class PartReader {
 public:
  PartReader(GradwireService& service, const ServiceOptions& options)
      : service_(service), options_(options) {}
  ~PartReader() { Drop(); }

  // `chunk_data`: the bytes of the part's chunk, in pieces (they may have arrived apart from its
  // message, in several received slices).
  absl::Status Add(ReqPart& part, const std::vector<absl::string_view>& chunk_data,
                   const Caller& caller) {
    if (part.has_header()) {
      if (started_) return absl::InvalidArgumentError("the header was sent twice");
      started_ = true;
      request_ = std::move(*part.mutable_header());
      if (absl::Status s = service_.CheckHeader(caller, request_); !s.ok()) return s;
      return assembler_.Start(wire::Slots(request_), options_.max_stream_bytes, "--max-stream-mib",
                              options_.chunk_bytes, [&](int64_t total) {
                                absl::Status s = service_.ReserveStreamBytes(caller, total);
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
    if (reserved_ > 0) service_.ReturnStreamBytes(client_, std::exchange(reserved_, 0));
  }

 private:
  GradwireService& service_;
  const ServiceOptions& options_;
  bool started_ = false;
  Req request_;
  wire::ChunkAssembler assembler_;
  int64_t reserved_ = 0;
  std::string client_;
};

namespace {

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

}  // namespace

// Forward and Backward: chunked request in, chunked response out.
// Raw: parts arrive and leave as grpc::ByteBuffers, so a chunk's bytes are copied once, from the
// received slices into place, and leave as slices of the response (zero_copy.h).
template <typename Req, typename ReqPart, typename Resp, typename RespPart>
class ChunkedBidiCall final
    : public Call<grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>> {
  using Base = Call<grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>>;

 public:
  using Work = std::function<absl::Status(const Caller&, const CallBase&, Req&, Resp*)>;
  // What the response leaves on the server that an undelivered response must release.
  using ContextOf = std::function<std::string(const Resp&)>;

  ChunkedBidiCall(GradwireService& service, grpc::CallbackServerContext* ctx, const char* method,
                  Work work, ContextOf context_of)
      : Base(service, ctx, method),
        work_(std::move(work)),
        context_of_(std::move(context_of)),
        reader_(service, service.options_) {
    if (absl::Status s = this->Authenticate(ctx); !s.ok()) {
      this->End(s);
      return;
    }
    this->StartRead(&incoming_);
  }

  void OnReadDone(bool ok) override {
    if (ok) {
      ReqPart part;
      wire::ReceivedMessage received;
      absl::Status s = received.Parse(incoming_, &part, wire::kPartChunk);
      if (s.ok()) s = reader_.Add(part, received.pieces(2), this->caller());
      incoming_.Clear();
      if (!s.ok()) {
        reader_.Drop();
        this->End(s);
        return;
      }
      this->StartRead(&incoming_);
      return;
    }
    if (this->Abandoned()) {
      this->End(absl::CancelledError(absl::StrCat(this->method_, " was cancelled")));
      return;
    }
    absl::Status s = reader_.Complete();
    NoteRequestIds(reader_.request());
    Admission admission;
    if (s.ok()) s = this->service_.Admit(this->caller(), module_id_, context_id_, &admission);
    if (!s.ok()) {
      reader_.Drop();
      this->End(s);
      return;
    }
    this->Submit(
        std::move(admission), [this] { Run(); },
        [this](absl::Status failed) { this->End(std::move(failed)); });
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
  // On the executor.
  void Run() {
    Resp response;
    absl::Status s =
        this->Abandoned()
            ? absl::CancelledError(absl::StrCat(this->method_, " was cancelled before it started"))
            : work_(this->caller(), *this, reader_.request(), &response);
    reader_.Drop();  // the request's tensors are no longer needed
    if (!s.ok()) {
      this->End(s);
      return;
    }
    std::lock_guard<std::mutex> lock(this->mu_);
    created_context_ = context_of_ ? context_of_(response) : std::string();
    writer_.emplace(std::move(response), this->service_.options_.chunk_bytes);
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

  void NoteRequestIds(const v1::ForwardRequest& r) {
    module_id_ = r.module_id();
    this->NoteIds(module_id_, {});
  }
  void NoteRequestIds(const v1::BackwardRequest& r) {
    context_id_ = r.context_id();
    this->NoteIds({}, context_id_);
  }

  void ReleaseUndelivered() {
    std::string id;
    {
      std::lock_guard<std::mutex> lock(this->mu_);
      id.swap(created_context_);
    }
    if (id.empty()) return;
    ReleaseUnconsumed(this->service_.executor_, this->service_.host_, {std::move(id)},
                      core::ContextStore::ReleaseReason::kUndelivered,
                      absl::StrCat(this->method_, ": response not delivered"));
  }

  Work work_;
  ContextOf context_of_;
  PartReader<Req, ReqPart> reader_;
  grpc::ByteBuffer incoming_;
  std::optional<PartWriter<Resp, RespPart>> writer_;  // under mu_
  grpc::ByteBuffer outgoing_;
  std::string created_context_;  // under mu_
  std::string module_id_, context_id_;
};

// SetWeights: chunked request in, one response out.
class SetWeightsChunkedCall final
    : public Call<grpc::ServerReadReactor<v1::SetWeightsRequestPart>> {
 public:
  SetWeightsChunkedCall(GradwireService& service, grpc::CallbackServerContext* ctx,
                        v1::SetWeightsResponse* response)
      : Call(service, ctx, "SetWeightsChunked"),
        response_(response),
        reader_(service, service.options_) {
    if (absl::Status s = Authenticate(ctx); !s.ok()) {
      End(s);
      return;
    }
    StartRead(&incoming_);
  }

  void OnReadDone(bool ok) override {
    if (ok) {
      absl::Status s = reader_.Add(
          incoming_, std::vector<absl::string_view>{incoming_.chunk().data()}, caller());
      incoming_.Clear();
      if (!s.ok()) {
        reader_.Drop();
        End(s);
        return;
      }
      StartRead(&incoming_);
      return;
    }
    if (Abandoned()) {
      End(absl::CancelledError("SetWeightsChunked was cancelled"));
      return;
    }
    absl::Status s = reader_.Complete();
    const std::string module_id = reader_.request().module_id();
    NoteIds(module_id, {});
    Admission admission;
    if (s.ok()) s = service_.Admit(caller(), module_id, {}, &admission);
    if (!s.ok()) {
      reader_.Drop();
      End(s);
      return;
    }
    Submit(
        std::move(admission),
        [this] {
          absl::Status s =
              Abandoned()
                  ? absl::CancelledError("SetWeightsChunked was cancelled before it started")
                  : service_.DoSetWeights(caller(), reader_.request(), response_);
          reader_.Drop();
          End(s);
        },
        [this](absl::Status failed) { End(std::move(failed)); });
  }

 private:
  v1::SetWeightsResponse* response_;
  PartReader<v1::SetWeightsRequest, v1::SetWeightsRequestPart> reader_;
  v1::SetWeightsRequestPart incoming_;
};

// GetWeights: one request in, chunked response out.
class GetWeightsChunkedCall final
    : public Call<grpc::ServerWriteReactor<v1::GetWeightsResponsePart>> {
 public:
  GetWeightsChunkedCall(GradwireService& service, grpc::CallbackServerContext* ctx,
                        const v1::GetWeightsRequest* request)
      : Call(service, ctx, "GetWeightsChunked"), request_(*request) {
    NoteIds(request_.module_id(), {});
    Admission admission;
    absl::Status s = Authenticate(ctx);
    if (s.ok()) s = service_.Admit(caller(), request_.module_id(), {}, &admission);
    if (!s.ok()) {
      End(s);
      return;
    }
    Submit(
        std::move(admission),
        [this] {
          v1::GetWeightsResponse response;
          absl::Status s =
              Abandoned()
                  ? absl::CancelledError("GetWeightsChunked was cancelled before it started")
                  : service_.DoGetWeights(caller(), request_, &response);
          if (!s.ok()) {
            End(s);
            return;
          }
          std::lock_guard<std::mutex> lock(mu_);
          writer_.emplace(std::move(response), service_.options_.chunk_bytes);
          writer_->Next(&outgoing_);
          if (!finished_) StartWrite(&outgoing_);
        },
        [this](absl::Status failed) { End(std::move(failed)); });
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
  const v1::GetWeightsRequest request_;
  std::optional<PartWriter<v1::GetWeightsResponse, v1::GetWeightsResponsePart>> writer_;
  v1::GetWeightsResponsePart outgoing_;
};

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* GradwireService::ForwardChunked(
    grpc::CallbackServerContext* ctx) {
  return new ChunkedBidiCall<v1::ForwardRequest, v1::ForwardRequestPart, v1::ForwardResponse,
                             v1::ForwardResponsePart>(
      *this, ctx, "ForwardChunked",
      [this](const Caller& caller, const CallBase& call, v1::ForwardRequest& req,
             v1::ForwardResponse* resp) { return DoForward(caller, req, resp, &call); },
      [](const v1::ForwardResponse& resp) { return resp.context_id(); });
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* GradwireService::BackwardChunked(
    grpc::CallbackServerContext* ctx) {
  return new ChunkedBidiCall<v1::BackwardRequest, v1::BackwardRequestPart, v1::BackwardResponse,
                             v1::BackwardResponsePart>(
      *this, ctx, "BackwardChunked",
      [this](const Caller& caller, const CallBase& call, v1::BackwardRequest& req,
             v1::BackwardResponse* resp) { return DoBackward(caller, req, resp, &call); },
      nullptr);
}

grpc::ServerWriteReactor<v1::GetWeightsResponsePart>* GradwireService::GetWeightsChunked(
    grpc::CallbackServerContext* ctx, const v1::GetWeightsRequest* req) {
  return new GetWeightsChunkedCall(*this, ctx, req);
}

grpc::ServerReadReactor<v1::SetWeightsRequestPart>* GradwireService::SetWeightsChunked(
    grpc::CallbackServerContext* ctx, v1::SetWeightsResponse* resp) {
  return new SetWeightsChunkedCall(*this, ctx, resp);
}

}  // namespace gradwire::rpc
