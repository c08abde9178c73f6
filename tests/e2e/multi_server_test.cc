// Two gradwire-server processes on loopback and a model whose two modules live on different
// servers: forwards and backwards route by placement, training works across them.
#include <gtest/gtest.h>

#include "demo.h"
#include "gradwire/client/cluster.h"
#include "server_process.h"

namespace gradwire {
namespace {

using client::Cluster;
using client::HostTensor;

TEST(ClusterTest, ParsesEndpointLists) {
  auto one = Cluster::ParseEndpoints("127.0.0.1:1");
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(*one, std::vector<std::string>{"127.0.0.1:1"});
  auto two = Cluster::ParseEndpoints("a:1, b:2");
  ASSERT_TRUE(two.ok());
  EXPECT_EQ(*two, (std::vector<std::string>{"a:1", "b:2"}));
  for (const char* bad : {"", "a:1,", ",a:1", "a:1,,b:2", "a:1,a:1"}) {
    EXPECT_EQ(Cluster::ParseEndpoints(bad).status().code(), absl::StatusCode::kInvalidArgument)
        << bad;
  }
}

class TwoServersTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(a_.address().empty());
    ASSERT_FALSE(b_.address().empty());
    client::ClientOptions options;
    options.timeout = std::chrono::seconds(20);
    cluster_ = std::make_unique<Cluster>(options, std::vector{a_.address(), b_.address()});
    ASSERT_TRUE(cluster_->WaitForReady(std::chrono::seconds(10)).ok());
  }

  size_t ModulesOn(size_t server) {
    auto list = cluster_->endpoint(server).ListModules();
    EXPECT_TRUE(list.ok()) << list.status();
    return list.ok() ? list->size() : 0;
  }

  testing::ServerProcess a_{::testing::TempDir(), {}};
  testing::ServerProcess b_{::testing::TempDir(), {}};
  std::unique_ptr<Cluster> cluster_;
};

TEST_F(TwoServersTest, TrainsAModelSpreadOverTwoServers) {
  cli::DemoOptions options;
  options.model = "linear";
  options.steps = 150;
  options.placement = {1, 0};  // fc1 on the second server, fc2 on the first
  auto model = cli::MakeRemoteModel(*cluster_, options);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(ModulesOn(0), 1u);
  EXPECT_EQ(ModulesOn(1), 1u);
  EXPECT_EQ((*model)->module_servers(), (std::vector<std::string>{b_.address(), a_.address()}));
  EXPECT_EQ(*cluster_->Locate((*model)->module_ids()[0]), 1u);

  auto result = cli::Train(**model, options, nullptr);
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_LT(result->final_loss, 0.5 * result->initial_loss);
  // Every backward reached its context's server: nothing is left saved anywhere.
  EXPECT_EQ(cluster_->routed_contexts(), 0u);
  for (size_t i = 0; i < 2; ++i) {
    auto info = cluster_->endpoint(i).GetServerInfo();
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->live_contexts(), 0);
    EXPECT_EQ(info->modules(), 1);
  }
  // Both modules took optimizer steps on their own servers.
  for (const std::string& id : (*model)->module_ids()) {
    auto weights = cluster_->GetWeights(id);
    ASSERT_TRUE(weights.ok()) << weights.status();
    EXPECT_EQ(weights->weight_version, uint64_t(options.steps) + 1);
  }
  model->reset();  // deletes the modules on both servers
  EXPECT_EQ(ModulesOn(0), 0u);
  EXPECT_EQ(ModulesOn(1), 0u);
}

TEST_F(TwoServersTest, RoundRobinPlacementAndRouting) {
  v1::ModuleSpec spec;
  spec.set_kind(v1::LINEAR);
  spec.set_in_features(8);
  spec.set_out_features(8);
  std::vector<std::string> ids;
  for (int i = 0; i < 4; ++i) {
    auto info = cluster_->CreateModule(spec);
    ASSERT_TRUE(info.ok()) << info.status();
    ids.push_back(info->module_id());
  }
  EXPECT_EQ(ModulesOn(0), 2u);
  EXPECT_EQ(ModulesOn(1), 2u);
  // A context lives where its module lives; the backward finds it there.
  HostTensor x = HostTensor::Zeros({2, 8});
  for (size_t i = 0; i < x.data.size(); ++i) x.data[i] = 0.25f * float(i % 7) - 0.7f;
  auto fwd = cluster_->Forward(ids[1], x, true);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  EXPECT_EQ(cluster_->endpoint(1).GetServerInfo()->live_contexts(), 1);
  EXPECT_EQ(cluster_->endpoint(0).GetServerInfo()->live_contexts(), 0);
  ASSERT_TRUE(cluster_->Backward(fwd->context_id, x).ok());
  EXPECT_EQ(cluster_->endpoint(1).GetServerInfo()->live_contexts(), 0);
  // A second cluster (another process, say) finds modules by asking the servers.
  client::ClientOptions options;
  Cluster other(options, {a_.address(), b_.address()});
  EXPECT_EQ(*other.Locate(ids[3]), 1u);
  EXPECT_EQ(other.Locate("0123456789abcdef0123456789abcdef").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(other.Backward(fwd->context_id, x).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(cluster_->CreateModule(spec, 2).status().code(), absl::StatusCode::kInvalidArgument);
  for (const std::string& id : ids) EXPECT_TRUE(cluster_->DeleteModule(id).ok());
}

}  // namespace
}  // namespace gradwire
