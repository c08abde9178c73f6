// Request ids (server/rpc/request_id.h) and the metrics they travel with: the W3C traceparent
// parser on valid and invalid values, and the real server over both transports: a call's
// trace-id is its request id in the report (logs, metrics) and at the end of its error, with and
// without a client-chosen trace-id; the queue wait and the per-client latency are observed.
#include "server/rpc/request_id.h"

#include <gtest/gtest.h>

#include <mutex>
#include <optional>
#include <regex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "server/metrics.h"
#include "test_server.h"

namespace gradwire {
namespace {

using rpc::ParseTraceparent;
using testing::Random;
using testing::TestServer;
using testing::TestServerOptions;
using testing::Transport;

constexpr char kTrace[] = "4bf92f3577b34da6a3ce929d0e0e4736";

TEST(TraceparentTest, ParsesVersion00AndLaterVersions) {
  auto r = ParseTraceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->id, kTrace);
  EXPECT_EQ(r->parent_id, "00f067aa0ba902b7");
  // Unsampled is as good; a later version may carry more fields after its flags.
  EXPECT_TRUE(ParseTraceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"));
  EXPECT_TRUE(ParseTraceparent("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-xyz"));
}

TEST(TraceparentTest, RefusesWhatW3CCallsInvalid) {
  for (const char* bad : {
           "",
           "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",       // no flags
           "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01",    // upper case
           "00-00000000000000000000000000000000-00f067aa0ba902b7-01",    // zero trace-id
           "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",    // zero parent id
           "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",    // version ff
           "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",  // 00 with more
           "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",   // no '-' before more
           "00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01",    // separators
           "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",    // not hex
       }) {
    EXPECT_FALSE(ParseTraceparent(bad).has_value()) << bad;
  }
}

TEST(TraceparentTest, ErrorsEndWithTheRequestIdAndOkStaysOk) {
  const rpc::RequestId r{kTrace, "00f067aa0ba902b7"};
  const absl::Status s = rpc::WithRequestId(absl::NotFoundError("module x"), r);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s.message(), std::string("module x [request ") + kTrace + "]");
  EXPECT_TRUE(rpc::WithRequestId(absl::OkStatus(), r).ok());
  EXPECT_EQ(testing::WithoutRequestId(s.message()), "module x");
}

class RequestIdTest : public ::testing::TestWithParam<Transport> {
 protected:
  void SetUp() override {
    TestServerOptions o;
    o.transport = GetParam();
    o.configure = [this](rpc::ServiceOptions& s) {
      s.on_rpc_done = [this](const rpc::RpcRecord& r) {
        std::lock_guard<std::mutex> lock(mu_);
        records_.push_back(r);
      };
      s.on_queue_wait = [this](const char* method, const std::string&, double seconds) {
        std::lock_guard<std::mutex> lock(mu_);
        waits_.emplace_back(method, seconds);
      };
    };
    server_ = std::make_unique<TestServer>(o);
    ASSERT_TRUE(server_->ok());
  }
  // The report of the call with `method` and request id `id`, waiting for it (a call is
  // reported once gRPC is done with it, a moment after the client has its answer).
  std::optional<rpc::RpcRecord> Record(const std::string& method, const std::string& id) {
    std::optional<rpc::RpcRecord> found;
    testing::WaitFor([&] {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& r : records_) {
        if (r.method == method && r.request.id == id) found = r;
      }
      return found.has_value();
    });
    return found;
  }

  std::unique_ptr<TestServer> server_;
  std::mutex mu_;
  std::vector<rpc::RpcRecord> records_;
  std::vector<std::pair<std::string, double>> waits_;
};

TEST_P(RequestIdTest, TheClientsTraceIdIsTheRequestIdOfTheReportAndTheError) {
  client::ClientOptions options;
  options.trace_id = kTrace;
  auto c = server_->Connect(options);
  auto failed = c->DeleteModule("0123456789abcdef0123456789abcdef");
  EXPECT_EQ(failed.code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::EndsWith(failed.message(), std::string(" [request ") + kTrace + "]")) << failed;
  auto r = Record("DeleteModule", kTrace);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->code, absl::StatusCode::kNotFound);
  EXPECT_EQ(r->request.parent_id.size(), 16u);
  // The report's message is the error without the suffix: logs carry the id in a field of its
  // own.
  EXPECT_EQ(r->message.find("[request"), std::string::npos) << r->message;
  EXPECT_EQ(r->client.rfind("peer ", 0), 0u) << r->client;  // no tokens: the peer's host
}

TEST_P(RequestIdTest, EachCallHasAFreshIdAndEveryComputeCallWaitsInTheQueue) {
  auto c = server_->Connect();
  grpc::ClientContext ctx;
  const std::string traceparent = c->PrepareContext(&ctx, "GetServerInfo");
  std::smatch m;
  ASSERT_TRUE(std::regex_match(traceparent, m, std::regex("00-([0-9a-f]{32})-([0-9a-f]{16})-01")))
      << traceparent;
  v1::GetServerInfoResponse resp;
  ASSERT_TRUE(c->stub().GetServerInfo(&ctx, {}, &resp).ok());
  auto info = Record("GetServerInfo", m[1]);
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->request.parent_id, m[2]);

  v1::ModuleSpec spec;
  spec.set_kind(v1::LINEAR);
  spec.set_in_features(16);
  spec.set_out_features(8);
  auto module = c->CreateModule(spec);
  ASSERT_TRUE(module.ok()) << module.status();
  auto f = c->Forward(module->module_id(), Random({4, 16}), true);
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_TRUE(c->Backward(f->context_id, Random({4, 8})).ok());
  ASSERT_TRUE(testing::WaitFor([&] {
    std::lock_guard<std::mutex> lock(mu_);
    return records_.size() >= 4;
  }));
  std::lock_guard<std::mutex> lock(mu_);
  std::set<std::string> ids, waited;
  for (const auto& r : records_) ids.insert(r.request.id);
  EXPECT_EQ(ids.size(), records_.size()) << "request ids repeat";
  for (const auto& [method, seconds] : waits_) {
    EXPECT_GE(seconds, 0.0) << method;
    waited.insert(method);
  }
  EXPECT_TRUE(waited.count("Forward") && waited.count("Backward") && waited.count("CreateModule"))
      << ::testing::PrintToString(waited);
}

INSTANTIATE_TEST_SUITE_P(Transports, RequestIdTest,
                         ::testing::Values(Transport::kTcp, Transport::kInProcess),
                         testing::TransportParamName);

TEST(MetricsTest, ClientLatencyQueueWaitAndBuildInfoAreOnThePage) {
  TestServer server;
  ASSERT_TRUE(server.ok());
  server::Metrics metrics;
  rpc::RpcRecord r;
  r.method = "Forward";
  r.code = absl::StatusCode::kOk;
  r.seconds = 0.003;
  r.client = "tenant alice";
  metrics.ObserveRpc(r);
  r.client.clear();  // failed authentication: no client
  r.code = absl::StatusCode::kUnauthenticated;
  metrics.ObserveRpc(r);
  metrics.ObserveQueueWait("Forward", "tenant alice", 0.00002);
  metrics.ObserveQueueWait("Forward", "", 0.00002);  // no client: by method only
  metrics.SetBuildInfo("1.2.3", "cpu");
  const std::string text = metrics.Render(server.host(), server.executor().queued());
  for (const std::string& line : std::vector<std::string>{
           "gradwire_rpc_total{code=\"OK\",method=\"Forward\"} 1",
           "gradwire_rpc_total{code=\"UNAUTHENTICATED\",method=\"Forward\"} 1",
           "gradwire_rpc_duration_seconds_count{method=\"Forward\"} 2",
           "gradwire_rpc_duration_seconds_bucket{method=\"Forward\",le=\"0.0025\"} 0",
           "gradwire_rpc_duration_seconds_bucket{method=\"Forward\",le=\"0.005\"} 2",
           "gradwire_client_rpc_duration_seconds_count{client=\"tenant alice\",method=\"Forward\"} "
           "1",
           "gradwire_queue_wait_seconds_bucket{method=\"Forward\",le=\"5e-05\"} 2",
           "gradwire_client_queue_wait_seconds_count{client=\"tenant alice\"} 1",
           "gradwire_build_info{device=\"cpu\",version=\"1.2.3\"} 1"}) {
    EXPECT_NE(text.find(line + "\n"), std::string::npos) << line << "\n" << text;
  }
  // The client histogram has the authenticated call only.
  EXPECT_EQ(text.find("gradwire_client_rpc_duration_seconds_count{client=\"\""), std::string::npos);
  std::smatch start;
  ASSERT_TRUE(
      std::regex_search(text, start, std::regex("\ngradwire_start_time_seconds ([0-9.e+]+)\n")));
  EXPECT_GT(std::stod(start[1]), 1.7e9);  // a Unix time of this century
}

}  // namespace
}  // namespace gradwire
