// RemoteModule (the libtorch client module) against a real in-process server: FP8 gradients match
// a float64 autograd reference, a two-layer model trains, and server contexts live exactly as long
// as the autograd graph that can use them.
#include "gradwire/torch/remote_module.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "server/core/tensor_calls.h"
#include "specs.h"
#include "test_server.h"

namespace gradwire::torch_client {
namespace {

::testing::AssertionResult HasText(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\"" << text << "\" does not contain \"" << part << "\"";
}

v1::ModuleSpec LinearSpec(int64_t in, int64_t out, uint64_t seed) {
  v1::ModuleSpec spec = testing::LinearSpec(in, out, true, seed);
  return spec;
}

v1::ModuleSpec MlpSpec(int64_t in, int64_t ffn, int64_t out, uint64_t seed) {
  v1::ModuleSpec spec;
  spec.set_kind(v1::LAYERNORM_MLP);
  spec.set_in_features(in);
  spec.set_ffn_features(ffn);
  spec.set_out_features(out);
  spec.set_bias(true);
  spec.set_activation(v1::GELU);
  spec.set_seed(seed);
  return spec;
}

// ||a - b|| / ||b|| in float64.
double RelErr(const torch::Tensor& a, const torch::Tensor& b) {
  const torch::Tensor a64 = a.detach().to(torch::kDouble);
  const torch::Tensor b64 = b.detach().to(torch::kDouble);
  return (a64 - b64).norm().item<double>() / b64.norm().item<double>();
}

// A float64 leaf copy of a server parameter, for the reference.
torch::Tensor Leaf(const NamedTensors& weights, const std::string& name) {
  return weights[name].to(torch::kDouble).requires_grad_(true);
}

class RemoteModuleTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(server_.ok());
    client::ClientOptions options;
    options.server = server_.address();
    client_ = std::make_shared<client::Client>(options);
    torch::manual_seed(1234);
  }

  int64_t LiveContexts() { return server_.host().Stats().live_contexts; }
  int64_t Modules() { return server_.host().Stats().modules; }

  testing::TestServer server_;
  std::shared_ptr<client::Client> client_;
};

TEST_F(RemoteModuleTest, LinearMatchesFloat64ReferenceOnUnquantizedWeights) {
  RemoteModule linear(client_, LinearSpec(48, 24, 7));
  const torch::Tensor x = torch::randn({3, 5, 48}).requires_grad_(true);
  const torch::Tensor y = linear(x);
  ASSERT_EQ(y.sizes(), (std::vector<int64_t>{3, 5, 24}));
  const torch::Tensor grad_y = torch::randn_like(y);
  (y * grad_y).sum().backward();

  const NamedTensors w = linear->get_weights();
  const torch::Tensor xr = x.detach().to(torch::kDouble).requires_grad_(true);
  const torch::Tensor weight = Leaf(w, "weight");
  const torch::Tensor bias = Leaf(w, "bias");
  const torch::Tensor yr = torch::matmul(xr, weight.t()) + bias;
  (yr * grad_y.to(torch::kDouble)).sum().backward();

  EXPECT_LE(RelErr(y, yr), 0.15);
  ASSERT_TRUE(x.grad().defined());
  EXPECT_LE(RelErr(x.grad(), xr.grad()), 0.3);
  const NamedTensors grads = linear->get_gradients();
  EXPECT_LE(RelErr(grads["weight"], weight.grad()), 0.3);
  EXPECT_LE(RelErr(grads["bias"], bias.grad()), 0.3);
  EXPECT_EQ(LiveContexts(), 0);
}

TEST_F(RemoteModuleTest, LayerNormMlpMatchesFloat64ReferenceOnUnquantizedWeights) {
  RemoteModule mlp(client_, MlpSpec(32, 64, 16, 11));
  // A non-trivial LayerNorm affine part, so that its gradients are checked too.
  NamedTensors ln;
  ln.insert("layer_norm_weight", 1.0 + 0.2 * torch::randn({32}));
  ln.insert("layer_norm_bias", 0.1 * torch::randn({32}));
  EXPECT_GT(mlp->set_weights(ln), 0u);

  const torch::Tensor x = (torch::randn({20, 32}) * 2.0 + 0.5).requires_grad_(true);
  const torch::Tensor y = mlp(x);
  ASSERT_EQ(y.sizes(), (std::vector<int64_t>{20, 16}));
  const torch::Tensor grad_y = torch::randn_like(y);
  (y * grad_y).sum().backward();

  const NamedTensors w = mlp->get_weights();
  ASSERT_EQ(w.size(), 6u);
  EXPECT_TRUE(torch::equal(w["layer_norm_weight"], ln["layer_norm_weight"]));
  NamedTensors leaves;
  for (const auto& item : w) leaves.insert(item.key(), Leaf(w, item.key()));
  const torch::Tensor xr = x.detach().to(torch::kDouble).requires_grad_(true);
  const torch::Tensor h =
      torch::layer_norm(xr, {32}, leaves["layer_norm_weight"], leaves["layer_norm_bias"], 1e-5);
  const torch::Tensor a =
      torch::gelu(torch::matmul(h, leaves["fc1_weight"].t()) + leaves["fc1_bias"], "tanh");
  const torch::Tensor yr = torch::matmul(a, leaves["fc2_weight"].t()) + leaves["fc2_bias"];
  (yr * grad_y.to(torch::kDouble)).sum().backward();

  EXPECT_LE(RelErr(y, yr), 0.15);
  ASSERT_TRUE(x.grad().defined());
  EXPECT_LE(RelErr(x.grad(), xr.grad()), 0.3);
  const NamedTensors grads = mlp->get_gradients();
  ASSERT_EQ(grads.size(), 6u);
  for (const auto& item : grads) {
    EXPECT_LE(RelErr(item.value(), leaves[item.key()].grad()), 0.3) << item.key();
  }
  EXPECT_EQ(LiveContexts(), 0);
}

// On the server's host the module's large tensors go through shared memory by themselves (the
// client's default), with the bits the wire gives.
TEST_F(RemoteModuleTest, LargeTensorsUseSharedMemoryWithTheWiresBits) {
  client::ClientOptions off;
  off.server = server_.address();
  off.shared_memory = client::ClientOptions::SharedMemory::kOff;
  auto wire_client = std::make_shared<client::Client>(off);
  RemoteModule shm(client_, LinearSpec(256, 128, 31));
  RemoteModule wire(wire_client, LinearSpec(256, 128, 31));
  const torch::Tensor x = torch::randn({200, 256});
  const torch::Tensor xa = x.clone().requires_grad_(true), xb = x.clone().requires_grad_(true);
  const torch::Tensor ya = shm(xa), yb = wire(xb);
  EXPECT_TRUE(torch::equal(ya, yb));
  const torch::Tensor dy = torch::randn_like(ya);
  (ya * dy).sum().backward();
  (yb * dy).sum().backward();
  EXPECT_TRUE(torch::equal(xa.grad(), xb.grad()));
  EXPECT_TRUE(torch::equal(shm->get_gradients()["weight"], wire->get_gradients()["weight"]));
  EXPECT_EQ(client_->shared_memory_calls(), 2);
  EXPECT_EQ(wire_client->shared_memory_calls(), 0);
  EXPECT_EQ(LiveContexts(), 0);
}

// The exact wire is the default: a Linear's float32 or bfloat16 input crosses as the server's own
// E4M3 cast of it, a LayerNormMLP's as float32, and everything comes back as on the F32 wire, bit
// for bit (outputs, input gradients, weight gradients).
TEST_F(RemoteModuleTest, TheDefaultExactWireGivesTheF32WiresBits) {
  ASSERT_TRUE(client_->options().wire_dtype.exact);
  client::ClientOptions f32;
  f32.server = server_.address();
  f32.wire_dtype = client::WireDType::kF32;
  auto f32_client = std::make_shared<client::Client>(f32);
  struct Case {
    v1::ModuleSpec spec;
    torch::Dtype dtype;
    bool fp8_input;
  };
  const Case cases[] = {{LinearSpec(48, 24, 41), torch::kFloat, true},
                        {LinearSpec(48, 24, 42), torch::kBFloat16, true},
                        {MlpSpec(48, 64, 48, 43), torch::kFloat, false}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.spec.DebugString());
    RemoteModule exact(client_, c.spec);
    RemoteModule wire(f32_client, c.spec);
    const int64_t fp8_before = client_->exact_fp8_inputs();
    const torch::Tensor x = torch::randn({9, 48}).to(c.dtype);
    const torch::Tensor xa = x.clone().requires_grad_(true), xb = x.clone().requires_grad_(true);
    const torch::Tensor ya = exact(xa), yb = wire(xb);
    EXPECT_EQ(ya.scalar_type(), c.dtype);
    EXPECT_TRUE(torch::equal(ya, yb));
    const torch::Tensor dy = torch::randn_like(ya);
    (ya * dy).sum().backward();
    (yb * dy).sum().backward();
    EXPECT_TRUE(torch::equal(xa.grad(), xb.grad()));
    const NamedTensors ga = exact->get_gradients(), gb = wire->get_gradients();
    ASSERT_EQ(ga.size(), gb.size());
    for (const auto& item : ga)
      EXPECT_TRUE(torch::equal(item.value(), gb[item.key()])) << item.key();
    EXPECT_EQ(client_->exact_fp8_inputs() - fp8_before, c.fp8_input ? 1 : 0);
  }
  EXPECT_EQ(f32_client->exact_fp8_inputs(), 0);
}

TEST_F(RemoteModuleTest, TwoLayerModelTrainsWithApplyGradients) {
  RemoteModule first(client_, LinearSpec(8, 32, 21));
  RemoteModule second(client_, LinearSpec(32, 1, 22));
  torch::nn::Sequential model(first, torch::nn::Functional(torch::relu), second);
  // Nothing local for an optimizer to see: the weights live on the server.
  EXPECT_TRUE(model->parameters().empty());

  const torch::Tensor x = torch::randn({64, 8});
  const torch::Tensor target =
      torch::sin(x.sum(1, /*keepdim=*/true)) + 0.5 * x.select(1, 0).unsqueeze(1);
  double initial = 0, final_loss = 0;
  for (int step = 0; step < 50; ++step) {
    const torch::Tensor loss = torch::mse_loss(model->forward(x), target);
    loss.backward();
    EXPECT_EQ(LiveContexts(), 0) << "step " << step;
    first->apply_gradients(0.1f);
    second->apply_gradients(0.1f);
    if (step == 0) initial = loss.item<double>();
    final_loss = loss.item<double>();
  }
  model->eval();
  torch::NoGradGuard no_grad;
  const double eval_loss = torch::mse_loss(model->forward(x), target).item<double>();
  std::printf("two-layer loss %.4f -> %.4f (eval %.4f)\n", initial, final_loss, eval_loss);
  EXPECT_GT(initial, 0.1);
  EXPECT_LT(final_loss, 0.6 * initial);
  EXPECT_LT(eval_loss, 0.6 * initial);
  EXPECT_EQ(first->get_weights().size(), 2u);
  EXPECT_EQ(server_.host().Info(first->module_id())->optimizer_steps, 50);
  EXPECT_EQ(server_.host().Info(second->module_id())->optimizer_steps, 50);
}

TEST_F(RemoteModuleTest, NoGradForwardAndEvalWithoutInputGradKeepNothingOnServer) {
  RemoteModule linear(client_, LinearSpec(16, 8, 3));
  const torch::Tensor x = torch::randn({4, 16}).requires_grad_(true);
  torch::Tensor reference;
  {
    torch::NoGradGuard no_grad;
    reference = linear(x);
    EXPECT_FALSE(reference.requires_grad());
    EXPECT_EQ(reference.grad_fn(), nullptr);
    EXPECT_EQ(LiveContexts(), 0);
  }
  linear->eval();
  const torch::Tensor y = linear(x.detach());  // nothing needs a gradient: inference
  EXPECT_FALSE(y.requires_grad());
  EXPECT_EQ(y.grad_fn(), nullptr);
  EXPECT_EQ(LiveContexts(), 0);
  EXPECT_TRUE(torch::allclose(y, reference));
  // eval() does not cut the graph: an input that needs a gradient gets one, as from a local
  // module in eval mode (a layer before it still learns).
  const torch::Tensor through = linear(x);
  EXPECT_TRUE(through.requires_grad());
  EXPECT_EQ(LiveContexts(), 1);
  through.sum().backward();
  ASSERT_TRUE(x.grad().defined());
  EXPECT_GT(x.grad().abs().sum().item<double>(), 0.0);
  EXPECT_EQ(LiveContexts(), 0);
  x.mutable_grad() = torch::Tensor();

  // The same input in training mode does keep a context, and gives the same values.
  linear->train();
  const torch::Tensor trained = linear(x);
  EXPECT_TRUE(trained.requires_grad());
  EXPECT_NE(trained.grad_fn(), nullptr);
  EXPECT_EQ(LiveContexts(), 1);
  EXPECT_TRUE(torch::allclose(trained, reference));
}

TEST_F(RemoteModuleTest, DroppingTheGraphWithoutBackwardReleasesTheContext) {
  RemoteModule linear(client_, LinearSpec(16, 8, 4));
  {
    const torch::Tensor y = linear(torch::randn({4, 16}));
    EXPECT_TRUE(y.requires_grad());  // the server weights need grad even if the input does not
    EXPECT_EQ(LiveContexts(), 1);
  }
  EXPECT_EQ(LiveContexts(), 0);

  // A downstream tensor keeps the graph, and with it the context, alive.
  torch::Tensor loss;
  {
    const torch::Tensor y = linear(torch::randn({4, 16}));
    loss = y.square().sum();
  }
  EXPECT_EQ(LiveContexts(), 1);
  loss = torch::Tensor();
  EXPECT_EQ(LiveContexts(), 0);
  EXPECT_EQ(linear->get_gradients()["weight"].abs().sum().item<float>(), 0.0f);
}

TEST_F(RemoteModuleTest, BackwardFreesTheContextAndAccumulatesOnTheServer) {
  RemoteModule linear(client_, LinearSpec(16, 8, 5));
  const torch::Tensor x = torch::randn({4, 16});  // first layer: no grad_input wanted
  const torch::Tensor loss = linear(x).square().sum();
  EXPECT_EQ(LiveContexts(), 1);
  loss.backward();
  EXPECT_EQ(LiveContexts(), 0);
  EXPECT_FALSE(x.grad().defined());
  const NamedTensors grads = linear->get_gradients();
  EXPECT_GT(grads["weight"].abs().sum().item<float>(), 0.0f);
  EXPECT_EQ(
      core::TensorGradients(server_.host(), linear->module_id(), false)->accumulated_backwards, 1);

  const torch::Tensor w0 = linear->get_weights()["weight"];
  linear->apply_gradients(0.1f);
  const torch::Tensor w1 = linear->get_weights()["weight"];
  EXPECT_TRUE(torch::allclose(w1, w0 - 0.1 * grads["weight"], 1e-5, 1e-6));
}

TEST_F(RemoteModuleTest, SecondBackwardThroughRetainedGraphRaises) {
  RemoteModule linear(client_, LinearSpec(16, 8, 6));
  const torch::Tensor loss = linear(torch::randn({4, 16})).sum();
  loss.backward({}, /*retain_graph=*/true);
  EXPECT_EQ(LiveContexts(), 0);
  try {
    loss.backward();
    FAIL() << "expected an exception";
  } catch (const std::exception& e) {
    EXPECT_TRUE(HasText(e.what(), "retain_graph"));
  }
  EXPECT_EQ(
      core::TensorGradients(server_.host(), linear->module_id(), false)->accumulated_backwards, 1);
}

TEST_F(RemoteModuleTest, ServerErrorInBackwardRaisesThroughAutograd) {
  RemoteModule linear(client_, LinearSpec(16, 8, 14));
  const torch::Tensor x = torch::randn({4, 16}).requires_grad_(true);
  const torch::Tensor loss = linear(x).sum();
  // Deleting the module on the server also drops its contexts.
  ASSERT_TRUE(server_.host().Delete(linear->module_id()).ok());
  try {
    loss.backward();
    FAIL() << "expected RemoteError";
  } catch (const RemoteError& e) {
    EXPECT_EQ(e.code(), absl::StatusCode::kNotFound);
    EXPECT_TRUE(HasText(e.what(), "NOT_FOUND"));
    EXPECT_TRUE(HasText(e.what(), "Backward"));
  }
  EXPECT_FALSE(x.grad().defined());
  EXPECT_EQ(LiveContexts(), 0);
}

TEST_F(RemoteModuleTest, WrongInputShapeRaisesAndLeavesTheServerUntouched) {
  RemoteModule linear(client_, LinearSpec(16, 8, 8));
  const core::HostStats before = server_.host().Stats();
  const uint64_t version = server_.host().Info(linear->module_id())->weight_version;
  const torch::Tensor bad = torch::randn({4, 15}).requires_grad_(true);
  for (bool training : {true, false}) {
    linear->train(training);
    try {
      linear(bad);
      FAIL() << "expected RemoteError, training=" << training;
    } catch (const RemoteError& e) {
      EXPECT_EQ(e.code(), absl::StatusCode::kInvalidArgument);
      EXPECT_TRUE(HasText(e.what(), "input.shape"));
      EXPECT_TRUE(HasText(e.what(), "INVALID_ARGUMENT"));
      EXPECT_TRUE(HasText(e.what(), "[4, 15]"));
    }
  }
  const core::HostStats after = server_.host().Stats();
  EXPECT_EQ(after.live_contexts, 0);
  EXPECT_EQ(after.modules, before.modules);
  EXPECT_EQ(after.workspace_builds, before.workspace_builds);
  EXPECT_EQ(after.workspace_hits, before.workspace_hits);
  EXPECT_EQ(server_.host().Info(linear->module_id())->weight_version, version);
  EXPECT_EQ(
      core::TensorGradients(server_.host(), linear->module_id(), false)->accumulated_backwards, 0);
}

TEST_F(RemoteModuleTest, OtherDtypesRoundTripThroughFloat32) {
  RemoteModule linear(client_, LinearSpec(16, 8, 9));
  const torch::Tensor x32 = torch::randn({4, 16});
  const torch::Tensor x64 = x32.to(torch::kDouble).requires_grad_(true);
  const torch::Tensor y64 = linear(x64);
  EXPECT_EQ(y64.scalar_type(), torch::kDouble);
  y64.sum().backward();
  ASSERT_TRUE(x64.grad().defined());
  EXPECT_EQ(x64.grad().scalar_type(), torch::kDouble);
  EXPECT_EQ(x64.grad().sizes(), x64.sizes());
  EXPECT_GT(x64.grad().abs().sum().item<double>(), 0.0);
  EXPECT_EQ(LiveContexts(), 0);

  torch::NoGradGuard no_grad;
  const torch::Tensor y32 = linear(x32);
  EXPECT_EQ(y32.scalar_type(), torch::kFloat);
  EXPECT_TRUE(torch::allclose(y64.to(torch::kFloat), y32));
  const torch::Tensor y16 = linear(x32.to(torch::kBFloat16));
  EXPECT_EQ(y16.scalar_type(), torch::kBFloat16);
  EXPECT_LE(RelErr(y16, y32), 0.05);
}

TEST_F(RemoteModuleTest, FrozenModuleWithoutInputGradRunsAsInference) {
  RemoteModule linear(client_, LinearSpec(16, 8, 10));
  linear->set_requires_grad(false);
  const torch::Tensor y = linear(torch::randn({4, 16}));
  EXPECT_FALSE(y.requires_grad());
  EXPECT_EQ(LiveContexts(), 0);
}

TEST_F(RemoteModuleTest, OwnedModulesAreDeletedAttachedOnesKept) {
  std::string id;
  {
    RemoteModule owner(client_, LinearSpec(16, 8, 12));
    id = owner->module_id();
    EXPECT_EQ(Modules(), 1);
    RemoteModule attached(client_, id);
    EXPECT_EQ(attached->info().spec().in_features(), 16);
    EXPECT_TRUE(torch::equal(attached->get_weights()["weight"], owner->get_weights()["weight"]));
  }
  EXPECT_EQ(Modules(), 0);

  {
    RemoteModule kept(client_, LinearSpec(16, 8, 13), RemoteModuleOptions{/*keep_on_server=*/true});
    id = kept->module_id();
  }
  EXPECT_EQ(Modules(), 1);
  { RemoteModule attached(client_, id); }
  EXPECT_EQ(Modules(), 1);

  try {
    RemoteModule missing(client_, std::string("no-such-module"));
    FAIL() << "expected RemoteError";
  } catch (const RemoteError& e) {
    EXPECT_EQ(e.code(), absl::StatusCode::kNotFound);
    EXPECT_TRUE(HasText(e.what(), "no-such-module"));
  }
}

TEST_F(RemoteModuleTest, ServerRejectionOfSpecRaises) {
  v1::ModuleSpec spec = LinearSpec(0, 8, 1);
  try {
    RemoteModule bad(client_, spec);
    FAIL() << "expected RemoteError";
  } catch (const RemoteError& e) {
    EXPECT_EQ(e.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(HasText(e.what(), "INVALID_ARGUMENT"));
    EXPECT_TRUE(HasText(e.what(), "in_features"));
  }
  EXPECT_EQ(Modules(), 0);
}

}  // namespace
}  // namespace gradwire::torch_client
