// Hostile clients against the real service, probe by probe (docs/security.md). Two tenants share
// one server with tokens: alice attacks, bob is the bystander. Every probe checks
//   - the status code and a piece of its message (and that the message stays short),
//   - that the server still serves bob,
//   - that nothing changed: both modules' weights, versions and gradients, the live contexts, the
//     queues and the chunked bytes in flight.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "gradwire/v1/service.grpc.pb.h"
#include "server/rpc/auth.h"
#include "tests/service/specs.h"
#include "tests/service/test_server.h"

namespace gradwire::testing {
namespace {

using grpc::StatusCode;
using rpc::Authenticator;

constexpr char kAliceToken[] = "alice-0123456789abcdef";
constexpr char kBobToken[] = "bob-fedcba9876543210xyz";
const std::string kAlice = std::string("Bearer ") + kAliceToken;
const std::string kBob = std::string("Bearer ") + kBobToken;
constexpr int kIn = 64, kOut = 32;

v1::Tensor F32(std::vector<int64_t> shape, float fill_scale = 1.0f) {
  client::HostTensor t = Random(shape);
  v1::Tensor out;
  out.set_dtype(v1::F32);
  for (int64_t d : shape) out.add_shape(d);
  for (float& v : t.data) v *= fill_scale;
  out.set_data(std::string(reinterpret_cast<const char*>(t.data.data()), t.data.size() * 4));
  return out;
}

v1::Tensor Filled(std::vector<int64_t> shape, float value) {
  v1::Tensor out = F32(shape);
  std::vector<float> data(out.data().size() / 4, value);
  out.set_data(std::string(reinterpret_cast<const char*>(data.data()), data.size() * 4));
  return out;
}

v1::ModuleSpec LinearSpec(int in = kIn, int out = kOut) {
  return testing::LinearSpec(in, out, /*bias=*/true, /*seed=*/7);
}

// One hostile call and what it must get.
struct Probe {
  std::string name;
  std::function<grpc::Status()> run;
  StatusCode code;
  std::string message_has;
};

// Everything a probe must leave as it was.
struct Snapshot {
  std::string weights[2], grads[2];
  uint64_t versions[2] = {0, 0};
  int64_t live_contexts = 0;
  bool operator==(const Snapshot& o) const {
    return weights[0] == o.weights[0] && weights[1] == o.weights[1] && grads[0] == o.grads[0] &&
           grads[1] == o.grads[1] && versions[0] == o.versions[0] && versions[1] == o.versions[1] &&
           live_contexts == o.live_contexts;
  }
};

class AdversarialTest : public ::testing::TestWithParam<int> {
 public:
  static void SetUpTestSuite() {
    static auto auth = *Authenticator::FromEntries({{"alice", kAliceToken}, {"bob", kBobToken}});
    TestServerOptions o;
    o.authenticator = &auth;
    o.limits.max_tensor_elements = int64_t(1) << 22;
    o.context_limits.client_bytes = int64_t(1) << 20;
    o.configure = [](rpc::ServiceOptions& options) {
      options.quotas.parameter_bytes = int64_t(8) << 20;
      options.quotas.stream_bytes = int64_t(4) << 20;
      options.max_stream_bytes = int64_t(64) << 20;
      options.chunk_bytes = 64 << 10;
    };
    server_ = new TestServer(o);
    ASSERT_TRUE(server_->ok());
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(64 << 20);
    args.SetMaxSendMessageSize(64 << 20);
    stub_ = v1::Gradwire::NewStub(grpc::CreateCustomChannel(
                                      server_->address(), grpc::InsecureChannelCredentials(), args))
                .release();
    bob_module_ = Create(kBob);
    alice_module_ = Create(kAlice);
    bob_context_ = TrainingForward(kBob, bob_module_);
    alice_context_ = TrainingForward(kAlice, alice_module_);
    // Alice holds accumulated gradients too (ApplyGradients probes must keep them), and a second
    // context for the backward probes.
    const std::string spent = TrainingForward(kAlice, alice_module_);
    v1::BackwardRequest b;
    b.set_context_id(spent);
    *b.mutable_grad_output() = F32({4, kOut});
    v1::BackwardResponse r;
    ASSERT_TRUE(Unary(&v1::Gradwire::Stub::Backward, b, &r, kAlice).ok());
  }
  static void TearDownTestSuite() {
    delete stub_;
    delete server_;
  }

  static std::vector<Probe>& Probes();

 protected:
  template <typename Req, typename Resp>
  using Method = grpc::Status (v1::Gradwire::Stub::*)(grpc::ClientContext*, const Req&, Resp*);

  template <typename Req, typename Resp>
  static grpc::Status Unary(Method<Req, Resp> method, const Req& req, Resp* resp,
                            const std::string& auth) {
    grpc::ClientContext ctx;
    if (!auth.empty()) ctx.AddMetadata("authorization", auth);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    return (stub_->*method)(&ctx, req, resp);
  }
  template <typename Resp, typename Req>
  static grpc::Status Unary(Method<Req, Resp> method, const Req& req, const std::string& auth) {
    Resp resp;
    return Unary(method, req, &resp, auth);
  }

  static std::string Create(const std::string& auth) {
    v1::CreateModuleRequest req;
    *req.mutable_spec() = LinearSpec();
    v1::CreateModuleResponse resp;
    EXPECT_TRUE(Unary(&v1::Gradwire::Stub::CreateModule, req, &resp, auth).ok());
    return resp.module().module_id();
  }
  static std::string TrainingForward(const std::string& auth, const std::string& module) {
    v1::ForwardRequest req;
    req.set_module_id(module);
    req.set_training(true);
    *req.mutable_input() = F32({4, kIn});
    v1::ForwardResponse resp;
    EXPECT_TRUE(Unary(&v1::Gradwire::Stub::Forward, req, &resp, auth).ok());
    return resp.context_id();
  }

  // A chunked call written part by part, then half-closed; its final status.
  template <typename Part, typename Out, typename Open>
  static grpc::Status Chunked(Open open, const std::vector<Part>& parts, const std::string& auth) {
    grpc::ClientContext ctx;
    if (!auth.empty()) ctx.AddMetadata("authorization", auth);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    auto stream = open(&ctx);
    for (const Part& p : parts) {
      if (!stream->Write(p)) break;
    }
    stream->WritesDone();
    Out out;
    while (stream->Read(&out)) {
    }
    return stream->Finish();
  }
  static grpc::Status ForwardChunked(const std::vector<v1::ForwardRequestPart>& parts,
                                     const std::string& auth = kAlice) {
    return Chunked<v1::ForwardRequestPart, v1::ForwardResponsePart>(
        [](grpc::ClientContext* c) { return stub_->ForwardChunked(c); }, parts, auth);
  }
  static grpc::Status BackwardChunked(const std::vector<v1::BackwardRequestPart>& parts) {
    return Chunked<v1::BackwardRequestPart, v1::BackwardResponsePart>(
        [](grpc::ClientContext* c) { return stub_->BackwardChunked(c); }, parts, kAlice);
  }
  static grpc::Status SetWeightsChunked(const std::vector<v1::SetWeightsRequestPart>& parts) {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", kAlice);
    v1::SetWeightsResponse resp;
    auto stream = stub_->SetWeightsChunked(&ctx, &resp);
    for (const auto& p : parts) {
      if (!stream->Write(p)) break;
    }
    stream->WritesDone();
    return stream->Finish();
  }
  static grpc::Status GetWeightsChunked(const std::string& module) {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", kAlice);
    v1::GetWeightsRequest req;
    req.set_module_id(module);
    auto stream = stub_->GetWeightsChunked(&ctx, req);
    v1::GetWeightsResponsePart part;
    while (stream->Read(&part)) {
    }
    return stream->Finish();
  }
  // One Train request; its per-request status (the stream itself must end OK).
  static grpc::Status TrainOne(const v1::TrainRequest& req) {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", kAlice);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    auto stream = stub_->Train(&ctx);
    stream->Write(req);
    stream->WritesDone();
    v1::TrainResponse resp;
    const bool got = stream->Read(&resp);
    grpc::Status end = stream->Finish();
    if (!end.ok())
      return grpc::Status(StatusCode::DATA_LOSS, "stream failed: " + end.error_message());
    if (!got) return grpc::Status(StatusCode::DATA_LOSS, "no response");
    return grpc::Status(StatusCode(resp.code()), resp.message());
  }

  static Snapshot Take() {
    Snapshot s;
    const std::pair<std::string, std::string> owners[2] = {{bob_module_, kBob},
                                                           {alice_module_, kAlice}};
    for (int i = 0; i < 2; ++i) {
      v1::GetWeightsRequest w;
      w.set_module_id(owners[i].first);
      v1::GetWeightsResponse wr;
      EXPECT_TRUE(Unary(&v1::Gradwire::Stub::GetWeights, w, &wr, owners[i].second).ok());
      s.weights[i] = wr.SerializeAsString();
      s.versions[i] = wr.weight_version();
      v1::GetGradientsRequest g;
      g.set_module_id(owners[i].first);
      v1::GetGradientsResponse gr;
      EXPECT_TRUE(Unary(&v1::Gradwire::Stub::GetGradients, g, &gr, owners[i].second).ok());
      s.grads[i] = gr.SerializeAsString();
    }
    s.live_contexts = server_->host().contexts().live_contexts();
    return s;
  }

  static inline TestServer* server_ = nullptr;
  static inline v1::Gradwire::Stub* stub_ = nullptr;
  static inline std::string bob_module_, alice_module_, bob_context_, alice_context_;
};

v1::ForwardRequestPart ForwardHeader(const std::string& module, std::vector<int64_t> shape) {
  v1::ForwardRequestPart part;
  v1::ForwardRequest* h = part.mutable_header();
  h->set_module_id(module);
  h->mutable_input()->set_dtype(v1::F32);
  for (int64_t d : shape) h->mutable_input()->add_shape(d);
  return part;
}

v1::ForwardRequestPart Chunk(uint32_t tensor, uint64_t offset, size_t bytes) {
  v1::ForwardRequestPart part;
  part.mutable_chunk()->set_tensor(tensor);
  part.mutable_chunk()->set_offset(offset);
  part.mutable_chunk()->set_data(std::string(bytes, '\x01'));
  return part;
}

std::vector<Probe>& AdversarialTest::Probes() {
  static std::vector<Probe>* probes = [] {
    auto* p = new std::vector<Probe>;
    auto add = [&](std::string name, std::function<grpc::Status()> run, StatusCode code,
                   std::string has) {
      p->push_back({std::move(name), std::move(run), code, std::move(has)});
    };
    using S = v1::Gradwire::Stub;

    // --- auth: bad credentials on every kind of call ---
    const std::pair<std::string, std::string> bad_auth[] = {
        {"none", ""},
        {"wrong-token", "Bearer not-a-real-token-0000"},
        {"basic-scheme", "Basic YWxpY2U6cGFzcw=="},
        {"lowercase-bearer", std::string("bearer ") + kAliceToken},
        {"no-space", std::string("Bearer") + kAliceToken},
        {"16KiB-token", "Bearer " + std::string(16 << 10, 'a')},
    };
    for (const auto& [label, header] : bad_auth) {
      const std::string h = header;
      const std::string has = label == "16KiB-token"   ? "over the limit"
                              : label == "wrong-token" ? "not valid"
                                                       : "bearer token";
      add(
          "auth/" + label + "/ListModules",
          [h] {
            return Unary<v1::ListModulesResponse>(&S::ListModules, v1::ListModulesRequest(), h);
          },
          StatusCode::UNAUTHENTICATED, has);
      add(
          "auth/" + label + "/Forward",
          [h] {
            v1::ForwardRequest r;
            r.set_module_id(bob_module_);
            *r.mutable_input() = F32({2, kIn});
            return Unary<v1::ForwardResponse>(&S::Forward, r, h);
          },
          StatusCode::UNAUTHENTICATED, has);
      add(
          "auth/" + label + "/GetWeights",
          [h] {
            v1::GetWeightsRequest r;
            r.set_module_id(bob_module_);
            return Unary<v1::GetWeightsResponse>(&S::GetWeights, r, h);
          },
          StatusCode::UNAUTHENTICATED, has);
      add(
          "auth/" + label + "/CreateModule",
          [h] {
            v1::CreateModuleRequest r;
            *r.mutable_spec() = LinearSpec();
            return Unary<v1::CreateModuleResponse>(&S::CreateModule, r, h);
          },
          StatusCode::UNAUTHENTICATED, has);
      add(
          "auth/" + label + "/ForwardChunked",
          [h] {
            return ForwardChunked({ForwardHeader(bob_module_, {2, kIn}), Chunk(0, 0, 2 * kIn * 4)},
                                  h);
          },
          StatusCode::UNAUTHENTICATED, has);
    }

    // --- tenancy: alice reaches for bob's module and context ---
    add(
        "tenancy/Forward-training",
        [] {
          v1::ForwardRequest r;
          r.set_module_id(bob_module_);
          r.set_training(true);
          *r.mutable_input() = F32({2, kIn});
          return Unary<v1::ForwardResponse>(&S::Forward, r, kAlice);
        },
        StatusCode::NOT_FOUND, "is not a module");
    add(
        "tenancy/Forward-inference",
        [] {
          v1::ForwardRequest r;
          r.set_module_id(bob_module_);
          *r.mutable_input() = F32({2, kIn});
          return Unary<v1::ForwardResponse>(&S::Forward, r, kAlice);
        },
        StatusCode::NOT_FOUND, "is not a module");
    add(
        "tenancy/GetWeights",
        [] {
          v1::GetWeightsRequest r;
          r.set_module_id(bob_module_);
          return Unary<v1::GetWeightsResponse>(&S::GetWeights, r, kAlice);
        },
        StatusCode::NOT_FOUND, "is not a module");
    add(
        "tenancy/SetWeights",
        [] {
          v1::SetWeightsRequest r;
          r.set_module_id(bob_module_);
          auto* n = r.add_parameters();
          n->set_name("bias");
          *n->mutable_tensor() = F32({kOut});
          return Unary<v1::SetWeightsResponse>(&S::SetWeights, r, kAlice);
        },
        StatusCode::NOT_FOUND, "is not a module");
    add(
        "tenancy/ApplyGradients",
        [] {
          v1::ApplyGradientsRequest r;
          r.set_module_id(bob_module_);
          return Unary<v1::ApplyGradientsResponse>(&S::ApplyGradients, r, kAlice);
        },
        StatusCode::NOT_FOUND, "is not a module");
    add(
        "tenancy/GetGradients-zero",
        [] {
          v1::GetGradientsRequest r;
          r.set_module_id(bob_module_);
          r.set_zero(true);
          return Unary<v1::GetGradientsResponse>(&S::GetGradients, r, kAlice);
        },
        StatusCode::NOT_FOUND, "is not a module");
    add(
        "tenancy/DeleteModule",
        [] {
          v1::DeleteModuleRequest r;
          r.set_module_id(bob_module_);
          return Unary<v1::DeleteModuleResponse>(&S::DeleteModule, r, kAlice);
        },
        StatusCode::NOT_FOUND, "is not a module");
    add(
        "tenancy/Backward",
        [] {
          v1::BackwardRequest r;
          r.set_context_id(bob_context_);
          *r.mutable_grad_output() = F32({4, kOut});
          return Unary<v1::BackwardResponse>(&S::Backward, r, kAlice);
        },
        StatusCode::NOT_FOUND, "context_id");
    add(
        "tenancy/ReleaseContext",
        [] {
          v1::ReleaseContextRequest r;
          r.set_context_id(bob_context_);
          return Unary<v1::ReleaseContextResponse>(&S::ReleaseContext, r, kAlice);
        },
        StatusCode::NOT_FOUND, "context_id");
    add(
        "tenancy/ForwardChunked",
        [] {
          return ForwardChunked({ForwardHeader(bob_module_, {2, kIn}), Chunk(0, 0, 2 * kIn * 4)});
        },
        StatusCode::NOT_FOUND, "is not a module");
    add(
        "tenancy/BackwardChunked",
        [] {
          v1::BackwardRequestPart h;
          h.mutable_header()->set_context_id(bob_context_);
          h.mutable_header()->mutable_grad_output()->set_dtype(v1::F32);
          h.mutable_header()->mutable_grad_output()->add_shape(4);
          h.mutable_header()->mutable_grad_output()->add_shape(kOut);
          return BackwardChunked({h});
        },
        StatusCode::NOT_FOUND, "not a live context");
    add(
        "tenancy/GetWeightsChunked", [] { return GetWeightsChunked(bob_module_); },
        StatusCode::NOT_FOUND, "is not a module");
    add(
        "tenancy/SetWeightsChunked",
        [] {
          v1::SetWeightsRequestPart h;
          h.mutable_header()->set_module_id(bob_module_);
          return SetWeightsChunked({h});
        },
        StatusCode::NOT_FOUND, "is not a module");
    add(
        "tenancy/Train-forward",
        [] {
          v1::TrainRequest r;
          r.mutable_forward()->set_module_id(bob_module_);
          r.mutable_forward()->set_training(true);
          *r.mutable_forward()->mutable_input() = F32({2, kIn});
          return TrainOne(r);
        },
        StatusCode::NOT_FOUND, "is not a module");
    add(
        "tenancy/Train-backward",
        [] {
          v1::TrainRequest r;
          r.mutable_backward()->set_context_id(bob_context_);
          *r.mutable_backward()->mutable_grad_output() = F32({4, kOut});
          return TrainOne(r);
        },
        StatusCode::NOT_FOUND, "context_id");
    add(
        "tenancy/Train-release",
        [] {
          v1::TrainRequest r;
          r.mutable_release()->set_context_id(bob_context_);
          return TrainOne(r);
        },
        StatusCode::NOT_FOUND, "context_id");

    // --- ids: malformed module and context ids, bounded in the answer ---
    const std::pair<std::string, std::string> bad_ids[] = {
        {"word", "nope"},
        {"31-hex", std::string(31, 'a')},
        {"33-hex", std::string(33, 'a')},
        {"uppercase", std::string(32, 'A')},
        {"8KiB", std::string(8 << 10, 'b')},
        {"newline", "0123456789abcdef\nforged log line"},
    };
    for (const auto& [label, value] : bad_ids) {
      const std::string id = value;
      add(
          "ids/module/" + label + "/Forward",
          [id] {
            v1::ForwardRequest r;
            r.set_module_id(id);
            *r.mutable_input() = F32({2, kIn});
            return Unary<v1::ForwardResponse>(&S::Forward, r, kAlice);
          },
          StatusCode::INVALID_ARGUMENT, "32 lowercase hex digits");
      add(
          "ids/module/" + label + "/GetWeights",
          [id] {
            v1::GetWeightsRequest r;
            r.set_module_id(id);
            return Unary<v1::GetWeightsResponse>(&S::GetWeights, r, kAlice);
          },
          StatusCode::INVALID_ARGUMENT, "32 lowercase hex digits");
      add(
          "ids/module/" + label + "/DeleteModule",
          [id] {
            v1::DeleteModuleRequest r;
            r.set_module_id(id);
            return Unary<v1::DeleteModuleResponse>(&S::DeleteModule, r, kAlice);
          },
          StatusCode::INVALID_ARGUMENT, "32 lowercase hex digits");
      add(
          "ids/context/" + label + "/Backward",
          [id] {
            v1::BackwardRequest r;
            r.set_context_id(id);
            *r.mutable_grad_output() = F32({4, kOut});
            return Unary<v1::BackwardResponse>(&S::Backward, r, kAlice);
          },
          StatusCode::INVALID_ARGUMENT, "32 lowercase hex digits");
      add(
          "ids/context/" + label + "/ReleaseContext",
          [id] {
            v1::ReleaseContextRequest r;
            r.set_context_id(id);
            return Unary<v1::ReleaseContextResponse>(&S::ReleaseContext, r, kAlice);
          },
          StatusCode::INVALID_ARGUMENT, "32 lowercase hex digits");
    }
    add(
        "ids/module/unknown",
        [] {
          v1::GetWeightsRequest r;
          r.set_module_id(std::string(32, '0'));
          return Unary<v1::GetWeightsResponse>(&S::GetWeights, r, kAlice);
        },
        StatusCode::NOT_FOUND, "is not a module");
    add(
        "ids/context/unknown",
        [] {
          v1::ReleaseContextRequest r;
          r.set_context_id(std::string(32, '0'));
          return Unary<v1::ReleaseContextResponse>(&S::ReleaseContext, r, kAlice);
        },
        StatusCode::NOT_FOUND, "context_id");
    add(
        "ids/module/empty",
        [] {
          v1::ApplyGradientsRequest r;
          return Unary<v1::ApplyGradientsResponse>(&S::ApplyGradients, r, kAlice);
        },
        StatusCode::INVALID_ARGUMENT, "module_id is required");

    // --- names ---
    const std::pair<std::string, std::string> bad_names[] = {
        {"257-chars", std::string(257, 'n')},     {"8MiB", std::string(8 << 20, 'n')},
        {"newline", "model\nlevel=error forged"}, {"utf8", "mod\xc3\xa8le"},
        {"nul", std::string("a\0b", 3)},
    };
    for (const auto& [label, value] : bad_names) {
      const std::string name = value;
      add(
          "names/" + label,
          [name] {
            v1::CreateModuleRequest r;
            *r.mutable_spec() = LinearSpec();
            r.mutable_spec()->set_name(name);
            return Unary<v1::CreateModuleResponse>(&S::CreateModule, r, kAlice);
          },
          StatusCode::INVALID_ARGUMENT, "spec.name");
    }

    // --- specs ---
    auto spec_probe = [&](std::string label, std::function<void(v1::ModuleSpec*)> edit,
                          std::string has) {
      add(
          "specs/" + label,
          [edit] {
            v1::CreateModuleRequest r;
            *r.mutable_spec() = LinearSpec();
            edit(r.mutable_spec());
            return Unary<v1::CreateModuleResponse>(&S::CreateModule, r, kAlice);
          },
          StatusCode::INVALID_ARGUMENT, std::move(has));
    };
    spec_probe(
        "kind-unset", [](v1::ModuleSpec* s) { s->set_kind(v1::ModuleKind(0)); }, "spec.kind");
    spec_probe(
        "kind-99", [](v1::ModuleSpec* s) { s->set_kind(v1::ModuleKind(99)); }, "spec.kind");
    spec_probe(
        "in-0", [](v1::ModuleSpec* s) { s->set_in_features(0); }, "spec.in_features");
    spec_probe(
        "in-huge", [](v1::ModuleSpec* s) { s->set_in_features(1 << 20); }, "spec.in_features");
    spec_probe(
        "out-negative", [](v1::ModuleSpec* s) { s->set_out_features(-5); }, "spec.out_features");
    spec_probe(
        "mlp-ffn-0", [](v1::ModuleSpec* s) { s->set_kind(v1::LAYERNORM_MLP); },
        "spec.ffn_features");
    spec_probe(
        "activation-99", [](v1::ModuleSpec* s) { s->set_activation(v1::Activation(99)); },
        "spec.activation");
    spec_probe(
        "scaling-7",
        [](v1::ModuleSpec* s) { s->mutable_recipe()->set_scaling(v1::ScalingRecipe(7)); },
        "spec.recipe.scaling");
    spec_probe(
        "amax-algo-9",
        [](v1::ModuleSpec* s) {
          s->mutable_recipe()->set_amax_compute_algo(v1::AmaxComputeAlgo(9));
        },
        "amax_compute_algo");
    spec_probe(
        "sgd-lr-negative",
        [](v1::ModuleSpec* s) { s->mutable_optimizer()->mutable_sgd()->set_learning_rate(-1); },
        "learning_rate");
    spec_probe(
        "adamw-beta1-1.5",
        [](v1::ModuleSpec* s) {
          s->mutable_optimizer()->mutable_adamw()->set_learning_rate(1e-3f);
          s->mutable_optimizer()->mutable_adamw()->set_beta1(1.5f);
        },
        "beta1");
    spec_probe(
        "layernorm-eps-nan",
        [](v1::ModuleSpec* s) {
          s->set_kind(v1::LAYERNORM_LINEAR);
          s->set_layernorm_eps(std::nanf(""));
        },
        "layernorm_eps");
    add(
        "specs/missing",
        [] {
          return Unary<v1::CreateModuleResponse>(&S::CreateModule, v1::CreateModuleRequest(),
                                                 kAlice);
        },
        StatusCode::INVALID_ARGUMENT, "spec is required");

    // --- tensors, on alice's own module and context ---
    auto forward_probe = [&](std::string label, std::function<void(v1::ForwardRequest*)> edit,
                             StatusCode code, std::string has) {
      add(
          "tensors/forward/" + label,
          [edit] {
            v1::ForwardRequest r;
            r.set_module_id(alice_module_);
            r.set_training(true);
            *r.mutable_input() = F32({2, kIn});
            edit(&r);
            return Unary<v1::ForwardResponse>(&S::Forward, r, kAlice);
          },
          code, std::move(has));
    };
    forward_probe(
        "dtype-unset",
        [](v1::ForwardRequest* r) { r->mutable_input()->set_dtype(v1::DTYPE_UNSPECIFIED); },
        StatusCode::INVALID_ARGUMENT, "dtype");
    forward_probe(
        "width",
        [](v1::ForwardRequest* r) {
          *r->mutable_input() = F32({2, kIn + 1});
        },
        StatusCode::INVALID_ARGUMENT, "in_features");
    forward_probe(
        "data-short", [](v1::ForwardRequest* r) { r->mutable_input()->mutable_data()->resize(7); },
        StatusCode::INVALID_ARGUMENT, "input");
    forward_probe(
        "negative-dim", [](v1::ForwardRequest* r) { r->mutable_input()->set_shape(0, -2); },
        StatusCode::INVALID_ARGUMENT, "input");
    forward_probe(
        "no-shape", [](v1::ForwardRequest* r) { r->mutable_input()->clear_shape(); },
        StatusCode::INVALID_ARGUMENT, "input");
    forward_probe(
        "nan",
        [](v1::ForwardRequest* r) {
          *r->mutable_input() = Filled({2, kIn}, std::nanf(""));
        },
        StatusCode::INVALID_ARGUMENT, "finite");
    forward_probe(
        "inf",
        [](v1::ForwardRequest* r) {
          *r->mutable_input() = Filled({2, kIn}, std::numeric_limits<float>::infinity());
        },
        StatusCode::INVALID_ARGUMENT, "finite");
    forward_probe(
        "fp8-scale-inv-0",
        [](v1::ForwardRequest* r) {
          r->mutable_input()->set_dtype(v1::FP8_E4M3);
          r->mutable_input()->set_data(std::string(2 * kIn, '\x10'));
          r->mutable_input()->set_scale_inv(0.0f);
        },
        StatusCode::INVALID_ARGUMENT, "scale_inv");
    forward_probe(
        "elements",
        [](v1::ForwardRequest* r) {
          *r->mutable_input() = F32({int64_t(1) << 17, kIn});  // 2^23 elements, over 2^22
        },
        StatusCode::RESOURCE_EXHAUSTED, "--max-tensor-elements");
    forward_probe(
        "output-dtype-99", [](v1::ForwardRequest* r) { r->set_output_dtype(v1::DType(99)); },
        StatusCode::INVALID_ARGUMENT, "output_dtype");
    forward_probe(
        "context-quota",
        [](v1::ForwardRequest* r) {
          *r->mutable_input() = F32({32768, kIn});  // several MiB saved, over the 1 MiB quota
        },
        StatusCode::RESOURCE_EXHAUSTED, "--max-context-bytes-per-client");
    auto backward_probe = [&](std::string label, std::function<void(v1::BackwardRequest*)> edit,
                              StatusCode code, std::string has) {
      add(
          "tensors/backward/" + label,
          [edit] {
            v1::BackwardRequest r;
            r.set_context_id(alice_context_);
            *r.mutable_grad_output() = F32({4, kOut});
            edit(&r);
            return Unary<v1::BackwardResponse>(&S::Backward, r, kAlice);
          },
          code, std::move(has));
    };
    backward_probe(
        "overflow-3e38",
        [](v1::BackwardRequest* r) {
          *r->mutable_grad_output() = Filled({4, kOut}, 3e38f);
        },
        StatusCode::OUT_OF_RANGE, "non-finite");
    backward_probe(
        "shape",
        [](v1::BackwardRequest* r) {
          *r->mutable_grad_output() = F32({5, kOut});
        },
        StatusCode::INVALID_ARGUMENT, "grad_output");
    backward_probe(
        "nan",
        [](v1::BackwardRequest* r) {
          *r->mutable_grad_output() = Filled({4, kOut}, std::nanf(""));
        },
        StatusCode::INVALID_ARGUMENT, "finite");
    backward_probe(
        "missing", [](v1::BackwardRequest* r) { r->clear_grad_output(); },
        StatusCode::INVALID_ARGUMENT, "grad_output is required");
    backward_probe(
        "grad-input-dtype-fp8-bogus",
        [](v1::BackwardRequest* r) { r->set_grad_input_dtype(v1::DType(42)); },
        StatusCode::INVALID_ARGUMENT, "grad_input_dtype");

    // --- limits and quotas ---
    add(
        "quota/parameters",
        [] {
          v1::CreateModuleRequest r;
          *r.mutable_spec() = LinearSpec(2048, 2048);  // 16 MiB of fp32, over 8 MiB
          return Unary<v1::CreateModuleResponse>(&S::CreateModule, r, kAlice);
        },
        StatusCode::RESOURCE_EXHAUSTED, "--max-parameter-bytes-per-client");
    auto lr_probe = [&](std::string label, float lr, StatusCode code, std::string has) {
      add(
          "limits/apply-lr-" + label,
          [lr] {
            v1::ApplyGradientsRequest r;
            r.set_module_id(alice_module_);
            r.set_learning_rate(lr);
            return Unary<v1::ApplyGradientsResponse>(&S::ApplyGradients, r, kAlice);
          },
          code, std::move(has));
    };
    lr_probe("3e38", 3e38f, StatusCode::OUT_OF_RANGE, "non-finite");
    lr_probe("inf", std::numeric_limits<float>::infinity(), StatusCode::INVALID_ARGUMENT,
             "learning_rate");
    lr_probe("nan", std::nanf(""), StatusCode::INVALID_ARGUMENT, "learning_rate");
    lr_probe("negative", -0.5f, StatusCode::INVALID_ARGUMENT, "learning_rate");
    auto set_probe = [&](std::string label, std::string name, v1::Tensor t, std::string has) {
      add(
          "limits/set-weights-" + label,
          [name, t] {
            v1::SetWeightsRequest r;
            r.set_module_id(alice_module_);
            auto* n = r.add_parameters();
            n->set_name(name);
            *n->mutable_tensor() = t;
            return Unary<v1::SetWeightsResponse>(&S::SetWeights, r, kAlice);
          },
          StatusCode::INVALID_ARGUMENT, std::move(has));
    };
    set_probe("inf", "bias", Filled({kOut}, std::numeric_limits<float>::infinity()), "finite");
    set_probe("unknown-name", "gamma", F32({kOut}), "not a parameter");
    set_probe("shape", "weight", F32({kOut, kIn + 1}), "shape");
    add(
        "limits/set-weights-empty",
        [] {
          v1::SetWeightsRequest r;
          r.set_module_id(alice_module_);
          return Unary<v1::SetWeightsResponse>(&S::SetWeights, r, kAlice);
        },
        StatusCode::INVALID_ARGUMENT, "empty");

    // --- chunks ---
    add(
        "chunks/chunk-first", [] { return ForwardChunked({Chunk(0, 0, 16)}); },
        StatusCode::INVALID_ARGUMENT, "must be the header");
    add(
        "chunks/header-twice",
        [] {
          return ForwardChunked(
              {ForwardHeader(alice_module_, {2, kIn}), ForwardHeader(alice_module_, {2, kIn})});
        },
        StatusCode::INVALID_ARGUMENT, "twice");
    add(
        "chunks/offset-gap",
        [] {
          return ForwardChunked({ForwardHeader(alice_module_, {2, kIn}), Chunk(0, 8, 16)});
        },
        StatusCode::INVALID_ARGUMENT, "out of order");
    add(
        "chunks/wrong-tensor",
        [] {
          return ForwardChunked({ForwardHeader(alice_module_, {2, kIn}), Chunk(1, 0, 16)});
        },
        StatusCode::INVALID_ARGUMENT, "chunk for tensor 1");
    add(
        "chunks/past-end",
        [] {
          return ForwardChunked(
              {ForwardHeader(alice_module_, {2, kIn}), Chunk(0, 0, 2 * kIn * 4 + 4)});
        },
        StatusCode::INVALID_ARGUMENT, "past its end");
    add(
        "chunks/data-in-header",
        [] {
          auto h = ForwardHeader(alice_module_, {2, kIn});
          h.mutable_header()->mutable_input()->set_data("xyz");
          return ForwardChunked({h});
        },
        StatusCode::INVALID_ARGUMENT, "must be empty");
    add(
        "chunks/ended-early",
        [] {
          return ForwardChunked({ForwardHeader(alice_module_, {2, kIn}), Chunk(0, 0, 64)});
        },
        StatusCode::INVALID_ARGUMENT, "ended early");
    add(
        "chunks/header-width",
        [] {
          return ForwardChunked({ForwardHeader(alice_module_, {2, kIn + 3})});
        },
        StatusCode::INVALID_ARGUMENT, "in_features");
    add(
        "chunks/header-elements",
        [] {
          return ForwardChunked({ForwardHeader(alice_module_, {int64_t(1) << 30, kIn})});
        },
        StatusCode::RESOURCE_EXHAUSTED, "--max-tensor-elements");
    add(
        "chunks/stream-quota",
        [] {
          // 8 MiB declared: within the element limit, over the 4 MiB in-flight quota.
          return ForwardChunked({ForwardHeader(alice_module_, {32768, kIn})});
        },
        StatusCode::RESOURCE_EXHAUSTED, "--max-stream-bytes-per-client");
    add(
        "chunks/set-weights-unknown-name",
        [] {
          v1::SetWeightsRequestPart h;
          h.mutable_header()->set_module_id(alice_module_);
          auto* n = h.mutable_header()->add_parameters();
          n->set_name("gamma");
          n->mutable_tensor()->set_dtype(v1::F32);
          n->mutable_tensor()->add_shape(kOut);
          return SetWeightsChunked({h});
        },
        StatusCode::INVALID_ARGUMENT, "not a parameter");
    add(
        "chunks/set-weights-shape",
        [] {
          v1::SetWeightsRequestPart h;
          h.mutable_header()->set_module_id(alice_module_);
          auto* n = h.mutable_header()->add_parameters();
          n->set_name("weight");
          n->mutable_tensor()->set_dtype(v1::F32);
          n->mutable_tensor()->add_shape(1 << 20);
          n->mutable_tensor()->add_shape(1 << 10);
          return SetWeightsChunked({h});
        },
        StatusCode::INVALID_ARGUMENT, "the shape must be");
    add(
        "chunks/backward-unknown-context",
        [] {
          v1::BackwardRequestPart h;
          h.mutable_header()->set_context_id(std::string(32, 'f'));
          return BackwardChunked({h});
        },
        StatusCode::NOT_FOUND, "not a live context");
    add(
        "chunks/backward-width",
        [] {
          v1::BackwardRequestPart h;
          h.mutable_header()->set_context_id(alice_context_);
          h.mutable_header()->mutable_grad_output()->set_dtype(v1::F32);
          h.mutable_header()->mutable_grad_output()->add_shape(4);
          h.mutable_header()->mutable_grad_output()->add_shape(kOut * 2);
          return BackwardChunked({h});
        },
        StatusCode::INVALID_ARGUMENT, "out_features");

    // --- streams ---
    add(
        "streams/no-op", [] { return TrainOne(v1::TrainRequest()); }, StatusCode::INVALID_ARGUMENT,
        "set forward, backward or release");
    add(
        "streams/bad-module-id",
        [] {
          v1::TrainRequest r;
          r.mutable_forward()->set_module_id("../../etc");
          return TrainOne(r);
        },
        StatusCode::INVALID_ARGUMENT, "32 lowercase hex digits");
    add(
        "streams/unknown-context",
        [] {
          v1::TrainRequest r;
          r.mutable_backward()->set_context_id(std::string(32, 'e'));
          *r.mutable_backward()->mutable_grad_output() = F32({4, kOut});
          return TrainOne(r);
        },
        StatusCode::NOT_FOUND, "context_id");
    add(
        "streams/overflow-backward",
        [] {
          v1::TrainRequest r;
          r.mutable_backward()->set_context_id(alice_context_);
          *r.mutable_backward()->mutable_grad_output() = Filled({4, kOut}, 3e38f);
          return TrainOne(r);
        },
        StatusCode::OUT_OF_RANGE, "non-finite");
    add(
        "streams/nan-forward",
        [] {
          v1::TrainRequest r;
          r.mutable_forward()->set_module_id(alice_module_);
          r.mutable_forward()->set_training(true);
          *r.mutable_forward()->mutable_input() = Filled({2, kIn}, std::nanf(""));
          return TrainOne(r);
        },
        StatusCode::INVALID_ARGUMENT, "finite");
    return p;
  }();
  return *probes;
}

TEST(AdversarialSuite, HasAtLeastAHundredProbes) {
  EXPECT_GE(AdversarialTest::Probes().size(), 100u);
}

TEST_P(AdversarialTest, IsRefusedAndChangesNothing) {
  const Probe& probe = Probes().at(size_t(GetParam()));
  SCOPED_TRACE(probe.name);
  const Snapshot before = Take();
  const grpc::Status status = probe.run();
  EXPECT_EQ(status.error_code(), probe.code) << status.error_message();
  EXPECT_NE(status.error_message().find(probe.message_has), std::string::npos)
      << "message: " << status.error_message();
  // Bounded: errors quote a prefix of a bad value, never all of it.
  EXPECT_LT(status.error_message().size(), 600u);
  EXPECT_EQ(status.error_message().find('\n'), std::string::npos);
  // Bob is still served.
  v1::ForwardRequest f;
  f.set_module_id(bob_module_);
  *f.mutable_input() = F32({2, kIn});
  v1::ForwardResponse fr;
  ASSERT_TRUE(Unary(&v1::Gradwire::Stub::Forward, f, &fr, kBob).ok());
  // Nothing changed, and nothing stays counted.
  EXPECT_TRUE(Take() == before);
  EXPECT_TRUE(WaitFor([] {
    for (const rpc::ClientUsage& u : server_->service().Usage()) {
      if (u.queued != 0 || u.stream_bytes != 0) return false;
    }
    return true;
  }));
}

INSTANTIATE_TEST_SUITE_P(Probes, AdversarialTest,
                         ::testing::Range(0, int(AdversarialTest::Probes().size())),
                         [](const ::testing::TestParamInfo<int>& info) {
                           std::string name = AdversarialTest::Probes()[size_t(info.param)].name;
                           for (char& c : name) {
                             if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
                           }
                           return name;
                         });

}  // namespace
}  // namespace gradwire::testing
