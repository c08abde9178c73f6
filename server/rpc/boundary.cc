#include "server/rpc/boundary.h"

#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace gradwire::rpc {

std::string Escaped(absl::string_view value, size_t max) {
  std::string out;
  const absl::string_view shown = value.substr(0, max);
  out.reserve(shown.size() + 16);
  for (unsigned char c : shown) {
    switch (c) {
      case '\\':
        out += "\\\\";
        break;
      case '"':
        out += "\\\"";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20 || c > 0x7e) {
          absl::StrAppendFormat(&out, "\\x%02x", c);
        } else {
          out += char(c);
        }
    }
  }
  if (value.size() > max) absl::StrAppend(&out, "...(", value.size(), " bytes)");
  return out;
}

absl::Status CheckId(absl::string_view field, absl::string_view id) {
  if (id.empty()) return absl::InvalidArgumentError(absl::StrCat(field, " is required"));
  bool hex = id.size() == kIdLength;
  for (size_t i = 0; hex && i < id.size(); ++i) {
    const char c = id[i];
    hex = (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
  }
  if (!hex) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " must be ", kIdLength, " lowercase hex digits, got \"", Escaped(id), "\""));
  }
  return absl::OkStatus();
}

absl::Status CheckOptionalId(absl::string_view field, absl::string_view id) {
  return id.empty() ? absl::OkStatus() : CheckId(field, id);
}

absl::Status CheckName(absl::string_view field, absl::string_view name) {
  if (name.size() > kMaxNameLength) {
    return absl::InvalidArgumentError(absl::StrCat(field, " is ", name.size(),
                                                   " bytes, over the limit of ", kMaxNameLength,
                                                   ": \"", Escaped(name), "\""));
  }
  for (unsigned char c : name) {
    if (c < 0x20 || c > 0x7e) {
      return absl::InvalidArgumentError(absl::StrCat(field, " must be printable ASCII, got \"",
                                                     Escaped(name, kMaxNameLength), "\""));
    }
  }
  return absl::OkStatus();
}

int64_t ShapeElements(const v1::Tensor& t) {
  if (t.shape_size() == 0) return 0;
  int64_t n = 1;
  for (int64_t d : t.shape()) {
    if (d <= 0) return 0;  // the decoder names the bad dimension
    if (n > std::numeric_limits<int64_t>::max() / d) return std::numeric_limits<int64_t>::max();
    n *= d;
  }
  return n;
}

absl::Status CheckElements(absl::string_view what, int64_t elements, int64_t limit) {
  if (limit > 0 && elements > limit) {
    return absl::ResourceExhaustedError(absl::StrCat(what, " has ", elements,
                                                     " elements, over the limit of ", limit,
                                                     " (--max-tensor-elements)"));
  }
  return absl::OkStatus();
}

}  // namespace gradwire::rpc
