#include "server/rpc/request_id.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "server/core/contexts/context_store.h"

namespace gradwire::rpc {
namespace {

thread_local const RequestId* t_current = nullptr;

bool LowerHex(std::string_view s) {
  return std::all_of(s.begin(), s.end(),
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

bool AllZero(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return c == '0'; });
}

}  // namespace

std::optional<RequestId> ParseTraceparent(std::string_view v) {
  // 2 + 1 + 32 + 1 + 16 + 1 + 2: version 00 is exactly this long; later versions may append
  // fields after another '-', which a version-00 reader ignores.
  constexpr size_t kLength = 55;
  if (v.size() < kLength || v[2] != '-' || v[35] != '-' || v[52] != '-') return std::nullopt;
  const std::string_view version = v.substr(0, 2), trace = v.substr(3, 32),
                         parent = v.substr(36, 16), flags = v.substr(53, 2);
  if (!LowerHex(version) || !LowerHex(trace) || !LowerHex(parent) || !LowerHex(flags)) {
    return std::nullopt;
  }
  if (version == "ff" || AllZero(trace) || AllZero(parent)) return std::nullopt;
  if (v.size() > kLength && (version == "00" || v[kLength] != '-')) return std::nullopt;
  return RequestId{std::string(trace), std::string(parent)};
}

RequestId RequestIdOf(const grpc::ServerContextBase& ctx) {
  const auto& metadata = ctx.client_metadata();
  // Sent twice: the first one counts.
  if (auto it = metadata.find("traceparent"); it != metadata.end()) {
    if (auto parsed = ParseTraceparent(std::string_view(it->second.data(), it->second.size()))) {
      return *std::move(parsed);
    }
  }
  return RequestId{core::RandomId128(), {}};
}

const RequestId* CurrentRequest() { return t_current; }

RequestScope::RequestScope(const RequestId& request) : previous_(t_current) {
  t_current = &request;
}

RequestScope::~RequestScope() { t_current = previous_; }

absl::Status WithRequestId(const absl::Status& status, const RequestId& request) {
  if (status.ok() || request.id.empty()) return status;
  return absl::Status(status.code(), absl::StrCat(status.message(), " [request ", request.id, "]"));
}

}  // namespace gradwire::rpc
