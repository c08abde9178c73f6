// Messages whose tensor bytes bypass protobuf's copies. The encoding is the standard one (a
// length-delimited field is tag, varint length, raw bytes), so either end may be an ordinary
// protobuf peer (grpcio, grpc-js): only how the bytes are produced and consumed differs.
//
// Sending: the data of each tensor field is moved out of the message and becomes a grpc::Slice of
// its own, released when gRPC is done with it; the rest of the message is serialised as usual.
// Receiving: the received slices are walked without protobuf; every field but the tensors' data is
// parsed into the message, and each tensor's data is a view into the received slices when it lies
// in one of them, else copied once into a contiguous buffer.
#pragma once

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <initializer_list>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/message.h"

namespace gradwire::wire {

// Top-level fields whose messages carry bytes in their field 3 (gradwire.v1.Tensor.data,
// gradwire.v1.TensorChunk.data), by message.
inline constexpr std::initializer_list<int> kForwardRequestTensors = {2};
inline constexpr std::initializer_list<int> kForwardResponseTensors = {1, 4};
inline constexpr std::initializer_list<int> kBackwardRequestTensors = {2, 6};
inline constexpr std::initializer_list<int> kBackwardResponseTensors = {1};
// The chunk of a ForwardRequestPart, BackwardRequestPart, ForwardResponsePart, ...
inline constexpr std::initializer_list<int> kPartChunk = {2};

class ReceivedMessage {
 public:
  // Parses `buffer` into `header` (which it clears first): every field except the `data` (field
  // 3) of the top-level Tensor or TensorChunk fields numbered in `tensor_fields`, whose bytes
  // data(field) returns.
  // INVALID_ARGUMENT when the bytes are not a valid protobuf encoding of `header`'s type.
  absl::Status Parse(const grpc::ByteBuffer& buffer, google::protobuf::Message* header,
                     std::initializer_list<int> tensor_fields);
  // The data bytes of tensor field `field` (empty when absent), contiguous: a view into the
  // received slice when they lie in one, else joined into one buffer (one copy, made on the first
  // call). Valid while this object lives and until the next Parse.
  absl::string_view data(int field) const;
  // Their size, and the bytes appended to `out` straight from the received slices (one copy,
  // without joining them first).
  size_t size(int field) const;
  void AppendTo(int field, std::string* out) const;
  // The pieces themselves (views into the received slices, in order; empty when absent).
  const std::vector<absl::string_view>& pieces(int field) const;
  // Tensors whose bytes spanned slices and were joined (tests, benchmarks).
  int copies() const { return int(joined_.size()); }

 private:
  std::vector<grpc::Slice> slices_;
  std::map<int, std::vector<absl::string_view>> data_;  // pieces in received slices
  mutable std::map<int, std::string> joined_;
};

// Serialises `msg` into `out`, moving the data of its top-level Tensor / TensorChunk fields in
// `tensor_fields` into slices of their own instead of copying them (`msg` loses those bytes).
void SerializeMoving(google::protobuf::Message* msg, std::initializer_list<int> tensor_fields,
                     grpc::ByteBuffer* out);

// The same for bytes the caller owns: the data of tensor field `field` is `external[field]` (the
// message's own data there must be empty), referenced, not copied. `release` runs once gRPC holds
// none of those slices any more (when `out` and every copy of it are gone and the call that sent
// it is done with them); until then the caller keeps the bytes alive and unchanged.
void SerializeReferencing(const google::protobuf::Message& msg,
                          const std::map<int, absl::string_view>& external,
                          std::function<void()> release, grpc::ByteBuffer* out);

}  // namespace gradwire::wire
