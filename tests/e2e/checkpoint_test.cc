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
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
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

// Servers sharing a checkpoint directory (--checkpoint-shared): a module is taken over on the
// first call about it, with the weights and version of its newest checkpoint; the server that
// lost it can no longer save it (not at a step, not at its shutdown) and lets it go with its
// contexts; a server without the flag cannot start on the directory while they run.
TEST(CheckpointTest, SharedDirectoryTakesModulesOverAndFencesTheServerThatLostThem) {
  char base[] = "/tmp/gradwire-shared-ckpt-XXXXXX";
  ASSERT_NE(mkdtemp(base), nullptr);
  const std::string dir = std::string(base) + "/checkpoints";
  // Takers do not ask the holder to hand over (--checkpoint-handover-wait 0): this test is about
  // fencing a holder; takeover_test and the proxy test's return phase check the hand-over.
  const std::vector<std::string> flags = {
      "--checkpoint-dir",           dir, "--checkpoint-shared", "--checkpoint-every", "1",
      "--checkpoint-handover-wait", "0"};
  std::mt19937 rng(std::random_device{}());
  auto connect = [](const ServerProcess& server) {
    client::ClientOptions options;
    options.server = server.address();
    return std::make_unique<client::Client>(options);
  };
  // A checks its claims only at steps, uploads and saves (so that it still has the module in
  // memory when B took it over, however slow this machine is).
  std::vector<std::string> a_flags = flags;
  a_flags.insert(a_flags.end(), {"--checkpoint-check-every", "0"});
  ServerProcess a(base, a_flags), b(base, flags);
  auto on_a = connect(a), on_b = connect(b);
  v1::ModuleSpec spec;
  spec.set_kind(v1::LAYERNORM_MLP);
  spec.set_in_features(8);
  spec.set_ffn_features(12);
  spec.set_out_features(8);
  spec.mutable_recipe()->set_scaling(v1::DELAYED);
  spec.mutable_optimizer()->mutable_sgd()->set_learning_rate(0.1f);
  auto info = on_a->CreateModule(spec);
  ASSERT_TRUE(info.ok()) << info.status();
  const std::string id = info->module_id();
  auto step = [&](client::Client& c) {
    auto f = c.Forward(id, Random({4, 8}, rng), true);
    ASSERT_TRUE(f.ok()) << f.status();
    ASSERT_TRUE(c.Backward(f->context_id, Random({4, 8}, rng)).ok());
    ASSERT_TRUE(c.ApplyGradients(id).ok());
  };
  for (int i = 0; i < 3; ++i) step(*on_a);
  auto pending = on_a->Forward(id, Random({4, 8}, rng), true);  // a context on A
  ASSERT_TRUE(pending.ok()) << pending.status();
  const client::NamedTensors on_a_weights = *on_a->GetWeights(id);
  EXPECT_EQ(on_a_weights.weight_version, 4u);

  // Nothing of it is on B until a call names it; the first takes it over, weights and version.
  EXPECT_TRUE(on_b->ListModules()->empty());
  auto taken = on_b->GetWeights(id);
  ASSERT_TRUE(taken.ok()) << taken.status() << b.Log();
  ExpectSameWeights(*taken, on_a_weights);
  EXPECT_EQ(taken->weight_version, 4u);
  EXPECT_NE(b.Log().find("took over module " + id), std::string::npos) << b.Log();
  // A's context does not move with its module: B says why, to a backward routed by its module
  // (every client routes a backward by its context's module; this client did not make it).
  {
    v1::BackwardRequest req;
    req.set_context_id(pending->context_id);
    v1::Tensor* g = req.mutable_grad_output();
    g->set_dtype(v1::F32);
    g->add_shape(4);
    g->add_shape(8);
    const client::HostTensor grad = Random({4, 8}, rng);
    g->set_data(std::string(reinterpret_cast<const char*>(grad.data.data()),
                            grad.data.size() * sizeof(float)));
    v1::BackwardResponse resp;
    grpc::ClientContext ctx;
    on_b->PrepareContext(&ctx, "Backward", id);
    const grpc::Status lost_here = on_b->stub().Backward(&ctx, req, &resp);
    EXPECT_EQ(lost_here.error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_NE(lost_here.error_message().find("came to this server process from its checkpoint"),
              std::string::npos)
        << lost_here.error_message();
  }

  // A lost it: a step there is refused before it changes anything, and A lets the module go.
  auto refused = on_a->ApplyGradients(id);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_NE(refused.status().message().find("moved to another server"), std::string::npos)
      << refused.status();
  auto lost_there = on_a->Backward(pending->context_id, Random({4, 8}, rng));
  EXPECT_EQ(lost_there.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(lost_there.status().message().find("its module moved to another server"),
            std::string::npos)
      << lost_there.status();

  // B trains on; A's graceful stop saves nothing of it (no rollback).
  for (int i = 0; i < 2; ++i) step(*on_b);
  const client::NamedTensors on_b_weights = *on_b->GetWeights(id);
  EXPECT_EQ(on_b_weights.weight_version, 6u);
  on_a.reset();
  EXPECT_EQ(a.Signal(SIGTERM), 0) << a.Log();

  // A module id taken in the directory cannot be created on another server.
  {
    ServerProcess c(base, flags);
    auto on_c = connect(c);
    v1::CreateModuleRequest req;
    *req.mutable_spec() = spec;
    req.set_module_id(id);
    v1::CreateModuleResponse resp;
    grpc::ClientContext ctx;
    on_c->PrepareContext(&ctx, "CreateModule");
    const grpc::Status created = on_c->stub().CreateModule(&ctx, req, &resp);
    EXPECT_EQ(created.error_code(), grpc::StatusCode::ALREADY_EXISTS) << created.error_message();
    EXPECT_TRUE(on_c->ListModules()->empty());
    // A third server takes it over from B's newest checkpoint, not A's.
    auto third = on_c->GetWeights(id);
    ASSERT_TRUE(third.ok()) << third.status();
    ExpectSameWeights(*third, on_b_weights);
    EXPECT_EQ(third->weight_version, 6u);
    // A server alone on the directory cannot start while they share it.
    const std::string alone = std::string(base) + "/alone.log";
    const std::string command = std::string(GRADWIRE_SERVER_BIN) +
                                " --listen 127.0.0.1:0 --checkpoint-dir " + dir + " > " + alone +
                                " 2>&1";
    EXPECT_NE(std::system(command.c_str()), 0);
    std::ifstream log(alone);
    const std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
    EXPECT_NE(text.find("--checkpoint-shared"), std::string::npos) << text;
    // Deleted there, it is gone from the directory: B cannot step or save it back. (B refuses
    // the step as moved, or, when its janitor let the module go already, knows no such module.)
    ASSERT_TRUE(on_c->DeleteModule(id).ok());
    auto stale = on_b->ApplyGradients(id);
    EXPECT_TRUE(stale.status().code() == absl::StatusCode::kFailedPrecondition ||
                stale.status().code() == absl::StatusCode::kNotFound)
        << stale.status();
    EXPECT_EQ(on_c->GetWeights(id).status().code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(c.Signal(SIGTERM), 0) << c.Log();
  }
  // B let the module go as moved: its owner is told so (a proxy's retry then reaches the server
  // that knows it was deleted), or, once B forgot the move, that there is no such module.
  const absl::Status after = on_b->GetWeights(id).status();
  EXPECT_TRUE((after.code() == absl::StatusCode::kFailedPrecondition &&
               after.message().find("moved") != std::string::npos) ||
              after.code() == absl::StatusCode::kNotFound)
      << after;
  on_b.reset();
  EXPECT_EQ(b.Signal(SIGTERM), 0) << b.Log();
  EXPECT_FALSE(std::filesystem::exists(dir + "/" + id)) << "B's shutdown wrote the module back";
  std::printf("logs in %s\n", base);
  if (::testing::Test::HasFailure()) return;  // keep the logs
  if (std::getenv("KEEP")) return;
  std::string cleanup = "rm -rf " + std::string(base);
  EXPECT_EQ(std::system(cleanup.c_str()), 0);
}

}  // namespace
}  // namespace gradwire
