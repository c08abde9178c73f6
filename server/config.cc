#include "server/config.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <limits>
#include <sstream>

#include "server/logging.h"

namespace gradwire::server {
namespace {

// Every flag may also come from the environment as GRADWIRE_SERVER_<FLAG> (upper case, - as _).
std::string EnvName(const std::string& long_name) {
  std::string env = "GRADWIRE_SERVER_";
  for (char c : long_name)
    env += c == '-' ? '_' : char(std::toupper(static_cast<unsigned char>(c)));
  return env;
}

// Options that are not configuration (never read from the environment or a file).
bool IsMeta(const CLI::Option* opt) {
  for (const std::string& name : opt->get_lnames()) {
    if (name == "help" || name == "config" || name == "print-config") return true;
  }
  return false;
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

// Adds every flag of `config` to `app`, each with its default, check and help text.
void AddFlags(CLI::App& app, ServerConfig& config, std::string& config_file, bool& print_config) {
  app.add_option("--listen", config.listen,
                 "address to serve on, host:port (port 0 picks a free port; the log says which)")
      ->capture_default_str();
  app.add_option("--device", config.device,
                 "compute device: cpu, cuda, or auto (cuda when usable, else cpu)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  app.add_option("--port-file", config.port_file,
                 "once serving, write the bound host:port to this file (atomically; removed at "
                 "exit): how a supervisor learns the port of --listen HOST:0 at any --log-level");
  app.add_option("--log-level", config.log_level, "trace, debug, info, warn, error or off")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "off"}))
      ->capture_default_str();
  app.add_option("--log-format", config.log_format,
                 "text, or json: one JSON object a line (time in UTC, level, msg, and the call's "
                 "request_id and parent_id in lines about a call; RPC lines also carry method, "
                 "code, duration_ms, module, context, tenant, error). The request id is the "
                 "trace-id of the client's W3C traceparent, or one made for the call")
      ->check(CLI::IsMember({"text", "json"}))
      ->capture_default_str();
  app.add_option("--max-message-mib", config.max_message_mib,
                 "largest gRPC response message sent, in MiB (requests: --max-request-bytes)")
      ->check(CLI::Range(1, 2047))
      ->capture_default_str();
  app.add_option("--max-request-bytes", config.max_request_bytes,
                 "largest request message, e.g. 64MiB (bytes; KiB, MiB, GiB accepted); larger "
                 "ones get RESOURCE_EXHAUSTED, and the transport drops ones over twice this unread")
      ->transform(CLI::AsSizeValue(true))
      ->check(CLI::Range(int64_t(1) << 10, int64_t(1) << 30))
      ->capture_default_str();
  app.add_option("--max-tensor-elements", config.max_tensor_elements,
                 "most elements of any tensor a call sends or makes the server build (forward "
                 "output, MLP hidden layer)")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 40))
      ->capture_default_str();
  app.add_option("--max-contexts-per-client", config.max_contexts_per_client,
                 "most live training contexts of one client (its tenant with tokens, else its "
                 "address); 0: no limit")
      ->check(CLI::Range(int64_t(0), int64_t(1) << 40))
      ->capture_default_str();
  app.add_option("--max-queued-per-module", config.max_queued_per_module,
                 "most calls waiting for the device per module; more get RESOURCE_EXHAUSTED; 0: no "
                 "limit")
      ->check(CLI::Range(int64_t(0), int64_t(1) << 40))
      ->capture_default_str();
  app.add_option("--max-queued-per-client", config.max_queued_per_client,
                 "most calls of one client (its tenant with tokens, else its address) waiting for "
                 "the device, over all its modules; more get RESOURCE_EXHAUSTED; 0: no limit")
      ->check(CLI::Range(int64_t(0), int64_t(1) << 40))
      ->capture_default_str();
  app.add_option("--max-parameter-bytes-per-client", config.max_parameter_bytes_per_client,
                 "quota: fp32 parameter bytes of one client's modules, e.g. 8GiB (gradients and "
                 "optimizer state add up to 3x more); a CreateModule past it gets "
                 "RESOURCE_EXHAUSTED; 0: none")
      ->transform(CLI::AsSizeValue(true))
      ->check(CLI::Range(int64_t(0), std::numeric_limits<int64_t>::max()))
      ->capture_default_str();
  app.add_option("--max-context-bytes-per-client", config.max_context_bytes_per_client,
                 "quota: saved-tensor bytes of one client's live training contexts, on the device "
                 "and offloaded together, e.g. 4GiB; a training forward past it gets "
                 "RESOURCE_EXHAUSTED and stores nothing; 0: none")
      ->transform(CLI::AsSizeValue(true))
      ->check(CLI::Range(int64_t(0), std::numeric_limits<int64_t>::max()))
      ->capture_default_str();
  app.add_option("--max-stream-bytes-per-client", config.max_stream_bytes_per_client,
                 "quota: tensor bytes one client's chunked requests may have in flight together "
                 "(as their headers declare), e.g. 4GiB; a header past it gets "
                 "RESOURCE_EXHAUSTED; 0: none")
      ->transform(CLI::AsSizeValue(true))
      ->check(CLI::Range(int64_t(0), std::numeric_limits<int64_t>::max()))
      ->capture_default_str();
  app.add_option("--context-memory", config.context_memory,
                 "device memory for saved tensors of training contexts, e.g. 4GiB (bytes; KiB, "
                 "MiB, GiB accepted; on the CPU backend host memory stands for the device). Past "
                 "it the least recently used contexts move to host memory; a forward whose "
                 "context alone is larger gets RESOURCE_EXHAUSTED")
      ->transform(CLI::AsSizeValue(true))
      ->check(CLI::Range(int64_t(1), std::numeric_limits<int64_t>::max()))
      ->capture_default_str();
  app.add_option("--host-offload-memory", config.host_offload_memory,
                 "host memory for contexts offloaded from the device, e.g. 8GiB (on the CPU "
                 "backend a separately accounted host copy); past it the least recently used are "
                 "evicted (their backward gets "
                 "NOT_FOUND saying so); 0: no offload, evict at once")
      ->transform(CLI::AsSizeValue(true))
      ->check(CLI::Range(int64_t(0), std::numeric_limits<int64_t>::max()))
      ->capture_default_str();
  app.add_option("--module-ttl", config.module_ttl_s,
                 "seconds after which a module whose owner made no call that succeeded and sent "
                 "no keep-alive is released with its contexts and gradients (0: never); refused "
                 "calls and other tenants' calls renew nothing. The project's clients "
                 "keep the modules they created or attached alive while they are open; durable "
                 "modules (--checkpoint-dir) are never released")
      ->check(CLI::Range(0.0, 1e9))
      ->capture_default_str();
  app.add_option("--context-ttl", config.context_ttl_s,
                 "seconds a training context may wait unused for its backward before it is "
                 "evicted (0: never)")
      ->check(CLI::Range(0.0, 1e9))
      ->capture_default_str();
  app.add_option("--heap-trim-every", config.heap_trim_every_s,
                 "seconds between returns of freed heap memory to the OS (malloc_trim; after this "
                 "long idle, the CPU backend's scratch buffers too); without them RSS creeps up "
                 "under training load while the memory in use stays flat (0: never)")
      ->check(CLI::Range(0.0, 1e9))
      ->capture_default_str();
  app.add_option("--heap-retain", config.heap_retain,
                 "keep freed large blocks in the heap for the next request instead of unmapping "
                 "them (each fresh block costs a page fault per 4 KiB); idle memory still goes "
                 "back by --heap-trim-every")
      ->capture_default_str();
  app.add_option("--delivery-slack-ms", config.delivery_slack_ms,
                 "a training forward that finishes less than this before its deadline releases "
                 "its context and answers CANCELLED: its response would reach the client after "
                 "it gave up (raise it on slow links; docs/security.md)")
      ->check(CLI::Range(0.0, 60000.0))
      ->capture_default_str();
  app.add_option("--shared-memory", config.shared_memory,
                 "auto: a client on this host (a loopback or Unix-socket peer) may ask the server "
                 "for a shared-memory region that only it can reach (CreateSharedMemory: the "
                 "server makes a 0600 object under a random name, and the client removes the "
                 "name once it has it open), and the project's clients then pass large tensors "
                 "through it by themselves; off: never (docs/shared-memory.md)")
      ->check(CLI::IsMember({"auto", "off"}))
      ->capture_default_str();
  app.add_option("--max-shared-memory-mib", config.max_shared_memory_mib,
                 "MiB of shared memory the server may make for clients, all regions together "
                 "(their pages are reserved in /dev/shm when made)")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 30))
      ->capture_default_str();
  app.add_option("--shared-memory-idle", config.shared_memory_idle_s,
                 "seconds after which a region the server made and no call used is closed (0: "
                 "never); the project's clients then make a new one")
      ->check(CLI::Range(0.0, 1e9))
      ->capture_default_str();
  app.add_flag("--allow-shared-memory", config.allow_shared_memory,
               "let clients on this host register POSIX shared-memory objects and pass tensors "
               "through them instead of the wire (RegisterSharedMemory; docs/shared-memory.md). A "
               "client can then reach any object the server's user may open whose name starts "
               "with --shared-memory-prefix");
  app.add_option("--shared-memory-prefix", config.shared_memory_prefix,
                 "shared-memory keys a client may register must start with this")
      ->capture_default_str();
  app.add_option("--max-shared-memory-regions", config.max_shared_memory_regions,
                 "shared-memory regions one client (tenant with tokens) may hold registered "
                 "(0: unlimited)")
      ->check(CLI::Range(0, 1 << 20))
      ->capture_default_str();
  app.add_option("--shutdown-grace", config.shutdown_grace_s,
                 "seconds in-flight calls may take to finish after SIGINT/SIGTERM")
      ->check(CLI::Range(0.0, 3600.0))
      ->capture_default_str();
  app.add_option("--tls-cert", config.tls_cert, "PEM certificate chain: serve TLS (with --tls-key)")
      ->check(CLI::ExistingFile);
  app.add_option("--tls-key", config.tls_key, "PEM private key of --tls-cert")
      ->check(CLI::ExistingFile);
  app.add_option("--tls-client-ca", config.tls_client_ca,
                 "PEM CA bundle: mutual TLS, every client must present a certificate it signed")
      ->check(CLI::ExistingFile);
  app.add_flag(
      "--insecure", config.insecure,
      "allow a non-loopback --listen address without TLS and bearer tokens (refused by default)");
  app.add_option(
      "--metrics-listen", config.metrics_listen,
      "serve Prometheus metrics at http://HOST:PORT/metrics, or on 127.0.0.1 with a bare "
      "PORT (port 0 picks one; off if empty). The page names clients and module ids: "
      "keep it on loopback or set --metrics-token-file");
  app.add_option("--metrics-token-file", config.metrics_token_file,
                 "file holding a bearer token the metrics endpoint requires (Authorization: "
                 "Bearer TOKEN); without it the endpoint answers anyone who can reach it")
      ->check(CLI::ExistingFile);
  app.add_option("--checkpoint-dir", config.checkpoint_dir,
                 "directory for module checkpoints: restored at start, written on create, weight "
                 "upload, every --checkpoint-every optimizer steps and at shutdown (off if empty)");
  app.add_flag("--checkpoint-shared", config.checkpoint_shared,
               "other servers share --checkpoint-dir (behind a proxy that routes each module's "
               "calls by the gradwire-route header): take a module over from its checkpoint on "
               "the first call about it instead of restoring all at start, and let go of a module "
               "another server took over since (docs/scaling-out.md). Every server sharing a "
               "directory needs it; a server without it refuses to start on a directory in use")
      ->capture_default_str();
  app.add_option("--checkpoint-check-every", config.checkpoint_check_every_s,
                 "with --checkpoint-shared: seconds between checks that this server still holds "
                 "each of its modules (one small read and a stat per module on the shared "
                 "storage); a module another server took over is let go of, with its contexts, at "
                 "the next check, or at its next step, upload or save (0: only then)")
      ->check(CLI::Range(0.0, 86400.0))
      ->capture_default_str();
  app.add_option("--checkpoint-handover-wait", config.checkpoint_handover_wait_s,
                 "with --checkpoint-shared: seconds a server taking over a module waits for the "
                 "live server holding it to pick up a hand-over request; that server then saves "
                 "the module, drops it and releases it, so no step it took is lost when a proxy "
                 "moves the module (a server coming back, one added). A holder that is gone or "
                 "does not answer in time is fenced instead, and its steps since its last save "
                 "are lost (0: never ask)")
      ->check(CLI::Range(0.0, 60.0))
      ->capture_default_str();
  app.add_option("--checkpoint-every", config.checkpoint_every,
                 "optimizer steps between a module's checkpoints (0: only create/upload/shutdown)")
      ->check(CLI::Range(int64_t(0), int64_t(1) << 40))
      ->capture_default_str();
  app.add_option("--cpu-threads", config.cpu_threads,
                 "threads the CPU backend computes on (casts, loops and GEMMs); 0: one per core. "
                 "Fewer leave cores to gRPC and to clients on the same host")
      ->check(CLI::Range(0, 256))
      ->capture_default_str();
  app.add_option("--cpu-gemm-threads", config.cpu_gemm_threads,
                 "who splits the CPU backend's GEMMs: pool (its own threads, BLAS single-threaded "
                 "on blocks: one set of threads for everything) or blas (BLAS's own threads)")
      ->check(CLI::IsMember({"pool", "blas"}))
      ->capture_default_str();
  app.add_option("--cuda-staging-mib", config.cuda_staging_mib,
                 "--device cuda: requests and responses of 1 MiB or more cross to and from the GPU "
                 "through two pinned buffers of this many MiB, copied on the host by the CPU "
                 "threads while the previous chunk crosses (0: plain pageable copies). Not yet "
                 "measured on a GPU: docs/cuda.md")
      ->check(CLI::Range(0, 1024))
      ->capture_default_str();
  app.add_option("--cpu-gemm", config.cpu_gemm,
                 "the CPU backend's three GEMMs (forward, input and weight gradients): ordered "
                 "(the FP8 GEMM: register-tiled, the reference backend's arithmetic bit for bit, "
                 "a row's result never depends on the other rows in the call, so a batch is one "
                 "GEMM) or blas (the process's BLAS on the decoded operands, for comparison)")
      ->check(CLI::IsMember({"blas", "ordered"}))
      ->capture_default_str();
  app.add_option("--cpu-isa", config.cpu_isa,
                 "the instruction set of the FP8 GEMM's micro-kernel: auto (the widest this CPU "
                 "runs: avx512bf16, avx512, avx2, baseline), or one of those names. Every copy "
                 "gives the same bits; a copy this CPU lacks is refused at start")
      ->check(CLI::IsMember({"auto", "avx512bf16", "avx512", "avx2", "baseline"}))
      ->capture_default_str();
  app.add_option("--default-recipe", config.default_recipe,
                 "the FP8 recipe of a module created without one: block (a power-of-two scale "
                 "per 1x128 block of activations and gradients, 128x128 of weights: one outlier "
                 "costs only its own block), mxfp8, current or delayed (one scale per tensor). A "
                 "module that asks for a margin gets current when this is block or mxfp8; "
                 "--device cuda, which has no block-scaled GEMM yet, uses current for them. "
                 "Restored modules keep the recipe they were saved with (docs/block-scaling.md)")
      ->check(CLI::IsMember({"block", "mxfp8", "current", "delayed"}))
      ->capture_default_str();
  app.add_option("--max-batch-rows", config.max_batch_rows,
                 "dynamic batching: forwards of one module, and backwards of one module's "
                 "contexts, waiting for the device run as one backend call over up to this many "
                 "rows in all (0 or 1: off). A batch takes whoever is already waiting (no delay "
                 "unless --batch-delay-us). Every request still gets exactly the bits it gets "
                 "alone or in sequence (docs/batching.md); with --cpu-gemm ordered a batch is one "
                 "GEMM, with blas one GEMM per request")
      ->check(CLI::Range(int64_t(0), int64_t(1) << 20))
      ->capture_default_str();
  app.add_option("--batch-yield", config.batch_yield,
                 "with --max-batch-rows: a running batch gives the requests it has not prepared "
                 "back (once) when another client's work is waiting, so one tenant's batch "
                 "delays another's call by one request's preparation and the batch's compute "
                 "(false: a batch runs whole; docs/batching.md says what it gains)")
      ->capture_default_str();
  app.add_option("--batch-delay-us", config.batch_delay_us,
                 "with --max-batch-rows: the longest a batch waits for more requests when the "
                 "device has nothing else to do (0: it runs with whoever is waiting)")
      ->check(CLI::Range(int64_t(0), int64_t(1000000)))
      ->capture_default_str();
  app.add_option("--stream-read-ahead", config.stream_read_ahead,
                 "requests of a Train stream read ahead of the responses written: a fast client "
                 "cannot make the server buffer more")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  app.add_option("--chunk-kib", config.chunk_kib,
                 "KiB per chunk of the chunked Forward/Backward/GetWeights/SetWeights calls: the "
                 "size the server sends and the largest it accepts (must fit --max-message-mib)")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--max-stream-mib", config.max_stream_mib,
                 "most MiB the tensors of one chunked request may add up to "
                 "(more: RESOURCE_EXHAUSTED before any chunk is read)")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--tokens-file", config.tokens_file,
                 "require bearer tokens: a file of \"TENANT TOKEN [WEIGHT]\" lines (# comments). "
                 "Every module and context belongs to the tenant that created it; other tenants "
                 "get NOT_FOUND. WEIGHT (default 1, at most 1000) is the tenant's part in the fair "
                 "shares of context memory")
      ->check(CLI::ExistingFile);
  app.add_option(
         "--tokens", config.tokens,
         "require bearer tokens given as TENANT:TOKEN[:WEIGHT] entries, comma-separated (meant for "
         "GRADWIRE_SERVER_TOKENS or the config file: a command line is visible to other "
         "users)")
      ->delimiter(',');
  for (CLI::Option* opt : app.get_options()) {
    if (!IsMeta(opt)) opt->envname(EnvName(opt->get_name(false, false).substr(2)));
  }
  app.add_option(
         "--config", config_file,
         "TOML file of flag values (keys are flag names: listen = \"0.0.0.0:50051\"); flags "
         "and GRADWIRE_SERVER_* variables override it; unknown keys are errors")
      ->envname("GRADWIRE_SERVER_CONFIG")
      ->check(CLI::ExistingFile);
  app.add_flag("--print-config", print_config,
               "print the effective configuration (tokens masked) as TOML and exit");
  app.footer(
      "Every flag can also be set as GRADWIRE_SERVER_<FLAG> (e.g. GRADWIRE_SERVER_LISTEN) or as a "
      "key of the --config file; precedence: flags > environment > file.");
}

}  // namespace

std::optional<int> ParseServerConfig(int argc, char** argv, ServerConfig& config) {
  CLI::App app{
      "gradwire-server: hosts FP8 Linear, LayerNormLinear and LayerNormMLP modules (E4M3 "
      "forward, E5M2 gradients) and runs them forward and backward for remote clients over "
      "gRPC."};
  std::string config_file;
  bool print_config = false;
  AddFlags(app, config, config_file, print_config);
  try {
    app.parse(argc, argv);
    if (!config_file.empty()) ApplyConfigFile(app, config_file);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (print_config) {
    std::fputs(RenderConfig(config).c_str(), stdout);
    return 0;
  }
  return std::nullopt;
}

std::string RenderConfig(const ServerConfig& f) {
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
  out << "module-ttl = " << f.module_ttl_s << "\n";
  out << "context-ttl = " << f.context_ttl_s << "\n";
  out << "heap-trim-every = " << f.heap_trim_every_s << "\n";
  out << "heap-retain = " << (f.heap_retain ? "true" : "false") << "\n";
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
  out << "checkpoint-shared = " << (f.checkpoint_shared ? "true" : "false") << "\n";
  out << "checkpoint-check-every = " << f.checkpoint_check_every_s << "\n";
  out << "checkpoint-handover-wait = " << f.checkpoint_handover_wait_s << "\n";
  out << "stream-read-ahead = " << f.stream_read_ahead << "\n";
  out << "cpu-threads = " << f.cpu_threads << "\n";
  out << "cpu-gemm-threads = " << quote(f.cpu_gemm_threads) << "\n";
  out << "cpu-gemm = " << quote(f.cpu_gemm) << "\n";
  out << "cpu-isa = " << quote(f.cpu_isa) << "\n";
  out << "cuda-staging-mib = " << f.cuda_staging_mib << "\n";
  out << "default-recipe = " << quote(f.default_recipe) << "\n";
  out << "max-batch-rows = " << f.max_batch_rows << "\n";
  out << "batch-delay-us = " << f.batch_delay_us << "\n";
  out << "batch-yield = " << (f.batch_yield ? "true" : "false") << "\n";
  out << "chunk-kib = " << f.chunk_kib << "\n";
  out << "max-stream-mib = " << f.max_stream_mib << "\n";
  out << "shared-memory = " << quote(f.shared_memory) << "\n";
  out << "max-shared-memory-mib = " << f.max_shared_memory_mib << "\n";
  out << "shared-memory-idle = " << f.shared_memory_idle_s << "\n";
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

}  // namespace gradwire::server
