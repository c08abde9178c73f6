#include "gradwire/storage/safetensors.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace gradwire::storage {
namespace {

using Json = nlohmann::json;

constexpr uint64_t kLengthBytes = kSafetensorsPrefixBytes;
// Hostile names can be as long as the header; error messages quote only their start.
constexpr size_t kMaxQuotedChars = 80;
// The JSON library's messages quote the offending token, which can be just as long.
constexpr size_t kMaxJsonErrorChars = 160;

struct DTypeInfo {
  StDType dtype;
  const char* name;
  int64_t size;
};

constexpr DTypeInfo kDTypes[] = {
    {StDType::kF32, "F32", 4},        {StDType::kBF16, "BF16", 2},      {StDType::kF16, "F16", 2},
    {StDType::kF8E4M3, "F8_E4M3", 1}, {StDType::kF8E5M2, "F8_E5M2", 1},
};

const DTypeInfo* FindDType(absl::string_view name) {
  for (const DTypeInfo& info : kDTypes) {
    if (name == info.name) return &info;
  }
  return nullptr;
}

std::string Quote(absl::string_view s) {
  if (s.size() <= kMaxQuotedChars) return absl::StrCat("'", absl::CHexEscape(s), "'");
  return absl::StrCat("'", absl::CHexEscape(s.substr(0, kMaxQuotedChars)), "'... (", s.size(),
                      " bytes)");
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// RFC 3629 UTF-8: no overlong forms, no surrogates, nothing above U+10FFFF. JSON text must be
// UTF-8, and this is what the JSON library checks when it writes the header.
bool IsValidUtf8(absl::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    uint32_t cp, min;
    if ((c & 0xE0) == 0xC0) {
      len = 2, cp = c & 0x1F, min = 0x80;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3, cp = c & 0x0F, min = 0x800;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4, cp = c & 0x07, min = 0x10000;
    } else {
      return false;
    }
    if (s.size() - i < len) return false;
    for (size_t k = 1; k < len; ++k) {
      const unsigned char cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += len;
  }
  return true;
}

// numel of `shape`, or INVALID_ARGUMENT naming `what` for a negative dimension or too many
// elements. Checked per step so the running product never overflows.
absl::StatusOr<uint64_t> CheckedNumel(const std::vector<int64_t>& shape, absl::string_view what) {
  uint64_t numel = 1;
  for (int64_t d : shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": negative dimension ", d, " in shape ", ShapeString(shape)));
    }
    const uint64_t ud = static_cast<uint64_t>(d);
    if (ud >= kMaxSafetensorsElements || (ud != 0 && numel > (kMaxSafetensorsElements - 1) / ud)) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": shape ", ShapeString(shape),
                                                     " has too many elements (overflow; the "
                                                     "limit is 2^40)"));
    }
    numel *= ud;
  }
  return numel;
}

}  // namespace

absl::StatusOr<uint64_t> SafetensorsHeaderLength(absl::string_view prefix, uint64_t file_size) {
  if (file_size < kLengthBytes || prefix.size() < kLengthBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "file is ", file_size, " bytes, shorter than the 8-byte header length prefix"));
  }
  uint64_t n = 0;
  for (size_t i = 0; i < kLengthBytes; ++i) {
    n |= uint64_t{static_cast<unsigned char>(prefix[i])} << (8 * i);
  }
  if (n > kMaxSafetensorsHeaderBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("header length ", n, " is larger than the limit of 100 MiB"));
  }
  if (n > file_size - kLengthBytes) {
    return absl::InvalidArgumentError(absl::StrCat("header length ", n, " is larger than the ",
                                                   file_size - kLengthBytes,
                                                   " bytes that follow the length prefix"));
  }
  return n;
}

namespace {

// Streams the header through nlohmann's SAX interface instead of building a JSON DOM: values
// that do not matter (unknown fields) are skipped without being stored, structural errors stop
// the parse at once, and nesting depth costs nothing, so memory stays close to the size of the
// result however the header is crafted.
class HeaderHandler {
 public:
  explicit HeaderHandler(uint64_t data_size) : data_size_(data_size) {}

  absl::Status status() const { return status_; }
  bool done() const { return state_ == State::kDone; }
  std::vector<StEntry>& entries() { return entries_; }
  std::map<std::string, std::string>& metadata() { return metadata_; }

  // The SAX interface (see nlohmann::json_sax).
  bool null() { return Value(Kind::kNull); }
  bool boolean(bool) { return Value(Kind::kBool); }
  bool number_integer(Json::number_integer_t v) {
    return v >= 0 ? Value(Kind::kUnsigned, static_cast<uint64_t>(v)) : Value(Kind::kNegative, 0, v);
  }
  bool number_unsigned(Json::number_unsigned_t v) { return Value(Kind::kUnsigned, v); }
  bool number_float(Json::number_float_t, const Json::string_t&) { return Value(Kind::kFloat); }
  bool string(Json::string_t& s) { return Value(Kind::kString, 0, 0, &s); }
  bool binary(Json::binary_t&) { return Value(Kind::kBinary); }
  bool start_object(std::size_t) { return Value(Kind::kObject); }
  bool start_array(std::size_t) { return Value(Kind::kArray); }
  bool key(Json::string_t& k);
  bool end_object();
  bool end_array();
  bool parse_error(std::size_t, const std::string&, const Json::exception& e) {
    std::string what = e.what();
    if (what.size() > kMaxJsonErrorChars) {
      what = absl::StrCat(what.substr(0, kMaxJsonErrorChars), "...");
    }
    return Fail(absl::StrCat("header is not valid JSON: ", what));
  }

 private:
  enum class Kind { kNull, kBool, kUnsigned, kNegative, kFloat, kString, kBinary, kObject, kArray };
  // Where in the header the next event is.
  enum class State {
    kRoot,        // before the top-level value
    kTop,         // in the top-level object: key or end
    kTopValue,    // after a top-level key
    kMetadata,    // in "__metadata__": key or end
    kMetaValue,   // after a metadata key
    kTensor,      // in a tensor entry: key or end
    kFieldValue,  // after a tensor entry key
    kShape,       // in "shape": element or end
    kOffsets,     // in "data_offsets": element or end
    kSkip,        // inside the value of an unknown tensor field
    kDone,        // after the top-level object
  };
  enum class Field { kDType, kShape, kOffsets, kUnknown };

  static const char* KindName(Kind kind) {
    switch (kind) {
      case Kind::kNull:
        return "null";
      case Kind::kBool:
        return "a boolean";
      case Kind::kUnsigned:
        return "an integer";
      case Kind::kNegative:
        return "a negative integer";
      case Kind::kFloat:
        return "a non-integer number";
      case Kind::kString:
        return "a string";
      case Kind::kBinary:
        return "binary data";
      case Kind::kObject:
        return "an object";
      case Kind::kArray:
        return "an array";
    }
    return "an unknown value";
  }

  bool Fail(std::string message) {
    status_ = absl::InvalidArgumentError(std::move(message));
    return false;
  }
  std::string Where() const { return absl::StrCat("tensor ", Quote(current_.tensor.name)); }

  bool Value(Kind kind, uint64_t u = 0, int64_t neg = 0, Json::string_t* s = nullptr);
  bool ShapeElement(Kind kind, uint64_t u, int64_t neg);
  bool OffsetElement(Kind kind, uint64_t u);
  bool FinishTensor();

  const uint64_t data_size_;
  absl::Status status_;
  State state_ = State::kRoot;
  std::vector<StEntry> entries_;
  std::map<std::string, std::string> metadata_;
  bool seen_metadata_ = false;
  bool value_is_metadata_ = false;
  std::string meta_key_;
  // The tensor entry being read.
  StEntry current_;
  Field field_ = Field::kUnknown;
  bool has_dtype_ = false, has_shape_ = false, has_offsets_ = false;
  uint64_t numel_ = 1;
  int offsets_seen_ = 0;
  uint64_t skip_depth_ = 0;
};

bool HeaderHandler::Value(Kind kind, uint64_t u, int64_t neg, Json::string_t* s) {
  const bool container = kind == Kind::kObject || kind == Kind::kArray;
  switch (state_) {
    case State::kRoot:
      if (kind != Kind::kObject) {
        return Fail(absl::StrCat("header is not a JSON object (it is ", KindName(kind), ")"));
      }
      state_ = State::kTop;
      return true;
    case State::kTopValue:
      if (value_is_metadata_) {
        if (kind != Kind::kObject) {
          return Fail(
              absl::StrCat("\"__metadata__\" must be an object of strings, not ", KindName(kind)));
        }
        state_ = State::kMetadata;
        return true;
      }
      if (kind != Kind::kObject) {
        return Fail(absl::StrCat(Where(), ": entry must be a JSON object, not ", KindName(kind)));
      }
      state_ = State::kTensor;
      return true;
    case State::kMetaValue:
      if (kind != Kind::kString) {
        return Fail(absl::StrCat("\"__metadata__\" value of key ", Quote(meta_key_),
                                 " must be a string, not ", KindName(kind)));
      }
      metadata_.emplace(std::move(meta_key_), std::move(*s));
      state_ = State::kMetadata;
      return true;
    case State::kFieldValue:
      switch (field_) {
        case Field::kDType: {
          if (kind != Kind::kString) {
            return Fail(
                absl::StrCat(Where(), ": \"dtype\" must be a string, not ", KindName(kind)));
          }
          const DTypeInfo* info = FindDType(*s);
          if (info == nullptr) {
            return Fail(absl::StrCat(Where(), ": unknown or unsupported dtype ", Quote(*s),
                                     " (supported: F32, BF16, F16, F8_E4M3, F8_E5M2)"));
          }
          current_.tensor.dtype = info->dtype;
          has_dtype_ = true;
          state_ = State::kTensor;
          return true;
        }
        case Field::kShape:
          if (kind != Kind::kArray) {
            return Fail(absl::StrCat(Where(), ": \"shape\" must be an array of integers, not ",
                                     KindName(kind)));
          }
          numel_ = 1;
          state_ = State::kShape;
          return true;
        case Field::kOffsets:
          if (kind != Kind::kArray) {
            return Fail(absl::StrCat(
                Where(), ": \"data_offsets\" must be an array of two non-negative integers, not ",
                KindName(kind)));
          }
          offsets_seen_ = 0;
          state_ = State::kOffsets;
          return true;
        case Field::kUnknown:
          if (container) {
            skip_depth_ = 1;
            state_ = State::kSkip;
          } else {
            state_ = State::kTensor;
          }
          return true;
      }
      break;
    case State::kShape:
      return ShapeElement(kind, u, neg);
    case State::kOffsets:
      return OffsetElement(kind, u);
    case State::kSkip:
      if (container) ++skip_depth_;
      return true;
    case State::kTop:
    case State::kMetadata:
    case State::kTensor:
    case State::kDone:
      break;
  }
  // The JSON grammar puts a key, not a value, in these states.
  return Fail("header has an unexpected JSON structure");
}

bool HeaderHandler::ShapeElement(Kind kind, uint64_t u, int64_t neg) {
  std::vector<int64_t>& shape = current_.tensor.shape;
  if (kind == Kind::kNegative) {
    return Fail(absl::StrCat(Where(), ": negative dimension ", neg, " at index ", shape.size(),
                             " of \"shape\""));
  }
  if (kind != Kind::kUnsigned) {
    return Fail(absl::StrCat(Where(), ": \"shape\" element ", shape.size(),
                             " must be a non-negative integer, not ", KindName(kind)));
  }
  if (u >= kMaxSafetensorsElements || (u != 0 && numel_ > (kMaxSafetensorsElements - 1) / u)) {
    return Fail(absl::StrCat(Where(), ": \"shape\" has too many elements at dimension ",
                             shape.size(), " (", u,
                             "): numel * element size would overflow; the limit is 2^40 "
                             "elements"));
  }
  numel_ *= u;
  shape.push_back(static_cast<int64_t>(u));
  return true;
}

bool HeaderHandler::OffsetElement(Kind kind, uint64_t u) {
  if (offsets_seen_ == 2) {
    return Fail(absl::StrCat(Where(),
                             ": \"data_offsets\" must be exactly two non-negative integers, "
                             "found more"));
  }
  if (kind != Kind::kUnsigned) {
    return Fail(absl::StrCat(Where(), ": \"data_offsets\" element ", offsets_seen_,
                             " must be a non-negative integer, not ", KindName(kind)));
  }
  (offsets_seen_ == 0 ? current_.begin : current_.end) = u;
  ++offsets_seen_;
  return true;
}

bool HeaderHandler::key(Json::string_t& k) {
  switch (state_) {
    case State::kTop:
      if (k == "__metadata__") {
        if (seen_metadata_) return Fail("\"__metadata__\" appears twice in the header");
        seen_metadata_ = true;
        value_is_metadata_ = true;
      } else {
        if (k.empty()) return Fail("a tensor has an empty name");
        value_is_metadata_ = false;
        current_ = StEntry();
        current_.tensor.name = std::move(k);
        has_dtype_ = has_shape_ = has_offsets_ = false;
      }
      state_ = State::kTopValue;
      return true;
    case State::kMetadata:
      if (metadata_.count(k) != 0) {
        return Fail(absl::StrCat("\"__metadata__\" has the key ", Quote(k), " twice"));
      }
      meta_key_ = std::move(k);
      state_ = State::kMetaValue;
      return true;
    case State::kTensor: {
      bool* seen = nullptr;
      if (k == "dtype") {
        field_ = Field::kDType, seen = &has_dtype_;
      } else if (k == "shape") {
        field_ = Field::kShape, seen = &has_shape_;
      } else if (k == "data_offsets") {
        field_ = Field::kOffsets, seen = &has_offsets_;
      } else {
        field_ = Field::kUnknown;
      }
      if (seen != nullptr) {
        if (*seen) return Fail(absl::StrCat(Where(), ": \"", k, "\" appears twice"));
        // Set now: a field whose value turns out ill-typed fails the whole parse anyway.
        *seen = true;
      }
      state_ = State::kFieldValue;
      return true;
    }
    case State::kSkip:
      return true;
    default:
      return Fail("header has an unexpected JSON structure");
  }
}

bool HeaderHandler::end_object() {
  switch (state_) {
    case State::kSkip:
      if (--skip_depth_ == 0) state_ = State::kTensor;
      return true;
    case State::kMetadata:
      state_ = State::kTop;
      return true;
    case State::kTensor:
      if (!FinishTensor()) return false;
      state_ = State::kTop;
      return true;
    case State::kTop:
      state_ = State::kDone;
      return true;
    default:
      return Fail("header has an unexpected JSON structure");
  }
}

bool HeaderHandler::end_array() {
  switch (state_) {
    case State::kSkip:
      if (--skip_depth_ == 0) state_ = State::kTensor;
      return true;
    case State::kShape:
      state_ = State::kTensor;
      return true;
    case State::kOffsets:
      if (offsets_seen_ != 2) {
        return Fail(absl::StrCat(Where(),
                                 ": \"data_offsets\" must be exactly two non-negative integers, "
                                 "found ",
                                 offsets_seen_));
      }
      state_ = State::kTensor;
      return true;
    default:
      return Fail("header has an unexpected JSON structure");
  }
}

bool HeaderHandler::FinishTensor() {
  for (auto [has, field] : {std::pair<bool, const char*>{has_dtype_, "dtype"},
                            {has_shape_, "shape"},
                            {has_offsets_, "data_offsets"}}) {
    if (!has) return Fail(absl::StrCat(Where(), ": missing \"", field, "\""));
  }
  const uint64_t begin = current_.begin, end = current_.end;
  const std::string offsets = absl::StrCat("\"data_offsets\" [", begin, ", ", end, "]");
  if (begin > end) return Fail(absl::StrCat(Where(), ": ", offsets, " has begin after end"));
  if (end > data_size_) {
    return Fail(absl::StrCat(Where(), ": ", offsets, " ends beyond the data section of ",
                             data_size_, " bytes"));
  }
  const uint64_t needed = numel_ * static_cast<uint64_t>(StDTypeSize(current_.tensor.dtype));
  if (end - begin != needed) {
    return Fail(absl::StrCat(Where(), ": ", offsets, " span ", end - begin, " bytes but ",
                             StDTypeName(current_.tensor.dtype), " shape ",
                             ShapeString(current_.tensor.shape), " needs ", needed));
  }
  entries_.push_back(std::move(current_));
  current_ = StEntry();
  return true;
}

}  // namespace

absl::StatusOr<std::vector<StEntry>> ParseSafetensorsHeader(
    absl::string_view json, uint64_t data_size, std::map<std::string, std::string>* metadata) {
  // nlohmann's lexer takes a NUL byte for the end of its input and would accept whatever follows;
  // JSON text has no place for one (strings must escape it).
  if (const size_t nul = json.find('\0'); nul != absl::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("header is not valid JSON: NUL byte at header offset ", nul));
  }
  HeaderHandler handler(data_size);
  bool ok;
  try {
    ok = Json::sax_parse(json.data(), json.data() + json.size(), &handler);
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("header is not valid JSON: ", e.what()));
  }
  if (!ok || !handler.done()) {
    if (!handler.status().ok()) return handler.status();
    return absl::InvalidArgumentError("header is not a complete JSON object");
  }
  std::vector<StEntry>& entries = handler.entries();

  // JSON allows repeated keys; a repeated tensor name would make a lookup by name ambiguous.
  {
    std::vector<const std::string*> names;
    names.reserve(entries.size());
    for (const StEntry& e : entries) names.push_back(&e.tensor.name);
    std::sort(names.begin(), names.end(),
              [](const std::string* a, const std::string* b) { return *a < *b; });
    for (size_t i = 1; i < names.size(); ++i) {
      if (*names[i] == *names[i - 1]) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor name ", Quote(*names[i]), " appears twice in the header"));
      }
    }
  }

  std::sort(entries.begin(), entries.end(), [](const StEntry& a, const StEntry& b) {
    return std::tie(a.begin, a.end, a.tensor.name) < std::tie(b.begin, b.end, b.tensor.name);
  });
  // Walking the sorted ranges with a cursor finds both overlaps and holes.
  uint64_t cursor = 0;
  const StEntry* previous = nullptr;
  for (const StEntry& e : entries) {
    if (e.begin < cursor) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", Quote(e.tensor.name), ": \"data_offsets\" [", e.begin, ", ",
                       e.end, "] overlap tensor ", Quote(previous->tensor.name), " [",
                       previous->begin, ", ", previous->end, "]"));
    }
    if (e.begin > cursor) {
      return absl::InvalidArgumentError(
          absl::StrCat("bytes [", cursor, ", ", e.begin,
                       ") of the data section are not covered by any tensor (a hole before "
                       "tensor ",
                       Quote(e.tensor.name), ")"));
    }
    cursor = e.end;
    previous = &e;
  }
  if (cursor != data_size) {
    return absl::InvalidArgumentError(absl::StrCat("bytes [", cursor, ", ", data_size,
                                                   ") at the end of the data section are not "
                                                   "covered by any tensor"));
  }
  if (metadata != nullptr) *metadata = std::move(handler.metadata());
  return std::move(entries);
}

absl::string_view StDTypeName(StDType dtype) {
  for (const DTypeInfo& info : kDTypes) {
    if (info.dtype == dtype) return info.name;
  }
  return "UNKNOWN";
}

int64_t StDTypeSize(StDType dtype) {
  for (const DTypeInfo& info : kDTypes) {
    if (info.dtype == dtype) return info.size;
  }
  return 0;
}

absl::StatusOr<std::string> SerializeSafetensors(
    const std::vector<StTensor>& tensors, const std::map<std::string, std::string>& metadata) {
  for (const auto& [key, value] : metadata) {
    if (!IsValidUtf8(key) || !IsValidUtf8(value)) {
      return absl::InvalidArgumentError(
          absl::StrCat("metadata key ", Quote(key), " or its value is not valid UTF-8"));
    }
  }
  std::set<absl::string_view> names;
  uint64_t data_size = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const StTensor& t = tensors[i];
    if (t.name.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("tensor #", i, " has an empty name"));
    }
    const std::string where = absl::StrCat("tensor ", Quote(t.name));
    if (t.name == "__metadata__") {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": the name \"__metadata__\" is reserved by the format"));
    }
    if (!IsValidUtf8(t.name)) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": name is not valid UTF-8"));
    }
    if (!names.insert(t.name).second) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": duplicate name"));
    }
    const int64_t element_size = StDTypeSize(t.dtype);
    if (element_size == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": invalid dtype value ", static_cast<int>(t.dtype)));
    }
    absl::StatusOr<uint64_t> numel = CheckedNumel(t.shape, where);
    if (!numel.ok()) return numel.status();
    const uint64_t size = *numel * static_cast<uint64_t>(element_size);
    if (t.data.size() != size) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": data has ", t.data.size(),
                                                     " bytes but ", StDTypeName(t.dtype), " shape ",
                                                     ShapeString(t.shape), " needs ", size));
    }
    data_size += size;
  }

  // The header is assembled piece by piece (each piece encoded by the JSON library) so that it
  // lists the metadata first and the tensors in data order, in time linear in their number.
  std::string text = "{";
  try {
    if (!metadata.empty()) text += absl::StrCat("\"__metadata__\":", Json(metadata).dump());
    uint64_t offset = 0;
    for (const StTensor& t : tensors) {
      const uint64_t size = t.data.size();
      nlohmann::ordered_json entry = {{"dtype", std::string(StDTypeName(t.dtype))},
                                      {"shape", t.shape},
                                      {"data_offsets", {offset, offset + size}}};
      if (text.size() > 1) text += ',';
      text += Json(t.name).dump();
      text += ':';
      text += entry.dump();
      offset += size;
    }
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("cannot encode the header: ", e.what()));
  }
  text += '}';
  // The format allows trailing spaces in the header; they align the data section to 8 bytes so
  // that a reader mapping the file can view tensors in place.
  text.append((kLengthBytes - text.size() % kLengthBytes) % kLengthBytes, ' ');

  std::string out;
  out.reserve(kLengthBytes + text.size() + data_size);
  const uint64_t n = text.size();
  for (size_t i = 0; i < kLengthBytes; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xFF));
  out += text;
  for (const StTensor& t : tensors) out += t.data;
  return out;
}

absl::StatusOr<std::vector<StTensor>> ParseSafetensors(
    absl::string_view bytes, std::map<std::string, std::string>* metadata) {
  absl::StatusOr<uint64_t> n = SafetensorsHeaderLength(bytes, bytes.size());
  if (!n.ok()) return n.status();
  const uint64_t data_start = kLengthBytes + *n;
  absl::StatusOr<std::vector<StEntry>> entries =
      ParseSafetensorsHeader(bytes.substr(kLengthBytes, *n), bytes.size() - data_start, metadata);
  if (!entries.ok()) return entries.status();
  std::vector<StTensor> tensors;
  tensors.reserve(entries->size());
  for (StEntry& e : *entries) {
    e.tensor.data.assign(bytes.data() + data_start + e.begin, e.end - e.begin);
    tensors.push_back(std::move(e.tensor));
  }
  return tensors;
}

}  // namespace gradwire::storage
