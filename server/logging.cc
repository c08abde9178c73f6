#include "server/logging.h"

#include <grpc/support/log.h>
#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <cstdio>
#include <memory>

#include "server/rpc/request_id.h"

namespace gradwire::server {
namespace {

void Append(spdlog::memory_buf_t& dest, const std::string& s) {
  dest.append(s.data(), s.data() + s.size());
}

// %* in a pattern: the message, escaped for a JSON string.
class JsonMessageFlag : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&,
              spdlog::memory_buf_t& dest) override {
    Append(dest, JsonEscape(std::string(msg.payload.data(), msg.payload.size())));
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<JsonMessageFlag>();
  }
};

// %Q in a pattern: the request id of the call the logging thread works for, as JSON members
// (,"request_id":"...","parent_id":"...") or as text ( request=...); nothing outside a call.
class RequestFlag : public spdlog::custom_flag_formatter {
 public:
  explicit RequestFlag(bool json) : json_(json) {}
  void format(const spdlog::details::log_msg&, const std::tm&,
              spdlog::memory_buf_t& dest) override {
    const rpc::RequestId* r = rpc::CurrentRequest();
    if (r == nullptr || r->id.empty()) return;
    if (!json_) {
      Append(dest, " request=" + r->id);
      return;
    }
    // Both ids are lowercase hex (request_id.cc checks a client's): nothing to escape.
    Append(dest, ",\"request_id\":\"" + r->id + "\"");
    if (!r->parent_id.empty()) Append(dest, ",\"parent_id\":\"" + r->parent_id + "\"");
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<RequestFlag>(json_);
  }

 private:
  bool json_;
};

// The length of the UTF-8 sequence at s[i] (1-4), or 0 when it is not one (overlong forms,
// surrogates and code points past U+10FFFF included).
size_t Utf8Length(const std::string& s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[i + k]); };
  const auto cont = [&](size_t k) { return i + k < s.size() && (b(k) & 0xC0) == 0x80; };
  const unsigned char c = b(0);
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) return cont(1) ? 2 : 0;
  if (c >= 0xE0 && c <= 0xEF) {
    if (!cont(1) || !cont(2)) return 0;
    if (c == 0xE0 && b(1) < 0xA0) return 0;   // overlong
    if (c == 0xED && b(1) >= 0xA0) return 0;  // surrogate
    return 3;
  }
  if (c >= 0xF0 && c <= 0xF4) {
    if (!cont(1) || !cont(2) || !cont(3)) return 0;
    if (c == 0xF0 && b(1) < 0x90) return 0;   // overlong
    if (c == 0xF4 && b(1) >= 0x90) return 0;  // past U+10FFFF
    return 4;
  }
  return 0;
}

// gRPC's own lines (gpr_log) in the server's format instead of gRPC's on stderr.
void GrpcLog(gpr_log_func_args* args) {
  const auto level = args->severity == GPR_LOG_SEVERITY_ERROR  ? spdlog::level::err
                     : args->severity == GPR_LOG_SEVERITY_INFO ? spdlog::level::info
                                                               : spdlog::level::debug;
  spdlog::log(level, "grpc: {} ({}:{})", args->message, args->file, args->line);
}

}  // namespace

std::string JsonEscape(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c >= 0x80) {
      const size_t n = Utf8Length(s, i);
      if (n == 0) {
        out += "\\ufffd";
        ++i;
      } else {
        out.append(s, i, n);
        i += n;
      }
      continue;
    }
    ++i;
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
        if (c < 0x20 || c == 0x7f) {
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
  const bool json = format == "json";
  // Log collectors read one time zone: UTC, marked Z. The text format stays in local time for
  // the person at the terminal.
  auto formatter = std::make_unique<spdlog::pattern_formatter>(
      json ? spdlog::pattern_time_type::utc : spdlog::pattern_time_type::local);
  formatter->add_flag<JsonMessageFlag>('*');
  formatter->add_flag<RequestFlag>('Q', json);
  formatter->set_pattern(json ? R"({"time":"%Y-%m-%dT%H:%M:%S.%eZ","level":"%l","msg":"%*"%Q})"
                              : "%Y-%m-%dT%H:%M:%S.%e %^%l%$ gradwire-server: %v%Q");
  spdlog::set_formatter(std::move(formatter));
  gpr_set_log_function(&GrpcLog);
}

// One line per RPC with its request-scoped fields: debug when OK, info when not.
void LogRpc(const rpc::RpcRecord& r, bool json) {
  const bool ok = r.code == absl::StatusCode::kOk;
  const auto level = ok ? spdlog::level::debug : spdlog::level::info;
  if (!spdlog::should_log(level)) return;
  const std::string code = absl::StatusCodeToString(r.code);
  const double ms = r.seconds * 1000.0;
  if (!json) {
    // The default pattern adds " request=ID": the report runs in the call's request scope.
    spdlog::log(level, "{} {} in {:.2f} ms{}{}{}{}{}{}", r.method, code, ms,
                r.module_id.empty() ? "" : " module=", r.module_id,
                r.context_id.empty() ? "" : " context=", r.context_id,
                r.tenant.empty() ? "" : " tenant=", r.tenant);
    if (!ok) spdlog::log(level, "  {}: {}", r.method, r.message);
    return;
  }
  // The "rpc" logger's pattern opens the object with time and level; the fields follow, the
  // request's among them (so its pattern has no %Q).
  static const std::shared_ptr<spdlog::logger> rpc = [] {
    auto logger = spdlog::stdout_color_mt("rpc");
    logger->set_formatter(std::make_unique<spdlog::pattern_formatter>(
        R"({"time":"%Y-%m-%dT%H:%M:%S.%eZ","level":"%l",%v})", spdlog::pattern_time_type::utc));
    logger->set_level(spdlog::get_level());
    return logger;
  }();
  rpc->log(level,
           R"("msg":"rpc","method":"{}","code":"{}","duration_ms":{:.3f},"module":"{}",)"
           R"("context":"{}","tenant":"{}","request_id":"{}","parent_id":"{}","error":"{}")",
           r.method, code, ms, JsonEscape(r.module_id), JsonEscape(r.context_id),
           JsonEscape(r.tenant), JsonEscape(r.request.id), JsonEscape(r.request.parent_id),
           JsonEscape(r.message));
}

}  // namespace gradwire::server
