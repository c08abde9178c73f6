// A real gradwire service on a real TCP loopback port (127.0.0.1:0), for tests.
#pragma once

#include <grpcpp/grpcpp.h>

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
#include "server/core/executor.h"
#include "server/core/module_host.h"
#include "server/rpc/service.h"

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
inline core::BackendPtr TestBackend() {
  const char* env = std::getenv("GRADWIRE_TEST_DEVICE");
  const std::string device = env ? env : "cpu";
  if (device == "cpu" || device.empty()) return core::MakeCpuBackend();
  if (device == "cuda") {
    auto b = core::MakeCudaBackend(0);
    if (b.ok()) return *b;
    std::fprintf(stderr, "GRADWIRE_TEST_DEVICE=cuda: %s\n",
                 std::string(b.status().message()).c_str());
  } else {
    std::fprintf(stderr, "GRADWIRE_TEST_DEVICE=%s: not a device (cpu or cuda)\n", device.c_str());
  }
  std::abort();
}

struct TestServerOptions {
  const rpc::Authenticator* authenticator = nullptr;  // tokens and tenant isolation when set
  int stream_read_ahead = 8;
  rpc::ServiceLimits limits;
  core::ContextLimits context_limits;
  // Adjusts the service's options last (chunk sizes, ...); may be empty.
  std::function<void(rpc::ServiceOptions&)> configure;
};

class TestServer {
 public:
  // With `authenticator`, calls need bearer tokens and tenants are isolated.
  explicit TestServer(const rpc::Authenticator* authenticator = nullptr, int stream_read_ahead = 8)
      : TestServer(Options(authenticator, stream_read_ahead)) {}
  // `configure` adjusts the service's options before it starts.
  explicit TestServer(const std::function<void(rpc::ServiceOptions&)>& configure)
      : TestServer(WithConfigure(configure)) {}
  explicit TestServer(const TestServerOptions& o)
      : host_(o.context_limits, nullptr, TestBackend()) {
    executor_ = std::make_unique<core::DeviceExecutor>(host_.backend().name());
    rpc::ServiceOptions options;
    options.version = "test";
    options.device = host_.backend().name();
    options.device_name = "test " + host_.backend().Describe();
    options.authenticator = o.authenticator;
    options.stream_read_ahead = o.stream_read_ahead;
    options.limits = o.limits;
    if (o.configure) o.configure(options);
    service_ = std::make_unique<rpc::GradwireService>(host_, *executor_, std::move(options));
    grpc::ServerBuilder builder;
    builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    builder.AddChannelArgument(GRPC_ARG_MAX_METADATA_SIZE, 64 << 10);
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(service_.get());
    // As gradwire-server does: twice the request limit, so a request over it is read and refused
    // with a message naming the flag.
    builder.SetMaxReceiveMessageSize(
        o.limits.max_request_bytes > 0 ? int(2 * o.limits.max_request_bytes) : 64 << 20);
    builder.SetMaxSendMessageSize(64 << 20);
    server_ = builder.BuildAndStart();
  }
  ~TestServer() {
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
    server_.reset();
    executor_.reset();
  }
  bool ok() const { return server_ != nullptr && port_ > 0; }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  // A connected client (20 s deadlines), with `token` when given.
  std::unique_ptr<client::Client> Connect(std::string token = {}) const {
    client::ClientOptions options;
    options.token = std::move(token);
    return Connect(std::move(options));
  }
  // A connected client with `options` (server and a 20 s deadline filled in).
  std::unique_ptr<client::Client> Connect(client::ClientOptions options) const {
    options.server = address();
    options.timeout = std::chrono::seconds(20);
    auto c = std::make_unique<client::Client>(options);
    EXPECT_TRUE(c->WaitForReady(std::chrono::seconds(10)).ok());
    return c;
  }
  core::ModuleHost& host() { return host_; }
  core::DeviceExecutor& executor() { return *executor_; }
  rpc::GradwireService& service() { return *service_; }

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

  core::ModuleHost host_;
  std::unique_ptr<core::DeviceExecutor> executor_;
  std::unique_ptr<rpc::GradwireService> service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

}  // namespace gradwire::testing
