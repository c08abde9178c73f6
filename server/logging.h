// gradwire-server's logs: spdlog set up as text or one JSON object a line, gRPC's own log lines
// routed through it, and one line per RPC with its request-scoped fields. Every line written
// while a thread works for a call carries that call's request id (rpc/request_id.h).
#pragma once

#include <string>

#include "server/rpc/service.h"

namespace gradwire::server {

// `s` escaped for the inside of a JSON (or TOML basic) string; bytes that are not UTF-8 become
// U+FFFD, so the result is always valid JSON.
std::string JsonEscape(const std::string& s);

// Sets the default logger's level ("trace" ... "off") and format: "text" (local time, level,
// "gradwire-server:", message, then " request=ID" inside a call) or "json" (an object a line:
// time in UTC, level, msg, and request_id and parent_id inside a call). gRPC's own log lines go
// through the same logger.
void SetUpLogging(const std::string& level, const std::string& format);

// One line for a finished RPC: at debug when it succeeded, at info when not (with its message).
// `json`: the RPC's fields as JSON members (method, code, duration_ms, module, context, tenant,
// request_id, parent_id, error) of one object.
void LogRpc(const rpc::RpcRecord& r, bool json);

}  // namespace gradwire::server
