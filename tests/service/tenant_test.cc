// Bearer tokens and tenant isolation: the Authenticator on its own, then the real service over
// loopback with two tenants.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <random>

#include "gradwire/client/client.h"
#include "server/rpc/auth.h"
#include "specs.h"
#include "test_server.h"

namespace gradwire {
namespace {

using client::HostTensor;
using rpc::Authenticator;

constexpr char kAliceToken[] = "alice-0123456789abcdef";
constexpr char kBobToken[] = "bob-fedcba9876543210xyz";

using testing::Random;
std::string WriteTemp(const std::string& text) {
  char path[] = "/tmp/gradwire-tokens-XXXXXX";
  const int fd = mkstemp(path);
  EXPECT_GE(fd, 0);
  close(fd);
  std::ofstream(path) << text;
  return path;
}

TEST(AuthenticatorTest, MapsTokensToTenants) {
  auto auth = Authenticator::FromEntries({{"alice", kAliceToken}, {"bob", kBobToken}});
  ASSERT_TRUE(auth.ok()) << auth.status();
  EXPECT_EQ(*auth->Authenticate(std::string("Bearer ") + kAliceToken), "alice");
  EXPECT_EQ(*auth->Authenticate(std::string("Bearer ") + kBobToken), "bob");
  EXPECT_EQ(auth->Tenants(), (std::vector<std::string>{"alice", "bob"}));
}

TEST(AuthenticatorTest, RejectsMissingMalformedAndWrongTokens) {
  auto auth = Authenticator::FromEntries({{"alice", kAliceToken}});
  ASSERT_TRUE(auth.ok());
  for (const std::string& header :
       {std::string(), std::string("Bearer "), std::string(kAliceToken),
        std::string("bearer ") + kAliceToken, std::string("Basic ") + kAliceToken,
        std::string("Bearer ") + kAliceToken + "x", std::string("Bearer ") + kBobToken,
        std::string("Bearer ") + std::string(kAliceToken).substr(1)}) {
    auto tenant = auth->Authenticate(header);
    ASSERT_FALSE(tenant.ok()) << header;
    EXPECT_EQ(tenant.status().code(), absl::StatusCode::kUnauthenticated);
    // The message never repeats what was presented.
    EXPECT_EQ(std::string(tenant.status().message()).find("0123456789"), std::string::npos);
  }
}

TEST(AuthenticatorTest, RejectsBadEntriesWithoutEchoingTokens) {
  struct Case {
    std::vector<std::pair<std::string, std::string>> entries;
    const char* expect;
  };
  const Case cases[] = {
      {{}, "no tokens"},
      {{{"", kAliceToken}}, "tenant"},
      {{{"al ice", kAliceToken}}, "tenant"},
      {{{std::string(65, 'a'), kAliceToken}}, "tenant"},
      {{{"alice", "short-secret"}}, "at least 16"},
      {{{"alice", "has space in the token"}}, "at least 16"},
      {{{"alice", kAliceToken}, {"bob", kAliceToken}}, "repeats the token of tenant alice"},
  };
  for (const Case& c : cases) {
    auto auth = Authenticator::FromEntries(c.entries);
    ASSERT_FALSE(auth.ok()) << c.expect;
    EXPECT_EQ(auth.status().code(), absl::StatusCode::kInvalidArgument);
    const std::string message(auth.status().message());
    EXPECT_NE(message.find(c.expect), std::string::npos) << message;
    for (const auto& [tenant, token] : c.entries) {
      EXPECT_EQ(message.find(token), std::string::npos) << message;
    }
  }
}

TEST(AuthenticatorTest, ReadsTokensFiles) {
  const std::string good = WriteTemp(std::string("# tenants\n\nalice ") + kAliceToken +
                                     "\n  bob\t" + kBobToken + "  \r\n");
  auto entries = Authenticator::ReadTokensFile(good);
  ASSERT_TRUE(entries.ok()) << entries.status();
  ASSERT_EQ(entries->size(), 2u);
  EXPECT_EQ((*entries)[1].first, "bob");
  EXPECT_EQ((*entries)[1].second, kBobToken);
  std::remove(good.c_str());

  for (const std::string& text :
       {std::string("alice\n"), std::string("# only comments\n"), std::string("alice a b c\n")}) {
    const std::string path = WriteTemp(text);
    auto bad = Authenticator::ReadTokensFile(path);
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << text;
    std::remove(path.c_str());
  }
  EXPECT_EQ(Authenticator::ReadTokensFile("/nonexistent/tokens").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_FALSE(Authenticator::ParseInline("alice").ok());
  EXPECT_FALSE(Authenticator::ParseInline(":token").ok());
  EXPECT_FALSE(Authenticator::ParseInline("alice:tok:en").ok());  // "en" is no weight
}

TEST(TokensFileTest, AThirdColumnGivesTheTenantsWeight) {
  const std::string path = WriteTemp(std::string("alice ") + kAliceToken + " 3\nbob " + kBobToken +
                                     "\nalice " + kAliceToken + "x 3.0\n");
  Authenticator::TenantWeights weights;
  auto entries = Authenticator::ReadTokensFile(path, &weights);
  ASSERT_TRUE(entries.ok()) << entries.status();
  EXPECT_EQ(entries->size(), 3u);
  EXPECT_EQ((*entries)[0].second, kAliceToken);
  ASSERT_EQ(weights.size(), 1u);  // bob has none: he weighs 1
  EXPECT_EQ(weights.at("alice"), 3.0);
  std::remove(path.c_str());

  for (const char* weight : {"0", "-1", "nan", "inf", "1001", "2x", "1e9"}) {
    const std::string bad = WriteTemp(std::string("alice ") + kAliceToken + " " + weight + "\n");
    auto read = Authenticator::ReadTokensFile(bad, &weights);
    EXPECT_EQ(read.status().code(), absl::StatusCode::kInvalidArgument) << weight;
    EXPECT_NE(std::string(read.status().message()).find("weight"), std::string::npos)
        << read.status();
    EXPECT_EQ(std::string(read.status().message()).find(kAliceToken), std::string::npos);
    std::remove(bad.c_str());
  }
  // A tenant cannot change its weight between lines.
  const std::string twice =
      WriteTemp(std::string("alice ") + kAliceToken + " 2\nalice " + kBobToken + " 5\n");
  Authenticator::TenantWeights fresh;
  EXPECT_FALSE(Authenticator::ReadTokensFile(twice, &fresh).ok());
  std::remove(twice.c_str());

  // The inline form: TENANT:TOKEN:WEIGHT.
  Authenticator::TenantWeights inline_weights;
  auto parsed =
      Authenticator::ParseInline(std::string("bob:") + kBobToken + ":0.5", &inline_weights);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->second, kBobToken);
  EXPECT_EQ(inline_weights.at("bob"), 0.5);
  EXPECT_FALSE(
      Authenticator::ParseInline(std::string("bob:") + kBobToken + ":0", &inline_weights).ok());
  EXPECT_FALSE(Authenticator::ParseInline("bob::2", &inline_weights).ok());
}

class TenantTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto made = Authenticator::FromEntries({{"alice", kAliceToken}, {"bob", kBobToken}});
    ASSERT_TRUE(made.ok());
    auth_ = std::make_unique<Authenticator>(std::move(*made));
    server_ = std::make_unique<testing::TestServer>(auth_.get());
    ASSERT_TRUE(server_->ok());
    alice_ = server_->Connect(kAliceToken);
    bob_ = server_->Connect(kBobToken);
    v1::ModuleSpec spec = testing::LinearSpec(16, 8, true, 3);
    auto info = alice_->CreateModule(spec);
    ASSERT_TRUE(info.ok()) << info.status();
    module_ = info->module_id();
    auto fwd = alice_->Forward(module_, Random({4, 16}), true);
    ASSERT_TRUE(fwd.ok()) << fwd.status();
    context_ = fwd->context_id;
  }

  std::unique_ptr<Authenticator> auth_;
  std::unique_ptr<testing::TestServer> server_;
  std::unique_ptr<client::Client> alice_, bob_;
  std::string module_, context_;
};

// The status another tenant gets must be the one an id that never existed gets.
void ExpectSameNotFound(const absl::Status& foreign, const absl::Status& unknown,
                        const std::string& foreign_id, const std::string& unknown_id) {
  EXPECT_EQ(foreign.code(), absl::StatusCode::kNotFound) << foreign;
  EXPECT_EQ(unknown.code(), absl::StatusCode::kNotFound) << unknown;
  // Each call has its own request id at the end; the rest must be the same.
  EXPECT_NE(std::string(foreign.message()).find(" [request "), std::string::npos) << foreign;
  std::string a = testing::WithoutRequestId(foreign.message());
  std::string b = testing::WithoutRequestId(unknown.message());
  a.replace(a.find(foreign_id), foreign_id.size(), "ID");
  b.replace(b.find(unknown_id), unknown_id.size(), "ID");
  EXPECT_EQ(a, b);
}

TEST_F(TenantTest, AnotherTenantsModuleIdIsNotFound) {
  const std::string unknown = "0123456789abcdef0123456789abcdef";
  ExpectSameNotFound(bob_->Forward(module_, Random({4, 16}), true).status(),
                     bob_->Forward(unknown, Random({4, 16}), true).status(), module_, unknown);
  ExpectSameNotFound(bob_->GetWeights(module_).status(), bob_->GetWeights(unknown).status(),
                     module_, unknown);
  ExpectSameNotFound(bob_->SetWeights(module_, {{"bias", Random({8})}}).status(),
                     bob_->SetWeights(unknown, {{"bias", Random({8})}}).status(), module_, unknown);
  ExpectSameNotFound(bob_->GetGradients(module_, true).status(),
                     bob_->GetGradients(unknown, true).status(), module_, unknown);
  ExpectSameNotFound(bob_->ApplyGradients(module_).status(), bob_->ApplyGradients(unknown).status(),
                     module_, unknown);
  ExpectSameNotFound(bob_->DeleteModule(module_), bob_->DeleteModule(unknown), module_, unknown);
  auto bobs = bob_->ListModules();
  ASSERT_TRUE(bobs.ok());
  EXPECT_TRUE(bobs->empty());

  // Nothing bob tried changed alice's module.
  auto info = alice_->ListModules();
  ASSERT_TRUE(info.ok());
  ASSERT_EQ(info->size(), 1u);
  EXPECT_EQ((*info)[0].weight_version(), 1u);
  EXPECT_EQ((*info)[0].live_contexts(), 1);
}

TEST_F(TenantTest, AnotherTenantsContextIdIsNotFoundLiveOrConsumed) {
  const std::string unknown = "fedcba9876543210fedcba9876543210";
  ExpectSameNotFound(bob_->Backward(context_, Random({4, 8})).status(),
                     bob_->Backward(unknown, Random({4, 8})).status(), context_, unknown);
  ExpectSameNotFound(bob_->ReleaseContext(context_), bob_->ReleaseContext(unknown), context_,
                     unknown);
  // Alice's backward still finds her context, then it is consumed.
  ASSERT_TRUE(alice_->Backward(context_, Random({4, 8})).ok());
  // A consumed context is FAILED_PRECONDITION for its owner, NOT_FOUND for everybody else.
  EXPECT_EQ(alice_->Backward(context_, Random({4, 8})).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ExpectSameNotFound(bob_->Backward(context_, Random({4, 8})).status(),
                     bob_->Backward(unknown, Random({4, 8})).status(), context_, unknown);
}

TEST_F(TenantTest, EachTenantWorksOnItsOwnModules) {
  v1::ModuleSpec spec = testing::LinearSpec(16, 16);
  auto bobs = bob_->CreateModule(spec);
  ASSERT_TRUE(bobs.ok()) << bobs.status();
  auto fwd = bob_->Forward(bobs->module_id(), Random({2, 16}), true);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  ASSERT_TRUE(bob_->Backward(fwd->context_id, Random({2, 16})).ok());
  EXPECT_TRUE(bob_->ApplyGradients(bobs->module_id()).ok());
  EXPECT_EQ(alice_->GetWeights(bobs->module_id()).status().code(), absl::StatusCode::kNotFound);
  auto alices = alice_->ListModules();
  ASSERT_TRUE(alices.ok());
  ASSERT_EQ(alices->size(), 1u);
  EXPECT_EQ((*alices)[0].module_id(), module_);
  // Both tenants' modules exist on the server.
  EXPECT_EQ(server_->host().List().size(), 2u);
  EXPECT_EQ(server_->host().Info(module_)->tenant, "alice");
  EXPECT_EQ(server_->host().Info(bobs->module_id())->tenant, "bob");
}

TEST_F(TenantTest, CallsWithoutAValidTokenAreUnauthenticatedAndChangeNothing) {
  auto anonymous = server_->Connect("");
  auto forger = server_->Connect("alice-0123456789abcdeX");
  for (client::Client* c : {anonymous.get(), forger.get()}) {
    EXPECT_EQ(c->GetServerInfo().status().code(), absl::StatusCode::kUnauthenticated);
    EXPECT_EQ(c->ListModules().status().code(), absl::StatusCode::kUnauthenticated);
    EXPECT_EQ(c->Forward(module_, Random({4, 16}), true).status().code(),
              absl::StatusCode::kUnauthenticated);
    EXPECT_EQ(c->Backward(context_, Random({4, 8})).status().code(),
              absl::StatusCode::kUnauthenticated);
    EXPECT_EQ(c->DeleteModule(module_).code(), absl::StatusCode::kUnauthenticated);
    v1::ModuleSpec spec = testing::LinearSpec(4, 4);
    EXPECT_EQ(c->CreateModule(spec).status().code(), absl::StatusCode::kUnauthenticated);
  }
  EXPECT_EQ(server_->host().List().size(), 1u);
  EXPECT_EQ(server_->host().Stats().live_contexts, 1);
  EXPECT_TRUE(alice_->Backward(context_, Random({4, 8})).ok());
}

}  // namespace
}  // namespace gradwire

namespace gradwire {
namespace {

// The Train stream authenticates once and keeps the caller's tenant for every request on it.
TEST_F(TenantTest, TrainStreamsAreIsolatedToo) {
  auto bobs = bob_->OpenTrainStream();
  ASSERT_TRUE(bobs->SendForward(1, module_, testing::Random({4, 16}), true));
  ASSERT_TRUE(bobs->SendBackward(2, context_, testing::Random({4, 8})));
  auto first = bobs->Read();
  auto second = bobs->Read();
  ASSERT_TRUE(first && second);
  EXPECT_EQ(first->code(), int(grpc::StatusCode::NOT_FOUND));
  EXPECT_EQ(second->code(), int(grpc::StatusCode::NOT_FOUND));
  EXPECT_TRUE(bobs->Finish().ok());
  // Alice's context survived bob's stream (which released only what it created: nothing).
  auto alices = alice_->OpenTrainStream();
  ASSERT_TRUE(alices->SendBackward(3, context_, testing::Random({4, 8})));
  auto done = alices->Read();
  ASSERT_TRUE(done);
  EXPECT_EQ(done->code(), 0) << done->message();
  EXPECT_TRUE(alices->Finish().ok());
  // Without a token the stream itself is refused.
  auto anonymous = server_->Connect();
  auto refused = anonymous->OpenTrainStream();
  EXPECT_FALSE(refused->Read().has_value());
  EXPECT_EQ(refused->Finish().code(), absl::StatusCode::kUnauthenticated);
}

// A tenant filling context memory cannot evict another tenant's contexts: past its fair share it
// gets RESOURCE_EXHAUSTED, and the other tenant's backward still works.
TEST(TenantFairShareTest, AHeavyTenantIsRefusedInsteadOfEvictingALightOne) {
  auto made = Authenticator::FromEntries({{"alice", kAliceToken}, {"bob", kBobToken}});
  ASSERT_TRUE(made.ok());
  testing::TestServerOptions o;
  o.authenticator = &*made;
  // Linear 64 -> 8 with 16 rows saves 16 * 64 = 1024 bytes of FP8 codes per context.
  o.context_limits = {/*device_bytes=*/16 * 1024, /*host_bytes=*/16 * 1024, /*ttl_seconds=*/0};
  testing::TestServer server(o);
  ASSERT_TRUE(server.ok());
  auto alice = server.Connect(kAliceToken);
  auto bob = server.Connect(kBobToken);
  const std::string a_module = alice->CreateModule(testing::LinearSpec(64, 8))->module_id();
  const std::string b_module = bob->CreateModule(testing::LinearSpec(64, 8))->module_id();
  auto a_fwd = alice->Forward(a_module, Random({16, 64}), true);
  ASSERT_TRUE(a_fwd.ok()) << a_fwd.status();
  int accepted = 0, refused = 0;
  for (int i = 0; i < 40; ++i) {
    auto f = bob->Forward(b_module, Random({16, 64}), true);
    if (f.ok()) {
      ++accepted;
      continue;
    }
    ++refused;
    EXPECT_EQ(f.status().code(), absl::StatusCode::kResourceExhausted) << f.status();
    EXPECT_NE(std::string(f.status().message()).find("fair share"), std::string::npos)
        << f.status();
  }
  EXPECT_EQ(accepted, 31);  // what alice leaves of the 32 KiB, then refused
  EXPECT_EQ(refused, 9);
  const core::ContextStats s = server.host().Stats().contexts;
  EXPECT_EQ(s.evicted_memory, 0);
  EXPECT_EQ(s.rejected_share, 9);
  auto back = alice->Backward(a_fwd->context_id, Random({16, 8}));
  EXPECT_TRUE(back.ok()) << back.status();
}

}  // namespace
}  // namespace gradwire
