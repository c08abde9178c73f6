#include "gradwire/wire/zero_copy.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>

#include "absl/strings/str_cat.h"
#include "google/protobuf/wire_format.h"
#include "gradwire/v1/service.pb.h"
#include "gradwire/v1/tensor.pb.h"

namespace gradwire::wire {
namespace {

constexpr int kTensorDataField = 3;
constexpr uint32_t kLengthDelimited = 2;

void AppendVarint(std::string* out, uint64_t v) {
  while (v >= 0x80) {
    out->push_back(char(uint8_t(v) | 0x80));
    v >>= 7;
  }
  out->push_back(char(uint8_t(v)));
}

// `v` as a varint of exactly `width` bytes (padded with continuation bytes, as an overlong
// encoding); `v` must fit.
void AppendVarintWidth(std::string* out, uint64_t v, size_t width) {
  for (size_t i = 0; i + 1 < width; ++i, v >>= 7) out->push_back(char(uint8_t(v & 0x7f) | 0x80));
  out->push_back(char(uint8_t(v & 0x7f)));
}

size_t VarintSize(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) v >>= 7, ++n;
  return n;
}

bool Listed(std::initializer_list<int> fields, uint64_t field) {
  return std::find(fields.begin(), fields.end(), int64_t(field)) != fields.end();
}

// Reads a message spread over slices, tracking the absolute position.
class SliceReader {
 public:
  explicit SliceReader(const std::vector<grpc::Slice>& slices) : slices_(slices) {
    for (const grpc::Slice& s : slices_) total_ += s.size();
    SkipEmpty();
  }
  uint64_t pos() const { return pos_; }
  uint64_t total() const { return total_; }
  bool done() const { return pos_ >= total_; }

  // A varint; its bytes, exactly as they came, appended to `raw` when given.
  bool Varint(uint64_t* v, std::string* raw = nullptr) {
    *v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (done()) return false;
      const uint8_t b = Current()[0];
      if (raw != nullptr) raw->push_back(char(b));
      Advance(1);
      *v |= uint64_t(b & 0x7f) << shift;
      if (!(b & 0x80)) return true;
    }
    return false;  // more than 10 bytes
  }
  // Appends the next n bytes to `out`.
  bool Append(uint64_t n, std::string* out) {
    if (n > total_ - pos_) return false;
    while (n > 0) {
      const size_t take = size_t(std::min<uint64_t>(n, Left()));
      out->append(reinterpret_cast<const char*>(Current()), take);
      Advance(take);
      n -= take;
    }
    return true;
  }
  // The next n bytes as views into the slices they lie in (one piece when they lie in one).
  bool Pieces(uint64_t n, std::vector<absl::string_view>* out) {
    if (n > total_ - pos_) return false;
    out->clear();
    while (n > 0) {
      const size_t take = size_t(std::min<uint64_t>(n, Left()));
      out->emplace_back(reinterpret_cast<const char*>(Current()), take);
      Advance(take);
      n -= take;
    }
    return true;
  }

 private:
  const uint8_t* Current() const { return slices_[index_].begin() + offset_; }
  size_t Left() const { return slices_[index_].size() - offset_; }
  void Advance(size_t n) {
    offset_ += n;
    pos_ += n;
    SkipEmpty();
  }
  void SkipEmpty() {
    while (index_ < slices_.size() && offset_ >= slices_[index_].size()) {
      ++index_;
      offset_ = 0;
    }
  }

  const std::vector<grpc::Slice>& slices_;
  size_t index_ = 0, offset_ = 0;
  uint64_t pos_ = 0, total_ = 0;
};

// Copies a field's value of wire type 0, 1, 2 or 5 into `out`, byte for byte as it came; false
// when malformed or when it would run past `end`. A length-delimited value is copied as bytes,
// without looking inside.
bool CopyValue(SliceReader& r, uint64_t wire_type, uint64_t end, std::string* out) {
  switch (wire_type) {
    case 0: {
      uint64_t v;
      return r.Varint(&v, out) && r.pos() <= end;
    }
    case 1:
      return 8 <= end - r.pos() && r.Append(8, out);
    case 2: {
      uint64_t n;
      if (!r.Varint(&n, out) || r.pos() > end || n > end - r.pos()) return false;
      return r.Append(n, out);
    }
    case 5:
      return 4 <= end - r.pos() && r.Append(4, out);
    default:
      return false;
  }
}

// Protobuf refuses groups nested deeper than its recursion limit (100); deeper ones are refused
// here without reading on, so a hostile message cannot make the walk hold a long stack.
constexpr size_t kMaxGroupDepth = 1000;

// Copies one field into `out` byte for byte (`tag_raw`: its tag as it came); false when malformed
// or when it would run past `end`. Groups (wire types 3 and 4), which this protocol does not use,
// are copied whole, iteratively, as protobuf keeps them among unknown fields. Everything but the
// tensors' data is copied unchanged, so protobuf judges the copy (overlong varints, depth, field
// numbers) exactly as it would have judged the original.
bool CopyField(SliceReader& r, const std::string& tag_raw, uint64_t tag, uint64_t end,
               std::string* out) {
  out->append(tag_raw);
  if ((tag & 7) != 3) return CopyValue(r, tag & 7, end, out);
  std::vector<uint64_t> open = {tag >> 3};  // field numbers of the groups not closed yet
  while (!open.empty()) {
    uint64_t inner;
    if (!r.Varint(&inner, out) || r.pos() > end || (inner >> 3) == 0) return false;
    const uint64_t wire_type = inner & 7;
    if (wire_type == 4) {  // an end of group must close the innermost open one
      if ((inner >> 3) != open.back()) return false;
      open.pop_back();
    } else if (wire_type == 3) {
      if (open.size() >= kMaxGroupDepth) return false;
      open.push_back(inner >> 3);
    } else if (!CopyValue(r, wire_type, end, out)) {
      return false;
    }
  }
  return true;
}

// Setting field `field` of `m`'s type clears the other members of its oneof: their data goes. A
// value of the wrong wire type does not set the field (protobuf keeps it as an unknown field).
void ClearOneofSiblings(const google::protobuf::Message& m, uint64_t tag,
                        std::map<int, std::vector<absl::string_view>>* data) {
  const uint64_t field = tag >> 3;
  if (data->empty() || field > uint64_t(std::numeric_limits<int>::max())) return;
  const google::protobuf::FieldDescriptor* fd = m.GetDescriptor()->FindFieldByNumber(int(field));
  const google::protobuf::OneofDescriptor* oneof = fd ? fd->containing_oneof() : nullptr;
  if (oneof == nullptr ||
      uint64_t(google::protobuf::internal::WireFormat::WireTypeForField(fd)) != (tag & 7)) {
    return;
  }
  for (int i = 0; i < oneof->field_count(); ++i) {
    if (oneof->field(i) != fd) data->erase(oneof->field(i)->number());
  }
}

absl::Status Malformed(const google::protobuf::Message& m) {
  return absl::InvalidArgumentError(
      absl::StrCat("the request is not a valid encoding of ", m.GetDescriptor()->full_name()));
}

// The prefix of one Tensor field whose data (n bytes) follows as a slice of its own: field tag,
// the Tensor's length, its other fields, the data field's tag and length.
std::string TensorPrefix(int field, const google::protobuf::Message& header, size_t n) {
  const std::string sub = header.SerializeAsString();
  const uint64_t data_field = n > 0 ? 1 + VarintSize(n) + n : 0;
  std::string prefix;
  AppendVarint(&prefix, (uint64_t(field) << 3) | kLengthDelimited);
  AppendVarint(&prefix, sub.size() + data_field);
  prefix += sub;
  if (n > 0) {
    AppendVarint(&prefix, (uint64_t(kTensorDataField) << 3) | kLengthDelimited);
    AppendVarint(&prefix, n);
  }
  return prefix;
}

void DeleteString(void* p) { delete static_cast<std::string*>(p); }

// The data field (number 3) of a Tensor or TensorChunk.
std::string* DataOf(google::protobuf::Message* m) {
  if (auto* t = dynamic_cast<v1::Tensor*>(m)) return t->mutable_data();
  return dynamic_cast<v1::TensorChunk&>(*m).mutable_data();
}

// Runs a caller's release callback when the last slice referencing its bytes goes
// (SerializeReferencing); each such slice owns one shared_ptr to it.
struct ReleaseHolder {
  std::function<void()> release;
  ~ReleaseHolder() {
    if (release) release();
  }
};

void DeleteHolder(void* p) { delete static_cast<std::shared_ptr<ReleaseHolder>*>(p); }

}  // namespace

absl::Status ReceivedMessage::Parse(const grpc::ByteBuffer& buffer,
                                    google::protobuf::Message* header,
                                    std::initializer_list<int> tensor_fields) {
  slices_.clear();
  data_.clear();
  joined_.clear();
  header->Clear();
  if (!buffer.Valid()) return absl::OkStatus();  // an empty message
  if (!buffer.Dump(&slices_).ok()) return Malformed(*header);
  SliceReader r(slices_);
  // The message without its tensors' data bytes, otherwise byte for byte as it came: each data
  // field keeps its tag and an empty value of its length's width, each tensor's length shrinks
  // by what was taken out (written in the width it came in).
  std::string rest;
  while (!r.done()) {
    uint64_t tag;
    std::string tag_raw;
    if (!r.Varint(&tag, &tag_raw) || (tag >> 3) == 0) return Malformed(*header);
    const uint64_t field = tag >> 3;
    if ((tag & 7) != kLengthDelimited || !Listed(tensor_fields, field)) {
      if (!CopyField(r, tag_raw, tag, r.total(), &rest)) return Malformed(*header);
      // Another member of a oneof that holds a tensor field clears it, as protobuf does.
      ClearOneofSiblings(*header, tag, &data_);
      continue;
    }
    uint64_t n;
    std::string n_raw;
    if (!r.Varint(&n, &n_raw) || n > r.total() - r.pos()) return Malformed(*header);
    const uint64_t end = r.pos() + n;
    std::string sub;
    while (r.pos() < end) {
      uint64_t subtag;
      std::string subtag_raw;
      if (!r.Varint(&subtag, &subtag_raw) || (subtag >> 3) == 0 || r.pos() > end) {
        return Malformed(*header);
      }
      if (subtag == ((uint64_t(kTensorDataField) << 3) | kLengthDelimited)) {
        uint64_t len;
        std::string len_raw;
        std::vector<absl::string_view> pieces;
        if (!r.Varint(&len, &len_raw) || r.pos() > end || len > end - r.pos() ||
            !r.Pieces(len, &pieces)) {
          return Malformed(*header);
        }
        // A later occurrence replaces an earlier one, as protobuf's merge does.
        data_[int(field)] = std::move(pieces);
        sub += subtag_raw;
        AppendVarintWidth(&sub, 0, len_raw.size());
      } else if (!CopyField(r, subtag_raw, subtag, end, &sub)) {
        return Malformed(*header);
      }
    }
    if (r.pos() != end) return Malformed(*header);
    rest += tag_raw;
    AppendVarintWidth(&rest, sub.size(), n_raw.size());  // no longer than it was: it fits
    rest += sub;
  }
  if (!header->ParseFromString(rest)) return Malformed(*header);
  return absl::OkStatus();
}

absl::string_view ReceivedMessage::data(int field) const {
  auto it = data_.find(field);
  if (it == data_.end() || it->second.empty()) return {};
  if (it->second.size() == 1) return it->second[0];
  auto joined = joined_.find(field);
  if (joined == joined_.end()) {
    std::string& copy = joined_[field];
    copy.reserve(size(field));
    AppendTo(field, &copy);
    return copy;
  }
  return joined->second;
}

const std::vector<absl::string_view>& ReceivedMessage::pieces(int field) const {
  static const std::vector<absl::string_view> kNone;
  auto it = data_.find(field);
  return it == data_.end() ? kNone : it->second;
}

size_t ReceivedMessage::size(int field) const {
  auto it = data_.find(field);
  size_t n = 0;
  if (it != data_.end()) {
    for (absl::string_view piece : it->second) n += piece.size();
  }
  return n;
}

void ReceivedMessage::AppendTo(int field, std::string* out) const {
  auto it = data_.find(field);
  if (it == data_.end()) return;
  for (absl::string_view piece : it->second) out->append(piece.data(), piece.size());
}

void SerializeMoving(google::protobuf::Message* msg, std::initializer_list<int> tensor_fields,
                     grpc::ByteBuffer* out) {
  const google::protobuf::Reflection* refl = msg->GetReflection();
  const google::protobuf::Descriptor* desc = msg->GetDescriptor();
  std::vector<grpc::Slice> slices(1);  // [0]: the other fields, filled last
  std::vector<std::pair<const google::protobuf::FieldDescriptor*, google::protobuf::Message*>>
      released;
  for (int field : tensor_fields) {
    const google::protobuf::FieldDescriptor* fd = desc->FindFieldByNumber(field);
    if (fd == nullptr || !refl->HasField(*msg, fd)) continue;
    google::protobuf::Message* t = refl->ReleaseMessage(msg, fd);
    std::string* data = DataOf(t);
    auto* bytes = new std::string(std::move(*data));
    data->clear();
    slices.emplace_back(TensorPrefix(field, *t, bytes->size()));
    if (bytes->empty()) {
      delete bytes;
    } else {
      slices.emplace_back(bytes->data(), bytes->size(), &DeleteString, bytes);
    }
    released.emplace_back(fd, t);
  }
  slices[0] = grpc::Slice(msg->SerializeAsString());
  for (auto& [fd, t] : released) refl->SetAllocatedMessage(msg, t, fd);  // back, without data
  *out = grpc::ByteBuffer(slices.data(), slices.size());
}

void SerializeReferencing(const google::protobuf::Message& msg,
                          const std::map<int, absl::string_view>& external,
                          std::function<void()> release, grpc::ByteBuffer* out) {
  const google::protobuf::Descriptor* desc = msg.GetDescriptor();
  std::unique_ptr<google::protobuf::Message> rest(msg.New());
  rest->CopyFrom(msg);
  const google::protobuf::Reflection* refl = rest->GetReflection();
  // One holder for every referencing slice: the last slice gRPC drops runs `release`.
  auto holder = std::make_shared<ReleaseHolder>();
  holder->release = std::move(release);
  std::vector<grpc::Slice> slices(1);
  for (const auto& [field, bytes] : external) {
    const google::protobuf::FieldDescriptor* fd = desc->FindFieldByNumber(field);
    if (fd == nullptr) continue;
    const google::protobuf::Message& t = refl->GetMessage(*rest, fd);
    slices.emplace_back(TensorPrefix(field, t, bytes.size()));
    if (!bytes.empty()) {
      slices.emplace_back(const_cast<char*>(bytes.data()), bytes.size(), &DeleteHolder,
                          new std::shared_ptr<ReleaseHolder>(holder));
    }
    refl->ClearField(rest.get(), fd);
  }
  slices[0] = grpc::Slice(rest->SerializeAsString());
  *out = grpc::ByteBuffer(slices.data(), slices.size());
}

}  // namespace gradwire::wire
