// gradwire-server: hosts FP8 modules and serves them over gRPC.
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <httplib.h>
#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "server/core/executor.h"
#include "server/core/heap_trim.h"
#include "server/core/module_host.h"
#include "server/metrics.h"
#include "server/rpc/auth.h"
#include "server/rpc/boundary.h"
#include "server/rpc/service.h"

namespace {

struct ServerFlags {
  std::string listen = "127.0.0.1:50051";  // loopback unless told otherwise
  std::string device = "auto";             // auto | cpu | cuda
  std::string log_level = "info";
  std::string log_format = "text";  // text | json (one JSON object a line)
  int max_message_mib = 64;         // largest response message
  // Saved-context memory (DESIGN.md, bounded memory): device budget, host offload budget, TTL.
  int64_t context_memory = int64_t(4) << 30;
  int64_t host_offload_memory = int64_t(8) << 30;
  double context_ttl_s = 600;
  // Seconds between returns of freed heap memory to the OS (core/heap_trim.h); 0: never.
  double heap_trim_every_s = 1;
  // Request limits: RESOURCE_EXHAUSTED naming the flag.
  int64_t max_request_bytes = int64_t(64) << 20;
  int64_t max_tensor_elements = int64_t(1) << 26;
  int64_t max_contexts_per_client = 4096;
  int64_t max_queued_per_module = 256;
  int64_t max_queued_per_client = 1024;
  // Per-client quotas in bytes: RESOURCE_EXHAUSTED naming the flag; 0: none.
  int64_t max_parameter_bytes_per_client = int64_t(8) << 30;
  int64_t max_context_bytes_per_client = int64_t(4) << 30;
  int64_t max_stream_bytes_per_client = int64_t(4) << 30;
  std::string metrics_token_file;   // bearer token the metrics endpoint requires; empty: none
  double shutdown_grace_s = 10.0;   // in-flight calls get this long on SIGINT/SIGTERM
  double delivery_slack_ms = 10.0;  // a forward this close to its deadline is abandoned
  std::string metrics_listen;       // host:port of the Prometheus endpoint; empty: off
  std::string tls_cert;             // PEM certificate chain; with tls_key: serve TLS
  std::string tls_key;              // PEM private key
  std::string tls_client_ca;        // PEM CA bundle: require and verify client certificates
  bool insecure = false;            // allow plaintext on a non-loopback address
  std::string checkpoint_dir;       // empty: modules live only in memory
  int64_t checkpoint_every = 100;   // optimizer steps between a module's checkpoints
  int stream_read_ahead = 8;        // Train-stream requests read ahead of their responses
  int cpu_threads = 0;              // CPU backend's intra-op threads (0: one per core)
  int chunk_kib = 4096;             // chunks of the chunked calls, sent and accepted
  int max_stream_mib = 4096;        // most tensor bytes one chunked request may carry
  std::string tokens_file;          // "TENANT TOKEN" lines: bearer tokens required
  std::string port_file;            // written with the bound host:port once serving
  // Shared-memory tensors for clients on this host: off by default.
  bool allow_shared_memory = false;
  std::string shared_memory_prefix = "gradwire";
  int max_shared_memory_regions = 16;
  std::vector<std::string> tokens;  // TENANT:TOKEN entries (environment or config file)
  std::string config;               // TOML file mirroring these flags
  bool print_config = false;        // print the effective configuration and exit
};

std::string JsonEscape(const std::string& s);

// Every flag may also come from the environment as GRADWIRE_SERVER_<FLAG> (upper case, - as _).
std::string EnvName(const std::string& long_name) {
  std::string env = "GRADWIRE_SERVER_";
  for (char c : long_name)
    env += c == '-' ? '_' : char(std::toupper(static_cast<unsigned char>(c)));
  return env;
}

// Options that are not configuration (never read from the environment or a file).
bool IsMeta(const CLI::Option* opt) {
  const std::string name = opt->get_name(false, true);
  return name == "--help" || name == "--config" || name == "--print-config";
}

// Fills every option not given as a flag or in the environment from the TOML file at `path`:
// flags > environment > file. Unknown keys and [sections] are errors that name the key; an empty
// string leaves the default (as an empty environment variable does).
void ApplyConfigFile(CLI::App& app, const std::string& path) {
  CLI::ConfigTOML reader;
  std::vector<CLI::ConfigItem> items;
  try {
    items = reader.from_file(path);
  } catch (const CLI::FileError&) {
    throw CLI::ValidationError("--config", "cannot read " + path);
  }
  for (const CLI::ConfigItem& item : items) {
    if (item.name == "++" || item.name == "--") continue;  // section markers
    std::string key = item.name;
    std::replace(key.begin(), key.end(), '_', '-');
    if (!item.parents.empty()) {
      throw CLI::ValidationError("--config",
                                 path + ": unknown key '" + item.fullname() +
                                     "' (sections are not used; write flags at the top level)");
    }
    CLI::Option* opt = app.get_option_no_throw("--" + key);
    if (opt == nullptr || IsMeta(opt)) {
      throw CLI::ValidationError("--config", path + ": unknown key '" + item.name +
                                                 "' (keys are the flag names, e.g. listen, "
                                                 "log-level; see --help)");
    }
    if (opt->count() > 0) continue;  // given as a flag or in the environment
    if (item.inputs.empty() || (item.inputs.size() == 1 && item.inputs[0].empty())) {
      continue;  // key = "" or key = []: the default
    }
    if (opt->get_expected_min() == 0) {
      opt->add_result(opt->get_flag_value(key, reader.to_flag(item)));
    } else {
      opt->add_result(item.inputs);
    }
    opt->run_callback();
  }
}

// The effective configuration as a TOML file --config accepts; token values masked.
std::string RenderConfig(const ServerFlags& f) {
  auto quote = [](const std::string& v) { return "\"" + JsonEscape(v) + "\""; };
  std::ostringstream out;
  out << "# gradwire-server effective configuration (flags > GRADWIRE_SERVER_* > --config file)\n";
  out << "listen = " << quote(f.listen) << "\n";
  out << "device = " << quote(f.device) << "\n";
  out << "log-level = " << quote(f.log_level) << "\n";
  out << "log-format = " << quote(f.log_format) << "\n";
  out << "max-message-mib = " << f.max_message_mib << "\n";
  out << "max-request-bytes = " << f.max_request_bytes << "\n";
  out << "max-tensor-elements = " << f.max_tensor_elements << "\n";
  out << "max-contexts-per-client = " << f.max_contexts_per_client << "\n";
  out << "max-queued-per-module = " << f.max_queued_per_module << "\n";
  out << "max-queued-per-client = " << f.max_queued_per_client << "\n";
  out << "max-parameter-bytes-per-client = " << f.max_parameter_bytes_per_client << "\n";
  out << "max-context-bytes-per-client = " << f.max_context_bytes_per_client << "\n";
  out << "max-stream-bytes-per-client = " << f.max_stream_bytes_per_client << "\n";
  out << "context-memory = " << f.context_memory << "\n";
  out << "host-offload-memory = " << f.host_offload_memory << "\n";
  out << "context-ttl = " << f.context_ttl_s << "\n";
  out << "heap-trim-every = " << f.heap_trim_every_s << "\n";
  out << "shutdown-grace = " << f.shutdown_grace_s << "\n";
  out << "delivery-slack-ms = " << f.delivery_slack_ms << "\n";
  out << "tls-cert = " << quote(f.tls_cert) << "\n";
  out << "tls-key = " << quote(f.tls_key) << "\n";
  out << "tls-client-ca = " << quote(f.tls_client_ca) << "\n";
  out << "insecure = " << (f.insecure ? "true" : "false") << "\n";
  out << "metrics-listen = " << quote(f.metrics_listen) << "\n";
  out << "metrics-token-file = " << quote(f.metrics_token_file) << "\n";
  out << "checkpoint-dir = " << quote(f.checkpoint_dir) << "\n";
  out << "port-file = " << quote(f.port_file) << "\n";
  out << "checkpoint-every = " << f.checkpoint_every << "\n";
  out << "stream-read-ahead = " << f.stream_read_ahead << "\n";
  out << "cpu-threads = " << f.cpu_threads << "\n";
  out << "chunk-kib = " << f.chunk_kib << "\n";
  out << "max-stream-mib = " << f.max_stream_mib << "\n";
  out << "allow-shared-memory = " << (f.allow_shared_memory ? "true" : "false") << "\n";
  out << "shared-memory-prefix = " << quote(f.shared_memory_prefix) << "\n";
  out << "max-shared-memory-regions = " << f.max_shared_memory_regions << "\n";
  out << "tokens-file = " << quote(f.tokens_file) << "\n";
  out << "tokens = [";
  for (size_t i = 0; i < f.tokens.size(); ++i) {
    const auto colon = f.tokens[i].find(':');
    out << (i ? ", " : "") << quote(f.tokens[i].substr(0, colon) + ":****");
  }
  out << "]\n";
  return out.str();
}

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

// One line per RPC with its request-scoped fields: debug when OK, info when not.
void LogRpc(const gradwire::rpc::RpcRecord& r, bool json) {
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

// Whether host:port names this machine's loopback interface only.
bool IsLoopback(const std::string& listen) {
  const auto colon = listen.rfind(':');
  std::string host = colon == std::string::npos ? listen : listen.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0 ||
         host.rfind("ipv4:127.", 0) == 0;
}

// Replaces a trailing ":0" port with the port the server actually bound.
std::string BoundAddress(const std::string& listen, int port) {
  const auto colon = listen.rfind(':');
  if (colon == std::string::npos) return listen;
  return listen.substr(0, colon + 1) + std::to_string(port);
}

// Resolves --device into a backend, or logs why it cannot and returns null. auto: the CUDA
// backend when it can run here, else the CPU.
gradwire::core::BackendPtr ResolveDevice(const std::string& requested) {
  if (requested == "cpu") return gradwire::core::MakeCpuBackend();
  auto cuda = gradwire::core::MakeCudaBackend(0);
  if (cuda.ok()) return *cuda;
  if (requested == "cuda") {
    spdlog::error("--device cuda: {}", std::string(cuda.status().message()));
    return nullptr;
  }
  spdlog::info("--device auto: {}; using the CPU backend", std::string(cuda.status().message()));
  return gradwire::core::MakeCpuBackend();
}

}  // namespace

int main(int argc, char** argv) {
  ServerFlags flags;
  CLI::App app{
      "gradwire-server: hosts FP8 Linear modules (E4M3 forward, E5M2 gradients) and "
      "runs them forward and backward for remote clients over gRPC."};
  app.add_option("--listen", flags.listen,
                 "address to serve on, host:port (port 0 picks a free port; the log says which)")
      ->capture_default_str();
  app.add_option("--device", flags.device,
                 "compute device: cpu, cuda, or auto (cuda when usable, else cpu)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  app.add_option("--port-file", flags.port_file,
                 "once serving, write the bound host:port to this file (atomically; removed at "
                 "exit): how a supervisor learns the port of --listen HOST:0 at any --log-level");
  app.add_option("--log-level", flags.log_level, "trace, debug, info, warn, error or off")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "off"}))
      ->capture_default_str();
  app.add_option("--log-format", flags.log_format,
                 "text, or json: one JSON object a line (time, level, msg; RPC lines also carry "
                 "method, code, duration_ms, module, context)")
      ->check(CLI::IsMember({"text", "json"}))
      ->capture_default_str();
  app.add_option("--max-message-mib", flags.max_message_mib,
                 "largest gRPC response message sent, in MiB (requests: --max-request-bytes)")
      ->check(CLI::Range(1, 2047))
      ->capture_default_str();
  app.add_option("--max-request-bytes", flags.max_request_bytes,
                 "largest request message, e.g. 64MiB (bytes; KiB, MiB, GiB accepted); larger "
                 "ones get RESOURCE_EXHAUSTED, and the transport drops ones over twice this unread")
      ->transform(CLI::AsSizeValue(true))
      ->check(CLI::Range(int64_t(1) << 10, int64_t(1) << 30))
      ->capture_default_str();
  app.add_option("--max-tensor-elements", flags.max_tensor_elements,
                 "most elements of any tensor a call sends or makes the server build (forward "
                 "output, MLP hidden layer)")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 40))
      ->capture_default_str();
  app.add_option("--max-contexts-per-client", flags.max_contexts_per_client,
                 "most live training contexts of one client (its tenant with tokens, else its "
                 "address); 0: no limit")
      ->check(CLI::Range(int64_t(0), int64_t(1) << 40))
      ->capture_default_str();
  app.add_option("--max-queued-per-module", flags.max_queued_per_module,
                 "most calls waiting for the device per module; more get RESOURCE_EXHAUSTED; 0: no "
                 "limit")
      ->check(CLI::Range(int64_t(0), int64_t(1) << 40))
      ->capture_default_str();
  app.add_option("--max-queued-per-client", flags.max_queued_per_client,
                 "most calls of one client (its tenant with tokens, else its address) waiting for "
                 "the device, over all its modules; more get RESOURCE_EXHAUSTED; 0: no limit")
      ->check(CLI::Range(int64_t(0), int64_t(1) << 40))
      ->capture_default_str();
  app.add_option("--max-parameter-bytes-per-client", flags.max_parameter_bytes_per_client,
                 "quota: fp32 parameter bytes of one client's modules, e.g. 8GiB (gradients and "
                 "optimizer state add up to 3x more); a CreateModule past it gets "
                 "RESOURCE_EXHAUSTED; 0: none")
      ->transform(CLI::AsSizeValue(true))
      ->check(CLI::Range(int64_t(0), std::numeric_limits<int64_t>::max()))
      ->capture_default_str();
  app.add_option("--max-context-bytes-per-client", flags.max_context_bytes_per_client,
                 "quota: saved-tensor bytes of one client's live training contexts, on the device "
                 "and offloaded together, e.g. 4GiB; a training forward past it gets "
                 "RESOURCE_EXHAUSTED and stores nothing; 0: none")
      ->transform(CLI::AsSizeValue(true))
      ->check(CLI::Range(int64_t(0), std::numeric_limits<int64_t>::max()))
      ->capture_default_str();
  app.add_option("--max-stream-bytes-per-client", flags.max_stream_bytes_per_client,
                 "quota: tensor bytes one client's chunked requests may have in flight together "
                 "(as their headers declare), e.g. 4GiB; a header past it gets "
                 "RESOURCE_EXHAUSTED; 0: none")
      ->transform(CLI::AsSizeValue(true))
      ->check(CLI::Range(int64_t(0), std::numeric_limits<int64_t>::max()))
      ->capture_default_str();
  app.add_option("--context-memory", flags.context_memory,
                 "device memory for saved tensors of training contexts, e.g. 4GiB (bytes; KiB, "
                 "MiB, GiB accepted; on the CPU backend host memory stands for the device). Past "
                 "it the least recently used contexts move to host memory; a forward whose "
                 "context alone is larger gets RESOURCE_EXHAUSTED")
      ->transform(CLI::AsSizeValue(true))
      ->check(CLI::Range(int64_t(1), std::numeric_limits<int64_t>::max()))
      ->capture_default_str();
  app.add_option("--host-offload-memory", flags.host_offload_memory,
                 "host memory for contexts offloaded from the device, e.g. 8GiB (on the CPU "
                 "backend a separately accounted host copy); past it the least recently used are "
                 "evicted (their backward gets "
                 "NOT_FOUND saying so); 0: no offload, evict at once")
      ->transform(CLI::AsSizeValue(true))
      ->check(CLI::Range(int64_t(0), std::numeric_limits<int64_t>::max()))
      ->capture_default_str();
  app.add_option("--context-ttl", flags.context_ttl_s,
                 "seconds a training context may wait unused for its backward before it is "
                 "evicted (0: never)")
      ->check(CLI::Range(0.0, 1e9))
      ->capture_default_str();
  app.add_option("--heap-trim-every", flags.heap_trim_every_s,
                 "seconds between returns of freed heap memory to the OS (malloc_trim); without "
                 "them RSS creeps up under training load while the memory in use stays flat "
                 "(0: never)")
      ->check(CLI::Range(0.0, 1e9))
      ->capture_default_str();
  app.add_option("--delivery-slack-ms", flags.delivery_slack_ms,
                 "a training forward that finishes less than this before its deadline releases "
                 "its context and answers CANCELLED: its response would reach the client after "
                 "it gave up (raise it on slow links; docs/security.md)")
      ->check(CLI::Range(0.0, 60000.0))
      ->capture_default_str();
  app.add_flag("--allow-shared-memory", flags.allow_shared_memory,
               "let clients on this host register POSIX shared-memory objects and pass tensors "
               "through them instead of the wire (RegisterSharedMemory; docs/shared-memory.md). A "
               "client can then reach any object the server's user may open whose name starts "
               "with --shared-memory-prefix");
  app.add_option("--shared-memory-prefix", flags.shared_memory_prefix,
                 "shared-memory keys a client may register must start with this")
      ->capture_default_str();
  app.add_option("--max-shared-memory-regions", flags.max_shared_memory_regions,
                 "shared-memory regions one client (tenant with tokens) may hold registered "
                 "(0: unlimited)")
      ->check(CLI::Range(0, 1 << 20))
      ->capture_default_str();
  app.add_option("--shutdown-grace", flags.shutdown_grace_s,
                 "seconds in-flight calls may take to finish after SIGINT/SIGTERM")
      ->check(CLI::Range(0.0, 3600.0))
      ->capture_default_str();
  app.add_option("--tls-cert", flags.tls_cert, "PEM certificate chain: serve TLS (with --tls-key)")
      ->check(CLI::ExistingFile);
  app.add_option("--tls-key", flags.tls_key, "PEM private key of --tls-cert")
      ->check(CLI::ExistingFile);
  app.add_option("--tls-client-ca", flags.tls_client_ca,
                 "PEM CA bundle: mutual TLS, every client must present a certificate it signed")
      ->check(CLI::ExistingFile);
  app.add_flag(
      "--insecure", flags.insecure,
      "allow a non-loopback --listen address without TLS and bearer tokens (refused by default)");
  app.add_option(
      "--metrics-listen", flags.metrics_listen,
      "serve Prometheus metrics at http://HOST:PORT/metrics, or on 127.0.0.1 with a bare "
      "PORT (port 0 picks one; off if empty). The page names clients and module ids: "
      "keep it on loopback or set --metrics-token-file");
  app.add_option("--metrics-token-file", flags.metrics_token_file,
                 "file holding a bearer token the metrics endpoint requires (Authorization: "
                 "Bearer TOKEN); without it the endpoint answers anyone who can reach it")
      ->check(CLI::ExistingFile);
  app.add_option("--checkpoint-dir", flags.checkpoint_dir,
                 "directory for module checkpoints: restored at start, written on create, weight "
                 "upload, every --checkpoint-every optimizer steps and at shutdown (off if empty)");
  app.add_option("--checkpoint-every", flags.checkpoint_every,
                 "optimizer steps between a module's checkpoints (0: only create/upload/shutdown)")
      ->check(CLI::Range(int64_t(0), int64_t(1) << 40))
      ->capture_default_str();
  app.add_option("--cpu-threads", flags.cpu_threads,
                 "threads the CPU backend splits casts and decodes over (its GEMMs use the BLAS's "
                 "own threads); 0: one per core. Fewer leave cores to gRPC and to clients on the "
                 "same host")
      ->check(CLI::Range(0, 4096))
      ->capture_default_str();
  app.add_option("--stream-read-ahead", flags.stream_read_ahead,
                 "requests of a Train stream read ahead of the responses written: a fast client "
                 "cannot make the server buffer more")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  app.add_option("--chunk-kib", flags.chunk_kib,
                 "KiB per chunk of the chunked Forward/Backward/GetWeights/SetWeights calls: the "
                 "size the server sends and the largest it accepts (must fit --max-message-mib)")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--max-stream-mib", flags.max_stream_mib,
                 "most MiB the tensors of one chunked request may add up to "
                 "(more: RESOURCE_EXHAUSTED before any chunk is read)")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--tokens-file", flags.tokens_file,
                 "require bearer tokens: a file of \"TENANT TOKEN\" lines (# comments). Every "
                 "module and context belongs to the tenant that created it; other tenants get "
                 "NOT_FOUND")
      ->check(CLI::ExistingFile);
  app.add_option("--tokens", flags.tokens,
                 "require bearer tokens given as TENANT:TOKEN entries, comma-separated (meant for "
                 "GRADWIRE_SERVER_TOKENS or the config file: a command line is visible to other "
                 "users)")
      ->delimiter(',');
  for (CLI::Option* opt : app.get_options()) {
    if (!IsMeta(opt)) opt->envname(EnvName(opt->get_name(false, false).substr(2)));
  }
  app.add_option(
         "--config", flags.config,
         "TOML file of flag values (keys are flag names: listen = \"0.0.0.0:50051\"); flags "
         "and GRADWIRE_SERVER_* variables override it; unknown keys are errors")
      ->envname("GRADWIRE_SERVER_CONFIG")
      ->check(CLI::ExistingFile);
  app.add_flag("--print-config", flags.print_config,
               "print the effective configuration (tokens masked) as TOML and exit");
  app.footer(
      "Every flag can also be set as GRADWIRE_SERVER_<FLAG> (e.g. GRADWIRE_SERVER_LISTEN) or as a "
      "key of the --config file; precedence: flags > environment > file.");
  try {
    app.parse(argc, argv);
    if (!flags.config.empty()) ApplyConfigFile(app, flags.config);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (flags.print_config) {
    std::fputs(RenderConfig(flags).c_str(), stdout);
    return 0;
  }

  spdlog::set_level(spdlog::level::from_str(flags.log_level));
  const bool json_logs = flags.log_format == "json";
  if (json_logs) {
    auto formatter = std::make_unique<spdlog::pattern_formatter>();
    formatter->add_flag<JsonMessageFlag>('*').set_pattern(
        R"({"time":"%Y-%m-%dT%H:%M:%S.%e","level":"%l","msg":"%*"})");
    spdlog::set_formatter(std::move(formatter));
  } else {
    spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ gradwire-server: %v");
  }

  // Signals are taken by sigwait below; block them before any thread starts so none gets them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  // A chunk travels in one message with a few bytes of framing around it, both ways: it must fit
  // what the server sends (--max-message-mib) and what it reads (twice --max-request-bytes).
  const int64_t chunk_room = (int64_t(flags.chunk_kib) << 10) + (int64_t(64) << 10);
  if (chunk_room > int64_t(flags.max_message_mib) << 20 ||
      chunk_room > 2 * flags.max_request_bytes) {
    spdlog::error(
        "--chunk-kib {} does not fit --max-message-mib {} and twice --max-request-bytes {} (a "
        "chunk needs 64 KiB of room)",
        flags.chunk_kib, flags.max_message_mib, flags.max_request_bytes);
    return 2;
  }

  gradwire::core::SetCpuThreads(flags.cpu_threads);
  const gradwire::core::BackendPtr backend = ResolveDevice(flags.device);
  if (!backend) return 2;
  const std::string device = backend->name(), description = backend->Describe();

  std::unique_ptr<gradwire::rpc::Authenticator> authenticator;
  if (!flags.tokens_file.empty() || !flags.tokens.empty()) {
    std::vector<std::pair<std::string, std::string>> entries;
    if (!flags.tokens_file.empty()) {
      auto read = gradwire::rpc::Authenticator::ReadTokensFile(flags.tokens_file);
      if (!read.ok()) {
        spdlog::error("{}", std::string(read.status().message()));
        return 2;
      }
      entries = std::move(*read);
    }
    for (const std::string& entry : flags.tokens) {
      auto parsed = gradwire::rpc::Authenticator::ParseInline(entry);
      if (!parsed.ok()) {
        spdlog::error("{}", std::string(parsed.status().message()));
        return 2;
      }
      entries.push_back(std::move(*parsed));
    }
    auto made = gradwire::rpc::Authenticator::FromEntries(entries);
    if (!made.ok()) {
      spdlog::error("{}", std::string(made.status().message()));
      return 2;
    }
    authenticator = std::make_unique<gradwire::rpc::Authenticator>(std::move(*made));
    const auto tenants = authenticator->Tenants();
    std::string names;
    for (const auto& t : tenants) names += (names.empty() ? "" : ", ") + t;
    spdlog::info("bearer tokens required: {} tokens for {} tenants ({})", authenticator->size(),
                 tenants.size(), names);
  }
  const bool tls = !flags.tls_cert.empty() || !flags.tls_key.empty();
  const bool tokens = authenticator != nullptr;
  if (!IsLoopback(flags.listen) && !(tls && tokens) && !flags.insecure) {
    spdlog::error(
        "refusing to serve on {} without {}: it is not a loopback address; give --tls-cert, "
        "--tls-key and --tokens-file, or --insecure if the network is trusted",
        flags.listen,
        tls      ? "bearer tokens"
        : tokens ? "TLS"
                 : "TLS and bearer tokens");
    return 2;
  }

  gradwire::core::ContextLimits context_limits;
  context_limits.device_bytes = flags.context_memory;
  context_limits.host_bytes = flags.host_offload_memory;
  context_limits.ttl_seconds = flags.context_ttl_s;
  context_limits.client_bytes = flags.max_context_bytes_per_client;
  gradwire::core::ModuleHost host(context_limits, nullptr, backend);
  std::unique_ptr<gradwire::core::Checkpointer> checkpointer;
  if (!flags.checkpoint_dir.empty()) {
    checkpointer = std::make_unique<gradwire::core::Checkpointer>(flags.checkpoint_dir,
                                                                  flags.checkpoint_every);
    if (auto s = checkpointer->Prepare(); !s.ok()) {
      spdlog::error("{}", std::string(s.message()));
      return 1;
    }
    auto restored = checkpointer->RestoreAll(host);
    if (!restored.ok()) {  // serving half a model would be worse than not starting
      spdlog::error("cannot restore checkpoints: {}", std::string(restored.status().message()));
      return 1;
    }
    spdlog::info("restored {} modules from {}", *restored, flags.checkpoint_dir);
  }
  auto executor = std::make_unique<gradwire::core::DeviceExecutor>(device);
  gradwire::server::Metrics metrics;
  gradwire::rpc::ServiceOptions service_options;
  service_options.version = GRADWIRE_VERSION;
  service_options.device = device;
  service_options.device_name = description;
  service_options.checkpointer = checkpointer.get();
  service_options.authenticator = authenticator.get();
  service_options.stream_read_ahead = flags.stream_read_ahead;
  service_options.chunk_bytes = int64_t(flags.chunk_kib) << 10;
  service_options.delivery_slack =
      std::chrono::milliseconds(static_cast<int64_t>(flags.delivery_slack_ms));
  service_options.max_stream_bytes = int64_t(flags.max_stream_mib) << 20;
  service_options.limits.max_request_bytes = flags.max_request_bytes;
  service_options.limits.max_tensor_elements = flags.max_tensor_elements;
  service_options.limits.max_contexts_per_client = flags.max_contexts_per_client;
  service_options.limits.max_queued_per_module = flags.max_queued_per_module;
  service_options.limits.max_queued_per_client = flags.max_queued_per_client;
  service_options.quotas.parameter_bytes = flags.max_parameter_bytes_per_client;
  service_options.quotas.stream_bytes = flags.max_stream_bytes_per_client;
  service_options.shared_memory.enabled = flags.allow_shared_memory;
  service_options.shared_memory.key_prefix = flags.shared_memory_prefix;
  service_options.shared_memory.max_regions = flags.max_shared_memory_regions;
  if (flags.allow_shared_memory) {
    spdlog::info("shared-memory tensors on: keys starting with \"{}\", up to {} regions a client",
                 flags.shared_memory_prefix, flags.max_shared_memory_regions);
  }
  service_options.on_rpc_done = [&metrics, json_logs](const gradwire::rpc::RpcRecord& r) {
    metrics.ObserveRpc(r.method, r.code, r.seconds);
    LogRpc(r, json_logs);
  };
  gradwire::rpc::GradwireService service(host, *executor, std::move(service_options));

  // The metrics endpoint: its own small HTTP server thread, off the gRPC path.
  httplib::Server http;
  std::thread http_thread;
  if (!flags.metrics_listen.empty()) {
    // A bare port binds loopback: the page names clients and module ids.
    if (flags.metrics_listen.find(':') == std::string::npos) {
      flags.metrics_listen = "127.0.0.1:" + flags.metrics_listen;
    }
    const auto colon = flags.metrics_listen.rfind(':');
    const std::string http_host = flags.metrics_listen.substr(0, colon);
    const int wanted =
        colon == std::string::npos ? -1 : std::atoi(flags.metrics_listen.c_str() + colon + 1);
    std::string metrics_token;
    if (!flags.metrics_token_file.empty()) {
      std::ifstream in(flags.metrics_token_file);
      std::getline(in, metrics_token);
      while (!metrics_token.empty() && std::isspace((unsigned char)metrics_token.back())) {
        metrics_token.pop_back();
      }
      if (metrics_token.empty()) {
        spdlog::error("--metrics-token-file {}: the first line must hold the token",
                      flags.metrics_token_file);
        return 1;
      }
    } else if (!IsLoopback(flags.metrics_listen)) {
      spdlog::warn(
          "metrics on {} answer anyone who can reach it (client names, module ids); set "
          "--metrics-token-file",
          flags.metrics_listen);
    }
    http.Get("/metrics", [&, metrics_token](const httplib::Request& req, httplib::Response& res) {
      if (!metrics_token.empty() && !gradwire::rpc::Authenticator::TokenMatches(
                                        req.get_header_value("Authorization"), metrics_token)) {
        res.status = 401;
        res.set_header("WWW-Authenticate", "Bearer");
        res.set_content("a bearer token is required\n", "text/plain");
        return;
      }
      res.set_content(metrics.Render(host, executor->queued(), service.Usage()),
                      "text/plain; version=0.0.4");
    });
    const int bound = wanted == 0 ? http.bind_to_any_port(http_host)
                                  : (http.bind_to_port(http_host, wanted) ? wanted : -1);
    if (colon == std::string::npos || wanted < 0 || bound <= 0) {
      spdlog::error("cannot serve metrics on {} (want HOST:PORT, free port)", flags.metrics_listen);
      return 1;
    }
    http_thread = std::thread([&http] { http.listen_after_bind(); });
    spdlog::info("metrics on http://{}:{}/metrics", http_host, bound);
  }
  // An early return below stops the endpoint first: destroying a joinable thread terminates.
  struct HttpStop {
    httplib::Server& http;
    std::thread& thread;
    ~HttpStop() {
      if (thread.joinable()) {
        http.stop();
        thread.join();
      }
    }
  } http_stop{http, http_thread};

  // Standard discovery: grpc.health.v1 (probes, `gradwire health`) and server reflection (generic
  // tools can list and call the API).
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  std::shared_ptr<grpc::ServerCredentials> credentials = grpc::InsecureServerCredentials();
  if (!flags.tls_cert.empty() || !flags.tls_key.empty() || !flags.tls_client_ca.empty()) {
    if (flags.tls_cert.empty() || flags.tls_key.empty()) {
      spdlog::error("TLS needs both --tls-cert and --tls-key");
      return 2;
    }
    auto read = [](const std::string& path) {
      std::ifstream in(path);
      std::stringstream text;
      text << in.rdbuf();
      return text.str();
    };
    grpc::SslServerCredentialsOptions tls(
        flags.tls_client_ca.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                                    : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    tls.pem_root_certs = flags.tls_client_ca.empty() ? "" : read(flags.tls_client_ca);
    tls.pem_key_cert_pairs.push_back({read(flags.tls_key), read(flags.tls_cert)});
    credentials = grpc::SslServerCredentials(tls);
    spdlog::info("TLS on{}", flags.tls_client_ca.empty()
                                 ? ""
                                 : " with client certificates required (mutual TLS)");
  }
  grpc::ServerBuilder builder;
  int port = 0;
  // One process per port: without this a second server would silently share the port.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Room for headers up to 64 KiB, so an oversized token reaches the authenticator and gets its
  // UNAUTHENTICATED instead of failing in the transport (docs/security.md).
  builder.AddChannelArgument(GRPC_ARG_MAX_METADATA_SIZE, 64 << 10);
  builder.AddListeningPort(flags.listen, credentials, &port);
  builder.RegisterService(&service);
  // Twice the request limit, so a request somewhat over it is read and refused with a message
  // naming --max-request-bytes; the transport drops anything larger unread.
  builder.SetMaxReceiveMessageSize(
      int(std::min<int64_t>(2 * flags.max_request_bytes, std::numeric_limits<int>::max())));
  builder.SetMaxSendMessageSize(flags.max_message_mib << 20);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    spdlog::error("cannot listen on {} (address in use, or not an address of this host?)",
                  flags.listen);
    return 1;
  }
  spdlog::info("gradwire {} on {}: {}", GRADWIRE_VERSION, device, description);
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  health->SetServingStatus(gradwire::v1::Gradwire::service_full_name(), true);
  health->SetServingStatus(true);  // "" and every service named so far
  const std::string bound = BoundAddress(flags.listen, port);
  spdlog::info("listening on {}", bound);
  if (!flags.port_file.empty()) {
    // Written whole under a temporary name, then renamed: a reader never sees half an address.
    const std::string tmp = flags.port_file + ".tmp";
    std::ofstream out(tmp, std::ios::trunc);
    out << bound << "\n";
    out.close();
    if (!out || std::rename(tmp.c_str(), flags.port_file.c_str()) != 0) {
      spdlog::error("cannot write --port-file {}: {}", gradwire::rpc::Escaped(flags.port_file, 256),
                    std::strerror(errno));
      std::remove(tmp.c_str());
      server->Shutdown();
      return 1;
    }
  }
  spdlog::info("context memory {} bytes on the device, {} bytes host offload, TTL {} s",
               flags.context_memory, flags.host_offload_memory, flags.context_ttl_s);

  // Housekeeping: evicts contexts past the TTL even when no call arrives to do it, and gives
  // freed heap memory back to the OS every --heap-trim-every seconds (core/heap_trim.h).
  std::mutex janitor_mu;
  std::condition_variable janitor_cv;
  bool janitor_stop = false;
  std::thread janitor;
  const bool evict = flags.context_ttl_s > 0;
  const bool trim = flags.heap_trim_every_s > 0;
  if (evict || trim) {
    auto period = std::chrono::milliseconds(1000);
    if (evict) {
      period = std::min(period, std::chrono::milliseconds(std::clamp<int64_t>(
                                    int64_t(flags.context_ttl_s * 250), 10, 1000)));
    }
    if (trim) {
      period = std::min(period, std::chrono::milliseconds(std::max<int64_t>(
                                    int64_t(flags.heap_trim_every_s * 1000), 10)));
    }
    const auto trim_every = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
        std::chrono::duration<double>(flags.heap_trim_every_s));
    janitor = std::thread([&, period, evict, trim, trim_every] {
      auto last_trim = std::chrono::steady_clock::now();
      std::unique_lock<std::mutex> lock(janitor_mu);
      while (!janitor_cv.wait_for(lock, period, [&] { return janitor_stop; })) {
        if (evict) {
          if (const int64_t n = host.EvictExpiredContexts(); n > 0) {
            spdlog::info("evicted {} contexts unused for {} s (--context-ttl)", n,
                         flags.context_ttl_s);
          }
        }
        if (trim && std::chrono::steady_clock::now() - last_trim >= trim_every) {
          const gradwire::core::HeapTrimResult r = gradwire::core::TrimHeap();
          last_trim = std::chrono::steady_clock::now();
          if (r.supported) {
            spdlog::debug("heap trim: RSS {} -> {} KiB in {:.1f} ms", r.rss_before_bytes >> 10,
                          r.rss_after_bytes >> 10, r.seconds * 1e3);
          }
        }
      }
    });
  }

  int signal_number = 0;
  sigwait(&signals, &signal_number);
  spdlog::info("received {}, shutting down (grace {:.1f} s)", strsignal(signal_number),
               flags.shutdown_grace_s);
  const auto deadline =
      std::chrono::system_clock::now() +
      std::chrono::milliseconds(static_cast<int64_t>(flags.shutdown_grace_s * 1000));
  health->SetServingStatus(false);  // probes see NOT_SERVING while in-flight calls drain
  server->Shutdown(deadline);  // refuses new calls; cancels what is still running at the deadline
  server->Wait();
  if (http_thread.joinable()) {  // before the executor goes: the endpoint reads its backlog
    http.stop();
    http_thread.join();
  }
  executor.reset();  // drains tasks the cancelled calls left behind
  if (janitor.joinable()) {
    {
      std::lock_guard<std::mutex> lock(janitor_mu);
      janitor_stop = true;
    }
    janitor_cv.notify_all();
    janitor.join();
  }
  int exit_code = 0;
  if (!flags.port_file.empty()) std::remove(flags.port_file.c_str());
  if (checkpointer) {
    auto saved = checkpointer->SaveAll(host);
    if (saved.ok()) {
      spdlog::info("checkpointed {} modules to {}", *saved, flags.checkpoint_dir);
    } else {
      spdlog::error("final checkpoint failed: {}", std::string(saved.status().message()));
      exit_code = 1;
    }
  }
  const auto stats = host.Stats();
  spdlog::info("stopped: {} modules, {} live contexts dropped", stats.modules, stats.live_contexts);
  return exit_code;
}
