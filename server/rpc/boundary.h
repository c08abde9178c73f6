// What crosses the service boundary from a client is checked here before anything uses it, and
// what the server repeats of it (errors, logs, metric labels) is bounded and escaped here.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "gradwire/v1/tensor.pb.h"

namespace gradwire::rpc {

// Module and context ids are 32 lowercase hex digits (what the server hands out).
inline constexpr size_t kIdLength = 32;
// Module names: at most this many printable ASCII characters.
inline constexpr size_t kMaxNameLength = 256;
// How much of a bad value an error or a log line repeats.
inline constexpr size_t kQuotePrefix = 40;

// `value` as printable ASCII: backslash escapes for quotes, backslashes and control bytes, \xNN
// for anything else outside printable ASCII; cut to `max` input bytes, saying how many there were.
// Safe to put in a log line, an error message or a metric label.
std::string Escaped(absl::string_view value, size_t max = kQuotePrefix);

// INVALID_ARGUMENT naming `field` unless `id` is 32 lowercase hex digits; "is required" when empty.
absl::Status CheckId(absl::string_view field, absl::string_view id);
// The same for an optional id: empty passes.
absl::Status CheckOptionalId(absl::string_view field, absl::string_view id);
// INVALID_ARGUMENT unless `name` has at most kMaxNameLength printable ASCII characters.
absl::Status CheckName(absl::string_view field, absl::string_view name);

// Elements of a tensor as its shape declares them (saturating; 0 without a shape or with a
// dimension that is not positive, which the decoder names), known before anything is decoded.
int64_t ShapeElements(const v1::Tensor& t);
// RESOURCE_EXHAUSTED naming `what` and --max-tensor-elements when `elements` is over `limit`
// (0: unlimited).
absl::Status CheckElements(absl::string_view what, int64_t elements, int64_t limit);

}  // namespace gradwire::rpc
