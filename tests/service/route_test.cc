// Routable calls: a client names the module of each call in the "gradwire-route" header, so that a
// proxy in front of several servers sends each module's calls to one of them
// (docs/scaling-out.md). The server takes a client's proposed module id, and refuses a call whose
// header names another module than the call is about, changing nothing.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "gradwire/client/client.h"
#include "specs.h"
#include "test_server.h"

namespace gradwire {
namespace {

using client::HostTensor;
using client::kRouteHeader;
using testing::Random;

constexpr int64_t kIn = 24, kOut = 16;

bool IsId(const std::string& id) {
  if (id.size() != 32) return false;
  for (char c : id) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

class RouteTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(server_.ok());
    c_ = server_.Connect();
    a_ = Create();
    b_ = Create();
  }
  std::string Create() {
    auto info = c_->CreateModule(testing::LinearSpec(kIn, kOut, true, 5));
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->module_id() : "";
  }
  // A client context as the library prepares one, with `route` as the header ("": none).
  void Prepare(grpc::ClientContext* ctx, const std::string& route) {
    c_->PrepareContext(ctx, "test", route);
  }
  using Stub = v1::Gradwire::Stub;
  // The unary `method` with `req`, routed by `route`; its response into `resp` when given.
  template <typename Req, typename Resp>
  grpc::Status Call(grpc::Status (Stub::*method)(grpc::ClientContext*, const Req&, Resp*),
                    const Req& req, const std::string& route, Resp* resp = nullptr) {
    grpc::ClientContext ctx;
    Prepare(&ctx, route);
    Resp local;
    return (c_->stub().*method)(&ctx, req, resp != nullptr ? resp : &local);
  }
  grpc::Status CreateRaw(const std::string& proposed, const std::string& route,
                         v1::CreateModuleResponse* resp) {
    v1::CreateModuleRequest req;
    *req.mutable_spec() = testing::LinearSpec(kIn, kOut, false, 9);
    req.set_module_id(proposed);
    return Call(&Stub::CreateModule, req, route, resp);
  }
  grpc::Status Forward(const std::string& module, bool training, const std::string& route,
                       v1::ForwardResponse* resp) {
    v1::ForwardRequest req;
    req.set_module_id(module);
    *req.mutable_input() = client::ToWire(Random({3, kIn}), client::WireDType::kF32);
    req.set_training(training);
    return Call(&Stub::Forward, req, route, resp);
  }
  grpc::Status Backward(const std::string& context, const std::string& route) {
    v1::BackwardRequest req;
    req.set_context_id(context);
    *req.mutable_grad_output() = client::ToWire(Random({3, kOut}), client::WireDType::kF32);
    return Call(&Stub::Backward, req, route);
  }
  std::vector<std::string> Modules() {
    std::vector<std::string> ids;
    auto list = c_->ListModules();
    EXPECT_TRUE(list.ok()) << list.status();
    if (list.ok()) {
      for (const auto& m : *list) ids.push_back(m.module_id());
    }
    return ids;
  }
  // A refusal of a call routed by `route` about `module`: INVALID_ARGUMENT naming the header
  // and both ids.
  static void ExpectMisrouted(const grpc::Status& s, const std::string& route,
                              const std::string& module, const char* what) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << what << ": " << s.error_message();
    const std::string& m = s.error_message();
    EXPECT_NE(m.find(kRouteHeader), std::string::npos) << what << ": " << m;
    EXPECT_NE(m.find(route), std::string::npos) << what << ": " << m;
    EXPECT_NE(m.find(module), std::string::npos) << what << ": " << m;
  }

  testing::TestServer server_;
  std::unique_ptr<client::Client> c_;
  std::string a_, b_;
};

TEST_F(RouteTest, TheClientChoosesTheModuleIdAndTheServerKeepsIt) {
  EXPECT_TRUE(IsId(a_)) << a_;
  EXPECT_NE(a_, b_);
  const std::string proposed = client::NewRandomId();
  v1::CreateModuleResponse resp;
  grpc::Status s = CreateRaw(proposed, proposed, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.module().module_id(), proposed);
  // Without a header as well (a direct connection).
  const std::string unrouted = client::NewRandomId();
  ASSERT_TRUE(CreateRaw(unrouted, "", &resp).ok());
  EXPECT_EQ(resp.module().module_id(), unrouted);
  // And without a proposal the server makes one.
  ASSERT_TRUE(CreateRaw("", "", &resp).ok());
  EXPECT_TRUE(IsId(resp.module().module_id()));
  EXPECT_EQ(Modules().size(), 5u);
}

TEST_F(RouteTest, AProposedIdThatIsTakenOrMalformedIsRefusedAndCreatesNothing) {
  v1::CreateModuleResponse resp;
  grpc::Status s = CreateRaw(a_, a_, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ALREADY_EXISTS) << s.error_message();
  EXPECT_NE(s.error_message().find(a_), std::string::npos) << s.error_message();
  for (const std::string& bad :
       {std::string("ABCDEF0123456789ABCDEF0123456789"), std::string("short"), std::string(33, 'a'),
        std::string("../../etc/passwd0123456789abcdef")}) {
    s = CreateRaw(bad, "", &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << bad;
    EXPECT_NE(s.error_message().find("module_id"), std::string::npos) << s.error_message();
  }
  EXPECT_EQ(Modules().size(), 2u);
  // The module whose id was proposed again is untouched: still its first spec's.
  auto weights = c_->GetWeights(a_);
  ASSERT_TRUE(weights.ok()) << weights.status();
  EXPECT_NE(weights->Find("bias"), nullptr);  // LinearSpec(..., true, 5), not the proposal's
}

TEST_F(RouteTest, ARoutedCreateMustProposeTheIdItIsRoutedBy) {
  v1::CreateModuleResponse resp;
  const std::string route = client::NewRandomId();
  grpc::Status s = CreateRaw("", route, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("must propose its module_id"), std::string::npos)
      << s.error_message();
  const std::string other = client::NewRandomId();
  ExpectMisrouted(CreateRaw(other, route, &resp), route, other, "CreateModule");
  EXPECT_EQ(Modules().size(), 2u);
}

TEST_F(RouteTest, ACallRoutedByAnotherModuleIsRefusedAndChangesNothing) {
  auto before = c_->GetWeights(a_);
  ASSERT_TRUE(before.ok()) << before.status();
  v1::ForwardResponse fwd;
  ExpectMisrouted(Forward(a_, true, b_, &fwd), b_, a_, "Forward");
  ExpectMisrouted(Forward(a_, false, b_, &fwd), b_, a_, "inference Forward");
  EXPECT_EQ(server_.host().Stats().live_contexts, 0);
  // A route that is not an id at all is no module's either.
  ExpectMisrouted(Forward(a_, false, "not \"a\" module", &fwd), "not", a_, "junk route");
  // The library never sends what gRPC cannot carry in a header (it would abort the process):
  // such an id goes without one, and the server names what is wrong with it.
  auto bad = c_->Forward("not an id\n", Random({3, kIn}), false);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();

  // A training context of a; its backward and release routed by b are refused, and it stays.
  ASSERT_TRUE(Forward(a_, true, a_, &fwd).ok());
  const std::string context = fwd.context_id();
  ASSERT_FALSE(context.empty());
  ExpectMisrouted(Backward(context, b_), b_, a_, "Backward");
  v1::ReleaseContextRequest release;
  release.set_context_id(context);
  ExpectMisrouted(Call(&Stub::ReleaseContext, release, b_), b_, a_, "ReleaseContext");
  EXPECT_EQ(server_.host().Stats().live_contexts, 1);

  // The module calls.
  v1::ApplyGradientsRequest apply;
  apply.set_module_id(a_);
  ExpectMisrouted(Call(&Stub::ApplyGradients, apply, b_), b_, a_, "ApplyGradients");
  v1::SetWeightsRequest set;
  set.set_module_id(a_);
  v1::NamedTensor* p = set.add_parameters();
  p->set_name("bias");
  *p->mutable_tensor() = client::ToWire(Random({kOut}), client::WireDType::kF32);
  ExpectMisrouted(Call(&Stub::SetWeights, set, b_), b_, a_, "SetWeights");
  v1::GetWeightsRequest get;
  get.set_module_id(a_);
  ExpectMisrouted(Call(&Stub::GetWeights, get, b_), b_, a_, "GetWeights");
  v1::KeepAliveRequest keep;
  keep.add_module_ids(a_);
  ExpectMisrouted(Call(&Stub::KeepAlive, keep, b_), b_, a_, "KeepAlive");
  v1::DeleteModuleRequest del;
  del.set_module_id(a_);
  ExpectMisrouted(Call(&Stub::DeleteModule, del, b_), b_, a_, "DeleteModule");

  // Nothing changed: a is there with its weights and version, and its context runs its backward
  // when routed right.
  EXPECT_EQ(Modules().size(), 2u);
  auto after = c_->GetWeights(a_);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->weight_version, before->weight_version);
  ASSERT_EQ(after->tensors.size(), before->tensors.size());
  for (size_t i = 0; i < after->tensors.size(); ++i) {
    EXPECT_EQ(after->tensors[i].second.data, before->tensors[i].second.data)
        << after->tensors[i].first;
  }
  const grpc::Status right = Backward(context, a_);
  EXPECT_TRUE(right.ok()) << right.error_message();
  EXPECT_EQ(server_.host().Stats().live_contexts, 0);
}

// The calls not about one module (server info, health, the module list) take any header.
TEST_F(RouteTest, ServerWideCallsIgnoreTheHeader) {
  v1::ListModulesResponse resp;
  ASSERT_TRUE(Call(&Stub::ListModules, v1::ListModulesRequest(), b_, &resp).ok());
  EXPECT_EQ(resp.modules_size(), 2);
  EXPECT_TRUE(Call(&Stub::GetServerInfo, v1::GetServerInfoRequest(), "anything").ok());
}

// A Train stream routed by one module: its requests about that module run, one about another
// is refused on its own and the stream goes on.
TEST_F(RouteTest, ATrainStreamServesOnlyTheModuleItIsRoutedBy) {
  auto stream = c_->OpenTrainStream(a_);
  ASSERT_TRUE(stream->SendForward(1, b_, Random({2, kIn}), true));
  ASSERT_TRUE(stream->SendForward(2, a_, Random({2, kIn}), true));
  std::string context;
  for (int i = 0; i < 2; ++i) {
    auto resp = stream->Read();
    ASSERT_TRUE(resp.has_value());
    if (resp->request_id() == 1) {
      EXPECT_EQ(resp->code(), int(grpc::StatusCode::INVALID_ARGUMENT)) << resp->message();
      EXPECT_NE(resp->message().find(kRouteHeader), std::string::npos);
    } else {
      ASSERT_EQ(resp->code(), 0) << resp->message();
      context = resp->forward().context_id();
    }
  }
  ASSERT_FALSE(context.empty());
  ASSERT_TRUE(stream->SendBackward(3, context, Random({2, kOut})));
  auto back = stream->Read();
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(back->code(), 0) << back->message();
  EXPECT_TRUE(stream->Finish().ok());
}

// The client library routes what it sends: its forwards, backwards (by the context's module),
// releases, weights and deletes all pass the server's check, and a context it did not make goes
// without a header.
TEST_F(RouteTest, TheClientLibraryRoutesEveryCallItMakes) {
  auto fwd = c_->Forward(a_, Random({4, kIn}), true);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  EXPECT_EQ(c_->ModuleOfContext(fwd->context_id), a_);
  auto dx = c_->Backward(fwd->context_id, Random({4, kOut}));
  ASSERT_TRUE(dx.ok()) << dx.status();
  EXPECT_EQ(c_->ModuleOfContext(fwd->context_id), "");  // consumed: forgotten
  auto again = c_->Forward(b_, Random({4, kIn}), true);
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(c_->ReleaseContext(again->context_id).ok());
  EXPECT_TRUE(c_->ApplyGradients(a_).ok());
  EXPECT_TRUE(c_->GetGradients(a_).ok());
  auto w = c_->GetWeights(b_);
  ASSERT_TRUE(w.ok());
  EXPECT_TRUE(c_->SetWeights(b_, {{"bias", w->tensors[1].second}}).ok());
  EXPECT_TRUE(c_->DeleteModule(b_).ok());
  EXPECT_EQ(Modules(), std::vector<std::string>{a_});
}

}  // namespace
}  // namespace gradwire
