// Durability with the real gradwire-server binary: a SIGKILL after a checkpoint loses nothing
// that was checkpointed; a graceful stop saves everything; a deleted module stays deleted.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>

#include "gradwire/client/client.h"
#include "server_process.h"

namespace gradwire {
namespace {

using client::HostTensor;
using testing::ServerProcess;

HostTensor Random(std::vector<int64_t> shape, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  HostTensor t = HostTensor::Zeros(std::move(shape));
  for (float& v : t.data) v = dist(rng);
  return t;
}

void ExpectSameWeights(const client::NamedTensors& a, const client::NamedTensors& b) {
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    EXPECT_EQ(a.tensors[i].first, b.tensors[i].first);
    EXPECT_EQ(a.tensors[i].second.shape, b.tensors[i].second.shape);
    EXPECT_EQ(a.tensors[i].second.data, b.tensors[i].second.data) << a.tensors[i].first;
  }
}

TEST(CheckpointTest, SigkillLosesNothingCheckpointedAndShutdownSavesAll) {
  char base[] = "/tmp/gradwire-ckpt-XXXXXX";
  ASSERT_NE(mkdtemp(base), nullptr);
  const std::string dir = std::string(base) + "/checkpoints";
  std::mt19937 rng(std::random_device{}());
  std::string id;
  client::NamedTensors checkpointed;
  {
    ServerProcess server(base, {"--checkpoint-dir", dir, "--checkpoint-every", "2"});
    client::ClientOptions options;
    options.server = server.address();
    client::Client client(options);
    v1::ModuleSpec spec;
    spec.set_kind(v1::LAYERNORM_MLP);
    spec.set_in_features(8);
    spec.set_ffn_features(12);
    spec.set_out_features(8);
    spec.set_bias(true);
    spec.set_activation(v1::SWIGLU);
    spec.mutable_recipe()->set_scaling(v1::DELAYED);
    spec.mutable_optimizer()->mutable_sgd()->set_learning_rate(0.1f);
    spec.mutable_optimizer()->mutable_sgd()->set_momentum(0.9f);
    auto info = client.CreateModule(spec);
    ASSERT_TRUE(info.ok()) << info.status();
    id = info->module_id();
    auto step = [&] {
      auto f = client.Forward(id, Random({4, 8}, rng), true);
      ASSERT_TRUE(f.ok()) << f.status();
      ASSERT_TRUE(client.Backward(f->context_id, Random({4, 8}, rng)).ok());
      ASSERT_TRUE(client.ApplyGradients(id).ok());
    };
    for (int i = 0; i < 4; ++i) step();  // checkpoints after steps 2 and 4
    auto w = client.GetWeights(id);
    ASSERT_TRUE(w.ok());
    checkpointed = *w;
    EXPECT_EQ(checkpointed.weight_version, 5u);
    step();  // step 5: not checkpointed, lost with the SIGKILL
    EXPECT_EQ(server.Signal(SIGKILL), 128 + SIGKILL);
  }
  {
    ServerProcess server(base, {"--checkpoint-dir", dir, "--checkpoint-every", "2"});
    EXPECT_NE(server.Log().find("restored 1 modules"), std::string::npos) << server.Log();
    client::ClientOptions options;
    options.server = server.address();
    client::Client client(options);
    auto w = client.GetWeights(id);
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_EQ(w->weight_version, 5u);
    ExpectSameWeights(*w, checkpointed);
    auto modules = client.ListModules();
    ASSERT_EQ(modules->size(), 1u);
    EXPECT_EQ((*modules)[0].optimizer_steps(), 4);
    EXPECT_EQ((*modules)[0].spec().activation(), v1::SWIGLU);
    EXPECT_EQ((*modules)[0].spec().recipe().scaling(), v1::DELAYED);
    // It trains on; a graceful stop saves the step that no periodic checkpoint covered.
    auto f = client.Forward(id, Random({4, 8}, rng), true);
    ASSERT_TRUE(f.ok()) << f.status();
    ASSERT_TRUE(client.Backward(f->context_id, Random({4, 8}, rng)).ok());
    ASSERT_TRUE(client.ApplyGradients(id).ok());
    checkpointed = *client.GetWeights(id);
    EXPECT_EQ(checkpointed.weight_version, 6u);
    EXPECT_EQ(server.Signal(SIGTERM), 0) << server.Log();
  }
  {
    ServerProcess server(base, {"--checkpoint-dir", dir, "--checkpoint-every", "2"});
    client::ClientOptions options;
    options.server = server.address();
    client::Client client(options);
    auto w = client.GetWeights(id);
    ASSERT_TRUE(w.ok()) << w.status();
    ExpectSameWeights(*w, checkpointed);
    EXPECT_EQ(w->weight_version, 6u);
    ASSERT_TRUE(client.DeleteModule(id).ok());
    EXPECT_EQ(server.Signal(SIGTERM), 0);
  }
  {
    ServerProcess server(base, {"--checkpoint-dir", dir, "--checkpoint-every", "2"});
    EXPECT_NE(server.Log().find("restored 0 modules"), std::string::npos) << server.Log();
    EXPECT_EQ(server.Signal(SIGTERM), 0);
  }
  std::printf("logs in %s\n", base);
  if (::testing::Test::HasFailure()) return;  // keep the logs
  if (std::getenv("KEEP")) return;
  std::string cleanup = "rm -rf " + std::string(base);
  EXPECT_EQ(std::system(cleanup.c_str()), 0);
}

}  // namespace
}  // namespace gradwire
