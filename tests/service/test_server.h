// The real gradwire server for the service suites: started as gradwire-server starts it, on a
// TCP loopback port (127.0.0.1:0), reachable over TCP or in-process.
#pragma once

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gradwire/client/client.h"
#include "server/core/module_host.h"
#include "server/rpc/scheduling/executor.h"
#include "server/rpc/service.h"
#include "server/server.h"

namespace gradwire::testing {

// A fresh standard-normal host tensor (never zeros). Safe from any thread: tests call it from
// many client threads at once.
inline client::HostTensor Random(std::vector<int64_t> shape) {
  thread_local std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> dist(0.0f, 1.0f);
  client::HostTensor t = client::HostTensor::Zeros(std::move(shape));
  for (float& v : t.data) v = dist(rng);
  return t;
}

// An error's message without the " [request ID]" the server ends it with (rpc/request_id.h):
// what two calls' errors must share when they should read the same.
inline std::string WithoutRequestId(absl::string_view message) {
  std::string m(message);
  const auto at = m.rfind(" [request ");
  if (at != std::string::npos && m.size() == at + 10 + 32 + 1 && m.back() == ']') m.resize(at);
  return m;
}

// Polls `done` until it holds or `ms` pass; returns its last value.
inline bool WaitFor(const std::function<bool()>& done, int ms = 10000) {
  for (int i = 0; i < ms / 5; ++i) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return done();
}

// The backend the service suites run on: GRADWIRE_TEST_DEVICE=cuda runs them on the CUDA
// backend (scripts/device/stage2.sh does on a GPU machine); unset or "cpu", the CPU backend.
// A device asked for that cannot run aborts the suite with the reason, rather than testing the
// CPU instead.
inline device::BackendPtr TestBackend() {
  const char* env = std::getenv("GRADWIRE_TEST_DEVICE");
  const std::string device = env ? env : "cpu";
  if (device == "cpu" || device.empty()) return device::MakeCpuBackend();
  if (device == "cuda") {
    auto b = device::MakeCudaBackend(0);
    if (b.ok()) return *b;
    std::fprintf(stderr, "GRADWIRE_TEST_DEVICE=cuda: %s\n",
                 std::string(b.status().message()).c_str());
  } else {
    std::fprintf(stderr, "GRADWIRE_TEST_DEVICE=%s: not a device (cpu or cuda)\n", device.c_str());
  }
  std::abort();
}

// How the tests' clients reach the server: a TCP loopback port, or gRPC's in-process transport
// (no sockets, no HTTP/2 framing on the network), as gRPC's own end-to-end tests run each case
// over both.
enum class Transport { kTcp, kInProcess };

inline const char* TransportName(Transport t) { return t == Transport::kTcp ? "Tcp" : "InProcess"; }

// For INSTANTIATE_TEST_SUITE_P over both transports: names the cases ".../Tcp" and ".../InProcess".
inline std::string TransportParamName(const ::testing::TestParamInfo<Transport>& info) {
  return TransportName(info.param);
}

struct TestServerOptions {
  const rpc::Authenticator* authenticator = nullptr;  // tokens and tenant isolation when set
  int stream_read_ahead = 8;
  rpc::ServiceLimits limits;
  core::ContextLimits context_limits;
  // Adjusts the service's options last (chunk sizes, ...); may be empty.
  std::function<void(rpc::ServiceOptions&)> configure;
  // What Connect() dials; address() is always the TCP port.
  Transport transport = Transport::kTcp;
  // --checkpoint-dir, --checkpoint-shared, --checkpoint-every; empty dir: no checkpoints.
  std::string checkpoint_dir;
  bool checkpoint_shared = false;
  int64_t checkpoint_every = 1;
  double checkpoint_check_every_s = 1;
  double checkpoint_handover_wait_s = 5;  // generous: sanitizers and a loaded machine
};

// The server gradwire-server runs (server/server.h), started with test options on 127.0.0.1:0:
// the same assembly, not a copy of it.
class TestServer {
 public:
  // With `authenticator`, calls need bearer tokens and tenants are isolated.
  explicit TestServer(const rpc::Authenticator* authenticator = nullptr, int stream_read_ahead = 8)
      : TestServer(Options(authenticator, stream_read_ahead)) {}
  // `configure` adjusts the service's options before it starts.
  explicit TestServer(const std::function<void(rpc::ServiceOptions&)>& configure)
      : TestServer(WithConfigure(configure)) {}
  explicit TestServer(Transport transport) : TestServer(WithTransport(transport)) {}
  explicit TestServer(const TestServerOptions& o) : transport_(o.transport) {
    server::ServerOptions options;
    options.listen = "127.0.0.1:0";
    options.backend = TestBackend();
    options.context_limits = o.context_limits;
    // Borrowed: the test owns the authenticator and outlives the server.
    options.authenticator = std::shared_ptr<const rpc::Authenticator>(
        o.authenticator, [](const rpc::Authenticator*) {});
    options.heap_trim_every_s = 0;
    options.service.version = "test";
    options.service.stream_read_ahead = o.stream_read_ahead;
    options.service.limits = o.limits;
    options.checkpoint_dir = o.checkpoint_dir;
    options.checkpoint_shared = o.checkpoint_shared;
    options.checkpoint_every = o.checkpoint_every;
    options.checkpoint_check_every_s = o.checkpoint_check_every_s;
    options.checkpoint_handover_wait_s = o.checkpoint_handover_wait_s;
    if (o.configure) o.configure(options.service);
    auto started = server::Server::Start(std::move(options));
    EXPECT_TRUE(started.ok()) << started.status();
    if (started.ok()) server_ = *std::move(started);
  }
  ~TestServer() {
    if (server_) {
      (void)server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
    }
  }
  bool ok() const { return server_ != nullptr && server_->port() > 0; }
  std::string address() const { return "127.0.0.1:" + std::to_string(server_->port()); }
  Transport transport() const { return transport_; }
  // A channel of the test's transport, with the client library's message size limits.
  std::shared_ptr<grpc::Channel> Channel(int max_message_mib = 64) const {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(max_message_mib << 20);
    args.SetMaxSendMessageSize(max_message_mib << 20);
    if (transport_ == Transport::kInProcess) return server_->InProcessChannel(args);
    return grpc::CreateCustomChannel(address(), grpc::InsecureChannelCredentials(), args);
  }
  // A connected client (20 s deadlines), with `token` when given.
  std::unique_ptr<client::Client> Connect(std::string token = {}) const {
    client::ClientOptions options;
    options.token = std::move(token);
    return Connect(std::move(options));
  }
  // A connected client with `options` (server and a 20 s deadline filled in) over the test's
  // transport.
  std::unique_ptr<client::Client> Connect(client::ClientOptions options) const {
    options.server = address();
    options.timeout = std::chrono::seconds(20);
    if (transport_ == Transport::kInProcess) {
      // Ready from the start; gRPC cannot watch an in-process channel's state (WaitForReady).
      return std::make_unique<client::Client>(options, Channel(options.max_message_mib));
    }
    auto c = std::make_unique<client::Client>(options);
    EXPECT_TRUE(c->WaitForReady(std::chrono::seconds(10)).ok());
    return c;
  }
  core::ModuleHost& host() { return server_->host(); }
  scheduling::DeviceExecutor& executor() { return server_->executor(); }
  rpc::GradwireService& service() { return server_->service(); }
  server::Server& server() { return *server_; }

 private:
  static TestServerOptions Options(const rpc::Authenticator* authenticator, int stream_read_ahead) {
    TestServerOptions o;
    o.authenticator = authenticator;
    o.stream_read_ahead = stream_read_ahead;
    return o;
  }
  static TestServerOptions WithConfigure(std::function<void(rpc::ServiceOptions&)> configure) {
    TestServerOptions o;
    o.configure = std::move(configure);
    return o;
  }
  static TestServerOptions WithTransport(Transport transport) {
    TestServerOptions o;
    o.transport = transport;
    return o;
  }

  Transport transport_;
  std::unique_ptr<server::Server> server_;
};

}  // namespace gradwire::testing
