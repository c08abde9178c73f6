#include "gradwire/wire/chunking.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gradwire/wire/tensor.h"

namespace gradwire::wire {

absl::StatusOr<int64_t> DataBytes(const v1::Tensor& t, absl::string_view field) {
  // One size table: the codec's, for the dtypes the contract knows.
  const absl::StatusOr<DType> dtype = FromProto(t.dtype(), field);
  const int64_t element_size = dtype.ok() ? ElementSize(*dtype) : 0;
  if (element_size == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".dtype must be one of F32, BF16, F16, FP8_E4M3, FP8_E5M2, got ",
                     v1::DType_Name(t.dtype()).empty() ? std::to_string(int(t.dtype()))
                                                       : v1::DType_Name(t.dtype())));
  }
  if (t.shape_size() == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".shape is empty; a tensor needs at least one dimension"));
  }
  int64_t numel = 1;
  for (int i = 0; i < t.shape_size(); ++i) {
    const int64_t d = t.shape(i);
    if (d < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".shape[", i, "] must be >= 1, got ", d));
    }
    if (d > kMaxTensorElements / numel) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".shape [", absl::StrJoin(t.shape(), ", "), "] has more than ",
                       kMaxTensorElements, " elements"));
    }
    numel *= d;
  }
  if (!t.has_block_scales()) {
    if (t.has_columnwise_scales()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field,
                       ".columnwise_scales needs block_scales: a columnwise copy is of a "
                       "block-scaled tensor"));
    }
    return numel * element_size;
  }
  if (!IsFp8(*dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".block_scales: only FP8 tensors have scales, this one is ", DTypeName(*dtype)));
  }
  if (t.scale_inv() != 0.0f) {
    return absl::InvalidArgumentError(absl::StrCat(field, " has both scale_inv (", t.scale_inv(),
                                                   ") and block_scales; send one of them"));
  }
  const int64_t cols = t.shape(t.shape_size() - 1), rows = numel / cols;
  auto check = [&](const v1::BlockScales& b, const char* name, int64_t r, int64_t c) {
    // At most kMaxTensorElements a side, so that no grid arithmetic (rows + block - 1) overflows.
    if (b.block_rows() < 1 || b.block_cols() < 1 || b.block_rows() > kMaxTensorElements ||
        b.block_cols() > kMaxTensorElements) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".", name, ": a block is at least 1 x 1 and at most ",
                       kMaxTensorElements, " a side, got ", b.block_rows(), " x ", b.block_cols()));
    }
    const int64_t grid_rows = (r - 1) / b.block_rows() + 1,
                  grid_cols = (c - 1) / b.block_cols() + 1;
    if (int64_t(b.scale_inv().size()) != grid_rows * grid_cols * 4) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".", name, ".scale_inv has ", b.scale_inv().size(), " bytes; ", b.block_rows(),
          " x ", b.block_cols(), " blocks of a ", r, " x ", c, " matrix need ",
          grid_rows * grid_cols, " float32 scales (", grid_rows * grid_cols * 4, " bytes)"));
    }
    return absl::OkStatus();
  };
  if (absl::Status s = check(t.block_scales(), "block_scales", rows, cols); !s.ok()) return s;
  if (!t.has_columnwise_scales()) return numel;
  if (absl::Status s = check(t.columnwise_scales(), "columnwise_scales", cols, rows); !s.ok()) {
    return s;
  }
  return 2 * numel;  // the codes, then their transpose's
}

namespace {

// `mutable_x()` would create an absent field: only ask for it when the field is present.
#define GW_ADD_IF_PRESENT(msg, name, out) \
  if ((msg).has_##name()) (out).push_back({(msg).mutable_##name(), #name})

template <typename Named>
std::vector<TensorSlot> NamedSlots(Named* params) {
  std::vector<TensorSlot> out;
  for (int i = 0; i < params->size(); ++i) {
    out.push_back(
        {params->Mutable(i)->mutable_tensor(), absl::StrCat("parameters[", i, "].tensor")});
  }
  return out;
}

}  // namespace

std::vector<TensorSlot> Slots(v1::ForwardRequest& m) {
  std::vector<TensorSlot> out;
  GW_ADD_IF_PRESENT(m, input, out);
  return out;
}
std::vector<TensorSlot> Slots(v1::ForwardResponse& m) {
  std::vector<TensorSlot> out;
  GW_ADD_IF_PRESENT(m, output, out);
  GW_ADD_IF_PRESENT(m, layernorm_output, out);
  return out;
}
std::vector<TensorSlot> Slots(v1::BackwardRequest& m) {
  std::vector<TensorSlot> out;
  GW_ADD_IF_PRESENT(m, grad_output, out);
  GW_ADD_IF_PRESENT(m, grad_layernorm_output, out);
  return out;
}
std::vector<TensorSlot> Slots(v1::BackwardResponse& m) {
  std::vector<TensorSlot> out;
  GW_ADD_IF_PRESENT(m, grad_input, out);
  return out;
}
std::vector<TensorSlot> Slots(v1::GetWeightsResponse& m) {
  return NamedSlots(m.mutable_parameters());
}
std::vector<TensorSlot> Slots(v1::SetWeightsRequest& m) {
  return NamedSlots(m.mutable_parameters());
}

int64_t PayloadBytes(const std::vector<TensorSlot>& slots) {
  int64_t total = 0;
  for (const TensorSlot& s : slots) total += int64_t(s.tensor->data().size());
  return total;
}

ChunkSplitter::ChunkSplitter(const std::vector<TensorSlot>& slots, int64_t chunk_bytes)
    : chunk_bytes_(std::max<int64_t>(1, chunk_bytes)) {
  for (const TensorSlot& s : slots) {
    data_.emplace_back();
    data_.back().swap(*s.tensor->mutable_data());  // a move: the header keeps no data
    total_ += int64_t(data_.back().size());
  }
}

bool ChunkSplitter::Next(uint32_t* tensor, uint64_t* offset, absl::string_view* data) {
  while (tensor_ < data_.size() && offset_ >= data_[tensor_].size()) {
    ++tensor_;
    offset_ = 0;
  }
  if (tensor_ >= data_.size()) return false;
  const std::string& d = data_[tensor_];
  const size_t n = std::min(d.size() - offset_, size_t(chunk_bytes_));
  *tensor = uint32_t(tensor_);
  *offset = offset_;
  *data = absl::string_view(d.data() + offset_, n);
  offset_ += n;
  return true;
}

bool ChunkSplitter::Next(v1::TensorChunk* chunk) {
  while (tensor_ < data_.size() && offset_ >= data_[tensor_].size()) {
    std::string().swap(data_[tensor_]);  // sent: free it now
    ++tensor_;
    offset_ = 0;
  }
  if (tensor_ >= data_.size()) return false;
  const std::string& d = data_[tensor_];
  const size_t n = std::min(d.size() - offset_, size_t(chunk_bytes_));
  chunk->set_tensor(uint32_t(tensor_));
  chunk->set_offset(offset_);
  chunk->set_data(d.data() + offset_, n);
  offset_ += n;
  return true;
}

absl::Status ChunkAssembler::Start(std::vector<TensorSlot> slots, int64_t max_total_bytes,
                                   absl::string_view limit_name, int64_t max_chunk_bytes,
                                   const std::function<absl::Status(int64_t)>& admit) {
  std::vector<int64_t> sizes;
  int64_t total = 0;
  for (const TensorSlot& s : slots) {
    if (!s.tensor->data().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(s.field, ".data must be empty in a chunked header (",
                       s.tensor->data().size(), " bytes given); its bytes travel in chunks"));
    }
    absl::StatusOr<int64_t> bytes = DataBytes(*s.tensor, s.field);
    if (!bytes.ok()) return bytes.status();
    sizes.push_back(*bytes);
    total += *bytes;
  }
  if (total > max_total_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("the message's tensors need ", total,
                                                     " bytes, more than ", limit_name, " (",
                                                     max_total_bytes, " bytes)"));
  }
  if (admit) {
    if (absl::Status s = admit(total); !s.ok()) return s;
  }
  // Capacity only: the pages are touched as the chunks arrive, so memory follows the bytes
  // received, not the bytes a header declares.
  for (size_t i = 0; i < slots.size(); ++i)
    slots[i].tensor->mutable_data()->reserve(size_t(sizes[i]));
  slots_ = std::move(slots);
  sizes_ = std::move(sizes);
  max_chunk_ = max_chunk_bytes;
  total_ = total;
  tensor_ = 0;
  offset_ = 0;
  received_ = 0;
  Advance();
  return absl::OkStatus();
}

void ChunkAssembler::Advance() {
  while (tensor_ < slots_.size() && offset_ >= sizes_[tensor_]) {
    ++tensor_;
    offset_ = 0;
  }
}

absl::Status ChunkAssembler::Add(const v1::TensorChunk& chunk) {
  return Add(chunk.tensor(), chunk.offset(), chunk.data());
}

absl::Status ChunkAssembler::Add(uint32_t chunk_tensor, uint64_t chunk_offset,
                                 absl::string_view chunk_data) {
  return Add(chunk_tensor, chunk_offset, std::vector<absl::string_view>{chunk_data});
}

absl::Status ChunkAssembler::Add(uint32_t chunk_tensor, uint64_t chunk_offset,
                                 const std::vector<absl::string_view>& pieces) {
  int64_t n = 0;
  for (absl::string_view piece : pieces) n += int64_t(piece.size());
  if (n == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk for tensor ", chunk_tensor, " at offset ", chunk_offset, " is empty"));
  }
  if (n > max_chunk_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk of ", n, " bytes is larger than the chunk limit (", max_chunk_, " bytes)"));
  }
  if (tensor_ >= slots_.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk for tensor ", chunk_tensor, " at offset ", chunk_offset, " arrived after all ",
        total_, " bytes of the message's ", slots_.size(), " tensor(s)"));
  }
  const TensorSlot& slot = slots_[tensor_];
  if (chunk_tensor != tensor_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk for tensor ", chunk_tensor, " arrived while tensor ", tensor_, " (", slot.field,
        ") still needs bytes from offset ", offset_, " of ", sizes_[tensor_]));
  }
  if (chunk_offset != uint64_t(offset_)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk of ", slot.field, " at offset ", chunk_offset, " is out of order: ",
        chunk_offset < uint64_t(offset_) ? "those bytes already arrived" : "bytes are missing",
        "; the next chunk must start at offset ", offset_));
  }
  if (n > sizes_[tensor_] - offset_) {
    return absl::InvalidArgumentError(absl::StrCat("chunk of ", slot.field, " at offset ", offset_,
                                                   " with ", n, " bytes runs past its end (",
                                                   sizes_[tensor_], " bytes)"));
  }
  for (absl::string_view piece : pieces) {  // at offset_: chunks arrive in order
    slot.tensor->mutable_data()->append(piece.data(), piece.size());
  }
  offset_ += n;
  received_ += n;
  Advance();
  return absl::OkStatus();
}

absl::Status ChunkAssembler::Complete() const {
  if (tensor_ >= slots_.size()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "the chunked message ended early: ", slots_[tensor_].field, " has ", offset_, " of ",
      sizes_[tensor_], " bytes (", received_, " of ", total_, " bytes in all)"));
}

}  // namespace gradwire::wire
