// Convergence parity: the demo's remote LayerNormMLP trained in FP8 (every recipe: current,
// delayed, block, block-hybrid, mxfp8) ends within 5% of the same model trained locally in
// float32 (ATen autograd) from the same initial weights, on the same data with the same SGD.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>

#include "demo.h"
#include "gradwire/client/client.h"
#include "test_server.h"

namespace gradwire {
namespace {

using client::HostTensor;

at::Tensor ToAt(const HostTensor& t) {
  return at::from_blob(const_cast<float*>(t.data.data()), t.shape, at::kFloat).clone();
}

HostTensor FromAt(const at::Tensor& t) {
  const at::Tensor c = t.detach().contiguous();
  HostTensor out;
  out.shape.assign(c.sizes().begin(), c.sizes().end());
  out.data.assign(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
  return out;
}

// The LayerNormMLP (GELU, tanh approximation) in float32 with autograd.
class LocalMlp final : public cli::DemoModel {
 public:
  explicit LocalMlp(const client::NamedTensors& init) {
    for (const auto& [name, tensor] : init.tensors) {
      params_.emplace_back(name, ToAt(tensor).set_requires_grad(true));
    }
  }
  absl::StatusOr<HostTensor> Forward(const HostTensor& x, bool training) override {
    const at::Tensor in = ToAt(x);
    at::Tensor ln =
        at::layer_norm(in, {in.size(1)}, P("layer_norm_weight"), P("layer_norm_bias"), 1e-5);
    at::Tensor h = at::gelu(at::matmul(ln, P("fc1_weight").t()) + P("fc1_bias"), "tanh");
    at::Tensor y = at::matmul(h, P("fc2_weight").t()) + P("fc2_bias");
    if (training) last_ = y;
    return FromAt(y);
  }
  absl::Status Backward(const HostTensor& dy) override {
    last_.backward(ToAt(dy));
    last_ = at::Tensor();
    return absl::OkStatus();
  }
  absl::Status Step(float lr) override {
    for (auto& [name, p] : params_) {
      p.data().sub_(p.grad(), lr);
      p.grad().zero_();
    }
    return absl::OkStatus();
  }

 private:
  const at::Tensor& P(const std::string& name) const {
    for (const auto& [n, p] : params_) {
      if (n == name) return p;
    }
    ADD_FAILURE() << "no parameter " << name;
    return params_[0].second;
  }
  std::vector<std::pair<std::string, at::Tensor>> params_;
  at::Tensor last_;
};

class DemoParityTest : public ::testing::TestWithParam<const char*> {};

TEST_P(DemoParityTest, Fp8LayerNormMlpEndsWithinFivePercentOfFloat32) {
  testing::TestServer server;
  ASSERT_TRUE(server.ok());
  client::ClientOptions copts;
  copts.server = server.address();
  client::Cluster cluster(copts, {server.address()});
  client::Client& client = cluster.endpoint(0);
  cli::DemoOptions options;
  options.model = "mlp";
  options.recipe = GetParam();
  options.steps = 300;
  options.learning_rate = 0.5f;

  auto remote = cli::MakeRemoteModel(cluster, options);
  ASSERT_TRUE(remote.ok()) << remote.status();
  auto init = client.GetWeights((*remote)->module_ids().at(0));
  ASSERT_TRUE(init.ok());
  LocalMlp local(*init);

  auto fp8 = cli::Train(**remote, options, nullptr);
  ASSERT_TRUE(fp8.ok()) << fp8.status();
  auto f32 = cli::Train(local, options, nullptr);
  ASSERT_TRUE(f32.ok()) << f32.status();
  std::printf("recipe %s: FP8 loss %.6f -> %.6f, float32 loss %.6f -> %.6f (%.2f%%)\n", GetParam(),
              fp8->initial_loss, fp8->final_loss, f32->initial_loss, f32->final_loss,
              100.0 * (fp8->final_loss / f32->final_loss - 1.0));
  EXPECT_NEAR(fp8->initial_loss, f32->initial_loss, 0.05 * f32->initial_loss);
  EXPECT_LT(f32->final_loss, 0.3 * f32->initial_loss);  // it did learn
  EXPECT_LE(std::fabs(fp8->final_loss - f32->final_loss), 0.05 * f32->final_loss);
}

INSTANTIATE_TEST_SUITE_P(Recipes, DemoParityTest,
                         ::testing::Values("current", "delayed", "block", "block-hybrid", "mxfp8"));

}  // namespace
}  // namespace gradwire
