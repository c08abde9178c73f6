// gradwire-server's configuration: every flag, its default and its help text, read from the
// command line, GRADWIRE_SERVER_* environment variables and a TOML file (precedence in that
// order), and rendered back as a TOML file. Parsing only: the server is assembled from the result
// in server.h.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace gradwire::server {

// One field a flag (--listen is `listen`, --context-ttl is `context_ttl_s`); each default is the
// flag's default.
struct ServerConfig {
  std::string listen = "127.0.0.1:50051";  // loopback unless told otherwise
  std::string device = "auto";             // auto | cpu | cuda
  std::string log_level = "info";
  std::string log_format = "text";  // text | json (one JSON object a line)
  int max_message_mib = 64;         // largest response message
  // Saved-context memory (DESIGN.md, bounded memory): device budget, host offload budget, TTL.
  int64_t context_memory = int64_t(4) << 30;
  int64_t host_offload_memory = int64_t(8) << 30;
  double context_ttl_s = 600;
  double module_ttl_s = 3600;
  // Seconds between returns of freed heap memory to the OS (core/heap_trim.h); 0: never.
  double heap_trim_every_s = 1;
  // Freed large blocks stay in the heap for reuse instead of being unmapped (core/heap_trim.h).
  bool heap_retain = true;
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
  std::string metrics_token_file;         // bearer token the metrics endpoint requires; empty: none
  double shutdown_grace_s = 10.0;         // in-flight calls get this long on SIGINT/SIGTERM
  double delivery_slack_ms = 10.0;        // a forward this close to its deadline is abandoned
  std::string metrics_listen;             // host:port of the Prometheus endpoint; empty: off
  std::string tls_cert;                   // PEM certificate chain; with tls_key: serve TLS
  std::string tls_key;                    // PEM private key
  std::string tls_client_ca;              // PEM CA bundle: require and verify client certificates
  bool insecure = false;                  // allow plaintext on a non-loopback address
  std::string checkpoint_dir;             // empty: modules live only in memory
  int64_t checkpoint_every = 100;         // optimizer steps between a module's checkpoints
  bool checkpoint_shared = false;         // other servers share checkpoint_dir
  double checkpoint_check_every_s = 1;    // seconds between checks of the modules' claims
  double checkpoint_handover_wait_s = 2;  // a live holder's time to pick up a hand-over
  int stream_read_ahead = 8;              // Train-stream requests read ahead of their responses
  int cpu_threads = 0;                    // CPU backend's threads (0: one per core)
  // The CUDA backend's wire crossings through two pinned slots of this many MiB (0: pageable
  // copies); core/staged_copy.h.
  int cuda_staging_mib = 0;
  std::string cpu_gemm_threads = "pool";  // who splits the CPU GEMMs: "pool" or "blas"
  std::string cpu_gemm = "ordered";       // the CPU GEMMs: "ordered" or "blas" (core/cpu_gemm.h)
  // The FP8 GEMM's copy: "auto" (the widest this CPU has) or one named in
  // kernels/cpu/ordered_gemm.h ("avx512bf16", "avx512", "avx2", "baseline"); same bits either way.
  std::string cpu_isa = "auto";
  std::string default_recipe = "block";  // of a module created without a recipe
  int64_t max_batch_rows = 256;          // dynamic batching (forwards, backwards); <= 1: off
  int64_t batch_delay_us = 0;            // the longest a batch waits for company
  bool batch_yield = false;              // a running batch yields to other clients' work
  int chunk_kib = 4096;                  // chunks of the chunked calls, sent and accepted
  int max_stream_mib = 4096;             // most tensor bytes one chunked request may carry
  std::string tokens_file;               // "TENANT TOKEN" lines: bearer tokens required
  std::string port_file;                 // written with the bound host:port once serving
  // Shared-memory tensors for clients on this host: off by default.
  std::string shared_memory = "auto";  // auto | off: CreateSharedMemory for same-host clients
  bool allow_shared_memory = false;
  std::string shared_memory_prefix = "gradwire";
  int max_shared_memory_regions = 64;
  int64_t max_shared_memory_mib = 2048;
  double shared_memory_idle_s = 300;
  std::vector<std::string> tokens;  // TENANT:TOKEN entries (environment or config file)
};

// Parses `argv` (then the environment, then the --config file) into `config`. Returns an exit
// code when the process should end now: 0 after --help or --print-config (printed to stdout),
// non-zero (the message on stderr) for a bad flag, value or config file; nullopt to go on.
std::optional<int> ParseServerConfig(int argc, char** argv, ServerConfig& config);

// The configuration as a TOML file that --config reads back; token values masked.
std::string RenderConfig(const ServerConfig& config);

}  // namespace gradwire::server
