#include "server/server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <httplib.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <mutex>
#include <sstream>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/core/heap_trim.h"
#include "server/device/cpu_gemm.h"
#include "server/rpc/boundary.h"

namespace gradwire::server {
namespace {

// Replaces a trailing ":0" port with the port the server actually bound.
std::string BoundAddress(const std::string& listen, int port) {
  const auto colon = listen.rfind(':');
  if (colon == std::string::npos) return listen;
  return listen.substr(0, colon + 1) + std::to_string(port);
}

absl::StatusOr<std::string> ReadWholeFile(const std::string& path, const char* what) {
  std::ifstream in(path);
  if (!in) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, " ", rpc::Escaped(path, 256), ": cannot read it"));
  }
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> Credentials(const ServerOptions& o) {
  if (o.tls_cert_file.empty() && o.tls_key_file.empty() && o.tls_client_ca_file.empty()) {
    return grpc::InsecureServerCredentials();
  }
  if (o.tls_cert_file.empty() || o.tls_key_file.empty()) {
    return absl::InvalidArgumentError("TLS needs both --tls-cert and --tls-key");
  }
  auto cert = ReadWholeFile(o.tls_cert_file, "--tls-cert");
  if (!cert.ok()) return cert.status();
  auto key = ReadWholeFile(o.tls_key_file, "--tls-key");
  if (!key.ok()) return key.status();
  grpc::SslServerCredentialsOptions tls(
      o.tls_client_ca_file.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                                   : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  if (!o.tls_client_ca_file.empty()) {
    auto ca = ReadWholeFile(o.tls_client_ca_file, "--tls-client-ca");
    if (!ca.ok()) return ca.status();
    tls.pem_root_certs = *std::move(ca);
  }
  tls.pem_key_cert_pairs.push_back({*std::move(key), *std::move(cert)});
  spdlog::info("TLS on{}", o.tls_client_ca_file.empty()
                               ? ""
                               : " with client certificates required (mutual TLS)");
  return grpc::SslServerCredentials(tls);
}

// Written whole under a temporary name, then renamed: a reader never sees half an address.
absl::Status WritePortFile(const std::string& path, const std::string& address) {
  const std::string tmp = path + ".tmp";
  std::ofstream out(tmp, std::ios::trunc);
  out << address << "\n";
  out.close();
  if (!out || std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    std::remove(tmp.c_str());
    return absl::FailedPreconditionError(
        absl::StrCat("cannot write --port-file ", rpc::Escaped(path, 256), ": ", why));
  }
  return absl::OkStatus();
}

}  // namespace

// The Prometheus endpoint: a small HTTP server (cpp-httplib) on a thread of its own, off the gRPC
// path, serving prometheus-cpp's exposition of the metrics (Metrics::Render). Not prometheus-cpp's
// own Exposer: Debian builds its civetweb with a fixed 100 KiB thread stack, smaller than the
// static TLS of the libraries this process loads (cuBLASLt, OpenBLAS, ...), so civetweb cannot
// start its threads here (pthread_create: EINVAL). docs/observability.md says more.
class Server::MetricsEndpoint {
 public:
  // Binds `listen` (a bare port binds loopback: the page names clients and module ids).
  static absl::StatusOr<std::unique_ptr<MetricsEndpoint>> Start(Server& server, std::string listen,
                                                                const std::string& token_file) {
    if (listen.find(':') == std::string::npos) listen = "127.0.0.1:" + listen;
    const auto colon = listen.rfind(':');
    const std::string host = listen.substr(0, colon);
    const int wanted = std::atoi(listen.c_str() + colon + 1);
    std::string token;
    if (!token_file.empty()) {
      std::ifstream in(token_file);
      std::getline(in, token);
      while (!token.empty() && std::isspace(static_cast<unsigned char>(token.back()))) {
        token.pop_back();
      }
      if (token.empty()) {
        return absl::InvalidArgumentError(absl::StrCat("--metrics-token-file ", token_file,
                                                       ": the first line must hold the token"));
      }
    } else if (!IsLoopback(listen)) {
      spdlog::warn(
          "metrics on {} answer anyone who can reach it (client names, module ids); set "
          "--metrics-token-file",
          listen);
    }
    std::unique_ptr<MetricsEndpoint> e(new MetricsEndpoint());
    e->http_.Get("/metrics", [&server, token](const httplib::Request& req, httplib::Response& res) {
      if (!token.empty() &&
          !rpc::Authenticator::TokenMatches(req.get_header_value("Authorization"), token)) {
        res.status = 401;
        res.set_header("WWW-Authenticate", "Bearer");
        res.set_content("a bearer token is required\n", "text/plain");
        return;
      }
      res.set_content(server.metrics_.Render(*server.host_, server.executor_->queued(),
                                             server.service_->Usage()),
                      "text/plain; version=0.0.4");
    });
    const int bound = wanted == 0 ? e->http_.bind_to_any_port(host)
                                  : (e->http_.bind_to_port(host, wanted) ? wanted : -1);
    if (wanted < 0 || bound <= 0) {
      return absl::UnavailableError(
          absl::StrCat("cannot serve metrics on ", listen, " (want HOST:PORT, free port)"));
    }
    e->address_ = host + ":" + std::to_string(bound);
    e->thread_ = std::thread([http = &e->http_] { http->listen_after_bind(); });
    spdlog::info("metrics on http://{}/metrics{}", e->address_,
                 token.empty() ? "" : " (bearer token required)");
    return e;
  }
  ~MetricsEndpoint() { Stop(); }
  void Stop() {
    if (thread_.joinable()) {
      http_.stop();
      thread_.join();
    }
  }
  const std::string& address() const { return address_; }

 private:
  MetricsEndpoint() = default;
  httplib::Server http_;
  std::thread thread_;
  std::string address_;
};

namespace {

// A thread that runs `tick` every `period` until Stop, which waits for a tick in progress (ticks
// run with the thread's lock held).
class Ticker {
 public:
  Ticker() = default;
  ~Ticker() { Stop(); }
  Ticker(const Ticker&) = delete;
  Ticker& operator=(const Ticker&) = delete;
  void Start(std::chrono::milliseconds period, std::function<void()> tick) {
    thread_ = std::thread([this, period, tick = std::move(tick)] {
      std::unique_lock<std::mutex> lock(mu_);
      while (!cv_.wait_for(lock, period, [this] { return stop_; })) tick();
    });
  }
  void Stop() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace

// Housekeeping: evicts contexts past the TTL even when no call arrives to do it, and gives freed
// heap memory back to the OS every --heap-trim-every seconds (core/heap_trim.h); once the server
// has been idle that long, the CPU backend's scratch buffers go too (under load they are what
// the next call reuses, and a trim does not touch them).
class Server::Janitor {
 public:
  // `sweep` runs about once a second besides (shared-memory regions gone idle).
  Janitor(core::ModuleHost& host, double ttl_s, double trim_every_s, std::function<void()> sweep) {
    const bool evict = ttl_s > 0, trim = trim_every_s > 0;
    if (!evict && !trim && !sweep) return;
    auto period = std::chrono::milliseconds(1000);
    if (evict) {
      period = std::min(
          period, std::chrono::milliseconds(std::clamp<int64_t>(int64_t(ttl_s * 250), 10, 1000)));
    }
    if (trim) {
      period = std::min(
          period, std::chrono::milliseconds(std::max<int64_t>(int64_t(trim_every_s * 1000), 10)));
    }
    using Clock = std::chrono::steady_clock;
    const auto trim_every =
        std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(trim_every_s));
    ticker_.Start(period, [&host, evict, trim, trim_every, ttl_s, sweep = std::move(sweep),
                           last_trim = Clock::now(), last_activity = Clock::now(),
                           calls_seen = host.Stats().compute_calls, trimmed_since_activity = false,
                           last_sweep = Clock::now()]() mutable {
      if (sweep && Clock::now() - last_sweep >= std::chrono::seconds(1)) {
        sweep();
        last_sweep = Clock::now();
      }
      if (evict) {
        if (const int64_t n = host.EvictExpiredContexts(); n > 0) {
          spdlog::info("evicted {} contexts unused for {} s (--context-ttl)", n, ttl_s);
        }
      }
      if (!trim) return;
      const auto now = Clock::now();
      if (const int64_t calls = host.Stats().compute_calls; calls != calls_seen) {
        calls_seen = calls;
        last_activity = now;
        trimmed_since_activity = false;
      }
      const bool idle = !trimmed_since_activity && now - last_activity >= trim_every;
      if (idle || now - last_trim >= trim_every) {
        const core::HeapTrimResult r = core::TrimHeap(/*release_scratch=*/idle);
        last_trim = Clock::now();
        trimmed_since_activity = trimmed_since_activity || idle;
        if (r.supported) {
          spdlog::debug("heap trim: RSS {} -> {} KiB in {:.1f} ms", r.rss_before_bytes >> 10,
                        r.rss_after_bytes >> 10, r.seconds * 1e3);
        }
      }
    });
  }
  void Stop() { ticker_.Stop(); }

 private:
  Ticker ticker_;
};

// With a shared checkpoint directory: the hand-overs other servers ask this one for, picked up
// every 50 ms (one directory listing), and this server's heartbeat every Heartbeat::kEveryS, on a
// thread of their own (the janitor's sweep can take long: it reads every held module's claim).
class Server::HandOverWatcher {
 public:
  HandOverWatcher(core::Checkpointer& checkpointer, rpc::GradwireService& service) {
    using Clock = std::chrono::steady_clock;
    const auto every = std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(core::Heartbeat::kEveryS));
    ticker_.Start(std::chrono::milliseconds(50),
                  [&checkpointer, &service, every, beat = Clock::now()]() mutable {
                    try {
                      service.HandOverRequested();
                      if (Clock::now() - beat >= every) {
                        checkpointer.heartbeat().Beat();
                        beat = Clock::now();
                      }
                    } catch (const std::exception& e) {  // the storage's trouble: tried again
                      spdlog::error("hand-over watcher: {}", e.what());
                    }
                  });
  }
  void Stop() { ticker_.Stop(); }

 private:
  Ticker ticker_;
};

absl::StatusOr<std::unique_ptr<Server>> Server::Start(ServerOptions options) {
  if (!options.backend) return absl::InvalidArgumentError("Server::Start: no backend");
  std::unique_ptr<Server> s(new Server());
  s->options_ = std::move(options);
  ServerOptions& o = s->options_;
  const std::string device = o.backend->name(), description = o.backend->Describe();
  s->host_ = std::make_unique<core::ModuleHost>(o.context_limits, nullptr, o.backend);
  if (!o.checkpoint_dir.empty()) {
    s->checkpointer_ = std::make_unique<core::Checkpointer>(o.checkpoint_dir, o.checkpoint_every);
    if (absl::Status prepared = s->checkpointer_->Prepare(o.checkpoint_shared); !prepared.ok()) {
      return prepared;
    }
    s->checkpointer_->handover().SetWait(o.checkpoint_handover_wait_s);
    if (o.checkpoint_shared) {
      // Servers sharing the directory each take a module over on the first call about it (the
      // proxy sends that call where the module's id hashes); restoring all here would take every
      // module from the servers that hold them.
      spdlog::info(
          "checkpoint dir {} shared with other servers: a module with a checkpoint there is taken "
          "over on the first call about it",
          o.checkpoint_dir);
    } else {
      // Serving half a model would be worse than not starting.
      absl::StatusOr<int64_t> restored = s->checkpointer_->RestoreAll(*s->host_);
      if (!restored.ok()) {
        return absl::Status(restored.status().code(), absl::StrCat("cannot restore checkpoints: ",
                                                                   restored.status().message()));
      }
      spdlog::info("restored {} modules from {}", *restored, o.checkpoint_dir);
    }
  }
  // The device is shared between clients by the same weights as context memory: with tokens a
  // client is its tenant, named "tenant NAME" by the service (rpc::Caller::client).
  scheduling::DeviceExecutor::Weights executor_weights;
  for (const auto& [tenant, weight] : o.context_limits.tenant_weights) {
    executor_weights.emplace("tenant " + tenant, weight);
  }
  s->executor_ = std::make_unique<scheduling::DeviceExecutor>(device, std::move(executor_weights));

  rpc::ServiceOptions service = o.service;
  if (core::BlockScaled(service.default_recipe) && device == "cuda") {
    // The CUDA backend refuses the block-scaled recipes at creation (docs/cuda.md).
    spdlog::info(
        "--default-recipe {}: the CUDA backend has no block-scaled GEMM yet; modules "
        "created without a recipe get current",
        core::ScalingModeName(service.default_recipe));
    service.default_recipe = core::ScalingMode::kCurrent;
  }
  spdlog::info("modules created without a recipe get {} (--default-recipe)",
               core::ScalingModeName(service.default_recipe));
  service.device = device;
  service.device_name = description;
  service.checkpointer = s->checkpointer_.get();
  service.authenticator = o.authenticator.get();
  if (service.shared_memory.create) {
    spdlog::info(
        "shared memory for clients on this host: regions the server makes, up to {} "
        "bytes in all, closed after {} s unused (--shared-memory off turns it off)",
        service.shared_memory.max_bytes, service.shared_memory.idle_timeout_s);
  }
  if (service.shared_memory.enabled) {
    spdlog::info("RegisterSharedMemory on: keys starting with \"{}\", up to {} regions a client",
                 service.shared_memory.key_prefix, service.shared_memory.max_regions);
  }
  service.on_rpc_done = [metrics = &s->metrics_,
                         then = std::move(service.on_rpc_done)](const rpc::RpcRecord& r) {
    metrics->ObserveRpc(r);
    if (then) then(r);
  };
  service.on_queue_wait = [metrics = &s->metrics_, then = std::move(service.on_queue_wait)](
                              const char* method, const std::string& client, double seconds) {
    metrics->ObserveQueueWait(method, client, seconds);
    if (then) then(method, client, seconds);
  };
  service.on_batch = [metrics = &s->metrics_, then = std::move(service.on_batch)](
                         const char* method, int64_t requests, int64_t rows) {
    metrics->ObserveBatch(method, requests, rows);
    if (then) then(method, requests, rows);
  };
  if (service.batching.enabled()) {
    spdlog::info(
        "dynamic batching on: forwards, and backwards, of one module in batches of up to {} "
        "rows, waiting up to {} us for company, {} ({})",
        service.batching.max_rows, service.batching.delay.count(),
        service.batching.yield ? "yielding to other clients' waiting work between requests"
                               : "each batch run whole",
        device.rfind("cpu", 0) != 0 ? "one GEMM per request on this backend"
        : device::GetCpuGemm() == device::CpuGemm::kOrdered
            ? "one GEMM per batch"
            : "one GEMM per request: --cpu-gemm ordered makes it one per batch");
  }
  s->metrics_.SetBuildInfo(o.service.version, device);
  s->service_ =
      std::make_unique<rpc::GradwireService>(*s->host_, *s->executor_, std::move(service));
  if (!o.metrics_listen.empty()) {
    auto endpoint = MetricsEndpoint::Start(*s, o.metrics_listen, o.metrics_token_file);
    if (!endpoint.ok()) return endpoint.status();
    s->endpoint_ = *std::move(endpoint);
    s->metrics_address_ = s->endpoint_->address();
  }

  auto credentials = Credentials(o);
  if (!credentials.ok()) return credentials.status();
  // Standard discovery: grpc.health.v1 (probes, `gradwire health`) and server reflection (generic
  // tools can list and call the API).
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // One process per port: without this a second server would silently share the port.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Room for headers up to 64 KiB, so an oversized token reaches the authenticator and gets its
  // UNAUTHENTICATED instead of failing in the transport (docs/security.md).
  builder.AddChannelArgument(GRPC_ARG_MAX_METADATA_SIZE, 64 << 10);
  for (const auto& [name, value] : o.channel_args) builder.AddChannelArgument(name, value);
  builder.AddListeningPort(o.listen, *credentials, &s->port_);
  builder.RegisterService(s->service_.get());
  // Twice the request limit, so a request somewhat over it is read and refused with a message
  // naming --max-request-bytes; the transport drops anything larger unread.
  const int64_t request_limit = o.service.limits.max_request_bytes;
  builder.SetMaxReceiveMessageSize(
      request_limit > 0 ? int(std::min<int64_t>(2 * request_limit, std::numeric_limits<int>::max()))
                        : std::numeric_limits<int>::max());
  builder.SetMaxSendMessageSize(o.max_message_mib << 20);
  s->grpc_ = builder.BuildAndStart();
  if (!s->grpc_ || s->port_ == 0) {
    s->grpc_.reset();
    return absl::UnavailableError(absl::StrCat(
        "cannot listen on ", o.listen, " (address in use, or not an address of this host?)"));
  }
  spdlog::info("gradwire {} on {}: {}", o.service.version, device, description);
  grpc::HealthCheckServiceInterface* health = s->grpc_->GetHealthCheckService();
  health->SetServingStatus(v1::Gradwire::service_full_name(), true);
  health->SetServingStatus(true);  // "" and every service named so far
  s->address_ = BoundAddress(o.listen, s->port_);
  spdlog::info("listening on {}", s->address_);
  if (!o.port_file.empty()) {
    if (absl::Status written = WritePortFile(o.port_file, s->address_); !written.ok()) {
      s->grpc_->Shutdown();
      s->grpc_->Wait();
      s->grpc_.reset();
      return written;
    }
  }
  spdlog::info("context memory {} bytes on the device, {} bytes host offload, TTL {} s",
               o.context_limits.device_bytes, o.context_limits.host_bytes,
               o.context_limits.ttl_seconds);
  // The sweep runs about once a second; the claims are checked every --checkpoint-check-every.
  const auto check_every = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(o.checkpoint_check_every_s));
  s->janitor_ =
      std::make_unique<Janitor>(*s->host_, o.context_limits.ttl_seconds, o.heap_trim_every_s,
                                [service = s->service_.get(), check_every,
                                 checked = std::chrono::steady_clock::now()]() mutable {
                                  service->CloseIdleSharedMemory();
                                  service->ExpireIdleModules();
                                  const auto now = std::chrono::steady_clock::now();
                                  if (check_every.count() > 0 && now - checked >= check_every) {
                                    service->LetGoOfMovedModules();
                                    checked = now;
                                  }
                                });
  if (s->checkpointer_ && s->checkpointer_->shared()) {
    s->handover_ = std::make_unique<HandOverWatcher>(*s->checkpointer_, *s->service_);
  }
  return s;
}

absl::StatusOr<int64_t> Server::Shutdown(std::chrono::system_clock::time_point deadline) {
  if (stopped_) return int64_t(0);
  stopped_ = true;
  if (grpc_) {
    grpc_->GetHealthCheckService()->SetServingStatus(false);  // NOT_SERVING while calls drain
    grpc_->Shutdown(deadline);  // refuses new calls; cancels what still runs at the deadline
    grpc_->Wait();
  }
  if (endpoint_) endpoint_->Stop();  // before the executor goes: the endpoint reads its backlog
  if (handover_) handover_->Stop();  // queues hand-overs on the executor
  executor_.reset();                 // drains tasks the cancelled calls left behind
  if (janitor_) janitor_->Stop();
  if (!options_.port_file.empty()) std::remove(options_.port_file.c_str());
  int64_t saved = 0;
  if (checkpointer_) {
    absl::StatusOr<int64_t> all = checkpointer_->SaveAll(*host_);
    checkpointer_->handover()
        .Leave();  // takers go on at once, from these saves, and ask this server nothing
    if (!all.ok()) {
      return absl::Status(all.status().code(),
                          absl::StrCat("final checkpoint failed: ", all.status().message()));
    }
    saved = *all;
    spdlog::info("checkpointed {} modules to {}", saved, options_.checkpoint_dir);
  }
  const auto stats = host_->Stats();
  spdlog::info("stopped: {} modules, {} live contexts dropped", stats.modules, stats.live_contexts);
  return saved;
}

Server::~Server() {
  if (grpc_ && !stopped_) (void)Shutdown(std::chrono::system_clock::now());
  // A server that failed to start stops what it had started, in reverse order.
  if (endpoint_) endpoint_->Stop();
  if (handover_) handover_->Stop();
  if (janitor_) janitor_->Stop();
}

std::shared_ptr<grpc::Channel> Server::InProcessChannel(const grpc::ChannelArguments& args) const {
  return grpc_->InProcessChannel(args);
}

absl::StatusOr<device::BackendPtr> ResolveDevice(const std::string& requested) {
  if (requested == "cpu") return device::MakeCpuBackend();
  if (requested != "auto" && requested != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("--device ", rpc::Escaped(requested, 64), ": want cpu, cuda or auto"));
  }
  auto cuda = device::MakeCudaBackend(0);
  if (cuda.ok()) return *cuda;
  if (requested == "cuda") {
    return absl::FailedPreconditionError(absl::StrCat("--device cuda: ", cuda.status().message()));
  }
  spdlog::info("--device auto: {}; using the CPU backend", std::string(cuda.status().message()));
  return device::MakeCpuBackend();
}

bool IsLoopback(const std::string& listen) {
  const auto colon = listen.rfind(':');
  std::string host = colon == std::string::npos ? listen : listen.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0 ||
         host.rfind("ipv4:127.", 0) == 0;
}

}  // namespace gradwire::server
