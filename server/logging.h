// gradwire-server's logs: spdlog set up as text or one JSON object a line, and one line per RPC
// with its request-scoped fields.
#pragma once

#include <string>

#include "server/rpc/service.h"

namespace gradwire::server {

// `s` escaped for the inside of a JSON (or TOML basic) string.
std::string JsonEscape(const std::string& s);

// Sets the default logger's level ("trace" ... "off") and format: "text" (time, level,
// "gradwire-server:", message) or "json" (an object with time, level and msg a line).
void SetUpLogging(const std::string& level, const std::string& format);

// One line for a finished RPC: at debug when it succeeded, at info when not (with its message).
// `json`: the RPC's fields as JSON members (method, code, duration_ms, module, context, tenant,
// error) of one object.
void LogRpc(const rpc::RpcRecord& r, bool json);

}  // namespace gradwire::server
