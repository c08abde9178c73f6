#include "server/logging.h"

#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <cstdio>
#include <memory>

namespace gradwire::server {
namespace {

// %* in a pattern: the message, escaped for a JSON string.
class JsonMessageFlag : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&,
              spdlog::memory_buf_t& dest) override {
    const std::string escaped = JsonEscape(std::string(msg.payload.data(), msg.payload.size()));
    dest.append(escaped.data(), escaped.data() + escaped.size());
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<JsonMessageFlag>();
  }
};

}  // namespace

std::string JsonEscape(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += char(c);
        }
    }
  }
  return out;
}

void SetUpLogging(const std::string& level, const std::string& format) {
  spdlog::set_level(spdlog::level::from_str(level));
  if (format == "json") {
    auto formatter = std::make_unique<spdlog::pattern_formatter>();
    formatter->add_flag<JsonMessageFlag>('*').set_pattern(
        R"({"time":"%Y-%m-%dT%H:%M:%S.%e","level":"%l","msg":"%*"})");
    spdlog::set_formatter(std::move(formatter));
  } else {
    spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ gradwire-server: %v");
  }
}

// One line per RPC with its request-scoped fields: debug when OK, info when not.
void LogRpc(const rpc::RpcRecord& r, bool json) {
  const bool ok = r.code == absl::StatusCode::kOk;
  const auto level = ok ? spdlog::level::debug : spdlog::level::info;
  if (!spdlog::should_log(level)) return;
  const std::string code = absl::StatusCodeToString(r.code);
  const double ms = r.seconds * 1000.0;
  if (!json) {
    spdlog::log(level, "{} {} in {:.2f} ms{}{}{}{}{}{}", r.method, code, ms,
                r.module_id.empty() ? "" : " module=", r.module_id,
                r.context_id.empty() ? "" : " context=", r.context_id,
                r.tenant.empty() ? "" : " tenant=", r.tenant);
    if (!ok) spdlog::log(level, "  {}: {}", r.method, r.message);
    return;
  }
  // The "rpc" logger's pattern opens the object with time and level; the fields follow.
  static const std::shared_ptr<spdlog::logger> rpc = [] {
    auto logger = spdlog::stdout_color_mt("rpc");
    logger->set_pattern(R"({"time":"%Y-%m-%dT%H:%M:%S.%e","level":"%l",%v})");
    logger->set_level(spdlog::get_level());
    return logger;
  }();
  rpc->log(level,
           R"("msg":"rpc","method":"{}","code":"{}","duration_ms":{:.3f},"module":"{}",)"
           R"("context":"{}","tenant":"{}","error":"{}")",
           r.method, code, ms, JsonEscape(r.module_id), JsonEscape(r.context_id),
           JsonEscape(r.tenant), JsonEscape(r.message));
}

}  // namespace gradwire::server
