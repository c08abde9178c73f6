// Internal helpers of the C++ client's calls: gRPC status conversion, chunked calls (a message as
// a header and its tensors' bytes in chunks, both ways) and unary calls whose tensor bytes skip
// protobuf's copies.
#pragma once

#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/codegen/client_unary_call.h>
#include <grpcpp/impl/codegen/rpc_method.h>

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "gradwire/wire/chunking.h"
#include "gradwire/wire/zero_copy.h"

namespace gradwire::client::internal {

// A gRPC status as an absl::Status of the same code, its message prefixed with `method`.
inline absl::Status FromGrpc(const char* method, const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat(method, ": ", s.error_message()));
}

// Writes `msg` as a chunked message: header, then its tensors' bytes in chunks.
template <typename Part, typename Msg, typename Writer>
inline bool WriteChunked(Writer* writer, Msg& msg, int64_t chunk_bytes) {
  wire::ChunkSplitter splitter(wire::Slots(msg), chunk_bytes);  // takes the data out of msg
  Part part;
  *part.mutable_header() = std::move(msg);
  if (!writer->Write(part)) return false;
  part.Clear();
  while (splitter.Next(part.mutable_chunk())) {
    if (!writer->Write(part)) return false;
    part.Clear();
  }
  return true;
}

// Reads a chunked message into `out`. A malformed sequence is the server's fault: INTERNAL.
// `*open` says whether the stream is still open (the caller must cancel it before Finish); when
// it ended, Finish has the server's status (an error refused before any header comes this way).
template <typename Part, typename Msg, typename Reader>
absl::Status ReadChunked(const char* method, Reader* reader, Msg* out, bool* open) {
  *open = true;
  Part part;
  bool started = false;
  wire::ChunkAssembler assembler;
  auto malformed = [method](const absl::Status& s) {
    return absl::InternalError(
        absl::StrCat(method, ": the server sent a malformed chunked response: ", s.message()));
  };
  while (reader->Read(&part)) {
    if (part.has_header()) {
      if (started) return malformed(absl::InvalidArgumentError("the header came twice"));
      started = true;
      *out = std::move(*part.mutable_header());
      // The response's size is what the client asked for: no limit beyond the shapes' own.
      absl::Status s = assembler.Start(wire::Slots(*out), std::numeric_limits<int64_t>::max(),
                                       "the client's limit", std::numeric_limits<int64_t>::max());
      if (!s.ok()) return malformed(s);
    } else if (part.has_chunk()) {
      if (!started) return malformed(absl::InvalidArgumentError("a chunk came before the header"));
      if (absl::Status s = assembler.Add(part.chunk()); !s.ok()) return malformed(s);
    }
    part.Clear();
  }
  *open = false;
  if (!started) return malformed(absl::InvalidArgumentError("no header"));
  if (absl::Status s = assembler.Complete(); !s.ok()) return malformed(s);
  return absl::OkStatus();
}

// Finishes a stream whose response was read (`read`: how the reading went; `open`: whether the
// stream was still open when it failed). A malformed response wins over the CANCELLED of the
// cancel that closes the stream; otherwise the server's status comes first, then the read's.
// `stream` is a pointer or a smart pointer to the stream.
template <typename StreamPtr>
absl::Status FinishAfterRead(const char* method, grpc::ClientContext& ctx, StreamPtr& stream,
                             const absl::Status& read, bool open) {
  if (!read.ok() && open) {
    ctx.TryCancel();
    (void)stream->Finish();
    return read;
  }
  if (auto s = FromGrpc(method, stream->Finish()); !s.ok()) return s;
  return read;
}

// Reads a chunked response to its end and finishes the call. A malformed response (the read
// failed while the stream was still open) wins over the CANCELLED of the cancel that closes it;
// otherwise the server's status comes first, then the read's.
template <typename Part, typename Msg, typename Stream>
absl::StatusOr<Msg> ReadToEnd(const char* method, grpc::ClientContext& ctx, Stream* stream) {
  Msg resp;
  bool open = false;
  absl::Status read = ReadChunked<Part>(method, stream, &resp, &open);
  if (absl::Status s = FinishAfterRead(method, ctx, stream, read, open); !s.ok()) return s;
  return resp;
}

// A unary call whose tensor bytes skip protobuf's copies both ways (gradwire/wire/zero_copy.h):
// the request's tensor data is moved into slices of its own, and the response's is left in the
// received slices for `received` to hand out. The bytes on the wire are the standard encoding.
template <typename Req, typename Resp>
absl::Status ZeroCopyUnary(grpc::ChannelInterface* channel, const char* method,
                           grpc::ClientContext* ctx, Req* req,
                           std::initializer_list<int> request_tensors,
                           wire::ReceivedMessage* received, Resp* resp,
                           std::initializer_list<int> response_tensors) {
  grpc::ByteBuffer out, in;
  wire::SerializeMoving(req, request_tensors, &out);
  const std::string path = absl::StrCat("/gradwire.v1.Gradwire/", method);
  const grpc::internal::RpcMethod rpc(path.c_str(), grpc::internal::RpcMethod::NORMAL_RPC);
  const grpc::Status s = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
      channel, rpc, ctx, out, &in);
  if (!s.ok()) return FromGrpc(method, s);
  if (absl::Status parsed = received->Parse(in, resp, response_tensors); !parsed.ok()) {
    return absl::InternalError(absl::StrCat(method, ": malformed response: ", parsed.message()));
  }
  return absl::OkStatus();
}

// A bidi chunked call whose chunks' bytes skip protobuf's copies both ways (zero_copy.h): each
// request chunk leaves as a slice pointing into `req`'s tensor bytes (kept alive until gRPC drops
// the slice), and each response chunk is copied once, from the received slices straight into its
// tensor. The parts on the wire are the standard encoding. A malformed response (the read failed
// while the stream was still open) wins over the CANCELLED of the cancel that closes it;
// otherwise the server's status comes first, then the read's.
template <typename ReqPart, typename RespPart, typename Resp, typename Req>
absl::StatusOr<Resp> ZeroCopyChunked(grpc::ChannelInterface* channel, const char* method,
                                     grpc::ClientContext& ctx, Req& req, int64_t chunk_bytes) {
  const std::string path = absl::StrCat("/gradwire.v1.Gradwire/", method);
  const grpc::internal::RpcMethod rpc(path.c_str(), grpc::internal::RpcMethod::BIDI_STREAMING);
  std::unique_ptr<grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>> stream(
      grpc::internal::ClientReaderWriterFactory<grpc::ByteBuffer, grpc::ByteBuffer>::Create(
          channel, rpc, &ctx));
  // Writes: the header, then the chunks as references into the request's bytes.
  auto splitter = std::make_shared<wire::ChunkSplitter>(wire::Slots(req), chunk_bytes);
  bool written = true;
  {
    ReqPart part;
    *part.mutable_header() = std::move(req);
    grpc::Slice header(part.SerializeAsString());
    written = stream->Write(grpc::ByteBuffer(&header, 1));
  }
  uint32_t tensor = 0;
  uint64_t offset = 0;
  absl::string_view data;
  while (written && splitter->Next(&tensor, &offset, &data)) {
    ReqPart part;
    part.mutable_chunk()->set_tensor(tensor);
    part.mutable_chunk()->set_offset(offset);
    grpc::ByteBuffer out;
    wire::SerializeReferencing(
        part, {{2, data}}, [keep = splitter] {}, &out);
    written = stream->Write(out);
  }
  if (written) stream->WritesDone();
  // Reads: the header, then each chunk's pieces into place.
  Resp resp;
  bool started = false, open = true;
  wire::ChunkAssembler assembler;
  absl::Status read;
  auto malformed = [method](const absl::Status& s) {
    return absl::InternalError(
        absl::StrCat(method, ": the server sent a malformed chunked response: ", s.message()));
  };
  grpc::ByteBuffer in;
  while (read.ok() && stream->Read(&in)) {
    RespPart part;
    wire::ReceivedMessage received;
    if (absl::Status s = received.Parse(in, &part, wire::kPartChunk); !s.ok()) {
      read = malformed(s);
    } else if (part.has_header()) {
      if (started) {
        read = malformed(absl::InvalidArgumentError("the header came twice"));
      } else {
        started = true;
        resp = std::move(*part.mutable_header());
        // The response's size is what the client asked for: no limit beyond the shapes' own.
        absl::Status s = assembler.Start(wire::Slots(resp), std::numeric_limits<int64_t>::max(),
                                         "the client's limit", std::numeric_limits<int64_t>::max());
        if (!s.ok()) read = malformed(s);
      }
    } else if (part.has_chunk()) {
      if (!started) {
        read = malformed(absl::InvalidArgumentError("a chunk came before the header"));
      } else if (absl::Status s = assembler.Add(part.chunk().tensor(), part.chunk().offset(),
                                                received.pieces(2));
                 !s.ok()) {
        read = malformed(s);
      }
    }
  }
  if (read.ok()) {
    open = false;
    if (!started) {
      read = malformed(absl::InvalidArgumentError("no header"));
    } else if (absl::Status s = assembler.Complete(); !s.ok()) {
      read = malformed(s);
    }
  }
  if (absl::Status s = FinishAfterRead(method, ctx, stream, read, open); !s.ok()) return s;
  return resp;
}

}  // namespace gradwire::client::internal
