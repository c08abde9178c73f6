// Module lifetimes (--module-ttl) through the real service: a module whose owner made no call
// that succeeded and sent no keep-alive for the TTL is released with its contexts and counted; its
// owner's calls that succeed and keep-alives renew it, refused calls and other tenants' calls do
// not; the C++ client keeps the modules it created or holds alive by itself and
// stops when told or when it goes; KeepAlive checks what it is given; GetServerInfo and each
// module's description say what the server does.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "gradwire/client/client.h"
#include "server/rpc/auth.h"
#include "specs.h"
#include "test_server.h"

namespace gradwire {
namespace {

using testing::LinearSpec;
using testing::Random;
using testing::TestServer;

void Sleep(double seconds) { std::this_thread::sleep_for(std::chrono::duration<double>(seconds)); }

// Expires what is due now and returns how many modules went so far: the server's janitor expires
// them too, about once a second, so the count is what the tests read, not who did it.
int64_t ExpiredSoFar(TestServer& server) {
  server.service().ExpireIdleModules();
  return server.host().Stats().modules_expired;
}

TestServer WithTtl(double ttl_s) {
  return TestServer([ttl_s](rpc::ServiceOptions& o) { o.module_ttl_s = ttl_s; });
}

// TTLs of a second and renewals every 0.2-0.33 s: a loaded machine may stall a thread for a good
// part of a second without a module going idle by accident.
TEST(ModuleLifetimeTest, IdleModulesAreReleasedWithTheirContexts) {
  TestServer server = WithTtl(1.0);
  ASSERT_TRUE(server.ok());
  auto c = server.Connect();
  auto info = c->GetServerInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_DOUBLE_EQ(info->module_ttl_s(), 1.0);
  const std::string idle = c->CreateModule(LinearSpec(16, 8))->module_id();
  const std::string used = c->CreateModule(LinearSpec(16, 8))->module_id();
  // Neither is kept alive by the client: only calls renew them here.
  c->Release(idle);
  c->Release(used);
  EXPECT_TRUE(c->held().empty());
  auto y = c->Forward(idle, Random({2, 16}), /*training=*/true);  // a context it holds
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_EQ(server.service().ExpireIdleModules(), 0);  // both just touched
  for (int i = 0; i < 6; ++i) {
    Sleep(0.2);
    ASSERT_TRUE(c->Forward(used, Random({1, 16}), false).ok());
  }
  Sleep(0.1);
  EXPECT_EQ(ExpiredSoFar(server), 1);  // idle, not used
  EXPECT_EQ(server.host().Stats().modules, 1);
  EXPECT_EQ(server.host().Stats().live_contexts, 0);  // its context went with it
  auto gone = c->Forward(idle, Random({1, 16}), false);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(c->Forward(used, Random({1, 16}), false).ok());
}

// A call admitted while its module was alive runs, however long it then waits to start: its
// module is busy from admission until the call's work returns, so the TTL sweep passes it by.
// Here the forward stalls for twice the TTL between leaving the queue and looking its module up
// (the on_queue_wait hook runs in that gap), while sweeps run.
TEST(ModuleLifetimeTest, ACallAdmittedBeforeTheTtlFindsItsModule) {
  std::atomic<bool> stall{false};
  testing::TestServerOptions o;
  o.configure = [&stall](rpc::ServiceOptions& s) {
    s.module_ttl_s = 1.0;
    s.on_queue_wait = [&stall](const char* method, const std::string&, double) {
      if (std::string(method) == "Forward" && stall.exchange(false)) Sleep(2.2);
    };
  };
  TestServer server(o);
  ASSERT_TRUE(server.ok());
  auto c = server.Connect();
  const std::string id = c->CreateModule(LinearSpec(16, 8))->module_id();
  c->Release(id);  // only calls renew it
  stall = true;
  std::thread sweeper([&] {  // sweeps during the stall, as the janitor does about once a second
    for (int i = 0; i < 8; ++i) {
      Sleep(0.25);
      server.service().ExpireIdleModules();
    }
  });
  auto y = c->Forward(id, Random({2, 16}), false);
  sweeper.join();
  EXPECT_FALSE(stall.load());  // the stall happened
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_EQ(ExpiredSoFar(server), 0);  // the forward's success renewed it
  // Idle from here on, it goes after its TTL.
  Sleep(1.4);
  EXPECT_EQ(ExpiredSoFar(server), 1);
}

TEST(ModuleLifetimeTest, TheClientKeepsItsModulesAlive) {
  TestServer server = WithTtl(1.0);
  ASSERT_TRUE(server.ok());
  auto c = server.Connect();
  const std::string kept = c->CreateModule(LinearSpec(16, 8))->module_id();
  const std::string dropped = c->CreateModule(LinearSpec(16, 8))->module_id();
  c->Release(dropped);
  EXPECT_EQ(c->held(), std::vector<std::string>{kept});
  Sleep(2.5);  // over two TTLs without a call; the keep-alive runs every 0.33 s
  EXPECT_GE(c->keep_alive_calls(), 3);
  EXPECT_EQ(ExpiredSoFar(server), 1);  // the one released
  auto listed = c->ListModules();
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].module_id(), kept);
  // Deleting stops it; a client that goes stops it.
  ASSERT_TRUE(c->DeleteModule(kept).ok());
  EXPECT_TRUE(c->held().empty());
  auto d = server.Connect();
  const std::string orphan = d->CreateModule(LinearSpec(16, 8))->module_id();
  const auto t0 = std::chrono::steady_clock::now();
  d.reset();  // at once: the keep-alive thread stops without waiting for its period
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(300));
  Sleep(1.5);
  EXPECT_EQ(ExpiredSoFar(server), 2);
  EXPECT_EQ(server.host().Stats().modules, 0);
  (void)orphan;
}

TEST(ModuleLifetimeTest, KeepAliveChecksItsInputAndNamesUnknownModules) {
  TestServer server = WithTtl(1.0);
  ASSERT_TRUE(server.ok());
  auto c = server.Connect();
  const std::string id = c->CreateModule(LinearSpec(16, 8))->module_id();
  c->Release(id);
  auto call = [&](const std::vector<std::string>& ids, v1::KeepAliveResponse* resp) {
    grpc::ClientContext ctx;
    c->PrepareContext(&ctx);
    v1::KeepAliveRequest req;
    for (const auto& m : ids) req.add_module_ids(m);
    return c->stub().KeepAlive(&ctx, req, resp);
  };
  for (int i = 0; i < 7; ++i) {
    Sleep(0.2);
    v1::KeepAliveResponse resp;
    ASSERT_TRUE(call({id, std::string(32, 'a')}, &resp).ok());
    ASSERT_EQ(resp.unknown_size(), 1);
    EXPECT_EQ(resp.unknown(0), std::string(32, 'a'));
  }
  EXPECT_EQ(server.service().ExpireIdleModules(), 0);  // renewed by hand, over the TTL
  v1::KeepAliveResponse resp;
  EXPECT_EQ(call({"not an id"}, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(call(std::vector<std::string>(4097, id), &resp).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
}

// Tokens for two tenants, alice and bob, and a server on them whose modules live one second
// unless renewed.
absl::StatusOr<rpc::Authenticator> TwoTenants() {
  return rpc::Authenticator::FromEntries(
      {{"alice", "token-alice-0123456789"}, {"bob", "token-bob-0123456789ab"}});
}
testing::TestServerOptions TtlOfOneSecond(const rpc::Authenticator& auth) {
  testing::TestServerOptions o;
  o.authenticator = &auth;
  o.configure = [](rpc::ServiceOptions& s) { s.module_ttl_s = 1.0; };
  return o;
}

TEST(ModuleLifetimeTest, AnotherTenantsModuleIsNotRenewed) {
  auto auth = TwoTenants();
  ASSERT_TRUE(auth.ok()) << auth.status();
  TestServer server(TtlOfOneSecond(*auth));
  ASSERT_TRUE(server.ok());
  auto alice = server.Connect("token-alice-0123456789");
  auto bob = server.Connect("token-bob-0123456789ab");
  const std::string id = alice->CreateModule(LinearSpec(16, 8))->module_id();
  alice->Release(id);
  bob->Hold(id);  // bob cannot see it: his keep-alives name it unknown and stop
  Sleep(1.6);
  EXPECT_TRUE(bob->held().empty());
  EXPECT_EQ(ExpiredSoFar(server), 1);
}

// Only the owner's calls that succeed renew a module. Another tenant naming it (keep-alives, a
// forward, a weights call, all refused) renews nothing, and neither does the owner's refused
// forward (a wrong width): both such modules go after the TTL, while the one the owner runs
// forwards on stays.
TEST(ModuleLifetimeTest, OnlyTheOwnersSuccessfulCallsRenewAModule) {
  auto auth = TwoTenants();
  ASSERT_TRUE(auth.ok()) << auth.status();
  TestServer server(TtlOfOneSecond(*auth));
  ASSERT_TRUE(server.ok());
  auto alice = server.Connect("token-alice-0123456789");
  auto bob = server.Connect("token-bob-0123456789ab");
  std::vector<std::string> ids;
  for (int i = 0; i < 3; ++i) {
    auto info = alice->CreateModule(LinearSpec(16, 8));
    ASSERT_TRUE(info.ok()) << info.status();
    ids.push_back(info->module_id());
    alice->Release(ids.back());  // only the calls below can renew it
  }
  const std::string& theirs = ids[0];   // only bob names it
  const std::string& refused = ids[1];  // only alice's refused forwards name it
  const std::string& used = ids[2];     // alice's forwards that succeed
  auto keep_alive = [](client::Client& c, const std::string& id) {
    grpc::ClientContext ctx;
    c.PrepareContext(&ctx);
    v1::KeepAliveRequest req;
    req.add_module_ids(id);
    v1::KeepAliveResponse resp;
    EXPECT_TRUE(c.stub().KeepAlive(&ctx, req, &resp).ok());
    return resp;
  };
  int refusals_while_alive = 0;
  for (int i = 0; i < 10; ++i) {  // 2 s and more: twice the TTL
    Sleep(0.2);
    const v1::KeepAliveResponse resp = keep_alive(*bob, theirs);
    ASSERT_EQ(resp.unknown_size(), 1);
    EXPECT_EQ(resp.unknown(0), theirs);
    EXPECT_EQ(bob->Forward(theirs, Random({1, 16}), false).status().code(),
              absl::StatusCode::kNotFound);
    EXPECT_EQ(bob->GetWeights(theirs).status().code(), absl::StatusCode::kNotFound);
    // Refused while the module lives, and NOT_FOUND once it went.
    const absl::StatusCode bad = alice->Forward(refused, Random({1, 15}), false).status().code();
    EXPECT_TRUE(bad == absl::StatusCode::kInvalidArgument || bad == absl::StatusCode::kNotFound)
        << absl::StatusCodeToString(bad);
    refusals_while_alive += bad == absl::StatusCode::kInvalidArgument;
    auto y = alice->Forward(used, Random({1, 16}), false);
    ASSERT_TRUE(y.ok()) << y.status();
  }
  EXPECT_GE(refusals_while_alive, 1);
  EXPECT_EQ(ExpiredSoFar(server), 2);
  auto listed = alice->ListModules();
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].module_id(), used);
  EXPECT_EQ(alice->GetWeights(theirs).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(alice->Forward(refused, Random({1, 16}), false).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(bob->held().empty());
}

TEST(ModuleLifetimeTest, OffWithZero) {
  TestServer server = WithTtl(0);
  ASSERT_TRUE(server.ok());
  auto c = server.Connect();
  EXPECT_EQ(c->GetServerInfo()->module_ttl_s(), 0.0);
  const std::string id = c->CreateModule(LinearSpec(16, 8))->module_id();
  c->Release(id);
  Sleep(0.1);
  EXPECT_EQ(ExpiredSoFar(server), 0);
  EXPECT_EQ(server.host().Stats().modules, 1);
}

TEST(ModuleLifetimeTest, DescriptionsNameTheKind) {
  TestServer server;
  ASSERT_TRUE(server.ok());
  auto c = server.Connect();
  v1::ModuleSpec mlp;
  mlp.set_kind(v1::LAYERNORM_MLP);
  mlp.set_in_features(64);
  mlp.set_ffn_features(256);
  mlp.set_out_features(32);
  mlp.set_activation(v1::SWIGLU);
  mlp.set_bias(true);
  auto a = c->CreateModule(mlp);
  auto b = c->CreateModule(testing::LayerNormLinearSpec(64, 32, true));
  auto d = c->CreateModule(LinearSpec(64, 32));
  ASSERT_TRUE(a.ok() && b.ok() && d.ok());
  EXPECT_EQ(a->description(), "LayerNormMLP 64 -> 256 -> 32, swiglu, bias");
  EXPECT_EQ(b->description(), "LayerNormLinear 64 -> 32, bias");
  EXPECT_EQ(d->description(), "Linear 64 -> 32");
}

}  // namespace
}  // namespace gradwire
