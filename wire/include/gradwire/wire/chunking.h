// Chunked messages (see the *Chunked RPCs in service.proto): a header -- the unary message with
// each tensor's data left empty -- then the tensors' bytes in order, in TensorChunks. Both sides
// use these: ChunkSplitter turns a full message into header + chunks, ChunkAssembler checks an
// incoming sequence and writes each chunk straight into the tensor it belongs to (the buffer is
// sized once from the header's dtype and shape, so reassembly makes no second full copy).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "gradwire/v1/service.pb.h"

namespace gradwire::wire {

// Most elements one tensor may have (also bounds the byte arithmetic).
inline constexpr int64_t kMaxTensorElements = int64_t(1) << 31;

// The data bytes `t`'s dtype and shape call for (twice the codes for an FP8 tensor with a
// columnwise copy); INVALID_ARGUMENT naming `field` when the dtype is unknown or the shape is
// empty, has a dimension < 1 or more than kMaxTensorElements elements, or when block scales are
// malformed: on a tensor that is not FP8, beside a scale_inv, a block under 1 x 1, a grid of the
// wrong size, a columnwise copy without block scales.
absl::StatusOr<int64_t> DataBytes(const v1::Tensor& t, absl::string_view field);

// A tensor of a message in chunk order, with the field name errors use.
struct TensorSlot {
  v1::Tensor* tensor;
  std::string field;
};

// The tensors of each chunked message, in the order service.proto's TensorChunk gives.
std::vector<TensorSlot> Slots(v1::ForwardRequest& m);
std::vector<TensorSlot> Slots(v1::ForwardResponse& m);
std::vector<TensorSlot> Slots(v1::BackwardRequest& m);
std::vector<TensorSlot> Slots(v1::BackwardResponse& m);
std::vector<TensorSlot> Slots(v1::GetWeightsResponse& m);
std::vector<TensorSlot> Slots(v1::SetWeightsRequest& m);

// Sum of the tensors' data bytes (as sent in a full message).
int64_t PayloadBytes(const std::vector<TensorSlot>& slots);

// Takes the data out of a full message's tensors (which leaves the message as its header) and
// hands it back in chunks of at most `chunk_bytes`.
class ChunkSplitter {
 public:
  ChunkSplitter(const std::vector<TensorSlot>& slots, int64_t chunk_bytes);
  // The next chunk; false once every byte was handed out.
  bool Next(v1::TensorChunk* chunk);
  // The same without copying: `data` points into the splitter's tensors, which stay alive as long
  // as the splitter (the copying Next frees each tensor once sent; this one does not).
  bool Next(uint32_t* tensor, uint64_t* offset, absl::string_view* data);
  int64_t total_bytes() const { return total_; }

 private:
  std::vector<std::string> data_;
  int64_t chunk_bytes_;
  size_t tensor_ = 0;
  size_t offset_ = 0;
  int64_t total_ = 0;
};

// Checks a chunk sequence against its header and places the bytes.
class ChunkAssembler {
 public:
  // `slots` are the header's tensors; their data must be empty. RESOURCE_EXHAUSTED when they add
  // up to more than `max_total_bytes` (naming `limit_name`); INVALID_ARGUMENT for a malformed
  // tensor. `admit`, when given, sees the total before anything is allocated and may refuse it.
  // On success each tensor's data has the capacity its shape needs; chunks fill it in order.
  absl::Status Start(std::vector<TensorSlot> slots, int64_t max_total_bytes,
                     absl::string_view limit_name, int64_t max_chunk_bytes,
                     const std::function<absl::Status(int64_t)>& admit = nullptr);
  // Places one chunk; INVALID_ARGUMENT when it is empty, larger than the chunk limit, for another
  // tensor than the one being filled, not at the next offset (missing, repeated or out-of-order
  // bytes), past the end of its tensor, or after the last byte.
  absl::Status Add(const v1::TensorChunk& chunk);
  // The same for a chunk whose bytes arrived apart from its message, in pieces (zero_copy.h):
  // they are copied once, straight into place.
  absl::Status Add(uint32_t tensor, uint64_t offset, absl::string_view data);
  absl::Status Add(uint32_t tensor, uint64_t offset, const std::vector<absl::string_view>& pieces);
  // OK when every byte arrived; else INVALID_ARGUMENT saying what is missing.
  absl::Status Complete() const;
  int64_t total_bytes() const { return total_; }
  int64_t received_bytes() const { return received_; }

 private:
  void Advance();
  std::vector<TensorSlot> slots_;
  std::vector<int64_t> sizes_;
  int64_t max_chunk_ = 0;
  size_t tensor_ = 0;
  int64_t offset_ = 0;
  int64_t total_ = 0;
  int64_t received_ = 0;
};

}  // namespace gradwire::wire
