// gradwire-server: hosts FP8 modules and serves them over gRPC. This file reads the configuration
// (server/config.h), checks what only makes sense together, starts the server (server/server.h)
// and stops it on SIGINT/SIGTERM.
#include <pthread.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "server/config.h"
#include "server/core/heap_trim.h"
#include "server/device/cpu_gemm.h"
#include "server/logging.h"
#include "server/rpc/auth.h"
#include "server/server.h"

namespace {

using gradwire::rpc::Authenticator;
using gradwire::server::ServerConfig;

// The bearer tokens of --tokens-file and --tokens, and the tenants' weights given there; null
// when neither is given. Returns an error for a bad file or entry.
absl::StatusOr<std::shared_ptr<const Authenticator>> LoadTokens(
    const ServerConfig& c, Authenticator::TenantWeights* weights) {
  if (c.tokens_file.empty() && c.tokens.empty()) return nullptr;
  std::vector<std::pair<std::string, std::string>> entries;
  if (!c.tokens_file.empty()) {
    auto read = Authenticator::ReadTokensFile(c.tokens_file, weights);
    if (!read.ok()) return read.status();
    entries = *std::move(read);
  }
  for (const std::string& entry : c.tokens) {
    auto parsed = Authenticator::ParseInline(entry, weights);
    if (!parsed.ok()) return parsed.status();
    entries.push_back(*std::move(parsed));
  }
  auto made = Authenticator::FromEntries(entries);
  if (!made.ok()) return made.status();
  auto authenticator = std::make_shared<const Authenticator>(*std::move(made));
  const auto tenants = authenticator->Tenants();
  std::string names;
  for (const auto& t : tenants) names += (names.empty() ? "" : ", ") + t;
  std::string weighted;
  for (const auto& t : tenants) {
    if (auto w = weights->find(t); w != weights->end()) {
      weighted += (weighted.empty() ? "" : ", ") + t + "=" + fmt::format("{:g}", w->second);
    }
  }
  spdlog::info("bearer tokens required: {} tokens for {} tenants ({}); weights {}",
               authenticator->size(), tenants.size(), names,
               weighted.empty() ? "all 1" : weighted + ", others 1");
  return authenticator;
}

// What only makes sense together: a chunk must fit the messages both ways, and a non-loopback
// address needs TLS and tokens (or --insecure). Returns the complaint, empty when all is well.
std::string CheckCombinations(const ServerConfig& c, bool tokens) {
  // A chunk travels in one message with a few bytes of framing around it, both ways: it must fit
  // what the server sends (--max-message-mib) and what it reads (twice --max-request-bytes).
  const int64_t chunk_room = (int64_t(c.chunk_kib) << 10) + (int64_t(64) << 10);
  if (chunk_room > int64_t(c.max_message_mib) << 20 || chunk_room > 2 * c.max_request_bytes) {
    return "--chunk-kib " + std::to_string(c.chunk_kib) + " does not fit --max-message-mib " +
           std::to_string(c.max_message_mib) + " and twice --max-request-bytes " +
           std::to_string(c.max_request_bytes) + " (a chunk needs 64 KiB of room)";
  }
  if ((!c.tls_cert.empty()) != (!c.tls_key.empty()))
    return "TLS needs both --tls-cert and --tls-key";
  const bool tls = !c.tls_cert.empty();
  if (!gradwire::server::IsLoopback(c.listen) && !(tls && tokens) && !c.insecure) {
    return "refusing to serve on " + c.listen + " without " +
           (tls      ? "bearer tokens"
            : tokens ? "TLS"
                     : "TLS and bearer tokens") +
           ": it is not a loopback address; give --tls-cert, --tls-key and --tokens-file, or "
           "--insecure if the network is trusted";
  }
  return "";
}

// The server's options from the configuration (the backend and tokens resolved by the caller).
gradwire::server::ServerOptions ToServerOptions(const ServerConfig& c) {
  gradwire::server::ServerOptions o;
  o.listen = c.listen;
  o.context_limits.device_bytes = c.context_memory;
  o.context_limits.host_bytes = c.host_offload_memory;
  o.context_limits.ttl_seconds = c.context_ttl_s;
  o.service.module_ttl_s = c.module_ttl_s;
  o.context_limits.client_bytes = c.max_context_bytes_per_client;
  o.tls_cert_file = c.tls_cert;
  o.tls_key_file = c.tls_key;
  o.tls_client_ca_file = c.tls_client_ca;
  o.max_message_mib = c.max_message_mib;
  o.checkpoint_dir = c.checkpoint_dir;
  o.checkpoint_every = c.checkpoint_every;
  o.checkpoint_shared = c.checkpoint_shared;
  o.checkpoint_check_every_s = c.checkpoint_check_every_s;
  o.checkpoint_handover_wait_s = c.checkpoint_handover_wait_s;
  o.metrics_listen = c.metrics_listen;
  o.metrics_token_file = c.metrics_token_file;
  o.heap_trim_every_s = c.heap_trim_every_s;
  o.port_file = c.port_file;
  gradwire::rpc::ServiceOptions& s = o.service;
  s.version = GRADWIRE_VERSION;
  s.stream_read_ahead = c.stream_read_ahead;
  // The config's check admits only the four names.
  gradwire::core::ScalingModeByName(c.default_recipe, &s.default_recipe);
  s.batching.max_rows = c.max_batch_rows;
  s.batching.delay = std::chrono::microseconds(c.batch_delay_us);
  s.batching.yield = c.batch_yield;
  s.chunk_bytes = int64_t(c.chunk_kib) << 10;
  s.delivery_slack = std::chrono::milliseconds(static_cast<int64_t>(c.delivery_slack_ms));
  s.max_stream_bytes = int64_t(c.max_stream_mib) << 20;
  s.limits.max_request_bytes = c.max_request_bytes;
  s.limits.max_tensor_elements = c.max_tensor_elements;
  s.limits.max_contexts_per_client = c.max_contexts_per_client;
  s.limits.max_queued_per_module = c.max_queued_per_module;
  s.limits.max_queued_per_client = c.max_queued_per_client;
  s.quotas.parameter_bytes = c.max_parameter_bytes_per_client;
  s.quotas.stream_bytes = c.max_stream_bytes_per_client;
  s.shared_memory.create = c.shared_memory == "auto";
  s.shared_memory.max_bytes = uint64_t(c.max_shared_memory_mib) << 20;
  s.shared_memory.idle_timeout_s = c.shared_memory_idle_s;
  s.shared_memory.enabled = c.allow_shared_memory;
  s.shared_memory.key_prefix = c.shared_memory_prefix;
  s.shared_memory.max_regions = c.max_shared_memory_regions;
  const bool json_logs = c.log_format == "json";
  s.on_rpc_done = [json_logs](const gradwire::rpc::RpcRecord& r) {
    gradwire::server::LogRpc(r, json_logs);
  };
  return o;
}

}  // namespace

static pthread_t g_main_thread;

// Runs only on a thread that does not block the stop signals (main blocks them): hands the
// signal to main's sigwait. pthread_kill is async-signal-safe.
static void ForwardToMain(int sig) { pthread_kill(g_main_thread, sig); }

int main(int argc, char** argv) {
  ServerConfig config;
  if (std::optional<int> exit_code = gradwire::server::ParseServerConfig(argc, argv, config)) {
    return *exit_code;
  }
  gradwire::server::SetUpLogging(config.log_level, config.log_format);

  // Signals are taken by sigwait below; block them here so the threads started from now on
  // inherit the block. Threads that libraries start before main (OpenBLAS's workers) do not
  // block them: a signal the kernel hands to one of those runs ForwardToMain, which passes it to
  // this thread, where it waits for sigwait (without the handler it would kill the process with
  // the default action whenever this thread is not in sigwait yet).
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  g_main_thread = pthread_self();
  struct sigaction forward = {};
  forward.sa_handler = ForwardToMain;
  sigemptyset(&forward.sa_mask);
  sigaction(SIGINT, &forward, nullptr);
  sigaction(SIGTERM, &forward, nullptr);

  Authenticator::TenantWeights weights;
  auto authenticator = LoadTokens(config, &weights);
  if (!authenticator.ok()) {
    spdlog::error("{}", std::string(authenticator.status().message()));
    return 2;
  }
  if (std::string bad = CheckCombinations(config, *authenticator != nullptr); !bad.empty()) {
    spdlog::error("{}", bad);
    return 2;
  }
  gradwire::device::SetCpuThreads(config.cpu_threads, config.cpu_gemm_threads == "blas");
  gradwire::device::SetCpuGemm(config.cpu_gemm == "ordered" ? gradwire::device::CpuGemm::kOrdered
                                                            : gradwire::device::CpuGemm::kBlas);
  if (std::string bad = gradwire::device::SetCpuIsa(config.cpu_isa); !bad.empty()) {
    spdlog::error("--cpu-isa {}: {}", config.cpu_isa, bad);
    return 2;
  }
  if (config.heap_retain && !gradwire::core::RetainLargeBlocks()) {
    spdlog::warn("--heap-retain: this C library has no mallopt; large blocks stay mmapped");
  }
  gradwire::device::SetCudaStaging(int64_t(config.cuda_staging_mib) << 20);
  auto backend = gradwire::server::ResolveDevice(config.device);
  if (!backend.ok()) {
    spdlog::error("{}", std::string(backend.status().message()));
    return 2;
  }

  gradwire::server::ServerOptions options = ToServerOptions(config);
  options.backend = *std::move(backend);
  options.authenticator = *std::move(authenticator);
  options.context_limits.tenant_weights = weights;
  auto server = gradwire::server::Server::Start(std::move(options));
  if (!server.ok()) {
    spdlog::error("{}", std::string(server.status().message()));
    return 1;
  }

  int signal_number = 0;
  sigwait(&signals, &signal_number);
  spdlog::info("received {}, shutting down (grace {:.1f} s)", strsignal(signal_number),
               config.shutdown_grace_s);
  const auto deadline =
      std::chrono::system_clock::now() +
      std::chrono::milliseconds(static_cast<int64_t>(config.shutdown_grace_s * 1000));
  absl::StatusOr<int64_t> stopped = (*server)->Shutdown(deadline);
  if (!stopped.ok()) {
    spdlog::error("{}", std::string(stopped.status().message()));
    return 1;
  }
  return 0;
}
