// gradwire-server assembled in one place: the module host on its backend, checkpoints, the device
// executor, the gRPC service with health and reflection, Prometheus metrics and their HTTP
// endpoint, and the housekeeping thread. `gradwire-server` (main.cc) and the in-process test
// servers start it the same way; only the options differ.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/core/checkpoints/checkpoint.h"
#include "server/core/contexts/context_store.h"
#include "server/core/module_host.h"
#include "server/device/backend.h"
#include "server/metrics.h"
#include "server/rpc/auth.h"
#include "server/rpc/scheduling/executor.h"
#include "server/rpc/service.h"

namespace gradwire::server {

// What a server is started with. Every field has the default gradwire-server's flags have.
struct ServerOptions {
  // host:port to serve on; port 0 picks a free one (Server::address() says which).
  std::string listen = "127.0.0.1:50051";
  // The device the modules compute on (ResolveDevice); required.
  device::BackendPtr backend;
  // Saved-context budgets: device bytes, host offload bytes, TTL, per-client bytes.
  core::ContextLimits context_limits;
  // The service: limits, quotas, chunk sizes, shared memory, test seams and the per-RPC hook.
  // Start fills in device and device_name from the backend, checkpointer and authenticator from
  // the fields below, and chains on_rpc_done after the server's own metrics.
  rpc::ServiceOptions service;
  // Bearer tokens and their tenants; null: no authentication, no isolation.
  std::shared_ptr<const rpc::Authenticator> authenticator;
  // TLS: PEM files of the certificate chain and its key (both, or neither: plaintext), and of the
  // CA bundle clients' certificates must be signed by (mutual TLS; empty: none asked for).
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_client_ca_file;
  // Largest response message, MiB. Requests may be up to twice service.limits.max_request_bytes
  // (so a request somewhat over the limit is read and refused naming the flag).
  int max_message_mib = 64;
  // Module checkpoints: restored at start, written on create, upload, every `checkpoint_every`
  // optimizer steps and at shutdown; empty: modules live only in memory.
  std::string checkpoint_dir;
  int64_t checkpoint_every = 100;
  // Other servers share checkpoint_dir (behind a proxy): modules are taken over on the first call
  // about them instead of all restored at start, and a module another server took over is let go
  // of (docs/scaling-out.md).
  bool checkpoint_shared = false;
  // With checkpoint_shared: seconds between checks that this server still holds each of its
  // modules (a module another server took over is let go of then, or at its next step, upload or
  // save); 0: only then.
  double checkpoint_check_every_s = 1;
  // With checkpoint_shared: seconds a server taking a module over waits for its live holder to
  // pick up a hand-over request (HandOver::SetWait); 0: never asks.
  double checkpoint_handover_wait_s = 2;
  // Prometheus endpoint, HOST:PORT (a bare PORT binds 127.0.0.1; port 0 picks one); empty: off.
  std::string metrics_listen;
  // A file whose first line is the bearer token the metrics endpoint requires; empty: none.
  std::string metrics_token_file;
  // Seconds between returns of freed heap memory to the OS (core/heap_trim.h); 0: never.
  double heap_trim_every_s = 1;
  // Written with the bound host:port once serving (atomically), removed at shutdown; empty: none.
  std::string port_file;
  // Further gRPC server arguments (GRPC_ARG_* name and integer value), after the server's own:
  // transport experiments in benchmarks.
  std::vector<std::pair<std::string, int>> channel_args;
};

// A running server. Start serves at once; Shutdown (or the destructor) drains and stops it.
class Server {
 public:
  // Builds everything and starts serving. An error names what failed (checkpoint directory or a
  // damaged checkpoint, metrics address or token file, listening address, port file); nothing is
  // left running then.
  static absl::StatusOr<std::unique_ptr<Server>> Start(ServerOptions options);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Stops serving: health turns NOT_SERVING, new calls are refused, calls in flight get until
  // `deadline` (then they are cancelled), queued work drains, the port file is removed and every
  // module is checkpointed when checkpoints are on. Returns how many modules the final checkpoint
  // wrote (0 without checkpoints), or why it failed. Only the first call does anything.
  absl::StatusOr<int64_t> Shutdown(std::chrono::system_clock::time_point deadline);

  // The bound port and host:port (the listen address with port 0 replaced).
  int port() const { return port_; }
  const std::string& address() const { return address_; }
  // The metrics endpoint's host:port, empty when off.
  const std::string& metrics_address() const { return metrics_address_; }
  // A channel into this server that skips the network (gRPC's in-process transport).
  std::shared_ptr<grpc::Channel> InProcessChannel(const grpc::ChannelArguments& args) const;

  core::ModuleHost& host() { return *host_; }
  scheduling::DeviceExecutor& executor() { return *executor_; }
  rpc::GradwireService& service() { return *service_; }
  // Null without --checkpoint-dir.
  core::Checkpointer* checkpointer() { return checkpointer_.get(); }
  const Metrics& metrics() const { return metrics_; }

 private:
  class MetricsEndpoint;  // server.cc
  class Janitor;          // server.cc
  class HandOverWatcher;  // server.cc
  Server() = default;

  ServerOptions options_;
  std::unique_ptr<core::ModuleHost> host_;
  std::unique_ptr<core::Checkpointer> checkpointer_;
  std::unique_ptr<scheduling::DeviceExecutor> executor_;
  Metrics metrics_;
  std::unique_ptr<rpc::GradwireService> service_;
  std::unique_ptr<MetricsEndpoint> endpoint_;
  std::unique_ptr<grpc::Server> grpc_;
  std::unique_ptr<Janitor> janitor_;
  std::unique_ptr<HandOverWatcher> handover_;
  int port_ = 0;
  std::string address_;
  std::string metrics_address_;
  bool stopped_ = false;
};

// Resolves a --device value (cpu, cuda, auto) into a backend. auto: the CUDA backend when it can
// run here (else the CPU, logging why); cuda: FAILED_PRECONDITION saying why it cannot run.
absl::StatusOr<device::BackendPtr> ResolveDevice(const std::string& requested);

// Whether host:port names this machine's loopback interface only.
bool IsLoopback(const std::string& listen);

}  // namespace gradwire::server
