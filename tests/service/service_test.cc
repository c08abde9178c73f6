// The real server, driven through the C++ client library over a TCP loopback port and over the
// in-process transport.
#include "server/rpc/service.h"

#include <ATen/ATen.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <set>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gradwire/client/client.h"
#include "gradwire/client/kinds.h"
#include "gradwire/kernels/fp8.h"
#include "server/core/kinds/kind_description.h"
#include "server/core/kinds/module_kind.h"
#include "server/core/module_host.h"
#include "server/core/tensor_calls.h"
#include "server/rpc/scheduling/executor.h"
#include "server/rpc/spec_convert.h"
#include "specs.h"
#include "test_server.h"

namespace gradwire {
namespace {

using client::HostTensor;

using testing::Random;
at::Tensor ToAt(const HostTensor& t) {
  return at::from_blob(const_cast<float*>(t.data.data()), t.shape, at::kFloat).clone();
}

class ServiceTest : public ::testing::TestWithParam<testing::Transport> {
 protected:
  void SetUp() override {
    ASSERT_TRUE(server_.ok());
    client_ = server_.Connect();
    module_ = CreateLinear(12, 6, true, 5);
  }

  std::string CreateLinear(int64_t in, int64_t out, bool bias, uint64_t seed) {
    v1::ModuleSpec spec = testing::LinearSpec(in, out, bias, seed);
    auto info = client_->CreateModule(spec);
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->module_id() : "";
  }

  // A valid training step works (the server still serves after whatever came before).
  void ExpectServes() {
    auto fwd = client_->Forward(module_, Random({3, 12}), true);
    ASSERT_TRUE(fwd.ok()) << fwd.status();
    auto bwd = client_->Backward(fwd->context_id, Random({3, 6}));
    ASSERT_TRUE(bwd.ok()) << bwd.status();
  }

  // Sends a raw Forward request and returns its status.
  grpc::Status RawForward(const v1::ForwardRequest& req) {
    grpc::ClientContext ctx;
    v1::ForwardResponse resp;
    return client_->stub().Forward(&ctx, req, &resp);
  }

  v1::ForwardRequest ValidForward() {
    v1::ForwardRequest req;
    req.set_module_id(module_);
    *req.mutable_input() = client::ToWire(Random({2, 12}), client::WireDType::kF32);
    req.set_training(true);
    return req;
  }

  testing::TestServer server_{GetParam()};
  core::ModuleHost& host_ = server_.host();
  std::unique_ptr<client::Client> client_;
  std::string module_;
};

TEST_P(ServiceTest, ServerInfoDescribesTheServer) {
  auto info = client_->GetServerInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->device(), host_.backend().name());  // "cpu" unless GRADWIRE_TEST_DEVICE says
  EXPECT_EQ(info->modules(), 1);
  ASSERT_EQ(info->module_kinds_size(), 3);
  EXPECT_EQ(info->module_kinds(0), v1::LINEAR);
  EXPECT_EQ(info->module_kinds(2), v1::LAYERNORM_MLP);
}

TEST_P(ServiceTest, TrainingStepMatchesTheInProcessModuleBitForBit) {
  // The same seed in a local host gives the same module: the wire must not change a bit. The local
  // host computes on the server's kind of backend (GRADWIRE_TEST_DEVICE): the claim is about the
  // wire, and another backend's GEMMs sum in another order.
  core::ModuleHost local(core::ContextLimits{}, nullptr, testing::TestBackend());
  core::ModuleSpec spec;
  spec.in_features = 12;
  spec.out_features = 6;
  spec.bias = true;
  spec.seed = 5;
  const std::string local_id = local.Create(spec)->module_id;

  const HostTensor x = Random({4, 12}), dy = Random({4, 6});
  auto remote_fwd = client_->Forward(module_, x, /*training=*/true);
  ASSERT_TRUE(remote_fwd.ok()) << remote_fwd.status();
  EXPECT_EQ(remote_fwd->context_id.size(), 32u);
  EXPECT_EQ(remote_fwd->weight_version, 1u);
  auto local_fwd = core::TensorForward(local, local_id, ToAt(x), true);
  ASSERT_TRUE(local_fwd.ok());
  EXPECT_TRUE(at::equal(ToAt(remote_fwd->output), local_fwd->output));
  EXPECT_EQ(host_.Stats().live_contexts, 1);

  auto remote_dx = client_->Backward(remote_fwd->context_id, dy);
  ASSERT_TRUE(remote_dx.ok()) << remote_dx.status();
  EXPECT_EQ(host_.Stats().live_contexts, 0);  // freed before the reply
  EXPECT_EQ(host_.Stats().context_bytes, 0);
  auto local_dx = core::TensorBackward(local, local_fwd->context_id, ToAt(dy), false, false);
  ASSERT_TRUE(local_dx.ok());
  EXPECT_TRUE(at::equal(ToAt(*remote_dx), *local_dx));

  auto version = client_->ApplyGradients(module_, 0.1f);
  ASSERT_TRUE(version.ok());
  EXPECT_EQ(*version, 2u);
  ASSERT_TRUE(local.ApplyGradients(local_id, 0.1f).ok());
  auto weights = client_->GetWeights(module_);
  ASSERT_TRUE(weights.ok());
  EXPECT_EQ(weights->weight_version, 2u);
  const core::ParametersCopy local_weights = *core::TensorWeights(local, local_id);
  ASSERT_EQ(weights->tensors.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(weights->tensors[i].first, local_weights.tensors[i].first);
    EXPECT_TRUE(at::equal(ToAt(weights->tensors[i].second), local_weights.tensors[i].second));
  }
}

TEST_P(ServiceTest, InferenceForwardCreatesNoContext) {
  auto fwd = client_->Forward(module_, Random({5, 12}), /*training=*/false);
  ASSERT_TRUE(fwd.ok());
  EXPECT_TRUE(fwd->context_id.empty());
  EXPECT_EQ(fwd->output.shape, (std::vector<int64_t>{5, 6}));
  EXPECT_EQ(host_.Stats().live_contexts, 0);
}

TEST_P(ServiceTest, LeadingDimensionsArePreserved) {
  auto fwd = client_->Forward(module_, Random({2, 3, 12}), true);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  EXPECT_EQ(fwd->output.shape, (std::vector<int64_t>{2, 3, 6}));
  auto dx = client_->Backward(fwd->context_id, Random({2, 3, 6}));
  ASSERT_TRUE(dx.ok()) << dx.status();
  EXPECT_EQ(dx->shape, (std::vector<int64_t>{2, 3, 12}));
}

TEST_P(ServiceTest, SetWeightsThenGetWeightsRoundTripsAndBumpsVersion) {
  const HostTensor w = Random({6, 12}), b = Random({6});
  auto version = client_->SetWeights(module_, {{"weight", w}, {"bias", b}});
  ASSERT_TRUE(version.ok()) << version.status();
  EXPECT_EQ(*version, 2u);
  auto got = client_->GetWeights(module_);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->Find("weight")->data, w.data);
  EXPECT_EQ(got->Find("bias")->data, b.data);
  // A subset: only the bias.
  const HostTensor b2 = Random({6});
  ASSERT_TRUE(client_->SetWeights(module_, {{"bias", b2}}).ok());
  got = client_->GetWeights(module_);
  EXPECT_EQ(got->Find("weight")->data, w.data);
  EXPECT_EQ(got->Find("bias")->data, b2.data);
  EXPECT_EQ(got->weight_version, 3u);
}

TEST_P(ServiceTest, SixteenBitWireDtypesStayCloseToF32) {
  const HostTensor x = Random({8, 12});
  auto f32 = client_->Forward(module_, x, false);
  ASSERT_TRUE(f32.ok());
  for (auto dtype : {client::WireDType::kBF16, client::WireDType::kF16}) {
    client::ClientOptions options = client_->options();
    options.wire_dtype = dtype;
    client::Client narrow(options);
    auto out = narrow.Forward(module_, x, false);
    ASSERT_TRUE(out.ok()) << out.status();
    for (size_t i = 0; i < x.data.size() && i < out->output.data.size(); ++i) {
      // bf16 input rounding can move an FP8 code by one step; bound by an E4M3 step.
      EXPECT_NEAR(out->output.data[i], f32->output.data[i],
                  0.15 * std::fabs(f32->output.data[i]) + 0.15);
    }
  }
}

TEST_P(ServiceTest, ListAndDeleteModules) {
  const std::string other = CreateLinear(3, 2, false, 1);
  auto list = client_->ListModules();
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->size(), 2u);
  auto fwd = client_->Forward(other, Random({1, 3}), true);
  ASSERT_TRUE(fwd.ok());
  ASSERT_TRUE(client_->DeleteModule(other).ok());
  EXPECT_EQ(host_.Stats().live_contexts, 0);  // its context went with it
  EXPECT_EQ(client_->DeleteModule(other).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->ListModules()->size(), 1u);
}

TEST_P(ServiceTest, DoubleBackwardIsFailedPreconditionAndRetainAllowsIt) {
  auto fwd = client_->Forward(module_, Random({2, 12}), true);
  ASSERT_TRUE(fwd.ok());
  client::BackwardOptions retain;
  retain.retain = true;
  ASSERT_TRUE(client_->Backward(fwd->context_id, Random({2, 6}), retain).ok());
  ASSERT_TRUE(client_->Backward(fwd->context_id, Random({2, 6})).ok());
  auto third = client_->Backward(fwd->context_id, Random({2, 6}));
  EXPECT_EQ(third.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(third.status().message().find("retain"), std::string::npos);
  ExpectServes();
}

TEST_P(ServiceTest, ReleaseContextFreesIt) {
  auto fwd = client_->Forward(module_, Random({2, 12}), true);
  ASSERT_TRUE(fwd.ok());
  EXPECT_EQ(host_.Stats().live_contexts, 1);
  ASSERT_TRUE(client_->ReleaseContext(fwd->context_id).ok());
  EXPECT_EQ(host_.Stats().live_contexts, 0);
  EXPECT_EQ(client_->ReleaseContext("ffffffffffffffffffffffffffffffff").code(),
            absl::StatusCode::kNotFound);
}

// One malformed request: how to break a valid Forward, the code and the words expected.
struct BadForward {
  const char* name;
  void (*mutate)(v1::ForwardRequest*);
  grpc::StatusCode code;
  const char* message;
};

const BadForward kBadForwards[] = {
    {"unset dtype",
     [](v1::ForwardRequest* r) { r->mutable_input()->set_dtype(v1::DTYPE_UNSPECIFIED); },
     grpc::INVALID_ARGUMENT, "input.dtype"},
    {"unknown dtype",
     [](v1::ForwardRequest* r) { r->mutable_input()->set_dtype(static_cast<v1::DType>(42)); },
     grpc::INVALID_ARGUMENT, "input.dtype"},
    {"wrong dtype for the bytes",
     [](v1::ForwardRequest* r) { r->mutable_input()->set_dtype(v1::BF16); }, grpc::INVALID_ARGUMENT,
     "input.data has 96 bytes"},
    {"shape mismatch with the module",
     [](v1::ForwardRequest* r) {
       r->mutable_input()->set_shape(0, 4);
       r->mutable_input()->set_shape(1, 6);
     },
     grpc::INVALID_ARGUMENT, "input.shape must be [..., 12]"},
    {"byte length not matching shape",
     [](v1::ForwardRequest* r) { r->mutable_input()->mutable_data()->resize(95); },
     grpc::INVALID_ARGUMENT, "input.data has 95 bytes"},
    {"zero dimension", [](v1::ForwardRequest* r) { r->mutable_input()->set_shape(0, 0); },
     grpc::INVALID_ARGUMENT, "input.shape[0] must be >= 1"},
    {"negative dimension", [](v1::ForwardRequest* r) { r->mutable_input()->set_shape(1, -12); },
     grpc::INVALID_ARGUMENT, "input.shape[1] must be >= 1"},
    {"huge dimensions",
     [](v1::ForwardRequest* r) {
       r->mutable_input()->set_shape(0, int64_t(1) << 40);
       r->mutable_input()->set_shape(1, int64_t(1) << 40);
     },
     grpc::INVALID_ARGUMENT, "elements"},
    {"no shape", [](v1::ForwardRequest* r) { r->mutable_input()->clear_shape(); },
     grpc::INVALID_ARGUMENT, "input.shape is empty"},
    {"no input", [](v1::ForwardRequest* r) { r->clear_input(); }, grpc::INVALID_ARGUMENT,
     "input is required"},
    {"no module id", [](v1::ForwardRequest* r) { r->clear_module_id(); }, grpc::INVALID_ARGUMENT,
     "module_id is required"},
    {"unknown module",
     [](v1::ForwardRequest* r) { r->set_module_id("0123456789abcdef0123456789abcdef"); },
     grpc::NOT_FOUND, "module_id 0123456789abcdef0123456789abcdef is not a module"},
    {"malformed module id", [](v1::ForwardRequest* r) { r->set_module_id("not-a-module"); },
     grpc::INVALID_ARGUMENT, "module_id must be 32 lowercase hex digits, got \"not-a-module\""},
    {"FP8 without scale_inv",
     [](v1::ForwardRequest* r) {
       r->mutable_input()->set_dtype(v1::FP8_E4M3);
       r->mutable_input()->mutable_data()->resize(24);
     },
     grpc::INVALID_ARGUMENT, "input.scale_inv"},
    {"FP8 with NaN scale_inv",
     [](v1::ForwardRequest* r) {
       r->mutable_input()->set_dtype(v1::FP8_E5M2);
       r->mutable_input()->mutable_data()->resize(24);
       r->mutable_input()->set_scale_inv(NAN);
     },
     grpc::INVALID_ARGUMENT, "input.scale_inv"},
    {"unknown output dtype",
     [](v1::ForwardRequest* r) { r->set_output_dtype(static_cast<v1::DType>(99)); },
     grpc::INVALID_ARGUMENT, "output_dtype must be F32, BF16, F16, FP8_E4M3 or FP8_E5M2"},
};

TEST_P(ServiceTest, BadForwardsGetClearErrorsAndChangeNothing) {
  const auto before = host_.Stats();
  const auto weights_before = client_->GetWeights(module_);
  ASSERT_TRUE(weights_before.ok());
  for (const BadForward& bad : kBadForwards) {
    SCOPED_TRACE(bad.name);
    v1::ForwardRequest req = ValidForward();
    bad.mutate(&req);
    const grpc::Status status = RawForward(req);
    EXPECT_EQ(status.error_code(), bad.code) << status.error_message();
    EXPECT_NE(status.error_message().find(bad.message), std::string::npos)
        << "message: " << status.error_message();
    const auto after = host_.Stats();
    EXPECT_EQ(after.live_contexts, before.live_contexts);
    EXPECT_EQ(after.modules, before.modules);
    EXPECT_EQ(after.workspace_builds + after.workspace_hits,
              before.workspace_builds + before.workspace_hits);
  }
  EXPECT_EQ(client_->GetWeights(module_)->Find("weight")->data,
            weights_before->Find("weight")->data);
  ExpectServes();
}

TEST_P(ServiceTest, BadBackwardsLeaveTheContextUsable) {
  auto fwd = client_->Forward(module_, Random({2, 12}), true);
  ASSERT_TRUE(fwd.ok());
  struct Case {
    const char* name;
    std::string context_id;
    HostTensor grad;
    grpc::StatusCode code;
    const char* message;
  } cases[] = {
      {"shape mismatch", fwd->context_id, Random({2, 7}), grpc::INVALID_ARGUMENT,
       "grad_output.shape must be [2, 6]"},
      {"rank mismatch", fwd->context_id, Random({12}), grpc::INVALID_ARGUMENT,
       "grad_output.shape must be [2, 6]"},
      {"unknown context", "00000000000000000000000000000000", Random({2, 6}), grpc::NOT_FOUND,
       "context_id 00000000000000000000000000000000"},
      {"empty context id", "", Random({2, 6}), grpc::INVALID_ARGUMENT, "context_id is required"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    auto result = client_->Backward(c.context_id, c.grad);
    EXPECT_EQ(int(result.status().code()), int(c.code)) << result.status();
    EXPECT_NE(result.status().message().find(c.message), std::string::npos) << result.status();
    EXPECT_EQ(host_.Stats().live_contexts, 1);
  }
  // Malformed bytes.
  v1::BackwardRequest req;
  req.set_context_id(fwd->context_id);
  *req.mutable_grad_output() = client::ToWire(Random({2, 6}), client::WireDType::kF32);
  req.mutable_grad_output()->mutable_data()->resize(10);
  grpc::ClientContext ctx;
  v1::BackwardResponse resp;
  const grpc::Status status = client_->stub().Backward(&ctx, req, &resp);
  EXPECT_EQ(status.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("grad_output.data has 10 bytes"), std::string::npos);
  // The context survived every bad call and still runs its backward.
  ASSERT_TRUE(client_->Backward(fwd->context_id, Random({2, 6})).ok());
  EXPECT_EQ(host_.Stats().live_contexts, 0);
}

TEST_P(ServiceTest, BadModuleAndOptimizerRequests) {
  v1::ModuleSpec spec = testing::LinearSpec(0, 3);
  auto created = client_->CreateModule(spec);
  EXPECT_EQ(created.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(created.status().message().find("spec.in_features"), std::string::npos);
  spec.set_in_features(3);
  spec.set_kind(v1::MODULE_KIND_UNSPECIFIED);
  created = client_->CreateModule(spec);
  EXPECT_EQ(created.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(created.status().message().find("spec.kind"), std::string::npos);
  spec.set_kind(v1::LINEAR);
  spec.set_out_features(1 << 20);
  EXPECT_EQ(client_->CreateModule(spec).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(host_.Stats().modules, 1);

  auto sgd = client_->ApplyGradients(module_, 0.0f);
  EXPECT_EQ(sgd.status().code(), absl::StatusCode::kOk);  // 0 keeps the configured rate
  sgd = client_->ApplyGradients(module_, -1.0f);
  EXPECT_EQ(sgd.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(sgd.status().message().find("learning_rate"), std::string::npos);
  EXPECT_EQ(client_->ApplyGradients(std::string(32, 'f'), 0.1f).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->ApplyGradients("nope", 0.1f).status().code(),
            absl::StatusCode::kInvalidArgument);

  auto set = client_->SetWeights(module_, {{"weight", Random({12, 6})}, {"bias", Random({6})}});
  EXPECT_EQ(set.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(set.status().message().find("(weight).shape must be [6, 12]"), std::string::npos)
      << set.status();
  set = client_->SetWeights(module_, {{"gamma", Random({6})}});
  EXPECT_EQ(set.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(set.status().message().find("not a parameter"), std::string::npos);
  set = client_->SetWeights(module_, {});
  EXPECT_EQ(set.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->GetWeights(module_)->weight_version, 2u);  // only the valid apply
  ExpectServes();
}

TEST_P(ServiceTest, LayerNormMlpOverTheWire) {
  v1::ModuleSpec spec;
  spec.set_kind(v1::LAYERNORM_MLP);
  spec.set_in_features(12);
  spec.set_ffn_features(20);
  spec.set_out_features(12);
  spec.set_activation(v1::SWIGLU);
  spec.set_bias(true);
  spec.set_return_layernorm_output(true);
  spec.mutable_recipe()->set_scaling(v1::DELAYED);
  spec.mutable_recipe()->set_amax_compute_algo(v1::MOST_RECENT);
  spec.mutable_optimizer()->mutable_adamw()->set_learning_rate(1e-3f);
  auto info = client_->CreateModule(spec);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->spec().ffn_features(), 20);
  EXPECT_EQ(info->spec().activation(), v1::SWIGLU);
  EXPECT_EQ(info->spec().recipe().amax_history_len(), 1024);  // the default, made explicit
  EXPECT_EQ(info->spec().optimizer().adamw().beta2(), 0.999f);
  EXPECT_EQ(info->parameter_names_size(), 6);
  auto fwd = client_->Forward(info->module_id(), Random({3, 4, 12}), true);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  EXPECT_EQ(fwd->output.shape, (std::vector<int64_t>{3, 4, 12}));
  ASSERT_TRUE(fwd->layernorm_output.has_value());
  EXPECT_EQ(fwd->layernorm_output->shape, (std::vector<int64_t>{3, 4, 12}));
  client::BackwardOptions options;
  options.grad_layernorm_output = Random({3, 4, 12});
  auto dx = client_->Backward(fwd->context_id, Random({3, 4, 12}), options);
  ASSERT_TRUE(dx.ok()) << dx.status();
  EXPECT_EQ(dx->shape, (std::vector<int64_t>{3, 4, 12}));
  auto grads = client_->GetGradients(info->module_id(), /*zero=*/true);
  ASSERT_TRUE(grads.ok());
  EXPECT_EQ(grads->accumulated_backwards, 1);
  ASSERT_NE(grads->Find("fc1_weight"), nullptr);
  EXPECT_EQ(grads->Find("fc1_weight")->shape, (std::vector<int64_t>{40, 12}));  // gated: 2 x ffn
  EXPECT_EQ(client_->ApplyGradients(info->module_id()).value(), 2u);
}

TEST_P(ServiceTest, BadModuleSpecsNameTheField) {
  struct Case {
    const char* name;
    void (*mutate)(v1::ModuleSpec*);
    const char* message;
  } cases[] = {
      {"MLP without ffn", [](v1::ModuleSpec* s) { s->set_kind(v1::LAYERNORM_MLP); },
       "spec.ffn_features"},
      {"activation on Linear", [](v1::ModuleSpec* s) { s->set_activation(v1::RELU); },
       "spec.activation"},
      {"unknown activation",
       [](v1::ModuleSpec* s) { s->set_activation(static_cast<v1::Activation>(77)); },
       "spec.activation"},
      {"unknown recipe",
       [](v1::ModuleSpec* s) {
         s->mutable_recipe()->set_scaling(static_cast<v1::ScalingRecipe>(9));
       },
       "spec.recipe.scaling"},
      {"negative margin", [](v1::ModuleSpec* s) { s->mutable_recipe()->set_margin(-1); },
       "spec.recipe.margin"},
      {"huge history",
       [](v1::ModuleSpec* s) { s->mutable_recipe()->set_amax_history_len(1 << 20); },
       "spec.recipe.amax_history_len"},
      {"negative lr",
       [](v1::ModuleSpec* s) { s->mutable_optimizer()->mutable_sgd()->set_learning_rate(-1); },
       "spec.optimizer.sgd.learning_rate"},
      {"momentum 1",
       [](v1::ModuleSpec* s) {
         s->mutable_optimizer()->mutable_sgd()->set_learning_rate(0.1f);
         s->mutable_optimizer()->mutable_sgd()->set_momentum(1.0f);
       },
       "spec.optimizer.sgd.momentum"},
      {"adamw beta1 > 1",
       [](v1::ModuleSpec* s) {
         s->mutable_optimizer()->mutable_adamw()->set_learning_rate(0.1f);
         s->mutable_optimizer()->mutable_adamw()->set_beta1(1.5f);
       },
       "spec.optimizer.adamw.beta1"},
      {"checkpoint on Linear", [](v1::ModuleSpec* s) { s->set_checkpoint(true); }, "checkpoint"},
      {"negative eps",
       [](v1::ModuleSpec* s) {
         s->set_kind(v1::LAYERNORM_LINEAR);
         s->set_layernorm_eps(-1e-5f);
       },
       "spec.layernorm_eps"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    v1::ModuleSpec spec = testing::LinearSpec(4, 4);
    c.mutate(&spec);
    auto created = client_->CreateModule(spec);
    EXPECT_EQ(created.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(created.status().message().find(c.message), std::string::npos) << created.status();
  }
  EXPECT_EQ(host_.Stats().modules, 1);
  ExpectServes();
}

TEST_P(ServiceTest, ConcurrentClientsAreAllServed) {
  constexpr int kThreads = 6, kSteps = 10;
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int s = 0; s < kSteps; ++s) {
        auto fwd = client_->Forward(module_, Random({3, 12}), true);
        if (!fwd.ok()) continue;
        if (client_->Backward(fwd->context_id, Random({3, 6})).ok()) ok.fetch_add(1);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), kThreads * kSteps);
  EXPECT_EQ(host_.Stats().live_contexts, 0);
}

INSTANTIATE_TEST_SUITE_P(Transports, ServiceTest,
                         ::testing::Values(testing::Transport::kTcp,
                                           testing::Transport::kInProcess),
                         testing::TransportParamName);

// Module kinds are described once, in the wire contract (module.proto: a KindDescription on each
// ModuleKind value), and every client reads that table; the server's own descriptions of its kinds
// must say the same: names, the spec fields each reads, and its widths in DescribeModule's order.
// A module created without a recipe gets the server's --default-recipe; a margin with a
// block-scaled default asks for per-tensor scaling (CURRENT); a recipe asked for is kept.
TEST(DefaultRecipeTest, AnUnsetRecipeIsTheServersDefault) {
  const std::pair<core::ScalingMode, v1::ScalingRecipe> defaults[] = {
      {core::ScalingMode::kBlock, v1::BLOCK},
      {core::ScalingMode::kMxfp8, v1::MXFP8},
      {core::ScalingMode::kCurrent, v1::CURRENT}};
  for (const auto& [mode, wire] : defaults) {
    testing::TestServer server([mode = mode](rpc::ServiceOptions& o) { o.default_recipe = mode; });
    auto client = server.Connect();
    v1::ModuleSpec spec;
    spec.set_kind(v1::LINEAR);
    spec.set_in_features(40);
    spec.set_out_features(8);
    auto unset = client->CreateModule(spec);
    ASSERT_TRUE(unset.ok()) << unset.status();
    EXPECT_EQ(unset->spec().recipe().scaling(), wire) << core::ScalingModeName(mode);
    // It computes under that recipe: a training step runs.
    auto fwd = client->Forward(unset->module_id(), testing::Random({5, 40}), true);
    ASSERT_TRUE(fwd.ok()) << fwd.status();
    ASSERT_TRUE(client->Backward(fwd->context_id, testing::Random({5, 8})).ok());

    spec.mutable_recipe()->set_margin(1);
    auto margin = client->CreateModule(spec);
    ASSERT_TRUE(margin.ok()) << margin.status();
    EXPECT_EQ(margin->spec().recipe().scaling(), v1::CURRENT) << core::ScalingModeName(mode);

    spec.mutable_recipe()->set_margin(0);
    spec.mutable_recipe()->set_scaling(v1::DELAYED);
    auto asked = client->CreateModule(spec);
    ASSERT_TRUE(asked.ok()) << asked.status();
    EXPECT_EQ(asked->spec().recipe().scaling(), v1::DELAYED) << core::ScalingModeName(mode);
  }
}

TEST(KindDescriptionsTest, TheContractDescribesTheServersKinds) {
  ASSERT_EQ(client::ModuleKinds().size(), core::KindDescriptions().size());
  for (const core::KindDescription* kind : core::KindDescriptions()) {
    SCOPED_TRACE(kind->spec_name());
    v1::ModuleKind wire = v1::MODULE_KIND_UNSPECIFIED;
    ASSERT_TRUE(v1::ModuleKind_Parse(kind->spec_name(), &wire));
    const v1::KindDescription* d = client::DescribeKind(wire);
    ASSERT_NE(d, nullptr);
    EXPECT_EQ(d->class_name(), kind->name());
    // The exact wire sends FP8 input codes only to a kind that takes them as they arrive.
    EXPECT_EQ(d->fp8_input(), core::FindKindBySpecName(kind->spec_name())->UsesFp8Input());
    // And FP8 grad_output codes (with column sums) only to one whose backward takes them.
    EXPECT_EQ(d->fp8_grad_output(),
              core::FindKindBySpecName(kind->spec_name())->Fp8GradOutputRole().has_value());
    EXPECT_EQ(client::KindByName(d->cli_name()), wire);
    EXPECT_EQ(client::KindByName(kind->spec_name()), wire);
    const std::set<std::string> fields(d->spec_fields().begin(), d->spec_fields().end());
    std::set<std::string> expected;
    if (kind->spec_fields().ffn) expected.insert({"ffn_features", "activation"});
    if (kind->spec_fields().layernorm) {
      expected.insert(
          {"layernorm_eps", "zero_centered_gamma", "return_layernorm_output", "checkpoint"});
    }
    EXPECT_EQ(fields, expected);
    for (const std::string& f : fields) EXPECT_TRUE(client::KindReads(wire, f)) << f;
    EXPECT_FALSE(client::KindReads(wire, "in_features"));
    core::ModuleSpec spec;
    spec.kind = kind->kind();
    spec.in_features = 96;
    spec.out_features = 64;
    spec.ffn_features = 128;
    spec.bias = true;  // so every description has a comma after its widths
    std::vector<std::string> widths;
    for (const auto& [field, width] : client::KindWidths(rpc::SpecToProto(spec))) {
      widths.push_back(absl::StrCat(width));
    }
    const std::string described = core::DescribeModule(spec);
    EXPECT_EQ(described.find(absl::StrCat(kind->name(), " ", absl::StrJoin(widths, " -> "), ",")),
              0u)
        << described;
  }
  EXPECT_EQ(client::DescribeKind(v1::MODULE_KIND_UNSPECIFIED), nullptr);
  EXPECT_EQ(client::DescribeKind(v1::ModuleKind(99)), nullptr);
  EXPECT_FALSE(client::KindByName("conv2d").has_value());
  EXPECT_EQ(client::KindNames(), "linear, layernorm-linear, layernorm-mlp");
}

}  // namespace
}  // namespace gradwire
