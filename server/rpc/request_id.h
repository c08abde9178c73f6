// Requests you can follow: every call has a request id, the trace-id of the W3C trace context its
// client sent in `traceparent` metadata, or one made here when it sent none (or a malformed one).
// Log lines written while a thread works for a call carry it (server/logging.cc reads
// CurrentRequest()), and so does the message of every error the call ends with, so a client's
// log line, its error and the server's log lines about the call can be joined on one string.
#pragma once

#include <grpcpp/grpcpp.h>

#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"

namespace gradwire::rpc {

struct RequestId {
  std::string id;         // 32 lowercase hex digits: the trace-id
  std::string parent_id;  // 16 lowercase hex digits: the client's span, empty when made here
};

// The ids of a `traceparent` value (W3C Trace Context: version-traceid-parentid-flags, lowercase
// hex; version ff, all-zero ids and, for version 00, anything after the flags are invalid);
// nullopt when it is malformed.
std::optional<RequestId> ParseTraceparent(std::string_view value);

// The request id of the call `ctx` belongs to: its `traceparent` when valid, else a fresh one.
RequestId RequestIdOf(const grpc::ServerContextBase& ctx);

// The request id the current thread works for; null outside a RequestScope.
const RequestId* CurrentRequest();

// Marks the current thread as working for `request` until the scope ends (scopes nest).
// `request` must outlive the scope.
class RequestScope {
 public:
  explicit RequestScope(const RequestId& request);
  ~RequestScope();
  RequestScope(const RequestScope&) = delete;
  RequestScope& operator=(const RequestScope&) = delete;

 private:
  const RequestId* previous_;
};

// `status` with " [request ID]" after its message when it is an error, so the client can quote
// the id; OK stays OK.
absl::Status WithRequestId(const absl::Status& status, const RequestId& request);

}  // namespace gradwire::rpc
