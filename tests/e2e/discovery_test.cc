// Discovery and observability with the real gradwire-server binary: grpc.health.v1, server
// reflection and the Prometheus metrics endpoint.
#include <google/protobuf/descriptor.pb.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <httplib.h>

#include <chrono>
#include <cstdlib>
#include <map>
#include <regex>
#include <sstream>
#include <thread>

#include "gradwire/client/client.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "server_process.h"

namespace gradwire {
namespace {

namespace refl = ::grpc::reflection::v1alpha;
using testing::ServerProcess;

class DiscoveryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/gradwire-discovery-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
    server_ = std::make_unique<ServerProcess>(dir_, std::vector<std::string>{});
    channel_ = grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials());
  }
  void TearDown() override {
    server_.reset();
    EXPECT_EQ(std::system(("rm -rf " + dir_).c_str()), 0);
  }

  // One request on the reflection stream.
  refl::ServerReflectionResponse Ask(const refl::ServerReflectionRequest& req) {
    auto stub = refl::ServerReflection::NewStub(channel_);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    auto stream = stub->ServerReflectionInfo(&ctx);
    EXPECT_TRUE(stream->Write(req));
    stream->WritesDone();
    refl::ServerReflectionResponse resp;
    EXPECT_TRUE(stream->Read(&resp));
    EXPECT_TRUE(stream->Finish().ok());
    return resp;
  }

  std::string dir_;
  std::unique_ptr<ServerProcess> server_;
  std::shared_ptr<grpc::Channel> channel_;
};

TEST_F(DiscoveryTest, ReflectionListsAndDescribesTheServices) {
  refl::ServerReflectionRequest list;
  list.set_list_services("*");
  const refl::ServerReflectionResponse services = Ask(list);
  std::vector<std::string> names;
  for (const auto& s : services.list_services_response().service()) names.push_back(s.name());
  EXPECT_NE(std::find(names.begin(), names.end(), "gradwire.v1.Gradwire"), names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "grpc.health.v1.Health"), names.end());

  refl::ServerReflectionRequest symbol;
  symbol.set_file_containing_symbol("gradwire.v1.Gradwire");
  const refl::ServerReflectionResponse file = Ask(symbol);
  ASSERT_GE(file.file_descriptor_response().file_descriptor_proto_size(), 1);
  google::protobuf::FileDescriptorProto proto;
  ASSERT_TRUE(proto.ParseFromString(file.file_descriptor_response().file_descriptor_proto(0)));
  EXPECT_EQ(proto.name(), "gradwire/v1/service.proto");
  ASSERT_EQ(proto.service_size(), 1);
  bool has_forward = false;
  for (const auto& m : proto.service(0).method()) has_forward |= m.name() == "Forward";
  EXPECT_TRUE(has_forward);
}

TEST_F(DiscoveryTest, HealthIsServingForTheServerAndTheGradwireService) {
  client::ClientOptions options;
  options.server = server_->address();
  client::Client client(options);
  EXPECT_EQ(client.CheckHealth("").value_or("error"), "SERVING");
  EXPECT_EQ(client.CheckHealth("gradwire.v1.Gradwire").value_or("error"), "SERVING");
  EXPECT_EQ(client.CheckHealth("no.such.Service").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace gradwire

namespace gradwire {
namespace {

// name{labels} value, as the Prometheus text format writes a sample (prometheus-cpp writes NaN
// as "Nan"; Prometheus reads either).
const std::regex kSample(
    R"(^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (-?[0-9.]+(e[-+]?[0-9]+)?|NaN|Nan|[+-]Inf)$)");

TEST(MetricsTest, PrometheusEndpointCountsCallsAndShowsState) {
  char dir[] = "/tmp/gradwire-metrics-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  ServerProcess server(dir, {"--metrics-listen", "127.0.0.1:0"});
  const std::string log = server.Log();
  std::smatch m;
  ASSERT_TRUE(std::regex_search(log, m, std::regex(R"(metrics on http://([0-9.]+):([0-9]+)/)")))
      << log;
  const std::string host = m[1];
  const int port = std::stoi(m[2]);

  client::ClientOptions options;
  options.server = server.address();
  client::Client client(options);
  v1::ModuleSpec spec;
  spec.set_kind(v1::LINEAR);
  spec.set_in_features(8);
  spec.set_out_features(4);
  spec.set_name("probe");
  spec.mutable_recipe()->set_scaling(v1::DELAYED);
  auto info = client.CreateModule(spec);
  ASSERT_TRUE(info.ok());
  client::HostTensor x = client::HostTensor::Zeros({3, 8});
  for (size_t i = 0; i < x.data.size(); ++i) x.data[i] = 0.25f * float(i % 7) - 0.6f;
  for (int i = 0; i < 2; ++i) {
    auto f = client.Forward(info->module_id(), x, true);
    ASSERT_TRUE(f.ok());
    ASSERT_TRUE(client.Backward(f->context_id, client::HostTensor::Zeros({3, 4})).ok());
  }
  EXPECT_FALSE(client.Forward(std::string(32, 'a'), x, false).ok());  // unknown: NOT_FOUND

  httplib::Client http(host, port);
  std::map<std::string, std::string> samples;
  // A call is reported last in its lifecycle, after its status went out (gRPC's OnDone): the
  // client may see the answer a moment before the server has counted it. Scrape until the last
  // call (the NOT_FOUND forward) shows, for up to 10 s.
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  do {
    auto res = http.Get("/metrics");
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 200);
    samples.clear();
    std::istringstream lines(res->body);
    std::string line;
    while (std::getline(lines, line)) {
      if (line.empty() || line[0] == '#') continue;
      std::smatch s;
      ASSERT_TRUE(std::regex_match(line, s, kSample)) << "not a sample: " << line;
      samples[std::string(s[1]) + std::string(s[2])] = s[3];
    }
    if (samples.count("gradwire_rpc_total{code=\"NOT_FOUND\",method=\"Forward\"}")) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  } while (std::chrono::steady_clock::now() < give_up);
  // prometheus-cpp writes a counter's labels in name order.
  EXPECT_EQ(samples["gradwire_rpc_total{code=\"OK\",method=\"Forward\"}"], "2");
  EXPECT_EQ(samples["gradwire_rpc_total{code=\"NOT_FOUND\",method=\"Forward\"}"], "1");
  EXPECT_EQ(samples["gradwire_rpc_total{code=\"OK\",method=\"Backward\"}"], "2");
  EXPECT_EQ(samples["gradwire_rpc_duration_seconds_count{method=\"Forward\"}"], "3");
  EXPECT_EQ(samples["gradwire_rpc_duration_seconds_bucket{method=\"Forward\",le=\"+Inf\"}"], "3");
  EXPECT_EQ(samples["gradwire_live_contexts"], "0");
  EXPECT_EQ(samples["gradwire_workspace_builds_total"], "1");
  EXPECT_EQ(samples["gradwire_workspace_hits_total"], "1");
  EXPECT_EQ(samples["gradwire_module_weight_version{module=\"" + info->module_id() +
                    "\",name=\"probe\"}"],
            "1");
  // Delayed scaling: after two steps the input scale is 448 / amax(x) = 448 / 0.9.
  const std::string role = "{module=\"" + info->module_id() + "\",name=\"probe\",role=\"input\"}";
  EXPECT_NEAR(std::stod(samples["gradwire_fp8_scale" + role]), 448.0 / 0.9, 1e-3);
  EXPECT_NEAR(std::stod(samples["gradwire_fp8_amax" + role]), 0.9, 1e-6);
  EXPECT_GT(std::stod(samples["gradwire_gemm_flops_total"]), 0.0);
  EXPECT_EQ(server.Signal(SIGKILL), 128 + SIGKILL);
  EXPECT_EQ(std::system((std::string("rm -rf ") + dir).c_str()), 0);
}

}  // namespace
}  // namespace gradwire
